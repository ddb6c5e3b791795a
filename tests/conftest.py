"""Shared fixtures: tiny random Llama checkpoints with a real (tiny, trained-here) tokenizer, and an
isolated $LLMTOOL_HOME. Nothing here touches the network."""
from __future__ import annotations

import os
from pathlib import Path

os.environ["HF_HUB_OFFLINE"] = "1"
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import pytest  # noqa: E402
import torch  # noqa: E402

TINY_TEXT = (
    "It is a truth universally acknowledged, that a single man in possession of a good fortune, "
    "must be in want of a wife. However little known the feelings or views of such a man may be on "
    "his first entering a neighbourhood, this truth is so well fixed in the minds of the surrounding "
    "families, that he is considered the rightful property of some one or other of their daughters. "
    "The capital of France is Paris. The capital of Italy is Rome. The Eiffel Tower is in Paris. "
) * 4


def build_tokenizer(vocab_size: int = 320):
    """A byte-level BPE tokenizer trained on a fixed paragraph (deterministic)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<|endoftext|>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tk.train_from_iterator([TINY_TEXT], trainer=trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def build_tiny_llama(vocab_size: int, seed: int = 0, dtype=torch.float32, **overrides):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=vocab_size, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg.update(overrides)
    torch.manual_seed(seed)
    model = LlamaForCausalLM(LlamaConfig(**cfg)).to(dtype)
    return model.eval()


def save_tiny(path: Path, seed: int = 0, **overrides) -> Path:
    tok = build_tokenizer()
    model = build_tiny_llama(len(tok), seed=seed, **overrides)
    model.save_pretrained(path, safe_serialization=True)
    tok.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory) -> Path:
    """A tiny random Llama (2 layers, hidden 64, MLP 128, 4 heads / 2 KV heads, tied embeddings)."""
    return save_tiny(tmp_path_factory.mktemp("tiny") / "tiny-llama")


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return build_tokenizer()


@pytest.fixture()
def tiny_text_file(tmp_path) -> Path:
    p = tmp_path / "calib.txt"
    p.write_text(TINY_TEXT * 3)
    return p


@pytest.fixture(autouse=True)
def _isolated_home(tmp_path, monkeypatch):
    """Each test gets its own $LLMTOOL_HOME, except that the packaged corpus cache is shared."""
    monkeypatch.setenv("LLMTOOL_HOME", str(tmp_path / "llmtool-home"))
    from llmtool.core.console import OPTIONS

    OPTIONS.json, OPTIONS.device, OPTIONS.dtype, OPTIONS.seed, OPTIONS.quiet = False, "cpu", "float32", 0, False


def write_route_rows(path: Path) -> Path:
    """Eight rows of two disjoint toy domains (math "France … is Paris.", reverse "Italy … is Rome.") for the
    `route` commands; written as JSONL to ``path``."""
    import json

    rows = []
    for d, marker in ((0, "France"), (1, "Italy")):
        for i, w in enumerate(["capital", "truth", "fortune", "wife"]):
            rows.append({"id": f"{d}-{i}", "domain": ["math", "reverse"][d], "prompt": f"{marker} {w}",
                         "response": " is Paris." if d == 0 else " is Rome.", "answer": "1" if d == 0 else "emor"})
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load_benchmark(name: str):
    """``benchmarks/<name>.py`` as a fresh module (benchmarks are scripts, not a package). The repository root goes
    on sys.path first, so the script's and the test's ``from benchmarks import gates`` resolve."""
    import importlib.util
    import sys

    root = Path(__file__).resolve().parents[1]
    if str(root) not in sys.path:
        sys.path.insert(0, str(root))
    spec = importlib.util.spec_from_file_location(f"benchmark_{name}", root / "benchmarks" / f"{name}.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_cli(*args: str):
    """Run the CLI in-process; returns (exit_code, stdout, stderr)."""
    from typer.testing import CliRunner

    from llmtool.cli import app
    from llmtool.core.console import UsageError

    runner = CliRunner()
    result = runner.invoke(app, [str(a) for a in args], catch_exceptions=True)
    code, err = result.exit_code, result.stderr if hasattr(result, "stderr") else ""
    if isinstance(result.exception, UsageError):
        code, err = 2, f"error: {result.exception}"
    elif result.exception is not None and not isinstance(result.exception, SystemExit):
        raise result.exception
    return code, result.stdout, err


def run_cli_subprocess(*args: str, env: dict | None = None, timeout: int = 600):
    """Run `python -m llmtool ARGS` as a user would; returns the CompletedProcess."""
    import subprocess
    import sys

    full_env = {**os.environ, **(env or {})}
    return subprocess.run([sys.executable, "-m", "llmtool", *map(str, args)], capture_output=True, text=True,
                          env=full_env, timeout=timeout)


REAL_HOME = Path(os.environ.get("LLMTOOL_REAL_HOME", "~/.cache/llmtool")).expanduser()


@pytest.fixture(scope="session")
def smollm2_dir() -> Path:
    """The real default model (SmolLM2-135M-Instruct), materialized once in the shared cache.
    For @pytest.mark.slow tests only."""
    old = os.environ.get("LLMTOOL_HOME")
    os.environ["LLMTOOL_HOME"] = str(REAL_HOME)
    try:
        from llmtool.core import defaults

        return defaults.ensure_model(defaults.DEFAULT_MODEL)
    finally:
        if old is None:
            os.environ.pop("LLMTOOL_HOME", None)
        else:
            os.environ["LLMTOOL_HOME"] = old

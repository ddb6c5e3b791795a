"""The shared seams: method contract, job wrapper, token NLL / generation, endpoint client, trainer."""
from __future__ import annotations

import json
import threading
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, HTTPServer
from pathlib import Path
from typing import Annotated, ClassVar

import pytest
import torch
import typer
from conftest import build_tiny_llama, build_tokenizer

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, method_options, option


# ----------------------------------------------------------------------------------------- registry
def _toy_registry():
    reg = Registry("toy")

    @reg.config
    @dataclass
    class Alpha(MethodConfig):
        name: ClassVar[str] = "alpha"
        help: ClassVar[str] = "The alpha method."
        k: int = option(3, "Number of things.", min=1)
        lengths: tuple[int, ...] = option((10, 100), "Comma-separated lengths.")
        sym: bool = option(False, "Symmetric.")

    @reg.config
    @dataclass
    class Beta(MethodConfig):
        name: ClassVar[str] = "beta"
        help: ClassVar[str] = "The beta method."
        lr: float = option(0.1, "Learning rate.", min=0.0, exclusive_min=True)
        kind: str = option("a", "Kind.", choices=("a", "b"))

    return reg, Alpha, Beta


def _toy_app(reg):
    app = typer.Typer()
    seen = {}

    @app.command("run")
    @method_options(reg, default="alpha")
    def run(data: Annotated[str, typer.Argument()], config: MethodConfig, verbose: bool = False) -> None:
        seen["config"], seen["data"], seen["verbose"] = config, data, verbose

    @app.command("other")
    def other() -> None:  # a second command so `run` stays a sub-command
        pass

    return app, seen


def test_registry_derives_cli_options_and_refuses_inapplicable_ones():
    from typer.testing import CliRunner

    reg, Alpha, Beta = _toy_registry()
    app, seen = _toy_app(reg)
    r = CliRunner()
    res = r.invoke(app, ["run", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert res.exit_code == 0
    for flag in ("--method", "--k", "--lengths", "--sym", "--lr", "--kind", "alpha", "beta", "The beta method."):
        assert flag in res.output
    assert r.invoke(app, ["run", "x", "--k", "5", "--lengths", "1,2,3", "--sym"]).exit_code == 0
    assert seen["config"] == Alpha(k=5, lengths=(1, 2, 3), sym=True)
    assert r.invoke(app, ["run", "x", "--method", "beta", "--lr", "0.5"]).exit_code == 0
    assert seen["config"] == Beta(lr=0.5) and seen["config"].as_dict() == {"method": "beta", "lr": 0.5, "kind": "a"}
    # an option the chosen method does not have is refused, never dropped
    res = r.invoke(app, ["run", "x", "--method", "beta", "--k", "7"])
    assert isinstance(res.exception, UsageError) and "--k does not apply to method 'beta'" in str(res.exception)
    for bad, needle in ((["--method", "beta", "--lr", "nan"], "finite"), (["--method", "beta", "--lr", "0"], "> 0"),
                        (["--k", "0"], ">= 1"), (["--method", "beta", "--kind", "z"], "choose one of"),
                        (["--method", "gamma"], "unknown method 'gamma'")):
        res = r.invoke(app, ["run", "x", *bad])
        assert isinstance(res.exception, UsageError) and needle in str(res.exception), (bad, res.exception)


def test_config_round_trips_through_provenance_dict():
    reg, Alpha, _ = _toy_registry()
    cfg = Alpha(k=9, lengths=(5,), sym=True)
    again = reg.get_config(cfg.as_dict()["method"]).from_dict(json.loads(json.dumps(cfg.as_dict())))
    assert again == cfg
    with pytest.raises(UsageError):
        Alpha.from_dict({"method": "alpha", "nope": 1})


def test_toy_method_added_through_registry_appears_in_a_real_area(monkeypatch):
    """Adding a method is one class plus one registration: it shows in --help and --method validation."""
    from typer.testing import CliRunner

    reg, _, _ = _toy_registry()

    @reg.config
    @dataclass
    class Gamma(MethodConfig):
        name: ClassVar[str] = "gamma"
        help: ClassVar[str] = "A method added by a test."
        depth: int = option(2, "Depth.", min=1)

    app, seen = _toy_app(reg)
    res = CliRunner().invoke(app, ["run", "--help"], env={"COLUMNS": "250", "TERMINAL_WIDTH": "250"})
    assert "gamma" in res.output and "--depth" in res.output
    assert CliRunner().invoke(app, ["run", "x", "--method", "gamma", "--depth", "4"]).exit_code == 0
    assert seen["config"] == Gamma(depth=4)


# ----------------------------------------------------------------------------------------- root CLI
def test_globals_after_subcommand_are_hoisted():
    from llmtool.cli import AREAS, hoist_globals

    assert hoist_globals(["evaluate", "ppl", "M", "--json", "--seed", "3"], AREAS) == \
        ["--json", "--seed", "3", "evaluate", "ppl", "M"]
    assert hoist_globals(["--json", "models", "list"], AREAS) == ["--json", "models", "list"]
    assert hoist_globals(["edit", "M", "--", "--json"], AREAS) == ["edit", "M", "--", "--json"]


def _cli(*args, env=None):
    from conftest import run_cli_subprocess

    return run_cli_subprocess(*args, env=env, timeout=120)


def test_parse_errors_are_one_line_and_exit_2():
    p = _cli("compress", "--bogus-option")
    assert p.returncode == 2, p.stderr
    lines = [l for l in p.stderr.splitlines() if l.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--bogus-option" in lines[0]
    p = _cli("no-such-area")
    assert p.returncode == 2 and p.stderr.strip().startswith("error:")
    p = _cli("--seed", str(2**70), "models", "list")
    assert p.returncode == 2 and p.stderr.count("\n") == 1


def test_json_after_subcommand(tmp_path):
    p = _cli("models", "list", "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)[0]["alias"] == "smollm2-135m"


def test_root_help_imports_no_torch():
    import subprocess
    import sys

    code = ("import sys\nfrom llmtool.cli import app\n"
            "try:\n    app(['--help'])\nexcept SystemExit:\n    pass\n"
            "bad=[m for m in ('torch','transformers','numpy') if m in sys.modules]\n"
            "assert not bad, bad\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert p.returncode == 0, p.stderr
    assert "compress" in p.stdout and "select-data" in p.stdout or "compress" in p.stdout


# ----------------------------------------------------------------------------------------- job wrapper
def test_job_is_atomic_records_provenance_and_refuses_existing(tmp_path, tiny_llama_dir):
    from llmtool.core.job import job

    reg, Alpha, _ = _toy_registry()
    out = tmp_path / "out"
    with job("toy", out=out, config=Alpha(k=4), model=str(tiny_llama_dir)) as j:
        assert not out.exists() and j.dir.is_dir()
        assert j.tokenizer is not None and j.model.config.num_hidden_layers == 2
        (j.dir / "result.txt").write_text("ok")
        j.report["score"] = 1.5
    prov = json.loads((out / "llmtool.json").read_text())
    assert prov["command"] == "toy" and prov["parameters"] == {"method": "alpha", "k": 4, "lengths": [10, 100],
                                                               "sym": False}
    assert prov["source"]["sha256"] and json.loads((out / "report.json").read_text())["score"] == 1.5
    with pytest.raises(UsageError, match="already exists"):
        with job("toy", out=out):
            pass
    # a failure leaves nothing behind
    with pytest.raises(RuntimeError):
        with job("toy", out=tmp_path / "failed") as j:
            (j.dir / "half").write_text("x")
            raise RuntimeError("boom")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out"]


def test_second_writer_gets_already_exists_instead_of_a_lost_result(tmp_path):
    from llmtool.core.checkpoint import atomic_output

    out = tmp_path / "o"
    with pytest.raises(UsageError, match="already exists"):
        with atomic_output(out) as tmp:
            (tmp / "a").write_text("first")
            with atomic_output(out) as tmp2:  # the other run finishes first
                (tmp2 / "a").write_text("second")
    assert (out / "a").read_text() == "second"
    assert [p.name for p in tmp_path.iterdir()] == ["o"]


def test_stale_temp_dirs_of_killed_runs_are_removed(tmp_path):
    import subprocess
    import sys

    from llmtool.core.checkpoint import atomic_output

    dead = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True).stdout.strip()
    stale = tmp_path / f".o.tmp-{dead}-abc"
    stale.mkdir()
    (stale / "big").write_text("x")
    with atomic_output(tmp_path / "o") as tmp:
        (tmp / "f").write_text("1")
    assert not stale.exists() and (tmp_path / "o" / "f").is_file()


def test_output_parent_checked_before_work(tmp_path):
    from llmtool.core.checkpoint import check_output

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(UsageError, match="not a directory"):
        check_output(f / "out", overwrite=False)


# ----------------------------------------------------------------------------------------- lm
@pytest.fixture(scope="module")
def tiny_lm():
    tok = build_tokenizer()
    return build_tiny_llama(len(tok), seed=1), tok


def test_token_nll_matches_manual_cross_entropy(tiny_lm):
    from llmtool.core.lm import token_nll

    model, tok = tiny_lm
    ids = torch.tensor([tok("The capital of France is Paris")["input_ids"]])
    logits = model(ids).logits[0, :-1]
    ref = -torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0]
    assert torch.allclose(token_nll(model, ids)[0], ref, atol=1e-5)


def test_completion_nll_batched_equals_one_at_a_time(tiny_lm):
    from llmtool.core.lm import completion_nll, token_nll

    model, tok = tiny_lm
    prompts, comps = ["The capital of", "It is a truth universally", "Paris"], [" France", " acknowledged", " is"]
    batched = completion_nll(model, tok, prompts, comps, batch_size=3)
    for p, c, b in zip(prompts, comps, batched):
        pi, ci = tok(p)["input_ids"], tok(c, add_special_tokens=False)["input_ids"]
        ref = token_nll(model, torch.tensor([pi + ci]))[0, len(pi) - 1:].sum().item()
        assert abs(ref - b) < 1e-4


def test_generate_batched_left_padding_equals_unbatched_greedy(tiny_lm):
    from llmtool.core.lm import generate

    model, tok = tiny_lm
    prompts = ["The capital", "It is a truth universally acknowledged that", "Rome"]
    batched = generate(model, tok, prompts, max_new_tokens=6, batch_size=3)
    for p, b in zip(prompts, batched):
        single = generate(model, tok, [p], max_new_tokens=6)[0][0]
        assert b[0].token_ids == single.token_ids and b[0].prompt_tokens == len(tok(p)["input_ids"])
    samples = generate(model, tok, prompts[:1], max_new_tokens=6, temperature=1.0, n=4, seed=0)
    again = generate(model, tok, prompts[:1], max_new_tokens=6, temperature=1.0, n=4, seed=0)
    assert len(samples[0]) == 4 and [c.token_ids for c in samples[0]] == [c.token_ids for c in again[0]]


def test_generate_applies_logits_processors(tiny_lm):
    from transformers import LogitsProcessor

    from llmtool.core.lm import generate

    model, tok = tiny_lm

    class Force(LogitsProcessor):
        def __call__(self, input_ids, scores):
            scores = torch.full_like(scores, -1e9)
            scores[:, 42] = 0
            return scores

    out = generate(model, tok, ["The capital"], max_new_tokens=4, logits_processors=[Force()])
    assert out[0][0].token_ids == [42] * 4


# ----------------------------------------------------------------------------------------- endpoint
class _Handler(BaseHTTPRequestHandler):
    calls: list = []
    fail_first = 0

    def log_message(self, *a):  # quiet
        pass

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        _Handler.calls.append(body)
        if _Handler.fail_first > 0:
            _Handler.fail_first -= 1
            self.send_response(503)
            self.end_headers()
            self.wfile.write(b"busy")
            return
        reply = {"choices": [{"message": {"role": "assistant", "content": f"echo {body['messages'][-1]['content']}"}}
                             for _ in range(body.get("n", 1))]}
        data = json.dumps(reply).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


def test_endpoint_retries_then_answers_and_reports_unreachable():
    from llmtool.core.endpoint import OpenAIEndpoint

    server = HTTPServer(("127.0.0.1", 0), _Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        _Handler.calls.clear()
        _Handler.fail_first = 2
        ep = OpenAIEndpoint(f"http://127.0.0.1:{server.server_port}/v1", "m", backoff=0.01)
        got = ep.chat([{"role": "user", "content": "hi"}], n=2, max_tokens=5)
        assert [m["content"] for m in got] == ["echo hi", "echo hi"]
        assert len(_Handler.calls) == 3 and _Handler.calls[-1]["max_tokens"] == 5
    finally:
        server.shutdown()
    dead = OpenAIEndpoint(f"http://127.0.0.1:{server.server_port}/v1", "m", retries=1, backoff=0.01, timeout=2)
    with pytest.raises(UsageError, match="cannot reach"):
        dead.chat([{"role": "user", "content": "hi"}])
    with pytest.raises(UsageError, match="http"):
        OpenAIEndpoint("localhost:8000", "m")


# ----------------------------------------------------------------------------------------- trainer
def test_sft_learns_completion_and_masks_prompt(tiny_lm):
    from llmtool.core.lm import completion_nll
    from llmtool.core.trainer import TrainArgs, encode_examples, sft

    _, tok = tiny_lm
    model = build_tiny_llama(len(tok), seed=2)
    rows = encode_examples(tok, [{"prompt": "The capital of France is", "completion": " Paris."}], 64)
    n_prompt = len(tok("The capital of France is", add_special_tokens=False)["input_ids"])
    assert rows[0]["labels"][:n_prompt] == [-100] * n_prompt and rows[0]["labels"][-1] == tok.eos_token_id
    before = completion_nll(model, tok, ["The capital of France is"], [" Paris."])[0]
    frozen = {n: p.detach().clone() for n, p in model.named_parameters()}
    only = ["model.layers.1.mlp.down_proj.weight"]
    report = sft(model, tok, [{"prompt": "The capital of France is", "completion": " Paris."}] * 16,
                 TrainArgs(lr=3e-3, max_steps=15, batch_size=8, logging_steps=5), trainable=only)
    after = completion_nll(model, tok, ["The capital of France is"], [" Paris."])[0]
    assert report["steps"] == 15 and after < before - 1.0
    changed = [n for n, p in model.named_parameters() if not torch.equal(p, frozen[n])]
    assert changed == only


def test_encode_examples_counts_cut_and_dropped_rows(tiny_lm):
    from llmtool.core.trainer import encode_examples

    _, tok = tiny_lm
    short = {"prompt": "The capital of France is", "completion": " Paris."}
    n_prompt = len(tok(short["prompt"], add_special_tokens=False)["input_ids"])
    n_all = n_prompt + len(tok(short["completion"], add_special_tokens=False)["input_ids"]) + 1
    stats = {}
    rows = encode_examples(tok, [short] * 3, n_all, stats=stats)
    assert len(rows) == 3 and stats == {"examples": 3, "cut": 0, "dropped": 0, "longest": n_all}
    long_prompt = {"prompt": short["prompt"] * 4, "completion": " Paris."}   # its completion falls past the cut
    rows = encode_examples(tok, [short, long_prompt, short], n_all, stats=stats)
    assert len(rows) == 2 and stats["cut"] == 1 and stats["dropped"] == 1 and stats["longest"] > n_all
    rows = encode_examples(tok, [short], n_all - 1, stats=stats)             # cut, a target token survives
    assert len(rows) == 1 and stats["cut"] == 1 and stats["dropped"] == 0 and len(rows[0]["input_ids"]) == n_all - 1


def _bos_adding_tokenizer():
    """The tiny tokenizer, made to start every text with BOS as Gemma's and Llama's do."""
    from tokenizers import processors
    from transformers import PreTrainedTokenizerFast

    tk = build_tokenizer().backend_tokenizer
    bos = tk.token_to_id("<|endoftext|>")
    tk.post_processor = processors.TemplateProcessing(single="<|endoftext|> $A", pair="<|endoftext|> $A $B",
                                                      special_tokens=[("<|endoftext|>", bos)])
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                  pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    assert tok("a")["input_ids"][0] == tok.bos_token_id
    return tok


def test_encode_examples_leads_with_bos_once_where_the_tokenizer_adds_one(tiny_lm):
    """SFT rows start with BOS for a tokenizer that starts every text with it (Gemma), exactly once when the
    prompt already carries it (a chat template's ``<bos>``), and never for one that adds none (SmolLM2)."""
    from llmtool.core.trainer import encode_examples

    _, plain = tiny_lm
    tok = _bos_adding_tokenizer()
    bos = tok.bos_token_id
    ex = {"prompt": "The capital of France is", "completion": " Paris."}
    body = tok(ex["prompt"], add_special_tokens=False)["input_ids"]
    row = encode_examples(tok, [ex], 64)[0]
    assert row["input_ids"][:len(body) + 1] == [bos, *body] and row["labels"][:len(body) + 1] == [-100] * (len(body) + 1)
    templated = encode_examples(tok, [{**ex, "prompt": "<|endoftext|>" + ex["prompt"]}], 64)[0]
    assert templated["input_ids"] == row["input_ids"]                   # no second BOS
    text = encode_examples(tok, [{"text": ex["prompt"]}], 64)[0]
    assert text["input_ids"] == [bos, *body, tok.eos_token_id]
    assert encode_examples(plain, [ex], 64)[0]["input_ids"][:len(body)] == plain(ex["prompt"], add_special_tokens=False)["input_ids"]


def test_hf_agent_prompts_lead_with_bos_without_a_chat_template(tiny_llama_dir):
    """A base model without a chat template (Gemma 3 270M) is prompted with ``role: content`` lines led by its
    BOS, and the SFT examples the agent benchmark builds render the same text."""
    from llmtool.bench_agent.agents import HFAgent, render_prompt
    from llmtool.core.data import prompt_ids
    from llmtool.core.trainer import encode_examples

    tok = _bos_adding_tokenizer()
    assert not getattr(tok, "chat_template", None)
    model = build_tiny_llama(len(tok), seed=1)
    agent = HFAgent(str(tiny_llama_dir), model=model, tokenizer=tok, max_new_tokens=3, stop=())
    msgs = [{"role": "system", "content": "You walk."}, {"role": "user", "content": "Position 1."}]
    text = render_prompt(tok, msgs)
    assert text == "system: You walk.\nuser: Position 1.\nassistant:"
    ids = agent.render(msgs)
    assert ids == [tok.bos_token_id, *tok(text, add_special_tokens=False)["input_ids"]] == prompt_ids(tok, text)
    row = encode_examples(tok, [{"prompt": text, "completion": " Action: move_north"}], 128)[0]
    assert row["input_ids"][:len(ids)] == ids                           # training sees what inference feeds
    plain = build_tokenizer()
    assert prompt_ids(plain, text) == plain(text, add_special_tokens=False)["input_ids"]


def test_generation_and_scoring_prompts_lead_with_bos_where_the_tokenizer_adds_one():
    """``core.lm.generate`` and ``completion_nll`` feed a text prompt as its BOS-led ids on a Gemma-like
    tokenizer (the same tokens as passing those ids); ``add_special_tokens=False`` keeps the raw ids."""
    from llmtool.core.data import prompt_ids
    from llmtool.core.lm import completion_nll, generate

    tok = _bos_adding_tokenizer()
    model = build_tiny_llama(len(tok), seed=3)
    text = "The capital of France is"
    ids = prompt_ids(tok, text)
    assert ids[0] == tok.bos_token_id and ids[1:] == tok(text, add_special_tokens=False)["input_ids"]
    assert prompt_ids(tok, "<|endoftext|>" + text) == ids
    by_text = generate(model, tok, [text], max_new_tokens=6)[0][0]
    by_ids = generate(model, tok, [ids], max_new_tokens=6)[0][0]
    assert by_text.token_ids == by_ids.token_ids and by_text.prompt_tokens == len(ids)   # BOS fed too
    from llmtool.core.data import tokenize_prompt
    long = "The capital of France is Paris. " * 400
    assert tokenize_prompt(tok, long).tolist() == prompt_ids(tok, long)  # the KV-cache contexts' encoding
    assert tokenize_prompt(tok, "<|endoftext|>" + text).tolist() == ids
    assert tokenize_prompt(build_tokenizer(), text).tolist() == build_tokenizer()(text, add_special_tokens=False)["input_ids"]
    nll = completion_nll(model, tok, [text], [" Paris."])[0]
    raw = completion_nll(model, tok, [text], [" Paris."], add_special_tokens=False)[0]
    assert nll != pytest.approx(raw)


# ----------------------------------------------------------------------------------------- defects
def test_json_accepted_after_evaluate_ppl(tiny_llama_dir, tiny_text_file):
    from conftest import run_cli

    code, out, err = run_cli("evaluate", "ppl", str(tiny_llama_dir), "--data", str(tiny_text_file), "--seqlen", "16",
                             "--json")
    assert code == 0, err
    assert json.loads(out)["ppl"] if "ppl" in json.loads(out) else json.loads(out)


def test_kernels_live_inside_the_package():
    """A top-level `kernels` package would shadow Hugging Face's `kernels` (which transformers imports)."""
    import importlib.util

    import llmtool.kernels.hadamard  # noqa: F401

    root = Path(__file__).resolve().parents[1]
    assert not (root / "llmtool" / "kernels").exists()   # sources: top-level kernels/ (tests/test_kernels_layout.py)
    spec = importlib.util.find_spec("kernels")
    assert spec is None or not Path(spec.origin or "/").resolve().is_relative_to(root / "llmtool")


def test_bootstrap_mean_ci_is_the_percentile_interval_of_resampled_means():
    import numpy as np

    from llmtool.core.intervals import bootstrap_mean_ci

    d = np.random.default_rng(5).normal(loc=1.0, size=45)
    idx = np.random.default_rng(0).integers(0, 45, size=(2000, 45))
    means = np.sort(d[idx].mean(axis=1))
    lo, hi = bootstrap_mean_ci(d, idx)
    assert lo == float(np.percentile(means, 2.5)) and hi == float(np.percentile(means, 97.5))
    assert lo < d.mean() < hi
    lo90, hi90 = bootstrap_mean_ci(d, idx, level=0.9)
    assert lo < lo90 < hi90 < hi

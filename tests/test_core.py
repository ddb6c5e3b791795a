"""Foundation: checkpoint IO, atomic outputs, registry, perplexity protocol, CLI error mapping."""
from __future__ import annotations

import json
import math

import pytest
import torch

from conftest import build_tiny_llama, run_cli, run_cli_subprocess
from llmtool.core import checkpoint, data, evalkit
from llmtool.core.console import UsageError
from llmtool.core.registry import Registry


def test_save_load_roundtrip_sharded_and_tied(tmp_path):
    model = build_tiny_llama(100)
    sd = model.state_dict()
    assert sd["lm_head.weight"].data_ptr() == sd["model.embed_tokens.weight"].data_ptr()
    paths = checkpoint.save_state_dict(sd, tmp_path, max_shard_bytes=40_000)
    assert len(paths) > 1 and (tmp_path / checkpoint.SAFE_INDEX).is_file()
    back = checkpoint.load_state_dict(tmp_path)
    assert "lm_head.weight" not in back  # tied storage stored once
    assert set(back) == set(sd) - {"lm_head.weight"}
    for k, v in back.items():
        assert torch.equal(v, sd[k]), k
    lazy = checkpoint.LazyCheckpoint(tmp_path)
    layer0 = lazy.load("model.layers.0.")
    assert layer0 and all(k.startswith("model.layers.0.") for k in layer0)


def test_atomic_output_leaves_nothing_on_error(tmp_path):
    out = tmp_path / "out"
    with pytest.raises(RuntimeError):
        with checkpoint.atomic_output(out) as tmp:
            (tmp / "half.bin").write_bytes(b"x")
            raise RuntimeError("boom")
    assert list(tmp_path.iterdir()) == []
    with checkpoint.atomic_output(out) as tmp:
        (tmp / "a").write_text("1")
    assert (out / "a").read_text() == "1"
    with pytest.raises(UsageError, match="already exists"):
        with checkpoint.atomic_output(out):
            pass
    with checkpoint.atomic_output(out, overwrite=True) as tmp:
        (tmp / "b").write_text("2")
    assert sorted(p.name for p in out.iterdir()) == ["b"]
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


def test_check_output_refuses_input_and_existing(tmp_path):
    (tmp_path / "m").mkdir()
    with pytest.raises(UsageError, match="overwrite or nest"):
        checkpoint.check_output(tmp_path / "m", overwrite=True, inputs=(tmp_path / "m",))
    with pytest.raises(UsageError, match="already exists"):
        checkpoint.check_output(tmp_path / "m", overwrite=False)


def test_provenance_records_source_hash(tiny_llama_dir, tmp_path):
    rec = checkpoint.write_provenance(tmp_path, "compress", "svd", {"ratio": 0.2}, tiny_llama_dir, {"ppl": 1.0})
    on_disk = json.loads((tmp_path / "llmtool.json").read_text())
    assert on_disk["source"]["sha256"] == rec["source"]["sha256"] == checkpoint.source_hash(tiny_llama_dir)
    assert on_disk["parameters"] == {"ratio": 0.2} and on_disk["metrics"] == {"ppl": 1.0}


def test_registry_lists_choices():
    reg = Registry("compress")
    reg.register("b")(1)
    reg.register("a")(2)
    assert reg.get("a") == 2 and reg.names() == ["a", "b"]
    with pytest.raises(UsageError, match="choose one of: a, b"):
        reg.get("zz")
    with pytest.raises(ValueError):
        reg.register("a")(3)


def _reference_nll(model, ids, seqlen, stride):
    """Independent sliding-window NLL: windows start every ``stride`` tokens; a window scores the
    positions not scored by an earlier window (the first position of a window has no context there,
    so disjoint windows score seqlen-1 tokens each)."""
    total, count = 0.0, 0
    scored_until = 0
    for begin in range(0, ids.numel() - 1, stride):
        end = min(begin + seqlen, ids.numel())
        with torch.no_grad():
            logits = model(input_ids=ids[None, begin:end]).logits[0]
        for pos in range(max(begin + 1, scored_until), end):
            total -= torch.log_softmax(logits[pos - 1 - begin].double(), -1)[ids[pos]].item()
            count += 1
        scored_until = end
        if end == ids.numel():
            break
    return total / count, count


@pytest.mark.parametrize("seqlen,stride", [(16, 16), (16, 8), (20, 7)])
def test_perplexity_matches_reference(seqlen, stride):
    model = build_tiny_llama(100, seed=1)
    ids = torch.randint(0, 100, (75,), generator=torch.Generator().manual_seed(0))
    r = evalkit.perplexity(model, ids, seqlen=seqlen, stride=stride, max_tokens=None, batch_size=3)
    nll, count = _reference_nll(model, ids, seqlen, stride)
    assert r.tokens == count
    assert count == (74 if stride < seqlen else 75 - math.ceil(75 / seqlen))
    assert r.nll == pytest.approx(nll, rel=1e-5)
    assert r.ppl == pytest.approx(math.exp(nll), rel=1e-5)


def test_perplexity_with_bos_scores_every_token_after_a_bos_column():
    """With ``bos_token_id`` each disjoint window is [BOS] + window and all its tokens are scored (the BOS is
    never scored), equal to a direct per-window computation."""
    model = build_tiny_llama(100, seed=1)
    ids = torch.randint(1, 100, (40,), generator=torch.Generator().manual_seed(0))
    r = evalkit.perplexity(model, ids, seqlen=16, max_tokens=None, batch_size=2, bos_token_id=0)
    total, count = 0.0, 0
    for b in range(0, 40, 16):
        x = torch.cat([torch.tensor([0]), ids[b:b + 16]])
        with torch.no_grad():
            logp = torch.log_softmax(model(input_ids=x[None]).logits[0].double(), -1)
        total -= logp[torch.arange(x.numel() - 1), x[1:]].sum().item()
        count += x.numel() - 1
    assert r.tokens == count == 40
    assert r.nll == pytest.approx(total / count, rel=1e-5)
    plain = evalkit.perplexity(model, ids, seqlen=16, max_tokens=None, batch_size=2)
    assert plain.tokens == 40 - 3  # without it, each window's first token has no context and is not scored


def test_scoring_bos_only_for_tokenizers_that_add_one(tiny_tokenizer):
    class Adds:
        bos_token_id = 7

        def __call__(self, text, add_special_tokens=True, return_attention_mask=False):
            return {"input_ids": ([7] if add_special_tokens else []) + [1]}

    class Declares(Adds):  # has a BOS token but does not add it (SmolLM2, Qwen2.5)
        def __call__(self, text, add_special_tokens=True, return_attention_mask=False):
            return {"input_ids": [1]}

    assert data.scoring_bos(Adds()) == 7
    assert data.scoring_bos(Declares()) is None
    assert data.scoring_bos(tiny_tokenizer) in (None, tiny_tokenizer.bos_token_id)


def test_read_jsonl_errors_name_the_line(tmp_path):
    p = tmp_path / "x.jsonl"
    p.write_text('{"text": "a"}\n{"text": \n')
    with pytest.raises(UsageError, match=r"x.jsonl:2: malformed JSON"):
        data.read_jsonl(p)
    p.write_text('{"text": "a"}\n{"other": 1}\n')
    with pytest.raises(UsageError, match=r"x.jsonl:2: missing field 'text'"):
        data.read_jsonl(p, required=("text",))


def test_calibration_batches_are_seeded_windows(tiny_tokenizer, tiny_text_file):
    a = data.calibration_batches(tiny_tokenizer, tiny_text_file, n=4, seqlen=16, seed=3)
    b = data.calibration_batches(tiny_tokenizer, tiny_text_file, n=4, seqlen=16, seed=3)
    c = data.calibration_batches(tiny_tokenizer, tiny_text_file, n=4, seqlen=16, seed=4)
    ids = data.tokenize(tiny_tokenizer, tiny_text_file.read_text())
    assert a.shape == (4, 16) and torch.equal(a, b) and not torch.equal(a, c)
    row = a[0].tolist()
    assert any(ids[s:s + 16].tolist() == row for s in range(ids.numel() - 15))


def test_calibration_windows_start_with_the_scoring_bos_only_when_asked(tiny_tokenizer, tiny_text_file):
    """Issue 40: Gemma's calibration windows start with its BOS (as its perplexity windows do); a tokenizer
    without a scoring BOS gets the same windows, draw for draw, so SmolLM2/Qwen results do not move."""
    class AddsBos:  # the tiny tokenizer, but putting BOS first when encoding with special tokens (Gemma)
        bos_token_id = 5

        def __call__(self, text, add_special_tokens=True, return_attention_mask=False):
            ids = tiny_tokenizer(text, add_special_tokens=False, return_attention_mask=False)["input_ids"]
            return {"input_ids": ([5] if add_special_tokens else []) + list(ids)}

    plain = data.calibration_batches(tiny_tokenizer, tiny_text_file, n=4, seqlen=16, seed=3)
    if data.scoring_bos(tiny_tokenizer) is None:
        assert torch.equal(plain, data.calibration_batches(tiny_tokenizer, tiny_text_file, n=4, seqlen=16, seed=3,
                                                           bos=True))
    gemma_like = AddsBos()
    without = data.calibration_batches(gemma_like, tiny_text_file, n=4, seqlen=16, seed=3)
    with_bos = data.calibration_batches(gemma_like, tiny_text_file, n=4, seqlen=16, seed=3, bos=True)
    assert torch.equal(without, plain)
    assert with_bos.shape == (4, 16) and (with_bos[:, 0] == 5).all()
    assert torch.equal(with_bos[:, 1:], plain[:, :15])  # the same draws, one text token fewer


def test_cli_version_and_ppl_json(tiny_llama_dir, tiny_text_file):
    code, out, _ = run_cli("--version")
    assert code == 0 and out.startswith("llmtool ")
    code, out, _ = run_cli("--json", "evaluate", "ppl", tiny_llama_dir, "--data", tiny_text_file, "--seqlen", "32")
    assert code == 0, out
    res = json.loads(out)
    assert res["seqlen"] == 32 and res["tokens"] > 0 and 1 < res["ppl"] < 1e4


def test_cli_user_errors_exit_2_one_line(tmp_path, tiny_llama_dir):
    proc = run_cli_subprocess("evaluate", "ppl", tmp_path / "missing")
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr and proc.stderr.strip().count("\n") == 0
    assert "no such model directory" in proc.stderr
    bad = tmp_path / "enc"
    bad.mkdir()
    (bad / "config.json").write_text(json.dumps({"architectures": ["BertModel"], "model_type": "bert"}))
    code, _, err = run_cli("evaluate", "ppl", bad)
    assert code == 2 and "not a causal language model" in err
    (bad / "config.json").write_text("{nope")
    code, _, err = run_cli("evaluate", "ppl", bad)
    assert code == 2 and "invalid JSON" in err
    code, _, err = run_cli("--dtype", "float8", "evaluate", "ppl", tiny_llama_dir, "--data", "austen-nope")
    assert code == 2


def test_austen_corpus_parses_into_books():
    from llmtool.core import defaults

    books = defaults.austen_books()
    assert set(defaults.AUSTEN_TRAIN + defaults.AUSTEN_TEST) <= set(books)
    pride = "\n".join(books["prideprejudice"])
    assert "It is a truth universally acknowledged" in pride
    test_text = defaults.text("austen-test")
    assert "Persuasion" in test_text or "Elliot" in test_text
    assert "Elizabeth Bennet" not in test_text  # train and test are disjoint books


@pytest.mark.slow
def test_default_model_is_coherent(smollm2_dir):
    from llmtool.core.models import load_model, load_tokenizer

    tok, model = load_tokenizer(smollm2_dir), load_model(smollm2_dir)
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_tokenize_in_pieces_equals_one_piece(tiny_tokenizer, monkeypatch):
    from conftest import TINY_TEXT

    words = TINY_TEXT.split()
    paras = [" ".join(words[i % len(words):][:20 + i % 7]) for i in range(60)]
    text = "\n\n".join(paras) + "\n\n\nCHAPTER 2\n\n" + "\n".join(paras[:10])
    whole = data.tokenize(tiny_tokenizer, text, chunk_chars=10**9)
    lengths = []
    real = data._encode
    monkeypatch.setattr(data, "_encode", lambda tok, t: (lengths.append(len(t)), real(tok, t))[1])
    pieces = data.tokenize(tiny_tokenizer, text, chunk_chars=500)
    assert torch.equal(pieces, whole)
    assert max(lengths) < len(text) // 2        # really encoded in pieces
    # a split that changes the ids (here: every piece gets a leading marker) falls back to one piece
    lengths.clear()
    monkeypatch.setattr(data, "_encode", lambda tok, t: (lengths.append(len(t)), [7] + real(tok, t))[1])
    assert data.tokenize(tiny_tokenizer, text, chunk_chars=500).numel() == whole.numel() + 1
    assert lengths[-1] == len(text)


def test_peak_rss_is_the_process_own_not_its_parents():
    """ru_maxrss survives exec on Linux: a child of a big parent would report the parent's size."""
    import subprocess
    import sys

    if not sys.platform.startswith("linux"):
        pytest.skip("VmHWM is Linux-only")
    big = torch.ones(256 * 1024 * 1024 // 4 * 4)        # 1 GiB touched in this (parent) process
    parent = evalkit.peak_rss_mb()
    assert parent > 1024
    out = subprocess.run([sys.executable, "-c", "from llmtool.core.evalkit import peak_rss_mb; print(peak_rss_mb())"],
                         capture_output=True, text=True, check=True).stdout
    del big
    assert float(out) < parent - 700

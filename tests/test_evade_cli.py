"""`llmtool evade` commands end to end on the tiny fixture model, and their user errors."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import run_cli, run_cli_subprocess

torch.set_num_threads(1)


def _write(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def _read(path):
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


@pytest.fixture()
def prompts(tmp_path):
    return _write(tmp_path / "prompts.jsonl", [
        {"id": "a", "prompt": "It is a truth universally acknowledged"},
        {"id": "b", "prompt": "The capital of France is"},
        {"id": "c", "prompt": "However little known the feelings"},
    ])


def test_watermark_detect_metrics_roundtrip(tiny_llama_dir, prompts, tmp_path):
    wm, plain = tmp_path / "wm.jsonl", tmp_path / "plain.jsonl"
    code, out, err = run_cli("evade", "watermark", tiny_llama_dir, prompts, "-o", wm, "--scheme", "unigram",
                             "--max-new-tokens", "80", "--no-repeat-ngram", "0")
    assert code == 0, err
    rows = _read(wm)
    assert [r["id"] for r in rows] == ["a", "b", "c"] and all(r["scheme"] == "unigram" for r in rows)
    code, _, err = run_cli("evade", "watermark", tiny_llama_dir, prompts, "-o", plain, "--scheme", "unigram",
                           "--max-new-tokens", "80", "--no-repeat-ngram", "0", "--unwatermarked")
    assert code == 0, err
    det_wm, det_plain = tmp_path / "det_wm.jsonl", tmp_path / "det_plain.jsonl"
    for src, dst, field in ((wm, det_wm, "watermarked_text"), (plain, det_plain, "text")):
        code, out, err = run_cli("--json", "evade", "detect", src, "--model", tiny_llama_dir, "--scheme", "unigram",
                                 "--field", field, "-o", dst)
        assert code == 0, err
    marked, unmarked = _read(det_wm), _read(det_plain)
    assert all(d["score_kind"] == "z" and d["n_scored"] > 40 for d in marked)
    assert min(d["score"] for d in marked) > max(d["score"] for d in unmarked)
    # the random tiny LM emits partial-byte tokens that re-tokenise into several ids, which dilutes z
    # below the fixed threshold 4 here (the real model does not do this); separation must still hold
    mean = lambda ds: sum(d["score"] for d in ds) / len(ds)  # noqa: E731
    assert mean(marked) - mean(unmarked) > 3 and not any(d["is_watermarked"] for d in unmarked)
    code, out, err = run_cli("--json", "evade", "metrics", det_wm, det_plain, "--fpr", "0.1")
    assert code == 0, err
    m = json.loads(out)
    assert m["auroc"] == 1.0 and m["tpr@fpr=0.1"] == 1.0
    assert m["asr"] == pytest.approx(1 - sum(d["is_watermarked"] for d in marked) / 3)


def test_bira_with_zero_bias_equals_vanilla(tiny_llama_dir, tmp_path):
    src = _write(tmp_path / "wm.jsonl", [{"id": i, "watermarked_text": t} for i, t in enumerate(
        ["The capital of France is Paris. The Eiffel Tower is in Paris.",
         "A single man in possession of a good fortune must be in want of a wife."])])
    outs = {}
    for method, extra in (("bira", ["--beta0", "0", "--max-iter", "1"]), ("vanilla", []), ("bira", ["--beta0", "-8"])):
        out = tmp_path / f"{method}{len(extra)}.jsonl"
        code, _, err = run_cli("--seed", "3", "evade", "attack", src, "-o", out, "--method", method,
                               "--paraphraser", tiny_llama_dir, *extra)
        assert code == 0, err
        outs[(method, len(extra))] = _read(out)
    zero, vanilla, strong = outs[("bira", 4)], outs[("vanilla", 0)], outs[("bira", 2)]
    assert [r["attacked_text"] for r in zero] == [r["attacked_text"] for r in vanilla]
    assert zero[0]["suppression_size"] > 5 and vanilla[0]["suppression_size"] == 0
    assert [r["attacked_text"] for r in strong] != [r["attacked_text"] for r in vanilla]
    assert all({"beta_final", "iterations", "degenerated", "watermarked_text"} <= set(r) for r in strong)


def test_cheap_edit_attacks(tiny_llama_dir, tmp_path):
    text = "a man in a cap and a man with a cap " * 4  # ' man' / ' cap' are whole-word tokens of the fixture
    src = _write(tmp_path / "wm.jsonl", [{"id": 0, "watermarked_text": text}])
    for method in ("word-delete", "synonym"):
        out = tmp_path / f"{method}.jsonl"
        extra = ["--paraphraser", tiny_llama_dir] if method == "synonym" else []
        code, _, err = run_cli("evade", "attack", src, "-o", out, "--method", method, *extra)
        assert code == 0, err
        attacked = _read(out)[0]["attacked_text"]
        assert attacked != text and len(attacked.split()) <= len(text.split())


@pytest.mark.parametrize("content, args, message", [
    ('{"watermarked_text": "fine"}\n{oops\n', ["detect"], "wm.jsonl:2: malformed JSON"),
    ('{"watermarked_text": "   "}\n', ["detect"], "field 'watermarked_text' is empty"),
    ('{"text": "hello"}\n', ["detect"], "missing field 'watermarked_text'"),
    ('{"watermarked_text": "hello"}\n', ["detect", "--scheme", "kgb"], "unknown scheme 'kgb'"),
    ('{"watermarked_text": "hello"}\n', ["attack", "--method", "magic"], "unknown method 'magic'"),
])
def test_user_errors(tiny_llama_dir, tmp_path, content, args, message):
    src = tmp_path / "wm.jsonl"
    src.write_text(content)
    cmd, *rest = args
    extra = ["--model", tiny_llama_dir] if cmd == "detect" else ["-o", tmp_path / "out.jsonl",
                                                                  "--paraphraser", tiny_llama_dir]
    code, _, err = run_cli("evade", cmd, src, *extra, *rest)
    assert code == 2 and message in err
    assert not (tmp_path / "out.jsonl").exists()


def test_bad_config_and_existing_output(tiny_llama_dir, prompts, tmp_path):
    cfg = tmp_path / "kgw.json"
    cfg.write_text('{"gamma": 0.25, "delta": ')
    code, _, err = run_cli("evade", "watermark", tiny_llama_dir, prompts, "-o", tmp_path / "o.jsonl", "--config", cfg)
    assert code == 2 and "kgw.json:1: malformed JSON" in err
    existing = tmp_path / "exists.jsonl"
    existing.write_text("keep\n")
    code, _, err = run_cli("evade", "watermark", tiny_llama_dir, prompts, "-o", existing)
    assert code == 2 and "exists" in err and existing.read_text() == "keep\n"


def test_error_is_one_line_without_traceback(tmp_path):
    src = tmp_path / "t.jsonl"
    src.write_text('{"watermarked_text": ""}\n')
    proc = run_cli_subprocess("evade", "detect", src, "--scheme", "unigram", "--model", "no-such-model-dir")
    assert proc.returncode == 2
    assert proc.stderr.strip().startswith("error:") and len(proc.stderr.strip().splitlines()) == 1
    assert "Traceback" not in proc.stderr


def test_calibrate_beta_cli(tiny_llama_dir, tmp_path):
    data = _write(tmp_path / "c.jsonl", [{"text": "The capital of France is Paris. The capital of Italy is Rome."}])
    code, out, err = run_cli("--json", "evade", "calibrate-beta", data, "--paraphraser", tiny_llama_dir,
                             "--from", "-2", "--to", "-4")
    assert code == 0, err
    res = json.loads(out)
    assert [c["beta"] for c in res["curve"]][:2] == [0.0, -2.0]      # the unbiased baseline first
    assert res["beta0"] is None or res["beta0"] == res["curve"][-1]["beta"]
    code, _, err = run_cli("evade", "calibrate-beta", data, "--paraphraser", tiny_llama_dir, "--from", "-5", "--to", "-1")
    assert code == 2 and "--to" in err


def test_bira_calibrates_beta0_per_rewriter_and_caches_it(tiny_llama_dir, tmp_path, monkeypatch):
    from llmtool.evade import beta_cache

    monkeypatch.setattr(beta_cache, "GRID", (-1.0, -2.0))      # a short grid keeps the test fast
    src = _write(tmp_path / "wm.jsonl", [{"id": 0, "watermarked_text": "The capital of France is Paris. It is old."}])
    res = []
    for i in range(2):
        out = tmp_path / f"o{i}.jsonl"
        code, stdout, err = run_cli("--json", "evade", "attack", src, "-o", out, "--method", "bira",
                                    "--paraphraser", tiny_llama_dir, "--calib-texts", "3", "--max-iter", "1")
        assert code == 0, err
        res.append(json.loads(stdout))
    first, second = res[0]["beta0"], res[1]["beta0"]
    assert first["cached"] is False and second["cached"] is True and first["beta0"] == second["beta0"]
    assert first["texts"] == 3 and first["grid"] == [-1.0, -2.0] and first["beta0"] in (-1.0, -2.0, -4.0)
    assert _read(tmp_path / "o0.jsonl")[0]["beta_final"] == first["beta0"]
    # an explicit --beta0 skips the calibration
    code, stdout, err = run_cli("--json", "evade", "attack", src, "-o", tmp_path / "o2.jsonl", "--method", "bira",
                                "--paraphraser", tiny_llama_dir, "--beta0", "-2", "--max-iter", "1")
    assert code == 0, err
    assert "beta0" not in json.loads(stdout)


def test_watermark_generation_reports_progress_per_batch(tiny_llama_dir, monkeypatch, capsys):
    """`evade watermark` had no progress over its generation batches: a long run was silent in a log."""
    from llmtool.core import console
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.evade.generation import DecodeConfig, generate_ids

    monkeypatch.setattr(console, "STATUS_EVERY_S", 0.0)
    model, tok = load_model(tiny_llama_dir), load_tokenizer(tiny_llama_dir)
    dec = DecodeConfig(max_new_tokens=3, batch_size=1, no_repeat_ngram_size=0)
    plain = generate_ids(model, tok, [[5, 6], [7, 8]], [], dec)
    capsys.readouterr()
    shown = generate_ids(model, tok, [[5, 6], [7, 8]], [], dec, description="generating")
    err = capsys.readouterr().err
    assert shown == plain and "generating: 1/2" in err and "generating: 2/2" in err

"""Start-time estimates (llmtool.core.eta): units scale with the sizes, the line goes to stderr only (never
stdout, silent under --quiet), the calibration cache is reused and rebuilt when corrupt, report.json keeps
the estimate. Tiny random models only; the estimate's accuracy is benchmarks/estimates.py's job."""
from __future__ import annotations

import json

import pytest

from llmtool.core import eta
from llmtool.core import eta_plans as plans

SHAPE = plans.Shape.from_config({"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
                                 "intermediate_size": 128, "vocab_size": 320})
CAL = {"gemm_flops": 1e10, "gemv_bytes": 1e10}


def _stage(stages, name):
    return next(s for s in stages if s.name == name)


# ------------------------------------------------------------------------------------ scaling
def test_forward_units_and_seconds_double_with_the_tokens():
    a, b = plans.ppl(SHAPE, 1000, 128)[0], plans.ppl(SHAPE, 2000, 128)[0]
    assert b.units == 2 * a.units
    assert b.seconds(CAL) == pytest.approx(2 * a.seconds(CAL))
    assert "2000 tokens" in b.label


def test_each_plan_scales_with_its_sizes():
    from llmtool.quantize.configs import METHODS as QM

    q = QM.get("quarot")()
    one = _stage(plans.quantize(SHAPE, q, 4, 128, True, 128, 512), "calibration")
    two = _stage(plans.quantize(SHAPE, q, 8, 128, True, 128, 512), "calibration")
    assert two.units == 2 * one.units
    ev1 = _stage(plans.quantize(SHAPE, q, 4, 128, True, 128, 512), "eval")
    ev2 = _stage(plans.quantize(SHAPE, q, 4, 128, True, 128, 1024), "eval")
    assert ev2.units == 2 * ev1.units
    assert all(s.name != "eval" for s in plans.quantize(SHAPE, q, 4, 128, False, 128, 512))
    rsq = QM.get("respinquant")(train_steps=4)
    rsq8 = QM.get("respinquant")(train_steps=8)
    assert _stage(plans.quantize(SHAPE, rsq8, 4, 128, False, 128, 0), "rotation training").units == \
        2 * _stage(plans.quantize(SHAPE, rsq, 4, 128, False, 128, 0), "rotation training").units

    assert _stage(plans.pretrain(SHAPE, 20, 4, 1, 64, 4), "train").units * 2 == \
        _stage(plans.pretrain(SHAPE, 40, 4, 1, 64, 4), "train").units
    k1 = plans.kvcache_evaluate(SHAPE, "niah_single", 512, 2, 0, 0)
    k2 = plans.kvcache_evaluate(SHAPE, "niah_single", 512, 4, 0, 0)
    assert [2 * s.units for s in k1] == [s.units for s in k2]
    assert _stage(plans.kvcache_evaluate(SHAPE, "ruler", 512, 2, 0, 0), "prefill").units == 4 * k1[0].units
    g1 = plans.grpo(SHAPE, 2, 2, 4, 16, 8, False)
    g2 = plans.grpo(SHAPE, 4, 2, 4, 16, 8, False)
    assert [2 * s.units for s in g1] == [s.units for s in g2]
    e1 = plans.edit(SHAPE, 2, [0, 1], 10, 1024, False)
    assert _stage(plans.edit(SHAPE, 2, [0, 1], 10, 2048, False), "key statistics").units == \
        2 * _stage(e1, "key statistics").units
    assert all(s.name != "key statistics" for s in plans.edit(SHAPE, 2, [0, 1], 10, 1024, True))  # cached: free


def test_estimate_adds_startup_and_loading_and_formats():
    est = eta.estimate(plans.ppl(SHAPE, 1000, 128), CAL, params=1e9)
    assert est["seconds"] == pytest.approx(eta.STARTUP_S + eta.LOAD_S_PER_BPARAM
                                           + sum(est["stage_seconds"].values()))
    assert eta.fmt_seconds(3) == "a few seconds" and eta.fmt_seconds(42) == "about 40 s"
    assert eta.fmt_seconds(240) == "about 4 min" and eta.fmt_seconds(2 * 3600 + 600) == "about 2 h 10 min"
    assert eta.line(plans.ppl(SHAPE, 1000, 128), 240).startswith("estimate: about 4 min (perplexity 1000 tokens")


# ------------------------------------------------------------------------------------ calibration cache
def test_calibration_is_cached_and_keyed(tmp_path, monkeypatch):
    calls = []
    monkeypatch.setattr(eta, "measure", lambda dtype, device: calls.append((dtype, device)) or
                        {"gemm_flops": 5e10, "gemv_bytes": 2e10, "measured": "now"})
    f = tmp_path / "cal.json"
    a = eta.calibration(threads=1, dtype="float32", device="cpu", path=f)
    b = eta.calibration(threads=1, dtype="float32", device="cpu", path=f)
    assert len(calls) == 1 and not a["cached"] and b["cached"] and b["gemm_flops"] == 5e10
    eta.calibration(threads=2, dtype="float32", device="cpu", path=f)  # another key: measured again
    assert len(calls) == 2 and set(json.loads(f.read_text())) == {"threads=1,dtype=float32,device=cpu",
                                                                   "threads=2,dtype=float32,device=cpu"}
    monkeypatch.setenv("LLMTOOL_ETA_RECALIBRATE", "1")
    eta.calibration(threads=1, dtype="float32", device="cpu", path=f)
    assert len(calls) == 3


@pytest.mark.parametrize("content", [
    "{not json", "", "[1, 2]", '{"threads=1,dtype=float32,device=cpu": {"gemm_flops": "fast", "gemv_bytes": 1}}',
    '{"threads=1,dtype=float32,device=cpu": {"gemm_flops": -1, "gemv_bytes": 1e9}}',
    '{"threads=1,dtype=float32,device=cpu": {"gemm_flops": 0, "gemv_bytes": 1e9}}',
    '{"threads=1,dtype=float32,device=cpu": {"gemm_flops": true, "gemv_bytes": 1e9}}',
    '{"threads=1,dtype=float32,device=cpu": 7}',
    "[" * 100000,
])
def test_corrupt_calibration_cache_is_recomputed(tmp_path, content):
    f = tmp_path / "cal.json"
    f.write_text(content)
    cal = eta.calibration(threads=1, dtype="float32", device="cpu", path=f)  # real (short) measurement
    assert not cal["cached"] and cal["gemm_flops"] > 0 and cal["gemv_bytes"] > 0
    assert eta._valid(json.loads(f.read_text())["threads=1,dtype=float32,device=cpu"])
    assert eta.calibration(threads=1, dtype="float32", device="cpu", path=f)["cached"]


def test_binary_and_unwritable_cache_never_fail(tmp_path, monkeypatch):
    monkeypatch.setattr(eta, "measure", lambda dtype, device: {"gemm_flops": 1e10, "gemv_bytes": 1e10})
    f = tmp_path / "cal.json"
    f.write_bytes(b"\xff\xfe\x00garbage")
    assert not eta.calibration(threads=1, path=f)["cached"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert eta.calibration(threads=1, path=blocker / "sub" / "cal.json")["gemm_flops"] == 1e10  # cannot write: ok


# ------------------------------------------------------------------------------------ the printed line
def _ppl(tiny_llama_dir, tiny_text_file, *extra):
    from conftest import run_cli

    return run_cli("evaluate", "ppl", str(tiny_llama_dir), "--data", str(tiny_text_file), "--seqlen", "16", *extra)


def test_estimate_line_on_stderr_not_stdout(tiny_llama_dir, tiny_text_file, monkeypatch):
    monkeypatch.setattr(eta, "MIN_PRINT_S", 0.0)
    code, out, err = _ppl(tiny_llama_dir, tiny_text_file, "--json")
    assert code == 0, err
    assert "estimate:" in err and "perplexity" in err
    assert "estimate:" not in out and json.loads(out)["ppl"] > 0  # stdout is one JSON document
    assert eta.LAST is not None and eta.LAST["seconds"] > 0


def test_estimate_silent_under_quiet_and_for_short_commands(tiny_llama_dir, tiny_text_file, monkeypatch):
    code, _, err = _ppl(tiny_llama_dir, tiny_text_file)  # a tiny model: far under MIN_PRINT_S
    assert code == 0 and "estimate:" not in err, err
    monkeypatch.setattr(eta, "MIN_PRINT_S", 0.0)
    code, _, err = _ppl(tiny_llama_dir, tiny_text_file, "--quiet")
    assert code == 0 and "estimate:" not in err, err


def test_short_estimate_needs_no_calibration(monkeypatch):
    monkeypatch.setattr(eta, "calibration", lambda *a, **k: pytest.fail("calibrated a short command"))
    assert eta.announce(plans.ppl(SHAPE, 100, 16), 1e5)["calibration"]["key"] == "slow-default"


def test_report_json_keeps_the_estimate(tiny_llama_dir, tmp_path, monkeypatch):
    from conftest import run_cli

    monkeypatch.setattr(eta, "MIN_PRINT_S", 0.0)
    out = tmp_path / "q"
    code, _, err = run_cli("quantize", "--method", "rtn", str(tiny_llama_dir), str(out), "--no-eval")
    assert code == 0, err
    assert "estimate:" in err
    report = json.loads((out / "report.json").read_text())
    assert report["estimate_seconds"] > 0 and report["seconds"] > 0
    assert eta.LAST is None  # taken by the job: never written into a later command's output


def test_record_file_for_the_benchmark(tmp_path, monkeypatch):
    rec = tmp_path / "rec.jsonl"
    monkeypatch.setenv("LLMTOOL_ETA_RECORD", str(rec))
    monkeypatch.setattr(eta, "calibration", lambda *a, **k: {**CAL, "key": "test"})
    eta.announce(plans.ppl(SHAPE, 10 ** 7, 512), 1e8, "evaluate ppl")
    row = json.loads(rec.read_text())
    assert row["command"] == "evaluate ppl" and row["stages"][0]["units"] == 10 ** 7 and row["seconds"] > 10


# ------------------------------------------------------------------------------------ progress without a tty
def test_progress_prints_status_lines_without_a_tty(monkeypatch, capsys):
    from llmtool.core import console

    monkeypatch.setattr(console, "STATUS_EVERY_S", 0.0)
    assert list(console.progress(range(3), "layers")) == [0, 1, 2]
    err = capsys.readouterr().err
    assert "layers: 1/3" in err and "layers: 3/3" in err
    console.OPTIONS.quiet = True
    assert list(console.progress(range(3), "layers")) == [0, 1, 2]
    assert "layers" not in capsys.readouterr().err


@pytest.mark.parametrize("value", ["x", {"a": 1}, [1], -5, 0, 10 ** 40, None, True])
def test_hostile_config_values_never_fail_the_estimate(tmp_path, value):
    import math

    cfg = {"hidden_size": value, "num_hidden_layers": value, "intermediate_size": value, "vocab_size": value,
           "num_attention_heads": value, "head_dim": value}
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    shape = plans.Shape.of(tmp_path)
    est = eta.estimate(plans.ppl(shape, 1000, 128), CAL, shape.params)
    assert math.isfinite(est["seconds"]) and est["seconds"] > 0


def test_a_leftover_estimate_of_another_command_is_not_reported(monkeypatch):
    monkeypatch.setattr(eta, "calibration", lambda *a, **k: {**CAL, "key": "test"})
    eta.announce(plans.ppl(SHAPE, 10 ** 7, 512), 1e8, "evaluate ppl")
    assert eta.take_last("edit keystone finetune") is None and eta.LAST is None
    eta.announce(plans.ppl(SHAPE, 10 ** 7, 512), 1e8, "learn-program run")
    assert eta.take_last("learn-program")["seconds"] > 0


def test_kvcache_generate_announces_prompts_times_new_tokens(tiny_llama_dir, tmp_path, monkeypatch):
    """`kvcache generate` had a plan but never announced it: a long prompts file started silently."""
    from conftest import run_cli

    monkeypatch.setattr(eta, "MIN_PRINT_S", 0.0)
    decode_units = []
    for n in (1, 3):
        prompts = tmp_path / f"p{n}.jsonl"
        prompts.write_text("".join(json.dumps({"context": "It is a truth universally acknowledged, that a single man",
                                               "question": " Who?"}) + "\n" for _ in range(n)))
        eta.LAST = None
        code, _, err = run_cli("kvcache", "generate", str(tiny_llama_dir), "--prompts", str(prompts),
                               "--max-new-tokens", "4")
        assert code == 0 and "estimate:" in err, err
        decode_units.append(next(s["units"] for s in eta.LAST["stages"] if s["name"] == "decode"))
    assert decode_units == [4, 12]

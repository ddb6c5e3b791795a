"""The BIRA beta0 sweep (benchmarks/evade_sweep.py) and the helpers it added to benchmarks/evade.py: fixed-beta0
attack names, the bootstrap similarity interval, the fresh (cache-bypassing) calibration, the curve's default
choice and its gates, and one end-to-end run on the tiny fixture model."""
from __future__ import annotations

import json

import pytest
import torch

from conftest import load_benchmark

torch.set_num_threads(1)


@pytest.fixture(scope="module")
def ev():
    return load_benchmark("evade")


@pytest.fixture(scope="module")
def sweep():
    return load_benchmark("evade_sweep")


def test_fixed_beta0_names(ev):
    assert ev.fixed_beta0("bira@-2") == -2.0 and ev.fixed_beta0("bira@-2.5") == -2.5
    assert ev.fixed_beta0("bira@0") == 0.0
    assert ev.fixed_beta0("bira-4") is None and ev.fixed_beta0("vanilla") is None
    for bad in ("bira@", "bira@x", "bira@1", "bira@nan"):
        with pytest.raises(ValueError):
            ev.fixed_beta0(bad)
    assert ev.main(["--attacks", "none", "bira@2"]) == 2          # refused before any model loads


def test_similarity_interval(ev):
    import random

    rng = random.Random(0)
    vals = [rng.random() for _ in range(200)]
    lo, hi = ev.similarity_interval(vals, seed=1)
    mean = sum(vals) / len(vals)
    assert lo < mean < hi and 0.02 < hi - lo < 0.12       # ~ 2 * 1.96 * 0.29 / sqrt(200) = 0.08
    assert ev.similarity_interval(vals, seed=1) == [lo, hi]  # seeded
    assert ev.similarity_interval([0.5] * 10) == [0.5, 0.5]
    assert ev.similarity_interval([0.5]) is None


def test_fresh_calibration_never_reads_the_cache(ev, tmp_path, monkeypatch):
    from llmtool.evade import beta_cache

    model = tmp_path / "rewriter"
    model.mkdir()
    (model / "config.json").write_text('{"model_type": "llama"}')
    settings = {"texts": 5, "grid": [-1.0, -2.0]}
    curve = [{"beta": 0.0, "degenerate_rate": 0.0}]
    assert beta_cache.calibrated_beta0(model, settings, lambda: (-2.0, curve), -4.0)[0] == -2.0
    cached = beta_cache.cache_path().read_text()
    beta0, entry = beta_cache.calibrated_beta0(model, settings, lambda: (-1.0, curve), -4.0, use_cache=False)
    assert (beta0, entry["cached"]) == (-1.0, False)          # measured, not the cached -2
    assert beta_cache.cache_path().read_text() == cached      # the real cache is not written
    assert beta_cache.calibrated_beta0(model, settings, lambda: (-3.0, curve), -4.0)[0] == -2.0  # outside: cached


def _row(scheme, beta0, evasion, sim, lo=None):
    sims = [sim + 0.05 * ((i % 5) - 2) for i in range(50)]
    return {"scheme": scheme, "beta0": beta0, "evasion": evasion,
            "evasion_ci": [evasion - 0.04 if lo is None else lo, min(1.0, evasion + 0.02)],
            "similarity": sim, "similarity_ci": [sim - 0.02, sim + 0.02], "_sims": sims}


def test_choose_beta0_least_negative_reaching_target_on_every_scheme(sweep):
    rows = [_row("kgw", -1.0, 0.97, 0.5), _row("kgw", -2.0, 0.99, 0.45), _row("kgw", -3.0, 1.0, 0.4),
            _row("unigram", -1.0, 0.90, 0.5), _row("unigram", -2.0, 0.96, 0.44), _row("unigram", -3.0, 0.99, 0.4)]
    c = sweep.choose_beta0(rows, ["kgw", "unigram"], 0.95)
    assert c["beta0"] == -2.0 and c["evasion"] == {"kgw": 0.99, "unigram": 0.96}
    assert sweep.choose_beta0(rows, ["kgw"], 0.95)["beta0"] == -1.0
    assert sweep.choose_beta0(rows, ["kgw", "unigram"], 0.995)["beta0"] is None
    # a beta0 missing on one scheme is not chosen
    assert sweep.choose_beta0([r for r in rows if (r["scheme"], r["beta0"]) != ("unigram", -2.0)],
                              ["kgw", "unigram"], 0.95)["beta0"] == -3.0


def test_sweep_gates_can_fail_and_are_not_tested_without_data(sweep):
    rows = [_row("kgw", -1.0, 0.97, 0.5), _row("kgw", -4.0, 1.0, 0.3),
            _row("unigram", -1.0, 0.96, 0.5), _row("unigram", -4.0, 0.99, 0.3)]
    betas = [-1.0, -4.0]
    choice = sweep.choose_beta0(rows, ["kgw", "unigram"])
    g = {x["gate"].split(":")[0]: x["verdict"] for x in
         sweep.sweep_gates(rows, ["kgw", "unigram"], betas, choice, {"beta0": -3.0})}
    assert list(g.values()) == ["met", "met", "not met"]     # calibrated -3 != curve -1
    g = [x["verdict"] for x in sweep.sweep_gates(rows, ["kgw", "unigram"], betas, choice, {"beta0": -1.0})]
    assert g[2] == "met"
    # the same similarity at both ends: the paired interval straddles 0 and the cost is not shown
    flat = [dict(r, _sims=[0.4 + 0.1 * (((i * 7 + int(r["beta0"])) % 5) - 2) for i in range(50)]) for r in rows]
    g = sweep.sweep_gates(flat, ["kgw", "unigram"], betas, choice, None)[1]
    assert g["verdict"] == "not met" and g["measured"]["kgw"]["ci"][0] < 0 < g["measured"]["kgw"]["ci"][1]
    assert sweep.paired_similarity_difference([0.5, 0.6, 0.7], [0.4, 0.5, 0.6])["diff"] == pytest.approx(0.1)
    # rows without per-text values (the main run's) cannot be compared
    no_text = [dict(r, _sims=None) if r["beta0"] == -4.0 else r for r in rows]
    assert sweep.sweep_gates(no_text, ["kgw", "unigram"], betas, choice, None)[1]["verdict"] == "not tested"
    assert sweep.sweep_gates(rows, ["kgw", "unigram"], betas, choice, None)[2]["verdict"] == "not tested"
    part = rows[:2]
    gp = sweep.sweep_gates(part, ["kgw", "unigram"], betas, sweep.choose_beta0(part, ["kgw", "unigram"]), None)
    assert [x["verdict"] for x in gp] == ["not tested"] * 3


def test_sweep_end_to_end_on_the_tiny_model(sweep, tiny_llama_dir, tmp_path, monkeypatch):
    """Two fixed beta0 and the fresh calibration on the tiny random Llama (a stub replaces MiniLM, a real model);
    the outputs carry per-text values, intervals, the calibration measured (not cached) and no machine path."""
    import llmtool.evade.similarity as similarity

    class StubEmbedder:
        def similarity(self, a, b):
            return [1.0 / (1 + abs(len(x) - len(y))) for x, y in zip(a, b)]

    monkeypatch.setattr(similarity, "SentenceEmbedder", StubEmbedder)
    from llmtool.evade import beta_cache

    out = tmp_path / "sweep"
    argv = ["--model", str(tiny_llama_dir), "--n", "3", "--n-neg", "8", "--max-new-tokens", "8",
            "--betas", "-1", "-3", "--calib-texts", "1", "--batch-size", "4", "--out", str(out)]
    assert sweep.main(argv) == 0
    doc = json.loads(out.with_suffix(".json").read_text())
    runs = json.loads(out.with_name("sweep_runs.json").read_text())
    assert [(r["scheme"], r["beta0"]) for r in doc["curve"]] == [("kgw", -1.0), ("kgw", -3.0),
                                                                  ("unigram", -1.0), ("unigram", -3.0)]
    for r in doc["curve"]:
        assert r["n"] == 3 and len(r["evasion_ci"]) == 2 and r["similarity_ci"][0] <= r["similarity"] <= \
            r["similarity_ci"][1]
    assert doc["calibration"]["cached"] is False and doc["calibration"]["fresh"] is True
    assert not beta_cache.cache_path().exists()               # the calibration did not touch $LLMTOOL_HOME
    rec = next(r for r in runs["summary"] if r["attack"] == "bira@-3")
    assert rec["beta0"] == -3.0 and len(rec["per_text"]["similarity"]) == 3
    assert all(1 <= a <= 4 for a in rec["per_text"]["attempts"])
    order = list(runs["meta"]["stage_seconds"])
    # beta0 by beta0 over the schemes; the calibration after the two mildest beta0
    assert order.index("kgw/bira@-1") < order.index("unigram/bira@-1") < order.index("kgw/bira@-3") \
        < order.index("unigram/bira@-3") < order.index("calibrate")
    assert len(doc["gates"]) == 3 and out.with_suffix(".png").stat().st_size > 1000


def test_fill_from_main_only_where_the_texts_match(sweep):
    sweep_rows = [dict(_row("kgw", -1.0, 0.7, 0.5), source="sweep")]
    main = [{"scheme": s, "attack": a, "beta0": b, "n_pos": 100, "evasion_rate": 0.99, "evasion_ci": [0.95, 1.0],
             "tpr@fpr=0.01": 0.03, "tpr@fpr=0.01_ci": [0.01, 0.08], "tpr@fpr=0.1": 0.1, "tpr@fpr=0.1_ci": [0, 0.2],
             "auroc": 0.5, "similarity": 0.37, "similarity_evaded": 0.37, "n_evaded": 99, "ppl_median": 8.0,
             "self_bleu": 0.2} for s in ("kgw", "unigram") for a, b in (("bira-cal", -3.0), ("bira-4", -4.0))]
    main.append(dict(main[0], attack="bira-cal", beta0=-1.0))     # a beta0 the sweep measured: the sweep's row wins
    rows = sweep.fill_from_main(sweep_rows, main, {"kgw": {"same_first_text": True},
                                                   "unigram": {"same_first_text": False}},
                                ["kgw", "unigram"], [-1.0, -3.0, -4.0])
    assert [(r["scheme"], r["beta0"], r["source"]) for r in rows] == [
        ("kgw", -1.0, "sweep"), ("kgw", -3.0, "main run"), ("kgw", -4.0, "main run")]
    assert rows[1]["similarity_ci"] is None and rows[0]["evasion"] == 0.7


def test_resume_skips_done_stages_and_matches_an_uninterrupted_run(ev, tiny_llama_dir, tmp_path, monkeypatch):
    """A run of two stages, then ``--resume`` with one more attack: the done stages are not rerun (their
    watermarked texts come from the state file) and every record equals the one-go run's; another protocol is
    refused with one line and exit code 2."""
    import llmtool.evade.similarity as similarity

    class StubEmbedder:
        def similarity(self, a, b):
            return [1.0 / (1 + abs(len(x) - len(y))) for x, y in zip(a, b)]

    monkeypatch.setattr(similarity, "SentenceEmbedder", StubEmbedder)
    base = ["--model", str(tiny_llama_dir), "--n", "3", "--n-neg", "8", "--max-new-tokens", "8", "--schemes", "kgw",
            "--order", "attack", "--per-text", "--batch-size", "4", "--threads", "1"]
    one_go, split = tmp_path / "one", tmp_path / "split"
    assert ev.main(base + ["--attacks", "none", "bira@-1", "bira@-3", "--out", str(one_go)]) == 0
    assert ev.main(base + ["--attacks", "none", "bira@-1", "--out", str(split)]) == 0
    calls = []
    import llmtool.evade.generation as generation
    orig = generation.generate_ids

    def counting(*a, **k):
        calls.append(1)
        return orig(*a, **k)

    monkeypatch.setattr(generation, "generate_ids", counting)
    assert ev.main(base + ["--attacks", "none", "bira@-1", "bira@-3", "--out", str(split), "--resume"]) == 0
    assert calls == []                                        # no watermarked text was regenerated
    a = json.loads(one_go.with_suffix(".json").read_text())
    b = json.loads(split.with_suffix(".json").read_text())
    assert b["meta"]["resumed_stages"] == ["kgw/negatives", "kgw/generate", "kgw/bira@-1"]
    key = lambda r: (r["scheme"], r["attack"])  # noqa: E731
    assert sorted(map(key, a["summary"])) == sorted(map(key, b["summary"])) and len(a["summary"]) == 3
    for ra, rb in zip(sorted(a["summary"], key=key), sorted(b["summary"], key=key)):
        assert ra["per_text"] == rb["per_text"] and ra["evasion_rate"] == rb["evasion_rate"]
    assert ev.main(base[:3] + ["4"] + base[4:] + ["--attacks", "none", "--out", str(split), "--resume"]) == 2

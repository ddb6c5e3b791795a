"""SySRs, bandit baselines, replay simulation and result-file readers (spec sysr.md section 8)."""
from __future__ import annotations

import json

import numpy as np
import pytest

from llmtool.core.console import UsageError
from llmtool.evaluate import bai_sim as B
from llmtool.evaluate import results_io as R
from llmtool.evaluate import sysr as S
from llmtool.evaluate.bai import BAI_METHODS
from tests.conftest import run_cli, run_cli_subprocess


def test_schedule_matches_spec_examples():
    assert S.sr_schedule(5, 1000) == [112, 140, 186, 279]
    assert S.schedule_cost(5, 1000) == 996
    assert S.sr_schedule(10, 20000) == [823, 915, 1029, 1176, 1372, 1646, 2058, 2744, 4115]
    assert S.schedule_cost(10, 20000) == 19993
    with pytest.raises(UsageError):
        S.sr_schedule(5, 4)


def test_every_method_stays_within_budget():
    rng = np.random.default_rng(0)
    names = [m for m in BAI_METHODS.names() if m != "full"]
    for trial in range(25):
        k = int(rng.integers(2, 51))
        n = int(rng.integers(2, 40))
        x = (rng.random((k, n)) < rng.random((k, 1))).astype(float)
        budget = int(rng.integers(k, k * n + 1))
        assert S.schedule_cost(k, budget) <= budget
        for m in names:
            if m == "ucbe-lrf" and trial % 5:
                continue  # the slow one: every fifth trial
            r = np.random.default_rng(trial)
            oracle = S.MatrixOracle(x, r, log=True)
            res = BAI_METHODS.get(m)(oracle, budget, r, ensemble=8) if m == "ucbe-lrf" else \
                BAI_METHODS.get(m)(oracle, budget, r)
            assert oracle.used <= budget, (m, k, n, budget, oracle.used)
            assert len(set(oracle.log)) == len(oracle.log), f"{m} evaluated a pair twice"
            assert 0 <= res.best < k


def test_synchronisation_invariant_and_no_repeats():
    m = B.synthetic_irt(7, 400, 0.05, 3.0, 1)
    rng = np.random.default_rng(5)
    oracle = S.MatrixOracle(m.scores, rng, log=True)
    res = S.sysr(oracle, 900, rng, m.models)
    assert len(set(oracle.log)) == len(oracle.log)
    done = 0
    for p in res.phases:
        alive = [m.models.index(a) for a in p["alive"]]
        cum = p["cumulative_queries"]
        seen = {a: {j for (b, j) in oracle.log[: 10 ** 9] if b == a} for a in alive}
        # every survivor has been scored on exactly the first `cum` queries of the permutation
        expected = set(res.query_order[:cum].tolist())
        for a in alive:
            assert seen[a] >= expected
        done = cum
    # the final survivors' query sets are identical
    final = [m.models.index(a) for a in res.phases[-1]["alive"]]
    sets = [{j for (b, j) in oracle.log if b == a} for a in final]
    assert all(s == sets[0] for s in sets) and len(sets[0]) == done
    assert res.used == oracle.used <= 900


def test_exhaustion_returns_exact_argmax():
    m = B.synthetic_irt(4, 50, 0.05, 3.0, 2)
    for budget in (4 * 50, 4 * 50 + 7, 190):
        rng = np.random.default_rng(0)
        res = S.sysr(S.MatrixOracle(m.scores, rng), budget, rng)
        if budget >= 200 or res.exhausted:
            assert res.exhausted and res.best in m.best()
    # n_k >= N in a late phase: still exact
    rng = np.random.default_rng(1)
    res = S.sysr(S.MatrixOracle(m.scores, rng), 190, rng)
    assert res.exhausted and res.best in m.best()


def _error(matrix, method, frac, reps=300):
    return B.simulate(matrix, [method], [frac], reps, seed=0)[0].error_rate


def test_high_similarity_sysr_beats_sr():
    m = B.synthetic_irt(10, 2000, 0.05, 3.0, 0)
    s = m.summary()
    assert 0.04 <= s["top2_gap"] <= 0.07 and 0.15 <= s["top2_disagreement"] <= 0.25
    sysr05, sr05 = _error(m, "sysr", 0.05), _error(m, "sr", 0.05)
    assert sysr05 <= 0.11
    assert sr05 - sysr05 >= 0.07
    assert _error(m, "sysr", 0.10) <= 0.02


def test_low_similarity_pairing_cannot_help():
    m = B.synthetic_irt(10, 2000, 0.05, 0.5, 0)
    assert m.summary()["top2_disagreement"] >= 0.35
    for f in (0.05, 0.10):
        assert abs(_error(m, "sysr", f) - _error(m, "sr", f)) <= 0.06


def test_small_gap_large_budget():
    m = B.synthetic_irt(10, 2000, 0.03, 3.0, 3)
    assert _error(m, "sysr", 0.2) <= 0.06


def test_label_permutation_invariance():
    m = B.synthetic_irt(10, 2000, 0.05, 3.0, 0)
    base = _error(m, "sysr", 0.05)
    best = m.best()[0]
    order = [a for a in range(10) if a != best]
    order.insert(3, best)
    shuffled = m.permuted(order)
    assert shuffled.best() == [3]
    assert abs(_error(shuffled, "sysr", 0.05) - base) <= 0.04


def test_reproducible_run_json(tmp_path):
    m = B.synthetic_irt(5, 300, 0.05, 3.0, 0)
    R.write_wide(m, tmp_path / "m.csv")
    outs = []
    for name, seed in (("a", 0), ("b", 0), ("c", 1)):
        code, _, err = run_cli("evaluate", "sysr", "--responses", tmp_path / "m.csv", "--budget", "400",
                               "--seed", seed, "-o", tmp_path / f"{name}.json")
        assert code == 0, err
        outs.append(json.loads((tmp_path / f"{name}.json").read_text()))
    assert outs[0] == outs[1]
    assert outs[0]["query_order_sha256"] != outs[2]["query_order_sha256"]
    doc = outs[0]
    assert doc["evaluations_used"] <= 400 and doc["best"] in m.models
    assert set(doc) >= {"best", "budget", "evaluations_used", "phases", "seed", "query_order_sha256", "exhausted"}
    assert set(doc["phases"][0]) >= {"k", "alive", "n_k", "new_queries", "cumulative_queries", "totals",
                                     "eliminated", "tie_broken"}


def test_live_mode_counts_calls_and_resumes(tmp_path):
    m = B.synthetic_irt(6, 200, 0.05, 3.0, 4)
    calls = []

    def scorer(name, j):
        calls.append((name, j))
        return m.scores[m.models.index(name), j]

    rng = np.random.default_rng(3)
    oracle = S.LiveOracle(m.models, m.item_ids, scorer, tmp_path / "cache.parquet")
    res = S.sysr(oracle, 500, rng, m.models)
    assert len(calls) == res.used == oracle.calls
    assert len(set(calls)) == len(calls)
    # same run in replay mode gives the same answer
    rng = np.random.default_rng(3)
    assert S.sysr(S.MatrixOracle(m.scores, rng), 500, rng).best == res.best

    # kill after 150 scorer calls, then resume from the cache
    cache = tmp_path / "cache2.parquet"
    n_calls = {"n": 0}

    def dying(name, j):
        n_calls["n"] += 1
        if n_calls["n"] > 150:
            raise KeyboardInterrupt
        return m.scores[m.models.index(name), j]

    with pytest.raises(KeyboardInterrupt):
        S.sysr(S.LiveOracle(m.models, m.item_ids, dying, cache), 500, np.random.default_rng(3), m.models)
    cached = len(S.read_cache(cache))
    assert cached > 0
    resumed_calls = []

    def counting(name, j):
        resumed_calls.append((name, j))
        assert (name, m.item_ids[j]) not in before
        return m.scores[m.models.index(name), j]

    before = set(S.read_cache(cache))
    oracle2 = S.LiveOracle(m.models, m.item_ids, counting, cache)
    res2 = S.sysr(oracle2, 500, np.random.default_rng(3), m.models)
    assert res2.best == res.best and res2.used == res.used
    assert len(resumed_calls) == res.used - cached


def _write(path, text):
    path.write_text(text)
    return path


def test_readers_wide_long_lm_eval(tmp_path):
    wide = _write(tmp_path / "w.csv", "item_id,a,b,c\n1,1,0,1\n2,0,0,1\n3,1,,1\n")
    mw = R.load_matrix([wide])
    assert mw.models == ["a", "b", "c"] and np.isnan(mw.scores[1, 2])
    mc, dropped = R.complete_items(mw)
    assert dropped == 1 and mc.shape == (3, 2)
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.table({"model": ["a", "a", "b", "b", "a"], "item_id": ["1", "2", "1", "2", "1"],
                             "score": [1.0, 0.0, 0.0, 1.0, 0.0], "sample": [0, 0, 0, 0, 1]}), tmp_path / "l.parquet")
    ml = R.load_matrix([tmp_path / "l.parquet"])
    assert ml.samples is not None and ml.scores[0, 0] == 0.5
    for name, rows in (("m1", [1, 0, 1]), ("m2", [0, 0, 1])):
        d = tmp_path / name
        d.mkdir()
        _write(d / "samples_arc.jsonl", "".join(json.dumps({"doc_id": i, "acc": v, "resps": []}) + "\n"
                                                for i, v in enumerate(rows)))
    me = R.load_matrix([str(tmp_path / "m1" / "samples_arc.jsonl"), f"other={tmp_path / 'm2' / 'samples_arc.jsonl'}"])
    assert me.models == ["m1", "other"] and me.scores.tolist() == [[1, 0, 1], [0, 0, 1]]


@pytest.mark.parametrize("text,needle", [
    ("item_id,a,b\n1,1,0\n1,0,1\n", "duplicate item_id '1'"),
    ("item_id,a,b\n1,1,yes\n", ":2: column 'b': non-numeric score 'yes'"),
    ("item_id,a,a\n1,1,0\n", "duplicated column(s) a"),
    ("id,a,b\n1,1,0\n", "missing column 'item_id'"),
    ("item_id,a\n1,1\n", "at least two model columns"),
    ("item_id,a,b\n1,1,\n2,0,\n", "model(s) with no scores at all: b"),
    ("item_id,a,b\n1,1,3\n", "outside [0, 1]"),
    ("model,item_id,score\na,1,1\na,1,0\nb,1,1\n", "duplicate row (model 'a', item_id '1')"),
])
def test_malformed_matrices(tmp_path, text, needle):
    p = _write(tmp_path / "bad.csv", text)
    with pytest.raises(UsageError) as e:
        R.load_matrix([p])
    assert needle in str(e.value)


def test_cli_errors_are_one_line(tmp_path):
    p = _write(tmp_path / "bad.csv", "item_id,a,b\n1,1,x\n")
    r = run_cli_subprocess("evaluate", "bai-sim", "--responses", p, "-o", tmp_path / "o.csv")
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert r.stderr.strip().count("\n") == 0 and "non-numeric score 'x'" in r.stderr
    code, _, err = run_cli("evaluate", "bai-sim", "--synthetic", "irt", "--methods", "sysr,nope", "-o",
                           tmp_path / "o.csv")
    assert code == 2 and "nope" in err


def test_bai_sim_cli_writes_results_and_summary(tmp_path):
    code, out, err = run_cli("--json", "evaluate", "bai-sim", "--synthetic", "irt", "--k", "5", "--n", "300",
                             "--methods", "sysr,sr,uniform-shared,ucbe@0.1", "--budget-fracs", "0.1,0.5",
                             "--reps", "30", "-o", tmp_path / "r.csv")
    assert code == 0, err
    lines = (tmp_path / "r.csv").read_text().splitlines()
    assert lines[0] == ("method,budget_frac,budget,rep_count,error_rate,error_ci_low,error_ci_high,mean_regret,"
                        "benchmark")
    assert len(lines) == 1 + 8
    summary = json.loads((tmp_path / "bai_summary.json").read_text())
    assert set(summary["methods"]) == {"sysr", "sr", "uniform-shared", "ucbe@0.1"}
    for row in json.loads(out)["results"]:
        assert row["error_ci_low"] <= row["error_rate"] <= row["error_ci_high"]


def test_wilson_interval():
    lo, hi = B.wilson(0, 300)
    assert lo == 0 and 0.01 < hi < 0.02
    lo, hi = B.wilson(150, 300)
    assert lo < 0.5 < hi and abs((lo + hi) / 2 - 0.5) < 1e-9


def test_live_cli_with_tiny_models(tmp_path, tiny_llama_dir):
    (tmp_path / "models.yaml").write_text(f"- {{name: a, path: '{tiny_llama_dir}', max_new_tokens: 2}}\n"
                                          f"- {{name: b, path: '{tiny_llama_dir}', max_new_tokens: 3}}\n")
    (tmp_path / "bench.jsonl").write_text("".join(json.dumps({"id": f"q{i}", "prompt": "The capital of France is",
                                                              "reference": "Paris"}) + "\n" for i in range(4)))
    args = ["--json", "evaluate", "sysr", "--models", tmp_path / "models.yaml", "--queries", tmp_path / "bench.jsonl",
            "--scorer", "contains", "--budget", "6", "-o", tmp_path / "live.json"]
    code, out, err = run_cli(*args)
    assert code == 0, err
    doc = json.loads(out)
    assert doc["scorer_calls"] == doc["evaluations_used"] <= 6 and doc["best"] in ("a", "b")
    code, out, err = run_cli(*args, "--overwrite")          # resumed from the cache: no new scorer calls
    assert code == 0, err
    again = json.loads(out)
    assert again["scorer_calls"] == 0 and again["best"] == doc["best"]
    (tmp_path / "bad.yaml").write_text("- {name: a}\n- {name: b, path: x}\n")
    code, _, err = run_cli("evaluate", "sysr", "--models", tmp_path / "bad.yaml", "--queries", tmp_path / "bench.jsonl",
                           "--budget", "4")
    assert code == 2 and "entry 1: needs fields 'name' and 'path'" in err


# ------------------------------------------------------------------ replay protocol (issue 19)

def test_rank1_fast_path_equals_general_als():
    from llmtool.evaluate.bai import rank1_ensemble

    rng = np.random.default_rng(3)
    x = (rng.random((6, 80)) < 0.6).astype(float)
    mask = rng.random((6, 80)) < 0.4
    fast = rank1_ensemble(x, mask, np.random.default_rng(7), ensemble=8, rank=1)
    # the same alternating ridge updates written out in float64 with einsum, same generator draws
    r = np.random.default_rng(7)
    m = mask[None] & (r.random((8, 6, 80)) >= 0.05)
    u = r.normal(0.0, 0.1, (8, 6)) + 0.5
    v = r.normal(0.0, 0.1, (8, 80)) + 0.5
    xm = np.where(mask, x, 0.0)
    for _ in range(10):
        u = np.einsum("ekn,kn,en->ek", m, xm, v) / (np.einsum("ekn,en->ek", m, v * v) + 0.1)
        v = np.einsum("ekn,kn,ek->en", m, xm, u) / (np.einsum("ekn,ek->en", m, u * u) + 0.1)
    general = u[:, :, None] * v[:, None, :]
    assert fast.shape == (8, 6, 80)
    np.testing.assert_allclose(fast, general, atol=2e-5)


def test_common_random_numbers_and_workers():
    m = B.synthetic_irt(5, 300, 0.05, 3.0, 1)
    rows = B.simulate(m, ["ucbe", "ucbe@1", "uniform"], [0.05, 0.2], 40, seed=2)
    cell = {(r.method, r.budget_frac): r for r in rows}
    for f in (0.05, 0.2):
        a, b = cell[("ucbe", f)], cell[("ucbe@1", f)]   # the same method under two labels
        assert a.wrong == b.wrong and len(a.wrong) == 40
        c = B.paired_comparison(a, b)
        assert c["difference"] == 0 and c["a_only"] == c["b_only"] == 0
        assert c["ci_low"] <= 0 <= c["ci_high"]
    c = B.paired_comparison(cell[("uniform", 0.05)], cell[("ucbe", 0.05)])
    assert c["difference"] == pytest.approx(cell[("uniform", 0.05)].error_rate - cell[("ucbe", 0.05)].error_rate)
    parallel = B.simulate(m, ["ucbe", "ucbe@1", "uniform"], [0.05, 0.2], 40, seed=2, workers=2)
    assert [(r.method, r.budget_frac, r.wrong, r.mean_regret) for r in parallel] == \
        [(r.method, r.budget_frac, r.wrong, r.mean_regret) for r in rows]


def test_paired_difference_interval_covers():
    from llmtool.core.intervals import paired_difference

    rng = np.random.default_rng(0)
    # correlated pairs: P(A err) = 0.30, P(B err) = 0.20, P(both) = 0.15 -> true difference 0.10
    probs = np.array([0.15, 0.15, 0.05, 0.65])          # both, A only, B only, neither
    hits, trials = 0, 2000
    for _ in range(trials):
        both, a_only, b_only, _ = rng.multinomial(100, probs)
        d, lo, hi = paired_difference(int(a_only), int(b_only), int(both), 100)
        assert lo <= d <= hi
        hits += lo <= 0.10 <= hi
    assert 0.93 <= hits / trials <= 0.975
    # paired beats unpaired: a strongly correlated pair gives a narrower interval than independent Wilsons
    d, lo, hi = paired_difference(5, 0, 40, 100)
    assert lo > 0 and hi - lo < 0.12
    with pytest.raises(ValueError):
        paired_difference(60, 50, 0, 100)

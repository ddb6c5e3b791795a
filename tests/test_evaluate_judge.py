"""Bradley-Terry-Davidson judge aggregation (spec judge-btd.md section 8)."""
from __future__ import annotations

import json

import numpy as np
import pytest
from scipy.optimize import minimize_scalar

from llmtool.core.console import UsageError
from llmtool.evaluate import judge_btd as J
from tests.conftest import run_cli


def test_probabilities():
    theta = np.linspace(-6, 6, 25)
    for nu in (0.2, 1.0, 5.0):
        pa, pt, pb = J.davidson_probs(theta, nu)
        assert np.allclose(pa + pt + pb, 1.0, atol=1e-12)
        qa, qt, qb = J.davidson_probs(-theta, nu)
        assert np.allclose(pa, qb) and np.allclose(pt, qt)
        _, p0, _ = J.davidson_probs(0.0, nu)
        assert abs(p0 - nu / (2 + nu)) < 1e-12
        # tie is the most likely outcome iff nu > e^{|theta|/2}
        assert np.array_equal(pt > np.maximum(pa, pb), nu > np.exp(np.abs(theta) / 2))


def test_closed_form_mle_matches_numeric():
    for nu in (0.2, 1.0, 5.0):
        for n in (1, 7, 30):
            for a in range(n + 1):
                for b in range(n + 1 - a):
                    t = n - a - b
                    m = (a - b) / n
                    if abs(m) >= 1:
                        continue
                    closed = float(J.theta_mle(m, nu))
                    num = minimize_scalar(lambda th: -J.loglik(a, t, b, th, np.log(nu)), bounds=(-40, 40),
                                          method="bounded", options={"xatol": 1e-12})
                    # refine with Newton on the score equation for a tight comparison
                    th = num.x
                    for _ in range(30):
                        pa, _, pb = J.davidson_probs(th, nu)
                        g = (a - b) / 2 - n * (pa - pb) / 2
                        h = -n * ((pa + pb) - (pa - pb) ** 2) / 4
                        th -= g / h
                    assert abs(closed - th) < 1e-8, (a, t, b, nu)


def test_shared_mode_recovery():
    c, theta, _ = J.synthetic_counts(2000, tau=1.5, log_nu0=0.0, n_votes=20, seed=0, shared=True)
    fit = J.fit_judge(c, "shared")
    assert abs(np.exp(fit.log_nu0) - 1.0) < 0.1 and abs(fit.tau - 1.5) < 0.15
    post = J.posterior(c, fit)
    assert np.corrcoef(post.theta_mean, theta)[0, 1] >= 0.90
    t_map = J.theta_map(c, fit.log_nu0, fit.tau)
    mle = np.clip(J.theta_mle(np.clip(c.margin(), -1 + 1e-9, 1 - 1e-9), np.exp(fit.log_nu0)), -8, 8)
    rmse = lambda x: float(np.sqrt(np.mean((x - theta) ** 2)))  # noqa: E731
    assert rmse(t_map) < rmse(mle)
    assert abs(np.corrcoef(t_map, post.theta_mean)[0, 1]) > 0.99


def test_item_mode_recovery():
    c, _, _ = J.synthetic_counts(3000, tau=1.5, log_nu0=0.0, omega=0.5, n_votes=20, seed=0)
    fit = J.fit_judge(c, "item")
    assert abs(np.exp(fit.log_nu0) - 1.0) < 0.15
    assert abs(fit.tau - 1.5) < 0.15 * 1.5
    assert abs(fit.omega - 0.5) < 0.15 * 0.5


def test_calibration_value():
    c, theta, _ = J.synthetic_counts(3000, tau=1.5, log_nu0=0.0, omega=0.5, n_votes=20, seed=0)
    h = J.synthetic_human(theta, nu_h=2.0, seed=1)
    run = J.run_judge(c, dict(zip(c.ids, h)), calib_ids=c.ids[:600], nu_mode="shared")
    assert 0.8 <= run.calibration.beta <= 1.2
    assert 1.7 <= np.exp(run.calibration.c) <= 2.4
    mae = {r["method"]: r["mae"] for r in run.metrics}
    assert mae["btd"] <= mae["majority"] - 0.05
    assert mae["btd"] <= mae["soft-sc"] + 0.01
    assert len(run.test_idx) == 2400 and not set(run.calib_idx) & set(run.test_idx)


@pytest.mark.parametrize("nu_mode", ["shared", "item"])
def test_monotone_decision_regions(nu_mode):
    c, theta, _ = J.synthetic_counts(400, seed=2)
    fit = J.fit_judge(c, nu_mode)
    cal = J.Calibration(1.0, 0.7, 0.5 if nu_mode == "item" else 0.0)
    n = 20
    grid = [(a, t, n - a - t) for a in range(n + 1) for t in range(n + 1 - a)]
    cc = J.counts_from_arrays(*zip(*grid))
    agg = J.btd_aggregate(cc, fit, cal)
    index = {g: i for i, g in enumerate(grid)}
    for (a, t, b), i in index.items():
        for move in ((a + 1, t, b - 1), (a + 1, t - 1, b)):
            if min(move) < 0:
                continue
            j = index[move]
            assert agg.score[j] >= agg.score[i] - 1e-12
            assert agg.label[j] >= agg.label[i] or agg.label[i] != 1
            assert not (agg.label[i] == 1 and agg.label[j] != 1)


def test_position_mirroring():
    rows, flipped = [], []
    rng = np.random.default_rng(0)
    for i in range(50):
        for s in range(10):
            r = int(rng.integers(-1, 2))
            rows.append({"id": str(i), "sample": s, "order": "AB", "rating": r})
            # the same canonical vote shown in BA order: the judge's presented rating is negated
            flipped.append({"id": str(i), "sample": s, "order": "BA", "rating": -r})
    c1 = J.counts_from_votes(rows, "presented")
    c2 = J.counts_from_votes(flipped, "presented")
    assert np.array_equal(c1.a, c2.a) and np.array_equal(c1.t, c2.t) and np.array_equal(c1.b, c2.b)
    fit = J.fit_judge(c1, "shared")
    a1 = J.btd_aggregate(c1, fit, J.Calibration())
    a2 = J.btd_aggregate(c2, fit, J.Calibration())
    assert np.allclose(a1.theta, a2.theta) and np.array_equal(a1.label, a2.label)
    # forgetting to mirror would turn every BA vote into its opposite
    c3 = J.counts_from_votes(flipped, "canonical")
    assert np.array_equal(c3.a, c1.b)


def test_parse_failures_reduce_n():
    rows = [{"id": "x", "sample": s, "rating": (None if s < 5 else (1 if s % 3 else 0))} for s in range(20)]
    rows += [{"id": "y", "sample": s, "rating": -1 if s % 2 else 1} for s in range(20)]
    c = J.counts_from_votes(rows)
    assert c.n.tolist() == [15, 20]
    sc = J.soft_sc(c)
    assert np.isclose(sc.score[0], (c.a[0] - c.b[0]) / 15)
    fit = J.fit_judge(c, "shared")
    post = J.posterior(c, fit)
    manual = J.posterior(J.counts_from_arrays([c.a[0]], [c.t[0]], [c.b[0]]), fit)
    assert np.isclose(post.theta_mean[0], manual.theta_mean[0])


def test_bad_votes_are_user_errors():
    with pytest.raises(UsageError, match="votes:2: field 'rating' must be a number"):
        J.counts_from_votes([{"id": 1, "rating": 1}, {"id": 1, "rating": "A"}])
    with pytest.raises(UsageError, match="duplicate"):
        J.counts_from_votes([{"id": 1, "sample": 0, "rating": 1}, {"id": 1, "sample": 0, "rating": 0}])


def test_cli_round_trip(tmp_path):
    code, _, err = run_cli("evaluate", "judge-synth", tmp_path / "syn", "--items", "500", "--seed", "0")
    assert code == 0, err
    calib_ids = [json.loads(l)["id"] for l in (tmp_path / "syn" / "human.jsonl").read_text().splitlines()][:100]
    human = [json.loads(l) for l in (tmp_path / "syn" / "human.jsonl").read_text().splitlines()]
    (tmp_path / "calib.jsonl").write_text("".join(json.dumps(h) + "\n" for h in human if h["id"] in calib_ids))
    args = ["evaluate", "judge", "--votes", tmp_path / "syn" / "votes.jsonl", "--human", tmp_path / "syn" / "human.jsonl",
            "--calib-labels", tmp_path / "calib.jsonl", "--frame", "presented"]
    code, _, err = run_cli(*args, "-o", tmp_path / "a" / "agg.jsonl")
    assert code == 0, err
    recs = [json.loads(l) for l in (tmp_path / "a" / "agg.jsonl").read_text().splitlines()]
    btd = [r for r in recs if r["method"] == "btd"]
    assert len(btd) == 500
    assert set(btd[0]) >= {"id", "method", "label", "score", "p", "theta", "theta_sd", "log_nu_item", "counts",
                           "polarity", "decisiveness"}
    calib = json.loads((tmp_path / "a" / "calib.json").read_text())["default"]
    assert set(calib) >= {"nu_mode", "log_nu0", "tau", "omega", "beta", "c", "gamma", "n_calib_items", "loglik"}
    assert calib["n_calib_items"] == 100
    code, _, err = run_cli(*args, "--load-calib", tmp_path / "a" / "calib.json", "-o", tmp_path / "b" / "agg.jsonl")
    assert code == 0, err
    assert (tmp_path / "a" / "agg.jsonl").read_text() == (tmp_path / "b" / "agg.jsonl").read_text()
    report = json.loads((tmp_path / "a" / "judge_report.json").read_text())
    assert report["test_items"] == 400 and {m["method"] for m in report["metrics"]} >= {"btd", "majority"}
    (tmp_path / "bad.jsonl").write_text('{"id": 1, "rating": 1}\n{"id": 2\n')
    code, _, err = run_cli("evaluate", "judge", "--votes", tmp_path / "bad.jsonl", "-o", tmp_path / "c.jsonl")
    assert code == 2 and "bad.jsonl:2: malformed JSON" in err

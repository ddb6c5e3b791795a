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


# ------------------------------------------------------------------ sampling: parse, mirror, tiny model end to end

from llmtool.evaluate import judge_sample as S  # noqa: E402


def test_parse_rating_is_strict_and_reads_the_last_line():
    p = S.parse_rating
    assert p("The first is fluent.\nFinal rating: A") == 1
    assert p("Final rating: B\n") == -1 and p("final rating: tie") == 0 and p("Final rating: **A**.") == 1
    assert p("Final rating: A\nOn reflection...\nFinal rating: B") == -1          # the last occurrence wins
    assert p("Final rating: A\nFinal rating: maybe B") is None                      # ... even when it is junk
    for junk in ("", "I prefer A.", "Final rating: A is better", "Final rating: a", "Final rating: C",
                 "Final rating:", "Final rating: 1", "Final rating: A or B", "Rating: A"):
        assert p(junk) is None, junk
    assert p("Final rating: 2", "5pt") == 2 and p("Final rating: -2", "5pt") == -2 and p("Final rating: +1", "5pt") == 1
    assert p("Final rating: 3", "5pt") is None and p("Final rating: 1.5", "5pt") is None  # out of scale / not a point
    assert p("Final rating: A", "5pt") is None
    assert p("Final rating: \u22123", "7pt") == -3 and p("Final rating: 4", "7pt") is None
    with pytest.raises(UsageError, match="--scale"):
        p("Final rating: A", "10pt")


def test_ba_votes_are_mirrored_into_the_canonical_frame():
    assert S.to_canonical(1, "AB") == 1 and S.to_canonical(1, "BA") == -1 and S.to_canonical(None, "BA") is None
    assert S.sample_orders(4, "half") == ["AB", "BA", "AB", "BA"] and set(S.sample_orders(3, "all")) == {"BA"}
    pairs = S.read_pairs([{"id": i, "prompt": "p", "response_a": f"GOODX {i}", "response_b": f"BADX {i}",
                           "task": "t"} for i in range(5)])

    def always_first_slot(prompts, n):   # a judge that always says "A" in the frame it is shown
        return [[S.Generation("Hmm.\nFinal rating: A", 3)] * n for _ in prompts]

    votes = S.sample_votes(pairs, always_first_slot, 6, "half")
    assert {v["order"] for v in votes} == {"AB", "BA"}
    c = J.counts_from_votes(votes)                      # canonical frame: the slot preference cancels
    assert c.a.tolist() == [3] * 5 and c.b.tolist() == [3] * 5 and np.allclose(J.soft_sc(c).score, 0)
    summary = S.vote_summary(votes)
    assert summary["first_slot_share_AB"] == summary["first_slot_share_BA"] == 1.0  # pure position bias
    none = J.counts_from_votes(S.sample_votes(pairs, always_first_slot, 6, "none"))
    assert none.a.tolist() == [6] * 5                   # without swapping the bias becomes a fake preference

    def content_judge(prompts, n):                      # prefers whichever slot holds the GOODX response
        return [[S.Generation("Final rating: " + ("A" if p.index("GOODX") < p.index("BADX") else "B"), 2)] * n
                for p in prompts]

    votes = S.sample_votes(pairs, content_judge, 4, "half")
    assert all(v["rating"] == 1 for v in votes)         # every vote, AB or BA, says canonical A
    assert set(votes[0]) == {"id", "task", "sample", "order", "raw", "rating", "thinking_tokens"}


def _two_task_counts(n_items=1500, nus=(0.3, 3.0), seed=0):
    parts, thetas = [], []
    for k, nu in enumerate(nus):
        c, theta, _ = J.synthetic_counts(n_items, tau=1.5, log_nu0=float(np.log(nu)), omega=0.3, n_votes=20,
                                         seed=seed + k)
        parts.append((f"t{k + 1}", c))
        thetas.append(theta)
    ids = [f"{t}-{i}" for t, c in parts for i in c.ids]
    cat = lambda f: np.concatenate([getattr(c, f) for _, c in parts])  # noqa: E731
    tasks = [t for t, c in parts for _ in c.ids]
    return J.Counts(ids, cat("a"), cat("t"), cat("b"), cat("rating_sum"), cat("first"), tasks), np.concatenate(thetas)


def test_per_task_fit_recovers_two_tie_propensities():
    c, theta = _two_task_counts()
    run = J.run_judge(c, nu_mode="item")
    assert set(run.fits) == {"t1", "t2"} and run.fit is None
    nu1, nu2 = (float(np.exp(run.fits[t].log_nu0)) for t in ("t1", "t2"))
    assert abs(nu1 - 0.3) < 0.15 * 0.3 and abs(nu2 - 3.0) < 0.15 * 3.0
    pooled = J.run_judge(c, nu_mode="item", per_task=False)
    assert set(pooled.fits) == {J.POOLED}
    nu_p = float(np.exp(pooled.fits[J.POOLED].log_nu0))
    assert nu1 * 1.3 < nu_p < nu2 / 1.3                 # a pooled fit sits between the two tasks
    # humans with task-specific tie propensities: the per-task calibration finds each (shared mode, beta ~ 1)
    h = np.concatenate([J.synthetic_human(theta[:1500], 0.5, seed=3), J.synthetic_human(theta[1500:], 4.0, seed=4)])
    run = J.run_judge(c, dict(zip(c.ids, h)), calib_frac=0.4, nu_mode="shared")
    nh1, nh2 = (float(np.exp(run.calibrations[t].c)) for t in ("t1", "t2"))
    assert 0.3 < nh1 < 0.8 and 2.8 < nh2 < 5.5, (nh1, nh2)
    assert {r["task"] for r in run.task_metrics} == {"t1", "t2"} and len(run.metrics) == len(J.METHODS)
    cal_tasks = np.asarray(c.tasks)[run.calib_idx]
    assert abs((cal_tasks == "t1").sum() - 600) <= 1 and abs((cal_tasks == "t2").sum() - 600) <= 1  # stratified
    doc = J.calib_document(run)
    assert set(doc) == {"t1", "t2"} and doc["t1"]["c"] != doc["t2"]["c"]


def test_groups_define_pairwise_accuracy():
    votes = [{"id": i, "sample": 0, "rating": r, "task": "t", **({"group": g} if g else {})}
             for i, r, g in (("a", 1, "x"), ("b", -1, "x"), ("c", 0, None))]
    c = J.counts_from_votes(votes)
    assert J.group_keys(c).tolist() == ["group:x", "group:x", "task:t"]
    assert J.group_keys(c, ["y", None, "y"]).tolist() == ["group:y", "group:x", "group:y"]


def test_self_agg_prompt_parse_and_report_row():
    pair = S.read_pairs([{"id": "q", "prompt": "P", "response_a": "RA", "response_b": "RB"}])[0]
    outs = [{"id": "q", "sample": 0, "order": "AB", "raw": "A reads better.\nFinal rating: A", "rating": 1},
            {"id": "q", "sample": 1, "order": "BA", "raw": "x" * 50 + "\nFinal rating: A", "rating": -1},
            {"id": "q", "sample": 2, "order": "AB", "raw": "???", "rating": None}]
    text = S.self_agg_prompt(pair, outs, max_raw_chars=20)
    assert "[Response A]\nRA" in text and "swapped order" in text and text.count("[Evaluation") == 3
    assert "(rating in the order above: B)" in text and "unreadable" in text and "x" * 21 not in text
    recs = S.self_aggregate([pair], outs, lambda prompts, n: [[S.Generation("Weighing...\nFinal rating: B", 4)]
                                                              for _ in prompts])
    assert recs[0]["rating"] == -1 and recs[0]["parsed"] and recs[0]["n_outputs"] == 3
    recs = S.self_aggregate([pair], outs, lambda prompts, n: [[S.Generation("I cannot decide", 4)] for _ in prompts])
    assert recs[0]["rating"] is None and not recs[0]["parsed"]
    c, theta, _ = J.synthetic_counts(200, seed=5)
    h = J.synthetic_human(theta, 2.0, seed=6)
    sa = {i: (None if k % 10 == 0 else float(np.sign(theta[k]))) for k, i in enumerate(c.ids[:150])}
    run = J.run_judge(c, dict(zip(c.ids, h)), nu_mode="shared", self_agg=sa)
    assert run.self_agg_failures == 15 + 50                # nulls and missing ids count as tie failures
    row = next(r for r in run.metrics if r["method"] == "self-agg")
    assert row["test_items"] == len(run.test_idx) and "pairwise_acc" in row
    assert (run.aggregates["self-agg"].label[150:] == 0).all()


def test_hf_sample_matches_core_generate_greedy(tiny_llama_dir):
    from llmtool.core.lm import generate
    from llmtool.core.models import load_model, load_tokenizer

    m, tok = load_model(tiny_llama_dir), load_tokenizer(tiny_llama_dir)
    texts = ["It is a truth universally", "The capital of France is Paris. The capital of"]  # different lengths
    ref = generate(m, tok, texts, max_new_tokens=10, temperature=0.0, batch_size=2)
    got = S.hf_sample(m, tok, texts, 3, temperature=0.0, max_new_tokens=10, batch_rows=6)
    for r, g in zip(ref, got):
        assert [x.text for x in g] == [r[0].text] * 3 and g[0].tokens == len(r[0].token_ids)
    forced = S.hf_sample(m, tok, texts, 2, temperature=1.0, max_new_tokens=3, force_final=True, value_tokens=2)
    assert all("\nFinal rating:" in x.text and x.tokens <= 3 for g in forced for x in g)


def test_judge_sample_and_self_agg_cli_with_a_tiny_local_model(tmp_path, tiny_llama_dir):
    pairs = [{"id": f"p{i}", "task": "t1" if i < 2 else "t2", "prompt": "Continue: It is a truth",
              "response_a": "universally acknowledged", "response_b": "acknowledged universally",
              **({"group": "g"} if i == 0 else {})} for i in range(3)]
    (tmp_path / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in pairs))
    votes_path = tmp_path / "votes.jsonl"
    code, out, err = run_cli("--json", "evaluate", "judge-sample", "--judge", f"hf:{tiny_llama_dir}", "--pairs",
                             tmp_path / "pairs.jsonl", "--n", "4", "--max-new-tokens", "6", "-o", votes_path)
    assert code == 0, err
    summary = json.loads(out)
    votes = [json.loads(l) for l in votes_path.read_text().splitlines()]
    assert len(votes) == 12 and summary["votes"] == 12
    for v in votes:
        assert set(v) - {"group"} == {"id", "task", "sample", "order", "raw", "rating", "thinking_tokens"}
        assert v["order"] == ("BA" if v["sample"] % 2 else "AB") and 0 < v["thinking_tokens"] <= 6
        assert v["rating"] == S.to_canonical(S.parse_rating(v["raw"]), v["order"])  # strict parse, never a guess
    assert votes[0]["group"] == "g" and "group" not in votes[4]
    assert any(v["rating"] is None for v in votes)      # a random model's text is unparseable -> null
    assert summary["parse_failures"] == sum(v["rating"] is None for v in votes)
    sa_path = tmp_path / "selfagg.jsonl"
    code, _, err = run_cli("evaluate", "judge-self-agg", "--judge", str(tiny_llama_dir), "--pairs",
                           tmp_path / "pairs.jsonl", "--votes", votes_path, "--max-new-tokens", "4", "--force-final",
                           "-o", sa_path)
    assert code == 0, err
    recs = [json.loads(l) for l in sa_path.read_text().splitlines()]
    assert [r["id"] for r in recs] == ["p0", "p1", "p2"] and all("\nFinal rating:" in r["raw"] for r in recs)
    assert all(r["rating"] == S.parse_rating(r["raw"]) and r["n_outputs"] == 4 for r in recs)
    code, _, err = run_cli("evaluate", "judge-sample", "--judge", "openai:gpt-x", "--pairs", tmp_path / "pairs.jsonl",
                           "-o", tmp_path / "v2.jsonl")
    assert code == 2 and "--api-base" in err and not (tmp_path / "v2.jsonl").exists()
    code, _, err = run_cli("evaluate", "judge-sample", "--judge", str(tiny_llama_dir), "--pairs",
                           tmp_path / "pairs.jsonl", "--swap", "sometimes", "-o", tmp_path / "v3.jsonl")
    assert code == 2 and "--swap" in err


def test_judge_cli_per_task_calibration_and_self_agg_row(tmp_path):
    c, theta = _two_task_counts(n_items=300)
    h = J.synthetic_human(theta, 2.0, seed=7)
    with open(tmp_path / "votes.jsonl", "w") as fh:
        for i, iid in enumerate(c.ids):
            ratings = [1] * int(c.a[i]) + [0] * int(c.t[i]) + [-1] * int(c.b[i])
            for s, r in enumerate(ratings):
                fh.write(json.dumps({"id": iid, "task": c.tasks[i], "sample": s, "rating": r}) + "\n")
    (tmp_path / "human.jsonl").write_text("".join(json.dumps({"id": i, "rating": int(x)}) + "\n"
                                                  for i, x in zip(c.ids, h)))
    (tmp_path / "selfagg.jsonl").write_text("".join(
        json.dumps({"id": i, "rating": None if k % 7 == 0 else int(np.sign(theta[k]))}) + "\n"
        for k, i in enumerate(c.ids)))
    args = ["evaluate", "judge", "--votes", tmp_path / "votes.jsonl", "--human", tmp_path / "human.jsonl",
            "--nu-mode", "shared", "--self-agg", tmp_path / "selfagg.jsonl"]
    code, _, err = run_cli(*args, "-o", tmp_path / "a" / "agg.jsonl")
    assert code == 0, err
    calib = json.loads((tmp_path / "a" / "calib.json").read_text())
    assert set(calib) == {"t1", "t2"} and all("soft_sc_cal_threshold" in v for v in calib.values())
    report = json.loads((tmp_path / "a" / "judge_report.json").read_text())
    assert {m["method"] for m in report["metrics"]} == {*J.METHODS, "self-agg"}
    assert {(m["task"], m["method"]) for m in report["task_metrics"]} >= {("t1", "self-agg"), ("t2", "btd")}
    assert report["self_agg"]["failures"] == len(range(0, 600, 7)) and set(report["fits"]) == {"t1", "t2"}
    recs = [json.loads(l) for l in (tmp_path / "a" / "agg.jsonl").read_text().splitlines()]
    assert {r["method"] for r in recs} == {*J.METHODS, "self-agg"} and recs[0]["task"] == "t1"
    code, _, err = run_cli(*args, "--load-calib", tmp_path / "a" / "calib.json", "-o", tmp_path / "b" / "agg.jsonl")
    assert code == 0, err
    assert (tmp_path / "a" / "agg.jsonl").read_text() == (tmp_path / "b" / "agg.jsonl").read_text()
    code, _, err = run_cli(*args, "--pool-tasks", "--load-calib", tmp_path / "a" / "calib.json", "-o",
                           tmp_path / "c" / "agg.jsonl")
    assert code == 2 and "no entry for task 'pooled'" in err
    code, _, err = run_cli(*args, "--pool-tasks", "-o", tmp_path / "d" / "agg.jsonl")
    assert code == 0, err
    assert set(json.loads((tmp_path / "d" / "calib.json").read_text())) == {"pooled"}

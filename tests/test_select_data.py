"""select-data: vMF numerics, GEM (monotone MM, balance vs EM), SHIFT farthest-first, CLI."""
from __future__ import annotations

import json
import time

import numpy as np
import pytest
from conftest import run_cli

from llmtool.select_data import gem, shift, vmf


# ------------------------------------------------------------------------------------ vMF numerics
def test_log_cd_closed_form_d3():
    k = np.array([0.1, 1.0, 10.0, 100.0, 500.0])
    ref = np.log(k / (4 * np.pi * np.sinh(k)))
    assert np.max(np.abs(vmf.log_cd(3, k) - ref) / np.abs(ref)) < 1e-10


def test_debye_agrees_with_ive_path():
    for kk in (200.0, 2000.0):
        a = vmf.log_iv(383.0, np.array([kk]))
        b = vmf._log_iv_debye(np.array([383.0]), np.array([kk]))
        assert abs(a - b) / abs(a) < 1e-6


@pytest.mark.parametrize("d", [3, 64, 768])
def test_kappa_inversion(d):
    for kk in (1.0, 10.0, 100.0, 1000.0, 10000.0):
        r = vmf.a_d(d, np.array([kk]))
        assert abs(vmf.kappa_newton(d, r)[0] / kk - 1) < 1e-4


# ------------------------------------------------------------------------------------ GEM
def cone(n=1500, d=16, seed=0):
    rng = np.random.default_rng(seed)
    p = np.array([.40, .20, .12, .08, .08, .05, .04, .03])
    common = rng.normal(size=d)
    common /= np.linalg.norm(common)
    dirs = rng.normal(size=(8, d))
    dirs /= np.linalg.norm(dirs, axis=1, keepdims=True)
    lab = rng.choice(8, size=n, p=p)
    return gem.normalize(3 * common + dirs[lab] + 0.35 * rng.normal(size=(n, d))), lab


def test_row_solver_is_the_maximiser():
    rng = np.random.default_rng(1)
    a = rng.normal(scale=30, size=(20, 6))
    q0 = rng.dirichlet(np.ones(6), size=20)
    lam = 200.0
    q = gem.quadratic_row_solve(a, q0, lam)
    assert np.allclose(q.sum(1), 1)

    def f(qq):
        return (a * qq).sum(1) - (qq * np.log(qq)).sum(1) - lam / 2 * ((qq - q0) ** 2).sum(1)

    best = f(q)
    for _ in range(200):  # no random perturbation on the simplex does better
        other = np.clip(q + rng.normal(scale=1e-3, size=q.shape), 1e-12, None)
        other /= other.sum(1, keepdims=True)
        assert np.all(f(other) <= best + 1e-9)


def _q_block(s, q, lam):
    """The part of J that depends on Q (μ, κ fixed): Σ q·s + Σ H(q_i) − (λN/2)‖ρ − u‖²."""
    rho = q.mean(0)
    return float((q * s).sum() - (q * np.log(np.maximum(q, 1e-300))).sum()
                 - 0.5 * lam * len(q) * ((rho - 1.0 / q.shape[1]) ** 2).sum())


def test_exact_q_step_is_the_limit_of_the_mm_steps():
    rng = np.random.default_rng(2)
    n, k, lam = 300, 5, 5000.0
    s = rng.normal(scale=20, size=(n, k)) + np.array([40.0, 10, 0, 0, 0])  # cluster 0 over-full under λ = 0
    q, t = gem.balanced_softmax(s, lam)
    assert np.allclose(q.sum(1), 1)
    assert np.allclose(t, lam * (q.mean(0) - 1.0 / k), atol=1e-5)  # KKT: price t = λ(ρ − u)
    best = _q_block(s, q, lam)
    for _ in range(100):  # no perturbation on the simplex does better (strictly concave block)
        other = np.clip(q + rng.normal(scale=1e-3, size=q.shape), 1e-12, None)
        other /= other.sum(1, keepdims=True)
        assert _q_block(s, other, lam) <= best + 1e-6
    # the per-sample quadratic-minoriser MM steps increase the block monotonically towards it
    cfg = gem.VMFSettings(k=k, lam=lam, q_step="mm")
    qm = np.exp(s - gem._logsumexp(s))
    vals = [_q_block(s, qm, lam)]
    for _ in range(30):
        qm = gem._q_step(s, qm, cfg)
        vals.append(_q_block(s, qm, lam))
    assert np.all(np.diff(vals) >= -1e-7 * np.abs(vals[1:]))
    assert vals[-1] <= best + 1e-6 and vals[-1] > vals[0]


def test_gem_monotone_and_balanced_vs_em():
    x, _ = cone()
    res = {}
    for lam in (0.0, 5000.0):
        cfg = gem.VMFSettings(k=8, lam=lam, balance="quadratic" if lam else "none", kappa="tied",
                              kappa_solver="newton", max_iter=30)
        r = gem.fit_vmf(x, cfg)
        tr = np.array(r.trace)
        assert np.all(np.diff(tr) >= -1e-9 * np.abs(tr[1:])), "J decreased"
        res[lam] = gem.intrinsic(r.labels, 8)
    # the literal one-step MM Q-step is monotone too (fewer iterations: it is slow)
    r = gem.fit_vmf(x[:600], gem.VMFSettings(k=8, q_step="mm", kappa="tied", kappa_solver="newton", max_iter=6))
    tr = np.array(r.trace)
    assert np.all(np.diff(tr) >= -1e-9 * np.abs(tr[1:])), "J decreased (mm)"
    em = gem.fit_vmf(x, gem.VMFSettings(k=8, lam=0, balance="none", prior="learned", max_iter=30))
    em_m = gem.intrinsic(em.labels, 8)
    # planted shares 0.40 … 0.03: EM keeps a giant cluster; GEM balances the HARD (argmax) shares
    assert em_m["max_share"] > 0.25
    assert res[5000.0]["norm_entropy"] > 0.99 > em_m["norm_entropy"]
    assert res[5000.0]["max_share"] < em_m["max_share"] - 0.1
    assert res[5000.0]["min_share"] > 2 * em_m["min_share"]


def test_gem_default_balances_hard_shares():
    x, _ = cone(seed=3)
    r = gem.fit_vmf(x, gem.VMFSettings(k=8, max_iter=40))  # defaults: λ = 5000, free approx κ, exact Q-step
    m = gem.intrinsic(r.labels, 8)
    assert m["norm_entropy"] > 0.99 and m["max_share"] < 0.2 and m["min_share"] > 0.08
    # hard shares follow the soft ones (rows are near one-hot at κ ~ 10²), no post-hoc rebalancing
    assert np.max(np.abs(gem.shares(r.labels, 8) - r.q.mean(0))) < 0.03


def test_gem_recovers_planted_equal_mixture():
    from sklearn.metrics import normalized_mutual_info_score

    rng = np.random.default_rng(0)
    d, k = 16, 5
    mus = gem.normalize(rng.normal(size=(k, d)))
    lab = np.repeat(np.arange(k), 200)
    x = gem.normalize(mus[lab] * 25 + rng.normal(size=(len(lab), d)))
    r = gem.fit_vmf(x, gem.VMFSettings(k=k, max_iter=10, n_init=3))
    assert normalized_mutual_info_score(lab, r.labels) >= 0.95


def test_gis_prefers_central_documents():
    x, _ = cone(n=600)
    r = gem.fit_vmf(x, gem.VMFSettings(k=4, max_iter=5))
    s = gem.gis_scores(x, r, m=5)
    j = int(np.argmax(np.bincount(r.labels)))
    idx = np.where(r.labels == j)[0]
    cos = x[idx] @ r.mu[j]
    from scipy.stats import spearmanr

    assert spearmanr(s[idx], cos).statistic > 0.5


# ------------------------------------------------------------------------------------ SHIFT
def brute_kcenter(phi, b):
    picked = [0]
    for _ in range(1, b):
        d = np.array([min(np.linalg.norm(phi[i] - phi[p]) for p in picked) for i in range(len(phi))])
        d[picked] = -1
        picked.append(int(np.argmax(d)))
    return picked


def test_farthest_first_equals_bruteforce():
    phi = np.random.default_rng(0).normal(size=(200, 5))
    got, _ = shift.weighted_farthest_first(phi, 12, first=0)
    assert got.tolist() == brute_kcenter(phi, 12)


def test_farthest_first_is_linear_in_n_times_b():
    rng = np.random.default_rng(0)
    phi = rng.normal(size=(100_000, 8)).astype(np.float64)
    c = shift.DistanceCounter()
    t = time.time()
    picked, _ = shift.weighted_farthest_first(phi, 16, weight=rng.random(100_000), counter=c)
    assert c.count == 100_000 * 16  # exactly N·B distance evaluations, never N²
    assert len(set(picked.tolist())) == 16
    assert time.time() - t < 20


def clusters_pool(seed=0):
    rng = np.random.default_rng(seed)
    centres = np.eye(5) * 10
    lab = np.repeat(np.arange(5), 200)
    s = centres[lab] + 0.1 * rng.normal(size=(1000, 5))
    u = np.where(lab < 2, rng.uniform(5, 6, 1000), rng.uniform(0, 3, 1000))
    dirs = gem.normalize(rng.normal(size=(1000, 5)))
    return s, s + dirs * u[:, None], lab, u


def test_shift_covers_clusters_and_topk_does_not():
    s, e, lab, u = clusters_pool()
    out = shift.shift_select(s, e, 10, feature_mode="split", alpha=0.0)
    top = np.argsort(-u)[:10]
    assert len(set(lab[out["picked"]])) >= 4
    assert len(set(lab[top])) <= 2
    phi = out["phi"]
    assert out["coverage_radius"] < shift.coverage_radius(phi, top)
    first = out["picked"][0]
    assert first == int(np.argmax(u))


def test_weighting_picks_high_quality_within_clusters():
    s, e, lab, u = clusters_pool()
    w = shift.quality(u, "rank")
    phi = shift.features(s, None, mode="prompt")
    picked, _ = shift.weighted_farthest_first(phi, 5, weight=w, first=int(np.argmax(u)))
    assert len(set(lab[picked])) == 5
    for p in picked:
        assert u[p] >= np.quantile(u[lab == lab[p]], 0.9) - 1e-12 or lab[p] >= 2
    flat, _ = shift.weighted_farthest_first(phi, 5)
    assert len(set(lab[flat])) == 5


# ------------------------------------------------------------------------------------ CLI
def _write_corpus(tmp_path, n=240):
    rng = np.random.default_rng(0)
    topics = ["cats", "boats", "stars"]
    rows, emb = [], []
    centres = gem.normalize(rng.normal(size=(3, 12)))
    for i in range(n):
        t = i % 3
        rows.append({"id": f"d{i}", "text": f"{topics[t]} kw{t} text number {i} " + " ".join(rng.choice(["a", "the", "big"], 5)),
                     "source": topics[t]})
        emb.append(centres[t] * 12 + rng.normal(size=12))
    corpus = tmp_path / "corpus.jsonl"
    corpus.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    from safetensors.numpy import save_file

    from llmtool.select_data.corpora import ids_hash

    emb_path = tmp_path / "emb.safetensors"
    save_file({"embeddings": np.asarray(emb, dtype=np.float32)}, str(emb_path),
              metadata={"model": "synthetic", "normalized": "false", "ids_sha256": ids_hash(r["id"] for r in rows)})
    return corpus, emb_path, rows


def test_cli_cluster_and_bad_input(tmp_path):
    corpus, emb, rows = _write_corpus(tmp_path)
    code, out, err = run_cli("select-data", "cluster", corpus, tmp_path / "g", "--embeddings", emb, "--k", "3",
                             "--max-iter", "5", "--json")
    assert code == 0, err
    summary = json.loads((tmp_path / "g" / "summary.json").read_text())
    assert summary["k"] == 3 and summary["norm_entropy"] > 0.99
    tax = json.loads((tmp_path / "g" / "taxonomy.json").read_text())
    names = " ".join(t["name"] for t in tax)
    assert all(t in names for t in ("cats", "boats", "stars"))
    assert len((tmp_path / "g" / "assignments.jsonl").read_text().splitlines()) == len(rows)
    # baselines share the outputs
    code, _, err = run_cli("select-data", "cluster", corpus, tmp_path / "s", "--embeddings", emb, "--method", "source")
    assert code == 0, err
    # K larger than the corpus
    code, _, err = run_cli("select-data", "cluster", corpus, tmp_path / "k", "--embeddings", emb, "--k", "1000")
    assert code == 2 and "larger than the corpus" in err and not (tmp_path / "k").exists()
    # embeddings that do not match the corpus
    short = tmp_path / "short.jsonl"
    short.write_text("\n".join(corpus.read_text().splitlines()[:-1]) + "\n")
    code, _, err = run_cli("select-data", "cluster", short, tmp_path / "m", "--embeddings", emb)
    assert code == 2 and "do not match" in err
    # option of another method refused
    code, _, err = run_cli("select-data", "cluster", corpus, tmp_path / "x", "--embeddings", emb, "--method", "source",
                           "--lam", "3")
    assert code == 2


def test_cli_features_and_select(tmp_path, tiny_llama_dir):
    pool = tmp_path / "pool.jsonl"
    rows = [{"id": f"p{i}", "prompt": f"What is {i} plus {i + 1}?", "answer": str(2 * i + 1)} for i in range(12)]
    pool.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    code, _, err = run_cli("select-data", "features", pool, tmp_path / "f", "--model", tiny_llama_dir,
                           "--max-new-tokens", "6", "--batch-size", "4")
    assert code == 0, err
    picks = {}
    for method in ("shift", "kcenter", "rirs-topk", "random", "answer-ppl"):
        out = tmp_path / f"{method}.jsonl"
        code, _, err = run_cli("select-data", "select", pool, "--features", tmp_path / "f", "-o", out,
                               "--method", method, "--budget", "4")
        assert code == 0, err
        picks[method] = [json.loads(line)["id"] for line in out.read_text().splitlines()]
        assert len(picks[method]) == 4
    # label-free: answers deleted → same SHIFT picks
    pool2 = tmp_path / "pool2.jsonl"
    pool2.write_text("\n".join(json.dumps({"id": r["id"], "prompt": r["prompt"]}) for r in rows) + "\n")
    code, _, err = run_cli("select-data", "select", pool2, "--features", tmp_path / "f", "-o", tmp_path / "s2.jsonl",
                           "--budget", "4")
    assert code == 0, err
    assert [json.loads(x)["id"] for x in (tmp_path / "s2.jsonl").read_text().splitlines()] == picks["shift"]
    # budget larger than the pool
    code, _, err = run_cli("select-data", "select", pool, "--features", tmp_path / "f", "-o", tmp_path / "b.jsonl",
                           "--budget", "50")
    assert code == 2 and "larger than the pool" in err and not (tmp_path / "b.jsonl").exists()
    # a pool line without prompt
    bad = tmp_path / "bad.jsonl"
    bad.write_text(json.dumps({"id": "x", "question": "?"}) + "\n")
    code, _, err = run_cli("select-data", "features", bad, tmp_path / "f2", "--model", tiny_llama_dir)
    assert code == 2 and "bad.jsonl:1" in err and "prompt" in err and not (tmp_path / "f2").exists()


# ------------------------------------------------------------------------------------ mixers
def test_doremi_update_constant_excess():
    from llmtool.select_data.mixing import doremi_weights

    out = doremi_weights(lambda t, a: np.array([0.0, 0.5, 0.0]), 3, 20)
    assert out["last"][1] >= 0.99
    assert 0.88 <= out["weights"][1] <= 0.93
    assert np.allclose(out["trace"].sum(1), 1) and out["trace"].min() >= 1e-3 / 3 - 1e-15


def test_regmix_beats_natural_and_uniform():
    from llmtool.select_data.mixing import dirichlet_mixtures, regmix_weights

    rng = np.random.default_rng(0)
    k = 5
    natural = np.array([0.5, 0.2, 0.15, 0.1, 0.05])
    target = np.array([0.1, 0.1, 0.2, 0.3, 0.3])
    a = np.array([1.0, 2.0, 1.5, 1.0, 3.0])

    def true_loss(w):
        return ((np.atleast_2d(w) - target) ** 2 * a).sum(1)

    w = dirichlet_mixtures(natural, 256, rng)
    loss = true_loss(w) + rng.normal(scale=1e-3, size=len(w))
    got = regmix_weights(w, loss, natural, candidates=20_000)["weights"]
    assert true_loss(got)[0] < true_loss(natural)[0] and true_loss(got)[0] < true_loss(np.full(k, 1 / k))[0]


def test_cli_distill_and_label(tmp_path):
    corpus, emb, rows = _write_corpus(tmp_path, n=300)
    code, _, err = run_cli("select-data", "cluster", corpus, tmp_path / "g", "--embeddings", emb, "--k", "3",
                           "--max-iter", "5")
    assert code == 0, err
    code, out, err = run_cli("select-data", "distill", tmp_path / "g", corpus, "-o", tmp_path / "student.bin", "--json")
    assert code == 0, err
    assert json.loads(out)["agreement"] >= 0.9
    code, _, err = run_cli("select-data", "label", corpus, "--student", tmp_path / "student.bin",
                           "-o", tmp_path / "labeled.jsonl")
    assert code == 0, err
    teacher = [json.loads(x)["domain"] for x in (tmp_path / "g" / "assignments.jsonl").read_text().splitlines()]
    got = [json.loads(x)["domain"] for x in (tmp_path / "labeled.jsonl").read_text().splitlines()]
    assert np.mean(np.array(teacher) == np.array(got)) >= 0.9


# ------------------------------------------------------------------------------------ self-consistency entropy
def test_final_answer_and_entropy():
    from llmtool.select_data.features import answer_entropy, final_answer

    assert final_answer("so x = 3, thus \\boxed{ 42 } and later 7") == "42"
    assert final_answer("first 1,200 then 3.5 apples") == "3.5"
    assert final_answer("no digits here\n  the end  \n") == "the end"
    assert final_answer("") == ""
    assert answer_entropy(["4"] * 8) == 0.0
    assert abs(answer_entropy(["1", "2", "3", "4"] * 2) - np.log(4)) < 1e-12
    assert abs(answer_entropy(["1"] * 6 + ["2"] * 2) - -(0.75 * np.log(0.75) + 0.25 * np.log(0.25))) < 1e-12


def test_sc_entropy_selector_picks_the_most_uncertain(tmp_path, tiny_llama_dir):
    from llmtool.select_data.methods import SELECTORS, run_selector

    feats = {"s": np.zeros((5, 3)), "e": np.ones((5, 3)), "sc_entropy": np.array([0.1, 1.2, 0.0, 0.7, 1.0])}
    assert list(run_selector(SELECTORS.build("sc-entropy", budget=3), feats)["picked"]) == [1, 4, 3]
    pool = tmp_path / "pool.jsonl"
    pool.write_text("".join(json.dumps({"id": f"p{i}", "prompt": f"What is {i} plus 2?"}) + "\n" for i in range(4)))
    code, _, err = run_cli("select-data", "features", pool, tmp_path / "f", "--model", tiny_llama_dir,
                           "--max-new-tokens", "4", "--batch-size", "4", "--sc-samples", "3")
    assert code == 0, err
    from safetensors.numpy import load_file

    sc = load_file(str(tmp_path / "f" / "features.safetensors"))["sc_entropy"]
    assert sc.shape == (4,) and (sc >= 0).all() and (sc <= np.log(3) + 1e-6).all()
    code, _, err = run_cli("select-data", "features", pool, tmp_path / "g", "--model", tiny_llama_dir,
                           "--max-new-tokens", "4")
    assert code == 0, err
    code, _, err = run_cli("select-data", "select", pool, "--features", tmp_path / "g", "-o", tmp_path / "s.jsonl",
                           "--method", "sc-entropy", "--budget", "2")
    assert code == 2 and "--sc-samples" in err and not (tmp_path / "s.jsonl").exists()

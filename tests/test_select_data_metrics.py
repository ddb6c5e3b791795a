"""select-data GEM benchmark metrics: student agreement, the unnormalised LM embedder, the collapse gate."""
from __future__ import annotations

import numpy as np

from conftest import load_benchmark
from llmtool.select_data.distill import student_agreement


def _bench():
    return load_benchmark("select_data")


def _keyword_corpus(n_per: int = 60, k: int = 4, seed: int = 0):
    rng = np.random.default_rng(seed)
    filler = [f"w{i}" for i in range(200)]
    texts, labels = [], []
    for j in range(k):
        vocab = [f"topic{j}word{i}" for i in range(15)]
        for _ in range(n_per):
            words = list(rng.choice(vocab, 6)) + list(rng.choice(filler, 6))
            rng.shuffle(words)
            texts.append(" ".join(words))
            labels.append(j)
    return texts, np.array(labels)


def test_student_agrees_with_a_text_determined_partition():
    texts, y = _keyword_corpus()
    st = student_agreement(texts, y, folds=5, seed=0)
    assert st["agreement"] >= 0.95 and st["kappa"] >= 0.9 and st["macro_f1"] >= 0.95
    assert abs(st["majority"] - 0.25) < 1e-9


def test_student_cannot_learn_random_labels():
    texts, _ = _keyword_corpus()
    y = np.random.default_rng(1).integers(0, 4, len(texts))
    st = student_agreement(texts, y, folds=5, seed=0)
    assert st["agreement"] < 0.4 and abs(st["kappa"]) < 0.15


def test_student_kappa_discounts_a_collapsed_partition():
    """A giant cluster plus random small ones: accuracy near the majority share, κ near 0."""
    texts, _ = _keyword_corpus()
    rng = np.random.default_rng(2)
    y = np.where(rng.random(len(texts)) < 0.85, 0, rng.integers(1, 4, len(texts)))
    st = student_agreement(texts, y, folds=5, seed=0)
    assert st["agreement"] >= 0.75 and st["kappa"] < 0.2


def test_embed_lm_keeps_input_order_and_matches_single_passes(tiny_llama_dir):
    import torch

    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.select_data.corpora import embed_lm

    model, tok = load_model(str(tiny_llama_dir)), load_tokenizer(str(tiny_llama_dir))
    texts = ["a much longer text " * 6, "short", "a middle sized text here", "x y", "another long one " * 4]
    emb = embed_lm(model, tok, texts, batch_size=2)
    ref = []
    with torch.no_grad():
        for t in texts:
            enc = tok([t], return_tensors="pt", truncation=True, max_length=128)
            ref.append(model(**enc, output_hidden_states=True).hidden_states[-1].float().mean(1)[0].numpy())
    assert emb.shape == (len(texts), model.config.hidden_size)
    np.testing.assert_allclose(emb, np.stack(ref), rtol=1e-4, atol=1e-4)
    assert not np.allclose(np.linalg.norm(emb, axis=1), 1.0)  # unnormalised


def _summary(km_top2: float, gem_top2: float, gem_kappa: float = 0.5, km_kappa: float = 0.0):
    base = {"norm_entropy": 0.99, "max_share": 0.05, "min_share": 0.02, "mean_cos": 0.5, "silhouette_cos": 0.1}
    return [{**base, "method": "gem", "top2_share": gem_top2, "student_agreement": 0.6, "student_kappa": gem_kappa},
            {**base, "method": "movmf-em", "norm_entropy": 0.97, "top2_share": 0.1, "student_kappa": 0.4},
            # a collapsed K-Means: high raw agreement (its giant cluster), κ as given
            {**base, "method": "kmeans", "norm_entropy": 0.8, "top2_share": km_top2, "student_agreement": 0.9,
             "student_kappa": km_kappa}]


def test_collapse_gate_is_not_tested_without_a_kmeans_collapse():
    gem_gates = _bench().gem_gates

    g = gem_gates(_summary(km_top2=0.15, gem_top2=0.09), k=24)["collapse_top2_le_half_kmeans"]
    assert g["verdict"] == "not tested" and g["met"] is None and "did not collapse" in g["reason"]


def test_collapse_gate_can_pass_and_fail():
    gem_gates = _bench().gem_gates

    assert gem_gates(_summary(km_top2=0.5, gem_top2=0.09), k=24)["collapse_top2_le_half_kmeans"]["verdict"] == "met"
    assert gem_gates(_summary(km_top2=0.3, gem_top2=0.2), k=24)["collapse_top2_le_half_kmeans"]["verdict"] == "not met"
    gates = gem_gates(_summary(km_top2=0.5, gem_top2=0.09), k=24)
    assert gates["student_kappa_ge_kmeans"]["verdict"] == "met"  # on κ, not on the collapse-inflated accuracy
    gates = gem_gates(_summary(km_top2=0.3, gem_top2=0.2, gem_kappa=0.3, km_kappa=0.4), k=24)
    assert gates["student_kappa_ge_kmeans"]["verdict"] == "not met"


def test_gates_are_computed_per_embedder():
    all_gem_gates = _bench().all_gem_gates

    rows = [{**r, "embedder": "minilm"} for r in _summary(0.15, 0.09)] + \
           [{**r, "embedder": "lm"} for r in _summary(0.6, 0.09)]
    g = all_gem_gates(rows, k=24)
    assert g["minilm:collapse_top2_le_half_kmeans"]["verdict"] == "not tested"
    assert g["lm:collapse_top2_le_half_kmeans"]["verdict"] == "met"


def test_mix_seed_summary_carries_run_to_run_variation():
    """Two seeds, 5 categories: an arm 0.1 below natural in both seeds has the interval [-0.1, -0.1]; one that is
    0.1 below in one seed and 0.1 above in the other straddles zero although each seed's category interval
    excludes it; a stored single-seed result reads as seed 0; protocols differing in the token budget do not mix."""
    sd = load_benchmark("select_data")
    cats = [f"c{i}" for i in range(5)]

    def run(seed, shift_b):
        nat = {c: 4.0 + 0.1 * i for i, c in enumerate(cats)}
        return {"seed": seed, "rows": [{"arm": "natural"}, {"arm": "a"}, {"arm": "b"}],
                "per_category": {"natural": nat, "a": {c: v - 0.1 for c, v in nat.items()},
                                 "b": {c: v + shift_b for c, v in nat.items()}}}

    rows = {r["arm"]: r for r in sd.mix_seed_summary([run(0, -0.1), run(1, 0.1)])}
    assert rows["a"]["minus_natural_ci"] == [-0.1, -0.1] and rows["a"]["seeds_below_natural"] == 2
    assert rows["b"]["per_seed_minus_natural"] == [-0.1, 0.1] and rows["b"]["seeds_below_natural"] == 1
    lo, hi = rows["b"]["minus_natural_ci"]
    assert lo < 0 < hi and rows["b"]["mean_loss_sd"] > 0.1
    old = {"rows": [{"arm": "natural"}], "per_category": {"natural": {"c0": 4.0}}}
    assert sd.mix_runs(old)[0]["seed"] == 0 and sd.mix_runs({"runs": [run(3, 0)]})[0]["seed"] == 3
    args = {k: 1 for k in sd._MIX_PROTOCOL}
    assert sd._same_mix_protocol(args, dict(args)) and not sd._same_mix_protocol(args, {**args, "mix_tokens": 2})

"""benchmarks/keystone_ablation.py: its interval, overlap and gate helpers (the model runs are benchmarks)."""
import math

import numpy as np
import torch

from conftest import load_benchmark

ks = load_benchmark("keystone_ablation")


def test_summary_is_the_token_weighted_ppl_and_a_bootstrap_interval_around_the_mean_increase():
    tokens = 10
    base = torch.tensor([20.0, 30.0, 40.0, 50.0], dtype=torch.float64)
    nll = base + torch.tensor([5.0, 10.0, 15.0, 20.0], dtype=torch.float64)
    idx = np.random.default_rng(0).integers(0, 4, size=(500, 4))
    s = ks.summarize(nll, base, tokens, idx)
    assert math.isclose(s["ppl"], math.exp(float(nll.sum()) / 40))
    assert math.isclose(s["dlogppl"], 1.25)  # mean of 0.5, 1.0, 1.5, 2.0
    assert 0.5 <= s["dlogppl_lo"] < 1.25 < s["dlogppl_hi"] <= 2.0
    assert ks.summarize(base, base, tokens, idx)["dlogppl"] == 0.0


def test_jaccard_counts_shared_neurons():
    from llmtool.edit.keystone import Neuron

    a = [Neuron("ffn", 1, 3), Neuron("o", 2, 5)]
    b = [Neuron("ffn", 1, 3), Neuron("q", 0, 1)]
    assert ks.jaccard(a, a) == 1.0 and math.isclose(ks.jaccard(a, b), 1 / 3)


def test_collapse_gate_fails_on_a_weak_ablation_and_on_a_strong_random_set():
    assert ks.collapse_gate("m", 30, 5.0, 150.0, [5.1, 5.2])["verdict"] == "met"
    assert ks.collapse_gate("m", 30, 5.2, 5.6, [5.2, 5.24])["verdict"] == "not met"   # Gemma 3's case
    assert ks.collapse_gate("m", 30, 5.0, 150.0, [5.0, 6.0])["verdict"] == "not met"  # random sets hurt too
    assert ks.collapse_gate("m", 30, 5.0, 150.0, [])["verdict"] == "not tested"

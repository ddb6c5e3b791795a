"""Real-model checks of `llmtool edit` on SmolLM2-135M (slow; run with `make test-slow`).

The spec's reproducible small-scale claims: under the forward anchor the remaining-residual ratio
falls much faster over the edited layers than under MEMIT's backward spreading and the edits land
at least as often; keystone neurons found by cross-task statistics collapse the model when removed
while an equal-size random set does not; the packaged edit set holds facts the model knows.
"""
from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def real(smollm2_dir):
    from llmtool.core.models import load_model, load_tokenizer

    torch.set_num_threads(2)
    model = load_model(smollm2_dir)
    for p in model.parameters():
        p.requires_grad_(False)
    return model, load_tokenizer(smollm2_dir)


@pytest.fixture(scope="module")
def edit_set():
    from llmtool.edit.requests import read_requests, resolve_requests

    return read_requests(resolve_requests("counterfact-smollm2"))


def test_packaged_edit_set_holds_known_facts(real, edit_set):
    from llmtool.edit.metrics import pair_scores

    model, tok = real
    assert len(edit_set) >= 100
    new = pair_scores(model, tok, [(r.filled(), r.target_new) for r in edit_set])
    true = pair_scores(model, tok, [(r.filled(), r.target_true) for r in edit_set])
    assert all(t[0] < n[0] for n, t in zip(new, true))  # unedited efficacy success is 0 %


def test_real_forward_anchor_beats_backward_spreading(real, edit_set, tmp_path):
    from llmtool.edit.covariance import second_moments
    from llmtool.edit.metrics import pair_scores
    from llmtool.edit.layerio import down_proj
    from llmtool.edit.memit import METHODS, EditConfig, compute_targets, edit_batch
    from llmtool.edit.prompts import generate_templates

    model, tok = real
    layers = [3, 4, 5, 6, 7]
    reqs = edit_set[:3]
    C = second_moments(model, tok, layers, "test", samples=4096, root=tmp_path)
    templates = generate_templates(model, tok, seed=0)
    originals = {l: down_proj(model, l).weight.detach().clone() for l in layers}
    ratios, success = {}, {}
    try:
        for anchor in ("backward", "forward"):
            cfg = EditConfig(layers=layers, anchor=anchor, mom2_update_weight=1500.0)
            solvers = {l: METHODS.get("memit")(C[l], cfg) for l in layers}
            prev = {l: torch.zeros(C[l].shape, dtype=torch.float64) for l in layers}
            torch.manual_seed(0)
            targets, _ = compute_targets(model, tok, reqs, cfg, templates)
            rep = edit_batch(model, tok, reqs, cfg, templates, solvers, prev, targets=targets)
            ratios[anchor] = [r["remaining_residual_ratio"] for r in rep["layers"]]
            new = pair_scores(model, tok, [(r.filled(), r.target_new) for r in reqs])
            true = pair_scores(model, tok, [(r.filled(), r.target_true) for r in reqs])
            success[anchor] = sum(n[0] < t[0] for n, t in zip(new, true))
            with torch.no_grad():
                for l in layers:
                    down_proj(model, l).weight.copy_(originals[l])
    finally:
        with torch.no_grad():
            for l in layers:
                down_proj(model, l).weight.copy_(originals[l])
    fw, bw = ratios["forward"], ratios["backward"]
    assert all(b <= a + 1e-6 for a, b in zip(fw, fw[1:])), fw
    assert fw[-1] < 0.5 * bw[-1], (fw, bw)
    assert all(f < b for f, b in zip(fw, bw)), (fw, bw)  # FE is ahead after every layer
    assert success["forward"] >= success["backward"] and success["forward"] == len(reqs), success


def test_real_keystone_ablation_collapses_vs_random(real):
    from llmtool.core.data import tokenize
    from llmtool.edit.keystone import (ablated, default_eval_texts, default_probes, matched_random, mean_ppl,
                                       probe_activations, rank_neurons)

    model, tok = real
    probe_ids = [tokenize(tok, r["text"]) for r in default_probes()]
    eval_ids = [tokenize(tok, r["text"]) for r in default_eval_texts()]
    acts = probe_activations(model, probe_ids, ["q", "k", "v", "o", "gate", "up", "ffn"])
    ranked = rank_neurons(acts, "worst-rank", "global", top=50)
    base = mean_ppl(model, eval_ids)
    with ablated(model, ranked[:10]):
        key = mean_ppl(model, eval_ids)
    rand = []
    for s in range(3):
        with ablated(model, matched_random(model, ranked[:10], s)):
            rand.append(mean_ppl(model, eval_ids))
    assert mean_ppl(model, eval_ids) == pytest.approx(base)  # ablation is undone on exit
    assert key > 3 * base, (key, base)
    assert max(rand) < 1.05 * base, (rand, base)

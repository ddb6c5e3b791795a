"""KV eviction (SnapKV / PyramidKV / AdaKV / StreamingLLM + CriticalKV) and the shared cache mechanism."""
from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch

from conftest import build_tiny_llama
from llmtool.kvcache import adakv, critical, eviction, snapkv
from llmtool.kvcache.cache import EvictableLayer, KVCache, kv_mask_transform
from llmtool.kvcache.pipeline import KVSpec, build_press, generate

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny():
    return build_tiny_llama(320, seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def prompt():
    g = torch.Generator().manual_seed(3)
    return torch.randint(1, 320, (1, 200), generator=g), torch.randint(1, 320, (1, 6), generator=g)


@pytest.fixture(scope="module")
def baseline(tiny, prompt):
    return _logits(tiny, *prompt, KVSpec())


def _logits(model, ctx, q, spec, steps=20, **kw):
    toks, stats, logits = generate(model, ctx, q, spec, max_new_tokens=steps, return_logits=True, **kw)
    return toks, stats, torch.stack([x[0] for x in logits])


# --- 1. no-op -------------------------------------------------------------------------------------
@pytest.mark.parametrize("evict,crit", [("pyramidkv", False), ("snapkv", True), ("adakv", True),
                                        ("streamingllm", False)])
def test_full_budget_is_exact_noop(tiny, prompt, baseline, evict, crit):
    ctx, q = prompt
    base_toks, _, base = baseline
    toks, stats, got = _logits(tiny, ctx, q, KVSpec(evict=evict, critical=crit, budget=1.0))
    assert len(toks) == 20
    assert toks == base_toks
    assert torch.equal(got, base)
    assert stats.kv_bytes == stats.full_kv_bytes


def test_full_cache_matches_plain_forward(tiny, prompt):
    ctx, q = prompt
    toks, _, logits = _logits(tiny, ctx, q, KVSpec(), steps=5)
    seq = torch.cat([ctx, q, torch.tensor([toks[:-1]])], dim=-1)
    with torch.no_grad():
        ref = tiny(input_ids=seq).logits[0, -5:]
    assert torch.allclose(logits, ref, atol=1e-5)


def test_compression_changes_cache_and_saves_memory(tiny, prompt):
    ctx, q = prompt
    _, _, base = _logits(tiny, ctx, q, KVSpec(), steps=3)
    _, stats, got = _logits(tiny, ctx, q, KVSpec(evict="snapkv", budget=0.25), steps=3)
    assert not torch.allclose(got, base)
    cache = stats.extra["cache"]
    for layer in cache.layers:
        # 50 context entries kept per head + 6 question + 2 decoded tokens
        assert layer.keys.shape[-2] == 50 + 6 + 2
        assert layer.get_seq_length() == 200 + 6 + 2
    assert stats.kv_bytes < 0.3 * stats.full_kv_bytes


# --- 2./3. the perturbation bound ---------------------------------------------------------------------
def _heads(g, h, n=256, d=16, dim=32):
    """``h`` random heads: Dirichlet(1) attention, log-normal value scales, random W_O (fp64)."""
    conc = torch.ones(n, dtype=torch.float64)
    gamma = torch._standard_gamma(conc.expand(h, n).contiguous())  # Dirichlet via normalised gammas
    attn = gamma / gamma.sum(-1, keepdim=True)
    v = torch.randn(h, n, d, dtype=torch.float64, generator=g)
    v = v * torch.exp(torch.randn(h, n, 1, dtype=torch.float64, generator=g))
    w_o = torch.randn(h, d, dim, dtype=torch.float64, generator=g) / math.sqrt(d)
    return attn, v @ w_o


def test_bound_holds_for_random_masks():
    g = torch.Generator().manual_seed(0)
    torch.manual_seed(0)
    attn, u = _heads(g, 1)
    attn, u = attn.expand(1000, -1), u.expand(1000, -1, -1)
    keep = torch.rand(1000, 256, generator=g, dtype=torch.float64) < torch.rand(1000, 1, generator=g, dtype=torch.float64)
    keep[:, 0] |= ~keep.any(-1)  # sigma > 0
    o = (attn[:, None] @ u)[:, 0]
    o_hat = (critical.output_after_eviction(attn[:, None], u, keep[:, None]))[:, 0]
    theta = critical.perturbation_bound(attn, u.abs().sum(-1), keep)
    assert ((o - o_hat).abs().sum(-1) <= theta + 1e-9).all()
    sigma = (attn * keep).sum(-1)
    assert torch.equal(2 - 1 / sigma >= 0, sigma >= 0.5)
    assert (sigma < 0.5).any() and (sigma > 0.5).any()


def test_critical_greedy_on_random_heads():
    """Spec acceptance 3. What is a theorem is asserted: CriticalKV's kept ``sum A ||u||`` is never
    below attention-only top-b's, it keeps exactly b entries, and its stage-1 set reaches
    sigma > 1/2 whenever the attention top-b/2 mass does. Whether theta and the measured
    perturbation are lower is *not* a theorem: on independent random heads they are not (measured
    here and reported in docs/kvcache.md), so the test pins the measured fractions' range only to
    catch regressions of the selection itself."""
    g = torch.Generator().manual_seed(1)
    torch.manual_seed(1)
    b = 64
    attn, u = _heads(g, 1000)
    norms = u.abs().sum(-1)
    keep_a = eviction.topk_mask(attn, b)
    keep_c = critical.critical_select(attn[None], norms[None], torch.full((1, 1000), b))[0]
    assert torch.equal(keep_c.sum(-1), torch.full((1000,), b))
    gain_c, gain_a = (keep_c * attn * norms).sum(-1), (keep_a * attn * norms).sum(-1)
    assert (gain_c >= gain_a - 1e-12).all() and (gain_c > gain_a).float().mean() > 0.9
    stage1 = eviction.topk_mask(attn, b // 2)
    reach = (attn * stage1).sum(-1) > 0.5
    assert ((attn * keep_c).sum(-1)[reach] > 0.5).all()
    assert not torch.equal(keep_c, keep_a)


# --- 4./5. selection structure ------------------------------------------------------------------------
def test_equal_norms_select_the_base_set():
    g = torch.Generator().manual_seed(2)
    s = torch.rand(2, 3, 100, generator=g)
    budgets = torch.tensor([[30, 20, 40], [10, 50, 25]])
    keep_c = critical.critical_select(s, torch.full_like(s, 3.0), budgets)
    assert torch.equal(keep_c, eviction.topk_mask(s, budgets))


def test_stage_structure_and_exact_budgets():
    g = torch.Generator().manual_seed(4)
    s = torch.rand(1, 4, 120, generator=g)
    s[..., -8:] = float("inf")  # window
    norms = torch.rand(1, 4, 120, generator=g) * 10
    budgets = torch.tensor([[40, 25, 60, 9]])
    keep = critical.critical_select(s, norms, budgets, first_stage_ratio=0.5)
    assert torch.equal(keep.sum(-1), budgets)
    assert keep[..., -8:].all()
    stage1 = eviction.topk_mask(s, torch.floor(0.5 * budgets.float()).long())
    assert (keep | ~stage1).all()


def test_adakv_budgets_sum_and_window():
    g = torch.Generator().manual_seed(5)
    s = torch.rand(2, 3, 90, generator=g) ** 4
    b = 20
    budgets = adakv.adakv_budgets(s, b, 0.2, window=8)
    assert torch.equal(budgets.sum(-1), torch.tensor([b * 3, b * 3]))
    assert (budgets >= 8).all()
    assert not (budgets == b).all()  # heads really get different budgets


def test_planted_large_value_entry_is_kept_only_by_critical():
    torch.manual_seed(0)
    h_q, h_kv, n, d, dim = 4, 2, 64, 8, 16
    values = torch.randn(1, h_kv, n, d) * 0.1
    values[0, :, 10] = 50.0  # planted large-value token
    scores = torch.rand(1, h_kv, n) + 1.0
    scores[..., 10] = 0.9  # moderate attention: outside the top-b by attention
    scores[..., -4:] = float("inf")
    module = SimpleNamespace(config=SimpleNamespace(num_attention_heads=h_q, model_type="llama"),
                             o_proj=SimpleNamespace(weight=torch.randn(dim, h_q * d)))
    budgets = torch.full((1, h_kv), 16)
    base = eviction.topk_mask(scores, budgets)
    press = critical.CriticalKVPress(base=snapkv.SnapKVPress(budget=0.25, window_size=4))
    crit = press.select(module, scores, None, values, budgets)
    assert not base[..., 10].any()
    assert crit[..., 10].all()


# --- 6. norms ------------------------------------------------------------------------------------
def test_projected_value_norms_loop_equals_einsum():
    g = torch.Generator().manual_seed(6)
    v = torch.randn(2, 3, 50, 16, generator=g)
    w = torch.randn(40, 9 * 16, generator=g)
    a = critical.projected_value_norms(v, w, 9)
    b = critical.projected_value_norms_dense(v, w, 9)
    assert a.shape == (2, 3, 50)
    assert torch.allclose(a, b, rtol=1e-5, atol=1e-4)
    # explicit head 4 (KV head 1) check of the W_O slicing: columns 4d:5d of o_proj.weight
    u = v[0, 1] @ w[:, 64:80].T
    per_head = torch.stack([(v[0, 1] @ w[:, q * 16:(q + 1) * 16].T).abs().sum(-1) for q in (3, 4, 5)]).mean(0)
    assert torch.allclose(a[0, 1], per_head, rtol=1e-5)
    assert u.shape == (50, 40)


# --- 7. masking == gathering ---------------------------------------------------------------------------
@pytest.mark.parametrize("evict,crit", [("snapkv", True), ("pyramidkv", False)])
def test_masking_equals_gathering(tiny, prompt, evict, crit, monkeypatch):
    ctx, q = prompt
    spec = KVSpec(evict=evict, critical=crit, budget=0.3)
    toks_g, stats_g, gathered = _logits(tiny, ctx, q, spec)
    real_build = build_press

    def masked(s):
        press = real_build(s)
        press.realise = "mask"
        if hasattr(press, "base"):
            press.base.realise = "mask"
        return press

    monkeypatch.setattr("llmtool.kvcache.pipeline.build_press", masked)
    toks_m, stats_m, maskedl = _logits(tiny, ctx, q, spec)
    assert toks_g == toks_m
    assert torch.allclose(gathered, maskedl, atol=1e-6)
    assert stats_m.kv_bytes > stats_g.kv_bytes


def test_adakv_head_varying_budgets_run_and_mask(tiny, prompt):
    ctx, q = prompt
    _, stats, logits = _logits(tiny, ctx, q, KVSpec(evict="adakv", budget=0.3, critical=True), steps=4)
    cache = stats.extra["cache"]
    assert torch.isfinite(logits).all()
    kept = sum(layer.kept_entries() for layer in cache.layers)
    b = int(0.3 * 200)
    assert kept == 2 * 1 * 2 * (b + 6 + 3)  # layers x batch x heads x (budget + question + decoded)


# --- 8. renormalisation --------------------------------------------------------------------------------
def test_masked_attention_renormalises_softmax():
    torch.manual_seed(0)
    n, d = 40, 8
    layer = EvictableLayer()
    k, v = torch.randn(1, 1, n, d), torch.randn(1, 1, n, d)
    layer.update(k, v)
    keep = torch.rand(1, 1, n) < 0.5
    keep[..., -1] = True
    eviction.mask_from_keep(layer, keep)
    kq, vq = torch.randn(1, 1, 1, d), torch.randn(1, 1, 1, d)
    keys, values = layer.update(kq, vq)
    cache = KVCache([layer])
    module = SimpleNamespace(_llmtool_cache=cache, layer_idx=0)
    query = torch.randn(1, 1, 1, d)
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    q2, k2, v2, mask = kv_mask_transform(module, query, keys, values, None)
    out, _ = sdpa_attention_forward(module, q2, k2, v2, mask, scaling=d ** -0.5)
    attn = torch.softmax((query[0, 0] @ keys[0, 0].T) * d ** -0.5, -1)[0]
    full_keep = torch.cat([keep[0, 0], torch.tensor([True])])
    expected = critical.output_after_eviction(attn, values[0, 0], full_keep)
    assert torch.allclose(out[0, 0, 0], expected, atol=1e-6)


# --- memory accounting ---------------------------------------------------------------------------------
def test_memory_counted_equals_tensors_held(tiny, prompt):
    ctx, q = prompt
    _, stats, _ = _logits(tiny, ctx, q, KVSpec(evict="adakv", budget=0.4), steps=3)
    cache = stats.extra["cache"]
    expected = 0
    for layer in cache.layers:
        expected += layer.keys.numel() * 4 + layer.values.numel() * 4
        expected += 0 if layer.bias is None else layer.bias.numel() * 4
    assert stats.kv_bytes == expected == cache.held_bytes()


def test_bad_press_arguments_raise_usage_errors():
    from llmtool.core.console import UsageError
    from llmtool.kvcache.pipeline import validate

    for kwargs in ({"evict": "snapkv", "budget": 0.0}, {"evict": "snapkv", "budget": 1.5},
                   {"evict": "snapkv", "budget": float("nan")}, {"evict": "nosuch"},
                   {"evict": "none", "critical": True}, {"quant": "kivi", "bits": 3},
                   {"quant": "kivi", "residual_length": 50}):
        with pytest.raises(UsageError):
            validate(KVSpec(**kwargs))

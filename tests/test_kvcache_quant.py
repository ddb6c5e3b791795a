"""KIVI and PatternKV cache layers, and the kv_quant kernel's torch reference."""
from __future__ import annotations

import math

import pytest
import torch

from conftest import build_tiny_llama
from llmtool.kernels.kv_quant import dequantize_groups, group_stats, pack_reference, quantize_groups, unpack_reference
from llmtool.kvcache import patternkv as pk
from llmtool.kvcache.cache import KVCache
from llmtool.kvcache.kivi import KIVILayer
from llmtool.kvcache.pipeline import KVSpec, decode_nll, generate

torch.set_num_threads(2)


@pytest.fixture(scope="module")
def tiny():
    # head dim 16, 2 KV heads, GQA group 2 (spec acceptance setting)
    return build_tiny_llama(320, seed=0, max_position_embeddings=1024)


@pytest.fixture(scope="module")
def ids():
    return torch.randint(1, 320, (1, 150), generator=torch.Generator().manual_seed(7))


def _decode_logits(model, cache, ids, prefix, total=80):
    """Prefill ``prefix`` tokens, then decode token by token up to ``total`` (3 flushes at G=8, R=16)."""
    from llmtool.kvcache.cache import attach

    ids = ids[:, :total]
    out = []
    with torch.no_grad(), attach(model):
        logits = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True).logits[:, -1]
        out.append(logits)
        for pos in range(prefix, ids.shape[-1]):
            out.append(model(input_ids=ids[:, pos:pos + 1], cache=cache, use_cache=True).logits[:, -1])
    return torch.cat(out)


def _layers(model, cls, **kw):
    return KVCache([cls(**kw) for _ in range(model.config.num_hidden_layers)])


def test_quantizer_error_bound_and_pack_roundtrip():
    g = torch.Generator().manual_seed(0)
    x = torch.randn(300, 32, generator=g) * torch.rand(300, 1, generator=g) * 5
    x[0] = 1.25  # constant group (zero range)
    for bits in (2, 4, 8):
        packed, scale, mn = quantize_groups(x, bits)
        assert packed.dtype == torch.uint8 and packed.shape == (300, 32 * bits // 8)
        xh = dequantize_groups(packed, scale, mn, bits)
        assert ((x - xh).abs() <= scale.float()[:, None] / 2 + 1e-6).all()
        assert torch.isfinite(xh).all()
        codes = torch.randint(0, 2 ** bits, (300, 32), generator=g).float()
        one, zero = torch.ones(300, dtype=torch.float16), torch.zeros(300, dtype=torch.float16)
        assert torch.equal(unpack_reference(pack_reference(codes, one, zero, bits), one, zero, bits), codes)
    s, m = group_stats(x, 2)
    assert (m.float() <= x.amin(-1)).all() and (s.float() * 3 + m.float() >= x.amax(-1) - 1e-6).all()


def test_sixteen_bit_is_a_noop(tiny, ids):
    full = _decode_logits(tiny, KVCache.full(2), ids, 40)
    for cls, kw in ((KIVILayer, {}), (pk.PatternKVLayer, {"k_patterns": 8, "v_patterns": 8})):
        cache = _layers(tiny, cls, k_bits=16, v_bits=16, group_size=8, residual_length=16, **kw)
        got = _decode_logits(tiny, cache, ids, 40)
        assert torch.allclose(got, full, atol=1e-5), (cls, (got - full).abs().max())
        assert cache.layers[0].flushes >= 3


def test_patternkv_reduces_to_kivi_bit_identically(tiny, ids):
    kivi = _layers(tiny, KIVILayer, k_bits=2, v_bits=2, group_size=8, residual_length=16)
    zero = _layers(tiny, pk.PatternKVLayer, k_bits=2, v_bits=2, group_size=8, residual_length=16,
                   init="zero", grow=False, v_gate=False)
    a = _decode_logits(tiny, kivi, ids, 40)
    b = _decode_logits(tiny, zero, ids, 40)
    assert torch.equal(a, b)
    for la, lb in zip(kivi.layers, zero.layers):
        assert len(la.k_chunks) == len(lb.k_chunks) > 1
        for ca, cb in zip(la.k_chunks + la.v_chunks, lb.k_chunks + lb.v_chunks):
            for key in ("codes", "scale", "min"):
                assert torch.equal(ca[key], cb[key])


def test_low_bits_are_lossy_and_ordered(tiny, ids):
    full = _decode_logits(tiny, KVCache.full(2), ids, 40)
    err = {}
    for bits in (2, 4, 8):
        cache = _layers(tiny, KIVILayer, k_bits=bits, v_bits=bits, group_size=8, residual_length=16)
        err[bits] = (_decode_logits(tiny, cache, ids, 40) - full).abs().mean().item()
    assert err[2] > err[4] > err[8] > 0


def test_flush_mechanics_and_assignments(tiny, ids):
    cache = _layers(tiny, pk.PatternKVLayer, k_bits=2, v_bits=2, group_size=8, residual_length=16,
                    k_patterns=8, v_patterns=8)
    prefix = 40
    _decode_logits(tiny, cache, ids, prefix)
    n = 80 - prefix
    for layer in cache.layers:
        assert layer.bank_size() == 8 + layer.flushes
        assert layer.flushes == (prefix % 16 + n) // 16 == 3
        assert layer.quantized_tokens + layer.win_k.shape[-2] == prefix + n
        for i, chunk in enumerate(layer.k_chunks):
            assert int(chunk["assign"].max()) < 8 + i  # bank size when the chunk was written
        for i, chunk in enumerate(layer.v_chunks):
            assert int(chunk["assign"].max()) < 8 + i


def test_chebyshev_centre_and_gate():
    g = torch.Generator().manual_seed(3)
    w = torch.randn(2, 3, 64, 16, generator=g) ** 3
    c = pk.chebyshev_centre(w)
    assert torch.allclose(c, (w.amax(dim=(0, 2)) + w.amin(dim=(0, 2))) / 2)
    radius = lambda centre: (w - centre[None, :, None]).abs().amax(dim=(0, 2, 3))  # noqa: E731
    assert (radius(c) <= radius(w.mean(dim=(0, 2))) + 1e-6).all()
    v = torch.randn(5, 64, generator=g)
    assert not pk.v_gate(v, torch.zeros_like(v)).any()  # rho = 1 -> no subtraction
    assert pk.v_gate(v, v * 0.999).all()  # rho -> 0 -> subtract
    rho = torch.tensor([0.0, 0.5, 0.9])
    assert torch.allclose(pk.gate_threshold(rho, 64), 0.1839 * torch.sqrt(1 + rho ** 4), atol=1e-4)


def test_patterns_shrink_residual_range():
    g = torch.Generator().manual_seed(4)
    centres = torch.randn(8, 64, generator=g) * 4
    x = centres[torch.randint(0, 8, (1, 512), generator=g)] + 0.3 * torch.randn(1, 512, 64, generator=g)
    bank = pk.kmeans(x, 8, seed=0)
    resid = x - pk.gather_patterns(bank, pk.l2_assign(x[None], bank))[0]
    rng = lambda t: (t.amax(-1) - t.amin(-1)).mean()  # noqa: E731
    assert rng(resid) < 0.5 * rng(x)


def test_quantized_memory_counted_equals_tensors_held(tiny, ids):
    spec = KVSpec(quant="patternkv", bits=2, group_size=16, residual_length=32, k_patterns=8, v_patterns=8)
    _, stats, _ = generate(tiny, ids[:, :100], None, spec, max_new_tokens=10)
    cache = stats.extra["cache"]
    d, h, b = 16, 2, 1
    expected = 0
    for layer in cache.layers:
        tq, w, m = layer.quantized_tokens, layer.win_k.shape[-2], layer.bank_size()
        k_bytes = b * h * (tq * d * 2 // 8 + (tq // 16) * d * 2 * 2 + tq * 2)  # codes, fp16 scale+min, int16 idx
        v_bytes = b * h * (tq * d * 2 // 8 + tq * (d // 16) * 2 * 2 + tq * 2 + tq)  # + 1-byte gate mask
        expected += k_bytes + v_bytes + 2 * b * h * w * d * 4 + 2 * h * m * d * 2
    assert stats.kv_bytes == expected
    kivi = generate(tiny, ids[:, :100], None, KVSpec(quant="kivi", bits=2, group_size=16, residual_length=32),
                    max_new_tokens=10)[1]
    assert kivi.kv_bytes < stats.kv_bytes < stats.full_kv_bytes


def test_decode_nll_full_vs_quantized(tiny, ids):
    seq = ids[:, :100]
    full, n, _ = decode_nll(tiny, seq[0], 60, KVSpec())
    with torch.no_grad():
        logp = torch.log_softmax(tiny(input_ids=seq).logits[0, 59:-1].float(), -1)
    ref = -logp.gather(-1, seq[0, 60:, None]).sum().item()
    assert n == 40 and math.isclose(full, ref, rel_tol=1e-5)
    q2, _, st = decode_nll(tiny, seq[0], 64, KVSpec(quant="kivi", bits=2, group_size=16, residual_length=32),
                           chunk=None)
    assert q2 != full and st.kv_bytes < st.full_kv_bytes


@pytest.mark.parametrize("spec", [KVSpec(quant="kivi", bits=2, group_size=16, residual_length=32),
                                  KVSpec(quant="patternkv", bits=2, group_size=16, residual_length=32, k_patterns=8,
                                         v_patterns=8),
                                  KVSpec(evict="adakv", budget=0.3, critical=True, window_size=8)])
def test_chunked_teacher_forcing_equals_token_by_token(tiny, ids, spec):
    one, n1, _ = decode_nll(tiny, ids[0, :128], 64, spec, chunk=1)
    many, n2, _ = decode_nll(tiny, ids[0, :128], 64, spec, chunk=None)
    assert n1 == n2 == 64
    assert math.isclose(one, many, rel_tol=1e-5)


@pytest.mark.parametrize("spec", [KVSpec(quant="patternkv", bits=2, group_size=16, residual_length=32, k_patterns=8,
                                         v_patterns=8),
                                  KVSpec(evict="pyramidkv", budget=0.3, critical=True, window_size=8)])
def test_shared_prefill_path_equals_direct_path(tiny, ids, spec):
    from llmtool.kvcache.pipeline import cache_from_prefill, capture_prefill, continue_nll, exact_chunk

    direct, n, _ = decode_nll(tiny, ids[0, :128], 64, spec, chunk=None)
    state = capture_prefill(tiny, ids[:, :64])
    with torch.no_grad():
        first = tiny(input_ids=ids[:, :64]).logits[:, -1]
    cache = cache_from_prefill(tiny, state, spec)
    shared, n2, _ = continue_nll(tiny, cache, ids[0, 64:128], first, exact_chunk(spec, 64, 64))
    assert n == n2 and math.isclose(direct, shared, rel_tol=1e-5)

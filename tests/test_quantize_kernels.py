"""Triton kernels of the quantize area vs their torch references (TRITON_INTERPRET=1, CPU tensors)."""
import os

os.environ["TRITON_INTERPRET"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

triton = pytest.importorskip("triton")

from llmtool.kernels import hadamard, intpack, quant, w4a4_matmul  # noqa: E402


@pytest.mark.parametrize("n", [16, 64, 576, 960, 1536, 2560])
def test_hadamard_orthogonal_and_fast_transform_matches_dense(n):
    h = hadamard.hadamard_matrix(n)
    assert torch.allclose(h @ h.T, torch.eye(n, dtype=torch.float64), atol=1e-12, rtol=0)
    assert set(torch.unique((h * n ** 0.5).round()).tolist()) == {-1.0, 1.0}
    x = torch.randn(3, n, dtype=torch.float64)
    assert torch.allclose(hadamard.hadamard_transform(x), x @ h, atol=1e-12, rtol=0)


def test_unsupported_hadamard_order_is_an_error():
    with pytest.raises(ValueError, match="no Hadamard"):
        hadamard.hadamard_matrix(42)


def test_fwht_triton_matches_reference():
    x = torch.randn(3, 64)
    ref = hadamard.fwht_reference(x)
    assert torch.allclose(hadamard.fwht_triton(x), ref, atol=1e-6)
    assert torch.allclose(ref, x @ hadamard.hadamard_matrix(64, torch.float32), atol=1e-5)


@pytest.mark.parametrize("bits,n", [(4, 16), (3, 24)])
def test_pack_unpack_roundtrip_and_triton_equal(bits, n):
    g = torch.Generator().manual_seed(0)
    codes = torch.randint(0, 2 ** bits, (5, n), generator=g).to(torch.uint8)
    ref = intpack.pack(codes, bits)
    assert ref.shape == (5, intpack.packed_width(n, bits))
    assert torch.equal(intpack.unpack(ref, bits), codes)
    tri_pack = intpack.pack_int4_triton if bits == 4 else intpack.pack_int3_triton
    tri_unpack = intpack.unpack_int4_triton if bits == 4 else intpack.unpack_int3_triton
    assert torch.equal(tri_pack(codes), ref)
    assert torch.equal(tri_unpack(ref), codes)


def test_int4_layout_is_low_nibble_first():
    codes = torch.tensor([[1, 2, 15, 0]], dtype=torch.uint8)
    assert intpack.pack(codes, 4).tolist() == [[0x21, 0x0F]]


@pytest.mark.parametrize("bits,symmetric", [(4, False), (3, False), (4, True)])
def test_per_token_quant_triton_matches_reference_and_error_bound(bits, symmetric):
    x = torch.randn(6, 40) * torch.linspace(0.1, 5, 6)[:, None]
    x[2] = 0.0  # an all-zero row gets scale 1
    c_ref, s_ref, z_ref = quant.quantize_per_token_reference(x, bits, symmetric)
    c_tri, s_tri, z_tri = quant.quantize_per_token_triton(x, bits, symmetric)
    assert torch.equal(c_tri, c_ref) and torch.equal(s_tri, s_ref) and torch.equal(z_tri, z_ref)
    fake = quant.fake_quant_per_token_reference(x, bits, symmetric)
    assert torch.allclose(quant.fake_quant_per_token_triton(x, bits, symmetric), fake, atol=0, rtol=0)
    # round-trip error at most half a quantization step, elementwise
    assert ((fake - x).abs() <= s_ref / 2 + 1e-6).all()
    assert int(c_ref.max()) <= 2 ** bits - 1


@pytest.mark.parametrize("m", [28, 36, 60, 108, 148])
def test_paley_orders_beyond_12_20_44_are_hadamard(m):
    """Paley I (q + 1, q ≡ 3 mod 4) and II (2(q + 1), q ≡ 1 mod 4) factors: ±1 entries, orthogonal rows."""
    h = hadamard._small_factor(m)
    assert torch.allclose(h @ h.T, torch.eye(m, dtype=torch.float64), atol=1e-12, rtol=0)
    assert set(torch.unique((h * m ** 0.5).round()).tolist()) == {-1.0, 1.0}


def test_factorize_keeps_earlier_orders_and_covers_7b_mlp_widths():
    # sizes that had a factorization keep it (checkpoints' rotations do not change)
    assert [hadamard.factorize(n) for n in (576, 960, 1536, 2560)] == [(144, 4), (240, 4), (12, 128), (20, 128)]
    assert hadamard.factorize(14336) == (28, 512) and hadamard.factorize(18944) == (148, 128)
    assert hadamard.factorize(13824) == (108, 128) and hadamard.factorize(11008) == (5504, 2)
    x = torch.randn(2, 28 * 16, dtype=torch.float64)
    assert torch.allclose(hadamard.hadamard_transform(x), x @ hadamard.hadamard_matrix(28 * 16), atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="no Hadamard matrix of order 22"):
        hadamard.factorize(22)


def test_fake_quant_16_bits_is_identity():
    x = torch.randn(4, 8)
    assert quant.fake_quant_per_token(x, 16) is x


def test_w4a4_matmul_triton_matches_reference_and_float():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(5, 64, generator=g)
    wcodes = torch.randint(0, 16, (40, 64), generator=g).to(torch.uint8)
    wscale = torch.rand(40, 1, generator=g) + 0.1
    packed = intpack.pack(wcodes, 4)
    xc, xs, xz = quant.quantize_per_token(x, 4)
    ref = w4a4_matmul.w4a4_matmul_reference(xc, xs, xz, packed, wscale)
    tri = w4a4_matmul.w4a4_matmul_triton(xc, xs, xz, packed, wscale)
    assert torch.equal(tri, ref)
    dense = ((xc.double() - xz.double()) * xs.double()) @ ((wcodes.double() - 8) * wscale.double()).T
    assert torch.allclose(ref.double(), dense, rtol=1e-5, atol=1e-5)



@pytest.mark.parametrize("index", [0, 2, 5, 9, 14])
def test_w4a4_autotune_configs_compute_the_same_integer_product(index):
    """Every tile shape and split-K the CUDA autotuner may pick gives the reference's exact result, on shapes
    that leave partial tiles in M, N and K (the autotuner itself needs a GPU; each config is launched here)."""
    cfg = w4a4_matmul._TUNE_CONFIGS[index].kwargs
    g = torch.Generator().manual_seed(2)
    m, n, k = 3, 72, 320
    wcodes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    wscale = torch.rand(n, 1, generator=g) + 0.1
    packed = intpack.pack(wcodes, 4)
    xc, xs, xz = quant.quantize_per_token(torch.randn(m, k, generator=g), 4)
    ref = w4a4_matmul.w4a4_matmul_reference(xc, xs, xz, packed, wscale)
    y, acc = torch.empty(m, n), torch.zeros(m, n, dtype=torch.int32)
    grid = (triton.cdiv(m, cfg["BLOCK_M"]), triton.cdiv(n, cfg["BLOCK_N"]), cfg["SPLIT_K"])
    w4a4_matmul._w4a4_kernel[grid](xc.contiguous(), xs.float().reshape(-1), xz.float().reshape(-1), packed,
                                   wscale.float().reshape(-1), y, acc, m, n, k, 8, 4, **cfg)
    if cfg["SPLIT_K"] > 1:
        y = acc.float() * xs.float().reshape(-1, 1) * wscale.float().reshape(1, -1)
    assert torch.equal(y, ref)
    assert w4a4_matmul._m_bucket(1) == 1 and w4a4_matmul._m_bucket(3) == 4 and w4a4_matmul._m_bucket(9000) == 4096

# ------------------------------------------------------------------ integer CPU paths (issue 18)

def _qlinear(w_bits, a_bits, n=96, k=128, symmetric=False, seed=0):
    from llmtool.quantize.modules import QuantLinear
    from llmtool.quantize.quantizers import weight_scale

    g = torch.Generator().manual_seed(seed)
    lin = torch.nn.Linear(k, n, bias=False)
    with torch.no_grad():
        lin.weight.copy_(torch.randn(n, k, generator=g) * 0.05)
    q = QuantLinear.from_linear(lin, a_symmetric=symmetric)
    w = lin.weight.detach().float()
    scale = weight_scale(w, w_bits, False).to(torch.float16).float()
    zero = 2 ** (w_bits - 1)
    codes = torch.clamp(torch.round(w / scale) + zero, 0, 2 ** w_bits - 1)
    q.set_quantized(codes.to(torch.uint8), scale, w_bits)
    q.a_bits = a_bits
    return q, torch.randn(5, k, generator=g)


@pytest.mark.parametrize("w_bits, a_bits, symmetric", [(4, 4, False), (4, 4, True), (3, 3, False), (4, 6, False),
                                                        (4, 7, True)])
def test_low_bit_activation_product_is_the_float_reference_exactly(w_bits, a_bits, symmetric):
    from llmtool.kernels.quant import quantize_per_token
    from llmtool.quantize.quantizers import weight_zero

    q, x = _qlinear(w_bits, a_bits, symmetric=symmetric)
    y = q(x)
    xc, xs, xz = quantize_per_token(x, a_bits, symmetric, 1.0)
    wc = q.codes().float() - weight_zero(w_bits)
    ref = ((xc.float() - xz) @ wc.T) * xs * q.weight_scale.float().reshape(1, -1)
    assert torch.equal(y, ref)
    assert q.cache_bytes() == q.in_features * q.out_features          # int8 codes, no float32 copy


@pytest.mark.parametrize("w_bits", [3, 4, 8])
def test_weight_only_products_match_the_dequantized_product(w_bits):
    q, x = _qlinear(w_bits, 16)
    ref = x @ q.dequantized_weight(torch.float32).T
    assert torch.allclose(q(x), ref, rtol=1e-5, atol=1e-6)
    assert q.cache_bytes() == q.in_features * q.out_features        # int8 codes only, no float copy
    if w_bits == 4:          # bf16 activations: torch's int4 weight-only kernel, same product up to bf16 rounding
        yb = q(x.bfloat16()).float()
        ref_b = x.bfloat16().float() @ q.dequantized_weight(torch.float32).T
        assert torch.allclose(yb, ref_b, rtol=2e-2, atol=2e-2), (yb - ref_b).abs().max()
        assert q.cache_bytes() <= 1.7 * q.in_features * q.out_features      # + 0.5 B packed int4 + group scales
    # the cache follows the codes: new codes give new results
    q.set_quantized(torch.full((q.out_features, q.in_features), 2 ** (w_bits - 1) + 1, dtype=torch.uint8),
                    q.weight_scale.float(), w_bits)
    assert torch.allclose(q(x), x.sum(1, keepdim=True) * q.weight_scale.float().reshape(1, -1), rtol=1e-4, atol=1e-5)



@pytest.mark.parametrize("w_bits", [3, 4, 8])
def test_weight_only_codes_product_scales_the_output_like_the_dequantized_reference(w_bits):
    """kernels.weight_only: the per-channel scale applied to the output columns equals the dequantized product."""
    from llmtool.kernels.weight_only import weight_only_mm_codes, weight_only_mm_reference

    g = torch.Generator().manual_seed(w_bits)
    half = 2 ** (w_bits - 1)
    qc = torch.randint(-half, half, (48, 320), generator=g).to(torch.int8)
    scale = torch.rand(48, generator=g) * 0.02 + 1e-3
    x = torch.randn(3, 320, generator=g)
    ref = weight_only_mm_reference(x, qc, scale)
    bound = 1e-5 * weight_only_mm_reference(x.abs(), qc.abs(), scale)    # float rounding-order bound
    assert ((weight_only_mm_codes(x, qc, scale) - ref).abs() <= bound).all()
    # a scale on the wrong channels would not match
    wrong = torch.nn.functional.linear(x, qc.float()) * scale.flip(0).reshape(1, -1)
    assert ((wrong - ref).abs() > bound).any()


@pytest.mark.skipif(not hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu"), reason="torch without the int4 CPU kernel")
@pytest.mark.parametrize("n, k", [(96, 128), (64, 576), (48, 1536)])
def test_int4_cpu_kernel_matches_the_reference_on_bf16_activations(n, k):
    """torch's int4 CPU kernel with unit group scales + llmtool's per-channel scale on the output: the
    dequantized product of the bf16-rounded activations, up to the kernel's bf16 output rounding."""
    from llmtool.kernels.weight_only import int4_mm_cpu, int4_pack_cpu, weight_only_mm_reference

    g = torch.Generator().manual_seed(n)
    codes = torch.randint(0, 16, (n, k), generator=g).to(torch.uint8)
    scale = torch.rand(n, generator=g) * 0.02 + 1e-3
    x = torch.randn(4, k, generator=g)
    op = int4_pack_cpu(codes)
    assert op is not None
    y = int4_mm_cpu(x, op, scale)
    assert y.dtype == torch.float32
    ref = weight_only_mm_reference(x.bfloat16().float(), codes.to(torch.int16) - 8, scale)
    tol = ref.abs().amax(dim=1, keepdim=True) * 2 ** -7          # bf16 output rounding of the kernel
    assert ((y - ref).abs() <= tol).all(), (y - ref).abs().max()
    # the nibble order and the zero point matter: swapped codes give a different product
    wrong = weight_only_mm_reference(x.bfloat16().float(), codes.to(torch.int16) - 7, scale)
    assert ((wrong - ref).abs() > tol).any()
    assert int4_pack_cpu(codes[:, 32:]) is None                 # K not a multiple of 64: no kernel
    assert int4_pack_cpu(codes[:40]) is None                    # N not a multiple of 16: no kernel


def test_quantlinear_w4a16_fp32_activations_exact_by_default_and_int4_kernel_opt_in(monkeypatch):
    from llmtool.quantize.modules import QuantLinear

    q, x = _qlinear(4, 16)
    ref = x @ q.dequantized_weight(torch.float32).T
    assert not QuantLinear.cpu_int4_bf16          # the default is the exact float32 product
    assert torch.allclose(q(x), ref, rtol=1e-5, atol=1e-6)
    assert "int8" in q._kernel_cache and "int4pack" not in q._kernel_cache
    q2, _ = _qlinear(4, 16)
    monkeypatch.setattr(QuantLinear, "cpu_int4_bf16", True)
    y = q2(x)
    assert y.dtype == torch.float32
    ref_b = x.bfloat16().float() @ q2.dequantized_weight(torch.float32).T
    assert torch.allclose(y, ref_b, rtol=2e-2, atol=2e-3), (y - ref_b).abs().max()
    assert not torch.equal(y, ref)                # it is the bf16 path, not the exact one
    assert "int8" not in q2._kernel_cache and "int4pack" in q2._kernel_cache
    assert q2.cache_bytes() < 0.6 * q2.in_features * q2.out_features   # 0.5 B/weight + unit group scales

def test_resident_bytes_counts_tied_storage_once_and_kernel_caches():
    from conftest import build_tiny_llama

    from llmtool.quantize.api import quantize_
    from llmtool.quantize.modules import QuantLinear, resident_bytes
    from llmtool.quantize.runner import make_config

    model = build_tiny_llama(128)
    unique = {p.data_ptr(): p.numel() * p.element_size() for p in list(model.parameters()) + list(model.buffers())}
    assert resident_bytes(model) == sum(unique.values())
    quantize_(model, make_config("rtn", w_bits=4, a_bits=16))
    model(input_ids=torch.zeros(1, 4, dtype=torch.long))          # builds the int8 code caches
    caches = sum(m.cache_bytes() for m in model.modules() if isinstance(m, QuantLinear))
    assert caches > 0
    unique = {t.data_ptr(): t.numel() * t.element_size() for t in list(model.parameters()) + list(model.buffers())}
    assert resident_bytes(model) == sum(unique.values()) + caches

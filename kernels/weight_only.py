"""Weight-only low-bit products on the CPU: ``y = x Wᵀ`` with ``W = scale · q`` (per-output-channel scales,
signed integer codes ``q``), without a float copy of ``W``.

Two paths, each beside its torch reference (:func:`weight_only_mm_reference`, the dequantized product):

* :func:`weight_only_mm_codes` -- the exact (float32) path for any bit width: the int8 codes are widened to
  float32 transiently and the per-channel scale is applied to the *output* columns,
  ``y_j = s_j · Σ_i x_i q_ji``, which is the reference ``Σ_i x_i (s_j q_ji)`` up to float rounding order.
  Measured on this project's AVX2 CPU (one thread, 1536 x 576, M = 1; ``benchmarks/peers.py --rows quant``
  records the model-level effect): scaling the [out, in] weight before the GEMM (``codes.float() * scale``,
  the previous path) took 10-20 ms per call -- torch's broadcast multiply over the weight, not the GEMM
  -- while widening alone takes 0.05 ms and the GEMM with the scale on the output 0.1-0.2 ms.
* :func:`int4_mm_cpu` -- torch's int4 weight-only CPU kernel (``aten._weight_int4pack_mm_for_cpu``) on the
  operand built by :func:`int4_pack_cpu` (``aten._convert_weight_to_int4pack_for_cpu``: 0.5 B per
  weight). The kernel is fast only with bfloat16 activations (float32 activations: 6-16 ms per call,
  slower than every other path; bf16: 0.06-0.7 ms). It computes ``Σ_g Σ_i x_i ((c − 8) · s_g + z_g)``
  per group ``g``; llmtool's scales are per channel, so the kernel gets unit scales and zero offsets
  (exact in bf16) and the float32 per-channel scale is applied to its output, as in the exact path. What
  is rounded: the activations to bfloat16 (8-bit mantissa) and the kernel's output to bfloat16; the
  codes are exact. ``llmtool.quantize.modules.QuantLinear`` uses it for bfloat16 activations always and,
  opt-in (``LLMTOOL_CPU_INT4=bf16`` or ``QuantLinear.cpu_int4_bf16 = True``), for float32 activations
  rounded to bfloat16 -- "A16" in the strict sense -- with the output returned in float32.

The codes convention is llmtool_quant's (``llmtool.kernels.intpack``): unsigned ``c ∈ [0, 15]`` with the
symmetric zero ``8``, so ``q = c − 8``, which is also the kernel's own offset.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

INT4_GROUPS = (256, 128, 64)       # group sizes the CPU kernel accepts that divide in_features (largest first)


def weight_only_mm_reference(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (scale [N] · q [N, K])ᵀ`` in float32: the dequantized product (the equality test)."""
    return F.linear(x.float(), q.float() * scale.float().reshape(-1, 1))


def weight_only_mm_codes(x: torch.Tensor, q_int8: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The same product from int8 codes ``q`` [N, K], scale applied to the output columns (float32)."""
    return F.linear(x.float(), q_int8.to(torch.float32)) * scale.float().reshape(1, -1)


def int4_cpu_available() -> bool:
    return hasattr(torch.ops.aten, "_weight_int4pack_mm_for_cpu") and \
        hasattr(torch.ops.aten, "_convert_weight_to_int4pack_for_cpu")


def int4_group(in_features: int) -> int | None:
    """The kernel's group size for ``in_features`` (None: the shape does not fit the kernel)."""
    return next((g for g in INT4_GROUPS if in_features % g == 0), None)


def int4_pack_cpu(codes: torch.Tensor):
    """(packed operand, group, unit scales_and_zeros [K/group, N, 2] bf16) for :func:`int4_mm_cpu` from
    unsigned 4-bit codes [N, K] (uint8 0..15), or None when the kernel is missing or the shape does not
    fit (``K`` not a multiple of 64, ``N`` not a multiple of 16)."""
    n, k = codes.shape
    group = int4_group(k)
    if group is None or n % 16 or not int4_cpu_available() or codes.is_cuda:
        return None
    packed = torch.ops.aten._convert_weight_to_int4pack_for_cpu(codes.to(torch.int32).contiguous(), 1)
    sz = torch.zeros(k // group, n, 2, dtype=torch.bfloat16)
    sz[..., 0] = 1.0
    return packed, group, sz


def int4_mm_cpu(x: torch.Tensor, operand, scale: torch.Tensor) -> torch.Tensor:
    """``x [M, K] @ (scale · (c − 8))ᵀ`` through torch's int4 CPU kernel (activations rounded to bf16).
    Returns float32 for float32 input, else the input's dtype."""
    packed, group, sz = operand
    y = torch.ops.aten._weight_int4pack_mm_for_cpu(x.to(torch.bfloat16).contiguous(), packed, group, sz)
    y = y.float() * scale.float().reshape(1, -1)
    return y if x.dtype == torch.float32 else y.to(x.dtype)

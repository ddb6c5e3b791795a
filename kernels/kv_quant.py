"""Group-wise asymmetric b-bit quantize+pack / unpack+dequantize for KV caches (KIVI / PatternKV).

Layout: ``x [N, G]`` - N groups of G values (the caller arranges K per-channel groups of G tokens
or V per-token groups of G channels as rows). Per group: ``min`` and ``scale`` stored as float16,
codes ``q = floor((x - min) / scale + 1/2)`` clamped to ``[0, 2^b - 1]``, packed little-end-first
``8 / b`` codes per uint8 (code ``j`` of a byte in bits ``b*j .. b*j + b - 1``), ``b`` in {2, 4, 8}.
Dequantized value: ``min + scale * q``.

The float16 statistics are rounded *outward* (``min`` down, ``scale`` up, see :func:`group_stats`)
so every code stays in range and ``|x - x_hat| <= scale / 2`` holds with the stored scale; the scale
is clamped at the smallest normal float16 (constant groups give a zero range).

Functions (same signatures for reference and triton):
- :func:`pack_reference` / :func:`pack_triton`: ``(x, scale, mn, bits) -> packed [N, G*b/8] uint8``;
- :func:`unpack_reference` / :func:`unpack_triton`: ``(packed, scale, mn, bits, dtype) -> [N, G]``;
- :func:`quantize_groups` / :func:`dequantize_groups`: dispatchers (triton on CUDA tensors with
  power-of-two G, the torch reference elsewhere). Tests compare both with ``TRITON_INTERPRET=1``; on a GPU
  they agree bit for bit only with IEEE division and no multiply-add fusion in the kernels (``EXACT_FP``).
"""
from __future__ import annotations

import torch

from llmtool.kernels._dispatch import EXACT_FP

try:
    import triton
    import triton.language as tl

    HAVE_TRITON = True
except Exception:  # pragma: no cover
    HAVE_TRITON = False

BITS = (2, 4, 8)
FP16_TINY = 6.103515625e-05  # smallest normal float16


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"kv_quant: bits must be one of {BITS}, got {bits}")


def group_stats(x: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float16 ``(scale, min)`` per row with outward rounding."""
    xf = x.float()
    mn = xf.amin(-1)
    mx = xf.amax(-1)
    mn16 = mn.to(torch.float16)
    low = mn16.float() > mn
    mn16 = torch.where(low, torch.nextafter(mn16, torch.full_like(mn16, -float("inf"))), mn16)
    scale = ((mx - mn16.float()) / (2 ** bits - 1)).clamp_min(FP16_TINY)
    s16 = scale.to(torch.float16)
    small = s16.float() < scale
    s16 = torch.where(small, torch.nextafter(s16, torch.full_like(s16, float("inf"))), s16)
    return s16, mn16


def pack_reference(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int) -> torch.Tensor:
    _check_bits(bits)
    n, g = x.shape
    per = 8 // bits
    q = torch.floor((x.float() - mn.float()[:, None]) / scale.float()[:, None] + 0.5)
    q = q.clamp(0, 2 ** bits - 1).to(torch.int32).view(n, g // per, per)
    shifts = torch.arange(per, dtype=torch.int32, device=x.device) * bits
    return (q << shifts).sum(-1).to(torch.uint8)


def unpack_reference(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                     dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _check_bits(bits)
    n, cols = packed.shape
    per = 8 // bits
    shifts = torch.arange(per, dtype=torch.int32, device=packed.device) * bits
    q = (packed.to(torch.int32)[..., None] >> shifts) & (2 ** bits - 1)
    x = mn.float()[:, None] + scale.float()[:, None] * q.view(n, cols * per).float()
    return x.to(dtype)


if HAVE_TRITON:

    @triton.jit
    def _pack_kernel(x_ptr, scale_ptr, min_ptr, out_ptr, G: tl.constexpr, BITS_: tl.constexpr,
                     PER: tl.constexpr):
        row = tl.program_id(0)
        s = tl.load(scale_ptr + row).to(tl.float32)
        m = tl.load(min_ptr + row).to(tl.float32)
        offs = tl.arange(0, G // PER)
        x0 = tl.load(x_ptr + row * G + offs * PER).to(tl.float32)
        q0 = tl.minimum(tl.maximum(tl.floor(tl.math.div_rn(x0 - m, s) + 0.5), 0.0), 2 ** BITS_ - 1.0)
        acc = q0.to(tl.int32)
        for j in tl.static_range(1, PER):
            xj = tl.load(x_ptr + row * G + offs * PER + j).to(tl.float32)
            q = tl.floor(tl.math.div_rn(xj - m, s) + 0.5)
            q = tl.minimum(tl.maximum(q, 0.0), 2 ** BITS_ - 1.0)
            acc = acc | (q.to(tl.int32) << (BITS_ * j))
        tl.store(out_ptr + row * (G // PER) + offs, acc.to(tl.uint8))

    @triton.jit
    def _unpack_kernel(p_ptr, scale_ptr, min_ptr, out_ptr, G: tl.constexpr, BITS_: tl.constexpr,
                       PER: tl.constexpr):
        row = tl.program_id(0)
        s = tl.load(scale_ptr + row).to(tl.float32)
        m = tl.load(min_ptr + row).to(tl.float32)
        offs = tl.arange(0, G // PER)
        p = tl.load(p_ptr + row * (G // PER) + offs).to(tl.int32)
        for j in tl.static_range(PER):
            q = (p >> (BITS_ * j)) & (2 ** BITS_ - 1)
            tl.store(out_ptr + row * G + offs * PER + j, m + s * q.to(tl.float32))


def pack_triton(x: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int) -> torch.Tensor:
    _check_bits(bits)
    n, g = x.shape
    per = 8 // bits
    out = torch.empty(n, g // per, dtype=torch.uint8, device=x.device)
    if n:
        _pack_kernel[(n,)](x.contiguous(), scale.contiguous(), mn.contiguous(), out, G=g, BITS_=bits, PER=per,
                           **EXACT_FP)
    return out


def unpack_triton(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                  dtype: torch.dtype = torch.float32) -> torch.Tensor:
    _check_bits(bits)
    n, cols = packed.shape
    per = 8 // bits
    out = torch.empty(n, cols * per, dtype=torch.float32, device=packed.device)
    if n:
        _unpack_kernel[(n,)](packed.contiguous(), scale.contiguous(), mn.contiguous(), out, G=cols * per,
                             BITS_=bits, PER=per, **EXACT_FP)
    return out.to(dtype)


def _use_triton(t: torch.Tensor, g: int) -> bool:
    return HAVE_TRITON and t.is_cuda and g >= 8 and (g & (g - 1)) == 0


def quantize_groups(x: torch.Tensor, bits: int):
    """``x [N, G]`` -> ``(packed uint8 [N, G*b/8], scale fp16 [N], min fp16 [N])``."""
    _check_bits(bits)
    if x.shape[-1] % (8 // bits):
        raise ValueError(f"kv_quant: group size {x.shape[-1]} not a multiple of {8 // bits}")
    scale, mn = group_stats(x, bits)
    pack = pack_triton if _use_triton(x, x.shape[-1]) else pack_reference
    return pack(x, scale, mn, bits), scale, mn


def dequantize_groups(packed: torch.Tensor, scale: torch.Tensor, mn: torch.Tensor, bits: int,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    g = packed.shape[-1] * (8 // bits)
    unpack = unpack_triton if _use_triton(packed, g) else unpack_reference
    return unpack(packed, scale, mn, bits, dtype)

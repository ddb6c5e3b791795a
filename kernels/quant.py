"""Per-token (per-row) integer quantization of activations: codes, scale and zero point, and the
quantize-dequantize ("fake quant") used to simulate low-bit activations.

Conventions (shared by weights and activations in llmtool_quant): ``x ≈ scale · (code − zero)`` with
unsigned ``code ∈ [0, 2^b − 1]``.

* asymmetric (per-token default): ``hi = c·max(max x, 0)``, ``lo = c·min(min x, 0)`` for clip ratio c,
  ``scale = (hi − lo)/(2^b − 1)``, ``zero = round(−lo/scale)``;
* symmetric: ``scale = c·max|x| / (2^(b−1) − 1)``, ``zero = 2^(b−1)`` (signed range [−2^(b−1), 2^(b−1) − 1]).

A row of zeros gets scale 1. Rounding is round-half-to-even in both the triton kernel and the torch
reference (the kernel implements it with floor, so both agree bit for bit). The kernel divides with IEEE
rounding (``tl.math.div_rn``; triton's ``/`` is an approximate division on NVIDIA GPUs) and is compiled without
multiply-add fusion, as the reference computes; without both, the GPU codes differed from the reference's.
"""
from __future__ import annotations

import torch

from llmtool.kernels._dispatch import EXACT_FP, use_triton


def _params_reference(x: torch.Tensor, bits: int, symmetric: bool, clip_ratio: float):
    # divisions by a tensor, never a Python number: on CUDA torch divides by a CPU scalar as a multiply by
    # its reciprocal (not the IEEE quotient), which made the reference's scales differ from the kernel's
    x = x.float()
    if symmetric:
        maxq = 2 ** (bits - 1) - 1
        amax = x.abs().amax(dim=-1, keepdim=True) * clip_ratio
        scale = amax / amax.new_tensor(float(maxq))
        scale = torch.where(amax > 0, scale, torch.ones_like(scale))
        zero = torch.full_like(scale, float(2 ** (bits - 1)))
    else:
        maxq = 2 ** bits - 1
        hi = x.amax(dim=-1, keepdim=True).clamp(min=0) * clip_ratio
        lo = x.amin(dim=-1, keepdim=True).clamp(max=0) * clip_ratio
        scale = (hi - lo) / hi.new_tensor(float(maxq))
        scale = torch.where(hi > lo, scale, torch.ones_like(scale))
        zero = torch.round(-lo / scale)
    return scale, zero


def quantize_per_token_reference(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0):
    """(codes uint8, scale fp32 [..., 1], zero fp32 [..., 1]) of each row of ``x``."""
    scale, zero = _params_reference(x, bits, symmetric, clip_ratio)
    qmax = 2 ** bits - 1
    codes = torch.clamp(torch.round(x.float() / scale) + zero, 0, qmax)
    return codes.to(torch.uint8), scale, zero


def fake_quant_per_token_reference(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0):
    codes, scale, zero = quantize_per_token_reference(x, bits, symmetric, clip_ratio)
    return ((codes.float() - zero) * scale).to(x.dtype)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _round_half_even(v):
        r = tl.floor(v + 0.5)
        tie = (r - v) == 0.5
        odd = (r - 2.0 * tl.floor(r * 0.5)) != 0.0
        return tl.where(tie & odd, r - 1.0, r)

    @triton.jit
    def _quant_rows_kernel(x_ptr, codes_ptr, scale_ptr, zero_ptr, out_ptr, n_cols, clip_ratio,
                           BITS: tl.constexpr, SYMMETRIC: tl.constexpr, WRITE_FAKE: tl.constexpr,
                           BLOCK: tl.constexpr):
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0).to(tl.float32)
        if SYMMETRIC:
            amax = tl.max(tl.abs(x), axis=0) * clip_ratio
            scale = tl.math.div_rn(amax, 2.0 ** (BITS - 1) - 1)
            scale = tl.where(amax > 0, scale, 1.0)
            zero = scale * 0.0 + 2 ** (BITS - 1)
        else:
            hi = tl.maximum(tl.max(x, axis=0), 0.0) * clip_ratio
            lo = tl.minimum(tl.min(x, axis=0), 0.0) * clip_ratio
            scale = tl.math.div_rn(hi - lo, 2.0 ** BITS - 1)
            scale = tl.where(hi > lo, scale, 1.0)
            zero = _round_half_even(tl.math.div_rn(-lo, scale))
        q = _round_half_even(tl.math.div_rn(x, scale)) + zero
        q = tl.minimum(tl.maximum(q, 0.0), 2 ** BITS - 1)
        tl.store(codes_ptr + row * n_cols + cols, q.to(tl.uint8), mask=mask)
        tl.store(scale_ptr + row, scale)
        tl.store(zero_ptr + row, zero)
        if WRITE_FAKE:
            tl.store(out_ptr + row * n_cols + cols, (q - zero) * scale, mask=mask)

    def _launch(x: torch.Tensor, bits: int, symmetric: bool, clip_ratio: float, fake: bool):
        shape = x.shape
        x2 = x.reshape(-1, shape[-1]).contiguous()
        rows, n = x2.shape
        codes = torch.empty(rows, n, dtype=torch.uint8, device=x.device)
        scale = torch.empty(rows, dtype=torch.float32, device=x.device)
        zero = torch.empty(rows, dtype=torch.float32, device=x.device)
        out = torch.empty(rows, n, dtype=torch.float32, device=x.device) if fake else codes
        _quant_rows_kernel[(rows,)](x2, codes, scale, zero, out, n, float(clip_ratio), BITS=bits,
                                    SYMMETRIC=bool(symmetric), WRITE_FAKE=fake,
                                    BLOCK=triton.next_power_of_2(n), **EXACT_FP)
        return codes.reshape(shape), scale.reshape(*shape[:-1], 1), zero.reshape(*shape[:-1], 1), out

    def quantize_per_token_triton(x, bits, symmetric=False, clip_ratio=1.0):
        codes, scale, zero, _ = _launch(x, bits, symmetric, clip_ratio, fake=False)
        return codes, scale, zero

    def fake_quant_per_token_triton(x, bits, symmetric=False, clip_ratio=1.0):
        _, _, _, out = _launch(x, bits, symmetric, clip_ratio, fake=True)
        return out.reshape(x.shape).to(x.dtype)
except ImportError:  # pragma: no cover
    quantize_per_token_triton = fake_quant_per_token_triton = None


def quantize_per_token(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0):
    if quantize_per_token_triton is not None and use_triton(x):
        return quantize_per_token_triton(x, bits, symmetric, clip_ratio)
    return quantize_per_token_reference(x, bits, symmetric, clip_ratio)


def fake_quant_per_token(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0):
    """Quantize-dequantize each row of ``x`` to ``bits`` bits; identity for bits >= 16."""
    if bits >= 16:
        return x
    if fake_quant_per_token_triton is not None and use_triton(x):
        return fake_quant_per_token_triton(x, bits, symmetric, clip_ratio)
    return fake_quant_per_token_reference(x, bits, symmetric, clip_ratio)

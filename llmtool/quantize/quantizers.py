"""Weight and activation quantizers shared by every quantize method.

* Weights: per-output-channel symmetric b-bit, signed range [−2^(b−1), 2^(b−1) − 1] stored as unsigned
  codes ``q + 2^(b−1)``; scale ``= c · max|w_row| / (2^(b−1) − 1)`` rounded to fp16 (the stored dtype),
  where the clip ratio ``c`` is 1 or, with ``w_clip``, the per-row grid-search minimiser of the
  reconstruction MSE over c ∈ {1.00, 0.95, ..., 0.50} (GPTQ/QuaRot-style ``mse`` search).
* Activations: dynamic per-token quantization from :mod:`kernels.quant` (asymmetric by default).
* ``*_ste`` variants are the straight-through fake quantizers used while learning rotations
  (round() has gradient 1; scales are differentiable functions of the tensor).
"""
from __future__ import annotations

import torch

from llmtool.kernels.quant import fake_quant_per_token

FP16_TINY = 2.0 ** -20


def weight_zero(bits: int) -> int:
    return 2 ** (bits - 1)


def weight_scale(w: torch.Tensor, bits: int, clip: bool = False, grid: int = 20, min_ratio: float = 0.5) -> torch.Tensor:
    """Per-row symmetric scale [out, 1] (fp16-representable float32), optionally clip-searched."""
    maxq = 2 ** (bits - 1) - 1
    w = w.float()
    amax = w.abs().amax(dim=1, keepdim=True).clamp(min=FP16_TINY)

    def to_scale(ratio):
        return (amax * ratio / maxq).clamp(min=FP16_TINY).half().float()

    best = to_scale(1.0)
    if not clip:
        return best
    best_err = ((dequantize_weight(quantize_weight(w, best, bits), best, bits) - w) ** 2).sum(1, keepdim=True)
    steps = int(round((1 - min_ratio) * grid))
    for k in range(1, steps + 1):
        s = to_scale(1.0 - k / grid)
        err = ((dequantize_weight(quantize_weight(w, s, bits), s, bits) - w) ** 2).sum(1, keepdim=True)
        better = err < best_err
        best = torch.where(better, s, best)
        best_err = torch.where(better, err, best_err)
    return best


def quantize_weight(w: torch.Tensor, scale: torch.Tensor, bits: int) -> torch.Tensor:
    """Unsigned codes (uint8) of ``w`` for per-row ``scale``."""
    z = weight_zero(bits)
    return torch.clamp(torch.round(w.float() / scale) + z, 0, 2 ** bits - 1).to(torch.uint8)


def dequantize_weight(codes: torch.Tensor, scale: torch.Tensor, bits: int, dtype=torch.float32) -> torch.Tensor:
    return ((codes.float() - weight_zero(bits)) * scale.float()).to(dtype)


def rtn_weight(w: torch.Tensor, bits: int, clip: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """Round-to-nearest: (codes, scale)."""
    scale = weight_scale(w, bits, clip)
    return quantize_weight(w, scale, bits), scale


def _round_ste(x: torch.Tensor) -> torch.Tensor:
    return x + (torch.round(x) - x).detach()


def fake_quant_weight_ste(w: torch.Tensor, bits: int) -> torch.Tensor:
    """Per-row symmetric RTN quantize-dequantize with a straight-through round (for training)."""
    if bits >= 16:
        return w
    maxq = 2 ** (bits - 1) - 1
    scale = (w.abs().amax(dim=1, keepdim=True) / maxq).clamp(min=FP16_TINY)
    q = torch.clamp(_round_ste(w / scale), -maxq - 1, maxq)
    return q * scale


def fake_quant_act_ste(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0) -> torch.Tensor:
    """Per-token quantize-dequantize with a straight-through round (for training)."""
    if bits >= 16:
        return x
    if symmetric:
        maxq = 2 ** (bits - 1) - 1
        scale = (x.abs().amax(dim=-1, keepdim=True) * clip_ratio / maxq).clamp(min=1e-8)
        return torch.clamp(_round_ste(x / scale), -maxq - 1, maxq) * scale
    maxq = 2 ** bits - 1
    hi = x.amax(dim=-1, keepdim=True).clamp(min=0) * clip_ratio
    lo = x.amin(dim=-1, keepdim=True).clamp(max=0) * clip_ratio
    scale = ((hi - lo) / maxq).clamp(min=1e-8)
    zero = torch.round(-lo / scale).detach()
    return (torch.clamp(_round_ste(x / scale) + zero, 0, maxq) - zero) * scale


def fake_quant_act(x: torch.Tensor, bits: int, symmetric: bool = False, clip_ratio: float = 1.0) -> torch.Tensor:
    """Inference-time per-token quantize-dequantize (kernel dispatch)."""
    return fake_quant_per_token(x, bits, symmetric, clip_ratio)

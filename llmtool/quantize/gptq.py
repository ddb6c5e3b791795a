"""GPTQ weight quantization (Frantar et al., 2023) with the quantizer of :mod:`.quantizers`.

Columns are quantized left to right; each column's rounding error, divided by the diagonal of the
upper Cholesky factor of ``H⁻¹`` (``H = Σ x xᵀ`` over calibration inputs of the layer), is propagated to
the not-yet-quantized columns, lazily in blocks of ``block_size`` columns. Dampening adds
``damp · mean(diag H)`` to the diagonal (SpinQuant/QuaRot default 0.01). Per-row scales are fixed
before the sweep from the full row (with the optional clip search), as GPTQ's ``find_params`` does
with static groups. No activation reordering.
"""
from __future__ import annotations

import torch

from llmtool.quantize.quantizers import weight_scale, weight_zero


def gptq_weight(w: torch.Tensor, hessian: torch.Tensor, bits: int, clip: bool = False, damp: float = 0.01,
                block_size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes uint8 [out, in], scale [out, 1]) of ``w`` minimising ‖(W − Ŵ) X‖ greedily."""
    W = w.detach().float().clone()
    H = hessian.detach().to(device=W.device, dtype=torch.float32).clone()  # on the weight's device
    n = W.shape[1]
    dead = torch.diag(H) == 0
    H[dead, dead] = 1
    W[:, dead] = 0
    scale = weight_scale(W, bits, clip)
    zero, maxq = weight_zero(bits), 2 ** bits - 1
    H += damp * torch.mean(torch.diag(H)) * torch.eye(n, dtype=H.dtype, device=H.device)
    L = torch.linalg.cholesky(H)
    Hinv = torch.cholesky_inverse(L)
    Hinv = torch.linalg.cholesky(Hinv, upper=True)
    codes = torch.zeros(W.shape, dtype=torch.uint8, device=W.device)
    s = scale[:, 0]
    for i1 in range(0, n, block_size):
        i2 = min(i1 + block_size, n)
        W1 = W[:, i1:i2].clone()
        E1 = torch.zeros_like(W1)
        Hinv1 = Hinv[i1:i2, i1:i2]
        for i in range(i2 - i1):
            col = W1[:, i]
            q = torch.clamp(torch.round(col / s) + zero, 0, maxq)
            codes[:, i1 + i] = q.to(torch.uint8)
            err = (col - (q - zero) * s) / Hinv1[i, i]
            W1[:, i:] -= err[:, None] * Hinv1[i, i:][None, :]
            E1[:, i] = err
        W[:, i2:] -= E1 @ Hinv[i1:i2, i2:]
    return codes, scale

"""Integer W4A4 matmul: per-token quantized activations times int4-packed per-channel weights.

``y[m, n] = (Σ_k (xc[m,k] − xz[m]) · (wc[n,k] − wz)) · xs[m] · ws[n]`` where ``xc`` are uint8
activation codes (≤ 7 bits) with per-row scale ``xs`` and zero ``xz`` (from
:func:`kernels.quant.quantize_per_token`), ``wc`` are 4-bit weight codes packed two per byte (low
nibble first, see :mod:`kernels.intpack`) with per-output-channel scale ``ws`` and a common zero
``wz`` (8 for symmetric int4; 4 for int3 codes re-packed as nibbles).

The triton kernel accumulates the integer products in int32 with ``tl.dot`` on int8 operands (a real
integer GEMM). The torch reference computes the same integer sum with a float32 matmul, which is exact
while ``K · max|xc − xz| · max|wc − wz| < 2^24`` (K ≤ 8192 at 4 bits); both then apply the scales in the
same order, so they agree bit for bit.
"""
from __future__ import annotations

import torch

from llmtool.kernels._dispatch import use_triton
from llmtool.kernels.intpack import unpack_int4_reference


def centered_weight(w_packed: torch.Tensor, w_zero: int) -> torch.Tensor:
    """Signed integer weights ``wc − wz`` as float32 [N, K] (for the reference path)."""
    return unpack_int4_reference(w_packed).float() - float(w_zero)


def w4a4_matmul_reference(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero: int = 8,
                          w_centered: torch.Tensor | None = None) -> torch.Tensor:
    """Reference with the kernel's signature; ``w_centered`` optionally caches :func:`centered_weight`."""
    wc = centered_weight(w_packed, w_zero) if w_centered is None else w_centered
    xc = x_codes.float() - x_zero.float()
    acc = xc @ wc.T
    return acc * x_scale.float() * w_scale.float().reshape(1, -1)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _w4a4_kernel(xc_ptr, xs_ptr, xz_ptr, wp_ptr, ws_ptr, y_ptr, M, N, K, w_zero,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        xz = tl.load(xz_ptr + rm, mask=rm < M, other=0.0).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        half_k = K // 2
        for k0 in range(0, K, BLOCK_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a = tl.load(xc_ptr + rm[:, None] * K + rk[None, :], mask=(rm[:, None] < M) & (rk[None, :] < K),
                        other=0).to(tl.int32)
            a = tl.where((rm[:, None] < M) & (rk[None, :] < K), a - xz[:, None], 0).to(tl.int8)
            byte = tl.load(wp_ptr + rn[None, :] * half_k + rk[:, None] // 2,
                           mask=(rn[None, :] < N) & (rk[:, None] < K), other=0).to(tl.int32)
            code = (byte >> ((rk[:, None] & 1) * 4)) & 15
            b = tl.where((rn[None, :] < N) & (rk[:, None] < K), code - w_zero, 0).to(tl.int8)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        xs = tl.load(xs_ptr + rm, mask=rm < M, other=0.0)
        ws = tl.load(ws_ptr + rn, mask=rn < N, other=0.0)
        y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
        tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=(rm[:, None] < M) & (rn[None, :] < N))

    def w4a4_matmul_triton(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero: int = 8,
                           w_centered: torch.Tensor | None = None) -> torch.Tensor:
        M, K = x_codes.shape
        N = w_packed.shape[0]
        y = torch.empty(M, N, dtype=torch.float32, device=x_codes.device)
        bm, bn, bk = 16, 32, 32
        grid = (triton.cdiv(M, bm), triton.cdiv(N, bn))
        _w4a4_kernel[grid](x_codes.contiguous(), x_scale.float().reshape(-1).contiguous(),
                           x_zero.float().reshape(-1).contiguous(), w_packed.contiguous(),
                           w_scale.float().reshape(-1).contiguous(), y, M, N, K, int(w_zero),
                           BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk)
        return y
except ImportError:  # pragma: no cover
    w4a4_matmul_triton = None


def w4a4_matmul(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero: int = 8, w_centered=None) -> torch.Tensor:
    """[M, K] codes × packed [N, K/2] → float32 [M, N] (triton on CUDA, reference elsewhere)."""
    if w4a4_matmul_triton is not None and use_triton(x_codes, w_packed):
        return w4a4_matmul_triton(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero)
    return w4a4_matmul_reference(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero, w_centered)

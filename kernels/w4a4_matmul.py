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

On CUDA the kernel is autotuned (``triton.autotune`` over block shapes, split-K, warps and pipeline stages)
per (M bucket, N, K): M is bucketed to the next power of two (capped at 4096) so decode (M = 1) and prefill
shapes get their own tiles without a retune for every prompt length. With split-K the programs add int32
partial sums atomically (exact, so the result does not depend on their order) and the scales are applied
after. Under ``TRITON_INTERPRET=1`` (the CPU tests) one fixed configuration runs.
"""
from __future__ import annotations

import torch

from llmtool.kernels._dispatch import interpreting, use_triton
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
    def _w4a4_kernel(xc_ptr, xs_ptr, xz_ptr, wp_ptr, ws_ptr, y_ptr, acc_ptr, M, N, K, w_zero, M_BUCKET,
                     BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SPLIT_K: tl.constexpr):
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
        pid_k = tl.program_id(2)
        rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m_ok = rm < M
        n_ok = rn < N
        xz = tl.load(xz_ptr + rm, mask=m_ok, other=0.0).to(tl.int32)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.int32)
        half_k = K // 2
        for k0 in range(pid_k * BLOCK_K, K, BLOCK_K * SPLIT_K):
            rk = k0 + tl.arange(0, BLOCK_K)
            a_ok = m_ok[:, None] & (rk[None, :] < K)
            a = tl.load(xc_ptr + rm[:, None] * K + rk[None, :], mask=a_ok, other=0).to(tl.int32)
            a = tl.where(a_ok, a - xz[:, None], 0).to(tl.int8)
            # column k's code is nibble k % 2 of byte k // 2 (each byte is read for both of its columns; an
            # even/odd split into two dots over whole bytes measured 2.5-3x slower at 2048 rows on an H200)
            b_ok = n_ok[None, :] & (rk[:, None] < K)
            byte = tl.load(wp_ptr + rn[None, :] * half_k + rk[:, None] // 2, mask=b_ok, other=0).to(tl.int32)
            code = (byte >> ((rk[:, None] & 1) * 4)) & 15
            b = tl.where(b_ok, code - w_zero, 0).to(tl.int8)
            acc += tl.dot(a, b, out_dtype=tl.int32)
        out_ok = m_ok[:, None] & n_ok[None, :]
        if SPLIT_K == 1:
            xs = tl.load(xs_ptr + rm, mask=m_ok, other=0.0)
            ws = tl.load(ws_ptr + rn, mask=n_ok, other=0.0)
            y = acc.to(tl.float32) * xs[:, None] * ws[None, :]
            tl.store(y_ptr + rm[:, None] * N + rn[None, :], y, mask=out_ok)
        else:
            # integer partial sums: atomic int32 adds are exact and order-free (deterministic); the
            # scales are applied afterwards in the reference's order
            tl.atomic_add(acc_ptr + rm[:, None] * N + rn[None, :], acc, mask=out_ok)

    # decode-sized tiles (BLOCK_M 16, the smallest tl.dot accepts) with split-K so a single row still fills
    # the GPU, and prefill-sized tiles; int8 tl.dot needs BLOCK_K >= 32
    _TUNE_CONFIGS = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "SPLIT_K": sk}, num_warps=w,
                                   num_stages=st)
                     for bm, bn, bk, sk, w, st in [
                         (16, 64, 256, 1, 4, 3), (16, 64, 128, 1, 4, 4), (16, 64, 256, 4, 4, 3),
                         (16, 64, 256, 8, 4, 3), (16, 128, 256, 4, 4, 3), (16, 64, 128, 16, 4, 4),
                         (16, 128, 128, 1, 4, 4), (32, 128, 128, 2, 4, 4),
                         (64, 64, 128, 1, 4, 4), (64, 128, 128, 1, 4, 4), (64, 256, 64, 1, 8, 3),
                         (128, 128, 64, 1, 4, 4), (128, 128, 128, 1, 8, 3), (128, 256, 64, 1, 8, 3),
                         (256, 128, 64, 1, 8, 3)]]

    SPLIT_K_MAX_BUCKET = 64   # split-K configs are tried only up to this M bucket

    def _prune(configs, named_args, **kwargs):
        """Row tiles no taller than the bucketed M; split-K only where few row tiles leave the GPU idle."""
        m = named_args["M_BUCKET"]
        kept = [c for c in configs if c.kwargs["BLOCK_M"] <= max(16, m)
                and (c.kwargs["SPLIT_K"] == 1 or m <= SPLIT_K_MAX_BUCKET)]
        return kept or configs[:1]

    _w4a4_tuned = triton.autotune(configs=_TUNE_CONFIGS, key=["M_BUCKET", "N", "K"], reset_to_zero=["acc_ptr"],
                                  prune_configs_by={"early_config_prune": _prune})(_w4a4_kernel)

    def _m_bucket(m: int) -> int:
        return min(4096, 1 << max(0, m - 1).bit_length())

    def w4a4_matmul_triton(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero: int = 8,
                           w_centered: torch.Tensor | None = None, tuned: bool | None = None) -> torch.Tensor:
        """The triton kernel; ``tuned`` (default: on unless interpreting) picks the autotuned launch."""
        M, K = x_codes.shape
        N = w_packed.shape[0]
        if tuned is None:
            tuned = not interpreting()
        bucket = _m_bucket(M)
        y = torch.empty(M, N, dtype=torch.float32, device=x_codes.device)
        # the int32 split-K accumulator (zeroed) only where a split-K config can be picked; otherwise a 1-element
        # tensor for the pointer argument, which the kernel dereferences only when SPLIT_K > 1
        acc_shape = (M, N) if tuned and bucket <= SPLIT_K_MAX_BUCKET else (1,)
        acc = torch.zeros(acc_shape, dtype=torch.int32, device=x_codes.device)
        xs = x_scale.float().reshape(-1).contiguous()
        ws = w_scale.float().reshape(-1).contiguous()
        args = (x_codes.contiguous(), xs, x_zero.float().reshape(-1).contiguous(), w_packed.contiguous(), ws, y,
                acc, M, N, K, int(w_zero), bucket)
        if tuned:
            grid = lambda meta: (triton.cdiv(M, meta["BLOCK_M"]), triton.cdiv(N, meta["BLOCK_N"]),  # noqa: E731
                                 meta["SPLIT_K"])
            _w4a4_tuned[grid](*args)
            split = _w4a4_tuned.best_config.kwargs["SPLIT_K"]
        else:
            bm, bn, bk, split = 16, 32, 32, 1
            _w4a4_kernel[(triton.cdiv(M, bm), triton.cdiv(N, bn), split)](*args, BLOCK_M=bm, BLOCK_N=bn,
                                                                          BLOCK_K=bk, SPLIT_K=split)
        if split > 1:
            y = acc.float() * xs.reshape(-1, 1) * ws.reshape(1, -1)
        return y
except ImportError:  # pragma: no cover
    w4a4_matmul_triton = None


def w4a4_matmul(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero: int = 8, w_centered=None) -> torch.Tensor:
    """[M, K] codes × packed [N, K/2] → float32 [M, N] (triton on CUDA, reference elsewhere)."""
    if w4a4_matmul_triton is not None and use_triton(x_codes, w_packed):
        return w4a4_matmul_triton(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero)
    return w4a4_matmul_reference(x_codes, x_scale, x_zero, w_packed, w_scale, w_zero, w_centered)

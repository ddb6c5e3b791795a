"""Activation whitening for SVD compression (SVD-LLM, reused by ZS-SVD).

For a Linear ``y = W x`` with ``W [m, n]`` and calibration inputs ``x_t`` (t = 1..N), let
``C = (1/N) sum_t x_t x_t^T`` and ``L`` any factor with ``L L^T = C``. Then
``||(W - W') X||_F^2 / N = ||(W - W') L||_F^2``, so the truncated SVD of ``A = W L`` gives the
rank-k ``W'`` with the smallest output error on the calibration data, and that error equals
``sum_{i>k} sigma_i(A)^2`` (the optimality property tested in tests/test_compress_math.py).

Numerics (spec zs-svd §3.2 and §6): the covariance is symmetrised, non-finite entries are zeroed,
``eps * I`` is added to the *token-averaged* covariance (eps = 1e-4 default), and ``L`` is the
lower Cholesky factor computed in float64. If Cholesky fails, the eigen fallback
``L = Q diag(sqrt(max(lambda, eps)))`` is used; that ``L`` is not triangular, so every solve with it
is a general solve. ``L^{-1}`` is never formed explicitly.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class Whitener:
    """A factor ``L`` of an input covariance (``L L^T = C + eps I``) and solves against it."""

    L: torch.Tensor          # [n, n], float64
    triangular: bool         # True: lower Cholesky factor; False: eigen fallback

    def whiten(self, weight: torch.Tensor) -> torch.Tensor:
        """``A = W L`` (the matrix whose SVD is truncated)."""
        return weight.to(self.L.dtype) @ self.L

    def unwhiten(self, rows: torch.Tensor) -> torch.Tensor:
        """``M L^{-1}`` for ``M [k, n]`` (maps whitened right factors back to input space)."""
        rows = rows.to(self.L.dtype)
        if self.triangular:
            return torch.linalg.solve_triangular(self.L, rows, upper=False, left=False)
        return torch.linalg.solve(self.L, rows, left=False)

    def whiten_gradient(self, grad: torch.Tensor) -> torch.Tensor:
        """``H = G L^{-T}``: the loss gradient w.r.t. ``A`` when ``W = A L^{-1}`` (on ``L``'s device: the
        gradient profile keeps gradients on the CPU)."""
        grad = grad.to(device=self.L.device, dtype=self.L.dtype)
        if self.triangular:
            return torch.linalg.solve_triangular(self.L.T, grad, upper=True, left=False)
        return torch.linalg.solve(self.L.T, grad, left=False)


def identity_whitener(n: int, device=None) -> Whitener:
    return Whitener(torch.eye(n, dtype=torch.float64, device=device), True)


def whitener_from_covariance(cov: torch.Tensor, eps: float = 1e-4, overwrite: bool = False) -> Whitener:
    """Cholesky factor of the regularised covariance, with the eigen fallback.

    ``overwrite=True`` (a float64 ``cov`` the caller no longer needs; the layer-streamed compression's
    memory bound): on the CPU the factor is computed in ``cov``'s own storage by LAPACK
    (:mod:`lapack_inplace`; equal to the copying path to rounding), elsewhere the regularised matrix is built
    there, so one or two ``[n, n]`` matrices fewer are alive."""
    from llmtool.compress.lapack_inplace import cholesky_lower_, symmetrize_
    from llmtool.core.models import all_finite    # (core.models imports transformers: not at import time)

    c = cov.to(torch.float64)
    in_place = overwrite and c is cov and c.device.type == "cpu" and c.is_contiguous()
    if overwrite and c is cov:
        symmetrize_(c)          # by blocks, the same bits as (c + c.T) * 0.5 with no second [n, n] matrix
    else:
        c = c + c.T             # ``cov`` is never modified; every later step is in place
        c.mul_(0.5)             # == / 2 exactly (a power-of-two scaling)
    torch.nan_to_num_(c, nan=0.0, posinf=0.0, neginf=0.0)   # == where(isfinite(c), c, 0) without isfinite's
                                                             # [n, n] float temporaries (|c| is one)
    c.diagonal().add_(eps)
    if in_place:
        # factored in its own storage by LAPACK, so the returned ``L`` *is* ``cov``; on failure ``c`` is restored
        if cholesky_lower_(c):
            if all_finite(c):
                return Whitener(c, True)
            raise FloatingPointError("non-finite Cholesky factor of a finite covariance")
    else:
        L, info = torch.linalg.cholesky_ex(c)
        if int(info) == 0 and all_finite(L):      # chunked: no [n, n] temporaries next to L and c
            return Whitener(L, True)
    evals, evecs = torch.linalg.eigh(c)
    return Whitener(evecs * evals.clamp_min(eps).sqrt()[None, :], False)

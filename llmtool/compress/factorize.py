"""Shared pieces of every SVD-family method: per-module shapes and budget numbers, the SVD of a
(possibly whitened) weight, and the split-sqrt(sigma) factors kept for one module.

Budget (spec zs-svd §3): a module ``W [m, n]`` costs ``m*n (+ bias)`` dense and ``r*(m+n) (+ bias)``
at rank ``r``; its break-even rank is ``r* = max(1, floor((m*n - 1)/(m+n)))``, the largest rank at
which the factorised form is strictly smaller.

Factors: with ``A = W L = U diag(sigma) V^T`` the rank-k factors are ``B = U_k diag(sqrt sigma_k)``
``[m, k]`` and ``A_k = diag(sqrt sigma_k) V_k^T L^{-1}`` ``[k, n]`` (a solve, never an inverse);
splitting sqrt(sigma) gives both factors a similar dynamic range in half precision. All of it runs
in float64; factors are cast to the model dtype only when stored.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from llmtool.compress.whitening import Whitener


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    out_features: int  # m
    in_features: int   # n
    has_bias: bool = False

    @property
    def full_rank(self) -> int:
        return min(self.out_features, self.in_features)

    @property
    def dense_params(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.has_bias else 0)

    @property
    def per_rank(self) -> int:
        return self.out_features + self.in_features

    @property
    def break_even(self) -> int:
        m, n = self.out_features, self.in_features
        return max(1, (m * n - 1) // (m + n))

    def params_at_rank(self, r: int) -> int:
        """Parameters stored for this module at planned rank ``r`` (dense if ``r > r*``)."""
        bias = self.out_features if self.has_bias else 0
        return self.dense_params if r > self.break_even else r * self.per_rank + bias


def uniform_rank(spec: ModuleSpec, ratio: float) -> int:
    """Rank that removes ``ratio`` of this module's parameters (``floor((1-ratio) m n/(m+n))``);
    ratio 0 keeps the full rank (exact reconstruction, used in tests)."""
    if ratio <= 0:
        return spec.full_rank
    m, n = spec.out_features, spec.in_features
    return max(1, min(spec.full_rank, int((1 - ratio) * m * n // (m + n))))


@dataclass
class Spectrum:
    """What one module contributes: its singular values (descending), optional predicted loss
    change of deleting each component, and factors for its leading ``kept`` components."""

    spec: ModuleSpec
    sigma: torch.Tensor                 # [full_rank] float64, descending
    delta_loss: torch.Tensor | None     # [full_rank] float64 or None
    b_full: torch.Tensor                # [m, kmax]
    a_full: torch.Tensor                # [kmax, n]

    def factors(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k > self.b_full.shape[1]:
            raise ValueError(f"{self.spec.name}: rank {k} > stored {self.b_full.shape[1]} components")
        return self.a_full[:k].contiguous(), self.b_full[:, :k].contiguous()


def whitened_svd(weight: torch.Tensor, whitener: Whitener):
    """``U, sigma, Vh`` of ``W L`` in float64."""
    return torch.linalg.svd(whitener.whiten(weight), full_matrices=False)


def split_factors(u: torch.Tensor, sigma: torch.Tensor, vh: torch.Tensor, k: int,
                  right: Whitener | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [k, n], B [m, k])`` with ``B A = U_k diag(sigma_k) V_k^T L^{-1}``."""
    root = sigma[:k].clamp_min(0).sqrt()
    b = u[:, :k] * root[None, :]
    a = root[:, None] * vh[:k]
    if right is not None:
        a = right.unwhiten(a)
    return a, b

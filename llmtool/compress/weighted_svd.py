"""Diagonally weighted SVD baselines, uniform rank ``r = floor((1 - ratio) m n / (m + n))``.

- `fwsvd` (Hsu et al., "Language model compression with weighted low-rank factorization", ICLR
  2022): row importance ``I_j = sum_c mean_s (dL_s/dW_jc)^2`` over the gradient sequences s (the
  empirical Fisher diagonal: the mean of squared per-sequence gradients, not the square of their
  mean, which would cancel opposing sequences), ``D = diag(sqrt I)``;
  SVD of ``D W``; ``B = D^{-1} U_r diag(sqrt sigma_r)``, ``A = diag(sqrt sigma_r) V_r^T``.
  Reconstructed: ``I`` is floored at ``1e-12 * max(I)`` so rows with zero gradient stay invertible,
  and sqrt(sigma) is split between the factors (the spec's ``B = D^{-1} U Sigma, A = V^T`` is the
  same product).
- `asvd` (Yuan et al., "ASVD: Activation-aware Singular Value Decomposition", 2023): input-channel
  scale ``S = diag(mean_t |x_t|)^alpha`` with ``alpha = 0.5``; SVD of ``W S``;
  ``A = diag(sqrt sigma_r) V_r^T S^{-1}``. Scales are floored at ``1e-6 * max``. The original
  sensitivity-based rank search is not included (uniform rank, as the spec allows).
"""
from __future__ import annotations

import torch

from llmtool.compress.factorize import ModuleSpec, Spectrum, split_factors


class FisherWeightedSVD:
    needs_gram = False
    needs_grad = True
    grad_squares = True  # the pipeline hands decompose() mean_s g_s**2, and this squares nothing more
    needs_abs_mean = False
    uniform = True
    rule = None

    def decompose(self, spec: ModuleSpec, weight: torch.Tensor, stats, grad, eps: float, kmax: int) -> Spectrum:
        # grad holds mean_s g_s**2 (grad_squares); the profile keeps gradients on the CPU to save device memory
        importance = grad.to(device=weight.device, dtype=torch.float64).sum(1)
        d = importance.clamp_min(1e-12 * float(importance.max().clamp_min(1e-300))).sqrt()
        u, sigma, vh = torch.linalg.svd(d[:, None] * weight.double(), full_matrices=False)
        a, b = split_factors(u, sigma, vh, kmax)
        return Spectrum(spec, sigma, None, b / d[:, None], a)


class ActivationAwareSVD:
    needs_gram = False
    needs_grad = False
    needs_abs_mean = True
    uniform = True
    rule = None
    alpha = 0.5

    def decompose(self, spec: ModuleSpec, weight: torch.Tensor, stats, grad, eps: float, kmax: int) -> Spectrum:
        scale = stats.abs_mean(spec.name).double().pow(self.alpha)
        scale = scale.clamp_min(1e-6 * float(scale.max().clamp_min(1e-300)))
        u, sigma, vh = torch.linalg.svd(weight.double() * scale[None, :], full_matrices=False)
        a, b = split_factors(u, sigma, vh, kmax)
        return Spectrum(spec, sigma, None, b, a / scale[None, :])

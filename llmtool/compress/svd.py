"""Plain truncated SVD baseline (`--method svd`, the official code's `vanilla_svd` mode).

``W = U diag(sigma) V^T``; every target module keeps the uniform rank
``r = floor((1 - ratio) m n / (m + n))`` so each module loses ``ratio`` of its parameters.
Factors ``B = U_r diag(sqrt sigma_r)``, ``A = diag(sqrt sigma_r) V_r^T``. Uses no data.
"""
from __future__ import annotations

import torch

from llmtool.compress.factorize import ModuleSpec, Spectrum, split_factors


class PlainSVD:
    needs_gram = False
    needs_grad = False
    needs_abs_mean = False
    uniform = True
    rule = None

    def decompose(self, spec: ModuleSpec, weight: torch.Tensor, stats, grad, eps: float, kmax: int) -> Spectrum:
        u, sigma, vh = torch.linalg.svd(weight.double(), full_matrices=False)
        a, b = split_factors(u, sigma, vh, kmax)
        return Spectrum(spec, sigma, None, b, a)

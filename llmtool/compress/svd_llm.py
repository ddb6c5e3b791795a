"""SVD-LLM-style whitened SVD baseline (`--method svd-llm`; Wang et al., "SVD-LLM: Truncation-aware
Singular Value Decomposition for LLM Compression", ICLR 2025; official `svdllm` mode of ZS-SVD).

``A = W L`` with ``L L^T`` the regularised input covariance (:mod:`whitening`), truncated SVD of
``A`` at the uniform rank ``r = floor((1 - ratio) m n / (m + n))``, factors
``B = U_r diag(sqrt sigma_r)``, ``A_r = diag(sqrt sigma_r) V_r^T L^{-1}``. Truncating the whitened
SVD minimises the layer-output error on the calibration data. It isolates the value of ZS-SVD's
global allocation: same whitening, same budget, uniform ranks. (SVD-LLM's optional parameter
update after truncation is not part of this baseline, as in the ZS-SVD comparison.)
"""
from __future__ import annotations

import torch

from llmtool.compress.factorize import ModuleSpec, Spectrum, split_factors, whitened_basis, whitened_svd
from llmtool.compress.whitening import whitener_from_covariance


class WhitenedSVD:
    needs_gram = True
    needs_grad = False
    needs_abs_mean = False
    uniform = True
    rule = None

    def decompose(self, spec: ModuleSpec, weight: torch.Tensor, stats, grad, eps: float, kmax: int,
                  whitener=None, low_memory=False, release_whitener: bool = False) -> Spectrum:
        """``whitener``: the module's input whitener when the caller already has it (shared by the modules
        that read one input; the layer-streamed path), else made from ``stats``; ``low_memory`` (False, True
        or a spill directory) as in :func:`whitened_svd`; ``release_whitener`` as in :func:`whitened_basis` (the
        caller's whitener is not used again)."""
        if whitener is None:
            whitener = whitener_from_covariance(stats.covariance(spec.name), eps)
        if low_memory:     # Q^T = V^T L^{-1} in V^T's storage, then the factors from it (one [k, n] matrix less)
            u, sigma, qt = whitened_basis(weight, whitener, low_memory, release_whitener)
            a, b = split_factors(u, sigma, qt, kmax)
            del qt
        else:
            u, sigma, vh = whitened_svd(weight, whitener)
            a, b = split_factors(u, sigma, vh, kmax, right=whitener)
            del vh
        del u
        return Spectrum(spec, sigma, None, b, a)

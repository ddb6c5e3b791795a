"""Registration of ZS-SVD and its selection ablations (the math lives in :mod:`zs_svd`).

All three whiten like SVD-LLM and keep, per module, factors for up to ``r*`` components; they differ
only in how the global selection orders components: ``zs-svd`` (zero-sum over signed predicted
loss changes), ``sigma-global`` (smallest whitened sigma first, no gradients), ``abs-delta``
(smallest |predicted loss change| first, no sign balancing).
"""
from __future__ import annotations

import torch

from llmtool.compress.factorize import ModuleSpec, Spectrum, split_factors, whitened_svd
from llmtool.compress.whitening import whitener_from_covariance
from llmtool.compress.zs_svd import predicted_loss_change, singular_value_gradients


class _GlobalWhitened:
    needs_gram = True
    needs_abs_mean = False
    uniform = False
    needs_grad = True
    streams_gradient = True   # the layer-streamed pipeline reduces each gradient to its r-vector (streamed.py)
    rule = "zero-sum"

    def decompose(self, spec: ModuleSpec, weight: torch.Tensor, stats, grad, eps: float, kmax: int) -> Spectrum:
        whitener = whitener_from_covariance(stats.covariance(spec.name), eps)
        u, sigma, vh = whitened_svd(weight, whitener)
        delta = None
        if self.needs_grad:
            delta = predicted_loss_change(sigma, singular_value_gradients(u, vh, grad, whitener))
        a, b = split_factors(u, sigma, vh, kmax, right=whitener)
        return Spectrum(spec, sigma, delta, b, a)


class ZeroSumSVD(_GlobalWhitened):
    rule = "zero-sum"


class SigmaGlobalSVD(_GlobalWhitened):
    needs_grad = False
    rule = "sigma-global"


class AbsDeltaSVD(_GlobalWhitened):
    rule = "abs-delta"

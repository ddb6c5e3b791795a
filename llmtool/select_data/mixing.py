"""Domain-weight mixers run on any taxonomy (GEM spec §3.6–3.7): the DoReMi weight update and RegMix's
mixture regression. This module holds the weight mathematics; the proxy models that produce the
per-domain losses are in :mod:`llmtool.select_data.proxies`.

DoReMi (Xie et al., NeurIPS 2023): exponentiated-gradient ascent on per-domain excess loss
λ_t[k] = mean over domain-k tokens of max(ℓ_proxy − ℓ_ref, 0): α' = α_{t−1} ⊙ exp(η λ_t),
α_t = (1 − c) α'/Σα' + c/K; the output is the step average ᾱ = (1/T) Σ_t α_t.

RegMix (Liu et al., ICLR 2025): mixtures w ~ Dirichlet(s · t) with s log-uniform in [0.1, 5] around the
natural distribution t; a regressor w → loss fitted on proxy runs; the output averages the top 100 of
S candidates drawn from the same prior by predicted loss. The regressor here is a quadratic ridge
model (degree-2 features) [ours; the spec's LightGBM is an optional dependency not installed], or plain
linear ridge (the spec's check regressor).
"""
from __future__ import annotations

import numpy as np


def doremi_step(alpha: np.ndarray, excess: np.ndarray, eta: float = 1.0, smooth: float = 1e-3) -> np.ndarray:
    k = len(alpha)
    a = alpha * np.exp(eta * np.maximum(excess, 0.0))
    a = a / a.sum()
    return (1.0 - smooth) * a + smooth / k


def doremi_weights(excess_fn, k: int, steps: int, eta: float = 1.0, smooth: float = 1e-3, on_update=None,
                   progress=None) -> dict:
    """Run ``steps`` DoReMi updates; ``excess_fn(t, alpha_prev)`` returns the per-domain excess loss λ_t and
    ``on_update(t, alpha_t)`` (the proxy's parameter step) sees the weights just updated, as in Algorithm 1."""
    alpha = np.full(k, 1.0 / k)
    trace = []
    for t in (progress(range(steps)) if progress else range(steps)):
        alpha = doremi_step(alpha, np.asarray(excess_fn(t, alpha), dtype=np.float64), eta, smooth)
        if on_update is not None:
            on_update(t, alpha)
        trace.append(alpha.copy())
    trace = np.array(trace)
    return {"weights": trace.mean(0), "last": trace[-1], "trace": trace}


def dirichlet_mixtures(natural: np.ndarray, m: int, rng: np.random.Generator) -> np.ndarray:
    t = np.asarray(natural, dtype=np.float64)
    s = np.exp(rng.uniform(np.log(0.1), np.log(5.0), size=m))
    return np.stack([rng.dirichlet(np.maximum(si * t * len(t), 1e-3)) for si in s])


def _quad(w: np.ndarray) -> np.ndarray:
    w = np.atleast_2d(w)
    iu = np.triu_indices(w.shape[1])
    return np.concatenate([w, (w[:, :, None] * w[:, None, :])[:, iu[0], iu[1]]], axis=1)


REGRESSORS = ("quadratic", "linear")


def _features(w: np.ndarray, regressor: str) -> np.ndarray:
    if regressor == "quadratic":
        return _quad(w)
    if regressor == "linear":
        return np.atleast_2d(w)
    raise ValueError(f"regressor {regressor!r}: one of {REGRESSORS}")


def regmix_fit(w: np.ndarray, loss: np.ndarray, ridge: float = 1e-4, regressor: str = "quadratic"):
    """Fit loss ≈ f(w) by ridge regression on quadratic or linear features; returns a predict function."""
    x = _features(w, regressor)
    xm, ym = x.mean(0), loss.mean()
    xc = x - xm
    coef = np.linalg.solve(xc.T @ xc + ridge * np.eye(x.shape[1]), xc.T @ (loss - ym))
    return lambda ww: (_features(ww, regressor) - xm) @ coef + ym


def regmix_weights(w: np.ndarray, loss: np.ndarray, natural: np.ndarray, candidates: int = 100_000,
                   top: int = 100, seed: int = 0, regressor: str = "quadratic") -> dict:
    rng = np.random.default_rng(seed)
    predict = regmix_fit(w, loss, regressor=regressor)
    cand = dirichlet_mixtures(natural, candidates, rng)
    pred = np.concatenate([predict(cand[i:i + 4096]) for i in range(0, len(cand), 4096)])  # bounded memory
    best = cand[np.argsort(pred)[:top]].mean(0)
    return {"weights": best / best.sum(), "predict": predict}

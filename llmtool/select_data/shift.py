"""SHIFT — training-free RLVR data selection from single-rollout hidden-state dynamics.

Paper: Wu, Cai, Wang, Ye, Schmidt, George, "Single-Rollout Hidden-State Dynamics for Training-Free
RLVR Data Selection", arXiv 2605.28631 (ICML 2026). No official code; this follows
../specs/shift.md with the issue's corrections as defaults (the spec's choices remain flags):

- One greedy rollout per pool prompt (chat template + step-by-step instruction). One forward pass over
  prompt + rollout gives the hidden states; the representation of a position is the hidden state
  *averaged over the decoder layers* (``layers="mean"``; ``last`` = final layer, spec default).
- Anchors: s(x) at the start of the reasoning (the last prompt token, whose logits emit the first
  generated token) and e(x) at its end (the last generated token). RIRS Δ(x) = e(x) − s(x) in float32.
- Quality q(x) = log(1 + ‖Δ(x)‖₂) (corrections; ``--quality rank|minmax|raw`` are the spec's variants),
  weight w = q^γ (γ = 1).
- Feature φ(x) = [s; α Δ] / ‖[s; α Δ]‖ (joint normalisation, corrections; ``--feature split`` is the
  spec's [ŝ; α Δ̂]).
- Quality-weighted greedy farthest-first: first pick argmax q, then repeatedly the point maximising
  w(x) · d(x, S), with d(x, S) = min over picks of the Euclidean distance in φ, updated incrementally
  after each pick: O(N·B·D) time, O(N) extra memory (ties → lower pool index).

Baselines (label-free, same budget and outputs) live in ``baselines.py``.
"""
from __future__ import annotations

import numpy as np


def quality(u: np.ndarray, mode: str = "log1p") -> np.ndarray:
    u = np.asarray(u, dtype=np.float64)
    if mode == "log1p":
        return np.log1p(u)
    if mode == "rank":
        order = np.argsort(np.argsort(u, kind="stable"), kind="stable")
        return (order + 1.0) / len(u)
    if mode == "minmax":
        span = u.max() - u.min()
        return np.clip((u - u.min()) / span if span > 0 else np.ones_like(u), 1e-3, 1.0)
    if mode == "raw":
        return u / max(u.max(), 1e-300)
    raise ValueError(f"unknown quality mode {mode!r}")


def features(s: np.ndarray, delta: np.ndarray, alpha: float = 1.0, mode: str = "joint") -> np.ndarray:
    """φ(x): joint [s; αΔ]/‖[s; αΔ]‖ (default) or split [s/‖s‖; α Δ/‖Δ‖]."""
    s = np.asarray(s, dtype=np.float64)
    delta = np.asarray(delta, dtype=np.float64)
    if mode == "joint":
        phi = np.concatenate([s, alpha * delta], axis=1)
        return phi / np.maximum(np.linalg.norm(phi, axis=1, keepdims=True), 1e-12)
    if mode == "split":
        sh = s / np.maximum(np.linalg.norm(s, axis=1, keepdims=True), 1e-12)
        dh = delta / np.maximum(np.linalg.norm(delta, axis=1, keepdims=True), 1e-12)
        return np.concatenate([sh, alpha * dh], axis=1)
    if mode == "prompt":
        return s / np.maximum(np.linalg.norm(s, axis=1, keepdims=True), 1e-12)
    raise ValueError(f"unknown feature mode {mode!r}")


class DistanceCounter:
    """Counts point-to-point distance evaluations (the complexity test reads it)."""

    def __init__(self):
        self.count = 0


def weighted_farthest_first(phi: np.ndarray, budget: int, weight: np.ndarray | None = None,
                            first: int | None = None, counter: DistanceCounter | None = None):
    """Greedy (weighted) farthest-first traversal.

    Returns (picked indices in selection order, min_dist at pick time for each pick). ``weight`` None
    means unweighted k-center greedy; ``first`` defaults to argmax weight (argmax q) or index 0."""
    n = phi.shape[0]
    budget = min(int(budget), n)
    w = np.ones(n) if weight is None else np.asarray(weight, dtype=np.float64)
    if first is None:
        first = int(np.argmax(w)) if weight is not None else 0
    picked = [first]
    gaps = [float("inf")]
    d = np.linalg.norm(phi - phi[first], axis=1).astype(np.float64)
    if counter is not None:
        counter.count += n
    chosen = np.zeros(n, dtype=bool)
    chosen[first] = True
    while len(picked) < budget:
        score = np.where(chosen, -np.inf, w * d)
        nxt = int(np.argmax(score))  # argmax returns the lowest index among ties
        picked.append(nxt)
        gaps.append(float(d[nxt]))
        chosen[nxt] = True
        d = np.minimum(d, np.linalg.norm(phi - phi[nxt], axis=1))
        if counter is not None:
            counter.count += n
    return np.array(picked, dtype=int), np.array(gaps)


def coverage_radius(phi: np.ndarray, picked: np.ndarray) -> float:
    d = np.full(phi.shape[0], np.inf)
    for p in picked:
        d = np.minimum(d, np.linalg.norm(phi - phi[p], axis=1))
    return float(d.max())


def shift_select(s: np.ndarray, e: np.ndarray, budget: int, *, alpha: float = 1.0, gamma: float = 1.0,
                 quality_mode: str = "log1p", feature_mode: str = "joint", counter=None) -> dict:
    """SHIFT selection from start/end states. Returns picks and per-pick diagnostics."""
    delta = np.asarray(e, dtype=np.float64) - np.asarray(s, dtype=np.float64)
    u = np.linalg.norm(delta, axis=1)
    q = quality(u, quality_mode)
    w = q ** gamma
    phi = features(s, delta, alpha, feature_mode)
    picked, gaps = weighted_farthest_first(phi, budget, w, first=int(np.argmax(q)), counter=counter)
    return {"picked": picked, "rirs_norm": u[picked], "quality": q[picked], "min_dist": gaps,
            "coverage_radius": coverage_radius(phi, picked), "u": u, "phi": phi}

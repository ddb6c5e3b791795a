"""Replay simulation of best-model identification methods over score matrices, and the synthetic
IRT generator with planted truth (spec sysr.md, sections 5 and 8).

Protocol: per method and budget fraction f (budget T = max(K, round(f * K * N))), R replays with
independent generators seeded by (seed, method, f, replay). Error rate = share of replays whose answer is
not among the exactly tied best full-benchmark means; Wilson 95% interval; mean simple regret in accuracy
points. Budget needed = smallest f on the grid with error <= delta (0.05); worst case = max over benchmarks.

Synthetic generator (``irt``): item difficulties b_j ~ N(0, spread^2), per-(model, item) noise
e_aj ~ N(0, 0.3^2), target accuracies linspace(0.55, 0.70, K) with the last replaced by (second-last + gap);
each model's ability theta_a is found by bisection so that mean_j sigmoid(theta_a - b_j + e_aj) equals its
target; X_aj ~ Bernoulli(sigmoid(theta_a - b_j + e_aj)). A large spread makes models agree on most items
(shared difficulty), a small spread makes them nearly independent.
"""
from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmtool.evaluate.bai import parse_method
from llmtool.evaluate.results_io import ScoreMatrix
from llmtool.evaluate.sysr import MatrixOracle


def synthetic_irt(k: int = 10, n: int = 2000, gap: float = 0.05, spread: float = 3.0, seed: int = 0,
                  noise: float = 0.3, low: float = 0.55, high: float = 0.70) -> ScoreMatrix:
    from llmtool.core.console import UsageError

    for name, v in (("gap", gap), ("spread", spread)):
        if not math.isfinite(v) or v < 0:
            raise UsageError(f"--{name} {v}: must be a finite number >= 0")
    top = (low + (high - low) * (k - 2) / max(1, k - 1)) + gap if k >= 2 else high
    if not 0 < top < 1:
        raise UsageError(f"--gap {gap}: the best model's target accuracy would be {top:.3f}, outside (0, 1)")
    rng = np.random.default_rng(seed)
    b = rng.normal(0.0, spread, n)
    e = rng.normal(0.0, noise, (k, n))
    targets = np.linspace(low, high, k)
    if k >= 2:
        targets[-1] = targets[-2] + gap
    thetas = np.empty(k)
    for a in range(k):
        lo, hi = -30.0, 30.0
        for _ in range(100):
            mid = 0.5 * (lo + hi)
            if np.mean(_sigmoid(mid - b + e[a])) < targets[a]:
                lo = mid
            else:
                hi = mid
        thetas[a] = 0.5 * (lo + hi)
    p = _sigmoid(thetas[:, None] - b[None, :] + e)
    x = (rng.random((k, n)) < p).astype(float)
    return ScoreMatrix([f"model_{a}" for a in range(k)], [f"q{j}" for j in range(n)], x,
                       source=f"synthetic:irt(k={k},n={n},gap={gap},spread={spread},seed={seed})")


def _sigmoid(z):
    return 1.0 / (1.0 + np.exp(-z))


def wilson(errors: int, total: int, z: float = 1.959963984540054) -> tuple[float, float]:
    """:func:`llmtool.core.intervals.wilson` with the endpoints exact at 0 and total errors."""
    from llmtool.core.intervals import wilson as wilson_interval

    if total == 0:
        return 0.0, 1.0
    lo, hi = wilson_interval(errors, total, z)
    return (0.0 if errors == 0 else lo), (1.0 if errors == total else hi)


def _stream(seed: int, method: str, frac_index: int, rep: int) -> np.random.Generator:
    tag = zlib.crc32(method.encode())
    return np.random.default_rng(np.random.SeedSequence([seed, tag, frac_index, rep]))


@dataclass
class SimRow:
    method: str
    budget_frac: float
    budget: int
    rep_count: int
    error_rate: float
    error_ci_low: float
    error_ci_high: float
    mean_regret: float
    max_used: int
    benchmark: str


def budget_for(frac: float, k: int, n: int) -> int:
    return int(max(k, round(frac * k * n)))


def simulate(matrix: ScoreMatrix, methods: Sequence[str], fracs: Sequence[float], reps: int, seed: int = 0,
             benchmark: str = "", method_params: dict[str, dict] | None = None,
             reps_per_method: dict[str, int] | None = None, progress=None) -> list[SimRow]:
    """Error rate, CI and regret per (method, budget fraction) over ``reps`` replays."""
    mu = matrix.scores.mean(axis=1)
    best = set(matrix.best())
    k, n = matrix.shape
    rows: list[SimRow] = []
    jobs = [(m, fi, f) for m in methods for fi, f in enumerate(fracs)]
    for m, fi, f in (progress(jobs, "bai-sim") if progress else jobs):
        label = m
        cfg = parse_method(m, **dict((method_params or {}).get(m, {})))   # "ucbe@0.1": UCB-E with a = 0.1
        name = cfg.name
        budget = budget_for(f, k, n)
        r_count = (reps_per_method or {}).get(name, reps)
        errors, regret, max_used = 0, 0.0, 0
        for rep in range(r_count):
            rng = _stream(seed, label, fi, rep)
            oracle = MatrixOracle(matrix.scores, rng, matrix.samples)
            res = cfg.run(oracle, budget, rng)
            if name != "full" and oracle.used > budget:
                raise AssertionError(f"{name} used {oracle.used} > budget {budget}")
            max_used = max(max_used, oracle.used)
            errors += res.best not in best
            regret += mu.max() - mu[res.best]
        lo, hi = wilson(errors, r_count)
        rows.append(SimRow(label, float(f), budget, r_count, errors / r_count, lo, hi,
                           100.0 * regret / r_count, max_used, benchmark or matrix.source))
    return rows


def budget_needed(rows: Sequence[SimRow], delta: float = 0.05) -> dict[str, dict[str, float | None]]:
    """Per benchmark and method: the smallest budget fraction with error <= delta (None = not reached)."""
    out: dict[str, dict[str, float | None]] = {}
    for r in sorted(rows, key=lambda r: r.budget_frac):
        bench = out.setdefault(r.benchmark, {})
        if r.method not in bench:
            bench[r.method] = None
        if bench[r.method] is None and r.error_rate <= delta:
            bench[r.method] = r.budget_frac
    return out


def summarise(rows: Sequence[SimRow], delta: float = 0.05) -> dict:
    """Average error and worst-case budget per method (None when some benchmark never reaches delta)."""
    needed = budget_needed(rows, delta)
    methods = list(dict.fromkeys(r.method for r in rows))
    summary = {}
    for m in methods:
        errs = [r.error_rate for r in rows if r.method == m]
        per_bench = {b: v.get(m) for b, v in needed.items()}
        worst = None if any(v is None for v in per_bench.values()) else max(per_bench.values())
        summary[m] = {"average_error": float(np.mean(errs)), "budget_needed": per_bench,
                      "worst_case_budget": worst}
    return {"delta": delta, "methods": summary}

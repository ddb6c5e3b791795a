"""Replay simulation of best-model identification methods over score matrices, and the synthetic
IRT generator with planted truth (spec sysr.md, sections 5 and 8).

Protocol: per method and budget fraction f (budget T = max(K, round(f * K * N))), R replays. Common random
numbers: replay r of every method at every budget starts from the same generator, seeded by (seed, r), so
two methods that draw queries the same way see the same queries and differences between methods are
measured on paired replays (:func:`paired_comparison`, Newcombe's paired-difference interval). Every
method gets the same R unless a per-method count is given explicitly. Error rate = share of replays whose
answer is not among the exactly tied best full-benchmark means; Wilson 95% interval; mean simple regret
in accuracy points. Budget needed = smallest f on the grid with error <= delta (0.05); worst case = max
over benchmarks. ``workers`` > 1 runs the (method, budget) cells in that many processes (same results).

Synthetic generator (``irt``): item difficulties b_j ~ N(0, spread^2), per-(model, item) noise
e_aj ~ N(0, 0.3^2), target accuracies linspace(0.55, 0.70, K) with the last replaced by (second-last + gap);
each model's ability theta_a is found by bisection so that mean_j sigmoid(theta_a - b_j + e_aj) equals its
target; X_aj ~ Bernoulli(sigmoid(theta_a - b_j + e_aj)). A large spread makes models agree on most items
(shared difficulty), a small spread makes them nearly independent.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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


def _stream(seed: int, rep: int) -> np.random.Generator:
    """Replay ``rep``'s generator: the same for every method and budget (common random numbers)."""
    return np.random.default_rng(np.random.SeedSequence([seed, rep]))


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
    wrong: str = ""          # per replay, "1" where the answer was wrong (for paired comparisons)


def budget_for(frac: float, k: int, n: int) -> int:
    return int(max(k, round(frac * k * n)))


def _cell(matrix: ScoreMatrix, label: str, params: dict, frac: float, r_count: int, seed: int,
          benchmark: str) -> SimRow:
    mu = matrix.scores.mean(axis=1)
    best = set(matrix.best())
    k, n = matrix.shape
    cfg = parse_method(label, **params)          # "ucbe@0.1": UCB-E with a = 0.1
    budget = budget_for(frac, k, n)
    wrong, regret, max_used = [], 0.0, 0
    for rep in range(r_count):
        rng = _stream(seed, rep)
        oracle = MatrixOracle(matrix.scores, rng, matrix.samples)
        res = cfg.run(oracle, budget, rng)
        if cfg.name != "full" and oracle.used > budget:
            raise AssertionError(f"{cfg.name} used {oracle.used} > budget {budget}")
        max_used = max(max_used, oracle.used)
        wrong.append(res.best not in best)
        regret += mu.max() - mu[res.best]
    errors = sum(wrong)
    lo, hi = wilson(errors, r_count)
    return SimRow(label, float(frac), budget, r_count, errors / r_count, lo, hi, 100.0 * regret / r_count,
                  max_used, benchmark or matrix.source, "".join("1" if w else "0" for w in wrong))


def simulate(matrix: ScoreMatrix, methods: Sequence[str], fracs: Sequence[float], reps: int, seed: int = 0,
             benchmark: str = "", method_params: dict[str, dict] | None = None,
             reps_per_method: dict[str, int] | None = None, progress=None, workers: int = 1) -> list[SimRow]:
    """Error rate, CI and regret per (method, budget fraction) over ``reps`` replays (common random
    numbers across methods and budgets; see the module docstring)."""
    jobs = []
    for m in methods:
        name = parse_method(m, **dict((method_params or {}).get(m, {}))).name
        for f in fracs:
            jobs.append((m, dict((method_params or {}).get(m, {})), float(f), (reps_per_method or {}).get(name, reps)))
    if workers > 1 and len(jobs) > 1:
        from concurrent.futures import ProcessPoolExecutor

        with ProcessPoolExecutor(max_workers=workers) as pool:
            futures = [pool.submit(_cell, matrix, m, p, f, r, seed, benchmark) for m, p, f, r in jobs]
            it = progress(futures, "bai-sim") if progress else futures
            return [fut.result() for fut in it]
    return [_cell(matrix, m, p, f, r, seed, benchmark) for m, p, f, r in (progress(jobs, "bai-sim") if progress else jobs)]


def paired_comparison(a: SimRow, b: SimRow) -> dict:
    """Error-rate difference a - b over the same replays (common random numbers), with Newcombe's
    paired-difference 95% interval; ``a_only``/``b_only`` count replays where only that method erred."""
    from llmtool.core.intervals import paired_difference

    if len(a.wrong) != len(b.wrong) or not a.wrong:
        raise ValueError("paired comparison needs the same replays of both methods")
    a_only = sum(x == "1" and y == "0" for x, y in zip(a.wrong, b.wrong))
    b_only = sum(x == "0" and y == "1" for x, y in zip(a.wrong, b.wrong))
    both = sum(x == "1" and y == "1" for x, y in zip(a.wrong, b.wrong))
    d, lo, hi = paired_difference(a_only, b_only, both, len(a.wrong))
    return {"a": a.method, "b": b.method, "budget_frac": a.budget_frac, "benchmark": a.benchmark,
            "difference": d, "ci_low": lo, "ci_high": hi, "a_only": a_only, "b_only": b_only, "both": both}


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

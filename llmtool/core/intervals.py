"""Confidence intervals shared by the areas' evaluations and the benchmarks (torch-free)."""
from __future__ import annotations

import math


def wilson(k: int, n: int, z: float = 1.96) -> tuple[float, float]:
    """Wilson score interval of a binomial proportion k/n (z = 1.96: 95 %); (0, 1) when n = 0."""
    if n == 0:
        return (0.0, 1.0)
    p = k / n
    den = 1 + z * z / n
    centre = (p + z * z / (2 * n)) / den
    half = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n)) / den
    return (max(0.0, centre - half), min(1.0, centre + half))


def paired_difference(a_only: int, b_only: int, both: int, n: int, z: float = 1.96) -> tuple[float, float, float]:
    """Difference p_A - p_B of two proportions measured on the same n units (paired, e.g. two methods'
    error rates over common random numbers), with Newcombe's (1998, method 10) hybrid score interval.
    ``a_only``: units where only A has the event, ``b_only``: only B, ``both``: both.
    Returns (difference, low, high)."""
    if n == 0:
        return 0.0, -1.0, 1.0
    neither = n - a_only - b_only - both
    if neither < 0 or min(a_only, b_only, both) < 0:
        raise ValueError(f"paired counts {a_only}, {b_only}, {both} do not fit in n = {n}")
    p1, p2 = (both + a_only) / n, (both + b_only) / n
    l1, u1 = wilson(both + a_only, n, z)
    l2, u2 = wilson(both + b_only, n, z)
    den = (both + a_only) * (neither + b_only) * (both + b_only) * (neither + a_only)
    phi = (both * neither - a_only * b_only) / math.sqrt(den) if den > 0 else 0.0
    diff = p1 - p2
    lo = diff - math.sqrt(max(0.0, (p1 - l1) ** 2 - 2 * phi * (p1 - l1) * (u2 - p2) + (u2 - p2) ** 2))
    hi = diff + math.sqrt(max(0.0, (u1 - p1) ** 2 - 2 * phi * (u1 - p1) * (p2 - l2) + (p2 - l2) ** 2))
    return diff, max(-1.0, lo), min(1.0, hi)


def bootstrap_mean_ci(values, idx, level: float = 0.95) -> tuple[float, float]:
    """Percentile bootstrap interval of the mean of ``values`` (one per unit, e.g. paired differences per
    problem or per category) over the resamples ``idx`` [draws, n] of unit indices. Passing one ``idx`` for
    several metrics resamples them in common."""
    import numpy as np

    boots = np.asarray(values)[idx].mean(axis=1)
    tail = round(50 * (1 - level), 10)
    return float(np.percentile(boots, tail)), float(np.percentile(boots, 100 - tail))

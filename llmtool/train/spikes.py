"""Spike score of a training series (loss or global gradient norm).

AdaGC (Wang et al., ICML 2026) reports a per-run "spike score"; the definition here is the OLMo-2
convention the spec adopts (reconstructed, ../shared/specs/adagc.md §5): the percentage of steps
i >= window whose value exceeds the mean of the preceding ``window`` values by at least ``sigma``
standard deviations (population std). A step counts only if it is strictly above the window mean, so a
constant series scores 0. Non-finite values count as spikes.
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def spike_flags(values: Sequence[float], window: int = 1000, sigma: float = 7.0) -> np.ndarray:
    """Boolean per step (False for the first ``window`` steps)."""
    if window < 1:
        raise ValueError("window must be >= 1")
    if sigma < 0:
        raise ValueError("sigma must be >= 0")
    x = np.asarray(values, dtype=np.float64)
    flags = np.zeros(len(x), dtype=bool)
    if len(x) <= window:
        return flags
    finite = np.where(np.isfinite(x), x, np.nan)
    c1 = np.concatenate([[0.0], np.nancumsum(finite)])
    c2 = np.concatenate([[0.0], np.nancumsum(finite ** 2)])
    cnt = np.concatenate([[0], np.cumsum(np.isfinite(x))])
    for i in range(window, len(x)):
        if not math.isfinite(x[i]):
            flags[i] = True
            continue
        n = cnt[i] - cnt[i - window]
        if n == 0:
            continue
        mean = (c1[i] - c1[i - window]) / n
        var = max((c2[i] - c2[i - window]) / n - mean * mean, 0.0)
        dev = x[i] - mean
        flags[i] = dev > 1e-12 * max(1.0, abs(mean)) and dev >= sigma * math.sqrt(var)
    return flags


def spike_score(values: Sequence[float], window: int = 1000, sigma: float = 7.0) -> float:
    """Percentage (0..100) of steps after the first ``window`` that are spikes."""
    n = len(values) - window
    if n <= 0:
        return 0.0
    return 100.0 * float(spike_flags(values, window, sigma).sum()) / n

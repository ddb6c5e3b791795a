"""PIPE metrics (pipe-interface.md §3.3–3.4): success rate per rewrite, drops, and Interface Reliance.

IR [code-exact]: per episode ``ℓ = log((d0 + α)/(d1 + α))`` with α = 1 (d0 original-name actions, d1
alias actions); ``L_o`` = mean over the episodes of ordering o; ``IR = exp((L_OS + L_SO)/2)``. The 95 %
CI resamples episodes within each ordering (percentile bootstrap, 2,000 draws, seeded). Success-rate CIs
are Wilson intervals [R].
"""
from __future__ import annotations

import math

import numpy as np

from llmtool.core.intervals import wilson


def episode_logodds(d0: int, d1: int, alpha: float = 1.0) -> float:
    return math.log((d0 + alpha) / (d1 + alpha))


def interface_reliance(ori_first: list[dict], syn_first: list[dict], alpha: float = 1.0, draws: int = 2000,
                       seed: int = 0) -> dict:
    """``ori_first``/``syn_first``: episode records with ``orig_calls`` and ``alias_calls``."""
    if not ori_first or not syn_first:
        raise ValueError("both orderings need at least one episode")
    l_os = np.array([episode_logodds(e["orig_calls"], e["alias_calls"], alpha) for e in ori_first])
    l_so = np.array([episode_logodds(e["orig_calls"], e["alias_calls"], alpha) for e in syn_first])
    ir = math.exp((l_os.mean() + l_so.mean()) / 2)
    rng = np.random.default_rng(seed)
    a = l_os[rng.integers(0, len(l_os), (draws, len(l_os)))].mean(1)
    b = l_so[rng.integers(0, len(l_so), (draws, len(l_so)))].mean(1)
    boot = np.exp((a + b) / 2)
    eps = ori_first + syn_first
    acting = [e for e in eps if e["orig_calls"] + e["alias_calls"] > 0]
    only_orig = sum(1 for e in acting if e["alias_calls"] == 0) / len(acting) if acting else float("nan")
    return {"ir": ir, "ir_lo": float(np.quantile(boot, 0.025)), "ir_hi": float(np.quantile(boot, 0.975)),
            "md_ori_first": math.exp(l_os.mean()), "md_syn_first": math.exp(l_so.mean()),
            "episodes": [len(l_os), len(l_so)], "share_only_original": only_orig}


def summarize(episodes: list[dict]) -> dict:
    n = len(episodes)
    k = sum(1 for e in episodes if e["success"])
    lo, hi = wilson(k, n) if n else (float("nan"), float("nan"))
    calls = sum(e["rounds"] for e in episodes) or 1
    return {"episodes": n, "sr": k / n if n else float("nan"), "sr_lo": lo, "sr_hi": hi,
            "mean_reward": sum(e["reward"] for e in episodes) / n if n else float("nan"),
            "deprecated_rate": sum(e["deprecated_calls"] for e in episodes) / calls,
            "invalid_rate": sum(e["invalid_calls"] for e in episodes) / calls,
            "orig_calls": sum(e["orig_calls"] for e in episodes),
            "alias_calls": sum(e["alias_calls"] for e in episodes),
            "prompt_tokens": sum(e["usage"]["prompt"] for e in episodes),
            "completion_tokens": sum(e["usage"]["completion"] for e in episodes)}

"""SySRs: Synchronized Successive Rejects for identifying the best LLM under an evaluation budget.

Paper: Lyu, Nejma, Wegel, Yang, Dorner, "Cutting LLM Evaluation Costs with SySRs: A Bandit Algorithm
that Provably Exploits Model Similarity" (arXiv 2606.07726, ICML 2026).

Setting: K models, a finite benchmark of N queries, scores X[a, j] in [0, 1]. The target is the model with
the largest full-benchmark mean mu_a = (1/N) sum_j X[a, j]; the budget T counts (model, query) evaluations.

Phase schedule (classical Successive Rejects, Audibert, Bubeck & Munos 2010):
    logbar(K) = 1/2 + sum_{i=2..K} 1/i,   n_0 = 0,
    n_k = ceil((T - K) / (logbar(K) * (K + 1 - k))),   k = 1..K-1.
Phase k has K + 1 - k survivors, each evaluated on n_k - n_{k-1} new queries, so the total
n_1 + ... + n_{K-1} + n_{K-1} <= T.

SySRs (what this module implements; the paper's pseudo-code could not be checked, so the algorithm
below is the reading of "Successive Rejects with every survivor evaluated on the same fresh queries"):
    pi <- seeded random permutation of the N queries (drawn without replacement)
    for k = 1..K-1:
        m <- min(n_k, N); evaluate every survivor on pi[n_{k-1} .. m)
        if m == N: return argmax of the exact sums (marked ``exhausted``)
        S_a <- sum_{j in pi[0..m)} X[a, j]    (all survivors share the query set, so S_a - S_b is a sum
                                               of paired differences; no variance or exploration constant)
        reject argmin S_a
Reconstructed choices (documented, tested):
  * bottom ties are broken first by the paired win count against the other tied models
    (sum_j 1[X_a > X_b] - 1[X_a < X_b]), which separates continuous scores; remaining ties are broken
    uniformly at random with the run's seeded generator and recorded as ``tie_broken``;
  * T < K is an error; T >= K*N is a full evaluation (exhausted);
  * with several stored samples per (model, item) one sample is drawn per evaluation, independently per model.

Live mode: the same algorithm over an oracle that calls a scorer lazily for requested (model, query) pairs
only, with a parquet cache so that an interrupted run resumes and reproduces the same answer.
"""
from __future__ import annotations

import abc

import hashlib
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Sequence

import numpy as np

from llmtool.core.console import UsageError


def logbar(k: int) -> float:
    return 0.5 + sum(1.0 / i for i in range(2, k + 1))


def sr_schedule(k: int, budget: int) -> list[int]:
    """Cumulative per-model evaluation counts n_1..n_{K-1} of Successive Rejects."""
    if k < 2:
        raise UsageError(f"need at least two models, got {k}")
    if budget < k:
        raise UsageError(f"budget {budget} is smaller than the number of models {k}")
    lb = logbar(k)
    return [math.ceil((budget - k) / (lb * (k + 1 - phase))) for phase in range(1, k)]


def schedule_cost(k: int, budget: int) -> int:
    n = sr_schedule(k, budget)
    return sum(n) + n[-1]


class Oracle(abc.ABC):
    """Scores of (model, query) evaluations with budget accounting and an optional evaluation log."""

    def __init__(self, n_models: int, n_items: int, log: bool = False):
        self.n_models, self.n_items = n_models, n_items
        self.used = 0
        self.log: list[tuple[int, int]] | None = [] if log else None

    @abc.abstractmethod
    def _scores(self, models: np.ndarray, items: np.ndarray) -> np.ndarray:
        """Scores of (model, item) pairs, one per pair."""

    def evaluate(self, models: Sequence[int], items: Sequence[int]) -> np.ndarray:
        """Scores of every model in ``models`` on every query in ``items`` ([len(models), len(items)])."""
        models = np.asarray(models, dtype=np.int64)
        items = np.asarray(items, dtype=np.int64)
        self.used += len(models) * len(items)
        if self.log is not None:
            self.log.extend((int(a), int(j)) for a in models for j in items)
        if len(models) == 0 or len(items) == 0:
            return np.zeros((len(models), len(items)))
        return self._scores(models, items)


class MatrixOracle(Oracle):
    """Replay over a stored score matrix (one sample drawn per evaluation when several are stored)."""

    def __init__(self, scores: np.ndarray, rng: np.random.Generator, samples: np.ndarray | None = None,
                 log: bool = False):
        super().__init__(scores.shape[0], scores.shape[1], log)
        self.scores, self.samples, self.rng = scores, samples, rng
        if samples is not None:
            self.sample_counts = (~np.isnan(samples)).sum(axis=2)

    def _scores(self, models, items):
        if self.samples is None:
            return self.scores[np.ix_(models, items)]
        counts = self.sample_counts[np.ix_(models, items)]
        pick = np.floor(self.rng.random(counts.shape) * counts).astype(np.int64)
        return self.samples[models[:, None], items[None, :], pick]


@dataclass
class BaiResult:
    """What one best-arm-identification run returns."""

    best: int
    used: int
    exhausted: bool = False
    phases: list[dict] = field(default_factory=list)
    query_order: np.ndarray | None = None
    tie_broken: bool = False


def break_bottom_tie(candidates: list[int], observed: dict[int, np.ndarray], rng: np.random.Generator
                     ) -> tuple[int, bool]:
    """Model to reject among ``candidates`` tied at the smallest sum: smallest paired win count against the
    other tied models, then uniformly at random. Returns (model, whether a random draw was needed)."""
    if len(candidates) == 1:
        return candidates[0], False
    wins = {a: sum(int(np.sign(observed[a] - observed[b]).sum()) for b in candidates if b != a) for a in candidates}
    low = min(wins.values())
    tied = [a for a in candidates if wins[a] == low]
    if len(tied) == 1:
        return tied[0], False
    return int(tied[rng.integers(len(tied))]), True


def argmax_random(values: np.ndarray, alive: Sequence[int], rng: np.random.Generator) -> int:
    vals = np.asarray([values[a] for a in alive])
    top = [a for a, v in zip(alive, vals) if np.isclose(v, vals.max(), rtol=0, atol=1e-12)]
    return int(top[rng.integers(len(top))]) if len(top) > 1 else int(top[0])


def sysr(oracle: Oracle, budget: int, rng: np.random.Generator, names: Sequence[str] | None = None) -> BaiResult:
    """Run SySRs against ``oracle``; ``rng`` draws the query permutation and random tie breaks."""
    k, n_items = oracle.n_models, oracle.n_items
    names = list(names) if names is not None else [str(a) for a in range(k)]
    order = rng.permutation(n_items)
    alive = list(range(k))
    if budget >= k * n_items:
        x = oracle.evaluate(alive, order)
        totals = x.sum(axis=1)
        best = argmax_random(totals, alive, rng)
        phase = {"k": 1, "alive": [names[a] for a in alive], "n_k": n_items, "new_queries": n_items,
                 "cumulative_queries": n_items, "totals": {names[a]: float(t) for a, t in zip(alive, totals)},
                 "eliminated": None, "tie_broken": False}
        return BaiResult(best, oracle.used, True, [phase], order)
    schedule = sr_schedule(k, budget)
    observed = {a: np.zeros(0) for a in alive}
    done = 0
    phases: list[dict] = []
    any_tie = False
    for phase_no, n_k in enumerate(schedule, 1):
        m = min(n_k, n_items)
        new = order[done:m]
        x = oracle.evaluate(alive, new)
        for row, a in enumerate(alive):
            observed[a] = np.concatenate([observed[a], x[row]])
        done = m
        totals = {a: float(observed[a].sum()) for a in alive}
        record = {"k": phase_no, "alive": [names[a] for a in alive], "n_k": n_k, "new_queries": int(len(new)),
                  "cumulative_queries": m, "totals": {names[a]: totals[a] for a in alive},
                  "eliminated": None, "tie_broken": False}
        if m == n_items:
            best = argmax_random(np.array([totals.get(a, -1.0) for a in range(k)]), alive, rng)
            phases.append(record)
            return BaiResult(best, oracle.used, True, phases, order, any_tie)
        low = min(totals.values())
        bottom = [a for a in alive if np.isclose(totals[a], low, rtol=0, atol=1e-9)]
        reject, tie = break_bottom_tie(bottom, observed, rng)
        any_tie |= tie
        record["eliminated"], record["tie_broken"] = names[reject], tie
        phases.append(record)
        alive.remove(reject)
    return BaiResult(alive[0], oracle.used, False, phases, order, any_tie)


def order_sha256(order: np.ndarray, item_ids: Sequence[str]) -> str:
    h = hashlib.sha256()
    for j in order:
        h.update(str(item_ids[int(j)]).encode())
        h.update(b"\n")
    return h.hexdigest()


def run_record(result: BaiResult, names: Sequence[str], item_ids: Sequence[str], budget: int, seed: int) -> dict:
    """The ``sysr_run.json`` document."""
    return {"best": names[result.best], "budget": budget, "evaluations_used": result.used,
            "phases": result.phases, "seed": seed,
            "query_order_sha256": order_sha256(result.query_order, item_ids),
            "exhausted": result.exhausted}


# ---------------------------------------------------------------- live mode (lazy scorer + resumable cache)

class LiveOracle(Oracle):
    """Calls ``score_fn(model_name, item_index)`` only for pairs not in the cache; the cache (parquet with
    columns model, item_id, score) is rewritten atomically after every model's batch, so a killed run
    resumes from where it stopped."""

    def __init__(self, models: Sequence[str], item_ids: Sequence[str], score_fn: Callable[[str, int], float],
                 cache_path: Path | None = None, log: bool = False):
        super().__init__(len(models), len(item_ids), log)
        self.models, self.item_ids, self.score_fn = list(models), list(item_ids), score_fn
        self.cache_path = Path(cache_path) if cache_path else None
        self.cache: dict[tuple[str, str], float] = {}
        self.calls = 0
        if self.cache_path and self.cache_path.is_file():
            self.cache = read_cache(self.cache_path)

    def _scores(self, models, items):
        out = np.zeros((len(models), len(items)))
        for r, a in enumerate(models):
            name = self.models[a]
            fresh = False
            for c, j in enumerate(items):
                key = (name, self.item_ids[j])
                if key not in self.cache:
                    value = float(self.score_fn(name, int(j)))
                    if not 0.0 <= value <= 1.0:
                        raise UsageError(f"scorer returned {value} for ({name}, {self.item_ids[j]}); scores must be in [0, 1]")
                    self.calls += 1
                    self.cache[key] = value
                    fresh = True
                    if self.cache_path and self.calls % 16 == 0:
                        write_cache(self.cache_path, self.cache)
                out[r, c] = self.cache[key]
            if fresh and self.cache_path:
                write_cache(self.cache_path, self.cache)
        return out


def read_cache(path: Path) -> dict[tuple[str, str], float]:
    import pyarrow.parquet as pq

    try:
        t = pq.read_table(path).to_pydict()
    except Exception as e:
        raise UsageError(f"{path}: unreadable cache ({e}); delete it to start over") from None
    if not {"model", "item_id", "score"} <= set(t):
        raise UsageError(f"{path}: cache lacks columns model, item_id, score")
    return {(m, i): float(s) for m, i, s in zip(t["model"], t["item_id"], t["score"])}


def write_cache(path: Path, cache: dict[tuple[str, str], float]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    from llmtool.core.checkpoint import atomic_file

    keys = list(cache)
    table = pa.table({"model": [k[0] for k in keys], "item_id": [k[1] for k in keys],
                      "score": [cache[k] for k in keys]})
    with atomic_file(path) as tmp:
        pq.write_table(table, tmp)

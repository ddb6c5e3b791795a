"""Baselines for best-model identification under a budget, on the same oracle and budget accounting as SySRs.

Methods (``BAI_METHODS`` registry of functions, and ``BAI_CONFIGS``, one config dataclass per method
whose options are the function's keyword arguments — the method contract ``bai-sim --methods`` is
checked against; every one returns a :class:`~llmtool.evaluate.sysr.BaiResult` and never
spends more than T (model, query) evaluations; queries are drawn without replacement per model):

* ``full``: every model on every query (T is ignored; reference, zero error by definition).
* ``uniform``: each model gets floor(T/K) queries drawn independently per model; best empirical mean.
* ``uniform-shared``: all models on the same floor(T/K) random queries (paired comparison, no adaptivity).
* ``sr``: classical Successive Rejects (Audibert, Bubeck & Munos 2010), schedule of SySRs, but an
  independent query permutation per model (what a bandit library does when arms are unrelated).
* ``sh`` / ``sh-shared``: Successive Halving (Karnin, Koren & Somekh 2013): R = ceil(log2 K) rounds; in
  round r every survivor gets floor(T / (|A_r| R)) new queries, the top ceil(|A_r|/2) by empirical mean are
  kept. Reconstructed choice: the mean uses all evaluations of the model so far (with finite-population
  sampling, discarding earlier rounds would waste budget); ``sh-shared`` draws the round's new queries once
  for all survivors.
* ``ucbe``: UCB-E (Audibert et al. 2010) in the batched form of the banditeval package (Zhou et al.,
  ICLR 2025): repeatedly pick the model maximising mean_a + sqrt(a / n_a) (unevaluated models first) and
  evaluate it on 32 of its unseen queries. Exploration constant ``a`` (default 1).
* ``ucbe-lrf``: UCB-E with low-rank factorisation (Zhou et al., "On Speeding Up Language Model
  Evaluation"): after a 5% uniformly random warm-up of (model, query) entries, an ensemble of 64 rank-1
  factorisations (alternating ridge least squares, regulariser 0.1, 10 sweeps, each member trained on a
  random 95% of the observed entries, i.e. dropout 0.05) imputes the unobserved scores; per-entry
  UCB = ensemble mean + eta * ensemble std (eta = 5); the model with the largest mean UCB over its row is
  evaluated on its 32 unseen queries with the largest ensemble std. The answer is the best row mean of the
  matrix with observed entries filled in and the rest imputed. This is our re-implementation from the
  paper's description (banditeval itself is not a dependency).

Random ties in final answers are broken uniformly with the run's generator.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, ClassVar, Optional

import numpy as np

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option
from llmtool.evaluate.sysr import BaiResult, Oracle, argmax_random, sr_schedule, sysr

BaiMethod = Callable[..., BaiResult]
BAI_METHODS: Registry[BaiMethod] = Registry("evaluate bai-sim")

BAI_METHODS.add("sysr", lambda oracle, budget, rng, **_: sysr(oracle, budget, rng))


@BAI_METHODS.register("full")
def full(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    alive = list(range(oracle.n_models))
    x = oracle.evaluate(alive, np.arange(oracle.n_items))
    return BaiResult(argmax_random(x.mean(axis=1), alive, rng), oracle.used, True)


def _uniform(oracle: Oracle, budget: int, rng: np.random.Generator, shared: bool) -> BaiResult:
    k, n = oracle.n_models, oracle.n_items
    per = min(budget // k, n)
    means = np.zeros(k)
    if shared:
        items = rng.permutation(n)[:per]
        means = oracle.evaluate(list(range(k)), items).mean(axis=1)
    else:
        for a in range(k):
            means[a] = oracle.evaluate([a], rng.permutation(n)[:per]).mean()
    return BaiResult(argmax_random(means, list(range(k)), rng), oracle.used, per == n)


@BAI_METHODS.register("uniform")
def uniform(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    return _uniform(oracle, budget, rng, shared=False)


@BAI_METHODS.register("uniform-shared")
def uniform_shared(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    return _uniform(oracle, budget, rng, shared=True)


@BAI_METHODS.register("sr")
def successive_rejects(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    k, n = oracle.n_models, oracle.n_items
    if budget >= k * n:
        return full(oracle, budget, rng)
    perms = [rng.permutation(n) for _ in range(k)]
    sums = np.zeros(k)
    done = 0
    alive = list(range(k))
    for n_k in sr_schedule(k, budget):
        m = min(n_k, n)
        for a in alive:
            sums[a] += oracle.evaluate([a], perms[a][done:m]).sum()
        done = m
        if m == n:
            return BaiResult(argmax_random(sums, alive, rng), oracle.used, True)
        low = min(sums[a] for a in alive)
        bottom = [a for a in alive if np.isclose(sums[a], low, rtol=0, atol=1e-9)]
        alive.remove(bottom[rng.integers(len(bottom))] if len(bottom) > 1 else bottom[0])
    return BaiResult(alive[0], oracle.used)


def _halving(oracle: Oracle, budget: int, rng: np.random.Generator, shared: bool) -> BaiResult:
    k, n = oracle.n_models, oracle.n_items
    rounds = max(1, math.ceil(math.log2(k)))
    alive = list(range(k))
    sums, counts = np.zeros(k), np.zeros(k, dtype=np.int64)
    perms = [rng.permutation(n) for _ in range(1 if shared else k)]
    shared_done = 0
    for _ in range(rounds):
        if len(alive) == 1:
            break
        per = budget // (len(alive) * rounds)
        if shared:
            new = perms[0][shared_done:min(shared_done + per, n)]
            x = oracle.evaluate(alive, new)
            for row, a in enumerate(alive):
                sums[a] += x[row].sum()
                counts[a] += len(new)
            shared_done += len(new)
        else:
            for a in alive:
                new = perms[a][counts[a]:min(counts[a] + per, n)]
                sums[a] += oracle.evaluate([a], new).sum()
                counts[a] += len(new)
        means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
        keep = math.ceil(len(alive) / 2)
        # rank by mean, random order among exact ties
        jitter = rng.random(k)
        alive = sorted(alive, key=lambda a: (-means[a], jitter[a]))[:keep]
    means = np.where(counts > 0, sums / np.maximum(counts, 1), 0.0)
    return BaiResult(argmax_random(means, alive, rng), oracle.used, bool((counts[alive] == n).all()))


@BAI_METHODS.register("sh")
def successive_halving(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    return _halving(oracle, budget, rng, shared=False)


@BAI_METHODS.register("sh-shared")
def successive_halving_shared(oracle: Oracle, budget: int, rng: np.random.Generator, **_) -> BaiResult:
    return _halving(oracle, budget, rng, shared=True)


@BAI_METHODS.register("ucbe")
def ucbe(oracle: Oracle, budget: int, rng: np.random.Generator, a: float = 1.0, batch_size: int = 32,
         **_) -> BaiResult:
    k, n = oracle.n_models, oracle.n_items
    perms = [rng.permutation(n) for _ in range(k)]
    sums, counts = np.zeros(k), np.zeros(k, dtype=np.int64)
    while oracle.used < budget:
        room = counts < n
        if not room.any():
            break
        with np.errstate(divide="ignore", invalid="ignore"):
            ucb = np.where(counts > 0, sums / np.maximum(counts, 1) + np.sqrt(a / np.maximum(counts, 1)), np.inf)
        ucb[~room] = -np.inf
        top = np.flatnonzero(ucb == ucb.max())
        arm = int(top[rng.integers(len(top))]) if len(top) > 1 else int(top[0])
        take = min(batch_size, n - counts[arm], budget - oracle.used)
        new = perms[arm][counts[arm]:counts[arm] + take]
        sums[arm] += oracle.evaluate([arm], new).sum()
        counts[arm] += take
    means = np.where(counts > 0, sums / np.maximum(counts, 1), -np.inf)
    return BaiResult(argmax_random(means, list(range(k)), rng), oracle.used, bool((counts == n).all()))


def rank1_ensemble(observed: np.ndarray, mask: np.ndarray, rng: np.random.Generator, ensemble: int = 64,
                   dropout: float = 0.05, reg: float = 0.1, iters: int = 10, rank: int = 1) -> np.ndarray:
    """Imputations [ensemble, K, N] of a partially observed matrix by an ensemble of rank-``rank``
    factorisations U V^T fitted with alternating ridge least squares on random 1-dropout subsets of the
    observed entries."""
    k, n = observed.shape
    x = np.where(mask, observed, 0.0)
    m = mask[None] & (rng.random((ensemble, k, n)) >= dropout)        # [E, K, N]
    if rank == 1:                                                      # same updates, scalar form (fast path)
        # batched matrix-vector products through BLAS (np.matmul) in float32: about 3x faster than einsum
        mf = m.astype(np.float32)
        mx = mf * x.astype(np.float32)[None]
        u = (rng.normal(0.0, 0.1, (ensemble, k)) + 0.5).astype(np.float32)
        v = (rng.normal(0.0, 0.1, (ensemble, n)) + 0.5).astype(np.float32)
        for _ in range(iters):
            u = np.matmul(mx, v[:, :, None])[..., 0] / (np.matmul(mf, (v * v)[:, :, None])[..., 0] + reg)
            v = np.matmul(u[:, None, :], mx)[:, 0, :] / (np.matmul((u * u)[:, None, :], mf)[:, 0, :] + reg)
        return u[:, :, None] * v[:, None, :]
    u = rng.normal(0.0, 0.1, (ensemble, k, rank)) + 0.5
    v = rng.normal(0.0, 0.1, (ensemble, n, rank)) + 0.5
    eye = np.eye(rank)
    for _ in range(iters):
        # rows: u_a = (sum_j m v_j v_j^T + reg I)^{-1} sum_j m x v_j
        gram = np.einsum("ekn,enr,ens->ekrs", m, v, v) + reg * eye
        rhs = np.einsum("ekn,kn,enr->ekr", m, x, v)
        u = np.linalg.solve(gram, rhs[..., None])[..., 0]
        gram = np.einsum("ekn,ekr,eks->enrs", m, u, u) + reg * eye
        rhs = np.einsum("ekn,kn,ekr->enr", m, x, u)
        v = np.linalg.solve(gram, rhs[..., None])[..., 0]
    return np.einsum("ekr,enr->ekn", u, v)


@BAI_METHODS.register("ucbe-lrf")
def ucbe_lrf(oracle: Oracle, budget: int, rng: np.random.Generator, eta: float = 5.0, batch_size: int = 32,
             warmup: float = 0.05, ensemble: int = 64, rank: int = 1, reg: float = 0.1, dropout: float = 0.05,
             iters: int = 10, **_) -> BaiResult:
    k, n = oracle.n_models, oracle.n_items
    obs = np.zeros((k, n))
    mask = np.zeros((k, n), dtype=bool)
    # warm-up: a random 5% of all entries (at least one per model), capped by the budget
    n_warm = min(budget, max(k, int(round(warmup * k * n))))
    flat = rng.permutation(k * n)
    first = [a * n + int(rng.integers(n)) for a in range(k)]
    picks = list(dict.fromkeys(first + flat.tolist()))[:n_warm]
    for p in picks:
        a, j = divmod(int(p), n)
        obs[a, j] = oracle.evaluate([a], [j])[0, 0]
        mask[a, j] = True
    while oracle.used < budget and not mask.all():
        imp = rank1_ensemble(obs, mask, rng, ensemble, dropout, reg, iters, rank)
        mean, std = imp.mean(axis=0), imp.std(axis=0)
        ucb = np.where(mask, obs, mean + eta * std)
        row_score = ucb.mean(axis=1)
        row_score[mask.all(axis=1)] = -np.inf
        arm = int(np.argmax(row_score))
        unseen = np.flatnonzero(~mask[arm])
        take = min(batch_size, len(unseen), budget - oracle.used)
        new = unseen[np.argsort(-std[arm, unseen], kind="stable")[:take]]
        obs[arm, new] = oracle.evaluate([arm], new)[0]
        mask[arm, new] = True
    if mask.all():
        filled = obs
    else:
        imp = rank1_ensemble(obs, mask, rng, ensemble, dropout, reg, iters, rank)
        filled = np.where(mask, obs, imp.mean(axis=0))
    return BaiResult(argmax_random(filled.mean(axis=1), list(range(k)), rng), oracle.used, bool(mask.all()))


# ------------------------------------------------------------------------------------- method contract
@dataclass
class BaiConfig(MethodConfig):
    """A best-model-identification method as a config: its options are the keyword arguments of the
    function registered under the same name in :data:`BAI_METHODS`. ``primary`` is the option that the
    ``NAME@VALUE`` form of ``llmtool evaluate bai-sim --methods`` sets."""

    primary: ClassVar[Optional[str]] = None

    def run(self, oracle: Oracle, budget: int, rng: np.random.Generator) -> BaiResult:
        return BAI_METHODS.get(self.name)(oracle, budget, rng, **{f.name: getattr(self, f.name) for f in self.fields()})


BAI_CONFIGS: Registry = Registry("evaluate bai-sim")


def _plain(name: str, help_text: str) -> type:
    """A method without options."""
    cls = dataclass(type(f"{name.title().replace('-', '')}Config", (BaiConfig,), {"name": name, "help": help_text}))
    return BAI_CONFIGS.add_config(cls)


for _name, _help in (("sysr", "Synthetic Successive Rejects (shared queries)."),
                     ("full", "Every model on every query (reference)."),
                     ("uniform", "floor(T/K) independent queries per model."),
                     ("uniform-shared", "The same floor(T/K) queries for all models."),
                     ("sr", "Classical Successive Rejects."),
                     ("sh", "Successive Halving."),
                     ("sh-shared", "Successive Halving, shared queries per round.")):
    _plain(_name, _help)


@BAI_CONFIGS.config
@dataclass
class UCBEConfig(BaiConfig):
    name: ClassVar[str] = "ucbe"
    help: ClassVar[str] = "UCB-E, batched."
    primary: ClassVar[Optional[str]] = "a"
    a: float = option(1.0, "Exploration constant.", min=0.0)
    batch_size: int = option(32, "Queries per pick.", min=1)


@BAI_CONFIGS.config
@dataclass
class UCBELRFConfig(BaiConfig):
    name: ClassVar[str] = "ucbe-lrf"
    help: ClassVar[str] = "UCB-E with low-rank factorisation."
    primary: ClassVar[Optional[str]] = "eta"
    eta: float = option(5.0, "UCB width in ensemble standard deviations.", min=0.0)
    batch_size: int = option(32, "Queries per pick.", min=1)
    warmup: float = option(0.05, "Uniform warm-up share of the entries.", min=0.0, max=1.0)
    ensemble: int = option(64, "Rank-r factorisations in the ensemble.", min=1)
    rank: int = option(1, "Factorisation rank.", min=1)
    reg: float = option(0.1, "Ridge regulariser.", min=0.0)
    dropout: float = option(0.05, "Share of observed entries each member leaves out.", min=0.0, max=1.0,
                            exclusive_max=True)
    iters: int = option(10, "Alternating least-squares sweeps.", min=1)


def default_methods() -> list[str]:
    """Every registered method except the ``full`` reference."""
    return [n for n in BAI_CONFIGS.names() if n != "full"]


def parse_method(spec: str, **params) -> BaiConfig:
    """``NAME`` or ``NAME@VALUE`` (sets the method's primary option) -> validated config; ``params``
    are further options. A value for a method without options is refused."""
    name, _, arg = spec.partition("@")
    cls = BAI_CONFIGS.get_config(name.strip())
    if arg:
        if cls.primary is None:
            raise UsageError(f"--methods {spec!r}: method {cls.name!r} has no option to set with '@'")
        try:
            params[cls.primary] = float(arg)
        except ValueError:
            raise UsageError(f"--methods {spec!r}: {arg!r} is not a number") from None
    return BAI_CONFIGS.build(cls.name, **params)

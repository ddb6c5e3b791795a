"""Distribution-calibrated aggregation of n thinking-judge ratings with a Bradley-Terry-Davidson model.

Paper: Dadkhahi, Trabelsi, Riley, Juraska, Mirzazadeh, "Distribution-Calibrated Inference Time Compute for
Thinking LLM-as-a-Judge" (arXiv 2512.03019). The paper's exact equations could not be checked; everything
below is the reconstruction of spec judge-btd.md ("BTD on counts + polarity + decisiveness + task-level
calibration"), implemented as stated there.

Counts of item i: a_i (A better), t_i (tie), b_i (B better), n_i = a_i + t_i + b_i (parse failures dropped,
so n_i varies). Polarity P_i = (a_i - b_i)/(a_i + b_i), decisiveness D_i = (a_i + b_i)/n_i, margin m_i = P_i D_i.

Davidson likelihood with latent preference theta and tie parameter nu > 0:
    p_A = e^{theta/2}/Z, p_B = e^{-theta/2}/Z, p_T = nu/Z, Z = e^{theta/2} + e^{-theta/2} + nu,
    l_i(theta, nu) = (a_i - b_i) theta/2 + t_i log nu - n_i log Z.
For fixed nu the theta-MLE solves m = p_A - p_B:
    e^{theta/2} = [m nu + sqrt(m^2 nu^2 + 4 (1 - m^2))] / (2 (1 - m)),  |m| < 1.

Judge-side model per task (``nu_mode``):
  * ``shared``: theta_i ~ N(0, tau^2), one nu per task;
  * ``item``:   theta_i ~ N(0, tau^2), log nu_i ~ N(log nu0, omega^2) (decisiveness informs nu_i).
Hyperparameters maximise the marginal likelihood, integrated with probabilists' Gauss-Hermite quadrature
(41 nodes for theta, 21 for log nu, log-sum-exp), L-BFGS-B on log parameters within nu0 in [1e-4, 1e3],
tau in [0.05, 20], omega in [0.01, 5]. Per-item posterior mean/sd of theta and posterior mean of log nu come
from the same grid; ``shared`` mode also gives the MAP by Newton's method.

Human-side calibration (the distribution-calibrated step), fitted on labelled calibration items only:
    p^H_A ∝ exp(beta theta_i / 2), p^H_B ∝ exp(-beta theta_i / 2),
    p^H_T ∝ exp(c + gamma (E[log nu_i] - log nu0))          (gamma = 0 in shared mode),
maximum likelihood of the human sign labels with an L2 penalty 1e-3 on (beta, c, gamma). Without labels:
beta = 1, c = log nu0, gamma = 0 (flagged as ``uncalibrated``).
Outputs: label = median of the 3-point predictive distribution (A if p_A > 1/2, B if p_B > 1/2, else tie),
which minimises expected absolute error; continuous score s = v_A p_A + v_B p_B with v_A, v_B the mean human
ratings of calibration items labelled A / B (+-1 on the 3-way scale).

Baselines on the same counts: majority (plurality; ties among the top classes -> tie), soft-sc (mean rating,
|mean| < 0.5 -> tie on the 3-way scale, nearest scale point otherwise), soft-sc-cal (tie threshold tuned on the
calibration split, grid 0..1 step 0.01, minimising MAE), single (first valid sample). Instruction-based
self-aggregation needs a judge model (llmtool.evaluate.judge_sample); its one rating per item enters here as the
``self-agg`` method row (a null rating counts as a tie and a failure).

Per task: the judge model, the human calibration and the soft-sc-cal threshold are fitted separately for each
``task`` of the votes (tie propensity is task-specific); the random calibration split is stratified by task;
metrics are reported overall and per task. ``per_task=False`` pools all tasks into one fit.

Metrics: MAE of the point score (median label value) against the human consensus rating, and
tie-calibrated pairwise accuracy within groups (Deutsch, Foster & Freitag 2023): a pair is correct when
sign(s_i - s_j), with |s_i - s_j| <= eps read as a tie, equals sign(h_i - h_j); eps is tuned on the
calibration split.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field

import numpy as np
from scipy.optimize import minimize
from scipy.special import logsumexp

from llmtool.core.console import UsageError

NU0_BOUNDS = (1e-4, 1e3)
TAU_BOUNDS = (0.05, 20.0)
OMEGA_BOUNDS = (0.01, 5.0)
LABELS = ("A", "tie", "B")


# ------------------------------------------------------------------ counts

@dataclass
class Counts:
    ids: list[str]
    a: np.ndarray
    t: np.ndarray
    b: np.ndarray
    rating_sum: np.ndarray            # sum of numeric (canonical) ratings, for soft-sc on Likert scales
    first: np.ndarray                 # first valid rating, for the `single` baseline
    tasks: list[str] = field(default_factory=list)
    groups: list[str | None] = field(default_factory=list)   # the votes' `group` field (None where absent)

    @property
    def n(self) -> np.ndarray:
        return self.a + self.t + self.b

    def polarity(self) -> np.ndarray:
        d = self.a + self.b
        return np.where(d > 0, (self.a - self.b) / np.maximum(d, 1), 0.0)

    def decisiveness(self) -> np.ndarray:
        return (self.a + self.b) / self.n

    def margin(self) -> np.ndarray:
        return (self.a - self.b) / self.n

    def subset(self, idx: np.ndarray) -> Counts:
        idx = np.asarray(idx)
        return Counts([self.ids[i] for i in idx], self.a[idx], self.t[idx], self.b[idx], self.rating_sum[idx],
                      self.first[idx], [self.tasks[i] for i in idx] if self.tasks else [],
                      [self.groups[i] for i in idx] if self.groups else [])


def counts_from_votes(rows: Sequence[dict], frame: str = "canonical", source: str = "votes") -> Counts:
    """Per-item counts from vote records ``{id, sample, order, rating}``. ``frame='canonical'``: ratings are
    already positive = A better; ``frame='presented'``: ratings refer to the shown order and BA-order votes
    are mirrored here. ``rating`` null = parse failure (dropped)."""
    if frame not in ("canonical", "presented"):
        raise UsageError(f"--frame must be canonical or presented, got {frame!r}")
    per: dict[str, list[float]] = {}
    task_of: dict[str, str] = {}
    group_of: dict[str, str | None] = {}
    seen: set[tuple[str, str]] = set()
    for line, r in enumerate(rows, 1):
        where = f"{source}:{line}"
        if "id" not in r or "rating" not in r:
            raise UsageError(f"{where}: missing field {'id' if 'id' not in r else 'rating'!r}")
        iid = str(r["id"])
        if "sample" in r:
            key = (iid, str(r["sample"]))
            if key in seen:
                raise UsageError(f"{where}: duplicate (id {iid!r}, sample {r['sample']!r})")
            seen.add(key)
        per.setdefault(iid, [])
        task_of.setdefault(iid, str(r.get("task", "default")))
        if iid not in group_of or group_of[iid] is None:
            group_of[iid] = None if r.get("group") is None else str(r["group"])
        x = r["rating"]
        if x is None:
            continue
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise UsageError(f"{where}: field 'rating' must be a number or null, got {x!r}")
        order = r.get("order", "AB")
        if order not in ("AB", "BA"):
            raise UsageError(f"{where}: field 'order' must be 'AB' or 'BA', got {order!r}")
        if frame == "presented" and order == "BA":
            x = -x
        per[iid].append(float(x))
    ids = [i for i, v in per.items() if v]
    dropped = [i for i, v in per.items() if not v]
    if not ids:
        raise UsageError(f"{source}: no valid ratings")
    if dropped:
        from llmtool.core.console import info

        info(f"{source}: {len(dropped)} item(s) without any valid rating dropped")
    a = np.array([sum(v > 0 for v in per[i]) for i in ids], dtype=float)
    t = np.array([sum(v == 0 for v in per[i]) for i in ids], dtype=float)
    b = np.array([sum(v < 0 for v in per[i]) for i in ids], dtype=float)
    s = np.array([sum(per[i]) for i in ids], dtype=float)
    first = np.array([per[i][0] for i in ids], dtype=float)
    return Counts(ids, a, t, b, s, first, [task_of[i] for i in ids], [group_of[i] for i in ids])


def counts_from_arrays(a, t, b, ids: Sequence[str] | None = None) -> Counts:
    a, t, b = (np.asarray(x, dtype=float) for x in (a, t, b))
    ids = list(ids) if ids is not None else [str(i) for i in range(len(a))]
    first = np.where(a > 0, 1.0, np.where(t > 0, 0.0, -1.0))
    return Counts(ids, a, t, b, a - b, first, ["default"] * len(a))


# ------------------------------------------------------------------ Davidson model

def davidson_probs(theta, nu):
    """(p_A, p_T, p_B) of the Davidson model; broadcasts."""
    theta, nu = np.asarray(theta, dtype=float), np.asarray(nu, dtype=float)
    # stable: divide through by e^{|theta|/2}
    h = np.abs(theta) / 2
    ea, eb = np.exp(theta / 2 - h), np.exp(-theta / 2 - h)
    en = nu * np.exp(-h)
    z = ea + eb + en
    return ea / z, en / z, eb / z


def log_z(theta, log_nu):
    return np.logaddexp(np.logaddexp(theta / 2, -theta / 2), log_nu)


def loglik(a, t, b, theta, log_nu):
    """Per-item Davidson log-likelihood (multinomial coefficient omitted)."""
    n = a + t + b
    return (a - b) * theta / 2 + t * log_nu - n * log_z(theta, log_nu)


def theta_mle(m, nu):
    """Closed-form theta-MLE for margin m (|m| < 1) and tie parameter nu."""
    m, nu = np.asarray(m, dtype=float), np.asarray(nu, dtype=float)
    if np.any(np.abs(m) >= 1):
        raise ValueError("theta-MLE is unbounded for |m| = 1")
    u = (m * nu + np.sqrt(m * m * nu * nu + 4 * (1 - m * m))) / (2 * (1 - m))
    return 2 * np.log(u)


# ------------------------------------------------------------------ judge-side fit

@dataclass
class JudgeFit:
    nu_mode: str
    log_nu0: float
    tau: float
    omega: float | None
    loglik: float
    n_items: int
    nodes_theta: int = 41
    nodes_nu: int = 21
    warnings: list[str] = field(default_factory=list)


def _gh(n_nodes: int) -> tuple[np.ndarray, np.ndarray]:
    x, w = np.polynomial.hermite_e.hermegauss(n_nodes)
    return x, np.log(w / math.sqrt(2 * math.pi))


def _grid_loglik(c: Counts, log_nu0: float, tau: float, omega: float | None, nt: int, nn: int):
    """Per item, per node: l_i + log quadrature weight; shape [I, Q] ('shared') or [I, Qt, Qn] ('item')."""
    xt, lwt = _gh(nt)
    theta = tau * xt
    a, t, b = c.a[:, None], c.t[:, None], c.b[:, None]
    if omega is None:
        return loglik(a, t, b, theta[None, :], log_nu0) + lwt[None, :], theta, None
    xn, lwn = _gh(nn)
    log_nu = log_nu0 + omega * xn
    ll = loglik(a[..., None], t[..., None], b[..., None], theta[None, :, None], log_nu[None, None, :])
    return ll + lwt[None, :, None] + lwn[None, None, :], theta, log_nu


def marginal_loglik(c: Counts, log_nu0: float, tau: float, omega: float | None = None,
                    nt: int = 41, nn: int = 21) -> float:
    g, _, _ = _grid_loglik(c, log_nu0, tau, omega, nt, nn)
    axes = tuple(range(1, g.ndim))
    return float(logsumexp(g, axis=axes).sum())


def fit_judge(c: Counts, nu_mode: str = "item", nt: int = 41, nn: int = 21) -> JudgeFit:
    """Maximise the marginal likelihood over (log nu0, log tau[, log omega])."""
    if nu_mode not in ("item", "shared"):
        raise UsageError(f"--nu-mode must be 'item' or 'shared', got {nu_mode!r}")
    bounds = [tuple(map(math.log, NU0_BOUNDS)), tuple(map(math.log, TAU_BOUNDS))]
    share_t = c.t.sum() / c.n.sum()
    x0 = [math.log(max(2 * share_t / max(1 - share_t, 1e-3), 1e-3)), math.log(1.0)]
    if nu_mode == "item":
        bounds.append(tuple(map(math.log, OMEGA_BOUNDS)))
        x0.append(math.log(0.3))

    def objective(x):
        omega = math.exp(x[2]) if nu_mode == "item" else None
        return -marginal_loglik(c, x[0], math.exp(x[1]), omega, nt, nn) / len(c.ids)

    res = minimize(objective, np.array(x0), method="L-BFGS-B", bounds=bounds)
    x = res.x
    fit = JudgeFit(nu_mode, float(x[0]), float(math.exp(x[1])), float(math.exp(x[2])) if nu_mode == "item" else None,
                   float(-res.fun * len(c.ids)), len(c.ids), nt, nn)
    if x[0] <= bounds[0][0] + 1e-6:
        fit.warnings.append("judge emits (almost) no ties: nu clamped at 1e-4; prefer --nu-mode shared")
    return fit


@dataclass
class ItemPosterior:
    theta_mean: np.ndarray
    theta_sd: np.ndarray
    log_nu_mean: np.ndarray


def posterior(c: Counts, fit: JudgeFit) -> ItemPosterior:
    g, theta, log_nu = _grid_loglik(c, fit.log_nu0, fit.tau, fit.omega, fit.nodes_theta, fit.nodes_nu)
    axes = tuple(range(1, g.ndim))
    w = np.exp(g - logsumexp(g, axis=axes, keepdims=True))
    if log_nu is None:
        mean = (w * theta).sum(axis=1)
        var = (w * theta ** 2).sum(axis=1) - mean ** 2
        lnu = np.full(len(mean), fit.log_nu0)
    else:
        wt = w.sum(axis=2)
        mean = (wt * theta).sum(axis=1)
        var = (wt * theta ** 2).sum(axis=1) - mean ** 2
        lnu = (w.sum(axis=1) * log_nu).sum(axis=1)
    return ItemPosterior(mean, np.sqrt(np.maximum(var, 0.0)), lnu)


def theta_map(c: Counts, log_nu: float, tau: float, steps: int = 50) -> np.ndarray:
    """MAP of theta_i under N(0, tau^2) for a shared nu (Newton, start at 0)."""
    nu = math.exp(log_nu)
    theta = np.zeros(len(c.ids))
    n, d = c.n, c.a - c.b
    for _ in range(steps):
        ep, em = np.exp(theta / 2), np.exp(-theta / 2)
        z = ep + em + nu
        grad = d / 2 - n * (ep - em) / (2 * z) - theta / tau ** 2
        hess = -n * ((ep + em) * z - (ep - em) ** 2) / (4 * z ** 2) - 1 / tau ** 2
        step = grad / hess
        theta = theta - step
        if np.max(np.abs(step)) < 1e-12:
            break
    return theta


# ------------------------------------------------------------------ human-side calibration

@dataclass
class Calibration:
    beta: float = 1.0
    c: float = 0.0
    gamma: float = 0.0
    v_a: float = 1.0
    v_b: float = -1.0
    n_calib_items: int = 0
    loglik: float | None = None
    calibrated: bool = False


def _human_probs(theta, dlognu, beta, c, gamma):
    la, lb = beta * theta / 2, -beta * theta / 2
    lt = c + gamma * dlognu
    lz = np.logaddexp(np.logaddexp(la, lb), lt)
    return np.exp(la - lz), np.exp(lt - lz), np.exp(lb - lz)


def fit_calibration(theta: np.ndarray, dlognu: np.ndarray, human_class: np.ndarray, human_rating: np.ndarray,
                    use_gamma: bool, l2: float = 1e-3) -> Calibration:
    """ML fit of (beta, c[, gamma]) on human sign classes (+1 A, 0 tie, -1 B)."""
    ya, yt, yb = human_class > 0, human_class == 0, human_class < 0

    def nll(x):
        beta, c = x[0], x[1]
        gamma = x[2] if use_gamma else 0.0
        la, lb, lt = beta * theta / 2, -beta * theta / 2, c + gamma * dlognu
        lz = np.logaddexp(np.logaddexp(la, lb), lt)
        ll = np.where(ya, la, np.where(yt, lt, lb)) - lz
        return -ll.sum() + l2 * float(np.sum(np.square(x)))

    x0 = np.array([1.0, 0.0, 0.0] if use_gamma else [1.0, 0.0])
    res = minimize(nll, x0, method="L-BFGS-B")
    v_a = float(human_rating[ya].mean()) if ya.any() else 1.0
    v_b = float(human_rating[yb].mean()) if yb.any() else -1.0
    return Calibration(float(res.x[0]), float(res.x[1]), float(res.x[2]) if use_gamma else 0.0, v_a, v_b,
                       len(theta), float(-res.fun), True)


# ------------------------------------------------------------------ aggregation methods

@dataclass
class Aggregate:
    method: str
    label: np.ndarray                 # +1 A, 0 tie, -1 B
    score: np.ndarray                 # continuous score on the human scale
    point: np.ndarray                 # point score for MAE (label value on the human scale)
    p: np.ndarray | None = None       # [I, 3] (pA, pT, pB)
    theta: np.ndarray | None = None
    theta_sd: np.ndarray | None = None
    log_nu: np.ndarray | None = None


def btd_aggregate(c: Counts, fit: JudgeFit, cal: Calibration) -> Aggregate:
    post = posterior(c, fit)
    dlognu = post.log_nu_mean - fit.log_nu0
    pa, pt, pb = _human_probs(post.theta_mean, dlognu, cal.beta, cal.c, cal.gamma if fit.nu_mode == "item" else 0.0)
    label = np.where(pa > 0.5, 1, np.where(pb > 0.5, -1, 0))
    point = np.where(label > 0, cal.v_a, np.where(label < 0, cal.v_b, 0.0))
    score = cal.v_a * pa + cal.v_b * pb
    return Aggregate("btd", label, score, point, np.stack([pa, pt, pb], axis=1), post.theta_mean, post.theta_sd,
                     post.log_nu_mean if fit.nu_mode == "item" else None)


def majority(c: Counts) -> Aggregate:
    stack = np.stack([c.a, c.t, c.b], axis=1)
    top = stack.max(axis=1, keepdims=True)
    winners = stack == top
    single = winners.sum(axis=1) == 1
    label = np.where(single, np.array([1, 0, -1])[np.argmax(stack, axis=1)], 0)
    return Aggregate("majority", label, label.astype(float), label.astype(float))


def soft_sc(c: Counts, threshold: float = 0.5, name: str = "soft-sc") -> Aggregate:
    mean = c.rating_sum / c.n
    label = np.where(np.abs(mean) < threshold, 0, np.sign(mean)).astype(int)
    point = np.where(label == 0, 0.0, np.clip(np.round(mean), None, None))
    point = np.where((label != 0) & (point == 0), np.sign(mean), point)
    return Aggregate(name, label, mean, point)


def single(c: Counts) -> Aggregate:
    label = np.sign(c.first).astype(int)
    return Aggregate("single", label, c.first.copy(), c.first.copy())


def tune_tie_threshold(c: Counts, human_rating: np.ndarray) -> float:
    grid = np.round(np.arange(0.0, 1.0 + 1e-9, 0.01), 2)
    maes = [np.abs(soft_sc(c, th).point - human_rating).mean() for th in grid]
    return float(grid[int(np.argmin(maes))])


# ------------------------------------------------------------------ metrics

def mae(point: np.ndarray, human: np.ndarray) -> float:
    return float(np.abs(point - human).mean())


def pairwise_accuracy(score: np.ndarray, human: np.ndarray, groups: Sequence[str], eps: float) -> float:
    """Tie-calibrated pairwise accuracy within groups."""
    score, human = np.asarray(score), np.asarray(human)
    groups = np.asarray(groups)
    correct = total = 0
    for g in np.unique(groups):
        idx = np.flatnonzero(groups == g)
        if len(idx) < 2:
            continue
        iu, ju = np.triu_indices(len(idx), 1)
        ds = score[idx][iu] - score[idx][ju]
        dh = human[idx][iu] - human[idx][ju]
        pred = np.where(np.abs(ds) <= eps, 0, np.sign(ds))
        truth = np.where(np.abs(dh) < 1e-9, 0, np.sign(dh))
        correct += int((pred == truth).sum())
        total += len(iu)
    return correct / total if total else float("nan")


def tune_eps(score: np.ndarray, human: np.ndarray, groups: Sequence[str], grid_size: int = 101) -> float:
    grid = np.quantile(np.abs(score - score.mean()), np.linspace(0, 1, grid_size)) / 2
    grid = np.unique(np.concatenate([[0.0], grid]))
    accs = np.array([pairwise_accuracy(score, human, groups, e) for e in grid])
    if np.all(np.isnan(accs)):   # no group with two calibration items: nothing to tune on
        return 0.0
    return float(grid[int(np.nanargmax(accs))])


# ------------------------------------------------------------------ human labels

def human_consensus(rows: Sequence[dict], source: str = "human") -> dict[str, float]:
    """Mean human rating per id (several raters allowed)."""
    per: dict[str, list[float]] = {}
    for line, r in enumerate(rows, 1):
        if "id" not in r or "rating" not in r:
            raise UsageError(f"{source}:{line}: missing field {'id' if 'id' not in r else 'rating'!r}")
        x = r["rating"]
        if isinstance(x, bool) or not isinstance(x, (int, float)) or not math.isfinite(x):
            raise UsageError(f"{source}:{line}: field 'rating' must be a number, got {x!r}")
        per.setdefault(str(r["id"]), []).append(float(x))
    return {k: float(np.mean(v)) for k, v in per.items()}


def sign_class(x: np.ndarray) -> np.ndarray:
    return np.where(np.abs(x) < 1e-9, 0, np.sign(x)).astype(int)


# ------------------------------------------------------------------ synthetic generator (spec tests 3-5)

def synthetic_counts(n_items: int, tau: float = 1.5, log_nu0: float = 0.0, omega: float = 0.5, n_votes: int = 20,
                     seed: int = 0, shared: bool = False) -> tuple[Counts, np.ndarray, np.ndarray]:
    """Judge counts from the Davidson model with theta_i ~ N(0, tau^2) and log nu_i ~ N(log nu0, omega^2)
    (omega ignored when ``shared``). Returns (counts, theta, log_nu)."""
    rng = np.random.default_rng(seed)
    theta = rng.normal(0.0, tau, n_items)
    log_nu = np.full(n_items, log_nu0) if shared else rng.normal(log_nu0, omega, n_items)
    pa, pt, pb = davidson_probs(theta, np.exp(log_nu))
    p = np.stack([pa, pt, pb], axis=1)
    draws = np.array([rng.multinomial(n_votes, pi / pi.sum()) for pi in p])
    return counts_from_arrays(draws[:, 0], draws[:, 1], draws[:, 2]), theta, log_nu


def synthetic_human(theta: np.ndarray, nu_h: float = 2.0, seed: int = 1) -> np.ndarray:
    """One human label per item from the Davidson model (+1 A, 0 tie, -1 B)."""
    rng = np.random.default_rng(seed)
    pa, pt, _pb = davidson_probs(theta, nu_h)
    u = rng.random(len(theta))
    return np.where(u < pa, 1, np.where(u < pa + pt, 0, -1)).astype(float)


# ------------------------------------------------------------------ end-to-end evaluation

METHODS = ("btd", "majority", "soft-sc", "soft-sc-cal", "single")
POOLED = "pooled"   # calib.json key of a fit over all tasks together (--pool-tasks)


@dataclass
class JudgeRun:
    fit: JudgeFit | None              # the fit of the only task/unit (None when tasks are fitted separately)
    calibration: Calibration | None   # likewise
    aggregates: dict[str, Aggregate]
    calib_idx: np.ndarray
    test_idx: np.ndarray
    metrics: list[dict]               # overall, on the test split
    fits: dict[str, JudgeFit] = field(default_factory=dict)            # per task (or POOLED)
    calibrations: dict[str, Calibration] = field(default_factory=dict)
    task_metrics: list[dict] = field(default_factory=list)            # per task, when there are several
    thresholds: dict[str, float] = field(default_factory=dict)         # soft-sc-cal tie threshold per unit
    self_agg_failures: int | None = None


def task_units(c: Counts, per_task: bool = True) -> dict[str, np.ndarray]:
    """Item indices of each calibration unit: one per task (``per_task``), or all items as one unit (the
    task's name when there is only one task, else ``pooled``)."""
    tasks = c.tasks or ["default"] * len(c.ids)
    names = sorted(set(tasks))
    if len(names) == 1:
        return {names[0]: np.arange(len(c.ids))}
    if not per_task:
        return {POOLED: np.arange(len(c.ids))}
    arr = np.asarray(tasks)
    return {t: np.flatnonzero(arr == t) for t in names}


def group_keys(c: Counts, groups: Sequence[str | None] | None = None) -> np.ndarray:
    """Pairwise-accuracy group of each item: ``groups`` (aligned with ``c.ids``; None entries fall back), else the
    votes' ``group`` field, else the task."""
    tasks = c.tasks or ["default"] * len(c.ids)
    given = list(groups) if groups is not None else (c.groups or [None] * len(c.ids))
    own = c.groups or [None] * len(c.ids)
    out = []
    for i in range(len(c.ids)):
        g = given[i] if given[i] is not None else own[i]
        out.append(f"group:{g}" if g is not None else f"task:{tasks[i]}")
    return np.asarray(out)


def self_agg_aggregate(c: Counts, ratings: dict[str, float | None]) -> tuple[Aggregate, int]:
    """The ``self-agg`` method row from one aggregated rating per id (canonical frame): a null rating or a
    missing id counts as a tie and as a failure. Returns (aggregate, failures)."""
    vals, failures = [], 0
    for iid in c.ids:
        r = ratings.get(iid)
        if r is None:
            failures += 1
            r = 0.0
        vals.append(float(r))
    v = np.asarray(vals)
    label = sign_class(v)
    return Aggregate("self-agg", label, v.copy(), v.copy()), failures


def _split(c: Counts, h: np.ndarray | None, calib_ids, calib_frac: float, seed: int) -> tuple[np.ndarray, np.ndarray]:
    """(calibration, test) indices among the labelled items; the random split is stratified by task (one task:
    exactly the old unstratified split)."""
    labelled = np.flatnonzero(~np.isnan(h)) if h is not None else np.array([], dtype=int)
    ids = np.array(c.ids)
    if calib_ids is not None:
        cs = set(map(str, calib_ids))
        calib_idx = np.array([i for i in labelled if ids[i] in cs], dtype=int)
    elif len(labelled):
        rng = np.random.default_rng(seed)
        tasks = np.asarray(c.tasks or ["default"] * len(c.ids))
        parts = []
        for t in sorted(set(tasks[labelled])):
            lab = labelled[tasks[labelled] == t]
            perm = rng.permutation(lab)
            parts.append(perm[:max(1, round(calib_frac * len(lab)))])
        calib_idx = np.sort(np.concatenate(parts)).astype(int)
    else:
        calib_idx = np.array([], dtype=int)
    return calib_idx, np.setdiff1d(labelled, calib_idx)


def _metric_rows(aggs: dict[str, Aggregate], h: np.ndarray, calib_idx: np.ndarray, test_idx: np.ndarray,
                 grp: np.ndarray, extra: dict | None = None) -> list[dict]:
    rows = []
    for m, agg in aggs.items():
        row = {**(extra or {}), "method": m, "test_items": len(test_idx),
               "mae": mae(agg.point[test_idx], h[test_idx]),
               "label_accuracy": float((agg.label[test_idx] == sign_class(h[test_idx])).mean())}
        if len(calib_idx) >= 2:
            eps = tune_eps(agg.score[calib_idx], h[calib_idx], grp[calib_idx])
            row["pairwise_acc"] = pairwise_accuracy(agg.score[test_idx], h[test_idx], grp[test_idx], eps)
            row["eps"] = eps
        rows.append(row)
    return rows


def _scatter(parts: list[tuple[np.ndarray, Aggregate]], size: int, method: str) -> Aggregate:
    """One Aggregate over all items from per-unit aggregates."""
    def merged(attr, width=None):
        first = getattr(parts[0][1], attr)
        if first is None:
            return None
        out = np.zeros((size, width) if width else size, dtype=float)
        for idx, agg in parts:
            out[idx] = getattr(agg, attr)
        return out

    label = np.zeros(size, dtype=int)
    for idx, agg in parts:
        label[idx] = agg.label
    return Aggregate(method, label, merged("score"), merged("point"), merged("p", 3), merged("theta"),
                     merged("theta_sd"), merged("log_nu"))


def run_judge(c: Counts, human: dict[str, float] | None = None, calib_ids: Sequence[str] | None = None,
              calib_frac: float = 0.2, nu_mode: str = "item", methods: Sequence[str] = METHODS,
              groups: Sequence[str | None] | None = None, seed: int = 0,
              fit: JudgeFit | dict[str, JudgeFit] | None = None,
              calibration: Calibration | dict[str, Calibration] | None = None, per_task: bool = True,
              self_agg: dict[str, float | None] | None = None) -> JudgeRun:
    """Fit the judge model and calibrate per task (each task's own tie propensity; ``per_task=False`` pools
    them), aggregate every method and (with human labels) score each on the test split, overall and per task.
    ``fit``/``calibration``: reuse instead of fitting (one for all units, or a dict keyed like
    :func:`task_units`). ``self_agg``: id -> aggregated rating (null = failure) adds the ``self-agg`` row."""
    for m in methods:
        if m not in METHODS:
            raise UsageError(f"unknown judge aggregation method {m!r}; choose from {', '.join(METHODS)}")
    h = np.array([human.get(i, np.nan) for i in c.ids]) if human is not None else None
    calib_idx, test_idx = _split(c, h, calib_ids, calib_frac, seed)
    units = task_units(c, per_task)
    fits, cals, thresholds = {}, {}, {}
    parts: dict[str, list] = {m: [] for m in methods}
    calib_set = set(calib_idx.tolist())
    for key, idx in units.items():
        sub = c.subset(idx)
        u_fit = fit.get(key) if isinstance(fit, dict) else fit
        if isinstance(fit, dict) and u_fit is None:
            raise UsageError(f"calibration file has no entry for {key!r} (it has: {', '.join(sorted(fit)) or 'none'})")
        u_fit = u_fit or fit_judge(sub, nu_mode)
        u_cal = calibration.get(key) if isinstance(calibration, dict) else calibration
        local_calib = np.array([j for j, i in enumerate(idx) if i in calib_set], dtype=int)
        if u_cal is None:
            if len(local_calib):
                post = posterior(sub.subset(local_calib), u_fit)
                hc = h[idx][local_calib]
                u_cal = fit_calibration(post.theta_mean, post.log_nu_mean - u_fit.log_nu0, sign_class(hc), hc,
                                        use_gamma=u_fit.nu_mode == "item")
            else:
                u_cal = Calibration(1.0, u_fit.log_nu0, 0.0)
        fits[key], cals[key] = u_fit, u_cal
        for m in methods:
            if m == "btd":
                agg = btd_aggregate(sub, u_fit, u_cal)
            elif m == "majority":
                agg = majority(sub)
            elif m == "soft-sc":
                agg = soft_sc(sub)
            elif m == "soft-sc-cal":
                th = tune_tie_threshold(sub.subset(local_calib), h[idx][local_calib]) if len(local_calib) else 0.5
                thresholds[key] = th
                agg = soft_sc(sub, th, "soft-sc-cal")
            else:
                agg = single(sub)
            parts[m].append((idx, agg))
    aggs = {m: _scatter(parts[m], len(c.ids), m) for m in methods}
    failures = None
    if self_agg is not None:
        aggs["self-agg"], failures = self_agg_aggregate(c, self_agg)
    metrics, task_metrics = [], []
    if h is not None and len(test_idx):
        grp = group_keys(c, groups)
        metrics = _metric_rows(aggs, h, calib_idx, test_idx, grp)
        tasks = np.asarray(c.tasks or ["default"] * len(c.ids))
        if len(set(tasks)) > 1:
            for t in sorted(set(tasks)):
                ci, ti = calib_idx[tasks[calib_idx] == t], test_idx[tasks[test_idx] == t]
                if len(ti):
                    task_metrics += _metric_rows(aggs, h, ci, ti, grp, {"task": t})
    single_unit = len(units) == 1
    only = next(iter(units))
    return JudgeRun(fits[only] if single_unit else None, cals[only] if single_unit else None, aggs, calib_idx,
                    test_idx, metrics, fits, cals, task_metrics, thresholds, failures)


def agg_records(c: Counts, agg: Aggregate) -> list[dict]:
    """``agg.jsonl`` rows."""
    pol, dec = c.polarity(), c.decisiveness()
    out = []
    for i, iid in enumerate(c.ids):
        rec = {"id": iid, "method": agg.method, "label": LABELS[1 - int(agg.label[i])], "score": float(agg.score[i]),
               "counts": [int(c.a[i]), int(c.t[i]), int(c.b[i])], "polarity": float(pol[i]),
               "decisiveness": float(dec[i])}
        if c.tasks and len(set(c.tasks)) > 1:
            rec["task"] = c.tasks[i]
        if agg.p is not None:
            rec["p"] = [float(x) for x in agg.p[i]]
        if agg.theta is not None:
            rec["theta"], rec["theta_sd"] = float(agg.theta[i]), float(agg.theta_sd[i])
        if agg.log_nu is not None:
            rec["log_nu_item"] = float(agg.log_nu[i])
        out.append(rec)
    return out


def calib_document(run: JudgeRun) -> dict:
    """``calib.json``: one entry per calibration unit (task, or ``pooled``)."""
    doc = {}
    for key, f in run.fits.items():
        cal = run.calibrations[key]
        doc[key] = {"nu_mode": f.nu_mode, "log_nu0": f.log_nu0, "tau": f.tau, "omega": f.omega,
                    "beta": cal.beta, "c": cal.c, "gamma": cal.gamma, "v_a": cal.v_a, "v_b": cal.v_b,
                    "calibrated": cal.calibrated, "n_calib_items": cal.n_calib_items, "loglik": f.loglik,
                    "calib_loglik": cal.loglik, "n_items": f.n_items, "warnings": f.warnings}
        if key in run.thresholds:
            doc[key]["soft_sc_cal_threshold"] = run.thresholds[key]
    return doc


def load_calib_document(doc: dict, path: str = "calib.json", task: str = "default") -> tuple[JudgeFit, Calibration]:
    if not isinstance(doc, dict) or task not in doc:
        have = ", ".join(sorted(doc)) if isinstance(doc, dict) else "nothing"
        raise UsageError(f"{path}: no entry for task {task!r} (it has: {have})")
    d = doc[task]
    try:
        fit = JudgeFit(d["nu_mode"], float(d["log_nu0"]), float(d["tau"]),
                       None if d["omega"] is None else float(d["omega"]), float(d["loglik"]), int(d["n_items"]))
        cal = Calibration(float(d["beta"]), float(d["c"]), float(d["gamma"]), float(d["v_a"]), float(d["v_b"]),
                          int(d["n_calib_items"]), d.get("calib_loglik"), bool(d["calibrated"]))
    except KeyError as e:
        raise UsageError(f"{path}: missing field {e.args[0]!r} for task {task!r}") from None
    except (TypeError, ValueError) as e:
        raise UsageError(f"{path}: malformed entry for task {task!r} ({e})") from None
    return fit, cal


def fit_summary(run: JudgeRun) -> dict:
    if run.fit is not None and len(run.fits) <= 1:
        return {"fit": asdict(run.fit), "calibration": asdict(run.calibration)}
    return {"fits": {k: asdict(f) for k, f in run.fits.items()},
            "calibrations": {k: asdict(c) for k, c in run.calibrations.items()}}

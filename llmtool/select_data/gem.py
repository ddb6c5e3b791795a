"""GEM — Geometric Entropy Mixing: balanced vMF-mixture domain discovery on the hypersphere.

Paper: Min, Qiao, Chen, Li, "GEM: Geometric Entropy Mixing for Optimal LLM Data Curation",
arXiv 2605.26121 (ICML 2026). No official code; this module follows ../specs/gem.md with the issue's
corrections (which outrank the spec's reconstructed points and are the defaults here).

Objective (maximised over the soft assignment Γ = Q, mean directions μ_k, concentrations κ_k; the
prior π is *decoupled*: held at uniform and never re-estimated from the realised shares):

    J = Σ_i Σ_k q_ik [log f(x_i; μ_k, κ_k) + log π_k] + Σ_i H(q_i) − (λ N / 2) ‖ρ(Q) − u‖²

with ρ(Q) = (1/N) Σ_i q_i the realised mixing shares and u = 1/K. This is N times the per-document
form (1/N)Σ_i[...] − (λ/2)‖π(Γ) − u‖² of the corrections, so the balance gradient seen by one
document is −λ(ρ_k − u): λ = 5000 is on the scale of vMF logits with κ in the hundreds (a cluster
1 % of the corpus over its fair share costs each member 50 nats). ``--balance entropy`` keeps the
spec's original λ·N·H(ρ) regulariser with its own multiplicative MM update (spec §3.3 step 2).

Q-step [reconstructed; the choice made here]. The corrections prescribe an MM step: a quadratic
minoriser of the balance term, solved per sample by mirror ascent. By Jensen,
‖ρ − ρ⁰‖² ≤ (1/N) Σ_i ‖q_i − q_i⁰‖², so

    −(λN/2)‖ρ − u‖² ≥ const − λ Σ_i (ρ⁰ − u)ᵀ q_i − (λ/2) Σ_i ‖q_i − q_i⁰‖²,

a separable minoriser touching at Q⁰; each row solves max_q aᵀq + H(q) − (λ/2)‖q − q⁰‖² with
a = s_i − λ(ρ⁰ − u), whose unique maximiser (the limit of mirror ascent on it) we compute exactly
(Lambert-W form of the KKT conditions, normaliser by bisection: :func:`quadratic_row_solve`).
Every such step is monotone, but it puts curvature λ on *every* row, while the true curvature of the
balance term for one document moving alone is λ/N: with λ = 5000 a row moves only ~Δs/λ ≈ 1 % of
its mass per step. Iterating the per-sample step on a fixed (μ, κ) converges to the maximiser of J
over Q (J is strictly concave in Q), which is characterised by

    q_i = softmax(s_i − t),   t = λ (ρ(Q) − u)      (s_ik = κ_k μ_kᵀ x_i + log C_d(κ_k) + log π_k),

i.e. the vMF posterior with a per-cluster logit price t_k. The default ``q_step="exact"`` goes
straight to that limit: t is the unique minimiser of the K-dimensional smooth convex dual
Σ_i lse(s_i − t) + N uᵀt + N‖t‖²/(2λ) (from −(λ/2)‖z‖² = min_t [−tᵀz + ‖t‖²/(2λ)] and the
minimax theorem), found by damped Newton; the rows are then per-sample softmaxes. This is the same
fixed point as the per-sample MM steps, reached in one Q-step instead of hundreds, and it is still a
monotone block-ascent (MM) step for J. ``q_step="mm"`` keeps the literal one-minoriser-step update
(with ``inner`` repeats). On the benchmark the literal step leaves the hard labels at the
spherical-k-means initialisation for tens of iterations; the exact Q-step balances them.
M-step: μ_k = r_k / ‖r_k‖ (exact); κ: per-cluster from the mean resultant length with the closed form
κ_k ≈ (R̄_k d − R̄_k³)/(1 − R̄_k²) (default, corrections), or ``--kappa-solver newton`` (the exact
maximiser; then J is monotone — used by the monotonicity test), ``--kappa tied`` (one κ for all).
Stopping (spec §3.3): relative change of J below ``tol`` = 1e-6 or ``max_iter`` = 200 iterations.
Hard labels are the argmax of Q (spec §2: ``domain`` = argmax); no post-hoc rebalancing.

Initialisation: spherical k-means++ seeding and 5 hard spherical k-means steps; Q is then the vMF
posterior under the initial κ (the spec's one-hot Q would freeze zero entries under the
multiplicative ``--balance entropy`` update). ``n_init`` restarts keep the largest J.

Baselines (same outputs): ``vmf`` (λ = 0, uniform fixed prior: vanilla vMF mixture),
``movmf-em`` (λ = 0, π ← ρ each iteration, free κ: Banerjee et al. 2005), ``spherical-kmeans``,
``kmeans`` (Euclidean on raw embeddings, scikit-learn), ``source`` (the corpus's own labels).

GIS (corrections): GIS_k(x) = log γ_ik + log f_ik + β log ρ_k(x), with γ the assignment
probability, f the vMF density and ρ_k(x) the mean cosine of x to its top-M same-cluster neighbours
(local density). Prototypes and cluster names come from the top-GIS documents (see ``gis.py``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from llmtool.select_data import vmf


@dataclass
class ClusterResult:
    method: str
    labels: np.ndarray                 # [N] int hard assignment
    q: np.ndarray | None = None        # [N, K] soft assignment (None for hard baselines)
    mu: np.ndarray | None = None       # [K, d]
    kappa: np.ndarray | None = None    # [K]
    prior: np.ndarray | None = None    # [K]
    trace: list = field(default_factory=list)
    events: list = field(default_factory=list)
    iterations: int = 0

    @property
    def k(self) -> int:
        return int(self.mu.shape[0]) if self.mu is not None else int(self.labels.max()) + 1


def normalize(x: np.ndarray) -> np.ndarray:
    n = np.linalg.norm(x, axis=1, keepdims=True)
    return x / np.maximum(n, 1e-12)


# ------------------------------------------------------------------------------------ initialisation
def spherical_kmeanspp(x: np.ndarray, k: int, rng: np.random.Generator) -> np.ndarray:
    """k-means++ seeding on cosine distance 1 − cos; returns indices of the seeds."""
    n = x.shape[0]
    first = int(rng.integers(n))
    seeds = [first]
    dist = np.maximum(1.0 - x @ x[first], 0.0)
    for _ in range(1, k):
        total = dist.sum()
        if total <= 0:
            cand = int(rng.integers(n))
        else:
            cand = int(rng.choice(n, p=dist / total))
        seeds.append(cand)
        dist = np.minimum(dist, np.maximum(1.0 - x @ x[cand], 0.0))
    return np.array(seeds)


def spherical_kmeans(x: np.ndarray, k: int, seed: int = 0, iters: int = 50, init_mu: np.ndarray | None = None):
    """Hard cosine k-means (uniform prior, κ → ∞). Returns (labels, mu)."""
    rng = np.random.default_rng(seed)
    mu = x[spherical_kmeanspp(x, k, rng)].copy() if init_mu is None else init_mu.copy()
    labels = np.full(x.shape[0], -1)
    for _ in range(iters):
        new = np.argmax(x @ mu.T, axis=1)
        if np.array_equal(new, labels):
            break
        labels = new
        for j in range(k):
            members = labels == j
            if members.any():
                mu[j] = x[members].sum(0)
            else:  # re-seed at the worst-fitting document
                worst = int(np.argmin(np.max(x @ mu.T, axis=1)))
                mu[j] = x[worst]
                labels[worst] = j
        mu = normalize(mu)
    return labels, mu


# ------------------------------------------------------------------------------------ helpers
def _logsumexp(a: np.ndarray) -> np.ndarray:
    m = a.max(axis=1, keepdims=True)
    return m + np.log(np.exp(a - m).sum(axis=1, keepdims=True))


def _entropy_rows(q: np.ndarray) -> float:
    with np.errstate(divide="ignore", invalid="ignore"):
        t = np.where(q > 0, q * np.log(q), 0.0)
    return float(-t.sum())


def log_w(t: np.ndarray, iters: int = 40, y0: np.ndarray | None = None) -> np.ndarray:
    """log of the Lambert W function at e^t: y with e^y + y = t (vectorised Newton, optional warm start)."""
    if y0 is None:
        big = np.maximum(t, 2.0)
        y0 = np.where(t < 1.0, t - np.exp(np.minimum(t, 1.0)), np.log(big - np.log(big)))
    y = y0
    for _ in range(iters):
        ey = np.exp(np.minimum(y, 700.0))
        step = (ey + y - t) / (ey + 1.0)
        y = y - step
        if np.max(np.abs(step)) < 1e-12:
            break
    return y


def quadratic_row_solve(a: np.ndarray, q0: np.ndarray, lam: float, iters: int = 55) -> np.ndarray:
    """Row-wise argmax over the simplex of aᵀq + H(q) − (λ/2)‖q − q0‖² (exact, via Lambert W).

    KKT: log q_k + λ q_k = a_k + λ q0_k − 1 − ν  ⇒  q_k = W(λ exp(c_k − ν)) / λ, c = a + λ q0 − 1;
    Σ_k q_k is decreasing in ν, so ν is found per row by bisection (W warm-started between steps)."""
    c = a + lam * q0 - 1.0
    log_lam = math.log(lam)
    cmax = c.max(axis=1, keepdims=True)
    k = a.shape[1]
    # bracket: at ν_lo the largest term alone reaches q = 1; at ν_hi every term is at most 1/K.
    lo = cmax - (1.0 + lam)
    hi = cmax + log_lam - (lam / k + math.log(lam / k)) + 1.0
    mid = 0.5 * (lo + hi)
    y = log_w(c - mid + log_lam, iters=12)
    for _ in range(iters):
        s = np.exp(np.minimum(y, 700.0)).sum(axis=1, keepdims=True) / lam
        lo = np.where(s > 1.0, mid, lo)
        hi = np.where(s > 1.0, hi, mid)
        mid = 0.5 * (lo + hi)
        y = log_w(c - mid + log_lam, iters=12)
    y = log_w(c - mid + log_lam, iters=40)
    q = np.exp(np.minimum(y, 700.0))
    return q / q.sum(axis=1, keepdims=True)


def balanced_softmax(s: np.ndarray, lam: float, t0: np.ndarray | None = None, tol: float = 1e-10,
                     max_newton: int = 100) -> tuple[np.ndarray, np.ndarray]:
    """Exact maximiser over Q (rows on the simplex) of Σ_i [q_iᵀ s_i + H(q_i)] − (λN/2)‖ρ(Q) − u‖².

    Dual: min_t F(t) = (1/N) Σ_i lse(s_i − t) + uᵀt + ‖t‖²/(2λ) (smooth, strictly convex in K
    dimensions); ∇F = u − ρ(t) + t/λ, ∇²F = (1/N) Σ_i (diag p_i − p_i p_iᵀ) + I/λ with
    p_i = softmax(s_i − t). Damped Newton from ``t0``; returns (Q, t) with q_i = softmax(s_i − t) and
    t = λ(ρ(Q) − u) at the optimum (the fixed point of the per-sample quadratic-minoriser MM steps)."""
    n, k = s.shape
    u = 1.0 / k
    t = np.zeros(k) if t0 is None else np.asarray(t0, dtype=np.float64).copy()

    def evaluate(tt):
        z = s - tt[None, :]
        lse = _logsumexp(z)
        p = np.exp(z - lse)
        return float(lse.mean() + u * tt.sum() + tt @ tt / (2.0 * lam)), p

    f, p = evaluate(t)
    for _ in range(max_newton):
        g = u - p.mean(0) + t / lam
        if np.max(np.abs(g)) <= tol:
            break
        h = (np.diag(p.sum(0)) - p.T @ p) / n + np.eye(k) / lam
        step = np.linalg.solve(h, g)
        dec = float(g @ step)
        a, accepted = 1.0, False
        while a >= 1e-8:
            f_new, p_new = evaluate(t - a * step)
            if f_new <= f - 1e-4 * a * dec:
                accepted = True
                break
            a *= 0.5
        if not accepted:  # no further decrease representable in float64: at the optimum
            break
        t, f, p = t - a * step, f_new, p_new
    return p, t


# ------------------------------------------------------------------------------------ the vMF family
@dataclass
class VMFSettings:
    k: int = 24
    lam: float = 5000.0
    balance: str = "quadratic"        # quadratic (corrections) | entropy (spec) | none
    prior: str = "fixed"              # fixed (GEM, vmf) | learned (movmf-em)
    kappa: str = "free"               # free | tied | fixed
    kappa_solver: str = "approx"      # approx (corrections) | newton (exact maximiser)
    kappa_value: float = 50.0
    q_step: str = "exact"             # exact (Γ-block maximiser = limit of the MM steps) | mm (one minoriser step)
    max_iter: int = 200
    tol: float = 1e-6
    n_init: int = 1
    seed: int = 0
    inner: int = 1


def _scores(x, mu, kappa, log_prior, d):
    return (x @ mu.T) * kappa[None, :] + vmf.log_cd(d, kappa)[None, :] + log_prior[None, :]


def _kappa_step(cfg: VMFSettings, r_norm: np.ndarray, nk: np.ndarray, n: int, d: int, current: np.ndarray):
    solve = vmf.kappa_newton if cfg.kappa_solver == "newton" else vmf.kappa_approx
    if cfg.kappa == "fixed":
        return np.full_like(current, cfg.kappa_value)
    if cfg.kappa == "tied":
        return np.full_like(current, float(solve(d, np.array([r_norm.sum() / n]))[0]))
    rbar = r_norm / np.maximum(nk, 1e-8 * n)
    return solve(d, rbar)


def objective(x, q, mu, kappa, log_prior, cfg: VMFSettings) -> float:
    n, d = x.shape
    s = _scores(x, mu, kappa, log_prior, d)
    j = float((q * s).sum()) + _entropy_rows(q)
    rho = q.mean(0)
    if cfg.balance == "quadratic" and cfg.lam > 0:
        u = 1.0 / q.shape[1]
        j -= 0.5 * cfg.lam * n * float(((rho - u) ** 2).sum())
    elif cfg.balance == "entropy" and cfg.lam > 0:
        j += cfg.lam * n * float(-(rho * np.log(np.maximum(rho, 1e-300))).sum())
    return j


def _q_step(s: np.ndarray, q_old: np.ndarray, cfg: VMFSettings, state: dict | None = None) -> np.ndarray:
    k = s.shape[1]
    if cfg.lam <= 0 or cfg.balance == "none":
        return np.exp(s - _logsumexp(s))
    rho0 = q_old.mean(0)
    if cfg.balance == "quadratic" and cfg.q_step == "exact":
        state = {} if state is None else state
        q, state["t"] = balanced_softmax(s, cfg.lam, state.get("t"))
        return q
    if cfg.balance == "quadratic":
        a = s - cfg.lam * (rho0 - 1.0 / k)[None, :]
        return quadratic_row_solve(a, q_old, cfg.lam)
    # entropy balance (spec §3.3 step 2): multiplicative MM update
    lq = np.log(np.maximum(q_old, 1e-300))
    z = (s + cfg.lam * lq - cfg.lam * np.log(np.maximum(rho0, 1e-300))[None, :]) / (1.0 + cfg.lam)
    return np.exp(z - _logsumexp(z))


def fit_vmf(x: np.ndarray, cfg: VMFSettings, method: str = "gem", progress=None) -> ClusterResult:
    """Fit the (balanced) vMF mixture; ``x`` must be L2-normalised [N, d]."""
    best = None
    for r in range(cfg.n_init):
        res = _fit_once(x, cfg, cfg.seed + r, method, progress)
        if best is None or res.trace[-1] > best.trace[-1]:
            best = res
    return best


def _fit_once(x: np.ndarray, cfg: VMFSettings, seed: int, method: str, progress) -> ClusterResult:
    n, d = x.shape
    k = cfg.k
    labels, mu = spherical_kmeans(x, k, seed=seed, iters=5)
    onehot = np.eye(k)[labels]
    r = onehot.T @ x
    nk = onehot.sum(0)
    kappa = _kappa_step(cfg, np.linalg.norm(r, axis=1), nk, n, d, np.full(k, cfg.kappa_value))
    log_prior = np.full(k, -math.log(k))
    s = _scores(x, mu, kappa, log_prior, d)
    q = np.exp(s - _logsumexp(s))
    trace = [objective(x, q, mu, kappa, log_prior, cfg)]
    events = []
    it = 0
    loop = range(cfg.max_iter)
    if progress is not None:
        loop = progress(loop, f"{method} (K={k})", total=cfg.max_iter)
    state: dict = {}
    inner = 1 if (cfg.q_step == "exact" and cfg.balance == "quadratic") else cfg.inner
    for it in loop:
        for _ in range(inner):
            s = _scores(x, mu, kappa, log_prior, d)
            q = _q_step(s, q, cfg, state)
        nk = q.sum(0)
        reseeded = False
        for j in np.where(nk < 1e-4 * n)[0]:
            worst = int(np.argmin(np.max(x @ mu.T, axis=1)))
            mu[j] = x[worst]
            q[worst] = np.eye(k)[j]
            events.append({"iter": it, "reseed": int(j), "doc": worst})
            reseeded = True
        r = q.T @ x
        nk = q.sum(0)
        r_norm = np.linalg.norm(r, axis=1)
        mu = r / np.maximum(r_norm[:, None], 1e-300)
        kappa = _kappa_step(cfg, r_norm, nk, n, d, kappa)
        if cfg.prior == "learned":
            log_prior = np.log(np.maximum(nk / n, 1e-300))
        j_new = objective(x, q, mu, kappa, log_prior, cfg)
        if reseeded:
            events[-1]["j"] = j_new
        prev = trace[-1]
        trace.append(j_new)
        if abs(j_new - prev) <= cfg.tol * max(abs(prev), 1.0) and not reseeded:
            break
    return ClusterResult(method=method, labels=np.argmax(q, axis=1), q=q, mu=mu, kappa=kappa,
                         prior=np.exp(log_prior), trace=trace, events=events, iterations=it + 1)


def euclidean_kmeans(emb: np.ndarray, k: int, seed: int = 0, n_init: int = 3) -> ClusterResult:
    from sklearn.cluster import KMeans

    km = KMeans(n_clusters=k, init="k-means++", n_init=n_init, random_state=seed).fit(emb)
    labels = km.labels_.astype(int)
    return ClusterResult(method="kmeans", labels=labels, mu=normalize(km.cluster_centers_))


def hard_result(method: str, labels: np.ndarray, x: np.ndarray) -> ClusterResult:
    k = int(labels.max()) + 1
    mu = normalize(np.stack([x[labels == j].sum(0) if (labels == j).any() else x[0] for j in range(k)]))
    return ClusterResult(method=method, labels=labels, mu=mu)


# ------------------------------------------------------------------------------------ metrics
def shares(labels: np.ndarray, k: int) -> np.ndarray:
    return np.bincount(labels, minlength=k) / len(labels)


def normalized_entropy(p: np.ndarray) -> float:
    p = p[p > 0]
    k = len(p)
    return float(-(p * np.log(p)).sum() / math.log(max(k, 2))) if k > 1 else 0.0


def intrinsic(labels: np.ndarray, k: int, x: np.ndarray | None = None) -> dict:
    """Share-balance metrics over hard assignments (entropy normalised by log K)."""
    p = shares(labels, k)
    h = float(-(p[p > 0] * np.log(p[p > 0])).sum() / math.log(k)) if k > 1 else 0.0
    out = {"k": k, "norm_entropy": h, "max_share": float(p.max()), "min_share": float(p.min()),
           "empty": int((p == 0).sum())}
    if x is not None:
        mu = normalize(np.stack([x[labels == j].sum(0) if (labels == j).any() else x[0] for j in range(k)]))
        out["mean_cos"] = float(np.mean(np.sum(x * mu[labels], axis=1)))
    return out


def log_density(x: np.ndarray, mu: np.ndarray, kappa: np.ndarray) -> np.ndarray:
    d = x.shape[1]
    return (x @ mu.T) * kappa[None, :] + vmf.log_cd(d, kappa)[None, :]


def local_density(x: np.ndarray, labels: np.ndarray, m: int = 10, chunk: int = 2048) -> np.ndarray:
    """ρ(x): mean cosine of x to its top-M nearest neighbours inside its own cluster."""
    out = np.zeros(len(x))
    for j in np.unique(labels):
        idx = np.where(labels == j)[0]
        xs = x[idx]
        mm = min(m, len(idx) - 1)
        if mm <= 0:
            out[idx] = 1.0
            continue
        for s in range(0, len(idx), chunk):
            sim = xs[s:s + chunk] @ xs.T
            rows = np.arange(sim.shape[0])
            sim[rows, s + rows] = -np.inf  # exclude self
            top = -np.partition(-sim, mm - 1, axis=1)[:, :mm]
            out[idx[s:s + chunk]] = top.mean(1)
    return out


def gis_scores(x: np.ndarray, res: ClusterResult, beta: float = 1.0, m: int = 10) -> np.ndarray:
    """GIS_k(x_i) for each document's own (hard) cluster: log γ + log f + β log ρ."""
    labels = res.labels
    kappa = res.kappa if res.kappa is not None else np.full(res.k, 50.0)
    logf = log_density(x, res.mu, kappa)[np.arange(len(x)), labels]
    if res.q is not None:
        gamma = res.q[np.arange(len(x)), labels]
    else:
        gamma = np.ones(len(x))
    rho = local_density(x, labels, m=m)
    return np.log(np.maximum(gamma, 1e-300)) + logf + beta * np.log(np.clip(rho, 1e-6, None))

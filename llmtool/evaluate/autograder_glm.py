"""Bayesian GLMs for autograder (LLM-as-a-judge) bias: ordinal scores and pairwise preferences.

Paper: Dubois, Coppock, Giulianelli, Flesch, Luettgau, Ududec, "Skewed Score: A Statistical Framework to
Assess Autograders" (arXiv 2507.03772; ICML 2026 version "Quantifying Biases in LLM-as-Judge Evals").
Official software: HiBayES (NumPyro + ArviZ); it is not on PyPI, so the models are re-implemented here on
``numpyro`` (NUTS) and ``arviz`` (R-hat, ESS, PSIS-LOO, WAIC).

Linear predictor for grade r:
    eta_r = alpha + sum_f beta^f[level_f(r)] + sum_(f,g) gamma^{fg}[level_f(r), level_g(r)]
            + sum_s delta^s[grader(r)] * z_s(r) + u[item(r)]
* categorical main effects, effect coding (default): L-1 free N(0, 1) coefficients, the last is minus their
  sum (each effect is a deviation from the grand mean); ``dummy`` coding fixes the first level at 0;
* interactions f:g (grader:LLM = self-preference): effect coding samples the (L_f-1)(L_g-1) free cells and
  completes the matrix so every row and column sums to zero (the double constraint that keeps it
  identifiable against the main effects); dummy coding zeroes the first row and column;
* continuous slopes on standardised covariates: a single N(0, 1) slope (``z``) or one slope per grader
  (``z:grader``) with partial pooling delta_g ~ N(mu, sigma), mu ~ N(0, 0.5), sigma ~ HalfNormal(1), non-centred;
* optional item random intercepts u ~ N(0, sigma_u), sigma_u ~ HalfNormal(1), non-centred;
* hierarchical grader types (``grader:grader_type``): grader effect = m_type + s_type * eps_g, m ~ N(0, 3),
  s ~ HalfCauchy(1), eps ~ N(0, 1); type differences m_t - m_t' are recorded as derived quantities.
Likelihoods: ``ordinal`` cumulative logit P(Y <= c) = sigmoid(kappa_c - eta) (NumPyro OrderedLogistic), with
kappa_0 ~ N(-(C-1)*0.4, 0.2) and increments d_c + 0.3, d_c ~ LogNormal(-0.5, 0.3); ``pairwise``
y ~ Bernoulli(sigmoid(eta)) where ``--pair-param bt`` uses eta = alpha + theta[LLM_1] - theta[LLM_2] + ...
(alpha = first-position bias, theta effect-coded); ``binomial`` Binomial(n, sigmoid(eta)).
Every family has the intercept alpha ~ N(0, 1), the ordinal one included, as in the spec (§3.3) and HiBayES:
with ordinal scores alpha and the cutpoints share the grand mean and are separated only by the kappa_0
prior N(-4, 0.2), which is what makes the fitted effects comparable with HiBayES's (an earlier version left
alpha out of the ordinal model: on the q1 fixture that fitted ~11 elpd worse and shrank the autograder
effect from HiBayES's -0.97 to -0.86).

Checks (thresholds of HiBayES): divergences = 0, R-hat < 1.01, bulk/tail ESS > 1000 (400-1000 warns),
prior and posterior predictive category frequencies inside the 94% predictive interval; model comparison by
PSIS-LOO or WAIC. Agreement: Krippendorff's alpha (ordinal for scores, nominal for preferences; reliability
matrix graders x units, repeated grades reduced by their median) on the observed data, on posterior predictive
draws, and on counterfactual draws with chosen bias terms zeroed (keeping the grand mean, since only the
effect-coded deviations are set to 0).
"""
from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

import numpy as np

from llmtool.core.console import UsageError

KINDS = ("ordinal", "pairwise", "binomial")


@dataclass
class GlmConfig:
    outcome: str = "score"
    kind: str = "ordinal"
    levels: tuple[int, int] | None = None      # ordinal scale min:max (default: data range)
    effects: list[str] = field(default_factory=list)
    interactions: list[str] = field(default_factory=list)       # "grader:LLM"
    slopes: list[str] = field(default_factory=list)             # "length" or "length_diff:grader"
    standardise: list[str] = field(default_factory=list)
    random: list[str] = field(default_factory=list)             # ["item"]
    hierarchical: str | None = None                             # "grader:grader_type"
    group_map: dict[str, str] = field(default_factory=dict)     # grader -> type; "*" = default
    pair_param: str = "pair"                                    # "pair" | "bt"
    coding: str = "effect"
    trials: str | None = None                                   # binomial: column with n
    chains: int = 4
    samples: int = 2000
    warmup: int = 1000
    target_accept: float = 0.95
    max_tree_depth: int = 10
    seed: int = 0
    tag: str = ""


# ------------------------------------------------------------------ data -> design

@dataclass
class Design:
    y: np.ndarray
    factors: dict[str, np.ndarray]             # factor name -> level index per row
    levels: dict[str, list[str]]
    covariates: dict[str, np.ndarray]          # standardised numeric columns
    cov_stats: dict[str, tuple[float, float]]
    n_classes: int = 0
    y_offset: int = 0
    trials: np.ndarray | None = None
    type_of_grader: np.ndarray | None = None   # hierarchical: grader level -> type index
    type_levels: list[str] = field(default_factory=list)


def _factor_names(cfg: GlmConfig) -> list[str]:
    names = list(cfg.effects)
    for inter in cfg.interactions:
        names += inter.split(":")
    for s in cfg.slopes:
        if ":" in s:
            names.append(s.split(":")[1])
    names += list(cfg.random)
    if cfg.hierarchical:
        names.append(cfg.hierarchical.split(":")[0])
    if cfg.pair_param == "bt":
        names += ["LLM_1", "LLM_2"]
    return list(dict.fromkeys(names))


def validate_config(cfg: GlmConfig) -> None:
    if cfg.kind not in KINDS:
        raise UsageError(f"--kind must be one of {', '.join(KINDS)}, got {cfg.kind!r}")
    if cfg.coding not in ("effect", "dummy"):
        raise UsageError(f"--coding must be effect or dummy, got {cfg.coding!r}")
    if cfg.pair_param not in ("pair", "bt"):
        raise UsageError(f"--pair-param must be pair or bt, got {cfg.pair_param!r}")
    if cfg.pair_param == "bt" and cfg.kind != "pairwise":
        raise UsageError("--pair-param bt needs --kind pairwise")
    for inter in cfg.interactions:
        if inter.count(":") != 1 or not all(inter.split(":")):
            raise UsageError(f"--interactions: expected FACTOR:FACTOR, got {inter!r}")
    for s in cfg.slopes:
        if s.count(":") > 1 or not all(s.split(":")):
            raise UsageError(f"--slopes: expected COLUMN or COLUMN:FACTOR, got {s!r}")
    if cfg.hierarchical and (cfg.hierarchical.count(":") != 1):
        raise UsageError(f"--hierarchical: expected GRADER:TYPE, got {cfg.hierarchical!r}")
    if cfg.kind == "binomial" and not cfg.trials:
        raise UsageError("--kind binomial needs --trials COLUMN (number of attempts per row)")
    if min(cfg.chains, cfg.samples, cfg.warmup) < 1:
        raise UsageError("--chains, --samples and --warmup must be positive")


def _short(value: Any, n: int = 60) -> str:
    """``repr`` of a cell for an error line, cut to ``n`` characters (a field may be 100k characters long)."""
    text = repr(value)
    return text if len(text) <= n else f"{text[:n]}... ({len(str(value))} characters)"


def build_design(rows: Sequence[dict], cfg: GlmConfig, source: str = "data") -> Design:
    validate_config(cfg)
    if not rows:
        raise UsageError(f"{source}: no rows")
    header = set(rows[0])
    hier_type = cfg.hierarchical.split(":")[1] if cfg.hierarchical else None
    needed = [cfg.outcome] + [f for f in _factor_names(cfg) if not (f == "llm_pair" and "llm_pair" not in header)]
    needed += [s.split(":")[0] for s in cfg.slopes] + ([cfg.trials] if cfg.trials else [])
    for col in needed:
        if col not in header:
            raise UsageError(f"{source}: missing column {col!r} (columns: {', '.join(sorted(header))})")
    if "llm_pair" in _factor_names(cfg) and "llm_pair" not in header:
        for col in ("LLM_1", "LLM_2"):
            if col not in header:
                raise UsageError(f"{source}: missing column 'llm_pair' (or LLM_1 and LLM_2 to build it)")
        rows = [{**r, "llm_pair": f"{r['LLM_1']}-{r['LLM_2']}"} for r in rows]

    def number(r: dict, col: str, i: int) -> float:
        try:
            x = float(r[col])
        except (TypeError, ValueError):
            raise UsageError(f"{source}:{i + 2}: column {col!r}: non-numeric value {_short(r[col])}") from None
        if not math.isfinite(x):
            raise UsageError(f"{source}:{i + 2}: column {col!r}: non-finite value {_short(r[col])}")
        return x

    y = np.array([number(r, cfg.outcome, i) for i, r in enumerate(rows)])
    d = Design(y=y, factors={}, levels={}, covariates={}, cov_stats={})
    if cfg.kind == "ordinal":
        if np.any(y != np.round(y)):
            raise UsageError(f"{source}: column {cfg.outcome!r} must hold integer grades for --kind ordinal")
        lo, hi = cfg.levels if cfg.levels else (int(y.min()), int(y.max()))
        bad = np.flatnonzero((y < lo) | (y > hi))
        if len(bad):
            raise UsageError(f"{source}:{bad[0] + 2}: column {cfg.outcome!r}: grade {y[bad[0]]:g} outside --levels {lo}:{hi}")
        d.y = (y - lo).astype(np.int64)
        d.n_classes, d.y_offset = hi - lo + 1, lo
        if d.n_classes < 2:
            raise UsageError("--kind ordinal needs at least two grade levels")
    elif cfg.kind == "pairwise":
        if not np.isin(y, (0, 1)).all():
            bad = int(np.flatnonzero(~np.isin(y, (0, 1)))[0])
            raise UsageError(f"{source}:{bad + 2}: column {cfg.outcome!r} must be 0 or 1 for --kind pairwise")
        d.y = y.astype(np.int64)
        d.n_classes = 2
    else:
        d.trials = np.array([number(r, cfg.trials, i) for i, r in enumerate(rows)]).astype(np.int64)
        if np.any(y < 0) or np.any(y > d.trials):
            raise UsageError(f"{source}: column {cfg.outcome!r} must lie in [0, {cfg.trials}]")
        d.y = y.astype(np.int64)
    for f in _factor_names(cfg):
        values = [str(r[f]) for r in rows]
        if f in ("LLM_1", "LLM_2"):
            continue
        levels = sorted(set(values))
        d.levels[f] = levels
        index = {lv: i for i, lv in enumerate(levels)}
        d.factors[f] = np.array([index[v] for v in values], dtype=np.int64)
    if cfg.pair_param == "bt":
        llms = sorted({str(r["LLM_1"]) for r in rows} | {str(r["LLM_2"]) for r in rows})
        d.levels["LLM"] = llms
        index = {lv: i for i, lv in enumerate(llms)}
        d.factors["LLM_1"] = np.array([index[str(r["LLM_1"])] for r in rows], dtype=np.int64)
        d.factors["LLM_2"] = np.array([index[str(r["LLM_2"])] for r in rows], dtype=np.int64)
    for s in cfg.slopes:
        col = s.split(":")[0]
        x = np.array([number(r, col, i) for i, r in enumerate(rows)])
        mean, sd = (float(x.mean()), float(x.std())) if col in cfg.standardise else (0.0, 1.0)
        if sd == 0:
            raise UsageError(f"{source}: column {col!r} is constant; cannot standardise")
        d.covariates[col] = (x - mean) / sd
        d.cov_stats[col] = (mean, sd)
    if cfg.hierarchical:
        g = cfg.hierarchical.split(":")[0]
        if hier_type in header:
            by_grader: dict[str, str] = {}
            for r in rows:
                by_grader.setdefault(str(r[g]), str(r[hier_type]))
        else:
            by_grader = {lv: _map_group(lv, cfg.group_map, hier_type) for lv in d.levels[g]}
        d.type_levels = sorted(set(by_grader.values()))
        if len(d.type_levels) < 2:
            raise UsageError("--hierarchical needs at least two grader types (see --group-map)")
        d.type_of_grader = np.array([d.type_levels.index(by_grader[lv]) for lv in d.levels[g]], dtype=np.int64)
    return d


def _map_group(level: str, group_map: dict[str, str], type_col: str) -> str:
    for pattern, t in group_map.items():
        if pattern != "*" and (level == pattern or level.startswith(pattern)):
            return t
    if "*" in group_map:
        return group_map["*"]
    raise UsageError(f"no grader type for {level!r}: add a column {type_col!r} or a --group-map entry")


def parse_group_map(text: str) -> dict[str, str]:
    out = {}
    for part in filter(None, (p.strip() for p in text.split(","))):
        if "=" not in part:
            raise UsageError(f"--group-map: expected PATTERN=TYPE, got {part!r}")
        k, v = part.split("=", 1)
        out[k.strip()] = v.strip()
    return out


# ------------------------------------------------------------------ model

def effect_vector(free, coding: str):
    import jax.numpy as jnp

    if coding == "effect":
        return jnp.concatenate([free, -free.sum(keepdims=True)])
    return jnp.concatenate([jnp.zeros(1), free])


def effect_matrix(free, coding: str):
    """Complete an (Lf-1) x (Lg-1) free block into an Lf x Lg interaction matrix."""
    import jax.numpy as jnp

    if coding == "effect":
        col = -free.sum(axis=1, keepdims=True)
        top = jnp.concatenate([free, col], axis=1)
        bottom = -top.sum(axis=0, keepdims=True)
        return jnp.concatenate([top, bottom], axis=0)
    lf, lg = free.shape
    top = jnp.zeros((1, lg + 1))
    return jnp.concatenate([top, jnp.concatenate([jnp.zeros((lf, 1)), free], axis=1)], axis=0)


def site_names(cfg: GlmConfig) -> dict[str, list[str]]:
    """Groups of deterministic sites, for counterfactual interventions: ``grader_effects`` etc."""
    groups: dict[str, list[str]] = {}
    for f in cfg.effects:
        groups[f"{f}_effects"] = [f"{f}_effects"]
    if cfg.hierarchical:
        groups[f"{cfg.hierarchical.split(':')[0]}_effects"] = [f"{cfg.hierarchical.split(':')[0]}_effects"]
    for inter in cfg.interactions:
        name = inter.replace(":", "_") + "_effects"
        groups[name] = [name]
    for s in cfg.slopes:
        name = s.replace(":", "_") + "_slope"
        groups[name] = [name]
    return groups


def make_model(cfg: GlmConfig, design: Design):
    """A NumPyro model function ``model(y=None, zero=())``; ``zero`` names deterministic effect sites
    whose values are replaced by 0 in the linear predictor (counterfactual intervention)."""
    import jax.numpy as jnp
    import numpyro
    import numpyro.distributions as dist

    n_rows = len(design.y)
    hier_factor = cfg.hierarchical.split(":")[0] if cfg.hierarchical else None

    def model(y=None, zero: Sequence[str] = ()):
        alpha = numpyro.sample("alpha", dist.Normal(0.0, 1.0))
        eta = jnp.zeros(n_rows) + alpha

        def use(name, value):
            value = numpyro.deterministic(name, value)
            return jnp.zeros_like(value) if name in zero else value

        for f in cfg.effects:
            if f == hier_factor:
                continue
            lv = len(design.levels[f])
            free = numpyro.sample(f"{f}_free", dist.Normal(0.0, 1.0).expand([lv - 1]).to_event(1))
            eta = eta + use(f"{f}_effects", effect_vector(free, cfg.coding))[design.factors[f]]
        if cfg.pair_param == "bt":
            lv = len(design.levels["LLM"])
            free = numpyro.sample("LLM_free", dist.Normal(0.0, 1.0).expand([lv - 1]).to_event(1))
            theta = use("LLM_strength", effect_vector(free, "effect"))
            eta = eta + theta[design.factors["LLM_1"]] - theta[design.factors["LLM_2"]]
        if hier_factor:
            nt = len(design.type_levels)
            ng = len(design.levels[hier_factor])
            m = numpyro.sample("type_mean", dist.Normal(0.0, 3.0).expand([nt]).to_event(1))
            s = numpyro.sample("type_scale", dist.HalfCauchy(1.0).expand([nt]).to_event(1))
            eps = numpyro.sample(f"{hier_factor}_raw", dist.Normal(0.0, 1.0).expand([ng]).to_event(1))
            tg = design.type_of_grader
            eff = use(f"{hier_factor}_effects", m[tg] + s[tg] * eps)
            eta = eta + eff[design.factors[hier_factor]]
            diffs = []
            for i in range(nt):
                for j in range(i + 1, nt):
                    diffs.append(m[i] - m[j])
            numpyro.deterministic("type_diff", jnp.stack(diffs))
        for inter in cfg.interactions:
            f, g = inter.split(":")
            lf, lg = len(design.levels[f]), len(design.levels[g])
            name = inter.replace(":", "_")
            free = numpyro.sample(f"{name}_free", dist.Normal(0.0, 1.0).expand([lf - 1, lg - 1]).to_event(2))
            mat = use(f"{name}_effects", effect_matrix(free, cfg.coding))
            eta = eta + mat[design.factors[f], design.factors[g]]
        for s in cfg.slopes:
            col, _, by = s.partition(":")
            name = s.replace(":", "_") + "_slope"
            z = design.covariates[col]
            if by:
                lv = len(design.levels[by])
                mu = numpyro.sample(f"{name}_mu", dist.Normal(0.0, 0.5))
                sd = numpyro.sample(f"{name}_sigma", dist.HalfNormal(1.0))
                raw = numpyro.sample(f"{name}_raw", dist.Normal(0.0, 1.0).expand([lv]).to_event(1))
                slope = use(name, mu + sd * raw)
                eta = eta + slope[design.factors[by]] * z
            else:
                slope = use(name, numpyro.sample(f"{name}_value", dist.Normal(0.0, 1.0)))
                eta = eta + slope * z
        for r in cfg.random:
            lv = len(design.levels[r])
            sd = numpyro.sample(f"{r}_sigma", dist.HalfNormal(1.0))
            raw = numpyro.sample(f"{r}_raw", dist.Normal(0.0, 1.0).expand([lv]).to_event(1))
            u = use(f"{r}_random", sd * raw)
            eta = eta + u[design.factors[r]]
        if cfg.kind == "ordinal":
            c = design.n_classes
            k0 = numpyro.sample("cut_first", dist.Normal(-(c - 1) * 0.4, 0.2))
            inc = numpyro.sample("cut_increments", dist.LogNormal(-0.5, 0.3).expand([c - 2]).to_event(1))
            cut = numpyro.deterministic("cutpoints", jnp.concatenate([k0[None], k0 + jnp.cumsum(inc + 0.3)]))
            numpyro.sample("obs", dist.OrderedLogistic(eta, cut), obs=y)
        elif cfg.kind == "pairwise":
            numpyro.sample("obs", dist.Bernoulli(logits=eta), obs=y)
        else:
            numpyro.sample("obs", dist.Binomial(jnp.asarray(design.trials), logits=eta), obs=y)

    return model


def ordinal_probs(eta: np.ndarray, cut: np.ndarray) -> np.ndarray:
    """Category probabilities of the cumulative-logit model ([..., C])."""
    eta = np.asarray(eta, dtype=float)[..., None]
    cdf = 1.0 / (1.0 + np.exp(-(np.asarray(cut, dtype=float) - eta)))
    ones = np.ones(eta.shape[:-1] + (1,))
    zeros = np.zeros(eta.shape[:-1] + (1,))
    full = np.concatenate([zeros, cdf, ones], axis=-1)
    return np.diff(full, axis=-1)


# ------------------------------------------------------------------ fitting and diagnostics

def _jax_setup() -> None:
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=1")
    import jax

    jax.config.update("jax_enable_x64", True)
    jax.config.update("jax_platform_name", "cpu")
    # XLA compilation dominates small fits on CPU: keep compiled programs in a persistent cache
    # (like triton's kernel cache), so repeated fits of the same model shape start at once.
    cache = os.environ.get("LLMTOOL_JAX_CACHE", str(Path("~/.cache/llmtool-jax").expanduser()))
    jax.config.update("jax_compilation_cache_dir", cache)
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.5)


@dataclass
class GlmFit:
    config: GlmConfig
    design: Design
    idata: object                  # arviz.InferenceData
    samples: dict                  # posterior samples, flattened over chains ([S, ...])
    diagnostics: dict
    summary: object                # pandas DataFrame (arviz.summary)


def fit(rows: Sequence[dict], cfg: GlmConfig, source: str = "data", progress: bool = False) -> GlmFit:
    _jax_setup()
    import warnings

    import arviz as az
    import jax
    from numpyro.infer import MCMC, NUTS, Predictive

    design = build_design(rows, cfg, source)
    model = make_model(cfg, design)
    kernel = NUTS(model, target_accept_prob=cfg.target_accept, max_tree_depth=cfg.max_tree_depth)
    mcmc = MCMC(kernel, num_warmup=cfg.warmup, num_samples=cfg.samples, num_chains=cfg.chains,
                chain_method="vectorized", progress_bar=progress)
    key = jax.random.PRNGKey(cfg.seed)
    k_mcmc, k_prior, k_post = jax.random.split(key, 3)
    y = design.y
    mcmc.run(k_mcmc, y=y, extra_fields=("diverging",))
    posterior_samples = mcmc.get_samples()
    prior = Predictive(model, num_samples=500)(k_prior)
    ppc = Predictive(model, posterior_samples)(k_post)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        idata = az.from_numpyro(mcmc, prior={k: np.asarray(v) for k, v in prior.items()},
                                posterior_predictive={"obs": ppc["obs"]})
    divergences = int(np.asarray(mcmc.get_extra_fields()["diverging"]).sum())
    summary = _summary(idata, cfg)
    diag = diagnostics(summary, divergences, cfg, design, np.asarray(prior["obs"]), np.asarray(ppc["obs"]))
    samples = {k: np.asarray(v) for k, v in posterior_samples.items()}
    return GlmFit(cfg, design, idata, samples, diag, summary)


def reported_vars(idata, cfg: GlmConfig) -> list[str]:
    names = list(idata.posterior.data_vars)
    return [n for n in names if not n.endswith(("_free", "_raw")) and n != "cut_increments"]


def _summary(idata, cfg: GlmConfig):
    import warnings

    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return az.summary(idata, var_names=reported_vars(idata, cfg), hdi_prob=0.94, round_to=None)


def diagnostics(summary, divergences: int, cfg: GlmConfig, design: Design, prior_obs: np.ndarray,
                post_obs: np.ndarray) -> dict:
    import pandas as pd

    # parameters fixed by construction (e.g. the last effect-coded level, dummy zeros) have NaN r_hat
    rhat = pd.to_numeric(summary["r_hat"], errors="coerce").dropna()
    ess_b = pd.to_numeric(summary["ess_bulk"], errors="coerce").dropna()
    ess_t = pd.to_numeric(summary["ess_tail"], errors="coerce").dropna()
    max_rhat = float(rhat.max()) if len(rhat) else float("nan")
    min_ess = float(min(ess_b.min(), ess_t.min())) if len(ess_b) else float("nan")
    draws = cfg.chains * cfg.samples

    def ess_status(v: float) -> str:
        return "pass" if v > 1000 else ("warn" if v >= 400 else "fail")

    checks = {
        "divergences": "pass" if divergences == 0 else ("warn" if divergences <= 0.01 * draws else "fail"),
        "r_hat": "pass" if max_rhat < 1.01 else "fail",
        "ess_bulk": ess_status(float(ess_b.min()) if len(ess_b) else float("nan")),
        "ess_tail": ess_status(float(ess_t.min()) if len(ess_t) else float("nan")),
        "prior_predictive": _predictive_check(design, prior_obs),
        "posterior_predictive": _predictive_check(design, post_obs),
    }
    return {"divergences": divergences, "max_r_hat": max_rhat, "min_ess": min_ess,
            "min_ess_bulk": float(ess_b.min()) if len(ess_b) else None,
            "min_ess_tail": float(ess_t.min()) if len(ess_t) else None,
            "draws": draws, "checks": checks,
            "passed": all(checks[k] != "fail" for k in ("divergences", "r_hat", "ess_bulk", "ess_tail"))}


def _predictive_check(design: Design, obs: np.ndarray) -> str:
    """Observed category frequencies inside the 94% interval of the predictive frequencies."""
    if design.n_classes == 0:
        return "skipped"
    obs = obs.reshape(-1, obs.shape[-1])
    freq = np.stack([(obs == c).mean(axis=1) for c in range(design.n_classes)], axis=1)
    lo, hi = np.quantile(freq, 0.03, axis=0), np.quantile(freq, 0.97, axis=0)
    observed = np.array([(design.y == c).mean() for c in range(design.n_classes)])
    return "pass" if bool(((observed >= lo - 1e-12) & (observed <= hi + 1e-12)).all()) else "fail"


def information_criteria(fit_: GlmFit) -> dict:
    import warnings

    import arviz as az

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        loo = az.loo(fit_.idata, pointwise=True)
        waic = az.waic(fit_.idata, pointwise=True)
    pareto_k = np.asarray(loo.pareto_k)
    return {"loo": {"elpd": float(loo.elpd_loo), "se": float(loo.se), "p": float(loo.p_loo),
                    "share_pareto_k_gt_0.7": float((pareto_k > 0.7).mean())},
            "waic": {"elpd": float(waic.elpd_waic), "se": float(waic.se), "p": float(waic.p_waic)},
            "pointwise": {"loo": np.asarray(loo.loo_i).tolist(), "waic": np.asarray(waic.waic_i).tolist(),
                          "pareto_k": pareto_k.tolist()}}


def compare(fits: dict[str, GlmFit], criterion: str = "loo") -> list[dict]:
    """arviz.compare over named fits: elpd, elpd difference to the best and its SE."""
    import warnings

    import arviz as az

    if criterion not in ("loo", "waic"):
        raise UsageError(f"--criterion must be loo or waic, got {criterion!r}")
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        table = az.compare({k: f.idata for k, f in fits.items()}, ic=criterion)
    elpd_col = f"elpd_{criterion}"
    return [{"model": name, "rank": int(r["rank"]), "elpd": float(r[elpd_col]), "se": float(r["se"]),
             "elpd_diff": float(r["elpd_diff"]), "dse": float(r["dse"]), "weight": float(r["weight"])}
            for name, r in table.iterrows()]


def interval(fit_: GlmFit, name: str, prob: float = 0.94) -> np.ndarray:
    """HDI of every element of a posterior site: array [..., 2]."""
    import arviz as az

    x = fit_.samples[name]
    flat = x.reshape(x.shape[0], -1)
    out = np.stack([az.hdi(flat[:, i], hdi_prob=prob) for i in range(flat.shape[1])])
    return out.reshape(x.shape[1:] + (2,))


def bias_table(fit_: GlmFit, prob: float = 0.94) -> list[dict]:
    """Posterior mean and HDI of every effect element, with level names; 'credible' = HDI excludes 0."""
    rows = []
    cfg, d = fit_.config, fit_.design
    for name, x in fit_.samples.items():
        if name.endswith(("_free", "_raw")) or name in ("cut_increments",):
            continue
        hdi = interval(fit_, name, prob)
        mean = x.mean(axis=0)
        labels = _element_labels(name, x.shape[1:], cfg, d)
        for idx, lab in labels:
            lo, hi = hdi[idx]
            rows.append({"parameter": name, "element": lab, "mean": float(mean[idx]), "sd": float(x[(slice(None),) + idx].std()),
                         "hdi_low": float(lo), "hdi_high": float(hi), "credible": bool(lo > 0 or hi < 0)})
    return rows


def _element_labels(name: str, shape: tuple, cfg: GlmConfig, d: Design) -> list[tuple[tuple, str]]:
    if shape == ():
        return [((), "")]
    axes_levels: list[list[str]] = []
    base = name
    for suffix in ("_effects", "_slope", "_random", "_strength"):
        if name.endswith(suffix):
            base = name[: -len(suffix)]
    if name == "type_mean" or name == "type_scale":
        axes_levels = [d.type_levels]
    elif name == "type_diff":
        nt = len(d.type_levels)
        axes_levels = [[f"{d.type_levels[i]}-{d.type_levels[j]}" for i in range(nt) for j in range(i + 1, nt)]]
    elif name == "LLM_strength":
        axes_levels = [d.levels["LLM"]]
    elif name.endswith("_effects") and ":" not in base and base in d.levels:
        axes_levels = [d.levels[base]]
    elif name.endswith("_effects") and "_" in base:
        for inter in cfg.interactions:
            if inter.replace(":", "_") == base:
                f, g = inter.split(":")
                axes_levels = [d.levels[f], d.levels[g]]
    elif name.endswith("_slope"):
        for s in cfg.slopes:
            if s.replace(":", "_") == base and ":" in s:
                axes_levels = [d.levels[s.split(":")[1]]]
    elif name.endswith("_random"):
        axes_levels = [d.levels[base]]
    out = []
    for idx in np.ndindex(*shape):
        if len(axes_levels) == len(shape):
            out.append((idx, ",".join(axes_levels[a][i] for a, i in enumerate(idx))))
        else:
            out.append((idx, ",".join(map(str, idx))))
    return out


# ------------------------------------------------------------------ agreement and counterfactuals

def reliability_matrix(y: np.ndarray, graders: np.ndarray, units: np.ndarray, n_graders: int, n_units: int) -> np.ndarray:
    """graders x units matrix of median grades (NaN where a grader did not grade a unit)."""
    mat = np.full((n_graders, n_units), np.nan)
    for g in range(n_graders):
        for u in range(n_units):
            sel = (graders == g) & (units == u)
            if sel.any():
                mat[g, u] = np.median(y[sel])
    return mat


def krippendorff_alpha(mat: np.ndarray, level: str) -> float:
    import krippendorff

    usable = (~np.isnan(mat)).sum(axis=0) >= 2
    if usable.sum() < 2:
        return float("nan")
    m = mat[:, usable]
    if np.unique(m[~np.isnan(m)]).size < 2:
        return float("nan")
    return float(krippendorff.alpha(reliability_data=m, level_of_measurement=level))


def _units(fit_: GlmFit, rows: Sequence[dict], units: Sequence[str]) -> tuple[np.ndarray, int]:
    keys = [tuple(str(r[u]) for u in units) for r in rows]
    levels = sorted(set(keys))
    index = {k: i for i, k in enumerate(levels)}
    return np.array([index[k] for k in keys]), len(levels)


def agreement(fit_: GlmFit, rows: Sequence[dict], units: Sequence[str], grader: str = "grader",
              counterfactual: Sequence[str] = (), draws: int = 200, seed: int = 0) -> dict:
    """Krippendorff's alpha on observed data, on posterior predictive draws, and on counterfactual draws with
    the named effect sites set to 0."""
    _jax_setup()
    import jax
    from numpyro.infer import Predictive

    for u in list(units) + [grader]:
        if u not in rows[0]:
            raise UsageError(f"agreement: missing column {u!r}")
    known = {s for group in site_names(fit_.config).values() for s in group}
    for name in counterfactual:
        if name not in known:
            raise UsageError(f"--counterfactual: unknown bias term {name!r}; choose from {', '.join(sorted(known))}")
    level = "ordinal" if fit_.config.kind == "ordinal" else ("nominal" if fit_.config.kind == "pairwise" else "interval")
    unit_idx, n_units = _units(fit_, rows, units)
    g_levels = sorted({str(r[grader]) for r in rows})
    g_idx = np.array([g_levels.index(str(r[grader])) for r in rows])
    observed = krippendorff_alpha(reliability_matrix(fit_.design.y.astype(float), g_idx, unit_idx,
                                                     len(g_levels), n_units), level)
    rng = np.random.default_rng(seed)
    total = next(iter(fit_.samples.values())).shape[0]
    pick = np.sort(rng.choice(total, size=min(draws, total), replace=False))
    sub = {k: v[pick] for k, v in fit_.samples.items()}
    model = make_model(fit_.config, fit_.design)
    key = jax.random.PRNGKey(seed)
    k1, k2 = jax.random.split(key)
    sims = {"posterior_predictive": np.asarray(Predictive(model, sub)(k1)["obs"])}
    if counterfactual:
        sims["counterfactual"] = np.asarray(Predictive(model, sub)(k2, zero=tuple(counterfactual))["obs"])
    out = {"level": level, "units": n_units, "graders": len(g_levels), "observed": observed,
           "counterfactual_zeroed": list(counterfactual), "draws": int(len(pick))}
    for name, sim in sims.items():
        alphas = np.array([krippendorff_alpha(reliability_matrix(s.astype(float), g_idx, unit_idx, len(g_levels),
                                                                 n_units), level) for s in sim])
        alphas = alphas[np.isfinite(alphas)]
        out[name] = {"mean": float(alphas.mean()) if len(alphas) else None,
                     "ci95": [float(np.quantile(alphas, 0.025)), float(np.quantile(alphas, 0.975))] if len(alphas) else None}
        out[name + "_mean_outcome"] = float(sim.mean()) + (fit_.design.y_offset if fit_.config.kind == "ordinal" else 0)
    return out


# ------------------------------------------------------------------ writing a fit directory

def write_fit(fit_: GlmFit, out: Path, ic: dict | None = None) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols: dict[str, list] = {}
    post = fit_.idata.posterior
    chains, draws = post.sizes["chain"], post.sizes["draw"]
    cols["chain"] = np.repeat(np.arange(chains), draws).tolist()
    cols["draw"] = np.tile(np.arange(draws), chains).tolist()
    for name in post.data_vars:
        arr = np.asarray(post[name]).reshape(chains * draws, -1)
        shape = post[name].shape[2:]
        for i, idx in enumerate(np.ndindex(*shape) if shape else [()]):
            col = name + ("" if not idx else "[" + ",".join(map(str, idx)) + "]")
            cols[col] = arr[:, i].tolist()
    pq.write_table(pa.table(cols), out / "draws.parquet")
    fit_.summary.to_csv(out / "summary.csv", float_format="%.6g")
    (out / "diagnostics.json").write_text(json.dumps(fit_.diagnostics, indent=2))
    (out / "levels.json").write_text(json.dumps({"factors": fit_.design.levels, "types": fit_.design.type_levels,
                                                 "standardised": fit_.design.cov_stats,
                                                 "outcome_offset": fit_.design.y_offset,
                                                 "coding": fit_.config.coding}, indent=2))
    (out / "config.json").write_text(json.dumps(asdict(fit_.config), indent=2))
    bias = bias_table(fit_)
    import csv

    with open(out / "effects.csv", "w", newline="") as fh:
        w = csv.DictWriter(fh, fieldnames=list(bias[0]) if bias else ["parameter"])
        w.writeheader()
        w.writerows(bias)
    if ic is not None:
        point = ic.pop("pointwise")
        (out / "ic.json").write_text(json.dumps(ic, indent=2))
        with open(out / "ic_pointwise.csv", "w", newline="") as fh:
            w = csv.writer(fh)
            w.writerow(["row", "loo", "waic", "pareto_k"])
            for i, vals in enumerate(zip(point["loo"], point["waic"], point["pareto_k"])):
                w.writerow([i, *vals])
        ic["pointwise"] = point
    try:
        fit_.idata.to_netcdf(str(out / "idata.nc"))
    except Exception:  # netCDF backend not installed: draws.parquet carries the draws
        pass


def load_fit_dir(path: Path):
    """InferenceData of a fit directory (for compare)."""
    import arviz as az

    nc = Path(path) / "idata.nc"
    if not nc.is_file():
        raise UsageError(f"{path}: no idata.nc (not an `evaluate autograder fit` output, or netCDF missing)")
    return az.from_netcdf(str(nc))

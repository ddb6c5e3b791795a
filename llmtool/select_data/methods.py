"""Registries of the select-data area: domain-discovery methods (GEM and its baselines) and RLVR
subset selectors (SHIFT and its label-free baselines), and the domain-weight mixers run on any taxonomy
(natural, uniform, DoReMi, RegMix). Each method is a config dataclass; the CLI is
derived from these registries."""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

import numpy as np

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

CLUSTERERS = Registry("select-data cluster")
SELECTORS = Registry("select-data select")
MIXERS = Registry("select-data mix")


# ------------------------------------------------------------------------------------ clustering
@dataclass
class GEMConfig(MethodConfig):
    name: ClassVar[str] = "gem"
    help: ClassVar[str] = "Balanced vMF mixture with decoupled prior, MM optimisation (GEM)."
    k: int = option(24, "Number of domains K.", min=2)
    lam: float = option(5000.0, "Balance strength λ.", min=0.0)
    balance: str = option("quadratic", "Balance regulariser: −(λN/2)‖ρ−u‖² or the spec's λN·H(ρ).",
                          choices=("quadratic", "entropy"))
    kappa: str = option("free", "Concentration: per cluster, one tied value, or fixed.", choices=("free", "tied", "fixed"))
    kappa_solver: str = option("approx", "κ from R̄: closed-form approximation or exact Newton.",
                               choices=("approx", "newton"))
    kappa_value: float = option(50.0, "κ when --kappa fixed.", min=0.0, exclusive_min=True)
    q_step: str = option("exact", "Q-step for the quadratic balance: the exact maximiser over Q (the limit of the "
                         "per-sample minoriser steps) or one per-sample quadratic-minoriser MM step.",
                         choices=("exact", "mm"))
    inner: int = option(1, "Q-steps per iteration with --q-step mm or --balance entropy.", min=1)
    max_iter: int = option(200, "Maximum MM iterations (stops earlier at relative change of J < 1e-6).", min=1)
    n_init: int = option(1, "Restarts (best J kept).", min=1)
    cluster_seed: int = option(0, "Seed of the k-means++ initialisation.")

    def settings(self):
        from llmtool.select_data.gem import VMFSettings

        return VMFSettings(k=self.k, lam=self.lam, balance=self.balance, prior="fixed", kappa=self.kappa,
                           kappa_solver=self.kappa_solver, kappa_value=self.kappa_value, q_step=self.q_step,
                           inner=self.inner, max_iter=self.max_iter, n_init=self.n_init, seed=self.cluster_seed)


@dataclass
class VMFConfig(GEMConfig):
    name: ClassVar[str] = "vmf"
    help: ClassVar[str] = "Vanilla vMF mixture: GEM with λ = 0 (uniform fixed prior)."
    lam: float = option(0.0, "Balance strength λ (0 for this baseline).", min=0.0)


@dataclass
class MovMFConfig(MethodConfig):
    name: ClassVar[str] = "movmf-em"
    help: ClassVar[str] = "Classical movMF EM: learned prior π ← ρ, free κ (Banerjee et al. 2005)."
    k: int = option(24, "Number of domains K.", min=2)
    max_iter: int = option(200, "Maximum EM iterations (stops earlier at relative change of J < 1e-6).", min=1)
    cluster_seed: int = option(0, "Seed of the k-means++ initialisation.")

    def settings(self):
        from llmtool.select_data.gem import VMFSettings

        return VMFSettings(k=self.k, lam=0.0, balance="none", prior="learned", kappa="free",
                           kappa_solver="approx", max_iter=self.max_iter, seed=self.cluster_seed)


@dataclass
class SphericalKMeansConfig(MethodConfig):
    name: ClassVar[str] = "spherical-kmeans"
    help: ClassVar[str] = "Cosine k-means on normalised embeddings."
    k: int = option(24, "Number of domains K.", min=2)
    cluster_seed: int = option(0, "Seed of the k-means++ initialisation.")


@dataclass
class KMeansConfig(MethodConfig):
    name: ClassVar[str] = "kmeans"
    help: ClassVar[str] = "Euclidean K-Means on raw embeddings (scikit-learn, k-means++, 3 inits)."
    k: int = option(24, "Number of domains K.", min=2)
    cluster_seed: int = option(0, "Seed of the k-means++ initialisation.")


@dataclass
class SourceConfig(MethodConfig):
    name: ClassVar[str] = "source"
    help: ClassVar[str] = "The corpus's own labels (the `source` field): human taxonomy."


for _c in (GEMConfig, VMFConfig, MovMFConfig, SphericalKMeansConfig, KMeansConfig, SourceConfig):
    CLUSTERERS.add_config(_c)


def run_clusterer(cfg: MethodConfig, raw: np.ndarray, sources: list[str] | None = None, progress=None):
    """Cluster raw embeddings [N, d] with the chosen method; returns (ClusterResult, domain names|None)."""
    from llmtool.select_data import gem

    x = gem.normalize(raw.astype(np.float64))
    n = len(x)
    if cfg.name == "source":
        if sources is None or any(s is None for s in sources):
            raise UsageError("--method source needs a `source` field on every corpus line")
        names = sorted(set(sources))
        labels = np.array([names.index(s) for s in sources])
        return gem.hard_result("source", labels, x), names
    k = getattr(cfg, "k")
    if k > n:
        raise UsageError(f"--k {k}: larger than the corpus ({n} documents)")
    if cfg.name == "kmeans":
        return gem.euclidean_kmeans(raw.astype(np.float64), k, seed=cfg.cluster_seed), None
    if cfg.name == "spherical-kmeans":
        labels, mu = gem.spherical_kmeans(x, k, seed=cfg.cluster_seed)
        return gem.ClusterResult(method="spherical-kmeans", labels=labels, mu=mu), None
    return gem.fit_vmf(x, cfg.settings(), method=cfg.name, progress=progress), None


# ------------------------------------------------------------------------------------ selection
@dataclass
class ShiftConfig(MethodConfig):
    name: ClassVar[str] = "shift"
    help: ClassVar[str] = "Quality-weighted farthest-first on [s; Δ] (SHIFT)."
    budget: int = option(16, "Number of prompts to select.", min=1)
    alpha: float = option(1.0, "Weight of the RIRS block in φ.", min=0.0)
    gamma: float = option(1.0, "Quality exponent (0 = unweighted).", min=0.0)
    quality: str = option("log1p", "Quality q from ‖Δ‖.", choices=("log1p", "rank", "minmax", "raw"))
    space: str = option("joint", "φ normalisation: joint [s;Δ]/‖·‖ or split [ŝ; αΔ̂].", choices=("joint", "split"))


@dataclass
class RandomConfig(MethodConfig):
    name: ClassVar[str] = "random"
    help: ClassVar[str] = "Uniform without replacement."
    budget: int = option(16, "Number of prompts to select.", min=1)
    select_seed: int = option(0, "Sampling seed.")


@dataclass
class KCenterConfig(MethodConfig):
    name: ClassVar[str] = "kcenter"
    help: ClassVar[str] = "Farthest-first CoreSet on normalised prompt states ŝ (Sener & Savarese)."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class MiniLMCoresetConfig(MethodConfig):
    name: ClassVar[str] = "minilm-coreset"
    help: ClassVar[str] = "Farthest-first CoreSet on all-MiniLM-L6-v2 prompt embeddings."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class KMeansCentresConfig(MethodConfig):
    name: ClassVar[str] = "kmeans-centres"
    help: ClassVar[str] = "K-means (K = budget) on ŝ; the item nearest each centre."
    budget: int = option(16, "Number of prompts to select.", min=1)
    select_seed: int = option(0, "K-means seed.")


@dataclass
class RirsTopkConfig(MethodConfig):
    name: ClassVar[str] = "rirs-topk"
    help: ClassVar[str] = "Top-B by ‖Δ‖ (no coverage; ablation)."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class CoresetRirsConfig(MethodConfig):
    name: ClassVar[str] = "coreset-rirs"
    help: ClassVar[str] = "Unweighted farthest-first in φ (ablation)."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class QPplConfig(MethodConfig):
    name: ClassVar[str] = "question-ppl"
    help: ClassVar[str] = "Highest prompt perplexity."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class APplConfig(MethodConfig):
    name: ClassVar[str] = "answer-ppl"
    help: ClassVar[str] = "Highest perplexity of the greedy rollout (low confidence = hard)."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class EntropyConfig(MethodConfig):
    name: ClassVar[str] = "entropy"
    help: ClassVar[str] = "Highest mean next-token entropy over the rollout."
    budget: int = option(16, "Number of prompts to select.", min=1)


@dataclass
class SCEntropyConfig(MethodConfig):
    name: ClassVar[str] = "sc-entropy"
    help: ClassVar[str] = "Highest self-consistency entropy of R sampled final answers (features --sc-samples R)."
    budget: int = option(16, "Number of prompts to select.", min=1)


for _c in (ShiftConfig, RandomConfig, KCenterConfig, MiniLMCoresetConfig, KMeansCentresConfig, RirsTopkConfig,
           CoresetRirsConfig, QPplConfig, APplConfig, EntropyConfig, SCEntropyConfig):
    SELECTORS.add_config(_c)


def _topk(score: np.ndarray, b: int) -> np.ndarray:
    return np.argsort(-score, kind="stable")[:b]


def run_selector(cfg: MethodConfig, feats: dict) -> dict:
    """Apply a selector to a feature dict (keys of features.extract). Returns {"picked", ...}."""
    from llmtool.select_data import shift

    n = len(feats["s"])
    b = cfg.budget
    if b > n:
        raise UsageError(f"--budget {b}: larger than the pool ({n} prompts)")
    s = np.asarray(feats["s"], dtype=np.float64)
    e = np.asarray(feats["e"], dtype=np.float64)
    u = np.linalg.norm(e - s, axis=1)
    if cfg.name == "shift":
        out = shift.shift_select(s, e, b, alpha=cfg.alpha, gamma=cfg.gamma, quality_mode=cfg.quality,
                                 feature_mode=cfg.space)
        return {"picked": out["picked"], "min_dist": out["min_dist"], "coverage_radius": out["coverage_radius"]}
    if cfg.name == "random":
        return {"picked": np.random.default_rng(cfg.select_seed).choice(n, size=b, replace=False)}
    if cfg.name in ("kcenter", "minilm-coreset", "coreset-rirs"):
        if cfg.name == "minilm-coreset":
            if "minilm" not in feats:
                raise UsageError("--method minilm-coreset needs features made with `select-data features --minilm`")
            phi = shift.features(np.asarray(feats["minilm"], dtype=np.float64), None, mode="prompt")
        elif cfg.name == "kcenter":
            phi = shift.features(s, None, mode="prompt")
        else:
            phi = shift.features(s, e - s)
        picked, gaps = shift.weighted_farthest_first(phi, b)
        return {"picked": picked, "min_dist": gaps, "coverage_radius": shift.coverage_radius(phi, picked)}
    if cfg.name == "kmeans-centres":
        from sklearn.cluster import KMeans

        phi = shift.features(s, None, mode="prompt")
        km = KMeans(n_clusters=b, n_init=3, random_state=cfg.select_seed).fit(phi)
        picked = []
        for c in km.cluster_centers_:
            dist = np.linalg.norm(phi - c, axis=1)
            dist[picked] = np.inf
            picked.append(int(np.argmin(dist)))
        return {"picked": np.array(picked)}
    if cfg.name == "rirs-topk":
        return {"picked": _topk(u, b)}
    if cfg.name == "question-ppl":
        return {"picked": _topk(np.asarray(feats["prompt_nll"], dtype=np.float64), b)}
    if cfg.name == "answer-ppl":
        return {"picked": _topk(np.asarray(feats["gen_nll"], dtype=np.float64), b)}
    if cfg.name == "entropy":
        return {"picked": _topk(np.asarray(feats["mean_entropy"], dtype=np.float64), b)}
    if cfg.name == "sc-entropy":
        if "sc_entropy" not in feats:
            raise UsageError("--method sc-entropy needs features made with `select-data features --sc-samples R`")
        return {"picked": _topk(np.asarray(feats["sc_entropy"], dtype=np.float64), b)}
    raise UsageError(f"unknown selector {cfg.name!r}")


# ------------------------------------------------------------------------------------ mixers
@dataclass
class NaturalConfig(MethodConfig):
    name: ClassVar[str] = "natural"
    help: ClassVar[str] = "Token shares of the domains (the no-reweighting baseline)."


@dataclass
class UniformConfig(MethodConfig):
    name: ClassVar[str] = "uniform"
    help: ClassVar[str] = "Equal weight per domain."


@dataclass
class _ProxyMixer(MethodConfig):
    """Options shared by the mixers that train proxy models (GEM spec §3.6–3.7)."""
    steps: int = option(300, "Updates per proxy model.", min=1)
    proxy_layers: int = option(2, "Proxy decoder layers.", min=1)
    proxy_d_model: int = option(128, "Proxy hidden size.", min=8)
    proxy_heads: int = option(4, "Proxy attention heads.", min=1)
    proxy_context: int = option(128, "Proxy context (tokens per training window).", min=8)
    proxy_vocab: int = option(4096, "Compact vocabulary: the most frequent ids of the corpus, the rest one OOV id.",
                              min=16)
    proxy_batch_size: int = option(32, "Sequences per proxy update (DoReMi: --per-domain per domain instead).", min=1)
    proxy_lr: float = option(1e-3, "Proxy peak learning rate (warm-up 5 %, cosine to 10 %).", min=0.0,
                             exclusive_min=True)
    val_fraction: float = option(0.1, "Documents held out per domain for the proxies' validation losses.",
                                 min=0.0, max=0.9)
    mix_seed: int = option(0, "Seed of the proxies, their data order and the held-out split.")

    def proxy(self):
        from llmtool.select_data.proxies import ProxySettings

        if self.proxy_d_model % self.proxy_heads:
            raise UsageError(f"--proxy-d-model {self.proxy_d_model} must be divisible by --proxy-heads {self.proxy_heads}")
        return ProxySettings(layers=self.proxy_layers, d_model=self.proxy_d_model, heads=self.proxy_heads,
                             context=self.proxy_context, vocab=self.proxy_vocab, batch_size=self.proxy_batch_size,
                             lr=self.proxy_lr, steps=self.steps, seed=self.mix_seed)


@dataclass
class DoReMiConfig(_ProxyMixer):
    name: ClassVar[str] = "doremi"
    help: ClassVar[str] = "DoReMi: Group-DRO proxy against a reference proxy; step-averaged weights."
    ref_weights: str = option("natural", "Reference model's mixture.", choices=("natural", "uniform"))
    per_domain: int = option(1, "Sequences per domain in each proxy batch.", min=1)
    eta: float = option(1.0, "Exponentiated-gradient step size η.", min=0.0, exclusive_min=True)
    smooth: float = option(1e-3, "Smoothing c towards uniform.", min=0.0, max=1.0)


@dataclass
class RegMixConfig(_ProxyMixer):
    name: ClassVar[str] = "regmix"
    help: ClassVar[str] = "RegMix: proxies on Dirichlet mixtures, a regression mixture → loss, top-100 search."
    proxies: int = option(64, "Proxy models (mixtures) trained.", min=4)
    max_epochs: float = option(4.0, "Redraw mixtures needing more passes than this over any domain.", min=0.0,
                               exclusive_min=True)
    target: str = option("uniform", "Target loss: mean of the per-domain validation losses, or token-weighted.",
                         choices=("uniform", "natural"))
    regressor: str = option("quadratic", "Regression of the target loss on the mixture.",
                            choices=("quadratic", "linear"))
    candidates: int = option(100_000, "Mixtures drawn from the prior in the search.", min=100)
    top: int = option(100, "Best predicted candidates averaged.", min=1)


for _c in (NaturalConfig, UniformConfig, DoReMiConfig, RegMixConfig):
    MIXERS.add_config(_c)


def run_mixer(cfg: MethodConfig, data, progress=None) -> dict:
    """Domain weights from a mixer over ``proxies.DomainData``; returns {"weights", ...diagnostics}."""
    natural = data.natural()
    if cfg.name == "natural":
        return {"weights": natural}
    if cfg.name == "uniform":
        return {"weights": np.full(data.k, 1.0 / data.k)}
    from llmtool.select_data import proxies

    s = cfg.proxy()
    if cfg.name == "doremi":
        ref = natural if cfg.ref_weights == "natural" else np.full(data.k, 1.0 / data.k)
        out = proxies.doremi(data, s, ref_weights=ref, per_domain=cfg.per_domain, eta=cfg.eta, smooth=cfg.smooth,
                             progress=progress)
        return {"weights": out["weights"], "last": out["last"], "ref_weights": ref, "ref_val": out["ref_val"],
                "proxy_val": out["proxy_val"]}
    if cfg.name == "regmix":
        from llmtool.select_data.mixing import regmix_weights

        sweep = proxies.regmix_sweep(data, s, proxies=cfg.proxies, natural=natural, max_epochs=cfg.max_epochs,
                                     target=cfg.target, progress=progress)
        pred = proxies.regmix_predictability(sweep["mixtures"], sweep["target"], seed=cfg.mix_seed,
                                             regressor=cfg.regressor)
        found = regmix_weights(sweep["mixtures"], sweep["target"], natural, candidates=cfg.candidates, top=cfg.top,
                               seed=cfg.mix_seed, regressor=cfg.regressor)
        return {"weights": found["weights"], "predicted_target": float(found["predict"](found["weights"])[0]),
                "proxy_mixtures": sweep["mixtures"], "proxy_val": sweep["val"], "proxy_target": sweep["target"],
                "draws": sweep["draws"], "predictability": pred}
    raise UsageError(f"unknown mixer {cfg.name!r}")

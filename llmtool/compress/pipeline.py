"""The shared compression pipeline: statistics -> per-module spectra -> ranks -> factorised model,
optionally repeated as truncate -> correct -> re-truncate stages (ZS-SVD §3.6).

One stage: (1) loss gradients of every target weight on the gradient batch, if the method needs
them (one backward pass of the full model per gradient sequence); (2) calibration statistics layer
by layer (:func:`profile.layer_statistics`), each layer's modules decomposed as soon as its
statistics exist and the statistics then dropped; a module keeps only the factors of the components
it can still use (``r*`` for global methods, the uniform rank otherwise), so memory stays at the
model, one layer's activations/statistics, and at most one dense-size set of factors;
(3) ranks: uniform, forced, or the global selection of :mod:`zs_svd`.

Between stages (``--correction pull-subspace``): every factorised module is densified to
``W_r = B A``, modules planned dense are set back to their original weight, the loss gradient at
that point is taken on ``proj_samples`` random calibration sequences (their last ``proj_seqlen``
tokens), and the pull-subspace correction toward the original weights is applied to every
truncated module at once. The last stage keeps the factors. Restored modules always end with their
original weights.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from llmtool.compress.factorize import ModuleSpec, Spectrum, uniform_rank
from llmtool.compress.lowrank import LowRankLinear, set_module
from llmtool.compress.methods import CORRECTIONS, CompressConfig  # noqa: F401  (re-exported)
from llmtool.compress.profile import layer_statistics, loss_gradients, target_names
from llmtool.compress.zs_svd import Selection, pull_subspace_correction, select_components
from llmtool.core.console import info, progress
from llmtool.core.evalkit import peak_rss_mb

@dataclass
class StageReport:
    stage: int
    removed_params: int
    target_removed: int
    running_sum: float | None
    predicted_delta_loss_factorised: float | None
    predicted_delta_loss_restored: float | None
    restored: list[str]
    seconds: dict[str, float]


@dataclass
class CompressionResult:
    method: str
    ratio: float
    ranks: dict[str, int]                  # factorised module -> rank
    dense: list[str]                       # target modules kept dense
    target_dense_params: int               # P_dense over target modules
    removed_params: int
    stages: list[StageReport] = field(default_factory=list)
    seconds: dict[str, float] = field(default_factory=dict)
    peak_rss_mb: float = 0.0
    selection: Selection | None = None     # last stage's global selection (None for uniform methods)

    @property
    def achieved_ratio(self) -> float:
        return self.removed_params / max(1, self.target_dense_params)

    def report(self) -> dict:
        d = asdict(self)
        d.pop("selection", None)
        d["achieved_ratio"] = self.achieved_ratio
        return d


def _specs(model) -> list[list[ModuleSpec]]:
    modules = dict(model.named_modules())
    return [[ModuleSpec(n, modules[n].out_features, modules[n].in_features, modules[n].bias is not None)
             for n in layer] for layer in target_names(model)]


def _kmax(method, spec: ModuleSpec, cfg: CompressConfig) -> int:
    if cfg.forced_ranks is not None:
        return int(cfg.forced_ranks[spec.name])
    if method.uniform:
        return uniform_rank(spec, cfg.ratio)
    return spec.break_even


def _spectra(model, method, cfg: CompressConfig, calib_ids, grad_ids, seconds: dict) -> dict[str, Spectrum]:
    layers = _specs(model)
    names = [s.name for layer in layers for s in layer]
    modules = dict(model.named_modules())
    dtype = next(model.parameters()).dtype
    grads: dict[str, torch.Tensor] = {}
    if method.needs_grad:
        t0 = time.perf_counter()
        grads = loss_gradients(model, names, grad_ids, square=getattr(method, "grad_squares", False))
        seconds["gradients"] = seconds.get("gradients", 0.0) + time.perf_counter() - t0
    t0 = time.perf_counter()
    if method.needs_gram or method.needs_abs_mean:
        per_layer = layer_statistics(model, calib_ids, cfg.batch_size, gram=method.needs_gram,
                                     abs_mean=method.needs_abs_mean)
    else:
        per_layer = progress(range(len(layers)), "decomposing (layers)")
    spectra: dict[str, Spectrum] = {}
    for i, stats in enumerate(per_layer):
        for spec in layers[i]:
            weight = modules[spec.name].weight.detach()
            sp = method.decompose(spec, weight, stats, grads.pop(spec.name, None), getattr(cfg, "eps", 0.0),
                                  _kmax(method, spec, cfg))
            sp.a_full, sp.b_full = sp.a_full.to(dtype), sp.b_full.to(dtype)
            spectra[spec.name] = sp
    seconds["statistics_and_svd"] = seconds.get("statistics_and_svd", 0.0) + time.perf_counter() - t0
    return spectra


def _plan(method, cfg: CompressConfig, spectra: dict[str, Spectrum]) -> tuple[dict[str, int], list[str], Selection | None]:
    specs = [sp.spec for sp in spectra.values()]
    if cfg.forced_ranks is not None:
        return {s.name: int(cfg.forced_ranks[s.name]) for s in specs}, [], None
    if method.uniform:
        return {s.name: uniform_rank(s, cfg.ratio) for s in specs}, [], None
    sel = select_components(specs, [sp.sigma for sp in spectra.values()],
                            [sp.delta_loss for sp in spectra.values()] if method.needs_grad else None,
                            cfg.ratio, cfg.resolved_keep_rank_ratio(), rule=method.rule)
    return sel.factorised, sel.restored, sel


def _projection_batch(calib_ids: torch.Tensor, cfg: CompressConfig, stage: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(cfg.seed + 1000 + stage)
    rows = torch.randperm(calib_ids.shape[0], generator=g)[:cfg.proj_samples]
    return calib_ids[rows, -min(cfg.proj_seqlen, calib_ids.shape[1]):]


@torch.no_grad()
def _correct(model, ranks: dict[str, int], restored: list[str], spectra: dict[str, Spectrum],
             original: dict[str, torch.Tensor], proj_ids: torch.Tensor) -> None:
    modules = dict(model.named_modules())
    truncated: dict[str, torch.Tensor] = {}
    for name, r in ranks.items():
        a, b = spectra[name].factors(r)
        truncated[name] = (b.double() @ a.double())
        modules[name].weight.copy_(truncated[name].to(modules[name].weight.dtype))
    for name in restored:
        modules[name].weight.copy_(original[name])
    per_seq = loss_gradients(model, list(truncated), proj_ids, average=False)
    updates = {}
    for name, w_r in progress(list(truncated.items()), "correction"):
        residual = original[name].double() - w_r
        updates[name] = w_r + pull_subspace_correction([g[name] for g in per_seq], residual)
    for name, w in updates.items():
        modules[name].weight.copy_(w.to(modules[name].weight.dtype))


def compress_model(model, cfg: CompressConfig, calib_ids: torch.Tensor | None,
                   grad_ids: torch.Tensor | None) -> CompressionResult:
    """Compress ``model`` in place (target Linears become LowRankLinear) and return what was done."""
    method = cfg.decomposer()
    stages = cfg.resolved_stages()
    specs = [s for layer in _specs(model) for s in layer]
    modules = dict(model.named_modules())
    original = {s.name: modules[s.name].weight.detach().clone() for s in specs} if stages > 1 else {}
    result = CompressionResult(cfg.name, cfg.ratio, {}, [], sum(s.dense_params for s in specs), 0)
    t_all = time.perf_counter()
    for stage in range(1, stages + 1):
        seconds: dict[str, float] = {}
        spectra = _spectra(model, method, cfg, calib_ids, grad_ids, seconds)
        t0 = time.perf_counter()
        ranks, restored, sel = _plan(method, cfg, spectra)
        seconds["selection"] = time.perf_counter() - t0
        removed = sum(s.dense_params - s.params_at_rank(ranks[s.name]) if s.name in ranks else 0 for s in specs)
        if stage < stages:
            t0 = time.perf_counter()
            _correct(model, ranks, restored, spectra, original, _projection_batch(calib_ids, cfg, stage))
            seconds["correction"] = time.perf_counter() - t0
        result.stages.append(StageReport(
            stage, removed, sel.target_removed if sel else int(cfg.ratio * result.target_dense_params),
            sel.running_sum if sel else None, sel.predicted_factorised if sel else None,
            sel.predicted_restored if sel else None, list(restored), seconds))
        if sel is not None:
            info(f"stage {stage}: {len(ranks)} modules factorised, {len(restored)} restored dense; "
                 f"predicted dL: factorised {sel.predicted_factorised:+.4g}, restored {sel.predicted_restored:+.4g}")
        if stage == stages:
            for name in restored:
                if name in original:
                    modules[name].weight.data.copy_(original[name])
            for name, r in ranks.items():
                a, b = spectra[name].factors(r)
                bias = modules[name].bias
                set_module(model, name, LowRankLinear.from_factors(a, b, None if bias is None else bias.detach()))
            result.ranks, result.dense, result.removed_params, result.selection = dict(ranks), list(restored), removed, sel
        del spectra
    result.seconds = {"total": time.perf_counter() - t_all}
    for st in result.stages:
        for k, v in st.seconds.items():
            result.seconds[k] = result.seconds.get(k, 0.0) + v
    result.peak_rss_mb = peak_rss_mb()
    return result

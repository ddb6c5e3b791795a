"""Gradient-clipping policies behind ``--clip``: none, global (GlobalGC), local-fixed, adagc, zclip.

Every policy is a :class:`~llmtool.core.registry.MethodConfig` in :data:`CLIPPERS` whose ``build(named
params)`` returns a clipper with ``clip_() -> ClipStats`` (modifies ``.grad`` in place, once per optimizer
update), ``state_dict()`` / ``load_state_dict()`` and ``state_bytes()``. They are pre-optimizer
transforms, so any torch optimizer (AdamW, Lion, Muon, SGD) runs unchanged after them; attach them with
:func:`attach_to_optimizer` (``Optimizer.register_step_pre_hook``) or, for transformers' Trainer, with
``ClipCallback`` in :mod:`llmtool.core.trainer`'s callers (Trainer clipping off: ``max_grad_norm=0``).

Baselines (spec §4):
* ``global``: G = ||g||_2 over all tensors, g *= min(1, c / (G + 1e-6)) (``clip_grad_norm_`` semantics).
* ``local-fixed``: the same rule applied to each tensor alone with a fixed threshold c (isolates "per
  tensor" from "adaptive").
* ``zclip`` (Kumar et al. 2025, reconstructed): EMA mean mu and variance s^2 of the global norm (alpha
  0.97) after a warm-up of plain observation; when z = (G - mu)/s > z_thr the gradient is rescaled to norm
  mu + z_thr * s (reconstructed choice: the "clip to threshold" variant, not the reciprocal one); the
  statistics are updated with the clipped norm.

Every policy is a :class:`GradTransform`: per-tensor norms are global across ranks (DDP, ZeRO-1, FSDP2
shards: see :mod:`llmtool.train.adagc`), so all ranks take the same decision; a step whose gradient has a
non-finite norm is skipped by every policy (gradients dropped, no state advance, ``skipped`` in the
statistics), so one overflow neither moves the weights nor poisons the policy's running statistics.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Iterable

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

if TYPE_CHECKING:
    import torch

# torch is imported inside functions so that building the CLI (which reads this registry) stays fast.
PRESETS = {  # mirrored in llmtool.train.adagc (checked by a test)
    "official": {"lambda_rel": 1.04, "beta": 0.99},
    "preprint": {"lambda_rel": 1.05, "beta": 0.98},
}


def _t():
    import torch

    from llmtool.train import adagc

    return torch, adagc

CLIPPERS: Registry = Registry("train", what="clipping policy")


class GradTransform:
    """What every clipping policy shares: the parameters it is bound to (re-bindable after a wrapper
    replaced them), the live gradients, distributed per-tensor norms and the non-finite skip."""

    name = "base"

    def __init__(self, named_params: Iterable[tuple[str, "torch.nn.Parameter"]]):
        self.bind(named_params)
        self.step = 0                                   # optimizer updates clipped so far (skips excluded)
        self.skipped = 0                                # updates skipped for a non-finite gradient

    def bind(self, named_params: Iterable[tuple[str, "torch.nn.Parameter"]]) -> None:
        self.params = _t()[1].unique_named_params(named_params)
        self.names = [n for n, _ in self.params]
        self._ids = frozenset(id(p) for _, p in self.params)

    def bound_to(self, model) -> bool:
        return self._ids == frozenset(id(p) for p in model.parameters() if p.requires_grad)

    def _measure(self):
        live = [(n, p.grad) for n, p in self.params if p.grad is not None]
        if self.params and not live:
            raise RuntimeError(f"{self.name} clipping: none of the {len(self.params)} bound parameters has a "
                               "gradient (clipper bound to parameters a wrapper replaced?)")
        names = [n for n, _ in live]
        grads = [g for _, g in live]
        return names, grads, _t()[1].grad_norms(grads)

    def _skip(self, names: list[str], norms):
        torch, A = _t()
        A.drop_grads_(self.params)
        self.skipped += 1
        st = A.make_stats(self.step + 1, "skipped", names, norms, torch.ones(len(names), dtype=torch.float64))
        st.skipped = True
        st.n_nonfinite = int((~torch.isfinite(norms)).sum())
        return st

    def clip_(self):
        """Clip ``.grad`` in place once per optimizer update; returns the update's ``ClipStats``."""
        torch, A = _t()
        names, grads, norms = self._measure()
        if not bool(torch.isfinite(norms).all()):
            return self._skip(names, norms)
        factors, stage = self._factors(names, norms)
        A.scale_grads_(grads, factors)
        self.step += 1
        return A.make_stats(self.step, stage, names, norms, factors)

    def _factors(self, names: list[str], norms):
        """(per-tensor factors as float64, stage name) from finite global norms; commits the policy's state."""
        raise NotImplementedError

    def state_dict(self) -> dict:
        return {"method": self.name, "step": self.step, "skipped": self.skipped}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.skipped = int(state.get("skipped", 0))

    def state_bytes(self) -> int:
        return 8


class NoClip(GradTransform):
    name = "none"

    def _factors(self, names, norms):
        torch = _t()[0]
        return torch.ones(len(names), dtype=torch.float64), "none"


class GlobalClip(GradTransform):
    name = "global"

    def __init__(self, named_params, max_norm: float = 1.0, eps: float = 1e-6):
        super().__init__(named_params)
        self.max_norm, self.eps = float(max_norm), float(eps)

    def _factors(self, names, norms):
        torch = _t()[0]
        total = float(norms.pow(2).sum().sqrt())
        h = min(1.0, self.max_norm / (total + self.eps))
        return torch.full((len(names),), h, dtype=torch.float64), "global"


class LocalFixedClip(GradTransform):
    name = "local-fixed"

    def __init__(self, named_params, max_norm: float = 0.1, eps: float = 1e-6):
        super().__init__(named_params)
        self.max_norm, self.eps = float(max_norm), float(eps)

    def _factors(self, names, norms):
        torch = _t()[0]
        return torch.clamp(self.max_norm / (norms + self.eps), max=1.0), "local"


class ZClip(GradTransform):
    name = "zclip"

    def __init__(self, named_params, z_thr: float = 2.5, alpha: float = 0.97, warmup: int = 25, eps: float = 1e-6):
        super().__init__(named_params)
        self.z_thr, self.alpha, self.warmup, self.eps = float(z_thr), float(alpha), int(warmup), float(eps)
        self.mean: float | None = None
        self.var = 0.0
        self._seen: list[float] = []

    def _factors(self, names, norms):
        torch = _t()[0]
        total = float(norms.pow(2).sum().sqrt())
        h = 1.0
        if self.step < self.warmup:
            self._seen.append(total)
            if self.step + 1 == self.warmup:
                t = torch.tensor(self._seen, dtype=torch.float64)
                self.mean, self.var = float(t.mean()), float(t.var(unbiased=False))
                self._seen = []
        else:
            std = math.sqrt(max(self.var, 0.0))
            z = (total - self.mean) / (std + self.eps)
            clipped_total = total
            if z > self.z_thr:
                clipped_total = self.mean + self.z_thr * std
                h = min(1.0, clipped_total / (total + self.eps))
            self.mean = self.alpha * self.mean + (1 - self.alpha) * clipped_total
            self.var = self.alpha * self.var + (1 - self.alpha) * (clipped_total - self.mean) ** 2
        return torch.full((len(names),), h, dtype=torch.float64), "zclip"

    def state_dict(self) -> dict:
        return {"method": self.name, "step": self.step, "skipped": self.skipped, "mean": self.mean,
                "var": self.var, "seen": list(self._seen)}

    def load_state_dict(self, state: dict) -> None:
        self.step, self.mean, self.var = int(state["step"]), state["mean"], float(state["var"])
        self.skipped = int(state.get("skipped", 0))
        self._seen = list(state.get("seen", []))

    def state_bytes(self) -> int:
        return 24


# ------------------------------------------------------------------------------------------ configs
@CLIPPERS.config
@dataclass
class NoClipConfig(MethodConfig):
    name: ClassVar[str] = "none"
    help: ClassVar[str] = "No gradient clipping."

    def build(self, named_params):
        return NoClip(named_params)


@CLIPPERS.config
@dataclass
class GlobalClipConfig(MethodConfig):
    name: ClassVar[str] = "global"
    help: ClassVar[str] = "Global-norm clipping (GlobalGC, clip_grad_norm_)."
    max_grad_norm: float = option(1.0, "Global clipping threshold.", min=0.0, exclusive_min=True)

    def build(self, named_params):
        return GlobalClip(named_params, self.max_grad_norm)


@CLIPPERS.config
@dataclass
class LocalFixedConfig(MethodConfig):
    name: ClassVar[str] = "local-fixed"
    help: ClassVar[str] = "Per-tensor clipping with a fixed threshold."
    local_max_norm: float = option(0.1, "Per-tensor clipping threshold.", min=0.0, exclusive_min=True)

    def build(self, named_params):
        return LocalFixedClip(named_params, self.local_max_norm)


@CLIPPERS.config
@dataclass
class ZClipConfig(MethodConfig):
    name: ClassVar[str] = "zclip"
    help: ClassVar[str] = "Z-score clipping of the global norm against its EMA mean/std."
    zclip_z: float = option(2.5, "Z-score threshold.", min=0.0, exclusive_min=True)
    zclip_alpha: float = option(0.97, "EMA factor of mean/variance.", min=0.0, max=1.0, exclusive_max=True)
    zclip_warmup: int = option(25, "Steps observed before clipping starts.", min=1)

    def build(self, named_params):
        return ZClip(named_params, self.zclip_z, self.zclip_alpha, self.zclip_warmup)


@CLIPPERS.config
@dataclass
class AdaGCConfig(MethodConfig):
    name: ClassVar[str] = "adagc"
    help: ClassVar[str] = "AdaGC: per-tensor clipping against an EMA of its own clipped norms."
    adagc_preset: str = option("official", "Preset for lambda-rel/beta: official (1.04/0.99) or "
                               "preprint (1.05/0.98).", choices=tuple(PRESETS))
    adagc_lambda_rel: float | None = option(None, "Relative threshold (overrides the preset).", min=0.0,
                                            exclusive_min=True)
    adagc_beta: float | None = option(None, "EMA factor of the reference norm (overrides the preset).",
                                      min=0.0, max=1.0, exclusive_max=True)
    adagc_warmup: int = option(100, "Warm-up updates of global clipping.", min=0)
    adagc_lambda_abs: float = option(1.0, "Global threshold during warm-up.", min=0.0, exclusive_min=True)
    adagc_eps: float = option(1e-6, "Epsilon in the clip factor.", min=0.0)
    adagc_warmup_ref: str = option("clipped", "Warm-up reference: running min of clipped (Megatron) or "
                                   "raw (Paddle) norms.", choices=("clipped", "raw"))

    def resolved(self) -> dict:
        p = PRESETS[self.adagc_preset]
        return {"lambda_rel": p["lambda_rel"] if self.adagc_lambda_rel is None else self.adagc_lambda_rel,
                "beta": p["beta"] if self.adagc_beta is None else self.adagc_beta,
                "warmup": self.adagc_warmup, "lambda_abs": self.adagc_lambda_abs, "eps": self.adagc_eps,
                "warmup_ref": self.adagc_warmup_ref}

    def build(self, named_params):
        return _t()[1].AdaGCClipper(named_params, **self.resolved())


def build_clipper(cfg: MethodConfig, model):
    """The clipper of ``cfg`` bound to ``model``'s parameters. Build it from the *wrapped* model (after
    FSDP2's ``fully_shard``), or let :class:`llmtool.core.trainer.ClipCallback` rebind it: a clipper bound
    to parameters a wrapper replaced finds no gradients and raises (never a silent no-op)."""
    return cfg.build(model.named_parameters())


def attach_to_optimizer(optimizer, clipper, on_stats=None):
    """Run ``clipper.clip_()`` right before every ``optimizer.step()`` (any torch optimizer)."""

    def hook(opt, args, kwargs):
        stats = clipper.clip_()
        if on_stats is not None:
            on_stats(stats)
        return None

    return optimizer.register_step_pre_hook(hook)


def refuse_deepspeed_zero(accelerator_or_args) -> None:
    """Refuse DeepSpeed at any ZeRO stage for the per-tensor clippers (the home GRPO loop's ``--grad-clip``).

    ZeRO >= 2 shards the gradients, so no rank sees a whole tensor; under accelerate ZeRO-0/1 step the optimizer
    inside ``accelerator.backward`` (``DeepSpeedEngineWrapper.backward`` calls ``engine.step()``), so a clipper
    called before ``optimizer.step()`` would act after the update it is meant to shape (the same reason
    :func:`llmtool.train.pretrain.check_distributed` refuses DeepSpeed for `train pretrain|sft --clip`)."""
    stage = None
    ds = getattr(accelerator_or_args, "deepspeed", None)
    plugin = getattr(getattr(accelerator_or_args, "state", None), "deepspeed_plugin", None)
    if plugin is not None:
        stage = getattr(plugin, "zero_stage", None)
    elif isinstance(ds, dict):
        stage = ds.get("zero_optimization", {}).get("stage")
    elif isinstance(ds, (str, bytes)) and ds:
        import json
        from pathlib import Path

        try:
            stage = json.loads(Path(ds).read_text()).get("zero_optimization", {}).get("stage")
        except (OSError, ValueError):
            stage = None
    hf = getattr(accelerator_or_args, "hf_deepspeed_config", None)
    if stage is None and hf is not None:
        stage = getattr(hf, "config", {}).get("zero_optimization", {}).get("stage")
    if stage is None and plugin is None and not ds and hf is None:
        return
    if stage is not None and int(stage) >= 2:
        why = "shards the gradients, so no rank sees a whole tensor"
    else:
        why = "steps the optimizer inside backward under accelerate, before the clipper can run"
    raise UsageError(f"--clip adagc/local-fixed does not run under DeepSpeed (ZeRO stage {stage if stage is not None else '?'} "
                     f"{why}); launch with an FSDP2 or DDP accelerate config (examples/accelerate/fsdp2.yaml, ddp.yaml)")

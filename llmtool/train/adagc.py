"""AdaGC: adaptive per-tensor gradient clipping.

Paper: G. Wang, S. Li, C. Chen, J. Zeng, J. Yang, D. Yu, Y. Ma, L. Shen, "AdaGC: Enhancing LLM
Pretraining Stability via Adaptive Gradient Clipping" (ICML 2026; arXiv 2502.11034, earlier title
"AdaGC: Improving Training Stability for Large Language Model Pretraining").

Implemented (notation of ../shared/specs/adagc.md §3; t counts optimizer updates):

* Stage 1, warm-up t <= T_warm (GlobalGC): G_t = sqrt(sum_i ||g_{t,i}||^2),
  h_t = min(1, lambda_abs / (G_t + eps)), g^_{t,i} = h_t g_{t,i}; the reference gamma_i is the running
  minimum of per-tensor norms (gamma_{1,i} = first norm seen, even 0).
* Stage 2, t > T_warm (per tensor): h_{t,i} = min(1, lambda_rel gamma_{t-1,i} / (||g_{t,i}|| + eps)),
  g^_{t,i} = h_{t,i} g_{t,i}, gamma_{t,i} = beta gamma_{t-1,i} + (1 - beta) ||g^_{t,i}||.
  The clip uses the *previous* reference, and the EMA is fed the *clipped* norm.

Reconstructed / chosen points (the official Megatron patch and Paddle's ClipGradByAdaptiveNorm settle
the defaults; the rest is ours):

* Defaults lambda_rel 1.04, beta 0.99, T_warm 100, lambda_abs 1.0, eps 1e-6 (official code); the earlier
  preprint's 1.05/0.98 is the named preset ``preprint``.
* ``warmup_ref="clipped"`` (Megatron: running min of clipped norms) or ``"raw"`` (Paddle: running min of
  raw norms); both are offered.
* Dead tensors (spec pitfall): a gamma that is still 0 when the adaptive stage starts would clip that
  tensor to zero forever. We follow the official "no lazy init" rule during warm-up, but in stage 2 a
  tensor whose reference is 0 is *not* clipped and its reference is re-seeded with its first non-zero
  norm (``dead_reseed=True``; set False for the literal rule).
* Zero gradient norm gives h = 1 (no NaN). Norms are computed in fp32.
* State (gamma per canonical parameter name, and the step counter) is committed only by
  :meth:`AdaGCClipper.clip_`; it is saved in ``state_dict()`` and restored exactly.
* Tied parameters: iterate unique tensors (first name wins), so a tied weight is clipped once.

Distributed (issue 41; the same rules hold for every ``--clip`` policy of :mod:`llmtool.train.clipping`):

* Per-tensor norms come from each rank's *local* gradient: a plain tensor under DDP (already all-reduced,
  identical on every rank) or DeepSpeed ZeRO-1, the local shard of a DTensor under FSDP2. For sharded
  tensors the squared shard norms are summed with one ``all_reduce`` (float64) over the mesh dimensions
  the tensor is sharded on, so ||g_i||^2 = sum_r ||g_i^(r)||^2 is the full tensor's norm and every rank
  computes the same factors from the same numbers: identical clip decisions without a broadcast.
* The parameters are (re)bound from the model the optimizer actually updates (:meth:`GradTransform.bind`;
  ``ClipCallback`` rebinds whenever the set of trainable tensors changes, e.g. after FSDP2's
  ``fully_shard`` replaced them). Names are canonical (wrapper prefixes such as ``module.`` or
  ``_fsdp_wrapped_module.`` removed), so gamma and checkpoints keep one key per tensor across launchers.
  A bound clipper that finds no gradient at all on a step raises instead of silently doing nothing.
* Non-finite steps: when any per-tensor norm is NaN/inf (an overflowed fp16 step, a bad batch), the
  update is skipped: every gradient is dropped (``p.grad = None``, so no torch optimizer moves the
  parameter or its moments), and neither gamma nor t advances. Without this one NaN gradient made gamma
  NaN for good, after which that tensor was never clipped again.
* Mixed precision: the clipper must see unscaled gradients; ``ClipCallback`` unscales through the
  optimizer's ``GradScaler`` (accelerate's fp16) when nothing has yet (see :mod:`llmtool.core.trainer`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

from llmtool.train.clipping import GradTransform

PRESETS = {
    "official": {"lambda_rel": 1.04, "beta": 0.99},
    "preprint": {"lambda_rel": 1.05, "beta": 0.98},
}


WRAPPER_PREFIXES = ("module.", "_orig_mod.", "_fsdp_wrapped_module.", "_checkpoint_wrapped_module.")


def canonical_name(name: str) -> str:
    """A parameter's name without the prefixes that DDP/FSDP/compile/checkpointing wrappers insert."""
    changed = True
    while changed:
        changed = False
        for pre in WRAPPER_PREFIXES:
            if name.startswith(pre):
                name, changed = name[len(pre):], True
        for mid in ("._fsdp_wrapped_module.", "._checkpoint_wrapped_module.", "._orig_mod."):
            if mid in name:
                name, changed = name.replace(mid, ".", 1), True
    return name


def unique_named_params(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters, each tensor once (tied weights keep their first name), canonical names."""
    seen, out = set(), []
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        out.append((canonical_name(name), p))
    return out


def _is_dtensor(t) -> bool:
    return hasattr(t, "placements") and hasattr(t, "to_local") and hasattr(t, "device_mesh")


def _local(g: torch.Tensor) -> torch.Tensor:
    return g.to_local() if _is_dtensor(g) else g


def _shard_dims(g) -> tuple[int, ...]:
    """Mesh dimensions a DTensor gradient is sharded on (its norm needs a sum over them)."""
    if not _is_dtensor(g):
        return ()
    dims = []
    for i, pl in enumerate(g.placements):
        if pl.is_partial():
            raise RuntimeError("gradient clipping got a DTensor gradient with a Partial placement (not yet reduced)")
        if pl.is_shard() or type(pl).__name__ == "_StridedShard":
            dims.append(i)
    return tuple(dims)


def local_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms of the local tensors (shards for DTensors) as float64 on the CPU; computed in
    fp32 (float64 grads in float64), one foreach kernel per device/dtype where available."""
    if not grads:
        return torch.zeros(0, dtype=torch.float64)
    locs = [_local(g) for g in grads]
    locs = [g if g.dtype in (torch.float32, torch.float64) else g.float() for g in locs]
    out = torch.zeros(len(locs), dtype=torch.float64)
    groups: dict = {}
    for i, g in enumerate(locs):
        groups.setdefault((g.device, g.dtype), []).append(i)
    for idx in groups.values():
        ts = [locs[i] for i in idx]
        try:
            ns = torch._foreach_norm(ts, 2)
        except (RuntimeError, AttributeError):  # pragma: no cover - very old torch
            ns = [t.norm(2) for t in ts]
        out[idx] = torch.stack([n.detach() for n in ns]).double().cpu()  # one device-to-host copy per group
    return out


def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms of the *whole* gradients as float64 on the CPU, identical on every rank.

    Plain tensors (one process, DDP, ZeRO-1): the local norm. DTensors (FSDP2): sqrt of the sum over ranks
    of the squared shard norms, one ``all_reduce`` per (mesh, sharded dims) group."""
    norms = local_norms(grads)
    groups: dict = {}
    for i, g in enumerate(grads):
        dims = _shard_dims(g)
        if dims:
            groups.setdefault((id(g.device_mesh), dims), (g.device_mesh, dims, []))[2].append(i)
    if not groups:
        return norms
    import torch.distributed as dist

    sq = norms.pow(2)
    for mesh, dims, idx in groups.values():
        dev = _local(grads[idx[0]]).device
        buf = sq[idx].to(dev)
        for d in dims:
            group = mesh.get_group(d) if mesh.ndim > 1 else mesh.get_group()
            dist.all_reduce(buf, op=dist.ReduceOp.SUM, group=group)
        sq[idx] = buf.cpu()
    return sq.sqrt()


def drop_grads_(params: Iterable[tuple[str, torch.nn.Parameter]]) -> None:
    """Skip this update: every gradient is dropped, so no optimizer moves the parameter or its state."""
    for _, p in params:
        p.grad = None


@dataclass
class ClipStats:
    step: int
    stage: str                    # "warmup" | "adaptive" | "global" | "none" | ...
    grad_norm: float              # global norm before clipping
    grad_norm_clipped: float      # global norm after clipping
    n_tensors: int
    n_clipped: int
    factor_min: float
    factor_median: float
    factor_max: float
    clipped_names: list[str]
    skipped: bool = False         # non-finite gradient: no parameter update, no state advance
    n_nonfinite: int = 0

    @property
    def clip_fraction(self) -> float:
        return self.n_clipped / self.n_tensors if self.n_tensors else 0.0

    def as_dict(self, with_names: bool = True) -> dict:
        d = {"step": self.step, "clip_stage": self.stage, "grad_norm": self.grad_norm,
             "grad_norm_clipped": self.grad_norm_clipped, "n_tensors": self.n_tensors,
             "n_clipped": self.n_clipped, "clip_fraction": self.clip_fraction,
             "clip_factor_min": self.factor_min, "clip_factor_median": self.factor_median,
             "clip_factor_max": self.factor_max, "skipped": self.skipped}
        if self.skipped:
            d["n_nonfinite"] = self.n_nonfinite
        if with_names:
            d["clipped_tensors"] = self.clipped_names[:20]
        return d


def make_stats(step: int, stage: str, names: list[str], norms: torch.Tensor, factors: torch.Tensor,
               tol: float = 1e-12) -> ClipStats:
    f = factors.double()
    n = norms.double()
    clipped = (f < 1.0 - tol).nonzero().flatten().tolist()
    return ClipStats(step=step, stage=stage, grad_norm=float(n.pow(2).sum().sqrt()) if len(n) else 0.0,
                     grad_norm_clipped=float((n * f).pow(2).sum().sqrt()) if len(n) else 0.0,
                     n_tensors=len(names), n_clipped=len(clipped),
                     factor_min=float(f.min()) if len(f) else 1.0,
                     factor_median=float(f.median()) if len(f) else 1.0,
                     factor_max=float(f.max()) if len(f) else 1.0,
                     clipped_names=[names[i] for i in clipped])


def scale_grads_(grads: list[torch.Tensor], factors: torch.Tensor) -> None:
    """g_i *= h_i, skipping tensors whose factor is exactly 1 (bit-identical passthrough). A DTensor is
    scaled shard by shard (the factor is the same on every rank)."""
    for g, h in zip(grads, factors.tolist()):
        if h != 1.0:
            _local(g).mul_(h)


class AdaGCClipper(GradTransform):
    """Per-tensor adaptive clipping of ``.grad`` in place; call :meth:`clip_` once per optimizer update
    (after backward/unscale, before ``optimizer.step()``)."""

    name = "adagc"

    def __init__(self, named_params: Iterable[tuple[str, torch.nn.Parameter]], *, lambda_rel: float = 1.04,
                 beta: float = 0.99, warmup: int = 100, lambda_abs: float = 1.0, eps: float = 1e-6,
                 warmup_ref: str = "clipped", dead_reseed: bool = True):
        if warmup_ref not in ("clipped", "raw"):
            raise ValueError(f"warmup_ref must be 'clipped' or 'raw', got {warmup_ref!r}")
        for k, v in (("lambda_rel", lambda_rel), ("lambda_abs", lambda_abs), ("eps", eps)):
            if not (math.isfinite(v) or v == math.inf) or v < 0:
                raise ValueError(f"{k} must be >= 0, got {v}")
        if not 0.0 <= beta < 1.0:
            raise ValueError(f"beta must be in [0, 1), got {beta}")
        if warmup < 0:
            raise ValueError(f"warmup must be >= 0, got {warmup}")
        super().__init__(named_params)
        self.lambda_rel, self.beta, self.warmup = float(lambda_rel), float(beta), int(warmup)
        self.lambda_abs, self.eps, self.warmup_ref = float(lambda_abs), float(eps), warmup_ref
        self.dead_reseed = dead_reseed
        self.gamma: dict[str, float] = {}               # reference norm per canonical name

    # ---- the transform -------------------------------------------------------------------------
    def _factors(self, names: list[str], norms: torch.Tensor) -> tuple[torch.Tensor, str]:
        """Factors from the (global, finite) per-tensor norms; commits gamma. Called by ``clip_``, which
        skips non-finite steps before this and advances t after it."""
        t = self.step + 1
        if t <= self.warmup:
            total = float(norms.pow(2).sum().sqrt())
            h = min(1.0, self.lambda_abs / (total + self.eps))
            factors = torch.full((len(names),), h, dtype=torch.float64)
            ref = norms * h if self.warmup_ref == "clipped" else norms
            for n, r in zip(names, ref.tolist()):
                self.gamma[n] = r if n not in self.gamma else min(self.gamma[n], r)
            return factors, "warmup"
        factors = torch.ones(len(names), dtype=torch.float64)
        for i, (n, g_norm) in enumerate(zip(names, norms.tolist())):
            prev = self.gamma.get(n)
            if prev is None or (prev == 0.0 and self.dead_reseed):
                # never seen / dead during warm-up: pass through and seed the reference
                self.gamma[n] = g_norm
                continue
            h = min(1.0, self.lambda_rel * prev / (g_norm + self.eps)) if g_norm > 0 else 1.0
            factors[i] = h
            self.gamma[n] = self.beta * prev + (1.0 - self.beta) * (h * g_norm)
        return factors, "adaptive"

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"method": self.name, "step": self.step, "skipped": self.skipped, "gamma": dict(self.gamma),
                "hparams": {"lambda_rel": self.lambda_rel, "beta": self.beta, "warmup": self.warmup,
                            "lambda_abs": self.lambda_abs, "eps": self.eps, "warmup_ref": self.warmup_ref,
                            "dead_reseed": self.dead_reseed}}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        self.gamma = {canonical_name(str(k)): float(v) for k, v in state["gamma"].items()}

    def state_bytes(self) -> int:
        """Extra optimizer-state bytes: one fp32 scalar per tensor (+ the step counter)."""
        return 4 * len(self.params) + 8

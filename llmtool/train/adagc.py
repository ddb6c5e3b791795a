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
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable

import torch

PRESETS = {
    "official": {"lambda_rel": 1.04, "beta": 0.99},
    "preprint": {"lambda_rel": 1.05, "beta": 0.98},
}


def unique_named_params(named_params: Iterable[tuple[str, torch.nn.Parameter]]) -> list[tuple[str, torch.nn.Parameter]]:
    """Trainable parameters, each tensor once (tied weights keep their first name)."""
    seen, out = set(), []
    for name, p in named_params:
        if not p.requires_grad or id(p) in seen:
            continue
        seen.add(id(p))
        out.append((name, p))
    return out


def grad_norms(grads: list[torch.Tensor]) -> torch.Tensor:
    """Per-tensor L2 norms in fp32 (one foreach kernel where available)."""
    if not grads:
        return torch.zeros(0)
    g32 = [g.float() if g.dtype != torch.float32 else g for g in grads]
    try:
        norms = torch._foreach_norm(g32, 2)
    except (RuntimeError, AttributeError):  # pragma: no cover - very old torch
        norms = [g.norm(2) for g in g32]
    return torch.stack([n.to(g32[0].device) for n in norms])


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

    @property
    def clip_fraction(self) -> float:
        return self.n_clipped / self.n_tensors if self.n_tensors else 0.0

    def as_dict(self, with_names: bool = True) -> dict:
        d = {"step": self.step, "clip_stage": self.stage, "grad_norm": self.grad_norm,
             "grad_norm_clipped": self.grad_norm_clipped, "n_tensors": self.n_tensors,
             "n_clipped": self.n_clipped, "clip_fraction": self.clip_fraction,
             "clip_factor_min": self.factor_min, "clip_factor_median": self.factor_median,
             "clip_factor_max": self.factor_max}
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
    """g_i *= h_i, skipping tensors whose factor is exactly 1 (bit-identical passthrough)."""
    for g, h in zip(grads, factors.tolist()):
        if h != 1.0:
            g.mul_(h)


class AdaGCClipper:
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
        self.params = unique_named_params(named_params)
        self.names = [n for n, _ in self.params]
        self.lambda_rel, self.beta, self.warmup = float(lambda_rel), float(beta), int(warmup)
        self.lambda_abs, self.eps, self.warmup_ref = float(lambda_abs), float(eps), warmup_ref
        self.dead_reseed = dead_reseed
        self.step = 0                                   # optimizer updates clipped so far
        self.gamma: dict[str, float] = {}               # reference norm per canonical name

    # ---- the transform -------------------------------------------------------------------------
    def clip_(self) -> ClipStats:
        live = [(n, p.grad) for n, p in self.params if p.grad is not None]
        names = [n for n, _ in live]
        grads = [g for _, g in live]
        norms = grad_norms(grads).double().cpu()
        t = self.step + 1
        if t <= self.warmup:
            total = float(norms.pow(2).sum().sqrt())
            h = min(1.0, self.lambda_abs / (total + self.eps))
            factors = torch.full((len(grads),), h, dtype=torch.float64)
            ref = norms * h if self.warmup_ref == "clipped" else norms
            for n, r in zip(names, ref.tolist()):
                self.gamma[n] = r if n not in self.gamma else min(self.gamma[n], r)
            stage = "warmup"
        else:
            factors = torch.ones(len(grads), dtype=torch.float64)
            for i, (n, g_norm) in enumerate(zip(names, norms.tolist())):
                prev = self.gamma.get(n)
                if prev is None or (prev == 0.0 and self.dead_reseed):
                    # never seen / dead during warm-up: pass through and seed the reference
                    self.gamma[n] = g_norm
                    continue
                h = min(1.0, self.lambda_rel * prev / (g_norm + self.eps)) if g_norm > 0 else 1.0
                factors[i] = h
                self.gamma[n] = self.beta * prev + (1.0 - self.beta) * (h * g_norm)
            stage = "adaptive"
        scale_grads_(grads, factors)
        self.step = t
        return make_stats(t, stage, names, norms, factors)

    # ---- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {"method": self.name, "step": self.step, "gamma": dict(self.gamma),
                "hparams": {"lambda_rel": self.lambda_rel, "beta": self.beta, "warmup": self.warmup,
                            "lambda_abs": self.lambda_abs, "eps": self.eps, "warmup_ref": self.warmup_ref,
                            "dead_reseed": self.dead_reseed}}

    def load_state_dict(self, state: dict) -> None:
        self.step = int(state["step"])
        self.gamma = {str(k): float(v) for k, v in state["gamma"].items()}

    def state_bytes(self) -> int:
        """Extra optimizer-state bytes: one fp32 scalar per tensor (+ the step counter)."""
        return 4 * len(self.params) + 8

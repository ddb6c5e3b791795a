"""Model-merging baselines of FusionRoute's comparison (arXiv:2601.05106, §4 baselines).

- Task Arithmetic (Ilharco et al., 2023): ``θ = θ_0 + λ Σ_i (θ_i − θ_0)``.
- DARE (Yu et al., 2024): each task vector's entries are dropped with probability ``p`` and the
  survivors rescaled by ``1/(1−p)``, then merged by task arithmetic. ``p = 0`` equals task arithmetic.

All checkpoints must share the base's architecture and vocabulary (tensor names and shapes); a
mismatch is refused, never silently broadcast. Non-float tensors are copied from the base.
"""
from __future__ import annotations

from typing import Sequence

import torch

from llmtool.core.console import UsageError


def _check(base: dict, experts: Sequence[dict], names: Sequence[str]) -> None:
    for sd, name in zip(experts, names):
        if set(sd) != set(base):
            diff = sorted(set(sd) ^ set(base))
            raise UsageError(f"{name}: tensor names differ from the base model's (e.g. {diff[0]})")
        for k, v in base.items():
            if tuple(sd[k].shape) != tuple(v.shape):
                raise UsageError(f"{name}: {k} has shape {tuple(sd[k].shape)}, base has {tuple(v.shape)} "
                                 "(vocabularies or architectures differ; refusing to merge)")


def task_arithmetic(base: dict, experts: Sequence[dict], lam: float = 1.0, names: Sequence[str] = ()) -> dict:
    _check(base, experts, names or [f"expert {i}" for i in range(len(experts))])
    out = {}
    for k, v in base.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        acc = v.float().clone()
        for sd in experts:
            acc += lam * (sd[k].float() - v.float())
        out[k] = acc.to(v.dtype)
    return out


def dare(base: dict, experts: Sequence[dict], p: float = 0.5, lam: float = 1.0, seed: int = 0,
         names: Sequence[str] = ()) -> dict:
    if not 0.0 <= p < 1.0:
        raise UsageError(f"--drop {p}: must be in [0, 1)")
    _check(base, experts, names or [f"expert {i}" for i in range(len(experts))])
    gen = torch.Generator().manual_seed(seed)
    out = {}
    for k, v in base.items():
        if not v.is_floating_point():
            out[k] = v.clone()
            continue
        acc = v.float().clone()
        for sd in experts:
            delta = sd[k].float() - v.float()
            if p > 0:
                keep = (torch.rand(delta.shape, generator=gen) >= p).float()
                delta = delta * keep / (1.0 - p)
            acc += lam * delta
        out[k] = acc.to(v.dtype)
    return out

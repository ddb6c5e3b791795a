"""ZS-SVD - Zero Sum SVD (Abbasi, Thrash, Qin, Sharma, Seifi, Kolouri; ICML 2026, arXiv 2602.02848).

Implemented equations (notation of the spec ``zs-svd.md``; ``W [m, n]``, ``L L^T = C``):

1. Whitened SVD ``A = W L = U diag(sigma) V^T`` (whitening in :mod:`whitening`).
2. Whitened gradient ``H = G_W L^{-T}`` (since ``W = A L^{-1}``, ``dL/dA = H``), singular-value
   gradient ``g_i = u_i^T H v_i`` computed as ``((U^T H) * V^T).sum(1)``.
3. First-order loss change of deleting component i: ``dL_i = -sigma_i g_i``.
4. Zero-sum global selection (:func:`select_components`): every module offers only its smallest
   remaining component (tail-only removal keeps the kept part the optimal truncated whitened SVD);
   two min-heaps keyed by ``|dL|`` hold the offers with ``dL >= 0`` and ``dL < 0``; each step takes
   from the heap whose sign opposes the running sum ``s`` (``s <= 0`` -> positive heap), falling
   back to the other heap when one is empty, until the removed parameters reach
   ``floor(ratio * P_dense)``. A module saves nothing until its rank reaches ``r*``, then
   ``m n - r*(m+n)``, then ``m+n`` per further component. Rank floor
   ``r_min = max(1, ceil(keep_rank_ratio * r*))``.
   Modules whose planned rank stays above ``r*`` are restored to their original dense weight; the
   components "dropped" from them still entered ``s`` (as in the released code) and their share of
   the predicted change is reported separately.
5. Optional correction (:func:`pull_subspace_correction`): at the truncated weight ``W_r``, with
   loss gradients ``g_1..g_N`` and teacher residual ``D = W_orig - W_r``,
   ``alpha = (G G^T + 1e-6 I)^{-1} G vec(D)``, ``dW' = sum_i alpha_i g_i`` (for N = 1:
   ``<g, D>/(<g, g> + 1e-6) g``), the smallest change whose first-order loss effect equals that of
   restoring the residual. All corrections are computed at the same point, then applied; the next
   stage re-whitens, re-scores and re-truncates the corrected dense model with the full budget.

Ablations sharing the same scores (spec §4.5): ``sigma-global`` (one heap keyed by whitened sigma,
no gradients) and ``abs-delta`` (one heap keyed by ``|dL|``, no sign balancing).

Reconstructed choices (documented here, see docs/compress.md): the per-module heap entry carries
the component index it offers, and a popped entry whose index is no longer the module's tail is
skipped (the version check of the spec); ties in the heap are broken by insertion order; the
default rank floor is 0 for ratio <= 0.4 and 0.3 above (the released scripts' 0.2/0.4 vs 0.6).
"""
from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

import torch

from llmtool.compress.factorize import ModuleSpec
from llmtool.compress.whitening import Whitener

RULES = ("zero-sum", "sigma-global", "abs-delta")


SCORE_CHUNK = 128   # components whose float64 ``u_i^T G`` rows exist at a time in :func:`singular_value_scores`


def singular_value_scores(u: torch.Tensor, qt: torch.Tensor, grad: torch.Tensor) -> torch.Tensor:
    """``g_i = u_i^T G q_i`` for every component i (float64, on ``grad``'s device), ``SCORE_CHUNK`` components
    at a time: ``diag(U^T G Q)`` without the ``[k, n]`` products (and their float64 copies) whole. Equal to
    ``((u.T @ G) * qt).sum(1)`` in float64 to rounding."""
    g = grad.to(torch.float64)
    out = torch.empty(u.shape[1], dtype=torch.float64, device=g.device)
    for a in range(0, u.shape[1], SCORE_CHUNK):
        b = min(u.shape[1], a + SCORE_CHUNK)
        rows = u[:, a:b].to(device=g.device, dtype=torch.float64).T @ g
        out[a:b] = (rows * qt[a:b].to(device=g.device, dtype=torch.float64)).sum(1)
    return out


def singular_value_gradients(u: torch.Tensor, vh: torch.Tensor, grad: torch.Tensor,
                             whitener: Whitener) -> torch.Tensor:
    """``g_i = u_i^T (G L^{-T}) v_i`` for every component (float64)."""
    return singular_value_scores(u, vh, whitener.whiten_gradient(grad))


def predicted_loss_change(sigma: torch.Tensor, g: torch.Tensor) -> torch.Tensor:
    """First-order change of the loss when component i is deleted: ``-sigma_i g_i``."""
    return -sigma * g


@dataclass
class Selection:
    """Outcome of one global selection."""

    planned_rank: dict[str, int]              # rank after the drops, every module
    factorised: dict[str, int]                # modules stored low-rank (planned rank <= r*)
    restored: list[str]                       # modules kept dense (planned rank > r*)
    target_removed: int
    removed: int                              # parameters actually saved (restored modules count 0)
    running_sum: float                        # s at the end (all popped dL)
    predicted_factorised: float               # sum of dL over components dropped from factorised modules
    predicted_restored: float                 # sum of dL "dropped" from restored modules
    steps: int
    # with record=True: (module, component index, dL, s after the step, both heaps non-empty at the pick)
    trace: list[tuple[str, int, float, float, bool]] = field(default_factory=list)


def saved_by_drop(spec: ModuleSpec, new_rank: int) -> int:
    """Parameters saved by lowering a module's rank to ``new_rank`` (from ``new_rank + 1``)."""
    r_star = spec.break_even
    if new_rank > r_star:
        return 0
    if new_rank == r_star:
        return spec.out_features * spec.in_features - r_star * spec.per_rank
    return spec.per_rank


def select_components(specs: list[ModuleSpec], sigmas: list[torch.Tensor],
                      deltas: list[torch.Tensor] | None, ratio: float, keep_rank_ratio: float = 0.0,
                      rule: str = "zero-sum", record: bool = False) -> Selection:
    """Global greedy removal of tail components across all modules (see module docstring)."""
    if rule not in RULES:
        raise ValueError(f"unknown selection rule {rule!r}")
    if rule != "sigma-global" and deltas is None:
        raise ValueError(f"rule {rule!r} needs predicted loss changes")
    sig = [s.double().tolist() for s in sigmas]
    dl = [d.double().tolist() for d in deltas] if deltas is not None else None
    rank = [sp.full_rank for sp in specs]
    floor = [max(1, math.ceil(keep_rank_ratio * sp.break_even)) for sp in specs]
    pos: list = []
    neg: list = []
    order = 0

    def offer(i: int) -> None:
        nonlocal order
        if rank[i] <= floor[i]:
            return
        idx = rank[i] - 1
        order += 1
        if rule == "sigma-global":
            heapq.heappush(pos, (sig[i][idx], order, i, idx))
        elif rule == "abs-delta":
            heapq.heappush(pos, (abs(dl[i][idx]), order, i, idx))
        else:
            d = dl[i][idx]
            heapq.heappush(pos if d >= 0 else neg, (abs(d), order, i, idx))

    for i in range(len(specs)):
        offer(i)
    target = int(math.floor(ratio * sum(sp.dense_params for sp in specs)))
    removed, s, steps = 0, 0.0, 0
    dropped_sum = [0.0] * len(specs)
    trace = []
    while removed < target and (pos or neg):
        both = bool(pos) and bool(neg)
        heap = pos if (s <= 0 or rule != "zero-sum") else neg
        if not heap:
            heap = neg if heap is pos else pos
        _, _, i, idx = heapq.heappop(heap)
        if idx != rank[i] - 1:  # stale offer (cannot happen with one offer per module; kept as a guard)
            continue
        d = dl[i][idx] if dl is not None else 0.0
        rank[i] -= 1
        s += d
        dropped_sum[i] += d
        removed += saved_by_drop(specs[i], rank[i])
        steps += 1
        if record:
            trace.append((specs[i].name, idx, d, s, both))
        offer(i)
    planned = {sp.name: rank[i] for i, sp in enumerate(specs)}
    factorised = {sp.name: rank[i] for i, sp in enumerate(specs) if rank[i] <= sp.break_even}
    restored = [sp.name for i, sp in enumerate(specs) if rank[i] > sp.break_even]
    return Selection(
        planned_rank=planned, factorised=factorised, restored=restored, target_removed=target,
        removed=sum(sp.dense_params - sp.params_at_rank(rank[i]) for i, sp in enumerate(specs)),
        running_sum=s,
        predicted_factorised=sum(dropped_sum[i] for i, sp in enumerate(specs) if sp.name in factorised),
        predicted_restored=sum(dropped_sum[i] for i, sp in enumerate(specs) if sp.name not in factorised),
        steps=steps, trace=trace,
    )


def pull_subspace_correction(grads: list[torch.Tensor], residual: torch.Tensor, ridge: float = 1e-6) -> torch.Tensor:
    """``dW' = sum_i alpha_i g_i`` with ``alpha = (G G^T + ridge I)^{-1} G vec(residual)``."""
    # [N, m*n] on the residual's device (the gradient profile keeps gradients on the CPU)
    g = torch.stack([x.reshape(-1).to(device=residual.device, dtype=torch.float64) for x in grads])
    rhs = g @ residual.reshape(-1).double()
    alpha = torch.linalg.solve(g @ g.T + ridge * torch.eye(len(grads), dtype=g.dtype, device=g.device), rhs)
    return (alpha @ g).reshape(residual.shape)

"""CriticalKV: perturbation-constrained critical-entry selection (Feng et al., "CriticalKV:
Optimizing KV Cache Eviction from an Output Perturbation Perspective", ICML 2026, arXiv 2502.03805).

One head's attention output is ``o = sum_i A_i u_i`` with projected values ``u_i = v_i W_O^(q)``
(``W_O^(q)`` = the ``d x D`` slice of ``o_proj.weight.T`` for query head ``q``, i.e. columns
``q d : (q+1) d`` of ``o_proj.weight``). Evicting with keep-mask ``N`` (kept mass
``sigma = sum N_i A_i``, softmax renormalised) gives ``o_hat = (1/sigma) sum N_i A_i u_i`` and

    ||o - o_hat||_1 <= theta = C - (2 - 1/sigma) * sum_i N_i A_i ||u_i||_1,   C = sum_i A_i ||u_i||_1.

When ``sigma >= 1/2`` lowering ``theta`` means maximising ``sum N_i A_i ||u_i||_1``. Selection per
KV head with budget ``b_h`` (any base scorer's ``A`` and any budget allocation):

1. stage 1: keep the top ``floor(alpha * b_h)`` entries by ``A`` (alpha = first_stage_ratio = 0.5),
   to secure ``sigma > 1/2``;
2. ``N_j = mean_{q in group} ||v_j W_O^(q)||_1`` (per query head, averaged over the GQA group,
   computed head by head in fp32);
3. stage 2: fill the remaining ``b_h - floor(alpha b_h)`` slots by ``(A_j + eps) * N_j`` (eps = 1e-4,
   inside the product so zero-attention, large-norm entries can surface).

Ablations: ``mode="product"`` (stage 2 only, alpha = 0) and ``mode="norm"`` (``N_j`` alone).
With AdaKV budgets (CriticalAdaKV) the per-head budgets are allocated from the base scores first
and the two-stage rule runs inside each head's budget, as the released CriticalAdaKV press (NVIDIA
kvpress) does; as there, AdaKV's safeguard entries (each head's top ``int(alpha_safe * b)`` by
score, window first) stay at the maximum score through stage 2, so a head whose budget is little
more than its safeguard keeps its whole safeguard even where ``floor(alpha * b_h)`` is smaller
(``protected`` in :func:`critical_select`; without it 5 of 90 layer-heads differed from the press
at budget 0.5 on SmolLM2). ``tests/test_kvcache_critical_adakv.py`` checks the keep sets against a
from-scratch reference of that press in every layer-head.
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch

from llmtool.core.console import UsageError
from llmtool.kvcache.eviction import Press, topk_mask


def projected_value_norms(values: torch.Tensor, o_weight: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """``[B, H_kv, n]``: mean over each KV head's query heads of ``||v_j W_O^(q)||_1`` (fp32, head
    by head so no ``B x H x n x D`` tensor is formed)."""
    b, h_kv, n, d = values.shape
    groups = num_q_heads // h_kv
    v = values.float()
    w = o_weight.float()
    out = torch.zeros(b, h_kv, n, dtype=torch.float32, device=values.device)
    for q in range(num_q_heads):
        kv = q // groups
        u = v[:, kv] @ w[:, q * d:(q + 1) * d].T  # [B, n, D]
        out[:, kv] += u.abs().sum(-1)
    return out / groups


def projected_value_norms_dense(values: torch.Tensor, o_weight: torch.Tensor, num_q_heads: int) -> torch.Tensor:
    """Same as :func:`projected_value_norms` with one einsum (reference for tests)."""
    b, h_kv, n, d = values.shape
    groups = num_q_heads // h_kv
    w = o_weight.float().T.reshape(num_q_heads, d, -1)  # rows of W_O^T per query head
    v = values.float().repeat_interleave(groups, dim=1)  # [B, Hq, n, d]
    u = torch.einsum("bqnd,qdD->bqnD", v, w)
    return u.abs().sum(-1).view(b, h_kv, groups, n).mean(2)


def critical_select(scores: torch.Tensor, norms: torch.Tensor, budgets: torch.Tensor,
                    first_stage_ratio: float = 0.5, eps: float = 1e-4, mode: str = "critical",
                    protected: torch.Tensor | None = None) -> torch.Tensor:
    """Keep-mask ``[B, H, n]`` with exactly ``budgets[b, h]`` entries per head. ``protected``
    (bool ``[B, H, n]``, e.g. AdaKV's safeguard entries) is kept ahead of stage 2 like stage 1's
    entries; it must fit in each head's budget (AdaKV's safeguard always does)."""
    fixed = torch.isinf(scores)
    if protected is not None:
        fixed = fixed | protected
    if mode == "norm":
        return topk_mask(norms.masked_fill(fixed, float("inf")), budgets)
    alpha = first_stage_ratio if mode == "critical" else 0.0
    stage1 = topk_mask(scores, torch.floor(alpha * budgets.float()).long())
    composite = (scores + eps) * norms
    composite = composite.masked_fill(stage1 | fixed, float("inf"))
    return topk_mask(composite, budgets)


@dataclass
class CriticalKVPress(Press):
    """Wraps a base press: its scores and budgets, CriticalKV's selection."""

    base: Press | None = None
    first_stage_ratio: float = 0.5
    eps: float = 1e-4
    mode: str = "critical"
    last_norms: dict = field(default_factory=dict, repr=False)

    def __post_init__(self):
        if self.base is None:
            raise UsageError("--critical needs a base eviction method (snapkv, pyramidkv, adakv)")
        if not 0.0 <= self.first_stage_ratio <= 1.0:
            raise UsageError(f"--first-stage-ratio {self.first_stage_ratio}: must be in [0, 1]")
        if self.mode not in ("critical", "product", "norm"):
            raise UsageError(f"unknown critical mode {self.mode!r}; choose critical, product, norm")
        self.budget, self.window_size, self.realise = self.base.budget, self.base.window_size, self.base.realise
        super().__post_init__()

    def score(self, module, hidden_states, keys, values, position_embeddings):
        return self.base.score(module, hidden_states, keys, values, position_embeddings)

    def layer_budgets(self, module, scores, n):
        return self.base.layer_budgets(module, scores, n)

    def select(self, module, scores, keys, values, budgets):
        from llmtool.core import arch
        from llmtool.core.attention import projection

        norms = projected_value_norms(values, projection(module, "o").weight, arch.n_heads(module.config))
        safeguard = getattr(self.base, "safeguard_mask", None)
        protected = safeguard(scores) if safeguard is not None else None
        return critical_select(scores, norms, budgets, self.first_stage_ratio, self.eps, self.mode, protected)


# --- the bound of section 3.4 (used by tests and the perturbation analysis) -------------------
def perturbation_bound(attn: torch.Tensor, u_norms: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``theta = C - (2 - 1/sigma) sum N_i A_i ||u_i||_1`` for one query (last axis = entries)."""
    keep = keep.to(attn.dtype)
    sigma = (keep * attn).sum(-1)
    c = (attn * u_norms).sum(-1)
    return c - (2 - 1 / sigma) * (keep * attn * u_norms).sum(-1)


def output_after_eviction(attn: torch.Tensor, u: torch.Tensor, keep: torch.Tensor) -> torch.Tensor:
    """``o_hat = (1/sigma) sum N_i A_i u_i`` (renormalised softmax over kept entries)."""
    w = attn * keep.to(attn.dtype)
    return (w / w.sum(-1, keepdim=True)) @ u

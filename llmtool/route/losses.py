"""FusionRoute training objectives (arXiv:2601.05106, §3.3 SFT and §3.4 CDPO), on teacher-forced
batches. Position ``t`` of a ``[B, T-1]`` tensor predicts token ``t+1`` of the sequence.

- :func:`expert_stats`: per expert only the gold-token log-prob ``g`` and the greedy id ``a``
  (``[n, B, T-1]``), never ``[n, B, T, V]`` (memory stays flat in the number of experts).
- :func:`informative_mask`: ``M_t = 1`` where the experts' greedy tokens disagree [P]; ``strict`` also
  needs one expert's greedy token to equal the gold token [R]; ``all`` disables masking (ablation).
- :func:`routing_loss`: ``-Σ_t M_t log Σ_i softmax(w_t)_i exp(g_{i,t}) / Σ_t M_t`` [R: exact form], the
  marginal likelihood that the router-chosen expert emitted the gold token; 0 (no NaN) when no position
  is informative.
- :func:`lm_loss`: mean next-token CE of the router LM over response tokens [P].
- :func:`fused_logprob`: ``Σ_t log softmax(r_t + e_{k_t,t})[y_t]`` with the expert term a fixed,
  no-gradient bias [P], ``k_t`` the routing head's argmax.
- :func:`cdpo_loss`: DPO loss of the fused policy against the stage-1 fused reference, ``β = 0.1`` [R];
  ``log 2`` when policy == reference.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def shift(input_ids: torch.Tensor, labels: torch.Tensor):
    """(targets [B, T-1], valid [B, T-1]) from ``labels`` (-100 = no loss)."""
    tgt = labels[:, 1:]
    valid = tgt != -100
    return tgt.clamp(min=0), valid


@torch.no_grad()
def expert_log_probs(expert, vocab, input_ids, attention_mask) -> torch.Tensor:
    """Full log-probs of one expert at every position: [B, T-1, V] (float32)."""
    out = expert(input_ids=input_ids, attention_mask=attention_mask, use_cache=False)
    return vocab.log_probs(out.logits[:, :-1])


@torch.no_grad()
def expert_stats(experts, vocab, input_ids, attention_mask, targets):
    """(g, a): gold log-prob and greedy id per expert, each [n, B, T-1]."""
    gs, as_ = [], []
    for m in experts:
        lp = expert_log_probs(m, vocab, input_ids, attention_mask)
        gs.append(lp.gather(-1, targets[..., None]).squeeze(-1))
        as_.append(lp.argmax(-1))
        del lp
    return torch.stack(gs), torch.stack(as_)


def informative_mask(a: torch.Tensor, valid: torch.Tensor, mode: str = "informative",
                     targets: torch.Tensor | None = None) -> torch.Tensor:
    """0/1 float mask [B, T-1] of positions that train the routing head."""
    if mode == "all":
        return valid.float()
    disagree = (a != a[:1]).any(0)
    m = disagree & valid
    if mode == "informative-strict":
        if targets is None:
            raise ValueError("strict mask needs targets")
        m = m & (a == targets[None]).any(0)
    elif mode != "informative":
        raise ValueError(f"unknown mask mode {mode!r}")
    return m.float()


def routing_loss(w: torch.Tensor, g: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """w: routing scores [B, T-1, n]; g: gold log-probs [n, B, T-1]; mask [B, T-1]."""
    log_alpha = torch.log_softmax(w.float(), dim=-1).permute(2, 0, 1)      # [n, B, T-1]
    nll = -torch.logsumexp(log_alpha + g.float(), dim=0)                    # [B, T-1]
    denom = mask.sum()
    if float(denom) == 0.0:
        return (w.float() * 0.0).sum()
    return (nll * mask).sum() / denom


def lm_loss(router_logits: torch.Tensor, vocab, targets: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    lp = vocab.log_probs(router_logits)
    nll = -lp.gather(-1, targets[..., None]).squeeze(-1)
    return (nll * valid).sum() / valid.sum().clamp(min=1)


def selected_expert_log_probs(experts, vocab, input_ids, attention_mask, k: torch.Tensor) -> torch.Tensor:
    """e_{k_t,t} for every position [B, T-1, V], no gradient (the experts are a fixed bias)."""
    e = None
    for i, m in enumerate(experts):
        rows = (k == i)
        if not bool(rows.any()):
            continue
        lp = expert_log_probs(m, vocab, input_ids, attention_mask)
        if e is None:
            e = torch.zeros_like(lp)
        e = torch.where(rows[..., None], lp, e)
    if e is None:
        e = torch.zeros((*k.shape, vocab.size), device=input_ids.device)
    return e.detach()


def fused_logprob(router_logits: torch.Tensor, e_sel: torch.Tensor, vocab, targets: torch.Tensor,
                  valid: torch.Tensor) -> torch.Tensor:
    """Σ_t log softmax(r_t + e_{k_t,t})[y_t] per sequence [B] (gradient through the router only)."""
    r = vocab.log_probs(router_logits)
    f = r + e_sel
    f = torch.where(torch.isfinite(f), f, torch.full_like(f, -1e30))
    lp = torch.log_softmax(f, dim=-1).gather(-1, targets[..., None]).squeeze(-1)
    return (lp * valid).sum(-1)


def cdpo_loss(pol_c, pol_r, ref_c, ref_r, beta: float = 0.1) -> torch.Tensor:
    margin = beta * ((pol_c - ref_c) - (pol_r - ref_r))
    return -F.logsigmoid(margin).mean()

"""BIRA — Bias-Inversion Rewriting Attack (Hwang, Park, Ok, "LLM Watermark Evasion via Bias
Inversion", ICML 2026, arXiv 2509.23019).

Idea: the watermark pushed "green" tokens into the text; the attacker does not know them, so it
takes a *proxy suppression set* — the tokens of the watermarked text with the highest surprisal under
an unwatermarked auxiliary LM — and paraphrases with a negative logit bias on that set, so the
rewrite's green fraction falls to (or below) chance; detection then fails with probability growing
exponentially in the length.

Equations / steps implemented:
1. Suppression set: tokenise x with the aux tokenizer (no special tokens), ``s_t = -log p_A(x_t |
   x_<t)`` for t = 2..L (the first token has no context and is dropped), ``tau = percentile_q(s)``,
   ``S = unique(x_t : s_t >= tau)`` ordered by decreasing surprisal (a token's rank is its largest
   surprisal). q = 0 gives every distinct token except a first-position-only token.
2. Biased paraphrasing: at every generated step ``logits[v] += beta`` for v in S (beta < 0);
   prompt tokens are untouched; EOS and the chat template's end-of-turn ids are never biased.
3. Adaptive schedule: beta <- beta0; up to max_iter times paraphrase, stop unless the output is
   degenerate, else beta <- beta + eta (relax toward 0). Returns (y, beta_final, iterations,
   degenerated).
4. Degeneration: the last min(450, len) rewriter tokens have distinct-1 < 0.25, or the output is
   shorter than 30% of the source (in rewriter tokens).
5. Cross-tokenizer mapping (aux -> rewriter/API): each member's decoded string and its
   leading-space variant are encoded with the target tokenizer; ids kept in surprisal order, the
   first ``limit`` (300 = OpenAI logit_bias cap).

6. beta0 calibration per rewriter (:func:`calibrate_beta`): the first beta on -1, -2, ..., -12 at which
   the rewriter degenerates, measured against its own degeneration on the same texts at beta = 0 (our
   generalisation of the paper's "first beta with one degenerate output of 50", identical to it when the
   rewriter does not degenerate unbiased; otherwise a paired-difference test). ``llmtool evade attack --method bira`` calibrates by default and caches the
   value per rewriter (:mod:`llmtool.evade.beta_cache`); ``--beta0`` overrides.

Reconstructed choices (spec [R]): q = 0, eta = 1.0, max_iter = ceil(|beta0| / eta) + 1, the
significance rule of step 6, beta0 = -4 where a value must be fixed without calibrating (the paper's
value for local Llama rewriters), the 30%-length rule, never biasing EOS / end-of-turn.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Callable, Sequence

import numpy as np
import torch

DEGENERATE_WINDOW = 450
DEGENERATE_DISTINCT = 0.25
MIN_LENGTH_RATIO = 0.3
API_BIAS_LIMIT = 300


@dataclass
class BiraConfig:
    beta0: float = -4.0
    eta: float = 1.0
    max_iter: int = 0          # 0 = ceil(|beta0| / eta) + 1
    percentile: float = 0.0

    def iterations(self) -> int:
        if self.max_iter > 0:
            return self.max_iter
        return int(math.ceil(abs(self.beta0) / self.eta)) + 1 if self.eta > 0 else 1


def rank_by_surprisal(ids: Sequence[int], surprisal: Sequence[float], percentile: float = 0.0) -> list[int]:
    """Suppression set from token ids and their surprisals (``surprisal[t]`` for ``ids[t]``; the
    first position is ignored). Distinct ids with surprisal >= the q-th percentile, ordered by
    decreasing (maximal) surprisal."""
    ids = list(ids)[1:]
    s = np.asarray(list(surprisal)[1:], dtype=np.float64)
    if not ids:
        return []
    tau = np.percentile(s, percentile)
    best: dict[int, float] = {}
    for tok, val in zip(ids, s):
        if val >= tau and val > best.get(tok, -np.inf):
            best[tok] = float(val)
    return [tok for tok, _ in sorted(best.items(), key=lambda kv: -kv[1])]


@torch.no_grad()
def token_surprisal(model, ids: Sequence[int]) -> np.ndarray:
    """``-log p(x_t | x_<t)`` for every position (position 0 gets NaN)."""
    from llmtool.core.lm import token_nll

    s = token_nll(model, torch.tensor([list(ids)], dtype=torch.long))[0].double().cpu().numpy()
    return np.concatenate([[np.nan], s])


def suppression_set(aux_model, aux_tokenizer, text: str, percentile: float = 0.0) -> list[int]:
    ids = aux_tokenizer(text, add_special_tokens=False)["input_ids"]
    if len(ids) < 2:
        return []
    return rank_by_surprisal(ids, token_surprisal(aux_model, ids), percentile)


def map_to_tokenizer(ids: Sequence[int], src_tokenizer, dst_tokenizer, limit: int | None = API_BIAS_LIMIT) -> list[int]:
    """Carry a suppression set into another tokenizer through strings (plus leading-space variants)."""
    out: dict[int, None] = {}
    for tok in ids:
        piece = src_tokenizer.decode([tok])
        stripped = piece.strip()
        for variant in dict.fromkeys([piece, stripped, " " + stripped]):
            if not variant.strip():
                continue
            for dst in dst_tokenizer(variant, add_special_tokens=False)["input_ids"]:
                out.setdefault(int(dst), None)
    mapped = list(out)
    return mapped[:limit] if limit else mapped


class SuppressionBias:
    """LogitsProcessor: ``logits[b, v] += beta_b`` for v in ``sets[b]`` except protected ids."""

    def __init__(self, sets: Sequence[Sequence[int]], betas: Sequence[float], vocab_size: int,
                 protected: Sequence[int] = ()):
        bias = torch.zeros(len(sets), vocab_size)
        for b, (ids, beta) in enumerate(zip(sets, betas)):
            ids = [i for i in ids if 0 <= i < vocab_size]
            if ids:
                bias[b, torch.tensor(ids, dtype=torch.long)] = float(beta)
        keep = [p for p in protected if p is not None and 0 <= p < vocab_size]
        if keep:
            bias[:, torch.tensor(keep, dtype=torch.long)] = 0.0
        self.bias = bias

    def __call__(self, input_ids, scores):
        bias = self.bias.to(device=scores.device, dtype=scores.dtype)
        if bias.shape[-1] != scores.shape[-1]:
            pad = scores.shape[-1] - bias.shape[-1]
            bias = torch.nn.functional.pad(bias, (0, pad)) if pad > 0 else bias[:, :scores.shape[-1]]
        return scores + bias


def is_degenerate(ids: Sequence[int], source_length: int | None = None) -> bool:
    ids = list(ids)
    if source_length and len(ids) < MIN_LENGTH_RATIO * source_length:
        return True
    if not ids:
        return True
    window = ids[-DEGENERATE_WINDOW:]
    return len(set(window)) / len(window) < DEGENERATE_DISTINCT


@dataclass
class AttackOutcome:
    ids: list[int]
    beta_final: float
    iterations: int
    degenerated: bool


def adaptive_attack(paraphrase: Callable[[list[int], list[float]], list[list[int]]], n_items: int,
                    source_lengths: Sequence[int], config: BiraConfig) -> list[AttackOutcome]:
    """Run the adaptive bias schedule for ``n_items`` texts at once. ``paraphrase(indices, betas)``
    returns rewriter ids for those items at those biases; only degenerate items are retried."""
    betas = [float(config.beta0)] * n_items
    results: list[AttackOutcome | None] = [None] * n_items
    active = list(range(n_items))
    for it in range(1, config.iterations() + 1):
        outs = paraphrase(active, [betas[i] for i in active])
        still = []
        for i, y in zip(active, outs):
            bad = is_degenerate(y, source_lengths[i])
            results[i] = AttackOutcome(list(y), betas[i], it, bad)
            if bad:
                still.append(i)
        if not still or it == config.iterations():
            break
        for i in still:
            betas[i] = min(0.0, betas[i] + config.eta)
        active = still
    return [r for r in results]  # type: ignore[misc]


def calibrate_beta(paraphrase: Callable[[float], list[list[int]]], source_lengths: Sequence[int],
                   betas: Sequence[float], baseline: bool = True) -> tuple[float | None, list[dict]]:
    """beta0 calibration per rewriter (spec 3.3): paraphrase the calibration texts at each beta (in the
    given order, e.g. -1, -2, ..., -12) and return the first beta at which the rewriter degenerates.

    The paper's rule is "at least one of the 50 outputs degenerates", which assumes none does at beta = 0.
    A small rewriter can degenerate without any bias (SmolLM2-135M: 15 % of outputs at beta = 0), which
    makes that rule fire at the first beta and say nothing. With ``baseline`` (default) the texts are first
    paraphrased at beta = 0 (same seed); when none degenerates there, the paper's rule applies unchanged;
    otherwise a beta counts as degenerating when its degenerate share is above the beta = 0 share on the
    same texts with the lower end of Newcombe's paired 99 % interval of the difference above zero (99 %:
    up to 12 betas are tested in turn; with 50 texts degenerating 15 % of the time at every beta it fires
    on 3 % of grids, 15 % at the 95 % level).
    Returns (beta0 or None when no beta on the grid degenerates, curve); the curve has one row per beta
    tried (the beta = 0 row first), stopping at the first hit."""
    from llmtool.core.intervals import paired_difference

    curve: list[dict] = []
    base = None
    if baseline:
        outs = paraphrase(0.0)
        base = [is_degenerate(y, n) for y, n in zip(outs, source_lengths)]
        curve.append({"beta": 0.0, "degenerate_rate": sum(base) / max(1, len(base)), "significant": False})
    for beta in betas:
        outs = paraphrase(float(beta))
        flags = [is_degenerate(y, n) for y, n in zip(outs, source_lengths)]
        k, n = sum(flags), max(1, len(flags))
        if base is None or not any(base):
            hit = k > 0
        else:
            only_beta = sum(f and not b for f, b in zip(flags, base))
            only_zero = sum(b and not f for f, b in zip(flags, base))
            both = sum(f and b for f, b in zip(flags, base))
            hit = paired_difference(only_beta, only_zero, both, len(flags), z=2.5758)[1] > 0
        curve.append({"beta": float(beta), "degenerate_rate": k / n, "significant": hit})
        if hit:
            return float(beta), curve
    return None, curve

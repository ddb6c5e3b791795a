"""Detection metrics over detector scores, and text-quality measures.

Scores are oriented so that larger = more watermarked before thresholding: z-scores as they are,
p-values negated (EXP: lower p = more watermarked).

- ``asr`` = 1 - mean(is_watermarked) at the scheme's fixed threshold (= evasion rate).
- ``tpr_at_fpr(pos, neg, fpr)``: the threshold is the (k+1)-th largest negative score with
  ``k = floor(fpr * n_neg)``, a text is flagged iff its score is strictly above it, so at most
  ``k`` negatives are flagged (empirical FPR <= fpr); TPR = flagged fraction of positives.
- ``auroc``: Mann-Whitney U / (n_pos n_neg), ties count 1/2.
- ``f1_best``: best F1 over thresholds "flag iff score >= t" for t in the observed scores.
- ``perplexity_of``: per-text perplexity under an oracle LM (mean token NLL of the text alone).
"""
from __future__ import annotations

import math
from typing import Sequence

import numpy as np


def oriented(scores: Sequence[float], score_kind: str) -> np.ndarray:
    s = np.asarray(scores, dtype=np.float64)
    return -s if score_kind == "p" else s


def asr(is_watermarked: Sequence[bool]) -> float:
    flags = np.asarray(is_watermarked, dtype=bool)
    return float(1.0 - flags.mean()) if flags.size else float("nan")


def fpr_threshold(neg: Sequence[float], fpr: float) -> float:
    neg = np.sort(np.asarray(neg, dtype=np.float64))
    k = int(math.floor(fpr * neg.size + 1e-12))
    return float(neg[neg.size - 1 - min(k, neg.size - 1)])


def tpr_at_fpr(pos: Sequence[float], neg: Sequence[float], fpr: float) -> tuple[float, float]:
    """(TPR, threshold) for oriented scores."""
    thr = fpr_threshold(neg, fpr)
    pos = np.asarray(pos, dtype=np.float64)
    return float((pos > thr).mean()), thr


def auroc(pos: Sequence[float], neg: Sequence[float]) -> float:
    pos = np.asarray(pos, dtype=np.float64)[:, None]
    neg = np.asarray(neg, dtype=np.float64)[None, :]
    return float(((pos > neg).sum() + 0.5 * (pos == neg).sum()) / (pos.size * neg.size))


def f1_best(pos: Sequence[float], neg: Sequence[float]) -> tuple[float, float]:
    pos = np.asarray(pos, dtype=np.float64)
    neg = np.asarray(neg, dtype=np.float64)
    best, best_t = 0.0, float("nan")
    for t in np.unique(np.concatenate([pos, neg])):
        tp = (pos >= t).sum()
        fp = (neg >= t).sum()
        fn = pos.size - tp
        f1 = 2 * tp / (2 * tp + fp + fn) if tp else 0.0
        if f1 > best:
            best, best_t = float(f1), float(t)
    return best, best_t


def detection_metrics(pos_scores, neg_scores, pos_flags, score_kind: str, fprs=(0.01, 0.1)) -> dict:
    pos, neg = oriented(pos_scores, score_kind), oriented(neg_scores, score_kind)
    out = {"n_pos": int(pos.size), "n_neg": int(neg.size), "asr": asr(pos_flags),
           "detect_rate": 1.0 - asr(pos_flags), "auroc": auroc(pos, neg)}
    for f in fprs:
        tpr, thr = tpr_at_fpr(pos, neg, f)
        out[f"tpr@fpr={f:g}"] = tpr
        out[f"threshold@fpr={f:g}"] = -thr if score_kind == "p" else thr
    out["f1_best"], _ = f1_best(pos, neg)
    return out


def perplexity_of(model, tokenizer, texts: Sequence[str]) -> list[float]:
    """exp(mean token NLL) of each text's first 1024 tokens (:func:`llmtool.core.lm.token_nll`)."""
    import torch

    from llmtool.core.lm import token_nll

    out = []
    for text in texts:
        ids = tokenizer(text, add_special_tokens=False)["input_ids"][:1024]
        if len(ids) < 2:
            out.append(float("nan"))
            continue
        out.append(math.exp(token_nll(model, torch.tensor([ids])).double().mean().item()))
    return out

"""EXP watermark (Aaronson's Gumbel-max scheme, as in MarkLLM's "EXP"): distortion-free sampling
with MarkLLM defaults (prefix h 4, key 15485863, p threshold 1e-4, temperature 0.7).

Equations implemented:
- seed ``s_t = key * ((prod of the last h tokens) mod V)``; ``r_t ~ U(0,1)^V`` from the seeded
  CPU generator;
- sampling: ``p = softmax(logits / T)`` (restricted to the top-k logits when ``top_k > 0``),
  next token ``= argmax_v r_{t,v}^{1/p_v}`` (computed as ``argmax log(r_v) / p_v``). Over random
  keys this is an exact draw from p (the Gumbel-max trick), hence distortion-free;
- detection: ``S = sum_{t >= h} -log(1 - r_{t, x_t})``; under H0 every term is Exp(1), so
  ``S ~ Gamma(n, 1)`` and ``p = Gamma.sf(S; n)``; watermarked iff ``p < p_threshold``. The score
  is a p-value: *lower* means more watermarked.

The processor fixes the next token itself (all other logits become -inf), so the caller decodes
greedily after it (``Scheme.chooses_token``); transformers' temperature/top-p warpers are not used.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmtool.evade.watermarks.base import Detection, Scheme, uniform_vector


@dataclass
class EXPConfig:
    prefix_length: int = 4
    key: int = 15485863
    p_threshold: float = 1e-4
    temperature: float = 0.7
    top_k: int = 0
    markllm_compat: bool = False

    def validate(self) -> str | None:
        if self.prefix_length < 1:
            return f"prefix_length must be >= 1, got {self.prefix_length}"
        if self.temperature <= 0:
            return f"temperature must be > 0, got {self.temperature}"
        if not 0 < self.p_threshold < 1:
            return f"p_threshold must be in (0, 1), got {self.p_threshold}"
        return None


class EXP(Scheme):
    name = "exp"
    score_kind = "p"
    config_cls = EXPConfig
    chooses_token = True

    def step_seed(self, context: Sequence[int]) -> int:
        prod = 1
        for tok in context[-self.config.prefix_length:]:
            prod = (prod * int(tok)) % self.vocab_size
        return self.config.key * prod

    def uniforms(self, context: Sequence[int]) -> np.ndarray:
        return uniform_vector(self.step_seed(context), self.vocab_size, self.config.markllm_compat)

    def choose(self, context: Sequence[int], probs: np.ndarray) -> int:
        """argmax_v r_v^(1/p_v) for the probability vector ``probs`` (float64, zeros allowed)."""
        r = self.uniforms(context)
        with np.errstate(divide="ignore"):
            key = np.where(probs > 0, np.log(r) / np.where(probs > 0, probs, 1.0), -np.inf)
        return int(np.argmax(key))

    def processor(self):
        return ExpSampler(self)

    def detect(self, ids: Sequence[int]) -> Detection:
        from scipy.stats import gamma

        ids = [int(t) for t in ids]
        h = self.config.prefix_length
        n = len(ids) - h
        if n < 1:
            return Detection(1.0, False, 0, "p")
        total = 0.0
        for t in range(h, len(ids)):
            r = self.uniforms(ids[t - h:t])[ids[t]]
            total += -np.log1p(-r) if r < 1 else 50.0
        p = float(gamma.sf(total, n))
        return Detection(p, p < self.config.p_threshold, n, "p")


class ExpSampler:
    """LogitsProcessor that turns the logits into a one-hot choice by the EXP rule."""

    def __init__(self, scheme: EXP):
        self.scheme = scheme

    def __call__(self, input_ids, scores):
        import torch

        cfg = self.scheme.config
        h = cfg.prefix_length
        logits = scores.double() / cfg.temperature
        if cfg.top_k > 0:
            kth = torch.topk(logits, min(cfg.top_k, logits.shape[-1]), dim=-1).values[:, -1:]
            logits = logits.masked_fill(logits < kth, float("-inf"))
        probs = torch.softmax(logits, dim=-1).cpu().numpy()
        out = torch.full_like(scores, float("-inf"))
        for b, row in enumerate(input_ids.tolist()):
            if len(row) < h:  # no full context: plain argmax of the tempered distribution
                choice = int(np.argmax(probs[b]))
            else:
                choice = self.scheme.choose(row[-h:], probs[b])
            out[b, choice] = 0.0
        return out

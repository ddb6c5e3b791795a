"""EXP watermark (Aaronson's Gumbel-max scheme, as in MarkLLM's "EXP"): distortion-free sampling
with MarkLLM defaults (prefix h 4, key 15485863, p threshold 1e-4, temperature 0.7).

Equations implemented:
- seed ``s_t = key * ((prod of the last h tokens) mod V)``; ``r_t ~ U(0,1)^V`` from the seeded
  CPU generator;
- sampling: ``p = softmax(logits / T)`` (restricted to the top-k logits when ``top_k > 0``),
  next token ``= argmax_v r_{t,v}^{1/p_v}``. Over random keys this is an exact draw from p (the
  Gumbel-max trick), hence distortion-free;
- detection: ``S = sum_{t >= h} -log(1 - r_{t, x_t})``; under H0 every term is Exp(1), so
  ``S ~ Gamma(n, 1)`` and ``p = Gamma.sf(S; n)``; watermarked iff ``p < p_threshold``. The score
  is a p-value: *lower* means more watermarked.

Default: ``r_t`` are float64 draws of numpy PCG64 seeded with ``s_t``; the choice is computed as
``argmax log(r_v) / p_v`` in float64 and ``-log(1 - r)`` as ``-log1p(-r)``.

``markllm_compat`` reproduces MarkLLM's EXP exactly on the CPU (checked against recorded values in
tests/test_evade_markllm_compat.py): ``r_t`` is the float32 ``torch.rand(V)`` of torch's CPU
generator seeded with ``s_t`` (bit for bit); the choice is ``argmax r ** (1 / p)`` in torch on
``p = softmax(scores / T)`` computed in the dtype and on the device of the scores, as MarkLLM does
(its float32 ties and underflows included); each detection term is
``log(1 / (1 - r))`` with the subtraction and division in float32, as MarkLLM computes it. Limits:
MarkLLM softmaxes the model's own logits, while a transformers ``generate`` hands processors float32
scores, so for a bf16/fp16 model the probabilities (hence rare choices) can differ; MarkLLM's
``top_k > 0`` branch fails (it gathers a 1-D uniform vector with 2-D indices), so compat mode with
``top_k > 0`` takes the intended rule (argmax over the k most probable tokens) with no MarkLLM
reference to match.

The processor fixes the next token itself (all other logits become -inf), so the caller decodes
greedily after it (``Scheme.chooses_token``); transformers' temperature/top-p warpers are not used.
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

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

    def choose(self, context: Sequence[int], probs) -> int:
        """argmax_v r_v^(1/p_v) for the probability vector ``probs`` (zeros allowed).

        Default: float64, computed as argmax log(r_v) / p_v. ``markllm_compat``: MarkLLM's
        ``r ** (1 / p)`` with the float32 ``r`` and ``1 / p`` in the dtype of ``probs`` (a torch
        tensor or an array; float64 is taken as float32), over the ``top_k`` most probable tokens
        when ``top_k > 0``."""
        r = self.uniforms(context)
        if self.config.markllm_compat:
            import torch

            u = torch.from_numpy(r)
            p = torch.as_tensor(probs).detach().cpu().reshape(-1)
            if p.dtype == torch.float64:
                p = p.float()
            if self.config.top_k > 0:
                top_p, top_i = torch.topk(p, min(self.config.top_k, p.numel()))
                return int(top_i[torch.argmax(u[top_i] ** (1 / top_p))])
            return int(torch.argmax(u ** (1 / p)))  # 1 / p in p's dtype, the power in float32 (or wider)
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
        compat = self.config.markllm_compat
        one = np.float32(1)
        for t in range(h, len(ids)):
            r = self.uniforms(ids[t - h:t])[ids[t]]
            if compat:  # float32 1 / (1 - r), then the float64 log, as MarkLLM
                total += math.log(float(one / (one - r)))
            else:
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
        if cfg.markllm_compat:
            return self._compat(input_ids, scores)
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

    def _compat(self, input_ids, scores):
        """MarkLLM's step: probabilities in the scores' dtype and device, the choice in float32."""
        import torch

        cfg = self.scheme.config
        probs = torch.softmax(scores / cfg.temperature, dim=-1).cpu()
        out = torch.full_like(scores, float("-inf"))
        for b, row in enumerate(input_ids.tolist()):
            if len(row) < cfg.prefix_length:  # no full context: plain argmax of the tempered distribution
                choice = int(torch.argmax(probs[b]))
            else:
                choice = self.scheme.choose(row[-cfg.prefix_length:], probs[b])
            out[b, choice] = 0.0
        return out

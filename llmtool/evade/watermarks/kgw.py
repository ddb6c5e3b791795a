"""KGW green-list watermark (Kirchenbauer et al., "A Watermark for Large Language Models", ICML 2023),
with MarkLLM's default parameters (gamma 0.5, delta 2.0, key 15485863, context width h = 1, "time"
(product) hashing over a left window, z threshold 4.0).

Equations implemented:
- fixed permutation ``P = perm_V(key)``; context value ``c = (prod_{i=1..h} x_{t-i}) mod V``;
  ``f = P[c]``; step seed ``s_t = (key * f) mod V``; green list ``G_t`` = first ``floor(gamma V)``
  entries of ``perm_V(s_t)``.
- generation: ``logits[G_t] += delta`` before sampling (transformers applies temperature / top-p
  after custom processors, so the effective bias on the tempered logits is delta / T, as in MarkLLM).
- detection on the continuation tokens (re-tokenised, no special tokens): for t >= h count
  ``x_t in G_t``; ``z = (c_g - gamma n) / sqrt(n gamma (1 - gamma))`` with ``n = T - h``;
  watermarked iff ``z > z_threshold``.

Reconstructed choices: permutations come from numpy PCG64 on the CPU (device independent);
``markllm_compat`` switches to torch's CPU ``randperm``, which gives MarkLLM's green lists exactly
(checked against recorded values in tests/test_evade_markllm_compat.py) as long as MarkLLM runs on
the CPU (it seeds a generator on its device, and CUDA generators give other permutations).
"""
from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from llmtool.evade.watermarks.base import Detection, Scheme, permutation


@dataclass
class KGWConfig:
    gamma: float = 0.5
    delta: float = 2.0
    key: int = 15485863
    context: int = 1
    z_threshold: float = 4.0
    markllm_compat: bool = False

    def validate(self) -> str | None:
        if not 0 < self.gamma < 1:
            return f"gamma must be in (0, 1), got {self.gamma}"
        if self.context < 1:
            return f"context must be >= 1, got {self.context}"
        return None


class KGW(Scheme):
    name = "kgw"
    score_kind = "z"
    config_cls = KGWConfig

    def __init__(self, vocab_size: int, config: KGWConfig | None = None):
        super().__init__(vocab_size, config)
        c = self.config
        self.n_green = math.floor(c.gamma * self.vocab_size)
        self.fixed_perm = permutation(c.key, self.vocab_size, c.markllm_compat)
        self._green = lru_cache(maxsize=512)(self._green_uncached)

    def step_seed(self, context: Sequence[int]) -> int:
        V = self.vocab_size
        prod = 1
        for tok in context[-self.config.context:]:
            prod = (prod * int(tok)) % V
        f = int(self.fixed_perm[prod])
        return (self.config.key * f) % V

    def _green_uncached(self, seed: int) -> np.ndarray:
        return np.sort(permutation(seed, self.vocab_size, self.config.markllm_compat)[: self.n_green])

    def green_list(self, context: Sequence[int]) -> np.ndarray:
        """Sorted green token ids for the next position after ``context`` (needs >= h tokens)."""
        return self._green(self.step_seed(context))

    def is_green(self, context: Sequence[int], token: int) -> bool:
        g = self.green_list(context)
        i = np.searchsorted(g, token)
        return bool(i < g.size and g[i] == token)

    def processor(self):
        return GreenListBias(self)

    def detect(self, ids: Sequence[int]) -> Detection:
        ids = [int(t) for t in ids]
        h = self.config.context
        n = len(ids) - h
        if n < 1:
            return Detection(0.0, False, 0, "z")
        green = sum(self.is_green(ids[t - h:t], ids[t]) for t in range(h, len(ids)))
        z = green_z(green, n, self.config.gamma)
        return Detection(z, z > self.config.z_threshold, n, "z")


def green_z(green: int, n: int, gamma: float) -> float:
    return (green - gamma * n) / math.sqrt(n * gamma * (1 - gamma))


class GreenListBias:
    """LogitsProcessor adding delta to the context-dependent green list of a :class:`KGW` scheme."""

    def __init__(self, scheme: KGW):
        self.scheme = scheme

    def __call__(self, input_ids, scores):
        import torch

        h = self.scheme.config.context
        rows = input_ids.tolist()
        bias = torch.zeros_like(scores)
        for b, row in enumerate(rows):
            if len(row) < h:
                continue
            green = torch.from_numpy(self.scheme.green_list(row[-h:]))
            bias[b, green.to(scores.device)] = self.scheme.config.delta
        return scores + bias

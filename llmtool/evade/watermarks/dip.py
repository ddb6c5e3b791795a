"""DiPmark (Wu et al., "A Resilient and Accessible Distribution-Preserving Watermark for Large
Language Models", ICML 2024) with MarkLLM defaults (gamma 0.5, alpha 0.45, key 42, context h 5,
z threshold 1.513).

Equations implemented:
- a permutation of the vocabulary seeded by SHA-256(context token bytes || key);
- alpha-reweighting: in permuted order token i covers ``[F_{i-1}, F_i)`` of the cumulative
  distribution; its new mass is ``|[F_{i-1},F_i) ∩ [alpha,1]| + |[F_{i-1},F_i) ∩ [1-alpha,1]|``
  (total mass (1-alpha) + alpha = 1; averaging over uniformly random permutations gives back p,
  so the scheme is distribution-preserving);
- detection: a token is green iff its 1-based position in the permutation divided by V is
  ``>= gamma``; ``z = (c_g - (1 - gamma) n) / sqrt(n)``; watermarked iff ``z > z_threshold``.
  With ``ignore_history`` a (context, token) pair already scored is skipped (history masking).

Reconstructed choices: each context token is hashed as 8 little-endian bytes, followed by the key
as 8 little-endian bytes; the permutation seed is the first 8 bytes of the digest (little-endian).
The processor applies its own temperature before reweighting and returns log-probabilities, so the
caller samples at temperature 1 without top-k/top-p (``Scheme.owns_sampling``).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmtool.evade.watermarks.base import Detection, Scheme, permutation


@dataclass
class DIPConfig:
    gamma: float = 0.5
    alpha: float = 0.45
    key: int = 42
    prefix_length: int = 5
    z_threshold: float = 1.513
    temperature: float = 0.7
    ignore_history: bool = False

    def validate(self) -> str | None:
        if not 0 <= self.alpha <= 0.5:
            return f"alpha must be in [0, 0.5], got {self.alpha}"
        if not 0 < self.gamma < 1:
            return f"gamma must be in (0, 1), got {self.gamma}"
        if self.prefix_length < 1:
            return f"prefix_length must be >= 1, got {self.prefix_length}"
        return None


def reweight(probs: np.ndarray, perm: np.ndarray, alpha: float) -> np.ndarray:
    """DiPmark alpha-reweighting of ``probs`` in the order ``perm`` (returns a new distribution)."""
    p_perm = probs[perm]
    upper = np.cumsum(p_perm)
    lower = upper - p_perm
    mass = (np.clip(upper - np.maximum(lower, alpha), 0, None)
            + np.clip(upper - np.maximum(lower, 1 - alpha), 0, None))
    out = np.empty_like(probs)
    out[perm] = mass
    return out


class DIP(Scheme):
    name = "dip"
    score_kind = "z"
    config_cls = DIPConfig
    owns_sampling = True

    def perm(self, context: Sequence[int]) -> np.ndarray:
        h = hashlib.sha256()
        for tok in context[-self.config.prefix_length:]:
            h.update(int(tok).to_bytes(8, "little", signed=True))
        h.update(int(self.config.key).to_bytes(8, "little", signed=True))
        seed = int.from_bytes(h.digest()[:8], "little")
        return permutation(seed, self.vocab_size)

    def processor(self):
        return DipReweight(self)

    def detect(self, ids: Sequence[int]) -> Detection:
        ids = [int(t) for t in ids]
        h = self.config.prefix_length
        seen, green, n = set(), 0, 0
        for t in range(h, len(ids)):
            ctx = tuple(ids[t - h:t])
            if self.config.ignore_history:
                if (ctx, ids[t]) in seen:
                    continue
                seen.add((ctx, ids[t]))
            perm = self.perm(ctx)
            position = int(np.nonzero(perm == ids[t])[0][0]) + 1
            green += position / self.vocab_size >= self.config.gamma
            n += 1
        if n < 1:
            return Detection(0.0, False, 0, "z")
        z = (green - (1 - self.config.gamma) * n) / math.sqrt(n)
        return Detection(z, z > self.config.z_threshold, n, "z")


class DipReweight:
    def __init__(self, scheme: DIP):
        self.scheme = scheme

    def __call__(self, input_ids, scores):
        import torch

        cfg = self.scheme.config
        probs = torch.softmax(scores.double() / cfg.temperature, dim=-1).cpu().numpy()
        out = []
        for b, row in enumerate(input_ids.tolist()):
            q = probs[b] if len(row) < cfg.prefix_length else reweight(probs[b], self.scheme.perm(row), cfg.alpha)
            out.append(q)
        q = torch.from_numpy(np.stack(out)).to(scores.device)
        return torch.log(q.clamp_min(0)).to(scores.dtype)

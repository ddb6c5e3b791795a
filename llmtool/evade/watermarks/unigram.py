"""Unigram watermark (Zhao et al., "Provable Robust Watermarking for AI-Generated Text", ICLR 2024):
one fixed green list for every position, MarkLLM defaults (gamma 0.5, delta 2.0, key 15485863,
z threshold 4.0).

Equations implemented:
- the mask holds ``floor(gamma V)`` ones shuffled by an RNG whose seed is the first 4 bytes
  (little-endian) of SHA-256 of the key, read as an integer; green ids = the first
  ``floor(gamma V)`` entries of ``perm_V(seed)`` (the same set as shuffling the 0/1 mask);
- generation: ``logits[G] += delta`` at every step;
- detection: over *all* continuation tokens (no prefix skipped) ``z = (c_g - gamma n) /
  sqrt(n gamma (1 - gamma))``; with ``unique`` each distinct token is scored once (the original
  paper's robust variant; MarkLLM does not do this).

Reconstructed choices: the key is hashed as its decimal string (``str(key).encode()``); the
shuffle uses numpy PCG64 (``markllm_compat``: torch CPU randperm).
"""
from __future__ import annotations

import hashlib
import math
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from llmtool.evade.watermarks.base import Detection, Scheme, permutation
from llmtool.evade.watermarks.kgw import green_z


@dataclass
class UnigramConfig:
    gamma: float = 0.5
    delta: float = 2.0
    key: int = 15485863
    z_threshold: float = 4.0
    unique: bool = False
    markllm_compat: bool = False

    def validate(self) -> str | None:
        if not 0 < self.gamma < 1:
            return f"gamma must be in (0, 1), got {self.gamma}"
        return None


class Unigram(Scheme):
    name = "unigram"
    score_kind = "z"
    config_cls = UnigramConfig

    def __init__(self, vocab_size: int, config: UnigramConfig | None = None):
        super().__init__(vocab_size, config)
        c = self.config
        digest = hashlib.sha256(str(c.key).encode()).digest()
        self.mask_seed = int.from_bytes(digest[:4], "little")
        n_green = int(math.floor(c.gamma * self.vocab_size))
        self.green_ids = np.sort(permutation(self.mask_seed, self.vocab_size, c.markllm_compat)[:n_green])
        self.mask = np.zeros(self.vocab_size, dtype=bool)
        self.mask[self.green_ids] = True

    def processor(self):
        return UnigramBias(self)

    def detect(self, ids: Sequence[int]) -> Detection:
        ids = [int(t) for t in ids]
        if self.config.unique:
            ids = list(dict.fromkeys(ids))
        n = len(ids)
        if n < 1:
            return Detection(0.0, False, 0, "z")
        green = int(self.mask[np.asarray(ids)].sum())
        z = green_z(green, n, self.config.gamma)
        return Detection(z, z > self.config.z_threshold, n, "z")


class UnigramBias:
    def __init__(self, scheme: Unigram):
        self.scheme = scheme
        self._bias = None

    def __call__(self, input_ids, scores):
        import torch

        if self._bias is None or self._bias.device != scores.device:
            mask = torch.from_numpy(self.scheme.mask)
            self._bias = (mask.to(scores.dtype) * self.scheme.config.delta).to(scores.device)
        return scores + self._bias

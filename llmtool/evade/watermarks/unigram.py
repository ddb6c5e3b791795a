"""Unigram watermark (Zhao et al., "Provable Robust Watermarking for AI-Generated Text", ICLR 2024):
one fixed green list for every position, MarkLLM defaults (gamma 0.5, delta 2.0, key 15485863,
z threshold 4.0).

Equations implemented:
- one green list ``G`` of ``floor(gamma V)`` ids drawn from an RNG seeded with the first 4 bytes
  (little-endian) of SHA-256 of the key;
- generation: ``logits[G] += delta`` at every step;
- detection: over *all* continuation tokens (no prefix skipped) ``z = (c_g - gamma n) /
  sqrt(n gamma (1 - gamma))``; with ``unique`` each distinct token is scored once (the original
  paper's robust variant; MarkLLM does not do this).

Default (llmtool's own lists): the key is hashed as its decimal string (``str(key).encode()``) and
``G`` = the first ``floor(gamma V)`` entries of a numpy PCG64 permutation of the vocabulary.

``markllm_compat`` reproduces MarkLLM's ``UnigramUtils`` exactly (checked against recorded values in
tests/test_evade_markllm_compat.py): the key is hashed as 8 little-endian bytes (a numpy int64), and
a 0/1 mask holding ``floor(gamma V)`` ones followed by zeros is shuffled in place by
``numpy.random.default_rng(seed)``; ``G`` = the positions of the ones. (Shuffling the mask is not
the same as taking a permutation's first entries: it yields the *inverse* permutation's first
entries, a different set.) Biasing and the z-score are the same in both modes.
"""
from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

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
        n_green = math.floor(c.gamma * self.vocab_size)
        if c.markllm_compat:
            digest = hashlib.sha256(int(c.key).to_bytes(8, "little", signed=True)).digest()
            self.mask_seed = int.from_bytes(digest[:4], "little")
            self.mask = np.zeros(self.vocab_size, dtype=bool)
            self.mask[:n_green] = True
            np.random.default_rng(self.mask_seed).shuffle(self.mask)
            self.green_ids = np.flatnonzero(self.mask)
        else:
            digest = hashlib.sha256(str(c.key).encode()).digest()
            self.mask_seed = int.from_bytes(digest[:4], "little")
            self.green_ids = np.sort(permutation(self.mask_seed, self.vocab_size)[:n_green])
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

"""DiPmark (Wu et al., "A Resilient and Accessible Distribution-Preserving Watermark for Large
Language Models", ICML 2024) with MarkLLM defaults (gamma 0.5, alpha 0.45, key 42, context h 5,
z threshold 1.513).

Equations implemented:
- a permutation of the vocabulary seeded by SHA-256(context token bytes || key bytes), the context
  being the last h tokens, each as 8 little-endian bytes;
- alpha-reweighting: in permuted order token i covers ``[F_{i-1}, F_i)`` of the cumulative
  distribution; its new mass is ``|[F_{i-1},F_i) ∩ [alpha,1]| + |[F_{i-1},F_i) ∩ [1-alpha,1]|``
  (total mass (1-alpha) + alpha = 1; averaging over uniformly random permutations gives back p,
  so the scheme is distribution-preserving);
- detection: a token is green iff its 1-based position in the permutation divided by V is
  ``>= gamma``; ``z = (c_g - (1 - gamma) n) / sqrt(n)``; watermarked iff ``z > z_threshold``.
- repeated contexts (DiPmark's history masking, MarkLLM's ``ignore_history_* = 0``): with
  ``skip_repeated_detection`` a position whose context already occurred earlier in the text is not
  scored; with ``skip_repeated_generation`` a generation step whose context already occurred in
  that sequence keeps the model's distribution. ``null`` (the default) means on in
  ``markllm_compat`` mode (MarkLLM's defaults) and off otherwise. (MarkLLM's flags are named the
  other way round: its ``ignore_history_detection: 1`` is ``skip_repeated_detection: false`` here.)

Default (llmtool's own keys): the key is appended as 8 little-endian bytes; the permutation is numpy
PCG64 seeded with the first 8 digest bytes (little-endian); only positions t >= h (full context)
are scored, n = their number; the processor reweights the *tempered* distribution
``softmax(logits / T)`` and returns its log-probabilities.

``markllm_compat`` reproduces MarkLLM's DIP on the CPU (checked against recorded values in
tests/test_evade_markllm_compat.py): the key bytes are 1024 bits of Python's ``random`` seeded with
the key, as 128 big-endian bytes (MarkLLM's derivation up to its commit 876ccb9; later revisions
dropped it and fail); the seed is the whole digest read big-endian, modulo 2**32 - 1, and the
permutation ``torch.randperm`` from torch's CPU generator (identical permutations). Detection scores
every position t >= 1 with the up-to-h preceding tokens as context, counts n = len(ids) - skipped
(the unscored first token included), and computes quantiles and z in float32 as MarkLLM does
(identical scores). The processor reweights the *untempered* ``softmax(logits)`` (MarkLLM's
processor runs before transformers' temperature warper) and returns ``log(q) / T``, so plain
sampling after it draws from MarkLLM's ``softmax((logits + log reweight) / T)`` (equal up to float
rounding: MarkLLM reweights in float32 logit space, here in float64 probabilities). Not covered:
MarkLLM on a GPU (CUDA generators give other permutations) and any top-k/top-p its ``gen_kwargs``
add after the processor.

The processor applies its own temperature, so the caller samples at temperature 1 without
top-k/top-p (``Scheme.owns_sampling``).
"""
from __future__ import annotations

import hashlib
import math
import random
from collections.abc import Sequence
from dataclasses import dataclass

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
    skip_repeated_detection: bool | None = None   # None: on with markllm_compat, off otherwise
    skip_repeated_generation: bool | None = None  # None: on with markllm_compat, off otherwise
    markllm_compat: bool = False

    def validate(self) -> str | None:
        for name in ("skip_repeated_detection", "skip_repeated_generation"):
            if not (getattr(self, name) is None or isinstance(getattr(self, name), bool)):
                return f"{name} must be true, false or null, got {getattr(self, name)!r}"
        if self.temperature <= 0:
            return f"temperature must be > 0, got {self.temperature}"
        if not 0 <= self.alpha <= 0.5:
            return f"alpha must be in [0, 0.5], got {self.alpha}"
        if not 0 < self.gamma < 1:
            return f"gamma must be in (0, 1), got {self.gamma}"
        if self.prefix_length < 1:
            return f"prefix_length must be >= 1, got {self.prefix_length}"
        return None

    def skips(self, which: str) -> bool:
        value = getattr(self, f"skip_repeated_{which}")
        return self.markllm_compat if value is None else value


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

    def __init__(self, vocab_size: int, config: DIPConfig | None = None):
        super().__init__(vocab_size, config)
        c = self.config
        if c.markllm_compat:
            self.key_bytes = random.Random(c.key).getrandbits(1024).to_bytes(128, "big")
        else:
            self.key_bytes = int(c.key).to_bytes(8, "little", signed=True)

    def context_code(self, context: Sequence[int]) -> bytes:
        """The last ``prefix_length`` tokens (fewer if the context is shorter) as 8-byte little-endian ints."""
        return b"".join(int(t).to_bytes(8, "little", signed=True) for t in context[-self.config.prefix_length:])

    def perm_seed(self, context: Sequence[int]) -> int:
        digest = hashlib.sha256(self.context_code(context) + self.key_bytes).digest()
        if self.config.markllm_compat:
            return int.from_bytes(digest, "big") % (2**32 - 1)
        return int.from_bytes(digest[:8], "little")

    def perm(self, context: Sequence[int]) -> np.ndarray:
        return permutation(self.perm_seed(context), self.vocab_size, self.config.markllm_compat)

    def processor(self):
        return DipReweight(self)

    def detect(self, ids: Sequence[int]) -> Detection:
        ids = [int(t) for t in ids]
        cfg = self.config
        h = cfg.prefix_length
        compat = cfg.markllm_compat
        skip = cfg.skips("detection")
        seen, green, scored, skipped = set(), 0, 0, 0
        V32, gamma32 = np.float32(self.vocab_size), np.float32(cfg.gamma)
        for t in range(1 if compat else h, len(ids)):
            ctx = ids[max(0, t - h):t]
            if skip:
                code = self.context_code(ctx)
                if code in seen:
                    skipped += 1
                    continue
                seen.add(code)
            perm = self.perm(ctx)
            position = int(np.nonzero(perm == ids[t])[0][0]) + 1
            if compat:  # float32 quantile and comparison, as MarkLLM
                green += bool(np.float32(position) / V32 >= gamma32)
            else:
                green += position / self.vocab_size >= cfg.gamma
            scored += 1
        n = len(ids) - skipped if compat else scored
        if n < 1:
            return Detection(0.0, False, 0, "z")
        if compat:  # MarkLLM's float32 tensor arithmetic
            z = float((np.float32(green) - np.float32((1 - cfg.gamma) * n)) / np.float32(math.sqrt(n)))
        else:
            z = (green - (1 - cfg.gamma) * n) / math.sqrt(n)
        return Detection(z, z > cfg.z_threshold, n, "z")


class DipReweight:
    """LogitsProcessor returning the log of the reweighted distribution (see the module docstring)."""

    def __init__(self, scheme: DIP):
        self.scheme = scheme
        self._rows: list[list[int]] | None = None   # the rows of the previous call (to spot a new generate)
        self._seen: list[set[bytes]] = []           # per row: context codes already used at a step

    def _repeated(self, rows: list[list[int]]) -> list[bool]:
        """Per row: whether this step's context already occurred at an earlier step of that sequence."""
        prev = self._rows
        if prev is None or len(prev) != len(rows) or any(len(r) != len(p) + 1 or r[:len(p)] != p
                                                         for r, p in zip(rows, prev)):
            self._seen = [set() for _ in rows]
        self._rows = rows
        out = []
        for row, seen in zip(rows, self._seen):
            code = self.scheme.context_code(row)
            out.append(code in seen)
            seen.add(code)
        return out

    def __call__(self, input_ids, scores):
        import torch

        cfg = self.scheme.config
        rows = input_ids.tolist()
        repeated = self._repeated(rows) if cfg.skips("generation") else [False] * len(rows)
        # compat: MarkLLM reweights the untempered distribution, the temperature acts afterwards
        tempered = 1.0 if cfg.markllm_compat else cfg.temperature
        probs = torch.softmax(scores.double() / tempered, dim=-1).cpu().numpy()
        out = []
        for b, row in enumerate(rows):
            if len(row) < cfg.prefix_length or repeated[b]:
                q = probs[b]
            else:
                q = reweight(probs[b], self.scheme.perm(row), cfg.alpha)
            out.append(q)
        logq = torch.log(torch.from_numpy(np.stack(out)).clamp_min(0))
        if cfg.markllm_compat:
            logq = logq / cfg.temperature
        return logq.to(scores.device).to(scores.dtype)

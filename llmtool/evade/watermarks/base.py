"""Shared pieces of every watermark scheme: the detection record, seeded permutations that do not
depend on the device, config parsing, and the small interface a scheme implements.

A scheme object holds its config and the generator's vocabulary size ``V`` (always the model's
``config.vocab_size``, never ``len(tokenizer)``: the embedding may have more rows than the
tokenizer has ids). It offers ``processor()`` (a transformers ``LogitsProcessor`` used with any
causal LM's ``generate``) and ``detect(ids)`` on the token ids of the *continuation only* (the
prompt is never scored).

All randomness that defines green lists / pseudo-random vectors is drawn on the CPU from seeds,
so the same key gives the same lists on any machine, with or without CUDA.
"""
from __future__ import annotations

import abc
import dataclasses
import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from llmtool.core.console import UsageError


@dataclass
class Detection:
    score: float           # z-score (score_kind "z") or p-value (score_kind "p")
    is_watermarked: bool   # decision at the scheme's fixed threshold
    n_scored: int          # number of tokens that entered the statistic
    score_kind: str        # "z": higher = more watermarked; "p": lower = more watermarked

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def permutation(seed: int, size: int, markllm_compat: bool = False) -> np.ndarray:
    """A permutation of ``range(size)`` fixed by ``seed``.

    Default: numpy PCG64 (device independent, fast). ``markllm_compat``: ``torch.randperm`` from
    torch's CPU generator seeded with ``seed``, as MarkLLM's KGW and DiPmark draw it on the CPU (a
    CUDA generator gives other permutations, so MarkLLM run on a GPU is not reproduced)."""
    if markllm_compat:
        import torch

        g = torch.Generator(device="cpu").manual_seed(int(seed))
        return torch.randperm(size, generator=g).numpy()
    return np.random.Generator(np.random.PCG64(int(seed))).permutation(size)


def uniform_vector(seed: int, size: int, markllm_compat: bool = False) -> np.ndarray:
    """``size`` i.i.d. U(0,1) draws fixed by ``seed``.

    Default: numpy PCG64, float64. ``markllm_compat``: float32 ``torch.rand`` from torch's CPU
    generator seeded with ``seed`` (bit for bit the vector MarkLLM's EXP draws on the CPU)."""
    if markllm_compat:
        import torch

        g = torch.Generator(device="cpu").manual_seed(int(seed))
        return torch.rand(size, generator=g, dtype=torch.float32).numpy()
    return np.random.Generator(np.random.PCG64(int(seed))).random(size)


def build_config(cls, overrides: dict[str, Any] | None, source: str = "--config"):
    """A config dataclass from defaults plus user overrides; unknown keys or bad types are user errors."""
    overrides = dict(overrides or {})
    fields = {f.name: f for f in dataclasses.fields(cls)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise UsageError(f"{source}: unknown field(s) {', '.join(unknown)} for {cls.__name__}; "
                         f"known: {', '.join(fields)}")
    values = {}
    for name, value in overrides.items():
        kind = type(fields[name].default)
        try:
            if kind is bool:
                if not isinstance(value, bool):
                    raise TypeError
                values[name] = value
            elif kind in (int, float):
                if isinstance(value, bool) or not isinstance(value, (int, float)):
                    raise TypeError
                if kind is int and float(value) != int(value):
                    raise TypeError
                values[name] = kind(value)
            else:
                values[name] = value
        except TypeError:
            raise UsageError(f"{source}: field {name!r} must be {kind.__name__}, got {value!r}") from None
    cfg = cls(**values)
    check = getattr(cfg, "validate", None)
    if check is not None:
        problem = check()
        if problem:
            raise UsageError(f"{source}: {problem}")
    return cfg


def read_config_file(path: str | Path | None) -> dict:
    if path is None:
        return {}
    p = Path(path)
    if not p.is_file():
        raise UsageError(f"{p}: no such config file")
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise UsageError(f"{p}:{e.lineno}: malformed JSON ({e.msg})") from None
    if not isinstance(data, dict):
        raise UsageError(f"{p}: a scheme config must be a JSON object")
    return data


class Scheme(abc.ABC):
    """Interface of a watermark scheme (subclasses set ``name``, ``score_kind``, ``config_cls``)."""

    name = ""
    score_kind = "z"
    config_cls: type = object
    # True when the processor fixes the next token itself (the caller decodes greedily after it).
    chooses_token = False

    def __init__(self, vocab_size: int, config=None):
        if vocab_size < 2:
            raise UsageError(f"vocabulary size {vocab_size} is too small for a watermark")
        self.vocab_size = int(vocab_size)
        self.config = config if config is not None else self.config_cls()

    @abc.abstractmethod
    def processor(self):
        """The transformers LogitsProcessor that embeds this watermark."""

    @abc.abstractmethod
    def detect(self, ids: Sequence[int]) -> Detection:
        """Detection statistic of a token sequence."""

    def config_dict(self) -> dict:
        return dataclasses.asdict(self.config)

    def config_sha(self) -> str:
        import hashlib

        blob = json.dumps({"scheme": self.name, "V": self.vocab_size, **self.config_dict()}, sort_keys=True)
        return hashlib.sha256(blob.encode()).hexdigest()[:16]

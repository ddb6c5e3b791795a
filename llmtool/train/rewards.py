"""Reward functions for RLVR, including the spurious ones of "Spurious Rewards" (Shao et al., ICML 2026,
arXiv 2506.10947, §2 and Table 1), as a registry of method configs (``--reward NAME[:ARG]``).

| name | reward (per rollout) |
|---|---|
| ``ground-truth`` | 1 iff the verifier accepts the response (rl_data: last integer / task verifier) |
| ``majority-vote`` | 1 iff the answer equals the row's pseudo-label ``mv_label`` (majority of samples of the untrained model, :func:`majority_labels`) |
| ``format`` | 1 iff the response contains the format marker (default: any integer; ``format:<substring>``) |
| ``random`` | Bernoulli(γ), ``random:0.5``; independent of the response, **seeded** per (seed, phase, prompt, rollout), the prompt being its position in the phase over all processes (so ranks draw differently) |
| ``incorrect`` | 1 iff the answer equals the row's ``wrong_label`` (a wrong majority label, or a deterministic wrong answer) |
| ``one-shot`` | ground truth on one training example repeated (the data is reduced to row ``one_shot_index``) |

Reconstructed choices: ``format`` uses "contains an integer" as its marker because SmolLM2 never writes
``\\boxed{}`` (spec corrections); when no row carries ``wrong_label``, ``incorrect`` uses
``answer + 1`` (a wrong answer that is deterministic and close, standing in for the paper's wrong
majority labels); the behaviour tracker (:func:`marker_rate`) is case-insensitive substring counting,
as the paper's "python" probe.
"""
from __future__ import annotations

import random
from collections import Counter
from dataclasses import dataclass
from typing import ClassVar, Sequence

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option
from llmtool.train import rl_data

REWARDS = Registry("train grpo", what="reward")


@dataclass
class RewardConfig(MethodConfig):
    """A reward: ``score(row, text, finish, key) -> float``; ``key`` = (seed, phase, prompt, rollout)."""
    needs_answer: ClassVar[bool] = True
    arg_field: ClassVar[str | None] = None   # the field set by ``NAME:ARG``

    def score(self, row: dict, text: str, finish: str, key: tuple) -> float:
        raise NotImplementedError

    def prepare_rows(self, rows: list[dict]) -> list[dict]:
        """Checks (and reductions) of the training rows before training."""
        return rows


@REWARDS.config
@dataclass
class GroundTruth(RewardConfig):
    name: ClassVar[str] = "ground-truth"
    help: ClassVar[str] = "1 iff the verifier accepts the answer."

    def score(self, row, text, finish, key):
        return float(rl_data.is_correct(row, text))


@REWARDS.config
@dataclass
class MajorityVote(RewardConfig):
    name: ClassVar[str] = "majority-vote"
    help: ClassVar[str] = "1 iff the answer equals the row's mv_label (majority of base-model samples)."

    def prepare_rows(self, rows):
        for i, r in enumerate(rows):
            if r.get("mv_label") in (None, ""):
                raise UsageError(f"--reward majority-vote: data row {i + 1} has no 'mv_label' "
                                 "(label the data first with `llmtool train label-majority`)")
        return rows

    def score(self, row, text, finish, key):
        return float(rl_data.matches(row, text, row["mv_label"]))


@REWARDS.config
@dataclass
class Format(RewardConfig):
    name: ClassVar[str] = "format"
    help: ClassVar[str] = "1 iff the response has the format (default: contains an integer answer)."
    needs_answer: ClassVar[bool] = False
    arg_field: ClassVar[str | None] = "marker"
    marker: str = option("", "Substring that defines the format (empty: any extractable answer).", cli=False)

    def score(self, row, text, finish, key):
        if self.marker:
            return float(self.marker.lower() in (text or "").lower())
        return float(rl_data.extract_answer(row, text) is not None)


@REWARDS.config
@dataclass
class RandomReward(RewardConfig):
    name: ClassVar[str] = "random"
    help: ClassVar[str] = "Bernoulli(gamma), independent of the response (seeded)."
    needs_answer: ClassVar[bool] = False
    arg_field: ClassVar[str | None] = "gamma"
    gamma: float = option(0.5, "Probability of reward 1.", min=0.0, max=1.0, cli=False)

    def score(self, row, text, finish, key):
        rng = random.Random(hash_key(("random",) + tuple(key)))
        return float(rng.random() < self.gamma)


@REWARDS.config
@dataclass
class Incorrect(RewardConfig):
    name: ClassVar[str] = "incorrect"
    help: ClassVar[str] = "1 iff the answer equals a wrong label (row's wrong_label, else answer+1)."

    def prepare_rows(self, rows):
        for r in rows:
            if r.get("wrong_label") in (None, ""):
                if r.get("task", "arith") != "arith":
                    raise UsageError("--reward incorrect: rows of non-arith tasks need a 'wrong_label'")
                r["wrong_label"] = str(int(r["answer"]) + 1)
        return rows

    def score(self, row, text, finish, key):
        return float(rl_data.matches(row, text, row["wrong_label"]))


@REWARDS.config
@dataclass
class OneShot(RewardConfig):
    name: ClassVar[str] = "one-shot"
    help: ClassVar[str] = "Ground truth on one training example, repeated."
    arg_field: ClassVar[str | None] = "index"
    index: int = option(0, "Row index of the single training example.", min=0, cli=False)

    def prepare_rows(self, rows):
        if self.index >= len(rows):
            raise UsageError(f"--reward one-shot:{self.index}: the data has only {len(rows)} rows")
        return [rows[self.index]]

    def score(self, row, text, finish, key):
        return float(rl_data.is_correct(row, text))


def hash_key(key: tuple) -> int:
    """A process-independent integer seed from a tuple (Python's ``hash`` of str is salted)."""
    import hashlib

    return int.from_bytes(hashlib.blake2b(repr(key).encode(), digest_size=8).digest(), "little")


def parse_reward(spec: str) -> RewardConfig:
    """``NAME`` or ``NAME:ARG`` (``random:0.5``, ``format:python``, ``one-shot:3``) → validated config."""
    name, _, arg = spec.partition(":")
    cls = REWARDS.get_config(name.strip())
    kw = {}
    if arg:
        if cls.arg_field is None:
            raise UsageError(f"--reward {spec!r}: reward {name!r} takes no argument")
        ftype = cls.type_hints()[cls.arg_field]
        try:
            kw[cls.arg_field] = {float: float, int: int}.get(ftype, str)(arg)
        except ValueError:
            raise UsageError(f"--reward {spec!r}: {arg!r} is not a valid {cls.arg_field}") from None
    cfg = cls(**kw)
    try:
        cfg.validate()
    except UsageError as e:
        raise UsageError(f"--reward {spec!r}: {e}".replace(f"--{cls.arg_field.replace('_', '-')} " if cls.arg_field else "", "")) from None
    return cfg  # type: ignore[return-value]


def make_reward_fn(cfg: RewardConfig, seed: int):
    """The GRPO loop's ``reward_fn(rollouts, phase)``."""
    def fn(rollouts, phase):
        counts: dict[int, int] = {}
        for r in rollouts:
            # keyed by the prompt's position in the phase over all processes (rank-independent, and
            # different on every rank): random rewards are per-rank draws that a 1-process run reproduces
            q = getattr(r, "global_index", -1)
            q = r.prompt_index if q is None or q < 0 else q
            j = counts.get(q, 0)
            counts[q] = j + 1
            r.reward = cfg.score(r.row, r.text, r.finish, (seed, phase, q, j))
            r.extra["correct"] = bool(rl_data.is_correct(r.row, r.text)) if cfg.needs_answer or "answer" in r.row \
                else None
    return fn


def marker_rate(texts: Sequence[str], marker: str) -> float:
    """Share of responses that contain ``marker`` (case-insensitive) — the behaviour tracker."""
    if not texts:
        return 0.0
    m = marker.lower()
    return sum(m in (t or "").lower() for t in texts) / len(texts)


def majority_labels(rows: list[dict], texts_per_row: Sequence[Sequence[str]]) -> list[dict]:
    """Add ``mv_label`` (most common extracted answer; ties → smallest key) and ``mv_correct``."""
    out = []
    for row, texts in zip(rows, texts_per_row):
        answers = [a for a in (rl_data.extract_answer(row, t) for t in texts) if a is not None]
        r = dict(row)
        if answers:
            c = Counter(answers)
            top = max(c.values())
            r["mv_label"] = sorted(a for a, k in c.items() if k == top)[0]
            r["mv_correct"] = rl_data.is_correct(row, "", answer=r["mv_label"])
        else:
            r["mv_label"] = None
            r["mv_correct"] = False
        out.append(r)
    return out

"""Fault injection for clipping experiments (AdaGC spec §5 scale plan; the issue's fault protocol).

* ``--inject-grad-spike STEP:TENSOR:SCALE[:STEPS]`` multiplies TENSOR's accumulated gradient by SCALE at
  optimizer updates STEP..STEP+STEPS-1 (1-based; applied before clipping, so the clipper sees it).
* ``--inject-garbage STEP[:STEPS]`` replaces the batches of updates STEP.. with uniformly random token ids
  (a data outlier; the labels follow the inputs).
* ``--inject-lr-spike STEP:FACTOR[:STEPS]`` multiplies every param group's learning rate by FACTOR for
  those updates, restored right after the optimizer step.

Parsing errors and unknown tensor names raise ``UsageError`` (one ``error:`` line, with close names).
"""
from __future__ import annotations

import difflib
import math
from dataclasses import dataclass

from llmtool.core.console import UsageError


@dataclass(frozen=True)
class GradSpike:
    step: int
    tensor: str
    scale: float
    steps: int = 1

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.steps


@dataclass(frozen=True)
class Window:
    step: int
    factor: float = 1.0
    steps: int = 1

    def active(self, step: int) -> bool:
        return self.step <= step < self.step + self.steps


def _int(text: str, flag: str, spec: str, what: str, lo: int = 1) -> int:
    try:
        v = int(text)
    except ValueError:
        raise UsageError(f"{flag} {spec!r}: {what} {text!r} is not an integer") from None
    if v < lo:
        raise UsageError(f"{flag} {spec!r}: {what} must be >= {lo}")
    return v


def _float(text: str, flag: str, spec: str, what: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise UsageError(f"{flag} {spec!r}: {what} {text!r} is not a number") from None
    if not math.isfinite(v):
        raise UsageError(f"{flag} {spec!r}: {what} must be finite")
    return v


def parse_grad_spike(spec: str, names: list[str] | None = None) -> GradSpike:
    flag = "--inject-grad-spike"
    parts = spec.split(":")
    if len(parts) not in (3, 4) or not parts[1]:
        raise UsageError(f"{flag} {spec!r}: expected STEP:TENSOR:SCALE[:STEPS]")
    step = _int(parts[0], flag, spec, "STEP")
    scale = _float(parts[2], flag, spec, "SCALE")
    steps = _int(parts[3], flag, spec, "STEPS") if len(parts) == 4 else 1
    tensor = parts[1]
    if names is not None:
        check_tensor(tensor, names, flag)
    return GradSpike(step, tensor, scale, steps)


def check_tensor(tensor: str, names: list[str], flag: str = "--inject-grad-spike") -> None:
    if tensor in names:
        return
    close = difflib.get_close_matches(tensor, names, n=5, cutoff=0.4)
    hint = f"; close names: {', '.join(close)}" if close else f"; e.g. {', '.join(names[:3])}"
    raise UsageError(f"{flag}: no trainable tensor named {tensor!r}{hint}")


def parse_window(spec: str, flag: str, with_factor: bool) -> Window:
    parts = spec.split(":")
    if with_factor:
        if len(parts) not in (2, 3):
            raise UsageError(f"{flag} {spec!r}: expected STEP:FACTOR[:STEPS]")
        factor = _float(parts[1], flag, spec, "FACTOR")
        if factor < 0:
            raise UsageError(f"{flag} {spec!r}: FACTOR must be >= 0")
        steps = _int(parts[2], flag, spec, "STEPS") if len(parts) == 3 else 1
    else:
        if len(parts) not in (1, 2):
            raise UsageError(f"{flag} {spec!r}: expected STEP[:STEPS]")
        factor, steps = 1.0, (_int(parts[1], flag, spec, "STEPS") if len(parts) == 2 else 1)
    return Window(_int(parts[0], flag, spec, "STEP"), factor, steps)


@dataclass
class Faults:
    grad_spikes: tuple[GradSpike, ...] = ()
    garbage: tuple[Window, ...] = ()
    lr_spikes: tuple[Window, ...] = ()

    @classmethod
    def parse(cls, grad_spikes=(), garbage=(), lr_spikes=(), names: list[str] | None = None) -> "Faults":
        return cls(tuple(parse_grad_spike(s, names) for s in grad_spikes or ()),
                   tuple(parse_window(s, "--inject-garbage", False) for s in garbage or ()),
                   tuple(parse_window(s, "--inject-lr-spike", True) for s in lr_spikes or ()))

    def __bool__(self) -> bool:
        return bool(self.grad_spikes or self.garbage or self.lr_spikes)

    def lr_factor(self, step: int) -> float:
        f = 1.0
        for w in self.lr_spikes:
            if w.active(step):
                f *= w.factor
        return f

    def is_garbage(self, step: int) -> bool:
        return any(w.active(step) for w in self.garbage)

    def as_dict(self) -> dict:
        return {"grad_spikes": [vars(g) for g in self.grad_spikes], "garbage": [vars(w) for w in self.garbage],
                "lr_spikes": [vars(w) for w in self.lr_spikes]}

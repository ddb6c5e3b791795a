"""Activation capture on named modules (forward hooks), shared by methods that need layer inputs,
outputs or Gram statistics from calibration data."""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch


def hidden_of(output):
    """The hidden states of a decoder layer's output: recent transformers return a tensor, older
    ones a tuple ``(hidden, ...)``."""
    return output[0] if isinstance(output, tuple) else output


def with_hidden(output, hidden):
    """``output`` with its hidden states replaced, in the same form (tensor or tuple)."""
    return (hidden, *output[1:]) if isinstance(output, tuple) else hidden


@contextmanager
def forward_hooks(model: torch.nn.Module, names: list[str],
                  fn: Callable[[str, torch.nn.Module, tuple, torch.Tensor], None]) -> Iterator[None]:
    """Call ``fn(name, module, inputs, output)`` after each forward of every named module."""
    modules = dict(model.named_modules())
    missing = [n for n in names if n not in modules]
    if missing:
        raise KeyError(f"no such modules: {missing[:3]}")
    handles = [modules[n].register_forward_hook(lambda m, i, o, n=n: fn(n, m, i, o)) for n in names]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


class GramAccumulator:
    """Accumulates ``X^T X`` and the token count of the inputs of named Linear modules
    (float64 on CPU by default: LLM activations make the Gram matrix badly conditioned)."""

    def __init__(self, dtype: torch.dtype = torch.float64):
        self.dtype = dtype
        self.gram: dict[str, torch.Tensor] = {}
        self.count: dict[str, int] = {}

    def __call__(self, name: str, module, inputs: tuple, output) -> None:
        x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(self.dtype)
        g = x.T @ x
        if name in self.gram:
            self.gram[name] += g
        else:
            self.gram[name] = g
        self.count[name] = self.count.get(name, 0) + x.shape[0]

    def covariance(self, name: str) -> torch.Tensor:
        return self.gram[name] / max(1, self.count[name])


@contextmanager
def capture_gram(model: torch.nn.Module, names: list[str], dtype=torch.float64) -> Iterator[GramAccumulator]:
    acc = GramAccumulator(dtype)
    with forward_hooks(model, names, acc):
        yield acc

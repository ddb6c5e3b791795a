"""Forward hooks on named modules and the decoder-layer output convention, shared by every area that
reads or changes activations (Gram statistics and layer-by-layer calibration: :mod:`llmtool.core.calib`)."""
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

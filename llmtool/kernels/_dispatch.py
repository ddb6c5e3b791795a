"""Shared helper of the quantize kernels: whether a call should go to triton or the torch reference."""
from __future__ import annotations

import os

import torch


def use_triton(*tensors: torch.Tensor) -> bool:
    """Triton on CUDA tensors (or anywhere under ``TRITON_INTERPRET=1`` when forced by a test);
    the pure-torch reference everywhere else."""
    try:
        import triton  # noqa: F401
    except ImportError:  # pragma: no cover
        return False
    return all(t.is_cuda for t in tensors)


def interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET") == "1"

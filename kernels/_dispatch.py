"""Shared helper of the quantize kernels: whether a call should go to triton or the torch reference."""
from __future__ import annotations

import os

import torch

# launch options for kernels that promise the torch reference's result bit for bit: no multiply-add
# contraction (torch rounds the product and the sum separately). Divisions in such kernels use
# tl.math.div_rn: triton's `/` on fp32 is an approximate division on NVIDIA GPUs (measured on an H200:
# the KV-cache codes differed from the reference's without both).
EXACT_FP = {"enable_fp_fusion": False}


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

"""In-place LAPACK calls for the layer-streamed compression (``compress --stream``), CPU only.

``torch.linalg`` returns new storage from every factorisation and copies its input into LAPACK's
column-major layout first, so a Cholesky factor of an ``[n, n]`` Gram matrix briefly needs two more
``[n, n]`` float64 matrices and an SVD of ``[m, n]`` needs the input, its copy, the outputs and the
divide-and-conquer workspace (measured on the default model's 576 x 1536 down projection: +18 MB for
the Cholesky, +24-26 MB for the SVD). scipy's LAPACK wrappers can overwrite their input
(``overwrite_a``), and a C-contiguous matrix is the column-major storage of its transpose, so:

* :func:`cholesky_lower_` factors a symmetric matrix in its own storage (``potrf``: +0 MB);
* :func:`svd_` takes the SVD of ``A`` from the column-major ``A^T``, destroying ``A`` (``gesdd``: +20 MB,
  of which 12 MB are the outputs; ``SVD_DRIVER = "gesvd"`` needs 8 MB less but took 2.5x the time, 0.47 s
  vs 0.18 s at 576 x 1536 on one thread, which made a whole run 1.5x slower);
* :func:`solve_right_lower_` computes ``M L^{-1}`` in ``M``'s storage (``trsm``).
* :func:`symmetrize_` (plain torch, any device) averages a matrix with its transpose by blocks, for the
  whitening's in-place path.

The numpy views handed to scipy are made from raw pointers (:func:`as_numpy`), not ``Tensor.numpy()``,
which would pin the tensor's storage (not resizable), and
:func:`llmtool.compress.factorize.storage_on_disk` frees a storage by resizing it. The results equal
``torch.linalg``'s to rounding (another LAPACK build); singular vectors' signs are made canonical by the
caller (:func:`llmtool.compress.factorize.canonical_signs`).
"""
from __future__ import annotations

import ctypes
import os

import numpy as np
import torch

SYM_BLOCK = 256   # rows of the blocks :func:`symmetrize_` averages at a time ([block, block] temporaries)
SVD_DRIVER = "gesdd"   # see the module docstring: "gesvd" needs 8 MB less at 576 x 1536 and takes 2.5x the time


def symmetrize_(c: torch.Tensor, block: int = SYM_BLOCK) -> torch.Tensor:
    """``c <- (c + c^T) / 2`` in place, one pair of ``[block, block]`` blocks at a time (the same bits as
    ``(c + c.T) * 0.5``: each entry is one sum and one multiplication by a power of two)."""
    n = c.shape[0]
    for i in range(0, n, block):
        for j in range(i, n, block):
            avg = c[i:i + block, j:j + block] + c[j:j + block, i:i + block].T
            avg.mul_(0.5)
            c[i:i + block, j:j + block] = avg
            c[j:j + block, i:i + block] = avg.T
    return c


def raw_bytes(t: torch.Tensor):
    """A writable ctypes buffer over the bytes of the contiguous CPU tensor ``t`` (for file I/O and numpy
    views). ``Tensor.numpy()`` would mark ``t``'s storage as not resizable for the rest of its life, which
    :func:`llmtool.compress.factorize.storage_on_disk` needs; the caller keeps ``t`` alive while it is used."""
    if t.device.type != "cpu" or not t.is_contiguous():
        raise ValueError("raw_bytes needs a contiguous CPU tensor")
    return (ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())


def write_raw(t: torch.Tensor, path) -> None:
    """The bytes of the contiguous CPU tensor ``t`` to ``path`` (no copy in memory)."""
    with open(path, "wb") as f:
        f.write(raw_bytes(t))


def read_raw(path, shape, dtype: torch.dtype) -> torch.Tensor:
    """A tensor read back from :func:`write_raw`'s file, which is then deleted."""
    t = torch.empty(shape, dtype=dtype)
    with open(path, "rb") as f:
        if f.readinto(raw_bytes(t)) != t.numel() * t.element_size():
            raise OSError(f"{path}: short read")
    os.unlink(path)
    return t


def as_numpy(t: torch.Tensor) -> np.ndarray:
    """A C-ordered numpy view of the contiguous CPU tensor ``t`` that torch does not track (see :func:`raw_bytes`)."""
    dtype = {torch.float64: np.float64, torch.float32: np.float32}[t.dtype]
    return np.frombuffer(raw_bytes(t), dtype=dtype).reshape(tuple(t.shape))


def _lapack(dtype: torch.dtype, name: str):
    from scipy.linalg import blas, lapack

    prefix = {torch.float64: "d", torch.float32: "s"}[dtype]
    return getattr(lapack if name != "trsm" else blas, prefix + name)


def cholesky_lower_(c: torch.Tensor) -> bool:
    """Overwrite the symmetric positive-definite CPU matrix ``c`` (C-contiguous float64/float32) with its
    lower Cholesky factor ``L`` (``L L^T = c``). Returns False, with ``c`` restored to its input, when the
    factorisation fails (``c`` not positive definite)."""
    if c.device.type != "cpu" or not c.is_contiguous():
        raise ValueError("cholesky_lower_ needs a contiguous CPU matrix")
    diag = c.diagonal().clone()
    a = as_numpy(c).T               # column-major storage of c^T == c: LAPACK's "upper" is c's lower triangle
    _, info = _lapack(c.dtype, "potrf")(a, lower=0, clean=0, overwrite_a=1)
    if info == 0:
        c.tril_()                    # the strictly upper part still holds the input
        return True
    # restore: the strictly upper triangle is untouched, the lower one (with the diagonal) was overwritten
    n = c.shape[0]
    for i in range(0, n, SYM_BLOCK):
        rows = slice(i, i + SYM_BLOCK)
        c[rows, :i] = c[:i, rows].T
        c[rows, rows] = c[rows, rows].triu() + c[rows, rows].triu(1).T
    c.diagonal().copy_(diag)
    return False


def svd_(a: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``U [m, k], sigma [k], Vh [k, n]`` (k = min(m, n)) of the C-contiguous CPU matrix ``a``, whose
    contents are destroyed. ``U`` and ``Vh`` are transposed views of column-major LAPACK output."""
    from scipy.linalg import svd

    if a.device.type != "cpu" or not a.is_contiguous():
        raise ValueError("svd_ needs a contiguous CPU matrix")
    # a^T = V S U^T in column-major storage: scipy's (u, s, vt) of a^T are (V, S, U^T)
    v, s, ut = svd(as_numpy(a).T, full_matrices=False, overwrite_a=True, check_finite=False, lapack_driver=SVD_DRIVER)
    return torch.from_numpy(ut).T, torch.from_numpy(s), torch.from_numpy(v).T


def solve_right_lower_(m: torch.Tensor, lower: torch.Tensor) -> torch.Tensor:
    """``M L^{-1}`` for a lower-triangular CPU ``L``, in ``M``'s storage when ``M`` is C-contiguous (as
    :func:`svd_` returns ``Vh``; otherwise in a contiguous copy)."""
    if m.dtype != lower.dtype or m.device.type != "cpu" or lower.device.type != "cpu":
        raise ValueError("solve_right_lower_ needs CPU matrices of one dtype")
    m, lower = m.contiguous(), lower.contiguous()
    # M L^{-1} = (L^{-T} M^T)^T; the C storage of M (of L) is the column-major storage of M^T (of the upper L^T)
    x = _lapack(m.dtype, "trsm")(1.0, as_numpy(lower).T, as_numpy(m).T, side=0, lower=0, trans_a=0, overwrite_b=1)
    return m if np.shares_memory(x, as_numpy(m)) else torch.from_numpy(np.ascontiguousarray(x.T))

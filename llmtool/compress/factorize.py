"""Shared pieces of every SVD-family method: per-module shapes and budget numbers, the SVD of a
(possibly whitened) weight, and the split-sqrt(sigma) factors kept for one module.

Budget (spec zs-svd §3): a module ``W [m, n]`` costs ``m*n (+ bias)`` dense and ``r*(m+n) (+ bias)``
at rank ``r``; its break-even rank is ``r* = max(1, floor((m*n - 1)/(m+n)))``, the largest rank at
which the factorised form is strictly smaller.

Factors: with ``A = W L = U diag(sigma) V^T`` the rank-k factors are ``B = U_k diag(sqrt sigma_k)``
``[m, k]`` and ``A_k = diag(sqrt sigma_k) V_k^T L^{-1}`` ``[k, n]`` (a solve, never an inverse);
splitting sqrt(sigma) gives both factors a similar dynamic range in half precision. All of it runs
in float64; factors are cast to the model dtype only when stored.
"""
from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from llmtool.compress.whitening import Whitener


@dataclass(frozen=True)
class ModuleSpec:
    name: str
    out_features: int  # m
    in_features: int   # n
    has_bias: bool = False

    @property
    def full_rank(self) -> int:
        return min(self.out_features, self.in_features)

    @property
    def dense_params(self) -> int:
        return self.out_features * self.in_features + (self.out_features if self.has_bias else 0)

    @property
    def per_rank(self) -> int:
        return self.out_features + self.in_features

    @property
    def break_even(self) -> int:
        m, n = self.out_features, self.in_features
        return max(1, (m * n - 1) // (m + n))

    def params_at_rank(self, r: int) -> int:
        """Parameters stored for this module at planned rank ``r`` (dense if ``r > r*``)."""
        bias = self.out_features if self.has_bias else 0
        return self.dense_params if r > self.break_even else r * self.per_rank + bias


def uniform_rank(spec: ModuleSpec, ratio: float) -> int:
    """Rank that removes ``ratio`` of this module's parameters (``floor((1-ratio) m n/(m+n))``);
    ratio 0 keeps the full rank (exact reconstruction, used in tests)."""
    if ratio <= 0:
        return spec.full_rank
    m, n = spec.out_features, spec.in_features
    return max(1, min(spec.full_rank, int((1 - ratio) * m * n // (m + n))))


@dataclass
class Spectrum:
    """What one module contributes: its singular values (descending), optional predicted loss
    change of deleting each component, and factors for its leading ``kept`` components."""

    spec: ModuleSpec
    sigma: torch.Tensor                 # [full_rank] float64, descending
    delta_loss: torch.Tensor | None     # [full_rank] float64 or None
    b_full: torch.Tensor                # [m, kmax]
    a_full: torch.Tensor                # [kmax, n]

    def factors(self, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        if k > self.b_full.shape[1]:
            raise ValueError(f"{self.spec.name}: rank {k} > stored {self.b_full.shape[1]} components")
        return self.a_full[:k].contiguous(), self.b_full[:, :k].contiguous()


WHITEN_CHUNK_ROWS = 64    # rows of W upcast to float64 at a time by the low-memory whitening
SIGN_BLOCK = 64           # columns of U whose magnitudes are compared at a time (no whole |U| temporary)


def canonical_signs(u: torch.Tensor, vh: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Flip each singular pair ``(u_i, v_i)`` (in place) so that the largest-magnitude entry of ``u_i`` is
    positive: LAPACK drivers may return either sign, and the factors ``B``/``A`` (unlike their product) carry
    it, so two paths (torch's LAPACK in memory, scipy's in place when streamed) store the same factors."""
    cols = torch.arange(u.shape[1], device=u.device)
    idx = torch.cat([u[:, j:j + SIGN_BLOCK].abs().argmax(0) for j in range(0, u.shape[1], SIGN_BLOCK)])
    sign = torch.sign(u[idx, cols])
    sign[sign == 0] = 1
    u.mul_(sign[None, :])
    vh.mul_(sign[:, None])
    return u, vh


def whiten_rows(weight: torch.Tensor, L: torch.Tensor) -> torch.Tensor:
    """``W L`` in ``L``'s dtype, ``WHITEN_CHUNK_ROWS`` rows of ``W`` upcast at a time (no whole upcast copy)."""
    a = torch.empty(weight.shape[0], L.shape[1], dtype=L.dtype, device=L.device)
    for r in range(0, weight.shape[0], WHITEN_CHUNK_ROWS):
        torch.matmul(weight[r:r + WHITEN_CHUNK_ROWS].to(L.dtype), L, out=a[r:r + WHITEN_CHUNK_ROWS])
    return a


@contextmanager
def storage_on_disk(t: torch.Tensor, directory):
    """Inside the block, the CPU tensor ``t``'s storage is in a file under ``directory`` and its memory is
    freed; on exit it is read back into a fresh allocation (every view of ``t`` stays valid). A tensor whose
    storage cannot be resized (memory owned by numpy) or that is not a contiguous CPU tensor is left alone."""
    from llmtool.compress.lapack_inplace import raw_bytes

    storage = t.untyped_storage()
    nbytes = storage.nbytes()
    if directory is None or t.device.type != "cpu" or not t.is_contiguous() or t.numel() * t.element_size() != nbytes \
            or t.storage_offset() != 0 or not storage.resizable():
        yield
        return
    with tempfile.TemporaryFile(dir=directory) as f:
        f.write(raw_bytes(t))
        storage.resize_(0)
        try:
            yield
        finally:
            storage.resize_(nbytes)
            f.seek(0)
            if f.readinto(raw_bytes(t)) != nbytes:
                raise OSError(f"short read restoring a spilled [{tuple(t.shape)}] tensor")


def whitened_svd(weight: torch.Tensor, whitener: Whitener, low_memory=False):
    """``U, sigma, Vh`` of ``W L`` in float64 (signs canonical, :func:`canonical_signs`).

    ``low_memory`` (the layer-streamed path; CPU only, else ignored): ``W L`` is built by :func:`whiten_rows`
    and its SVD taken in place (:func:`llmtool.compress.lapack_inplace.svd_`); a directory there also moves
    ``L`` to a file in it while the SVD runs (:func:`storage_on_disk`), so the ``[n, n]`` factor and the SVD's
    workspace are never in memory together."""
    L = whitener.L
    if low_memory and weight.device.type == "cpu" and L.device.type == "cpu":
        from llmtool.compress.lapack_inplace import svd_

        a = whiten_rows(weight, L)
        with storage_on_disk(L, None if low_memory is True else low_memory):
            u, sigma, vh = svd_(a)
            del a
    else:
        u, sigma, vh = torch.linalg.svd(whitener.whiten(weight), full_matrices=False)
    u, vh = canonical_signs(u, vh)
    return u, sigma, vh


def unwhiten_rows_(vh: torch.Tensor, whitener: Whitener) -> torch.Tensor:
    """``Vh L^{-1}``, computed in ``vh``'s storage for a CPU Cholesky factor
    (:func:`llmtool.compress.lapack_inplace.solve_right_lower_`), else :meth:`Whitener.unwhiten`."""
    if vh.device.type == "cpu" and whitener.triangular and whitener.L.device.type == "cpu":
        from llmtool.compress.lapack_inplace import solve_right_lower_

        return solve_right_lower_(vh, whitener.L)
    return whitener.unwhiten(vh)


def whitened_basis(weight: torch.Tensor, whitener: Whitener, low_memory=False, release_whitener: bool = False):
    """``(U [m, k], sigma [k], Q^T = V^T L^{-1} [k, n])`` of ``W L = U diag(sigma) V^T`` (float64). On the CPU
    with ``low_memory`` (True or a spill directory, as in :func:`whitened_svd`): in-place LAPACK (the SVD
    destroys ``W L``, ``Q^T`` is solved in ``V^T``'s storage). ``release_whitener=True`` (the whitener's last
    module; the caller never uses it again) frees ``L``'s storage as soon as ``Q^T`` is solved, so the
    ``[n, n]`` factor is not alive next to the caller's factors, scratch writes and the next Gram."""
    u, sigma, vh = whitened_svd(weight, whitener, low_memory=low_memory)
    qt = unwhiten_rows_(vh, whitener) if low_memory else whitener.unwhiten(vh)
    del vh
    if release_whitener:
        release_storage(whitener.L)
    return u, sigma, qt


def release_storage(t: torch.Tensor) -> None:
    """Free a CPU tensor's memory now, whoever else refers to it (its storage is resized to 0 bytes; any
    later use of it fails). A storage that cannot be resized (owned by numpy or a file) is left alone."""
    storage = t.untyped_storage()
    if t.device.type == "cpu" and storage.resizable():
        storage.resize_(0)


def split_factors(u: torch.Tensor, sigma: torch.Tensor, vh: torch.Tensor, k: int,
                  right: Whitener | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(A [k, n], B [m, k])`` with ``B A = U_k diag(sigma_k) V_k^T L^{-1}``."""
    root = sigma[:k].clamp_min(0).sqrt()
    b = u[:, :k] * root[None, :]
    a = root[:, None] * vh[:k]
    if right is not None:
        a = right.unwhiten(a)
    return a, b

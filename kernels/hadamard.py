"""Hadamard matrices and the fast Walsh–Hadamard transform (used by QuaRot/ReSpinQuant rotations).

* :func:`hadamard_matrix` builds a normalised Hadamard matrix ``H`` (``H Hᵀ = I``) of order
  ``n = m · 2^k`` where ``m`` is 1, a product of the Paley orders 12, 20, 44, or any order a Paley
  construction gives over a prime field (I: q + 1; II: 2(q + 1)): ``H = H_m ⊗ H_{2^k}`` with a Sylvester
  ``H_{2^k}``. This covers 576 = 144·4, 960 = 240·4, 1536 = 12·128, 2560 = 20·128, and the 7B-scale MLP
  widths 14336 = 28·512, 18944 = 148·128, 13824 = 108·128, 11008 = 5504·2 (see :func:`factorize`).
* :func:`hadamard_transform` computes ``x @ H`` along the last dim in O(n log n + n m): a fast
  Walsh–Hadamard transform over the power-of-two factor and a small dense product over ``H_m``.
* :func:`fwht` is the power-of-two transform itself (normalised by 1/sqrt(n)); its triton kernel runs
  one butterfly stage per launch (``out[i] = x[i] ± x[i xor h]``); :func:`fwht_reference` is the
  pure-torch version with the same signature.
"""
from __future__ import annotations

import functools
import math

import torch

from llmtool.kernels._dispatch import use_triton

PALEY_PRIMES = {12: 11, 20: 19, 44: 43}  # Paley construction I: order q + 1 for primes q ≡ 3 (mod 4)


def _is_prime(q: int) -> bool:
    if q < 2:
        return False
    return all(q % d for d in range(2, int(q ** 0.5) + 1))


def _jacobsthal(q: int) -> torch.Tensor:
    """``Q[i, j] = χ(j − i)`` over GF(q), q prime: χ the quadratic character (0 at 0), float64."""
    square = torch.zeros(q, dtype=torch.bool)
    square[(torch.arange(1, q) ** 2) % q] = True
    chi = torch.where(square, 1.0, -1.0).double()
    chi[0] = 0.0
    idx = (torch.arange(q)[None, :] - torch.arange(q)[:, None]) % q
    return chi[idx]


def _paley(q: int) -> torch.Tensor:
    """Unnormalised Hadamard matrix of order q + 1 (Paley I, q prime ≡ 3 mod 4) as float64."""
    n = q + 1
    h = torch.empty(n, n, dtype=torch.float64)
    h[0, :] = 1
    h[1:, 0] = -1
    h[1:, 1:] = _jacobsthal(q) + torch.eye(q, dtype=torch.float64)
    return h


def _paley2(q: int) -> torch.Tensor:
    """Unnormalised Hadamard matrix of order 2(q + 1) (Paley II, q prime ≡ 1 mod 4) as float64: the symmetric
    conference matrix C = [[0, 1ᵀ], [1, Q]] gives H = C ⊗ [[1, 1], [1, −1]] + I ⊗ [[1, −1], [−1, −1]]."""
    c = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    c[0, 1:] = 1
    c[1:, 0] = 1
    c[1:, 1:] = _jacobsthal(q)
    a = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    return torch.kron(c, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def _paley_kind(m: int) -> str | None:
    """'I' or 'II' when a Paley construction gives order ``m`` over a prime field, else None."""
    if m % 4 == 0 and _is_prime(m - 1) and (m - 1) % 4 == 3:
        return "I"
    if m % 4 == 0 and _is_prime(m // 2 - 1) and (m // 2 - 1) % 4 == 1:
        return "II"
    return None


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def _is_pow2(n: int) -> bool:
    return n >= 1 and n & (n - 1) == 0


@functools.lru_cache(maxsize=None)
def factorize(n: int) -> tuple[int, int]:
    """Split ``n`` into (m, p): ``m`` 1, a Paley order or a product of two, ``p`` a power of two.

    Products of the orders 12, 20 and 44 are tried first (the factorizations llmtool has always used, so
    earlier checkpoints keep their rotations); then the smallest m = n / 2^k that a Paley construction over a
    prime field gives (I: q + 1, q ≡ 3 mod 4; II: 2(q + 1), q ≡ 1 mod 4). That covers 14336 = 28·512
    (Llama-3-8B, Mistral-7B), 18944 = 148·128 (Qwen2-7B), 13824 = 108·128 (Llama-2-13B), 3584 = 28·128; Llama-2's
    11008 = 43·256 gets m = 5504 (Paley I, q = 5503), a large dense factor (QuaRot uses a stored order-172
    matrix, which no Paley construction gives)."""
    candidates = [1]
    for a in PALEY_PRIMES:
        candidates.append(a)
        for b in PALEY_PRIMES:
            candidates.append(a * b)
    for m in sorted(set(candidates)):
        if n % m == 0 and _is_pow2(n // m):
            return m, n // m
    m = n
    while m % 2 == 0:
        m //= 2
    while m <= n:
        if _paley_kind(m):
            return m, n // m
        m *= 2
    raise ValueError(f"no Hadamard matrix of order {n} available (need m·2^k with m a Paley order (q + 1 for a "
                     f"prime q ≡ 3 mod 4, 2(q + 1) for a prime q ≡ 1 mod 4) or a product of 12, 20, 44)")


@functools.lru_cache(maxsize=None)
def _small_factor(m: int) -> torch.Tensor:
    """Normalised H_m for the non-power-of-two factor (m = 1, a Paley order, or a product of two)."""
    if m == 1:
        return torch.ones(1, 1, dtype=torch.float64)
    if m in PALEY_PRIMES:
        return _paley(PALEY_PRIMES[m]) / math.sqrt(m)
    for a in PALEY_PRIMES:
        if m % a == 0 and (m // a) in PALEY_PRIMES:
            return torch.kron(_small_factor(a), _small_factor(m // a))
    kind = _paley_kind(m)
    if kind == "I":
        return _paley(m - 1) / math.sqrt(m)
    if kind == "II":
        return _paley2(m // 2 - 1) / math.sqrt(m)
    raise ValueError(f"no Hadamard factor of order {m}")


def hadamard_matrix(n: int, dtype=torch.float64, device=None) -> torch.Tensor:
    """Dense normalised Hadamard matrix of order ``n`` (``H_m ⊗ H_{2^k}``)."""
    m, p = factorize(n)
    h = torch.kron(_small_factor(m), _sylvester(p) / math.sqrt(p))
    return h.to(dtype=dtype, device=device)


def fwht_reference(x: torch.Tensor) -> torch.Tensor:
    """Normalised Walsh–Hadamard transform along the last dim (power-of-two length), pure torch."""
    n = x.shape[-1]
    if not _is_pow2(n):
        raise ValueError(f"fwht needs a power-of-two length, got {n}")
    shape = x.shape
    y = x.reshape(-1, n)
    h = 1
    while h < n:
        y = y.reshape(-1, n // (2 * h), 2, h)
        a, b = y[:, :, 0, :], y[:, :, 1, :]
        y = torch.stack([a + b, a - b], dim=2)
        h *= 2
    return (y.reshape(shape) / math.sqrt(n)).to(x.dtype)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _butterfly_kernel(x_ptr, out_ptr, total, h, scale, BLOCK: tl.constexpr):
        pid = tl.program_id(0)
        offs = pid * BLOCK + tl.arange(0, BLOCK)
        mask = offs < total
        is_high = (offs & h) != 0
        low = tl.where(is_high, offs - h, offs)
        a = tl.load(x_ptr + low, mask=mask, other=0.0)
        b = tl.load(x_ptr + low + h, mask=mask, other=0.0)
        out = tl.where(is_high, a - b, a + b) * scale
        tl.store(out_ptr + offs, out, mask=mask)

    def fwht_triton(x: torch.Tensor) -> torch.Tensor:
        n = x.shape[-1]
        if not _is_pow2(n):
            raise ValueError(f"fwht needs a power-of-two length, got {n}")
        src = x.contiguous().clone()
        dst = torch.empty_like(src)
        total = src.numel()
        block = 1024
        h, stages = 1, int(math.log2(n))
        for s in range(stages):
            # fold the 1/sqrt(n) normalisation into the last stage
            scale = 1.0 / math.sqrt(n) if s == stages - 1 else 1.0
            _butterfly_kernel[(triton.cdiv(total, block),)](src, dst, total, h, scale, BLOCK=block)
            src, dst = dst, src
            h *= 2
        return src
except ImportError:  # pragma: no cover
    fwht_triton = None


def fwht(x: torch.Tensor) -> torch.Tensor:
    """Normalised fast Walsh–Hadamard transform along the last dim (triton on CUDA)."""
    if fwht_triton is not None and use_triton(x):
        return fwht_triton(x)
    return fwht_reference(x)


def hadamard_transform(x: torch.Tensor) -> torch.Tensor:
    """``x @ hadamard_matrix(n)`` along the last dim without forming the n×n matrix.

    With x viewed as X[i_m, i_p] (row-major), ``x (A ⊗ B) = vec(Aᵀ X B)``: FWHT for B, dense Aᵀ for A."""
    n = x.shape[-1]
    m, p = factorize(n)
    y = fwht(x) if m == 1 else fwht(x.reshape(*x.shape[:-1], m, p))
    if m == 1:
        return y
    a = _small_factor(m).to(dtype=x.dtype, device=x.device)
    y = torch.matmul(a.T, y)
    return y.reshape(x.shape)

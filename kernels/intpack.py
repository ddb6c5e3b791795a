"""Packing of unsigned low-bit integer codes into bytes (the on-disk layout of llmtool_quant).

* int4: two codes per byte along the last dim, **low nibble first** (byte = c[2j] | c[2j+1] << 4).
  Read as little-endian int32 words this is the compressed-tensors "pack-quantized" layout
  (8 nibbles per word, lowest first).
* int3: eight codes in three bytes along the last dim: the 24-bit little-endian word
  ``Σ_j c[8g+j] << 3j`` is stored as bytes (w & 255, w >> 8 & 255, w >> 16).

Codes are unsigned (``0 .. 2^b - 1``; symmetric weights store ``q + 2^(b-1)``). The last dim must be
a multiple of 2 (int4) or 8 (int3). Each function has a triton kernel and a torch reference with the
same signature; the dispatchers use triton on CUDA tensors.
"""
from __future__ import annotations

import torch

from llmtool.kernels._dispatch import use_triton


def _check(codes: torch.Tensor, bits: int, multiple: int) -> None:
    if codes.dtype != torch.uint8:
        raise TypeError(f"int{bits} codes must be uint8, got {codes.dtype}")
    if codes.shape[-1] % multiple:
        raise ValueError(f"int{bits} packing needs the last dim to be a multiple of {multiple}, got {codes.shape[-1]}")


def pack_int4_reference(codes: torch.Tensor) -> torch.Tensor:
    _check(codes, 4, 2)
    c = codes.reshape(*codes.shape[:-1], -1, 2)
    return (c[..., 0] & 15) | ((c[..., 1] & 15) << 4)


def unpack_int4_reference(packed: torch.Tensor) -> torch.Tensor:
    low, high = packed & 15, packed >> 4
    return torch.stack([low, high], dim=-1).reshape(*packed.shape[:-1], -1)


def pack_int3_reference(codes: torch.Tensor) -> torch.Tensor:
    _check(codes, 3, 8)
    c = codes.reshape(*codes.shape[:-1], -1, 8).to(torch.int32) & 7
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=codes.device)
    word = (c << shifts).sum(-1)
    out = torch.stack([word & 255, (word >> 8) & 255, (word >> 16) & 255], dim=-1)
    return out.to(torch.uint8).reshape(*codes.shape[:-1], -1)


def unpack_int3_reference(packed: torch.Tensor) -> torch.Tensor:
    b = packed.reshape(*packed.shape[:-1], -1, 3).to(torch.int32)
    word = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16)
    shifts = torch.arange(0, 24, 3, dtype=torch.int32, device=packed.device)
    codes = (word[..., None] >> shifts) & 7
    return codes.to(torch.uint8).reshape(*packed.shape[:-1], -1)


try:
    import triton
    import triton.language as tl

    @triton.jit
    def _pack4_kernel(c_ptr, out_ptr, n_out, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_out
        lo = tl.load(c_ptr + 2 * offs, mask=mask, other=0).to(tl.int32) & 15
        hi = tl.load(c_ptr + 2 * offs + 1, mask=mask, other=0).to(tl.int32) & 15
        tl.store(out_ptr + offs, (lo | (hi << 4)).to(tl.uint8), mask=mask)

    @triton.jit
    def _unpack4_kernel(p_ptr, out_ptr, n_in, BLOCK: tl.constexpr):
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = offs < n_in
        b = tl.load(p_ptr + offs, mask=mask, other=0).to(tl.int32)
        tl.store(out_ptr + 2 * offs, (b & 15).to(tl.uint8), mask=mask)
        tl.store(out_ptr + 2 * offs + 1, ((b >> 4) & 15).to(tl.uint8), mask=mask)

    @triton.jit
    def _pack3_kernel(c_ptr, out_ptr, n_groups, BLOCK: tl.constexpr):
        g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = g < n_groups
        word = tl.zeros([BLOCK], dtype=tl.int32)
        for j in tl.static_range(8):
            c = tl.load(c_ptr + 8 * g + j, mask=mask, other=0).to(tl.int32) & 7
            word = word | (c << (3 * j))
        tl.store(out_ptr + 3 * g, (word & 255).to(tl.uint8), mask=mask)
        tl.store(out_ptr + 3 * g + 1, ((word >> 8) & 255).to(tl.uint8), mask=mask)
        tl.store(out_ptr + 3 * g + 2, ((word >> 16) & 255).to(tl.uint8), mask=mask)

    @triton.jit
    def _unpack3_kernel(p_ptr, out_ptr, n_groups, BLOCK: tl.constexpr):
        g = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        mask = g < n_groups
        b0 = tl.load(p_ptr + 3 * g, mask=mask, other=0).to(tl.int32)
        b1 = tl.load(p_ptr + 3 * g + 1, mask=mask, other=0).to(tl.int32)
        b2 = tl.load(p_ptr + 3 * g + 2, mask=mask, other=0).to(tl.int32)
        word = b0 | (b1 << 8) | (b2 << 16)
        for j in tl.static_range(8):
            tl.store(out_ptr + 8 * g + j, ((word >> (3 * j)) & 7).to(tl.uint8), mask=mask)

    _BLOCK = 256

    def pack_int4_triton(codes: torch.Tensor) -> torch.Tensor:
        _check(codes, 4, 2)
        c = codes.contiguous()
        out = torch.empty(*c.shape[:-1], c.shape[-1] // 2, dtype=torch.uint8, device=c.device)
        n = out.numel()
        _pack4_kernel[(triton.cdiv(n, _BLOCK),)](c, out, n, BLOCK=_BLOCK)
        return out

    def unpack_int4_triton(packed: torch.Tensor) -> torch.Tensor:
        p = packed.contiguous()
        out = torch.empty(*p.shape[:-1], p.shape[-1] * 2, dtype=torch.uint8, device=p.device)
        n = p.numel()
        _unpack4_kernel[(triton.cdiv(n, _BLOCK),)](p, out, n, BLOCK=_BLOCK)
        return out

    def pack_int3_triton(codes: torch.Tensor) -> torch.Tensor:
        _check(codes, 3, 8)
        c = codes.contiguous()
        out = torch.empty(*c.shape[:-1], c.shape[-1] * 3 // 8, dtype=torch.uint8, device=c.device)
        groups = c.numel() // 8
        _pack3_kernel[(triton.cdiv(groups, _BLOCK),)](c, out, groups, BLOCK=_BLOCK)
        return out

    def unpack_int3_triton(packed: torch.Tensor) -> torch.Tensor:
        p = packed.contiguous()
        out = torch.empty(*p.shape[:-1], p.shape[-1] * 8 // 3, dtype=torch.uint8, device=p.device)
        groups = p.numel() // 3
        _unpack3_kernel[(triton.cdiv(groups, _BLOCK),)](p, out, groups, BLOCK=_BLOCK)
        return out
except ImportError:  # pragma: no cover
    pack_int4_triton = unpack_int4_triton = pack_int3_triton = unpack_int3_triton = None


def pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """Pack uint8 codes of ``bits`` ∈ {3, 4} bits (8 bits: stored as is)."""
    if bits == 8:
        return codes.to(torch.uint8)
    if bits == 4:
        return pack_int4_triton(codes) if use_triton(codes) else pack_int4_reference(codes)
    if bits == 3:
        return pack_int3_triton(codes) if use_triton(codes) else pack_int3_reference(codes)
    raise ValueError(f"cannot pack {bits}-bit codes (supported: 3, 4, 8)")


def unpack(packed: torch.Tensor, bits: int) -> torch.Tensor:
    if bits == 8:
        return packed
    if bits == 4:
        return unpack_int4_triton(packed) if use_triton(packed) else unpack_int4_reference(packed)
    if bits == 3:
        return unpack_int3_triton(packed) if use_triton(packed) else unpack_int3_reference(packed)
    raise ValueError(f"cannot unpack {bits}-bit codes (supported: 3, 4, 8)")


def packed_width(n: int, bits: int) -> int:
    """Bytes per row of ``n`` codes."""
    return {8: n, 4: n // 2, 3: n * 3 // 8}[bits]

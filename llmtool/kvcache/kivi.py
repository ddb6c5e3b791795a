"""KIVI-style KV-cache quantization (Liu et al., "KIVI: A Tuning-Free Asymmetric 2bit Quantization for
KV Cache", ICML 2024), the baseline of PatternKV, as a ``transformers`` cache layer.

Quantizer: asymmetric uniform b-bit min/scale per group (``kernels/kv_quant.py``), scale and min in
float16. Axes: **K per-channel** (each channel over a group of ``G`` consecutive tokens), **V per-token**
(each token over groups of ``G_v = min(G, d)`` channels). A recent-token window of up to ``R``
tokens stays in full precision (the model's dtype). Prefill attention uses the exact K/V; the
first ``T - (T mod R)`` prompt tokens are quantized right away, the rest start the window; whenever
the window holds ``R`` tokens it is quantized and appended (whole-window flush, as PatternKV's
implementation; original KIVI slides V one token at a time - a documented deviation).
``R`` must be a multiple of ``G``. ``bits = 16`` stores the (residual) values unquantized, an
exact identity used to test the plumbing.

Attention reads dequantized K/V (the reference "dequantize then attend" path): :meth:`update`
returns the full-length dequantized prefix + window. Memory reported is what the layer holds:
packed codes, scales, mins (and, in subclasses, pattern banks, assignments and masks) + the window.

This class is also the shared residual store of PatternKV: subclasses override
:meth:`_prefill_patterns`, :meth:`_encode_k`, :meth:`_encode_v` and :meth:`_pattern_k` /
:meth:`_pattern_v` (KIVI encodes the raw vectors: no pattern).
"""
from __future__ import annotations

import torch
from transformers.cache_utils import CacheLayerMixin

from llmtool.kernels.kv_quant import dequantize_groups, quantize_groups
from llmtool.core.console import UsageError
from llmtool.kvcache.cache import tensor_bytes

QUANT_BITS = (2, 4, 8, 16)


def check_quant_args(bits: int, group_size: int, residual_length: int) -> None:
    if bits not in QUANT_BITS:
        raise UsageError(f"--bits {bits}: must be one of {', '.join(map(str, QUANT_BITS))}")
    if group_size < 1 or group_size % 4:
        raise UsageError(f"--group-size {group_size}: must be a positive multiple of 4")
    if residual_length < group_size or residual_length % group_size:
        raise UsageError(f"--residual-length {residual_length}: must be a positive multiple of "
                         f"--group-size {group_size}")


def quantize_k(x: torch.Tensor, bits: int, g: int) -> dict:
    """K per-channel: ``x [B, H, T, d]`` with ``T % g == 0`` -> chunk dict."""
    if bits == 16:
        return {"raw": x.clone()}
    b, h, t, d = x.shape
    rows = x.view(b, h, t // g, g, d).transpose(-1, -2).reshape(-1, g)
    packed, scale, mn = quantize_groups(rows, bits)
    return {"codes": packed.view(b, h, t // g, d, -1), "scale": scale.view(b, h, t // g, d),
            "min": mn.view(b, h, t // g, d)}


def dequantize_k(chunk: dict, bits: int, dtype) -> torch.Tensor:
    if "raw" in chunk:
        return chunk["raw"]
    b, h, ng, d, _ = chunk["codes"].shape
    rows = dequantize_groups(chunk["codes"].reshape(b * h * ng * d, -1), chunk["scale"].reshape(-1),
                             chunk["min"].reshape(-1), bits, dtype)
    return rows.view(b, h, ng, d, -1).transpose(-1, -2).reshape(b, h, -1, d)


def quantize_v(x: torch.Tensor, bits: int, g: int) -> dict:
    """V per-token: ``x [B, H, T, d]`` with ``d % g == 0`` -> chunk dict."""
    if bits == 16:
        return {"raw": x.clone()}
    b, h, t, d = x.shape
    packed, scale, mn = quantize_groups(x.reshape(-1, g), bits)
    return {"codes": packed.view(b, h, t, d // g, -1), "scale": scale.view(b, h, t, d // g),
            "min": mn.view(b, h, t, d // g)}


def dequantize_v(chunk: dict, bits: int, dtype) -> torch.Tensor:
    if "raw" in chunk:
        return chunk["raw"]
    b, h, t, ng, _ = chunk["codes"].shape
    rows = dequantize_groups(chunk["codes"].reshape(b * h * t * ng, -1), chunk["scale"].reshape(-1),
                             chunk["min"].reshape(-1), bits, dtype)
    return rows.view(b, h, t, -1)


class KIVILayer(CacheLayerMixin):
    is_sliding = False
    is_compileable = False
    is_croppable = False

    def __init__(self, k_bits: int = 2, v_bits: int = 2, group_size: int = 64, residual_length: int = 64,
                 v_group_size: int | None = None):
        super().__init__()
        check_quant_args(k_bits, group_size, residual_length)
        check_quant_args(v_bits, group_size, residual_length)
        self.k_bits, self.v_bits = k_bits, v_bits
        self.group_size, self.residual_length = group_size, residual_length
        self.v_group_size = v_group_size
        self.k_chunks: list[dict] = []
        self.v_chunks: list[dict] = []
        self.win_k: torch.Tensor | None = None
        self.win_v: torch.Tensor | None = None
        self.seen = 0
        self.flushes = 0
        self.quantized_tokens = 0

    # --- pattern hooks (KIVI: none) -------------------------------------------------------------
    def _prefill_patterns(self, k: torch.Tensor, v: torch.Tensor) -> None:
        return None

    def _encode_k(self, k: torch.Tensor, at_flush: bool) -> tuple[torch.Tensor, dict]:
        return k, {}

    def _encode_v(self, v: torch.Tensor, at_flush: bool) -> tuple[torch.Tensor, dict]:
        return v, {}

    def _pattern_k(self, chunk: dict, dtype) -> torch.Tensor | float:
        return 0.0

    def _pattern_v(self, chunk: dict, dtype) -> torch.Tensor | float:
        return 0.0

    def _grow(self, k_window: torch.Tensor, v_window: torch.Tensor) -> None:
        return None

    # --- CacheLayerMixin ------------------------------------------------------------------------
    def lazy_initialization(self, key_states, value_states) -> None:
        self.dtype, self.device = key_states.dtype, key_states.device
        d = key_states.shape[-1]
        g_v = self.v_group_size or min(self.group_size, d)
        if d % g_v:
            raise UsageError(f"V group size {g_v} does not divide the head dim {d}")
        self.v_group_size = g_v
        self.win_k = key_states[..., :0, :]
        self.win_v = value_states[..., :0, :]
        self.is_initialized = True

    def _store(self, k: torch.Tensor, v: torch.Tensor, at_flush: bool) -> None:
        rk, meta_k = self._encode_k(k, at_flush)
        rv, meta_v = self._encode_v(v, at_flush)
        self.k_chunks.append({**quantize_k(rk.float() if self.k_bits != 16 else rk, self.k_bits, self.group_size),
                              **meta_k})
        self.v_chunks.append({**quantize_v(rv.float() if self.v_bits != 16 else rv, self.v_bits, self.v_group_size),
                              **meta_v})
        self.quantized_tokens += k.shape[-2]

    def update(self, key_states, value_states, *args, **kwargs):
        first = not self.is_initialized
        if first:
            self.lazy_initialization(key_states, value_states)
        self.seen += key_states.shape[-2]
        r = self.residual_length
        if first:
            t = key_states.shape[-2]
            tq = t - t % r
            self._prefill_patterns(key_states, value_states)
            if tq:
                self._store(key_states[..., :tq, :], value_states[..., :tq, :], at_flush=False)
            self.win_k = key_states[..., tq:, :].clone()
            self.win_v = value_states[..., tq:, :].clone()
            return key_states, value_states
        self.win_k = torch.cat([self.win_k, key_states], dim=-2)
        self.win_v = torch.cat([self.win_v, value_states], dim=-2)
        keys, values = self.materialize()
        while self.win_k.shape[-2] >= r:
            wk, wv = self.win_k[..., :r, :], self.win_v[..., :r, :]
            self._grow(wk, wv)
            self._store(wk, wv, at_flush=True)
            self.flushes += 1
            self.win_k, self.win_v = self.win_k[..., r:, :].clone(), self.win_v[..., r:, :].clone()
        return keys, values

    def materialize(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized prefix (+ patterns added back) followed by the full-precision window."""
        ks = [dequantize_k(c, self.k_bits, self.dtype) + self._pattern_k(c, self.dtype) for c in self.k_chunks]
        vs = [dequantize_v(c, self.v_bits, self.dtype) + self._pattern_v(c, self.dtype) for c in self.v_chunks]
        k = torch.cat([*(x.to(self.dtype) for x in ks), self.win_k], dim=-2)
        v = torch.cat([*(x.to(self.dtype) for x in vs), self.win_v], dim=-2)
        return k, v

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.seen + query_length, 0

    def get_seq_length(self) -> int:
        return self.seen

    def get_max_length(self) -> int:
        return -1

    def reset(self) -> None:
        self.__init__(self.k_bits, self.v_bits, self.group_size, self.residual_length)

    def held_tensors(self) -> list[torch.Tensor]:
        out = [self.win_k, self.win_v]
        for c in self.k_chunks + self.v_chunks:
            out.extend(c.values())
        return out

    def held_bytes(self) -> int:
        return tensor_bytes(*self.held_tensors())

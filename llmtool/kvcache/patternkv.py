"""PatternKV (Zhang et al., "PatternKV: Flattening KV Representation Expands Quantization Headroom",
ICML 2026, arXiv 2510.05176): quantize the residual of each cached K/V vector after subtracting
its nearest *pattern*, on top of the KIVI store of ``kivi.py`` (same axes, G, R, window).

Per layer and KV head (keys post-RoPE, as cached):

* **Prefill** (T tokens): k-means (k = ``k_patterns`` = 32, seeded init from k distinct random
  tokens, squared-L2 assignment ``||x||^2 + ||c||^2 - 2 x.c`` clamped at 0, mean update, empty
  clusters re-seeded with random tokens, <= 30 iterations or max centre shift <= 1e-4, fp32) on the
  batch-mean keys; the same for values (``v_patterns``). Banks ``C_K``, ``C_V`` stored in float16.
  Quantized-prefix tokens are assigned to the nearest centre by L2.
* **Residuals**: ``r_t = k_t - C_K[a_t]`` quantized per channel; for V the pattern is subtracted only
  when the gate passes: ``rho = range(v - c) / range(v)`` and
  ``1 - rho^2 >= (2 z / sqrt(5 d)) sqrt(1 + rho^4)`` with ``z = Phi^-1(0.95)``; mask bit ``m_t``.
* **Window flush** (every R decoded tokens): one new pattern per head = the Chebyshev centre of the
  window (per-dimension mid-range pooled over batch and window tokens), appended to the bank
  (append-only, so stored assignments stay valid); window tokens assigned by the range distance
  ``max_j (x - c)_j - min_j (x - c)_j`` over the whole bank; V gate as above.
* **Attention** adds the pattern back exactly: ``k_hat = r_hat + C_K[a]``, ``v_hat = r_hat + m C_V[a]``
  (reference path: dequantize then attend; the only error is the residual's quantization error).

Reconstructed choices: k = min(k_patterns, T) when the prompt is shorter than the bank;
assignments stored as int16 per (batch, head, token) and the gate mask as one bool byte per token
(their real bytes are counted). ``init="zero"`` with ``grow=False`` and ``v_gate=False`` is the
all-zero single-pattern reduction to KIVI (acceptance test).
"""
from __future__ import annotations

import math

import torch

from llmtool.kvcache.kivi import KIVILayer

Z95 = 1.6448536269514722


def kmeans(x: torch.Tensor, k: int, iters: int = 30, tol: float = 1e-4, seed: int = 0) -> torch.Tensor:
    """Batched k-means: ``x [H, T, d]`` -> centres ``[H, k, d]`` (fp32)."""
    h, t, d = x.shape
    x = x.float()
    g = torch.Generator().manual_seed(seed)
    init = torch.stack([torch.randperm(t, generator=g)[:k] for _ in range(h)]).to(x.device)
    centres = x.gather(1, init[..., None].expand(h, k, d)).clone()
    for _ in range(iters):
        assign = l2_assign(x, centres)
        sums = torch.zeros_like(centres).scatter_add_(1, assign[..., None].expand(h, t, d), x)
        counts = torch.zeros(h, k, device=x.device).scatter_add_(1, assign, torch.ones(h, t, device=x.device))
        new = sums / counts.clamp_min(1)[..., None]
        empty = counts == 0
        if empty.any():
            picks = torch.randint(0, t, (h, k), generator=g).to(x.device)
            new = torch.where(empty[..., None], x.gather(1, picks[..., None].expand(h, k, d)), new)
        shift = (new - centres).abs().amax()
        centres = new
        if shift <= tol:
            break
    return centres


def l2_assign(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Nearest centre by squared L2: ``x [..., H, T, d]``, ``centres [H, M, d]`` -> ``[..., H, T]``."""
    x = x.float()
    c = centres.float()
    dist = (x * x).sum(-1, keepdim=True) + (c * c).sum(-1)[..., None, :] - 2 * x @ c.transpose(-1, -2)
    return dist.clamp_min(0).argmin(-1)


def range_assign(x: torch.Tensor, centres: torch.Tensor) -> torch.Tensor:
    """Nearest centre by range distance ``max_j (x-c)_j - min_j (x-c)_j``."""
    diff = x.float()[..., :, None, :] - centres.float()[:, None, :, :]  # [..., H, T, M, d]
    return (diff.amax(-1) - diff.amin(-1)).argmin(-1)


def chebyshev_centre(window: torch.Tensor) -> torch.Tensor:
    """Per-dimension mid-range over batch and tokens: ``[B, H, R, d]`` -> ``[H, d]``."""
    w = window.float()
    return (w.amax(dim=(0, 2)) + w.amin(dim=(0, 2))) / 2


def gate_threshold(rho: torch.Tensor, d: int) -> torch.Tensor:
    return (2 * Z95 / math.sqrt(5 * d)) * torch.sqrt(1 + rho ** 4)


def v_gate(v: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Mask (bool) of tokens whose pattern shrinks the per-token range enough."""
    rng = lambda u: u.amax(-1) - u.amin(-1)  # noqa: E731
    rho = rng(v.float() - c.float()) / rng(v.float()).clamp_min(1e-8)
    return (1 - rho ** 2) >= gate_threshold(rho, v.shape[-1])


def gather_patterns(bank: torch.Tensor, assign: torch.Tensor) -> torch.Tensor:
    """``bank [H, M, d]``, ``assign [B, H, T]`` -> ``[B, H, T, d]``."""
    b, h, t = assign.shape
    idx = assign.long().permute(1, 0, 2).reshape(h, b * t)
    out = bank.gather(1, idx[..., None].expand(h, b * t, bank.shape[-1]))
    return out.view(h, b, t, -1).permute(1, 0, 2, 3)


class PatternKVLayer(KIVILayer):
    def __init__(self, k_bits: int = 2, v_bits: int = 2, group_size: int = 64, residual_length: int = 64,
                 k_patterns: int = 32, v_patterns: int = 32, kmeans_iters: int = 30, seed: int = 0,
                 v_gate: bool = True, grow: bool = True, init: str = "kmeans", v_group_size: int | None = None):
        super().__init__(k_bits, v_bits, group_size, residual_length, v_group_size)
        self.k_patterns, self.v_patterns = k_patterns, v_patterns
        self.kmeans_iters, self.seed = kmeans_iters, seed
        self.use_gate, self.grow, self.init = v_gate, grow, init
        self.bank_k: torch.Tensor | None = None
        self.bank_v: torch.Tensor | None = None

    def _prefill_patterns(self, k, v):
        h, d = k.shape[1], k.shape[-1]
        if self.init == "zero":
            self.bank_k = torch.zeros(h, 1, d, dtype=torch.float16, device=k.device)
            self.bank_v = torch.zeros(h, 1, d, dtype=torch.float16, device=k.device)
            return
        t = k.shape[-2]
        self.bank_k = kmeans(k.mean(0), min(self.k_patterns, t), self.kmeans_iters, seed=self.seed).half()
        self.bank_v = kmeans(v.mean(0), min(self.v_patterns, t), self.kmeans_iters, seed=self.seed + 1).half()

    def _grow(self, k_window, v_window):
        if self.grow:
            self.bank_k = torch.cat([self.bank_k, chebyshev_centre(k_window).half()[:, None]], dim=1)
            self.bank_v = torch.cat([self.bank_v, chebyshev_centre(v_window).half()[:, None]], dim=1)

    def _assign(self, x, bank, at_flush):
        return (range_assign(x, bank) if at_flush else l2_assign(x, bank)).to(torch.int16)

    def _encode_k(self, k, at_flush):
        a = self._assign(k, self.bank_k, at_flush)
        return k.float() - gather_patterns(self.bank_k, a).float(), {"assign": a}

    def _encode_v(self, v, at_flush):
        a = self._assign(v, self.bank_v, at_flush)
        c = gather_patterns(self.bank_v, a).float()
        mask = v_gate(v, c) if self.use_gate else torch.ones(a.shape, dtype=torch.bool, device=v.device)
        return v.float() - mask[..., None] * c, {"assign": a, "mask": mask}

    def _pattern_k(self, chunk, dtype):
        return gather_patterns(self.bank_k, chunk["assign"]).to(dtype)

    def _pattern_v(self, chunk, dtype):
        return (gather_patterns(self.bank_v, chunk["assign"]) * chunk["mask"][..., None]).to(dtype)

    def bank_size(self) -> int:
        return 0 if self.bank_k is None else self.bank_k.shape[1]

    def held_tensors(self):
        return super().held_tensors() + [self.bank_k, self.bank_v]

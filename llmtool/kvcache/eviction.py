"""Prefill-time KV eviction, kvpress style: a *press* is a small object with a ``score`` (per
(head, entry) importance), a budget allocation (per layer and per head), and a ``select`` step
(top-b by score, or CriticalKV's two-stage rule). :meth:`Press.apply` registers a forward hook on
every attention module; when armed, the hook compresses that layer's cache right after the
prefill forward, and decoding continues on the reduced cache.

Budget convention: ``budget`` is the fraction of the context's entries **kept** per KV head
(kvpress' ``compression_ratio = 1 - budget``); ``b = floor(budget * n)`` with the observation
window always kept (reconstructed choice: ``b`` is raised to ``min(w, n)`` when smaller, so the
window is never evicted). ``budget = 1`` is an exact no-op (nothing is touched).

Sliding-window layers (Gemma 2/3 local layers, Mistral-style ``sliding_window`` configs;
``core.arch.attention_kinds``): a sliding layer only ever reads the last W entries, and transformers
masks it by absolute position; a compacted layer's mask is rebuilt here (old entries all visible), which
would let a sliding layer read entries older than its window. So eviction is applied to the
full-attention layers only and sliding layers keep their cache and transformers' sliding mask (exact;
the budget fraction then describes the full layers, and the memory report counts the sliding layers'
entries whole). A model whose every layer slides is refused by name (nothing would be evicted).

Realising budgets (spec 3.5): uniform per-layer budgets are gathered physically (real memory
saving); head-varying budgets (AdaKV) are gathered to the longest head of the layer and the
padding slots masked with ``-inf`` by the ``kvcache`` attention transform (exact; the padding is
counted in the memory report).
"""
from __future__ import annotations

import abc

import math
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from llmtool.core.console import UsageError
from llmtool.core.registry import Registry
from llmtool.kvcache.cache import EvictableLayer, KVCache, attention_modules

PRESSES = Registry("kvcache", what="eviction method")


def check_budget(budget: float) -> float:
    if not (isinstance(budget, (int, float)) and 0.0 < float(budget) <= 1.0) or math.isnan(budget):
        raise UsageError(f"--budget {budget}: must be a fraction of the cache to keep, in (0, 1]")
    return float(budget)


def uniform_budget(n: int, budget: float, window: int) -> int:
    return min(n, max(int(math.floor(budget * n + 1e-9)), min(window, n)))


def topk_mask(scores: torch.Tensor, k: torch.Tensor | int) -> torch.Tensor:
    """Bool mask of the top-``k`` entries along the last axis; ``k`` may vary per row
    (tensor broadcastable to ``scores.shape[:-1]``). Ties broken by position (stable sort)."""
    order = torch.sort(scores, dim=-1, descending=True, stable=True).indices
    rank = torch.empty_like(order)
    rank.scatter_(-1, order, torch.arange(scores.shape[-1], device=scores.device).expand_as(order))
    if not torch.is_tensor(k):
        k = torch.tensor(k, device=scores.device)
    return rank < k[..., None]


def keep_from_mask(layer: EvictableLayer, keep: torch.Tensor) -> None:
    """Compact ``layer`` to the True entries of ``keep`` ([B, H_kv, n] over the whole prefix)."""
    counts = keep.sum(-1)
    longest = int(counts.max())
    n = keep.shape[-1]
    pos = torch.arange(n, device=keep.device).expand_as(keep)
    # kept positions first (ascending), then the rest; take the first `longest`
    sort_key = torch.where(keep, pos, pos + n)
    index = sort_key.sort(dim=-1).values[..., :longest]
    valid = index < n
    index = torch.where(valid, index, torch.zeros_like(index))
    layer.keep(index, valid)


def mask_from_keep(layer: EvictableLayer, keep: torch.Tensor) -> None:
    """Masking realisation (spec 3.5 reference): keep every tensor, put ``-inf`` on the evicted
    (head, position) logits for every later step. No memory saving; used to test gathering."""
    layer.bias = torch.zeros(keep.shape, dtype=torch.float32, device=keep.device).masked_fill_(~keep, float("-inf"))
    layer.compressed = True


@dataclass
class Press(abc.ABC):
    """Base class. Subclasses implement :meth:`score` (``[B, H_kv, n]``, higher = keep) and may
    override :meth:`layer_budgets` (per-head budgets ``[B, H_kv]``) and :meth:`select`."""

    budget: float = 1.0
    window_size: int = 32
    realise: str = "gather"  # gather (real memory saving) | mask (reference, keeps all tensors)
    armed: bool = field(default=False, repr=False)
    stats: list = field(default_factory=list, repr=False)

    def __post_init__(self):
        check_budget(self.budget)
        if self.window_size < 1:
            raise UsageError(f"--window-size {self.window_size}: must be >= 1")

    # --- interface -------------------------------------------------------------------------
    @abc.abstractmethod
    def score(self, module, hidden_states, keys, values, position_embeddings) -> torch.Tensor:
        """Importance of every cached entry, [batch, kv_heads, seq]."""

    def layer_budgets(self, module, scores: torch.Tensor, n: int) -> torch.Tensor:
        b = uniform_budget(n, self.budget, self.window_size)
        return torch.full(scores.shape[:2], b, dtype=torch.long, device=scores.device)

    def select(self, module, scores, keys, values, budgets) -> torch.Tensor:
        return topk_mask(scores, budgets)

    # --- mechanism -------------------------------------------------------------------------
    def compress(self, module, hidden_states, layer: EvictableLayer, position_embeddings) -> None:
        keys, values = layer.keys, layer.values
        n = keys.shape[-2]
        if self.budget >= 1.0 or n <= self.window_size:
            return
        from llmtool.core.arch import is_sliding

        if is_sliding(module):   # a sliding-window layer (module docstring): not evicted
            return
        scores = self.score(module, hidden_states, keys, values, position_embeddings).float()
        budgets = self.layer_budgets(module, scores, n)
        if bool((budgets >= n).all()):
            return
        window = min(self.window_size, n)
        scores[..., n - window:] = float("inf")  # the observation window is never evicted
        keep = self.select(module, scores, keys, values, budgets)
        self.stats.append({"layer": module.layer_idx, "n": n, "kept": int(keep.sum()),
                           "heads": keep.shape[0] * keep.shape[1]})
        (mask_from_keep if self.realise == "mask" else keep_from_mask)(layer, keep)

    def _hook(self, module, args, kwargs, output):
        if not self.armed:
            return
        cache = kwargs.get("cache", kwargs.get("past_key_values"))
        hidden = kwargs.get("hidden_states", args[0] if args else None)
        if not isinstance(cache, KVCache) or hidden is None or hidden.shape[1] < 2:
            return
        layer = cache.layers[module.layer_idx]
        if isinstance(layer, EvictableLayer) and not layer.compressed:
            with torch.no_grad():
                self.compress(module, hidden, layer, kwargs["position_embeddings"])

    @contextmanager
    def apply(self, model):
        """Register the compression hook on every attention module (armed by the pipeline for the
        prefill of the context only)."""
        mods = attention_modules(model)
        from llmtool.core import arch

        if mods and self.budget < 1.0 and all(arch.is_sliding(m) for m in mods):
            arch.refuse(f"kvcache eviction ({type(self).__name__})", arch.arch_of(model).family, arch.P_SLIDING,
                        "every layer is sliding-window, and sliding layers are not evicted (their window already "
                        "bounds what they read)")
        handles = [m.register_forward_hook(self._hook, with_kwargs=True) for m in mods]
        try:
            yield self
        finally:
            for h in handles:
                h.remove()


def window_queries(module, hidden_states, position_embeddings, window: int) -> torch.Tensor:
    """Post-RoPE queries of the last ``window`` positions: ``[B, H_q, w, d]``."""
    from llmtool.core.attention import apply_rope, projection

    b, t, _ = hidden_states.shape
    d = module.head_dim
    h = hidden_states[:, -window:]
    q = projection(module, "q")(h).view(b, h.shape[1], -1, d).transpose(1, 2)
    if hasattr(module, "q_norm"):  # Qwen3 / Gemma 3 per-head query norm (arch: q/k norms)
        q = module.q_norm(q)
    cos, sin = position_embeddings
    cos, sin = cos[:, -window:].unsqueeze(1), sin[:, -window:].unsqueeze(1)
    return apply_rope(q, cos, sin)


def window_attention(module, hidden_states, keys, position_embeddings, window: int) -> torch.Tensor:
    """Softmax attention (fp32) of the last ``window`` queries over all ``n`` keys, causal inside the
    window: ``[B, H_q, w, n]``."""
    q = window_queries(module, hidden_states, position_embeddings, window).float()
    h_q, h_kv = q.shape[1], keys.shape[1]
    k = keys.float().repeat_interleave(h_q // h_kv, dim=1)
    # the module's own score scale (Gemma: query_pre_attn_scalar**-0.5) and soft-cap (Gemma 2), as its forward
    logits = (q @ k.transpose(-1, -2)) * getattr(module, "scaling", 1.0 / math.sqrt(module.head_dim))
    cap = getattr(module, "attn_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    n = keys.shape[-2]
    causal = torch.ones(window, window, dtype=torch.bool, device=q.device).triu(1)
    logits[..., n - window:] = logits[..., n - window:].masked_fill(causal, float("-inf"))
    return torch.softmax(logits, dim=-1)

"""The one mechanism every KV method of ``llmtool kvcache`` plugs into.

* :class:`KVCache` is a ``transformers.Cache`` whose layers are llmtool layer objects
  (:class:`EvictableLayer` for eviction presses, the quantized layers of ``kivi.py`` /
  ``patternkv.py``). Each layer reports the bytes of the tensors it really holds
  (:meth:`held_bytes`), which is what ``memory`` numbers in reports are.
* :func:`attach` installs, for the duration of a ``with`` block, (1) a forward pre-hook on every
  attention module that tells the module which cache layer it reads and (2) the ``kvcache``
  transform of the shared attention function (:mod:`llmtool.core.attention`), so it composes with
  other transforms (a quantized checkpoint's KV quantization stays on). The transform leaves
  attention alone, except for layers that were compacted (eviction): there it builds the mask from
  the layer's own physical length and adds the ``-inf`` bias on evicted (head, slot) pairs of
  head-varying budgets (AdaKV), which is exact (spec "masking is the reference").

Positions: after eviction the cache holds fewer entries than tokens seen. ``get_seq_length`` returns
the number of tokens *seen* (so transformers derives the right RoPE positions for new tokens), while
the attention function masks with the physical length.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

ATTN_NAME = "kvcache"  # the transform's name in core.attention


def tensor_bytes(*tensors) -> int:
    """Bytes of the storage of the given tensors (None and empty ignored)."""
    return sum(t.numel() * t.element_size() for t in tensors if t is not None)


class EvictableLayer(DynamicLayer):
    """A full-precision layer whose prefix can be compacted to kept entries.

    ``keys``/``values`` are ``[B, H_kv, L, d]``; ``bias`` is ``None`` (every slot valid) or a
    ``[B, H_kv, L]`` additive bias with ``-inf`` on padding slots of heads that keep fewer entries
    than the longest head of the layer (head-varying budgets)."""

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.seen = 0
        self.bias: torch.Tensor | None = None
        self.compressed = False

    def update(self, key_states, value_states, *args, **kwargs):
        self.seen += key_states.shape[-2]
        keys, values = super().update(key_states, value_states)
        if self.bias is not None:
            pad = self.bias.new_zeros(*self.bias.shape[:2], key_states.shape[-2])
            self.bias = torch.cat([self.bias, pad], dim=-1)
        return keys, values

    def get_seq_length(self) -> int:
        return self.seen

    def physical_length(self) -> int:
        return 0 if self.keys is None or self.keys.numel() == 0 else self.keys.shape[-2]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.physical_length() + query_length, 0

    def keep(self, index: torch.Tensor, valid: torch.Tensor | None = None) -> None:
        """Replace the cache by the entries ``index`` ([B, H_kv, L'] positions, ascending per head).
        ``valid`` ([B, H_kv, L'] bool) marks real entries; False slots are padding (masked)."""
        gather = index[..., None].expand(*index.shape, self.keys.shape[-1])
        self.keys = self.keys.gather(2, gather).contiguous()
        self.values = self.values.gather(2, gather).contiguous()
        if valid is None or bool(valid.all()):
            self.bias = None
        else:
            self.bias = torch.zeros(valid.shape, dtype=torch.float32, device=valid.device)
            self.bias.masked_fill_(~valid, float("-inf"))
        self.compressed = True

    def held_bytes(self) -> int:
        return tensor_bytes(self.keys, self.values, self.bias)

    def kept_entries(self) -> int:
        """Number of valid (head, position) entries held."""
        if self.keys is None:
            return 0
        b, h, n, _ = self.keys.shape
        if self.bias is None:
            return b * h * n
        return int(torch.isfinite(self.bias).sum())


class KVCache(Cache):
    """A ``transformers.Cache`` over llmtool layers (one per decoder layer, created up front)."""

    def __init__(self, layers: list):
        super().__init__(layers=layers)

    @classmethod
    def full(cls, num_layers: int) -> "KVCache":
        return cls([EvictableLayer() for _ in range(num_layers)])

    def held_bytes(self) -> int:
        return sum(layer.held_bytes() for layer in self.layers)


def num_layers_of(model) -> int:
    return model.config.get_text_config(decoder=True).num_hidden_layers


def attention_modules(model) -> list:
    """Attention modules of the decoder layers, in layer order (architecture from ``core.arch``)."""
    from llmtool.core.attention import attention_modules as modules

    return modules(model)


def kv_mask_transform(module, query, key, value, attention_mask, **kwargs):
    """The kvcache transform of the shared attention function (``core.attention``).

    Untouched layers keep transformers' mask. A compacted layer's physical length differs from other
    layers' (and from the tokens seen), so its mask is built here: old entries visible (minus per-head
    padding), causal among the new ones."""
    cache = getattr(module, "_llmtool_cache", None)
    layer = cache.layers[module.layer_idx] if isinstance(cache, KVCache) else None
    if not isinstance(layer, EvictableLayer) or not layer.compressed:
        return query, key, value, attention_mask
    b, hq, q_len, d = query.shape
    h_kv, total = key.shape[1], key.shape[2]
    past = total - q_len
    mask = torch.zeros(b, h_kv, q_len, total, dtype=torch.float32, device=query.device)
    if layer.bias is not None:
        mask[..., :past] += layer.bias[:, :, None, :past]
    if q_len > 1:
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
        mask[..., past:] = mask[..., past:].masked_fill(causal, float("-inf"))
    mask = mask.repeat_interleave(hq // h_kv, dim=1).to(query.dtype)
    return query, key, value, mask


@contextmanager
def attach(model):
    """Add the kvcache transform to the model's attention (``core.attention``, composing with any other
    transform, e.g. a quantized checkpoint's KV quantization) and let each attention module see its
    cache layer; restores the model on exit."""
    from llmtool.core.attention import transform

    modules = attention_modules(model)

    def pre_hook(module, args, kwargs):
        module._llmtool_cache = kwargs.get("cache", kwargs.get("past_key_values"))

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
    try:
        with transform(model, ATTN_NAME, kv_mask_transform, modules, order=10):
            yield model
    finally:
        for h in handles:
            h.remove()
        for m in modules:
            m.__dict__.pop("_llmtool_cache", None)

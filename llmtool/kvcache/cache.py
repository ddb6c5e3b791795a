"""The one mechanism every KV method of ``llmtool kvcache`` plugs into.

* :class:`KVCache` is a ``transformers.Cache`` whose layers are llmtool layer objects
  (:class:`EvictableLayer` for eviction presses, the quantized layers of ``kivi.py`` /
  ``patternkv.py``). Each layer reports the bytes of the tensors it really holds
  (:meth:`held_bytes`), which is what ``memory`` numbers in reports are.
* :func:`attach` installs, for the duration of a ``with`` block, (1) a forward pre-hook on every
  attention module that tells the module which cache layer it reads and (2) the attention function
  ``llmtool_kv`` (registered in transformers' ``AttentionInterface``). That function is plain SDPA,
  except for layers whose kept entries differ per head (AdaKV budgets): there it adds an additive
  ``-inf`` bias on the evicted (head, slot) pairs and builds the causal mask from the layer's own
  physical length, which is exact (spec "masking is the reference").

Positions: after eviction the cache holds fewer entries than tokens seen. ``get_seq_length`` returns
the number of tokens *seen* (so transformers derives the right RoPE positions for new tokens), while
the attention function masks with the physical length.
"""
from __future__ import annotations

from contextlib import contextmanager

import torch
from transformers.cache_utils import Cache, DynamicLayer

ATTN_NAME = "llmtool_kv"


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
    """Attention modules (any module with ``layer_idx`` and q/k/v/o projections), in layer order."""
    found = [m for m in model.modules()
             if hasattr(m, "layer_idx") and all(hasattr(m, p) for p in ("q_proj", "k_proj", "v_proj", "o_proj"))]
    if not found:
        from llmtool.core.console import UsageError

        raise UsageError(f"unsupported architecture {type(model).__name__}: no attention modules with "
                         "q_proj/k_proj/v_proj/o_proj found")
    return sorted(found, key=lambda m: m.layer_idx)


def _kv_attention(module, query, key, value, attention_mask, dropout=0.0, scaling=None, **kwargs):
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    cache = getattr(module, "_llmtool_cache", None)
    layer = cache.layers[module.layer_idx] if isinstance(cache, KVCache) else None
    if not isinstance(layer, EvictableLayer) or not layer.compressed:
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                      scaling=scaling, **kwargs)
    # A compacted layer: its physical length differs from other layers' (and from the tokens seen),
    # so the mask is built here: old entries visible (minus per-head padding), causal among new ones.
    b, hq, q_len, d = query.shape
    h_kv, total = key.shape[1], key.shape[2]
    groups = hq // h_kv
    past = total - q_len
    mask = torch.zeros(b, h_kv, q_len, total, dtype=torch.float32, device=query.device)
    if layer.bias is not None:
        mask[..., :past] += layer.bias[:, :, None, :past]
    if q_len > 1:
        causal = torch.ones(q_len, q_len, dtype=torch.bool, device=query.device).triu(1)
        mask[..., past:] = mask[..., past:].masked_fill(causal, float("-inf"))
    mask = mask.repeat_interleave(groups, dim=1).to(query.dtype)
    out = torch.nn.functional.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scaling,
                                                           enable_gqa=groups > 1)
    return out.transpose(1, 2).contiguous(), None


def _register() -> None:
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    AttentionInterface.register(ATTN_NAME, _kv_attention)
    AttentionMaskInterface.register(ATTN_NAME, sdpa_mask)


_register()


@contextmanager
def attach(model):
    """Route ``model``'s attention through ``llmtool_kv`` and let each attention module see its
    cache layer; restores the model on exit."""
    modules = attention_modules(model)

    def pre_hook(module, args, kwargs):
        module._llmtool_cache = kwargs.get("cache", kwargs.get("past_key_values"))

    handles = [m.register_forward_pre_hook(pre_hook, with_kwargs=True) for m in modules]
    configs = {id(m.config): m.config for m in modules if hasattr(m, "config")}
    configs[id(model.config)] = model.config
    saved = {k: c._attn_implementation for k, c in configs.items()}
    for c in configs.values():
        c._attn_implementation = ATTN_NAME
    try:
        yield model
    finally:
        for h in handles:
            h.remove()
        for k, c in configs.items():
            c._attn_implementation = saved[k]
        for m in modules:
            m.__dict__.pop("_llmtool_cache", None)

"""One registered attention function to which areas *add* per-layer transforms.

transformers dispatches every attention module through ``config._attn_implementation`` (one name in
its ``AttentionInterface``). When two areas each register their own function and claim that single
slot, the last one wins and the other's effect silently disappears (a checkpoint quantized with KV
quantization, measured under a KV-cache method, ran without its KV quantization). Here there is one
function per base implementation (``llmtool_sdpa``, ``llmtool_eager``, ...): it runs the transforms
that areas attached to the attention module, in order, then the model's original implementation.

A transform is a callable::

    fn(module, query, key, value, attention_mask, **kwargs) -> (query, key, value, attention_mask)

(``query`` ``[B, H_q, q, d]``, ``key``/``value`` ``[B, H_kv, k, d]`` after RoPE and after the cache
update; ``attention_mask`` what transformers built for the base implementation, or ``None``). It may
change the tensors (KV quantization, an online rotation) or replace the mask (eviction masks built
from a compacted cache layer's own length, per-head ``-inf`` biases); a mask it returns is additive
float or boolean ``[B, 1 or H_q, q, k]`` and is passed to the base function as is.

API::

    add_transform(model, "kv-quant", fn, modules=None, order=0)   # modules: default every layer's attention
    remove_transform(model, "kv-quant")
    with transform(model, "kvcache", fn, order=10): ...           # added for the block only
    attention_modules(model)                                      # one per decoder layer (core.arch)
    apply_rope(x, cos, sin)                                       # rotate-half RoPE (Llama family)

Transforms run in ascending ``order`` (ties: the order they were added). The base implementation is
what the model used when the first transform was added (``sdpa`` unless loaded otherwise); when the
last transform is removed the model is switched back to it. Nothing here is saved with a checkpoint
(``_attn_implementation`` is not serialised; transforms are attributes of the modules).
"""
from __future__ import annotations

import sys
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

PREFIX = "llmtool_"
_TRANSFORMS = "_llmtool_attn_transforms"   # module attribute: {name: (order, seq, fn)}
_BASE = "_llmtool_attn_base"               # module attribute: base implementation name
_SEQ = [0]


def attention_modules(model) -> list[torch.nn.Module]:
    """The attention module of every decoder layer, in layer order (architecture from core.arch)."""
    from llmtool.core import arch

    spec = arch.arch_of(model, "attention")
    return [arch.attention(layer, spec) for layer in arch.decoder_layers(model)]


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate-half rotary embedding of ``x`` ``[..., d]`` with ``cos``/``sin`` broadcastable to it."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def _base_function(module, base: str) -> Callable:
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    if base == "eager" or base not in ALL_ATTENTION_FUNCTIONS:
        eager = getattr(sys.modules.get(type(module).__module__), "eager_attention_forward", None)
        if eager is None:
            raise RuntimeError(f"{type(module).__name__}: no eager attention function in {type(module).__module__}")
        return eager
    return ALL_ATTENTION_FUNCTIONS[base]


def _attention(module, query, key, value, attention_mask, *args, **kwargs):
    for _, _, fn in sorted(getattr(module, _TRANSFORMS, {}).values(), key=lambda t: t[:2]):
        query, key, value, attention_mask = fn(module, query, key, value, attention_mask, **kwargs)
    return _base_function(module, getattr(module, _BASE, "sdpa"))(module, query, key, value, attention_mask,
                                                                     *args, **kwargs)


def implementation_name(base: str) -> str:
    """The registered name that runs transforms on top of ``base`` (registering it on first use)."""
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface, sdpa_mask
    from transformers.modeling_utils import AttentionInterface

    name = PREFIX + base
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _attention)
        mask = ALL_MASK_ATTENTION_FUNCTIONS._global_mapping.get(base, sdpa_mask)
        AttentionMaskInterface.register(name, mask)
    return name


def _configs(model, modules) -> list:
    found = {id(model.config): model.config}
    for m in modules:
        cfg = getattr(m, "config", None)
        if cfg is not None:
            found.setdefault(id(cfg), cfg)
    return list(found.values())


def _current(model) -> str:
    return getattr(model.config, "_attn_implementation", None) or "eager"


def add_transform(model, name: str, fn: Callable, modules: Iterable | None = None, order: int = 0) -> None:
    """Attach ``fn`` under ``name`` to ``modules`` (default: every layer's attention) and route the model's
    attention through the llmtool function. Adding a name again replaces its function."""
    modules = list(attention_modules(model) if modules is None else modules)
    current = _current(model)
    base = current[len(PREFIX):] if current.startswith(PREFIX) else current
    impl = implementation_name(base)
    _SEQ[0] += 1
    for m in attention_modules(model):
        setattr(m, _BASE, base)
    for m in modules:
        table = m.__dict__.setdefault(_TRANSFORMS, {})
        table[name] = (order, _SEQ[0], fn)
    for cfg in _configs(model, modules):
        cfg._attn_implementation = impl


def remove_transform(model, name: str) -> None:
    """Detach ``name`` from every attention module; the base implementation is restored when no
    transform is left."""
    mods = attention_modules(model)
    for m in mods:
        table = m.__dict__.get(_TRANSFORMS)
        if table is not None:
            table.pop(name, None)
            if not table:
                del m.__dict__[_TRANSFORMS]
    if not any(_TRANSFORMS in m.__dict__ for m in mods):
        current = _current(model)
        if current.startswith(PREFIX):
            for cfg in _configs(model, mods):
                cfg._attn_implementation = current[len(PREFIX):]


def transforms(module) -> list[str]:
    """Names of the transforms attached to one attention module, in the order they run."""
    table = getattr(module, _TRANSFORMS, {})
    return [k for k, _ in sorted(table.items(), key=lambda kv: kv[1][:2])]


@contextmanager
def transform(model, name: str, fn: Callable, modules: Iterable | None = None, order: int = 0):
    """:func:`add_transform` for the duration of a ``with`` block (a transform already attached
    under ``name`` is put back afterwards)."""
    mods = list(attention_modules(model) if modules is None else modules)
    saved = {id(m): getattr(m, _TRANSFORMS, {}).get(name) for m in mods}
    add_transform(model, name, fn, mods, order)
    try:
        yield model
    finally:
        remove_transform(model, name)
        for m in mods:
            if saved[id(m)] is not None:
                m.__dict__.setdefault(_TRANSFORMS, {})[name] = saved[id(m)]
        if any(saved.values()):
            cur = _current(model)
            base = cur[len(PREFIX):] if cur.startswith(PREFIX) else cur
            for cfg in _configs(model, mods):
                cfg._attn_implementation = implementation_name(base)


def projection(module, role: str):
    """The ``q``/``k``/``v``/``o`` projection of one attention module (names from core.arch; a role of a
    fused ``qkv_proj`` is a callable view of its rows)."""
    from llmtool.core import arch

    return arch.attention_role(module, role)

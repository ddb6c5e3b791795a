"""Hook plumbing shared by the editing methods: read or change a decoder layer's residual-stream
output at chosen token positions, and read the ``mlp.down_proj`` input (the MEMIT key).

Decoder layers return a tensor in recent transformers and a tuple ``(hidden, ...)`` in older
ones; ``core.hooks.hidden_of`` / ``with_hidden`` handle both. Positions are given per batch row
as a 1-D LongTensor (``positions[b]`` = token index in row b), so nothing assumes a layout beyond
``hidden[b, t, :]``.
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Iterator

import torch

from llmtool.core.arch import decoder_layers, linear
from llmtool.core.hooks import hidden_of, with_hidden


def down_proj(model, layer: int) -> torch.nn.Linear:
    """The MLP down projection of decoder ``layer`` (refused, by layout property, where the edit methods
    cannot write it: an MoE layer's per-expert tensors)."""
    from llmtool.core import arch

    block = decoder_layers(model)[layer]
    if arch.is_moe_layer(block):
        spec = arch.arch_of_layer(block)
        arch.refuse("edit (MEMIT/AlphaEdit)", spec.family, arch.P_EXPERTS,
                    f"layer {layer}'s down projection is one of {arch.n_experts(block)} routed experts, chosen "
                    "per token; the single key -> value least-squares edit has no one matrix to write")
    return linear(block, "down")


@contextmanager
def edit_layer_output(model, layer: int, fn: Callable[[torch.Tensor], torch.Tensor]) -> Iterator[None]:
    """Replace decoder layer ``layer``'s hidden output by ``fn(hidden)`` (fn must not write in place)."""
    handle = decoder_layers(model)[layer].register_forward_hook(
        lambda m, i, o: with_hidden(o, fn(hidden_of(o))))
    try:
        yield
    finally:
        handle.remove()


def scatter_at(hidden: torch.Tensor, positions: torch.Tensor, values: torch.Tensor, add: bool) -> torch.Tensor:
    """``hidden`` with row b, token positions[b] set to (or increased by) values[b] (out of place)."""
    rows = torch.arange(hidden.shape[0], device=hidden.device)
    mask = torch.zeros(hidden.shape[:2], dtype=hidden.dtype, device=hidden.device)
    mask[rows, positions] = 1.0
    full = torch.zeros_like(hidden)
    full = full.index_put((rows, positions), values.to(hidden.dtype))
    if add:
        return hidden + full
    return hidden * (1 - mask[..., None]) + full


@torch.no_grad()
def capture_at(model, batch: dict, positions: torch.Tensor, layers: list[int], what: str) -> dict[int, torch.Tensor]:
    """For each layer, the vector at ``positions`` of either the layer output (``what='out'``,
    d_model), the down_proj input (``what='key'``, d_ff) or the down_proj output (``what='value'``,
    d_model; differs from the MLP's contribution when the family has a post-feedforward norm);
    returns {layer: [batch, dim]}."""
    got: dict[int, torch.Tensor] = {}
    rows = torch.arange(positions.shape[0])
    handles = []
    for l in layers:
        if what == "out":
            h = decoder_layers(model)[l].register_forward_hook(
                lambda m, i, o, l=l: got.__setitem__(l, hidden_of(o)[rows, positions].detach()))
        elif what == "value":
            h = down_proj(model, l).register_forward_hook(
                lambda m, i, o, l=l: got.__setitem__(l, o[rows, positions].detach()))
        else:
            h = down_proj(model, l).register_forward_hook(
                lambda m, i, o, l=l: got.__setitem__(l, i[0][rows, positions].detach()))
        handles.append(h)
    try:
        model(**batch)
    finally:
        for h in handles:
            h.remove()
    return got

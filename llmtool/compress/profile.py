"""Calibration statistics for SVD-family compression, gathered layer by layer, and loss gradients.

Target modules (spec zs-svd §2): ``q_proj k_proj v_proj o_proj gate_proj up_proj down_proj`` of
every decoder layer. Modules that read the same input share one set of statistics (official
default): q/k/v read the attention-norm output, gate/up the MLP-norm output.

:func:`layer_statistics` runs the calibration batch through the model one decoder layer at a time:
the inputs of layer 0 are caught once, then each layer is applied to the stored hidden states
while forward hooks on its target modules accumulate ``X^T X`` (float64) and ``sum |x|``. Only one
layer's activations ``[samples, seqlen, hidden]`` and one layer's statistics are alive at a time;
the generator yields each layer's statistics before moving on, so the caller can factorise it.

:func:`loss_gradients` does one forward/backward pass of the whole model per gradient sequence
(mean next-token cross-entropy) and returns ``dL/dW`` of every target weight, averaged over
sequences, on CPU (float32; float64 when the model is float64).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterator

import torch

from llmtool.core.console import UsageError, progress
from llmtool.core.hooks import forward_hooks, hidden_of
from llmtool.core.models import decoder_layers

TARGET_SUFFIXES = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                   "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# module -> module whose input it shares (statistics are captured on the latter only)
SHARED_INPUT = {"self_attn.k_proj": "self_attn.q_proj", "self_attn.v_proj": "self_attn.q_proj",
                "mlp.up_proj": "mlp.gate_proj"}


def layer_prefix(model) -> str:
    layers = decoder_layers(model)
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise UsageError(f"unsupported architecture {type(model).__name__}: decoder layers are not a named module")


def target_names(model) -> list[list[str]]:
    """Full names of the target Linear modules, grouped by decoder layer."""
    prefix = layer_prefix(model)
    modules = dict(model.named_modules())
    out = []
    for i in range(len(decoder_layers(model))):
        names = [f"{prefix}.{i}.{s}" for s in TARGET_SUFFIXES]
        for n in names:
            if not isinstance(modules.get(n), torch.nn.Linear):
                raise UsageError(f"unsupported architecture {type(model).__name__}: {n} is not a Linear "
                                 f"(llmtool compress supports Llama-style q/k/v/o/gate/up/down projections)")
        out.append(names)
    return out


def statistics_source(name: str) -> str:
    """The module whose input statistics ``name`` uses."""
    head, _, tail2 = name.rpartition(".")
    parent, _, block = head.rpartition(".")
    key = f"{block}.{tail2}"
    return f"{parent}.{SHARED_INPUT[key]}" if key in SHARED_INPUT else name


@dataclass
class LayerStatistics:
    index: int
    names: list[str]
    gram: dict[str, torch.Tensor] = field(default_factory=dict)     # source module -> X^T X (fp64)
    abs_sum: dict[str, torch.Tensor] = field(default_factory=dict)  # source module -> sum |x| (fp64)
    count: dict[str, int] = field(default_factory=dict)             # source module -> tokens

    def covariance(self, name: str) -> torch.Tensor:
        src = statistics_source(name)
        return self.gram[src] / max(1, self.count[src])

    def abs_mean(self, name: str) -> torch.Tensor:
        src = statistics_source(name)
        return self.abs_sum[src] / max(1, self.count[src])


class _CaughtInputs(Exception):
    pass


def _first_layer_inputs(model, ids: torch.Tensor, batch_size: int):
    layer0 = decoder_layers(model)[0]
    caught: list[tuple[torch.Tensor, dict]] = []

    def catch(module, args, kwargs):
        hidden = args[0] if args else kwargs["hidden_states"]
        rest = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        caught.append((hidden.detach(), rest))
        raise _CaughtInputs

    handle = layer0.register_forward_pre_hook(catch, with_kwargs=True)
    device = next(model.parameters()).device
    try:
        with torch.no_grad():
            for chunk in ids.split(batch_size):
                try:
                    model(input_ids=chunk.to(device), use_cache=False)
                except _CaughtInputs:
                    pass
    finally:
        handle.remove()
    return caught


def layer_statistics(model, ids: torch.Tensor, batch_size: int = 4, gram: bool = True,
                     abs_mean: bool = False) -> Iterator[LayerStatistics]:
    """Yield the input statistics of each decoder layer's target modules, layer by layer."""
    layers = decoder_layers(model)
    groups = target_names(model)
    batches = _first_layer_inputs(model, ids, batch_size)
    for i in progress(range(len(layers)), "calibration (layers)"):
        stats = LayerStatistics(i, groups[i])
        sources = sorted({statistics_source(n) for n in groups[i]})

        def accumulate(name, module, inputs, output, stats=stats):
            x = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).to(torch.float64)
            if gram:
                g = x.T @ x
                stats.gram[name] = stats.gram[name] + g if name in stats.gram else g
            if abs_mean:
                a = x.abs().sum(0)
                stats.abs_sum[name] = stats.abs_sum[name] + a if name in stats.abs_sum else a
            stats.count[name] = stats.count.get(name, 0) + x.shape[0]

        outputs = []
        with torch.no_grad(), forward_hooks(model, sources, accumulate):
            for hidden, kwargs in batches:
                out = layers[i](hidden, **kwargs)
                outputs.append(hidden_of(out).detach())
        yield stats
        batches = [(o, kw) for o, (_, kw) in zip(outputs, batches)]


def loss_gradients(model, names: list[str], ids: torch.Tensor, average: bool = True) -> dict[str, torch.Tensor] | list:
    """``dL/dW`` (float32, CPU) of the named Linear weights on each sequence of ``ids`` [k, T].
    ``average=True``: one dict averaged over sequences; else a list of per-sequence dicts."""
    modules = dict(model.named_modules())
    weights = [modules[n].weight for n in names]
    saved = [(p, p.requires_grad) for p in model.parameters()]
    for p, _ in saved:
        p.requires_grad_(False)
    for w in weights:
        w.requires_grad_(True)
    device = weights[0].device
    per_seq: list[dict[str, torch.Tensor]] = []
    total: dict[str, torch.Tensor] = {}
    try:
        for row in progress(list(ids), "gradients"):
            x = row[None].to(device)
            with torch.enable_grad():
                loss = model(input_ids=x, labels=x, use_cache=False).loss
                grads = torch.autograd.grad(loss, weights)
            g = {n: (gr.detach() if gr.dtype == torch.float64 else gr.detach().float()).cpu()
                 for n, gr in zip(names, grads)}
            if average:
                for n, gr in g.items():
                    total[n] = total[n] + gr if n in total else gr
            else:
                per_seq.append(g)
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)
    if not average:
        return per_seq
    return {n: t / len(ids) for n, t in total.items()}

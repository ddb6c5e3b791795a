"""Calibration statistics for SVD-family compression, gathered layer by layer, and loss gradients.

Target modules (spec zs-svd §2): the q/k/v/o/gate/up/down projections of every decoder layer (names
from :mod:`llmtool.core.arch`). Modules that read the same input share one set of statistics
(official default): q/k/v read the attention-norm output, gate/up the MLP-norm output.

:func:`layer_statistics` runs the calibration batch through the model one decoder layer at a time
(:func:`llmtool.core.calib.replay_layers`): the inputs of layer 0 are caught once, then each layer is
applied to the stored hidden states while forward hooks on its target modules accumulate ``X^T X``
(float64) and ``sum |x|`` (:class:`llmtool.core.calib.InputStatistics`). Only one
layer's activations ``[samples, seqlen, hidden]`` and one layer's statistics are alive at a time;
the generator yields each layer's statistics before moving on, so the caller can factorise it.

:func:`loss_gradients` does one forward/backward pass of the whole model per gradient sequence
(mean next-token cross-entropy) and returns ``dL/dW`` of every target weight, averaged over
sequences, on CPU (float32; float64 when the model is float64).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from llmtool.core.arch import input_source, module_names
from llmtool.core.calib import InputStatistics, replay_layers
from llmtool.core.console import progress
from llmtool.core.hooks import forward_hooks


def target_names(model) -> list[list[str]]:
    """Full names of the target Linear modules (every block Linear; a fused ``qkv_proj``/``gate_up_proj`` is one
    target and gets one low-rank factorisation), grouped by decoder layer."""
    return module_names(model)


def statistics_source(name: str) -> str:
    """The module whose input statistics ``name`` uses."""
    return input_source(name)


@dataclass
class LayerStatistics(InputStatistics):
    """One layer's input statistics, looked up through the shared-input source of each module."""

    index: int = 0
    names: tuple = ()
    spilled: dict = field(default_factory=dict)   # source -> (file, shape, dtype) of a Gram written to disk

    def covariance(self, name: str) -> torch.Tensor:
        return super().covariance(statistics_source(name))

    def abs_mean(self, name: str) -> torch.Tensor:
        return super().abs_mean(statistics_source(name))


def layer_statistics(model, ids: torch.Tensor, batch_size: int = 4, gram: bool = True,
                     abs_mean: bool = False, layer_context=None, chunk_rows: int | None = None,
                     spill_dir=None) -> Iterator[LayerStatistics]:
    """Yield the input statistics of each decoder layer's target modules, layer by layer (the layer is
    still loaded while the caller handles its statistics; ``layer_context`` as in ``replay_layers``;
    ``chunk_rows`` as in :class:`InputStatistics`).

    ``spill_dir`` (CPU, the layer-streamed compression): two forwards of the layer, one for the widest
    input (the MLP down projection's) and one for the others, each pass's Grams written to files in
    ``spill_dir`` right after it (``LayerStatistics.spilled``; :func:`streamed.source_whiteners` reads them
    back), so the widest Gram is never in memory next to the others (at the default model 19 MB instead
    of 27 MB next to the layer's weights and activations), for one more forward of the layer (measured
    +9 s on a 68 s run; one forward per source would cost +23 s). The widest input's pass runs first and
    drops each output as it is made; the last pass keeps them, after which the layer's inputs are dropped."""
    from llmtool.compress.lapack_inplace import write_raw

    groups = target_names(model)
    modules = dict(model.named_modules())
    for step in replay_layers(model, ids, batch_size, layer_context=layer_context):
        names = groups[step.index]
        stats = LayerStatistics(gram_on=gram, abs_on=abs_mean, chunk_rows=chunk_rows, index=step.index,
                                names=tuple(names))
        sources = sorted({statistics_source(n) for n in names})
        passes = [sources]
        if spill_dir is not None and gram and len(sources) > 1:
            widest = max(sources, key=lambda n: modules[n].in_features)
            passes = [[widest], [s for s in sources if s != widest]]   # outputs kept by the last pass only
        for k, group in enumerate(passes):
            with forward_hooks(model, group, stats.hook):
                last = k == len(passes) - 1
                step.forward(keep=last, discard=not last)
            for source in group:   # a routed expert no calibration token reached: identity statistics
                if source not in stats.count:
                    n_in = modules[source].in_features
                    w = modules[source].weight
                    stats.count[source] = 1
                    if gram:
                        stats.gram[source] = torch.eye(n_in, dtype=stats.dtype, device=w.device)
                    if abs_mean:
                        stats.abs_sum[source] = torch.ones(n_in, dtype=stats.dtype, device=w.device)
            if len(passes) > 1:
                for source in group:
                    g = stats.gram.pop(source)
                    path = Path(spill_dir) / f"gram-{step.index}-{sources.index(source)}.bin"
                    write_raw(g, path)
                    stats.spilled[source] = (path, tuple(g.shape), g.dtype)
                    del g
        if spill_dir is not None:   # the outputs are kept: the layer's inputs are not needed again
            step.inputs[:] = [(None, kw) for _, kw in step.inputs]
        yield stats


def loss_gradients(model, names: list[str], ids: torch.Tensor, average: bool = True,
                   square: bool = False) -> dict[str, torch.Tensor] | list:
    """``dL/dW`` (float32, CPU) of the named Linear weights on each sequence of ``ids`` [k, T].
    ``average=True``: one dict averaged over sequences; else a list of per-sequence dicts.
    ``square=True`` (with ``average``): the per-sequence mean of the elementwise *squared* gradient,
    the empirical Fisher diagonal (not the square of the mean gradient)."""
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
                    gr = gr * gr if square else gr
                    total[n] = total[n] + gr if n in total else gr
            else:
                per_seq.append(g)
    finally:
        for p, flag in saved:
            p.requires_grad_(flag)
    if not average:
        return per_seq
    return {n: t / len(ids) for n, t in total.items()}

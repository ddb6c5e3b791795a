"""Layer-streamed compression (``llmtool compress --stream``): the same methods as :mod:`pipeline` with
one decoder layer's weights in memory at a time.

Memory of the in-memory pipeline is the whole model, a float32 gradient of every target matrix and the
factors of every module until the save (about 4x the weights). Here:

* **Weights**: the model is built on the ``meta`` device (accelerate's ``init_empty_weights``); only the
  parts outside the decoder layers (embeddings, final norm, head, rotary tables) are loaded. Each decoder
  layer is materialised from the safetensors checkpoint when it is needed and sent back to ``meta``
  afterwards (:class:`LayerStream`). In pass 1's no-grad forwards this happens per submodule (forward
  pre-hooks read a module's tensors, forward hooks drop them), so one matrix of the layer is in memory at a
  time; each target weight is re-read from the checkpoint just before its own SVD.
* **Statistics and bases** (pass 1): the calibration batch is replayed layer by layer
  (:func:`profile.layer_statistics`), in two forwards per layer on the CPU: one for the widest input (the
  MLP down projection's, 19 MB of float64 Gram at the default model) and one for the others, each pass's
  Grams written to the scratch directory as soon as the pass ends, so at most the widest Gram is in memory
  next to one module's weight; the first pass drops each output as it is made. Uniform-rank methods
  factorise each module at once, park its factors in a scratch file (:class:`LayerParts`) and write the
  layer's output shard when the layer is done. Global-selection methods (zs-svd, abs-delta, sigma-global) keep the singular values in memory and
  write each module's basis to a scratch file next to the output as soon as its SVD is done
  (:func:`source_whiteners` reads one Gram back at a time and factors it in its own storage): ``U [m, k]``
  and ``Q^T = V^T L^{-1} [k, n]``, which give both the factors ``B = U_r diag(sqrt sigma)``,
  ``A = diag(sqrt sigma) Q^T_r`` and the singular-value gradient. The SVD is taken in place
  (:mod:`lapack_inplace`) while ``L`` waits in a scratch file (:func:`factorize.storage_on_disk`), and
  ``Q^T`` is solved in ``V^T``'s storage; after the last module that reads an input, ``L``'s memory is freed
  at once.
* **Gradients** (pass 2, zs-svd and abs-delta): the official code's "efficient importance". With
  ``W = A L^{-1}`` and ``A = U diag(sigma) V^T``, ``g_i = u_i^T G L^{-T} v_i = u_i^T G q_i`` with
  ``q_i`` the i-th column of ``Q = L^{-T} V``, so each weight gradient ``G`` is reduced to the r-vector
  ``diag(U^T G Q)`` (:func:`singular_value_scores`, a block of components at a time) as soon as it exists
  and then dropped. The backward pass is layer-wise gradient checkpointing to disk: a no-grad forward
  writes each layer's input hidden states (``[T, d]``) to the scratch directory, the head's loss gives
  ``dL/dh`` of the last layer, and going back, each layer's input is read back, the layer materialised and
  re-run with autograd, and ``autograd.grad`` returns its weight gradients and ``dL/dh`` of its input. One
  gradient sequence ("window") at a time; the score is the mean over windows (equal token counts, so it
  equals the gradient of the mean loss), and the report gives the predicted loss change of the chosen
  truncation under each window separately (``gradient_windows``): the window spread.
* **Output** (pass 3, after the global selection): one safetensors shard per decoder layer plus one for
  the rest, with an HF index, written layer by layer; restored (dense) modules are copied from the
  source checkpoint. The format is :mod:`lowrank`'s, identical to the in-memory pipeline's.

Peak memory is the non-layer weights (for small models the tied embedding dominates), one layer's
calibration activations (``samples x seqlen x d``, twice in the last statistics pass), and the largest of:
the widest input's Gram with one module's weight (its statistics pass), one module's SVD (its whitened
weight, the outputs and LAPACK's workspace), or one module's ``L`` with its weight and basis (measured
on the default model: the last two within 3 MB of each other, the first 8 MB below); the gradient pass
needs less (two hidden states, one layer's weights and gradients). The heap is trimmed after each module
(:func:`trim_heap`).
On a GPU (``--device cuda``) the statistics stay on the device and the torch.linalg path is used.

Not streamed (refused with a one-line error): ``fwsvd`` (its Fisher weight needs every squared
gradient entry) and multi-stage runs (``--correction pull-subspace``: the correction needs the loss
gradient at the truncated model, i.e. every module's truncated weight at once).

Numerics: the bases are stored in float32 for float16/bfloat16/float32 models and in float64 for
float64 models (the in-memory pipeline keeps them in float64 in RAM); with a float64 model both paths
give the same ranks and factors to rounding (tests/test_compress_stream.py).
"""
from __future__ import annotations

import functools
import json
import shutil
import time
from contextlib import contextmanager
from pathlib import Path

import torch

from llmtool.compress.factorize import ModuleSpec, split_factors, whitened_basis
from llmtool.compress.pipeline import CompressionResult, StageReport, _kmax, _specs
from llmtool.compress.profile import layer_statistics
from llmtool.compress.whitening import whitener_from_covariance
from llmtool.compress.zs_svd import select_components, singular_value_scores
from llmtool.core.console import UsageError, info, progress
from llmtool.core.evalkit import current_rss_mb, peak_rss_mb


@functools.lru_cache(maxsize=1)
def _glibc():
    """The C library on Linux (glibc's malloc tuning calls), else None."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
    except OSError:
        return None


MMAP_THRESHOLD = 64 << 10   # bytes: allocations from this size up get their own mappings


def release_large_frees() -> None:
    """Serve allocations of ``MMAP_THRESHOLD`` (64 KiB) and more with their own mappings, returned to the OS
    when freed (glibc only; elsewhere nothing happens). glibc otherwise raises its mmap threshold after the
    first large free and keeps later layer-sized buffers in its heap, so a run that loads and frees one layer
    after another grows by fragments; measured on the default model: peak 937 MB -> 856 MB after 4 layers,
    flat afterwards (threshold 1 MiB), and a further 12 MB less with 64 KiB (the [576]-to-[192, 576] tensors
    of a layer no longer fragment the heap), at no measurable cost in time."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "mallopt"):
        libc.mallopt(-3, MMAP_THRESHOLD)   # M_MMAP_THRESHOLD (fixes it, which also stops the dynamic raise)


def trim_heap() -> None:
    """Give the heap's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing happens). Called
    after each layer: the allocations under the mmap threshold that a layer's forward/backward leaves freed
    otherwise stay in the process, measured on the default model as 2.7-3.5 MB per layer and pass (peak 886 ->
    789 MB for streamed ZS-SVD at 40 %)."""
    libc = _glibc()
    if libc is not None and hasattr(libc, "malloc_trim"):
        libc.malloc_trim(0)


def check_streamable(cfg) -> None:
    """Refuse, in one line, a configuration the streamed pipeline cannot run."""
    method = cfg.decomposer()
    if cfg.resolved_stages() > 1:
        raise UsageError("--stream runs one stage: --correction pull-subspace needs the loss gradient of the whole "
                         "truncated model (run it without --stream)")
    if method.needs_grad and not getattr(method, "streams_gradient", False):
        raise UsageError(f"--stream does not support --method {cfg.name} (its weight needs every squared gradient "
                         "entry; run it without --stream)")


class LayerStream:
    """A causal LM whose decoder layers live on ``meta`` until :meth:`layer` materialises one from the
    checkpoint; everything outside the layers is loaded at construction."""

    def __init__(self, src: Path, dtype: torch.dtype, device: torch.device):
        from accelerate import init_empty_weights
        from transformers import AutoModelForCausalLM

        from llmtool.core.arch import decoder_layers, layers_prefix
        from llmtool.core.checkpoint import LazyCheckpoint, read_config
        from llmtool.core.models import hf_config

        self.src, self.dtype, self.device = Path(src), dtype, device
        self.rss_between_layers: float | None = None   # the most resident memory (MiB) at a layer's release
        self.ckpt = LazyCheckpoint(self.src)
        self.checked: set[str] = set()   # keys whose values were found finite
        config = hf_config(self.src, read_config(self.src))
        with init_empty_weights(include_buffers=False):
            model = AutoModelForCausalLM.from_config(config, dtype=dtype)
        model.eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.model = model
        self.layers = decoder_layers(model)
        self.prefix = layers_prefix(model) + "."
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        expected = list(model.state_dict().keys())
        self.layer_keys: list[list[str]] = [[] for _ in self.layers]
        self.other_keys: list[str] = []
        for key in expected:
            if key.startswith(self.prefix):
                idx, _, rest = key[len(self.prefix):].partition(".")
                self.layer_keys[int(idx)].append(rest)
            else:
                self.other_keys.append(key)
        missing = [k for k in expected if k not in self.ckpt and not self._tied_head(k)]
        if missing:
            raise UsageError(f"{self.src}: checkpoint lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]} "
                             "(refusing to initialise them randomly)")
        for key in self.other_keys:
            if not self._tied_head(key):
                self._set(model, key, self.read(key))
        if self.tied:
            model.tie_weights()

    def _tied_head(self, key: str) -> bool:
        return self.tied and key.endswith("lm_head.weight") and key not in self.ckpt

    def read(self, key: str) -> torch.Tensor:
        """A tensor of the source checkpoint in the run's dtype (CPU); NaN/inf weights are refused."""
        from llmtool.core.models import refuse_nonfinite

        t = self.ckpt.get(key)
        if not t.is_floating_point():
            return t
        if key not in self.checked:     # once per tensor: pass 1 re-reads each weight per forward call
            refuse_nonfinite(self.src, key, t)
            self.checked.add(key)
        return t.to(self.dtype)

    def read_to_device(self, key: str) -> torch.Tensor:
        """:meth:`read` on the run's device."""
        return self.read(key).to(self.device)

    def _set(self, module, name: str, value) -> None:
        from accelerate.utils import set_module_tensor_to_device

        set_module_tensor_to_device(module, name, self.device if value is not None else "meta", value=value)

    @contextmanager
    def layer(self, i: int, lazy: bool = False):
        """Layer ``i`` with its weights loaded (sent back to ``meta`` on exit).

        ``lazy=True`` (pass 1's no-grad forwards): each submodule's own tensors are read from the checkpoint
        by a forward pre-hook and sent back to ``meta`` by a forward hook, so one module's weight is in memory
        at a time instead of the layer's (at the default model 3.5 MB instead of 13.5 MB next to the widest
        Gram; at 7B in bfloat16, 90 MB instead of 400 MB). Each weight is read once per forward call (page
        cache pages; each tensor's finiteness is checked on its first read only)."""
        layer = self.layers[i]
        owned: dict[str, list[str]] = {}
        for name in self.layer_keys[i]:
            owned.setdefault(name.rpartition(".")[0], []).append(name)
        handles = []
        if lazy:
            for path in [p for p in owned if p]:
                module = layer.get_submodule(path)
                names = owned.pop(path)
                handles.append(module.register_forward_pre_hook(
                    lambda m, args, names=names: self._load(i, names)))
                handles.append(module.register_forward_hook(
                    lambda m, args, out, names=names: self._unload(i, names)))
        self._load(i, [n for names in owned.values() for n in names])
        try:
            yield layer
        finally:
            for h in handles:
                h.remove()
            self._unload(i, self.layer_keys[i])
            trim_heap()
            rss = current_rss_mb()
            if rss is not None:
                self.rss_between_layers = max(self.rss_between_layers or 0.0, rss)

    def _load(self, i: int, names: list[str]) -> None:
        for name in names:
            self._set(self.layers[i], name, self.read(f"{self.prefix}{i}.{name}"))

    def _unload(self, i: int, names: list[str]) -> None:
        for name in names:
            self._set(self.layers[i], name, None)


class ShardWriter:
    """Writes an HF-sharded safetensors checkpoint one shard at a time (the index at :meth:`close`)."""

    def __init__(self, out_dir: Path, n_shards: int):
        self.out_dir, self.n_shards, self.k = Path(out_dir), n_shards, 0
        self.weight_map: dict[str, str] = {}
        self.total = 0

    def write(self, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        self.k += 1
        name = f"model-{self.k:05d}-of-{self.n_shards:05d}.safetensors"
        tensors = {k: v.detach().contiguous().cpu() for k, v in tensors.items()}
        save_file(tensors, str(self.out_dir / name), metadata={"format": "pt"})
        self.weight_map.update({k: name for k in tensors})
        self.total += sum(t.numel() * t.element_size() for t in tensors.values())

    def close(self) -> None:
        from llmtool.core.checkpoint import SAFE_INDEX

        if self.k != self.n_shards:
            raise RuntimeError(f"wrote {self.k} of {self.n_shards} shards")
        (self.out_dir / SAFE_INDEX).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                           "weight_map": self.weight_map}, indent=2))


def _basis_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def basis_path(scratch: Path, module: str) -> Path:
    """The scratch file of one module's basis (``u`` and ``qt``): one file per module, written as soon as
    the module's SVD is done, so at most one module's basis is in memory."""
    return scratch / f"{module}.safetensors"


def source_whiteners(stats, layer_specs: list[ModuleSpec], eps: float):
    """``(spec, whitener, last)`` for each module of a layer, in order, with one whitener per statistics source
    (q/k/v share the attention-norm output, gate/up the MLP-norm output): the same ``L`` as one whitener per
    module, computed once. A source's Gram matrix is taken from ``stats`` (or read back from the file
    :func:`profile.layer_statistics` spilled it to) and divided in place when its whitener is made, and the
    whitener is dropped after the source's last module (``last``: the caller may free its factor's storage
    there, :func:`factorize.whitened_basis`), so one source's ``[n, n]`` float64 matrix is alive at a time (on
    the CPU the factor is computed in the Gram's own storage)."""
    from llmtool.compress.lapack_inplace import read_raw
    from llmtool.compress.profile import statistics_source

    groups: dict[str, list[ModuleSpec]] = {}
    for spec in layer_specs:
        groups.setdefault(statistics_source(spec.name), []).append(spec)
    spilled = stats.spilled
    for source, group in groups.items():
        cov = read_raw(*spilled.pop(source)) if source in spilled else stats.gram.pop(source)
        cov.div_(max(1, stats.count[source]))                 # == stats.covariance(), in place
        whitener = whitener_from_covariance(cov, eps, overwrite=True)
        del cov
        for j, spec in enumerate(group):
            yield spec, whitener, j == len(group) - 1
        del whitener


class LayerParts:
    """One layer's replaced modules: each module's output tensors are written to a scratch file as soon as they
    are made and read back only for the layer's shard (:meth:`collect`), so the factors of the modules done
    are not in memory next to the next module's SVD (at the default model, 8 MB of a layer's float32
    factors next to the down projection's)."""

    def __init__(self, scratch: Path):
        self.scratch, self.files = Path(scratch), {}

    def add(self, module: str, tensors: dict[str, torch.Tensor]) -> None:
        from safetensors.torch import save_file

        path = self.scratch / f"part-{module}.safetensors"
        save_file({k: v.detach().contiguous().cpu() for k, v in tensors.items()}, str(path))
        self.files[module] = path

    def collect(self) -> dict[str, dict[str, torch.Tensor]]:
        """``{module: tensors}`` of every part added, read back (their files are removed)."""
        from safetensors.torch import load_file

        out = {}
        for module, path in self.files.items():
            out[module] = load_file(str(path))
            path.unlink()
        self.files = {}
        return out


def _layer_out(stream: LayerStream, i: int, replaced: dict[str, dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
    """The output tensors of layer ``i``: its source tensors, with each module in ``replaced`` swapped for
    the given tensors (keys relative to the module)."""
    out = {}
    mods = tuple(n + "." for n in replaced)
    for name in stream.layer_keys[i]:
        key = f"{stream.prefix}{i}.{name}"
        if not key.startswith(mods):       # a replaced module's weight and bias are in ``replaced``
            out[key] = stream.read(key)
    for module, tensors in replaced.items():
        for rel, t in tensors.items():
            out[f"{module}.{rel}"] = t
    return out


def _lowrank_tensors(a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None, dtype) -> dict[str, torch.Tensor]:
    t = {"lowrank_a.weight": a.to(dtype), "lowrank_b.weight": b.to(dtype)}
    if bias is not None:
        t["lowrank_b.bias"] = bias.to(dtype)
    return t


HEAD_CHUNK = 32
STATS_CHUNK_ROWS = 64   # rows of a module input upcast to float64 and added to its Gram at a time (0.8 MB at 1536)
STREAM_BATCH = 1    # calibration sequences per layer forward in pass 1 (the in-memory pipeline: cfg.batch_size);
                    # a batch of 4 x 512 tokens costs ~4x the attention and MLP temporaries for no change in result


def _head_gradient(model, last: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """``dL/dh`` of the last layer's output for the mean next-token cross-entropy, computed over
    ``HEAD_CHUNK`` positions at a time (the final norm and the head act per position, so this is exact):
    the ``[T, vocab]`` logits and their gradient never exist at once (at T = 512 and a 49k vocabulary
    they are 100 MB each; at 32 positions, 6.3 MB)."""
    from llmtool.core.arch import final_norm, lm_head

    norm, head = final_norm(model), lm_head(model)
    cap = getattr(model.config, "final_logit_softcapping", None)
    n = last.shape[1] - 1
    grad = torch.zeros_like(last)
    for a in range(0, n, HEAD_CHUNK):
        b = min(n, a + HEAD_CHUNK)
        x = last[:, a:b].detach().requires_grad_(True)
        with torch.enable_grad():
            logits = head(norm(x)).float()
            if cap:   # Gemma 2's final logit soft-capping (core.arch: logit soft-capping), as its forward
                logits = torch.tanh(logits / cap) * cap
            loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                     ids[:, a + 1:b + 1].reshape(-1), reduction="sum") / n
            (g,) = torch.autograd.grad(loss, [x])
        grad[:, a:b] = g
    return grad


def _hidden_path(scratch: Path, i: int) -> Path:
    return scratch / f"hidden-{i:05d}.safetensors"


@torch.no_grad()
def _gradient_scores(stream: LayerStream, specs: list[list[ModuleSpec]], grad_ids: torch.Tensor,
                     scratch: Path) -> list[dict[str, torch.Tensor]]:
    """Per gradient window (sequence): ``{module: g [k]}`` with ``g_i = u_i^T G q_i``, float64.

    The layer inputs of the no-grad forward are written to the scratch directory as they are produced and
    read back one at a time going backwards (checkpointing to disk: two ``[T, d]`` hidden states in memory,
    not one per layer); each layer's weights are dropped before its gradients are scored, and each
    gradient as soon as its r-vector exists."""
    from safetensors.torch import load_file, save_file

    from llmtool.core.calib import captured_inputs
    from llmtool.core.hooks import hidden_of

    model = stream.model
    modules = dict(model.named_modules())
    windows = []
    n_layers = len(stream.layers)
    for row in progress(list(grad_ids), "gradients (windows)"):
        (h, kws), = captured_inputs(model, row[None])   # per-layer kwargs (sliding / full layers)
        for i in range(n_layers):
            save_file({"h": h.contiguous()}, str(_hidden_path(scratch, i)))
            with stream.layer(i) as layer:
                h = hidden_of(layer(h, **kws[i])).detach()
        grad_h = _head_gradient(model, h, row[None].to(h.device))
        del h
        scores: dict[str, torch.Tensor] = {}
        for i in reversed(range(n_layers)):
            names = [s.name for s in specs[i]]
            h_in = load_file(str(_hidden_path(scratch, i)), device=str(grad_h.device))["h"]
            _hidden_path(scratch, i).unlink()
            with stream.layer(i) as layer:
                weights = [modules[n].weight for n in names]
                for w in weights:
                    w.requires_grad_(True)
                h_in.requires_grad_(i > 0)
                with torch.enable_grad():
                    out = hidden_of(layer(h_in, **kws[i]))
                    grads = list(torch.autograd.grad(out, ([h_in] if i > 0 else []) + weights,
                                                     grad_outputs=grad_h))
                for w in weights:
                    w.requires_grad_(False)
                del weights, out, h_in     # the layer's weights go back to meta on exit: hold no reference
            if i > 0:
                grad_h = grads.pop(0).detach()
            for name in names:
                g = grads.pop(0)
                basis = load_file(str(basis_path(scratch, name)))
                scores[name] = singular_value_scores(basis["u"], basis["qt"], g).cpu()
                del basis, g
        windows.append(scores)
    return windows


def compress_streamed(src: Path, out_dir: Path, cfg, calib_ids, grad_ids, dtype: torch.dtype,
                      device: torch.device) -> tuple[CompressionResult, dict]:
    """Compress the checkpoint at ``src`` into ``out_dir`` (weights only; the caller writes config.json
    with :func:`lowrank.write_lowrank_config`). Returns the result and extra report fields."""
    from safetensors.torch import load_file, save_file

    check_streamable(cfg)
    release_large_frees()
    t_all = time.perf_counter()
    method = cfg.decomposer()
    stream = LayerStream(src, dtype, device)
    model = stream.model
    specs = _specs(model)
    flat = [s for layer in specs for s in layer]
    eps = getattr(cfg, "eps", 0.0)
    n_layers = len(stream.layers)
    writer = ShardWriter(out_dir, n_layers + 1)
    scratch = Path(out_dir) / ".stream-scratch"
    scratch.mkdir()
    bdtype = _basis_dtype(dtype)
    seconds: dict[str, float] = {}
    result = CompressionResult(cfg.name, cfg.ratio, {}, [], sum(s.dense_params for s in flat), 0)
    sigmas: dict[str, torch.Tensor] = {}
    ranks: dict[str, int] = {}
    extra: dict = {"streamed": True}

    # pass 1: statistics, then factors (uniform) or bases (global selection), layer by layer
    t0 = time.perf_counter()
    # lazy layers: a module's weights are in memory only while its forward runs (none without statistics), and
    # each target weight is re-read from the checkpoint just before its own SVD
    lazy_layer = functools.partial(stream.layer, lazy=True)
    if method.needs_gram or method.needs_abs_mean:
        per_layer = layer_statistics(model, calib_ids, STREAM_BATCH, gram=method.needs_gram,
                                     abs_mean=method.needs_abs_mean, layer_context=lazy_layer,
                                     chunk_rows=STATS_CHUNK_ROWS, spill_dir=scratch if device.type == "cpu" else None)
    else:
        def no_stats():
            for i in progress(range(n_layers), "decomposing (layers)"):
                with lazy_layer(i):
                    yield None
        per_layer = no_stats()
    for i, stats in enumerate(per_layer):
        if method.uniform:
            parts = LayerParts(scratch)
            pairs = (source_whiteners(stats, specs[i], eps) if method.needs_gram
                     else ((spec, None, True) for spec in specs[i]))
            for spec, whitener, last in pairs:
                weight = stream.read_to_device(f"{spec.name}.weight")
                bias = stream.read(f"{spec.name}.bias") if spec.has_bias else None
                k = _kmax(method, spec, cfg)
                extra_kw = {} if whitener is None else {"whitener": whitener, "low_memory": scratch,
                                                        "release_whitener": last}
                sp = method.decompose(spec, weight, stats, None, eps, k, **extra_kw)
                del whitener, extra_kw, weight   # extra_kw held the source's [n, n] factor into the next layer
                a, b = sp.factors(k)
                ranks[spec.name] = k
                parts.add(spec.name, _lowrank_tensors(a, b, bias, dtype))
                del sp, a, b
                trim_heap()
            writer.write(_layer_out(stream, i, parts.collect()))
        else:
            for spec, whitener, last in source_whiteners(stats, specs[i], eps):
                u, sigma, qt = whitened_basis(stream.read_to_device(f"{spec.name}.weight"), whitener, scratch,
                                              release_whitener=last)
                del whitener
                sigmas[spec.name] = sigma.cpu()
                save_file({"u": u.to(bdtype).cpu().contiguous(), "qt": qt.to(bdtype).cpu().contiguous()},
                          str(basis_path(scratch, spec.name)))
                del u, qt
                trim_heap()
    seconds["statistics_and_svd"] = time.perf_counter() - t0
    # the floor the per-layer work of pass 1 sits on (the gradient pass's layer boundaries hold a layer's gradients)
    extra["rss_between_layers_mb"] = stream.rss_between_layers

    sel = None
    restored: list[str] = []
    if not method.uniform:
        deltas = None
        if method.needs_grad:
            t0 = time.perf_counter()
            windows = _gradient_scores(stream, specs, grad_ids, scratch)
            seconds["gradients"] = time.perf_counter() - t0
            mean_g = {n: sum(w[n] for w in windows) / len(windows) for n in sigmas}
            deltas = [-sigmas[s.name] * mean_g[s.name] for s in flat]
        t0 = time.perf_counter()
        if cfg.forced_ranks is not None:
            ranks = {s.name: int(cfg.forced_ranks[s.name]) for s in flat}
        else:
            sel = select_components(flat, [sigmas[s.name] for s in flat], deltas, cfg.ratio,
                                    cfg.resolved_keep_rank_ratio(), rule=method.rule)
            ranks, restored = dict(sel.factorised), list(sel.restored)
        seconds["selection"] = time.perf_counter() - t0
        if method.needs_grad:
            extra["gradient_windows"] = window_spread(windows, sigmas, flat, sel.planned_rank if sel else ranks)
        # pass 3: factors at the chosen ranks, layer by layer
        t0 = time.perf_counter()
        for i in progress(range(n_layers), "writing (layers)"):
            parts = LayerParts(scratch)
            for spec in specs[i]:
                if spec.name not in ranks:
                    continue
                # B = U_r diag(sqrt sigma), A = diag(sqrt sigma) Q^T_r (Q^T is already V^T L^{-1}); only the
                # kept components are upcast
                r = ranks[spec.name]
                basis = load_file(str(basis_path(scratch, spec.name)))
                a, b = split_factors(basis["u"][:, :r].double(), sigmas[spec.name].double(),
                                     basis["qt"][:r].double(), r)
                del basis
                bias_key = f"{spec.name}.bias"
                bias = stream.read(bias_key) if spec.has_bias else None
                parts.add(spec.name, _lowrank_tensors(a, b, bias, dtype))
                del a, b
                trim_heap()
            writer.write(_layer_out(stream, i, parts.collect()))
        seconds["writing"] = time.perf_counter() - t0
    shutil.rmtree(scratch)
    state = model.state_dict()          # the resident non-layer weights (re-reading them would hold a second copy)
    rest = {k: state[k] for k in stream.other_keys if not stream._tied_head(k)}
    del state
    writer.write(rest)
    writer.close()
    removed = sum(s.dense_params - s.params_at_rank(ranks[s.name]) if s.name in ranks else 0 for s in flat)
    result.stages.append(StageReport(
        1, removed, sel.target_removed if sel else int(cfg.ratio * result.target_dense_params),
        sel.running_sum if sel else None, sel.predicted_factorised if sel else None,
        sel.predicted_restored if sel else None, list(restored), seconds))
    if sel is not None:
        info(f"{len(ranks)} modules factorised, {len(restored)} restored dense; "
             f"predicted dL: factorised {sel.predicted_factorised:+.4g}, restored {sel.predicted_restored:+.4g}")
    result.ranks, result.dense, result.removed_params, result.selection = dict(ranks), restored, removed, sel
    result.seconds = {"total": time.perf_counter() - t_all, **seconds}
    result.peak_rss_mb = peak_rss_mb()
    extra["resident_non_layer_bytes"] = sum(t.numel() * t.element_size() for t in
                                            {id(p): p for p in model.parameters() if p.device.type != "meta"}.values())
    return result, extra


def window_spread(windows: list[dict[str, torch.Tensor]], sigmas: dict[str, torch.Tensor],
                  specs: list[ModuleSpec], planned: dict[str, int]) -> dict:
    """The predicted loss change of the chosen truncation (components dropped from factorised modules)
    under each gradient window on its own, and their mean and standard deviation."""
    per = []
    for w in windows:
        total = 0.0
        for s in specs:
            r = planned[s.name]
            if r <= s.break_even:
                total += float((-sigmas[s.name][r:] * w[s.name][r:]).sum())
        per.append(total)
    mean = sum(per) / len(per)
    sd = (sum((x - mean) ** 2 for x in per) / (len(per) - 1)) ** 0.5 if len(per) > 1 else None
    return {"windows": len(per), "predicted_dl_per_window": per, "mean": mean, "sd": sd}



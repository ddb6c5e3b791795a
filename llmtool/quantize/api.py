"""Library entry point of `llmtool quantize`: ``quantize_(model, config, calib)``.

Shared pipeline for every method (the method only decides the rotations):
1. (rotating methods) :func:`rotations.prepare` — untie lm_head, fold RMSNorm gains;
   fuse the down_proj online Hadamard; the method builds (and possibly learns) its rotations;
   :func:`rotations.fuse` writes them into the weights; ReSpinQuant installs its low-rank
   residual transitions.
2. Every block Linear becomes a :class:`QuantLinear` (online Hadamard on down_proj when rotated).
3. Weights: GPTQ (layer by layer on the rotated model: each layer's Hessians come from the outputs of
   the already-quantized previous layers, activations in full precision during calibration, as in
   QuaRot/SpinQuant) or RTN; both with the same per-channel symmetric quantizer and clip search.
4. Dynamic per-token activation quantization is switched on for every block Linear input; K/V are
   fake-quantized when ``kv_bits < 16``. Embeddings, lm_head, norms and residual stay in float.
5. Embedding and lm_head are rounded to fp16 (their stored dtype) when weights are quantized, so the
   in-memory model equals the reloaded checkpoint.
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field

import torch

from llmtool.core.console import UsageError, info, progress
from llmtool.core.models import decoder_layers
from llmtool.core.registry import Registry
from llmtool.quantize import rotations as rot_mod
from llmtool.quantize.gptq import gptq_weight
from llmtool.quantize.modules import (BLOCK_LINEARS, LowRankTransition, QuantLinear, enable_kv_quant,
                                      install_transitions)
from llmtool.quantize.quantizers import rtn_weight

VALID_BITS = (3, 4, 8, 16)
VALID_KV_BITS = (4, 8, 16)


@dataclass
class QuantConfig:
    """Quantizer settings shared by every method."""
    w_bits: int = 4
    a_bits: int = 4
    kv_bits: int = 16
    weight_algorithm: str = "gptq"      # gptq | rtn
    w_clip: bool = True
    a_symmetric: bool = False
    a_clip_ratio: float = 1.0
    kv_group_size: int = 128
    gptq_damp: float = 0.01
    gptq_block_size: int = 128
    seed: int = 0
    method: str = field(default="", init=False)

    def validate(self) -> None:
        for name, val in (("--w-bits", self.w_bits), ("--a-bits", self.a_bits)):
            if val not in VALID_BITS:
                raise UsageError(f"{name} {val}: unsupported bit width (choose one of {', '.join(map(str, VALID_BITS))})")
        if self.kv_bits not in VALID_KV_BITS:
            raise UsageError(f"--kv-bits {self.kv_bits}: unsupported bit width (choose one of 4, 8, 16)")
        if self.weight_algorithm not in ("gptq", "rtn"):
            raise UsageError(f"--weight-algorithm {self.weight_algorithm!r}: choose gptq or rtn")
        if not 0 < self.a_clip_ratio <= 1:
            raise UsageError(f"--a-clip-ratio {self.a_clip_ratio}: must be in (0, 1]")

    def as_dict(self) -> dict:
        return asdict(self)


# name -> (config class, rotate(model, config, calib) -> (RotationSet | None, report dict))
METHODS: Registry = Registry("quantize")


def _replace_linears(model, cfg: QuantConfig, rotated: bool) -> None:
    for layer in decoder_layers(model):
        for name in BLOCK_LINEARS:
            parent_name, child = name.rsplit(".", 1)
            parent = layer.get_submodule(parent_name)
            lin = getattr(parent, child)
            q = QuantLinear.from_linear(lin, a_symmetric=cfg.a_symmetric, a_clip_ratio=cfg.a_clip_ratio,
                                        online_hadamard=rotated and child == "down_proj")
            setattr(parent, child, q)


def block_quant_linears(layer) -> dict[str, QuantLinear]:
    return {n: layer.get_submodule(n) for n in BLOCK_LINEARS}


class _Stop(Exception):
    pass


@torch.no_grad()
def _first_layer_inputs(model, calib: torch.Tensor):
    layers = decoder_layers(model)
    got = {}

    def grab(mod, args, kwargs):
        got["h"] = args[0] if args else kwargs.pop("hidden_states")
        got["kw"] = {k: v for k, v in kwargs.items() if k != "hidden_states"}
        raise _Stop

    handle = layers[0].register_forward_pre_hook(grab, with_kwargs=True)
    try:
        model(input_ids=calib.to(next(model.parameters()).device), use_cache=False)
    except _Stop:
        pass
    finally:
        handle.remove()
    return got["h"], got["kw"]


@torch.no_grad()
def quantize_weights(model, cfg: QuantConfig, calib: torch.Tensor | None) -> None:
    layers = decoder_layers(model)
    if cfg.w_bits >= 16:
        return
    if cfg.weight_algorithm == "rtn":
        for layer in progress(layers, "rtn weights"):
            for q in block_quant_linears(layer).values():
                codes, scale = rtn_weight(q.weight, cfg.w_bits, cfg.w_clip)
                q.set_quantized(codes, scale, cfg.w_bits)
        return
    if calib is None:
        raise UsageError("GPTQ needs calibration data")
    h, kw = _first_layer_inputs(model, calib)
    for layer in progress(layers, "gptq layers"):
        linears = block_quant_linears(layer)
        hess = {n: None for n in linears}

        def observer(name):
            def fn(x):
                x2 = x.reshape(-1, x.shape[-1]).float()
                g = x2.T @ x2
                hess[name] = g if hess[name] is None else hess[name] + g
            return fn

        for n, q in linears.items():
            q.observer = observer(n)
        layer(h, **kw)
        for q in linears.values():
            q.observer = None
        for n, q in linears.items():
            codes, scale = gptq_weight(q.weight, hess[n].cpu(), cfg.w_bits, cfg.w_clip, cfg.gptq_damp,
                                       cfg.gptq_block_size)
            q.set_quantized(codes.to(q.weight.device), scale, cfg.w_bits)
        h = layer(h, **kw)
        if isinstance(h, tuple):
            h = h[0]


def enable_activation_quant(model, cfg: QuantConfig) -> None:
    for layer in decoder_layers(model):
        for q in block_quant_linears(layer).values():
            q.a_bits, q.a_symmetric, q.a_clip_ratio = cfg.a_bits, cfg.a_symmetric, cfg.a_clip_ratio
    if cfg.kv_bits < 16:
        enable_kv_quant(model, decoder_layers(model), cfg.kv_bits, cfg.kv_group_size)


@torch.no_grad()
def install_low_rank_transitions(model, rot, rank: int) -> dict:
    """Approximate every transition with rank ``rank``; returns the mean/max ‖T̂ − T‖_F."""
    layers = decoder_layers(model)
    hidden = model.config.hidden_size
    errors = []
    for i, layer in enumerate(layers):
        mods = []
        for t in rot_mod.transitions(rot, i):
            t = t.detach().double()
            basis, core = rot_mod.approximate_transition(t, rank)
            dtype = next(layer.parameters()).dtype
            m = LowRankTransition(hidden, basis.shape[1], dtype=dtype)
            m.basis.copy_(basis.to(dtype))
            m.core.copy_(core.to(dtype))
            dense = torch.eye(hidden, dtype=torch.float64) + basis @ core @ basis.T
            errors.append(float(torch.linalg.norm(dense - t)))
            mods.append(m.to(next(layer.parameters()).device))
        install_transitions(layer, mods[0], mods[1])
    return {"transition_error_mean": sum(errors) / len(errors), "transition_error_max": max(errors)}


@torch.no_grad()
def round_storage(model, cfg: QuantConfig) -> None:
    if cfg.w_bits >= 16:
        return
    for w in (model.get_input_embeddings().weight, model.lm_head.weight):
        w.copy_(w.half().to(w.dtype))


def quantize_(model, config: QuantConfig, calib: torch.Tensor | None = None) -> dict:
    """Quantize ``model`` in place with ``config`` (a method's config dataclass); returns a report."""
    config.validate()
    entry = METHODS.get(config.method)
    rotate = entry[1]
    rot_mod.check_supported(model)
    report: dict = {"method": config.method}
    t0 = time.perf_counter()
    rot, extra = rotate(model, config, calib)
    report.update(extra)
    rotated = rot is not None
    if rotated:
        rank = getattr(config, "rank", None)
        if rank is not None and not rot.tied:
            report.update(install_low_rank_transitions(model, rot, rank))
    report["rotation_seconds"] = time.perf_counter() - t0
    _replace_linears(model, config, rotated)
    t1 = time.perf_counter()
    info(f"quantizing weights ({config.weight_algorithm}, {config.w_bits} bits)")
    quantize_weights(model, config, calib)
    report["weight_quant_seconds"] = time.perf_counter() - t1
    enable_activation_quant(model, config)
    round_storage(model, config)
    report["rotations"] = rot
    return report

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
import torch

from llmtool.core import arch
from llmtool.core.calib import InputStatistics, replay_layers
from llmtool.core.console import UsageError, info, progress
from llmtool.core.models import decoder_layers
from llmtool.quantize import rotations as rot_mod
from llmtool.quantize.gptq import gptq_weight
from llmtool.quantize.modules import (LowRankTransition, QuantExperts, QuantLinear, enable_kv_quant,
                                      install_transitions)
from llmtool.quantize.configs import METHODS, QuantConfig  # noqa: F401  (METHODS re-exported)
from llmtool.quantize.quantizers import rtn_weight


def block_quant_linears(layer) -> dict[str, QuantLinear]:
    """module name (role, or fused name such as ``qkv``, or ``experts.E.gate_up`` / ``experts.E.down`` of an
    MoE layer once its experts are :class:`QuantExperts`) -> block Linear of a decoder layer (QuantLinear
    once replaced)."""
    return arch.block_linears(layer)   # QuantExperts lists its per-expert QuantLinears


def _replace_linears(model, cfg: QuantConfig, rotated: bool) -> None:
    for layer in decoder_layers(model):
        for role, lin in arch.block_linears(layer).items():
            q = QuantLinear.from_linear(lin, a_symmetric=cfg.a_symmetric, a_clip_ratio=cfg.a_clip_ratio,
                                        online_hadamard=rotated and role == "down")
            arch.set_linear(layer, role, q)
        if arch.is_moe_layer(layer):   # routed experts: per-expert QuantLinears (the router stays in float)
            spec = arch.arch_of_layer(layer)
            ex = arch.experts(layer)
            q = QuantExperts.from_experts(ex, getattr(ex, spec.experts.gate_up), getattr(ex, spec.experts.down),
                                          online_hadamard=rotated, a_symmetric=cfg.a_symmetric,
                                          a_clip_ratio=cfg.a_clip_ratio)
            arch.set_module(layer, spec.experts.path, q)


@torch.no_grad()
def quantize_weights(model, cfg: QuantConfig, calib: torch.Tensor | None) -> None:
    """RTN, or GPTQ layer by layer: each layer's Hessians ``X^T X`` (float32, of the inputs each QuantLinear
    sees after its online Hadamard) come from the outputs of the already-quantized previous layers."""
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
    for step in replay_layers(model, calib, desc="gptq layers"):
        linears = block_quant_linears(step.layer)
        hess = InputStatistics(dtype=torch.float32)
        for role, q in linears.items():
            q.observer = lambda x, role=role: hess.add(role, x)
        step.forward()
        for q in linears.values():
            q.observer = None
        for role, q in linears.items():
            if role not in hess.gram:   # an expert no calibration token was routed to: no Hessian, RTN
                codes, scale = rtn_weight(q.weight, cfg.w_bits, cfg.w_clip)
            else:
                codes, scale = gptq_weight(q.weight, hess.gram[role], cfg.w_bits, cfg.w_clip, cfg.gptq_damp,
                                           cfg.gptq_block_size)
            q.set_quantized(codes.to(q.weight.device), scale, cfg.w_bits)


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
            dense = torch.eye(hidden, dtype=torch.float64, device=t.device) + basis @ core @ basis.T
            errors.append(float(torch.linalg.norm(dense - t)))
            mods.append(m.to(next(layer.parameters()).device))
        install_transitions(layer, mods[0], mods[1])
    return {"transition_error_mean": sum(errors) / len(errors), "transition_error_max": max(errors)}


@torch.no_grad()
def round_storage(model, cfg: QuantConfig) -> None:
    if cfg.w_bits >= 16:
        return
    for w in (arch.embed(model).weight, arch.lm_head(model).weight):
        w.copy_(w.half().to(w.dtype))


def quantize_(model, config: QuantConfig, calib: torch.Tensor | None = None) -> dict:
    """Quantize ``model`` in place with ``config`` (a method's config dataclass); returns a report."""
    config.validate()
    METHODS.get(config.name)
    rot_mod.check_supported(model, config.name, getattr(config, "train_steps", 0))
    report: dict = {"method": config.name}
    t0 = time.perf_counter()
    rot, extra = config.rotate(model, calib)
    report.update(extra)
    rotated = rot is not None
    if rotated:
        rank = getattr(config, "rank", None)
        if rank is not None and not rot.tied:
            hidden = model.config.hidden_size
            if 0 < rank < hidden and rot_mod.online_pre_norm_gains(model):
                info(f"warning: ReSpinQuant rank {rank} on a sandwich-norm family "
                     f"({getattr(model.config, 'model_type', '?')}): on Gemma 3 270M rank 32 broke the model "
                     f"(ppl 5.9e5 at W4A4) where --rank {hidden} (the hidden size) matched QuaRot; "
                     "see docs/quantize.md")
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

"""ReSpinQuant (Kim et al., ICML 2026, arXiv 2604.11080): layer-wise learned rotations fused offline,
with a low-rank orthogonal approximation of the residual basis changes.

Equations implemented (row vectors, see :mod:`.rotations` for the fusion rules):
* independent dense rotations per layer — ``R1[i]`` (stream entering layer i, read by q/k/v and
  written by the previous down_proj / the embedding), ``R2[i]`` (written by o_proj, read by gate/up),
  ``R3[i]`` (per-head value/output rotation) — all fused into the weights;
* the residual connections change basis: ``h_mid = h T_attn + Attn(h)``, ``T_attn = R1[i]ᵀ R2[i]``;
  ``h_out = h_mid T_ffn + FFN(h_mid)``, ``T_ffn = R2[i]ᵀ R1[i+1]`` — exact (dense) while training;
* after training each T is replaced by ``T̂ = I + Q (polar(QᵀTQ) − I) Qᵀ`` with Q the top-``rank``
  left singular vectors of ``T − I`` (stored as ``basis``/``core``; O(rD) per token online);
* initialisation: every R1/R2 the same deterministic normalised Hadamard H_D (all T = I at step 0),
  R3 independent random Hadamards; online Hadamard on the down_proj input (fused in W_down);
* learning: next-token cross-entropy of the fake-quantized rotated model (weights per-channel
  symmetric RTN with straight-through rounding, activations per-token with the configured bits and
  symmetry, KV as configured), gradients only into the rotations, effective weights recomputed
  from the frozen weights at every step, Cayley SGD with a cosine learning-rate schedule
  (:class:`.rotations.CayleySGD`, lr 1.5, weight decay 0);
* then GPTQ on the fused, rotated model (shared pipeline in :mod:`.api`).

Reconstructed / scaled-down choices (documented in docs/quantize.md):
* CPU recipe: ``train_steps`` = 16 steps of ``train_batch`` = 1 sequence of ``train_seqlen`` = 256
  tokens (the paper: 100 steps × 8 × 2048 of WikiText-2). Training sequences are the calibration
  windows (cropped to ``train_seqlen``), cycled in order; GPTQ uses the full windows.
* float32 forward during training (the paper uses bf16 on GPU); rotations always float32.
* SpinQuant (``--method spinquant``) is the special case with one global R shared by every R1/R2
  (transitions are exactly I and none is installed); ``rank = 0`` drops the transitions (T̂ = I) and
  ``rank = D`` keeps them exactly — the paper's ablation brackets.
"""
from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from llmtool.core import arch
from llmtool.core.console import info, progress
from llmtool.core.models import decoder_layers
from llmtool.kernels.hadamard import hadamard_transform
from llmtool.quantize import rotations as R
from llmtool.quantize.configs import QuantConfig, RotationTrainingConfig
from llmtool.quantize.modules import (DenseTransition, disable_kv_quant, enable_kv_quant, install_post_norm_rotations,
                                      install_transitions, pre_norm_matrices, remove_transitions)
from llmtool.quantize.quantizers import fake_quant_act_ste, fake_quant_weight_ste


class _TrainLinear(nn.Module):
    """A block Linear during rotation learning: weight set each step, fake-quantized with STE."""

    def __init__(self, cfg: QuantConfig, online_hadamard: bool):
        super().__init__()
        self.cfg, self.online_hadamard = cfg, online_hadamard
        self.weight_eff = None
        self.bias_eff = None   # rotated bias (Qwen2's q/k/v), kept in float like QuantLinear's

    def forward(self, x):
        if self.online_hadamard:
            x = hadamard_transform(x)
        x = fake_quant_act_ste(x, self.cfg.a_bits, self.cfg.a_symmetric, self.cfg.a_clip_ratio)
        y = F.linear(x, fake_quant_weight_ste(self.weight_eff, self.cfg.w_bits))
        return y if self.bias_eff is None else y + self.bias_eff.to(y.dtype)


class _TrainExperts(nn.Module):
    """An MoE layer's routed experts during rotation learning: effective 3-D weights set each step
    (gate_up ``· R2``, down ``R1ᵀ ·``), each expert's matrices fake-quantized like a block Linear, the
    online Hadamard on each down input; the same routed sum as transformers' experts module."""

    def __init__(self, cfg: QuantConfig, act_fn, n: int):
        super().__init__()
        self.cfg, self.act_fn, self.num_experts = cfg, act_fn, n
        self.gate_up_eff = self.down_eff = None

    def forward(self, hidden_states, top_k_index, top_k_weights):
        out = torch.zeros_like(hidden_states)
        c = self.cfg
        for e in range(self.num_experts):
            tok, pos = torch.where(top_k_index == e)
            if tok.numel() == 0:
                continue
            x = fake_quant_act_ste(hidden_states[tok], c.a_bits, c.a_symmetric, c.a_clip_ratio)
            gate, up = F.linear(x, fake_quant_weight_ste(self.gate_up_eff[e], c.w_bits)).chunk(2, dim=-1)
            h = hadamard_transform(self.act_fn(gate) * up)
            h = fake_quant_act_ste(h, c.a_bits, c.a_symmetric, c.a_clip_ratio)
            y = F.linear(h, fake_quant_weight_ste(self.down_eff[e], c.w_bits)) * top_k_weights[tok, pos, None]
            out = out.index_add(0, tok, y.to(out.dtype))
        return out


@contextlib.contextmanager
def training_view(model, rot: R.RotationSet, cfg: QuantConfig):
    """Temporarily turn the prepared model into the differentiable fake-quantized rotated model.
    Yields ``refresh()`` which recomputes every effective weight and transition from ``rot``."""
    layers = decoder_layers(model)
    spec = arch.arch_of(model)
    saved, frozen, train_mods, bias_frozen = [], [], [], []
    for layer in layers:
        orig, mods, keep = {}, {}, {}
        moe = arch.is_moe_layer(layer)
        roles = arch.ATTENTION_ROLES if moe else arch.ROLES
        orig = {role: arch.role_weight(layer, role).detach() for role in roles}
        orig_b = {role: arch.role_bias(layer, role) for role in roles}
        if moe:   # the experts (3-D) and the router read R2 / write R1[i+1], recomputed each step
            ex, router = arch.experts(layer), arch.router(layer)
            orig.update(gate_up=getattr(ex, spec.experts.gate_up).detach(),
                        down=getattr(ex, spec.experts.down).detach(), router=router.weight.detach())
            keep["experts"] = ex
            keep["router_weight"] = router.weight
            mods["experts"] = _TrainExperts(cfg, ex.act_fn, orig["gate_up"].shape[0])
            arch.set_module(layer, spec.experts.path, mods["experts"])
            del router.weight
        bias_frozen.append({r: None if b is None else b.detach() for r, b in orig_b.items()})
        for name, lin in arch.block_linears(layer).items():   # a fused qkv_proj / gate_up_proj: one module
            keep[name] = lin
            mods[name] = _TrainLinear(cfg, online_hadamard=name == "down")
            arch.set_linear(layer, name, mods[name])
        install_transitions(layer, DenseTransition(), DenseTransition())
        if R.post_norms(model):   # sandwich norms: the online rotation after each post-norm, learned with the rest
            eye = torch.eye(arch.hidden_size(model))
            install_post_norm_rotations(layer, eye, eye)
        saved.append(keep)
        frozen.append(orig)
        train_mods.append(mods)
    n = len(layers)
    h_emb = arch.embed(model).register_forward_hook(lambda m, i, o: o @ rot.r1(0).to(o.dtype))
    h_lm = arch.lm_head(model).register_forward_pre_hook(lambda m, a: (a[0] @ rot.r1(n).T.to(a[0].dtype),))
    if cfg.kv_bits < 16:
        enable_kv_quant(model, layers, cfg.kv_bits, cfg.kv_group_size)

    def refresh():
        for i, layer in enumerate(layers):
            w = R.layer_weights(frozen[i], rot, i, model.config)
            b = R.layer_biases(bias_frozen[i], rot, i, model.config)
            for name, mod in train_mods[i].items():
                if name == "experts":
                    mod.gate_up_eff, mod.down_eff = w["gate_up"], w["down"]
                    arch.router(layer).weight = w["router"]
                    continue
                fused = spec.fused.get(name)
                mod.weight_eff = torch.cat([w[r] for r in fused.roles]) if fused else w[name]
                roles = fused.roles if fused else (name,)
                if any(r in b for r in roles):
                    mod.bias_eff = torch.cat([b[r] for r in roles]) if fused else b[name]
            t_attn, t_ffn = R.transitions(rot, i)
            layer.attn_transition.matrix, layer.mlp_transition.matrix = t_attn, t_ffn
            if R.post_norms(model):
                arch.attn_out_norm(layer).live, arch.mlp_out_norm(layer).live = rot.r2(i), rot.r1(i + 1)
            pre = pre_norm_matrices(layer)
            if pre is not None:   # the pre-norm gains diag(g) (rotations.prepare), in the learned bases
                for m, r in zip(pre, (rot.r1(i), rot.r2(i))):
                    m.live = r.T @ (m.rotation.to(r.dtype) @ r)

    try:
        yield refresh
    finally:
        h_emb.remove()
        h_lm.remove()
        for layer, keep in zip(layers, saved):
            remove_transitions(layer)
            for path in (spec.attn_out_norm, spec.mlp_out_norm) if R.post_norms(model) else ():
                arch.set_module(layer, path, layer.get_submodule(path).norm)   # fuse() installs the final ones
            for pre in pre_norm_matrices(layer) or ():
                pre.live = None   # the pre-norm wrappers stay (diag(g)); fuse() conjugates them
            for role, lin in keep.items():
                if role == "experts":
                    arch.set_module(layer, spec.experts.path, lin)
                elif role == "router_weight":
                    router = arch.router(layer)
                    if "weight" in router.__dict__:
                        del router.weight
                    router.weight = lin
                else:
                    arch.set_linear(layer, role, lin)
        if cfg.kv_bits < 16:
            disable_kv_quant(model)


def learn_rotations(model, rot: R.RotationSet, calib: torch.Tensor, cfg: RotationTrainingConfig) -> list[float]:
    """Cayley-SGD the rotations on the fake-quantized CE loss; returns the loss per step."""
    for p in model.parameters():
        p.requires_grad_(False)
    opt = R.CayleySGD(rot.matrices(), lr=cfg.lr)
    losses = []
    data = calib[:, : cfg.train_seqlen]
    device = next(model.parameters()).device
    with training_view(model, rot, cfg) as refresh:
        for step in progress(range(cfg.train_steps), "rotation steps"):
            lr = cfg.lr * 0.5 * (1 + math.cos(math.pi * step / max(1, cfg.train_steps)))
            idx = [(step * cfg.train_batch + j) % data.shape[0] for j in range(cfg.train_batch)]
            batch = data[idx].to(device)
            refresh()
            out = model(input_ids=batch, labels=batch, use_cache=False)
            out.loss.backward()
            opt.step(lr)
            opt.zero_grad()
            losses.append(float(out.loss.detach()))
    info(f"rotation learning: CE {losses[0]:.3f} -> {losses[-1]:.3f} over {len(losses)} steps")
    return losses


def build_rotations(model, cfg: QuantConfig, tied: bool) -> R.RotationSet:
    g = torch.Generator().manual_seed(cfg.seed)
    return R.RotationSet.hadamard_init(len(decoder_layers(model)), arch.hidden_size(model), arch.head_dim(model), tied=tied,
                                       generator=g, dtype=torch.float32)


def rotate(model, config: RotationTrainingConfig, calib, tied: bool):
    R.prepare(model)
    R.fuse_down_hadamard(model)
    rot = build_rotations(model, config, tied).to(next(model.parameters()).device)
    losses = []
    if config.train_steps > 0:
        if calib is None:
            raise ValueError("rotation learning needs calibration data")
        losses = learn_rotations(model, rot, calib, config)
    R.fuse(model, rot)
    return rot, {"train_losses": losses}

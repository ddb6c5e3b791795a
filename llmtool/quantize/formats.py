"""On-disk format of quantized checkpoints (``llmtool_quant``, format version 1) and its loader.

Directory: ``config.json`` (the source config with ``tie_word_embeddings: false`` when rotated, plus a
top-level ``"llmtool_quant"`` block: method, format_version, weights {bits, symmetric, granularity,
algorithm}, activations {bits, symmetric, granularity: per_token, dynamic, clip_ratio}, kv_cache
{bits, group_size, symmetric}, online_hadamard {qk_after_rope, down_proj_input, sizes},
residual_transition {rank, dtype} or null), ``model.safetensors``, tokenizer files, ``llmtool.json``.

Tensors (compressed-tensors "pack-quantized" naming): every quantized block Linear ``P`` stores
``P.weight_packed`` (uint8; int4: two codes per byte, low nibble first — the same bytes as
compressed-tensors' little-endian int32 words; int3: 8 codes in 3 bytes), ``P.weight_scale``
(fp16 [out, 1]) and ``P.weight_shape`` (int64 [2]); the weight is ``scale · (code − 2^(b−1))``.
Embedding and lm_head are fp16, norms float32 (all ones after gain folding), and ReSpinQuant adds
``model.layers.{i}.attn_transition.{basis,core}`` / ``mlp_transition.{basis,core}`` (float32); a rotated
Gemma (``post_norm_rotation: true``) stores each sandwich post-norm as ``...{post_attention,post_feedforward}
_layernorm.norm.weight`` plus its online ``rotation`` [D, D] (float32), and (``pre_norm_gain_online: true``)
each pre-norm as ``...{input,pre_feedforward}_layernorm.norm.weight`` (unit gain) plus its online
``rotation`` ``Rᵀ diag(g) R`` [D, D] (float32).
The file is not servable by vLLM (the transitions and the online Hadamard need llmtool's modules);
``llmtool.load(dir)`` rebuilds the model and reproduces the in-memory quantized model exactly.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

from llmtool.core.checkpoint import copy_tokenizer, load_state_dict, mark_llmtool_format, save_state_dict
from llmtool.core.console import UsageError
from llmtool.core.models import decoder_layers

FORMAT_VERSION = 1
KEY = "llmtool_quant"


def quant_block(cfg, rotated: bool, rank: int | None, model_config) -> dict:
    from llmtool.kernels.hadamard import factorize

    return {
        "method": cfg.method, "format_version": FORMAT_VERSION,
        "weights": {"bits": cfg.w_bits, "symmetric": True, "granularity": "per_channel",
                    "algorithm": cfg.weight_algorithm if cfg.w_bits < 16 else "none", "clip_search": cfg.w_clip},
        "activations": {"bits": cfg.a_bits, "symmetric": cfg.a_symmetric, "granularity": "per_token",
                        "dynamic": True, "clip_ratio": cfg.a_clip_ratio},
        "kv_cache": {"bits": cfg.kv_bits, "group_size": cfg.kv_group_size, "symmetric": False},
        "online_hadamard": {"qk_after_rope": cfg.kv_bits < 16, "down_proj_input": rotated,
                            "sizes": {"down_proj_input": model_config.intermediate_size,
                                      "factorization": list(factorize(model_config.intermediate_size))}},
        "residual_transition": None if rank is None else {"rank": int(rank), "dtype": "float32"},
        # sandwich post-norms (Gemma) under a rotation: each post-norm output is rotated online
        # (``...post_attention_layernorm.{norm.weight,rotation}``, ``...post_feedforward_layernorm.{...}``)
        "post_norm_rotation": bool(rotated and _post_norms(model_config)),
        # and each pre-norm keeps its gain online: unit-gain norm, then ``Rᵀ diag(g) R``
        # (``...{input,pre_feedforward}_layernorm.{norm.weight,rotation}``)
        "pre_norm_gain_online": bool(rotated and _post_norms(model_config)),
    }


def _post_norms(model_config) -> bool:
    from llmtool.core import arch

    return arch.is_supported(model_config) and bool(arch.arch_of(model_config).attn_out_norm)


def storage_tensors(model, block: dict) -> dict[str, torch.Tensor]:
    """The tensors written to model.safetensors, in their stored dtypes."""
    from llmtool.core.arch import arch_of

    quantized = block["weights"]["bits"] < 16
    family = arch_of(model)
    fp16 = {f"{family.embed}.weight", f"{family.lm_head}.weight"}
    tensors = {}
    for name, t in model.state_dict().items():
        if t.is_floating_point() and not name.endswith("weight_scale"):
            if quantized and name in fp16:
                t = t.half()
            elif "transition" in name:
                t = t.float()
            elif quantized:
                t = t.float()
        tensors[name] = t
    if model.config.tie_word_embeddings:
        tensors.pop(f"{family.lm_head}.weight", None)
    return tensors


def save_quantized(model, out_dir: Path, source_dir: Path, block: dict) -> None:
    out_dir = Path(out_dir)
    config = json.loads((Path(source_dir) / "config.json").read_text())
    config["tie_word_embeddings"] = bool(model.config.tie_word_embeddings)
    config[KEY] = block
    config = mark_llmtool_format(config, "llmtool_quant", "LlmtoolQuantForCausalLM")
    save_state_dict(storage_tensors(model, block), out_dir)
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    copy_tokenizer(source_dir, out_dir)


def build_structure(model, block: dict) -> None:
    """Give a freshly built HF model the llmtool_quant modules described by ``block``."""
    from llmtool.core import arch
    from llmtool.quantize.modules import (LowRankTransition, QuantExperts, QuantLinear, enable_kv_quant,
                                          install_post_norm_rotations, install_pre_norm_matrices,
                                          install_transitions)

    w, a, kv = block["weights"], block["activations"], block["kv_cache"]
    had = block["online_hadamard"]["down_proj_input"]
    trans = block.get("residual_transition")
    hidden = model.config.hidden_size
    for layer in decoder_layers(model):
        for role, lin in arch.block_linears(layer).items():
            q = QuantLinear(lin.in_features, lin.out_features, w_bits=16, a_bits=a["bits"],
                            a_symmetric=a["symmetric"], a_clip_ratio=a["clip_ratio"],
                            online_hadamard=had and role == "down", dtype=lin.weight.dtype,
                            bias=lin.bias is not None)
            if w["bits"] < 16:
                del q.weight
                q.w_bits = w["bits"]
                from llmtool.kernels.intpack import packed_width

                q.register_buffer("weight_packed", torch.zeros(lin.out_features, packed_width(lin.in_features, w["bits"]),
                                                               dtype=torch.uint8))
                q.register_buffer("weight_scale", torch.ones(lin.out_features, 1, dtype=torch.float16))
                q.register_buffer("weight_shape", torch.zeros(2, dtype=torch.int64))
            arch.set_linear(layer, role, q)
        if arch.is_moe_layer(layer):   # routed experts as per-expert QuantLinears (QuantExperts)
            spec = arch.arch_of_layer(layer)
            ex = arch.experts(layer)
            n, two_i, d = getattr(ex, spec.experts.gate_up).shape
            arch.set_module(layer, spec.experts.path, QuantExperts(
                n, d, two_i // 2, ex.act_fn, online_hadamard=had, dtype=getattr(ex, spec.experts.gate_up).dtype,
                w_bits=w["bits"], a_bits=a["bits"], a_symmetric=a["symmetric"], a_clip_ratio=a["clip_ratio"]))
        if trans is not None:
            install_transitions(layer, LowRankTransition(hidden, trans["rank"]), LowRankTransition(hidden, trans["rank"]))
        if block.get("post_norm_rotation"):
            eye = torch.eye(hidden)
            install_post_norm_rotations(layer, eye, eye)
        if block.get("pre_norm_gain_online"):
            eye = torch.eye(hidden)
            install_pre_norm_matrices(layer, eye, eye)
    if kv["bits"] < 16:
        enable_kv_quant(model, decoder_layers(model), kv["bits"], kv["group_size"])


def load_checkpoint(path, config: dict, dtype, device):
    """Rebuild a quantized model from an llmtool_quant directory (``llmtool.load`` calls this)."""
    from transformers import AutoModelForCausalLM

    from llmtool.core.arch import arch_of
    from llmtool.core.models import hf_config as read_hf_config

    block = config[KEY]
    if block.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}/config.json: llmtool_quant.format_version {block.get('format_version')!r} "
                         f"is not supported (expected {FORMAT_VERSION})")
    hf_config = read_hf_config(path, config)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32)
    build_structure(model, block)
    sd = load_state_dict(Path(path))
    missing, unexpected = model.load_state_dict(sd, strict=False)
    allowed = {f"{arch_of(model).lm_head}.weight"} if config.get("tie_word_embeddings") else set()
    if set(missing) - allowed or unexpected:
        bad = sorted(set(missing) - allowed)[:3] or sorted(unexpected)[:3]
        raise UsageError(f"{path}/model.safetensors: tensors do not match the llmtool_quant layout ({bad})")
    if config.get("tie_word_embeddings"):
        model.tie_weights()
    if block["weights"]["bits"] < 16:
        with torch.no_grad():
            for w in (model.get_input_embeddings().weight, model.lm_head.weight):
                w.copy_(w.half().float())
    return model.to(dtype=dtype).to(device)

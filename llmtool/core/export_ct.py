"""compressed-tensors export of ``llmtool_quant`` checkpoints (``llmtool models export --format
compressed-tensors``, ``llmtool quantize --export compressed-tensors``).

The output is an ordinary transformers directory (the base architecture's config.json and safetensors)
whose ``quantization_config`` has ``quant_method: compressed-tensors``: transformers loads it through its
CompressedTensorsHfQuantizer (with the ``compressed-tensors`` package installed) and vLLM serves it. The
layout follows compressed-tensors 0.20.1 (:data:`CT_VERSION`); the writer needs neither that package nor
a model in memory: it converts the checkpoint's files tensor by tensor.

Mapping. llmtool stores each quantized block Linear ``P`` as unsigned codes ``c = q + 2^(b−1)``
(``q ∈ [−2^(b−1), 2^(b−1) − 1]``) packed in ``P.weight_packed`` (uint8), one fp16 scale per output row in
``P.weight_scale`` [out, 1] and ``P.weight_shape``; the weight is ``scale · q`` (symmetric, per channel,
RTN or GPTQ alike). That is compressed-tensors' ``strategy: channel, symmetric: true`` scheme:

* weight-only (A16), b ∈ {3, 4, 8} → format ``pack-quantized``: ``P.weight_packed`` int32
  [out, ⌈in·b/32⌉], the codes as one dense little-endian bit stream (element i at bit i·b, offset
  2^(b−1)), which is exactly llmtool's byte stream read as little-endian int32 words; ``P.weight_shape``
  int64 [2]; no ``weight_zero_point`` (symmetric).
* W8A8 → format ``int-quantized``: ``P.weight`` int8 [out, in] (``q``) and ``input_activations``
  ``{num_bits: 8, type: int, strategy: token, dynamic: true, symmetric: <as quantized>}``.
* ``P.weight_scale`` is written float32 [out, 1]: the same (fp16-representable) values, widened because
  compressed-tensors dequantizes in the scale's dtype and ``q · s`` is exact in float32 but not always in
  float16. So the weights compressed-tensors reconstructs equal llmtool's ``scale · q`` bit for bit; the
  writer checks that for every module (with compressed-tensors' own decompressor when it is installed).
* ``targets: ["Linear"]``, ``ignore``: every Linear of the base model that is not quantized (lm_head).
  Embeddings, lm_head and norms are copied at their stored dtypes (fp16 embeddings, float32 norms);
  config.json's ``dtype`` (the default load dtype) follows the global ``--dtype``.

Refused with a one-line error (exit 2) that suggests ``--format dense``: the online Hadamard before
down_proj of the rotating methods (QuaRot, SpinQuant, ReSpinQuant) — compressed-tensors' ``hadamard``
transform is Sylvester-only (powers of two, while llmtool's is ``H_m ⊗ H_2^k`` with Paley factors for
sizes such as 1536) and transformers drops ``transform_config`` when loading, so the model would load
without the rotation and silently compute something else; ReSpinQuant's residual transitions; KV-cache
quantization (with its head-dim Hadamard on Q and K); activation quantization other than W8A8 or with a
clip ratio below 1 (compressed-tensors' dynamic quantizer has no clip); unquantized weights (W16).

Activation quantization at W8A8 is the loader's own: for asymmetric activations (llmtool's default)
compressed-tensors' dynamic per-token quantizer computes the same scale ((max − min)/255) and zero point,
but rounds x/s + z after adding z in float32, so an element within float32 precision of a rounding boundary
lands one code away (about 1 in 4·10^5 on SmolLM2); for symmetric ones it divides max|x| by 127.5 where
llmtool (and vLLM's int8 kernel) divide by 127. The flips compound through the layers: transformers'
perplexity differs by 0.1–0.2% (benchmarks/results/export_check.md); the weights are identical.
"""
from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from llmtool.core.console import UsageError

if TYPE_CHECKING:
    import torch

CT_VERSION = "0.20.1"  # the compressed-tensors release whose format this writer follows
FORMAT = "compressed-tensors"
WEIGHT_ONLY_BITS = (3, 4, 8)


def refusal(w_bits: int, a_bits: int, a_clip_ratio: float, kv_bits: int, online_hadamard: bool,
            transitions: bool, symmetric: bool = True, granularity: str = "per_channel") -> str | None:
    """Why quantizer settings have no exact compressed-tensors form (None when they have one)."""
    if transitions:
        return "ReSpinQuant's residual transitions have no compressed-tensors equivalent"
    if online_hadamard:
        return ("the online Hadamard before down_proj (QuaRot/SpinQuant/ReSpinQuant) has no exact compressed-tensors "
                "form (its hadamard transform is Sylvester-only and transformers ignores transform_config)")
    if kv_bits < 16:
        return f"KV-cache quantization (KV{kv_bits}, with a head-dim Hadamard on Q and K) has no compressed-tensors equivalent"
    if w_bits >= 16:
        return "the weights are not quantized (W16): nothing to pack"
    if not symmetric or granularity != "per_channel":
        return f"weight quantization ({'symmetric' if symmetric else 'asymmetric'} {granularity}) is not supported"
    if a_bits < 16 and not (a_bits == 8 and w_bits == 8):
        return f"W{w_bits}A{a_bits}: only weight-only (A16) and W8A8 are exported"
    if a_bits < 16 and a_clip_ratio != 1.0:
        return f"activation clip ratio {a_clip_ratio}: compressed-tensors' dynamic quantizer does not clip"
    if a_bits >= 16 and w_bits not in WEIGHT_ONLY_BITS:
        return f"W{w_bits}A16 is not supported"
    return None


def check_block(block: dict, where: str, alternative: str = "--format dense") -> None:
    """Refuse (UsageError, one line) an ``llmtool_quant`` block that has no exact compressed-tensors form."""
    w, a = block["weights"], block["activations"]
    why = refusal(w_bits=w["bits"], a_bits=a["bits"], a_clip_ratio=a.get("clip_ratio", 1.0),
                  kv_bits=block["kv_cache"]["bits"], online_hadamard=bool(block["online_hadamard"]["down_proj_input"]
                                                                       or block["online_hadamard"]["qk_after_rope"]),
                  transitions=block.get("residual_transition") is not None, symmetric=w.get("symmetric", True),
                  granularity=w.get("granularity", "per_channel"))
    if why:
        raise UsageError(f"{where}: cannot export to compressed-tensors: {why}; use {alternative} "
                         "(a plain transformers checkpoint of the dequantized weights)")


def quantization_config(block: dict, ignore: list[str]) -> dict:
    """config.json's ``quantization_config`` for an exportable ``llmtool_quant`` block."""
    w, a = block["weights"], block["activations"]
    act = None
    if a["bits"] < 16:
        act = {"num_bits": a["bits"], "type": "int", "symmetric": bool(a["symmetric"]), "group_size": None,
               "strategy": "token", "dynamic": True}
    fmt = "int-quantized" if act is not None else "pack-quantized"
    qc = {
        "config_groups": {"group_0": {
            "targets": ["Linear"],
            "weights": {"num_bits": w["bits"], "type": "int", "symmetric": True, "group_size": None,
                        "strategy": "channel", "dynamic": False},
            "input_activations": act, "output_activations": None, "format": fmt}},
        "format": fmt, "global_compression_ratio": None, "ignore": list(ignore), "kv_cache_scheme": None,
        "quant_method": "compressed-tensors", "quantization_status": "compressed", "sparsity_config": {},
        "transform_config": {}, "version": CT_VERSION,
    }
    try:
        from compressed_tensors.quantization import QuantizationConfig
    except ImportError:
        return qc
    QuantizationConfig.model_validate(qc)  # the library's own schema check, when it is installed
    return qc


def _ct():
    try:
        import compressed_tensors
    except ImportError:
        return None
    return compressed_tensors


def int32_words(packed: torch.Tensor) -> torch.Tensor:
    """llmtool's packed bytes [rows, n] (a dense little-endian bit stream per row) as compressed-tensors'
    int32 words [rows, ⌈n/4⌉] (zero padding), independent of the host's byte order."""
    import torch

    rows, n = packed.shape
    pad = (-n) % 4
    b = torch.nn.functional.pad(packed.to(torch.int64), (0, pad)).reshape(rows, -1, 4)
    words = b[..., 0] | (b[..., 1] << 8) | (b[..., 2] << 16) | (b[..., 3] << 24)
    return torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)


def pack_codes(packed: torch.Tensor, codes: torch.Tensor, bits: int) -> torch.Tensor:
    """``weight_packed`` of one module. With compressed-tensors installed its own ``pack_to_int32`` packs the
    signed values (the library defines the layout its loaders read, so the file is by construction what it
    unpacks); without it the same words come from llmtool's bytes (:func:`int32_words`; a test checks both
    agree for 3, 4 and 8 bits)."""
    import torch

    if _ct() is not None:
        from compressed_tensors.compressors.pack_quantized.helpers import pack_to_int32

        return pack_to_int32((codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8), bits)
    return int32_words(packed)


def _reconstruct(fmt: str, tensors: dict, qc: dict) -> torch.Tensor:
    """The weight a loader rebuilds from one module's exported tensors: compressed-tensors' own decompressor
    when installed, else this module's reading of the format (the inverse of :func:`pack_codes`)."""
    import torch

    if _ct() is not None:
        from compressed_tensors.compressors import BaseCompressor
        from compressed_tensors.quantization import QuantizationScheme

        scheme = QuantizationScheme.model_validate(qc["config_groups"]["group_0"])
        return BaseCompressor.get_value_from_registry(fmt).decompress(dict(tensors), scheme)["weight"]
    scale = tensors["weight_scale"]
    if fmt == "int-quantized":
        return tensors["weight"].to(scale.dtype) * scale
    bits = qc["config_groups"]["group_0"]["weights"]["num_bits"]
    out, cols = (int(v) for v in tensors["weight_shape"])
    w = tensors["weight_packed"].to(torch.int64) & 0xFFFFFFFF
    stream = torch.stack([(w >> (8 * k)) & 255 for k in range(4)], dim=-1).reshape(out, -1)
    bitpos = torch.arange(cols, dtype=torch.int64) * bits
    raw = (stream[:, bitpos // 8] | (stream[:, (bitpos // 8 + 1).clamp(max=stream.shape[1] - 1)] << 8)) >> (bitpos % 8)
    q = (raw & (2 ** bits - 1)) - 2 ** (bits - 1)
    return q.to(scale.dtype) * scale


def convert_module(name: str, packed: torch.Tensor, scale: torch.Tensor, shape: torch.Tensor, block: dict,
                   qc: dict) -> dict[str, torch.Tensor]:
    """The compressed-tensors tensors (local names) of one llmtool QuantLinear, checked to dequantize to
    llmtool's ``scale · (code − 2^(b−1))`` exactly."""
    import torch

    from llmtool.kernels.intpack import unpack

    bits = block["weights"]["bits"]
    fmt = qc["format"]
    codes = unpack(packed, bits)
    out, cols = (int(v) for v in shape)
    if tuple(codes.shape) != (out, cols):
        raise UsageError(f"{name}.weight_packed of shape {tuple(packed.shape)} does not hold a {out}x{cols} "
                         f"{bits}-bit weight")
    s32 = scale.float().reshape(out, 1)
    if fmt == "int-quantized":
        tensors = {"weight": (codes.to(torch.int16) - 2 ** (bits - 1)).to(torch.int8), "weight_scale": s32}
    else:
        tensors = {"weight_packed": pack_codes(packed, codes, bits), "weight_scale": s32,
                   "weight_shape": torch.tensor([out, cols], dtype=torch.int64)}
    ours = (codes.float() - 2 ** (bits - 1)) * s32
    theirs = _reconstruct(fmt, tensors, qc)
    if theirs.dtype != torch.float32 or not torch.equal(theirs, ours):
        raise RuntimeError(f"compressed-tensors export: the reconstructed weight of {name} differs from llmtool's "
                           f"(max |diff| {float((theirs.float() - ours).abs().max()):.3g}); nothing was written")
    return tensors


def base_linears(config: dict, path: Path) -> tuple[list[str], set[str]]:
    """Names of every nn.Linear of the base architecture and its state-dict keys (built on the meta device)."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtool.core.models import hf_config

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(hf_config(path, config))
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)], set(model.state_dict())


def convert(config: dict, keys: Iterable[str], get: Callable[[str], torch.Tensor], path: Path,
            dtype_name: str, progress: Callable = lambda xs, _desc: xs,
            alternative: str = "--format dense") -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, tensors) of the compressed-tensors export of the ``llmtool_quant`` checkpoint at
    ``path``, given as its config.json dict and tensor accessors."""
    from llmtool.core.checkpoint import base_config_dict

    where = str(path)
    if "llmtool_quant" not in config:
        raise UsageError(f"{where}: compressed-tensors export needs a quantized checkpoint of `llmtool quantize` "
                         f"(config.json has no llmtool_quant block); use {alternative}")
    block = config["llmtool_quant"]
    check_block(block, where, alternative)
    keys = list(keys)
    modules = sorted(k[: -len(".weight_packed")] for k in keys if k.endswith(".weight_packed"))
    linears, want = base_linears(config, path)
    if not modules or set(modules) - set(linears):
        raise UsageError(f"{where}: no quantized Linear modules found" if not modules else
                         f"{where}: {min(set(modules) - set(linears))} is not a Linear of the base model")
    qc = quantization_config(block, ignore=sorted(set(linears) - set(modules)))
    own = {f"{m}.{s}" for m in modules for s in ("weight_packed", "weight_scale", "weight_shape")}
    rest = [k for k in keys if k not in own]
    extra = sorted(set(rest) - want)
    if extra:
        raise UsageError(f"{where}: cannot export to compressed-tensors: {extra[0]} has no equivalent in the base "
                         f"architecture; use {alternative}")
    tensors: dict = {}
    for m in progress(modules, "compressed-tensors"):
        for k, v in convert_module(m, get(f"{m}.weight_packed"), get(f"{m}.weight_scale"), get(f"{m}.weight_shape"),
                                   block, qc).items():
            tensors[f"{m}.{k}"] = v
    for k in rest:
        tensors[k] = get(k)
    cfg = {k: v for k, v in base_config_dict(config).items() if not k.startswith("llmtool_")}
    cfg["dtype"] = dtype_name
    cfg.pop("torch_dtype", None)
    cfg["quantization_config"] = qc
    return cfg, tensors


def save_compressed_tensors(src: Path, out_dir: Path, dtype_name: str = "float32",
                            alternative: str = "--format dense") -> dict:
    """Write the compressed-tensors export of the llmtool_quant directory ``src`` into ``out_dir`` (config.json,
    safetensors, tokenizer files); returns ``{"ct_format", "scheme", "modules", "verified_with"}``."""
    from llmtool.core.checkpoint import (
        LazyCheckpoint,
        copy_tokenizer,
        read_config,
        save_state_dict,
    )
    from llmtool.core.console import progress

    src, out_dir = Path(src), Path(out_dir)
    config = read_config(src)
    ckpt = LazyCheckpoint(src)
    cfg, tensors = convert(config, ckpt.keys(), ckpt.get, src, dtype_name, progress, alternative)
    save_state_dict(tensors, out_dir)
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2, sort_keys=True) + "\n")
    copy_tokenizer(src, out_dir)
    qc = cfg["quantization_config"]
    g = qc["config_groups"]["group_0"]
    a = g["input_activations"]
    scheme = f"W{g['weights']['num_bits']}A{a['num_bits'] if a else 16}"
    return {"ct_format": qc["format"], "scheme": scheme, "modules": sum(1 for k in tensors if k.endswith(".weight_scale")),
            "verified_with": "compressed-tensors " + _ct().__version__ if _ct() is not None else "llmtool's reader"}

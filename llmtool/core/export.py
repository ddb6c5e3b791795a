"""Export of llmtool's own checkpoint formats to a plain transformers checkpoint (``llmtool models export``).

Low-rank factors and packed integer weights are read by ``llmtool.load`` only; a user who wants to serve
or fine-tune the result with other tools needs the dense equivalent. :func:`densify` replaces every module
that stands in for a Linear and implements ``to_dense_linear()`` (the protocol: return an ``nn.Linear``
computing the same map without activation quantization) by that Linear, then checks that what is left is
exactly the base architecture: its state-dict keys must equal those of a freshly built model of the same
config, so a module with no plain equivalent (ReSpinQuant's residual transitions) is refused by name
rather than dropped. Lossy parts of the stand-ins (activation quantization, KV-cache quantization) are
returned so the caller can report them; weights are exact (``B·A``, or ``scale·(code − zero)`` times the
folded online Hadamard).
"""
from __future__ import annotations

from pathlib import Path

import torch
from torch import nn

from llmtool.core.arch import set_module
from llmtool.core.console import UsageError


def densify(model: nn.Module) -> list[str]:
    """Replace stand-in modules by dense Linears in place; return what the dense model no longer does."""
    from transformers import AutoModelForCausalLM

    dropped: set[str] = set()
    for name, mod in list(model.named_modules()):
        if hasattr(mod, "to_dense_linear"):
            dense = mod.to_dense_linear()
            dropped.update(getattr(mod, "dense_export_drops", lambda: [])())
            set_module(model, name, dense)
    for name, mod in model.named_modules():
        if getattr(mod, "kv_bits", 16) < 16:  # the attention-module attribute of a quantized KV cache
            dropped.add("KV-cache quantization (and the head-dim Hadamard on Q and K, which cancels in QK^T)")
    with torch.device("meta"):
        reference = AutoModelForCausalLM.from_config(model.config)
    want, have = set(reference.state_dict()), set(model.state_dict())
    if model.config.tie_word_embeddings:
        want.discard("lm_head.weight")
        have.discard("lm_head.weight")
    extra, missing = sorted(have - want), sorted(want - have)
    if extra or missing:
        what = f"{extra[0]} has no equivalent in {type(reference).__name__}" if extra else f"{missing[0]} is missing"
        raise UsageError(f"cannot export to plain transformers: {what} "
                         f"({len(extra)} extra, {len(missing)} missing tensors)")
    return sorted(dropped)


def save_dense(model: nn.Module, out_dir: Path, dtype: torch.dtype | None = None) -> None:
    """Write ``model`` (after :func:`densify`) as an ordinary transformers checkpoint: base config.json
    (no llmtool block), safetensors weights."""
    from llmtool.core.checkpoint import save_state_dict

    cfg = model.config
    for key in ("llmtool_lowrank", "llmtool_quant", "llmtool_base_config"):
        if hasattr(cfg, key):
            delattr(cfg, key)
    if dtype is not None:
        model = model.to(dtype)
        cfg.torch_dtype = dtype
    state = {k: v.detach().contiguous() for k, v in model.state_dict().items()}
    if cfg.tie_word_embeddings:
        state.pop("lm_head.weight", None)
    save_state_dict(state, Path(out_dir))
    cfg.architectures = [type(model).__name__]
    cfg.save_pretrained(str(out_dir))
    if getattr(model, "generation_config", None) is not None:
        try:
            model.generation_config.save_pretrained(str(out_dir))
        except ValueError:
            pass

"""The factorised Linear layer and the on-disk low-rank checkpoint format (format version 1).

A factorised module ``P`` computes ``y = B (A x) (+ bias)`` and stores ``P.lowrank_a.weight``
``[r, in]`` and ``P.lowrank_b.weight`` ``[out, r]`` (and ``P.lowrank_b.bias`` if the original had a
bias). Modules kept dense keep ``P.weight``; everything else is the original state dict (tied
embeddings stay tied: ``lm_head.weight`` is not written twice).

``config.json`` is the source config plus a block::

    "llmtool_lowrank": {"format_version": 1, "method": "zs-svd", "ratio": 0.4,
                        "ranks": {"model.layers.0.self_attn.q_proj": 212, ...},
                        "dense": ["model.layers.3.mlp.up_proj", ...], "calibration": {...}, "stages": 1}

:func:`load_checkpoint` (called by ``llmtool.load`` through ``core.models.FORMAT_MODULES``) builds
the architecture from the config, swaps every module in ``ranks`` for a :class:`LowRankLinear`
and loads the weights with ``strict=True``.
"""
from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from torch import nn

from llmtool.core.arch import set_module  # noqa: F401  (re-exported: compress.pipeline imports it from here)
from llmtool.kernels.lowrank_matmul import lowrank_matmul

FORMAT_KEY = "llmtool_lowrank"
FORMAT_VERSION = 1


class LowRankLinear(nn.Module):
    """``y = B (A x) + bias`` with ``A = lowrank_a.weight [r, in]``, ``B = lowrank_b.weight [out, r]``."""

    def __init__(self, in_features: int, out_features: int, rank: int, bias: bool = False,
                 dtype: torch.dtype | None = None, device=None):
        super().__init__()
        self.in_features, self.out_features, self.rank = in_features, out_features, rank
        self.lowrank_a = nn.Linear(in_features, rank, bias=False, dtype=dtype, device=device)
        self.lowrank_b = nn.Linear(rank, out_features, bias=bias, dtype=dtype, device=device)

    @classmethod
    def from_factors(cls, a: torch.Tensor, b: torch.Tensor, bias: torch.Tensor | None = None,
                     dtype: torch.dtype | None = None) -> "LowRankLinear":
        dtype = dtype or a.dtype
        mod = cls(a.shape[1], b.shape[0], a.shape[0], bias=bias is not None, dtype=dtype, device=a.device)
        with torch.no_grad():
            mod.lowrank_a.weight.copy_(a.to(dtype))
            mod.lowrank_b.weight.copy_(b.to(dtype))
            if bias is not None:
                mod.lowrank_b.bias.copy_(bias.to(dtype))
        return mod

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return lowrank_matmul(x, self.lowrank_a.weight, self.lowrank_b.weight, self.lowrank_b.bias)

    def dense_weight(self) -> torch.Tensor:
        """``B A`` (the dense matrix this module represents)."""
        return self.lowrank_b.weight @ self.lowrank_a.weight

    def to_dense_linear(self) -> nn.Linear:
        """The ``nn.Linear`` with weight ``B A`` (``llmtool models export``; core.export's protocol)."""
        w = self.lowrank_b.weight
        lin = nn.Linear(self.in_features, self.out_features, bias=self.lowrank_b.bias is not None,
                        dtype=w.dtype, device=w.device)
        with torch.no_grad():
            lin.weight.copy_((self.lowrank_b.weight.double() @ self.lowrank_a.weight.double()).to(w.dtype))
            if lin.bias is not None:
                lin.bias.copy_(self.lowrank_b.bias)
        return lin

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, rank={self.rank}"


def swap_in_lowrank(model: nn.Module, ranks: dict[str, int]) -> None:
    """Replace each named Linear by an (uninitialised) LowRankLinear of the given rank."""
    for name, r in ranks.items():
        old = model.get_submodule(name)
        p = old.weight
        set_module(model, name, LowRankLinear(old.in_features, old.out_features, int(r),
                                              bias=old.bias is not None, dtype=p.dtype, device=p.device))


def unique_param_count(tensors: dict[str, torch.Tensor]) -> int:
    seen, n = set(), 0
    for t in tensors.values():
        key = (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape))
        if key not in seen:
            seen.add(key)
            n += t.numel()
    return n


def save_lowrank(model: nn.Module, out_dir: Path, config: dict, block: dict) -> dict:
    """Write the model's state dict and ``config.json`` (with the format block) into ``out_dir``.
    Returns ``{"params": stored parameter count, "files": [...]}``."""
    from llmtool.core.checkpoint import save_state_dict

    out_dir = Path(out_dir)
    state = model.state_dict()
    files = save_state_dict(state, out_dir)
    write_lowrank_config(out_dir, config, block)
    return {"params": unique_param_count(state), "files": [f.name for f in files]}


def write_lowrank_config(out_dir: Path, config: dict, block: dict) -> None:
    """``config.json`` of a low-rank checkpoint: the source config, the format block, and the llmtool-only
    architecture name (shared by :func:`save_lowrank` and the layer-streamed writer)."""
    from llmtool.core.checkpoint import mark_llmtool_format

    cfg = {k: v for k, v in config.items() if k != FORMAT_KEY}
    cfg[FORMAT_KEY] = {"format_version": FORMAT_VERSION, **block}
    cfg = mark_llmtool_format(cfg, "llmtool_lowrank", "LlmtoolLowRankForCausalLM")
    (Path(out_dir) / "config.json").write_text(json.dumps(cfg, indent=2))


def stored_param_count(model_dir: Path) -> int:
    """Number of parameters stored in the checkpoint's safetensors files."""
    from safetensors import safe_open

    from llmtool.core.checkpoint import weight_files

    n = 0
    for f in weight_files(model_dir):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                n += math.prod(h.get_slice(k).get_shape())
    return n


def load_checkpoint(path: Path, config: dict, dtype: torch.dtype, device: torch.device) -> nn.Module:
    """Rebuild a low-rank checkpoint written by :func:`save_lowrank` (``llmtool.load`` entry point)."""
    from transformers import AutoModelForCausalLM

    from llmtool.core.checkpoint import load_state_dict
    from llmtool.core.console import UsageError
    from llmtool.core.models import hf_config as read_hf_config

    block = config.get(FORMAT_KEY) or {}
    if block.get("format_version") != FORMAT_VERSION:
        raise UsageError(f"{path}/config.json: {FORMAT_KEY}.format_version must be {FORMAT_VERSION}, "
                         f"got {block.get('format_version')!r}")
    ranks = block.get("ranks")
    if not isinstance(ranks, dict):
        raise UsageError(f"{path}/config.json: {FORMAT_KEY}.ranks must be an object of module -> rank")
    hf_config = read_hf_config(path, config)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=dtype)
    from llmtool.core.experts import unfuse_experts

    unfuse_experts(model)   # an MoE checkpoint was compressed with its experts as per-expert Linears
    try:
        swap_in_lowrank(model, ranks)
    except AttributeError as e:
        raise UsageError(f"{path}/config.json: {FORMAT_KEY}.ranks names a module the model lacks ({e})") from None
    state = load_state_dict(path)
    tied = bool(getattr(hf_config, "tie_word_embeddings", False))
    expected = model.state_dict()
    for key in expected:
        if key not in state and tied and key.endswith("lm_head.weight"):
            emb = model.get_input_embeddings()
            emb_name = next(n for n, mod in model.named_modules() if mod is emb)
            state[key] = state[f"{emb_name}.weight"]
    try:
        model.load_state_dict({k: v.to(dtype) for k, v in state.items()}, strict=True)
    except RuntimeError as e:
        raise UsageError(f"{path}: weights do not match {FORMAT_KEY} config ({str(e).splitlines()[0]})") from None
    if tied:
        model.tie_weights()
    return model.to(device).eval()

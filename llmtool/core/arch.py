"""Architecture adapter: where a decoder-only causal LM keeps its blocks, and what is in a block.

Every area that reaches into a model (compression, quantization, editing, KV-cache methods) asks this
module instead of spelling module names itself. A family is one :class:`Arch` entry in
:data:`FAMILIES` (keyed by ``config.model_type``); adding a family that keeps the Llama layout under
other names is one entry.

Roles of the block Linears (:data:`ROLES`): ``q k v o`` (attention projections) and
``gate up down`` (gated MLP). Roles that read the same input (:data:`SHARED_INPUT`): ``k``/``v``
read what ``q`` reads (the attention-norm output), ``up`` reads what ``gate`` reads (the MLP-norm
output), so input statistics are gathered once per group.

API (``model`` is a loaded ``*ForCausalLM``; ``layer`` one decoder block)::

    arch = arch_of(model)                     # Arch of its family (UsageError when unsupported)
    decoder_layers(model)                     # the ModuleList of blocks (any family)
    layers_prefix(model)                      # "model.layers"
    linear(layer, "q") / linear_path("q")     # the module / "self_attn.q_proj"
    linear_names(model, roles)                # [[full names of layer 0], [layer 1], ...]
    attention(layer), mlp(layer)              # the attention / MLP sub-modules
    input_norm(layer), post_attention_norm(layer), final_norm(model)
    embed(model), lm_head(model)
    head_dim(config), n_heads(config), n_kv_heads(config)
    require(model, "quantize", bias_free=True)   # refuse what a command cannot handle
"""
from __future__ import annotations

import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from llmtool.core.console import UsageError

# torch is not imported here: arch_of/require on a config dict run in a command's preflight, before torch.
if TYPE_CHECKING:
    import torch

ROLES = ("q", "k", "v", "o", "gate", "up", "down")
ATTENTION_ROLES = ("q", "k", "v", "o")
MLP_ROLES = ("gate", "up", "down")
# role -> role whose input it reads (statistics of the latter serve both)
SHARED_INPUT = {"k": "q", "v": "q", "up": "gate"}


@dataclass(frozen=True)
class Arch:
    """Module paths of one family (relative to the model for model-level parts, to the block otherwise)."""

    family: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    post_attention_norm: str = "post_attention_layernorm"
    linears: dict = field(default_factory=lambda: {
        "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"})
    norm: str = "rmsnorm"
    # roles whose Linears may carry a bias in this family (Qwen2: q/k/v)
    biased_roles: tuple = ()

    def linear_path(self, role: str) -> str:
        try:
            return self.linears[role]
        except KeyError:
            raise ValueError(f"unknown block role {role!r}; roles: {', '.join(ROLES)}") from None


FAMILIES: dict[str, Arch] = {
    "llama": Arch("llama"),
    "mistral": Arch("mistral"),
    "qwen2": Arch("qwen2", biased_roles=("q", "k", "v")),
}

# where other decoder-only families keep their blocks (layer discovery only; no roles)
_OTHER_LAYER_PATHS = ("model.layers", "model.decoder.layers", "transformer.h", "gpt_neox.layers")


def _get(obj, path: str):
    for part in path.split("."):
        obj = getattr(obj, part)
    return obj


def _model_type(model_or_config) -> str:
    cfg = getattr(model_or_config, "config", model_or_config)
    if isinstance(cfg, dict):  # an llmtool-only format names its base family in llmtool_base_config
        base = cfg.get("llmtool_base_config") or {}
        return str(base.get("model_type") or cfg.get("model_type", "?"))
    return str(getattr(cfg, "model_type", "?"))


def supported_families() -> list[str]:
    return sorted(FAMILIES)


def is_supported(model_or_config) -> bool:
    return _model_type(model_or_config) in FAMILIES


def arch_of(model_or_config, command: str = "llmtool") -> Arch:
    """The :class:`Arch` of a model (or its config / config.json dict)."""
    mt = _model_type(model_or_config)
    if mt not in FAMILIES:
        raise UsageError(f"unsupported architecture model_type={mt!r} for `{command}` "
                         f"(supported: {', '.join(supported_families())})")
    return FAMILIES[mt]


def require(model_or_config, command: str, bias_free: bool = False) -> Arch:
    """``arch_of`` plus the checks a command needs: ``bias_free`` refuses families or checkpoints whose
    block Linears carry biases (a model, its HF config, or a config.json dict)."""
    arch = arch_of(model_or_config, command)
    if bias_free:
        cfg = _cfg(model_or_config)
        get = cfg.get if isinstance(cfg, dict) else (lambda k, d=None: getattr(cfg, k, d))
        biased = bool(get("attention_bias", False) or get("mlp_bias", False) or arch.biased_roles)
        torch = sys.modules.get("torch")  # a model can only exist once torch is imported
        if not biased and torch is not None and isinstance(model_or_config, torch.nn.Module):
            layer = decoder_layers(model_or_config)[0]
            biased = any(getattr(linear(layer, r, arch), "bias", None) is not None for r in ROLES)
        if biased:
            raise UsageError(f"unsupported architecture {arch.family!r} with biased projections for `{command}`")
    return arch


# ------------------------------------------------------------------------------------------ layers
def decoder_layers(model) -> torch.nn.ModuleList:
    """The list of decoder blocks (supported families by their table; others by common paths)."""
    mt = _model_type(model)
    paths = (FAMILIES[mt].layers,) if mt in FAMILIES else _OTHER_LAYER_PATHS
    for path in paths:
        try:
            return _get(model, path)
        except AttributeError:
            continue
    raise UsageError(f"unsupported architecture {type(model).__name__}: cannot find its decoder layers")


def layers_prefix(model) -> str:
    """Dotted name of the decoder-layer list inside ``model`` (e.g. ``model.layers``)."""
    layers = decoder_layers(model)
    for name, mod in model.named_modules():
        if mod is layers:
            return name
    raise UsageError(f"unsupported architecture {type(model).__name__}: decoder layers are not a named module")


def linear_path(role: str, arch: Arch | None = None) -> str:
    return (arch or FAMILIES["llama"]).linear_path(role)


def linear(layer: torch.nn.Module, role: str, arch: Arch | None = None) -> torch.nn.Module:
    """The block Linear of ``role`` in decoder ``layer``."""
    return layer.get_submodule(linear_path(role, arch))


def set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Replace the submodule at dotted path ``name`` of ``root`` by ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def set_linear(layer: torch.nn.Module, role: str, module: torch.nn.Module, arch: Arch | None = None) -> None:
    """Replace the block Linear of ``role`` in ``layer`` by ``module``."""
    set_module(layer, linear_path(role, arch), module)


def linear_names(model, roles=ROLES, check_linear: bool = True) -> list[list[str]]:
    """Full module names of the block Linears of ``roles``, grouped by decoder layer."""
    arch = arch_of(model)
    prefix = layers_prefix(model)
    layers = decoder_layers(model)
    out = []
    for i, layer in enumerate(layers):
        names = []
        for r in roles:
            path = arch.linear_path(r)
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                mod = None
            if check_linear and not isinstance(mod, sys.modules["torch"].nn.Linear):
                raise UsageError(f"unsupported architecture {type(model).__name__}: {prefix}.{i}.{path} is not a "
                                 "Linear (expected Llama-style q/k/v/o/gate/up/down projections)")
            names.append(f"{prefix}.{i}.{path}")
        out.append(names)
    return out


def role_of(name: str, arch: Arch | None = None) -> str | None:
    """The role of a full or block-relative module name (``...layers.3.mlp.up_proj`` -> ``up``)."""
    arch = arch or FAMILIES["llama"]
    for role, path in arch.linears.items():
        if name == path or name.endswith("." + path):
            return role
    return None


def input_source(name: str, arch: Arch | None = None) -> str:
    """Full name of the Linear whose input ``name`` shares (itself when it shares with none)."""
    arch = arch or FAMILIES["llama"]
    role = role_of(name, arch)
    if role not in SHARED_INPUT:
        return name
    path = arch.linear_path(role)
    return name[: len(name) - len(path)] + arch.linear_path(SHARED_INPUT[role])


def attention(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule((arch or FAMILIES["llama"]).attention)


def mlp(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule((arch or FAMILIES["llama"]).mlp)


def input_norm(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule((arch or FAMILIES["llama"]).input_norm)


def post_attention_norm(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule((arch or FAMILIES["llama"]).post_attention_norm)


def final_norm(model) -> torch.nn.Module:
    return model.get_submodule(arch_of(model).final_norm)


def embed(model) -> torch.nn.Module:
    return model.get_input_embeddings()


def lm_head(model) -> torch.nn.Module:
    return model.get_submodule(arch_of(model).lm_head)


# ------------------------------------------------------------------------------------------ sizes
def _cfg(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def n_heads(model_or_config) -> int:
    return int(_cfg(model_or_config).num_attention_heads)


def n_kv_heads(model_or_config) -> int:
    cfg = _cfg(model_or_config)
    return int(getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads)


def head_dim(model_or_config) -> int:
    cfg = _cfg(model_or_config)
    return int(getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads)


def hidden_size(model_or_config) -> int:
    return int(_cfg(model_or_config).hidden_size)

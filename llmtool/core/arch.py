"""Architecture adapter: where a decoder-only causal LM keeps its blocks, and what is in a block.

Every area that reaches into a model (compression, quantization, editing, KV-cache methods) asks this
module instead of spelling module names itself. A family is one :class:`Arch` entry in
:data:`FAMILIES` (keyed by ``config.model_type``): module paths plus the layout properties a method
may have to handle or refuse, as data:

* ``norm``: ``rmsnorm`` (``x / rms(x) * w``) or ``rmsnorm_plus_one`` (Gemma: ``x / rms(x) * (1 + w)``;
  :func:`norm_gain` returns the effective gain and :func:`set_unit_gain` the weight that makes it 1);
* sandwich norms (Gemma 2/3): ``attn_out_norm`` / ``mlp_out_norm`` normalise the attention / MLP
  *output* before the residual add; the MLP's input norm is then ``pre_feedforward_layernorm``
  (:func:`mlp_norm`; in Gemma ``post_attention_layernorm`` is the attention's output norm);
* ``qk_norms`` (Qwen3, Gemma 3): RMSNorms over ``head_dim`` applied to q and k before RoPE;
* ``fused`` projections (Phi-3 ``qkv_proj``, ``gate_up_proj``): a fused Linear split into roles by row
  slices (:func:`role_slices`; :func:`role_weight` is a writable view of one role's rows, whatever the
  layout);
* ``experts`` (Qwen3-MoE, Mixtral): routed experts as indexed roles (transformers 5 stores them as 3-D
  parameters ``gate_up_proj [E, 2I, D]`` (gate rows, then up rows) and ``down_proj [E, D, I]``, not as
  Linears; :func:`expert_weight`), the router module, and a shared expert where the family has one;
* attention kinds per layer (:func:`attention_kinds`: ``full`` / ``sliding`` from ``config.layer_types``,
  or every layer sliding when a Mistral-style config sets ``sliding_window`` without layer types);
* logit soft-capping (Gemma 2: ``final_logit_softcapping`` / ``attn_logit_softcapping``) and the
  embedding scale (Gemma: embeddings multiplied by ``sqrt(hidden_size)`` inside the embedding module).

Roles of the block Linears (:data:`ROLES`): ``q k v o`` (attention projections) and
``gate up down`` (gated MLP). Roles that read the same input (:data:`SHARED_INPUT`): ``k``/``v``
read what ``q`` reads (the attention-norm output), ``up`` reads what ``gate`` reads (the MLP-norm
output), so input statistics are gathered once per group. The *modules* of a block
(:func:`block_linears`) are the roles' Linears, except that a fused Linear appears once under its
fused name (``qkv``, ``gate_up``); an MoE layer's MLP contributes its experts only once they are Linears
(``experts.E.gate_up`` / ``experts.E.down``: :func:`llmtool.core.experts.unfuse_experts` for compression,
``quantize.modules.QuantExperts`` for quantization); the router stays a float module (:func:`router`).

A method that cannot handle a layout property refuses it with :func:`refuse` (one ``error:`` line naming
the method, the family and the property); :func:`properties` lists a config's properties, and
:func:`check_config` / :func:`check_layout` reject malformed family configs and weights (missing
``head_dim`` where the family needs it, a fused projection of the wrong size, an MoE layer without
its router) before anything loads.

API (``model`` is a loaded ``*ForCausalLM``; ``layer`` one decoder block)::

    arch = arch_of(model)                     # Arch of its family (UsageError when unsupported)
    decoder_layers(model)                     # the ModuleList of blocks (any family)
    layers_prefix(model)                      # "model.layers"
    linear(layer, "q") / linear_path("q")     # the module / "self_attn.q_proj" (fused role: refused)
    block_linears(layer)                      # {"q": Linear, ...} or {"qkv": Linear, "o": ..., "gate_up": ...}
    role_weight(layer, "v")                   # writable view of the v rows (of qkv_proj when fused)
    linear_names(model, roles)                # [[full names of layer 0], [layer 1], ...]
    module_names(model)                       # full names of every block Linear module, per layer
    attention(layer), mlp(layer)              # the attention / MLP sub-modules
    input_norm(layer), post_attention_norm(layer) (= mlp_norm), final_norm(model)
    attn_out_norm(layer), mlp_out_norm(layer) # sandwich norms (None when the family has none)
    embed(model), lm_head(model)
    head_dim(config), n_heads(config), n_kv_heads(config), attention_kinds(config)
    is_moe_layer(layer), experts(layer), router(layer), expert_weight(layer, e, "down")
    require(model, "quantize", bias_free=True)   # refuse what a command cannot handle
    refuse("QuaRot", "gemma3_text", "post-norms", "why")  # raise the one-line refusal
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
NORM_KINDS = ("rmsnorm", "rmsnorm_plus_one")

# layout property names (what a refusal names; what the support matrix lists per family)
P_BIAS = "q/k/v bias"
P_QK_NORM = "q/k norms"
P_POST_NORMS = "sandwich post-norms"
P_PLUS_ONE = "(1 + w) RMSNorm"
P_FUSED = "fused qkv_proj / gate_up_proj"
P_EXPERTS = "routed experts"
P_SHARED_EXPERT = "shared expert"
P_SLIDING = "sliding-window layers"
P_SOFTCAP = "logit soft-capping"
P_EMBED_SCALE = "embedding scale"
P_GEGLU = "GeGLU MLP"


@dataclass(frozen=True)
class Fused:
    """A fused Linear holding several roles, stacked by rows in ``roles`` order."""

    path: str
    roles: tuple


@dataclass(frozen=True)
class Experts:
    """Routed experts of an MoE block (paths relative to the decoder block)."""

    path: str = "mlp.experts"
    gate_up: str = "gate_up_proj"       # parameter [E, 2I, D]: gate rows then up rows
    down: str = "down_proj"             # parameter [E, D, I]
    router: str = "mlp.gate"            # module with weight [E, D]
    shared: str | None = None           # a shared-expert MLP (gate/up/down Linears) where present
    count_key: str = "num_experts"      # config key of the expert count (config.json may use the alias)
    size_key: str = "moe_intermediate_size"
    # the router's tensor in a checkpoint (transformers serialises MoE models in their original per-expert
    # layout: Mixtral's block_sparse_moe.experts.E.w1/w2/w3, Qwen3-MoE's mlp.experts.E.gate/up/down_proj)
    ckpt_router: str = "mlp.gate.weight"
    count_aliases: tuple = ("num_experts", "num_local_experts")


@dataclass(frozen=True)
class Arch:
    """Module paths (relative to the model for model-level parts, to the block otherwise) and layout
    properties of one family."""

    family: str
    layers: str = "model.layers"
    embed: str = "model.embed_tokens"
    final_norm: str = "model.norm"
    lm_head: str = "lm_head"
    attention: str = "self_attn"
    mlp: str = "mlp"
    input_norm: str = "input_layernorm"
    # the norm whose output the MLP reads (Llama: post_attention_layernorm; Gemma: pre_feedforward_layernorm)
    post_attention_norm: str = "post_attention_layernorm"
    attn_out_norm: str | None = None     # sandwich norm on the attention output (Gemma)
    mlp_out_norm: str | None = None      # sandwich norm on the MLP output (Gemma)
    qk_norms: tuple | None = None        # (q_norm path, k_norm path) over head_dim
    linears: dict = field(default_factory=lambda: {
        "q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
        "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"})
    fused: dict = field(default_factory=dict)   # fused name -> Fused
    norm: str = "rmsnorm"
    # roles whose Linears may carry a bias in this family (Qwen2: q/k/v)
    biased_roles: tuple = ()
    experts: Experts | None = None
    embed_scale: bool = False            # embeddings multiplied by sqrt(hidden) inside the embedding module
    gelu_mlp: bool = False               # GeGLU (gelu_pytorch_tanh gate) instead of SwiGLU
    head_dim_required: bool = False      # config.json must state head_dim (it differs from hidden / heads)

    def linear_path(self, role: str) -> str:
        if role in self.linears:
            return self.linears[role]
        for name, f in self.fused.items():
            if role in f.roles:
                raise UsageError(f"role {role!r} of {self.family} is a row slice of the fused {f.path} "
                                 f"({P_FUSED}); read it through arch.role_weight")
        if role in self.fused:
            return self.fused[role].path
        raise ValueError(f"unknown block role {role!r}; roles: {', '.join(ROLES)}")

    def fused_of(self, role: str) -> tuple[str, Fused] | None:
        for name, f in self.fused.items():
            if role in f.roles:
                return name, f
        return None

    def module_roles(self) -> tuple[str, ...]:
        """Names of the block's Linear modules in role order (a fused module once, under its fused name)."""
        out = []
        for r in ROLES:
            hit = self.fused_of(r)
            name = hit[0] if hit else r
            if name not in out:
                out.append(name)
        return tuple(out)

    def module_path(self, name: str) -> str:
        return self.fused[name].path if name in self.fused else self.linears[name]


_LLAMA_LINEARS = Arch("llama").linears
_PHI3_LINEARS = {"o": "self_attn.o_proj", "down": "mlp.down_proj"}
_PHI3_FUSED = {"qkv": Fused("self_attn.qkv_proj", ("q", "k", "v")),
               "gate_up": Fused("mlp.gate_up_proj", ("gate", "up"))}
_GEMMA = dict(norm="rmsnorm_plus_one", post_attention_norm="pre_feedforward_layernorm",
              attn_out_norm="post_attention_layernorm", mlp_out_norm="post_feedforward_layernorm",
              embed_scale=True, gelu_mlp=True, head_dim_required=True)
_QK = ("self_attn.q_norm", "self_attn.k_norm")

FAMILIES: dict[str, Arch] = {
    "llama": Arch("llama"),
    "mistral": Arch("mistral"),
    "qwen2": Arch("qwen2", biased_roles=("q", "k", "v")),
    "qwen3": Arch("qwen3", qk_norms=_QK, head_dim_required=True),
    "gemma2": Arch("gemma2", **_GEMMA),
    "gemma3_text": Arch("gemma3_text", qk_norms=_QK, **_GEMMA),
    "phi3": Arch("phi3", linears=_PHI3_LINEARS, fused=_PHI3_FUSED),
    "qwen3_moe": Arch("qwen3_moe", qk_norms=_QK, head_dim_required=True, experts=Experts()),
    "mixtral": Arch("mixtral", experts=Experts(count_key="num_local_experts", size_key="intermediate_size",
                                               ckpt_router="block_sparse_moe.gate.weight")),
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


def refuse(method: str, family: str, prop: str, why: str) -> None:
    """Raise the one-line refusal of a method on a family's layout property (exit code 2)."""
    raise UsageError(f"{method} does not support {family} ({prop}): {why}")


def _getter(model_or_config):
    cfg = _cfg(model_or_config)
    if isinstance(cfg, dict):   # an llmtool-only format keeps the sizes at the top level (model_type in the base)
        return cfg.get
    return lambda k, d=None: getattr(cfg, k, d)


def require(model_or_config, command: str, bias_free: bool = False) -> Arch:
    """``arch_of`` plus the checks a command needs: ``bias_free`` refuses families or checkpoints whose
    block Linears carry biases (a model, its HF config, or a config.json dict)."""
    arch = arch_of(model_or_config, command)
    if bias_free:
        get = _getter(model_or_config)
        biased = bool(get("attention_bias", False) or get("mlp_bias", False) or arch.biased_roles)
        torch = sys.modules.get("torch")  # a model can only exist once torch is imported
        if not biased and torch is not None and isinstance(model_or_config, torch.nn.Module):
            layer = decoder_layers(model_or_config)[0]
            biased = any(getattr(m, "bias", None) is not None for m in block_linears(layer, arch).values())
        if biased:
            raise UsageError(f"unsupported architecture {arch.family!r} with biased projections for `{command}`")
    return arch


def properties(model_or_config) -> list[str]:
    """The layout properties of a model / config (names a refusal and the support matrix use)."""
    arch = arch_of(model_or_config)
    get = _getter(model_or_config)
    out = []
    if arch.biased_roles or get("attention_bias", False):
        out.append(P_BIAS)
    if arch.qk_norms:
        out.append(P_QK_NORM)
    if arch.norm == "rmsnorm_plus_one":
        out.append(P_PLUS_ONE)
    if arch.attn_out_norm or arch.mlp_out_norm:
        out.append(P_POST_NORMS)
    if arch.gelu_mlp:
        out.append(P_GEGLU)
    if arch.fused:
        out.append(P_FUSED)
    if arch.experts is not None:
        out.append(P_EXPERTS)
        if arch.experts.shared:
            out.append(P_SHARED_EXPERT)
    if "sliding" in attention_kinds(model_or_config):
        out.append(P_SLIDING)
    if get("final_logit_softcapping", None) or get("attn_logit_softcapping", None):
        out.append(P_SOFTCAP)
    if arch.embed_scale:
        out.append(P_EMBED_SCALE)
    return out


# ------------------------------------------------------------------------------------------ config checks
def check_config(src, config: dict) -> None:
    """Torch-free checks of a supported family's config.json (unknown families pass: commands that need
    an adapter refuse them through :func:`arch_of`)."""
    mt = _model_type(config)
    if mt not in FAMILIES:
        return
    arch = FAMILIES[mt]
    get = _getter(config)
    if arch.head_dim_required and not get("head_dim", None):
        raise UsageError(f"{src}: config.json of a {mt} model has no head_dim (the family's head size is not "
                         "hidden_size / num_attention_heads; it must be stated)")
    if arch.experts is not None:
        n, k = n_experts_of(config), get("num_experts_per_tok", None)
        if not isinstance(n, int) or n < 1:
            raise UsageError(f"{src}: config.json of a {mt} model has no valid {arch.experts.count_key} ({n!r})")
        if not isinstance(k, int) or not 1 <= k <= n:
            raise UsageError(f"{src}: config.json num_experts_per_tok={k!r} must be between 1 and "
                             f"{arch.experts.count_key}={n}")


def _moe_layer_ids(arch: Arch, get, n_layers: int) -> list[int]:
    if arch.experts is None:
        return []
    if arch.family != "qwen3_moe":
        return list(range(n_layers))
    only, step = set(get("mlp_only_layers", None) or []), int(get("decoder_sparse_step", 1) or 1)
    return [i for i in range(n_layers) if i not in only and (i + 1) % step == 0]


def expected_shapes(config: dict) -> dict[str, tuple]:
    """Checkpoint tensor name -> expected shape for the family-specific tensors (fused projections, MoE
    routers and experts) of a config.json dict (torch-free)."""
    arch = arch_of(config)
    get = _getter(config)
    n_layers = int(get("num_hidden_layers", 0) or 0)
    hidden = int(get("hidden_size", 0) or 0)
    heads = int(get("num_attention_heads", 1) or 1)
    kv = int(get("num_key_value_heads", None) or heads)
    hd = int(get("head_dim", None) or hidden // heads)
    inter = int(get("intermediate_size", 0) or 0)
    out = {}
    for i in range(n_layers):
        pre = f"{arch.layers}.{i}."
        for name, f in arch.fused.items():
            rows = sum({"q": heads * hd, "k": kv * hd, "v": kv * hd, "gate": inter, "up": inter}[r] for r in f.roles)
            out[pre + f.path + ".weight"] = (rows, hidden)
    if arch.experts is not None:   # the router (experts: per-expert or 3-D tensors, converted by transformers)
        n = int(n_experts_of(config) or 0)
        for i in _moe_layer_ids(arch, get, n_layers):
            out[f"{arch.layers}.{i}.{arch.experts.ckpt_router}"] = (n, hidden)
    return out


def n_experts_of(config):
    """The expert count of an MoE config (dict or HF config; config.json may spell it by its alias)."""
    spec = arch_of(config)
    get = _getter(config)
    for key in (spec.experts.count_key, *spec.experts.count_aliases):
        if get(key, None) is not None:
            return get(key)
    return None


def check_layout(src, config: dict, shapes: dict[str, tuple] | None) -> None:
    """Family tensors of a checkpoint against its config (``shapes``: tensor name -> shape from the
    safetensors headers): a fused projection of the wrong size, an MoE layer without its router or
    experts. Checkpoints in an llmtool-only format (low-rank, packed) are skipped."""
    if shapes is None or _model_type(config) not in FAMILIES or "llmtool_base_config" in config:
        return
    check_config(src, config)
    for name, shape in expected_shapes(config).items():
        got = shapes.get(name)
        if got is None:
            spec = arch_of(config)
            what = "MoE router" if spec.experts is not None and name.endswith(spec.experts.ckpt_router) \
                else "fused projection"
            raise UsageError(f"{src}: {spec.family} checkpoint has no {name} (its {what} is missing)")
        if tuple(got) != tuple(shape):
            raise UsageError(f"{src}: {name} has shape {list(got)}, config.json implies {list(shape)}")


def header_shapes(model_dir) -> dict[str, tuple] | None:
    """Tensor name -> shape over every safetensors file of ``model_dir`` (headers only, torch-free)."""
    from llmtool.core.checkpoint import check_safetensors, weight_files

    try:
        files = weight_files(model_dir)
    except UsageError:
        return None
    shapes = {}
    for f in files:
        if str(f).endswith(".safetensors"):
            for k, v in check_safetensors(f).items():
                if k != "__metadata__":
                    shapes[k] = tuple(v["shape"])
    return shapes


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


def layer_config(layer):
    """The HF config a decoder block was built from (blocks keep it on themselves or their attention)."""
    for obj in (layer, getattr(layer, "self_attn", None), getattr(layer, "attention", None)):
        cfg = getattr(obj, "config", None)
        if cfg is not None and not isinstance(cfg, dict):
            return cfg
    return None


def arch_of_layer(layer, arch: Arch | None = None) -> Arch:
    """The family of a decoder block (``arch`` when given; from the block's config otherwise, Llama when
    the block carries none)."""
    if arch is not None:
        return arch
    cfg = layer_config(layer)
    return FAMILIES.get(str(getattr(cfg, "model_type", "llama")), FAMILIES["llama"])


def linear_path(role: str, arch: Arch | None = None) -> str:
    return (arch or FAMILIES["llama"]).linear_path(role)


def linear(layer: torch.nn.Module, role: str, arch: Arch | None = None) -> torch.nn.Module:
    """The block Linear of ``role`` in decoder ``layer`` (or of a fused name such as ``qkv``); a role that
    is a slice of a fused Linear is refused (use :func:`role_weight`)."""
    return layer.get_submodule(arch_of_layer(layer, arch).linear_path(role))


def block_linears(layer: torch.nn.Module, arch: Arch | None = None) -> dict:
    """Module name -> Linear of every block Linear of ``layer`` (fused ones once; an MoE MLP's experts only once
    unfused into Linears by :func:`llmtool.core.experts.unfuse_experts` or quantized per expert)."""
    arch = arch_of_layer(layer, arch)
    out = {}
    moe = is_moe_layer(layer, arch)
    for name in arch.module_roles():
        if moe and name in MLP_ROLES + ("gate_up",):
            continue
        out[name] = layer.get_submodule(arch.module_path(name))
    if moe:   # experts unfused into Linears (core.experts.LinearExperts): ``experts.E.gate_up`` / ``experts.E.down``
        ex = layer.get_submodule(arch.experts.path)
        if hasattr(ex, "linears"):
            out.update(ex.linears())
    return out


def role_slices(config, arch: Arch | None = None) -> dict[str, tuple[str, slice]]:
    """role -> (module name, row slice) for every role of a block (unfused roles: the whole weight)."""
    arch = arch or arch_of(config)
    hd, h, kv = head_dim(config), n_heads(config), n_kv_heads(config)
    inter = int(_getter(config)("intermediate_size"))
    sizes = {"q": h * hd, "k": kv * hd, "v": kv * hd, "gate": inter, "up": inter}
    out = {}
    for role in ROLES:
        hit = arch.fused_of(role)
        if hit is None:
            out[role] = (role, slice(None))
            continue
        name, f = hit
        start = sum(sizes[r] for r in f.roles[: f.roles.index(role)])
        out[role] = (name, slice(start, start + sizes[role]))
    return out


def role_weight(layer: torch.nn.Module, role: str, arch: Arch | None = None) -> torch.Tensor:
    """Writable view of the weight rows of ``role`` (``[out, in]``), a slice of the fused Linear when the
    family fuses the role."""
    arch = arch_of_layer(layer, arch)
    hit = arch.fused_of(role)
    if hit is None:
        return layer.get_submodule(arch.linear_path(role)).weight
    name, f = hit
    sl = role_slices(layer_config(layer), arch)[role][1]
    return layer.get_submodule(f.path).weight[sl]


def role_bias(layer: torch.nn.Module, role: str, arch: Arch | None = None):
    arch = arch_of_layer(layer, arch)
    hit = arch.fused_of(role)
    if hit is None:
        return getattr(layer.get_submodule(arch.linear_path(role)), "bias", None)
    b = getattr(layer.get_submodule(hit[1].path), "bias", None)
    return None if b is None else b[role_slices(layer_config(layer), arch)[role][1]]


class RoleLinear:
    """A role of a (possibly fused) Linear as a callable with ``weight``/``bias`` views (``F.linear``)."""

    def __init__(self, weight, bias=None):
        self.weight, self.bias = weight, bias

    def __call__(self, x):
        return sys.modules["torch"].nn.functional.linear(x, self.weight.to(x.dtype),
                                                         None if self.bias is None else self.bias.to(x.dtype))


def attention_role(module, role: str, arch: Arch | None = None):
    """The ``q``/``k``/``v``/``o`` projection of one *attention module* (its Linear, or a
    :class:`RoleLinear` over the role's rows when the family fuses it)."""
    arch = arch or arch_of(module.config, "attention")
    prefix = arch.attention + "."
    hit = arch.fused_of(role)
    if hit is None:
        path = arch.linear_path(role)
        return _get(module, path[len(prefix):] if path.startswith(prefix) else path)
    f = hit[1]
    fused = _get(module, f.path[len(prefix):])
    sl = role_slices(module.config, arch)[role][1]
    return RoleLinear(fused.weight[sl], None if fused.bias is None else fused.bias[sl])


def set_module(root: torch.nn.Module, name: str, module: torch.nn.Module) -> None:
    """Replace the submodule at dotted path ``name`` of ``root`` by ``module``."""
    parent, _, child = name.rpartition(".")
    setattr(root.get_submodule(parent) if parent else root, child, module)


def set_linear(layer: torch.nn.Module, role: str, module: torch.nn.Module, arch: Arch | None = None) -> None:
    """Replace the block Linear of ``role`` (or fused name) in ``layer`` by ``module``."""
    arch = arch_of_layer(layer, arch)
    set_module(layer, arch.module_path(role) if role in arch.fused else arch.linear_path(role), module)


def linear_names(model, roles=ROLES, check_linear: bool = True) -> list[list[str]]:
    """Full module names of the block Linears of ``roles`` (or fused names), grouped by decoder layer."""
    arch = arch_of(model)
    prefix = layers_prefix(model)
    layers = decoder_layers(model)
    out = []
    for i, layer in enumerate(layers):
        names = []
        for r in roles:
            path = arch.module_path(r) if r in arch.fused else arch.linear_path(r)
            try:
                mod = layer.get_submodule(path)
            except AttributeError:
                mod = None
            if check_linear and not isinstance(mod, sys.modules["torch"].nn.Linear):
                if arch.experts is not None and is_moe_layer(layer, arch) and r in MLP_ROLES:
                    raise UsageError(f"{prefix}.{i}.{arch.mlp} of {arch.family} is a routed-experts block "
                                     f"({P_EXPERTS}): its {r} projections are 3-D expert tensors, not Linears")
                raise UsageError(f"unsupported architecture {type(model).__name__}: {prefix}.{i}.{path} is not a "
                                 "Linear (expected Llama-style q/k/v/o/gate/up/down projections)")
            names.append(f"{prefix}.{i}.{path}")
        out.append(names)
    return out


def module_names(model) -> list[list[str]]:
    """Full names of every block Linear module (fused ones once; an MoE MLP contributes none), per layer."""
    arch = arch_of(model)
    prefix = layers_prefix(model)
    out = []
    for i, layer in enumerate(decoder_layers(model)):
        paths = {id(m): n for n, m in layer.named_modules()}
        out.append([f"{prefix}.{i}.{paths[id(m)]}" for m in block_linears(layer, arch).values()])
    return out


def role_of(name: str, arch: Arch | None = None) -> str | None:
    """The role (or fused name) of a full or block-relative module name (``...layers.3.mlp.up_proj`` -> ``up``)."""
    arch = arch or FAMILIES["llama"]
    for role in arch.module_roles():
        path = arch.module_path(role)
        if name == path or name.endswith("." + path):
            return role
    return None


def input_source(name: str, arch: Arch | None = None) -> str:
    """Full name of the Linear whose input ``name`` shares (itself when it shares with none)."""
    arch = arch or FAMILIES["llama"]
    role = role_of(name, arch)
    if role not in SHARED_INPUT or SHARED_INPUT[role] not in arch.linears:
        return name
    path = arch.linear_path(role)
    return name[: len(name) - len(path)] + arch.linear_path(SHARED_INPUT[role])


def attention(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule(arch_of_layer(layer, arch).attention)


def mlp(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule(arch_of_layer(layer, arch).mlp)


def input_norm(layer, arch: Arch | None = None) -> torch.nn.Module:
    return layer.get_submodule(arch_of_layer(layer, arch).input_norm)


def post_attention_norm(layer, arch: Arch | None = None) -> torch.nn.Module:
    """The norm whose output the MLP reads (``pre_feedforward_layernorm`` in Gemma)."""
    return layer.get_submodule(arch_of_layer(layer, arch).post_attention_norm)


mlp_norm = post_attention_norm


def attn_out_norm(layer, arch: Arch | None = None):
    path = arch_of_layer(layer, arch).attn_out_norm
    return None if path is None else layer.get_submodule(path)


def mlp_out_norm(layer, arch: Arch | None = None):
    path = arch_of_layer(layer, arch).mlp_out_norm
    return None if path is None else layer.get_submodule(path)


def qk_norms(layer, arch: Arch | None = None) -> tuple | None:
    paths = arch_of_layer(layer, arch).qk_norms
    return None if paths is None else tuple(layer.get_submodule(p) for p in paths)


def norm_gain(norm: torch.nn.Module, arch: Arch) -> torch.Tensor:
    """The effective multiplicative gain of an RMSNorm of ``arch`` (``1 + w`` for ``rmsnorm_plus_one``)."""
    return norm.weight + 1.0 if arch.norm == "rmsnorm_plus_one" else norm.weight


def set_unit_gain(norm: torch.nn.Module, arch: Arch) -> None:
    """Make the norm's effective gain 1 (weight 0 for ``rmsnorm_plus_one``, 1 otherwise), in place."""
    norm.weight.data.fill_(0.0 if arch.norm == "rmsnorm_plus_one" else 1.0)


def final_norm(model) -> torch.nn.Module:
    return model.get_submodule(arch_of(model).final_norm)


def embed(model) -> torch.nn.Module:
    return model.get_input_embeddings()


def lm_head(model) -> torch.nn.Module:
    return model.get_submodule(arch_of(model).lm_head)


# ------------------------------------------------------------------------------------------ experts
def is_moe_layer(layer, arch: Arch | None = None) -> bool:
    arch = arch_of_layer(layer, arch)
    if arch.experts is None:
        return False
    try:
        layer.get_submodule(arch.experts.path)
        return True
    except AttributeError:
        return False


def experts(layer, arch: Arch | None = None):
    arch = arch_of_layer(layer, arch)
    return layer.get_submodule(arch.experts.path)


def router(layer, arch: Arch | None = None):
    arch = arch_of_layer(layer, arch)
    return layer.get_submodule(arch.experts.router)


def n_experts(layer, arch: Arch | None = None) -> int:
    arch = arch_of_layer(layer, arch)
    return int(getattr(experts(layer, arch), arch.experts.gate_up).shape[0])


def expert_weight(layer, e: int, role: str, arch: Arch | None = None) -> torch.Tensor:
    """Writable ``[out, in]`` view of expert ``e``'s ``gate``/``up``/``down`` weight."""
    arch = arch_of_layer(layer, arch)
    ex = experts(layer, arch)
    if role == "down":
        return getattr(ex, arch.experts.down)[e]
    gu = getattr(ex, arch.experts.gate_up)[e]
    half = gu.shape[0] // 2
    if role == "gate":
        return gu[:half]
    if role == "up":
        return gu[half:]
    raise ValueError(f"unknown expert role {role!r}; expert roles: gate, up, down")


# ------------------------------------------------------------------------------------------ sizes
def _cfg(model_or_config):
    return getattr(model_or_config, "config", model_or_config)


def n_heads(model_or_config) -> int:
    return int(_getter(model_or_config)("num_attention_heads"))


def n_kv_heads(model_or_config) -> int:
    get = _getter(model_or_config)
    return int(get("num_key_value_heads", None) or get("num_attention_heads"))


def head_dim(model_or_config) -> int:
    get = _getter(model_or_config)
    return int(get("head_dim", None) or get("hidden_size") // get("num_attention_heads"))


def hidden_size(model_or_config) -> int:
    return int(_getter(model_or_config)("hidden_size"))


def attention_kinds(model_or_config) -> list[str]:
    """``full`` or ``sliding`` per decoder layer: ``config.layer_types`` when present; otherwise every layer
    is sliding when the config sets a ``sliding_window`` (and does not switch it off with
    ``use_sliding_window: false``), full when it does not."""
    get = _getter(model_or_config)
    n = int(get("num_hidden_layers", 0) or 0)
    types = get("layer_types", None)
    if types:
        return ["sliding" if "sliding" in str(t) else "full" for t in types][:n]
    sliding = get("sliding_window", None) and get("use_sliding_window", True) is not False
    return ["sliding" if sliding else "full"] * n


def is_sliding(attention_module) -> bool:
    """Whether an attention module (it carries ``config`` and ``layer_idx``) is a sliding-window layer."""
    kinds = attention_kinds(attention_module.config)
    i = getattr(attention_module, "layer_idx", None)
    return i is not None and i < len(kinds) and kinds[i] == "sliding"


def sliding_window(model_or_config) -> int | None:
    """The sliding-window width of the sliding layers (None when no layer slides)."""
    if "sliding" not in attention_kinds(model_or_config):
        return None
    return int(_getter(model_or_config)("sliding_window"))

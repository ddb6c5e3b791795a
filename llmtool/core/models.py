"""Model and tokenizer loading from a local directory or a packaged default's alias.

Nothing is fetched from a model hub: ``HF_HUB_OFFLINE=1`` is set before transformers loads, and
every load passes ``local_files_only=True``.

Checkpoints written by llmtool in a format plain transformers cannot read (low-rank factors,
packed integers) carry a block in config.json naming the format; :data:`FORMAT_MODULES` maps that
block to the module whose ``load_checkpoint(path, config, dtype, device)`` rebuilds the model, so
``llmtool.load(dir)`` works for all of them.
"""
from __future__ import annotations

import importlib
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

transformers.utils.logging.set_verbosity_error()
transformers.utils.logging.disable_progress_bar()

from llmtool.core.checkpoint import read_config  # noqa: E402,F401
from llmtool.core.console import OPTIONS, UsageError  # noqa: E402
# the torch-free checks live in core.preflight (commands run them before heavy imports); re-exported here
from llmtool.core.preflight import (check_causal_lm, check_weights, refuse_remote_code,  # noqa: E402,F401
                                    resolve_model)

FORMAT_MODULES = {
    "llmtool_lowrank": "llmtool.compress.lowrank",
    "llmtool_quant": "llmtool.quantize.formats",
}

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "float16": torch.float16, "fp16": torch.float16,
          "bfloat16": torch.bfloat16, "bf16": torch.bfloat16, "float64": torch.float64, "fp64": torch.float64}


def parse_dtype(name: str | torch.dtype | None) -> torch.dtype:
    if isinstance(name, torch.dtype):
        return name
    name = name or OPTIONS.dtype
    try:
        return DTYPES[name]
    except KeyError:
        raise UsageError(f"unknown --dtype {name!r}; choose one of: float32, float16, bfloat16, float64") from None


def parse_device(name: str | None) -> torch.device:
    name = name or OPTIONS.device
    if name.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError(f"--device {name}: CUDA is not available on this machine")
    try:
        return torch.device(name)
    except RuntimeError:
        raise UsageError(f"unknown --device {name!r}") from None


def _allow_nonfinite() -> bool:
    return os.environ.get("LLMTOOL_ALLOW_NONFINITE") == "1"


def refuse_nonfinite(path: Path | str, name: str, tensor: torch.Tensor) -> None:
    """Refuse one weight with NaN/inf values (set $LLMTOOL_ALLOW_NONFINITE=1 to load it anyway); for
    loaders that read tensors themselves, such as the streamed compress path."""
    if (tensor.is_floating_point() and tensor.device.type != "meta" and not _allow_nonfinite()
            and not all_finite(tensor)):
        raise UsageError(f"{path}: weight {name} has NaN or infinite values "
                         "(set LLMTOOL_ALLOW_NONFINITE=1 to load it anyway)")


FINITE_CHUNK = 1 << 18     # entries per isfinite call (2 MB float64 temporaries)


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether every entry is finite, checked over chunks of ``FINITE_CHUNK`` entries: ``torch.isfinite`` of a
    whole tensor builds temporaries of about 3x its size (measured: +300 MB transient for the default model's
    108 MB embedding, which set the streamed compress peak)."""
    if tensor.dim() == 0:
        return bool(torch.isfinite(tensor))
    if not tensor.is_contiguous():     # reshape(-1) would copy it whole (e.g. a column-major LAPACK result):
        rows = max(1, FINITE_CHUNK // max(1, tensor[0].numel()))     # slices along dim 0 are views
        return all(bool(torch.isfinite(part).all()) for part in tensor.split(rows))
    flat = tensor.reshape(-1)
    return all(bool(torch.isfinite(flat[i:i + FINITE_CHUNK]).all()) for i in range(0, flat.numel(), FINITE_CHUNK))


def check_finite(model, path: Path | str) -> None:
    """Refuse a model with NaN/inf weights (set $LLMTOOL_ALLOW_NONFINITE=1 to load it anyway)."""
    if _allow_nonfinite():
        return
    for name, p in model.named_parameters():
        refuse_nonfinite(path, name, p)


def load_model(model, dtype=None, device=None, check: bool = True):
    """Load a causal LM (any HF dir, default alias, or llmtool output) in eval mode.

    Safety and integrity: safetensors only (headers checked first), never remote code, every tensor the
    architecture expects must be in the checkpoint (missing or unexpected keys are an error, never
    re-initialised), and no NaN/inf weights."""
    path = resolve_model(model)
    config = read_config(path)
    if check:
        check_causal_lm(path, config)
    refuse_remote_code(path, config)
    torch_dtype = parse_dtype(dtype)
    dev = parse_device(device)
    check_weights(path)
    for key, module in FORMAT_MODULES.items():
        if key in config:
            mod = importlib.import_module(module)
            m = mod.load_checkpoint(path, config, torch_dtype, dev)
            check_finite(m, path)
            return m.eval()
    from transformers import AutoModelForCausalLM

    try:
        m, info = AutoModelForCausalLM.from_pretrained(path, dtype=torch_dtype, local_files_only=True,
                                                       trust_remote_code=False, use_safetensors=True,
                                                       output_loading_info=True)
    except ImportError as e:           # e.g. a compressed-tensors export without the compressed-tensors package
        quant = (config.get("quantization_config") or {}).get("quant_method")
        hint = f" (pip install 'llmtool[export]' for {quant} checkpoints)" if quant == "compressed-tensors" else ""
        raise UsageError(f"{path}: cannot load model: {str(e).splitlines()[0][:200]}{hint}") from None
    except (OSError, ValueError, KeyError, RuntimeError) as e:
        raise UsageError(f"{path}: cannot load model ({str(e).splitlines()[0][:200]})") from None
    missing = sorted(info.get("missing_keys") or [])
    unexpected = sorted(info.get("unexpected_keys") or [])
    mismatched = info.get("mismatched_keys") or []
    if missing:
        raise UsageError(f"{path}: checkpoint lacks {len(missing)} weight(s) the model needs, e.g. {missing[0]} "
                         "(refusing to initialise them randomly)")
    if unexpected:
        raise UsageError(f"{path}: checkpoint has {len(unexpected)} weight(s) the architecture does not use, "
                         f"e.g. {unexpected[0]}")
    if mismatched:
        raise UsageError(f"{path}: weight shapes do not match config.json, e.g. {mismatched[0][0]}")
    check_finite(m, path)
    return m.to(dev).eval()


def hf_config(path: Path | str, config: dict | None = None):
    """The transformers config of a checkpoint; for an llmtool-only format (see
    :func:`llmtool.core.checkpoint.mark_llmtool_format`) the base architecture's config."""
    from transformers import AutoConfig

    from llmtool.core.checkpoint import BASE_CONFIG_KEY, base_config_dict

    config = config if config is not None else read_config(Path(path))
    if BASE_CONFIG_KEY not in config:
        return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    cfg = base_config_dict(config)
    model_type = cfg.pop("model_type", None)
    try:
        return AutoConfig.for_model(model_type, **cfg)
    except ValueError as e:
        raise UsageError(f"{path}/config.json: {BASE_CONFIG_KEY}.model_type {model_type!r}: {e}") from None


def load_tokenizer(model):
    from transformers import AutoTokenizer

    path = resolve_model(model)
    refuse_remote_code(path)
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except (OSError, ValueError) as e:
        raise UsageError(f"{path}: cannot load tokenizer ({str(e).splitlines()[0]})") from None
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def decoder_layers(model) -> torch.nn.ModuleList:
    """The list of decoder blocks of a causal LM (see :mod:`llmtool.core.arch`)."""
    from llmtool.core.arch import decoder_layers as layers_of

    return layers_of(model)


def set_seed(seed: int | None = None) -> int:
    seed = OPTIONS.seed if seed is None else seed
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)
    return seed


def param_count(model) -> int:
    seen, n = set(), 0
    for p in model.parameters():
        if p.data_ptr() not in seen:
            seen.add(p.data_ptr())
            n += p.numel()
    return n


def tiny_llama(vocab_size: int, *, layers: int = 2, d_model: int = 128, heads: int = 4, max_length: int = 128,
               seed: int = 0, bos_token_id=None, eos_token_id=None):
    """A from-scratch Llama (tied embeddings, MLP width 4·d) for pretraining and for data-mixing proxies."""
    from transformers import LlamaConfig, LlamaForCausalLM

    if d_model % heads:
        raise UsageError(f"--d-model {d_model} must be divisible by --heads {heads}")
    cfg = LlamaConfig(vocab_size=vocab_size, hidden_size=d_model, intermediate_size=4 * d_model,
                      num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=heads,
                      max_position_embeddings=max(max_length, 128), tie_word_embeddings=True,
                      bos_token_id=bos_token_id, eos_token_id=eos_token_id)
    torch.manual_seed(seed)
    return LlamaForCausalLM(cfg)

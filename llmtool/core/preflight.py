"""Checks of a command's inputs that need neither torch nor transformers, so that a wrong path, a
checkpoint that is not a causal LM, a corrupt safetensors header or an existing output is refused in a
fraction of a second, before any heavy import.

:func:`preflight` is what a command calls first; :func:`llmtool.core.job.job` runs the same checks again
(cheap) so that library callers get them too.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any, Callable, Iterable

from llmtool.core.checkpoint import read_config
from llmtool.core.console import UsageError


def resolve_model(model: str | os.PathLike) -> Path:
    """A model argument is a directory or the alias of a packaged default (materialized on first use)."""
    path = Path(model).expanduser()
    if path.is_dir():
        read_config(path)  # raises a clear error when config.json is missing
        return path
    from llmtool.core import defaults

    if str(model) in defaults.MODELS:
        return defaults.ensure_model(str(model))
    if path.exists():
        raise UsageError(f"{path}: not a directory (give a model directory or a default alias)")
    raise UsageError(
        f"{model}: no such model directory or default alias (aliases: {', '.join(defaults.MODELS)})"
    )


def check_causal_lm(path: Path, config: dict | None = None) -> dict:
    config = config if config is not None else read_config(path)
    check_config_values(path, config)
    archs = config.get("architectures") or []
    archs = archs if isinstance(archs, list) else [archs]
    if not any(str(a).endswith("ForCausalLM") for a in archs):
        raise UsageError(
            f"{path}: not a causal language model (config.json architectures={archs or 'missing'}); "
            "llmtool needs a *ForCausalLM checkpoint"
        )
    return config


def _auto_map_at(config: Any, where: str = "", depth: int = 0) -> str | None:
    """The dotted location of an ``auto_map`` key anywhere in ``config`` (sub-configs such as
    ``text_config`` or ``vision_config`` included), or None."""
    if depth > 32:
        return None
    if isinstance(config, dict):
        if "auto_map" in config:
            return f"{where}.auto_map" if where else "auto_map"
        for k, v in config.items():
            found = _auto_map_at(v, f"{where}.{k}" if where else str(k), depth + 1)
            if found:
                return found
    elif isinstance(config, list):
        for i, v in enumerate(config):
            found = _auto_map_at(v, f"{where}[{i}]", depth + 1)
            if found:
                return found
    return None


def check_side_files(path: Path) -> None:
    """The tokenizer and generation files a checkpoint has are regular files: transformers opens them
    without looking, and a FIFO there blocks the load forever (a directory or symlink loop fails deep
    inside it). Run by :func:`refuse_remote_code`, which every model and tokenizer load goes through."""
    from llmtool.core.checkpoint import TOKENIZER_FILES, regular_file

    for name in TOKENIZER_FILES:
        f = Path(path) / name
        if f.exists() or f.is_symlink():
            regular_file(f)


def refuse_remote_code(path: Path, config: dict | None = None) -> None:
    """A checkpoint whose config asks to run its own code (``auto_map``, at the top or in any sub-config)
    is refused: llmtool never runs remote code, and transformers would otherwise ask on a terminal."""
    from llmtool.core.checkpoint import read_json

    check_side_files(path)
    config = config if config is not None else read_config(path)
    found = _auto_map_at(config)
    if found:
        raise UsageError(f"{path}/config.json: {found} asks to run the checkpoint's own code; "
                         "llmtool never runs remote code")
    tc = Path(path) / "tokenizer_config.json"
    if tc.exists() or tc.is_symlink():
        found = _auto_map_at(read_json(tc))
        if found:
            raise UsageError(f"{tc}: {found} asks to run the checkpoint's own code; llmtool never runs remote code")


# config.json sizes that must be positive integers when present (at the top or in a sub-config such as
# text_config): zero attention heads made transformers divide by zero deep inside model construction.
POSITIVE_CONFIG_INTS = ("num_attention_heads", "num_key_value_heads", "hidden_size", "num_hidden_layers",
                        "intermediate_size", "vocab_size", "head_dim")


def check_config_values(path: Path, config: dict) -> None:
    """The architecture sizes of config.json are positive integers and the attention heads divide evenly
    into key/value groups; a violation is a one-line error naming the key (before any import of
    transformers, which would otherwise fail with a ZeroDivisionError or a shape error)."""
    subs = [("", config)] + [(f"{k}.", v) for k, v in config.items() if k.endswith("_config") and isinstance(v, dict)]
    for prefix, cfg in subs:
        for key in POSITIVE_CONFIG_INTS:
            if key not in cfg or cfg[key] is None:
                continue
            v = cfg[key]
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise UsageError(f"{path}/config.json: {prefix}{key} = {v!r} must be a positive integer")
        heads, kv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
        if isinstance(heads, int) and isinstance(kv, int) and heads % kv:
            raise UsageError(f"{path}/config.json: {prefix}num_attention_heads = {heads} is not a multiple of "
                             f"{prefix}num_key_value_heads = {kv}")


FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3", "F8_E5M2"}


def check_weights(path: Path, config: dict | None = None) -> None:
    """Every weight file's safetensors header is checked against its size before anything loads it. In
    a plain floating-point checkpoint (no ``quantization_config``, not an llmtool packed/low-rank format)
    every ``*.weight`` tensor must be stored as floating point: integer or boolean weights would otherwise
    be cast silently into meaningless floats."""
    from llmtool.core.checkpoint import check_safetensors, weight_files

    if config is None:
        try:
            config = read_config(path)
        except UsageError:
            config = {}
    packed = "quantization_config" in config or any(str(k).startswith("llmtool_") for k in config)
    for f in weight_files(path):
        header = check_safetensors(f)
        if packed:
            continue
        for name, info in header.items():
            if name != "__metadata__" and name.endswith(".weight") and info.get("dtype") not in FLOAT_DTYPES:
                raise UsageError(f"{f}: weight {name} is stored as {info.get('dtype')}; a floating-point "
                                 "checkpoint needs floating-point weights (refusing to cast them)")


def check_inputs(inputs: Iterable[Any]) -> tuple[Path, ...]:
    """Every input file or directory exists and is a directory or a regular file (``None`` entries are
    skipped)."""
    out = []
    for p in inputs:
        if p is None:
            continue
        path = Path(p).expanduser()
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
        if not path.is_dir():  # a FIFO would block the reader forever; a device or socket is no input either
            from llmtool.core.checkpoint import regular_file

            regular_file(path)
        out.append(path)
    return tuple(out)


def looks_like_path(value: str | os.PathLike | None) -> bool:
    """For options that take a packaged name *or* a file (``--data austen-train`` vs ``--data my.txt``): a
    value with a path separator or a file suffix is a path, and is checked to exist."""
    if value is None:
        return False
    text = str(value)
    return os.sep in text or "/" in text or bool(Path(text).suffix) or Path(text).exists()


def checked_model(model: str | os.PathLike, check_config: Callable[[Path, dict], None] | None = None) -> Path:
    """The resolved model directory after the cheap checks: a causal LM, no remote code, the command's own
    ``check_config`` on config.json, then sane safetensors headers (pickle-only refused)."""
    model_path = resolve_model(model)
    config = check_causal_lm(model_path)
    refuse_remote_code(model_path, config)
    if check_config is not None:
        check_config(model_path, config)
    check_weights(model_path, config)
    from llmtool.core.arch import check_layout, header_shapes   # a known family's config vs its tensors

    check_layout(model_path, config, header_shapes(model_path))
    return model_path


def preflight(model: str | os.PathLike | None = None, out: str | os.PathLike | None = None, *,
              inputs: Iterable[Any] = (), overwrite: bool = False,
              check_config: Callable[[Path, dict], None] | None = None) -> Path | None:
    """The cheap checks of a command, before it imports torch: the model (directory or alias, a causal
    LM, no remote code, sane safetensors headers, the command's own ``check_config``), the inputs, and
    the output path (absent unless ``overwrite``, not inside an input, writable parent). Returns the
    resolved model path."""
    from llmtool.core.checkpoint import check_output

    paths = check_inputs(inputs)  # first: the cheapest, and a default model may need materialising
    model_path = checked_model(model, check_config) if model is not None else None
    if out is not None:
        check_output(Path(out), overwrite, inputs=paths + ((model_path,) if model_path else ()))
    return model_path

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
    archs = config.get("architectures") or []
    if not any(str(a).endswith("ForCausalLM") for a in archs):
        raise UsageError(
            f"{path}: not a causal language model (config.json architectures={archs or 'missing'}); "
            "llmtool needs a *ForCausalLM checkpoint"
        )
    return config


def refuse_remote_code(path: Path, config: dict | None = None) -> None:
    """A checkpoint whose config asks to run its own code (``auto_map``) is refused: llmtool never runs
    remote code, and transformers would otherwise ask on a terminal."""
    import json

    config = config if config is not None else read_config(path)
    if "auto_map" in config:
        raise UsageError(f"{path}/config.json: auto_map asks to run the checkpoint's own code; "
                         "llmtool never runs remote code")
    tc = Path(path) / "tokenizer_config.json"
    if tc.is_file():
        try:
            if "auto_map" in json.loads(tc.read_text()):
                raise UsageError(f"{tc}: auto_map asks to run the checkpoint's own code; llmtool never runs remote code")
        except (json.JSONDecodeError, UnicodeDecodeError):
            raise UsageError(f"{tc}: invalid JSON") from None


def check_weights(path: Path) -> None:
    """Every weight file's safetensors header is checked against its size before anything loads it."""
    from llmtool.core.checkpoint import check_safetensors, weight_files

    for f in weight_files(path):
        check_safetensors(f)


def check_inputs(inputs: Iterable[Any]) -> tuple[Path, ...]:
    """Every input file or directory exists (``None`` entries are skipped)."""
    out = []
    for p in inputs:
        if p is None:
            continue
        path = Path(p).expanduser()
        if not path.exists():
            raise UsageError(f"{path}: no such file or directory")
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
    check_weights(model_path)
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

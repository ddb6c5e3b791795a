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

Formats (:data:`EXPORT_FORMATS`): ``dense`` (above), ``compressed-tensors``
(:mod:`llmtool.core.export_ct`: the quantized weights kept packed, for transformers and vLLM) and
``remote-code`` (:mod:`llmtool.core.export_remote`: low-rank factors kept, with a modeling file that plain
transformers runs under ``trust_remote_code=True``).
:func:`export_checkpoint` writes either from an llmtool output directory; ``llmtool models export`` calls it,
and ``--export FORMAT`` of ``quantize``/``compress`` (:func:`run_then_export`) runs the method into a
scratch directory inside the atomic output and calls it on that, so both write the same files.

This module imports no torch at import time (the CLI reads :data:`EXPORT_FORMATS` to build ``--help``).
"""
from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

from llmtool.core.console import UsageError

if TYPE_CHECKING:
    import torch
    from torch import nn

EXPORT_FORMATS = ("dense", "compressed-tensors", "remote-code")


def check_format(fmt: str, flag: str, choices: tuple[str, ...]) -> None:
    if fmt not in choices:
        raise UsageError(f"{flag} {fmt!r}: choose one of {', '.join(choices)}")


def densify(model: nn.Module) -> list[str]:
    """Replace stand-in modules by dense Linears in place; return what the dense model no longer does."""
    import torch
    from transformers import AutoModelForCausalLM

    from llmtool.core.arch import set_module
    from llmtool.core.console import progress

    dropped: set[str] = set()
    stand_ins = [(name, mod) for name, mod in model.named_modules() if hasattr(mod, "to_dense_linear")]
    for name, mod in progress(stand_ins, "dense weights"):
        dense = mod.to_dense_linear()
        dropped.update(getattr(mod, "dense_export_drops", list)())
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


def _files(out_dir: Path) -> list[dict]:
    return [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(Path(out_dir).iterdir()) if f.is_file()]


def source_format(config: dict) -> str:
    return next((k for k in ("llmtool_lowrank", "llmtool_quant") if k in config), "transformers")


def export_checkpoint(src: Path, out_dir: Path, fmt: str, dtype: str | None = None,
                      alternative: str = "--format dense") -> dict:
    """Write the ``fmt`` export of the checkpoint directory ``src`` into the (empty) directory ``out_dir``.
    Returns ``{"format", "source_format", "not_representable", "files": [{name, bytes}], "bytes", ...}``."""
    from llmtool.core.checkpoint import copy_tokenizer, dir_size_bytes, read_config
    from llmtool.core.console import OPTIONS

    check_format(fmt, "--format", EXPORT_FORMATS)
    src, out_dir = Path(src), Path(out_dir)
    config = read_config(src)
    report: dict = {"format": fmt, "source_format": source_format(config)}
    dtype_name = dtype or OPTIONS.dtype
    if fmt == "dense":
        from llmtool.core.models import load_model, parse_dtype

        model = load_model(src)
        report["not_representable"] = densify(model)
        save_dense(model, out_dir, parse_dtype(dtype_name))
        copy_tokenizer(src, out_dir)
    elif fmt == "remote-code":
        from llmtool.core.export_remote import save_remote_code

        report.update(save_remote_code(src, out_dir))
        report["not_representable"] = []
    else:
        from llmtool.core.export_ct import save_compressed_tensors

        report.update(save_compressed_tensors(src, out_dir, dtype_name, alternative))
        report["not_representable"] = []
    report["files"] = _files(out_dir)
    report["bytes"] = dir_size_bytes(out_dir)
    return report


def run_then_export(out: Path, overwrite: bool, fmt: str, run: Callable[[Path, bool], dict],
                    alternative: str = "--export dense") -> tuple[dict, dict | None]:
    """``run(OUT, overwrite)`` writes an llmtool output (``quantize``, ``compress``). With ``fmt`` ``native``
    it writes OUT itself; otherwise it writes a scratch directory inside the atomic output of OUT, which then
    receives the ``fmt`` export of it (:func:`export_checkpoint`), the run's ``report.json`` and
    ``llmtool.json`` (with an ``export`` entry) and nothing else. Returns ``(run result, export report)``."""
    if fmt == "native":
        return run(Path(out), overwrite), None
    from llmtool.core.checkpoint import PROVENANCE, atomic_output

    with atomic_output(Path(out), overwrite=overwrite) as tmp:
        native = tmp / ".native"
        result = run(native, False)
        exp = export_checkpoint(native, tmp, fmt, alternative=alternative)
        summary = {k: exp[k] for k in ("format", "source_format", "not_representable", "bytes")}
        for name in ("report.json", PROVENANCE):
            if (native / name).is_file():
                record = json.loads((native / name).read_text())
                record["export"] = summary
                (tmp / name).write_text(json.dumps(record, indent=2, default=str))
        shutil.rmtree(native)
        exp["files"] = _files(tmp)
    if isinstance(result, dict) and "out" in result:
        result = {**result, "out": str(out)}
    return result, exp

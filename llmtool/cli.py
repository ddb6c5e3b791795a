"""Root command: global options, and one sub-command per area (each area's ``cli.py`` holds a
Typer app named ``app``; areas are discovered, so adding a method never edits this file)."""
from __future__ import annotations

import importlib
import importlib.util
import sys
from typing import Annotated, Optional

import typer

from llmtool import __version__
from llmtool.core.console import OPTIONS, UsageError, fail

# (sub-command name, module holding `app`, one-line help). Order = order in --help.
AREAS = [
    ("models", "llmtool.core.models_cli", "Packaged default models: list and materialize them."),
    ("compress", "llmtool.compress.cli", "Low-rank compression: zs-svd and its SVD baselines."),
    ("quantize", "llmtool.quantize.cli", "Weight/activation quantization: respinquant, quarot, rtn."),
    ("kvcache", "llmtool.kvcache.cli", "KV-cache eviction and quantization during generation."),
    ("edit", "llmtool.edit.cli", "Knowledge editing (memit, alphaedit) and keystone neurons."),
    ("evaluate", "llmtool.evaluate.cli", "Perplexity, best-model identification, judges, autograders."),
    ("evade", "llmtool.evade.cli", "Watermarking, detection and watermark-evasion attacks."),
]

app = typer.Typer(
    name="llmtool", help="Recent LLM research methods and their baselines, on local Hugging Face checkpoints.",
    rich_markup_mode="rich", no_args_is_help=True, pretty_exceptions_enable=False, add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"llmtool {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    json_out: Annotated[bool, typer.Option("--json", help="Print machine-readable JSON on stdout.")] = False,
    device: Annotated[str, typer.Option(help="Torch device: cpu, cuda, cuda:1 ...")] = "cpu",
    dtype: Annotated[str, typer.Option(help="Compute dtype: float32, bfloat16, float16, float64.")] = "float32",
    seed: Annotated[int, typer.Option(help="Random seed for data sampling and methods.")] = 0,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="No progress bars or status lines.")] = False,
    version: Annotated[Optional[bool], typer.Option("--version", callback=_version, is_eager=True,
                                                    help="Show the version and exit.")] = None,
) -> None:
    OPTIONS.json, OPTIONS.device, OPTIONS.dtype, OPTIONS.seed, OPTIONS.quiet = json_out, device, dtype, seed, quiet


for _name, _module, _help in AREAS:
    if importlib.util.find_spec(_module) is not None:
        app.add_typer(importlib.import_module(_module).app, name=_name, help=_help)


def main() -> None:
    """Console-script entry point: user errors become one line on stderr and exit code 2."""
    try:
        app()
    except UsageError as e:
        fail(str(e), e.exit_code)
    except KeyboardInterrupt:
        fail("interrupted", 130)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())

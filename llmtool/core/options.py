"""Typer option/argument types shared by every command (declared once, reused everywhere)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Model directory (HF format) or a default alias, e.g. smollm2-135m.",
                                         metavar="MODEL")]
OutDirArg = Annotated[Path, typer.Argument(help="Output directory (must not exist unless --overwrite).",
                                           metavar="OUT")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")]
CalibData = Annotated[str, typer.Option("--calib-data", help="Calibration text: a packaged dataset name "
                                        "(austen-train, austen-test) or a .txt/.jsonl/.parquet file.")]
CalibSamples = Annotated[int, typer.Option("--calib-samples", min=1, help="Number of calibration sequences.")]
CalibSeqlen = Annotated[int, typer.Option("--calib-seqlen", min=2, help="Tokens per calibration sequence.")]
EvalData = Annotated[str, typer.Option("--data", help="Eval text: packaged dataset name or a text file.")]
Seqlen = Annotated[int, typer.Option("--seqlen", min=2, help="Tokens per evaluation window.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=2, help="Evaluate on the first N tokens of the text.")]

"""`llmtool train grpo|pretrain|sft|...`: the training area's verbs, each defined in its own module
(``cli_grpo`` for RLVR, ``cli_base`` for pretraining and SFT) and merged here."""
from __future__ import annotations

import importlib
import importlib.util

import typer

app = typer.Typer(no_args_is_help=True, help="Training: GRPO (RLVR), pretraining and SFT with AdaGC clipping.")

for _module in ("llmtool.train.cli_base", "llmtool.train.cli_grpo"):
    if importlib.util.find_spec(_module) is not None:
        app.add_typer(importlib.import_module(_module).app)

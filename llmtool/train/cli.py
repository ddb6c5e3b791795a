"""`llmtool train grpo|pretrain|sft|...`: the training area's verbs, each defined in its own module
(``cli_grpo`` for RLVR, ``cli_base`` for pretraining and SFT) and merged here."""
from __future__ import annotations

import typer

from llmtool.train import cli_base, cli_grpo

app = typer.Typer(no_args_is_help=True, help="Training: GRPO (RLVR), pretraining and SFT with AdaGC clipping.")

app.add_typer(cli_base.app)
app.add_typer(cli_grpo.app)

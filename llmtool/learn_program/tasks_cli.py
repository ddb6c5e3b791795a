"""`llmtool tasks list|generate`: the 13 algorithmic tasks of LLM-PV as `input -> label` datasets."""
from __future__ import annotations

import typer

from llmtool.core.console import emit
from llmtool.core.options import OutDirArg, Overwrite

app = typer.Typer(no_args_is_help=True, help="Algorithmic program-learning tasks: list and generate.")


@app.command("list")
def list_command() -> None:
    """List the built-in tasks (id, name, input kind, rule)."""
    from llmtool.learn_program.tasks import TASKS

    rows = [{"id": t.id, "task": t.name, "kind": t.kind, "short_rule": "yes" if t.solvable else "no",
             "rule": t.description} for t in TASKS.values()]
    emit({"tasks": rows}, rows=rows, title="LLM-PV tasks")


@app.command("generate")
def generate_command(
    out: OutDirArg,
    task: str = typer.Option(..., "--task", help="Task name (see `llmtool tasks list`)."),
    length: int = typer.Option(100, "--length", min=1, help="Input length L (digits/bits; edges for graph_has_cycle)."),
    train: int = typer.Option(100, "--train", min=0, help="Training examples (even)."),
    val: int = typer.Option(100, "--val", min=0, help="Validation examples (even)."),
    test: int = typer.Option(10_000, "--test", min=0, help="Test examples (even)."),
    seed: int = typer.Option(42, "--data-seed", help="Data seed (the derived seed also hashes task, L and sizes; the global --seed does not change the data)."),
    overwrite: Overwrite = False,
) -> None:
    """Write OUT/{train,val,test}.txt (`input -> label` lines) and OUT/meta.json."""
    from llmtool.core.job import job
    from llmtool.learn_program.tasks import generate, get_task, write_dataset

    get_task(task)
    with job("tasks generate", out=out, overwrite=overwrite) as j:
        ds = generate(task, length, train, val, test, seed=seed)
        write_dataset(ds, j.dir)
        j.report.update(ds.meta)
    emit({"out": str(out), **ds.meta})

"""Console output shared by every command: global options, progress bars, tables, JSON output,
and the mapping of user errors to a one-line message and exit code 2.

Every command prints its human-readable output through :func:`emit` (a rich table on stdout, or
one JSON document when the global ``--json`` flag is set) and reports loops over layers/samples
through :func:`progress` (drawn on stderr, silent under ``--json`` or when stderr is no terminal).

Text that comes from the user (paths, file contents, option values) may contain rich markup such as
``x[/bold]y``: every message printed here goes out with markup *off* (the error prefix is styled as a
:class:`rich.text.Text`, table cells are :class:`~rich.text.Text`), so such a path prints as typed and never
raises ``MarkupError`` -- in particular not after a command has written its output.
"""
from __future__ import annotations

import json
import sys
from dataclasses import dataclass
from typing import Any, Iterable, Iterator, NoReturn, Sequence, TypeVar

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn
from rich.table import Table
from rich.text import Text

T = TypeVar("T")

stdout = Console()
stderr = Console(stderr=True)


class UsageError(Exception):
    """A problem with the user's input (file, option, value). Printed as one line; exit code 2."""

    exit_code = 2


class Terminated(BaseException):
    """Raised in the main thread by the SIGTERM handler the CLI installs: like Ctrl-C it unwinds every
    ``finally``/``except BaseException`` (temporary outputs are removed), then the CLI prints
    ``error: terminated`` and exits 143 (128 + SIGTERM). Not a KeyboardInterrupt subclass, so that the
    two exit codes stay apart."""

    exit_code = 143


@dataclass
class GlobalOptions:
    json: bool = False
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    quiet: bool = False
    threads: int | None = None
    debug: bool = False


OPTIONS = GlobalOptions()


STATUS_EVERY_S = 30.0  # without a bar (no tty, --json), a long loop says where it is at most this often


def progress(items: Iterable[T], description: str, total: int | None = None) -> Iterator[T]:
    """Iterate ``items`` with a rich progress bar on stderr (hidden under --json/--quiet or no tty). Without a bar,
    a loop still running after :data:`STATUS_EVERY_S` prints a status line (``description: i/total after N s``)
    that often, so a long stage is never silent in a log; --quiet silences it."""
    if total is None and hasattr(items, "__len__"):
        total = len(items)  # type: ignore[arg-type]
    show = not (OPTIONS.json or OPTIONS.quiet) and stderr.is_terminal
    if not show:
        if OPTIONS.quiet:
            yield from items
            return
        import time

        t0 = last = time.monotonic()
        for i, item in enumerate(items, 1):
            yield item
            now = time.monotonic()
            if now - last >= STATUS_EVERY_S:
                info(f"{description}: {i}/{total if total is not None else '?'} after {now - t0:.0f} s")
                last = now
        return
    with Progress(
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
        console=stderr, transient=True,
    ) as bar:
        task = bar.add_task(description, total=total)
        for item in items:
            yield item
            bar.advance(task)


def info(message: str) -> None:
    """A status line on stderr (never mixed into --json stdout)."""
    if not OPTIONS.quiet:
        try:
            stderr.print(message, highlight=False, markup=False, soft_wrap=True)
        except Exception:  # a status line never fails a command (e.g. after its output is written)
            sys.stderr.write(f"{message}\n")


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if abs(value) < 1e5 else f"{value:.3e}"
    return str(value)


def table(rows: Sequence[dict], title: str | None = None, columns: Sequence[str] | None = None) -> Table:
    columns = list(columns or (rows[0].keys() if rows else []))
    # Long cells (model paths, lists of numbers) fold onto the next line instead of being cut to `gri…`
    # when the table is wider than the terminal, or than rich's 80 columns when stdout is no terminal.
    t = Table(title=Text(title) if title is not None else None)  # Text: user paths are never markup
    for c in columns:
        t.add_column(Text(str(c)), overflow="fold", no_wrap=False)
    for row in rows:
        t.add_row(*(Text(_fmt(row.get(c, "")), overflow="fold") for c in columns))
    return t


def markdown_table(rows: Sequence[dict], columns: Sequence[str] | None = None) -> str:
    """A GitHub markdown table of ``rows`` (used by benchmarks for the README)."""
    columns = list(columns or (rows[0].keys() if rows else []))
    lines = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    for row in rows:
        lines.append("| " + " | ".join(_fmt(row.get(c, "")) for c in columns) + " |")
    return "\n".join(lines)


def emit(result: Any, rows: Sequence[dict] | None = None, title: str | None = None) -> None:
    """Print a command's result: ``result`` as JSON under --json, else ``rows`` as a table
    (or ``result`` as key/value rows when it is a flat dict). Under a multi-process launch only the main
    process prints (see :mod:`llmtool.core.dist`)."""
    from llmtool.core.dist import is_main

    if not is_main():
        return
    if OPTIONS.json:
        sys.stdout.write(json.dumps(result, indent=2, default=_json_default) + "\n")
        return
    if rows is None and isinstance(result, dict):
        rows = [{"key": k, "value": v} for k, v in result.items() if not isinstance(v, (dict, list))]
    try:
        if rows:
            stdout.print(table(rows, title=title))
        elif result is not None and not isinstance(result, dict):
            stdout.print(result, markup=False)
    except (BrokenPipeError, KeyboardInterrupt):
        raise
    except Exception:  # the result is printed after the output is written: never fail there, print it plainly
        sys.stdout.write(json.dumps(result if rows is None else {"title": title, "rows": list(rows)}, indent=2,
                                    default=_json_default) + "\n")


def _json_default(obj: Any) -> Any:
    try:
        import numpy as np

        if isinstance(obj, np.generic):
            return obj.item()
        if isinstance(obj, np.ndarray):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    try:
        import torch

        if isinstance(obj, torch.Tensor):
            return obj.tolist()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(obj, "__dataclass_fields__"):
        from dataclasses import asdict

        return asdict(obj)
    return str(obj)


def fail(message: str, code: int = 2) -> NoReturn:
    """Print ``error: message`` on stderr and exit with ``code`` (no traceback)."""
    try:
        stderr.print(Text.assemble(("error:", "red"), " " + str(message)), highlight=False, soft_wrap=True)
    except Exception:  # never a traceback while reporting an error
        sys.stderr.write(f"error: {message}\n")
    raise SystemExit(code)

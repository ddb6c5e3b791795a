"""The evaluation task registry of ``llmtool evaluate tasks`` (in the manner of lm-evaluation-harness:
named tasks, each a function of a model that returns its metrics, run together by one command).

Areas contribute tasks through a hook, without cross-area imports: :data:`PROVIDERS` is a lazy
table of module paths that this module imports *by name* only when tasks are listed or run (a
module that is not installed is skipped). A provider module defines::

    def tasks() -> dict[str, tuple[Callable, str]]:
        # task name -> (fn(model, tokenizer, options) -> dict of metrics, one-line help)

where ``options`` is a :class:`TaskOptions` (read its attributes; do not import this module).
Providers: this area's own (``ppl``, ``retention``), kvcache's RULER-style synthetic tasks,
and the edit area's CounterFact metrics (``llmtool.edit.eval_tasks``, when present).
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from typing import Callable, Optional

from llmtool.core.console import UsageError

# module path -> what it contributes (shown by `llmtool evaluate tasks --list`)
PROVIDERS: dict[str, str] = {
    "llmtool.evaluate.builtin_tasks": "perplexity and retention",
    "llmtool.kvcache.eval_tasks": "RULER-style synthetic long-context tasks",
    "llmtool.edit.eval_tasks": "CounterFact edit metrics",
}


@dataclass
class TaskOptions:
    """Settings every task may read (each task uses the ones it needs)."""

    data: str = "austen-test"          # ppl / retention: text (packaged name or file)
    seqlen: int = 512                  # ppl / retention: window
    max_tokens: int = 16384            # ppl / retention: first N tokens of the text
    batch_size: int = 4                # ppl / retention: windows per forward
    base: Optional[str] = None         # retention: the reference model (before editing / training)
    length: int = 1024                 # synthetic tasks: context tokens
    samples: int = 10                  # synthetic tasks: samples per task
    filler: str = "austen-train"       # synthetic tasks: haystack corpus
    requests: Optional[str] = None     # counterfact: edit requests file
    seed: int = 0


@dataclass(frozen=True)
class Task:
    name: str
    fn: Callable
    help: str
    provider: str


def _available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


def registry() -> dict[str, Task]:
    """Every task of every available provider (providers imported here, by name)."""
    out: dict[str, Task] = {}
    for module in PROVIDERS:
        if not _available(module):
            continue
        for name, (fn, help_text) in importlib.import_module(module).tasks().items():
            if name in out:
                raise ValueError(f"evaluation task {name!r} contributed twice ({out[name].provider}, {module})")
            out[name] = Task(name, fn, help_text, module)
    return dict(sorted(out.items()))


def resolve(names: list[str]) -> list[Task]:
    tasks = registry()
    unknown = [n for n in names if n not in tasks]
    if unknown:
        raise UsageError(f"unknown task {unknown[0]!r} for `llmtool evaluate tasks`; choose one of: "
                         f"{', '.join(tasks)}")
    return [tasks[n] for n in dict.fromkeys(names)]


def run(model, tokenizer, names: list[str], options: TaskOptions) -> dict[str, dict]:
    """Metrics of each task in ``names`` for one loaded model."""
    return {t.name: t.fn(model, tokenizer, options) for t in resolve(names)}

"""`llmtool example-data NAME -o FILE`: small real input files for the README's quick paths.

Several commands read an input kind that no other command makes (a prompts file with a long context, a
corpus of documents with a source, response pairs for a judge, a per-item score matrix, autograder grades).
This command writes one such file, so that every README example runs as written from any directory:

==================  =======================================================================================
name                what is written
==================  =======================================================================================
``kvcache-prompts`` ``{"context", "question", "answer"}`` JSONL: Austen-like filler (two fixed sentences,
                    repeated) with one "special magic number" needle at a seeded depth, for
                    ``kvcache generate --prompts``. ``--n`` rows, about 450 tokens of context each.
``corpus``          ``{"id", "text", "source"}`` JSONL for ``select-data``: the first ``--n`` paragraphs of
                    at least 200 characters taken in turn from the four austen-train novels (``source`` =
                    the novel). Reads the packaged Austen corpus (fetched from Debian on first use).
``sft``             ``{"prompt", "completion"}`` JSONL for ``train sft``: ``--n`` one- and two-digit
                    additions and products, seeded by the global ``--seed``.
``judge-pairs``     ``{"id", "task", "prompt", "response_a", "response_b"}`` JSONL for ``evaluate
                    judge-sample``: six hand-written pairs (packaged; ``--n`` keeps the first N).
``score-matrix``    a wide 0/1 CSV (``item_id`` + one column per model) for ``evaluate sysr
                    --responses``: seven SmolLM2-135M variants on 1,024 items, as measured by
                    ``benchmarks/evaluate.py`` (packaged).
``hibayes-q1..q5``  the HiBayES example grades (CSV, MIT) that ``evaluate autograder fit --data`` reads
                    (packaged with ``llmtool.evaluate``).
==================  =======================================================================================

The packaged files live in ``llmtool/core/example_data/`` and ``llmtool/evaluate/data/hibayes/``; the
generated ones depend only on ``--n`` and ``--seed``. The output follows the file convention: ``-o FILE``,
refused when it exists unless ``--overwrite``, written atomically.
"""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Annotated, Optional

import typer

HERE = Path(__file__).resolve().parent
PACKAGED = HERE / "example_data"
HIBAYES = HERE.parent / "evaluate" / "data" / "hibayes"

app = typer.Typer()


def _kvcache_prompts(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    a = "Mr. Bennet was so odd a mixture of quick parts, sarcastic humour, reserve, and caprice. "
    b = "Her mind was less difficult to develop. "
    metals = ["copper", "silver", "cobalt", "nickel", "zinc", "iron", "tin", "gold"]
    rows = []
    for i in range(n):
        metal, number = metals[i % len(metals)], str(rng.randrange(1_000_000, 10_000_000))
        filler = [a] * 20 + [b] * 20
        filler.insert(rng.randrange(4, 37), f"The special magic number for {metal} is: {number}. ")
        rows.append(json.dumps({"id": f"needle-{i}", "context": "".join(filler),
                                "question": f"\n\nThe special magic number for {metal} is:", "answer": number}))
    return rows


def _corpus(n: int, seed: int) -> list[str]:
    from llmtool.core import defaults

    books = defaults.austen_books()
    paras = {k: [p for p in defaults._join_lines(books[k]).split("\n\n") if len(p) >= 200]
             for k in defaults.AUSTEN_TRAIN}
    rows, i = [], 0
    while len(rows) < n and any(i < len(v) for v in paras.values()):
        for k in defaults.AUSTEN_TRAIN:
            if i < len(paras[k]) and len(rows) < n:
                rows.append(json.dumps({"id": f"{k}-{i}", "text": paras[k][i], "source": k}))
        i += 1
    return rows


def _sft(n: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        x, y = rng.randrange(1, 100), rng.randrange(1, 10)
        op = "+" if i % 2 == 0 else "*"
        rows.append(json.dumps({"prompt": f"What is {x} {op} {y}? Answer: ",
                                "completion": str(x + y if op == "+" else x * y)}))
    return rows


GENERATED = {"kvcache-prompts": (_kvcache_prompts, 4), "corpus": (_corpus, 400), "sft": (_sft, 64)}
COPIED = {"judge-pairs": PACKAGED / "judge_pairs.jsonl", "score-matrix": PACKAGED / "evaluate_matrix.csv",
          **{f"hibayes-q{i}": HIBAYES / f"q{i}.csv" for i in range(1, 6)}}
NAMES = [*GENERATED, *COPIED]


def write(name: str, out: Path, n: Optional[int] = None, overwrite: bool = False, seed: int = 0) -> dict:
    """Write example file ``name`` to ``out``; returns a summary row."""
    from llmtool.core.checkpoint import atomic_file
    from llmtool.core.console import UsageError

    if name not in NAMES:
        raise UsageError(f"unknown example {name!r}; choose one of: {', '.join(NAMES)}")
    if n is not None and name in COPIED and name != "judge-pairs":
        raise UsageError(f"--n does not apply to {name!r} (a packaged file, written whole)")
    with atomic_file(out, overwrite=overwrite) as tmp:
        if name in GENERATED:
            fn, default_n = GENERATED[name]
            lines = fn(default_n if n is None else n, seed)
        else:
            lines = COPIED[name].read_text().splitlines()
            if n is not None:
                lines = lines[:n]
        tmp.write_text("\n".join(lines) + "\n")
    rows = len(lines) - (1 if COPIED.get(name, Path()).suffix == ".csv" else 0)  # a CSV's header is no row
    return {"name": name, "out": str(out), "rows": rows}


@app.command()
def example_data(
    name: Annotated[str, typer.Argument(help="One of: " + ", ".join(NAMES) + ".")],
    out: Annotated[Path, typer.Option("--out", "-o", help="Output file (JSONL or CSV).")],
    n: Annotated[Optional[int], typer.Option("--n", min=1, help="Rows to write (generated files; "
                                             "default kvcache-prompts 4, corpus 400, sft 64).")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")] = False,
) -> None:
    """Write a small input file for the README's examples (prompts, corpus, SFT rows, judge pairs, ...)."""
    from llmtool.core.console import OPTIONS, emit

    emit(write(name, out, n=n, overwrite=overwrite, seed=OPTIONS.seed))

"""Prompt, parsing, sandboxed verification and selection for LLM-PV (spec llm-pv §3.1, §3.3).

- Prompt (our wording, the runner's structure): a problem statement naming the input kind and length,
  every *training* example as one ``input -> label`` line in a seeded shuffled order, and the output
  contract ``{"code": "<python source defining f>"}``. Validation and test examples never appear.
- Parse: the ``code`` field of the last JSON object that has one (double-escaped newlines repaired);
  else the last fenced code block; else the last top-level ``def`` block (with the top-level imports
  before it). No function definition -> ``parse_ok = False``. The function is ``f`` if defined, else the
  first top-level function.
- Predictions are normalised to 0/1: bools; ints (non-zero -> 1); strings "0"/"1"/"true"/"false".
  Anything else, or an exception on an input, is a wrong prediction for that input only. This is
  stricter than the official runner, which maps any non-empty non-numeric output to 1.
- Selection: highest validation accuracy; ties -> higher training accuracy -> shorter source
  (characters, comments and blank lines stripped) -> earlier index.
"""

from __future__ import annotations

import ast
import io
import json
import random
import re
import time
import tokenize
from dataclasses import dataclass

from llmtool.core.sandbox import SandboxLimits, call_many

KIND_TEXT = {
    "binary": "binary strings (characters '0' and '1')",
    "decimal": "decimal digit strings (a number written in base 10)",
    "graph": "edge lists: concatenated edges 'uAAvBB' with 2-digit vertex ids",
    "tabular": "tabular rows written as 'feature:value,feature:value,...'",
    "string": "strings",
}


def build_prompt(train: list[tuple[str, int]], kind: str, length: int | None, seed: int = 0) -> str:
    rows = list(train)
    random.Random(seed).shuffle(rows)
    size = f" of length {length}" if length else ""
    lines = "\n".join(f"{x} -> {y}" for x, y in rows)
    return (
        f"You are given input strings x, which are {KIND_TEXT.get(kind, 'strings')}{size}, and a binary label "
        "0/1 for each. Write a short Python function `f(x)` that computes the label from `x` (a Python str, not "
        "a list). It must be an explicit rule, not a fitted or learned model, and it may use only the Python "
        "standard library.\n\n"
        f"Training examples (input -> label):\n{lines}\n\n"
        'Return only a JSON object {"code": "<python source defining f>"} and nothing else: no prose, no '
        "markdown. Return the JSON immediately."
    )


_FENCE = re.compile(r"```[ \t]*(?:python|py|Python)?[ \t]*\n(.*?)```", re.S)


def _json_codes(text: str) -> list[str]:
    dec = json.JSONDecoder()
    found = []
    i = text.find("{")
    while i >= 0:
        try:
            obj, end = dec.raw_decode(text, i)
        except ValueError:
            i = text.find("{", i + 1)
            continue
        if isinstance(obj, dict) and isinstance(obj.get("code"), str):
            found.append(obj["code"])
        i = text.find("{", end if end > i else i + 1)
    return found


def _bare_def(text: str) -> str | None:
    lines = text.splitlines()
    starts = [i for i, l in enumerate(lines) if l.startswith("def ")]
    if not starts:
        return None
    s = starts[-1]
    body = [lines[s]]
    for l in lines[s + 1:]:
        if l.strip() == "" or l[:1] in (" ", "\t"):
            body.append(l)
        else:
            break
    imports = [l for l in lines[:s] if re.match(r"(import|from)\s+\w", l)]
    return "\n".join(imports + body).rstrip() + "\n"


def extract_code(text: str) -> str | None:
    """The candidate program in a model answer, or None when there is no function definition."""
    for code in reversed(_json_codes(text)):
        if "\n" not in code and "\\n" in code:
            code = code.replace("\\n", "\n").replace("\\t", "\t").replace('\\"', '"')
        if re.search(r"^\s*def\s+\w+\s*\(", code, re.M):
            return code.strip("\n") + "\n"
    fences = _FENCE.findall(text)
    for code in reversed(fences):
        if re.search(r"^\s*def\s+\w+\s*\(", code, re.M):
            return code.strip("\n") + "\n"
    return _bare_def(text)


def function_name(code: str) -> str | None:
    """``f`` if defined at top level, else the first top-level function; None if none (or no parse)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return None
    names = [n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))]
    return "f" if "f" in names else (names[0] if names else None)


def source_length(code: str) -> int:
    """Characters of the source without comments and blank lines (the tie-break length)."""
    try:
        toks = [t for t in tokenize.generate_tokens(io.StringIO(code).readline) if t.type != tokenize.COMMENT]
        code = tokenize.untokenize(toks)
    except (tokenize.TokenError, IndentationError, SyntaxError):
        pass
    return sum(len(l.rstrip()) for l in code.splitlines() if l.strip())


def normalise(value) -> int | None:
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int):
        return int(value != 0)
    if isinstance(value, str):
        v = value.strip().lower()
        return {"0": 0, "1": 1, "true": 1, "false": 0}.get(v)
    return None


@dataclass
class Evaluation:
    acc: float
    predictions: list[int | None]
    errors: int
    first_error: str | None
    seconds: float
    timed_out: bool


def evaluate(code: str, func: str, rows: list[tuple[str, int]], limits: SandboxLimits,
             wrapper: list[str] | None = None) -> Evaluation:
    """Run the program on every input of ``rows`` in one sandboxed process; accuracy against labels."""
    if not rows:
        return Evaluation(float("nan"), [], 0, None, 0.0, False)
    t0 = time.monotonic()
    res = call_many(code, func, [[x] for x, _ in rows], limits=limits, wrapper=wrapper)
    preds, errors, first = [], 0, None
    timed_out = False
    for r in res:
        p = normalise(r.value) if r.ok else None
        if p is None:
            errors += 1
            msg = r.error if not r.ok else f"non-binary output {r.value!r:.60}"
            first = first or msg
            timed_out = timed_out or (not r.ok and "timed out" in (r.error or ""))
        preds.append(p)
    correct = sum(p == y for p, (_, y) in zip(preds, rows))
    return Evaluation(correct / len(rows), preds, errors, first, time.monotonic() - t0, timed_out)


OUTCOMES = ("binary_on_all", "no_function", "syntax_error", "timeout", "exception", "non_binary_output")


def outcome(c: dict) -> str:
    """What became of one proposal, for the summary's breakdown: it returned 0/1 on every train/val input,
    or the first reason it did not (no function in the answer, a syntax error, a timeout, an exception,
    or an output that is not a 0/1 label)."""
    if not c.get("parse_ok"):
        return "no_function"
    if not c.get("compile_ok"):
        return "syntax_error"
    if not c.get("n_errors"):
        return "binary_on_all"
    if c.get("timed_out"):
        return "timeout"
    return "non_binary_output" if (c.get("error") or "").startswith("non-binary output") else "exception"


def selection_key(c: dict):
    """Sort key: best first (val desc, train desc, shorter source, earlier index)."""
    return (-(c.get("val_acc") or 0.0), -(c.get("train_acc") or 0.0), c.get("length", 10 ** 9), c["idx"])


def select(candidates: list[dict]) -> dict | None:
    ok = [c for c in candidates if c.get("compile_ok")]
    return min(ok, key=selection_key) if ok else None

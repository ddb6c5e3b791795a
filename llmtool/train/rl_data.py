"""RLVR data: offline, deterministic task generators, answer extraction and the JSONL loader.

Rows are ``{"prompt": str, "answer": str, "task": str, ...}``. Tasks (all generated from a seed):

- ``arith`` — addition/multiplication word-free prompts ("What is 7 + 5?"), mixing 1-digit items
  (SmolLM2-135M ≈ 60 % correct at T = 1) and 2-digit additions (≈ 12 %) with ``--hard-frac`` so that
  groups have reward variance. Scored on the **last integer** of the response: a ``\\boxed{}`` format
  gives this model no reward variance (0 % boxed; spec corrections).
- ``mul`` — harder multiplication for a stronger model, in the same "What is a * b?" form and scored the
  same way: 2-digit × 2-digit and 3-digit × 1-digit items (Qwen2.5-Coder-0.5B-Instruct, greedy, with its chat
  template: ≈ 46 % and 56 % correct in a 40-item pilot, so groups have reward variance); ``hard_frac`` is the
  2-digit × 2-digit share.
- ``sum-two`` — the multi-answer task for diversity: "Write N as a sum of two positive integers."
  Any ``a + b`` with ``a, b >= 1`` and ``a + b = N`` is correct; the answer key is the unordered pair,
  so distinct correct answers per prompt can be counted.
- ``rg:<name>`` — a PyPI ``reasoning-gym`` generator with its own verifier (optional dependency);
  ``rg:gsm_symbolic`` is the hard transfer set.

Reconstructed choices: "last integer" accepts a leading minus sign and ignores thousands
separators; for ``sum-two`` the last ``a + b`` in the text is the answer.
"""
from __future__ import annotations

import json
import random
import re
from pathlib import Path
from typing import Iterable

from llmtool.core.console import UsageError

_INT = re.compile(r"-?\d[\d,]*")
_PAIR = re.compile(r"(\d+)\s*\+\s*(\d+)")


def last_integer(text: str) -> str | None:
    """The last integer in ``text`` as a canonical string (``"1,024"`` → ``"1024"``), or None."""
    found = _INT.findall(text or "")
    if not found:
        return None
    s = found[-1].replace(",", "").rstrip(",")
    try:
        return str(int(s))
    except ValueError:
        return None


def sum_pair(text: str) -> tuple[int, int] | None:
    """The last ``a + b`` in ``text`` as a sorted pair, or None."""
    found = _PAIR.findall(text or "")
    if not found:
        return None
    a, b = int(found[-1][0]), int(found[-1][1])
    return (min(a, b), max(a, b))


def extract_answer(row: dict, text: str) -> str | None:
    """The response's final answer in the row's task format (a hashable string key)."""
    task = row.get("task", "arith")
    if task == "sum-two":
        p = sum_pair(text)
        return None if p is None else f"{p[0]}+{p[1]}"
    if task.startswith("rg:"):
        return (text or "").strip().splitlines()[-1].strip() if (text or "").strip() else None
    return last_integer(text)


def is_correct(row: dict, text: str, answer: str | None = None) -> bool:
    """Verifier: does ``text`` (or an already extracted ``answer``) solve ``row``?"""
    task = row.get("task", "arith")
    ans = extract_answer(row, text) if answer is None else answer
    if ans is None:
        return False
    if task == "sum-two":
        a, b = (int(x) for x in ans.split("+"))
        return a >= 1 and b >= 1 and a + b == int(row["n"])
    if task.startswith("rg:"):
        return _rg_score(row, ans) >= 1.0
    return ans == str(row["answer"]).strip()


def matches(row: dict, text: str, label: str) -> bool:
    """Does the response's answer equal an arbitrary ``label`` (majority-vote / incorrect rewards)?"""
    ans = extract_answer(row, text)
    return ans is not None and ans == str(label).strip()


# ------------------------------------------------------------------------------------ generators
def make_arith(n: int, seed: int = 0, hard_frac: float = 0.4) -> list[dict]:
    """1-digit additions/multiplications and (a ``hard_frac`` share of) 2-digit additions."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if rng.random() < hard_frac:
            a, b = rng.randint(10, 99), rng.randint(10, 99)
            op, level = "+", "2-digit"
        else:
            a, b = rng.randint(1, 9), rng.randint(1, 9)
            op, level = rng.choice("+*"), "1-digit"
        ans = a + b if op == "+" else a * b
        sym = "+" if op == "+" else "*"
        rows.append({"prompt": f"What is {a} {sym} {b}?", "answer": str(ans), "task": "arith", "level": level,
                     "id": f"arith-{seed}-{i}"})
    return rows


def make_mul(n: int, seed: int = 0, hard_frac: float = 0.5) -> list[dict]:
    """2-digit × 2-digit (a ``hard_frac`` share, level ``2x2``) and 3-digit × 1-digit (``3x1``, factor 2-9)
    multiplications, "What is a * b?", answer the product."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        if rng.random() < hard_frac:
            a, b, level = rng.randint(10, 99), rng.randint(10, 99), "2x2"
        else:
            a, b, level = rng.randint(100, 999), rng.randint(2, 9), "3x1"
        rows.append({"prompt": f"What is {a} * {b}?", "answer": str(a * b), "task": "mul", "level": level,
                     "id": f"mul-{seed}-{i}"})
    return rows


def make_sum_two(n: int, seed: int = 0, lo: int = 6, hi: int = 20) -> list[dict]:
    """"Write N as a sum of two positive integers" (N - 1 correct unordered... ordered pairs; the key
    is the unordered pair, so ``N // 2`` distinct correct answers)."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        N = rng.randint(lo, hi)
        rows.append({"prompt": f"Write {N} as a sum of two positive integers. Answer in the form a + b.",
                     "answer": f"any a + b = {N}", "n": N, "task": "sum-two", "id": f"sum2-{seed}-{i}"})
    return rows


def rg_dataset(name: str, n: int, seed: int, config: dict | None):
    """A reasoning-gym dataset; ``config`` holds the generator's difficulty fields (lists stand for tuples, as
    they come back from JSON)."""
    import reasoning_gym

    kw = {k: tuple(v) if isinstance(v, list) else v for k, v in (config or {}).items()}
    return reasoning_gym.create_dataset(name, size=n, seed=seed, **kw)


def make_reasoning_gym(name: str, n: int, seed: int = 0, config: dict | None = None) -> list[dict]:
    """``n`` prompts of the reasoning-gym generator ``name`` with its verifier fields; ``config`` sets the
    generator's difficulty (e.g. ``{"max_terms": 3, "max_digits": 1}`` for ``chain_sum``) and travels with each
    row, so the verifier rebuilds the same items."""
    try:
        import reasoning_gym  # noqa: F401
    except ImportError:
        raise UsageError("task rg:NAME needs the optional package reasoning-gym (pip install reasoning-gym)") from None
    try:
        ds = rg_dataset(name, n, seed, config)
    except Exception as e:  # unknown generator names and config fields raise various errors
        raise UsageError(f"reasoning-gym task {name!r}: {e}") from None
    extra = {"rg_config": dict(config)} if config else {}
    rows = []
    for i, item in enumerate(ds):
        rows.append({"prompt": item["question"] + "\nGive only the final answer on the last line.",
                     "answer": str(item["answer"]), "task": f"rg:{name}", "rg_index": i, "rg_seed": seed,
                     "rg_size": n, "id": f"rg-{name}-{seed}-{i}", **extra})
    return rows


_RG_CACHE: dict = {}


def _rg_score(row: dict, ans: str) -> float:
    name, config = row["task"][3:], row.get("rg_config")
    key = (name, row.get("rg_size"), row.get("rg_seed"), json.dumps(config, sort_keys=True))
    if key not in _RG_CACHE:
        _RG_CACHE[key] = rg_dataset(name, row["rg_size"], row["rg_seed"], config)
    ds = _RG_CACHE[key]
    return float(ds.score_answer(ans, ds[row["rg_index"]]))


def make_task(task: str, n: int, seed: int = 0, hard_frac: float = 0.4) -> list[dict]:
    if task == "arith":
        return make_arith(n, seed, hard_frac)
    if task == "mul":
        return make_mul(n, seed, hard_frac)
    if task == "sum-two":
        return make_sum_two(n, seed)
    if task.startswith("rg:"):
        return make_reasoning_gym(task[3:], n, seed)
    raise UsageError(f"unknown task {task!r}: choose arith, mul, sum-two or rg:<reasoning-gym name>")


# ------------------------------------------------------------------------------------ loading
def load_rows(path: str | Path, need_answer: bool = True) -> list[dict]:
    """Read a JSONL file of rows; a malformed line or a missing field is one UsageError naming the
    file, line and field. ``path`` may also be ``gen:<task>:<n>[:<seed>]`` for generated data."""
    text = str(path)
    if text.startswith("gen:"):
        parts = text.split(":")
        try:
            task = parts[1] if parts[1] != "rg" else f"rg:{parts[2]}"
            rest = parts[2:] if parts[1] != "rg" else parts[3:]
            n = int(rest[0])
            seed = int(rest[1]) if len(rest) > 1 else 0
        except (IndexError, ValueError):
            raise UsageError(f"--data {text!r}: expected gen:<task>:<n>[:<seed>]") from None
        return make_task(task, n, seed)
    p = Path(text)
    if not p.is_file():
        raise UsageError(f"--data {p}: no such file")
    from llmtool.core.data import iter_jsonl

    rows = []
    for ln, row in iter_jsonl(p):
        if not isinstance(row.get("prompt"), str) or not row["prompt"].strip():
            raise UsageError(f"{p}:{ln}: missing field 'prompt' (a non-empty string)")
        if need_answer and row.get("task", "arith") != "sum-two" and row.get("answer") in (None, ""):
            raise UsageError(f"{p}:{ln}: missing field 'answer' (needed by a verifier reward)")
        if row.get("task") == "sum-two" and not isinstance(row.get("n"), int):
            raise UsageError(f"{p}:{ln}: missing field 'n' (an integer) for task sum-two")
        rows.append(row)
    if not rows:
        raise UsageError(f"--data {p}: no rows")
    return rows


def write_rows(rows: Iterable[dict], path: Path) -> None:
    with open(path, "w", encoding="utf-8") as fh:
        for r in rows:
            fh.write(json.dumps(r) + "\n")

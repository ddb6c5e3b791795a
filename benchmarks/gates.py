"""Gate verdicts shared by the benchmarks: **met**, **not met**, or **not tested** with a reason.

A gate compares measured numbers with a threshold; it only tests a paper's claim when the run could
have failed it. Each gate therefore names its precondition: the experimental condition under which
the comparison can go either way (the proposer reached val = 1.0 on some rule, the clip bound on at
least 1 % of tokens, pass@k is below 1, the two arms are not tied, the experts are not disjoint).
When the precondition does not hold the verdict is ``not tested`` and the reason is printed, never
``met`` (issues 42 and 43: several gates passed on ties at 0 %, on empty sets, or on saturated
metrics).

One record per gate, JSON-ready::

    {"gate": name, "verdict": "met" | "not met" | "not tested", "met": True | False | None,
     "measured": ..., "reason": "..."}

``met`` stays a bool (``None`` when not tested) so older readers of the results keep working.
"""
from __future__ import annotations

import json
import math

MET, NOT_MET, NOT_TESTED = "met", "not met", "not tested"


def gate(name: str, ok, measured=None, *, precondition: bool = True, reason: str = "") -> dict:
    """The verdict of one gate. ``ok`` is evaluated only when ``precondition`` holds (pass a
    callable to defer a comparison that is meaningless otherwise, e.g. over an empty set);
    ``reason`` says what the precondition is (printed when it fails)."""
    if not precondition:
        return {"gate": name, "verdict": NOT_TESTED, "met": None, "measured": measured,
                "reason": reason or "its precondition did not hold"}
    value = bool(ok() if callable(ok) else ok)
    return {"gate": name, "verdict": MET if value else NOT_MET, "met": value, "measured": measured,
            "reason": ""}


def verdict(g) -> str:
    """The verdict string of a gate record, or of a legacy bool / ``{"met": ...}`` value."""
    if isinstance(g, dict):
        if "verdict" in g:
            return g["verdict"]
        if "met" in g:
            return NOT_TESTED if g["met"] is None else (MET if g["met"] else NOT_MET)
    if isinstance(g, bool):
        return MET if g else NOT_MET
    return str(g)


def render(g, *, bold: bool = True) -> str:
    """``met (measured …)``, ``**NOT met** (measured …)`` or ``not tested: reason (measured …)``."""
    v = verdict(g)
    text = {MET: "met", NOT_MET: "**NOT met**" if bold else "NOT met"}.get(v, v)
    if isinstance(g, dict):
        if v == NOT_TESTED and g.get("reason"):
            text += f": {g['reason']}"
        m = g.get("measured")
        if m is not None and m != {} and m != []:
            text += f" (measured {m if isinstance(m, str) else json.dumps(m, default=str)})"
    return text


def lines(gates, *, bold: bool = True) -> list[str]:
    """Markdown bullets for a list of gate records (or a ``{name: record}`` mapping)."""
    items = gates.items() if isinstance(gates, dict) else ((g["gate"], g) for g in gates)
    return [f"- {name}: {render(g, bold=bold)}" for name, g in items]


def tied(a: float, b: float, tol: float = 1e-12) -> bool:
    """Whether two arm statistics are equal (a ``<=`` gate on them cannot separate the arms)."""
    return math.isclose(float(a), float(b), rel_tol=0.0, abs_tol=tol)


def saturated(values, top: float = 1.0, tol: float = 1e-9) -> bool:
    """Whether every value sits at the metric's ceiling (a direction on them cannot fail)."""
    values = list(values)
    return bool(values) and all(float(v) >= top - tol for v in values)

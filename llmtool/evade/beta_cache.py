"""BIRA's beta0 per rewriter: calibrate once (:func:`llmtool.evade.bira.calibrate_beta`) and remember it.

The paper calibrates beta0 per rewriter (-4 for Llama-3.1-8B/70B, -11 for gpt-4o-mini), so
``llmtool evade attack --method bira`` without ``--beta0`` looks up the value measured for this rewriter
and, on the first use, measures it on the packaged held-out Austen text (``austen-test``), then stores it
in ``$LLMTOOL_HOME/evade/beta0.json``. The key is a fingerprint of the rewriter (config.json, the
safetensors headers and sizes) plus everything the measurement depends on (decoding, grid, texts, seed),
so a fine-tuned or re-quantised rewriter in the same directory is calibrated again.
"""
from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Callable

GRID = tuple(float(-b) for b in range(1, 13))     # the paper's -1, -2, ..., -12
CALIB_SOURCE = "austen-test"


def cache_path() -> Path:
    from llmtool.core.defaults import home

    return home() / "evade" / "beta0.json"


def rewriter_fingerprint(model_dir: Path) -> str:
    """sha256 of config.json and of every safetensors file's name, size and header (the tensor table)."""
    h = hashlib.sha256()
    h.update((model_dir / "config.json").read_bytes())
    for f in sorted(model_dir.glob("*.safetensors")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            n = int.from_bytes(fh.read(8), "little")
            h.update(fh.read(min(n, 100_000_000)))
    return h.hexdigest()


def cache_key(fingerprint: str, settings: dict) -> str:
    return hashlib.sha256(json.dumps({"rewriter": fingerprint, **settings}, sort_keys=True).encode()).hexdigest()


def lookup(key: str) -> dict | None:
    path = cache_path()
    if not path.is_file():
        return None
    try:
        return json.loads(path.read_text()).get(key)
    except (json.JSONDecodeError, OSError, AttributeError):
        return None              # a damaged cache is ignored (and rewritten on the next store)


def store(key: str, entry: dict) -> None:
    from llmtool.core.checkpoint import atomic_file

    path = cache_path()
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        doc = json.loads(path.read_text()) if path.is_file() else {}
        if not isinstance(doc, dict):
            doc = {}
    except (json.JSONDecodeError, OSError):
        doc = {}
    doc[key] = entry
    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(doc, indent=1))


def calibrated_beta0(model_dir: Path, settings: dict, measure: Callable[[], tuple[float | None, list[dict]]],
                     fallback: float) -> tuple[float, dict]:
    """beta0 for the rewriter in ``model_dir`` under ``settings``: the cached value, else ``measure()``
    (stored). When no beta on the grid degenerates the rewriter tolerates the whole grid and its end is
    used; ``fallback`` is used only when the measurement is uninformative (the rewriter degenerates at
    beta = 0 more often than not). Returns (beta0, entry) with ``entry["cached"]`` saying where it came from."""
    key = cache_key(rewriter_fingerprint(model_dir), settings)
    entry = lookup(key)
    if entry is not None and isinstance(entry.get("beta0"), (int, float)):
        return float(entry["beta0"]), {**entry, "cached": True}
    beta0, curve = measure()
    base = curve[0]["degenerate_rate"] if curve and curve[0]["beta"] == 0.0 else 0.0
    if beta0 is None:
        beta0, note = (fallback, f"uninformative: {base:.0%} degenerate at beta = 0") if base > 0.5 else \
            (min(settings["grid"]), "no beta on the grid degenerates: its end is used")
    else:
        note = "first beta degenerating significantly more often than beta = 0"
    entry = {"beta0": float(beta0), "curve": curve, "note": note, "rewriter": str(model_dir), **settings}
    store(key, entry)
    return float(beta0), {**entry, "cached": False}

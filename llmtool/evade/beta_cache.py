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
                     fallback: float, use_cache: bool = True) -> tuple[float, dict]:
    """beta0 for the rewriter in ``model_dir`` under ``settings``: the cached value, else ``measure()``
    (stored). When no beta on the grid degenerates the rewriter tolerates the whole grid and its end is
    used; ``fallback`` is used only when the measurement is uninformative (the rewriter degenerates at
    beta = 0 more often than not). ``use_cache=False`` always measures and neither reads nor writes the cache
    (a benchmark re-measuring the calibration). Returns (beta0, entry) with ``entry["cached"]`` saying where it
    came from."""
    key = cache_key(rewriter_fingerprint(model_dir), settings)
    entry = lookup(key) if use_cache else None
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
    if use_cache:
        store(key, entry)
    return float(beta0), {**entry, "cached": False}


def calibrate_for_rewriter(para, model_dir: Path, *, texts: int, temperature: float, top_p: float, seed: int,
                           percentile: float = 0.0, aux_name: str | None = None, aux_model=None, aux_tokenizer=None,
                           announce: Callable[[], None] | None = None, use_cache: bool = True) -> tuple[float, dict]:
    """beta0 of the rewriter ``para`` (a :class:`llmtool.evade.paraphrase.Paraphraser` loaded from
    ``model_dir``): cached, or measured on ``texts`` held-out Austen texts with
    :func:`llmtool.evade.bira.calibrate_beta` (``announce`` is called before a measurement; ``use_cache``: see
    :func:`calibrated_beta0`)."""
    settings = {"texts": texts, "source": CALIB_SOURCE, "grid": list(GRID), "temperature": temperature,
                "top_p": top_p, "percentile": percentile, "aux_model": aux_name, "seed": seed,
                "rule": "wilson-vs-beta0"}

    def measure():
        from llmtool.evade.attacks import suppression_sets
        from llmtool.evade.bira import calibrate_beta
        from llmtool.evade.prompts import austen_prompts

        if announce is not None:
            announce()
        docs = [r["prompt"] + " " + r["human_text"] for r in austen_prompts(texts, source=CALIB_SOURCE, seed=seed)]
        sets = suppression_sets(docs, para, aux_model, aux_tokenizer, percentile)
        lengths = [para.source_length(t) for t in docs]
        return calibrate_beta(lambda beta: para.rewrite_ids(docs, sets, [beta] * len(docs), seed=seed), lengths, GRID)

    return calibrated_beta0(model_dir, settings, measure, fallback=-4.0, use_cache=use_cache)

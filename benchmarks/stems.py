"""Results-file stems of benchmarks that take ``--model``: the default model's results keep the benchmark's own
name, any other model gets ``<name>-<model>`` (issue 40's second-family rows), so a run with another model never
overwrites the default model's tables."""
from __future__ import annotations

import re
from pathlib import Path

DEFAULT_MODEL = "smollm2-135m"


def model_stem(name: str, model: str, default: str = DEFAULT_MODEL) -> str:
    """``name`` for the default model, else ``name-<model>`` with the model's alias or directory name lowercased and
    every run of other characters (dots included, so the stem takes a suffix safely) turned into one '-'."""
    if model == default:
        return name
    slug = re.sub(r"[^A-Za-z0-9]+", "-", Path(model.rstrip("/")).name).strip("-").lower()
    return f"{name}-{slug or 'model'}"

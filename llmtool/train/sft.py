"""Supervised fine-tuning with a ``--clip`` policy (AdaGC, GlobalGC, ...), on the shared trainer.

Rows are JSONL ``{"prompt", "completion"}`` (loss on completion tokens) or ``{"text"}`` (loss on every
token); a malformed line is refused naming the file, line and field. The training itself is
:func:`llmtool.train.pretrain.train_with_clipper` (the same runner as pretraining), so metrics JSONL,
spike scores, fault injection and clipper-state checkpoints behave identically.
"""
from __future__ import annotations

from pathlib import Path

from llmtool.core.console import UsageError


def load_sft_rows(path: str | Path) -> list[dict]:
    from llmtool.core.data import iter_jsonl

    path = Path(path)
    if not path.is_file():
        raise UsageError(f"--data {path}: no such file")
    rows = []
    for ln, rec in iter_jsonl(path):
        if "text" in rec:
            if not isinstance(rec["text"], str):
                raise UsageError(f"{path}:{ln}: field 'text' must be a string")
            rows.append({"text": rec["text"]})
        elif "prompt" in rec and "completion" in rec:
            for k in ("prompt", "completion"):
                if not isinstance(rec[k], str):
                    raise UsageError(f"{path}:{ln}: field '{k}' must be a string")
            rows.append({"prompt": rec["prompt"], "completion": rec["completion"]})
        else:
            raise UsageError(f"{path}:{ln}: needs field 'text' or fields 'prompt' and 'completion'")
    if not rows:
        raise UsageError(f"--data {path}: no rows")
    return rows

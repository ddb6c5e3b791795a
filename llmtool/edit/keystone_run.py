"""Keystone/random/full SFT run: train, measure target-task loss and retention (perplexity on the
other capability texts) before and after, write the merged checkpoint, the delta file,
``trainable_manifest.json`` and ``metrics.jsonl`` into the job directory (the CLI wraps it in
:func:`llmtool.core.job.job`, which writes ``llmtool.json`` and ``report.json``)."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from llmtool.core.checkpoint import copy_tokenizer, save_state_dict
from llmtool.edit.keystone import Neuron, default_eval_texts
from llmtool.edit.keystone_sft import SFTConfig, encode_examples, finetune, task_metrics


def run_finetune(model, tok, src: Path, tmp: Path, train_rows: list[dict], held_rows: list[dict],
                 neurons: list[Neuron] | None, cfg: SFTConfig, mode: str) -> tuple[dict, dict]:
    """Train, measure, and write the outputs into the job directory ``tmp``; returns (summary, metrics)."""
    from llmtool.core.data import tokenize

    pad = tok.pad_token_id or 0
    held_ex = encode_examples(tok, held_rows, cfg.max_length)
    retention_ids = [tokenize(tok, r["text"]) for r in default_eval_texts()]
    before = task_metrics(model, held_ex, retention_ids, pad)
    res = finetune(model, tok, train_rows, cfg, mode, neurons)
    after = task_metrics(model, held_ex, retention_ids, pad)
    records, trainable_count, delta_state = res["records"], res["trainable_parameters"], res["delta_state"]
    save_state_dict(model.state_dict(), tmp)
    for f in ("config.json", "generation_config.json"):
        if (src / f).is_file():
            (tmp / f).write_bytes((src / f).read_bytes())
    copy_tokenizer(src, tmp)
    if delta_state:
        from safetensors.torch import save_file

        save_file(delta_state, str(tmp / "keystone_delta.safetensors"))
    manifest = {"trainable": mode, "trainable_parameters": trainable_count, "config": asdict(cfg),
                "neurons": [asdict(n) for n in neurons] if neurons else None}
    (tmp / "trainable_manifest.json").write_text(json.dumps(manifest, indent=1))
    (tmp / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    metrics = {"before": before, "after": after, "steps": len(records), "trainable_parameters": trainable_count}
    summary = {"trainable": mode, "trainable_parameters": trainable_count, "steps": len(records),
               "target_loss_before": before["target_loss"], "target_loss_after": after["target_loss"],
               "retention_ppl_before": before["retention_ppl"], "retention_ppl_after": after["retention_ppl"]}
    return summary, metrics

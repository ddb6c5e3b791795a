"""Keystone/random/full SFT run: train, measure target-task loss and retention (perplexity on the
other capability texts) before and after, write the merged checkpoint, the delta file,
``trainable_manifest.json`` and ``metrics.jsonl``."""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import torch

from llmtool.core.checkpoint import atomic_output, copy_tokenizer, save_state_dict, write_provenance
from llmtool.edit.keystone import Neuron, default_eval_texts
from llmtool.edit.keystone_sft import SFTConfig, task_metrics, train, trainable_parameters


def run_finetune(model, tok, src: Path, out: Path, overwrite: bool, train_ex, held_ex,
                 neurons: list[Neuron] | None, cfg: SFTConfig, mode: str) -> dict:
    from llmtool.core.data import tokenize

    pad = tok.pad_token_id or 0
    retention_ids = [tokenize(tok, r["text"]) for r in default_eval_texts()]
    before = task_metrics(model, held_ex, retention_ids, pad)
    params, deltas = trainable_parameters(model, mode, neurons)
    records = train(model, train_ex, params, cfg, pad)
    after = task_metrics(model, held_ex, retention_ids, pad)
    trainable_count = sum(p.numel() for p in params)
    names = {id(m): n for n, m in model.named_modules()}
    delta_state = deltas.state(names) if deltas else {}
    if deltas:
        deltas.merge()
    for p in model.parameters():
        p.requires_grad_(False)
    with atomic_output(out, overwrite) as tmp:
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
        metrics = {"before": before, "after": after, "steps": len(records)}
        write_provenance(tmp, "edit keystone finetune", mode, asdict(cfg), source=src, metrics=metrics)
    return {"trainable": mode, "trainable_parameters": trainable_count, "steps": len(records),
            "target_loss_before": before["target_loss"], "target_loss_after": after["target_loss"],
            "retention_ppl_before": before["retention_ppl"], "retention_ppl_after": after["retention_ppl"]}

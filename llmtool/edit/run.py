"""End-to-end ``llmtool edit``: load the model, fetch cached key statistics and context templates,
apply the edits, and write a checkpoint in which only the edited ``down_proj.weight`` tensors
differ (every other tensor is copied byte for byte from the input, dtype kept), plus
``edit_manifest.json``, ``targets.safetensors`` and ``llmtool.json``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from llmtool.core.checkpoint import (LazyCheckpoint, atomic_output, copy_tokenizer, save_state_dict,
                                     source_hash, write_provenance)
from llmtool.core.console import UsageError, info
from llmtool.edit.memit import EditConfig, apply_edits
from llmtool.edit.requests import EditRequest


def fingerprint(model_dir: Path) -> str:
    return source_hash(model_dir)[:16]


def check_layers(layers: list[int], n_layers: int) -> list[int]:
    if not layers:
        raise UsageError("--layers: give at least one layer")
    bad = [l for l in layers if not 0 <= l < n_layers]
    if bad:
        raise UsageError(f"--layers: {bad} out of range (model has {n_layers} layers: 0..{n_layers - 1})")
    if len(set(layers)) != len(layers):
        raise UsageError("--layers: repeated layer")
    return sorted(layers)


def prepare(model, tok, model_dir: Path, cfg: EditConfig, seed: int, stats_corpus: str, stats_samples: int,
            cache: bool = True):
    """Second moments for cfg.layers and the context templates (both cached per model)."""
    from llmtool.core.defaults import home
    from llmtool.edit.covariance import second_moments
    from llmtool.edit.prompts import cached_templates

    fp = fingerprint(model_dir)
    C = second_moments(model, tok, cfg.layers, fp, corpus=stats_corpus, samples=stats_samples, seed=seed)
    templates = cached_templates(model, tok, fp, seed, home() / "edit-cache" if cache else None)
    return C, templates, fp


def save_edited(model, src: Path, tmp: Path, layers: list[int]) -> list[str]:
    """Write the checkpoint: original tensors, with the edited layers' down_proj replaced."""
    from llmtool.core.models import decoder_layers

    ckpt = LazyCheckpoint(src)
    tensors = ckpt.load()
    changed = []
    for l in layers:
        matches = [k for k in tensors if k.endswith(f"layers.{l}.mlp.down_proj.weight")]
        if len(matches) != 1:
            raise UsageError(f"{src}: cannot find mlp.down_proj.weight of layer {l} in the checkpoint")
        name = matches[0]
        w = decoder_layers(model)[l].mlp.down_proj.weight.detach().cpu()
        tensors[name] = w.to(tensors[name].dtype).contiguous()
        changed.append(name)
    save_state_dict(tensors, tmp)
    for f in ("config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    copy_tokenizer(src, tmp)
    return changed


def write_outputs(model, src: Path, out: Path, overwrite: bool, cfg: EditConfig, requests: list[EditRequest],
                  report: dict, templates: list[str], params: dict) -> dict:
    from safetensors.torch import save_file

    with atomic_output(out, overwrite) as tmp:
        changed = save_edited(model, src, tmp, cfg.layers if requests else [])
        batches = report.get("batches", [])
        manifest = {
            "method": cfg.method, "anchor": cfg.anchor, "layers": cfg.layers, "config": cfg.to_json(),
            "templates": templates, "requests": [r.digest() for r in requests],
            "changed_tensors": changed,
            "batches": [{"layers": b["layers"], "z": b["z"]} for b in batches],
            "solver": report.get("solver", {}), **params,
        }
        (tmp / "edit_manifest.json").write_text(json.dumps(manifest, indent=2, default=str))
        targets = {}
        for bi, b in enumerate(batches):
            for l, t in b["targets"].items():
                targets[f"batch{bi}.layer{l}"] = t.float().contiguous()
        if targets:
            save_file(targets, str(tmp / "targets.safetensors"))
        final = batches[-1]["layers"][-1]["remaining_residual_ratio"] if batches else None
        write_provenance(tmp, "edit", f"{cfg.method}+{cfg.anchor}", {**cfg.to_json(), **params}, source=src,
                         metrics={"requests": len(requests), "final_remaining_residual_ratio": final})
    return manifest


def run_edit(model_arg: str, requests: list[EditRequest], out: Path, cfg: EditConfig, overwrite: bool = False,
             seed: int = 0, stats_corpus: str = "austen-train", stats_samples: int = 20000,
             preset: str | None = None) -> dict:
    from llmtool.core.checkpoint import check_output
    from llmtool.core.models import check_causal_lm, decoder_layers, load_model, load_tokenizer, resolve_model, set_seed

    src = resolve_model(model_arg)
    check_causal_lm(src)
    check_output(out, overwrite, inputs=(src,))
    tok = load_tokenizer(src)
    model = load_model(src, dtype=torch.float32)
    try:
        decoder_layers(model)[0].mlp.down_proj
    except AttributeError:
        raise UsageError(f"{src}: unsupported architecture (decoder layers have no mlp.down_proj)") from None
    cfg.layers = check_layers(cfg.layers, len(decoder_layers(model)))
    set_seed(seed)
    if not requests:
        info("empty request set: writing an unchanged copy")
        return write_outputs(model, src, out, overwrite, cfg, [], {}, [], {"seed": seed})
    C, templates, fp = prepare(model, tok, src, cfg, seed, stats_corpus, stats_samples)
    report = apply_edits(model, tok, requests, cfg, templates, C)
    params = {"seed": seed, "stats_corpus": stats_corpus, "stats_samples": stats_samples, "model_fingerprint": fp,
              "preset": preset}
    return write_outputs(model, src, out, overwrite, cfg, requests, report, templates, params)

"""End-to-end ``llmtool edit``: load the model, fetch cached key statistics and context templates,
apply the edits, and write a checkpoint in which only the edited ``down_proj.weight`` tensors
differ (every other tensor is copied byte for byte from the input, dtype kept), plus
``edit_manifest.json``, ``targets.safetensors`` and ``llmtool.json``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from llmtool.core.checkpoint import LazyCheckpoint, copy_tokenizer, save_state_dict, source_hash
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
    from llmtool.core.arch import linear_names

    ckpt = LazyCheckpoint(src)
    tensors = ckpt.load()
    changed = []
    for l in layers:
        module = linear_names(model, roles=("down",))[l][0]
        matches = [k for k in tensors if k == f"{module}.weight" or k.endswith("." + module.split(".", 1)[-1] + ".weight")]
        if len(matches) != 1:
            raise UsageError(f"{src}: cannot find {module}.weight of layer {l} in the checkpoint")
        name = matches[0]
        w = model.get_submodule(module).weight.detach().cpu()
        tensors[name] = w.to(tensors[name].dtype).contiguous()
        changed.append(name)
    save_state_dict(tensors, tmp)
    for f in ("config.json", "generation_config.json"):
        if (src / f).is_file():
            shutil.copy2(src / f, tmp / f)
    copy_tokenizer(src, tmp)
    return changed


def write_outputs(model, src: Path, tmp: Path, cfg: EditConfig, requests: list[EditRequest],
                  report: dict, templates: list[str], params: dict) -> dict:
    """Checkpoint, ``edit_manifest.json`` and ``targets.safetensors`` into the job directory ``tmp``."""
    from safetensors.torch import save_file

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
    return manifest


def _dtype(model) -> str:
    return str(next(model.parameters()).dtype).replace("torch.", "")


def run_edit(model_arg: str, requests: list[EditRequest], out: Path, cfg: EditConfig, overwrite: bool = False,
             seed: int = 0, stats_corpus: str = "austen-train", stats_samples: int = 20000,
             preset: str | None = None, method_config=None) -> dict:
    """Edit MODEL into OUT inside the shared job wrapper. Provenance is ``method_config`` (the CLI's method
    config) as a dict; the runtime EditConfig and run settings are recorded beside it."""
    from llmtool.core.arch import arch_of
    from llmtool.core.job import job
    from llmtool.core.models import decoder_layers, set_seed

    with job("edit", out, overwrite=overwrite, config=method_config if method_config is not None else cfg,
             model=model_arg, seed=seed) as j:
        src = j.model_path
        tok = j.tokenizer
        model = j.model  # the global --dtype (statistics and solves are float64 regardless)
        arch_of(model, "llmtool edit")
        cfg.layers = check_layers(cfg.layers, len(decoder_layers(model)))
        from llmtool.edit.layerio import down_proj

        for l in cfg.layers:   # an MoE layer's per-expert down projections are refused here, before statistics
            down_proj(model, l)
        set_seed(seed)
        params = {"seed": seed, "dtype": _dtype(model)}
        report, templates = {}, []
        if not requests:
            info("empty request set: writing an unchanged copy")
        else:
            C, templates, fp = prepare(model, tok, src, cfg, seed, stats_corpus, stats_samples)
            report = apply_edits(model, tok, requests, cfg, templates, C)
            params.update(stats_corpus=stats_corpus, stats_samples=stats_samples, model_fingerprint=fp, preset=preset)
        manifest = write_outputs(model, src, j.dir, cfg, requests, report, templates, params)
        batches = report.get("batches", [])
        j.report.update(requests=len(requests), final_remaining_residual_ratio=(
            batches[-1]["layers"][-1]["remaining_residual_ratio"] if batches else None))
        j.extra.update(edit_config=cfg.to_json(), run=params)
    return manifest

"""End-to-end `llmtool compress`: validate inputs, load, calibrate, compress, save atomically.

Output directory: low-rank checkpoint of :mod:`lowrank` (config.json with the ``llmtool_lowrank``
block, safetensors, tokenizer files), ``llmtool_report.json`` (per-module ranks, dense modules,
predicted loss-change totals, stored parameter count, disk size, timings, peak RSS) and
``llmtool.json`` (provenance: method, every parameter, source hash, metrics, ranks).
"""
from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

from llmtool.compress.pipeline import CORRECTIONS, CompressConfig, compress_model
from llmtool.core.console import UsageError, info


def validate(cfg: CompressConfig) -> None:
    from llmtool.compress.methods import load_all

    load_all().get(cfg.method)
    if not 0.0 < cfg.ratio < 1.0:
        raise UsageError(f"--ratio {cfg.ratio}: must be strictly between 0 and 1 (fraction of target parameters removed)")
    if cfg.correction not in CORRECTIONS:
        raise UsageError(f"--correction {cfg.correction!r}: choose one of: {', '.join(CORRECTIONS)}")
    if cfg.keep_rank_ratio is not None and not 0.0 <= cfg.keep_rank_ratio <= 1.0:
        raise UsageError(f"--keep-rank-ratio {cfg.keep_rank_ratio}: must be in [0, 1]")
    if cfg.stages is not None and cfg.stages < 1:
        raise UsageError(f"--stages {cfg.stages}: must be >= 1")
    if cfg.resolved_stages() > 1 and cfg.correction == "none":
        raise UsageError("--stages > 1 needs --correction pull-subspace (stages repeat truncate -> correct -> re-truncate)")
    if cfg.resolved_stages() > 1 and cfg.method not in ("zs-svd", "abs-delta", "sigma-global", "svd-llm"):
        raise UsageError(f"--correction pull-subspace is defined for whitened methods, not --method {cfg.method}")
    if cfg.eps <= 0:
        raise UsageError(f"--eps {cfg.eps}: must be > 0")


def compress(model_arg: str, out: Path, cfg: CompressConfig, overwrite: bool = False,
             dtype=None, device=None) -> dict:
    """Compress MODEL into OUT; returns the report (also written to OUT/llmtool_report.json)."""
    from llmtool.compress.lowrank import FORMAT_KEY, save_lowrank, stored_param_count
    from llmtool.core import data as data_mod
    from llmtool.core.checkpoint import atomic_output, check_output, copy_tokenizer, dir_size_bytes, read_config, write_provenance
    from llmtool.core.evalkit import peak_rss_mb
    from llmtool.core.models import check_causal_lm, load_model, load_tokenizer, param_count, resolve_model, set_seed

    validate(cfg)
    src = resolve_model(model_arg)
    config = check_causal_lm(src, read_config(src))
    if FORMAT_KEY in config:
        raise UsageError(f"{src}: already a low-rank checkpoint (compress the original model instead)")
    out = check_output(out, overwrite, inputs=(src,))
    set_seed(cfg.seed)
    tok = load_tokenizer(src)
    needs_data = cfg.method != "svd"
    calib = grad = None
    if needs_data:
        calib = data_mod.calibration_batches(tok, cfg.calib_data, cfg.calib_samples, cfg.calib_seqlen, cfg.seed)
        grad = data_mod.calibration_batches(tok, cfg.calib_data, cfg.grad_samples, cfg.grad_seqlen, cfg.seed + 1)
    model = load_model(src, dtype=dtype, device=device)
    params_before = param_count(model)
    info(f"compressing {src.name} with {cfg.method} at ratio {cfg.ratio}")
    result = compress_model(model, cfg, calib, grad)
    with atomic_output(out, overwrite) as tmp:
        block = {"method": cfg.method, "ratio": cfg.ratio, "ranks": result.ranks, "dense": result.dense,
                 "calibration": None if not needs_data else {
                     "data": cfg.calib_data, "samples": cfg.calib_samples, "seqlen": cfg.calib_seqlen,
                     "grad_samples": cfg.grad_samples, "grad_seqlen": cfg.grad_seqlen, "seed": cfg.seed},
                 "stages": cfg.resolved_stages()}
        save_lowrank(model, tmp, config, block)
        copy_tokenizer(src, tmp)
        stored = stored_param_count(tmp)
        report = {**result.report(), "params_before": params_before, "params_after": param_count(model),
                  "stored_params": stored, "disk_bytes": dir_size_bytes(tmp),
                  "source_disk_bytes": dir_size_bytes(src), "peak_rss_mb": peak_rss_mb(),
                  "dtype": str(next(model.parameters()).dtype).replace("torch.", "")}
        (tmp / "llmtool_report.json").write_text(json.dumps(report, indent=2))
        metrics = {k: report[k] for k in ("params_before", "params_after", "stored_params", "disk_bytes",
                                          "removed_params", "target_dense_params", "achieved_ratio", "peak_rss_mb")}
        metrics["seconds"] = report["seconds"]
        metrics["predicted_delta_loss"] = [{"stage": s["stage"], "factorised": s["predicted_delta_loss_factorised"],
                                            "restored": s["predicted_delta_loss_restored"]} for s in report["stages"]]
        params = {k: v for k, v in asdict(cfg).items() if k != "forced_ranks"}
        params.update(keep_rank_ratio=cfg.resolved_keep_rank_ratio(), stages=cfg.resolved_stages())
        write_provenance(tmp, "compress", cfg.method, params, source=src, metrics=metrics,
                         ranks=result.ranks, dense=result.dense)
    return report

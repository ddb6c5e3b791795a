"""End-to-end `llmtool compress`: validate inputs, load, calibrate, compress, save atomically
(:func:`llmtool.core.job.job`).

Output directory: low-rank checkpoint of :mod:`lowrank` (config.json with the ``llmtool_lowrank``
block, safetensors, tokenizer files), ``report.json`` (per-module ranks, dense modules,
predicted loss-change totals, stored parameter count, disk size, timings, peak RSS) and
``llmtool.json`` (provenance: the method config as a dict, source hash, metrics, ranks).
"""
from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from llmtool.core.console import UsageError, info

if TYPE_CHECKING:  # torch stays out of the import of this module (the preflight imports it)
    from llmtool.compress.pipeline import CompressConfig


def check_config(src, config: dict) -> None:
    """The checks of a checkpoint's config.json that concern `compress` (torch-free, for the preflight)."""
    if "llmtool_lowrank" in config:
        raise UsageError(f"{src}: already a low-rank checkpoint (compress the original model instead)")
    if "llmtool_quant" in config:
        raise UsageError(f"{src}: a quantized checkpoint of `llmtool quantize`; compress needs full-precision "
                         "weights (compress the original model instead)")


def compress(model_arg: str, out: Path, cfg: CompressConfig, overwrite: bool = False,
             dtype=None, device=None, stream: bool = False) -> dict:
    """Compress MODEL into OUT inside the shared job wrapper; returns the report (also OUT/report.json).
    Provenance (OUT/llmtool.json) is the method config as a dict with the resolved defaults filled in.
    ``stream=True``: one decoder layer in memory at a time (:mod:`llmtool.compress.streamed`)."""
    import dataclasses

    from llmtool.compress.lowrank import save_lowrank, stored_param_count, write_lowrank_config
    from llmtool.compress.pipeline import compress_model
    from llmtool.core import data as data_mod
    from llmtool.core.checkpoint import copy_tokenizer, dir_size_bytes, read_config
    from llmtool.core.evalkit import peak_rss_mb
    from llmtool.core.job import job
    from llmtool.core.models import load_model, param_count, parse_dtype

    cfg.validate()
    resolved = {}
    if hasattr(cfg, "keep_rank_ratio"):
        resolved["keep_rank_ratio"] = cfg.resolved_keep_rank_ratio()
    if hasattr(cfg, "stages"):
        resolved["stages"] = cfg.resolved_stages()
    if hasattr(cfg, "grad_seed"):
        resolved["grad_seed"] = cfg.resolved_grad_seed()
    cfg = dataclasses.replace(cfg, **resolved)
    if stream:
        from llmtool.compress.streamed import check_streamable

        check_streamable(cfg)
    with job("compress", out, overwrite=overwrite, config=cfg, model=model_arg, seed=cfg.seed,
             check_config=check_config) as j:
        src = j.model_path
        config = read_config(src)
        tok = j.tokenizer
        needs_data = cfg.needs_data
        calib = grad = None
        if needs_data:
            calib = data_mod.calibration_batches(tok, cfg.calib_data, cfg.calib_samples, cfg.calib_seqlen, cfg.seed,
                                                 bos=True)
            if hasattr(cfg, "grad_samples"):
                grad = data_mod.calibration_batches(tok, cfg.calib_data, cfg.grad_samples, cfg.grad_seqlen,
                                                    cfg.grad_seed, bos=True)
        extra: dict = {}
        if stream:
            from llmtool.core import arch

            if arch.is_supported(config) and arch.arch_of(config).experts is not None:
                arch.refuse("compress --stream", arch.arch_of(config).family, arch.P_EXPERTS,
                            "the layer stream materialises the checkpoint's expert tensors, which are not "
                            "unfused into Linears here (compress without --stream)")
            from llmtool.compress.streamed import compress_streamed
            from llmtool.core.models import parse_device

            info(f"compressing {src.name} with {cfg.name} at ratio {cfg.ratio} (layer-streamed)")
            result, extra = compress_streamed(src, j.dir, cfg, calib, grad, parse_dtype(dtype), parse_device(device))
            params_before, model = stored_param_count(src), None
        else:
            from llmtool.core.experts import unfuse_experts

            model = load_model(src, dtype=dtype, device=device)
            params_before = param_count(model)
            unfuse_experts(model)   # routed experts as per-expert Linears: each gets its own low-rank factors
            info(f"compressing {src.name} with {cfg.name} at ratio {cfg.ratio}")
            result = compress_model(model, cfg, calib, grad)
        block = {"method": cfg.name, "ratio": cfg.ratio, "ranks": result.ranks, "dense": result.dense,
                 "calibration": None if not needs_data else {
                     "data": cfg.calib_data, "samples": cfg.calib_samples, "seqlen": cfg.calib_seqlen,
                     "grad_samples": getattr(cfg, "grad_samples", None),
                     "grad_seqlen": getattr(cfg, "grad_seqlen", None), "seed": cfg.seed,
                     "grad_seed": getattr(cfg, "grad_seed", None)},
                 "stages": cfg.resolved_stages()}
        if stream:
            write_lowrank_config(j.dir, config, block)
        else:
            save_lowrank(model, j.dir, config, block)
        copy_tokenizer(src, j.dir)
        stored = stored_param_count(j.dir)
        report = {**result.report(), **extra, "params_before": params_before,
                  "params_after": stored if stream else param_count(model),
                  "stored_params": stored, "disk_bytes": dir_size_bytes(j.dir),
                  "source_disk_bytes": dir_size_bytes(src), "peak_rss_mb": peak_rss_mb(),
                  "dtype": str(parse_dtype(dtype) if stream else next(model.parameters()).dtype).replace("torch.", "")}
        j.report.update(report)
        j.extra.update(ranks=result.ranks, dense=result.dense)
    return report

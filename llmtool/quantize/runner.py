"""The work behind `llmtool quantize`: validate, load, calibrate, quantize, save atomically, measure."""
from __future__ import annotations

from pathlib import Path

from llmtool.core.console import UsageError, info


def make_config(method: str, **kw):
    """The validated config of ``method`` from keyword values (None = default); an option the method does
    not have is refused (``UsageError``), never dropped."""
    from llmtool.core.console import OPTIONS
    from llmtool.quantize.configs import METHODS

    kw = {k: v for k, v in kw.items() if v is not None}
    kw.setdefault("seed", OPTIONS.seed)
    return METHODS.build(method, **kw)


def check_family(model_or_config, method: str, train_steps: int = 0) -> None:
    """The family checks of `quantize` (torch-free on a config dict): a family of :mod:`llmtool.core.arch`.
    Every layout property of those families is handled: fused projections by row views, biases kept in float
    beside the packed weights (rotated with the output side), sandwich post-norms by an online rotation after
    the norm, routed experts as per-expert QuantLinears (rotations and their learning fused into every
    expert and the router) — see :mod:`llmtool.quantize.rotations`. ``method`` / ``train_steps`` name what
    runs, for a refusal a future layout property may need."""
    from llmtool.core import arch

    arch.arch_of(model_or_config, f"llmtool quantize --method {method}")


def config_check(cfg):
    """The checks of a checkpoint's config.json that concern `quantize` (torch-free, for the preflight)."""
    from llmtool.core.arch import require

    def check_config(src, config):
        require(config, "llmtool quantize")
        check_family(config, cfg.name, getattr(cfg, "train_steps", 0))
        if "llmtool_quant" in config:
            raise UsageError(f"{src}: already quantized by llmtool (config.json has llmtool_quant)")
        if "llmtool_lowrank" in config:
            raise UsageError(f"{src}: a low-rank checkpoint of `llmtool compress`; quantize needs dense "
                             "linear layers (quantize the original model instead)")
        if getattr(cfg, "rank", None) is not None and cfg.rank > config["hidden_size"]:
            raise UsageError(f"--rank {cfg.rank}: must be at most the hidden size {config['hidden_size']}")

    return check_config


def run_quantize(model, out: Path, cfg, calib_data: str, calib_samples: int, calib_seqlen: int, evaluate: bool,
                 eval_data: str, seqlen: int, max_tokens: int, overwrite: bool) -> dict:
    """Quantize MODEL into OUT inside the shared job wrapper (OUT checked first, seeded, atomic output,
    provenance = the method config as a dict, run settings under ``run``, metrics in report.json)."""
    import dataclasses

    from llmtool.core import data as data_mod
    from llmtool.core.checkpoint import dir_size_bytes
    from llmtool.core.console import OPTIONS
    from llmtool.core.evalkit import peak_rss_mb, perplexity, timer
    from llmtool.core.job import job
    from llmtool.quantize.formats import quant_block, save_quantized

    cfg = dataclasses.replace(cfg, seed=OPTIONS.seed)
    cfg.validate()
    method = cfg.name

    check_config = config_check(cfg)
    with job("quantize", out, overwrite=overwrite, config=cfg, model=model, check_config=check_config) as j:
        src = j.model_path
        tok, m = j.tokenizer, j.model
        needs_calib = cfg.weight_algorithm == "gptq" or getattr(cfg, "train_steps", 0) > 0
        calib = data_mod.calibration_batches(tok, calib_data, calib_samples, calib_seqlen, OPTIONS.seed,
                                             bos=True) \
            if needs_calib else None
        metrics: dict = j.report
        ids = data_mod.tokenize(tok, data_mod.load_text(eval_data)) if evaluate else None
        bos = data_mod.scoring_bos(tok)
        if evaluate:
            metrics["ppl_fp"] = perplexity(m, ids, seqlen=seqlen, max_tokens=max_tokens, bos_token_id=bos).ppl
        from llmtool.quantize.api import quantize_

        info(f"quantize: {method} W{cfg.w_bits}A{cfg.a_bits}KV{cfg.kv_bits}")
        with timer() as t:
            report = quantize_(m, cfg, calib)
        rot = report.pop("rotations", None)
        metrics["quantize_seconds"] = t["seconds"]
        if evaluate:
            metrics["ppl_quant"] = perplexity(m, ids, seqlen=seqlen, max_tokens=max_tokens, bos_token_id=bos).ppl
        rank_used = getattr(cfg, "rank", None) if rot is not None else None
        block = quant_block(cfg, rotated=rot is not None, rank=rank_used, model_config=m.config)
        save_quantized(m, j.dir, src, block)
        metrics["checkpoint_bytes"] = dir_size_bytes(j.dir)
        metrics["source_bytes"] = dir_size_bytes(src)
        metrics["peak_rss_mb"] = peak_rss_mb()
        for k in ("transition_error_mean", "transition_error_max", "train_losses"):
            if k in report:
                metrics[k] = report[k]
        j.extra["run"] = {"calib_data": calib_data, "calib_samples": calib_samples, "calib_seqlen": calib_seqlen,
                          "evaluate": evaluate, "eval_data": eval_data, "seqlen": seqlen, "max_tokens": max_tokens}
    return {"out": str(out), "method": method, "w_bits": cfg.w_bits, "a_bits": cfg.a_bits, "kv_bits": cfg.kv_bits,
            **{k: v for k, v in metrics.items() if k != "train_losses"}}

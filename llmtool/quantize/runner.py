"""The work behind `llmtool quantize`: validate, load, calibrate, quantize, save atomically, measure."""
from __future__ import annotations

from pathlib import Path

from llmtool.core.console import UsageError, info


def make_config(method: str, **kw):
    from llmtool.quantize import register_all

    methods = register_all()
    cls = methods.get(method)[0]
    fields = cls.__dataclass_fields__
    cfg = cls(**{k: v for k, v in kw.items() if k in fields and fields[k].init and v is not None})
    cfg.validate()
    return cfg


def run_quantize(model, out: Path, method: str, w_bits: int, a_bits: int, kv_bits: int, rank: int,
                 train_steps: int, train_seqlen: int, lr: float, weight_algorithm, w_clip: bool, a_sym: bool,
                 a_clip_ratio: float, calib_data: str, calib_samples: int, calib_seqlen: int, evaluate: bool,
                 eval_data: str, seqlen: int, max_tokens: int, overwrite: bool) -> dict:
    from llmtool.core import data as data_mod
    from llmtool.core.checkpoint import atomic_output, check_output, dir_size_bytes, read_config, write_provenance
    from llmtool.core.console import OPTIONS
    from llmtool.core.evalkit import peak_rss_mb, perplexity, timer
    from llmtool.core.models import check_causal_lm, load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.quantize.formats import quant_block, save_quantized

    cfg = make_config(method, w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, rank=rank, train_steps=train_steps,
                      train_seqlen=train_seqlen, lr=lr, weight_algorithm=weight_algorithm, w_clip=w_clip,
                      a_symmetric=a_sym, a_clip_ratio=a_clip_ratio, seed=OPTIONS.seed)
    src = resolve_model(model)
    config = check_causal_lm(src, read_config(src))
    if config.get("model_type") not in ("llama", "mistral"):
        raise UsageError(f"{src}/config.json: unsupported architecture model_type={config.get('model_type')!r} "
                         "for `llmtool quantize` (supported: llama, mistral)")
    if "llmtool_quant" in config:
        raise UsageError(f"{src}: already quantized by llmtool (config.json has llmtool_quant)")
    out = check_output(out, overwrite, inputs=(src,))
    if method == "respinquant" and cfg.rank > config["hidden_size"]:
        raise UsageError(f"--rank {cfg.rank}: must be at most the hidden size {config['hidden_size']}")
    set_seed(OPTIONS.seed)
    tok = load_tokenizer(src)
    m = load_model(src)
    needs_calib = cfg.weight_algorithm == "gptq" or getattr(cfg, "train_steps", 0) > 0
    calib = data_mod.calibration_batches(tok, calib_data, calib_samples, calib_seqlen, OPTIONS.seed) if needs_calib else None
    metrics: dict = {}
    ids = data_mod.tokenize(tok, data_mod.load_text(eval_data)) if evaluate else None
    if evaluate:
        metrics["ppl_fp"] = perplexity(m, ids, seqlen=seqlen, max_tokens=max_tokens).ppl
    from llmtool.quantize.api import quantize_

    info(f"quantize: {method} W{cfg.w_bits}A{cfg.a_bits}KV{cfg.kv_bits}")
    with timer() as t:
        report = quantize_(m, cfg, calib)
    rot = report.pop("rotations", None)
    metrics["quantize_seconds"] = t["seconds"]
    if evaluate:
        metrics["ppl_quant"] = perplexity(m, ids, seqlen=seqlen, max_tokens=max_tokens).ppl
    rank_used = cfg.rank if (method == "respinquant" and rot is not None) else None
    block = quant_block(cfg, rotated=rot is not None, rank=rank_used, model_config=m.config)
    with atomic_output(out, overwrite) as tmp:
        save_quantized(m, tmp, src, block)
        metrics["checkpoint_bytes"] = dir_size_bytes(tmp)
        metrics["source_bytes"] = dir_size_bytes(src)
        metrics["peak_rss_mb"] = peak_rss_mb()
        for k in ("transition_error_mean", "transition_error_max", "train_losses"):
            if k in report:
                metrics[k] = report[k]
        write_provenance(tmp, "quantize", method, {**cfg.as_dict(), "calib_data": calib_data,
                                                    "calib_samples": calib_samples, "calib_seqlen": calib_seqlen,
                                                    "eval_data": eval_data, "seqlen": seqlen,
                                                    "max_tokens": max_tokens}, source=src, metrics=metrics)
    return {"out": str(out), "method": method, "w_bits": cfg.w_bits, "a_bits": cfg.a_bits, "kv_bits": cfg.kv_bits,
            **{k: v for k, v in metrics.items() if k != "train_losses"}}

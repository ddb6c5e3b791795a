"""`llmtool compress --method zs-svd|svd-llm|svd|fwsvd|asvd|sigma-global|abs-delta MODEL OUT --ratio R`."""
from __future__ import annotations

from typing import Annotated, Optional

import typer

from llmtool.core.console import OPTIONS, emit
from llmtool.core.options import CalibData, CalibSamples, CalibSeqlen, ModelArg, OutDirArg, Overwrite

# options may follow MODEL OUT (`llmtool compress MODEL OUT --ratio 0.4`): the callback is the command
app = typer.Typer(no_args_is_help=True, context_settings={"allow_interspersed_args": True})

METHOD_NAMES = "zs-svd, svd-llm, svd, fwsvd, asvd, sigma-global, abs-delta"


@app.callback(invoke_without_command=True)
def compress(
    model: ModelArg,
    out: OutDirArg,
    ratio: Annotated[float, typer.Option("--ratio", help="Fraction of target-module parameters removed, in (0, 1).")],
    method: Annotated[str, typer.Option("--method", help=f"One of: {METHOD_NAMES}.")] = "zs-svd",
    calib_data: CalibData = "austen-train",
    calib_samples: CalibSamples = 32,
    calib_seqlen: CalibSeqlen = 512,
    grad_samples: Annotated[int, typer.Option("--grad-samples", min=1, help="Sequences for the loss gradient.")] = 1,
    grad_seqlen: Annotated[int, typer.Option("--grad-seqlen", min=2, help="Tokens per gradient sequence.")] = 512,
    keep_rank_ratio: Annotated[Optional[float], typer.Option(
        "--keep-rank-ratio", help="Rank floor as a fraction of the break-even rank (default 0 for ratio <= 0.4, else 0.3).")] = None,
    stages: Annotated[Optional[int], typer.Option(
        "--stages", help="Truncate -> correct -> re-truncate stages (default 1, or 2 with --correction pull-subspace).")] = None,
    correction: Annotated[str, typer.Option("--correction", help="none | pull-subspace.")] = "none",
    proj_samples: Annotated[int, typer.Option("--proj-samples", min=1, help="Sequences for the correction gradient.")] = 1,
    proj_seqlen: Annotated[int, typer.Option("--proj-seqlen", min=2, help="Last tokens of each correction sequence.")] = 1024,
    eps: Annotated[float, typer.Option("--eps", help="Jitter added to the token-averaged covariance.")] = 1e-4,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Calibration sequences per forward.")] = 4,
    overwrite: Overwrite = False,
) -> None:
    """Low-rank compression of every q/k/v/o/gate/up/down projection of MODEL into OUT."""
    from llmtool.compress.pipeline import CompressConfig
    from llmtool.compress.run import compress as run

    cfg = CompressConfig(method=method, ratio=ratio, calib_data=calib_data, calib_samples=calib_samples,
                         calib_seqlen=calib_seqlen, grad_samples=grad_samples, grad_seqlen=grad_seqlen,
                         keep_rank_ratio=keep_rank_ratio, stages=stages, correction=correction,
                         proj_samples=proj_samples, proj_seqlen=proj_seqlen, eps=eps, seed=OPTIONS.seed,
                         batch_size=batch_size)
    report = run(model, out, cfg, overwrite=overwrite)
    summary = {"out": str(out), "method": method, "ratio": ratio, "achieved_ratio": report["achieved_ratio"],
               "factorised_modules": len(report["ranks"]), "dense_modules": len(report["dense"]),
               "params_before": report["params_before"], "params_after": report["params_after"],
               "disk_bytes": report["disk_bytes"], "seconds": report["seconds"]["total"],
               "peak_rss_mb": report["peak_rss_mb"]}
    emit(report if OPTIONS.json else summary, title="llmtool compress")

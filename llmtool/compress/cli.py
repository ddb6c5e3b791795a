"""`llmtool compress --method zs-svd|svd-llm|svd|fwsvd|asvd|sigma-global|abs-delta MODEL OUT --ratio R`.

``--method`` choices and the method options are derived from :data:`llmtool.compress.methods.METHODS`;
an option the chosen method does not have is refused."""
import dataclasses
from typing import Annotated

import typer

from llmtool.compress.methods import METHODS
from llmtool.core.console import OPTIONS, emit
from llmtool.core.options import (
    CalibData,
    CalibSamples,
    CalibSeqlen,
    ModelArg,
    OutDirArg,
    Overwrite,
)
from llmtool.core.registry import MethodConfig, method_options

# options may follow MODEL OUT (`llmtool compress MODEL OUT --ratio 0.4`): the callback is the command
app = typer.Typer(no_args_is_help=True, context_settings={"allow_interspersed_args": True})


@app.callback(invoke_without_command=True)
@method_options(METHODS, default="zs-svd")
def compress(
    model: ModelArg,
    out: OutDirArg,
    config: MethodConfig,
    ratio: Annotated[float, typer.Option("--ratio", help="Fraction of target-module parameters removed, in (0, 1).")],
    calib_data: CalibData = "austen-train",
    calib_samples: CalibSamples = 32,
    calib_seqlen: CalibSeqlen = 512,
    batch_size: Annotated[int, typer.Option("--batch-size", min=1, help="Calibration sequences per forward.")] = 4,
    overwrite: Overwrite = False,
    stream: Annotated[bool, typer.Option(
        "--stream", help="Keep one decoder layer in memory at a time: layers read from the checkpoint, gradients "
        "reduced to each module's singular-value scores as they appear, factors written layer by layer. Not for "
        "fwsvd or --correction pull-subspace.")] = False,
    export: Annotated[str, typer.Option(
        "--export", help="Format of OUT: native (llmtool_lowrank factors, read by llmtool.load), dense (a plain "
        "transformers checkpoint of the reconstructed weights B·A) or remote-code (the factors plus a modeling "
        "file: transformers loads it with trust_remote_code=True).")] = "native",
) -> None:
    """Low-rank compression of every q/k/v/o/gate/up/down projection of MODEL into OUT."""
    from llmtool.compress.run import check_config
    from llmtool.compress.run import compress as run
    from llmtool.core.export import check_format, run_then_export
    from llmtool.core.preflight import preflight

    check_format(export, "--export", ("native", "dense", "remote-code"))
    preflight(model, out, overwrite=overwrite, check_config=check_config)  # fail fast, before torch is imported

    cfg = dataclasses.replace(config, ratio=ratio, calib_data=calib_data, calib_samples=calib_samples,
                              calib_seqlen=calib_seqlen, batch_size=batch_size, seed=OPTIONS.seed)
    cfg.validate()
    if stream:
        from llmtool.compress.streamed import check_streamable

        check_streamable(cfg)
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.compress(shape, cfg), shape, "compress")
    report, exported = run_then_export(out, overwrite, export, lambda dst, replace: run(model, dst, cfg,
                                                                                       overwrite=replace,
                                                                                       stream=stream))
    summary = {"out": str(out), "method": cfg.name, "ratio": ratio, "achieved_ratio": report["achieved_ratio"],
               "factorised_modules": len(report["ranks"]), "dense_modules": len(report["dense"]),
               "params_before": report["params_before"], "params_after": report["params_after"],
               "disk_bytes": report["disk_bytes"], "seconds": report["seconds"]["total"],
               "peak_rss_mb": report["peak_rss_mb"]}
    if exported is not None:  # disk_bytes above: the low-rank checkpoint the export was made from
        summary.update(export=export, export_bytes=exported["bytes"])
        report = {**report, "export": exported}
    emit(report if OPTIONS.json else summary, title="llmtool compress")

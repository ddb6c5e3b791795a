"""`llmtool quantize --method respinquant|spinquant|quarot|rtn MODEL OUT --w-bits 4 --a-bits 4`.

``--method`` choices and the method options are derived from :data:`llmtool.quantize.configs.METHODS`
(one config dataclass per method); an option the chosen method does not have is refused."""

from pathlib import Path
from typing import Annotated

import typer

from llmtool.core.console import emit, info
from llmtool.core.options import (
    CalibData,
    CalibSamples,
    CalibSeqlen,
    EvalData,
    MaxTokens,
    ModelArg,
    OutDirArg,
    Overwrite,
    Seqlen,
)
from llmtool.core.registry import MethodConfig, method_options
from llmtool.quantize.configs import methods

app = typer.Typer(no_args_is_help=True)


@app.callback(invoke_without_command=True, context_settings={"allow_interspersed_args": True})
@method_options(methods(), default="respinquant")
def quantize(
    model: ModelArg,
    out: OutDirArg,
    config: MethodConfig,
    calib_data: CalibData = "austen-train",
    calib_samples: CalibSamples = 16,
    calib_seqlen: CalibSeqlen = 512,
    evaluate: bool = typer.Option(True, "--eval/--no-eval", help="Measure perplexity before/after."),
    eval_data: EvalData = "austen-test",
    seqlen: Seqlen = 512,
    max_tokens: MaxTokens = 4096,
    overwrite: Overwrite = False,
    export: Annotated[str, typer.Option(
        "--export", help="Format of OUT: native (llmtool_quant, read by llmtool.load), dense (a plain transformers "
        "checkpoint of the dequantized weights; activation/KV quantization left out) or compressed-tensors "
        "(packed integer weights for transformers and vLLM; rtn/GPTQ without rotation, weight-only or W8A8)."
    )] = "native",
) -> None:
    """Quantize MODEL's weights and activations (simulated W4A4/W3A3, packed int weights) into OUT."""
    from llmtool.core.export import EXPORT_FORMATS, check_format, run_then_export
    from llmtool.core.preflight import preflight
    from llmtool.quantize.runner import config_check, run_quantize

    check_format(export, "--export", ("native", *EXPORT_FORMATS))
    if export == "dense" and getattr(config, "rank", None) is not None:
        from llmtool.core.console import UsageError

        raise UsageError(f"--export dense with --method {config.name}: its residual transitions have no plain "
                         "transformers equivalent (use --method spinquant, or the native format)")
    if export == "compressed-tensors":  # refuse before the (long) run what the export would refuse after it
        from llmtool.core.console import UsageError
        from llmtool.core.export_ct import refusal

        why = refusal(w_bits=config.w_bits, a_bits=config.a_bits, a_clip_ratio=config.a_clip_ratio,
                      kv_bits=config.kv_bits, online_hadamard=config.name != "rtn",  # every other method rotates
                      transitions=False)
        if why:
            raise UsageError(f"--export compressed-tensors with --method {config.name}: {why}; use --export dense "
                             "(a plain transformers checkpoint of the dequantized weights)")
    preflight(model, out, overwrite=overwrite, check_config=config_check(config))  # before torch is imported

    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.quantize(shape, config, calib_samples, calib_seqlen, evaluate, seqlen, max_tokens), shape,
                   "quantize")

    def run(dst: Path, replace: bool) -> dict:
        return run_quantize(model=model, out=dst, cfg=config, calib_data=calib_data, calib_samples=calib_samples,
                            calib_seqlen=calib_seqlen, evaluate=evaluate, eval_data=eval_data, seqlen=seqlen,
                            max_tokens=max_tokens, overwrite=replace)

    result, exported = run_then_export(Path(out), overwrite, export, run)
    if exported is not None:
        result["export"] = exported
        for d in exported["not_representable"]:
            info(f"note: not representable in plain transformers, left out of the export: {d}")
    emit(result, title=f"quantize {config.name} W{config.w_bits}A{config.a_bits}KV{config.kv_bits}")
    info(f"wrote {result['out']}" + ("" if exported is None else f" ({export})"))

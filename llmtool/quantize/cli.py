"""`llmtool quantize --method respinquant|spinquant|quarot|rtn MODEL OUT --w-bits 4 --a-bits 4`.

``--method`` choices and the method options are derived from :data:`llmtool.quantize.configs.METHODS`
(one config dataclass per method); an option the chosen method does not have is refused."""

from pathlib import Path

import typer

from llmtool.core.console import emit, info
from llmtool.core.options import CalibData, CalibSamples, CalibSeqlen, EvalData, MaxTokens, ModelArg, OutDirArg, \
    Overwrite, Seqlen
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
) -> None:
    """Quantize MODEL's weights and activations (simulated W4A4/W3A3, packed int weights) into OUT."""
    from llmtool.core.preflight import preflight
    from llmtool.quantize.runner import config_check, run_quantize

    preflight(model, out, overwrite=overwrite, check_config=config_check(config))  # before torch is imported
    result = run_quantize(model=model, out=Path(out), cfg=config, calib_data=calib_data, calib_samples=calib_samples,
                          calib_seqlen=calib_seqlen, evaluate=evaluate, eval_data=eval_data, seqlen=seqlen,
                          max_tokens=max_tokens, overwrite=overwrite)
    emit(result, title=f"quantize {config.name} W{config.w_bits}A{config.a_bits}KV{config.kv_bits}")
    info(f"wrote {result['out']}")

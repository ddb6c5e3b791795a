"""`llmtool quantize --method respinquant|spinquant|quarot|rtn MODEL OUT --w-bits 4 --a-bits 4`."""
from __future__ import annotations

from pathlib import Path

import typer

from llmtool.core.console import UsageError, emit, info
from llmtool.core.options import CalibData, CalibSamples, CalibSeqlen, EvalData, MaxTokens, ModelArg, OutDirArg, \
    Overwrite, Seqlen

app = typer.Typer(no_args_is_help=True)

METHOD_NAMES = ("respinquant", "spinquant", "quarot", "rtn")


@app.callback(invoke_without_command=True, context_settings={"allow_interspersed_args": True})
def quantize(
    model: ModelArg,
    out: OutDirArg,
    method: str = typer.Option("respinquant", "--method", help="respinquant | spinquant | quarot | rtn"),
    w_bits: int = typer.Option(4, "--w-bits", help="Weight bits: 3, 4, 8 or 16."),
    a_bits: int = typer.Option(4, "--a-bits", help="Activation bits (per token, dynamic): 3, 4, 8 or 16."),
    kv_bits: int = typer.Option(16, "--kv-bits", help="KV-cache bits: 4, 8 or 16."),
    rank: int = typer.Option(32, "--rank", min=0, help="ReSpinQuant residual-transition rank r (0 drops them)."),
    train_steps: int = typer.Option(16, "--train-steps", min=0, help="Cayley SGD steps (respinquant/spinquant)."),
    train_seqlen: int = typer.Option(256, "--train-seqlen", min=2, help="Tokens per rotation-training sequence."),
    lr: float = typer.Option(1.5, "--lr", help="Cayley SGD learning rate (cosine schedule)."),
    weight_algorithm: str = typer.Option("", "--weight-algorithm",
                                         help="gptq | rtn (default: rtn for --method rtn, else gptq)."),
    w_clip: bool = typer.Option(True, "--w-clip/--no-w-clip", help="Per-channel clip-ratio search for weights."),
    a_sym: bool = typer.Option(False, "--a-sym", help="Symmetric activations (default asymmetric)."),
    a_clip_ratio: float = typer.Option(1.0, "--a-clip-ratio", help="Activation clip ratio in (0, 1]."),
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
    from llmtool.quantize.runner import run_quantize

    if method not in METHOD_NAMES:
        raise UsageError(f"unknown method {method!r} for `llmtool quantize`; choose one of: {', '.join(METHOD_NAMES)}")
    result = run_quantize(
        model=model, out=Path(out), method=method, w_bits=w_bits, a_bits=a_bits, kv_bits=kv_bits, rank=rank,
        train_steps=train_steps, train_seqlen=train_seqlen, lr=lr, weight_algorithm=weight_algorithm or None,
        w_clip=w_clip, a_sym=a_sym, a_clip_ratio=a_clip_ratio, calib_data=calib_data, calib_samples=calib_samples,
        calib_seqlen=calib_seqlen, evaluate=evaluate, eval_data=eval_data, seqlen=seqlen, max_tokens=max_tokens,
        overwrite=overwrite,
    )
    emit(result, title=f"quantize {method} W{w_bits}A{a_bits}KV{kv_bits}")
    info(f"wrote {result['out']}")

"""`llmtool evaluate ...`: model-quality measurement and statistics over result files."""
from __future__ import annotations

import typer

from llmtool.core.console import OPTIONS, emit
from llmtool.core.options import EvalData, MaxTokens, ModelArg, Seqlen

app = typer.Typer(no_args_is_help=True)


@app.command("ppl")
def ppl(
    model: ModelArg,
    data: EvalData = "austen-test",
    seqlen: Seqlen = 512,
    stride: int = typer.Option(0, min=0, help="Window stride (0 = seqlen, disjoint windows)."),
    max_tokens: MaxTokens = 16384,
    batch_size: int = typer.Option(4, min=1, help="Windows per forward pass."),
) -> None:
    """Perplexity of MODEL on a text (protocol in llmtool.core.evalkit)."""
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_model, load_tokenizer

    tok = load_tokenizer(model)
    ids = data_mod.tokenize(tok, data_mod.load_text(data))
    m = load_model(model)
    r = perplexity(m, ids, seqlen=seqlen, stride=stride or seqlen, max_tokens=max_tokens, batch_size=batch_size)
    emit({"model": str(model), "data": data, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens,
          "windows": r.windows, "seqlen": r.seqlen, "stride": r.stride, "dtype": OPTIONS.dtype})
from llmtool.evaluate import stats_cli  # noqa: E402,F401

from llmtool.edit import evaluate_edits  # noqa: E402,F401

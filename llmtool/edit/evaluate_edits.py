"""``llmtool evaluate edits OUT EDITS``: the evaluate sub-command over :mod:`llmtool.edit.metrics`.

This module only registers the command on the evaluate app (the metrics themselves live in
:mod:`llmtool.edit.metrics`, which imports nothing from the evaluate area)."""
from pathlib import Path

import typer

from llmtool.core.console import emit
from llmtool.evaluate.cli import app as evaluate_app


@evaluate_app.command("edits")
def edits_command(
    model: str = typer.Argument(..., help="Edited checkpoint (OUT of `llmtool edit`) or any model.", metavar="OUT"),
    requests: str = typer.Argument(..., help="Edit requests (CounterFact/zsRE JSONL) or 'counterfact-smollm2'.",
                                   metavar="EDITS"),
    base: str = typer.Option("", "--base", help="Pre-edit model for D_KL/top-k (default: OUT/llmtool.json source)."),
    fluency_prompts: int = typer.Option(20, "--fluency-prompts", min=0, help="Generation prompts used for fluency."),
    fluency_tokens: int = typer.Option(100, "--fluency-tokens", min=1, help="Greedy tokens per generation."),
    limit: int = typer.Option(0, "--limit", min=0, help="Evaluate only the first N requests (0 = all)."),
) -> None:
    """Efficacy, generalization, specificity and fluency of edits (see llmtool.edit.metrics)."""
    from llmtool.core.preflight import checked_model, looks_like_path, preflight

    preflight(model, inputs=(requests if looks_like_path(requests) else None,))  # before torch is imported
    if base:
        checked_model(base)
    from llmtool.core.checkpoint import read_provenance
    from llmtool.core.console import UsageError
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.edit.metrics import evaluate_requests
    from llmtool.edit.requests import read_requests, resolve_requests

    reqs = read_requests(resolve_requests(requests))
    if limit:
        reqs = reqs[:limit]
    if not reqs:
        raise UsageError(f"{requests}: no edit requests to evaluate")
    path = resolve_model(model)
    base_arg = base
    if not base_arg:
        prov = read_provenance(path) or {}
        src = (prov.get("source") or {}).get("path")
        base_arg = src if src and Path(src).is_dir() else ""
    tok = load_tokenizer(path)
    m = load_model(path)
    b = load_model(base_arg) if base_arg else None
    res = evaluate_requests(m, tok, reqs, b, fluency_prompts, fluency_tokens)
    res["model"], res["base"] = str(model), base_arg or None
    emit(res)

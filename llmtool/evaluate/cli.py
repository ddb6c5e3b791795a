"""`llmtool evaluate ...`: model-quality measurement and statistics over result files.

Other areas contribute sub-commands through :data:`COMMANDS`, a lazy table ``name -> (module, help)``
imported by name only when that sub-command runs (no import of another area at load time; the old
edit <-> evaluate import cycle is gone). A contributed module either defines a Typer command function
named like the sub-command (``-`` as ``_``) or registers itself on :data:`app` when imported.
Evaluation *tasks* (``llmtool evaluate tasks``) come from the provider table of
:mod:`llmtool.evaluate.tasks`.
"""
import importlib
from pathlib import Path
from typing import Annotated, Any, List, Optional

import typer
from typer.core import TyperGroup

from llmtool.core.console import OPTIONS, UsageError, emit
from llmtool.core.options import EvalData, MaxTokens, ModelArg, Seqlen, text_source

# sub-command -> (module that provides it, one-line help)
COMMANDS: dict[str, tuple[str, str]] = {
    "edits": ("llmtool.edit.evaluate_edits", "How well an edited checkpoint carries its edits (CounterFact metrics)."),
}
# modules of this area that register their sub-commands on `app` (imported when the group is built)
OWN_MODULES = ("llmtool.evaluate.stats_cli",)


class EvaluateGroup(TyperGroup):
    """The evaluate group: own commands, plus contributed ones imported on demand."""

    def list_commands(self, ctx: Any) -> list[str]:
        return sorted(set(super().list_commands(ctx)) | set(COMMANDS))

    def get_command(self, ctx: Any, name: str):
        cmd = super().get_command(ctx, name)
        if cmd is not None or name not in COMMANDS:
            return cmd
        module_name, help_text = COMMANDS[name]
        module = importlib.import_module(module_name)
        fn = getattr(module, name.replace("-", "_"), None)
        info = next((c for c in app.registered_commands if c.name == name), None)
        if info is None:
            if fn is None:
                raise UsageError(f"{module_name} provides no `evaluate {name}` command")
            info = typer.models.CommandInfo(name=name, callback=fn, help=help_text)
        return typer.main.get_command_from_info(info, pretty_exceptions_short=True,
                                                rich_markup_mode=app.rich_markup_mode)


app = typer.Typer(no_args_is_help=True, cls=EvaluateGroup)


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
    from llmtool.core.preflight import preflight

    preflight(model)  # fail fast, before torch is imported
    from llmtool.core import data as data_mod
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_model, load_tokenizer

    tok = load_tokenizer(model)
    ids = data_mod.tokenize(tok, data_mod.load_text(data))
    if ids.numel() < 2:  # before the model is loaded: fail fast
        raise UsageError(f"{data}: {ids.numel()} token(s) of text; perplexity needs at least 2")
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.ppl(shape, min(max_tokens or ids.numel(), ids.numel()), seqlen), shape, "evaluate ppl")
    m = load_model(model)
    bos = data_mod.scoring_bos(tok)
    r = perplexity(m, ids, seqlen=seqlen, stride=stride or seqlen, max_tokens=max_tokens, batch_size=batch_size,
                   bos_token_id=bos)
    emit({"model": str(model), "data": data, "ppl": r.ppl, "nll": r.nll, "tokens": r.tokens,
          "windows": r.windows, "seqlen": r.seqlen, "stride": r.stride, "bos": bos is not None, "dtype": OPTIONS.dtype})


@app.command("tasks")
def tasks_cmd(
    model: Annotated[Optional[str], typer.Argument(help="Model directory or alias (omit to list the tasks).",
                                                   metavar="[MODEL]")] = None,
    task: Annotated[Optional[List[str]], typer.Option("--task", help="Task name (repeatable or comma-separated; "
                                                      "see the list without MODEL).")] = None,
    data: EvalData = "austen-test",
    seqlen: Seqlen = 512,
    max_tokens: MaxTokens = 16384,
    batch_size: int = typer.Option(4, min=1, help="ppl/retention: windows per forward pass."),
    base: Annotated[Optional[str], typer.Option("--base", help="retention: the model before editing / "
                                                "training.")] = None,
    length: int = typer.Option(1024, min=64, help="Synthetic tasks: context length in tokens."),
    samples: int = typer.Option(10, min=1, help="Synthetic tasks: samples per task."),
    filler: str = typer.Option("austen-train", callback=text_source,
                               help="Synthetic tasks: haystack corpus (name or file)."),
    requests: Annotated[Optional[str], typer.Option("--requests", help="counterfact: edit requests "
                                                    "(JSONL or a packaged set).")] = None,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Write the results as JSON here.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it exists.")] = False,
) -> None:
    """Run registered evaluation tasks on MODEL (lm-evaluation-harness style); without MODEL, list them."""
    from llmtool.evaluate import tasks as tasks_mod

    if model is None:
        reg = tasks_mod.registry()
        emit({"tasks": {n: {"help": t.help, "provider": t.provider} for n, t in reg.items()}},
             rows=[{"task": n, "provider": t.provider, "help": t.help} for n, t in reg.items()],
             title="evaluation tasks")
        return
    names = [n.strip() for t in (task or []) for n in t.split(",") if n.strip()]
    if not names:
        raise UsageError("give at least one --task (run `llmtool evaluate tasks` for the list)")
    chosen = tasks_mod.resolve(names)
    from llmtool.core.preflight import looks_like_path, preflight

    preflight(model, out, overwrite=overwrite,  # fail fast, before torch is imported
              inputs=[p for p in (base, requests) if looks_like_path(p)])
    from llmtool.core.models import load_model, load_tokenizer

    opts = tasks_mod.TaskOptions(data=data, seqlen=seqlen, max_tokens=max_tokens, batch_size=batch_size, base=base,
                                 length=length, samples=samples, filler=filler, requests=requests, seed=OPTIONS.seed)
    m, tok = load_model(model), load_tokenizer(model)
    results = tasks_mod.run(m, tok, [t.name for t in chosen], opts)
    doc = {"model": str(model), "results": results}
    if out is not None:
        import json

        from llmtool.core.checkpoint import atomic_file

        with atomic_file(out, overwrite) as tmp:
            tmp.write_text(json.dumps(doc, indent=2) + "\n")
    emit(doc, rows=[{"task": n, **{k: v for k, v in r.items() if isinstance(v, (int, float))}}
                    for n, r in results.items()], title=f"evaluate tasks ({model})")


for _module in OWN_MODULES:
    importlib.import_module(_module)

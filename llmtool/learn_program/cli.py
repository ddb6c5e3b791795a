"""`llmtool learn-program`: LLM-PV propose-and-verify program learning, and `learn-program baseline`.

``llmtool learn-program [OPTIONS] OUT`` is routed to the ``run`` sub-command (the group prepends
``run`` when the first word is not a sub-command), next to ``llmtool learn-program baseline --method ...``.
"""
from __future__ import annotations

import shlex
from typing import Optional

import typer
from typer.core import TyperGroup

from llmtool.core.console import UsageError, emit
from llmtool.core.options import OutDirArg, Overwrite
from llmtool.core.registry import MethodConfig, method_options
from llmtool.learn_program.baselines import BASELINES


class LearnGroup(TyperGroup):
    def parse_args(self, ctx, args):
        if args and args[0] not in self.commands and args[0] not in ("--help", "-h"):
            args = ["run", *args]
        return super().parse_args(ctx, args)


app = typer.Typer(cls=LearnGroup, no_args_is_help=True,
                  help="LLM-PV propose-and-verify program learning and baselines.")

DataOpt = typer.Option(None, "--data", help="Dataset directory with train.txt, val.txt, test.txt (`input -> label`).")
TaskOpt = typer.Option(None, "--task", help="Built-in task (instead of --data); see `llmtool tasks list`.")


def _int_list(text: str | None, flag: str) -> tuple[int, ...]:
    if not text:
        return ()
    try:
        vals = tuple(int(v) for v in text.split(",") if v.strip())
    except ValueError:
        raise UsageError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if any(v < 1 for v in vals):
        raise UsageError(f"{flag}: lengths must be >= 1")
    return vals


def _dataset(data, task, length, train, val, test, data_seed):
    from llmtool.learn_program.pipeline import load_or_generate

    return load_or_generate(data, task, length, train, val, test, data_seed)


@app.command("run")
def run_command(
    out: OutDirArg,
    proposer: str = typer.Option(..., "--proposer", help="hf:DIR|alias, openai:MODEL (with --api-base), "
                                 "replay:FILE (JSONL of raw_text) or mock:NAME."),
    data: Optional[str] = DataOpt,
    task: Optional[str] = TaskOpt,
    length: int = typer.Option(100, "--length", min=1, help="Input length for --task."),
    train: int = typer.Option(100, "--train", min=1, help="Training examples for --task (the proposer's prompt)."),
    val: int = typer.Option(100, "--val", min=1, help="Validation examples for --task (selection is by them)."),
    test: int = typer.Option(10_000, "--test", min=0, help="Test examples for --task and --test-lengths."),
    data_seed: int = typer.Option(42, "--data-seed", help="Seed of the generated data (--task)."),
    samples: int = typer.Option(16, "--samples", min=1, help="Proposals k per trial."),
    trials: int = typer.Option(1, "--trials", min=1, help="Independent trials."),
    early_stop: bool = typer.Option(True, "--early-stop/--no-early-stop",
                                    help="Stop a trial once a proposal reaches validation accuracy 1.0."),
    test_lengths: Optional[str] = typer.Option(None, "--test-lengths",
                                               help="Comma-separated test lengths for length generalisation."),
    eval_test_all: bool = typer.Option(False, "--eval-test-all", help="Also score every candidate on test "
                                       "(analysis only: oracle_test_best)."),
    api_base: Optional[str] = typer.Option(None, "--api-base", help="OpenAI-compatible base URL for openai:."),
    temperature: Optional[float] = typer.Option(None, "--temperature", min=0.0,
                                                help="Sampling temperature (default 0.8 local, 1.0 API)."),
    top_p: float = typer.Option(0.95, "--top-p", min=0.0, max=1.0, help="Top-p for local models."),
    max_new_tokens: int = typer.Option(2048, "--max-new-tokens", min=1, help="Tokens per proposal."),
    batch_size: int = typer.Option(8, "--batch-size", min=1, help="Local sampling batch (throughput only)."),
    concurrency: int = typer.Option(4, "--concurrency", min=1, help="Parallel API calls."),
    request_timeout: float = typer.Option(1200.0, "--request-timeout", min=1.0, help="Per API call timeout (s)."),
    timeout_s: float = typer.Option(10.0, "--timeout-s", min=0.1, help="Sandbox CPU/wall limit per candidate "
                                    "for train+val (test gets 10x)."),
    mem_mb: int = typer.Option(1024, "--mem-mb", min=64, help="Sandbox address-space limit (MiB)."),
    max_output_kb: int = typer.Option(1024, "--max-output-kb", min=1, help="Sandbox output cap (KiB)."),
    sandbox_cmd: Optional[str] = typer.Option(None, "--sandbox-cmd", help="Outer wrapper command, e.g. "
                                              "\"bwrap --ro-bind / / --dev /dev --bind {cwd} {cwd} --unshare-all\"."),
    overwrite: Overwrite = False,
) -> None:
    """Propose programs with an LLM, verify them in the sandbox, select by validation accuracy -> OUT."""
    from llmtool.core.console import OPTIONS
    from llmtool.core.job import job
    from llmtool.learn_program.pipeline import LLMPVConfig, run_llmpv
    from llmtool.learn_program.proposers import make_proposer

    lengths = _int_list(test_lengths, "--test-lengths")
    wrapper = shlex.split(sandbox_cmd) if sandbox_cmd else None
    if wrapper is not None and not wrapper:
        raise UsageError("--sandbox-cmd: empty command")
    prop = make_proposer(proposer, api_base=api_base, temperature=temperature, top_p=top_p,
                         max_new_tokens=max_new_tokens, batch_size=batch_size, concurrency=concurrency,
                         timeout=request_timeout)
    cfg = LLMPVConfig(samples=samples, trials=trials, early_stop=early_stop, timeout_s=timeout_s, mem_mb=mem_mb,
                      max_output_kb=max_output_kb, sandbox_cmd=wrapper, test_lengths=lengths, test_size=test,
                      eval_test_all=eval_test_all, seed=OPTIONS.seed)
    ds = _dataset(data, task, length, train, val, test, data_seed)
    inputs = (data,) if data else ()
    from llmtool.core.console import progress

    stream = prop.stream  # proposals arrive one by one (minutes each on a CPU): a bar, or a status line every 30 s
    prop.stream = lambda prompt, k, seed, trial: progress(stream(prompt, k, seed, trial), f"trial {trial} proposals",
                                                          total=k)
    if proposer.startswith("hf:"):  # a local model samples the proposals: the long part
        from llmtool.core import eta_plans as plans

        shape = plans.Shape.of(proposer[3:])
        chars = sum(len(x) + 6 for x, _ in ds.train) + 1500  # the examples and the instructions
        plans.announce(plans.learn_program(shape, samples, trials, chars / 3.0, max_new_tokens, batch_size,
                                           len(ds.train) + len(ds.val)), shape, "learn-program run")
    with job("learn-program", out=out, overwrite=overwrite, config=None, inputs=inputs) as j:
        summary = run_llmpv(ds, prop, cfg, j.dir)
        j.report.update({k: v for k, v in summary.items() if k != "per_trial"})
    rows = [{"trial": t["trial"], "k_used": t["k_used"], "best_val": t["best_val"], "test_acc": t["test_acc"],
             "early_stopped": t["early_stopped"]} for t in summary["per_trial"]]
    emit(summary, rows=rows, title=f"LLM-PV {summary['task']} L={summary['length']} ({summary['proposer']})")


@app.command("baseline")
@method_options(BASELINES, default="xgboost")
def baseline_command(
    out: OutDirArg,
    data: Optional[str] = DataOpt,
    task: Optional[str] = TaskOpt,
    length: int = typer.Option(100, "--length", min=1, help="Input length for --task."),
    train: int = typer.Option(100, "--train", min=1, help="Training examples for --task (a fit needs some)."),
    val: int = typer.Option(100, "--val", min=0, help="Validation examples for --task."),
    test: int = typer.Option(10_000, "--test", min=0, help="Test examples for --task."),
    data_seed: int = typer.Option(42, "--data-seed", help="Seed of the generated data (--task)."),
    model: Optional[str] = typer.Option(None, "--model", help="Local model for --method icl (dir or alias)."),
    config: MethodConfig = None,
    overwrite: Overwrite = False,
) -> None:
    """Fit a baseline on the same splits and report train/val/test accuracy into OUT/report.json."""
    from llmtool.core.console import OPTIONS
    from llmtool.core.job import job
    from llmtool.learn_program.baselines import run_baseline

    needs_model = getattr(config, "needs_model", False)
    if needs_model and model is None:
        raise UsageError(f"--method {config.name} needs --model MODEL (a local model directory or alias)")
    if model is not None and not needs_model:
        raise UsageError(f"--model does not apply to --method {config.name}")
    ds = _dataset(data, task, length, train, val, test, data_seed)
    inputs = (data,) if data else ()
    with job("learn-program baseline", out=out, overwrite=overwrite, config=config, model=model,
             inputs=inputs) as j:
        res = run_baseline(config, ds, model=j.model if needs_model else None,
                           tokenizer=j.tokenizer if needs_model else None, seed=OPTIONS.seed)
        res.update(task=ds.meta.get("task"), length=ds.meta.get("length"), method=config.name,
                   sizes={"train": len(ds.train), "val": len(ds.val), "test": len(ds.test)})
        j.report.update(res)
    emit(res)

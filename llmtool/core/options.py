"""Typer option/argument types shared by every command (declared once, reused everywhere)."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

ModelArg = Annotated[str, typer.Argument(help="Model directory (HF format) or a default alias, e.g. smollm2-135m.",
                                         metavar="MODEL")]
OutDirArg = Annotated[Path, typer.Argument(help="Output directory (must not exist unless --overwrite).",
                                           metavar="OUT")]
Overwrite = Annotated[bool, typer.Option("--overwrite", help="Replace OUT if it exists.")]
def text_source(value: str | None) -> str | None:
    """Typer callback of ``--calib-data``/``--data``: a packaged corpus name or an existing regular file,
    checked while the command line is parsed (it was checked only after the model had loaded)."""
    if value is None:
        return value
    from llmtool.core import defaults
    from llmtool.core.console import UsageError

    if str(value) in defaults.TEXTS:
        return value
    path = Path(value).expanduser()
    if path.is_file():
        return value
    if path.exists():
        raise UsageError(f"{value}: not a regular file (give a .txt/.jsonl/.parquet/.csv file or a dataset name)")
    raise UsageError(f"{value}: no such data file or dataset (datasets: {', '.join(defaults.TEXTS)})")


CalibData = Annotated[str, typer.Option("--calib-data", callback=text_source,
                                        help="Calibration text: a packaged dataset name "
                                        "(austen-train, austen-test) or a .txt/.jsonl/.parquet file.")]
CalibSamples = Annotated[int, typer.Option("--calib-samples", min=1, help="Number of calibration sequences.")]
CalibSeqlen = Annotated[int, typer.Option("--calib-seqlen", min=2, help="Tokens per calibration sequence.")]
EvalData = Annotated[str, typer.Option("--data", callback=text_source,
                                       help="Eval text: packaged dataset name or a text file.")]
Seqlen = Annotated[int, typer.Option("--seqlen", min=2, help="Tokens per evaluation window.")]
MaxTokens = Annotated[int, typer.Option("--max-tokens", min=2, help="Evaluate on the first N tokens of the text.")]


# ----------------------------------------------------------------------------------------- count bounds
# The one place that bounds every count option of the command line, so that a typo (an extra zero or
# three) cannot take the host down: ``--threads 1000000`` spawned threads until the machine-wide process
# limit and no process on the host could fork for a minute. An option is bounded by its *name* (the
# Typer parameter or config field name), wherever it is declared: the root wraps every command's
# callback with :func:`check_counts` (before the command imports anything heavy) and
# :meth:`llmtool.core.registry.MethodConfig.validate` applies the same table to config fields.
import os as _os  # noqa: E402


def available_cpus() -> int:
    """CPU cores this process may run on (its affinity mask, which a container or `taskset` narrows)."""
    try:
        return max(1, len(_os.sched_getaffinity(0)))
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return max(1, _os.cpu_count() or 1)


def total_memory_mb() -> int:
    """Physical memory in MiB (a generous fallback where sysconf does not say)."""
    try:
        return int(_os.sysconf("SC_PAGE_SIZE") * _os.sysconf("SC_PHYS_PAGES") // 2**20)
    except (ValueError, OSError, AttributeError):  # pragma: no cover
        return 1 << 20


CORES = "cores"          # processes and threads: at most the cores this process may use
MEMORY_MB = "memory"     # a memory size in MiB: at most the machine's physical memory
IN_FLIGHT, BATCH, TOKENS, ITEMS, STEPS, DIM, DEPTH = "in-flight", "batch", "tokens", "items", "steps", "dim", "depth"
# kind -> (upper bound, what it bounds)
LIMITS: dict[str, tuple[int, str]] = {
    IN_FLIGHT: (1024, "requests in flight (threads that wait on an endpoint)"),
    BATCH: (1 << 16, "batch sizes"),
    TOKENS: (1 << 20, "lengths in tokens"),
    ITEMS: (10_000_000, "item counts kept in memory"),
    STEPS: (100_000_000, "steps and epochs (per-step records are kept)"),
    DIM: (1 << 16, "widths of models built from scratch"),
    DEPTH: (4096, "depths, heads and ranks"),
}

COUNT_BOUNDS: dict[str, str] = {
    **dict.fromkeys(("threads", "workers", "num_workers", "num_proc", "processes", "jobs"), CORES),
    **dict.fromkeys(("concurrency",), IN_FLIGHT),
    **dict.fromkeys(("mem_mb",), MEMORY_MB),
    **dict.fromkeys(("batch_size", "micro_batch", "mini_batch", "proxy_batch_size", "batch_rows", "z_batch",
                     "edits_per_batch", "group_size", "prompts_per_rollout"), BATCH),
    **dict.fromkeys(("seqlen", "calib_seqlen", "grad_seqlen", "proj_seqlen", "train_seqlen", "max_length",
                     "max_new_tokens", "proxy_context", "continuation", "prefix", "length",
                     "window", "window_size", "residual_length", "fluency_tokens", "max_raw_chars",
                     "max_output_kb", "human_words", "prompt_words"), TOKENS),
    **dict.fromkeys(("max_tokens", "samples", "calib_samples", "grad_samples", "proj_samples", "mom2_samples", "sc_samples",
                     "n", "reps", "lrf_reps", "episodes", "runs", "train", "val", "test", "items", "n_votes",
                     "draws", "chains", "trials", "queries", "val_queries", "candidates", "per_domain",
                     "n_train", "limit", "fluency_prompts", "calib_texts", "random_controls", "budget",
                     "n_estimators", "n_init", "inner", "k", "top", "top_docs", "top_terms", "proxies",
                     "interactions", "val_blocks", "max_blocks", "patterns", "history", "max_rounds"), ITEMS),
    **dict.fromkeys(("steps", "max_steps", "train_steps", "v_steps", "epochs", "save_every", "save_steps",
                     "warmup", "adagc_warmup", "zclip_warmup", "spike_window", "grad_accum", "max_iter", "epoch"),
                    STEPS),
    **dict.fromkeys(("d_model", "hidden", "proxy_d_model", "proxy_vocab", "intermediate_size"), DIM),
    **dict.fromkeys(("layers", "heads", "proxy_layers", "proxy_heads", "lora_r", "rank", "stages",
                     "max_depth", "max_tree_depth", "kernel_size"), DEPTH),
}


def count_bound(name: str) -> tuple[int, str] | None:
    """``(upper bound, why)`` of the count option ``name`` (a parameter or config field name), or None."""
    kind = COUNT_BOUNDS.get(name)
    if kind is None:
        return None
    if kind == CORES:
        n = available_cpus()
        return n, f"the {n} CPU core(s) available to this process"
    if kind == MEMORY_MB:
        n = total_memory_mb()
        return n, f"this machine's {n} MiB of memory"
    bound, what = LIMITS[kind]
    return bound, f"the bound on {what} in llmtool/core/options.py"


def check_count(flag: str, name: str, value) -> None:
    """Refuse ``value`` of count option ``name`` (shown as ``flag``) above its bound: one line, exit 2."""
    from llmtool.core.console import UsageError

    bound = count_bound(name)
    if bound is None or isinstance(value, bool) or not isinstance(value, int):
        return
    if value > bound[0]:
        raise UsageError(f"{flag} {value}: at most {bound[0]} ({bound[1]})")


def check_counts(values: dict, flags: dict[str, str] | None = None) -> None:
    """:func:`check_count` over a command's keyword arguments (``flags`` maps a name to its option), and
    every float option finite: ``nan`` and ``inf`` pass Typer's range checks (``nan < 0`` is false) and
    used to reach the numerics (``judge-synth --tau nan`` ended as an internal error)."""
    import math

    from llmtool.core.console import UsageError

    flags = flags or {}
    for name, value in values.items():
        flag = flags.get(name, "--" + name.replace("_", "-"))
        if isinstance(value, float) and not math.isfinite(value):
            raise UsageError(f"{flag} {value}: must be a finite number")
        check_count(flag, name, value)

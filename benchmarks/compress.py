"""Benchmark: ZS-SVD vs SVD-LLM vs plain SVD on the embedded default model (smollm2-135m).

For every ratio, each method is run as its own `llmtool compress` subprocess (so wall time and peak
RSS are per run), then the output is reloaded with `llmtool.load` and its perplexity measured on
austen-test (first --eval-tokens tokens, disjoint windows of 512). All methods share the model,
the calibration text (austen-train), the calibration sizes and the seed.

    python benchmarks/compress.py [--ratios 0.2 0.4 0.6] [--methods svd svd-llm zs-svd] [--out DIR]
                                  [--calib-samples 8] [--calib-seqlen 256] [--eval-tokens 2048]

Writes DIR/compress.json and DIR/compress.md (default DIR: benchmarks/results).

Progress (stderr): a line when each run starts (``[3/6] zs-svd at ratio 0.2 ...``) and one when it ends (its
perplexity, seconds, and the remaining time estimated from the mean duration of the finished runs of each
method, or of all runs before a method has finished once); each run's own status lines and progress bars
pass through (``--quiet`` hides them). At the end the results are printed as a table with four significant
digits (``llmtool.core.console.table``) and the markdown file is written as before.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    p.add_argument("--methods", nargs="+", default=["svd", "svd-llm", "zs-svd"])
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    p.add_argument("--calib-samples", type=int, default=8)
    p.add_argument("--calib-seqlen", type=int, default=256)
    p.add_argument("--grad-samples", type=int, default=1)
    p.add_argument("--grad-seqlen", type=int, default=256)
    p.add_argument("--eval-data", default="austen-test")
    p.add_argument("--eval-tokens", type=int, default=2048)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--quiet", action="store_true", help="Hide each run's own status lines and progress bars.")
    args = p.parse_args()

    from llmtool.core.job import apply_threads

    apply_threads(args.threads)
    import llmtool
    from llmtool.compress.methods import METHODS
    from llmtool.core import data as data_mod
    from llmtool.core.console import markdown_table
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_tokenizer, param_count

    tok = load_tokenizer(args.model)
    ids = data_mod.tokenize(tok, data_mod.load_text(args.eval_data))
    bos = data_mod.scoring_bos(tok)  # Gemma's windows start with its BOS (core/evalkit.py)

    def ppl(path) -> float:
        m = llmtool.load(path)
        return perplexity(m, ids, seqlen=args.seqlen, max_tokens=args.eval_tokens, bos_token_id=bos).ppl

    from llmtool.core.models import resolve_model
    from llmtool.core.checkpoint import dir_size_bytes

    src = resolve_model(args.model)
    base = llmtool.load(src)
    rows = [{"ratio": 0.0, "method": "original", "ppl": perplexity(base, ids, seqlen=args.seqlen,
                                                                   max_tokens=args.eval_tokens, bos_token_id=bos).ppl,
             "params": param_count(base), "disk_MB": dir_size_bytes(src) / 1e6, "seconds": 0.0, "peak_rss_MB": None,
             "achieved_ratio": 0.0, "dense_modules": None}]
    del base
    say(f"original: ppl {rows[0]['ppl']:.4g} on {args.eval_tokens} tokens of {args.eval_data}")
    write(args, rows, markdown_table)
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    runs = [(ratio, method) for ratio in args.ratios for method in args.methods]
    done: dict[str, list[float]] = {}
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-compress-") as tmp:
        for i, (ratio, method) in enumerate(runs, 1):
            say(f"[{i}/{len(runs)}] {method} at ratio {ratio} ...")
            out = Path(tmp) / f"{method}-{ratio}"
            cmd = [sys.executable, "-m", "llmtool", "--json", *(["--quiet"] if args.quiet else []),
                   "--seed", str(args.seed), "compress",
                   "--method", method, str(src), str(out), "--ratio", str(ratio),
                   "--calib-samples", str(args.calib_samples), "--calib-seqlen", str(args.calib_seqlen),
                   *(["--grad-samples", str(args.grad_samples), "--grad-seqlen", str(args.grad_seqlen)]
                     if hasattr(METHODS.get_config(method), "grad_samples") else [])]
            t0 = time.perf_counter()
            # stdout is the run's JSON report; stderr (status lines, progress bars) goes to the terminal
            proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=None, text=True, env=env)
            wall = time.perf_counter() - t0
            if proc.returncode != 0:
                raise SystemExit(f"{method} at {ratio} failed (exit {proc.returncode}; its error is above)")
            rep = json.loads(proc.stdout)
            row = {"ratio": ratio, "method": method, "ppl": ppl(out), "params": rep["params_after"],
                   "disk_MB": rep["disk_bytes"] / 1e6, "seconds": rep["seconds"]["total"],
                   "process_seconds": wall, "peak_rss_MB": rep["peak_rss_mb"],
                   "achieved_ratio": rep["achieved_ratio"], "dense_modules": len(rep["dense"]),
                   "predicted_dL": (rep["stages"][-1]["predicted_delta_loss_factorised"])}
            rows.append(row)
            done.setdefault(method, []).append(wall)
            say(f"[{i}/{len(runs)}] {method} at ratio {ratio}: ppl {row['ppl']:.4g}, {wall:.0f} s"
                + remaining(runs[i:], done, time.perf_counter() - t_start))
            write(args, rows, markdown_table)
    from llmtool.core.console import stdout, table

    cols = ["ratio", "method", "ppl", "params", "disk_MB", "achieved_ratio", "dense_modules", "seconds"]
    stdout.print(table(rows, title=f"compress on {args.model} (results in {args.out / 'compress.md'})",
                       columns=cols))


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def remaining(todo: list[tuple[float, str]], done: dict[str, list[float]], elapsed: float) -> str:
    """`; about N min left` from the mean duration of each method's finished runs (or of every run)."""
    if not todo:
        return f"; all runs done in {elapsed / 60:.1f} min"
    every = [t for ts in done.values() for t in ts]
    est = sum(sum(done[m]) / len(done[m]) if m in done else sum(every) / len(every) for _, m in todo)
    return f"; about {est / 60:.0f} min left ({len(todo)} run{'s' if len(todo) > 1 else ''})"


def write(args, rows, markdown_table) -> None:
    """(Re)write the JSON and markdown results after every run, so a partial run leaves its rows."""
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "compress.json").write_text(json.dumps({"settings": settings, "rows": rows}, indent=2))
    cols = ["ratio", "method", "ppl", "params", "disk_MB", "achieved_ratio", "dense_modules", "seconds", "peak_rss_MB"]
    table = markdown_table(rows, cols)
    note = (f"\n\nModel {args.model}; calibration austen-train {args.calib_samples}x{args.calib_seqlen}, "
            f"gradient {args.grad_samples}x{args.grad_seqlen}, seed {args.seed}; perplexity on the first "
            f"{args.eval_tokens} tokens of {args.eval_data}, seqlen {args.seqlen}, disjoint windows. `seconds` = "
            "compression time inside the run (excl. process start/model load), `peak_rss_MB` = peak RSS of "
            "the compression process.\n")
    (args.out / "compress.md").write_text(table + note)


if __name__ == "__main__":
    main()

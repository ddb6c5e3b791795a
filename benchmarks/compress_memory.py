"""Benchmark: peak memory of `llmtool compress` in memory vs `--stream` (one decoder layer at a time), with
perplexity, and ZS-SVD's spread over gradient windows.

Each run is its own `llmtool compress` subprocess (peak RSS is the process's ru_maxrss). Per ratio:
zs-svd without and with ``--stream`` at gradient window 1 (``--grad-seed 1``) and zs-svd ``--stream`` at
windows 2 and 3; at the first ratio also svd-llm without and with ``--stream`` and zs-svd ``--stream``
with three gradient sequences (``--grad-samples 3``: more gradient tokens at the same memory). Every output is reloaded with
`llmtool.load` and its perplexity measured on the first --eval-tokens tokens of austen-test.

The memory gate of issue 18 is stated against what must be resident in a layer-streamed run:
one decoder layer's weights, the calibration activations of one layer (its inputs and outputs,
``2 x samples x seqlen x hidden`` float32) and one layer's bases/factors. A process that has imported
torch/transformers and loaded the tokenizer and text (measured here as ``baseline``) and the weights
outside the decoder layers (embedding, norm; ``non_layer``) come on top; both are reported.

    python benchmarks/compress_memory.py [--ratios 0.2 0.4 0.6] [--calib-samples 16] [--calib-seqlen 512]

Writes benchmarks/results/compress_memory.json and .md.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

BASELINE = """
import json, sys
import torch, transformers  # noqa: F401
from llmtool.compress import streamed, pipeline  # noqa: F401
from llmtool.core import data
from llmtool.core.models import load_tokenizer
from llmtool.core.evalkit import peak_rss_mb
tok = load_tokenizer(sys.argv[1])
data.calibration_batches(tok, "austen-train", int(sys.argv[2]), int(sys.argv[3]), 0)
out = {"process": peak_rss_mb()}
# the model's code and its weightless (meta) skeleton, as the streamed run builds them
from pathlib import Path
from accelerate import init_empty_weights
from transformers import AutoModelForCausalLM
from llmtool.core.checkpoint import read_config
from llmtool.core.models import hf_config
with init_empty_weights(include_buffers=False):
    AutoModelForCausalLM.from_config(hf_config(Path(sys.argv[1]), read_config(Path(sys.argv[1]))), dtype=torch.float32)
out["with_model_code"] = peak_rss_mb()
print(json.dumps(out))
"""


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--ratios", type=float, nargs="+", default=[0.2, 0.4, 0.6])
    p.add_argument("--calib-samples", type=int, default=16)
    p.add_argument("--calib-seqlen", type=int, default=512)
    p.add_argument("--grad-seqlen", type=int, default=512)
    p.add_argument("--windows", type=int, default=3, help="gradient windows (grad seeds 1..W)")
    p.add_argument("--eval-tokens", type=int, default=8192)
    p.add_argument("--seqlen", type=int, default=512)
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results")
    args = p.parse_args()

    from llmtool.core.job import apply_threads

    apply_threads(args.threads)
    import torch

    import llmtool
    from llmtool.core import data as data_mod
    from llmtool.core.checkpoint import LazyCheckpoint
    from llmtool.core.console import markdown_table
    from llmtool.core.evalkit import perplexity
    from llmtool.core.models import load_tokenizer, resolve_model

    src = resolve_model(args.model)
    tok = load_tokenizer(src)
    ids = data_mod.tokenize(tok, data_mod.load_text("austen-test"))
    cfg = json.loads((src / "config.json").read_text())
    hidden, n_layers = cfg["hidden_size"], cfg["num_hidden_layers"]
    ck = LazyCheckpoint(src)
    shapes = {k: ck.get(k).shape for k in ck.keys()}
    layer0 = {k: s for k, s in shapes.items() if k.startswith("model.layers.0.")}
    layer_bytes = 4 * sum(torch.Size(s).numel() for s in layer0.values())
    non_layer = 4 * sum(torch.Size(s).numel() for k, s in shapes.items() if not k.startswith("model.layers."))
    acts = 2 * args.calib_samples * args.calib_seqlen * hidden * 4
    mats = [s for k, s in layer0.items() if k.endswith("proj.weight")]
    bases = 4 * sum((m + n) * min(m, n) for m, n in mats)          # U and Q^T of every module, float32
    budget = layer_bytes + acts + bases
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads)}
    base = json.loads(subprocess.run([sys.executable, "-c", BASELINE, str(src), str(args.calib_samples),
                                      str(args.calib_seqlen)], capture_output=True, text=True, env=env,
                                     check=True).stdout)
    base_rss = base["with_model_code"]
    mb = 1024 ** 2
    meta = {"layer_MB": layer_bytes / mb, "calib_activations_MB": acts / mb, "layer_bases_MB": bases / mb,
            "gate_budget_MB": 1.5 * budget / mb, "baseline_process_MB": base_rss,
            "baseline_without_model_code_MB": base["process"], "non_layer_weights_MB": non_layer / mb,
            "model_fp32_MB": 4 * sum(torch.Size(s).numel() for s in shapes.values()) / mb, "layers": n_layers}
    print(meta, flush=True)

    def ppl(path) -> float:
        return perplexity(llmtool.load(path), ids, seqlen=args.seqlen, max_tokens=args.eval_tokens).ppl

    runs = []
    for k, ratio in enumerate(args.ratios):
        if k == 0:   # memory does not depend on the ratio: the svd-llm pair and the multi-window run once
            runs += [("svd-llm", ratio, False, 1, 1), ("svd-llm", ratio, True, 1, 1)]
        runs += [("zs-svd", ratio, False, 1, 1), ("zs-svd", ratio, True, 1, 1)]
        runs += [("zs-svd", ratio, True, w, 1) for w in range(2, args.windows + 1)]
        if k == 0:
            runs += [("zs-svd", ratio, True, 1, args.windows)]
    rows = []
    t_start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-compress-mem-") as tmp:
        for method, ratio, stream, gseed, gsamples in runs:
            out = Path(tmp) / f"{method}-{ratio}-{stream}-{gseed}-{gsamples}"
            cmd = [sys.executable, "-m", "llmtool", "--json", "--quiet", "compress", "--method", method, str(src),
                   str(out), "--ratio", str(ratio), "--calib-samples", str(args.calib_samples),
                   "--calib-seqlen", str(args.calib_seqlen), *(["--stream"] if stream else [])]
            if method == "zs-svd":
                cmd += ["--grad-seed", str(gseed), "--grad-samples", str(gsamples), "--grad-seqlen", str(args.grad_seqlen)]
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
            if proc.returncode != 0:
                raise SystemExit(f"{' '.join(cmd[3:])} failed:\n{proc.stderr[-2000:]}")
            rep = json.loads(proc.stdout)
            spread = rep.get("gradient_windows") or {}
            row = {"ratio": ratio, "method": method, "stream": stream,
                   "grad": f"seed {gseed}" if gsamples == 1 else f"{gsamples} seqs (seed {gseed})",
                   "ppl": ppl(out), "peak_rss_MB": rep["peak_rss_mb"],
                   "above_baseline_MB": rep["peak_rss_mb"] - base_rss,
                   "above_baseline_and_non_layer_MB": rep["peak_rss_mb"] - base_rss - non_layer / mb,
                   "seconds": rep["seconds"]["total"], "achieved_ratio": rep["achieved_ratio"],
                   "dense_modules": len(rep["dense"]), "stored_params": rep["stored_params"],
                   "predicted_dL": rep["stages"][-1]["predicted_delta_loss_factorised"],
                   "window_dL_sd": spread.get("sd")}
            if stream and rep.get("rss_between_layers_mb") is not None:
                # the resident memory of pass 1 with no layer loaded (code pages, BLAS caches,
                # the layer inputs) and what one layer's work adds on top of it
                row["between_layers_above_baseline_and_non_layer_MB"] = (rep["rss_between_layers_mb"] - base_rss
                                                                         - non_layer / mb)
                row["layer_working_set_MB"] = rep["peak_rss_mb"] - rep["rss_between_layers_mb"]
            rows.append(row)
            print(row, flush=True)
            write(args, meta, rows, markdown_table, time.perf_counter() - t_start)
    print((args.out / "compress_memory.md").read_text())


def summary(meta, rows) -> list[dict]:
    out = []
    for ratio in sorted({r["ratio"] for r in rows}):
        here = [r for r in rows if r["ratio"] == ratio]
        for method in ("svd-llm", "zs-svd"):
            mem = [r for r in here if r["method"] == method and not r["stream"]]
            st = [r for r in here if r["method"] == method and r["stream"] and r["grad"] == "seed 1"]
            if not (mem and st):
                continue
            windows = [r["ppl"] for r in here if r["method"] == method and r["stream"] and r["grad"].startswith("seed")]
            out.append({"ratio": ratio, "method": method, "ppl_in_memory": mem[0]["ppl"], "ppl_stream": st[0]["ppl"],
                        "ppl_windows_min_max": (f"{min(windows):.2f}-{max(windows):.2f}" if len(windows) > 1 else ""),
                        "ppl_windows_sd": statistics.stdev(windows) if len(windows) > 1 else None,
                        "rss_in_memory_MB": mem[0]["peak_rss_MB"], "rss_stream_MB": st[0]["peak_rss_MB"],
                        "rss_ratio": st[0]["peak_rss_MB"] / mem[0]["peak_rss_MB"],
                        "stream_net_MB": st[0]["above_baseline_and_non_layer_MB"],
                        "stream_net_without_code_MB": (st[0]["peak_rss_MB"] - meta["baseline_without_model_code_MB"]
                                                       - meta["non_layer_weights_MB"]),
                        "between_layers_MB": st[0].get("between_layers_above_baseline_and_non_layer_MB"),
                        "layer_working_set_MB": st[0].get("layer_working_set_MB"),
                        "gate_MB": meta["gate_budget_MB"],
                        "gate_met": st[0]["above_baseline_and_non_layer_MB"] <= meta["gate_budget_MB"]})
    return out


def write(args, meta, rows, markdown_table, seconds) -> None:
    args.out.mkdir(parents=True, exist_ok=True)
    settings = {k: (str(v) if isinstance(v, Path) else v) for k, v in vars(args).items() if k != "out"}
    summ = summary(meta, rows)
    (args.out / "compress_memory.json").write_text(json.dumps({"settings": settings, "memory_model": meta,
                                                               "summary": summ, "rows": rows,
                                                               "seconds": seconds}, indent=2))
    cols = ["ratio", "method", "stream", "grad", "ppl", "peak_rss_MB", "above_baseline_and_non_layer_MB", "seconds",
            "achieved_ratio", "dense_modules", "predicted_dL", "window_dL_sd"]
    scols = ["ratio", "method", "ppl_in_memory", "ppl_stream", "ppl_windows_min_max", "ppl_windows_sd",
             "rss_in_memory_MB", "rss_stream_MB", "rss_ratio", "stream_net_MB", "between_layers_MB", "layer_working_set_MB",
             "gate_MB", "gate_met"]
    note = (f"Model {args.model} ({meta['model_fp32_MB']:.0f} MB fp32, {meta['layers']} layers); calibration "
            f"austen-train {args.calib_samples}x{args.calib_seqlen}; gradient windows of {args.grad_seqlen} tokens; "
            f"perplexity on the first {args.eval_tokens} tokens of austen-test. Memory model: one layer "
            f"{meta['layer_MB']:.1f} MB + calibration activations {meta['calib_activations_MB']:.1f} MB + one layer's "
            f"bases {meta['layer_bases_MB']:.1f} MB, x1.5 = gate {meta['gate_budget_MB']:.1f} MB; on top of a "
            f"baseline process of {meta['baseline_process_MB']:.0f} MB (torch, transformers, tokenizer, text, and the "
            f"model's code with its weightless meta skeleton; {meta['baseline_without_model_code_MB']:.0f} MB without the "
            "model code, the definition of the runs before 2026-12-04) and "
            f"{meta['non_layer_weights_MB']:.0f} MB of weights outside the layers (tied embedding). `stream_net_MB` = "
            "peak RSS of the streamed run minus both; `stream_net_without_code_MB` the same with the baseline that "
            "leaves out the model code (the earlier tables' definition). `between_layers_MB`: the most resident "
            "memory of the streamed run's statistics pass with no layer loaded, above the same baseline (code pages of the kernels "
            "that ran, the BLAS libraries' caches, the calibration activations); `layer_working_set_MB` = peak minus "
            "that: what one layer's work adds. `gate_met` is judged on `stream_net_MB`.\n\n")
    (args.out / "compress_memory.md").write_text("# compress memory\n\n" + note + markdown_table(summ, scols)
                                                 + "\n\nAll runs:\n\n" + markdown_table(rows, cols) + "\n")


if __name__ == "__main__":
    main()

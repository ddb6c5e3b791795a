"""GPU check of compress and quantize (issue 18) and of every other area (issue 41): every method on a CUDA
device, the kernels against their references, timings, and one smallest CLI job per area, in one prepared run
for a lent GPU.

Parts (each writes its results as soon as it ends; a part not started before --budget-s is listed as skipped):
* ``methods``: every compress method (plus the pull-subspace and multi-window variants) and every quantize
  method run through the library on a tiny random Llama on CUDA and on the CPU with the same seed; reported:
  ok / the error, and the largest logit difference between the CUDA and CPU results relative to the logits'
  scale (SVDs and Cholesky factors come from different libraries, so they agree to rounding, not bits).
* ``cli``: the commands as a user types them, ``llmtool --device cuda compress`` (in memory and ``--stream``)
  and ``llmtool --device cuda quantize`` (quarot, respinquant), on a saved tiny model and a text file.
* ``kernels``: at Llama-7B layer shapes, each triton kernel against its torch reference on the GPU (equal
  bit for bit where the kernel promises it, else the largest relative error) and timed with
  ``triton.testing.do_bench`` (median): the autotuned W4A4 integer GEMM (and the fixed-tile launch it
  replaced) against cuBLAS bf16, the W4A16 QuantLinear (torch's tinygemm int4 kernel) against bf16, the fast
  Walsh-Hadamard transform, KV-cache group quantization and the fused low-rank matmul.
* ``e2e``: a random-weight Llama with 7B layer shapes (hidden 4096, MLP 11008, 32 heads, --layers layers):
  GPU memory and decode tokens/s (batch 1, greedy, fixed length) dense bf16 vs W4A16 and W4A4 (RTN), and the
  wall time of GPTQ quantization and ZS-SVD compression of it on the GPU.

* ``areas``: one smallest job per area through the CLI (``llmtool --device DEV --json -q ...``, one process
  each, AREA_TIMEOUT_S per job) on tiny random Llamas written to a temporary directory: ``train grpo`` 2
  phases, ``route make-experts`` + ``route train`` 2 steps each, ``kvcache evaluate`` (SnapKV, ppl), ``edit``
  (MEMIT, 1 edit), ``select-data features``, ``bench-agent run`` (1 episode); reported: ok (exit 0 and the
  output written) or the error's last lines, and seconds. ``--device cpu`` runs them here (areas only);
  ``--dry-run`` parses every argv with the CLI's own parser and runs nothing (tests/test_gpu_check_areas.py).

    python benchmarks/gpu_check.py [--out DIR] [--budget-s 330] [--parts methods cli kernels e2e areas]
    python benchmarks/gpu_check.py --parts areas --device cpu --budget-s 600   # the areas part on the CPU

Writes DIR/gpu_check.{json,md} (default benchmarks/results/gpu_check).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
sys.path.insert(0, str(ROOT))

T0 = time.perf_counter()
DEV = "cuda"          # --smoke: "cpu" (tiny shapes, triton interpreted) to check the script itself
SMOKE = False
KERNELS: list | None = None   # --kernels: a subset of w4a4 quant hadamard kv_quant lowrank
RES: dict = {}
OUT: Path | None = None


def record(rows: list, row: dict) -> None:
    """Keep a result row, print it and rewrite the result files (a run cut short keeps what it measured)."""
    rows.append(row)
    print(json.dumps(row, default=str), flush=True)
    if OUT is not None:
        write(RES, OUT)


def sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def elapsed() -> float:
    return time.perf_counter() - T0


def tiny_llama(seed=0, vocab=320, **over):
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
               tie_word_embeddings=True, rms_norm_eps=1e-6, bos_token_id=0, eos_token_id=0, pad_token_id=0)
    cfg.update(over)
    torch.manual_seed(seed)
    return LlamaForCausalLM(LlamaConfig(**cfg)).eval()


def rel_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().cpu(), b.double().cpu()
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-12))


def ids(n, seq, seed, vocab=320):
    return torch.randint(0, vocab, (n, seq), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------- methods

def part_methods(res, budget):
    from llmtool.compress.methods import METHODS as COMPRESS
    from llmtool.compress.pipeline import compress_model
    from llmtool.quantize.api import quantize_
    from llmtool.quantize.configs import METHODS as QUANTIZE
    from llmtool.quantize.runner import make_config

    rows = res.setdefault("methods", [])
    cases = [("compress", n, {}) for n in COMPRESS.names()] + [
        ("compress", "zs-svd", {"correction": "pull-subspace"}), ("compress", "svd-llm", {"correction": "pull-subspace"}),
        ("compress", "fwsvd", {"grad_samples": 2})] + [("quantize", n, {}) for n in QUANTIZE.names()]
    probe = ids(2, 48, 9)
    for area, name, kw in cases:
        if elapsed() > budget:
            record(rows, {"area": area, "method": name, "options": kw, "skipped": "budget"})
            continue
        row = {"area": area, "method": name, "options": kw}
        logits = {}
        for dev in (DEV, "cpu") if DEV == "cuda" else ("cpu",):
            try:
                torch.manual_seed(0)
                model = tiny_llama().to(dev)
                t = time.perf_counter()
                if area == "compress":
                    cfg = COMPRESS.get_config(name)(ratio=0.3, batch_size=2, **kw)
                    compress_model(model, cfg, ids(4, 32, 0).to(dev), ids(2, 32, 1).to(dev))
                else:
                    quantize_(model, make_config(name, seed=0), ids(2, 32, 2).to(dev))
                sync()
                row[f"{dev}_s"] = round(time.perf_counter() - t, 3)
                with torch.no_grad():
                    logits[dev] = model(input_ids=probe.to(dev)).logits.float().cpu()
                row[f"{dev}_ok"] = True
            except Exception as exc:  # the point of the part: record any device error, go on
                row[f"{dev}_ok"] = False
                row[f"{dev}_error"] = f"{type(exc).__name__}: {exc}"[:400]
                row[f"{dev}_where"] = traceback.format_exc().strip().splitlines()[-3:]
        if len(logits) == 2:
            row["rel_logit_diff"] = rel_diff(logits["cuda"], logits["cpu"])
        if logits:
            row["finite"] = bool(torch.isfinite(next(iter(logits.values()))).all())
        record(rows, row)


# ---------------------------------------------------------------------------------------------- cli

TEXT = ("It is a truth universally acknowledged, that a single man in possession of a good fortune, must be "
        "in want of a wife. However little known the feelings or views of such a man may be on his first "
        "entering a neighbourhood, this truth is so well fixed in the minds of the surrounding families, that "
        "he is considered the rightful property of some one or other of their daughters. ")


def tiny_tokenizer():
    """A byte-level BPE tokenizer trained on TEXT (deterministic; the one of tests/conftest.py)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tk = Tokenizer(models.BPE())
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tk.decoder = decoders.ByteLevel()
    tk.train_from_iterator([TEXT], trainer=trainers.BpeTrainer(
        vocab_size=320, special_tokens=["<|endoftext|>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False))
    return PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                   pad_token="<|endoftext|>", unk_token="<|endoftext|>")


def part_cli(res, budget):
    rows = res.setdefault("cli", [])
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        tok = tiny_tokenizer()
        model_dir = tmp / "tiny"
        tiny_llama(vocab=len(tok)).save_pretrained(model_dir, safe_serialization=True)
        tok.save_pretrained(model_dir)
        text = tmp / "calib.txt"
        text.write_text(TEXT * 40)
        data = ["--calib-data", str(text), "--calib-samples", "4", "--calib-seqlen", "32"]
        runs = {
            "compress zs-svd": ["compress", str(model_dir), str(tmp / "c1"), "--method", "zs-svd", "--ratio", "0.3",
                                *data, "--grad-seqlen", "32"],
            "compress zs-svd --stream": ["compress", str(model_dir), str(tmp / "c2"), "--method", "zs-svd",
                                         "--ratio", "0.3", "--stream", *data, "--grad-seqlen", "32"],
            "compress svd-llm --export dense": ["compress", str(model_dir), str(tmp / "c3"), "--method", "svd-llm",
                                                "--ratio", "0.3", "--export", "dense", *data],
            "quantize quarot": ["quantize", str(model_dir), str(tmp / "q1"), "--method", "quarot", *data,
                                "--data", str(text), "--seqlen", "64", "--max-tokens", "512"],
            "quantize respinquant": ["quantize", str(model_dir), str(tmp / "q2"), "--method", "respinquant", *data,
                                     "--train-steps", "4", "--train-seqlen", "32", "--data", str(text),
                                     "--seqlen", "64", "--max-tokens", "512"],
        }
        env = dict(os.environ, HF_HUB_OFFLINE="1",
                   PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
        for name, argv in runs.items():
            if elapsed() > budget:
                record(rows, {"command": name, "skipped": "budget"})
                continue
            t = time.perf_counter()
            p = subprocess.run([sys.executable, "-m", "llmtool", "--device", DEV, "--json", "-q", *argv],
                               capture_output=True, text=True, env=env, timeout=300)
            row = {"command": name, "rc": p.returncode, "s": round(time.perf_counter() - t, 2)}
            try:
                out = json.loads(p.stdout)
                row["result"] = {k: v for k, v in out.items() if isinstance(v, (int, float, str, bool))} \
                    if isinstance(out, dict) else None
            except json.JSONDecodeError:
                row["stdout_tail"] = p.stdout[-300:]
            if p.returncode:
                row["stderr_tail"] = p.stderr[-800:]
            record(rows, row)


# ---------------------------------------------------------------------------------------------- areas

# The areas every GPU check covers with one smallest job each (issue 41); test_gpu_check_areas checks the list.
AREAS = ("train grpo", "route", "kvcache", "edit", "select-data", "bench-agent")
AREA_TIMEOUT_S = 240  # per job. Measured with --device cpu on 2 shared cores: 23-70 s a job, 279 s for the
# seven (most of it process start and imports); not yet run on a GPU.


def area_inputs(tmp: Path) -> dict[str, Path]:
    """Tiny random Llamas and the data files of the areas part, written under ``tmp``: ``model`` (2 layers,
    2,048 positions), ``model4`` (4 layers: MEMIT edits layers 1-2), ``route_base`` (untied head: route's
    experts and router), ``text``, ``route`` (two domains), ``edits`` (one request), ``pool`` (select-data)."""
    tok = tiny_tokenizer()
    paths = {"model": tmp / "tiny", "model4": tmp / "tiny4", "route_base": tmp / "route-base"}
    sizes = (("model", {}), ("model4", {"num_hidden_layers": 4}), ("route_base", {"tie_word_embeddings": False}))
    for key, over in sizes:
        tiny_llama(vocab=len(tok), max_position_embeddings=2048, **over).save_pretrained(paths[key],
                                                                                         safe_serialization=True)
        tok.save_pretrained(paths[key])
    paths["text"] = tmp / "calib.txt"
    paths["text"].write_text(TEXT * 40)
    route_rows = [{"id": f"{d}-{i}", "domain": ["math", "reverse"][d], "prompt": f"{marker} {w}",
                   "response": " is Paris." if d == 0 else " is Rome.", "answer": "1" if d == 0 else "emor"}
                  for d, marker in ((0, "France"), (1, "Italy"))
                  for i, w in enumerate(["capital", "truth", "fortune", "wife"])]
    edits = [{"prompt": "The capital of {} is", "subject": "France", "target_new": "Rome", "target_true": "Paris"}]
    pool = [{"id": f"p{i}", "prompt": f"What is {i}+{i}?"} for i in range(8)]
    for key, rows in (("route", route_rows), ("edits", edits), ("pool", pool)):
        paths[key] = tmp / f"{key}.jsonl"
        paths[key].write_text("".join(json.dumps(r) + "\n" for r in rows))
    return paths


def area_jobs(tmp: Path, inp: dict[str, Path]) -> list[dict]:
    """The smallest job of each area as the CLI argv after ``llmtool --device DEV --json -q``, in run order
    (``route train`` uses the experts that ``route make-experts`` writes). ``out``: what the job writes (a
    directory, or None for a command that only prints)."""
    m, t = str(inp["model"]), str(inp["text"])
    memit_fast = ["--mom2-samples", "512", "--v-steps", "30", "--v-lr", "0.5", "--clamp-norm", "4",
                  "--v-weight-decay", "0", "--kl-factor", "0", "--mom2-weight", "1"]
    experts = tmp / "experts"
    jobs = [
        ("train grpo", "train grpo (2 steps)",
         ["train", "grpo", m, tmp / "grpo", "--data", "gen:arith:8:1", "--steps", "2", "--group-size", "4",
          "--prompts-per-rollout", "2", "--mini-batch", "4", "--micro-batch", "4", "--max-new-tokens", "5",
          "--lr", "1e-3", "--reward", "random:0.5"], tmp / "grpo"),
        ("route", "route make-experts (2 steps)",
         ["route", "make-experts", inp["route_base"], experts, "--data", inp["route"], "--max-steps", "2",
          "--batch-size", "4", "--template", "raw"], experts),
        ("route", "route train (2 steps)",
         ["route", "train", tmp / "router", "--data", inp["route"],
          "--experts", f"{experts / 'math'},{experts / 'reverse'}", "--base", inp["route_base"], "--max-steps", "2",
          "--batch-size", "4", "--template", "raw"], tmp / "router"),
        ("kvcache", "kvcache evaluate (snapkv, ppl)",
         ["kvcache", "evaluate", m, "--task", "ppl", "--data", t, "--samples", "2", "--prefix", "64",
          "--continuation", "32", "--method", "snapkv", "--budget", "0.5"], None),
        ("edit", "edit memit (1 edit)",
         ["edit", "--method", "memit", "--layers", "1,2", inp["model4"], inp["edits"], tmp / "edited",
          "--calib-data", t, *memit_fast], tmp / "edited"),
        ("select-data", "select-data features",
         ["select-data", "features", inp["pool"], tmp / "features", "--model", m, "--max-new-tokens", "6",
          "--batch-size", "4"], tmp / "features"),
        ("bench-agent", "bench-agent run (1 episode)",
         ["bench-agent", "run", f"hf:{m}", tmp / "agent", "--env", "grid-nav", "--episodes", "1", "--max-rounds", "2",
          "--max-new-tokens", "8"], tmp / "agent"),
    ]
    return [{"area": a, "job": name, "argv": [str(x) for x in argv], "out": out} for a, name, argv, out in jobs]


def parse_job(argv: list[str]) -> str:
    """Parse ``llmtool --device DEV --json -q ARGV`` with the CLI's own parser, running nothing: the command path
    (e.g. ``route train``); a wrong option, value or argument raises click's error (the dry run's check)."""
    import typer

    from llmtool.cli import app

    cmd = typer.main.get_command(app)
    ctx = cmd.make_context("llmtool", ["--device", DEV, "--json", "-q", *argv])
    path = []
    while hasattr(cmd, "resolve_command"):  # a group (typer vendors its own click: no isinstance check)
        protected = getattr(ctx, "_protected_args", None) or getattr(ctx, "protected_args", None) or []  # click 8.2+
        rest = [*protected, *ctx.args]
        if not rest:
            break
        sub_name, sub, rest = cmd.resolve_command(ctx, rest)
        if sub is None:
            raise ValueError(f"no command {sub_name!r} under {' '.join(['llmtool', *path])}")
        path.append(sub_name)
        ctx = sub.make_context(sub_name, rest, parent=ctx)
        cmd = sub
    return " ".join(path)


def part_areas(res, budget, dry_run: bool = False):
    """One smallest job per area through the CLI on DEV (``--device``): ok / the error's last lines, seconds."""
    rows = res.setdefault("areas", [])
    env = dict(os.environ, HF_HUB_OFFLINE="1",
               PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    with tempfile.TemporaryDirectory() as tmp:
        tmp = Path(tmp)
        jobs = area_jobs(tmp, area_inputs(tmp))
        for job in jobs:
            row = {"area": job["area"], "job": job["job"], "device": DEV}
            if dry_run:
                try:
                    row.update(command=parse_job(job["argv"]), ok=True)
                except Exception as e:  # click's UsageError / BadParameter: the argv does not parse
                    row.update(ok=False, error=f"{type(e).__name__}: {e}")
                record(rows, row)
                continue
            if elapsed() > budget:
                record(rows, {**row, "skipped": "budget"})
                continue
            t = time.perf_counter()
            try:
                p = subprocess.run([sys.executable, "-m", "llmtool", "--device", DEV, "--json", "-q", *job["argv"]],
                                   capture_output=True, text=True, env=env, timeout=AREA_TIMEOUT_S)
                rc, stdout, stderr = p.returncode, p.stdout, p.stderr
            except subprocess.TimeoutExpired as e:
                rc, stdout, stderr = None, "", f"timeout after {AREA_TIMEOUT_S} s: {(e.stderr or b'')[-300:]!r}"
            ok = rc == 0 and (job["out"] is None or Path(job["out"]).is_dir())
            row.update(ok=ok, rc=rc, s=round(time.perf_counter() - t, 2))
            if not ok:
                row["error"] = "\n".join(stderr.strip().splitlines()[-3:])[-600:] or "no output written"
            try:
                out = json.loads(stdout)
                row["result"] = {k: v for k, v in out.items() if isinstance(v, (int, float, str, bool))} \
                    if isinstance(out, dict) else None
            except json.JSONDecodeError:
                pass
            record(rows, row)


# ---------------------------------------------------------------------------------------------- kernels

def bench(fn) -> float:
    """Median milliseconds (triton's do_bench on CUDA; one timed call in the CPU smoke run)."""
    if DEV != "cuda":
        t = time.perf_counter()
        fn()
        return (time.perf_counter() - t) * 1e3
    import triton

    return float(triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median"))


def part_kernels(res, budget):
    import torch.nn.functional as F

    from llmtool.kernels import hadamard, kv_quant, lowrank_matmul, quant, w4a4_matmul
    from llmtool.kernels.intpack import pack
    from llmtool.quantize.modules import QuantLinear
    from llmtool.quantize.quantizers import rtn_weight

    rows = res.setdefault("kernels", [])
    dev = DEV
    tuned = DEV == "cuda"      # the autotuner times configs with CUDA events
    g = torch.Generator(device=dev).manual_seed(0)
    if SMOKE:
        torch.set_num_threads(1)

    def add(row):
        record(rows, row)

    def wanted(name: str) -> bool:
        return KERNELS is None or name in KERNELS

    # W4A4 integer GEMM and the W4A4 / W4A16 QuantLinear, per (N, K) and M
    for n, k in [] if not wanted("w4a4") else [(64, 128)] if SMOKE else [(4096, 4096), (11008, 4096), (4096, 11008)]:
        w = torch.randn(n, k, device=dev, generator=g) * 0.02
        codes, scale = rtn_weight(w, 4, False)
        packed = pack(codes.to(torch.uint8), 4)
        w_bf16 = w.to(torch.bfloat16)
        qa = QuantLinear(k, n, w_bits=16, a_bits=4, a_symmetric=True, dtype=torch.bfloat16).to(dev)
        qa.set_quantized(codes, scale, 4)
        qw = QuantLinear(k, n, w_bits=16, a_bits=16, dtype=torch.bfloat16).to(dev)
        qw.set_quantized(codes, scale, 4)
        w_deq = qw.dequantized_weight(torch.float32)
        for m in [1, 16] if SMOKE else [1, 8, 16, 256, 2048]:
            if elapsed() > budget:
                add({"kernel": "w4a4/w4a16", "n": n, "k": k, "m": m, "skipped": "budget"})
                continue
            x = torch.randn(m, k, device=dev, generator=g)
            xb = x.to(torch.bfloat16)
            xc, xs, xz = quant.quantize_per_token(x, 4, True, 1.0)
            ref = w4a4_matmul.w4a4_matmul_reference(xc, xs, xz, packed, scale, 8)
            y_tuned = w4a4_matmul.w4a4_matmul_triton(xc, xs, xz, packed, scale, 8, tuned=tuned)
            fixed = w4a4_matmul.w4a4_matmul_triton(xc, xs, xz, packed, scale, 8, tuned=False)
            y16 = qw(xb)
            y16_ref = (xb.float() @ w_deq.T)
            row = {"kernel": "w4a4/w4a16", "n": n, "k": k, "m": m,
                   "w4a4_tuned_equal_ref": bool(torch.equal(y_tuned, ref)),
                   "w4a4_fixed_equal_ref": bool(torch.equal(fixed, ref)),
                   "w4a16_rel_err_vs_dequant": rel_diff(y16.float(), y16_ref),
                   "ms_bf16_cublas": bench(lambda: F.linear(xb, w_bf16)),
                   "ms_w4a4_gemm_tuned": bench(lambda: w4a4_matmul.w4a4_matmul_triton(xc, xs, xz, packed, scale, 8,
                                                                                     tuned=tuned)),
                   "ms_w4a4_gemm_fixed": bench(lambda: w4a4_matmul.w4a4_matmul_triton(xc, xs, xz, packed, scale, 8,
                                                                                     tuned=False)),
                   "ms_w4a4_quantlinear": bench(lambda: qa(xb)),
                   "ms_w4a16_quantlinear": bench(lambda: qw(xb)),
                   "ms_w4a16_dequant_fp32": bench(lambda: F.linear(x, qw._int8_codes().float() * qw.weight_scale.float()))}
            if tuned:
                row["w4a4_best_config"] = str(w4a4_matmul._w4a4_tuned.best_config)
            for key in ("ms_w4a4_gemm_tuned", "ms_w4a4_quantlinear", "ms_w4a16_quantlinear"):
                row[key.replace("ms_", "speedup_vs_bf16_")] = round(row["ms_bf16_cublas"] / row[key], 3)
            add(row)
        torch.cuda.empty_cache()

    # per-token activation quantization (the W4A4 input): codes, scales, zeros equal to the reference's
    for bits, sym in [(4, True), (4, False), (8, False)] if wanted("quant") else []:
        if elapsed() > budget:
            add({"kernel": "quant_per_token", "bits": bits, "skipped": "budget"})
            continue
        x = torch.randn(4096, 4096, device=dev, generator=g) * 3
        got = quant.quantize_per_token_triton(x, bits, sym, 0.9) if DEV == "cuda" else \
            quant.quantize_per_token(x, bits, sym, 0.9)
        ref = quant.quantize_per_token_reference(x, bits, sym, 0.9)
        add({"kernel": "quant_per_token", "bits": bits, "symmetric": sym, "rows": 4096, "cols": 4096,
             "codes_equal_ref": bool(torch.equal(got[0], ref[0])),
             "codes_mismatch_fraction": float((got[0] != ref[0]).float().mean()),
             "scale_zero_equal_ref": bool(torch.equal(got[1], ref[1]) and torch.equal(got[2], ref[2])),
             "ms_triton": bench(lambda: quant.quantize_per_token(x, bits, sym, 0.9)),
             "ms_reference": bench(lambda: quant.quantize_per_token_reference(x, bits, sym, 0.9))})

    # fast Walsh-Hadamard transform / Hadamard transform (rows x n)
    for n in [] if not wanted("hadamard") else [64, 192] if SMOKE else [4096, 12288, 16384]:
        if elapsed() > budget:
            add({"kernel": "hadamard", "n": n, "skipped": "budget"})
            continue
        x = torch.randn(16 if SMOKE else 8192, n, device=dev, generator=g)
        fn = hadamard.fwht if n & (n - 1) == 0 else hadamard.hadamard_transform
        y = fn(x)
        h = hadamard.hadamard_matrix(n, dtype=torch.float32, device=dev) if n <= 12288 else None
        row = {"kernel": "hadamard", "n": n, "rows": x.shape[0], "fn": fn.__name__,
               "rel_err_vs_dense": rel_diff(y, x.double() @ h.double()) if h is not None else None,
               "ms_triton": bench(lambda: fn(x))}
        if n & (n - 1) == 0:
            row["ms_torch_reference"] = bench(lambda: hadamard.fwht_reference(x))
        if h is not None:
            hb, xb = h.to(torch.bfloat16), x.to(torch.bfloat16)
            row["ms_dense_bf16_matmul"] = bench(lambda: xb @ hb)
        add(row)
        torch.cuda.empty_cache()

    # KV-cache group quantization (KIVI / PatternKV): N groups of G = 128 values
    for bits in (2, 4) if wanted("kv_quant") else ():
        if elapsed() > budget:
            add({"kernel": "kv_quant", "bits": bits, "skipped": "budget"})
            continue
        x = torch.randn(256 if SMOKE else 1 << 19, 128, device=dev, generator=g, dtype=torch.float16)
        scale, mn = kv_quant.group_stats(x, bits)
        p_t, p_r = kv_quant.pack_triton(x, scale, mn, bits), kv_quant.pack_reference(x, scale, mn, bits)
        u_t = kv_quant.unpack_triton(p_t, scale, mn, bits, torch.float16)
        u_r = kv_quant.unpack_reference(p_r, scale, mn, bits, torch.float16)
        add({"kernel": "kv_quant", "bits": bits, "groups": x.shape[0], "group": 128,
             "pack_equal_ref": bool(torch.equal(p_t, p_r)), "unpack_equal_ref": bool(torch.equal(u_t, u_r)),
             "pack_mismatch_fraction": float((p_t != p_r).float().mean()),
             "ms_pack_triton": bench(lambda: kv_quant.pack_triton(x, scale, mn, bits)),
             "ms_pack_reference": bench(lambda: kv_quant.pack_reference(x, scale, mn, bits)),
             "ms_unpack_triton": bench(lambda: kv_quant.unpack_triton(p_t, scale, mn, bits, torch.float16)),
             "ms_unpack_reference": bench(lambda: kv_quant.unpack_reference(p_r, scale, mn, bits, torch.float16))})
        torch.cuda.empty_cache()

    # fused low-rank matmul (compressed Linear forward)
    for dtype in (torch.bfloat16, torch.float32) if wanted("lowrank") else ():
        for m in (16,) if SMOKE else (16, 2048):
            if elapsed() > budget:
                add({"kernel": "lowrank", "m": m, "skipped": "budget"})
                continue
            k, r, n = (64, 16, 96) if SMOKE else (4096, 1024, 11008)
            x = torch.randn(m, k, device=dev, generator=g).to(dtype)
            a = (torch.randn(r, k, device=dev, generator=g) * 0.02).to(dtype)
            b = (torch.randn(n, r, device=dev, generator=g) * 0.02).to(dtype)
            dense = (b.float() @ a.float()).to(dtype)
            y_t = lowrank_matmul.lowrank_matmul_triton(x, a, b)
            y_r = lowrank_matmul.lowrank_matmul_reference(x.double(), a.double(), b.double())
            add({"kernel": "lowrank", "dtype": str(dtype).replace("torch.", ""), "m": m, "k": k, "r": r, "n": n,
                 "rel_err_vs_fp64": rel_diff(y_t, y_r),
                 "ms_triton": bench(lambda: lowrank_matmul.lowrank_matmul_triton(x, a, b)),
                 "ms_torch_two_matmuls": bench(lambda: lowrank_matmul.lowrank_matmul_reference(x, a, b)),
                 "ms_dense_same_shape": bench(lambda: F.linear(x, dense))})
            torch.cuda.empty_cache()


# ---------------------------------------------------------------------------------------------- e2e

def mem_reset() -> None:
    if DEV == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()


def mem_now(model) -> int:
    """Bytes the model holds: allocated GPU memory on CUDA (after freeing the caches' slack), else its
    parameters, buffers and QuantLinear kernel caches."""
    if DEV == "cuda":
        torch.cuda.empty_cache()
        return torch.cuda.memory_allocated()
    from llmtool.quantize.modules import resident_bytes

    return resident_bytes(model)


def part_e2e(res, budget, layers: int, jobs=("quarot", "zs-svd")):
    from transformers import LlamaConfig, LlamaForCausalLM

    from llmtool.compress.methods import METHODS as COMPRESS
    from llmtool.compress.pipeline import compress_model
    from llmtool.quantize.api import quantize_
    from llmtool.quantize.runner import make_config

    rows = res.setdefault("e2e", [])
    shape = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_attention_heads=4) if SMOKE else \
        dict(vocab_size=32000, hidden_size=4096, intermediate_size=11008, num_attention_heads=32)
    cfg = LlamaConfig(num_hidden_layers=layers, num_key_value_heads=shape["num_attention_heads"],
                      max_position_embeddings=4096, tie_word_embeddings=False, **shape)
    vocab = shape["vocab_size"]

    def build(dtype=torch.bfloat16):
        torch.manual_seed(0)
        with torch.device(DEV):
            m = LlamaForCausalLM(cfg).to(dtype).eval()
        return m

    prompt = ids(1, 32, 5, vocab=vocab).to(DEV)
    calib = ids(2, 64, 6, vocab=vocab).to(DEV) if SMOKE else ids(16, 512, 6, vocab=vocab).to(DEV)

    def decode(model, new=128, reps=3):
        times = []
        for _ in range(reps):
            sync()
            t = time.perf_counter()
            with torch.no_grad():
                model.generate(prompt, max_new_tokens=new, min_new_tokens=new, do_sample=False)
            sync()
            times.append(time.perf_counter() - t)
        return new / sorted(times)[len(times) // 2]

    settings = [("bf16", None), ("rtn W4A16", dict(w_bits=4, a_bits=16)), ("rtn W4A4", dict(w_bits=4, a_bits=4))]
    base = {}
    for label, over in settings:
        if elapsed() > budget:
            record(rows, {"setting": label, "skipped": "budget"})
            continue
        mem_reset()
        model = build()
        row = {"setting": label, "layers": layers}
        if over is not None:
            t = time.perf_counter()
            quantize_(model, make_config("rtn", **over))
            sync()
            row["quantize_s"] = round(time.perf_counter() - t, 2)
        row["memory_gb"] = round(mem_now(model) / 2**30, 4)
        decode(model, new=8, reps=1)           # warm-up: kernel caches, autotune, cuBLAS handles
        row["decode_tok_s"] = round(decode(model), 2)
        if label == "bf16":
            base = row
        else:
            row["memory_ratio"] = round(row["memory_gb"] / base["memory_gb"], 3) if base else None
            row["decode_ratio"] = round(row["decode_tok_s"] / base["decode_tok_s"], 3) if base else None
        record(rows, row)
        del model

    jobs = [(label, area, name) for label, area, name in [
        ("quantize quarot W4A4 (GPTQ, 16 x 512 calibration)", "quantize", "quarot"),
        ("compress zs-svd 40 % (16 x 512 calibration)", "compress", "zs-svd")] if name in jobs]
    for label, area, name in jobs:
        if elapsed() > budget:
            record(rows, {"job": label, "skipped": "budget"})
            continue
        mem_reset()
        model = build(torch.float32)
        t = time.perf_counter()
        row = {"job": label, "layers": layers}
        try:
            if area == "quantize":
                quantize_(model, make_config(name, seed=0), calib)
            else:
                ccfg = COMPRESS.get_config(name)(ratio=0.4, batch_size=4, grad_seqlen=calib.shape[1])
                compress_model(model, ccfg, calib, calib[:1])
            sync()
            row["s"] = round(time.perf_counter() - t, 2)
            if DEV == "cuda":
                row["peak_gb"] = round(torch.cuda.max_memory_allocated() / 2**30, 2)
        except Exception as exc:
            row["error"] = f"{type(exc).__name__}: {exc}"[:400]
            row["where"] = traceback.format_exc().strip().splitlines()[-3:]
        record(rows, row)
        del model


# ---------------------------------------------------------------------------------------------- output

def write(res, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1, default=str))
    lines = [f"# GPU check ({res['env'].get('device', '?')})", ""]
    sections: dict = {}
    for part, rows in res.items():
        if part in ("env", "meta", "part_errors") or not rows:
            continue
        for r in rows:
            sub = r.get("kernel") or ("jobs" if "job" in r else None)
            sections.setdefault(f"{part}: {sub}" if sub else part, []).append(r)
    for part, rows in sections.items():
        keys = []
        for r in rows:
            keys += [k for k in r if k not in keys and not isinstance(r[k], (list, dict))]
        lines += [f"## {part}", "", "| " + " | ".join(keys) + " |", "|" + "---|" * len(keys)]
        for r in rows:
            cells = []
            for k in keys:
                v = r.get(k, "")
                cells.append(f"{v:.4g}" if isinstance(v, float) else str(v))
            lines.append("| " + " | ".join(cells) + " |")
        lines.append("")
    out.with_suffix(".md").write_text("\n".join(lines))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(RESULTS / "gpu_check"))
    ap.add_argument("--budget-s", type=float, default=330.0, help="parts/items not started by then are skipped")
    ap.add_argument("--parts", nargs="+", default=["methods", "kernels", "cli", "e2e"])
    ap.add_argument("--layers", type=int, default=4, help="decoder layers of the 7B-shaped model (e2e)")
    ap.add_argument("--kernels", nargs="+", default=None, help="kernels part: only these (w4a4 quant hadamard kv_quant lowrank)")
    ap.add_argument("--jobs", nargs="*", default=["quarot", "zs-svd"],
                    help="e2e wall-time jobs to run (quarot: GPTQ W4A4; zs-svd: 40 %% compression); none: --jobs")
    ap.add_argument("--smoke", action="store_true",
                    help="run every part on the CPU at tiny shapes (triton interpreted) to check the script")
    ap.add_argument("--device", choices=["cuda", "cpu"], default="cuda",
                    help="areas part: the device its jobs run on (cpu: check the jobs here; the other parts need "
                         "--smoke for the CPU)")
    ap.add_argument("--dry-run", action="store_true",
                    help="areas part: parse every job's argv with the CLI's parser, run nothing")
    args = ap.parse_args()
    global DEV, SMOKE, KERNELS
    KERNELS = args.kernels
    if args.smoke:
        os.environ["TRITON_INTERPRET"] = "1"
        DEV, SMOKE = "cpu", True
    elif args.device == "cpu":
        if set(args.parts) - {"areas"}:
            print("gpu_check: --device cpu runs the areas part only (the other parts: --smoke)", file=sys.stderr)
            return 2
        DEV = "cpu"
    elif not torch.cuda.is_available() and not args.dry_run:
        print("gpu_check: no CUDA device (use --smoke or --device cpu to check the script on the CPU)",
              file=sys.stderr)
        return 2
    import transformers

    try:
        import triton
        tver = triton.__version__
    except ImportError:
        tver = None
    global OUT
    res = RES
    res.update({"env": {"device": torch.cuda.get_device_name() if DEV == "cuda" and torch.cuda.is_available()
                        else ("cpu (smoke)" if SMOKE else DEV), "torch": torch.__version__, "cuda": torch.version.cuda,
                   "triton": tver, "transformers": transformers.__version__, "python": platform.python_version()},
           "meta": {"argv": sys.argv[1:], "budget_s": args.budget_s}})
    out = OUT = Path(args.out)
    parts = {"methods": lambda: part_methods(res, args.budget_s), "cli": lambda: part_cli(res, args.budget_s),
             "kernels": lambda: part_kernels(res, args.budget_s),
             "e2e": lambda: part_e2e(res, args.budget_s, args.layers, args.jobs),
             "areas": lambda: part_areas(res, args.budget_s, args.dry_run)}
    for name in args.parts:
        t = time.perf_counter()
        try:
            parts[name]()
        except Exception as exc:
            res.setdefault("part_errors", {})[name] = traceback.format_exc()[-1500:]
            print(f"part {name} failed: {exc}", file=sys.stderr, flush=True)
        res["meta"][f"{name}_s"] = round(time.perf_counter() - t, 1)
        res["meta"]["total_s"] = round(elapsed(), 1)
        write(res, out)
    print(f"wrote {out}.json / .md in {elapsed():.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

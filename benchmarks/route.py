"""Benchmark for `llmtool route`: FusionRoute vs each expert, route-only / router-only ablations,
sequence selection, Collab-style token selection, Task Arithmetic / DARE merges and SFT on the union,
all on the same experts, data, template, greedy decoding and seed.

Every step is the CLI a user would run (printed and recorded), in a work directory:

    python benchmarks/route.py                          # CPU default (small: see --train/--test)
    python benchmarks/route.py --train 2000 --test 200 --router-rows 0 --template chat   # issue protocol

Writes benchmarks/results/route.json, route.md and route.png (accuracy per domain and method).
Gates from the issue are evaluated and reported as met / NOT met / not tested (``benchmarks/gates.py``)
with the measured figures: "fusion >= best expert + 15" and ">= 90 % routing" are not tested when the
experts are disjoint (each <= 5 % on the other's domain), where any router better than a coin passes.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import shlex
import subprocess
import sys
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gates import NOT_TESTED, gate, verdict  # noqa: E402
PY = [sys.executable, "-m", "llmtool"]


def run_measured(args: list[str], log: list, env: dict) -> dict:
    """Like :func:`sh` but reaps the child with wait4 to get its own peak memory."""
    cmd = PY + [str(a) for a in args]
    # recorded with the work directory as $W: a machine-local path never lands in the results
    text = ("llmtool " + " ".join(shlex.quote(str(a)) for a in args)).replace(env["ROUTE_BENCH_WORK"], "$W")
    print("$ " + text, flush=True)
    t0 = time.time()
    with open(os.devnull, "w") as devnull:
        errf = open(Path(env["ROUTE_BENCH_WORK"]) / "stderr.log", "a")
        p = subprocess.Popen(cmd, env=env, stdout=devnull, stderr=errf)
        _, status, ru = os.wait4(p.pid, 0)
        errf.close()
    rc = os.waitstatus_to_exitcode(status)
    rec = {"cmd": text, "seconds": round(time.time() - t0, 1), "rc": rc, "peak_rss_mib": round(ru.ru_maxrss / 1024, 1)}
    log.append(rec)
    (Path(env["ROUTE_BENCH_WORK"]) / "steps.json").write_text(json.dumps(log, indent=1))
    if rc != 0:
        raise SystemExit(f"step failed (rc {rc}): {text}; see {env['ROUTE_BENCH_WORK']}/stderr.log")
    return rec


DISJOINT_TOL = 0.05  # an expert at <= 5 % on every other domain knows nothing of it


def disjoint_experts(acc: dict, doms: list[str], tol: float = DISJOINT_TOL) -> bool:
    """Whether every domain expert scores <= ``tol`` on every other domain: then any router better than a
    coin lifts the mean by ~1/n of the gap, and "routes to the matching expert" is what separable prompts
    give for free (issue 42)."""
    return all(acc[f"expert:{e}"][d] <= tol for e in doms for d in doms if d != e)


def route_gates(acc: dict, mean: dict, rq: dict, doms: list[str]) -> list[dict]:
    """The issue's gates as met / not met / not tested records (``benchmarks/gates.py``). "Fusion >= best
    expert + 15" and ">= 90 % routing to the matching expert" are tested only when the experts are not
    disjoint (each > 5 % somewhere outside its own domain); with disjoint experts they hold for any router
    better than a coin."""
    expert_names = [f"expert:{d}" for d in doms]
    best_expert = max(expert_names, key=lambda n: mean[n])
    best_merge = max(("merge-ta", "merge-dare"), key=lambda n: mean[n])
    disjoint = disjoint_experts(acc, doms)
    cross = {f"expert:{e} on {d}": acc[f"expert:{e}"][d] for e in doms for d in doms if d != e}
    why = ("the experts are disjoint (each <= 5 % on the other's domain: "
           + ", ".join(f"{k} {100 * v:.1f} %" for k, v in cross.items())
           + "), so any router better than a coin passes")
    out = [gate("calibration: base <= 25 % on each domain", all(acc["base"][d] <= 0.25 for d in doms),
                {d: acc["base"][d] for d in doms})]
    for d in doms:
        others = [acc[f"expert:{o}"][d] for o in doms if o != d]
        out.append(gate(f"calibration: expert:{d} >= 60 % on {d} and >= 30 points above the other expert",
                        acc[f"expert:{d}"][d] >= 0.60 and all(acc[f"expert:{d}"][d] - o >= 0.30 for o in others),
                        {"own": acc[f"expert:{d}"][d], "other": others}))
    out.append(gate("FusionRoute mean >= best single expert mean + 15 points",
                    mean["fusion"] >= mean[best_expert] + 0.15,
                    {"fusion": round(mean["fusion"], 4), best_expert: round(mean[best_expert], 4)},
                    precondition=not disjoint, reason=why))
    out.append(gate("FusionRoute >= each domain's expert - 5 points on that domain",
                    all(acc["fusion"][d] >= acc[f"expert:{d}"][d] - 0.05 for d in doms),
                    {d: [acc["fusion"][d], acc[f"expert:{d}"][d]] for d in doms}))
    out.append(gate("FusionRoute >= route-only - 1 point on every domain",
                    all(acc["fusion"][d] >= acc["route-only"][d] - 0.01 for d in doms),
                    {d: [acc["fusion"][d], acc["route-only"][d]] for d in doms}))
    out.append(gate("FusionRoute mean >= best merge mean + 10 points", mean["fusion"] >= mean[best_merge] + 0.10,
                    {"fusion": round(mean["fusion"], 4), best_merge: round(mean[best_merge], 4)}))
    out.append(gate("FusionRoute mean >= token-select and seq-select means",
                    mean["fusion"] >= mean["token-select"] and mean["fusion"] >= mean["seq-select"],
                    {k: round(mean[k], 4) for k in ("fusion", "token-select", "seq-select")}))
    out.append(gate("routing: matching expert on >= 90 % of informative positions",
                    (rq["matching_expert_rate"] or 0) >= 0.90,
                    {k: rq[k] for k in ("matching_expert_rate", "informative_fraction")},
                    precondition=not disjoint, reason=why))
    return out


def gate_rows(gates: list[dict]) -> list[dict]:
    return [{"gate": x["gate"], "met": {True: "yes", False: "**NOT met**"}.get(x["met"], NOT_TESTED),
             "measured": json.dumps(x["measured"]) + (f"; {x['reason']}" if verdict(x) == NOT_TESTED else "")}
            for x in gates]


def regate(tag: str) -> None:
    """``--regate``: the gates of a stored run re-judged by :func:`route_gates` (e.g. after a precondition was
    added); the JSON's ``gates`` and the md's gate table are replaced, everything else is kept."""
    from llmtool.core.console import markdown_table

    jf, mf = RESULTS / f"{tag}.json", RESULTS / f"{tag}.md"
    res = json.loads(jf.read_text())
    doms = list(res["accuracy"]["base"])
    res["gates"] = route_gates(res["accuracy"], res["mean_accuracy"], res["routing_quality"], doms)
    jf.write_text(json.dumps(res, indent=2, default=str))
    md = mf.read_text()
    head, sep, rest = md.partition("Gates:\n\n")
    _, sep2, tail = rest.partition("\n\nCommands:")
    if not (sep and sep2):
        raise SystemExit(f"{mf}: no 'Gates:' ... 'Commands:' section to replace")
    mf.write_text(head + sep + markdown_table(gate_rows(res["gates"])) + sep2 + tail)
    print(f"re-judged {len(res['gates'])} gates of {jf.name}")


def mean_gap_ci(a: list[dict], b: list[dict]) -> dict:
    """Paired difference of per-item correctness (a − b), mean over items with a normal 95 % interval."""
    bi = {x["id"]: x["correct"] for x in b}
    d = [int(x["correct"]) - int(bi[x["id"]]) for x in a if x["id"] in bi]
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / max(1, n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {"mean_gap_points": round(100 * m, 2), "ci95_points": [round(100 * (m - half), 2), round(100 * (m + half), 2)],
            "n": n}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--domains", default="math,code")
    ap.add_argument("--train", type=int, default=160, help="training rows per domain (issue protocol: 2000)")
    ap.add_argument("--test", type=int, default=40, help="test rows per domain (issue protocol: 200)")
    ap.add_argument("--router-rows", type=int, default=96, help="router SFT rows (mixed; 0 = all training rows)")
    ap.add_argument("--expert-lr", type=float, default=2e-4)
    ap.add_argument("--router-lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--union-max-steps", type=int, default=-1,
                    help="sft-union steps (-1 = --epochs over the union, the experts' combined budget)")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="24 fits the longest code answer (21 tokens)")
    ap.add_argument("--template", default="raw", help="raw (CPU default: shorter sequences) or chat")
    ap.add_argument("--cdpo", action="store_true", help="also run make-prefs + stage cdpo and evaluate it")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", default=None, help="work dir (default: a fresh temp dir)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="route")
    ap.add_argument("--regate", action="store_true",
                    help="re-judge the gates of the stored results/<tag>.json and rewrite their section of <tag>.md "
                         "(nothing is run)")
    args = ap.parse_args()
    if args.regate:
        regate(args.tag)
        return

    import tempfile

    work = Path(args.work or tempfile.mkdtemp(prefix="route-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLMTOOL_THREADS": str(args.threads), "ROUTE_BENCH_WORK": str(work),
           "TOKENIZERS_PARALLELISM": "false"}
    g = ["--seed", str(args.seed)]
    log: list = json.loads((work / "steps.json").read_text()) if (work / "steps.json").is_file() else []
    t_start = time.time()
    doms = [d.strip() for d in args.domains.split(",") if d.strip()]
    T = ["--template", args.template]
    gen = ["--max-new-tokens", str(args.max_new_tokens), "--batch-size", "16"] + T

    data = work / "data"
    if not data.exists():
        run_measured(g + ["route", "data", data, "--domains", args.domains, "--train", args.train, "--test", args.test],
                     log, env)
    train, test = data / "train.jsonl", data / "test.jsonl"
    rows = [json.loads(x) for x in train.read_text().splitlines()]
    router_data = work / "router.jsonl"
    if args.router_rows and args.router_rows < len(rows):
        rnd = random.Random(args.seed)
        sub = rnd.sample(rows, args.router_rows)
        router_data.write_text("".join(json.dumps(r) + "\n" for r in sub))
    else:
        router_data.write_text(train.read_text())

    experts_dir = work / "experts"
    tr = ["--epochs", args.epochs, "--batch-size", args.batch_size] + T
    if not experts_dir.exists():
        run_measured(g + ["route", "make-experts", args.model, experts_dir, "--data", train, "--lr", args.expert_lr] + tr,
                     log, env)
    experts = ",".join(str(experts_dir / d) for d in doms)
    fr = work / "fr"
    if not fr.exists():
        run_measured(g + ["route", "train", fr, "--data", router_data, "--experts", experts, "--base", args.model,
                          "--lr", args.router_lr] + tr, log, env)
    base_b = ["--experts", experts, "--base", args.model]
    for name, extra in (("ta", ["--method", "merge-ta"]), ("dare", ["--method", "merge-dare"]),
                        ("union", ["--method", "sft-union", "--data", train, "--lr", args.expert_lr,
                                   "--epochs", args.epochs, "--max-steps", args.union_max_steps,
                                   "--batch-size", args.batch_size] + T),
                        ("seq", ["--method", "seq-select", "--in", test] + gen),
                        ("tok", ["--method", "token-select", "--in", test] + gen)):
        if not (work / name).exists():
            run_measured(g + ["route", "baseline", work / name] + extra + base_b, log, env)
    if args.cdpo and not (work / "fr-cdpo").exists():
        run_measured(g + ["route", "make-prefs", "--router", fr, "--data", router_data, "-o", work / "prefs.jsonl",
                          "--limit", "32", "--max-new-tokens", str(args.max_new_tokens), "--overwrite"], log, env)
        run_measured(g + ["route", "train", work / "fr-cdpo", "--stage", "cdpo", "--init", fr, "--data",
                          work / "prefs.jsonl", "--lr", "1e-5", "--batch-size", "4"], log, env)

    systems = {"base": ["--model", args.model]}
    for i, d in enumerate(doms):
        systems[f"expert:{d}"] = ["--model", experts_dir / d]
    systems.update({"fusion": ["--router", fr, "--mode", "fusion"], "route-only": ["--router", fr, "--mode", "route-only"],
                    "router-only": ["--router", fr, "--mode", "router-only"],
                    "seq-select": ["--generations", work / "seq" / "generations.jsonl"],
                    "token-select": ["--generations", work / "tok" / "generations.jsonl"],
                    "merge-ta": ["--model", work / "ta"], "merge-dare": ["--model", work / "dare"],
                    "sft-union": ["--model", work / "union"]})
    if args.cdpo:
        systems["fusion+cdpo"] = ["--router", work / "fr-cdpo", "--mode", "fusion"]
    evals, mem = {}, {}
    for name, sel in systems.items():
        out = work / f"eval-{name.replace(':', '-')}.json"
        if not out.exists():
            rec = run_measured(g + ["route", "eval", "--data", test, "-o", out] + sel + gen, log, env)
            mem[name] = rec["peak_rss_mib"]
        evals[name] = json.loads(out.read_text())

    # routing quality on held-out single-domain gold sequences (in-process)
    from llmtool.core.job import apply_threads
    from llmtool.route.analysis import routing_quality
    from llmtool.route.router import load_router
    from llmtool.route.vocab import VocabView

    apply_threads(args.threads)
    router, tok, models, meta = load_router(fr)
    test_rows = [json.loads(x) for x in test.read_text().splitlines()]
    rq = routing_quality(router, models, VocabView(meta.vocab_size_used, meta.n_tokens), tok, test_rows,
                         {d: i for i, d in enumerate(doms)}, template=args.template)

    acc = {n: {d: e["domains"][d]["accuracy"] for d in doms} for n, e in evals.items()}
    ci = {n: {d: e["domains"][d]["ci95"] for d in doms} for n, e in evals.items()}
    mean = {n: sum(v.values()) / len(v) for n, v in acc.items()}
    expert_names = [f"expert:{d}" for d in doms]
    best_expert = max(expert_names, key=lambda n: mean[n])
    gates = route_gates(acc, mean, rq, doms)
    gap = mean_gap_ci(evals["fusion"]["items"], evals["route-only"]["items"])

    tps = {n: evals[n].get("tokens_per_s") for n in evals}
    cost = {"fusion_tokens_per_s": tps.get("fusion"), "single_expert_tokens_per_s": tps.get(expert_names[0]),
            "ratio_fusion_over_expert": (round(tps["fusion"] / tps[expert_names[0]], 3)
                                         if tps.get("fusion") and tps.get(expert_names[0]) else None),
            "peak_rss_mib": mem,
            "scaling": "memory = router + n experts resident (n+1 models); compute per token = router + the selected "
                       "expert (plus catch-up prefill when the route switches); experts could sit behind "
                       "OpenAI-compatible endpoints only if those return full next-token log-probs over the vocabulary"}
    result = {"config": vars(args), "work": "(temp dir)", "accuracy": acc, "ci95": ci, "mean_accuracy": mean,
              "best_expert": best_expert, "fusion_minus_route_only": gap, "routing_quality": rq,
              "expert_share": {n: {d: evals[n]["domains"][d].get("expert_share") for d in doms}
                               for n in ("fusion", "route-only", "token-select", "seq-select") if n in evals},
              "cost": cost, "gates": gates, "steps": log, "seconds_total": round(time.time() - t_start, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(result, indent=2, default=str))

    from llmtool.core.console import markdown_table

    table = []
    for n in systems:
        row = {"system": n}
        for d in doms:
            lo, hi = ci[n][d]
            row[d] = f"{100 * acc[n][d]:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"
        row["mean"] = f"{100 * mean[n]:.1f}"
        row["tok/s"] = tps.get(n) if tps.get(n) is not None else "-"
        table.append(row)
    gl = gate_rows(gates)
    md = [f"# route benchmark ({args.model}, domains {', '.join(doms)}, {args.train} train / {args.test} test per domain, "
          f"template {args.template}, greedy, seed {args.seed})", "",
          "Accuracy % per domain with Wilson 95 % interval:", "", markdown_table(table), "",
          f"FusionRoute − route-only (paired, points): {gap['mean_gap_points']} "
          f"[{gap['ci95_points'][0]}, {gap['ci95_points'][1]}] over {gap['n']} items.", "",
          f"Routing quality (held-out gold sequences): matching expert on {rq['matching_expert_rate']} of informative "
          f"positions; informative fraction {rq['informative_fraction']:.3f}.", "",
          f"Cost: fusion {cost['fusion_tokens_per_s']} tok/s vs single expert {cost['single_expert_tokens_per_s']} tok/s "
          f"(ratio {cost['ratio_fusion_over_expert']}); peak RSS MiB per eval process: {json.dumps(mem)}", "",
          "Gates:", "", markdown_table(gl), "", "Commands:", "", "```"] + [s["cmd"] for s in log] + ["```", ""]
    (RESULTS / f"{args.tag}.md").write_text("\n".join(md))
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        fig, ax = plt.subplots(figsize=(10, 4))
        names = list(systems)
        width = 0.8 / len(doms)
        for j, d in enumerate(doms):
            ax.bar([i + j * width for i in range(len(names))], [100 * acc[n][d] for n in names], width, label=d)
        ax.set_xticks([i + width * (len(doms) - 1) / 2 for i in range(len(names))])
        ax.set_xticklabels(names, rotation=35, ha="right")
        ax.set_ylabel("accuracy %")
        ax.legend()
        ax.set_title("llmtool route: accuracy per domain")
        fig.tight_layout()
        fig.savefig(RESULTS / f"{args.tag}.png", dpi=110)
    except Exception as e:  # the plot is optional
        print(f"plot skipped: {e}", file=sys.stderr)
    print("\n".join(md))


if __name__ == "__main__":
    main()

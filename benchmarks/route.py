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
import re
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
    doms = res.get("mean_over") or list(res["accuracy"]["base"])
    res["gates"] = route_gates(res["accuracy"], res["mean_accuracy"], res["routing_quality"], doms)
    jf.write_text(json.dumps(res, indent=2, default=str))
    md = mf.read_text()
    head, sep, rest = md.partition("Gates:\n\n")
    _, sep2, tail = rest.partition("\n\nCommands:")
    if not (sep and sep2):
        raise SystemExit(f"{mf}: no 'Gates:' ... 'Commands:' section to replace")
    mf.write_text(head + sep + markdown_table(gate_rows(res["gates"])) + sep2 + tail)
    print(f"re-judged {len(res['gates'])} gates of {jf.name}")


def _gap_summary(d: list[float]) -> dict:
    """Mean of paired per-item differences with a normal 95 % interval, in points."""
    n = len(d)
    m = sum(d) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in d) / max(1, n - 1))
    half = 1.96 * sd / math.sqrt(n)
    return {"mean_gap_points": round(100 * m, 2), "ci95_points": [round(100 * (m - half), 2), round(100 * (m + half), 2)],
            "n": n}


def fmt_gap(g: dict) -> str:
    """``mean [low, high]`` of a gap summary, in points."""
    return f"{g['mean_gap_points']} [{g['ci95_points'][0]}, {g['ci95_points'][1]}]"


def mean_gap_ci(a: list[dict], b: list[dict]) -> dict:
    """Paired difference of per-item correctness (a − b), mean over items with a normal 95 % interval."""
    bi = {x["id"]: x["correct"] for x in b}
    return _gap_summary([int(x["correct"]) - int(bi[x["id"]]) for x in a if x["id"] in bi])


def pooled_gap_ci(a_runs: list[list[dict]], b_runs: list[list[dict]]) -> dict:
    """Paired difference over items of the per-item correctness averaged over runs (seeds): a − b, normal 95 %
    interval with items as the unit (the runs are paired on the same items)."""
    def avg(runs):
        acc: dict = {}
        for items in runs:
            for x in items:
                acc.setdefault(x["id"], []).append(int(x["correct"]))
        return {k: sum(v) / len(v) for k, v in acc.items()}

    a, b = avg(a_runs), avg(b_runs)
    return {**_gap_summary([a[k] - b[k] for k in a if k in b]), "runs": [len(a_runs), len(b_runs)]}


def items_of(ev: dict, doms: list[str]) -> list[dict]:
    return [x for x in ev["items"] if x["domain"] in doms]


JOINT_WEAK = 0.30  # the joint gate tests "fusion combines the experts" only when each expert alone is <= 30 % on joint


def extra_gates(acc: dict, mean: dict, seeds: dict, doms: list[str], has_joint: bool, cdpo: dict | None) -> list[dict]:
    """Gates added for issue 42: the joint task, fusion vs SFT-union over seeds, stage 2 vs stage 1."""
    from benchmarks.gates import tied

    out = []
    if has_joint and all(k in acc for k in ["fusion"] + [f"expert:{d}" for d in doms]):
        ex = {f"expert:{d}": acc[f"expert:{d}"]["joint"] for d in doms}
        best = max(ex, key=ex.get)
        weak = all(v <= JOINT_WEAK for v in ex.values())
        out.append(gate("joint: FusionRoute >= best single expert on joint + 5 points",
                        acc["fusion"]["joint"] >= ex[best] + 0.05,
                        {"fusion": acc["fusion"]["joint"], **ex},
                        precondition=weak, reason=f"an expert alone reaches > {100 * JOINT_WEAK:.0f} % on joint "
                        "(the task does not need both experts)"))
    if seeds.get("fusion_minus_sft_union"):
        g = seeds["fusion_minus_sft_union"]
        fm, um = seeds["mean"]["fusion"], seeds["mean"]["sft-union"]
        out.append(gate(f"FusionRoute mean >= SFT-union mean over {g['runs'][0]} seeds (paired interval above 0)",
                        g["ci95_points"][0] > 0, {"fusion": fm, "sft-union": um, "paired_gap": g},
                        precondition=not tied(fm, um), reason="the two arms are tied"))
    if cdpo is not None:
        out.append(gate("stage 2 (CDPO) mean >= stage 1 mean (same router, same items)",
                        mean["fusion+cdpo"] >= mean["fusion"], {"stage2": round(mean["fusion+cdpo"], 4),
                                                                 "stage1": round(mean["fusion"], 4), "paired_gap": cdpo},
                        precondition=not tied(mean["fusion+cdpo"], mean["fusion"]),
                        reason="stage 1 and stage 2 have equal means (tied arms)"))
    return out


def fmt_lam(x: float) -> str:
    return f"{x:g}"


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--domains", default="math,code")
    ap.add_argument("--train", type=int, default=160, help="training rows per domain (issue protocol: 2000)")
    ap.add_argument("--test", type=int, default=40, help="test rows per domain (issue protocol: 200)")
    ap.add_argument("--joint", type=int, default=-1, help="joint report-only rows (-1 = --test; 0 = no joint set)")
    ap.add_argument("--val", type=int, default=40, help="validation rows per domain for the merge lambda sweep "
                    "(generated at another seed, prompts of train/test dropped; 0 = no sweep, lambda 1)")
    ap.add_argument("--lams", default="0.3,0.5,0.7,1.0", help="merge lambdas swept on the validation split")
    ap.add_argument("--router-rows", type=int, default=96, help="router SFT rows (mixed; 0 = all training rows)")
    ap.add_argument("--expert-rows", default="", help="train each expert (and sft-union, and the router's sample) on "
                    "the first N training rows of its domain, e.g. math=1200,code=320 (default: all)")
    ap.add_argument("--expert-lr", type=float, default=2e-4)
    ap.add_argument("--router-lr", type=float, default=1e-4)
    ap.add_argument("--epochs", type=float, default=1.0)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--union-max-steps", type=int, default=-1,
                    help="sft-union steps on the router's SFT data (the union of the domains; spec: the same token "
                         "budget as the router): -1 = --epochs over it, as the router")
    ap.add_argument("--max-new-tokens", type=int, default=24, help="24 fits the longest code answer (21 tokens)")
    ap.add_argument("--template", default="raw", help="raw (CPU default: shorter sequences) or chat")
    ap.add_argument("--cdpo", action="store_true", help="also run make-prefs + stage cdpo and evaluate it")
    ap.add_argument("--prefs-limit", type=int, default=64, help="router rows sampled for the CDPO preference pairs")
    ap.add_argument("--seeds", default="", help="comma-separated extra seeds for the router and sft-union (the data "
                    "and the experts stay those of --seed), e.g. 1,2")
    ap.add_argument("--stop-at", default="", help="HH:MM (UTC): the stage-2 part and each extra seed start only before "
                    "this time; a part not started is listed under 'skipped_for_time' (results stay labelled)")
    ap.add_argument("--report-only", action="store_true", help="run nothing new: write the results from the steps "
                    "already finished in --work (systems not evaluated are left out and their gates read 'not tested')")
    ap.add_argument("--note", default="", help="a sentence printed under the title (e.g. how the experts were made)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="work dir (default: a fresh temp dir); finished steps are reused")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="route")
    ap.add_argument("--regate", action="store_true",
                    help="re-judge the gates of the stored results/<tag>.json and rewrite their section of <tag>.md "
                         "(nothing is run)")
    return ap


GEN_LABELS = {"seq-select": "seq-select (judge)", "token-select": "token-select (implicit)",
              "fusion+cdpo": "fusion + stage 2 (CDPO)"}
SEED_SYSTEMS = ("fusion", "route-only", "sft-union")


class RouteBench:
    """One benchmark run in a work directory: each phase runs the CLI steps it needs (a step whose output
    exists is reused, so a run resumes) and keeps what the report needs as attributes."""

    def __init__(self, args):
        import tempfile

        self.args = a = args
        self.work = Path(a.work or tempfile.mkdtemp(prefix="route-bench-"))
        self.work.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, "HF_HUB_OFFLINE": "1", "LLMTOOL_THREADS": str(a.threads),
                    "ROUTE_BENCH_WORK": str(self.work), "TOKENIZERS_PARALLELISM": "false",
                    "OMP_NUM_THREADS": str(a.threads)}
        steps = self.work / "steps.json"
        self.log: list = json.loads(steps.read_text()) if steps.is_file() else []
        self.t_start = time.time()
        self.g = ["--seed", str(a.seed)]
        self.doms = [d.strip() for d in a.domains.split(",") if d.strip()]
        self.n_joint = a.test if a.joint < 0 else a.joint
        self.lams = [float(x) for x in a.lams.split(",") if x.strip()] if a.val else [1.0]
        self.extra_seeds = [int(x) for x in a.seeds.split(",") if x.strip() and int(x) != a.seed]
        self.T = ["--template", a.template]
        self.gen = ["--max-new-tokens", str(a.max_new_tokens), "--batch-size", "16"] + self.T
        self.tr = ["--epochs", a.epochs, "--batch-size", a.batch_size] + self.T
        # peak memory per evaluation, also of the steps an earlier (resumed) run finished
        self.mem: dict = {}
        for rec in self.log:
            m = re.search(r" route eval .* -o \$W/eval-(\S+)\.json", rec["cmd"])
            if m:
                self.mem[m.group(1)] = rec["peak_rss_mib"]
        self.skipped: list = []
        self.evals: dict = {}

    # ------------------------------------------------------------------ steps
    def step(self, argv: list) -> dict:
        return run_measured(argv, self.log, self.env)

    def sfx(self, s: int) -> str:
        return "" if s == self.args.seed else f"-s{s}"

    def evaluate(self, name: str, sel: list, data_file: Path | None = None, gs=None, key: str | None = None) -> dict | None:
        """``name``'s evaluation, read from the work dir when a run already wrote it (``key`` names that file
        when the system's settings vary between runs, e.g. a merge's lambda)."""
        out = self.work / f"eval-{(key or name).replace(':', '-')}.json"
        if not out.exists() and self.args.report_only:
            return None
        if not out.exists():
            rec = self.step((gs or self.g) + ["route", "eval", "--data", data_file or self.evalset, "-o", out]
                            + sel + self.gen)
            self.mem[out.stem[len("eval-"):]] = rec["peak_rss_mib"]
        return json.loads(out.read_text())

    def time_left(self, part: str) -> bool:
        if not self.args.stop_at:
            return True
        import datetime

        now = datetime.datetime.now(datetime.timezone.utc).strftime("%H:%M")
        if now < self.args.stop_at:
            return True
        self.skipped.append(part)
        print(f"skipped for time ({now} >= --stop-at {self.args.stop_at}): {part}", flush=True)
        return False

    # ------------------------------------------------------------------ phases
    def prepare_data(self) -> None:
        """Train/test rows, the report-only joint set, the merge validation split, the experts' rows and the
        router's sample."""
        a, work = self.args, self.work
        data = work / "data"
        if not data.exists():
            self.step(self.g + ["route", "data", data, "--domains", a.domains, "--train", a.train, "--test", a.test]
                      + (["--transfer", "joint"] if self.n_joint else []))
        self.train = data / "train.jsonl"
        rows = [json.loads(x) for x in self.train.read_text().splitlines()]
        self.test_rows = [json.loads(x) for x in (data / "test.jsonl").read_text().splitlines()]
        # the joint set: report-only, never trained on; a joint item whose arithmetic is also a math training
        # question is dropped (no overlap with train)
        self.joint_rows, self.joint_dropped = [], 0
        if self.n_joint:
            train_text = "\n".join(r["prompt"] for r in rows)
            for r in (json.loads(x) for x in (data / "transfer.jsonl").read_text().splitlines()):
                if r["domain"] != "joint":
                    continue
                if f": {r['arith']} =" in train_text:
                    self.joint_dropped += 1
                    continue
                self.joint_rows.append(r)
            self.joint_rows = self.joint_rows[:self.n_joint]
        self.cols = self.doms + (["joint"] if self.joint_rows else [])
        self.evalset = work / "eval.jsonl"
        self.evalset.write_text("".join(json.dumps(r) + "\n" for r in self.test_rows + self.joint_rows))

        # validation split for the merge sweep: another data seed, prompts of train and test dropped
        self.val = work / "val.jsonl"
        if a.val and not self.val.exists():
            vdir = work / "valdata"
            if not vdir.exists():
                self.step(["--seed", str(a.seed + 1000), "route", "data", vdir, "--domains", a.domains,
                           "--train", 1, "--test", a.val])
            seen = {r["prompt"] for r in rows + self.test_rows}
            vrows = [json.loads(x) for x in (vdir / "test.jsonl").read_text().splitlines()]
            self.val.write_text("".join(json.dumps(r) + "\n" for r in vrows if r["prompt"] not in seen))

        # the experts' training data: every training row, or the first N rows of each domain (--expert-rows)
        if a.expert_rows:
            caps = {k.strip(): int(v) for k, v in (x.split("=") for x in a.expert_rows.split(",") if x.strip())}
            rows = [r for d in self.doms for r in [x for x in rows if x["domain"] == d][:caps.get(d, len(rows))]]
            self.train = work / "experts-train.jsonl"
            self.train.write_text("".join(json.dumps(r) + "\n" for r in rows))
        self.rows = rows
        self.router_data = work / "router.jsonl"
        if a.router_rows and a.router_rows < len(rows):
            sub = random.Random(a.seed).sample(rows, a.router_rows)
            self.router_data.write_text("".join(json.dumps(r) + "\n" for r in sub))
        else:
            self.router_data.write_text(self.train.read_text())
        self.n_router = sum(1 for _ in self.router_data.read_text().splitlines())
        self.router_steps = math.ceil(self.n_router * a.epochs / a.batch_size)

    def make_experts(self) -> None:
        a = self.args
        self.experts_dir = self.work / "experts"
        if not self.experts_dir.exists():
            self.step(self.g + ["route", "make-experts", a.model, self.experts_dir, "--data", self.train, "--lr",
                                a.expert_lr] + self.tr)
        self.experts = ",".join(str(self.experts_dir / d) for d in self.doms)
        self.base_b = ["--experts", self.experts, "--base", a.model]

    def train_router_union(self, s: int) -> None:
        a, gs = self.args, ["--seed", str(s)]
        fr_s = self.work / f"fr{self.sfx(s)}"
        if not fr_s.exists():
            self.step(gs + ["route", "train", fr_s, "--data", self.router_data, "--experts", self.experts, "--base",
                            a.model, "--lr", a.router_lr] + self.tr)
        un = self.work / f"union{self.sfx(s)}"
        if not un.exists():
            self.step(gs + ["route", "baseline", un, "--method", "sft-union", "--data", self.router_data, "--lr",
                            a.expert_lr, "--epochs", a.epochs, "--max-steps", a.union_max_steps, "--batch-size",
                            a.batch_size] + self.T + self.base_b)

    def merge_sweep(self) -> None:
        """Merges: lambda swept on the validation split, the best-on-val lambda evaluated on test."""
        self.sweep: dict = {"merge-ta": {}, "merge-dare": {}}
        for method, short in (("merge-ta", "ta"), ("merge-dare", "dare")):
            for lam in self.lams:
                d = self.work / f"{short}-l{fmt_lam(lam)}"
                if not d.exists():
                    self.step(self.g + ["route", "baseline", d, "--method", method, "--lam", lam] + self.base_b)
                if self.args.val:
                    ev = self.evaluate(f"val-{short}-l{fmt_lam(lam)}", ["--model", d], self.val)
                    if ev is not None:
                        self.sweep[method][fmt_lam(lam)] = ev["mean_accuracy"]
        self.best_lam = {m: (max(self.lams, key=lambda x: (v[fmt_lam(x)], -abs(x - 1.0))) if v else 1.0)
                         for m, v in self.sweep.items()}

    def generation_baselines(self) -> None:
        w = self.work
        self.gen_baselines = {
            "seq-select": ("seq", ["--method", "seq-select", "--scorer", "judge", "--in", self.evalset]),
            # the verifier picks among the judge run's candidates (the same greedy answers, not generated twice)
            "seq-select:verifier": ("seq-verifier", ["--method", "seq-select", "--scorer", "verifier", "--candidates",
                                                     w / "seq" / "generations.jsonl", "--in", self.evalset]),
            "token-select": ("tok", ["--method", "token-select", "--value", "implicit", "--in", self.evalset]),
            "token-select:confidence": ("tok-conf", ["--method", "token-select", "--value", "confidence", "--in",
                                                     self.evalset])}
        for d, extra in self.gen_baselines.values():
            if not (w / d).exists() and not self.args.report_only:
                self.step(self.g + ["route", "baseline", w / d] + extra + self.gen + self.base_b)

    def evaluate_systems(self) -> None:
        a, w = self.args, self.work
        fr = w / "fr"
        systems = {"base": ["--model", a.model]}
        for d in self.doms:
            systems[f"expert:{d}"] = ["--model", self.experts_dir / d]
        systems.update({"fusion": ["--router", fr, "--mode", "fusion"], "route-only": ["--router", fr, "--mode", "route-only"],
                        "router-only": ["--router", fr, "--mode", "router-only"]})
        for name, (d, _) in self.gen_baselines.items():
            systems[name] = ["--generations", w / d / "generations.jsonl"]
        systems.update({"merge-ta": ["--model", w / f"ta-l{fmt_lam(self.best_lam['merge-ta'])}"],
                        "merge-dare": ["--model", w / f"dare-l{fmt_lam(self.best_lam['merge-dare'])}"],
                        "sft-union": ["--model", w / "union"]})
        # a merge's file names its lambda: a later run with another best lambda does not reuse a stale evaluation
        keys = {m: f"{m}-l{fmt_lam(self.best_lam[m])}" for m in ("merge-ta", "merge-dare")}
        evals = self.evals
        for name, sel in systems.items():
            if name.startswith(("seq-select", "token-select")) and not Path(sel[1]).exists():
                continue
            ev = self.evaluate(name, sel, key=keys.get(name))
            if ev is not None:
                evals[name] = ev
        # seq-select's oracle scorer keeps the row's domain expert's greedy answer: its accuracy is each expert's on
        # its own domain (from their evaluations above; no joint row has a domain expert)
        doms = self.doms
        if all(f"expert:{d}" in evals for d in doms):
            evals["seq-select:oracle"] = {
                "domains": {d: {k: v for k, v in evals[f"expert:{d}"]["domains"][d].items() if k != "expert_share"}
                            for d in doms},
                "items": [x for d in doms for x in evals[f"expert:{d}"]["items"] if x["domain"] == d]}
        systems["seq-select:oracle"] = []
        order = [k for k in systems if k != "seq-select:oracle"]
        order.insert(order.index("seq-select:verifier") + 1, "seq-select:oracle")
        self.systems = {k: systems.get(k, []) for k in order if k in evals}

    def stage2(self) -> None:
        """Stage 2 (CDPO) from the seed's stage-1 router, compared on the same items."""
        a, w = self.args, self.work
        if not a.cdpo or not ((w / "eval-fusion+cdpo.json").exists()
                              or (not a.report_only and self.time_left("stage 2 (CDPO)"))):
            return
        if not (w / "fr-cdpo").exists():
            if not (w / "prefs.jsonl").exists():
                self.step(self.g + ["route", "make-prefs", "--router", w / "fr", "--data", self.router_data, "-o",
                                    w / "prefs.jsonl", "--limit", str(a.prefs_limit), "--max-new-tokens",
                                    str(a.max_new_tokens), "--batch-size", "16"])
            self.step(self.g + ["route", "train", w / "fr-cdpo", "--stage", "cdpo", "--init", w / "fr", "--data",
                                w / "prefs.jsonl", "--lr", "1e-5", "--batch-size", "4"])
        self.systems["fusion+cdpo"] = ["--router", w / "fr-cdpo", "--mode", "fusion"]
        self.evals["fusion+cdpo"] = self.evaluate("fusion+cdpo", self.systems["fusion+cdpo"])

    def extra_seed_runs(self) -> None:
        """Extra seeds for the router and sft-union (same data, experts and items)."""
        a, w = self.args, self.work
        self.seed_evals = {k: ({a.seed: self.evals[k]} if k in self.evals else {}) for k in SEED_SYSTEMS}
        self.done_seeds = []
        for s in self.extra_seeds:
            sx = self.sfx(s)
            if not all((w / f"eval-{n}{sx}.json").exists() for n in SEED_SYSTEMS) \
                    and (a.report_only or not self.time_left(f"seed {s}")):
                continue
            self.done_seeds.append(s)
            self.train_router_union(s)
            gs = ["--seed", str(s)]
            fr_s = w / f"fr{sx}"
            self.seed_evals["fusion"][s] = self.evaluate(f"fusion{sx}", ["--router", fr_s, "--mode", "fusion"], gs=gs)
            self.seed_evals["route-only"][s] = self.evaluate(f"route-only{sx}", ["--router", fr_s, "--mode", "route-only"],
                                                             gs=gs)
            self.seed_evals["sft-union"][s] = self.evaluate(f"sft-union{sx}", ["--model", w / f"union{sx}"], gs=gs)

    def routing(self) -> None:
        """Routing quality on held-out gold sequences (in-process): single-domain test rows, and the joint rows."""
        from llmtool.core.job import apply_threads
        from llmtool.route.analysis import routing_quality
        from llmtool.route.router import load_router
        from llmtool.route.vocab import VocabView

        doms = self.doms
        apply_threads(self.args.threads)
        router, tok, models, meta = load_router(self.work / "fr")
        vv = VocabView(meta.vocab_size_used, meta.n_tokens)
        self.rq = routing_quality(router, models, vv, tok, self.test_rows, {d: i for i, d in enumerate(doms)},
                                  template=self.args.template)
        self.rq_joint = None
        if self.joint_rows:
            # on joint there is no "matching" expert: the rate below is the share of informative positions routed
            # to expert 0 (doms[0])
            q = routing_quality(router, models, vv, tok, self.joint_rows, {"joint": 0}, template=self.args.template)
            self.rq_joint = {"informative_fraction": q["informative_fraction"],
                             "informative_positions": q["informative_positions"], "positions": q["positions"],
                             f"share_routed_to_{doms[0]}": q["matching_expert_rate"]}

    # ------------------------------------------------------------------ results
    def seed_summary(self) -> dict:
        """Per-seed accuracy, mean and sd over seeds, paired gaps per seed and pooled over seeds."""
        doms, cols, joint = self.doms, self.cols, bool(self.joint_rows)
        seeds_all = [self.args.seed] + self.done_seeds
        per_seed = {k: {str(s): {d: v[s]["domains"][d]["accuracy"] for d in cols} for s in seeds_all if s in v}
                    for k, v in self.seed_evals.items()}
        out: dict = {"seeds": seeds_all, "per_seed": per_seed, "mean": {}, "sd": {}, "per_seed_gaps": {}}
        for k, v in per_seed.items():
            if not v:
                continue
            ms = [sum(a[d] for d in doms) / len(doms) for a in v.values()]
            out["mean"][k] = round(sum(ms) / len(ms), 4)
            out["sd"][k] = round(math.sqrt(sum((m - sum(ms) / len(ms)) ** 2 for m in ms) / max(1, len(ms) - 1)), 4)
            if joint:
                js = [a["joint"] for a in v.values()]
                out["mean"][k + " (joint)"] = round(sum(js) / len(js), 4)
        se = self.seed_evals
        for other in ("route-only", "sft-union"):
            key = f"fusion_minus_{other.replace('-', '_')}"
            if not se["fusion"] or not se[other]:
                continue
            out["per_seed_gaps"][key] = {str(s): mean_gap_ci(items_of(se["fusion"][s], doms), items_of(se[other][s], doms))
                                         for s in seeds_all if s in se["fusion"] and s in se[other]}
            out[key] = pooled_gap_ci([items_of(e, doms) for e in se["fusion"].values()],
                                     [items_of(e, doms) for e in se[other].values()])
            if joint:
                out[key + "_joint"] = pooled_gap_ci([items_of(e, ["joint"]) for e in se["fusion"].values()],
                                                    [items_of(e, ["joint"]) for e in se[other].values()])
        return out

    def cdpo_summary(self, cdpo_gap: dict | None) -> dict | None:
        if cdpo_gap is None:
            return None
        w, doms, evals = self.work, self.doms, self.evals
        prefs = [json.loads(x) for x in (w / "prefs.jsonl").read_text().splitlines()]
        rep_file = w / "fr-cdpo" / "report.json"
        rep = json.loads(rep_file.read_text()) if rep_file.is_file() else {}
        return {"pairs": len(prefs), "pairs_by_domain": {d: sum(p["domain"] == d for p in prefs) for d in doms},
                "chosen_from_gold": sum(p["chosen_source"] == "gold" for p in prefs),
                "paired_gap_vs_stage1": cdpo_gap,
                "paired_gap_vs_stage1_joint": (mean_gap_ci(items_of(evals["fusion+cdpo"], ["joint"]),
                                                           items_of(evals["fusion"], ["joint"]))
                                               if self.joint_rows else None),
                "train_report": {k: v for k, v in rep.items() if not isinstance(v, (list, dict))}}

    def results(self) -> dict:
        """Accuracy tables, gates, gaps, seeds, stage 2 and cost as the results JSON."""
        from llmtool.route.tasks import correct

        a, doms, cols, evals, joint_rows = self.args, self.doms, self.cols, self.evals, self.joint_rows
        acc = {n: {d: e["domains"][d]["accuracy"] for d in cols if d in e["domains"]} for n, e in evals.items()}
        ci = {n: {d: e["domains"][d]["ci95"] for d in cols if d in e["domains"]} for n, e in evals.items()}
        mean = {n: sum(v[d] for d in doms) / len(doms) for n, v in acc.items()}
        expert_names = [f"expert:{d}" for d in doms]
        try:
            gates = route_gates(acc, mean, self.rq, doms)
        except KeyError as e:
            gates = [gate("the issue's route gates", False, precondition=False,
                          reason=f"system {e} was not evaluated in the time available")]
        # the generation baselines' gate covers every scorer / value now
        sel_names = ["seq-select", "seq-select:verifier", "token-select", "token-select:confidence"]
        gates = [x for x in gates if not x["gate"].startswith("FusionRoute mean >= token-select")]
        gates.append(gate("FusionRoute mean >= every seq-select (judge, verifier) and token-select (implicit, confidence) mean",
                          lambda: all(mean["fusion"] >= mean[k] for k in sel_names),
                          {k: round(mean[k], 4) for k in ["fusion"] + sel_names if k in mean},
                          precondition=all(k in mean for k in ["fusion"] + sel_names),
                          reason="not every system was evaluated in the time available"))
        both = "fusion" in evals and "route-only" in evals
        gap = (mean_gap_ci(items_of(evals["fusion"], doms), items_of(evals["route-only"], doms)) if both
               else {"mean_gap_points": None, "ci95_points": [None, None], "n": 0})
        gap_joint = (mean_gap_ci(items_of(evals["fusion"], ["joint"]), items_of(evals["route-only"], ["joint"]))
                     if joint_rows and both else None)
        # joint: the oracle of sequence selection ("either expert's answer is correct"), from the judge run's candidates
        seq_any_joint = None
        if joint_rows:
            gens = (self.work / "seq" / "generations.jsonl").read_text().splitlines()
            cands = {r["id"]: r.get("candidates") for r in map(json.loads, gens)}
            ok = [any(correct(r, c) for c in (cands.get(r["id"]) or [])) for r in joint_rows]
            seq_any_joint = {"correct": sum(ok), "n": len(ok), "accuracy": round(sum(ok) / len(ok), 4)}
        seeds = self.seed_summary()
        cdpo_gap = (mean_gap_ci(items_of(evals["fusion+cdpo"], doms), items_of(evals["fusion"], doms))
                    if "fusion+cdpo" in evals else None)
        gates += extra_gates(acc, mean, seeds if len(seeds["seeds"]) > 1 else {}, doms, bool(joint_rows), cdpo_gap)
        tps = {n: evals[n].get("tokens_per_s") for n in evals}
        e0 = expert_names[0]
        cost = {"fusion_tokens_per_s": tps.get("fusion"), "single_expert_tokens_per_s": tps.get(e0),
                "ratio_fusion_over_expert": (round(tps["fusion"] / tps[e0], 3) if tps.get("fusion") and tps.get(e0)
                                             else None),
                "peak_rss_mib": self.mem,
                "scaling": "memory = router + n experts resident (n+1 models); compute per token = router + the selected "
                           "expert (plus catch-up prefill when the route switches); experts could sit behind "
                           "OpenAI-compatible endpoints only if those return full next-token log-probs over the vocabulary"}
        share_names = ["fusion", "route-only", "token-select", "token-select:confidence", "seq-select",
                       "seq-select:verifier"] + (["fusion+cdpo"] if "fusion+cdpo" in evals else [])
        return {"config": {**vars(a), "work": "$W"}, "work": "(temp dir)", "sizes": {
                    "train_per_domain": a.train, "test_per_domain": a.test, "joint": len(joint_rows),
                    "joint_dropped_overlap_with_math_train": self.joint_dropped,
                    "val": sum(1 for _ in self.val.read_text().splitlines()) if a.val else 0,
                    "expert_rows": {d: sum(r["domain"] == d for r in self.rows) for d in doms},
                    "router_rows": self.n_router, "router_steps": self.router_steps, "union_steps": a.union_max_steps},
                "accuracy": acc, "ci95": ci, "mean_accuracy": mean, "mean_over": doms,
                "best_expert": max(expert_names, key=lambda n: mean[n]), "fusion_minus_route_only": gap,
                "fusion_minus_route_only_joint": gap_joint, "routing_quality": self.rq,
                "routing_quality_joint": self.rq_joint,
                "expert_share": {n: {d: evals[n]["domains"][d].get("expert_share") for d in cols
                                     if d in evals[n]["domains"]} for n in share_names if n in evals},
                "merge_sweep_val": self.sweep, "merge_best_lambda": self.best_lam,
                "seq_select_any_correct_joint": seq_any_joint, "seeds": seeds, "cdpo": self.cdpo_summary(cdpo_gap),
                "skipped_for_time": self.skipped, "cost": cost, "gates": gates, "steps": self.log,
                "seconds_total": round(time.time() - self.t_start, 1)}


def report_markdown(res: dict, systems: list[str], evals: dict, note: str = "") -> list[str]:
    """The results JSON as the markdown report: accuracy table, gaps, routing, merge sweep, seeds, stage 2, cost,
    gates and the commands."""
    from llmtool.core.console import markdown_table

    cfg, sz, doms = res["config"], res["sizes"], res["mean_over"]
    acc, ci, mean, seeds = res["accuracy"], res["ci95"], res["mean_accuracy"], res["seeds"]
    joint = sz["joint"] > 0
    cols = doms + (["joint"] if joint else [])
    best_lam, sweep = res["merge_best_lambda"], res["merge_sweep_val"]
    labels = {"merge-ta": f"merge-ta (λ={fmt_lam(best_lam['merge-ta'])}, best on val)",
              "merge-dare": f"merge-dare (λ={fmt_lam(best_lam['merge-dare'])}, best on val)", **GEN_LABELS}
    table = []
    for n in systems:
        row = {"system": labels.get(n, n)}
        for d in cols:
            if d in acc[n]:
                lo, hi = ci[n][d]
                row[d] = f"{100 * acc[n][d]:.1f} [{100 * lo:.0f}, {100 * hi:.0f}]"
            else:
                row[d] = "-"
        row[f"mean ({'+'.join(doms)})"] = f"{100 * mean[n]:.1f}"
        if joint:
            sh = evals[n]["domains"].get("joint", {}).get("expert_share")
            row["joint expert share"] = (", ".join(f"{k} {v:.2f}" for k, v in sh.items()) if sh else "-")
        tps = evals[n].get("tokens_per_s")
        row["tok/s"] = tps if tps is not None else "-"
        table.append(row)
    lams = [float(x) for x in cfg["lams"].split(",") if x.strip()]
    sweep_rows = [{"lambda": fmt_lam(x), **{m: (f"{100 * sweep[m][fmt_lam(x)]:.1f}" if fmt_lam(x) in sweep[m] else "-")
                                              for m in sweep}} for x in lams] if cfg["val"] else []
    seed_rows = [{"system": k, "seed": s, **{d: f"{100 * a[d]:.1f}" for d in cols},
                  "mean": f"{100 * sum(a[d] for d in doms) / len(doms):.1f}"}
                 for k, v in seeds["per_seed"].items() for s, a in v.items()]
    gap, gap_joint, rq, rq_joint = (res["fusion_minus_route_only"], res["fusion_minus_route_only_joint"],
                                    res["routing_quality"], res["routing_quality_joint"])
    union_steps = sz["union_steps"]
    md = [f"# route benchmark ({cfg['model']}, domains {', '.join(doms)}, {cfg['train']} train / {cfg['test']} test per "
          f"domain + {sz['joint']} joint, template {cfg['template']}, greedy, data/expert seed {cfg['seed']})", "",
          f"Experts: {json.dumps(sz['expert_rows'])} training rows (batch {cfg['batch_size']}); "
          f"router: {sz['router_rows']} rows, {sz['router_steps']} steps; sft-union: the router's rows, "
          f"{union_steps if union_steps > 0 else sz['router_steps']} steps; merge λ picked on {sz['val']} validation "
          f"rows (another data seed, no train/test prompt); joint: {sz['joint']} rows "
          f"({sz['joint_dropped_overlap_with_math_train']} dropped whose arithmetic is a math training question).", "",
          ] + ([note, ""] if note else []) + (
          [f"Not run for time: {', '.join(res['skipped_for_time'])}.", ""] if res["skipped_for_time"] else []) + [
          "Accuracy % per domain with Wilson 95 % interval (mean over the trained domains; joint is report-only):", "",
          markdown_table(table), "",
          f"FusionRoute − route-only (paired, points, {'+'.join(doms)}): {fmt_gap(gap)} over {gap['n']} items"
          + (f"; on joint: {fmt_gap(gap_joint)} over {gap_joint['n']} items." if gap_joint else "."), ""]
    sa = res["seq_select_any_correct_joint"]
    if sa:
        md += [f"Sequence selection's ceiling on joint (either expert's answer correct): {sa['correct']}/{sa['n']}.", ""]
    md += [f"Routing quality (held-out gold sequences, {'+'.join(doms)}): matching expert on {rq['matching_expert_rate']} "
           f"of informative positions; informative fraction {rq['informative_fraction']:.3f}."
           + (f" On joint gold answers: informative fraction {rq_joint['informative_fraction']:.3f}, share of informative "
              f"positions routed to {doms[0]} {rq_joint[f'share_routed_to_{doms[0]}']}." if rq_joint else ""), ""]
    if sweep_rows:
        md += ["Merge λ sweep (validation mean accuracy %, " + "+".join(doms) + "):", "", markdown_table(sweep_rows), ""]
    if len(seeds["seeds"]) > 1:
        md += [f"Seeds (router and sft-union seeds {', '.join(map(str, seeds['seeds']))}; data, experts and items "
               "fixed):", "", markdown_table(seed_rows), ""]
        for key in [k for k in ("fusion_minus_route_only", "fusion_minus_sft_union") if k in seeds]:
            md.append(f"- {key.replace('_', ' ')} (paired over items, per-item correctness averaged over seeds): "
                      f"{fmt_gap(seeds[key])} points" + (f"; joint {fmt_gap(seeds[key + '_joint'])}" if joint else "")
                      + "; per seed: " + ", ".join(f"{s}: {fmt_gap(x)}" for s, x in seeds["per_seed_gaps"][key].items()))
        md.append("")
    c = res["cdpo"]
    if c:
        md += [f"Stage 2 (CDPO, {c['pairs']} preference pairs {json.dumps(c['pairs_by_domain'])}, "
               f"{c['chosen_from_gold']} with the gold answer as chosen) − stage 1 (paired, same items): "
               f"{fmt_gap(c['paired_gap_vs_stage1'])} points"
               + (f"; joint {fmt_gap(c['paired_gap_vs_stage1_joint'])}" if joint else "") + ".", ""]
    cost = res["cost"]
    md += [f"Cost: fusion {cost['fusion_tokens_per_s']} tok/s vs single expert {cost['single_expert_tokens_per_s']} tok/s "
           f"(ratio {cost['ratio_fusion_over_expert']}); peak RSS MiB per eval process: {json.dumps(cost['peak_rss_mib'])}",
           "", "Gates:", "", markdown_table(gate_rows(res["gates"])), "", "Commands:", "", "```"] \
        + [s["cmd"] for s in res["steps"]] + ["```", ""]
    return md


def plot_accuracy(res: dict, systems: list[str], path: Path) -> None:
    """Bar chart of accuracy per domain and system (optional: skipped with a message when matplotlib fails)."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        acc, doms, best_lam = res["accuracy"], res["mean_over"], res["merge_best_lambda"]
        cols = doms + (["joint"] if res["sizes"]["joint"] else [])
        labels = {"merge-ta": f"merge-ta (λ={fmt_lam(best_lam['merge-ta'])}, best on val)",
                  "merge-dare": f"merge-dare (λ={fmt_lam(best_lam['merge-dare'])}, best on val)", **GEN_LABELS}
        fig, ax = plt.subplots(figsize=(12, 4))
        width = 0.8 / len(cols)
        for j, d in enumerate(cols):
            ax.bar([i + j * width for i in range(len(systems))], [100 * acc[n].get(d, 0) for n in systems], width,
                   label=d)
        ax.set_xticks([i + width * (len(cols) - 1) / 2 for i in range(len(systems))])
        ax.set_xticklabels([labels.get(n, n) for n in systems], rotation=35, ha="right", fontsize=7)
        ax.set_ylabel("accuracy %")
        ax.legend()
        ax.set_title("llmtool route: accuracy per domain")
        fig.tight_layout()
        fig.savefig(path, dpi=110)
    except Exception as e:  # the plot is optional
        print(f"plot skipped: {e}", file=sys.stderr)


def main() -> None:
    args = build_parser().parse_args()
    if args.regate:
        regate(args.tag)
        return
    b = RouteBench(args)
    b.prepare_data()
    b.make_experts()
    b.train_router_union(args.seed)
    b.merge_sweep()
    b.generation_baselines()
    b.evaluate_systems()
    b.stage2()
    b.extra_seed_runs()
    b.routing()
    res = b.results()
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(res, indent=2, default=str))
    md = report_markdown(res, list(b.systems), b.evals, args.note)
    (RESULTS / f"{args.tag}.md").write_text("\n".join(md))
    plot_accuracy(res, list(b.systems), RESULTS / f"{args.tag}.png")
    print("\n".join(md))


if __name__ == "__main__":
    main()

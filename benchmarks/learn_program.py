"""Benchmark for `llmtool learn-program` (LLM-PV, issue 12): classical baselines on the 13 tasks, the default
model as a program proposer, a weak-proposer sanity suite, replayed correct programs (the pipeline given a
strong proposer) and the sandbox's hostile-program suite.

    .venv/bin/python benchmarks/learn_program.py                  # CPU default (reductions in the .md header)
    .venv/bin/python benchmarks/learn_program.py --k 64 --max-new-tokens 512 --transformer-seeds 5
                                                                  # the issue's proposer protocol (hours on a CPU)

Parts (``--parts``, comma list; a part not run keeps its previous results in the JSON):

* ``classical``: XGBoost, random forest, logistic regression and an MLP on every task at L = 100, 100 train
  + 100 val + 10,000 test (XGBoost, RF and logreg fit on train + val, the MLP stops early on val: spec
  §4), ``--seeds`` data/model seeds; the small SGD-trained transformer on
  ``--transformer-tasks`` with ``--transformer-seeds``. Train accuracy beside test. Gates: XGBoost and RF
  test accuracy in [45, 55] % on the parity family, Dyck-2, CA parity and SHA-256 parity; XGBoost >= 70 %
  on palindrome.
* ``proposer``: ``hf:MODEL`` (``--model``, default smollm2-135m) proposes ``--k`` programs per task for
  full parity, pattern 1, palindrome and is-prime at L = 20 (``--proposer-tasks``: other tasks, ``all`` for
  the 13; a run on some tasks keeps the stored rows of the others); parse/compile rates, best validation, the selected program's test
  accuracy, proposals/s and sandbox executions/s, and the first 10 raw proposals of each task (text,
  outcome, val accuracy, error) so that "no valid program" can be audited. No accuracy gate.
* ``sanity``: the same proposer on four one-line rules (first bit 1, last bit 1, majority of ones, contains
  "11") at L = 20, given as user data in the ``input -> label`` format: pass@k (a proposal reaching val 1.0)
  with a Wilson interval over the four rules, and the gate "val 1.0 => test >= 0.99" (``not tested``
  when no rule reaches val 1.0: the gate is about the selected programs, and there are none). The first
  10 raw proposals per rule are kept as in ``proposer``.
* ``replay``: a replay proposer with written-out correct programs (one wrong proposal first) for the 10
  solvable tasks: test accuracy at L = 100 and, trained at L = 10, at test length 100.
* ``sandbox``: every hostile program of spec §8.3 run through ``core/sandbox.py``; each must be blocked.
* ``icl``: in-context learning with the same local model at L = 100 on ``--icl-tasks`` (default all 13),
  ``--icl-queries`` test inputs each (paper: 100), with a Wilson interval; the prompt holds as many of the
  100 training examples as fit the model's context (SmolLM2: 76 binary ones, 12 graph ones).

``--tasks`` runs the classical part on some tasks only and keeps the other tasks' rows, so for example the
prime tasks can be rerun at ``--prime-test 10000`` alone; the ``icl`` part likewise keeps the rows of tasks
it did not run. Each part's command is recorded, and the reductions against the issue's protocol are read
from the stored results.

Writes benchmarks/results/learn_program.{json,md,png}; with another ``--model`` the default results stem is
``learn_program-<model>`` (e.g. ``learn_program-qwen2-5-coder-0-5b``), so the SmolLM2 results are kept.
"""
from __future__ import annotations

import argparse
import json
import os
import shlex
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = ROOT / "benchmarks" / "results"
RAW_KEPT = 10  # raw proposals kept per task in the results, so "no valid program" can be audited

from benchmarks.gates import gate, lines as gate_lines, render  # noqa: E402
from benchmarks.stems import model_stem  # noqa: E402

DEFAULT_MODEL = "smollm2-135m"
PARITY_LIKE = ["parity_all", "parity_first_half", "parity_rand_3", "parity_rand_10", "dyck2", "automata_parity",
               "sha256_parity"]
PRIME_TASKS = ["prime_decimal", "prime_plus_47"]
PROPOSER_TASKS = ["parity_all", "patternmatch1", "palindrome", "prime_decimal"]
SANITY_RULES = {
    "first_bit_1": lambda x: int(x[0] == "1"),
    "last_bit_1": lambda x: int(x[-1] == "1"),
    "majority_ones": lambda x: int(x.count("1") > len(x) // 2),
    "contains_11": lambda x: int("11" in x),
}


def results_stem(model: str) -> Path:
    """The default results stem of a proposer/ICL model (``benchmarks/stems.py``): the SmolLM2 results keep their
    name, any other model gets its own."""
    return RESULTS / model_stem("learn_program", model, DEFAULT_MODEL)


def wilson(k: int, n: int) -> list[float]:
    from llmtool.core.intervals import wilson as wilson_interval

    return [round(v, 4) for v in wilson_interval(k, n)]


def mean_sd(xs: list[float]) -> list[float]:
    return [statistics.fmean(xs), statistics.stdev(xs) if len(xs) > 1 else 0.0]


# ------------------------------------------------------------------------------------------ parts
def part_classical(a, log) -> dict:
    from llmtool.learn_program.baselines import BASELINES, run_baseline
    from llmtool.learn_program.tasks import TASKS, generate

    out: dict = {"length": 100, "sizes": [100, 100, 10_000], "seeds": a.seeds, "prime_test": a.prime_test, "rows": []}
    methods = [m for m in a.methods.split(",") if m]
    for task in _task_list(a.tasks, TASKS):
        for seed in range(a.seeds):
            n_test = a.prime_test if task.startswith("prime") else 10_000
            ds = generate(task, 100, 100, 100, n_test, seed=42 + seed)
            for m in methods:
                t0 = time.time()
                r = run_baseline(BASELINES.build(m), ds, seed=seed)
                out["rows"].append({"task": task, "method": m, "seed": seed, "fit_on": r.get("fit_on"),
                                    "train_acc": r.get("train_acc"), "test_acc": r.get("test_acc"),
                                    "seconds": round(time.time() - t0, 2)})
        log(f"classical: {task} done")
    for task in a.transformer_tasks.split(","):
        if not task:
            continue
        for seed in range(a.transformer_first_seed, a.transformer_first_seed + a.transformer_seeds):
            ds = generate(task, 100, 100, 100, 10_000, seed=42 + seed)
            t0 = time.time()
            r = run_baseline(BASELINES.build("transformer", epochs=a.transformer_epochs), ds, seed=seed)
            out["rows"].append({"task": task, "method": "transformer", "seed": seed, "train_acc": r.get("train_acc"),
                                "test_acc": r.get("test_acc"), "seconds": round(time.time() - t0, 2)})
            log(f"transformer: {task} seed {seed}: test {r.get('test_acc')}")
    return out


def _task_list(arg: str, known) -> list[str]:
    tasks = [t for t in arg.split(",") if t] or list(known)
    bad = [t for t in tasks if t not in known]
    if bad:
        raise SystemExit(f"error: unknown task(s) {bad}; known: {', '.join(known)}")
    return tasks


def merge_rows(prev: list[dict], new: list[dict], keys=("task", "method")) -> list[dict]:
    """``new`` rows plus the previous rows of every ``keys`` tuple (say task and method) that this run did not
    measure, so a run on a few tasks (or, keyed by seed too, a few seeds) refreshes those and keeps the rest."""
    done = {tuple(r.get(k) for k in keys) for r in new}
    return [r for r in prev if tuple(r.get(k) for k in keys) not in done] + new


def part_icl(a, log) -> dict:
    """In-context learning with the same local model: the training examples (as many as fit its context) in
    the prompt, then each of ``--icl-queries`` test inputs at L = 100, scored by the two answers' NLL."""
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.learn_program.baselines import BASELINES, run_baseline
    from llmtool.learn_program.tasks import TASKS, generate

    model, tok = load_model(a.model), load_tokenizer(a.model)
    rows = []
    for task in _task_list(a.icl_tasks, TASKS):
        ds = generate(task, 100, 100, 100, max(a.icl_queries, 2) + max(a.icl_queries, 2) % 2, seed=42)
        t0 = time.time()
        r = run_baseline(BASELINES.build("icl", queries=a.icl_queries, val_queries=0), ds, model=model,
                         tokenizer=tok, seed=0)
        k, n = round(r["test_acc"] * r["test_queries"]), r["test_queries"]
        rows.append({"task": task, "method": "icl", "seed": 0, "test_acc": r["test_acc"], "queries": n,
                     "ci95": wilson(k, n), "train_in_prompt": r["train_in_prompt"],
                     "seconds": round(time.time() - t0, 1)})
        log(f"icl: {task}: test {r['test_acc']:.2f} ({n} queries, {r['train_in_prompt']} examples in the prompt)")
    return {"model": a.model, "length": 100, "queries": a.icl_queries, "rows": rows}


def _proposer(a):
    from llmtool.learn_program.proposers import HFProposer

    if not a.dtype:
        return HFProposer(a.model, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size)
    from llmtool.core.models import load_model, load_tokenizer

    return HFProposer(a.model, max_new_tokens=a.max_new_tokens, batch_size=a.batch_size,
                      model_obj=load_model(a.model, dtype=a.dtype), tokenizer=load_tokenizer(a.model))


def _run(ds, proposer, a, out_dir: Path) -> dict:
    from llmtool.learn_program.pipeline import LLMPVConfig, run_llmpv

    out_dir.mkdir(parents=True, exist_ok=True)
    s = run_llmpv(ds, proposer, LLMPVConfig(samples=a.k, early_stop=False, timeout_s=5.0, seed=a.seed), out_dir)
    s["raw_proposals"] = raw_proposals(out_dir / "candidates.jsonl")
    sel = out_dir / "selected.py"  # the selected program's source, so a val-1.0 result can be read, not only counted
    s["selected_code"] = sel.read_text(encoding="utf-8") if sel.is_file() else None
    return s


def raw_proposals(path: Path, n: int = RAW_KEPT) -> list[dict]:
    """The first ``n`` proposals of a run as the model wrote them, with what became of each."""
    out = []
    if path.is_file():
        for line in path.read_text(encoding="utf-8").splitlines()[:n]:
            c = json.loads(line)
            out.append({"idx": c.get("idx"), "outcome": c.get("outcome"), "val_acc": c.get("val_acc"),
                        "error": c.get("error"), "raw_text": c.get("raw_text")})
    return out


KEYS = ("outcomes", "parse_rate", "compile_rate", "best_val", "train_acc", "test_acc", "k_used", "proposals_per_s",
        "sandbox_executions_per_s", "tokens", "seconds", "raw_proposals", "selected_code")


def part_proposer(a, log, work: Path) -> dict:
    from llmtool.learn_program.tasks import TASKS, generate

    prop, rows = _proposer(a), []
    tasks = list(TASKS) if a.proposer_tasks == "all" else _task_list(a.proposer_tasks or ",".join(PROPOSER_TASKS),
                                                                         TASKS)
    for task in tasks:
        # palindromes of length 20 are only 2**10 = 1,024 strings: a 2,000-input balanced test split would need
        # 1,000 of them unseen, so that task gets 500 test inputs.
        ds = generate(task, 20, 100, 100, 500 if task == "palindrome" else 2_000, seed=42)
        s = _run(ds, prop, a, work / "proposer" / task)
        rows.append({"task": task, "k": a.k, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype or "checkpoint", **{k: s.get(k) for k in KEYS}})
        log(f"proposer: {task}: parse {s['parse_rate']:.2f} compile {s['compile_rate']:.2f} best val {s['best_val']}")
    return {"model": a.model, "k": a.k, "length": 20, "max_new_tokens": a.max_new_tokens,
            "dtype": a.dtype or "checkpoint", "rows": rows}


def sanity_dataset(rule: str, seed: int):
    """Balanced, unique L = 20 splits (100/100/2,000) of a one-line rule, as user data."""
    import random

    from llmtool.learn_program.tasks import Dataset

    f, rng, seen, rows = SANITY_RULES[rule], random.Random(f"{rule}:{seed}"), set(), {0: [], 1: []}
    need = {0: 1_100, 1: 1_100}
    while any(len(rows[c]) < need[c] for c in (0, 1)):
        x = "".join(rng.choice("01") for _ in range(20))
        if x in seen:
            continue
        y = f(x)
        if len(rows[y]) < need[y]:
            seen.add(x)
            rows[y].append((x, y))
    zeros, ones = rows[0], rows[1]  # 50/50 in every split

    def take(lo, hi):
        part = zeros[lo:hi] + ones[lo:hi]
        rng.shuffle(part)
        return part

    return Dataset(train=take(0, 50), val=take(50, 100), test=take(100, 1_100),
                   meta={"task": None, "rule": rule, "length": 20, "kind": "binary"})


def part_sanity(a, log, work: Path) -> dict:
    from llmtool.learn_program.tasks import read_dataset, write_dataset

    prop, rows = _proposer(a), []
    for rule in _task_list(a.sanity_rules, SANITY_RULES) if a.sanity_rules else SANITY_RULES:
        d = work / "sanity-data" / rule
        d.mkdir(parents=True, exist_ok=True)
        write_dataset(sanity_dataset(rule, a.seed), d)  # the user-data path: written, then read back
        ds = read_dataset(d)
        s = _run(ds, prop, a, work / "sanity" / rule)
        hit = (s.get("best_val") or 0) >= 1.0
        rows.append({"rule": rule, "k": a.k, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype or "checkpoint",
                     "pass_at_k": hit,
                     **{k: s.get(k) for k in KEYS}})
        log(f"sanity: {rule}: best val {s['best_val']} test {s['test_acc']}")
    return {"model": a.model, "k": a.k, "max_new_tokens": a.max_new_tokens, "dtype": a.dtype or "checkpoint",
            "rows": rows}  # pass@k and the gate: main adds them over the (merged) rows, as for the proposer part


def sanity_gate(rows: list[dict]) -> dict:
    """"val 1.0 => selected test >= 0.99": tested only when some rule reached val 1.0 (an empty set of
    perfect-val rules passes any "all" trivially)."""
    perfect = [r for r in rows if r.get("pass_at_k")]
    return gate("val 1.0 => selected test >= 0.99", lambda: all((r["test_acc"] or 0) >= 0.99 for r in perfect),
                {r.get("rule") or r.get("task"): r.get("test_acc") for r in perfect},
                precondition=bool(perfect), reason="no rule reached val = 1.0, so no selected program to test")


def proposer_summary(rows: list[dict]) -> dict:
    """pass@k over the proposer part's tasks or the sanity part's rules (a proposal reaching val 1.0), its Wilson
    interval, and the gate "val 1.0 => selected test >= 0.99" over them."""
    marked = [{**r, "pass_at_k": (r.get("best_val") or 0) >= 1.0} for r in rows]
    hits = sum(r["pass_at_k"] for r in marked)
    return {"pass_at_k": hits / len(rows) if rows else None, "pass_at_k_ci95": wilson(hits, len(rows)),
            "n_val_perfect": hits, "gate_val1_implies_test_ge_0.99": sanity_gate(marked)}


def sanity_gate_of(p: dict) -> dict:
    """The sanity gate of a stored result (results written before the gate record existed are re-judged
    from their rows)."""
    g = p.get("gate_val1_implies_test_ge_0.99")
    return g if isinstance(g, dict) else sanity_gate(p["rows"])


def part_replay(a, log, work: Path) -> dict:
    from llmtool.learn_program.pipeline import LLMPVConfig, run_llmpv
    from llmtool.learn_program.proposers import ReplayProposer
    from llmtool.learn_program.reference_programs import replay_lines
    from llmtool.learn_program.tasks import SOLVABLE, generate

    rows = []
    for task in SOLVABLE:
        rec = {"task": task}
        for role in ("L100", "short"):
            if role == "short" and task.startswith("parity_rand_"):
                rec["train_short_test100"] = ("n/a: the k positions are drawn per input length, so the L = 10 "
                                              "and L = 100 rules differ by construction")
                continue
            lengths = (100,) if role == "L100" else (10, 12, 14, 16)
            for train_len in lengths:  # the shortest length whose input space holds 100 + 100 unique inputs
                try:
                    ds = generate(task, train_len, 100, 100, 10_000 if role == "L100" else 0, seed=42)
                    break
                except Exception as e:  # noqa: BLE001 - too small an input space at this length
                    err = str(e)
            else:
                rec[f"{role}_error"] = err
                continue
            f = work / "replay" / f"{task}-{train_len}.jsonl"
            f.parent.mkdir(parents=True, exist_ok=True)
            f.write_text("\n".join(replay_lines(task, train_len)) + "\n")
            cfg = LLMPVConfig(samples=2, early_stop=False, timeout_s=20.0, seed=a.seed,
                              test_lengths=(100,) if role == "short" else (), test_size=2_000)
            s = run_llmpv(ds, ReplayProposer(str(f)), cfg)
            if role == "L100":
                rec["test_acc_L100"] = s["test_acc"]
            else:
                rec["train_length"] = train_len
                rec["train_short_test100"] = (s["length_generalization"] or {}).get("100")
        rows.append(rec)
        log(f"replay: {task}: {rec}")
    applicable = [r for r in rows if not str(r.get("train_short_test100", "")).startswith("n/a")]
    ok = [r for r in applicable if r.get("test_acc_L100") == 1.0 and r.get("train_short_test100") == 1.0]
    ok100 = [r for r in rows if r.get("test_acc_L100") == 1.0]
    return {"rows": rows, "n_exact_L100": len(ok100), "n": len(rows), "n_exact_length_gen": len(ok),
            "n_length_gen": len(applicable),
            "all_exact": len(ok100) == len(rows) and len(ok) == len(applicable)}


def part_sandbox(a, log, work: Path) -> dict:
    from llmtool.core.sandbox import sandbox_available
    from llmtool.learn_program.hostile import run_hostile_suite

    recs = run_hostile_suite(work / "hostile")
    blocked = sum(bool(r.get("blocked")) for r in recs)
    log(f"sandbox: {blocked}/{len(recs)} hostile programs blocked")
    prot = sandbox_available()
    prot["python"] = Path(prot["python"]).name          # no machine-local path in the results
    return {"records": _scrub(recs, str(work), "WORK"), "blocked": blocked, "n": len(recs), "protections": prot}


def _scrub(x, path: str, token: str):
    """``x`` with every occurrence of the scratch path ``path`` replaced by ``token`` (strings in nested
    lists and dicts), so the results name no directory of the machine that ran them."""
    if isinstance(x, str):
        return x.replace(path, token)
    if isinstance(x, list):
        return [_scrub(v, path, token) for v in x]
    if isinstance(x, dict):
        return {k: _scrub(v, path, token) for k, v in x.items()}
    return x


# ------------------------------------------------------------------------------------------ report
def reductions(res: dict) -> list[str]:
    """Where the stored results fall short of the issue's protocol, read from the results themselves (parts
    may come from different runs)."""
    red = []
    for part in ("proposer", "sanity"):
        p = res.get(part) or {}
        if p and p.get("k", 64) < 64:
            red.append(f"{part}: k = {p['k']} proposals per task instead of 64")
    n_prop = len({r.get("task") for r in (res.get("proposer") or {}).get("rows", [])})
    if 0 < n_prop < 13:
        red.append(f"proposer on {n_prop} of the 13 tasks")
    mnt = (res.get("proposer") or {}).get("max_new_tokens")
    if mnt:
        red.append(f"at most {mnt} new tokens per proposal")
    c = res.get("classical") or {}
    tf = [r for r in c.get("rows", []) if r["method"] == "transformer"]
    if tf:
        per_task = {t: len({r["seed"] for r in tf if r["task"] == t}) for t in sorted({r["task"] for r in tf})}
        if len(per_task) < 13 or min(per_task.values()) < 5:
            red.append(f"the SGD transformer on {len(per_task)} task(s) (seeds: "
                       + ", ".join(f"{t} {n}" for t, n in per_task.items()) + ")")
    old_fit = [r for r in c.get("rows", []) if r["method"] in ("xgboost", "random-forest", "logreg")
               and r.get("fit_on") != "train+val"]
    if old_fit:
        red.append(f"{', '.join(sorted({r['method'] for r in old_fit}))} rows of "
                   f"{', '.join(sorted({r['task'] for r in old_fit}))} fitted on train only (measured before the "
                   "spec's train + val fit; rerun `--parts classical` on those tasks)")
    for part in ("proposer", "sanity"):
        rows = (res.get(part) or {}).get("rows", [])
        if rows and not all(r.get("raw_proposals") for r in rows):
            red.append(f"{part}: raw proposals not kept (results older than the raw-proposal record; rerun "
                       f"`--parts {part}`)")
    if c and c.get("prime_test", 2_000) < 10_000:
        red.append(f"{c.get('prime_test', 2_000):,} test inputs (not 10,000) for {' and '.join(PRIME_TASKS)}")
    icl = res.get("icl") or {}
    n_icl = len({r["task"] for r in icl.get("rows", [])})
    if n_icl == 0:
        red.append("in-context learning not run")
    elif n_icl < 13:
        red.append(f"in-context learning on {n_icl} of the 13 tasks" + " (every query costs a forward pass over "
                   "a prompt of ~8,000 tokens with the 135M model)")
    if any(r.get("train_in_prompt", 100) < 100 for r in icl.get("rows", [])):
        red.append("ICL prompts hold only the training examples that fit SmolLM2's 8,192-token context "
                   "(column 'examples')")
    return red


def classical_table(c: dict) -> tuple[list[str], dict]:
    from collections import defaultdict

    agg = defaultdict(lambda: {"train": [], "test": []})
    for r in c["rows"]:
        agg[(r["task"], r["method"])]["train"].append(r["train_acc"])
        agg[(r["task"], r["method"])]["test"].append(r["test_acc"])
    from llmtool.learn_program.tasks import TASKS

    order = ["xgboost", "random-forest", "logreg", "mlp", "transformer"]  # fixed columns: a partial rerun's rows
    methods = sorted(dict.fromkeys(r["method"] for r in c["rows"]),   # come last in the JSON
                     key=lambda m: order.index(m) if m in order else len(order))
    tasks = sorted(dict.fromkeys(r["task"] for r in c["rows"]), key=lambda t: list(TASKS).index(t) if t in TASKS else 99)
    lines = ["| task | " + " | ".join(f"{m} test (train)" for m in methods) + " |", "|---" * (len(methods) + 1) + "|"]
    for t in tasks:
        cells = []
        for m in methods:
            v = agg.get((t, m))
            if not v or not v["test"]:
                cells.append("")
                continue
            te, tr = mean_sd([100 * x for x in v["test"]]), statistics.fmean(100 * x for x in v["train"])
            cells.append(f"{te[0]:.1f} ± {te[1]:.1f} ({tr:.0f}) n={len(v['test'])}")
        lines.append(f"| {t} | " + " | ".join(cells) + " |")
    gates = {}
    for m in ("xgboost", "random-forest"):
        vals = {t: statistics.fmean(agg[(t, m)]["test"]) for t in PARITY_LIKE if agg.get((t, m), {}).get("test")}
        name = f"{m}_in_[45,55]_on_parity_family_dyck2_ca_sha"
        gates[name] = gate(name, lambda vals=vals: all(0.45 <= v <= 0.55 for v in vals.values()),
                           {k: round(v, 4) for k, v in vals.items()}, precondition=bool(vals),
                           reason=f"no {m} rows on the parity family")
    pal = agg.get(("palindrome", "xgboost"), {}).get("test")
    gates["xgboost_palindrome_ge_70"] = gate("xgboost_palindrome_ge_70", lambda: statistics.fmean(pal) >= 0.70,
                                             round(statistics.fmean(pal), 4) if pal else None,
                                             precondition=bool(pal), reason="no xgboost palindrome rows")
    return lines, gates


def how(x: dict) -> str:
    """How a hostile program ended (the sandbox's violation, a timeout or the exit status)."""
    if x.get("violation"):
        text = f"violation: {x['violation']}"
    elif x.get("timed_out"):
        text = "killed at the time limit"
    else:
        text = f"exit {x.get('returncode')}"
    return text if x.get("blocked") else text + f"; ESCAPED: {x.get('escape')}"


def write_md(res: dict, path: Path) -> None:
    L = ["# learn-program benchmark (LLM-PV)", ""]
    cmds = res.get("part_commands") or {}
    if cmds:
        L += ["Commands (a part keeps its results until it is rerun; a partial rerun lists its command after those "
              "whose rows it kept):", ""]
        L += [f"- {part}: " + "; then ".join(f"`{c}`" for c in cmd) for part, cmd in cmds.items()]
        L.append("")
    else:
        L += [f"Command: `{res.get('command', '')}`", ""]
    if res.get("reductions"):
        L += ["**Reductions against the issue's protocol:** " + "; ".join(res["reductions"]), ""]
    c = res.get("classical")
    if c:
        lines, gates = classical_table(c)
        L += ["## Classical baselines (L = 100, 100 train / 100 val / 10,000 test)", "",
              "Test accuracy % mean ± sd over seeds, train accuracy % in brackets. XGBoost, random forest and "
              "logreg fit on train + val (spec §4: no validation use; their train accuracy is over those 200), the "
              "MLP stops early on val and the transformer keeps its best-val epoch (train accuracy over the 100 "
              "train examples).", "", *lines, "",
              "Gates:", ""]
        L += gate_lines(gates)
        L.append("")
    icl = res.get("icl")
    if icl:
        L += [f"## In-context learning: {icl.get('model')}, L = 100", "",
              "The training examples in the prompt (as many of the 100 as fit the context with the longest query), "
              "then one test input; the label whose answer has the lower NLL. Accuracy % with a 95 % Wilson "
              "interval.", "", "| task | test acc % | 95 % CI | queries | examples in prompt | seconds |",
              "|---|---|---|---|---|---|"]
        L += [f"| {r['task']} | {100 * r['test_acc']:.0f} | [{100 * r['ci95'][0]:.0f}, {100 * r['ci95'][1]:.0f}] | "
              f"{r['queries']} | {r['train_in_prompt']} | {r['seconds']:.0f} |" for r in icl["rows"]]
        L.append("")
    for part, title in (("proposer", "Model as proposer (L = 20)"), ("sanity", "Proposer sanity suite (L = 20)")):
        p = res.get(part)
        if not p:
            continue
        L += [f"## {title}: {p.get('model') or res.get('model')}, k = {p.get('k')}", "",
              "| task | k | parse | compile | best val | selected train | selected test | proposals/s | sandbox exec/s |",
              "|---|---|---|---|---|---|---|---|---|"]
        for r in p["rows"]:
            name = r.get("task") or r.get("rule")
            fmt = lambda v, d=3: "" if v is None else (f"{v:.{d}f}" if isinstance(v, float) else str(v))  # noqa: E731
            L.append(f"| {name} | {r.get('k', p.get('k'))} | {fmt(r['parse_rate'], 2)} | {fmt(r['compile_rate'], 2)} | {fmt(r['best_val'])} | "
                     f"{fmt(r['train_acc'])} | {fmt(r['test_acc'])} | {fmt(r['proposals_per_s'], 3)} | "
                     f"{fmt(r['sandbox_executions_per_s'], 0)} |")
        L += ["", "What became of each proposal (count of k): " + "; ".join(
            f"{r.get('task') or r.get('rule')}: " + ", ".join(f"{k} {v}" for k, v in (r.get("outcomes") or {}).items() if v)
            for r in p["rows"]) + ". Predictions must be 0/1 (bool, int or '0'/'1'/'true'/'false'); any other "
            "output counts as wrong for that input, stricter than the official runner, which maps any non-empty "
            "non-numeric output to 1."]
        perfect = [r for r in p["rows"] if (r.get("best_val") or 0) >= 1.0 and r.get("selected_code")]
        if perfect:
            L += ["", "Selected programs with val 1.0: " + "; ".join(
                f"{r.get('task') or r.get('rule')}: `{' '.join(r['selected_code'].split())}`" for r in perfect) + "."]
        if part == "sanity":
            L += ["", f"pass@{p['k']} over the four rules: {p['pass_at_k']:.2f} (95 % CI {p['pass_at_k_ci95']}); "
                  f"gate 'val 1.0 => selected test >= 0.99': {render(sanity_gate_of(p))} "
                  f"({p['n_val_perfect']} rule(s) reached val 1.0)."]
        else:  # pass@k over the tasks run: a proposal reaching val 1.0
            ps = proposer_summary(p["rows"])
            ci = ps["pass_at_k_ci95"]
            L += ["", f"pass@k over the {len(p['rows'])} tasks run (a proposal with val 1.0): {ps['n_val_perfect']}/"
                  f"{len(p['rows'])} (95 % Wilson CI [{ci[0]:.2f}, {ci[1]:.2f}]); gate 'val 1.0 => selected test "
                  f">= 0.99': {render(ps['gate_val1_implies_test_ge_0.99'])}."]
        kept = [(r.get("task") or r.get("rule"), len(r.get("raw_proposals") or [])) for r in p["rows"]]
        if any(n for _, n in kept):
            L += ["", f"The first {RAW_KEPT} raw proposals of each {'rule' if part == 'sanity' else 'task'} are kept "
                  f"in the JSON (`{part}.rows[].raw_proposals`: text, outcome, val accuracy, error) to audit the "
                  "outcomes above."]
        L.append("")
    r = res.get("replay")
    if r:
        L += ["## Replayed correct programs (the pipeline with a strong proposer)", "",
              "A replay proposer returns a wrong program, then the written-out correct one; selection is by "
              "validation accuracy. Length generalisation: trained at the shortest length (10, else 12-16) whose "
              "input space holds 100 + 100 unique inputs per class, tested on 2,000 inputs of length 100.", "",
              "| task | test acc, L = 100 | train length | test acc at L = 100 |", "|---|---|---|---|"]
        L += [f"| {x['task']} | {x.get('test_acc_L100', '')} | {x.get('train_length', '')} | "
              f"{x.get('train_short_test100', x.get('short_error', ''))} |" for x in r["rows"]]
        L += ["", f"Gate (1.0 at L = 100 on every solvable task, and from the short length to 100 where the rule is "
              f"length-independent): {render(gate('replay', r['all_exact']))} "
              f"({r['n_exact_L100']}/{r['n']} at L = 100, {r['n_exact_length_gen']}/{r['n_length_gen']} length "
              "generalisation)", ""]
    s = res.get("sandbox")
    if s:
        L += ["## Sandbox: hostile programs (spec §8.3)", "", f"Blocked: {s['blocked']} of {s['n']}.", "",
              "| program | blocked | how |", "|---|---|---|"]
        L += [f"| {x.get('name')} | {'yes' if x.get('blocked') else '**no**'} | {how(x)} |" for x in s["records"]]
        L.append("")
    L.append(f"Compute time, summed over the parts' runs: {res.get('wall_seconds', 0) / 60:.1f} min "
             f"({res.get('machine')}).")
    path.write_text("\n".join(L) + "\n")


def plot(res: dict, path: Path) -> None:
    c = res.get("classical")
    if not c:
        return
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from collections import defaultdict

    agg = defaultdict(list)
    for r in c["rows"]:
        agg[(r["task"], r["method"])].append(r["test_acc"])
    tasks = list(dict.fromkeys(r["task"] for r in c["rows"]))
    methods = list(dict.fromkeys(r["method"] for r in c["rows"]))
    for r in (res.get("icl") or {}).get("rows", []):
        agg[(r["task"], "icl (SmolLM2-135M)")].append(r["test_acc"])
    if res.get("icl"):
        methods.append("icl (SmolLM2-135M)")
    replay = {x["task"]: x.get("test_acc_L100") for x in (res.get("replay") or {}).get("rows", [])}
    fig, ax = plt.subplots(figsize=(13, 4))
    w = 0.8 / (len(methods) + 1)
    for j, m in enumerate(methods):
        ys = [100 * statistics.fmean(agg[(t, m)]) if agg.get((t, m)) else float("nan") for t in tasks]
        ax.bar([i + j * w for i in range(len(tasks))], ys, w, label=m)
    ax.bar([i + len(methods) * w for i in range(len(tasks))],
           [100 * replay[t] if isinstance(replay.get(t), float) else float("nan") for t in tasks], w,
           label="LLM-PV, replayed correct program", color="k")
    ax.axhline(50, color="grey", lw=0.8, ls="--")
    ax.set_xticks([i + 0.4 for i in range(len(tasks))], tasks, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("test accuracy % (L = 100)")
    ax.legend(fontsize=7, ncol=3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--parts", default="classical,replay,sandbox,sanity,proposer,icl")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--tasks", default="", help="classical part: these tasks only (comma list; the JSON keeps the "
                    "other tasks' previous rows)")
    ap.add_argument("--icl-tasks", default="", help="icl part: these tasks (default all 13)")
    ap.add_argument("--icl-queries", type=int, default=100, help="icl part: test queries per task (paper: 100)")
    ap.add_argument("--methods", default="xgboost,random-forest,logreg,mlp")
    ap.add_argument("--transformer-tasks", default="parity_all,patternmatch1,palindrome,dyck2")
    ap.add_argument("--transformer-seeds", type=int, default=1)
    ap.add_argument("--transformer-first-seed", type=int, default=0,
                    help="first transformer seed (a --tasks rerun with seeds N.. adds them to the stored ones)")
    ap.add_argument("--transformer-epochs", type=int, default=200)
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--k", type=int, default=8, help="proposals per task (issue: 64)")
    ap.add_argument("--max-new-tokens", type=int, default=192)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--dtype", default="", help="sanity/proposer parts: load the model in this dtype (bfloat16 "
                    "halves its memory; on a 2-core AVX-512-BF16 CPU it prefilled 1.6x faster but decoded 1.9x "
                    "slower than float32); default the checkpoint's")
    ap.add_argument("--prime-test", type=int, default=2_000,
                    help="test size of the two prime tasks (drawing 10,000 L = 100 primes takes ~2 min per split)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--proposer-tasks", default="", help="proposer part: these tasks (comma list, or 'all' for the "
                    "13; default parity_all,patternmatch1,palindrome,prime_decimal); the JSON keeps the other "
                    "tasks' rows")
    ap.add_argument("--sanity-rules", default="", help="sanity part: these rules (comma list of "
                    f"{', '.join(SANITY_RULES)}; default all four); the JSON keeps the other rules' rows")
    ap.add_argument("--out", default=None, help="results stem (default benchmarks/results/learn_program, or "
                    "learn_program-<model> when --model is not smollm2-135m)")
    a = ap.parse_args(argv)
    if a.out is None:
        a.out = str(results_stem(a.model))
    import platform

    import torch

    torch.set_num_threads(a.threads)
    parts = [p for p in a.parts.split(",") if p]
    start = time.time()

    def log(msg):
        print(f"[{time.time() - start:7.1f}s] {msg}", file=sys.stderr, flush=True)

    out = Path(a.out)
    suffixed = lambda ext: out.with_name(out.name + ext)  # noqa: E731 - not with_suffix: a stem may hold dots
    command = "python benchmarks/learn_program.py " + shlex.join(argv if argv is not None else sys.argv[1:])

    def load() -> dict:
        f = suffixed(".json")
        return json.loads(f.read_text()) if f.is_file() else {}

    def save(res: dict) -> None:
        f = suffixed(".json")
        tmp = suffixed(".json.tmp")
        tmp.write_text(json.dumps(res, indent=2, default=str) + "\n")
        tmp.replace(f)  # atomic: a concurrent run never reads a half-written file

    # Each part's result is merged into the JSON as it is when the part ends (re-read then), so two runs of
    # different parts (say the proposer and the icl part) can share one results file.
    with tempfile.TemporaryDirectory(prefix="lp-bench-") as tmp:
        work = Path(tmp)
        for part in parts:
            t0 = time.time()
            if part == "classical":
                value = part_classical(a, log)
            elif part == "icl":
                value = part_icl(a, log)
            elif part == "proposer":
                value = part_proposer(a, log, work)
            elif part == "sanity":
                value = part_sanity(a, log, work)
            elif part == "replay":
                value = part_replay(a, log, work)
            elif part == "sandbox":
                value = part_sandbox(a, log, work)
            else:
                ap.error(f"unknown part {part!r}")
            res = load()
            old = res.get(part)
            merged = bool(old) and ((part == "classical" and a.tasks) or part == "icl"
                                    or (part == "proposer" and bool(a.proposer_tasks))
                                    or (part == "sanity" and bool(a.sanity_rules)))
            if merged and part == "classical":
                covers_primes = all(t in a.tasks.split(",") for t in PRIME_TASKS)
                value = {**old, "prime_test": a.prime_test if covers_primes else old.get("prime_test", 2_000),
                         "rows": merge_rows(old["rows"], value["rows"], keys=("task", "method", "seed"))}
            elif merged:
                value["rows"] = merge_rows(old["rows"], value["rows"], keys=("rule",) if part == "sanity" else
                                           ("task", "method"))
                if part == "sanity":  # the suite's order
                    value["rows"].sort(key=lambda r: list(SANITY_RULES).index(r["rule"]))
                if part in ("proposer", "sanity"):  # the part's k is the smallest of its rows' (older rows lack one)
                    value["k"] = min(r.get("k", old.get("k", a.k)) for r in value["rows"])
            if part in ("proposer", "sanity"):  # pass@k and the val-1.0 gate over the (merged) rows
                value.update(proposer_summary(value["rows"]))
            res[part] = value
            res["model"] = a.model
            secs = res.setdefault("part_seconds", {})  # a merging rerun adds its time to the kept rows' time
            secs[part] = round((secs.get(part, 0.0) if merged else 0.0) + time.time() - t0, 1)
            # a merging rerun adds its command to those that produced the rows it kept
            cmds = res.setdefault("part_commands", {})
            before = cmds.get(part, []) if merged else []
            cmds[part] = before + [command] if command not in before else before
            save(res)
    res = load()
    res.pop("command", None)
    res["reductions"] = reductions(res)
    res["wall_seconds"] = sum(res.get("part_seconds", {}).values())
    res["machine"] = f"{platform.machine()}, {os.cpu_count()} CPUs, torch {torch.__version__}"
    save(res)
    write_md(res, suffixed(".md"))
    plot(res, suffixed(".png"))
    log(f"wrote {out}.json/.md/.png")
    return res


if __name__ == "__main__":
    main()

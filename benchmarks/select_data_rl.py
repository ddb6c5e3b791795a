"""SHIFT with RL (issue 14): every selector's subset of the reasoning-gym pool trained with GRPO under identical
settings, several seeds, beside the full pool and the untrained policy.

    .venv/bin/python benchmarks/select_data_rl.py --seeds 3 --workers 2 --threads 1

The pool is the SHIFT part's (``select_data.py``): 7 reasoning-gym generators x ``--pool-per-gen`` prompts with
their verifiers, the generator name never read by a selector. The policy whose rollouts give the selection
features is the policy GRPO starts from: the default model, or (``--warmup-steps`` > 0) the default model after
that many SFT steps on other prompts of the same generators (SmolLM2-135M as shipped solves ~0 % of this pool,
so GRPO gets no reward variance from it; the warm start is cached like train_grpo.py's). Every selector picks
``--budget`` prompts (random and kmeans-centres draw with the GRPO seed, so each seed has its own subset); each
(selector, seed) is one GRPO run of ``--steps`` phases with the same prompts/phase, G, lr and updates as the
full-pool run, then greedy pass@1 on ``--test-per-gen`` x 7 in-domain prompts (another seed of the same
generators) and ``--transfer`` gsm_symbolic prompts. Runs are appended to
``benchmarks/results/select_data_rl.runs.jsonl`` and reused by any later command with the same protocol.

``--difficulty easy`` (issue 42's calibration) draws the pool, the warm start's prompts and the test set from
``select_data.POOL_CONFIGS["easy"]`` (one-digit operands, short words) instead of reasoning-gym's defaults.

The issue's gate comes first: full-pool GRPO must beat the starting policy by >= 5 points in-domain (paired,
seeds pooled) over at least 3 seeds of the full arm ("not tested" below that); when it does not, the report says
the selector comparison is uninformative at this scale. ``--report-only`` trains nothing and reports the runs file's
finished runs, each arm over the seeds it has (how a comparison still under way is reported); ``--train-seeds``
trains only some seeds of the missing runs (to split them between invocations as cores free up). The budget and
the feature length change only the selectors' picks, so a new ``--budget`` under its own ``--tag`` takes the start's
evaluation and the full-pool runs from the tag that trained them (``--reference-from TAG``) instead of retraining.

The report adds sensitivity rows over the test items of the generators where no single answer reaches
``LABEL_PRIOR_SHARE`` (90 %) of the test answers: on such a generator (syllogism here, 20 of 22 "Yes") a constant
answer scores that share, so a subset that flips the policy's preferred label moves the in-domain score by the
generator's whole share without any change in reasoning.
Writes benchmarks/results/TAG.{json,md,png} and TAG.runs.jsonl (``--tag``, default select_data_rl).
"""
from __future__ import annotations

import argparse
import hashlib
import json
import os
import shlex
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from select_data import GENERATORS, POOL_CONFIGS, shift_pool  # noqa: E402
from train_grpo import _greedy_eval, _run_jobs, _train_once, cached_sft, paired_vs_base  # noqa: E402

RESULTS = ROOT / "benchmarks" / "results"
from benchmarks.gates import gate, render, verdict  # noqa: E402
# every setting that changes an arm's result (sc_samples only changes the sc-entropy arm's picks, which are
# stored in its record; the selector list and the seed count only add runs)
PROTOCOL = ("model", "pool_per_gen", "budget", "feature_tokens", "steps", "group_size", "prompts",
            "updates", "micro_batch", "lr", "max_new_tokens", "gen_batch", "test_per_gen", "transfer",
            "warmup_steps", "warmup_lr", "warmup_per_gen")
# recorded only when they differ from these defaults (the committed runs files stay reusable)
OPTIONAL = {"difficulty": "default"}
FULL_GATE = "full - base >= 0.05 in-domain"
# a generator whose test answers are one value at this share measures the policy's label prior (sensitivity rows)
LABEL_PRIOR_SHARE = 0.9
MIN_GATE_SEEDS = 3  # the full-pool gain must hold over this many GRPO training seeds before selectors are compared
# settings that change only which prompts a selector picks: the starting policy's evaluation and the full-pool runs
# are the same under any value of them, so another budget's runs file can lend them (--reference-from)
PICK_ONLY = ("budget", "feature_tokens")
REFERENCE_ARMS = ("base", "full")
DEFAULT_SELECTORS = ("shift,random,kmeans-centres,kcenter,minilm-coreset,rirs-topk,question-ppl,answer-ppl,"
                     "entropy,sc-entropy")


def run_protocol(a, checksum: str) -> dict:
    """The settings that name a run in the runs file; an OPTIONAL key only when it is not its default."""
    from llmtool.core.runlog import protocol_of

    return {**protocol_of(a, PROTOCOL, OPTIONAL), "start_checksum": checksum}


def run_key(record: dict) -> tuple:
    """A run's name in the runs files: (arm, GRPO seed); a lent run keeps the name it had."""
    return record["arm"], record["seed"]


def reference_runs(path: Path, protocol: dict) -> dict:
    """The starting policy's evaluation and the full-pool runs in the runs file ``path`` whose protocol equals
    ``protocol`` apart from the PICK_ONLY settings: {(arm, seed): record}."""
    from llmtool.core.runlog import RunLog

    other = RunLog(path, protocol, run_key)
    return {k: r for k, r in other.done(ignore=PICK_ONLY).items() if k[0] in REFERENCE_ARMS}


def pool_key(a) -> list:
    """The pool's part of a cache key: empty at the default difficulty, so the default pool's caches keep their
    names."""
    return [a.difficulty] if a.difficulty != OPTIONAL["difficulty"] else []


def gen_rows(per_gen: int, seed: int, difficulty: str) -> list[dict]:
    """``per_gen`` GRPO rows of each generator at ``difficulty`` (select_data.POOL_CONFIGS), with the rl_data
    verifier fields and the generator's name (for reporting only)."""
    from llmtool.train import rl_data

    cfg = POOL_CONFIGS[difficulty]
    return [dict(r, generator=g) for g in GENERATORS
            for r in rl_data.make_reasoning_gym(g, per_gen, seed=seed, config=cfg.get(g))]


def pool_rows(per_gen: int, difficulty: str = "default") -> list[dict]:
    """The SHIFT pool as GRPO rows: the same questions as select_data.shift_pool (same generators, size, seed
    and difficulty)."""
    return gen_rows(per_gen, 0, difficulty)


def test_rows(per_gen: int, transfer: int, difficulty: str = "default") -> tuple[list[dict], list[dict]]:
    from llmtool.train import rl_data

    ind = gen_rows(per_gen, 1000, difficulty)
    tr = rl_data.make_reasoning_gym("gsm_symbolic", transfer, seed=1000) if transfer else []
    return ind, tr


def start_policy(a) -> tuple[str, str]:
    """The default model, or its SFT warm start on ``--warmup-per-gen`` prompts per generator (seed 500, disjoint
    from the pool's seed 0 and the test's seed 1000), each answered by the generator's reference answer."""
    if a.warmup_steps <= 0:
        return a.model, "none"
    from llmtool.core.lm import chat_prompt

    def make_rows(tok):
        rows = gen_rows(a.warmup_per_gen, 500, a.difficulty)
        return [{"prompt": chat_prompt(tok, r["prompt"]), "completion": r["answer"]} for r in rows]

    key = [a.warmup_steps, a.warmup_lr, a.warmup_per_gen, "rg7", *pool_key(a)]
    return cached_sft(a.model, key, make_rows, a.warmup_steps, a.warmup_lr, a.threads * a.workers, "shift-rl",
                      max_length=256)


def selection_features(a, policy: str, checksum: str) -> dict:
    """SHIFT's features of the pool from ``policy``'s greedy rollouts (as select_data.bench_shift computes
    them) plus MiniLM prompt embeddings and, with ``--sc-samples``, self-consistency entropy; cached."""
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.select_data import features as F
    from llmtool.select_data.corpora import embed_minilm

    key = hashlib.sha256(json.dumps([checksum, policy if checksum == "none" else "", a.pool_per_gen,
                                     a.feature_tokens, a.sc_samples, *pool_key(a)]).encode()).hexdigest()[:12]
    path = Path(tempfile.gettempdir()) / f"llmtool-bench-shift-rl-feats-{key}.npz"
    if path.is_file():
        return dict(np.load(path))
    import torch

    torch.set_num_threads(max(1, a.threads * a.workers))
    prompts = [r["prompt"] for r in shift_pool(a.pool_per_gen, difficulty=a.difficulty)]  # the raw questions, as bench_shift reads them
    model, tok = load_model(policy), load_tokenizer(policy)
    t = time.time()
    feats = F.extract(model, tok, prompts, max_new_tokens=a.feature_tokens, batch_size=8)["features"]
    feats["minilm"] = embed_minilm(prompts)
    if a.sc_samples:
        feats["sc_entropy"] = F.sc_entropy(model, tok, prompts, samples=a.sc_samples,
                                           max_new_tokens=a.feature_tokens, batch_size=8)
    print(f"[shift-rl] features of {len(prompts)} prompts in {time.time() - t:.0f} s", flush=True)
    feats = {k: np.asarray(v) for k, v in feats.items()}
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **feats)
    tmp.rename(path)
    return feats


def pick(name: str, seed: int, feats: dict, budget: int, n: int) -> list[int]:
    from llmtool.select_data.methods import SELECTORS, run_selector

    if name == "full":
        return list(range(n))
    kw = {"budget": budget}
    if name in ("random", "kmeans-centres"):
        kw["select_seed"] = seed
    return [int(i) for i in run_selector(SELECTORS.build(name, **kw), feats)["picked"]]


def _job(job: dict) -> dict:
    """One (arm, seed): GRPO from the starting policy on the arm's prompts, then greedy pass@1 in-domain and on
    the transfer set (arm "base": the starting policy itself), in its own process."""
    import torch

    from llmtool.core.models import load_model, load_tokenizer

    a = argparse.Namespace(**job["a"])
    torch.set_num_threads(a.threads)
    tok, model = load_tokenizer(job["policy"]), load_model(job["policy"])
    pool = pool_rows(a.pool_per_gen, a.difficulty)
    ind, tr = test_rows(a.test_per_gen, a.transfer, a.difficulty)
    t = time.time()
    hist = []
    if job["arm"] != "base":
        rows = [pool[i] for i in job["ids"]]
        base_state = {k: v.clone() for k, v in model.state_dict().items()}
        model, hist, _ = _train_once(base_state, model, tok, rows, "ground-truth", job["seed"], a)
    model.eval()
    out = {"arm": job["arm"], "seed": job["seed"], "ids": job["ids"],
           "generators": sorted({pool[i]["generator"] for i in job["ids"]}),
           "in_domain": _greedy_eval(model, tok, ind, a), "transfer": _greedy_eval(model, tok, tr, a) if tr else None,
           "train_reward": [float(h["reward_mean"]) for h in hist if "reward_mean" in h],
           "zero_variance_groups": [float(h["zero_std_groups"]) for h in hist if "zero_std_groups" in h],
           # share of the training rollouts cut at --max-new-tokens (the end anchor is then not the answer's end)
           "truncated": [float(h["truncated"]) for h in hist if "truncated" in h],
           "seconds": time.time() - t}
    return out


def per_generator(records: list[dict], gens: list[str]) -> dict:
    """In-domain accuracy per generator, averaged over the records (seeds)."""
    ok = np.mean([r["in_domain"]["ok"] for r in records], axis=0)
    return {g: float(ok[[i for i, x in enumerate(gens) if x == g]].mean()) for g in GENERATORS}


def label_prior_generators(rows: list[dict], share: float = LABEL_PRIOR_SHARE) -> dict:
    """{generator: (answer, share)} for the generators whose test answers are one value at ``share`` or more: there
    a constant answer scores that share, so the generator's accuracy reads the policy's label prior (e.g. syllogism,
    20 of 22 test answers "Yes"), and one prompt of the other label in a training subset can flip it."""
    out = {}
    for g in dict.fromkeys(r["generator"] for r in rows):
        answers = [str(r["answer"]).strip() for r in rows if r["generator"] == g]
        top = max(set(answers), key=answers.count)
        if answers.count(top) >= share * len(answers):
            out[g] = (top, answers.count(top) / len(answers))
    return out


def summarise(done: dict, arms: list[str], seeds: int, gens: list[str], draws: int = 2000,
              prior_gens: dict | None = None) -> dict:
    """The report's numbers. ``prior_gens`` (``label_prior_generators``) adds, per arm, Δ vs base and − random
    over the test items of the other generators (``without_label_prior``): a sensitivity check, since a label
    flip on such a generator moves the in-domain score by its whole share."""
    from llmtool.core.intervals import bootstrap_mean_ci

    base = done[("base", 0)]
    res = {"base": {"in_domain": base["in_domain"]["pass@1"],
                    "transfer": base["transfer"]["pass@1"] if base["transfer"] else None}, "arms": {}}
    res["per_generator"] = {"base": per_generator([base], gens)}
    n_items = len(base["in_domain"]["ok"])
    idx = np.random.default_rng(0).integers(0, n_items, size=(draws, n_items))
    per_item, arm_runs = {}, {}
    for arm in arms:
        # every seed below --seeds that has finished (a --report-only summary can hold arms with fewer seeds)
        runs = [done[(arm, s)] for s in range(seeds) if (arm, s) in done]
        if not runs:
            continue
        arm_runs[arm] = runs
        ind = [r["in_domain"]["pass@1"] for r in runs]
        tr = [r["transfer"]["pass@1"] for r in runs if r["transfer"]]
        per_item[arm] = np.mean([r["in_domain"]["ok"] for r in runs], axis=0)
        res["per_generator"][arm] = per_generator(runs, gens)
        d, lo, hi = paired_vs_base([r["in_domain"]["ok"] for r in runs], base["in_domain"]["ok"])
        res["arms"][arm] = {
            "seeds": len(runs), "in_domain": float(np.mean(ind)), "in_domain_sd": float(np.std(ind, ddof=1)) if len(ind) > 1 else None,
            "transfer": float(np.mean(tr)) if tr else None,
            "transfer_sd": float(np.std(tr, ddof=1)) if len(tr) > 1 else None,
            "delta_vs_base": d, "delta_vs_base_ci95": [lo, hi],
            "generators_covered": float(np.mean([len(r["generators"]) for r in runs])),
            "per_seed_in_domain": ind, "train_seconds": float(np.mean([r["seconds"] for r in runs])),
            # GRPO learns only from groups whose G rewards differ; the share of such groups over all phases
            "groups_with_variance": float(1 - np.mean([z for r in runs for z in r["zero_variance_groups"]])),
            "train_reward": float(np.mean([x for r in runs for x in r["train_reward"]])),
            "truncated": (float(np.mean([x for r in runs for x in r["truncated"]]))
                          if all(r.get("truncated") for r in runs) else None)}
    def comparisons(arm: str, draws_idx, mask=slice(None)) -> dict:
        """The arm − random and SHIFT − arm differences of seed-averaged per-item scores over the ``mask`` items,
        each with its bootstrap interval over items. SHIFT − arm is the method under test against every other arm
        (SHIFT − full: "close to the full pool"; SHIFT − a coreset or top-RIRS: the paper's baseline and ablation
        claims)."""
        out = {}
        for key, minuend, subtrahend in (("minus_random", arm, "random"), ("shift_minus", "shift", arm)):
            if minuend != subtrahend and minuend in per_item and subtrahend in per_item:
                diff = (per_item[minuend] - per_item[subtrahend])[mask]
                out[key], out[f"{key}_ci95"] = float(diff.mean()), list(bootstrap_mean_ci(diff, draws_idx))
        return out

    for arm in per_item:
        res["arms"][arm].update(comparisons(arm, idx))
    if prior_gens:
        keep = np.array([g not in prior_gens for g in gens])
        res["label_prior_generators"] = {g: {"answer": a, "share": x} for g, (a, x) in prior_gens.items()}
        base_ok = np.asarray(base["in_domain"]["ok"])[keep]
        res["base"]["in_domain_without_label_prior"] = float(base_ok.mean())
        kidx = np.random.default_rng(0).integers(0, int(keep.sum()), size=(draws, int(keep.sum())))
        for arm, e in res["arms"].items():
            d, lo, hi = paired_vs_base([list(np.asarray(r["in_domain"]["ok"])[keep]) for r in arm_runs[arm]],
                                       list(base_ok))
            e["without_label_prior"] = {"n_items": int(keep.sum()), "in_domain": float(per_item[arm][keep].mean()),
                                        "delta_vs_base": d, "delta_vs_base_ci95": [lo, hi],
                                        **comparisons(arm, kidx, keep)}
    if "full" in res["arms"]:
        f = res["arms"]["full"]
        # one seed can carry a GRPO gain by chance: the gate is tested only over >= 3 training seeds
        res["gate"] = {FULL_GATE: gate(
            FULL_GATE, f["delta_vs_base"] >= 0.05, round(f["delta_vs_base"], 4),
            precondition=f["seeds"] >= MIN_GATE_SEEDS,
            reason=f"{f['seeds']} training seed(s), the gate needs {MIN_GATE_SEEDS}"),
            "delta": f["delta_vs_base"], "ci95": f["delta_vs_base_ci95"]}
    return res


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    names = ["base", *res["arms"]]
    fig, ax = plt.subplots(figsize=(max(6.0, 0.75 * len(names)), 3.8))
    for i, name in enumerate(names):
        if name == "base":
            ax.bar(i, 100 * res["base"]["in_domain"], color="C7")
            continue
        e = res["arms"][name]
        ax.bar(i, 100 * e["in_domain"], color="C1" if name == "shift" else "C0", alpha=0.7)
        ax.plot([i] * len(e["per_seed_in_domain"]), [100 * x for x in e["per_seed_in_domain"]], "k.", ms=5)
    ax.set_xticks(range(len(names)), names, rotation=30, ha="right", fontsize=8)
    ax.set_ylabel("in-domain greedy pass@1 (%)")
    ax.set_title("GRPO on each selector's subset (dots: seeds)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def _ci_cell(value: float, ci: list) -> str:
    """A table cell ``+0.012 [-0.030, +0.051]``: a difference and its 95 % interval."""
    return f"{value:+.3f} [{ci[0]:+.3f}, {ci[1]:+.3f}]"


def _comparison_cells(e: dict) -> dict:
    """The report's optional difference columns (− random, SHIFT − arm) of one arm's summary (main or sensitivity)."""
    cols = {"minus_random": "− random [95 % CI]", "shift_minus": "SHIFT − arm [95 % CI]"}
    return {col: _ci_cell(e[key], e[f"{key}_ci95"]) for key, col in cols.items() if key in e}


def markdown(res: dict) -> str:
    st = res["settings"]
    lines = ["# SHIFT with RL", "", f"Command: `{res['command']}`", "",
             f"Pool {7 * st['pool_per_gen']} prompts (7 reasoning-gym generators, "
             f"{st.get('difficulty', 'default')} difficulty: `select_data.POOL_CONFIGS`), budget {st['budget']}; GRPO "
             f"{st['steps']} phases × {st['prompts']} prompts × G = {st['group_size']}, lr {st['lr']}, "
             f"{st['updates']} updates/phase, ≤ {st['max_new_tokens']} new tokens, ground-truth reward; "
             f"{res['seeds']} seed(s). Starting policy: "
             + (f"{st['model']} after {st['warmup_steps']} SFT steps on {st['warmup_per_gen']} other prompts per "
                f"generator" if st["warmup_steps"] else st["model"]) + f" (checksum {res['start_checksum']}). "
             f"Test: greedy pass@1 on {res['n_in_domain']} in-domain prompts and {res['n_transfer']} gsm_symbolic "
             "prompts.", ""]
    g = res.get("gate")
    if g:
        lines += [f"**Gate** full-pool GRPO − starting policy ≥ 5 points in-domain: "
                  f"{render(g[FULL_GATE], bold=False)} (Δ {100 * g['delta']:+.1f} points, "
                  f"paired 95 % CI [{100 * g['ci95'][0]:+.1f}, {100 * g['ci95'][1]:+.1f}], seeds pooled)."
                  + {"met": "", "not met": " The selector comparison below is therefore not tested at this scale "
                                           "(RL gains nothing for any selector to keep).",
                     "not tested": " Until it is, a selector comparison on this setting is premature."}[
                         verdict(g[FULL_GATE])], ""]
    rows = [{"arm": "base (no RL)", "in-domain pass@1": round(res["base"]["in_domain"], 3),
             "transfer pass@1": None if res["base"]["transfer"] is None else round(res["base"]["transfer"], 3)}]
    for name, e in res["arms"].items():
        sd = "" if e["in_domain_sd"] is None else f" ± {e['in_domain_sd']:.3f}"
        r = {"arm": name, "seeds": e.get("seeds", res["seeds"]), "in-domain pass@1": f"{e['in_domain']:.3f}{sd}",
             "transfer pass@1": None if e["transfer"] is None else f"{e['transfer']:.3f}",
             "Δ vs base [95 % CI]": _ci_cell(e["delta_vs_base"], e["delta_vs_base_ci95"]),
             "generators covered": e["generators_covered"],
             "train reward": round(e["train_reward"], 3), "groups with reward variance": round(e["groups_with_variance"], 3),
             "rollouts truncated": "" if e.get("truncated") is None else round(e["truncated"], 3),
             **_comparison_cells(e)}
        rows.append(r)
    from llmtool.core.console import markdown_table

    cols = list(dict.fromkeys(k for r in rows for k in r))
    rows = [{k: r.get(k, "") for k in cols} for r in rows]
    lines += [markdown_table(rows), "",
              ("Mean ± sd over seeds. Δ vs base: paired with the starting policy on the same items, seeds pooled "
               "(Newcombe). − random and SHIFT − arm: seed-averaged per-item differences, bootstrap over test items "
               "(it resamples items, not training runs)."), ""]
    lp = res.get("label_prior_generators")
    if lp:
        named = ", ".join(f"{g} ({100 * v['share']:.0f} % of its test answers {v['answer']!r})" for g, v in lp.items())
        wrows = [{"arm": name, "in-domain pass@1": f"{w['in_domain']:.3f}",
                  "Δ vs base [95 % CI]": _ci_cell(w["delta_vs_base"], w["delta_vs_base_ci95"]), **_comparison_cells(w)}
                 for name, w in ((n, e["without_label_prior"]) for n, e in res["arms"].items())]
        cols = list(dict.fromkeys(k for r in wrows for k in r))
        n_kept = next(iter(res["arms"].values()))["without_label_prior"]["n_items"]
        head = (f"Sensitivity: the same runs over the {n_kept} test items of the generators where no single "
                f"answer reaches {100 * LABEL_PRIOR_SHARE:.0f} % (left out: {named}; a constant answer scores "
                "that much there, so a subset that flips the policy's preferred label moves the score by the "
                f"generator's whole share; base {res['base']['in_domain_without_label_prior']:.3f}):")
        lines += [head, "",
                  markdown_table([{k: r.get(k, "") for k in cols} for r in wrows]), ""]
    pg = res["per_generator"]
    lines += ["In-domain accuracy per generator (mean over seeds):", "",
              markdown_table([{"arm": k, **{g: round(v[g], 3) for g in GENERATORS}} for k, v in pg.items()]), ""]
    if res.get("plot"):
        lines += [f"Plot: `benchmarks/results/{res['plot']}`.", ""]
    return "\n".join(lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--pool-per-gen", type=int, default=50)
    ap.add_argument("--budget", type=int, default=16)
    ap.add_argument("--selectors", default=DEFAULT_SELECTORS, help="comma list of select-data selectors")
    ap.add_argument("--no-full", action="store_true", help="skip the full-pool arm")
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--feature-tokens", type=int, default=48, help="rollout length for the selection features")
    ap.add_argument("--sc-samples", type=int, default=8, help="samples for sc-entropy (0 drops that selector)")
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--group-size", type=int, default=8)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--updates", type=int, default=2)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=1e-5)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--gen-batch", type=int, default=16)
    ap.add_argument("--test-per-gen", type=int, default=22, help="in-domain test prompts per generator (7 x 22 = 154)")
    ap.add_argument("--transfer", type=int, default=150, help="gsm_symbolic transfer prompts (0 = none)")
    ap.add_argument("--warmup-steps", type=int, default=0)
    ap.add_argument("--warmup-lr", type=float, default=1e-4)
    ap.add_argument("--warmup-per-gen", type=int, default=64)
    ap.add_argument("--marker", default="=", help="tracked marker (reported by the shared evaluation)")
    ap.add_argument("--workers", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--difficulty", default="default", choices=sorted(POOL_CONFIGS),
                    help="the pool's generator configurations (select_data.POOL_CONFIGS; 'easy' is the calibrated pool)")
    ap.add_argument("--train-seeds", default="", help="comma list: train only these of the missing seeds (the report "
                                                       "still covers every finished one; to split a run's seeds "
                                                       "between invocations)")
    ap.add_argument("--reference-from", default="", metavar="TAG",
                    help="take the starting policy's evaluation and the full-pool runs from TAG.runs.jsonl where every "
                         "setting but the budget and feature tokens is this command's (a new --budget then trains "
                         "only its selectors); they are copied into this tag's runs file")
    ap.add_argument("--report-only", action="store_true",
                    help="train nothing: summarise the runs file's finished runs (each arm over its seeds)")
    ap.add_argument("--tag", default="select_data_rl", help="results stem: benchmarks/results/TAG.{json,md,png} and "
                                                           "TAG.runs.jsonl")
    a = ap.parse_args()
    if not a.tag or "/" in a.tag:
        ap.error("--tag: a file stem without '/'")
    try:  # checked before the warm start and the features, which can take minutes
        only = {int(x) for x in a.train_seeds.split(",")} if a.train_seeds else None
    except ValueError:
        ap.error(f"--train-seeds: a comma list of integers, got {a.train_seeds!r}")
    ref_path = RESULTS / f"{a.reference_from}.runs.jsonl" if a.reference_from else None
    if ref_path and ("/" in a.reference_from or not ref_path.is_file()):
        ap.error(f"--reference-from: no runs file {ref_path.name} in benchmarks/results")
    from llmtool.core.runlog import RunLog
    from llmtool.select_data.methods import SELECTORS

    sels = [x for x in a.selectors.split(",") if x and not (x == "sc-entropy" and not a.sc_samples)]
    for x in sels:
        if x not in SELECTORS.names():
            raise SystemExit(f"--selectors: unknown selector {x!r} (choose from {', '.join(SELECTORS.names())})")
    arms = ([] if a.no_full else ["full"]) + sels
    policy, checksum = start_policy(a)
    protocol = run_protocol(a, checksum)
    log = RunLog(RESULTS / f"{a.tag}.runs.jsonl", protocol, run_key)
    done = log.done()
    if ref_path:  # a new budget: the full arm and the start as another tag trained them, copied in
        lent = {k: {**r, "reference_from": a.reference_from} for k, r in reference_runs(ref_path, protocol).items()
                if k not in done}
        for r in lent.values():
            log.append(r)
        done.update(lent)
        print(f"[shift-rl] {len(lent)} start / full-pool runs taken from {ref_path.name}", flush=True)
    runs = [("base", 0)] + [(x, s) for s in range(a.seeds) for x in arms]
    missing = [k for k in runs if k not in done]
    unfinished = len(missing)
    if only is not None and not a.report_only:
        missing = [(x, s) for x, s in missing if x == "base" or s in only]  # the start is every arm's reference
    if a.report_only:
        if ("base", 0) not in done:
            raise SystemExit(f"--report-only: {log.path.name} has no evaluation of the starting policy")
        print(f"[shift-rl] {len(runs)} runs: {len(runs) - len(missing)} finished, {len(missing)} not run "
              "(--report-only)", flush=True)
        missing = []
    # the features cost minutes of rollouts and only a selector still to train reads them (the full pool takes
    # every prompt; a finished run's picks are in its record)
    n = 7 * a.pool_per_gen
    feats = selection_features(a, policy, checksum) if any(x in sels for x, _ in missing) else {}
    todo = [{"arm": x, "seed": s, "ids": [] if x == "base" else pick(x, s, feats, a.budget, n), "a": vars(a),
             "policy": policy} for x, s in missing]
    if not a.report_only:
        left = f", {unfinished - len(todo)} left to other --train-seeds" if unfinished > len(todo) else ""
        print(f"[shift-rl] {len(runs)} runs: {len(runs) - unfinished} reused, {len(todo)} to train{left}", flush=True)

    def keep(r):
        done[(r["arm"], r["seed"])] = r
        log.append(r)
        tr = "" if r["transfer"] is None else f", transfer {r['transfer']['pass@1']:.3f}"
        print(f"[shift-rl] {r['arm']} seed {r['seed']}: in-domain {r['in_domain']['pass@1']:.3f}{tr} "
              f"({r['seconds']:.0f} s)", flush=True)

    _run_jobs(_job, todo, a.workers, keep)
    ind, tr = test_rows(a.test_per_gen, a.transfer, a.difficulty)
    res = summarise(done, arms, a.seeds, [r["generator"] for r in ind], prior_gens=label_prior_generators(ind))
    res.update(settings=protocol, seeds=a.seeds, start_checksum=checksum, n_in_domain=len(ind), n_transfer=len(tr),
               command=shlex.join(["benchmarks/select_data_rl.py", *sys.argv[1:]]), runs_file=log.path.name)
    res["plot"] = plot(res, RESULTS / f"{a.tag}.png")
    (RESULTS / f"{a.tag}.json").write_text(json.dumps(res, indent=2, default=float))
    md = markdown(res)
    (RESULTS / f"{a.tag}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

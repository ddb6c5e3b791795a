"""Real-judge benchmark of judge aggregation: the default model (SmolLM2-135M-Instruct) judges real pairs built
from held-out Austen (austen-test: Northanger Abbey, Persuasion), with n sampled thinking-then-rating votes per
pair, aggregated by every method of `llmtool evaluate judge` (+ self-aggregation on a subset).

Pairs (the better side is known by construction; A/B position randomised per item, seeded):
* task ``shuffle``: a passage's opening sentences as the prompt; the genuine next sentence vs the same sentence
  word-shuffled. Tie items: two different word shuffles of it.
* task ``splice``: the genuine next sentence vs a sentence of similar length from another book (austen-train).
  Tie items: two different spliced sentences.
A quarter of each task's items are ties (human rating 0), the rest +1 / -1.

Sampling: `judge_sample.sample_votes` (the code of `llmtool evaluate judge-sample`), n votes per pair,
temperature 1.0, ``--swap half``, reasoning budget ``--reasoning`` tokens with budget forcing (``--force-final``:
an output with no ``Final rating:`` line gets one appended and up to 4 sampled value tokens; the strict parser
decides, junk stays null). Aggregation: `judge_btd.run_judge` (the code of `llmtool evaluate judge`), calibration
split ``--calib-frac`` stratified by task, per-task fits (and a pooled BTD fit for comparison).
Intervals: Wilson 95 % for label accuracy, percentile bootstrap (2000 resamples of test items) for MAE and
pairwise accuracy. Writes benchmarks/results/evaluate_judge_real.{json,md} and the raw votes
(evaluate_judge_real.votes.jsonl; ``--reuse`` re-aggregates them without sampling).

    python benchmarks/evaluate_judge_real.py                     # ~15-20 min on a busy 2-core CPU
    python benchmarks/evaluate_judge_real.py --items 16 --n 4 --self-agg-items 4 --dry   # smoke run
    python benchmarks/evaluate_judge_real.py --model qwen2.5-coder-0.5b --items 48      # another judge

With a ``--model`` other than smollm2-135m the results stem is ``evaluate_judge_real-<model>`` (e.g.
``evaluate_judge_real-qwen2-5-coder-0-5b``), so the SmolLM2 results are kept; ``--stem`` names it.
"""
from __future__ import annotations

import argparse
import json
import re
import shlex
import sys
import time
from pathlib import Path

import numpy as np

from llmtool.core.console import markdown_table
from llmtool.core.intervals import wilson

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.stems import model_stem  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
STEM = "evaluate_judge_real"
DEFAULT_MODEL = "smollm2-135m"


def stem_of(model: str) -> str:
    """The results stem of a judge model: the default keeps ``STEM``; dots and separators become '-'
    (``benchmarks/stems.py``)."""
    return model_stem(STEM, model, DEFAULT_MODEL)


SENT = re.compile(r"(?<=[.!?])\s+(?=[A-Z\"'])")


# ------------------------------------------------------------------ pairs from held-out Austen

def _sentences(text: str) -> list[str]:
    return [s.strip() for s in SENT.split(text) if s.strip()]


def _shuffle(words: list[str], rng) -> str:
    for _ in range(20):
        perm = list(rng.permutation(len(words)))
        if perm != sorted(perm):
            break
    return " ".join(words[i] for i in perm)


def build_pairs(items: int, seed: int, tie_share: float = 0.25, ctx_words: int = 45,
                cont_words: tuple[int, int] = (8, 30)) -> tuple[list[dict], dict[str, int]]:
    """Pairs and their known labels (+1 A better, 0 tie, -1 B better)."""
    from llmtool.core import defaults

    rng = np.random.default_rng(seed)
    test_paras = [p for p in defaults.text("austen-test").split("\n\n") if p.strip()]
    foreign = [s for p in defaults.text("austen-train").split("\n\n") for s in _sentences(p)
               if cont_words[0] <= len(s.split()) <= cont_words[1] and '"' not in s]
    cands = []
    for p in test_paras:
        sents = _sentences(p)
        for k in range(1, len(sents)):
            ctx = " ".join(sents[:k])
            if len(ctx.split()) > ctx_words:
                break
            nxt = sents[k]
            if len(ctx.split()) >= 15 and cont_words[0] <= len(nxt.split()) <= cont_words[1]:
                cands.append((ctx, nxt))
                break
    order = rng.permutation(len(cands))
    if len(cands) < items:
        raise SystemExit(f"only {len(cands)} usable passages for {items} items")
    pairs, labels = [], {}
    per_task = {"shuffle": items // 2, "splice": items - items // 2}
    used = 0
    for task, count in per_task.items():
        n_tie = round(tie_share * count)
        for j in range(count):
            ctx, nxt = cands[order[used]]
            used += 1
            iid = f"{task}-{j:03d}"
            tie = j < n_tie
            words = nxt.split()
            if task == "shuffle":
                good, bad = (_shuffle(words, rng), _shuffle(words, rng)) if tie else (nxt, _shuffle(words, rng))
            else:
                f1, f2 = (foreign[i] for i in rng.choice(len(foreign), 2, replace=False))
                good, bad = (f1, f2) if tie else (nxt, f1)
            if tie:
                a, b, lab = good, bad, 0
            elif rng.random() < 0.5:
                a, b, lab = good, bad, 1
            else:
                a, b, lab = bad, good, -1
            pairs.append({"id": iid, "task": task, "prompt": f"Continue this passage from a novel:\n{ctx}",
                          "response_a": a, "response_b": b})
            labels[iid] = lab
    return pairs, labels


# ------------------------------------------------------------------ intervals

def _boot(fn, idx: np.ndarray, reps: int, seed: int) -> tuple[float, float]:
    rng = np.random.default_rng(seed)
    vals = [fn(rng.choice(idx, len(idx), replace=True)) for _ in range(reps)]
    vals = [v for v in vals if np.isfinite(v)]
    if not vals:
        return float("nan"), float("nan")
    return float(np.percentile(vals, 2.5)), float(np.percentile(vals, 97.5))


def _pairwise_resampled(score: np.ndarray, human: np.ndarray, grp: np.ndarray, eps: float, s: np.ndarray) -> float:
    """Tie-calibrated pairwise accuracy over the items ``s`` (a bootstrap resample, with repeats); pairs of two
    copies of the same item are skipped (they would be free 'correct ties')."""
    correct = total = 0
    for g in np.unique(grp[s]):
        sg = s[grp[s] == g]
        iu, ju = np.triu_indices(len(sg), 1)
        keep = sg[iu] != sg[ju]
        iu, ju = sg[iu][keep], sg[ju][keep]
        ds, dh = score[iu] - score[ju], human[iu] - human[ju]
        pred = np.where(np.abs(ds) <= eps, 0, np.sign(ds))
        truth = np.where(np.abs(dh) < 1e-9, 0, np.sign(dh))
        correct += int((pred == truth).sum())
        total += len(iu)
    return correct / total if total else float("nan")


def method_rows(run, h: np.ndarray, grp: np.ndarray, idx: np.ndarray, reps: int, seed: int, only=None,
                extra: dict | None = None) -> list[dict]:
    from llmtool.evaluate import judge_btd as J

    eps_of = {r["method"]: r.get("eps", 0.0) for r in run.metrics}
    rows = []
    truth = J.sign_class(h)
    for m, agg in run.aggregates.items():
        if only and m not in only:
            continue
        eps = eps_of.get(m, 0.0)
        correct = int((agg.label[idx] == truth[idx]).sum())
        lo, hi = wilson(correct, len(idx))
        mae = J.mae(agg.point[idx], h[idx])
        mlo, mhi = _boot(lambda s, agg=agg: J.mae(agg.point[s], h[s]), idx, reps, seed)
        pw = J.pairwise_accuracy(agg.score[idx], h[idx], grp[idx], eps)
        plo, phi = _boot(lambda s, agg=agg, eps=eps: _pairwise_resampled(agg.score, h, grp, eps, s), idx, reps,
                         seed + 1)
        rows.append({**(extra or {}), "method": m, "items": len(idx), "mae": mae, "mae_ci": [mlo, mhi],
                     "label_acc": correct / len(idx), "label_acc_ci": [lo, hi], "pairwise_acc": pw,
                     "pairwise_acc_ci": [plo, phi], "eps": eps})
    return rows


def _fmt_rows(rows: list[dict]) -> list[dict]:
    out = []
    for r in rows:
        out.append({**({"task": r["task"]} if "task" in r else {}), "method": r["method"], "items": r["items"],
                    "MAE [95% CI]": f"{r['mae']:.3f} [{r['mae_ci'][0]:.3f}, {r['mae_ci'][1]:.3f}]",
                    "label acc [Wilson]": f"{r['label_acc']:.3f} [{r['label_acc_ci'][0]:.3f}, {r['label_acc_ci'][1]:.3f}]",
                    "pairwise acc [95% CI]": f"{r['pairwise_acc']:.3f} [{r['pairwise_acc_ci'][0]:.3f}, "
                                             f"{r['pairwise_acc_ci'][1]:.3f}]"})
    return out


# ------------------------------------------------------------------ main

def reading(summary: dict, per_vote: dict, by: dict, same_as_tie: bool) -> str:
    """The md's reading, from the measured numbers (a better-than-chance judge reads differently from one at
    chance): single-vote accuracy over both orders with a Wilson interval, position bias, and which
    aggregators' label-accuracy intervals lie above the always-tie reference."""
    ns = [per_vote.get(f"single_vote_n_{o}") or 0 for o in ("AB", "BA")]
    accs = [per_vote.get(f"single_vote_acc_{o}") or 0.0 for o in ("AB", "BA")]
    n = sum(ns)
    k = round(sum(a * m for a, m in zip(accs, ns)))
    lo, hi = wilson(k, n) if n else (float("nan"), float("nan"))
    signal = n > 0 and lo > 0.5
    fs = [summary["first_slot_share_AB"], summary["first_slot_share_BA"]]
    biased = all(f is not None and f >= 0.65 for f in fs) or all(f is not None and f <= 0.35 for f in fs)
    tie = by["always-tie"]["label_acc"]   # = the share of tie items among the test items
    coin = 0.5 * (1 - tie)                 # a judge that picks A or B at random and never says tie
    above = [m for m, r in by.items() if m != "always-tie" and r["label_acc_ci"][0] > max(tie, coin)]
    text = (f"The judge parses {1 - summary['parse_failure_rate']:.0%} of its outputs (with budget forcing) and picks "
            f"the first slot in {fs[0]:.0%} (AB) / {fs[1]:.0%} (BA) of its valid votes"
            + (": a position bias. " if biased else ". ")
            + f"Its single-vote accuracy on decided items is {accs[0]:.2f} (AB) and {accs[1]:.2f} (BA), "
            f"{k}/{n} = {k / max(n, 1):.2f} over both orders (Wilson 95 % [{lo:.2f}, {hi:.2f}]): "
            + ("above chance. " if signal else "not distinguishable from chance. "))
    refs = f"always tie {tie:.3f}, a random A/B pick {coin:.3f}"
    if above:
        text += (f"Label accuracy above both chance references ({refs}; lower bound of the Wilson interval above "
                 f"them): {', '.join(above)}. ")
    else:
        text += f"No aggregator's label-accuracy interval lies above both chance references ({refs}). "
    if same_as_tie:
        text += ("BTD's MAE is exactly that of the constant 'always tie' prediction: the per-task fit finds tau at "
                 "its lower bound and the calibration predicts the MAE-optimal median, tie, for (almost) every "
                 "item -- the fallback for an uninformative judge, not evidence that BTD extracts signal. ")
    if not signal:
        text += ("This benchmark measures the pipeline end to end on a real model; the paper's claim needs a judge "
                 "that is better than chance (API or GPU).")
    return text


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL)
    ap.add_argument("--stem", default=None, help="results stem under benchmarks/results (default "
                    "evaluate_judge_real, or evaluate_judge_real-<model> for another --model)")
    ap.add_argument("--items", type=int, default=96)
    ap.add_argument("--n", type=int, default=8)
    ap.add_argument("--reasoning", type=int, default=24, help="max new (thinking) tokens before forcing")
    ap.add_argument("--temperature", type=float, default=1.0)
    ap.add_argument("--self-agg-items", type=int, default=32, help="test items that also get self-aggregation")
    ap.add_argument("--self-agg-raw-chars", type=int, default=240)
    ap.add_argument("--calib-frac", type=float, default=0.25)
    ap.add_argument("--batch-rows", type=int, default=64)
    ap.add_argument("--chunk-items", type=int, default=16, help="pairs per sampling call (progress/timing)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (1 is fastest on a contended CPU)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--boot", type=int, default=2000)
    ap.add_argument("--reuse", action="store_true", help="re-aggregate the saved votes (no sampling)")
    ap.add_argument("--dry", action="store_true", help="do not write results")
    args = ap.parse_args()
    stem = args.stem or stem_of(args.model)

    import torch

    from llmtool.evaluate import judge_btd as J
    from llmtool.evaluate import judge_sample as S

    torch.set_num_threads(args.threads)
    t0 = time.time()
    pairs, labels = build_pairs(args.items, args.seed)
    votes_path = RESULTS / f"{stem}.votes.jsonl"
    selfagg_path = RESULTS / f"{stem}.selfagg.jsonl"
    timing = {}
    model = tok = None
    if args.reuse:
        votes = [json.loads(line) for line in votes_path.read_text().splitlines()]
        selfagg = [json.loads(line) for line in selfagg_path.read_text().splitlines()] if selfagg_path.exists() else []
    else:
        from llmtool.core.models import load_model, load_tokenizer

        model, tok = load_model(args.model), load_tokenizer(args.model)
        gen = S.hf_generator(model, tok, temperature=args.temperature, max_new_tokens=args.reasoning,
                             batch_rows=args.batch_rows, seed=args.seed, force_final=True)
        votes = []
        ts = time.time()
        for s in range(0, len(pairs), args.chunk_items):
            chunk = pairs[s:s + args.chunk_items]
            votes += S.sample_votes(chunk, gen, args.n, "half", "3way")
            done = s + len(chunk)
            el = time.time() - ts
            print(f"sampled {done}/{len(pairs)} pairs in {el:.0f}s (est. total {el / done * len(pairs):.0f}s)",
                  flush=True)
        timing["sampling_s"] = round(time.time() - ts, 1)
        selfagg = []

    # ---- aggregate (per task, and pooled for comparison)
    counts = J.counts_from_votes(votes)
    coverage = len(counts.ids) / len(pairs)
    human = {i: float(labels[i]) for i in counts.ids}
    run = J.run_judge(counts, human, calib_frac=args.calib_frac, nu_mode="item", seed=args.seed)
    run_shared = J.run_judge(counts, human, calib_frac=args.calib_frac, nu_mode="shared", seed=args.seed,
                             methods=["btd"])
    pooled = J.run_judge(counts, human, calib_frac=args.calib_frac, nu_mode="item", seed=args.seed,
                         methods=["btd"], per_task=False)

    # ---- self-aggregation on a stratified subset of the test split
    tasks = np.asarray(counts.tasks)
    rng = np.random.default_rng(args.seed + 5)
    sub_idx = []
    for t in sorted(set(tasks)):
        ti = run.test_idx[tasks[run.test_idx] == t]
        k = min(len(ti), args.self_agg_items // len(set(tasks)))
        sub_idx += list(rng.choice(ti, k, replace=False))
    sub_idx = np.sort(np.asarray(sub_idx, dtype=int))
    sub_ids = {counts.ids[i] for i in sub_idx}
    if not args.reuse and len(sub_idx):
        agg_gen = S.hf_generator(model, tok, temperature=0.0, max_new_tokens=args.reasoning,
                                 batch_rows=args.batch_rows, seed=args.seed, force_final=True)
        ts = time.time()
        selfagg = S.self_aggregate([p for p in pairs if p["id"] in sub_ids], votes, agg_gen, "3way",
                                   args.self_agg_raw_chars)
        timing["self_agg_s"] = round(time.time() - ts, 1)
        print(f"self-aggregated {len(selfagg)} pairs in {timing['self_agg_s']}s", flush=True)
    sa = {r["id"]: r["rating"] for r in selfagg}
    run_sa = J.run_judge(counts, human, calib_frac=args.calib_frac, nu_mode="item", seed=args.seed,
                         self_agg=sa) if sa else None

    # ---- metrics with intervals
    h = np.array([human[i] for i in counts.ids])
    grp = J.group_keys(counts)
    # BTD variants: rename so they sit in one table
    run.aggregates["btd-shared"] = run_shared.aggregates["btd"]
    run.aggregates["btd-pooled"] = pooled.aggregates["btd"]
    eps_extra = {r["method"] + suffix: r.get("eps", 0.0) for rr, suffix in ((run_shared, "-shared"), (pooled, "-pooled"))
                 for r in rr.metrics}
    run.metrics += [{"method": k, "eps": v} for k, v in eps_extra.items()]
    # reference: a constant "tie" prediction (what an aggregator should fall back to when the judge carries no signal)
    zeros = np.zeros(len(counts.ids))
    run.aggregates["always-tie"] = J.Aggregate("always-tie", zeros.astype(int), zeros, zeros)
    overall = method_rows(run, h, grp, run.test_idx, args.boot, args.seed)
    per_task = []
    for t in sorted(set(tasks)):
        per_task += method_rows(run, h, grp, run.test_idx[tasks[run.test_idx] == t], args.boot, args.seed,
                                extra={"task": t})
    subset_rows = []
    if run_sa is not None:
        subset_rows = method_rows(run_sa, h, grp, sub_idx, args.boot, args.seed)

    summary = S.vote_summary(votes)
    decided = {i for i, v in labels.items() if v != 0}
    per_vote = {}
    for order in ("AB", "BA"):
        vv = [v for v in votes if v["order"] == order and v["rating"] is not None and v["id"] in decided]
        per_vote[f"single_vote_acc_{order}"] = (sum(np.sign(v["rating"]) == labels[v["id"]] for v in vv) / len(vv)
                                                if vv else None)
        per_vote[f"single_vote_n_{order}"] = len(vv)
    fits = {k: {"nu0": float(np.exp(f.log_nu0)), "tau": f.tau, "omega": f.omega,
                "beta": run.calibrations[k].beta, "nu_h_hat": float(np.exp(run.calibrations[k].c)),
                "gamma": run.calibrations[k].gamma} for k, f in run.fits.items()}
    fits["pooled"] = {"nu0": float(np.exp(pooled.fits[J.POOLED].log_nu0)), "tau": pooled.fits[J.POOLED].tau,
                      "omega": pooled.fits[J.POOLED].omega, "beta": pooled.calibrations[J.POOLED].beta,
                      "nu_h_hat": float(np.exp(pooled.calibrations[J.POOLED].c))}
    vote_shares = {}
    for t in sorted(set(tasks)):
        vv = [v for v in votes if v["task"] == t and v["rating"] is not None]
        vote_shares[t] = {"A": sum(v["rating"] > 0 for v in vv) / max(len(vv), 1),
                          "tie": sum(v["rating"] == 0 for v in vv) / max(len(vv), 1),
                          "B": sum(v["rating"] < 0 for v in vv) / max(len(vv), 1)}
    timing["total_s"] = round(time.time() - t0, 1)
    if args.reuse and (RESULTS / f"{stem}.json").exists():   # keep the timing of the run that sampled the votes
        timing = {**json.loads((RESULTS / f"{stem}.json").read_text()).get("timing", {}),
                  "reaggregated_s": timing["total_s"]}
    command = "python benchmarks/evaluate_judge_real.py " + shlex.join(sys.argv[1:])
    if args.reuse and (RESULTS / f"{stem}.json").exists():   # the command that sampled the votes, then this one
        sampled_by = json.loads((RESULTS / f"{stem}.json").read_text()).get("command")
        command = f"{sampled_by}; re-aggregated by: {command}" if sampled_by and "re-aggregated" not in sampled_by \
            else (f"{sampled_by.split('; re-aggregated by: ')[0]}; re-aggregated by: {command}" if sampled_by
                  else command)
    sa_fail = sum(r["rating"] is None for r in selfagg)
    doc = {"command": command, "config": vars(args), "pairs": len(pairs), "coverage": coverage, "votes": summary, **per_vote,
           "vote_shares_by_task": vote_shares, "calib_items": len(run.calib_idx),
           "test_items": len(run.test_idx), "fits": fits, "metrics": overall, "task_metrics": per_task,
           "self_agg": {"items": len(selfagg), "failures": sa_fail, "subset_metrics": subset_rows},
           "timing": timing}
    print(json.dumps({k: doc[k] for k in ("coverage", "votes", "fits", "timing")}, indent=1, default=float))
    print(markdown_table(_fmt_rows(overall)))
    if args.dry:
        return
    RESULTS.mkdir(exist_ok=True)
    if not args.reuse:
        votes_path.write_text("".join(json.dumps(v, ensure_ascii=False) + "\n" for v in votes))
        selfagg_path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in selfagg))
    (RESULTS / f"{stem}.json").write_text(json.dumps(doc, indent=2, default=float) + "\n")
    md = [f"# Real judge: {args.model} on held-out Austen pairs", "",
          (f"{len(pairs)} pairs (2 tasks x {len(pairs) // 2}; 25 % ties), n = {args.n} votes per pair, temperature "
           f"{args.temperature}, --swap half, reasoning budget {args.reasoning} tokens then budget forcing "
           f"(`--force-final`). Calibration split {len(run.calib_idx)} items (stratified by task), test "
           f"{len(run.test_idx)} items. Per-task fits unless marked pooled. Wall time {timing['total_s']:.0f} s."), "",
          "## Votes", "",
          markdown_table([{"votes": summary["votes"], "parse failures": f"{summary['parse_failure_rate']:.3f}",
                           "items with >= 1 valid vote": f"{coverage:.3f}",
                           "first-slot share AB": summary["first_slot_share_AB"],
                           "first-slot share BA": summary["first_slot_share_BA"],
                           "tie share AB": summary["tie_share_AB"], "tie share BA": summary["tie_share_BA"],
                           "single-vote acc AB": per_vote["single_vote_acc_AB"],
                           "single-vote acc BA": per_vote["single_vote_acc_BA"]}]), "",
          ("First-slot share = share of valid votes for the response shown in the Response A slot; an unbiased "
           "judge gives the same share in both orders. Single-vote accuracy on decided (non-tie) items."), "",
          "## Aggregation, test split (all tasks)", "", markdown_table(_fmt_rows(overall)), "",
          "## Per task", "", markdown_table(_fmt_rows(per_task)), "",
          "## Fitted parameters", "",
          markdown_table([{"unit": k, **{kk: (f"{vv:.3f}" if isinstance(vv, float) else vv) for kk, vv in f.items()}}
                          for k, f in fits.items()]), ""]
    if subset_rows:
        md += [f"## Self-aggregation subset ({len(sub_idx)} test items; {sa_fail} unparsed -> tie)", "",
               markdown_table(_fmt_rows(subset_rows)), ""]
    by = {r["method"]: r for r in overall}
    same_as_tie = abs(by["btd"]["mae"] - by["always-tie"]["mae"]) < 1e-9
    md += ["## Reading", "", reading(summary, per_vote, by, same_as_tie), ""]
    (RESULTS / f"{stem}.md").write_text("\n".join(md))
    print(f"wrote {RESULTS / stem}.json/.md")


if __name__ == "__main__":
    main()

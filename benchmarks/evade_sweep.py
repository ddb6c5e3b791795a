"""beta0 sweep of BIRA (issue 43): evasion against similarity at fixed beta0, and the calibrated beta0 re-measured.

The main benchmark (benchmarks/evade.py) compares attacks at one beta0 each; its "similarity at matched
detection" is the similarity over the texts an attack evades, which says nothing about what a stronger
bias costs. This script runs benchmarks/evade.py itself (same prompts, texts, negatives, seed and metrics)
with the attacks ``bira@B`` (BIRA at the fixed beta0 = B, passed explicitly) for every B in ``--betas``, on
the schemes in ``--schemes``, plus the ``calibrate`` stage with ``--fresh-calibration`` (the calibration of
``llmtool evade attack --method bira`` without --beta0, measured with the beta0 cache pointed at an empty
temporary file, so it is never read from ~/.cache). Per (scheme, beta0) it reports the evasion rate and
TPR@1 % FPR with Wilson 95 % intervals, the mean MiniLM similarity to the watermarked text with a percentile
bootstrap 95 % interval, the median perplexity, the first-try degeneration rate and the mean attempts.

Default beta0 from the curve: the least negative beta0 whose evasion rate (point estimate) reaches
``--target`` (0.95, the paper's level) on every scheme; the Wilson lower bounds are reported beside it.
Outputs: ``<out>.json`` / ``<out>.md`` (the summary, gates, command), ``<out>.png`` (evasion vs similarity,
one point per beta0 per scheme) and ``<out>_runs.json`` / ``_runs.md`` (benchmarks/evade.py's own records,
with the per-text values).

    python benchmarks/evade_sweep.py --threads 1                         # 2 schemes x 4 beta0, 100 texts
    python benchmarks/evade_sweep.py --n 10 --calib-texts 10 --out /tmp/pilot   # a pilot
    python benchmarks/evade_sweep.py --summarize-only                     # rebuild outputs from _runs.json
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks import evade as evade_bench  # noqa: E402
from benchmarks.gates import gate, lines  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
RESULTS = Path("benchmarks") / "results"     # relative to ROOT (main() runs there): no machine path is recorded
BETAS = [-1.0, -2.0, -3.0, -4.0]
TARGET = 0.95


def attack_name(beta0: float) -> str:
    return f"{evade_bench.FIXED_BIRA}{beta0:g}"


def evade_argv(args) -> list[str]:
    """The benchmarks/evade.py command line of the sweep: generation ("none"), then each beta0 over every
    scheme, the two mildest first and the calibration after them (a run stopped by --stop-at keeps the
    most informative part of the curve)."""
    betas = sorted(args.betas, reverse=True)
    attacks = ["none"] + [attack_name(b) for b in betas[:2]] + [evade_bench.CALIBRATE] + \
        [attack_name(b) for b in betas[2:]]
    argv = ["--model", args.model, "--n", str(args.n), "--n-neg", str(args.n_neg),
            "--max-new-tokens", str(args.max_new_tokens), "--schemes", *args.schemes, "--attacks", *attacks,
            "--calib-texts", str(args.calib_texts), "--order", "attack", "--fresh-calibration", "--per-text",
            "--seed", str(args.seed), "--batch-size", str(args.batch_size), "--threads", str(args.threads),
            "--out", str(Path(args.out).with_name(Path(args.out).name + "_runs"))]
    return argv + (["--stop-at", args.stop_at] if args.stop_at else []) + (["--resume"] if args.resume else [])


def curve_rows(records: list[dict], source: str = "sweep") -> list[dict]:
    """One row per (scheme, fixed beta0) record of benchmarks/evade.py, sorted by scheme then beta0 (mildest
    first). With ``source="main run"`` the records are the main benchmark's ``bira-cal`` / ``bira-4`` rows
    (BIRA at their recorded fixed beta0)."""
    rows = []
    for r in records:
        beta0 = evade_bench.fixed_beta0(r["attack"]) if source == "sweep" else \
            (r.get("beta0") if r["attack"] in ("bira-cal", "bira-4") else None)
        if beta0 is None:
            continue
        rows.append({"scheme": r["scheme"], "beta0": float(beta0), "source": source, "n": r["n_pos"],
                     "evasion": r["evasion_rate"], "evasion_ci": r["evasion_ci"],
                     "tpr@1%": r["tpr@fpr=0.01"], "tpr@1%_ci": r["tpr@fpr=0.01_ci"],
                     "tpr@10%": r["tpr@fpr=0.1"], "tpr@10%_ci": r["tpr@fpr=0.1_ci"], "auroc": r["auroc"],
                     "similarity": r["similarity"], "similarity_ci": r.get("similarity_ci"),
                     "similarity_evaded": r["similarity_evaded"], "n_evaded": r["n_evaded"],
                     "ppl_median": r["ppl_median"], "self_bleu": r["self_bleu"],
                     "first_try_degenerate": r.get("first_try_degenerate_rate"),
                     "degenerate_final": r.get("degenerate_rate"), "mean_attempts": r.get("mean_attempts"),
                     "mean_beta_final": r.get("mean_beta_final"),
                     "_sims": (r.get("per_text") or {}).get("similarity")})
    return sorted(rows, key=lambda x: (x["scheme"], -x["beta0"]))


def fill_from_main(rows: list[dict], main_records: list[dict], same: dict, schemes: list[str],
                   betas: list[float]) -> list[dict]:
    """The sweep's rows plus, for a (scheme, beta0) the sweep did not reach, the main run's row at that beta0
    (its ``bira-cal`` / ``bira-4``: the same algorithm at a fixed beta0), only where the sweep's watermarked
    texts are the main run's (``same[scheme]["same_first_text"]``). Such rows have no bootstrap interval."""
    have = {(r["scheme"], r["beta0"]) for r in rows}
    extra = [r for r in curve_rows(main_records, source="main run")
             if r["scheme"] in schemes and r["beta0"] in betas and (r["scheme"], r["beta0"]) not in have
             and same.get(r["scheme"], {}).get("same_first_text")]
    out, seen = [], set()
    for r in rows + extra:
        if (r["scheme"], r["beta0"]) not in seen:
            seen.add((r["scheme"], r["beta0"]))
            out.append(r)
    return sorted(out, key=lambda x: (x["scheme"], -x["beta0"]))


def paired_similarity_difference(a: list[float], b: list[float], seed: int = 0) -> dict:
    """Mean over texts of a_i - b_i (two attacks' similarities on the same texts) with a percentile bootstrap
    95 % interval (the texts resampled)."""
    d = [x - y for x, y in zip(a, b)]
    return {"diff": round(sum(d) / len(d), 4), "ci": [round(v, 4) for v in evade_bench.similarity_interval(d, seed)]}


def similarity_steps(rows: list[dict], schemes: list[str], betas: list[float]) -> dict:
    """Paired similarity differences between consecutive beta0 (mildest first) measured with per-text values."""
    by = {(r["scheme"], r["beta0"]): r for r in rows}
    out = {}
    for s in schemes:
        bs = [b for b in sorted(betas, reverse=True) if by.get((s, b), {}).get("_sims")]
        out[s] = [{"from": a, "to": b, **paired_similarity_difference(by[(s, a)]["_sims"], by[(s, b)]["_sims"])}
                  for a, b in zip(bs, bs[1:])]
    return out


def choose_beta0(rows: list[dict], schemes: list[str], target: float = TARGET) -> dict:
    """The least negative beta0 whose evasion rate is >= ``target`` on every scheme in ``schemes`` (point
    estimates), among the beta0 measured on all of them. ``beta0`` is None when none reaches it."""
    by = {(r["scheme"], r["beta0"]): r for r in rows}
    complete = sorted({b for _, b in by if all((s, b) in by for s in schemes)}, reverse=True)
    for b in complete:
        if all(by[(s, b)]["evasion"] >= target for s in schemes):
            return {"beta0": b, "target": target, "measured_beta0": complete,
                    "evasion": {s: by[(s, b)]["evasion"] for s in schemes},
                    "evasion_wilson_low": {s: by[(s, b)]["evasion_ci"][0] for s in schemes},
                    "similarity": {s: by[(s, b)]["similarity"] for s in schemes}}
    return {"beta0": None, "target": target, "measured_beta0": complete}


def sweep_gates(rows: list[dict], schemes: list[str], betas: list[float], choice: dict, calibration) -> list[dict]:
    by = {(r["scheme"], r["beta0"]): r for r in rows}
    full = all((s, b) in by for s in schemes for b in betas)
    gates = [gate(f"some beta0 reaches evasion >= {choice['target']:.2f} on every scheme", choice["beta0"] is not None,
                  measured=choice.get("beta0"), precondition=bool(choice["measured_beta0"]),
                  reason="no beta0 was measured on every scheme")]
    with_texts = [b for b in sorted(betas, reverse=True) if all(by.get((s, b), {}).get("_sims") for s in schemes)]
    ends = (with_texts[0], with_texts[-1]) if len(with_texts) >= 2 else None
    diffs = {s: paired_similarity_difference(by[(s, ends[0])]["_sims"], by[(s, ends[1])]["_sims"])
             for s in schemes} if ends else None
    gates.append(gate(
        "a stronger bias costs similarity: the mildest minus the strongest beta0 with per-text values, paired "
        "bootstrap 95 % interval above 0 on every scheme",
        lambda: all(d["ci"][0] > 0 for d in diffs.values()),
        measured=None if not ends else {"beta0": list(ends), **diffs},
        precondition=ends is not None, reason="fewer than two beta0 with per-text similarities on every scheme"))
    cal = None if calibration is None else calibration.get("beta0")
    gates.append(gate("the calibrated beta0 equals the curve's choice", lambda: cal == choice["beta0"],
                      measured={"calibrated": cal, "curve": choice["beta0"]},
                      precondition=cal is not None and choice["beta0"] is not None and full,
                      reason="the calibration or a complete curve reaching the target is missing"))
    return gates


def plot(rows: list[dict], path: Path, choice: dict, calibration) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.6))
    for scheme, colour in zip(sorted({r["scheme"] for r in rows}), ["tab:blue", "tab:orange", "tab:green", "tab:red"]):
        rs = [r for r in rows if r["scheme"] == scheme]
        xs, ys = [r["similarity"] for r in rs], [r["evasion"] for r in rs]
        # max(0, .): a Wilson bound at a rate of 1 can sit a rounding error below the rate
        xerr = [[max(0.0, r["similarity"] - (r["similarity_ci"] or [r["similarity"]] * 2)[0]) for r in rs],
                [max(0.0, (r["similarity_ci"] or [r["similarity"]] * 2)[1] - r["similarity"]) for r in rs]]
        yerr = [[max(0.0, r["evasion"] - r["evasion_ci"][0]) for r in rs],
                [max(0.0, r["evasion_ci"][1] - r["evasion"]) for r in rs]]
        ax.errorbar(xs, ys, xerr=xerr, yerr=yerr, fmt="o-", color=colour, capsize=3, label=scheme)
        for r in rs:
            ax.annotate(f"β0 {r['beta0']:g}" + ("*" if r["source"] != "sweep" else ""), (r["similarity"], r["evasion"]), textcoords="offset points",
                        xytext=(5, -12 if scheme == "unigram" else 6), fontsize=8, color=colour)
    ax.axhline(choice["target"], color="grey", ls=":", lw=1, label=f"evasion {choice['target']:.2f}")
    ax.set_xlabel("similarity to the watermarked text (MiniLM cosine, mean, bootstrap 95 %)")
    ax.set_ylabel("evasion rate (Wilson 95 %)")
    if any(r["source"] != "sweep" for r in rows):
        ax.text(0.99, 0.02, "* from the main run (no similarity interval)", transform=ax.transAxes, ha="right",
                fontsize=7)
    cal = "not measured" if calibration is None else f"{calibration['beta0']:g}"
    ax.set_title(f"BIRA beta0 sweep, SmolLM2-135M rewriter (calibrated beta0: {cal})", fontsize=10)
    ax.legend(fontsize=8, loc="lower left")
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


def consistency_with_main(records: list[dict], main_json: Path) -> dict:
    """Whether the sweep's watermarked texts match the main run's: first text and mean detector score of
    the "none" row per scheme (the main run stores only those)."""
    if not main_json.is_file():
        return {}
    main = {(r["scheme"], r["attack"]): r for r in json.loads(main_json.read_text())["summary"]}
    out = {}
    for r in records:
        m = main.get((r["scheme"], "none"))
        if r["attack"] == "none" and m is not None:
            out[r["scheme"]] = {"same_first_text": r["example"] == m["example"],
                                "mean_score": round(r["mean_score"], 3), "main_mean_score": round(m["mean_score"], 3)}
    return out


def _f(x, d=3):
    return "" if x is None else f"{x:.{d}f}"


def _ci(c, d=2):
    return "" if not c else f"[{c[0]:.{d}f}, {c[1]:.{d}f}]"


def summarize(args, runs: dict, command: str) -> dict:
    from llmtool.core.console import markdown_table

    meta, records = runs["meta"], runs["summary"]
    rebuilt = "--summarize-only" in command.split()
    if rebuilt:
        command = " ".join(w for w in command.split() if w != "--summarize-only")
    main_json = RESULTS / "evade.json"
    same = consistency_with_main(records, main_json)
    rows = curve_rows(records)
    if not args.no_fill and main_json.is_file():
        rows = fill_from_main(rows, json.loads(main_json.read_text())["summary"], same, args.schemes, args.betas)
    choice = choose_beta0(rows, args.schemes, args.target)
    cal = meta.get("calibration")
    gates = sweep_gates(rows, args.schemes, sorted(args.betas, reverse=True), choice, cal)
    none = {r["scheme"]: r for r in records if r["attack"] == "none"}
    doc = {"command": command, "rebuilt_with_summarize_only": rebuilt, "runs_command": "python benchmarks/evade.py " + " ".join(evade_argv(args)),
           "model": meta["model"], "n": meta["n"], "n_neg": meta["n_neg"], "max_new_tokens": meta["max_new_tokens"],
           "seed": meta["seed"], "schemes": args.schemes, "betas": sorted(args.betas, reverse=True),
           "target": args.target, "fpr_at_fixed_threshold": meta["fpr_at_fixed_threshold"],
           "calibration": cal, "choice": choice, "gates": gates,
           "curve": [{k: v for k, v in r.items() if k != "_sims"} for r in rows],
           "similarity_steps": similarity_steps(rows, args.schemes, args.betas),
           "unattacked": {s: {"ppl_median": r["ppl_median"], "mean_score": r["mean_score"]} for s, r in none.items()},
           "same_texts_as_main_run": same, "skipped": meta["skipped"], "stage_seconds": meta["stage_seconds"],
           "seconds_total": meta["seconds_total"], "torch_threads": meta["torch_threads"],
           "similarity_interval": f"percentile bootstrap 95 %, {evade_bench.BOOT_DRAWS} resamples of the texts",
           "rate_intervals": "Wilson 95 % over the n watermarked texts"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    if rows:
        plot(rows, out.with_suffix(".png"), choice, cal)
    table = markdown_table([{
        "scheme": r["scheme"], "β0": f"{r['beta0']:g}", "source": r["source"], "n": r["n"],
        "evasion [95% CI]": f"{r['evasion']:.2f} {_ci(r['evasion_ci'])}",
        "TPR@1%FPR [CI]": f"{r['tpr@1%']:.2f} {_ci(r['tpr@1%_ci'])}", "AUROC": _f(r["auroc"], 2),
        "sim [bootstrap CI]": f"{r['similarity']:.3f} {_ci(r['similarity_ci'], 3) or '(no per-text values)'}",
        "ppl (median)": _f(r["ppl_median"], 1), "self-BLEU": _f(r["self_bleu"]),
        "degenerate 1st try": _f(r["first_try_degenerate"], 2) or ("not recorded" if r["source"] != "sweep" else ""), "attempts": _f(r["mean_attempts"], 2),
        "degenerate final": _f(r["degenerate_final"], 2)} for r in rows],
        ["scheme", "β0", "source", "n", "evasion [95% CI]", "TPR@1%FPR [CI]", "AUROC", "sim [bootstrap CI]", "ppl (median)",
         "self-BLEU", "degenerate 1st try", "attempts", "degenerate final"]) if rows else "(no results)"
    expected = [f"{sc}/{attack_name(b)}" for b in sorted(args.betas, reverse=True) for sc in args.schemes] + \
        [evade_bench.CALIBRATE]
    not_run = [x for x in expected if x not in meta["stage_seconds"]]
    doc["stages_not_run"] = not_run
    out.with_suffix(".json").write_text(json.dumps(doc, indent=2))
    cal_txt = ("not measured (" + ("skipped: past --stop-at" if evade_bench.CALIBRATE in meta["skipped"] else
                                   "the run stopped before it") + ")") if cal is None else (
        f"beta0 = {cal['beta0']:g} ({cal['note']}; {cal['texts']} austen-test texts; cache "
        f"{'bypassed (cache off)' if cal.get('fresh') else 'used'}, read from cache: {cal['cached']}; "
        + ", ".join(f"beta {c['beta']:g}: {c['degenerate_rate']:.0%} degenerate"
                    + (" (significant)" if c["significant"] else "") for c in cal["curve"])
        + f"; {cal['seconds'] / 60:.1f} min)")
    ch = choice
    missing = [f"{b:g}" for b in sorted(args.betas, reverse=True) if b not in ch["measured_beta0"]]
    ch_txt = ("no beta0 reaches it on every scheme" if ch["beta0"] is None else
              f"**beta0 = {ch['beta0']:g}** (evasion " + ", ".join(
                  f"{s} {ch['evasion'][s]:.2f} (Wilson low {ch['evasion_wilson_low'][s]:.2f}), sim "
                  f"{ch['similarity'][s]:.3f}" for s in args.schemes) + ")")
    if missing:
        ch_txt += f"; **beta0 {', '.join(missing)} not measured on every scheme, so the choice is among the others**"
    same_txt = "; ".join(f"{s}: first text identical {v['same_first_text']}, mean score {v['mean_score']} "
                         f"(main run {v['main_mean_score']})" for s, v in same.items()) or "main run not found"
    unatt = "; ".join(f"{s} {v['ppl_median']:.1f}" for s, v in doc["unattacked"].items())
    partial = bool(not_run)
    md = (f"# BIRA beta0 sweep{' (PARTIAL: stages not run: ' + ', '.join(not_run) + ')' if partial else ''}\n\n"
          f"Command: `{command}`{' (tables rebuilt from the runs file with --summarize-only)' if rebuilt else ''}\n(runs `{doc['runs_command']}`; its own records in "
          f"`{out.name}_runs.json`)\n\n"
          f"Model {meta['model']} (generator, paraphraser, aux LM); {meta['n']} watermarked texts per scheme "
          f"(austen-test prompts of 30 words, {meta['max_new_tokens']} new tokens, seed {meta['seed']}: the prompts "
          f"and negatives of `benchmarks/results/evade.md`); {meta['n_neg']} human negatives. BIRA at a fixed beta0 "
          f"(passed explicitly), eta 1, q = 0, adaptive relaxation on degenerate outputs (max_iter = |beta0| + 1). "
          f"Rates with Wilson 95 % intervals over the n texts; sim = mean all-MiniLM-L6-v2 cosine to the "
          f"watermarked text with a percentile-bootstrap 95 % interval ({evade_bench.BOOT_DRAWS} resamples); ppl = "
          f"median perplexity under the unwatermarked model (unattacked texts: {unatt}); degenerate 1st try = share "
          f"of texts whose paraphrase at beta0 itself degenerated (then retried at beta0 + 1, ...). source = "
          f"sweep: measured by this run; main run: a (scheme, beta0) this run did not reach, taken from "
          f"`benchmarks/results/evade.json` (its bira-cal / bira-4 row: the same attack at that fixed beta0 on the "
          f"same watermarked texts; 2 torch threads, no per-text values, so no similarity interval).\n\n"
          f"Same texts as the main run: {same_txt}.\n\n"
          f"Calibration re-measured (library path of `evade attack --method bira` without --beta0): {cal_txt}.\n\n"
          f"Stages skipped at --stop-at: {', '.join(meta['skipped']) or 'none'}; stages of the sweep not run: "
          f"{', '.join(not_run) or 'none'}. Total {meta['seconds_total'] / 60:.1f} min, "
          f"{meta['torch_threads']} torch thread(s).\n\n" + table + "\n\n"
          "Similarity lost per step of beta0 (paired over the same texts, mean difference with a bootstrap 95 % "
          "interval; only beta0 with per-text values): " + ("; ".join(
              f"{sc} {st['from']:g} -> {st['to']:g}: {st['diff']:.3f} [{st['ci'][0]:.3f}, {st['ci'][1]:.3f}]"
              for sc, steps in doc["similarity_steps"].items() for st in steps) or "none") + ".\n\n"
          f"Default from the curve (least negative beta0 with evasion >= {ch['target']:.2f} on "
          f"{' and '.join(args.schemes)}): {ch_txt}.\n\n## Gates\n\n" + "\n".join(lines(gates)) + "\n\n"
          f"![evasion vs similarity]({out.name}.png)\n")
    out.with_suffix(".md").write_text(md)
    print(md)
    return doc


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=100)
    ap.add_argument("--n-neg", type=int, default=505)
    ap.add_argument("--max-new-tokens", type=int, default=80, help="80: the committed main run's setting")
    ap.add_argument("--schemes", nargs="+", default=["kgw", "unigram"])
    ap.add_argument("--betas", nargs="+", type=float, default=BETAS)
    ap.add_argument("--calib-texts", type=int, default=50)
    ap.add_argument("--target", type=float, default=TARGET, help="evasion level the default beta0 must reach")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--batch-size", type=int, default=16)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--stop-at", default=None, help="UTC HH:MM, passed to benchmarks/evade.py")
    ap.add_argument("--resume", action="store_true",
                    help="passed to benchmarks/evade.py: continue a stopped sweep from <out>_runs_state.json")
    ap.add_argument("--out", default=str(RESULTS / "evade_beta0"))
    ap.add_argument("--summarize-only", action="store_true", help="rebuild the outputs from <out>_runs.json")
    ap.add_argument("--no-fill", action="store_true",
                    help="do not complete beta0 the run did not reach with the main run's rows")
    args = ap.parse_args(argv)
    os.chdir(ROOT)
    for b in args.betas:
        if b > 0:
            ap.error("--betas must be <= 0")
    cmd = "python benchmarks/evade_sweep.py " + " ".join(argv if argv is not None else sys.argv[1:])
    runs_path = Path(args.out).with_name(Path(args.out).name + "_runs.json")
    if not args.summarize_only:
        rc = evade_bench.main(evade_argv(args))
        if rc:
            return rc
    summarize(args, json.loads(runs_path.read_text()), cmd.strip())
    return 0


if __name__ == "__main__":
    sys.exit(main())

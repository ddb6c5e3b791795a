"""SHIFT with RL across budgets (issue 42: "compare SHIFT with random, the coresets and RIRS at B = 7, 16, 32"):
one table and one plot from the reports that ``select_data_rl.py`` wrote for each budget, trains nothing.

    .venv/bin/python benchmarks/select_data_rl_budgets.py \\
        --tags select_data_rl_easy_w30_p8_b7,select_data_rl_easy_w30_p8,select_data_rl_easy_w30_p8_b32

Each tag is one budget's report (``benchmarks/results/TAG.json``). The reports must share the starting policy
(checksum) and every protocol setting except the ones that only change a selector's picks
(``select_data_rl.PICK_ONLY``: budget, feature tokens); otherwise the budgets are not one comparison and the
command exits 2. A tag whose report is missing exits 2 as well (a budget not yet run is left out of ``--tags``).

Per budget and selector: in-domain pass@1 (mean ± sd over seeds), Δ vs the starting policy (paired, seeds pooled)
and SHIFT − selector (seed-averaged per-item differences, bootstrap over test items), as each tag's report computed
them. The claim "SHIFT beats random" is judged per budget: met when SHIFT − random's interval lies above 0, not
met otherwise, and "not tested" while either arm has fewer than ``MIN_SEEDS`` training seeds at that budget.
Writes benchmarks/results/OUT.{json,md,png} (``--out``, default select_data_rl_budgets).
"""
from __future__ import annotations

import argparse
import json
import shlex
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
RESULTS = ROOT / "benchmarks" / "results"
from benchmarks.gates import gate, render

MIN_SEEDS = 3
# settings that change only which prompts a selector picks (as select_data_rl.PICK_ONLY; repeated here so this
# reader does not import the training script and its dependencies)
PICK_ONLY = ("budget", "feature_tokens")
CLAIM = "SHIFT − random > 0 in-domain (95 % CI above 0)"
# the other selectors' line colours: matplotlib's cycle without SHIFT's (C1) and the start line's grey (C7)
OTHER_COLOURS = ("C0", "C2", "C3", "C4", "C5", "C6", "C8", "C9")


def load(tags: list[str], results: Path | None = None) -> list[dict]:
    """Each tag's report, sorted by budget; a usage error (SystemExit with a one-line message) when a report is
    missing, two tags share a budget, or the reports differ in anything but the budget and feature tokens."""
    results, reps = results or RESULTS, []
    if not tags:
        raise SystemExit("error: --tags: no tag given")
    for t in tags:
        p = results / f"{t}.json"
        if "/" in t or not p.is_file():
            raise SystemExit(f"error: --tags: no report {t}.json in benchmarks/results")
        try:
            r = json.loads(p.read_text())
        except ValueError:
            r = {}
        if not isinstance(r, dict) or "settings" not in r or "arms" not in r:
            raise SystemExit(f"error: --tags: {t}.json is not a select_data_rl.py report")
        reps.append({"tag": t, **r})
    ref = reps[0]
    for r in reps[1:]:
        if r["start_checksum"] != ref["start_checksum"]:
            raise SystemExit(f"error: {r['tag']} starts from another policy than {ref['tag']} "
                             f"({r['start_checksum']} vs {ref['start_checksum']})")
        diff = sorted(k for k in set(r["settings"]) | set(ref["settings"])
                      if k not in PICK_ONLY and r["settings"].get(k) != ref["settings"].get(k))
        if diff:
            raise SystemExit(f"error: {r['tag']} and {ref['tag']} differ in {', '.join(diff)} (only the budget and "
                             "the feature tokens may differ)")
    budgets = [r["settings"]["budget"] for r in reps]
    if len(set(budgets)) < len(budgets):
        raise SystemExit(f"error: --tags: two reports share a budget ({budgets})")
    return sorted(reps, key=lambda r: r["settings"]["budget"])


def summarise(reps: list[dict]) -> dict:
    """Per budget: each selector's numbers (full pool and start as references) and the SHIFT-beats-random gate."""
    ref = reps[0]
    out = {"base": ref["base"], "full": ref["arms"].get("full"), "start_checksum": ref["start_checksum"],
           "budgets": {}, "gates": {}}
    for r in reps:
        b = r["settings"]["budget"]
        keys = ("seeds", "in_domain", "in_domain_sd", "per_seed_in_domain", "delta_vs_base", "delta_vs_base_ci95",
                "shift_minus", "shift_minus_ci95", "groups_with_variance", "generators_covered")
        arms = {k: {**{f: e.get(f) for f in keys}, "without_label_prior": e.get("without_label_prior")}
                for k, e in r["arms"].items() if k != "full"}
        out["budgets"][str(b)] = {"tag": r["tag"], "arms": arms}
        s, rnd = arms.get("shift"), arms.get("random")
        n = min(s["seeds"] if s else 0, rnd["seeds"] if rnd else 0)
        ci = rnd["shift_minus_ci95"] if n else None
        out["gates"][f"B = {b}: {CLAIM}"] = gate(
            CLAIM, lambda ci=ci: ci[0] > 0, None if not n else {"shift_minus_random": round(rnd["shift_minus"], 4),
                                                                "ci95": [round(x, 4) for x in ci]},
            precondition=n >= MIN_SEEDS,
            reason=f"the fewer of SHIFT's and random's training seeds at B = {b} is {n}, the claim needs {MIN_SEEDS}")
    return out


def _cell(e: dict | None) -> str:
    if not e:
        return "not run"
    sd = f" ± {e['in_domain_sd']:.3f}" if e.get("in_domain_sd") is not None else ""
    return f"{e['in_domain']:.3f}{sd} ({e['seeds']})"


def _ci(v, ci) -> str:
    return "" if v is None else f"{100 * v:+.1f} [{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"


def markdown(res: dict, command: str) -> str:
    budgets = list(res["budgets"])
    arms = list(dict.fromkeys(a for b in budgets for a in res["budgets"][b]["arms"]))
    full = res["full"]

    def table(title: str, cell, *, skip_shift: bool = False) -> list[str]:
        """One table: a row per selector, a column per budget; ``cell`` maps an arm's summary (or None) to text."""
        rows = [f"| {a} | " + " | ".join(cell(res["budgets"][b]["arms"].get(a)) for b in budgets) + " |"
                for a in arms if not (skip_shift and a == "shift")]
        return ["", title, "", "| selector | " + " | ".join(f"B = {b}" for b in budgets) + " |",
                "|---|" + "---|" * len(budgets), *rows]

    def shift_minus(e: dict | None) -> str:
        return _ci(e["shift_minus"], e["shift_minus_ci95"]) if e and e.get("shift_minus") is not None else "—"

    lines = ["# SHIFT with RL across budgets", "", f"Command: `{command}`", "",
             f"Starting policy {res['base']['in_domain']:.3f} in-domain (checksum {res['start_checksum']}); full pool "
             + (f"{full['in_domain']:.3f} ± {full['in_domain_sd'] or 0:.3f} ({full['seeds']} seeds), "
                f"Δ {_ci(full['delta_vs_base'], full['delta_vs_base_ci95'])} points." if full else "not run."),
             "Reports: " + ", ".join(f"B = {b}: `{res['budgets'][b]['tag']}`" for b in budgets) + "."]
    lines += table("In-domain greedy pass@1, mean ± sd over seeds (seeds):", _cell)
    lines += table("Δ vs the starting policy, points [95 % CI] (paired, seeds pooled):",
                   lambda e: _ci(e["delta_vs_base"], e["delta_vs_base_ci95"]) if e else "not run")
    lines += table("SHIFT − selector, points [95 % CI] (bootstrap over test items):", shift_minus, skip_shift=True)
    prior = [e["without_label_prior"] for b in budgets for e in res["budgets"][b]["arms"].values()
             if e.get("without_label_prior")]
    if prior:
        lines += table(f"SHIFT − selector without the label-prior generators ({prior[0]['n_items']} test items; "
                       "each report's sensitivity rows), points [95 % CI]:",
                       lambda e: shift_minus((e or {}).get("without_label_prior")), skip_shift=True)
    lines += ["", "Claim per budget:", ""] + [f"- {k}: {render(g)}" for k, g in res["gates"].items()]
    return "\n".join(lines) + "\n"


def plot(res: dict, path: Path) -> str | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return None
    budgets = [int(b) for b in res["budgets"]]
    arms = list(dict.fromkeys(a for b in res["budgets"].values() for a in b["arms"]))
    fig, ax = plt.subplots(figsize=(7.6, 4.0))
    for i, a in enumerate(arms):
        xs, ys, dots = [], [], []
        for b in budgets:
            e = res["budgets"][str(b)]["arms"].get(a)
            if e:
                xs.append(b)
                ys.append(100 * e["in_domain"])
                dots += [(b, 100 * v) for v in e["per_seed_in_domain"]]
        style = {"color": "C1", "lw": 2.5} if a == "shift" else {"color": OTHER_COLOURS[i % len(OTHER_COLOURS)], "lw": 1.2}
        ax.plot(xs, ys, "o-", label=a, **style)
        ax.plot([d[0] for d in dots], [d[1] for d in dots], ".", color=style["color"], alpha=0.4, ms=4)
    ax.axhline(100 * res["base"]["in_domain"], color="C7", ls="--", label="start (no RL)")
    if res["full"]:
        ax.axhline(100 * res["full"]["in_domain"], color="k", ls=":", label="full pool (350)")
    ax.set_xscale("log", base=2)
    ax.set_xticks(budgets, [str(b) for b in budgets])
    ax.set_xlabel("budget B (prompts)")
    ax.set_ylabel("in-domain greedy pass@1 (%)")
    ax.set_title("GRPO on each selector's B prompts (dots: seeds)")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path.name


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tags", required=True, help="comma list of select_data_rl.py tags, one per budget")
    ap.add_argument("--out", default="select_data_rl_budgets", help="output name under benchmarks/results")
    a = ap.parse_args(argv)
    if "/" in a.out or not a.out:
        ap.error("--out: a file name without a folder")
    try:
        reps = load([t for t in a.tags.split(",") if t])
    except SystemExit as e:
        print(e, file=sys.stderr)
        raise SystemExit(2) from None
    res = summarise(reps)
    res["command"] = shlex.join(["benchmarks/select_data_rl_budgets.py", *(sys.argv[1:] if argv is None else argv)])
    res["plot"] = plot(res, RESULTS / f"{a.out}.png")
    (RESULTS / f"{a.out}.json").write_text(json.dumps(res, indent=2, default=float))
    md = markdown(res, res["command"])
    (RESULTS / f"{a.out}.md").write_text(md)
    print(md)


if __name__ == "__main__":
    main()

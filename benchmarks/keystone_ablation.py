"""Keystone-neuron ablation with samples, probe sets and random seeds (issue 43: the committed ablation
was one measurement on four texts).

For each model, keystone sets are found (``rank_neurons``: worst-rank over probes, global scope, the seven
families, as ``llmtool edit keystone find``) from several probe sets:

- ``packaged``: the four packaged probes (math, code, knowledge, ...), the set behind the committed row;
- ``loo-i``: the packaged probes without probe i (the paper's claim is that a *few* prompts suffice, so
  dropping one should not move the set);
- ``austen-s``: four 128-token windows of austen-train drawn with seed s (one genre, no task mix).

Each set's top-k neurons are ablated and the model is scored on ``--windows`` held-out 256-token windows of
austen-test (BOS first where the tokenizer adds it) and on the four packaged evaluation texts. Controls:
``--random-controls`` equal-size random sets with the same family × layer histogram as the packaged set
(seeds 0..R-1). Reported per row: perplexity over all windows (token-weighted), the mean per-window log-ppl
increase over the unablated model with a percentile-bootstrap 95 % interval over windows, and for the
random controls the same over seeds (mean and max). Probe-set stability: Jaccard overlap of each set's
top-k with the packaged set's.

Gate (per model, k): "ablating the k keystones raises held-out perplexity at least 2x while no random
control raises it by 10 %": the claim's collapse direction. It can fail either way (weak keystones, as on
Gemma 3, or strong random sets); its precondition is only that the random controls ran.

    python benchmarks/keystone_ablation.py --models smollm2-135m,gemma3-270m --threads 1
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gates import gate, render  # noqa: E402

RESULTS = Path(__file__).parent / "results"
FAMILIES = ["q", "k", "v", "o", "gate", "up", "ffn"]


def window_nll(model, windows: torch.Tensor, batch: int) -> torch.Tensor:
    """[n] summed next-token NLL of each window (float64)."""
    from llmtool.core.lm import token_nll

    out = []
    for i in range(0, windows.shape[0], batch):
        out.append(token_nll(model, windows[i:i + batch]).double().sum(1))
    return torch.cat(out)


def jaccard(a, b) -> float:
    a, b = {n.key for n in a}, {n.key for n in b}
    return len(a & b) / max(1, len(a | b))


def summarize(nll: torch.Tensor, base: torch.Tensor, tokens: int, idx) -> dict:
    """Perplexity over all windows and the mean per-window log-ppl increase with its bootstrap CI."""
    from llmtool.core.intervals import bootstrap_mean_ci

    delta = ((nll - base) / tokens).numpy()
    lo, hi = bootstrap_mean_ci(delta, idx)
    return {"ppl": math.exp(float(nll.sum()) / (tokens * len(nll))), "dlogppl": float(delta.mean()),
            "dlogppl_lo": lo, "dlogppl_hi": hi}


def collapse_gate(name: str, k: int, base_ppl: float, keystone_ppl: float, random_ppls: list[float]) -> dict:
    """The claim's collapse direction: the keystones raise perplexity >= 2x, no random control by 10 %."""
    ratio = keystone_ppl / base_ppl
    rand_ratio = max(random_ppls) / base_ppl if random_ppls else None
    return gate(f"{name}, k = {k}: keystone ablation >= 2x held-out ppl, every random control < 1.1x",
                lambda: ratio >= 2.0 and rand_ratio < 1.1,
                {"keystone_ratio": round(ratio, 3), "max_random_ratio": None if rand_ratio is None else round(rand_ratio, 4)},
                precondition=bool(random_ppls), reason="no random control ran")


def run_model(name: str, args) -> dict:
    import numpy as np

    from llmtool.core.data import calibration_batches, tokenize
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.edit.keystone import (ablated, default_eval_texts, default_probes, matched_random, mean_ppl,
                                       probe_activations, rank_neurons)
    from llmtool.edit.prompts import bos_prefix

    path = resolve_model(name)
    tok, model = load_tokenizer(path), load_model(path)
    model.eval()
    bos = bos_prefix(tok)
    pre = torch.tensor(bos, dtype=torch.long)

    def with_bos(w: torch.Tensor) -> torch.Tensor:
        return torch.cat([pre.expand(w.shape[0], len(bos)), w], 1) if bos else w

    windows = with_bos(calibration_batches(tok, "austen-test", n=args.windows, seqlen=args.seqlen,
                                           seed=args.seed + 1000))
    tokens = windows.shape[1] - 1
    eval_ids = [torch.cat([pre, tokenize(tok, r["text"])]) for r in default_eval_texts()]
    packaged = [torch.cat([pre, tokenize(tok, r["text"])]) for r in default_probes()]
    probe_sets = {"packaged": packaged}
    for i in range(len(packaged)):
        probe_sets[f"loo-{i}"] = [p for j, p in enumerate(packaged) if j != i]
    for s in range(args.austen_probe_sets):
        probe_sets[f"austen-{s}"] = list(with_bos(calibration_batches(tok, "austen-train", n=len(packaged),
                                                                      seqlen=128, seed=args.seed + 2000 + s)))
    ks = [int(x) for x in args.k.split(",")]
    ranked = {}
    for pname, probes in probe_sets.items():
        acts = probe_activations(model, probes, FAMILIES)
        ranked[pname] = rank_neurons(acts, "worst-rank", "global", top=max(ks))
    rng = np.random.default_rng(args.seed)
    idx = rng.integers(0, windows.shape[0], size=(2000, windows.shape[0]))
    t0 = time.perf_counter()
    base = window_nll(model, windows, args.batch)
    base_row = {"model": name, "k": 0, "set": "none", **summarize(base, base, tokens, idx),
                "packaged_eval_ppl": mean_ppl(model, eval_ids)}
    rows, gates = [base_row], []
    for k in ks:
        for pname in probe_sets:
            neurons = ranked[pname][:k]
            with ablated(model, neurons):
                nll = window_nll(model, windows, args.batch)
                pe = mean_ppl(model, eval_ids)
            rows.append({"model": name, "k": k, "set": pname, **summarize(nll, base, tokens, idx),
                         "packaged_eval_ppl": pe, "jaccard_vs_packaged": jaccard(neurons, ranked["packaged"][:k]),
                         "families": ",".join(sorted({n.family for n in neurons}))})
            print(json.dumps(rows[-1]), flush=True)
        rand = []
        for s in range(args.random_controls):
            with ablated(model, matched_random(model, ranked["packaged"][:k], args.seed + s)):
                nll = window_nll(model, windows, args.batch)
                pe = mean_ppl(model, eval_ids)
            rand.append({**summarize(nll, base, tokens, idx), "packaged_eval_ppl": pe})
        rr = np.array([r["dlogppl"] for r in rand])
        rows.append({"model": name, "k": k, "set": f"random x{len(rand)}",
                     "ppl": float(np.mean([r["ppl"] for r in rand])), "ppl_max": max(r["ppl"] for r in rand),
                     "dlogppl": float(rr.mean()), "dlogppl_lo": float(rr.min()), "dlogppl_hi": float(rr.max()),
                     "packaged_eval_ppl": float(np.mean([r["packaged_eval_ppl"] for r in rand])),
                     "packaged_eval_ppl_max": max(r["packaged_eval_ppl"] for r in rand)})
        print(json.dumps(rows[-1]), flush=True)
        key = next(r for r in rows if r["k"] == k and r["set"] == "packaged")
        gates.append(collapse_gate(name, k, base_row["ppl"], key["ppl"], [r["ppl"] for r in rand]))
    return {"rows": rows, "gates": gates, "seconds": time.perf_counter() - t0,
            "top10_packaged": [list(n.key) for n in ranked["packaged"][:10]]}


def fmt(x, nd=3):
    return "" if x is None else (f"{x:.{nd}g}" if isinstance(x, float) else str(x))


def write(out: dict, tag: str) -> None:
    from llmtool.core.console import markdown_table

    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{tag}.json").write_text(json.dumps(out, indent=1))
    cfg = out["config"]
    lines = [f"# keystone ablation ({cfg['models']}; {cfg['windows']} held-out windows of {cfg['seqlen']} tokens "
             f"of austen-test, {cfg['random_controls']} random controls, seed {cfg['seed']})", "",
             "`dlogppl` = mean per-window increase of log-perplexity over the unablated model, 95 % bootstrap "
             "interval over windows (for the random row: mean, then min and max over the control seeds). "
             "`packaged_eval_ppl` = the committed metric (4 packaged texts). `jaccard` = overlap of the set's "
             "top-k with the packaged probes' top-k.", ""]
    for m in out["models"].values():
        table = [{"model": r["model"], "k": r["k"], "probe set": r["set"], "ppl": fmt(r["ppl"], 4),
                  "dlogppl [95 %]": f"{r['dlogppl']:+.3f} [{r['dlogppl_lo']:+.3f}, {r['dlogppl_hi']:+.3f}]",
                  "packaged_eval_ppl": fmt(r["packaged_eval_ppl"], 4)
                  + (f" (max {r['packaged_eval_ppl_max']:.4g})" if "packaged_eval_ppl_max" in r else ""),
                  "jaccard": fmt(r.get("jaccard_vs_packaged"), 2), "families": r.get("families", "")}
                 for r in m["rows"]]
        lines += [markdown_table(table), "", "Gates:", ""]
        lines += [f"- {g['gate']}: {render(g)}" for g in m["gates"]]
        lines += ["", f"{m['seconds']:.0f} s", ""]
    lines += ["Command:", "", "```", out["command"], "```", ""]
    (RESULTS / f"{tag}.md").write_text("\n".join(lines))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--models", default="smollm2-135m")
    ap.add_argument("--k", default="10,30")
    ap.add_argument("--windows", type=int, default=32)
    ap.add_argument("--seqlen", type=int, default=256)
    ap.add_argument("--austen-probe-sets", type=int, default=2)
    ap.add_argument("--random-controls", type=int, default=10)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--tag", default="keystone_ablation")
    args = ap.parse_args()
    from llmtool.core.job import apply_threads

    apply_threads(args.threads)
    out = {"config": vars(args), "command": "python benchmarks/keystone_ablation.py " + " ".join(sys.argv[1:]),
           "models": {}}
    for name in args.models.split(","):
        out["models"][name] = run_model(name, args)
        write(out, args.tag)
    print((RESULTS / f"{args.tag}.md").read_text())


if __name__ == "__main__":
    main()

"""Benchmark for `llmtool edit`: MEMIT and AlphaEdit with the backward (MEMIT spreading) and the
forward (FE replay) anchor on the default model and the packaged counterfactual edit set, at
several batch sizes, plus keystone-neuron ablation perplexity vs matched random neurons.

Targets are computed once per anchor on the unedited model (they do not depend on the solver or
on the other requests of the batch) and reused for every method and size, so each size's run is
exactly what `llmtool edit` would do on the first N requests.

    python benchmarks/edit.py                      # CPU defaults (sizes 1,4)
    python benchmarks/edit.py --sizes 1,10,100     # the issue's full grid (about 1.5 h on 2 CPU cores)
"""
from __future__ import annotations

import argparse
import copy
import json
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--edits", default="counterfact-smollm2")
    ap.add_argument("--sizes", default="1,4")
    ap.add_argument("--layers", default=None, help="edited layers (default: the model's preset)")
    ap.add_argument("--methods", default="memit,alphaedit")
    ap.add_argument("--v-steps", type=int, default=25)
    ap.add_argument("--mom2-samples", type=int, default=20000)
    ap.add_argument("--mom2-weight", type=float, default=None,
                    help="MEMIT's lambda on the key second moment (default: the model's preset, llmtool/edit/presets.py)")
    ap.add_argument("--tag", default="edit", help="results file stem (benchmarks/results/<tag>.json/.md)")
    ap.add_argument("--fluency-prompts", type=int, default=4)
    ap.add_argument("--fluency-tokens", type=int, default=30)
    ap.add_argument("--keystone-k", default="10,30")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    from llmtool.core.job import apply_threads

    apply_threads(args.threads)

    import llmtool.edit.alphaedit  # noqa: F401
    from llmtool.core.models import load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.edit.anchors import ZConfig
    from llmtool.edit.metrics import evaluate_requests
    from llmtool.edit.keystone import (ablated, default_eval_texts, default_probes, matched_random, mean_ppl,
                                       probe_activations, rank_neurons)
    from llmtool.core.data import tokenize
    from llmtool.edit.layerio import down_proj
    from llmtool.edit.memit import METHODS, EditConfig, compute_targets, edit_batch
    from llmtool.edit.requests import read_requests, resolve_requests
    from llmtool.edit.presets import preset_for
    from llmtool.edit.prompts import bos_prefix
    from llmtool.edit.run import prepare
    from llmtool.core.checkpoint import read_config

    set_seed(args.seed)
    sizes = [int(s) for s in args.sizes.split(",")]
    src = resolve_model(args.model)
    preset = preset_for(read_config(src))
    if args.mom2_weight is None:
        args.mom2_weight = preset.mom2_update_weight
    layers = [int(x) for x in args.layers.split(",")] if args.layers else list(preset.layers)
    tok, model = load_tokenizer(src), load_model(src)
    for p in model.parameters():
        p.requires_grad_(False)
    base = copy.deepcopy(model)
    reqs = read_requests(resolve_requests(args.edits))[:max(sizes)]
    zcfg = ZConfig(v_num_grad_steps=args.v_steps)
    cfg0 = EditConfig(layers=layers, z=zcfg)
    C, templates, fp = prepare(model, tok, src, cfg0, args.seed, "austen-train", args.mom2_samples)
    originals = {l: down_proj(model, l).weight.detach().clone() for l in layers}

    targets, z_time = {}, {}
    for anchor in ("backward", "forward"):
        t0 = time.perf_counter()
        targets[anchor], _ = compute_targets(model, tok, reqs, EditConfig(layers=layers, anchor=anchor, z=zcfg),
                                             templates)
        z_time[anchor] = time.perf_counter() - t0

    rows = [{"method": "unedited", "anchor": "-", "edits": n,
             **evaluate_requests(model, tok, reqs[:n], base, args.fluency_prompts, args.fluency_tokens)}
            for n in sizes]
    write = _writer(args, rows, fp, layers, preset, sizes, templates, bool(bos_prefix(tok)))
    for method in args.methods.split(","):
        for anchor in ("backward", "forward"):
            for n in sizes:
                cfg = EditConfig(layers=layers, method=method, anchor=anchor, z=zcfg, mom2_update_weight=args.mom2_weight)
                solvers = {l: METHODS.get(method)(C[l], cfg) for l in layers}
                prev = {l: torch.zeros_like(C[l], dtype=torch.float64) for l in layers}
                t0 = time.perf_counter()
                rep = edit_batch(model, tok, reqs[:n], cfg, templates, solvers, prev,
                                 targets={l: t[:n] for l, t in targets[anchor].items()})
                seconds = time.perf_counter() - t0 + z_time[anchor] * n / len(reqs)
                metrics = evaluate_requests(model, tok, reqs[:n], base, args.fluency_prompts, args.fluency_tokens)
                rows.append({"method": method, "anchor": anchor, "edits": n, **metrics,
                             "residual_ratios": [round(r["remaining_residual_ratio"], 3) for r in rep["layers"]],
                             "final_residual_ratio": rep["layers"][-1]["remaining_residual_ratio"],
                             "seconds": seconds})
                with torch.no_grad():
                    for l in layers:
                        down_proj(model, l).weight.copy_(originals[l])
                print(json.dumps({k: v for k, v in rows[-1].items() if not isinstance(v, list)}), flush=True)
                write([], 0, [], complete=False)

    # keystone ablation
    # a tokenizer that starts every text with BOS (Gemma) gets it here too, as its model always saw text
    bos = torch.tensor(bos_prefix(tok), dtype=torch.long)
    probe_ids = [torch.cat([bos, tokenize(tok, r["text"])]) for r in default_probes()]
    eval_ids = [torch.cat([bos, tokenize(tok, r["text"])]) for r in default_eval_texts()]
    fams = ["q", "k", "v", "o", "gate", "up", "ffn"]
    acts = probe_activations(model, probe_ids, fams)
    ranked = rank_neurons(acts, "worst-rank", "global", top=200)
    base_ppl = mean_ppl(model, eval_ids)
    key_rows = []
    for k in [int(x) for x in args.keystone_k.split(",")]:
        with ablated(model, ranked[:k]):
            kp = mean_ppl(model, eval_ids)
        rand = []
        for s in range(3):
            with ablated(model, matched_random(model, ranked[:k], args.seed + s)):
                rand.append(mean_ppl(model, eval_ids))
        key_rows.append({"k": k, "base_ppl": base_ppl, "keystone_ppl": kp, "random_ppl_mean": sum(rand) / 3,
                         "random_ppl_max": max(rand), "keystone_families": ",".join(
                             sorted({n.family for n in ranked[:k]}))})
    total = sum(int(a.shape[1] * a.shape[2]) for a in acts.values())

    write(key_rows, total, [n.key for n in ranked[:10]], complete=True)
    print((RESULTS / f"{args.tag}.md").read_text())


def _writer(args, rows, fp, layers, preset, sizes, templates, keystone_bos):
    """Writes benchmarks/results/<tag>.json/.md; called after every edit row (marked partial) and at the end."""
    from llmtool.core.console import markdown_table

    command = "python benchmarks/edit.py " + " ".join(sys.argv[1:])

    def write(key_rows, total, top, complete):
        out = {"model": args.model, "model_fingerprint": fp, "command": command, "args": vars(args),
               "complete": complete, "layers": layers, "preset": preset.name, "keystone_bos": keystone_bos,
               "templates": templates, "edit": rows, "keystone": key_rows, "keystone_candidates": total,
               "top_keystone": top}
        RESULTS.mkdir(parents=True, exist_ok=True)
        (RESULTS / f"{args.tag}.json").write_text(json.dumps(out, indent=1, default=str))
        cols = ["method", "anchor", "edits", "efficacy_success", "efficacy_accuracy", "generalization_success",
                "generalization_accuracy", "neighborhood_success", "specificity_kl", "top1_overlap", "top5_overlap",
                "fluency", "final_residual_ratio", "seconds"]
        md = ["# llmtool edit benchmark" + ("" if complete else " (PARTIAL: the run had not finished)"), "",
              f"Model `{args.model}`, edit set `{args.edits}`, layers {layers}, "
              f"λ = {args.mom2_weight:g}, key statistics from {args.mom2_samples} positions, sizes {sizes}, "
              f"seed {args.seed}. Command: `{command}`",
              "", markdown_table(rows, cols), "", "Remaining-residual ratio per edited layer:", "",
              markdown_table([{"method": r["method"], "anchor": r["anchor"], "edits": r["edits"],
                               "ratios": " ".join(map(str, r["residual_ratios"]))}
                              for r in rows if "residual_ratios" in r])]
        if key_rows:
            md += ["", f"## Keystone ablation ({total} candidate neurons; perplexity on 4 held-out texts"
                   + (", each text after BOS" if keystone_bos else "") + ")", "", markdown_table(key_rows)]
        (RESULTS / f"{args.tag}.md").write_text("\n".join(md) + "\n")
    return write


if __name__ == "__main__":
    main()

"""Benchmark for `llmtool edit keystone finetune`: SFT on a target task that updates only the
keystone neurons' parameters, against SFT of an equal-size random neuron set (same family × layer
histogram) and full SFT, on the default model. Reports held-out target-task loss (gain) and
perplexity on the packaged capability texts (retention), for each mode at each learning rate of a
small grid, and the best learning rate per mode by target loss.

    python benchmarks/keystone_sft.py                 # k=30, 64 steps, lr grid 1e-5,1e-4,1e-3
"""
from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

RESULTS = Path(__file__).parent / "results"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--k", type=int, default=30)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--batch-size", type=int, default=8)
    ap.add_argument("--lrs", default="1e-5,1e-4,1e-3")
    ap.add_argument("--modes", default="keystone,random,full")
    ap.add_argument("--threads", type=int, default=2, help="torch threads (the llmtool --threads policy)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default="keystone-sft")
    args = ap.parse_args()
    from llmtool.core.job import apply_threads

    apply_threads(args.threads)

    from llmtool.core.console import markdown_table
    from llmtool.core.data import tokenize
    from llmtool.core.models import load_model, load_tokenizer, resolve_model, set_seed
    from llmtool.edit.keystone import (default_eval_texts, default_probes, matched_random, probe_activations,
                                       rank_neurons)
    from llmtool.edit.keystone_sft import SFTConfig, arithmetic_task, encode_examples, finetune, task_metrics

    set_seed(args.seed)
    src = resolve_model(args.model)
    tok, model = load_tokenizer(src), load_model(src)
    pad = tok.pad_token_id or 0
    acts = probe_activations(model, [tokenize(tok, r["text"]) for r in default_probes()],
                             ["q", "k", "v", "o", "gate", "up", "ffn"])
    keystone = rank_neurons(acts, "worst-rank", "global", top=args.k)[:args.k]
    random_set = matched_random(model, keystone, args.seed)
    task = arithmetic_task(256 + 64, args.seed)
    train_rows, held = task[:-64], encode_examples(tok, task[-64:])
    retention_ids = [tokenize(tok, r["text"]) for r in default_eval_texts()]
    base = task_metrics(model, held, retention_ids, pad)
    original = {k: v.detach().clone() for k, v in model.state_dict().items()}

    rows = []
    for mode in args.modes.split(","):
        for lr in [float(x) for x in args.lrs.split(",")]:
            cfg = SFTConfig(lr=lr, max_steps=args.steps, batch_size=args.batch_size, seed=args.seed)
            t0 = time.perf_counter()
            res = finetune(model, tok, train_rows, cfg, mode, keystone if mode == "keystone" else random_set)
            seconds = time.perf_counter() - t0
            after = task_metrics(model, held, retention_ids, pad)
            rows.append({"mode": mode, "lr": lr, "trainable_parameters": res["trainable_parameters"],
                         "target_loss_before": base["target_loss"], "target_loss_after": after["target_loss"],
                         "retention_ppl_before": base["retention_ppl"], "retention_ppl_after": after["retention_ppl"],
                         "seconds": seconds})
            print(json.dumps(rows[-1]), flush=True)
            model.load_state_dict(original)
    best = [min((r for r in rows if r["mode"] == m), key=lambda r: r["target_loss_after"])
            for m in args.modes.split(",")]
    out = {"model": args.model, "args": vars(args), "keystone": [n.key for n in keystone], "rows": rows, "best": best}
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{args.tag}.json").write_text(json.dumps(out, indent=1))
    md = ["# keystone fine-tuning benchmark", "",
          f"Model `{args.model}`, target task: two-number addition (256 train / 64 held-out examples), "
          f"k = {args.k} neurons, {args.steps} steps of batch {args.batch_size}, seed {args.seed}. Retention: "
          f"perplexity on the 4 packaged capability texts. Command: `python benchmarks/keystone_sft.py --steps {args.steps}`", "",
          "Best learning rate per mode (lowest held-out target loss):", "", markdown_table(best), "",
          "All runs:", "", markdown_table(rows)]
    (RESULTS / f"{args.tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()

"""Benchmark of `llmtool kvcache` on the default model (SmolLM2-135M-Instruct), same data and seed
for every method.

1. Decode perplexity on real text (austen-test): prefill ``--prefix`` tokens, compress, then
   teacher-force ``--continuation`` tokens through the compressed cache (chunked exactly, see
   ``pipeline.exact_chunk``). Methods: full cache; snapkv / pyramidkv / adakv with and without
   ``--critical`` at each budget; KIVI and PatternKV at 2 and 4 bits (G = R = 64). One uncompressed
   prefill per sequence is shared by all methods (compression only affects later tokens).
   "Compression loss" = NLL increase over the full cache.
2. Needle retrieval (niah_single, question-agnostic) at ``--lengths`` with ``--samples`` seeded
   samples, at budget ``--niah-budget``, for full / snapkv / adakv +- critical and KIVI / PatternKV 2-bit.
KV bytes are the bytes the cache really holds after the run; decode tok/s is timed over a few greedy
single-token steps on the compressed cache.

    python benchmarks/kvcache.py                       # defaults (about 15 min on 2 shared cores)
    python benchmarks/kvcache.py --sequences 8 --lengths 1024,2048 --samples 20   # bigger run
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from llmtool.core.console import markdown_table  # noqa: E402


@torch.no_grad()
def greedy_after(model, cache, question, steps, eos):
    """Question-agnostic: append the question to the compressed cache, then greedy-decode."""
    from llmtool.kvcache.cache import attach
    from llmtool.kvcache.pipeline import greedy_decode

    with attach(model):
        logits = model(input_ids=question, cache=cache, use_cache=True).logits[:, -1]
        t0 = time.perf_counter()
        out, forwards = greedy_decode(model, cache, logits, steps, eos)
        rate = max(1, forwards) / (time.perf_counter() - t0)
    return out, rate


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--data", default="austen-test")
    ap.add_argument("--prefix", type=int, default=512)
    ap.add_argument("--continuation", type=int, default=128)
    ap.add_argument("--sequences", type=int, default=2)
    ap.add_argument("--budgets", default="0.1,0.2,0.5")
    ap.add_argument("--lengths", default="512")
    ap.add_argument("--samples", type=int, default=2)
    ap.add_argument("--niah-budget", type=float, default=0.2)
    ap.add_argument("--speed-steps", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results" / "kvcache"))
    ap.add_argument("--threads", type=int, default=2, help="torch CPU threads (the measured runs used 2).")
    args = ap.parse_args()

    from llmtool.core.job import apply_threads

    apply_threads(args.threads)
    from llmtool.core.data import load_text, tokenize, tokenize_prompt
    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.kvcache import tasks
    from llmtool.kvcache.pipeline import (KVSpec, cache_from_prefill, capture_prefill, continue_nll, exact_chunk,
                                          full_cache_bytes)

    set_seed(args.seed)
    model, tok = load_model(args.model), load_tokenizer(args.model)
    budgets = [float(b) for b in args.budgets.split(",")]
    specs = [KVSpec()]
    for b in budgets:
        for ev in ("snapkv", "pyramidkv", "adakv"):
            specs += [KVSpec(evict=ev, budget=b), KVSpec(evict=ev, budget=b, critical=True)]
    for bits in (2, 4):
        for q in ("kivi", "patternkv"):
            specs.append(KVSpec(quant=q, bits=bits, group_size=64, residual_length=64, seed=args.seed))

    ids = tokenize(tok, load_text(args.data))
    span = args.prefix + args.continuation
    acc = {s.label(): {"nll": 0.0, "tokens": 0, "kv_bytes": 0, "full_kv_bytes": 0, "tok_s": []} for s in specs}
    t_start = time.perf_counter()
    for i in range(args.sequences):
        seq = ids[i * span:(i + 1) * span][None]
        state = capture_prefill(model, seq[:, :args.prefix])
        with torch.no_grad():
            first = model(input_ids=seq[:, :args.prefix]).logits[:, -1]
        for spec in specs:
            cache = cache_from_prefill(model, state, spec)
            nll, n, rate = continue_nll(model, cache, seq[0, args.prefix:], first,
                                        exact_chunk(spec, args.prefix, args.continuation),
                                        speed_steps=args.speed_steps if i == 0 else 0)
            a = acc[spec.label()]
            a["nll"] += nll
            a["tokens"] += n
            a["kv_bytes"] += cache.held_bytes()
            a["full_kv_bytes"] += full_cache_bytes(model, cache.get_seq_length())
            if not math.isnan(rate):
                a["tok_s"].append(rate)
            print(f"[seq {i}] {spec.label():28s} nll/tok={nll / n:.4f} kv={cache.held_bytes()}", flush=True)
    full_nll = acc["full"]["nll"] / acc["full"]["tokens"]
    ppl_rows = []
    for spec in specs:
        a = acc[spec.label()]
        mean = a["nll"] / a["tokens"]
        ppl_rows.append({
            "method": spec.label(), "evict": spec.evict, "critical": spec.critical,
            "budget": spec.budget if spec.evict != "none" else "", "quant": spec.quant,
            "bits": spec.bits if spec.quant != "none" else "",
            "decode_ppl": math.exp(mean), "nll_increase": mean - full_nll,
            "kv_MB": a["kv_bytes"] / args.sequences / 2**20, "kv_fraction": a["kv_bytes"] / a["full_kv_bytes"],
            "decode_tok_s": sum(a["tok_s"]) / len(a["tok_s"]) if a["tok_s"] else float("nan"),
        })

    # --- needle retrieval -----------------------------------------------------------------------------
    nb = args.niah_budget
    niah_specs = [KVSpec(), KVSpec(evict="snapkv", budget=nb), KVSpec(evict="snapkv", budget=nb, critical=True),
                  KVSpec(evict="adakv", budget=nb), KVSpec(evict="adakv", budget=nb, critical=True),
                  KVSpec(quant="kivi", bits=2), KVSpec(quant="patternkv", bits=2, seed=args.seed)]
    niah_rows = []
    for length in [int(x) for x in args.lengths.split(",")]:
        samples = tasks.make_samples("niah_single", tok, length, args.samples, seed=args.seed)
        states = [capture_prefill(model, tokenize_prompt(tok, s.context)[None]) for s in samples]
        questions = {id(s): tokenize(tok, "\n\n" + s.question)[None] for s in samples}
        for spec in niah_specs:
            score, kv, full, rates = 0.0, 0, 0, []
            for s, state in zip(samples, states):
                cache = cache_from_prefill(model, state, spec)
                text, rate = greedy_after(model, cache, questions[id(s)], 8, tok.eos_token_id)
                score += tasks.score(tok.decode(text, skip_special_tokens=True), s.answers)
                kv, full = kv + cache.held_bytes(), full + full_cache_bytes(model, cache.get_seq_length())
                rates.append(rate)
            niah_rows.append({"length": length, "method": spec.label(), "accuracy": 100 * score / len(samples),
                              "samples": len(samples), "kv_fraction": kv / full,
                              "decode_tok_s": sum(rates) / len(rates)})
            print(f"[niah {length}] {spec.label():28s} acc={100 * score / len(samples):.0f}", flush=True)

    elapsed = time.perf_counter() - t_start
    settings = {k: v for k, v in vars(args).items() if k != "out"}
    result = {"settings": settings, "protocol": "question-agnostic; decode ppl chunked-exact teacher forcing",
              "decode_ppl": ppl_rows, "niah": niah_rows, "seconds": elapsed,
              "machine": f"{os.cpu_count()} CPU threads visible, torch threads 2, shared with other jobs"}
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(result, indent=2) + "\n")
    cmd = "python benchmarks/kvcache.py" + "".join(
        f" --{k.replace('_', '-')} {v}" for k, v in settings.items() if v != ap.get_default(k))
    md = [f"Command: `{cmd}` (model {args.model}, data {args.data}, prefix {args.prefix} + continuation "
          f"{args.continuation}, {args.sequences} sequences, seed {args.seed}; {elapsed / 60:.1f} min)", "",
          "Decode perplexity under compressed caches:", "",
          markdown_table(ppl_rows, ["method", "decode_ppl", "nll_increase", "kv_MB", "kv_fraction", "decode_tok_s"]),
          "", f"Needle retrieval (niah_single, question-agnostic, budget {nb}):", "",
          markdown_table(niah_rows, ["length", "method", "accuracy", "samples", "kv_fraction", "decode_tok_s"]), ""]
    out.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))


if __name__ == "__main__":
    main()

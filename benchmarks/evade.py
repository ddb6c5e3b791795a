"""Benchmark for `llmtool evade`: detection before and after each attack, per watermark scheme,
with semantic similarity and perplexity, on the packaged default model.

Setup (defaults, CPU-sized): generator = paraphraser = aux LM = SmolLM2-135M-Instruct (the only
packaged model family; the spec's CPU plan uses SmolLM2-360M as rewriter, not available here);
prompts = first 30 words of N = 10 Austen paragraphs (llmtool.evade.prompts), 80 new tokens, T 0.7,
top-p 0.9, no-repeat-ngram 4; negatives for TPR@FPR thresholds = the human continuations of the
same paragraphs (their next 80 words) scored by the same detector; schemes KGW, Unigram, EXP (DiPmark with --schemes ... dip); attacks: none, vanilla
paraphrase (beta 0), BIRA (beta0 -4, eta 1, q 0), word deletion 0.3, embedding-neighbour synonym
substitution 0.5, emoji attack. Similarity = all-MiniLM-L6-v2 cosine to the watermarked text;
ppl = median per-text perplexity under the (unwatermarked) default model.

    python benchmarks/evade.py                      # defaults (~15 min on 2 idle CPU cores)
    python benchmarks/evade.py --n 100 --max-new-tokens 200 --seeds 0 1 2
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).resolve().parent / "results"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--n", type=int, default=10)
    ap.add_argument("--max-new-tokens", type=int, default=80)
    ap.add_argument("--schemes", nargs="+", default=["kgw", "unigram", "exp"])
    ap.add_argument("--attacks", nargs="+", default=["none", "vanilla", "bira", "word-delete", "synonym", "emoji"])
    ap.add_argument("--beta0", type=float, default=-4.0)
    ap.add_argument("--percentile", type=float, default=0.0)
    ap.add_argument("--seeds", type=int, nargs="+", default=[0])
    ap.add_argument("--batch-size", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=str(RESULTS / "evade"))
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)

    from llmtool.core.models import load_model, load_tokenizer, set_seed
    from llmtool.evade.attacks import ATTACKS, AttackContext
    from llmtool.evade.bira import BiraConfig
    from llmtool.evade.generation import DecodeConfig, generate_ids, scheme_decoding
    from llmtool.evade.metrics import detection_metrics, perplexity_of
    from llmtool.evade.paraphrase import Paraphraser
    from llmtool.evade.prompts import austen_prompts
    from llmtool.evade.similarity import SentenceEmbedder
    from llmtool.evade.watermarks import make_scheme

    t_start = time.time()
    tok, model = load_tokenizer(args.model), load_model(args.model)
    vocab = int(model.config.vocab_size)
    embedder = SentenceEmbedder()
    prompts = austen_prompts(args.n, prompt_words=30, human_words=args.max_new_tokens, seed=0)
    prompt_texts = [p["prompt"] for p in prompts]
    human = [p["human_text"] for p in prompts]
    prompt_ids = [tok(p, add_special_tokens=False)["input_ids"] for p in prompt_texts]

    def ids_of(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    records = []
    for seed in args.seeds:
        set_seed(seed)
        decode = DecodeConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size, seed=seed)
        plain = [tok.decode(o, skip_special_tokens=True) for o in generate_ids(model, tok, prompt_ids, [], decode)]
        para = Paraphraser(model, tok, DecodeConfig(max_new_tokens=args.max_new_tokens, batch_size=args.batch_size,
                                                    seed=seed, no_repeat_ngram_size=0))
        for name in args.schemes:
            scheme = make_scheme(name, vocab)
            dec = DecodeConfig(**{**decode.__dict__})
            if hasattr(scheme.config, "temperature"):
                dec.temperature = scheme.config.temperature
            t0 = time.time()
            marked = [tok.decode(o, skip_special_tokens=True) for o in
                      generate_ids(model, tok, prompt_ids, [scheme.processor()], dec, **scheme_decoding(scheme))]
            neg = [scheme.detect(ids_of(t)) for t in human]
            neg_scores = [d.score for d in neg]
            gen_neg = [scheme.detect(ids_of(t)) for t in plain]
            print(f"[seed {seed}] {name}: generated in {time.time() - t0:.0f}s", file=sys.stderr)
            for attack in ["unwatermarked-gen"] + args.attacks:
                t0 = time.time()
                extra = {}
                if attack == "unwatermarked-gen":
                    texts, dets = plain, gen_neg
                elif attack == "none":
                    texts = marked
                else:
                    ctx = AttackContext(paraphraser=para, bira=BiraConfig(args.beta0, 1.0, 0, args.percentile),
                                        seed=seed, generator=model, generator_tokenizer=tok, scheme=scheme,
                                        decode=DecodeConfig(**{**dec.__dict__, "no_repeat_ngram_size": 0}),
                                        prompts=prompt_texts)
                    res = ATTACKS.get(attack)(marked, ctx)
                    texts = [r["attacked_text"] or " " for r in res]
                    if "degenerated" in res[0]:
                        extra = {"degenerate_rate": statistics.fmean(r["degenerated"] for r in res),
                                 "mean_attempts": statistics.fmean(r["iterations"] for r in res),
                                 "mean_beta_final": statistics.fmean(r["beta_final"] for r in res)}
                if attack != "unwatermarked-gen":
                    dets = [scheme.detect(ids_of(t)) for t in texts]
                m = detection_metrics([d.score for d in dets], neg_scores, [d.is_watermarked for d in dets],
                                      scheme.score_kind)
                sims = embedder.similarity(marked, texts)
                ppl = perplexity_of(model, tok, texts)
                rec = {"seed": seed, "scheme": name, "attack": attack, **m,
                       "mean_score": statistics.fmean(d.score for d in dets),
                       "similarity": statistics.fmean(sims), "ppl_median": statistics.median(ppl),
                       "mean_tokens": statistics.fmean(len(ids_of(t)) for t in texts),
                       "seconds": time.time() - t0, **extra,
                       "example": texts[0][:300]}
                records.append(rec)
                print(f"  {attack:18s} detect={m['detect_rate']:.2f} tpr@1%={m['tpr@fpr=0.01']:.2f} "
                      f"auroc={m['auroc']:.2f} sim={rec['similarity']:.2f} ppl={rec['ppl_median']:.1f} "
                      f"({rec['seconds']:.0f}s)", file=sys.stderr)

            write_results(args, argv, records, t_start)
    return 0


def write_results(args, argv, records, t_start) -> None:
    """Aggregate over seeds (mean; sd when more than one seed) and write JSON + markdown."""
    from llmtool.core.console import markdown_table

    done = [s for s in args.schemes if any(r["scheme"] == s for r in records)]
    rows = []
    keys = ["detect_rate", "asr", "tpr@fpr=0.01", "tpr@fpr=0.1", "auroc", "f1_best", "mean_score", "similarity",
            "ppl_median", "mean_tokens"]
    for name in done:
        for attack in ["unwatermarked-gen"] + args.attacks:
            group = [r for r in records if r["scheme"] == name and r["attack"] == attack]
            if not group:
                continue
            row = {"scheme": name, "attack": attack}
            for k in keys:
                vals = [g[k] for g in group]
                row[k] = statistics.fmean(vals)
                if len(vals) > 1:
                    row[k + "_sd"] = statistics.stdev(vals)
            if "degenerate_rate" in group[0]:
                row["degenerate_rate"] = statistics.fmean(g["degenerate_rate"] for g in group)
                row["mean_attempts"] = statistics.fmean(g["mean_attempts"] for g in group)
            rows.append(row)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    meta = {"model": args.model, "n": args.n, "max_new_tokens": args.max_new_tokens, "seeds": args.seeds,
            "beta0": args.beta0, "eta": 1.0, "percentile": args.percentile, "negatives": "human Austen continuations",
            "fpr_note": f"with {args.n} negatives, FPR 1% and 10% thresholds are the "
                        f"{1 + int(0.01 * args.n)}-th and {1 + int(0.1 * args.n)}-th largest human score",
            "seconds_total": time.time() - t_start, "torch_threads": args.threads, "schemes_done": done}
    out.with_suffix(".json").write_text(json.dumps({"meta": meta, "summary": rows, "runs": records}, indent=2))
    cols = ["scheme", "attack", "detect_rate", "tpr@fpr=0.01", "tpr@fpr=0.1", "auroc", "mean_score", "similarity",
            "ppl_median", "degenerate_rate", "mean_attempts"]
    table = markdown_table(rows, cols)
    cmd = "python benchmarks/evade.py " + " ".join(argv if argv is not None else sys.argv[1:])
    out.with_suffix(".md").write_text(
        f"# evade benchmark\n\nCommand: `{cmd.strip()}`\n\n"
        f"Model {args.model} (generator, paraphraser and aux LM), {args.n} Austen prompts x {args.max_new_tokens} "
        f"new tokens, seeds {args.seeds}, BIRA beta0 {args.beta0}, eta 1, q {args.percentile}. detect_rate = "
        f"fraction flagged at the scheme's fixed threshold (1 - ASR); TPR thresholds from human continuations. "
        f"mean_score: z (kgw/unigram/dip) or p-value (exp). Total {meta['seconds_total'] / 60:.1f} min.\n\n"
        + table + "\n")
    print(table)


if __name__ == "__main__":
    sys.exit(main())

"""Causal tracing of MLP outputs at the subject's last token (the layer-choice argument of ROME/MEMIT),
used to choose the edited layers of a model without a measured preset (llmtool/edit/presets.py).

For each fact of an edit set (rewrite prompt, true object): run the clean prompt and record every layer's
down_proj output at the subject's last token; then corrupt the subject tokens' input embeddings with Gaussian
noise (``--noise`` × the std of the embedding table's output over the vocabulary, fixed seed) and, for each
layer l, run the corrupted prompt again with only layer l's down_proj output at the subject's last token
restored to its clean value (``--window`` consecutive layers centred on l when > 1). The indirect effect of
layer l is P(true object's first token | restored) − P(… | corrupted), averaged over facts and noise draws.
Prompts start with the tokenizer's BOS where it adds one (``edit.prompts``).

    python benchmarks/edit_trace.py --model gemma3-270m --edits counterfact-gemma3 --facts 40 --threads 1
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch

RESULTS = Path(__file__).parent / "results"


def subject_span_start(tok, prompt: str, subject: str, n_ids: int) -> int:
    """Index (in ``subject_last_index``'s ids, BOS included) of the subject's first token."""
    from llmtool.edit.prompts import bos_prefix

    start = prompt.index("{}")
    text = prompt[:start] + subject + prompt[start + 2:]
    enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
    first = min(i for i, (s, e) in enumerate(enc["offset_mapping"]) if e > start and e > s)
    assert len(enc["input_ids"]) + len(bos_prefix(tok)) == n_ids
    return first + len(bos_prefix(tok))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--edits", default="counterfact-smollm2")
    ap.add_argument("--facts", type=int, default=40, help="first N requests of the edit set")
    ap.add_argument("--noise-draws", type=int, default=3)
    ap.add_argument("--noise", type=float, default=3.0, help="noise std in units of the embedding std")
    ap.add_argument("--window", type=int, default=1, help="consecutive layers restored together")
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--tag", default=None)
    args = ap.parse_args()
    from llmtool.core.job import apply_threads

    apply_threads(args.threads)
    from llmtool.core.arch import decoder_layers
    from llmtool.core.console import markdown_table
    from llmtool.core.models import load_model, load_tokenizer, resolve_model
    from llmtool.edit.layerio import down_proj
    from llmtool.edit.prompts import encode, pad_batch, subject_last_index
    from llmtool.edit.requests import read_requests, resolve_requests

    t_start = time.perf_counter()
    src = resolve_model(args.model)
    tok, model = load_tokenizer(src), load_model(src)
    model.eval()
    reqs = read_requests(resolve_requests(args.edits))[:args.facts]
    n_layers = len(decoder_layers(model))
    emb = model.get_input_embeddings()
    with torch.no_grad():
        sample = torch.arange(0, emb.weight.shape[0], max(1, emb.weight.shape[0] // 4096))
        emb_std = float(emb(sample).float().std())
    g = torch.Generator().manual_seed(args.seed)
    half = args.window // 2
    effects = torch.zeros(n_layers)
    p_clean_all, p_corrupt_all, n = [], [], 0
    for r in reqs:
        ids, idx = subject_last_index(tok, r.prompt, r.subject)
        first = subject_span_start(tok, r.prompt, r.subject, len(ids))
        target = encode(tok, " " + r.target_true)[0]
        rows = n_layers + 1
        batch = pad_batch([ids] * rows, tok.pad_token_id or 0)
        with torch.no_grad():
            clean = {}
            hs = [down_proj(model, l).register_forward_hook(
                lambda m, i, o, l=l: clean.__setitem__(l, o[0, idx].detach().clone())) for l in range(n_layers)]
            p_clean = float(torch.softmax(model(**pad_batch([ids], tok.pad_token_id or 0)).logits[0, -1].float(), -1)[target])
            for h in hs:
                h.remove()
        for _ in range(args.noise_draws):
            noise = torch.randn(idx - first + 1, emb.weight.shape[1], generator=g) * args.noise * emb_std

            def corrupt(m, i, o, noise=noise):
                o = o.clone()
                o[:, first:idx + 1] += noise.to(o.dtype)
                return o

            def restore(m, i, o, l):
                o = o.clone()
                for row in range(n_layers):   # row `row` restores layers row-half .. row+half
                    if abs(row - l) <= half:
                        o[row, idx] = clean[l].to(o.dtype)
                return o

            hs = [emb.register_forward_hook(corrupt)]
            hs += [down_proj(model, l).register_forward_hook(lambda m, i, o, l=l: restore(m, i, o, l))
                   for l in range(n_layers)]
            try:
                with torch.no_grad():
                    probs = torch.softmax(model(**batch).logits[:, len(ids) - 1].float(), -1)[:, target]
            finally:
                for h in hs:
                    h.remove()
            p_corrupt = float(probs[-1])   # the last row restores nothing
            effects += probs[:n_layers] - p_corrupt
            p_clean_all.append(p_clean)
            p_corrupt_all.append(p_corrupt)
            n += 1
        print(f"{r.subject}: p_clean={p_clean:.3f}", file=sys.stderr, flush=True)
    effects /= max(n, 1)
    rows = [{"layer": l, "indirect_effect": round(float(effects[l]), 4)} for l in range(n_layers)]
    mean_clean, mean_corrupt = sum(p_clean_all) / n, sum(p_corrupt_all) / n
    order = sorted(range(n_layers), key=lambda l: -float(effects[l]))
    out = {"model": args.model, "edits": args.edits, "facts": len(reqs), "args": vars(args),
           "command": "python benchmarks/edit_trace.py " + " ".join(sys.argv[1:]),
           "embedding_std": emb_std, "p_clean_mean": mean_clean, "p_corrupt_mean": mean_corrupt,
           "layers": rows, "top5_layers": order[:5], "seconds": time.perf_counter() - t_start}
    tag = args.tag or f"edit-trace-{args.model}"
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / f"{tag}.json").write_text(json.dumps(out, indent=1))
    md = [f"# Causal tracing of MLP outputs at the subject's last token: `{args.model}`", "",
          f"Command: `{out['command']}`. {len(reqs)} facts of `{args.edits}` × {args.noise_draws} noise draws "
          f"(noise {args.noise} × embedding std {emb_std:.3g}), window {args.window}. Mean P(true object) clean "
          f"{mean_clean:.3f}, corrupted {mean_corrupt:.3f}. Indirect effect = P(restored) − P(corrupted).", "",
          markdown_table(rows), "", f"Largest effects at layers {order[:5]}.",
          f"{out['seconds']:.0f} s."]
    (RESULTS / f"{tag}.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    assert math.isfinite(float(effects.sum()))


if __name__ == "__main__":
    main()

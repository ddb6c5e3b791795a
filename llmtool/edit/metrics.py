"""Edit-quality metrics (the library behind ``llmtool evaluate edits OUT edits.jsonl``): how well an
edited checkpoint carries its edits. Imports nothing from the evaluate area.

Metrics (as in the forward-anchor spec §5; all in %, D_KL in nats):
* Efficacy: on the rewrite prompt, teacher forced. Success (ES) = mean-token NLL of target_new <
  that of target_true; Accuracy (EA) = every target_new token is the argmax.
* Generalization: the same on the paraphrase prompts (PS / PA).
* Specificity on neighbourhood prompts (other subjects, own true answer): NS = fraction with
  NLL(own answer) < NLL(target_new); neighbourhood accuracy = own answer argmax on every token;
  with the pre-edit model (``--base``, else the ``source`` recorded in OUT/llmtool.json):
  D_KL = mean KL(p_pre ‖ p_post) of the next-token distribution at the end of the prompt
  (probabilities floored at 1e-10) and Top-k = |top-k_pre ∩ top-k_post| / k for k = 1, 5, 10.
* Score = harmonic mean of ES, PS, NS.
* Fluency GE = mean over generations of (1/3)·H₂ + (2/3)·H₃ (base-2 n-gram entropies) of greedy
  continuations of the generation prompts (the filled rewrite prompt when a request has none),
  ×100 as in the MEMIT papers (they report it ×1 of entropy in bits ×100/100; we keep bits×100).
Prompts start with the tokenizer's BOS where it adds one (``prompts.encode_prompt``; Gemma).
"""
from __future__ import annotations

import math
from collections import Counter

import torch

from llmtool.core.console import progress
from llmtool.edit.prompts import encode, encode_prompt, pad_batch
from llmtool.edit.requests import EditRequest

TOPK = (1, 5, 10)


@torch.no_grad()
def pair_scores(model, tok, pairs: list[tuple[str, str]], chunk: int = 32) -> list[tuple[float, bool]]:
    """For each (prompt, target): mean-token NLL of " "+target after prompt, and whether every
    target token is the argmax (teacher forced)."""
    device = next(model.parameters()).device
    items = []
    for prompt, target in pairs:
        p, t = encode_prompt(tok, prompt), encode(tok, " " + target)
        items.append((p + t, len(p), t))
    out = []
    for s in range(0, len(items), chunk):
        group = items[s:s + chunk]
        batch = pad_batch([g[0] for g in group], tok.pad_token_id or 0, device)
        logp = torch.log_softmax(model(**batch).logits.float(), -1)
        for b, (ids, n_p, t) in enumerate(group):
            pos = torch.arange(n_p - 1, n_p - 1 + len(t), device=device)
            lp = logp[b, pos]
            tt = torch.tensor(t, device=device)
            nll = -lp.gather(-1, tt[:, None]).mean().item()
            out.append((nll, bool((lp.argmax(-1) == tt).all())))
    return out


def target_nll(model, tok, prompts: list[str], target: str) -> list[float]:
    return [n for n, _ in pair_scores(model, tok, [(p, target) for p in prompts])]


@torch.no_grad()
def next_token_logprobs(model, tok, prompts: list[str], chunk: int = 32) -> torch.Tensor:
    device = next(model.parameters()).device
    rows = []
    for s in range(0, len(prompts), chunk):
        seqs = [encode_prompt(tok, p) for p in prompts[s:s + chunk]]
        batch = pad_batch(seqs, tok.pad_token_id or 0, device)
        logits = model(**batch).logits.float()
        last = torch.tensor([len(x) - 1 for x in seqs], device=device)
        rows.append(torch.log_softmax(logits[torch.arange(len(seqs), device=device), last], -1).cpu())
    return torch.cat(rows) if rows else torch.zeros(0)


def ngram_entropy(tokens: list[str], n: int) -> float:
    grams = Counter(tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1))
    total = sum(grams.values())
    return -sum(c / total * math.log2(c / total) for c in grams.values()) if total else 0.0


def fluency(texts: list[str]) -> float:
    vals = [(ngram_entropy(t.split(), 2) / 3 + 2 * ngram_entropy(t.split(), 3) / 3) for t in texts]
    return 100 * sum(vals) / len(vals) if vals else float("nan")


@torch.no_grad()
def greedy_generations(model, tok, prompts: list[str], max_new_tokens: int) -> list[str]:
    device = next(model.parameters()).device
    out = []
    for p in prompts:
        ids = torch.tensor([encode_prompt(tok, p)], device=device)
        g = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=max_new_tokens, do_sample=False,
                           pad_token_id=tok.pad_token_id)
        out.append(tok.decode(g[0, ids.shape[1]:], skip_special_tokens=True))
    return out


def _pct(xs: list) -> float:
    return 100.0 * sum(xs) / len(xs) if xs else float("nan")


def evaluate_requests(model, tok, requests: list[EditRequest], base=None, fluency_prompts: int = 20,
                      fluency_tokens: int = 100) -> dict:
    """All metrics for ``model`` (edited) on ``requests``; ``base`` enables D_KL and Top-k."""
    rw_new = pair_scores(model, tok, [(r.filled(), r.target_new) for r in requests])
    with_true = [i for i, r in enumerate(requests) if r.target_true]
    rw_true = pair_scores(model, tok, [(requests[i].filled(), requests[i].target_true) for i in with_true])
    es = [rw_new[i][0] < t[0] for i, t in zip(with_true, rw_true)]
    para = [(p, r) for r in requests for p in r.paraphrase_prompts]
    pn = pair_scores(model, tok, [(p, r.target_new) for p, r in para])
    pt = pair_scores(model, tok, [(p, r.target_true) for p, r in para if r.target_true])
    pn_by = {id(x): s for x, s in zip(para, pn)}
    ps = [pn_by[id(x)][0] < t[0] for x, t in zip([x for x in para if x[1].target_true], pt)]
    neigh = [(p, a, r) for r in requests for p, a in r.neighborhood]
    nn = pair_scores(model, tok, [(p, r.target_new) for p, a, r in neigh])
    na = pair_scores(model, tok, [(p, a) for p, a, r in neigh])
    ns = [a[0] < n[0] for n, a in zip(nn, na)]
    res = {
        "requests": len(requests),
        "efficacy_success": _pct(es), "efficacy_accuracy": _pct([a for _, a in rw_new]),
        "generalization_success": _pct(ps), "generalization_accuracy": _pct([a for _, a in pn]),
        "neighborhood_success": _pct(ns), "neighborhood_accuracy": _pct([a for _, a in na]),
    }
    parts = [res["efficacy_success"], res["generalization_success"], res["neighborhood_success"]]
    res["score"] = (len(parts) / sum(1 / max(p, 1e-9) for p in parts)) if all(p == p for p in parts) else float("nan")
    if base is not None and neigh:
        prompts = [p for p, _, _ in neigh]
        post = next_token_logprobs(model, tok, prompts)
        pre = next_token_logprobs(base, tok, prompts)
        p_pre = pre.exp().clamp_min(1e-10)
        p_post = post.exp().clamp_min(1e-10)
        res["specificity_kl"] = float((p_pre * (p_pre.log() - p_post.log())).sum(-1).mean())
        for k in TOPK:
            a, b = pre.topk(k, -1).indices, post.topk(k, -1).indices
            inter = [len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(a, b)]
            res[f"top{k}_overlap"] = 100.0 * sum(inter) / len(inter)
    if fluency_prompts > 0 and requests:
        gp = []
        for r in requests:
            gp.extend(r.generation_prompts or [r.filled()])
        gp = gp[:fluency_prompts]
        res["fluency"] = fluency(greedy_generations(model, tok, list(progress(gp, "fluency generations")),
                                                    fluency_tokens))
    return res

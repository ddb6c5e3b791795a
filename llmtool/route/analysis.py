"""Routing quality on held-out single-domain sequences (FusionRoute, arXiv:2601.05106, §3.3 mask):
teacher-forced over gold responses, at the *informative* positions (the experts' greedy tokens
disagree), how often the routing head's argmax is the expert that matches the sequence's domain."""
from __future__ import annotations

from typing import Sequence

import torch

from llmtool.core.data import prompt_ids


@torch.no_grad()
def routing_quality(router, experts, vocab, tokenizer, rows: Sequence[dict], domain_to_expert: dict[str, int],
                    template: str = "chat", batch_size: int = 8) -> dict:
    from llmtool.route.losses import expert_stats, informative_mask, shift
    from llmtool.route.pipeline import render
    from llmtool.route.training import _pad

    dev = next(router.parameters()).device
    eos = tokenizer.eos_token_id
    hits = informative = positions = 0
    per: dict[str, list[int]] = {}
    rows = [r for r in rows if r.get("domain") in domain_to_expert and isinstance(r.get("response"), str)]
    for s in range(0, len(rows), batch_size):
        chunk = rows[s:s + batch_size]
        seqs, labs = [], []
        for r in chunk:
            p = prompt_ids(tokenizer, render(tokenizer, r["prompt"], template))
            c = tokenizer(r["response"], add_special_tokens=False)["input_ids"] + [eos]
            seqs.append(p + c)
            labs.append([-100] * len(p) + c)
        width = max(len(x) for x in seqs)
        ids = _pad(seqs, eos, width).to(dev)
        labels = _pad(labs, -100, width).to(dev)
        mask = _pad([[1] * len(x) for x in seqs], 0, width).to(dev)
        tgt, valid = shift(ids, labels)
        _, a = expert_stats(experts, vocab, ids, mask, tgt)
        m = informative_mask(a, valid).bool()
        _, w, _ = router(ids, attention_mask=mask, use_cache=False)
        k = w[:, :-1].argmax(-1)
        for b, r in enumerate(chunk):
            want = domain_to_expert[r["domain"]]
            h, n = int((k[b][m[b]] == want).sum()), int(m[b].sum())
            hits, informative, positions = hits + h, informative + n, positions + int(valid[b].sum())
            acc = per.setdefault(r["domain"], [0, 0])
            acc[0] += h
            acc[1] += n
    return {"matching_expert_rate": hits / informative if informative else None,
            "informative_fraction": informative / positions if positions else 0.0,
            "informative_positions": informative, "positions": positions,
            "per_domain": {d: (h / n if n else None) for d, (h, n) in per.items()}}

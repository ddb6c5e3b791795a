"""Batched generation with optional logits processors (watermarks, suppression biases), used for
the watermarked corpus, the paraphrase attacks and the emoji attack.

Decoding is :func:`llmtool.core.lm.generate` (left-padded batches, KV cache): sampling (temperature /
top-p) unless a scheme fixes the token itself (EXP: greedy after its processor) or owns the sampling
(DiPmark: temperature 1, no top-p, its processor applies its own temperature). Each batch is seeded with ``seed + batch index`` so a
run is reproducible and a single item can be regenerated.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DecodeConfig:
    max_new_tokens: int = 150
    temperature: float = 0.7
    top_p: float = 0.9
    no_repeat_ngram_size: int = 4
    batch_size: int = 16
    seed: int = 0


def generate_ids(model, tokenizer, prompt_ids: list[list[int]], processors: list | None = None,
                 decode: DecodeConfig | None = None, greedy: bool = False, plain_sampling: bool = False,
                 max_new_tokens: list[int] | None = None, batch_seed: int | None = None,
                 stop_ids: list[int] | None = None, description: str | None = None) -> list[list[int]]:
    """Continuation ids (prompt stripped, stopped at EOS or any of ``stop_ids``, stop token not included)
    for each prompt, decoded by :func:`llmtool.core.lm.generate` one batch at a time (so each batch gets
    its own seed and processors). ``processors`` is a list, or a callable ``(start, stop) -> list`` for
    per-item processors of the batch holding prompts ``start..stop-1``; ``no_repeat_ngram_size`` runs
    before them (as in transformers' own ordering). ``description`` shows progress over the batches (a bar in a
    terminal, a status line every 30 s otherwise) for callers that have no progress of their own."""
    from transformers import NoRepeatNGramLogitsProcessor

    from llmtool.core.lm import generate

    decode = decode or DecodeConfig()
    stops = set(stop_ids) if stop_ids else {tokenizer.eos_token_id}
    if greedy:
        sampling = dict(temperature=0.0)
    elif plain_sampling:
        sampling = dict(temperature=1.0, top_p=1.0, top_k=0)
    else:
        sampling = dict(temperature=decode.temperature, top_p=decode.top_p, top_k=0)
    outputs: list[list[int]] = []
    starts = range(0, len(prompt_ids), decode.batch_size)
    if description:
        from llmtool.core.console import progress

        starts = progress(starts, description)
    for start in starts:
        chunk = prompt_ids[start:start + decode.batch_size]
        budgets = [decode.max_new_tokens] * len(chunk) if max_new_tokens is None else \
            max_new_tokens[start:start + len(chunk)]
        chosen = processors(start, start + len(chunk)) if callable(processors) else processors
        procs = ([NoRepeatNGramLogitsProcessor(decode.no_repeat_ngram_size)] if decode.no_repeat_ngram_size else []) \
            + list(chosen or [])
        comps = generate(model, tokenizer, chunk, max_new_tokens=max(budgets), batch_size=len(chunk),
                         logits_processors=procs, seed=(decode.seed if batch_seed is None else batch_seed) + start,
                         **sampling)
        for (c,), limit in zip(comps, budgets):
            cut = c.token_ids[:limit]
            first = next((j for j, t in enumerate(cut) if t in stops), None)
            outputs.append(cut if first is None else cut[:first])
    return outputs


def scheme_decoding(scheme) -> dict:
    """How to decode after a scheme's processor (see module docstring)."""
    if scheme is None:
        return {}
    if getattr(scheme, "chooses_token", False):
        return {"greedy": True}
    if getattr(scheme, "owns_sampling", False):
        return {"plain_sampling": True}
    return {}

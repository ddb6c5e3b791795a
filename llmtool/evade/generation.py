"""Batched generation with optional logits processors (watermarks, suppression biases), used for
the watermarked corpus, the paraphrase attacks and the emoji attack.

Decoding: left-padded batches; sampling (temperature / top-p) unless a scheme fixes the token
itself (EXP: greedy after its processor) or owns the sampling (DiPmark: temperature 1, no top-p,
its processor applies its own temperature). Each batch is seeded with ``seed + batch index`` so a
run is reproducible and a single item can be regenerated.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch


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
                 stop_ids: list[int] | None = None) -> list[list[int]]:
    """Continuation ids (prompt stripped, stopped at EOS, EOS not included) for each prompt.
    ``processors`` is a list, or a callable ``(start, stop) -> list`` for per-item processors of the
    batch holding prompts ``start..stop-1``."""
    from transformers import LogitsProcessorList

    decode = decode or DecodeConfig()
    device = next(model.parameters()).device
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = list(stop_ids) if stop_ids else [tokenizer.eos_token_id]
    outputs: list[list[int]] = []
    for start in range(0, len(prompt_ids), decode.batch_size):
        chunk = prompt_ids[start:start + decode.batch_size]
        width = max(len(p) for p in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, p in enumerate(chunk):
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
        new_tokens = decode.max_new_tokens if max_new_tokens is None else \
            max(max_new_tokens[start:start + decode.batch_size])
        torch.manual_seed((decode.seed if batch_seed is None else batch_seed) + start)
        kwargs = dict(max_new_tokens=new_tokens, pad_token_id=pad, eos_token_id=eos,
                      no_repeat_ngram_size=decode.no_repeat_ngram_size or None)
        if greedy:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        elif plain_sampling:
            kwargs.update(do_sample=True, temperature=1.0, top_p=1.0, top_k=0)
        else:
            kwargs.update(do_sample=True, temperature=decode.temperature, top_p=decode.top_p, top_k=0)
        chosen = processors(start, start + len(chunk)) if callable(processors) else processors
        procs = LogitsProcessorList(chosen or [])
        with torch.no_grad():
            out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device),
                                 logits_processor=procs, **kwargs)
        for i in range(len(chunk)):
            cont = out[i, width:].tolist()
            limit = new_tokens if max_new_tokens is None else max_new_tokens[start + i]
            cut = [t for t in cont[:limit]]
            for j, t in enumerate(cut):
                if t in eos:
                    cut = cut[:j]
                    break
            outputs.append(cut)
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

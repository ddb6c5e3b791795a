"""Token NLL and batched generation, written once for every area.

- :func:`token_nll` — per-token negative log-likelihood of a batch (the building block of perplexity,
  completion scoring, judges and edit metrics).
- :func:`completion_nll` — summed NLL of each completion given its prompt, batched with right padding.
- :func:`generate` — batched sampling / greedy decoding on top of transformers' ``model.generate``
  (left padding, KV cache, user logits processors such as watermarks, stop strings, ``n`` samples per
  prompt, seeded). Returns :class:`Completion` objects per prompt.
- :func:`chat_prompt` — a user turn wrapped in the tokenizer's chat template when it has one.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch

from llmtool.core.console import progress


def _device(model) -> torch.device:
    return next(model.parameters()).device


def token_nll(model, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
              logits: torch.Tensor | None = None) -> torch.Tensor:
    """NLL of token ``t+1`` given tokens ``<= t``: shape ``[B, T-1]``, 0 where the target is masked.

    ``logits`` may be passed when the caller already has them (e.g. from a hooked forward)."""
    if input_ids.dim() == 1:
        input_ids = input_ids[None]
    if logits is None:
        dev = _device(model)
        with torch.no_grad():
            logits = model(input_ids=input_ids.to(dev),
                           attention_mask=None if attention_mask is None else attention_mask.to(dev),
                           use_cache=False).logits
    logits = logits[:, :-1].float()
    target = input_ids[:, 1:].to(logits.device)
    nll = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.size(-1)), target.reshape(-1),
                                            reduction="none").view(target.shape)
    if attention_mask is not None:
        nll = nll * attention_mask[:, 1:].to(nll.device, nll.dtype)
    return nll


def completion_nll(model, tokenizer, prompts: Sequence[str], completions: Sequence[str], batch_size: int = 8,
                   add_special_tokens: bool | None = None, desc: str | None = None) -> list[float]:
    """Summed NLL of ``completions[i]`` given ``prompts[i]`` (prompt and completion tokenized apart and
    concatenated, so the completion's tokens are exactly those of the completion string). Prompts are encoded
    by :func:`_encode_prompt` (BOS first where the tokenizer starts every text with one)."""
    if len(prompts) != len(completions):
        raise ValueError("prompts and completions differ in length")
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else 0
    pairs = []
    for p, c in zip(prompts, completions):
        pi = _encode_prompt(tokenizer, p, add_special_tokens)
        ci = tokenizer(c, add_special_tokens=False)["input_ids"]
        pairs.append((pi, ci))
    out: list[float] = []
    starts = range(0, len(pairs), batch_size)
    for s in (progress(starts, desc) if desc else starts):
        chunk = pairs[s:s + batch_size]
        width = max(len(p) + len(c) for p, c in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        target = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, (p, c) in enumerate(chunk):
            seq = p + c
            ids[i, :len(seq)] = torch.tensor(seq)
            mask[i, :len(seq)] = 1
            target[i, len(p):len(seq)] = 1
        nll = token_nll(model, ids, mask)
        out.extend((nll * target[:, 1:].to(nll.dtype)).sum(-1).tolist())
    return out


def _encode_prompt(tokenizer, text: str, add_special_tokens: bool | None) -> list[int]:
    """``None`` (the default): ``core.data.prompt_ids`` — no special tokens but the BOS a Gemma or Llama
    tokenizer starts every text with, never twice; ``True`` / ``False``: the tokenizer's own choice."""
    from llmtool.core.data import prompt_ids

    if add_special_tokens is None:
        return prompt_ids(tokenizer, text)
    return tokenizer(text, add_special_tokens=add_special_tokens)["input_ids"]


def chat_prompt(tokenizer, user: str, system: str | None = None) -> str:
    """``user`` as a chat turn with the generation prompt appended (plain text when no template)."""
    if getattr(tokenizer, "chat_template", None):
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": user}]
        return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    return (system + "\n\n" if system else "") + user


@dataclass
class Completion:
    text: str
    token_ids: list[int] = field(default_factory=list)
    prompt_tokens: int = 0
    finish: str = "length"  # "stop" (eos or stop string) or "length"


def _truncate_at_stop(text: str, stop: Sequence[str]) -> tuple[str, bool]:
    cut = min((i for i in (text.find(s) for s in stop) if i >= 0), default=-1)
    return (text[:cut], True) if cut >= 0 else (text, False)


@torch.no_grad()
def generate(model, tokenizer, prompts: Sequence[str] | Sequence[Sequence[int]], *, max_new_tokens: int = 64,
             temperature: float = 0.0, top_p: float = 1.0, top_k: int = 0, n: int = 1, batch_size: int = 8,
             logits_processors: Sequence = (), stop: Sequence[str] = (), seed: int | None = None,
             desc: str | None = None, add_special_tokens: bool | None = None) -> list[list[Completion]]:
    """``n`` completions for each prompt (text, or token ids). ``temperature == 0`` is greedy.

    Prompts are left-padded in batches of ``batch_size`` (each prompt's ``n`` samples share its batch
    row block); the KV cache is used; ``logits_processors`` (transformers ``LogitsProcessor`` objects)
    are applied after the model's logits; ``stop`` strings end a completion (the text is cut before
    the stop string). Text prompts are encoded by :func:`_encode_prompt` (BOS first where the tokenizer
    starts every text with one)."""
    from transformers import LogitsProcessorList

    if n < 1:
        raise ValueError("n must be >= 1")
    dev = _device(model)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    eos = tokenizer.eos_token_id
    encoded = [list(p) if not isinstance(p, str) else _encode_prompt(tokenizer, p, add_special_tokens)
               for p in prompts]
    if seed is not None:
        torch.manual_seed(seed)
    per_batch = max(1, batch_size // n) if n <= batch_size else 1
    results: list[list[Completion]] = []
    starts = range(0, len(encoded), per_batch)
    for s in (progress(starts, desc, total=len(starts)) if desc else starts):
        chunk = encoded[s:s + per_batch]
        width = max(len(e) for e in chunk)
        ids = torch.full((len(chunk), width), pad, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for i, e in enumerate(chunk):
            if e:
                ids[i, width - len(e):] = torch.tensor(e)
                mask[i, width - len(e):] = 1
        kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos,
                      num_return_sequences=n, logits_processor=LogitsProcessorList(list(logits_processors)))
        if temperature > 0:
            kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=top_k)
        else:
            kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        out = model.generate(input_ids=ids.to(dev), attention_mask=mask.to(dev), **kwargs)
        new = out[:, width:].cpu()
        for i, e in enumerate(chunk):
            comps = []
            for j in range(n):
                row = new[i * n + j].tolist()
                finish = "length"
                if eos is not None and eos in row:
                    row = row[:row.index(eos)]
                    finish = "stop"
                text = tokenizer.decode(row, skip_special_tokens=True)
                if stop:
                    text, hit = _truncate_at_stop(text, stop)
                    finish = "stop" if hit else finish
                comps.append(Completion(text=text, token_ids=row, prompt_tokens=len(e), finish=finish))
            results.append(comps)
    return results

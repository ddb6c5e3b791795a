"""Prompt construction for locate-then-edit: the subject's last-token index, the model-generated
context templates, and right-padded batches.

Lookup index: the filled prompt is tokenized once with character offsets; the index is the last
token whose span starts before the end of the subject (robust to tokenizers that merge the
leading space into the subject's first token). Tokenizers without offsets fall back to the
length of the tokenized prefix ending at the subject.

BOS: a tokenizer that puts a beginning-of-sequence token in front of every encoded text (Gemma, Llama 2/3;
``llmtool.core.data.scoring_bos``) belongs to a model that never saw a prompt without it, so every prompt
here (lookup sequences, rewriting prompts, metric prompts, template generation) starts with that BOS.
Measured on Gemma 3 270M: without it the top next token after "The novel Hamlet was written by" is
" him" (P(" William") < 0.03); with it, " William" at 0.66. Targets (``" " + target``) never get one.
Tokenizers that add none (SmolLM2, Qwen2.5) encode exactly as before.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch

TEMPLATE_STARTS = ("The", "Therefore", "Because", "I", "You")


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def bos_prefix(tok) -> list[int]:
    """``[bos_token_id]`` when the tokenizer starts every text with it, else ``[]``."""
    from llmtool.core.data import scoring_bos

    bos = scoring_bos(tok)
    return [] if bos is None else [bos]


def encode_prompt(tok, text: str) -> list[int]:
    """A prompt's ids as the model saw text in training: the text's ids after the tokenizer's BOS where it
    starts every text with one (``core.data.prompt_ids``, shared with generation and SFT)."""
    from llmtool.core.data import prompt_ids

    return prompt_ids(tok, text)


def subject_last_index(tok, prompt: str, subject: str) -> tuple[list[int], int]:
    """Token ids of ``prompt`` with its ``{}`` filled by ``subject``, and the index of the subject's
    last token."""
    start = prompt.index("{}")
    text = prompt[:start] + subject + prompt[start + 2:]
    end = start + len(subject)
    try:
        enc = tok(text, add_special_tokens=False, return_offsets_mapping=True)
        ids, offsets = enc["input_ids"], enc["offset_mapping"]
        idx = max(i for i, (s, e) in enumerate(offsets) if s < end and e > s)
    except (NotImplementedError, ValueError, KeyError, TypeError):
        ids = encode(tok, text)
        idx = len(encode(tok, text[:end])) - 1
    bos = bos_prefix(tok)
    return bos + ids, idx + len(bos)


def pad_batch(seqs: list[list[int]], pad_id: int, device="cpu") -> dict:
    n = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), n), pad_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), n), dtype=torch.long)
    for i, s in enumerate(seqs):
        ids[i, :len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, :len(s)] = 1
    return {"input_ids": ids.to(device), "attention_mask": mask.to(device)}


@torch.no_grad()
def generate_templates(model, tok, seed: int, n_tokens: int = 10, top_k: int = 5) -> list[str]:
    """``["{}"]`` plus one ``"<generated prefix>. {}"`` per start word (top-k sampling, fixed seed)."""
    device = next(model.parameters()).device
    g = torch.Generator().manual_seed(seed)
    out = ["{}"]
    for start in TEMPLATE_STARTS:
        ids = encode_prompt(tok, start)
        for _ in range(n_tokens):
            logits = model(input_ids=torch.tensor([ids], device=device)).logits[0, -1].float().cpu()
            top = torch.topk(logits, top_k)
            probs = torch.softmax(top.values, -1)
            ids.append(int(top.indices[torch.multinomial(probs, 1, generator=g)]))
        text = tok.decode(ids, skip_special_tokens=True).replace("{", " ").replace("}", " ")
        out.append(text.strip() + ". {}")
    return out


def cached_templates(model, tok, fingerprint: str, seed: int, cache_dir: Path | None) -> list[str]:
    """Context templates, cached per (model fingerprint, seed) so z-optimisation and keys agree
    across runs."""
    if cache_dir is None:
        return generate_templates(model, tok, seed)
    bos = "-bos" if bos_prefix(tok) else ""   # templates generated after a BOS are not those generated without
    path = Path(cache_dir) / fingerprint / f"templates-seed{seed}{bos}.json"
    if path.is_file():
        return json.loads(path.read_text())
    templates = generate_templates(model, tok, seed)
    path.parent.mkdir(parents=True, exist_ok=True)
    from llmtool.core.checkpoint import atomic_file

    with atomic_file(path) as tmp:
        Path(tmp).write_text(json.dumps(templates))
    return templates

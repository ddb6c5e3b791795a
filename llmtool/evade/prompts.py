"""Prompt set for the watermark experiments, derived from the packaged Austen test text.

Protocol (mirrors the paper's C4 prompts/human-negatives split): the text is cut into paragraphs;
paragraphs with at least ``prompt_words + human_words`` words are kept in order of appearance; a
seeded shuffle picks ``n`` of them. The first ``prompt_words`` words are the prompt (the generator
continues it); the next ``human_words`` words are the human continuation, used as unwatermarked
negatives for thresholds at fixed FPR. Records: ``{"id", "prompt", "human_text"}``.
"""
from __future__ import annotations

import random
import re

from llmtool.core.console import UsageError


def austen_prompts(n: int = 30, prompt_words: int = 30, human_words: int = 120, seed: int = 0,
                   source: str = "austen-test") -> list[dict]:
    from llmtool.core.data import load_text

    text = load_text(source)
    paragraphs = [re.sub(r"\s+", " ", p).strip() for p in re.split(r"\n\s*\n", text)]
    long_enough = [p.split(" ") for p in paragraphs if len(p.split(" ")) >= prompt_words + human_words]
    if len(long_enough) < n:
        raise UsageError(f"{source}: only {len(long_enough)} paragraphs of >= {prompt_words + human_words} words, "
                         f"asked for {n}")
    picked = random.Random(seed).sample(range(len(long_enough)), n)
    rows = []
    for i, idx in enumerate(sorted(picked)):
        words = long_enough[idx]
        rows.append({"id": f"austen-{idx}", "prompt": " ".join(words[:prompt_words]),
                     "human_text": " ".join(words[prompt_words:prompt_words + human_words])})
    return rows

"""Paraphrasing with a local chat LM, optionally under a per-item suppression bias (BIRA) — the
shared engine of ``--method bira`` and ``--method vanilla`` (= ``paraphrase``: same prompt, beta 0,
one pass).

Prompt (version ``PROMPT_VERSION``, our own wording): a system message asking for a faithful
paraphrase (keep facts, numbers, names, terms, tone and format; change wording and structure; add
and drop nothing; output only the rewrite) and a user message ``"Documents:\\n" + text``, rendered
with the rewriter's chat template. Decoding: sampling, top-p 0.9, temperature 0.7, max new tokens =
1.5 x source length in rewriter tokens; the prompt is never biased, nor are EOS / end-of-turn ids.
"""
from __future__ import annotations

from dataclasses import dataclass

from llmtool.evade.bira import SuppressionBias
from llmtool.evade.generation import DecodeConfig, generate_ids

PROMPT_VERSION = "paraphrase-v1"
SYSTEM_PROMPT = (
    "You rewrite documents. Paraphrase the document the user sends: keep every fact, number, name and "
    "technical term, and keep its tone and format, but change the wording and the sentence structure. "
    "Do not add anything and do not leave anything out. Reply with the rewritten document only."
)


def prompt_ids(tokenizer, text: str) -> list[int]:
    messages = [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": "Documents:\n" + text}]
    if getattr(tokenizer, "chat_template", None):
        rendered = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        return tokenizer(rendered, add_special_tokens=False)["input_ids"]
    return tokenizer(SYSTEM_PROMPT + "\n\nDocuments:\n" + text + "\n\nRewrite:\n", add_special_tokens=False)["input_ids"]


def stop_ids(tokenizer) -> list[int]:
    """EOS plus the chat template's end-of-turn ids (never biased, always stop generation)."""
    ids = {tokenizer.eos_token_id}
    for name in ("<|im_end|>", "<|eot_id|>", "<|end|>", "<end_of_turn>", "<|endoftext|>"):
        tid = tokenizer.convert_tokens_to_ids(name) if name in tokenizer.get_vocab() else None
        if tid is not None:
            ids.add(tid)
    return sorted(i for i in ids if i is not None)


@dataclass
class Paraphraser:
    model: object
    tokenizer: object
    decode: DecodeConfig
    length_factor: float = 1.5

    def source_length(self, text: str) -> int:
        return len(self.tokenizer(text, add_special_tokens=False)["input_ids"])

    def rewrite_ids(self, texts: list[str], sets: list[list[int]] | None = None,
                    betas: list[float] | None = None, seed: int | None = None) -> list[list[int]]:
        """Rewriter ids for each text, with ``betas[i]`` on ``sets[i]`` when sets are given."""
        vocab = int(self.model.config.vocab_size)
        stops = stop_ids(self.tokenizer)
        budgets = [max(8, int(round(self.length_factor * self.source_length(t)))) for t in texts]
        prompts = [prompt_ids(self.tokenizer, t) for t in texts]
        procs = None
        if sets is not None:
            betas = betas or [0.0] * len(texts)

            def procs(start: int, stop: int) -> list:
                return [SuppressionBias(sets[start:stop], betas[start:stop], vocab, protected=stops)]

        return generate_ids(self.model, self.tokenizer, prompts, procs, self.decode,
                            max_new_tokens=budgets, stop_ids=stops, batch_seed=seed)

"""Cheap text-edit baselines (MarkLLM-style editors) and the emoji attack's stripping step.

- Word deletion: each word is deleted independently with probability ``ratio`` (0.3) — seeded per
  call; the kept words are re-joined with single spaces.
- Synonym substitution (ratio 0.5): WordNet is not shipped by any package this project may use
  offline, so the substitute of a word is its nearest neighbour, by cosine similarity of the
  rewriter LM's input embeddings, among whole-word vocabulary entries (a leading-space token of 3+
  lowercase letters, not a case/plural variant of the word). Each eligible word (lowercase, 3+
  letters, a single token with its leading space, not a stop word) is replaced with probability
  ``ratio``. This is a reconstruction: embedding neighbours are near-synonyms or related words.
- Emoji attack helpers: the instruction text and :func:`strip_emoji`, which removes emoji code
  points (and the spaces they leave) from the generated text before detection.
"""
from __future__ import annotations

import random
import re

import torch

STOP_WORDS = frozenset(
    "the and for are but not you all any can had her was one our out has him his how its may who did let "
    "she too use that with have this will your from they been were said each which their them then than "
    "these would there could should into very what when where about after before being over such only "
    "also just most some other more".split()
)


def delete_words(text: str, ratio: float = 0.3, seed: int = 0) -> str:
    rng = random.Random(seed)
    words = text.split()
    kept = [w for w in words if rng.random() >= ratio]
    return " ".join(kept)


class EmbeddingSynonyms:
    """Nearest whole-word neighbour in a causal LM's input-embedding space."""

    def __init__(self, model, tokenizer):
        emb = model.get_input_embeddings().weight.detach().float().cpu()
        vocab = tokenizer.get_vocab()
        words, ids = [], []
        for tok_id in sorted(vocab.values()):
            piece = tokenizer.decode([tok_id])
            if re.fullmatch(r" [a-z]{3,}", piece):
                words.append(piece[1:])
                ids.append(tok_id)
        self.tokenizer = tokenizer
        self.words = words
        self.word_ids = {w: i for w, i in zip(words, ids)}
        self.matrix = torch.nn.functional.normalize(emb[torch.tensor(ids)], dim=-1)
        self.ids = torch.tensor(ids)
        self._cache: dict[str, str | None] = {}

    def neighbour(self, word: str) -> str | None:
        if word in self._cache:
            return self._cache[word]
        best = None
        tok_id = self.word_ids.get(word)
        if tok_id is not None:
            row = self.words.index(word)
            sims = self.matrix @ self.matrix[row]
            for j in torch.argsort(sims, descending=True).tolist():
                cand = self.words[j]
                if cand == word or cand.rstrip("s") == word.rstrip("s") or cand.startswith(word) or word.startswith(cand):
                    continue
                best = cand
                break
        self._cache[word] = best
        return best

    def substitute(self, text: str, ratio: float = 0.5, seed: int = 0) -> str:
        rng = random.Random(seed)

        def repl(m: re.Match) -> str:
            word = m.group(0)
            if word in STOP_WORDS or word not in self.word_ids or rng.random() >= ratio:
                return word
            return self.neighbour(word) or word

        return re.sub(r"\b[a-z]{3,}\b", repl, text)


EMOJI = "\U0001F600"
EMOJI_INSTRUCTION = (f"Continue the text below. After every single word you write, add the emoji {EMOJI}. "
                     "Write only the continuation.\n\n")
_EMOJI_RE = re.compile("[\U0001F000-\U0001FAFF\u2600-\u27BF\uFE0F\u200D]+")


def strip_emoji(text: str) -> str:
    stripped = _EMOJI_RE.sub(" ", text)
    return re.sub(r"[ \t]{2,}", " ", re.sub(r" +([,.;:!?])", r"\1", stripped)).strip()

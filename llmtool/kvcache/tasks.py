"""RULER-style synthetic long-context tasks generated from a seed (no download).

Each sample is ``{"task", "context", "question", "answers"}``: the context is real filler text
(a random stretch of a packaged corpus, default ``austen-train``) of about ``length`` tokens with
the task's facts inserted at random depths; the question comes after the context (so eviction in the
question-agnostic protocol cannot see it); ``answers`` are the strings a correct reply contains.
Scoring (:func:`score`): the fraction of ``answers`` found in the generated text (RULER's
``string_match_all``), so single-answer tasks score 0 or 1.

Tasks (after RULER, Hsieh et al. 2024, reconstructed at small scale):
* ``niah_single``: one "special magic number" needle for one key; asked for that key's number.
* ``niah_multikey``: four needles with distinct keys (three distractors); asked for one key.
* ``variable_tracking``: a chain ``VAR A = 12345``, ``VAR B = VAR A`` ... (4 hops) scattered in the
  filler; asked which variables hold the value (all names expected).
* ``aggregation``: common-word extraction: a numbered word list in which three words appear many
  times and the rest once; asked for the three most frequent words.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from llmtool.core.console import UsageError

TASKS = ("niah_single", "niah_multikey", "variable_tracking", "aggregation")
_KEYS = ["apple", "river", "violet", "harbor", "lantern", "meadow", "copper", "falcon", "pepper", "orchid",
         "saddle", "thistle", "walnut", "ember", "glacier", "marble", "quartz", "raven", "sparrow", "tulip"]
_WORDS = ["anchor", "basket", "candle", "desert", "engine", "forest", "garden", "hammer", "island", "jacket",
          "kettle", "ladder", "magnet", "needle", "orange", "pencil", "quiver", "rocket", "saddle", "ticket",
          "umbrella", "valley", "wagon", "yellow", "zipper", "bottle", "castle", "dragon", "feather", "goblet"]


@dataclass
class Sample:
    task: str
    context: str
    question: str
    answers: list

    def as_dict(self) -> dict:
        return {"task": self.task, "context": self.context, "question": self.question, "answers": self.answers}


def _filler(tokenizer, corpus_ids, n_tokens: int, rng: random.Random) -> list[str]:
    """Sentences of real text totalling about ``n_tokens`` tokens, from a random offset."""
    start = rng.randrange(0, max(1, len(corpus_ids) - n_tokens - 1))
    text = tokenizer.decode(corpus_ids[start:start + n_tokens])
    parts = [p.strip() for p in text.replace("\n", " ").split(". ") if p.strip()]
    return [p if p.endswith(".") else p + "." for p in parts]


def _insert(sentences: list[str], facts: list[str], rng: random.Random) -> str:
    out = list(sentences)
    for fact in facts:
        out.insert(rng.randint(0, len(out)), fact)
    return " ".join(out)


def _number(rng: random.Random) -> str:
    return str(rng.randint(1000000, 9999999))


def make_sample(task: str, tokenizer, corpus_ids, length: int, rng: random.Random) -> Sample:
    if task == "niah_single" or task == "niah_multikey":
        keys = rng.sample(_KEYS, 4 if task == "niah_multikey" else 1)
        numbers = [_number(rng) for _ in keys]
        facts = [f"The special magic number for {k} is: {n}." for k, n in zip(keys, numbers)]
        target = rng.randrange(len(keys))
        filler = _filler(tokenizer, corpus_ids, max(16, length - 20 * len(facts)), rng)
        q = f"What is the special magic number for {keys[target]}? The special magic number for {keys[target]} is:"
        return Sample(task, _insert(filler, facts, rng), q, [numbers[target]])
    if task == "variable_tracking":
        names = ["".join(rng.choice("ABCDEFGHIJKLMNOPQRSTUVWXYZ") for _ in range(5)) for _ in range(5)]
        value = str(rng.randint(10000, 99999))
        facts = [f"VAR {names[0]} = {value}."] + [f"VAR {names[i]} = VAR {names[i - 1]}." for i in range(1, 5)]
        filler = _filler(tokenizer, corpus_ids, max(16, length - 12 * len(facts)), rng)
        # keep chain order: insert at increasing depths
        depth = sorted(rng.randint(0, len(filler)) for _ in facts)
        out = list(filler)
        for off, (pos, fact) in enumerate(zip(depth, facts)):
            out.insert(pos + off, fact)
        q = f"Question: Find all variables that are assigned the value {value}. Answer: The variables are:"
        return Sample(task, " ".join(out), q, names)
    if task == "aggregation":
        common = rng.sample(_WORDS, 3)
        rare_pool = [w for w in _WORDS if w not in common]
        n_items = max(20, length // 4)
        items = []
        for i in range(n_items):
            items.append(common[i % 3] if rng.random() < 0.45 else rng.choice(rare_pool))
        rng.shuffle(items)
        # rare words must stay rarer than the common ones
        counts = {w: items.count(w) for w in set(items)}
        floor = min(counts.get(w, 0) for w in common)
        items = [w for w in items if w in common or counts[w] < floor] or items
        body = " ".join(f"{i + 1}. {w}" for i, w in enumerate(items))
        q = ("Question: What are the three most common words in the list above? "
             "Answer: The three most common words are:")
        return Sample(task, "Below is a numbered list of words. " + body, q, common)
    raise UsageError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}, ppl")


def make_samples(task: str, tokenizer, length: int, n: int, seed: int = 0, corpus: str = "austen-train") -> list[Sample]:
    from llmtool.core.data import load_text, tokenize

    if task not in TASKS:
        raise UsageError(f"unknown task {task!r}; choose one of: {', '.join(TASKS)}, ppl")
    if length < 64:
        raise UsageError(f"--length {length}: must be at least 64 tokens")
    ids = tokenize(tokenizer, load_text(corpus)).tolist()
    rng = random.Random(f"{task}:{length}:{seed}")
    return [make_sample(task, tokenizer, ids, length, rng) for _ in range(n)]


def score(generated: str, answers: list) -> float:
    text = generated.lower()
    return sum(a.lower() in text for a in answers) / len(answers)

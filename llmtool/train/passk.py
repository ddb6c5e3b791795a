"""Evaluation for RLVR: unbiased pass@k, greedy pass@1 and answer diversity.

- pass@k (Chen et al. 2021, eq. 1): per problem with n samples of which c are correct,
  ``1 - C(n-c, k) / C(n, k)`` (1 when ``n - c < k``), averaged over problems; requires n ≥ k.
  Computed as a running product to stay exact in floats for large n.
- diversity (SetPO spec §5): distinct correct final answers per problem, Shannon entropy (nats) of the
  extracted-answer distribution per problem, mean over problems;
- greedy pass@1 (temperature 0) and the behaviour-marker frequency of the greedy responses.
"""
from __future__ import annotations

import math
from collections import Counter
from typing import Sequence

from llmtool.train import rl_data


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimator of P(at least one of k draws without replacement is correct)."""
    if k > n:
        raise ValueError(f"pass@{k} needs n >= k samples (n = {n})")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def answer_entropy(answers: Sequence[str | None]) -> float:
    """Entropy (nats) of the answers' empirical distribution (no answer counts as its own value)."""
    c = Counter("<none>" if a is None else a for a in answers)
    n = sum(c.values())
    return -sum(v / n * math.log(v / n) for v in c.values()) if n else 0.0


def score_samples(rows: Sequence[dict], texts: Sequence[Sequence[str]], ks: Sequence[int]) -> dict:
    """pass@k for each k, distinct correct answers and answer entropy from ``texts[i]`` (n samples of row i)."""
    per_k = {k: [] for k in ks}
    distinct, ent, acc, per_problem = [], [], [], []
    for row, samples in zip(rows, texts):
        answers = [rl_data.extract_answer(row, t) for t in samples]
        correct = [a is not None and rl_data.is_correct(row, t, answer=a) for a, t in zip(answers, samples)]
        n, c = len(samples), sum(correct)
        for k in ks:
            per_k[k].append(pass_at_k(n, c, k))
        distinct.append(len({a for a, ok in zip(answers, correct) if ok}))
        ent.append(answer_entropy(answers))
        acc.append(c / n if n else 0.0)
        per_problem.append({"id": row.get("id"), "n": n, "correct": c, "distinct_correct": distinct[-1]})
    m = len(acc) or 1
    out = {f"pass@{k}": sum(v) / m for k, v in per_k.items()}
    out.update({"mean_accuracy": sum(acc) / m, "distinct_correct": sum(distinct) / m,
                "answer_entropy": sum(ent) / m, "problems": len(acc)})
    return {"summary": out, "per_problem": per_problem}


def evaluate(model, tokenizer, rows: Sequence[dict], *, n: int = 16, ks: Sequence[int] = (1, 2, 4, 8, 16),
             temperature: float = 1.0, top_p: float = 1.0, max_new_tokens: int = 64, batch_size: int = 64,
             seed: int = 0, greedy: bool = True, marker: str = "", system: str | None = None,
             desc: str | None = None) -> dict:
    """Sample ``n`` responses per row and score them; optionally greedy pass@1 too."""
    from llmtool.core.lm import chat_prompt, generate

    if n < max(ks):
        raise ValueError(f"pass@k needs n >= max k ({n} < {max(ks)})")
    prompts = [chat_prompt(tokenizer, r["prompt"], system=system) for r in rows]
    was = model.training
    model.eval()
    res: dict = {}
    if n > 0:
        comps = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_p=top_p, n=n, batch_size=batch_size, seed=seed, desc=desc)
        texts = [[c.text for c in g] for g in comps]
        res = score_samples(rows, texts, ks)
        if marker:
            flat = [t for g in texts for t in g]
            res["summary"]["marker_freq_sampled"] = sum(marker.lower() in t.lower() for t in flat) / max(len(flat), 1)
    if greedy:
        g = generate(model, tokenizer, prompts, max_new_tokens=max_new_tokens, temperature=0.0,
                     batch_size=batch_size)
        gt = [c[0].text for c in g]
        ok = [rl_data.is_correct(r, t) for r, t in zip(rows, gt)]
        res.setdefault("summary", {})["greedy_pass@1"] = sum(ok) / max(len(ok), 1)
        res["greedy_correct"] = ok
        if marker:
            res["summary"]["marker_freq_greedy"] = sum(marker.lower() in t.lower() for t in gt) / max(len(gt), 1)
    model.train(was)
    res["settings"] = {"n": n, "ks": list(ks), "temperature": temperature, "top_p": top_p,
                       "max_new_tokens": max_new_tokens, "batch_size": batch_size, "seed": seed}
    return res

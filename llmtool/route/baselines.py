"""The baseline families of FusionRoute's comparison (arXiv:2601.05106, §4; authors' corrected list),
one registered method each (``llmtool route baseline --method NAME``):

- ``seq-select``: every expert writes a full answer, a scorer picks one. Scorers [R]: ``judge`` — the
  highest mean token log-likelihood of the answer under a judge model (default: the base model; the
  paper uses a reward model, none ships offline); ``vote`` — majority of the extracted answers (ties:
  judge); ``verifier`` — a rule-based format reward a user without gold answers can compute
  (:func:`llmtool.route.tasks.format_ok`: math a bare integer, code/joint a first function that parses with
  ``ast.parse``, parsing only), ties (all or none well-formed) broken by the judge; ``oracle`` — the expert
  named for the row's domain (upper bound). Cost ≈ n × one expert.
- ``token-select``: Collab-style training-free token-level controlled decoding over the experts'
  proposals (see :mod:`llmtool.route.decoding`).
- ``merge-ta`` / ``merge-dare``: Task Arithmetic / DARE merges of the experts into the base
  (:mod:`llmtool.route.merging`); the output is an ordinary HF checkpoint, evaluated like an expert.
- ``sft-union``: the base fine-tuned on the union of the experts' training data (same trainer, same
  steps budget flags) — the paper's "direct fine-tuning" baseline.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from llmtool.core.console import UsageError
from llmtool.core.registry import MethodConfig, Registry, option

BASELINES = Registry("route baseline")


@BASELINES.config
@dataclass
class SeqSelectConfig(MethodConfig):
    name: ClassVar[str] = "seq-select"
    help: ClassVar[str] = "All experts answer; a scorer picks one answer per prompt."
    kind: ClassVar[str] = "generate"
    scorer: str = option("judge", "Answer picker: judge (mean log-lik under --base), vote, verifier (format reward "
                         "per domain, ties by judge), oracle (by domain).", choices=("judge", "vote", "verifier", "oracle"))
    candidates: str = option("", "A seq-select generations.jsonl whose rows carry every expert's answer "
                             "('candidates', in --experts order): pick among those instead of generating again.")


@BASELINES.config
@dataclass
class TokenSelectConfig(MethodConfig):
    name: ClassVar[str] = "token-select"
    help: ClassVar[str] = "Collab-style token-level selection among the experts' greedy proposals."
    kind: ClassVar[str] = "generate"
    value: str = option("implicit", "Proposal value: implicit (log-ratio to --base) or confidence (own log-prob).",
                        choices=("implicit", "confidence"))


@BASELINES.config
@dataclass
class MergeTAConfig(MethodConfig):
    name: ClassVar[str] = "merge-ta"
    help: ClassVar[str] = "Task Arithmetic merge of the experts into --base."
    kind: ClassVar[str] = "model"
    lam: float = option(1.0, "Task-vector scale lambda.", min=0.0)


@BASELINES.config
@dataclass
class MergeDareConfig(MethodConfig):
    name: ClassVar[str] = "merge-dare"
    help: ClassVar[str] = "DARE (drop and rescale task vectors) then Task Arithmetic."
    kind: ClassVar[str] = "model"
    lam: float = option(1.0, "Task-vector scale lambda.", min=0.0)
    drop: float = option(0.5, "Drop probability p of each task-vector entry.", min=0.0, max=1.0, exclusive_max=True)


@BASELINES.config
@dataclass
class SFTUnionConfig(MethodConfig):
    name: ClassVar[str] = "sft-union"
    help: ClassVar[str] = "Fine-tune --base on the union of the experts' training data."
    kind: ClassVar[str] = "model"
    lr: float = option(1e-4, "Learning rate.", min=0.0, exclusive_min=True)
    epochs: float = option(1.0, "Epochs.", min=0.0, exclusive_min=True)
    max_steps: int = option(-1, "Steps (> 0 overrides --epochs).")
    lora_r: int = option(0, "LoRA rank (0 = full fine-tune).", min=0)


def seq_select(outputs: list[list[str]], rows: list[dict], scorer: str, expert_domains: list[str] | None = None,
               judge=None, tokenizer=None, template: str = "chat") -> list[int]:
    """Index of the chosen expert per row; ``outputs[i][j]`` is expert i's answer to row j."""
    n = len(outputs)
    picks = []
    judge_scores = None
    if scorer in ("judge", "vote", "verifier"):
        from llmtool.core.lm import completion_nll
        from llmtool.route.pipeline import render

        judge_scores = []
        for i in range(n):
            prompts = [render(tokenizer, r["prompt"], template) for r in rows]
            outs = [o if o else " " for o in outputs[i]]
            nll = completion_nll(judge, tokenizer, prompts, outs)
            lens = [max(1, len(tokenizer(o, add_special_tokens=False)["input_ids"])) for o in outs]
            judge_scores.append([-a / b for a, b in zip(nll, lens)])
    for j, r in enumerate(rows):
        if scorer == "oracle":
            dom = r.get("domain")
            if expert_domains is None or dom not in expert_domains:
                raise UsageError(f"record {r.get('id')}: oracle scorer needs a domain matching an expert "
                                 f"({', '.join(expert_domains or [])})")
            picks.append(expert_domains.index(dom))
        elif scorer == "vote":
            from llmtool.route.tasks import domain

            ext = domain(r["domain"]).extract if "domain" in r else (lambda s: s.strip())
            answers = [ext(outputs[i][j]) for i in range(n)]
            counts = {a: answers.count(a) for a in answers}
            best = max(counts.values())
            tied = [i for i in range(n) if counts[answers[i]] == best]
            picks.append(max(tied, key=lambda i: judge_scores[i][j]))
        elif scorer == "verifier":
            from llmtool.route.tasks import format_ok

            reward = [float(format_ok(r.get("domain"), outputs[i][j])) for i in range(n)]
            picks.append(max(range(n), key=lambda i: (reward[i], judge_scores[i][j])))
        else:
            picks.append(max(range(n), key=lambda i: judge_scores[i][j]))
    return picks

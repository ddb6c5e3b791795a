"""NLI entailment between a watermarked source text and its rewrite, in both directions (the spec's quality
metric "NLI entailment (both directions)"), with any local Hugging Face NLI classifier (a
``*ForSequenceClassification`` checkpoint such as roberta-large-mnli or cross-encoder/nli-deberta-v3-base),
loaded offline with plain transformers (``local_files_only=True``, never remote code).

What is computed, per (source, rewrite) pair:

- ``src_to_hyp``: P(entailment | premise = source, hypothesis = rewrite), the softmax probability of the
  entailment class over the classifier's logits, the pair encoded as a tokenizer *pair* (premise first);
  ``hyp_to_src`` the same with the roles swapped;
- ``bidirectional``: min of the two directions (a rewrite counts as meaning-preserving only if each text
  entails the other);
- ``entailed_both``: argmax of the classifier is the entailment class in both directions.

The summary holds the means of ``src_to_hyp``, ``hyp_to_src`` and ``bidirectional`` and the share of pairs
entailed both ways. Choices the spec leaves open (reconstructed, ours):

- the entailment class is read from ``config.id2label``: the one label containing "entail"
  (case-insensitive), negated labels ("not_entailment", "non-entailment") excluded; a model with none (or
  with several) is refused as not an NLI classifier, never guessed from a position;
- probabilities are used, not hard labels, for the means (hard labels only for the share); the classifier
  runs in float32;
- over-long pairs are truncated ``longest_first`` (the longer text loses tokens first) to ``max_length``
  tokens (default 512, capped by the tokenizer's ``model_max_length``);
- the bidirectional score of a pair is the minimum of its two directions (the mean of the minima, not the
  minimum of the means).
"""
from __future__ import annotations

import re
from pathlib import Path
from typing import Sequence

from llmtool.core.console import UsageError

_NEGATED = re.compile(r"\b(not|non|no)[\s_-]*entail")


def entailment_label(id2label: dict, source: str | Path = "config.json") -> int:
    """The index of the entailment class in ``id2label`` (keys may be ints or strings, as in config.json)."""
    labels = {int(k): str(v) for k, v in id2label.items()}
    hits = [i for i, name in labels.items() if "entail" in name.lower() and not _NEGATED.search(name.lower())]
    if len(hits) != 1:
        found = ", ".join(labels[i] for i in sorted(labels)) or "none"
        why = "no label contains 'entail'" if not hits else "several labels contain 'entail'"
        raise UsageError(f"{source}: not an NLI classifier ({why}; id2label has: {found})")
    return hits[0]


def check_nli_model(path: str | Path) -> tuple[Path, int]:
    """The cheap, torch-free checks of an NLI model directory (run before anything heavy loads): it exists,
    has a valid config.json of a sequence classifier with an entailment label, asks for no remote code and
    has sane safetensors weights. Returns the path and the entailment index from config.json."""
    from llmtool.core.checkpoint import read_config
    from llmtool.core.preflight import check_weights, refuse_remote_code

    path = Path(path).expanduser()
    if not path.exists():
        raise UsageError(f"{path}: no such NLI model directory")
    if not path.is_dir():
        raise UsageError(f"{path}: not a directory (give a local NLI classifier's model directory)")
    config = read_config(path)  # one-line error when config.json is missing or invalid
    archs = config.get("architectures") or []
    if archs and not any(str(a).endswith("ForSequenceClassification") for a in archs):
        raise UsageError(f"{path}: not an NLI classifier (config.json architectures={archs}; "
                         "needs a *ForSequenceClassification checkpoint)")
    refuse_remote_code(path, config)
    index = entailment_label(config.get("id2label") or {}, path / "config.json")
    check_weights(path)
    return path, index


class NLIScorer:
    """A local NLI classifier; :meth:`entailment` gives P(entailment) per (premise, hypothesis) pair."""

    def __init__(self, path: str | Path, device: str = "cpu", batch_size: int = 16, max_length: int = 512):
        import os

        os.environ.setdefault("HF_HUB_OFFLINE", "1")
        import llmtool.core.models  # noqa: F401  (offline mode, quiet transformers logging)
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        if batch_size < 1 or max_length < 2:
            raise ValueError("batch_size must be >= 1 and max_length >= 2")
        path, _ = check_nli_model(path)
        self.path = path
        self.tokenizer = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
        model, loading = AutoModelForSequenceClassification.from_pretrained(
            path, local_files_only=True, trust_remote_code=False, output_loading_info=True, dtype=torch.float32)
        missing = sorted(loading.get("missing_keys") or [])
        if missing:  # e.g. a bare encoder: transformers would put a random classifier head on it
            raise UsageError(f"{path}: weights missing for {missing[0]} (a trained NLI classifier head is needed)")
        self.model = model.to(device).eval()
        self.device = device
        self.batch_size = batch_size
        limit = getattr(self.tokenizer, "model_max_length", None)
        self.max_length = min(max_length, limit) if isinstance(limit, int) and 0 < limit < 1_000_000 else max_length
        self.labels = {int(k): str(v) for k, v in self.model.config.id2label.items()}
        self.entail_index = entailment_label(self.labels, path / "config.json")

    def probabilities(self, premises: Sequence[str], hypotheses: Sequence[str]):
        """Softmax over the classifier's classes for each (premise, hypothesis) pair: a float32 tensor
        [pairs, classes] on the CPU."""
        import torch

        premises, hypotheses = list(premises), list(hypotheses)
        if len(premises) != len(hypotheses):
            raise ValueError(f"{len(premises)} premises but {len(hypotheses)} hypotheses")
        chunks = []
        with torch.no_grad():
            for i in range(0, len(premises), self.batch_size):
                enc = self.tokenizer(premises[i:i + self.batch_size], hypotheses[i:i + self.batch_size],
                                     truncation=True, padding=True, max_length=self.max_length,
                                     return_tensors="pt").to(self.device)
                logits = self.model(**enc).logits
                chunks.append(torch.softmax(logits.float(), dim=-1).cpu())
        if not chunks:
            return torch.zeros(0, len(self.labels))
        return torch.cat(chunks)

    def entailment(self, premises: Sequence[str], hypotheses: Sequence[str]) -> list[float]:
        """P(entailment) for each (premise, hypothesis) pair."""
        return self.probabilities(premises, hypotheses)[:, self.entail_index].tolist()

    def both_directions(self, src: Sequence[str], hyp: Sequence[str]) -> dict:
        """Per-pair entailment source -> rewrite and rewrite -> source, their minimum, whether the classifier
        predicts entailment both ways, and a summary (means, share entailed both ways; None without pairs)."""
        fwd, bwd = self.probabilities(src, hyp), self.probabilities(hyp, src)
        e = self.entail_index
        s2h, h2s = fwd[:, e].tolist(), bwd[:, e].tolist()
        both_min = [min(a, b) for a, b in zip(s2h, h2s)]
        entailed = [bool(a == e and b == e) for a, b in zip(fwd.argmax(-1).tolist(), bwd.argmax(-1).tolist())]
        n = len(s2h)

        def mean(xs):
            return sum(xs) / n if n else None

        return {"src_to_hyp": s2h, "hyp_to_src": h2s, "bidirectional": both_min, "entailed_both": entailed,
                "summary": {"pairs": n, "src_to_hyp_mean": mean(s2h), "hyp_to_src_mean": mean(h2s),
                            "bidirectional_mean": mean(both_min), "entailed_both_share": mean(entailed)}}


def model_name(path: str | Path) -> str:
    """What results record of an NLI model: its directory's name, never a machine's absolute path."""
    return Path(path).expanduser().resolve().name or str(path)

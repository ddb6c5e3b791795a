"""Shared-vocabulary checks for token-level collaboration (FusionRoute, arXiv:2601.05106, §3.1).

Every model in a collaboration must score the same token ids. ``vocab_hash`` identifies a tokenizer by
its token -> id map and special tokens (not by file bytes, which change on re-save). ``VocabView`` takes
``V = min(config.vocab_size)`` over all models and sets ids ``>= len(tokenizer)`` (padding rows of the
embedding) to ``-inf`` before the log-softmax, so a fused argmax can never land on a junk id.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch

from llmtool.core.console import UsageError


def vocab_hash(tokenizer) -> str:
    """sha256 of the token -> id map plus the special tokens (bos/eos/pad)."""
    vocab = sorted(tokenizer.get_vocab().items(), key=lambda kv: kv[1])
    special = [tokenizer.bos_token_id, tokenizer.eos_token_id]
    blob = json.dumps([vocab, special], ensure_ascii=False).encode()
    return hashlib.sha256(blob).hexdigest()


def check_same_tokenizer(reference_hash: str, tokenizer, where: str | Path, against: str = "the router") -> None:
    """Refuse a model whose tokenizer differs from the reference (error names the tokenizer file)."""
    got = vocab_hash(tokenizer)
    if got != reference_hash:
        raise UsageError(f"{Path(where) / 'tokenizer.json'}: tokenizer differs from {against}'s "
                         f"(vocab sha256 {got[:12]} != {reference_hash[:12]}); experts must share one tokenizer")


@dataclass(frozen=True)
class VocabView:
    size: int        # V: the id range every model scores (min over config.vocab_size)
    n_tokens: int    # len(tokenizer): ids >= this are padding rows

    @classmethod
    def of(cls, models, tokenizer) -> "VocabView":
        sizes = [int(m.config.vocab_size) for m in models]
        v = min(sizes)
        n = len(tokenizer)
        if n > v:
            raise UsageError(f"tokenizer has {n} tokens but a model's vocab_size is only {v}")
        return cls(size=v, n_tokens=n)

    def log_probs(self, logits: torch.Tensor) -> torch.Tensor:
        """log-softmax over the shared id range, padded ids at -inf (float32)."""
        z = logits[..., : self.size].float()
        if self.n_tokens < self.size:
            z = z.clone()
            z[..., self.n_tokens:] = float("-inf")
        return torch.log_softmax(z, dim=-1)

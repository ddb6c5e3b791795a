"""The FusionRoute router: a causal LM plus a linear routing head (arXiv:2601.05106, §3.1), and its
on-disk format.

At prefix ``s_t`` the router gives hidden ``h_t`` (last layer, as returned in ``hidden_states[-1]``),
LM log-probs ``r_t`` and routing scores ``w_t = W h_t + b`` (one per expert) [P: linear projection of the
final hidden state]. The head starts at zero, i.e. uniform routing [R].

Directory format (``route train`` output): the router LM as an ordinary HF checkpoint (so
``router-only`` is plain generation and ``from_pretrained`` loads it), ``routing_head.safetensors``
(``W`` [n_experts, d_model], ``b`` [n_experts]) and ``fusionroute.json`` (ordered experts with path and
tokenizer hash, vocab used, router base, stage, hyper-parameters). Loading refuses experts whose
tokenizer differs from the recorded hash.
"""
from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Sequence

import torch
from torch import nn

from llmtool.core.console import UsageError

HEAD_FILE = "routing_head.safetensors"
META_FILE = "fusionroute.json"


class FusionRouter(nn.Module):
    """Router LM ``lm`` with routing head ``head``: ``forward`` returns (logits, routing scores, output)."""

    def __init__(self, lm, n_experts: int):
        super().__init__()
        if n_experts < 1:
            raise ValueError("need at least one expert")
        self.lm = lm
        self.head = nn.Linear(lm.config.hidden_size, n_experts)
        nn.init.zeros_(self.head.weight)
        nn.init.zeros_(self.head.bias)
        self.head.to(next(lm.parameters()).device)

    @property
    def config(self):
        return self.lm.config

    @property
    def n_experts(self) -> int:
        return self.head.out_features

    def forward(self, input_ids, attention_mask=None, **kwargs):
        out = self.lm(input_ids=input_ids, attention_mask=attention_mask, output_hidden_states=True, **kwargs)
        h = out.hidden_states[-1]
        return out.logits, self.head(h.to(self.head.weight.dtype)), out


@dataclass
class ExpertRef:
    name: str
    path: str
    vocab_sha256: str


@dataclass
class RouterMeta:
    experts: list[ExpertRef]
    vocab_size_used: int
    n_tokens: int
    router_base: str
    stage: str
    params: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"format": "llmtool-fusionroute", "version": 1,
                "experts": [e.__dict__ for e in self.experts], "vocab_size_used": self.vocab_size_used,
                "n_tokens": self.n_tokens, "router_base": self.router_base, "stage": self.stage,
                "params": self.params}


def save_router(out_dir: Path, router: FusionRouter, tokenizer, meta: RouterMeta) -> None:
    from safetensors.torch import save_file

    out_dir = Path(out_dir)
    router.lm.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    save_file({"W": router.head.weight.detach().float().cpu().contiguous(),
               "b": router.head.bias.detach().float().cpu().contiguous()}, str(out_dir / HEAD_FILE))
    (out_dir / META_FILE).write_text(json.dumps(meta.to_json(), indent=2))


def read_meta(router_dir: Path) -> RouterMeta:
    p = Path(router_dir) / META_FILE
    if not p.is_file():
        raise UsageError(f"{router_dir}: not a FusionRoute router (no {META_FILE}; make one with `llmtool route train`)")
    try:
        raw = json.loads(p.read_text())
        experts = [ExpertRef(**e) for e in raw["experts"]]
        return RouterMeta(experts=experts, vocab_size_used=int(raw["vocab_size_used"]), n_tokens=int(raw["n_tokens"]),
                          router_base=str(raw.get("router_base", "")), stage=str(raw.get("stage", "")),
                          params=dict(raw.get("params") or {}))
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise UsageError(f"{p}: malformed ({e.__class__.__name__}: {e})") from None


def load_head(router_dir: Path, router: FusionRouter) -> None:
    from safetensors.torch import load_file

    p = Path(router_dir) / HEAD_FILE
    if not p.is_file():
        raise UsageError(f"{router_dir}: missing {HEAD_FILE}")
    t = load_file(str(p))
    if tuple(t["W"].shape) != tuple(router.head.weight.shape):
        raise UsageError(f"{p}: W has shape {tuple(t['W'].shape)}, expected {tuple(router.head.weight.shape)}")
    with torch.no_grad():
        router.head.weight.copy_(t["W"])
        router.head.bias.copy_(t["b"])


def load_experts(paths: Sequence[str], reference_hash: str, against: str = "the router"):
    """Load expert models (causal LMs, same tokenizer as the reference) in eval mode, gradients off."""
    from llmtool.core.models import check_causal_lm, load_model, load_tokenizer, resolve_model
    from llmtool.route.vocab import check_same_tokenizer

    models = []
    for p in paths:
        path = resolve_model(p)
        check_causal_lm(path)
        check_same_tokenizer(reference_hash, load_tokenizer(path), path, against)
        m = load_model(path)
        m.requires_grad_(False)
        models.append(m.eval())
    return models


def load_router(router_dir: Path, experts: Sequence[str] | None = None):
    """(router, tokenizer, expert models, meta) from a ``route train`` output directory.

    ``experts`` overrides the recorded expert paths (same count, same tokenizer)."""
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.route.vocab import check_same_tokenizer, vocab_hash

    router_dir = Path(router_dir)
    meta = read_meta(router_dir)
    paths = list(experts) if experts else [e.path for e in meta.experts]
    if len(paths) != len(meta.experts):
        raise UsageError(f"--experts: the router was trained with {len(meta.experts)} experts, got {len(paths)}")
    tok = load_tokenizer(router_dir)
    ref = meta.experts[0].vocab_sha256 if meta.experts else vocab_hash(tok)
    check_same_tokenizer(ref, tok, router_dir, "the recorded experts")
    lm = load_model(router_dir)
    router = FusionRouter(lm, len(paths))
    load_head(router_dir, router)
    models = load_experts(paths, ref)
    return router.eval(), tok, models, meta

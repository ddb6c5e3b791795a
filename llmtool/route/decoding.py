"""Fusion decoding with per-model KV caches (FusionRoute, arXiv:2601.05106, §3.1–3.2), and the
Collab-style token-level baseline that reuses the same machinery.

Per step ``t`` and row: the router reads the newest token (its own KV cache) and gives ``r_t`` and
``w_t``; ``k_t = argmax w_t`` [P]; the selected expert gives ``e_{k_t,t}``; the fused score is
``f_t = r_t + e_{k_t,t}`` (sum of log-softmaxes, eq. of the product-of-experts in §3.1) [P]; the next
token is ``argmax f_t`` (greedy, default [P]) or a sample from ``softmax(f_t / T)``.

KV caches (no recomputation of the prefix): every model is an :class:`Stream` with its own cache and a
"processed up to" pointer. An expert is run only when some active row of the batch selects it, and
then it catches up, in one forward call, on every token appended since its pointer (lazy catch-up).
Reconstructed choices [R]: the catch-up is done for the whole batch (all rows share the expert's cache
and pointer), so rows that did not pick the expert get its state for free later; ``eager=True`` runs
every expert at every step (debug mode; gives the same tokens — tested). Left padding with per-row
``position_ids`` and attention masks; a row that produced EOS is frozen (pad tokens fed after it).

Modes: ``fusion`` (r + e_k), ``route-only`` (r := 0, pure token routing), ``router-only`` (r alone),
``force:K`` (k fixed, r kept), ``expert:K`` (plain decoding with expert K).

Token-level baseline ``token_select`` [R, Collab-style controlled decoding with a mixture of agents]:
every expert proposes its greedy token; each proposal gets the value ``log π_j(a_j) - log π_ref(a_j)``
(the implicit token reward of expert j against the reference model that the experts were fine-tuned
from) or, with ``value="confidence"``, ``log π_j(a_j)``; the best-valued proposal is emitted. Training
free; costs all experts (and the reference) at every step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from llmtool.route.vocab import VocabView

MODES = ("fusion", "route-only", "router-only", "force", "expert")


def parse_mode(mode: str, n_experts: int) -> tuple[str, int | None]:
    """``fusion|route-only|router-only|expert:K|force:K`` -> (kind, K)."""
    from llmtool.core.console import UsageError

    if ":" in mode:
        kind, _, k = mode.partition(":")
        if kind not in ("expert", "force"):
            raise UsageError(f"--mode {mode!r}: choose fusion, route-only, router-only, expert:K or force:K")
        try:
            idx = int(k)
        except ValueError:
            raise UsageError(f"--mode {mode!r}: K must be an integer") from None
        if not 0 <= idx < n_experts:
            raise UsageError(f"--mode {mode!r}: K out of range (0..{n_experts - 1} for {n_experts} experts)")
        return kind, idx
    if mode not in ("fusion", "route-only", "router-only"):
        raise UsageError(f"--mode {mode!r}: choose fusion, route-only, router-only, expert:K or force:K")
    return mode, None


def cache_kwarg(model, cache) -> dict:
    """The KV-cache keyword of this transformers version (``cache`` in 5.24+, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(type(model).forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def returned_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


class Stream:
    """One model's incremental state over a batch: KV cache + number of columns already processed."""

    def __init__(self, model, vocab: VocabView, hidden: bool = False):
        self.model, self.vocab, self.hidden = model, vocab, hidden
        self.cache = None
        self.done = 0
        self.calls = 0

    @torch.no_grad()
    def step(self, seq: torch.Tensor, mask: torch.Tensor, pos: torch.Tensor):
        """Catch up on ``seq[:, done:]`` and return (log-probs at the last column [B, V], last hidden or None)."""
        L = seq.shape[1]
        dev = next(self.model.parameters()).device
        out = self.model(input_ids=seq[:, self.done:L].to(dev), attention_mask=mask[:, :L].to(dev),
                         position_ids=pos[:, self.done:L].to(dev), use_cache=True,
                         output_hidden_states=self.hidden, logits_to_keep=1, **cache_kwarg(self.model, self.cache))
        self.cache = returned_cache(out)
        self.done = L
        self.calls += 1
        lp = self.vocab.log_probs(out.logits[:, -1]).cpu()
        h = out.hidden_states[-1][:, -1] if self.hidden else None
        return lp, h


@dataclass
class DecodeResult:
    token_ids: list[int]
    trace: list[int]
    finish: str
    scores: list[torch.Tensor] = field(default_factory=list)   # per-step scores (record_scores only)


Chooser = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


def left_pad(prompts: Sequence[Sequence[int]], pad_id: int):
    width = max(len(p) for p in prompts)
    seq = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            seq[i, width - len(p):] = torch.tensor(list(p), dtype=torch.long)
            mask[i, width - len(p):] = 1
    pos = (mask.cumsum(-1) - 1).clamp(min=0)
    return seq, mask, pos


def decode_loop(prompts: Sequence[Sequence[int]], choose: Chooser, *, eos_ids: Sequence[int], pad_id: int,
                max_new_tokens: int, temperature: float = 0.0, generator: torch.Generator | None = None,
                record_scores: bool = False) -> list[DecodeResult]:
    """Generic incremental decoding: ``choose(seq, mask, pos, active)`` -> (scores [B, V], trace [B])."""
    if any(len(p) == 0 for p in prompts):
        raise ValueError("empty prompt")
    seq, mask, pos = left_pad(prompts, pad_id)
    B = seq.shape[0]
    eos = set(int(e) for e in eos_ids if e is not None)
    active = torch.ones(B, dtype=torch.bool)
    results = [DecodeResult([], [], "length") for _ in range(B)]
    for _ in range(max_new_tokens):
        scores, trace = choose(seq, mask, pos, active)
        if temperature > 0:
            probs = torch.softmax(scores / temperature, dim=-1)
            nxt = torch.multinomial(probs, 1, generator=generator).squeeze(-1)
        else:
            nxt = scores.argmax(-1)
        for b in range(B):
            if not active[b]:
                continue
            tok = int(nxt[b])
            if record_scores:
                results[b].scores.append(scores[b].clone())
            if tok in eos:
                results[b].finish = "stop"
                active[b] = False
                continue
            results[b].token_ids.append(tok)
            results[b].trace.append(int(trace[b]))
        nxt = torch.where(active, nxt, torch.full_like(nxt, pad_id))
        seq = torch.cat([seq, nxt[:, None]], dim=1)
        mask = torch.cat([mask, torch.ones((B, 1), dtype=mask.dtype)], dim=1)
        pos = torch.cat([pos, pos[:, -1:] + 1], dim=1)
        if not bool(active.any()):
            break
    return results


class FusionChooser:
    """Per-step choice of FusionRoute in one of its modes (see the module docstring)."""

    def __init__(self, router, experts: Sequence, vocab: VocabView, mode: str = "fusion", k: int | None = None,
                 eager: bool = False):
        self.kind, self.k, self.eager = mode, k, eager
        self.router = router
        self.vocab = vocab
        self.rstream = Stream(router.lm, vocab, hidden=True) if router is not None and mode != "expert" else None
        self.streams = [Stream(m, vocab) for m in experts]
        self.expert_calls = 0

    def __call__(self, seq, mask, pos, active):
        B = seq.shape[0]
        r = torch.zeros((B, self.vocab.size))
        if self.rstream is not None:
            r, h = self.rstream.step(seq, mask, pos)
            with torch.no_grad():
                w = self.router.head(h.to(self.router.head.weight.dtype)).float().cpu()
            k = w.argmax(-1)
        else:
            k = torch.full((B,), -1, dtype=torch.long)
        if self.kind in ("force", "expert"):
            k = torch.full((B,), int(self.k), dtype=torch.long)
        if self.kind == "router-only":
            return r, torch.full((B,), -1, dtype=torch.long)
        need = set(range(len(self.streams))) if self.eager else set(int(x) for x in k[active].tolist())
        e = torch.zeros((B, self.vocab.size))
        for i in sorted(need):
            lp, _ = self.streams[i].step(seq, mask, pos)
            self.expert_calls += 1
            rows = k == i
            e[rows] = lp[rows]
        if self.kind in ("route-only", "expert"):
            return e, k
        return r + e, k


class TokenSelectChooser:
    """Collab-style training-free token-level selection among expert proposals (module docstring)."""

    def __init__(self, experts: Sequence, vocab: VocabView, reference=None, value: str = "implicit"):
        if value == "implicit" and reference is None:
            raise ValueError("value='implicit' needs a reference model")
        self.value = value
        self.vocab = vocab
        self.streams = [Stream(m, vocab) for m in experts]
        self.ref = Stream(reference, vocab) if value == "implicit" else None

    def __call__(self, seq, mask, pos, active):
        lps = torch.stack([s.step(seq, mask, pos)[0] for s in self.streams])   # [n, B, V]
        props = lps.argmax(-1)                                                 # [n, B]
        own = lps.gather(-1, props[..., None]).squeeze(-1)                    # [n, B]
        val = own
        if self.ref is not None:
            ref = self.ref.step(seq, mask, pos)[0]                            # [B, V]
            val = own - ref.gather(-1, props.T).T
        j = val.argmax(0)                                                      # [B]
        tok = props.gather(0, j[None]).squeeze(0)
        scores = torch.full((seq.shape[0], self.vocab.size), float("-inf"))
        scores[torch.arange(seq.shape[0]), tok] = 0.0
        return scores, j


def batched(prompts: Sequence[Sequence[int]], batch_size: int, make_chooser: Callable[[], Chooser], *,
            eos_ids, pad_id, max_new_tokens, temperature=0.0, seed=None, record_scores=False,
            desc: str | None = None) -> tuple[list[DecodeResult], float]:
    """Decode all prompts in batches (a fresh chooser, i.e. fresh caches, per batch); returns results and seconds."""
    from llmtool.core.console import progress

    gen = None
    if temperature > 0:
        gen = torch.Generator().manual_seed(int(seed or 0))
    out: list[DecodeResult] = []
    starts = list(range(0, len(prompts), batch_size))
    t0 = time.time()
    for s in (progress(starts, desc, total=len(starts)) if desc else starts):
        out.extend(decode_loop(prompts[s:s + batch_size], make_chooser(), eos_ids=eos_ids, pad_id=pad_id,
                               max_new_tokens=max_new_tokens, temperature=temperature, generator=gen,
                               record_scores=record_scores))
    return out, time.time() - t0


def eos_ids_of(tokenizer, *models) -> list[int]:
    ids = {tokenizer.eos_token_id}
    for m in models:
        gc = getattr(m, "generation_config", None)
        e = getattr(gc, "eos_token_id", None) if gc is not None else None
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    return sorted(i for i in ids if i is not None)

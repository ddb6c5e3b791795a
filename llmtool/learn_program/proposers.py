"""Proposal distributions for LLM-PV: ``hf:DIR|alias``, ``openai:MODEL`` (+ ``--api-base``),
``replay:FILE`` and ``mock:NAME`` (test doubles).

Every proposer yields raw answer texts one at a time (internally batched / concurrent), so the
caller can stop drawing as soon as a candidate reaches validation accuracy 1.0. Samples are
independent: sample ``idx`` uses seed ``seed + idx``; the sampler never sees validation scores.

Defaults (spec §3.2): local models temperature 0.8, top-p 0.95; API models temperature 1.0.
"""

from __future__ import annotations

import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

from llmtool.core.console import UsageError


@dataclass
class Proposal:
    text: str
    tokens: int = 0


class Proposer:
    spec: str = ""

    def stream(self, prompt: str, k: int, seed: int, trial: int) -> Iterator[Proposal]:  # pragma: no cover
        raise NotImplementedError


class HFProposer(Proposer):
    """A local transformers model (directory or default alias), batched sampling via core.lm.generate."""

    def __init__(self, model: str, *, temperature: float = 0.8, top_p: float = 0.95, max_new_tokens: int = 2048,
                 batch_size: int = 8, model_obj=None, tokenizer=None):
        self.spec = f"hf:{model}"
        self.model_arg = model
        self.temperature, self.top_p, self.max_new_tokens, self.batch_size = temperature, top_p, max_new_tokens, batch_size
        self._model, self._tok = model_obj, tokenizer

    def _load(self):
        if self._model is None:
            from llmtool.core.models import load_model, load_tokenizer

            self._model = load_model(self.model_arg)
            self._tok = load_tokenizer(self.model_arg)
        return self._model, self._tok

    def stream(self, prompt: str, k: int, seed: int, trial: int) -> Iterator[Proposal]:
        from llmtool.core.lm import chat_prompt

        model, tok = self._load()
        text = chat_prompt(tok, prompt)
        done = 0
        while done < k:
            n = min(self.batch_size, k - done)
            for c in sample_shared_prefix(model, tok, text, n, max_new_tokens=self.max_new_tokens,
                                          temperature=self.temperature, top_p=self.top_p, seed=seed + done):
                yield c
            done += n


def cache_kwarg(model, cache) -> dict:
    """The KV-cache keyword of this transformers version (``cache`` in 5.x, ``past_key_values`` before)."""
    import inspect

    params = inspect.signature(model.forward).parameters
    return {"cache" if "cache" in params else "past_key_values": cache}


def output_cache(out):
    c = getattr(out, "cache", None)
    return c if c is not None else getattr(out, "past_key_values", None)


def sample_shared_prefix(model, tok, text: str, n: int, *, max_new_tokens: int, temperature: float, top_p: float,
                         seed: int) -> list[Proposal]:
    """``n`` samples of one prompt that share a single prefill.

    ``generate(..., num_return_sequences=n)`` prefills the (long: every training example) prompt n times;
    here the prompt minus its last token is run once, its KV cache repeated n times, and decoding
    continues from it. Token for token the same computation as :func:`llmtool.core.lm.generate` with
    the same seed (tested with greedy decoding); models whose cache cannot be repeated use that function.
    """
    import torch

    from llmtool.core.lm import generate

    ids = tok(text, add_special_tokens=False)["input_ids"]
    pad = tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id
    eos = tok.eos_token_id
    dev = next(model.parameters()).device
    x = torch.tensor([ids], dtype=torch.long, device=dev)
    torch.manual_seed(seed)
    cache = None
    if len(ids) > 1:
        with torch.no_grad():
            cache = output_cache(model(input_ids=x[:, :-1], use_cache=True))
    if cache is None or not hasattr(cache, "batch_repeat_interleave"):
        comps = generate(model, tok, [text], n=n, max_new_tokens=max_new_tokens, temperature=temperature,
                         top_p=top_p, batch_size=n, seed=seed)[0]
        return [Proposal(c.text, len(c.token_ids)) for c in comps]
    if n > 1:
        cache.batch_repeat_interleave(n)
    kwargs = dict(max_new_tokens=max_new_tokens, pad_token_id=pad, eos_token_id=eos)
    if temperature > 0:
        kwargs.update(do_sample=True, temperature=temperature, top_p=top_p, top_k=0)
    else:
        kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
    with torch.no_grad():
        out = model.generate(input_ids=x.repeat(n, 1), attention_mask=torch.ones((n, len(ids)), dtype=torch.long,
                                                                                  device=dev),
                             **cache_kwarg(model, cache), **kwargs)
    res = []
    for row in out[:, len(ids):].cpu().tolist():
        if eos is not None and eos in row:
            row = row[:row.index(eos)]
        res.append(Proposal(tok.decode(row, skip_special_tokens=True), len(row)))
    return res


class OpenAIProposer(Proposer):
    """Any OpenAI-compatible chat endpoint (vLLM, llama.cpp server, hosted APIs); key from $OPENAI_API_KEY."""

    def __init__(self, model: str, api_base: str, *, temperature: float = 1.0, max_tokens: int = 2048,
                 concurrency: int = 4, timeout: float = 1200.0, endpoint=None):
        from llmtool.core.endpoint import OpenAIEndpoint

        self.spec = f"openai:{model}"
        self.endpoint = endpoint or OpenAIEndpoint(api_base, model, timeout=timeout)
        self.temperature, self.max_tokens, self.concurrency = temperature, max_tokens, max(1, concurrency)
        self._checked = False

    def _one(self, prompt: str, seed: int) -> Proposal:
        msg = self.endpoint.chat([{"role": "user", "content": prompt}], n=1, temperature=self.temperature,
                                 max_tokens=self.max_tokens, seed=seed)[0]
        content = msg.get("content") or ""
        if isinstance(content, list):  # content parts
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        return Proposal(str(content), 0)

    def stream(self, prompt: str, k: int, seed: int, trial: int) -> Iterator[Proposal]:
        if not self._checked:
            self.endpoint.check()  # UsageError "cannot reach ..." when the server is down
            self._checked = True
        with ThreadPoolExecutor(self.concurrency) as pool:
            done = 0
            while done < k:
                n = min(self.concurrency, k - done)
                futs = [pool.submit(self._one, prompt, seed + done + i) for i in range(n)]
                for fu in futs:
                    yield fu.result()
                done += n


class ReplayProposer(Proposer):
    """Previously generated answers, in order: a JSONL file with ``raw_text`` (or ``text``/``code``) per
    line and an optional ``trial``; a run's ``candidates.jsonl`` works as is. Lines without ``trial`` are
    used by every trial."""

    def __init__(self, path: str):
        self.spec = f"replay:{path}"
        p = Path(path)
        if not p.is_file():
            raise UsageError(f"--proposer replay:{path}: no such file")
        self.rows: list[tuple[int | None, Proposal]] = []
        for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1):
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except ValueError as e:
                raise UsageError(f"{p}:{n}: not valid JSON ({e.msg})") from None
            if not isinstance(rec, dict):
                raise UsageError(f"{p}:{n}: expected a JSON object")
            if isinstance(rec.get("raw_text"), str):
                text = rec["raw_text"]
            elif isinstance(rec.get("text"), str):
                text = rec["text"]
            elif isinstance(rec.get("code"), str):
                text = json.dumps({"code": rec["code"]})
            else:
                raise UsageError(f"{p}:{n}: field 'raw_text' (or 'text'/'code') missing or not a string")
            trial = rec.get("trial")
            self.rows.append((trial if isinstance(trial, int) else None, Proposal(text, int(rec.get("tokens") or 0))))
        if not self.rows:
            raise UsageError(f"{p}: no proposals")

    def stream(self, prompt: str, k: int, seed: int, trial: int) -> Iterator[Proposal]:
        mine = [p for t, p in self.rows if t is None or t == trial]
        yield from mine[:k]


MOCKS = {
    "parity": '{"code": "def f(x):\\n    return x.count(\'1\') % 2\\n"}',
    "first-bit": '{"code": "def f(x):\\n    return x[0] == \'1\'\\n"}',
    "none": "I think the rule has to do with the number of ones, but I am not sure.",
    "syntax": '{"code": "def f(x)\\n    return 1\\n"}',
}


class MockProposer(Proposer):
    """Test doubles: the same fixed answer k times."""

    def __init__(self, name: str):
        if name not in MOCKS:
            raise UsageError(f"--proposer mock:{name}: unknown mock; known: {', '.join(MOCKS)}")
        self.spec = f"mock:{name}"
        self.text = MOCKS[name]

    def stream(self, prompt: str, k: int, seed: int, trial: int) -> Iterator[Proposal]:
        for _ in range(k):
            yield Proposal(self.text, 0)


def make_proposer(spec: str, *, api_base: str | None = None, temperature: float | None = None,
                  top_p: float = 0.95, max_new_tokens: int = 2048, batch_size: int = 8, concurrency: int = 4,
                  timeout: float = 1200.0) -> Proposer:
    kind, _, arg = spec.partition(":")
    if not arg:
        raise UsageError(f"--proposer {spec!r}: expected hf:MODEL, openai:MODEL, replay:FILE or mock:NAME")
    if kind == "hf":
        return HFProposer(arg, temperature=0.8 if temperature is None else temperature, top_p=top_p,
                          max_new_tokens=max_new_tokens, batch_size=batch_size)
    if kind == "openai":
        if not api_base:
            raise UsageError("--proposer openai:MODEL needs --api-base URL (e.g. http://localhost:8000/v1)")
        return OpenAIProposer(arg, api_base, temperature=1.0 if temperature is None else temperature,
                              max_tokens=max_new_tokens, concurrency=concurrency, timeout=timeout)
    if kind == "replay":
        return ReplayProposer(arg)
    if kind == "mock":
        return MockProposer(arg)
    raise UsageError(f"--proposer {spec!r}: unknown kind {kind!r} (hf, openai, replay, mock)")

"""Running a causal LM with a compressed KV cache: building the cache/press from options, greedy
generation (question-agnostic or question-aware), teacher-forced decode NLL, and the measurements
every report carries (KV bytes really held, prefill seconds, decode tokens/s).

Protocols:
* eviction compresses right after the prefill of the *context*; by default the question is appended
  afterwards (question-agnostic, kvpress ``compress_questions=False``); ``compress_question=True``
  prefills context + question together and compresses that (question-aware SnapKV protocol);
* quantized caches keep prefill attention exact and quantize what later steps read.
"""
from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch

from llmtool.core.console import UsageError
from llmtool.kvcache.cache import EvictableLayer, KVCache, attach, num_layers_of


@dataclass
class KVSpec:
    """What compression to apply (from CLI options or the benchmark)."""

    evict: str = "none"          # none | snapkv | pyramidkv | adakv | streamingllm
    critical: bool = False
    budget: float = 1.0
    window_size: int = 32
    kernel_size: int = 5
    first_stage_ratio: float = 0.5
    eps: float = 1e-4
    critical_mode: str = "critical"
    quant: str = "none"          # none | kivi | patternkv
    bits: int = 2
    group_size: int = 64
    residual_length: int = 64
    k_patterns: int = 32
    v_patterns: int = 32
    v_gate: bool = True
    seed: int = 0

    def label(self) -> str:
        parts = []
        if self.evict != "none":
            parts.append(("critical+" if self.critical else "") + f"{self.evict}@{self.budget:g}")
        if self.quant != "none":
            parts.append(f"{self.quant}-{self.bits}bit")
        return " ".join(parts) or "full"


def validate(spec: KVSpec) -> KVSpec:
    from llmtool.kvcache import adakv, pyramidkv, snapkv, streamingllm  # noqa: F401  (register presses)
    from llmtool.kvcache.eviction import PRESSES, check_budget
    from llmtool.kvcache.kivi import check_quant_args

    check_budget(spec.budget)
    if spec.evict != "none":
        PRESSES.get(spec.evict)
    if spec.critical and spec.evict in ("none", "streamingllm"):
        raise UsageError("--critical needs --evict snapkv, pyramidkv or adakv")
    if spec.quant not in ("none", "kivi", "patternkv"):
        raise UsageError(f"unknown --quant {spec.quant!r}; choose one of: none, kivi, patternkv")
    if spec.quant != "none":
        check_quant_args(spec.bits, spec.group_size, spec.residual_length)
        if spec.evict != "none":
            raise UsageError("--evict and --quant cannot be combined in one run; choose one")
    if spec.evict == "none" and spec.budget < 1.0:
        raise UsageError("--budget needs an eviction method (--evict snapkv|pyramidkv|adakv|streamingllm)")
    if spec.window_size < 1 or spec.kernel_size < 1:
        raise UsageError("--window-size and --kernel-size must be >= 1")
    return spec


def build_press(spec: KVSpec):
    if spec.evict == "none":
        return None
    from llmtool.kvcache import adakv, pyramidkv, snapkv, streamingllm  # noqa: F401  (register presses)
    from llmtool.kvcache.critical import CriticalKVPress
    from llmtool.kvcache.eviction import PRESSES

    cls = PRESSES.get(spec.evict)
    kwargs = {"budget": spec.budget, "window_size": spec.window_size}
    if spec.evict != "streamingllm":
        kwargs["kernel_size"] = spec.kernel_size
    press = cls(**kwargs)
    if spec.critical:
        press = CriticalKVPress(base=press, first_stage_ratio=spec.first_stage_ratio, eps=spec.eps,
                                mode=spec.critical_mode)
    return press


def build_cache(model, spec: KVSpec) -> KVCache:
    n = num_layers_of(model)
    if spec.quant == "kivi":
        from llmtool.kvcache.kivi import KIVILayer

        return KVCache([KIVILayer(spec.bits, spec.bits, spec.group_size, spec.residual_length) for _ in range(n)])
    if spec.quant == "patternkv":
        from llmtool.kvcache.patternkv import PatternKVLayer

        return KVCache([PatternKVLayer(spec.bits, spec.bits, spec.group_size, spec.residual_length,
                                       spec.k_patterns, spec.v_patterns, seed=spec.seed, v_gate=spec.v_gate)
                        for _ in range(n)])
    return KVCache.full(n)


def full_cache_bytes(model, tokens: int, batch: int = 1) -> int:
    """Bytes an uncompressed cache of ``tokens`` tokens takes in the model's dtype."""
    from llmtool.core import arch

    cfg = model.config.get_text_config(decoder=True)
    elem = next(model.parameters()).element_size()
    return 2 * cfg.num_hidden_layers * batch * arch.n_kv_heads(cfg) * tokens * arch.head_dim(cfg) * elem


@dataclass
class RunStats:
    prefill_seconds: float = 0.0
    decode_seconds: float = 0.0
    decode_tokens: int = 0
    kv_bytes: int = 0
    full_kv_bytes: int = 0
    context_tokens: int = 0
    extra: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        return self.decode_tokens / self.decode_seconds if self.decode_seconds > 0 else float("nan")

    def as_dict(self) -> dict:
        return {"prefill_s": self.prefill_seconds, "decode_tok_s": self.decode_tokens_per_s,
                "kv_bytes": self.kv_bytes, "full_kv_bytes": self.full_kv_bytes,
                "kv_fraction": self.kv_bytes / self.full_kv_bytes if self.full_kv_bytes else float("nan"),
                "context_tokens": self.context_tokens}


def _device(model):
    return next(model.parameters()).device


@torch.no_grad()
def greedy_decode(model, cache, last_logits: torch.Tensor, max_new_tokens: int, eos_token_id: int | None = None,
                  logits_out: list | None = None) -> tuple[list[int], int]:
    """Greedy decoding through ``cache`` (inside :func:`attach`) from ``last_logits`` ``[1, V]`` (the
    prompt's last position): at most ``max_new_tokens`` tokens, EOS included when hit. Returns the new
    token ids and the number of single-token forward passes run; ``logits_out`` collects their logits."""
    tokens, forwards = [], 0
    nxt = last_logits.argmax(-1).view(1, 1)
    while True:
        tokens.append(int(nxt))
        if (eos_token_id is not None and tokens[-1] == eos_token_id) or len(tokens) >= max_new_tokens:
            return tokens, forwards
        logits = model(input_ids=nxt, cache=cache, use_cache=True).logits[:, -1]
        forwards += 1
        if logits_out is not None:
            logits_out.append(logits.float().cpu())
        nxt = logits.argmax(-1).view(1, 1)


def target_nll(ids: torch.Tensor, logits: torch.Tensor) -> float:
    """Summed NLL of ``ids[:, 1:]`` given ``logits`` ``[1, len(ids) - 1, V]`` (teacher forcing through a
    cache, one chunk at a time) via :func:`llmtool.core.lm.token_nll`."""
    from llmtool.core.lm import token_nll

    padded = torch.cat([logits, logits[:, -1:]], dim=1)   # token_nll drops the last position's logits
    return token_nll(None, ids, logits=padded).sum().item()


@torch.no_grad()
def generate(model, context_ids: torch.Tensor, question_ids: torch.Tensor | None, spec: KVSpec,
             max_new_tokens: int = 16, eos_token_id: int | None = None, compress_question: bool = False,
             return_logits: bool = False):
    """Greedy generation with the compressed cache. ``context_ids``/``question_ids``: ``[1, T]``.
    Returns ``(new_token_ids list, RunStats, logits list or None)``."""
    dev = _device(model)
    cache = build_cache(model, spec)
    press = build_press(spec)
    stats = RunStats()
    logits_out = [] if return_logits else None
    ctx = context_ids.to(dev)
    q = question_ids.to(dev) if question_ids is not None and question_ids.numel() else None
    if compress_question and q is not None:
        ctx, q = torch.cat([ctx, q], dim=-1), None
    stats.context_tokens = ctx.shape[-1]
    with attach(model), (press.apply(model) if press is not None else nullcontext()):
        t0 = time.perf_counter()
        if press is not None:
            press.armed = True
        out = model(input_ids=ctx, cache=cache, use_cache=True)
        if press is not None:
            press.armed = False
        if q is not None:
            out = model(input_ids=q, cache=cache, use_cache=True)
        stats.prefill_seconds = time.perf_counter() - t0
        if return_logits:
            logits_out.append(out.logits[:, -1].float().cpu())
        t0 = time.perf_counter()
        tokens, stats.decode_tokens = greedy_decode(model, cache, out.logits[:, -1], max_new_tokens, eos_token_id,
                                                    logits_out)
        stats.decode_seconds = time.perf_counter() - t0
    stats.kv_bytes = cache.held_bytes()
    stats.full_kv_bytes = full_cache_bytes(model, cache.get_seq_length())
    stats.extra["cache"] = cache
    return tokens, stats, logits_out


def exact_chunk(spec: KVSpec, prefix: int, continuation: int) -> int:
    """Largest teacher-forcing chunk that gives *exactly* the token-by-token result: new tokens are
    never evicted, so eviction/full caches take the whole continuation at once; quantized caches
    flush whole windows of R tokens, so with the prefix a multiple of R a chunk of R tokens sees the
    same quantized history + exact window as one-token steps would."""
    if spec.quant == "none":
        return continuation
    return spec.residual_length if prefix % spec.residual_length == 0 else 1


@torch.no_grad()
def decode_nll(model, ids: torch.Tensor, prefix: int, spec: KVSpec, chunk: int | None = 1) -> tuple[float, int, RunStats]:
    """Prefill ``ids[:prefix]`` (compressing it), then teacher-force the rest through the compressed
    cache, ``chunk`` tokens per forward (1 = token by token; None = :func:`exact_chunk`).
    Returns (total NLL of the continuation, its token count, stats)."""
    if ids.numel() <= prefix + 1:
        raise UsageError(f"need more than {prefix + 1} tokens for decode perplexity, got {ids.numel()}")
    dev = _device(model)
    ids = ids.to(dev).view(1, -1)
    total = ids.shape[-1]
    chunk = chunk or exact_chunk(spec, prefix, total - prefix)
    cache = build_cache(model, spec)
    press = build_press(spec)
    stats = RunStats(context_tokens=prefix)
    nll, count = 0.0, 0
    with attach(model), (press.apply(model) if press is not None else nullcontext()):
        t0 = time.perf_counter()
        if press is not None:
            press.armed = True
        out = model(input_ids=ids[:, :prefix], cache=cache, use_cache=True)
        if press is not None:
            press.armed = False
        stats.prefill_seconds = time.perf_counter() - t0
        t0 = time.perf_counter()
        logits = out.logits[:, -1:]
        pos = prefix
        while pos < total:
            n = min(logits.shape[1], total - pos)
            nll += target_nll(ids[:, pos - 1:pos + n], logits[:, :n])
            count += n
            pos += n
            if pos >= total:
                break
            step = ids[:, pos - 1:min(pos - 1 + chunk, total - 1)]
            logits = model(input_ids=step, cache=cache, use_cache=True).logits
            stats.decode_tokens += step.shape[-1]
        stats.decode_seconds = time.perf_counter() - t0
    stats.kv_bytes = cache.held_bytes()
    stats.full_kv_bytes = full_cache_bytes(model, cache.get_seq_length())
    return nll, count, stats


def ppl(nll: float, count: int) -> float:
    return math.exp(nll / max(1, count))


__all__ = ["KVSpec", "validate", "build_press", "build_cache", "generate", "decode_nll", "RunStats",
           "EvictableLayer"]


@dataclass
class PrefillState:
    """What one uncompressed prefill leaves behind, so many compression settings can be compared on
    the same prefix without re-running it (compression after prefill only affects later tokens)."""

    keys: list
    values: list
    hidden: list
    position_embeddings: tuple
    tokens: int


@torch.no_grad()
def capture_prefill(model, ids: torch.Tensor) -> PrefillState:
    from llmtool.kvcache.cache import attention_modules

    mods = attention_modules(model)
    hidden = [None] * len(mods)
    pos = {}

    def hook(module, args, kwargs):
        hidden[module.layer_idx] = kwargs.get("hidden_states", args[0] if args else None)
        pos["pe"] = kwargs["position_embeddings"]

    handles = [m.register_forward_pre_hook(hook, with_kwargs=True) for m in mods]
    cache = KVCache.full(num_layers_of(model))
    try:
        with attach(model):
            model(input_ids=ids.to(_device(model)), cache=cache, use_cache=True)
    finally:
        for h in handles:
            h.remove()
    return PrefillState([l.keys for l in cache.layers], [l.values for l in cache.layers], hidden, pos["pe"],
                        ids.shape[-1])


@torch.no_grad()
def cache_from_prefill(model, state: PrefillState, spec: KVSpec) -> KVCache:
    """The cache ``spec`` would hold right after prefilling ``state``'s tokens."""
    from llmtool.kvcache.cache import attention_modules

    cache = build_cache(model, spec)
    press = build_press(spec)
    mods = attention_modules(model)
    for i, layer in enumerate(cache.layers):
        layer.update(state.keys[i].clone(), state.values[i].clone())
        if press is not None:
            press.compress(mods[i], state.hidden[i], layer, state.position_embeddings)
    return cache


@torch.no_grad()
def continue_nll(model, cache: KVCache, ids: torch.Tensor, prefix_logits: torch.Tensor, chunk: int,
                 speed_steps: int = 0) -> tuple[float, int, float]:
    """Teacher-forced NLL of ``ids`` (the continuation) after a prefilled ``cache``; optional
    greedy single-token steps afterwards to time decoding. Returns (nll, tokens, decode tok/s)."""
    dev = _device(model)
    ids = ids.to(dev).view(1, -1)
    nll = -torch.log_softmax(prefix_logits.float(), -1)[0, ids[0, 0]].item()
    rate = float("nan")
    with attach(model):
        for start in range(0, ids.shape[-1] - 1, chunk):
            step = ids[:, start:min(start + chunk, ids.shape[-1] - 1)]
            logits = model(input_ids=step, cache=cache, use_cache=True).logits
            nll += target_nll(ids[:, start:start + 1 + step.shape[-1]], logits)
        if speed_steps:
            t0 = time.perf_counter()
            _, forwards = greedy_decode(model, cache, logits[:, -1], speed_steps + 1)
            rate = forwards / (time.perf_counter() - t0)
    return nll, ids.shape[-1], rate

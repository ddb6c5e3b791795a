"""The planned work of each long command, as :class:`llmtool.core.eta.Stage` s computed from its sizes.

One function per command maps the command's options to stages; the command calls
``eta_plans.announce_<command>(...)`` (or ``eta.announce(plan(...), shape.params)``) just before its work.
Every function is cheap (reads ``config.json`` only) and torch-free; the constants that turn these units into
seconds live in :mod:`llmtool.core.eta`. Counts are upper bounds where a run may stop early (EOS, early stop).
"""
from __future__ import annotations

import math
from typing import Any

from llmtool.core import eta
from llmtool.core.eta import Shape, Stage, decode, fixed, forward, fmt_count, linalg, train


def _cov_flops(shape: Shape) -> float:
    """Flops per token of accumulating every layer's input covariances (X^T X per distinct input)."""
    return 2.0 * shape.layers * sum(d * d for d in shape.input_dims())


def _svd_flops(m: int, n: int) -> float:
    k = min(m, n)
    return 4.0 * m * n * k + 8.0 * k ** 3


def announce(stages: list[Stage], shape: Shape | None, what: str) -> dict | None:
    return eta.announce(stages, shape.params if shape is not None else 0.0, what)


# ------------------------------------------------------------------------------------------ quantize
def quantize(shape: Shape, cfg: Any, calib_samples: int, calib_seqlen: int, evaluate: bool, seqlen: int,
             max_tokens: int) -> list[Stage]:
    st: list[Stage] = []
    if evaluate:
        st.append(forward("eval", 2 * max_tokens, shape, seqlen, f"eval 2x{fmt_count(max_tokens)} tokens"))
    steps = int(getattr(cfg, "train_steps", 0) or 0)
    gptq = cfg.weight_algorithm == "gptq"
    if gptq or steps:
        tok = calib_samples * calib_seqlen
        s = forward("calibration", tok, shape, calib_seqlen, f"calibration {calib_samples}x{calib_seqlen} tokens")
        if gptq:  # layer-wise forwards and Hessian accumulation
            s.flops_per_unit += _cov_flops(shape)
        st.append(s)
    if steps:
        tb, ts = int(getattr(cfg, "train_batch", 1)), int(getattr(cfg, "train_seqlen", 256))
        st.append(train("rotation training", steps * tb * ts, shape, ts, f"{steps} rotation steps x {tb * ts} tokens"))
        per_step = shape.layers if getattr(cfg, "name", "") == "respinquant" else 1
        st.append(linalg("rotation training", steps * per_step * 20.0 * shape.hidden ** 3, ""))
    if gptq:
        flops = shape.layers * sum(2.0 * o * i * i + i ** 3 for o, i in shape.linears())
        st.append(linalg("gptq", flops, f"GPTQ on {shape.layers * 7} matrices"))
    if cfg.w_clip or not gptq:  # clip-ratio grid search: a few passes of quantize-and-compare per weight
        st.append(linalg("weight quantization", shape.params * 400.0, ""))
    return st


# ------------------------------------------------------------------------------------------ compress
def compress(shape: Shape, cfg: Any) -> list[Stage]:
    st: list[Stage] = []
    mats = [lin for _ in range(shape.layers) for lin in shape.linears()]
    if getattr(cfg, "needs_data", True):
        tok = cfg.calib_samples * cfg.calib_seqlen
        s = forward("calibration", tok, shape, cfg.calib_seqlen,
                    f"calibration {cfg.calib_samples}x{cfg.calib_seqlen} tokens")
        s.flops_per_unit += _cov_flops(shape)
        st.append(s)
        # whitening: one symmetric factorization per distinct input, and the whitened product per matrix
        st.append(linalg("whitening", shape.layers * sum(10.0 * d ** 3 for d in shape.input_dims())
                         + sum(2.0 * o * i * i for o, i in mats), ""))
    if hasattr(cfg, "grad_samples"):
        st.append(train("gradients", cfg.grad_samples * cfg.grad_seqlen, shape, cfg.grad_seqlen,
                        f"gradients {cfg.grad_samples}x{cfg.grad_seqlen} tokens"))
    stages = int(getattr(cfg, "stages", None) or 1)
    st.append(linalg("svd", stages * sum(_svd_flops(o, i) for o, i in mats), f"SVD of {len(mats)} matrices"
                     + (f" x {stages} stages" if stages > 1 else "")))
    if getattr(cfg, "correction", "none") != "none":
        st.append(train("correction", (stages - 1) * cfg.proj_samples * cfg.proj_seqlen, shape, cfg.proj_seqlen,
                        "correction gradients"))
    return st


# ------------------------------------------------------------------------------------------ edit
def edit(shape: Shape, requests: int, layers: list[int], v_steps: int, mom2_samples: int, stats_cached: bool,
         method: str = "memit") -> list[Stage]:
    st: list[Stage] = []
    if not stats_cached:
        # the statistics pass runs the whole model over ceil(samples / 256) windows of 256 tokens
        n = math.ceil(mom2_samples / 256) * 256
        s = forward("key statistics", n, shape, 256, f"key statistics {fmt_count(n)} positions")
        s.flops_per_unit += 2.0 * len(layers) * shape.intermediate ** 2
        st.append(s)
    if requests:
        # target optimisation: v_steps forward+backward passes over each request's ~16 prompts of ~12 tokens
        st.append(train("targets", requests * v_steps * 16 * 12, shape, 12, f"{requests} requests x {v_steps} steps"))
        d = shape.intermediate
        st.append(linalg("updates", len(layers) * (4.0 * d ** 3 + (30.0 * d ** 3 if method == "alphaedit" else 0)),
                         ""))
    return st


def edit_stats_cached(model: Any, layers: list[int], corpus: str, samples: int, seed: int) -> bool:
    """Whether every layer's key statistics are already in the cache (then that stage costs nothing)."""
    try:
        from llmtool.core.models import resolve_model
        from llmtool.edit.covariance import _file, stats_root
        from llmtool.edit.run import fingerprint

        fp = fingerprint(resolve_model(model))
        def present(l: int) -> bool:
            f = _file(stats_root(), fp, l, corpus, samples, 256, seed)
            return f.is_file() or f.with_name(f.stem + "-bos" + f.suffix).is_file()  # BOS-prefixed windows

        return all(present(l) for l in layers)
    except Exception:  # an estimate never fails a command
        return False


# ------------------------------------------------------------------------------------------ train
def grpo(shape: Shape, steps: int, prompts: int, group: int, max_new_tokens: int, batch_size: int,
         kl: bool, prompt_tokens: int = 48, endpoint: bool = False) -> list[Stage]:
    rollouts = prompts * group
    st: list[Stage] = []
    if not endpoint:
        calls = math.ceil(rollouts / batch_size)
        st.append(decode("rollouts", steps * calls * max_new_tokens, min(batch_size, rollouts), shape,
                         prompt_tokens + max_new_tokens / 2,
                         f"{steps} phases x {rollouts} rollouts x up to {max_new_tokens} tokens"))
    seq = prompt_tokens + max_new_tokens
    tok = steps * rollouts * seq
    st.append(train("updates", tok, shape, seq, f"train {fmt_count(tok)} tokens"))
    st.append(forward("updates", tok * (2 if kl else 1), shape, seq, ""))  # old (and reference) log-probs
    return st


def prompt_tokens(rows: list[dict], system_prompt: str | None = None, field: str = "prompt") -> float:
    """Mean prompt length in tokens (about 4 characters each, plus a chat template's ~20)."""
    texts = [str(r.get(field, "")) for r in rows[:1000] if isinstance(r, dict)]
    mean = sum(map(len, texts)) / max(1, len(texts))
    return mean / 4.0 + 20 + len(system_prompt or "") / 4.0


def tokenizer_vocab(tokenizer: Any) -> int:
    """Vocabulary size of a tokenizer source (its model's config.json; 50k where unknown)."""
    try:
        from llmtool.core.checkpoint import read_config
        from llmtool.core.models import resolve_model

        return int(read_config(resolve_model(tokenizer)).get("vocab_size") or 50000)
    except Exception:
        return 50000


def pretrain(shape: Shape, steps: int, batch: int, grad_accum: int, max_length: int, val_blocks: int) -> list[Stage]:
    tok = steps * batch * grad_accum * max_length
    return [train("train", tok, shape, max_length, f"{steps} updates x {batch * grad_accum}x{max_length} tokens"),
            fixed("train", steps * grad_accum * 0.01, ""),  # per-step python overhead (clipper, metrics)
            forward("eval", val_blocks * max_length, shape, max_length, f"val {val_blocks}x{max_length} tokens")]


def sft(shape: Shape, steps: int, batch: int, grad_accum: int, max_length: int, row_tokens: float) -> list[Stage]:
    seq = min(max_length, max(2.0, row_tokens))
    tok = steps * batch * grad_accum * seq
    return [train("train", tok, shape, seq, f"{steps} updates x {batch * grad_accum} rows of ~{seq:.0f} tokens"),
            fixed("train", steps * grad_accum * 0.05, "")]


def sft_row_tokens(rows: list[dict]) -> float:
    """Mean tokens per SFT row, from its characters (about 4 per token)."""
    if not rows:
        return 2.0
    chars = [sum(len(str(v)) for k, v in r.items() if k in ("prompt", "completion", "response", "text"))
             for r in rows[:2000] if isinstance(r, dict)]
    return max(2.0, sum(chars) / len(chars) / 4.0 + 8)


# ------------------------------------------------------------------------------------------ generation
def kvcache_evaluate(shape: Shape, task: str, length: int, samples: int, prefix: int, continuation: int,
                     max_new_tokens: int = 24) -> list[Stage]:
    if task == "ppl":
        return [forward("prefill", samples * prefix, shape, prefix, f"{samples} x {prefix} prefill tokens"),
                decode("decode", samples * continuation, 1, shape, prefix + continuation / 2,
                       f"{samples} x {continuation} decode steps")]
    n = samples * (4 if task == "ruler" else 1)
    return [forward("prefill", n * length, shape, length, f"{n} contexts x {length} tokens"),
            decode("decode", n * max_new_tokens, 1, shape, length, f"up to {n} x {max_new_tokens} decode steps")]


def kvcache_generate(shape: Shape, prompts: int, prompt_tokens: float, max_new_tokens: int) -> list[Stage]:
    return [forward("prefill", prompts * prompt_tokens, shape, prompt_tokens,
                    f"{prompts} prompts x ~{prompt_tokens:.0f} tokens"),
            decode("decode", prompts * max_new_tokens, 1, shape, prompt_tokens,
                   f"up to {prompts} x {max_new_tokens} decode steps")]


def generation(name: str, shape: Shape, texts: int, prompt_tokens: float, max_new_tokens: int, batch: int,
               label: str = "") -> list[Stage]:
    """Batched sampling of ``texts`` continuations (``batch`` per call) of ~``prompt_tokens`` prompts."""
    calls = math.ceil(texts / max(1, batch))
    b = min(batch, texts)
    return [forward(name, texts * prompt_tokens, shape, prompt_tokens, ""),
            decode(name, calls * max_new_tokens, b, shape, prompt_tokens + max_new_tokens / 2,
                   label or f"{name} {texts} x up to {max_new_tokens} tokens")]


def learn_program(shape: Shape, samples: int, trials: int, prompt_tokens: float, max_new_tokens: int,
                  batch: int, checks: int) -> list[Stage]:
    n = samples * trials
    st = generation("proposals", shape, n, prompt_tokens, max_new_tokens, batch,
                    f"up to {n} proposals x {max_new_tokens} tokens (prompt ~{fmt_count(prompt_tokens)} tokens)")
    st.append(fixed("verification", n * (0.3 + checks * 2e-5), f"{n} candidates run in the sandbox"))
    return st


def ppl(shape: Shape, tokens: int, seqlen: int) -> list[Stage]:
    return [forward("perplexity", tokens, shape, seqlen, f"perplexity {fmt_count(tokens)} tokens")]


# ------------------------------------------------------------------------------------------ route, select-data, agents
def finetune(name: str, shape: Shape, rows: list[dict], epochs: float, max_steps: int, batch_size: int,
             max_length: int, grad_accum: int = 1) -> Stage:
    """Trainer fine-tuning over ``rows`` (``max_steps`` > 0 overrides ``epochs``)."""
    seq = min(max_length, sft_row_tokens(rows))
    n = max_steps * batch_size * grad_accum if max_steps and max_steps > 0 else epochs * len(rows)
    return train(name, n * seq, shape, seq, f"{name} {fmt_count(n)} rows x ~{seq:.0f} tokens")


def route_make_experts(shape: Shape, rows: list[dict], domains: list[str], epochs: float, max_steps: int,
                       batch_size: int, max_length: int) -> list[Stage]:
    st = [finetune(f"expert {d}", shape, [r for r in rows if r.get("domain") == d], epochs, max_steps, batch_size,
                   max_length) for d in domains]
    st.append(fixed("loading", len(domains) * LOAD_S(shape), ""))
    return st


def LOAD_S(shape: Shape) -> float:
    return eta.LOAD_S_PER_BPARAM * shape.params / 1e9


def route_train(base: Shape, experts: list[Shape], rows: list[dict], epochs: float, max_steps: int,
                batch_size: int, max_length: int) -> list[Stage]:
    st = [finetune("router", base, rows, epochs, max_steps, batch_size, max_length)]
    tok = st[0].units
    seq = min(max_length, sft_row_tokens(rows))
    st += [forward("experts", tok, e, seq, f"{len(experts)} experts' forwards") for e in experts]
    st.append(fixed("loading", sum(LOAD_S(e) for e in experts), ""))
    for s in st[2:-1]:
        s.label = ""
    return st


MINILM = Shape.from_config({"hidden_size": 384, "num_hidden_layers": 6, "num_attention_heads": 12,
                            "intermediate_size": 1536, "vocab_size": 30522})


def embed(shape: Shape, texts: list[str], max_length: int) -> list[Stage]:
    tok = sum(min(max_length, len(t) / 4.0 + 2) for t in texts)
    return [forward("embed", tok, shape, max_length, f"embed {len(texts)} texts, ~{fmt_count(tok)} tokens")]


def bench_agent(shape: Shape, episodes: int, rounds: int, max_new_tokens: int) -> list[Stage]:
    """Episodes x rounds agent turns: a growing conversation is prefilled, then up to max_new_tokens decoded."""
    turns = episodes * rounds
    ctx = 400 + 60 * rounds / 2  # system prompt and observations, the history grows with the rounds
    return [forward("prompts", turns * ctx, shape, ctx, ""),
            decode("turns", turns * max_new_tokens, 1, shape, ctx,
                   f"up to {episodes} episodes x {rounds} rounds x {max_new_tokens} tokens")]


def mix_proxies(config: Any, domains: int) -> list[Stage]:
    """select-data mix: the proxy models a mixer trains (DoReMi: reference + DRO proxy; RegMix: --proxies)."""
    if not hasattr(config, "proxy_d_model"):
        return []
    shape = Shape.from_config({"hidden_size": config.proxy_d_model, "num_hidden_layers": config.proxy_layers,
                               "num_attention_heads": config.proxy_heads, "vocab_size": config.proxy_vocab})
    n = int(getattr(config, "proxies", 2))
    batch = config.per_domain * domains if hasattr(config, "per_domain") else config.proxy_batch_size
    tok = n * config.steps * batch * config.proxy_context
    return [train("proxies", tok, shape, config.proxy_context, f"{n} proxies x {config.steps} steps x {batch} "
                  f"sequences of {config.proxy_context} tokens"),
            fixed("proxies", n * config.steps * 0.004, "")]

"""`llmtool kvcache generate|evaluate`: generation and long-context evaluation under a compressed KV
cache (eviction: snapkv, pyramidkv, adakv, streamingllm, each with optional `--critical`;
quantization: kivi, patternkv). Model weights are never touched."""
from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info, progress
from llmtool.core.options import EvalData, ModelArg

app = typer.Typer(no_args_is_help=True)

Evict = Annotated[str, typer.Option("--evict", help="Eviction: none, snapkv, pyramidkv, adakv, streamingllm.")]
Critical = Annotated[bool, typer.Option("--critical", help="CriticalKV two-stage selection on top of --evict.")]
Budget = Annotated[float, typer.Option("--budget", help="Fraction of the context's KV entries kept, in (0, 1].")]
Window = Annotated[int, typer.Option("--window-size", help="Observation window (always kept).")]
Kernel = Annotated[int, typer.Option("--kernel-size", help="SnapKV pooling kernel.")]
Alpha = Annotated[float, typer.Option("--first-stage-ratio", help="CriticalKV stage-1 share of the budget.")]
Quant = Annotated[str, typer.Option("--quant", help="KV quantization: none, kivi, patternkv.")]
Bits = Annotated[int, typer.Option("--bits", help="Quantization bits: 2, 4, 8 or 16 (identity).")]
Group = Annotated[int, typer.Option("--group-size", help="Quantization group size G (V groups: min(G, head dim)).")]
Residual = Annotated[int, typer.Option("--residual-length", help="Full-precision window R (multiple of G).")]
Patterns = Annotated[int, typer.Option("--patterns", help="PatternKV initial K and V patterns per head.")]
Gate = Annotated[bool, typer.Option("--v-gate/--no-v-gate", help="PatternKV value gate.")]
CompressQ = Annotated[bool, typer.Option("--compress-question", help="Question-aware protocol (compress "
                                         "context + question); default question-agnostic.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")]


def _spec(evict, critical, budget, window_size, kernel_size, first_stage_ratio, quant, bits, group_size,
          residual_length, patterns, v_gate):
    from llmtool.kvcache.pipeline import KVSpec, validate

    for name, value in (("--window-size", window_size), ("--kernel-size", kernel_size), ("--patterns", patterns)):
        if value < 1:
            raise UsageError(f"{name} {value}: must be >= 1")
    return validate(KVSpec(evict=evict, critical=critical, budget=budget, window_size=window_size,
                           kernel_size=kernel_size, first_stage_ratio=first_stage_ratio, quant=quant, bits=bits,
                           group_size=group_size, residual_length=residual_length, k_patterns=patterns,
                           v_patterns=patterns, v_gate=v_gate, seed=OPTIONS.seed))


def _load(model):
    import torch

    from llmtool.core.models import load_model, load_tokenizer, set_seed

    if OPTIONS.device == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    set_seed()
    return load_model(model), load_tokenizer(model)


@app.command("generate")
def generate_cmd(
    model: ModelArg,
    prompts: Annotated[Path, typer.Option("--prompts", help="JSONL: one object per line with `context` "
                                          "(or `prompt`) and optional `question`.")],
    out: Annotated[Optional[Path], typer.Option("--out", help="Write results as JSONL here.")] = None,
    max_new_tokens: MaxNew = 32,
    evict: Evict = "none", critical: Critical = False, budget: Budget = 1.0, window_size: Window = 32,
    kernel_size: Kernel = 5, first_stage_ratio: Alpha = 0.5, quant: Quant = "none", bits: Bits = 2,
    group_size: Group = 64, residual_length: Residual = 64, patterns: Patterns = 32, v_gate: Gate = True,
    compress_question: CompressQ = False,
) -> None:
    """Greedy generation for each prompt with the chosen KV compression; reports KV bytes held and decode tokens/s."""
    from llmtool.core.data import read_jsonl, tokenize, write_jsonl
    from llmtool.kvcache.pipeline import generate

    spec = _spec(evict, critical, budget, window_size, kernel_size, first_stage_ratio, quant, bits, group_size,
                 residual_length, patterns, v_gate)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    rows_in = read_jsonl(prompts)
    for i, r in enumerate(rows_in, 1):
        if not isinstance(r.get("context", r.get("prompt")), str):
            raise UsageError(f"{prompts}: record {i}: needs a string field 'context' (or 'prompt')")
        if "question" in r and not isinstance(r["question"], str):
            raise UsageError(f"{prompts}: record {i}: field 'question' must be a string")
    m, tok = _load(model)
    results = []
    for r in progress(rows_in, "generate"):
        ctx = tokenize(tok, r.get("context", r.get("prompt")))
        if ctx.numel() < 1:
            raise UsageError(f"{prompts}: empty context")
        q = tokenize(tok, r["question"]) if r.get("question") else None
        ids, stats, _ = generate(m, ctx[None], None if q is None else q[None], spec, max_new_tokens,
                                 eos_token_id=tok.eos_token_id, compress_question=compress_question)
        results.append({"method": spec.label(), "completion": tok.decode(ids, skip_special_tokens=True),
                        "new_tokens": len(ids), **stats.as_dict()})
    if out is not None:
        write_jsonl(out, results)
        info(f"wrote {out}")
    emit({"model": str(model), "method": spec.label(), "protocol": "question-aware" if compress_question
          else "question-agnostic", "results": results},
         rows=[{k: r[k] for k in ("completion", "kv_bytes", "kv_fraction", "decode_tok_s")} for r in results],
         title=f"kvcache generate ({spec.label()})")


def evaluate_spec(m, tok, spec, task: str, length: int, samples: int, seed: int, data: str, prefix: int,
                  continuation: int, compress_question: bool = False, max_new_tokens: int = 24,
                  filler: str = "austen-train") -> dict:
    """One evaluation (task accuracy or decode perplexity) of ``spec``; shared with the benchmark."""
    import math

    from llmtool.core.data import load_text, tokenize
    from llmtool.kvcache import tasks as tasks_mod
    from llmtool.kvcache.pipeline import decode_nll, generate

    kv, full, dec_tok, dec_s = 0, 0, 0, 0.0
    if task == "ppl":
        ids = tokenize(tok, load_text(data))
        span = prefix + continuation
        if ids.numel() < span * samples:
            raise UsageError(f"{data}: {ids.numel()} tokens, need {span * samples} for --samples {samples}")
        nll, count = 0.0, 0
        for i in progress(range(samples), "decode ppl"):
            a, c, st = decode_nll(m, ids[i * span:(i + 1) * span], prefix, spec, chunk=None)
            nll, count = nll + a, count + c
            kv, full, dec_tok, dec_s = kv + st.kv_bytes, full + st.full_kv_bytes, dec_tok + st.decode_tokens, \
                dec_s + st.decode_seconds
        metric = {"ppl": math.exp(nll / count), "nll": nll / count, "tokens": count}
    else:
        names = tasks_mod.TASKS if task == "ruler" else (task,)
        per_task = {}
        for name in names:
            total = 0.0
            for s in progress(tasks_mod.make_samples(name, tok, length, samples, seed, filler), name):
                ctx = tokenize(tok, s.context)[None]
                q = tokenize(tok, "\n\n" + s.question)[None]
                ids, st, _ = generate(m, ctx, q, spec, max_new_tokens, eos_token_id=tok.eos_token_id,
                                      compress_question=compress_question)
                total += tasks_mod.score(tok.decode(ids, skip_special_tokens=True), s.answers)
                kv, full, dec_tok, dec_s = kv + st.kv_bytes, full + st.full_kv_bytes, \
                    dec_tok + st.decode_tokens, dec_s + st.decode_seconds
            per_task[name] = 100.0 * total / samples
        metric = {"accuracy": sum(per_task.values()) / len(per_task), **{f"acc_{k}": v for k, v in per_task.items()}}
    return {"method": spec.label(), **metric, "kv_bytes_mean": kv / max(1, samples * (1 if task != "ruler" else 4)),
            "kv_fraction": kv / full if full else float("nan"),
            "decode_tok_s": dec_tok / dec_s if dec_s > 0 else float("nan")}


@app.command("evaluate")
def evaluate_cmd(
    model: ModelArg,
    task: Annotated[str, typer.Option("--task", help="niah_single, niah_multikey, variable_tracking, "
                                      "aggregation, ruler (all four), or ppl (decode perplexity on real text).")],
    length: Annotated[int, typer.Option("--length", help="Context length in tokens for synthetic tasks.")] = 1024,
    samples: Annotated[int, typer.Option("--samples", help="Samples per task (ppl: sequences).")] = 10,
    data: EvalData = "austen-test",
    filler: Annotated[str, typer.Option("--filler", help="Synthetic tasks: corpus (name or file) for the "
                                        "haystack text.")] = "austen-train",
    prefix: Annotated[int, typer.Option("--prefix", help="ppl: prefill tokens (compressed).")] = 512,
    continuation: Annotated[int, typer.Option("--continuation", help="ppl: teacher-forced decode tokens.")] = 256,
    evict: Evict = "none", critical: Critical = False, budget: Budget = 1.0, window_size: Window = 32,
    kernel_size: Kernel = 5, first_stage_ratio: Alpha = 0.5, quant: Quant = "none", bits: Bits = 2,
    group_size: Group = 64, residual_length: Residual = 64, patterns: Patterns = 32, v_gate: Gate = True,
    compress_question: CompressQ = False,
) -> None:
    """Accuracy on seeded RULER-style tasks, or decode perplexity, under the chosen KV compression."""
    from llmtool.kvcache.tasks import TASKS

    spec = _spec(evict, critical, budget, window_size, kernel_size, first_stage_ratio, quant, bits, group_size,
                 residual_length, patterns, v_gate)
    if task not in (*TASKS, "ruler", "ppl"):
        raise UsageError(f"unknown --task {task!r}; choose one of: {', '.join(TASKS)}, ruler, ppl")
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be >= 1")
    if task == "ppl" and (prefix < 2 or continuation < 1):
        raise UsageError("--prefix must be >= 2 and --continuation >= 1")
    if task != "ppl" and length < 64:
        raise UsageError(f"--length {length}: must be at least 64 tokens")
    m, tok = _load(model)
    result = evaluate_spec(m, tok, spec, task, length, samples, OPTIONS.seed, data, prefix, continuation,
                           compress_question, filler=filler)
    result = {"model": str(model), "task": task, "length": length if task != "ppl" else prefix + continuation,
              "protocol": "question-aware" if compress_question else "question-agnostic", **result}
    emit(result, title=f"kvcache evaluate {task}")

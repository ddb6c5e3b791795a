"""`llmtool kvcache generate|evaluate`: generation and long-context evaluation under a compressed KV
cache. ``--method`` and its options come from :data:`llmtool.kvcache.methods.METHODS` (eviction:
snapkv, pyramidkv, adakv, streamingllm, SnapKV-family ones with optional ``--critical``; quantization:
kivi, patternkv; ``full`` = uncompressed). Model weights are never touched."""

from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info, progress
from llmtool.core.options import EvalData, ModelArg
from llmtool.core.registry import MethodConfig, method_options
from llmtool.kvcache.methods import METHODS

app = typer.Typer(no_args_is_help=True)

CompressQ = Annotated[bool, typer.Option("--compress-question", help="Question-aware protocol (compress "
                                         "context + question); default question-agnostic.")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", help="Tokens to generate per prompt.")]


def _spec(config: MethodConfig):
    from llmtool.kvcache.methods import to_spec

    return to_spec(config, seed=OPTIONS.seed)


def _load(model):
    from llmtool.core.job import apply_threads
    from llmtool.core.models import load_model, load_tokenizer, set_seed

    apply_threads()
    set_seed()
    return load_model(model), load_tokenizer(model)


@app.command("generate")
@method_options(METHODS, default="full")
def generate_cmd(
    model: ModelArg,
    prompts: Annotated[Path, typer.Option("--prompts", help="JSONL: one object per line with `context` "
                                          "(or `prompt`) and optional `question`.")],
    config: MethodConfig,
    out: Annotated[Optional[Path], typer.Option("-o", "--out", help="Write results as JSONL here.")] = None,
    overwrite: Annotated[bool, typer.Option("--overwrite", help="Replace --out if it exists.")] = False,
    max_new_tokens: MaxNew = 32,
    compress_question: CompressQ = False,
) -> None:
    """Greedy generation for each prompt with the chosen KV compression; reports KV bytes held and decode tokens/s."""
    from llmtool.core.preflight import preflight

    preflight(model, out, inputs=(prompts,), overwrite=overwrite)  # fail fast, before torch is imported
    from llmtool.core.data import read_jsonl, scoring_bos, tokenize, tokenize_prompt, write_jsonl
    from llmtool.kvcache.pipeline import generate

    spec = _spec(config)
    if out is not None:
        from llmtool.core.checkpoint import check_output

        check_output(out, overwrite)
    if max_new_tokens < 1:
        raise UsageError(f"--max-new-tokens {max_new_tokens}: must be >= 1")
    rows_in = read_jsonl(prompts)
    for i, r in enumerate(rows_in, 1):
        if not isinstance(r.get("context", r.get("prompt")), str):
            raise UsageError(f"{prompts}: record {i}: needs a string field 'context' (or 'prompt')")
        if "question" in r and not isinstance(r["question"], str):
            raise UsageError(f"{prompts}: record {i}: field 'question' must be a string")
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    texts = [{"prompt": r.get("context", r.get("prompt", "")) + r.get("question", "")} for r in rows_in]
    plans.announce(plans.kvcache_generate(shape, len(rows_in), plans.prompt_tokens(texts) - 20, max_new_tokens),
                   shape, "kvcache generate")
    m, tok = _load(model)
    results = []
    for r in progress(rows_in, "generate"):
        ctx = tokenize_prompt(tok, r.get("context", r.get("prompt")))    # BOS first on Gemma / Llama
        if ctx.numel() < 1 or (ctx.numel() == 1 and scoring_bos(tok) is not None):
            raise UsageError(f"{prompts}: empty context")
        q = tokenize(tok, r["question"]) if r.get("question") else None
        ids, stats, _ = generate(m, ctx[None], None if q is None else q[None], spec, max_new_tokens,
                                 eos_token_id=tok.eos_token_id, compress_question=compress_question)
        results.append({"method": spec.label(), "completion": tok.decode(ids, skip_special_tokens=True),
                        "new_tokens": len(ids), **stats.as_dict()})
    if out is not None:
        write_jsonl(out, results)  # atomic; --overwrite was checked before any work
        info(f"wrote {out}")
    emit({"model": str(model), "method": spec.label(), "config": config.as_dict(),
          "protocol": "question-aware" if compress_question else "question-agnostic", "results": results},
         rows=[{k: r[k] for k in ("completion", "kv_bytes", "kv_fraction", "decode_tok_s")} for r in results],
         title=f"kvcache generate ({spec.label()})")


def evaluate_spec(m, tok, spec, task: str, length: int, samples: int, seed: int, data: str, prefix: int,
                  continuation: int, compress_question: bool = False, max_new_tokens: int = 24,
                  filler: str = "austen-train") -> dict:
    """One evaluation (task accuracy or decode perplexity) of ``spec``; shared with the benchmark."""
    import math

    import torch

    from llmtool.core.data import load_text, scoring_bos, tokenize, tokenize_prompt
    from llmtool.kvcache import tasks as tasks_mod
    from llmtool.kvcache.pipeline import decode_nll, generate

    kv, full, dec_tok, dec_s = 0, 0, 0, 0.0
    if task == "ppl":
        ids = tokenize(tok, load_text(data))
        span = prefix + continuation
        if ids.numel() < span * samples:
            raise UsageError(f"{data}: {ids.numel()} tokens, need {span * samples} for --samples {samples}")
        nll, count = 0.0, 0
        bos = scoring_bos(tok)   # Gemma / Llama windows start with their BOS, as `evaluate ppl`'s do
        lead = torch.tensor([] if bos is None else [bos], dtype=ids.dtype)
        for i in progress(range(samples), "decode ppl"):
            a, c, st = decode_nll(m, torch.cat([lead, ids[i * span:(i + 1) * span]]), prefix + lead.numel(), spec,
                                  chunk=None)
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
                ctx = tokenize_prompt(tok, s.context)[None]
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
@method_options(METHODS, default="full")
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
    compress_question: CompressQ = False,
    config: MethodConfig = None,
) -> None:
    """Accuracy on seeded RULER-style tasks, or decode perplexity, under the chosen KV compression."""
    from llmtool.core.preflight import preflight

    preflight(model)  # fail fast, before torch is imported
    from llmtool.kvcache.tasks import TASKS

    spec = _spec(config)
    if task not in (*TASKS, "ruler", "ppl"):
        raise UsageError(f"unknown --task {task!r}; choose one of: {', '.join(TASKS)}, ruler, ppl")
    if samples < 1:
        raise UsageError(f"--samples {samples}: must be >= 1")
    if task == "ppl" and (prefix < 2 or continuation < 1):
        raise UsageError("--prefix must be >= 2 and --continuation >= 1")
    if task != "ppl" and length < 64:
        raise UsageError(f"--length {length}: must be at least 64 tokens")
    from llmtool.core import eta_plans as plans

    shape = plans.Shape.of(model)
    plans.announce(plans.kvcache_evaluate(shape, task, length, samples, prefix, continuation), shape,
                   "kvcache evaluate")
    m, tok = _load(model)
    result = evaluate_spec(m, tok, spec, task, length, samples, OPTIONS.seed, data, prefix, continuation,
                           compress_question, filler=filler)
    result = {"model": str(model), "task": task, "length": length if task != "ppl" else prefix + continuation,
              "protocol": "question-aware" if compress_question else "question-agnostic", **result,
              "config": config.as_dict()}
    emit(result, title=f"kvcache evaluate {task}")

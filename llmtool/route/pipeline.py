"""Shared plumbing of the route commands: prompt rendering (one template, one set of token ids for every
model), batched generation into output records with ``route_trace``, and per-domain scoring."""
from __future__ import annotations

import time
from pathlib import Path
from typing import Callable, Sequence

from llmtool.core.console import UsageError


def read_rows(path: Path, required=("prompt",)) -> list[dict]:
    from llmtool.core.data import read_jsonl

    rows = read_jsonl(path, required=required)
    for i, r in enumerate(rows, 1):
        for f in required:
            if not isinstance(r[f], str):
                raise UsageError(f"{path}: record {i}: field {f!r} must be a string")
        if "prompt" in required and not r["prompt"].strip():
            raise UsageError(f"{path}: record {i}: field 'prompt' is empty")
        r.setdefault("id", str(i - 1))
    return rows


def render(tokenizer, prompt: str, template: str = "chat") -> str:
    from llmtool.core.lm import chat_prompt

    return chat_prompt(tokenizer, prompt) if template == "chat" else prompt


def encode_prompts(tokenizer, rows: Sequence[dict], template: str = "chat") -> list[list[int]]:
    from llmtool.core.data import prompt_ids      # imports torch: not at module level (CLI preflight)

    return [prompt_ids(tokenizer, render(tokenizer, r["prompt"], template)) for r in rows]


def sft_examples(tokenizer, rows: Sequence[dict], template: str = "chat", path: str = "--data") -> list[dict]:
    out = []
    for i, r in enumerate(rows, 1):
        if not isinstance(r.get("response"), str):
            raise UsageError(f"{path}: record {i}: missing string field 'response'")
        out.append({"prompt": render(tokenizer, r["prompt"], template), "completion": r["response"]})
    return out


def run_generation(rows: Sequence[dict], tokenizer, make_chooser: Callable, models: Sequence, *, mode: str,
                   expert_names: Sequence[str] = (), max_new_tokens: int = 32, batch_size: int = 8,
                   temperature: float = 0.0, seed: int = 0, template: str = "chat", desc: str | None = "generate"):
    """Output records (``id``, ``output``, ``n_tokens``, ``route_trace``, ``expert_share``, ``mode``,
    ``seconds``) and a summary (tokens, seconds, tokens/s)."""
    from llmtool.route.decoding import batched, eos_ids_of

    prompts = encode_prompts(tokenizer, rows, template)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    results, secs = batched(prompts, batch_size, make_chooser, eos_ids=eos_ids_of(tokenizer, *models), pad_id=pad,
                            max_new_tokens=max_new_tokens, temperature=temperature, seed=seed, desc=desc)
    per = secs / max(1, len(rows))
    records = []
    n_tok = 0
    for r, res in zip(rows, results):
        trace = res.trace
        share = {}
        if trace and all(k >= 0 for k in trace) and expert_names:
            for k in trace:
                share[expert_names[k]] = share.get(expert_names[k], 0) + 1
            share = {k: round(v / len(trace), 4) for k, v in share.items()}
        n_tok += len(res.token_ids)
        rec = {"id": r.get("id"), "output": tokenizer.decode(res.token_ids, skip_special_tokens=True),
               "n_tokens": len(res.token_ids), "route_trace": trace, "expert_share": share, "mode": mode,
               "finish": res.finish, "seconds": round(per, 4)}
        if "domain" in r:
            rec["domain"] = r["domain"]
        records.append(rec)
    return records, {"tokens": n_tok, "seconds": round(secs, 3), "tokens_per_s": round(n_tok / max(secs, 1e-9), 2)}


def score_records(rows: Sequence[dict], records: Sequence[dict], expert_names: Sequence[str] = ()) -> dict:
    """Accuracy per domain (with a Wilson 95 % interval) and expert share per domain."""
    from llmtool.route.tasks import correct, wilson

    by: dict[str, dict] = {}
    for r, rec in zip(rows, records):
        if "answer" not in r or "domain" not in r:
            raise UsageError(f"record {r.get('id')}: scoring needs 'domain' and 'answer' fields")
        d = by.setdefault(r["domain"], {"n": 0, "correct": 0, "trace": [0] * len(expert_names), "tok": 0})
        ok = correct(r, rec["output"])
        rec["correct"] = ok
        d["n"] += 1
        d["correct"] += int(ok)
        for k in rec.get("route_trace") or []:
            if 0 <= k < len(expert_names):
                d["trace"][k] += 1
                d["tok"] += 1
    out = {}
    items = [{"id": r.get("id"), "domain": r["domain"], "correct": bool(rec["correct"])} for r, rec in zip(rows, records)]
    for name, d in sorted(by.items()):
        lo, hi = wilson(d["correct"], d["n"])
        entry = {"n": d["n"], "correct": d["correct"], "accuracy": round(d["correct"] / d["n"], 4),
                 "ci95": [round(lo, 4), round(hi, 4)]}
        if d["tok"]:
            entry["expert_share"] = {e: round(c / d["tok"], 4) for e, c in zip(expert_names, d["trace"])}
        out[name] = entry
    accs = [v["accuracy"] for v in out.values()]
    return {"domains": out, "mean_accuracy": round(sum(accs) / len(accs), 4) if accs else None, "items": items}


def seconds_since(t0: float) -> float:
    return round(time.time() - t0, 3)

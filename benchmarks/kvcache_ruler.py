"""Question-aware RULER-style retrieval under KV eviction (issue 19), and a line-by-line check of llmtool's
SnapKV against NVIDIA kvpress's on the same prompts.

1. Grid: niah_single, niah_multikey and variable_tracking at --length tokens, --samples seeded samples each,
   question-aware protocol (context + question prefilled and compressed together, as in the SnapKV and
   CriticalKV papers' setting), for the full cache and snapkv / adakv with and without CriticalKV at each
   of --budgets. Accuracy with a Wilson 95 % interval per cell (samples are few).
2. Failure mode of the needle task: for each eviction setting, the share of niah_single answers whose first
   3 digits are right (the answer numbers are 7 digits, one token per digit in SmolLM2's tokenizer).
3. kvpress check (only when `kvpress` imports): SnapKV at budget 0.2, window 32, kernel 5, question-aware,
   greedy, through kvpress's own press on the same token ids; the count of samples whose generations are
   identical to llmtool's.

    python benchmarks/kvcache_ruler.py [--length 1024] [--samples 10] [--budgets 0.2,0.5]

Writes benchmarks/results/kvcache_ruler.{json,md}.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

TASKS = ("niah_single", "niah_multikey", "variable_tracking")


def _kvpress_generate(model, ctx, steps, eos, budget, window, critical=False):
    """Greedy generation with kvpress's SnapKVPress (or CriticalKVPress over it) compressing the prefill
    (question-aware)."""
    import torch
    from kvpress import CriticalKVPress, SnapKVPress
    from transformers import DynamicCache

    cache = DynamicCache()
    press = SnapKVPress(compression_ratio=1 - budget, window_size=window, kernel_size=5)
    if critical:
        press = CriticalKVPress(press, epsilon=1e-4, first_stage_ratio=0.5)
    seen = ctx.shape[1]

    def pre(module, args, kwargs):  # kvpress reads kwargs the attention of this transformers version lacks
        kwargs.setdefault("past_key_values", kwargs.get("cache", cache))
        kwargs.setdefault("cache_position", torch.arange(seen))
        return args, kwargs

    attn = [layer.self_attn for layer in model.model.layers]
    with torch.no_grad(), press(model):
        handles = [a.register_forward_pre_hook(pre, with_kwargs=True, prepend=True) for a in attn]
        try:
            out = model(input_ids=ctx, past_key_values=cache)
        finally:
            for h in handles:
                h.remove()
    gen, pos = [], seen
    with torch.no_grad():
        nxt = out.logits[:, -1].argmax(-1)
        for _ in range(steps):
            if nxt.item() == eos:
                break
            gen.append(nxt.item())
            out = model(input_ids=nxt[None], past_key_values=cache, position_ids=torch.tensor([[pos]]))
            pos += 1
            nxt = out.logits[:, -1].argmax(-1)
    return gen, cache.get_seq_length()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default="smollm2-135m")
    ap.add_argument("--length", type=int, default=1024)
    ap.add_argument("--samples", type=int, default=10)
    ap.add_argument("--budgets", default="0.2,0.5")
    ap.add_argument("--methods", default="snapkv,critical+snapkv,adakv,critical+adakv")
    ap.add_argument("--max-new-tokens", type=int, default=24)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--kvpress-only", action="store_true", help="rerun only the kvpress check against the "
                    "llmtool outputs stored in the previous JSON")
    a = ap.parse_args()
    import warnings

    import torch

    warnings.filterwarnings("ignore", category=FutureWarning)  # kvpress's kwargs on this transformers version

    import llmtool
    from llmtool.core.console import markdown_table
    from llmtool.core.data import tokenize
    from llmtool.core.intervals import wilson
    from llmtool.core.models import load_tokenizer, resolve_model
    from llmtool.kvcache import tasks as T
    from llmtool.kvcache.pipeline import KVSpec, generate

    torch.set_num_threads(a.threads)
    path = resolve_model(a.model)
    tok, model = load_tokenizer(path), llmtool.load(path)
    samples = {t: T.make_samples(t, tok, a.length, a.samples, a.seed) for t in TASKS}
    specs = [("full", KVSpec())]
    for b in (float(x) for x in a.budgets.split(",")):
        for meth in a.methods.split(","):
            specs.append((f"{meth}@{b:g}", KVSpec(evict=meth.split("+")[-1], critical=meth.startswith("critical"),
                                                   budget=b)))
    rows, outputs, t0 = [], {}, time.time()
    dst = ROOT / "benchmarks" / "results" / "kvcache_ruler"
    if a.kvpress_only:
        prev = json.loads(dst.with_suffix(".json").read_text())
        rows = prev["rows"]
        outputs = {(k, "niah_single"): v for k, v in prev["outputs_niah_single"].items()}
        specs = []
    for label, spec in specs:
        row = {"setting": label}
        for task in TASKS:
            hits, texts = 0.0, []
            for s in samples[task]:
                ctx = tokenize(tok, s.context)[None]
                q = tokenize(tok, "\n\n" + s.question)[None]
                ids, st, _ = generate(model, ctx, q, spec, a.max_new_tokens, eos_token_id=tok.eos_token_id,
                                      compress_question=True)
                text = tok.decode(ids, skip_special_tokens=True)
                texts.append(text)
                hits += T.score(text, s.answers)
            lo, hi = wilson(round(hits), len(samples[task]))
            row[task] = f"{100 * hits / len(samples[task]):.0f} [{100 * lo:.0f}, {100 * hi:.0f}]"
            row[f"{task}_acc"] = hits / len(samples[task])
            outputs[(label, task)] = texts
        first3 = sum(t.strip()[:3] == s.answers[0][:3] for t, s in zip(outputs[(label, "niah_single")],
                                                                         samples["niah_single"]))
        row["niah_single_first3"] = first3 / len(samples["niah_single"])
        rows.append(row)
        print(json.dumps(row), file=sys.stderr, flush=True)

    check = None
    try:
        import kvpress  # noqa: F401
    except ImportError:
        check = {"ran": False, "why": "kvpress is not installed"}
    if check is None:
        from transformers import AutoModelForCausalLM

        hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager").eval()
        check = {"ran": True, "setting": "budget 0.2, window 32, kernel 5, question-aware, greedy, niah_single",
                 "presses": {}}
        for label, critical in (("snapkv@0.2", False), ("critical+snapkv@0.2", True)):
            ours = outputs.get((label, "niah_single"))
            same, theirs = 0, []
            for i, s in enumerate(samples["niah_single"]):
                ids = torch.cat([tokenize(tok, s.context)[None], tokenize(tok, "\n\n" + s.question)[None]], -1)
                gen, _ = _kvpress_generate(hf, ids, a.max_new_tokens, tok.eos_token_id, 0.2, 32, critical)
                theirs.append(tok.decode(gen, skip_special_tokens=True))
                same += ours is not None and theirs[-1] == ours[i]
            check["presses"][label] = {"identical_generations": same, "samples": len(theirs),
                                       "kvpress_outputs": theirs, "llmtool_outputs": ours}
    command = "python benchmarks/kvcache_ruler.py " + " ".join(sys.argv[1:])
    if a.kvpress_only:  # the grid came from the previous run
        command = f"{prev['command']} (grid), then {command} (kvpress check)"
    res = {"command": command, "model": a.model,
           "length": a.length, "samples": a.samples, "protocol": "question-aware (context + question compressed)",
           "rows": rows, "kvpress_check": check, "seconds": round(time.time() - t0, 1),
           "answers_niah_single": [s.answers[0] for s in samples["niah_single"]],
           "outputs_niah_single": {k[0]: v for k, v in outputs.items() if k[1] == "niah_single"}}
    dst.with_suffix(".json").write_text(json.dumps(res, indent=2) + "\n")
    table = markdown_table([{"setting": r["setting"], **{t: r[t] for t in TASKS},
                             "niah_single first 3 digits right": f"{100 * r['niah_single_first3']:.0f}"}
                            for r in rows])
    kv = (f"kvpress check ({check['setting']}): generations identical to llmtool's on " + ", ".join(
        f"{v['identical_generations']}/{v['samples']} samples for {k}" for k, v in check["presses"].items()) + "."
        if check.get("ran") else f"kvpress check not run: {check['why']}.")
    dst.with_suffix(".md").write_text(
        f"# KV eviction on question-aware RULER-style tasks ({a.model}, {a.length} tokens)\n\nCommand: "
        f"`{res['command']}`\n\nAccuracy % [Wilson 95 % CI] over {a.samples} seeded samples per task; the "
        "question is inside the compressed prefill (SnapKV's observation window covers it).\n\n" + table +
        "\n\n" + kv + "\n")
    print(table)
    print(kv)


if __name__ == "__main__":
    main()

"""Does a model as shipped give GRPO a learning signal on a task? (issue 40: GRPO rows on a second family only
where the base model gives signal.)

GRPO's advantage is the reward minus its group mean: a group whose G rollouts all score the same contributes
nothing. This script samples G rollouts per prompt from the model as given, exactly as `llmtool train grpo`
would (raw task prompt through the model's chat template where it has one, temperature 1.0 by default), scores
them with the task's verifier, and reports the mean reward with a Wilson interval, pass@G and the share of
prompts whose group has reward variance (0 < correct < G). A model with no such group cannot move under GRPO
from this start; a warm start (as the SetPO benchmark's SFT steps) is then needed, and the row says so.

    python benchmarks/grpo_signal.py --models gemma3-270m --tasks sum-two,arith --threads 1

Writes benchmarks/results/grpo_signal.json and .md (``--out`` to change), with three sampled answers per
(model, task) for audit.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from benchmarks.gates import gate, lines as gate_lines  # noqa: E402

MAX_NEW = {"sum-two": 16, "arith": 48, "mul": 64}  # the train_grpo benchmark's settings per task


def group_signal(per_problem: list[dict]) -> dict:
    """From per-prompt (n, correct) counts: the share of prompts whose group has reward variance, and how many
    prompts are all-wrong / all-right."""
    n_var = sum(0 < p["correct"] < p["n"] for p in per_problem)
    return {"prompts": len(per_problem), "with_variance": n_var,
            "share_with_variance": n_var / max(len(per_problem), 1),
            "all_wrong": sum(p["correct"] == 0 for p in per_problem),
            "all_right": sum(p["correct"] == p["n"] for p in per_problem)}


def measure(model_name: str, task: str, a, loaded: tuple | None = None) -> dict:
    """One (model, task) row; ``loaded`` = (tokenizer, model) already in memory, else they are loaded."""
    from llmtool.core.intervals import wilson
    from llmtool.core.lm import chat_prompt, generate
    from llmtool.core.models import load_model, load_tokenizer
    from llmtool.train import passk, rl_data

    tok, model = loaded or (load_tokenizer(model_name), load_model(model_name))
    rows = rl_data.make_task(task, a.rows, seed=a.seed)
    max_new = a.max_new_tokens or MAX_NEW.get(task, 48)
    t = time.time()
    prompts = [chat_prompt(tok, r["prompt"]) for r in rows]
    comps = generate(model, tok, prompts, max_new_tokens=max_new, temperature=a.temperature, n=a.group_size,
                     batch_size=a.batch_size, seed=a.seed, desc=f"{model_name} {task}")
    texts = [[c.text for c in g] for g in comps]
    scored = passk.score_samples(rows, texts, [1, a.group_size])
    correct = sum(p["correct"] for p in scored["per_problem"])
    total = sum(p["n"] for p in scored["per_problem"])
    sig = group_signal(scored["per_problem"])
    return {"model": model_name, "task": task, "max_new_tokens": max_new, "chat_template": bool(getattr(tok, "chat_template", None)),
            "mean_reward": correct / total, "mean_reward_ci": list(wilson(correct, total)),
            f"pass@{a.group_size}": scored["summary"][f"pass@{a.group_size}"], **sig,
            "samples": [{"prompt": rows[i]["prompt"], "answer": texts[i][0]} for i in range(min(3, len(rows)))],
            "seconds": round(time.time() - t, 1)}


def markdown(res: dict) -> str:
    a = res["args"]
    out = [f"# GRPO signal of the models as shipped ({a['rows']} prompts x G = {a['group_size']} rollouts, "
           f"T = {a['temperature']}, seed {a['seed']})", "", f"Command: `{res['command']}`", "",
           "| model | task | mean reward [95 % CI] | pass@G | prompts with reward variance | all wrong | all right | s |",
           "|---|---|---|---|---|---|---|---|"]
    G = a["group_size"]
    for r in res["rows"]:
        lo, hi = r["mean_reward_ci"]
        out.append(f"| {r['model']} | {r['task']} | {r['mean_reward']:.3f} [{lo:.3f}, {hi:.3f}] | {r[f'pass@{G}']:.3f} "
                   f"| {r['with_variance']}/{r['prompts']} | {r['all_wrong']} | {r['all_right']} | {r['seconds']:.0f} |")
    out += ["", "Gates:", ""] + gate_lines(res["gates"]) + ["", "First sampled answer of the first three prompts:", ""]
    for r in res["rows"]:
        for s in r["samples"]:
            out.append(f"- {r['model']} / {r['task']}: {s['prompt']!r} → {s['answer']!r}")
    return "\n".join(out) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default="smollm2-135m", help="comma-separated model aliases or paths")
    ap.add_argument("--tasks", default="sum-two,arith", help="comma-separated tasks (arith, mul, sum-two, rg:<name>)")
    ap.add_argument("--rows", type=int, default=32, help="prompts per task")
    ap.add_argument("--group-size", type=int, default=8, help="rollouts per prompt (GRPO's G)")
    ap.add_argument("--temperature", type=float, default=1.0, help="rollout temperature (llmtool train grpo's default)")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="0: the train_grpo benchmark's setting per task")
    ap.add_argument("--batch-size", type=int, default=64)
    ap.add_argument("--seed", type=int, default=400, help="data and sampling seed (400: the benchmarks' test rows)")
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default="benchmarks/results/grpo_signal")
    a = ap.parse_args()
    if a.rows < 1 or a.group_size < 2 or not a.temperature > 0 or a.max_new_tokens < 0 or a.threads < 1:
        ap.error("need --rows >= 1, --group-size >= 2 (a group of one has no variance), --temperature > 0, "
                 "--max-new-tokens >= 0 and --threads >= 1")
    import torch

    torch.set_num_threads(a.threads)
    from llmtool.core.models import load_model, load_tokenizer

    rows = []
    for m in [x for x in a.models.split(",") if x]:
        loaded = (load_tokenizer(m), load_model(m))  # once per model, for all its tasks
        for task in [x for x in a.tasks.split(",") if x]:
            rows.append(measure(m, task, a, loaded))
            print(json.dumps({k: v for k, v in rows[-1].items() if k != "samples"}), flush=True)
    gates = {f"{r['model']}/{r['task']}": gate(
        f"{r['model']} gives GRPO signal on {r['task']} (>= 10 % of prompts with reward variance)",
        r["share_with_variance"] >= 0.10, {k: r[k] for k in ("with_variance", "prompts", "mean_reward")})
        for r in rows}
    res = {"args": vars(a), "command": "python benchmarks/grpo_signal.py " + " ".join(sys.argv[1:]),
           "rows": rows, "gates": gates}
    out = Path(a.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps(res, indent=1))
    out.with_suffix(".md").write_text(markdown(res))
    print(markdown(res))


if __name__ == "__main__":
    main()

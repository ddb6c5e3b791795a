"""Benchmark for `llmtool bench-agent`: PIPE rewrites (oracle under every rewrite on every built-in
environment, the default model on grid navigation, optionally the fine-tune-on-oracle-trajectories
experiment and its control), UltraHorizon (scripted explorers at two horizons and two context policies,
the default model at a tiny horizon) and harness cost.

    python benchmarks/bench_agent.py                 # CPU defaults, about 15 min on 2 busy cores
    python benchmarks/bench_agent.py --sft           # + fine-tune on oracle trajectories (shared trainer)
    python benchmarks/bench_agent.py --sft --control # + the control agent (SFT under random aliases)
    python benchmarks/bench_agent.py --only uh-scripted   # rerun the scripted UltraHorizon rows only
    python benchmarks/bench_agent.py --only uh-scripted --uh-judge openai:URL#MODEL   # + the free-report rows
    python benchmarks/bench_agent.py --sft --base-episodes 20 --train-tasks 400 --sft-steps 300   # GPU scale
    python benchmarks/bench_agent.py --only oracle   # rerun the oracle table only; other parts kept from the JSON
    python benchmarks/bench_agent.py --only uh-model --uh-model-envs grid,seq,bio --uh-model-steps 3,10 \
        --uh-model-runs 8 --workers 2                 # the default model's UltraHorizon cells only
    python benchmarks/bench_agent.py --only pipe --model qwen2.5-coder-0.5b --base-episodes 20   # another model

Writes benchmarks/results/bench_agent.{json,md,png}; a model other than the default writes
bench_agent-<model>.{json,md,png} instead, so its rows never replace the default model's. Acceptance gates are reported as met / NOT met /
not tested (``benchmarks/gates.py``) with the measured figure; nothing is hard-coded. The base model's
IR gate is not tested when the base model makes no valid tool call in the dual-interface runs (its IR
is then 1 by definition, not by measurement); the control agent (``--control``, issue 42) is the agent that
can act but was never trained on the names: it is fine-tuned like the fine-tuned agent on the same oracle
episodes shown under fresh random aliases per episode (``llmtool/bench_agent/control.py``), and its IR should
be about 1.

UltraHorizon protocols: the scripted rows run the **easier variant (closed menu)** with the rule judge (the
prompt lists the candidate rule IDs); with ``--uh-judge openai:URL#MODEL|hf:MODEL`` they also run the
default protocol, a free-text report scored by that LLM judge. ``oracle (reads the truth)`` is an upper
bound, not an explorer; ``script:infer`` infers the rules from its own observations by elimination over the
menu's candidate rules (so its menu and free scores measure identifiability within that space).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
RESULTS = Path(__file__).parent / "results"
STEM = "bench_agent"  # the results stem of this invocation (set from --model by main)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from benchmarks.gates import gate, render  # noqa: E402
from benchmarks.stems import DEFAULT_MODEL, model_stem  # noqa: E402


def results_stem(model: str) -> str:
    """The results stem of a model's rows (``benchmarks/stems.py``): another model never overwrites SmolLM2's."""
    return model_stem("bench_agent", model)

MODES = ("none", "synonym", "obfuscate", "dual-ori-first", "dual-syn-first")
ACCEPTANCE_ENV = "grid-nav"   # the issue gates the fine-tuning experiment here; other envs are reported


def oracle_rows(n_tasks: int, seed: int, work: Path, n_external: int = 20) -> dict:
    """Built-in envs (n_tasks each) and the real games TextWorldExpress / ScienceWorld (n_external each,
    when llmtool[agent] and Java are installed)."""
    from llmtool.bench_agent.agents import make_agent
    from llmtool.bench_agent.envs import BUILTIN, EXTERNAL
    from llmtool.bench_agent.harness import load_tasks, run
    from llmtool.core.console import UsageError

    out = {}
    for env_name in (*BUILTIN, *EXTERNAL):
        n = max(10, n_tasks // 3) if env_name == "os-sandbox" else n_tasks   # sandbox: one process per command
        if env_name in EXTERNAL:
            n = n_external
            try:
                from llmtool.bench_agent.envs import make_env

                make_env(env_name)
            except UsageError as e:
                print(f"  oracle {env_name}: skipped ({e})", flush=True)
                continue
        out[env_name] = {}
        base_rewards = None
        for mode in MODES:
            s = run(env_name, make_agent("script:oracle"), mode, load_tasks(None, n, seed),
                    work / f"oracle-{env_name}-{mode}", overwrite=True)
            eps = [json.loads(x) for x in (work / f"oracle-{env_name}-{mode}" / "episodes.jsonl").read_text().splitlines()]
            rewards = [e["reward"] for e in eps]
            base_rewards = base_rewards or rewards
            out[env_name][mode] = {"sr": s["sr"], "episodes": s["episodes"], "steps_per_s": s["steps_per_s"],
                                   "orig_calls": s["orig_calls"], "alias_calls": s["alias_calls"],
                                   "rewards_equal_to_none": rewards == base_rewards}
        print(f"  oracle {env_name}: " + ", ".join(f"{m} {v['sr']:.2f}" for m, v in out[env_name].items()), flush=True)
    return out


def eval_agent(env_name, agent, n_eval, seed, history, work: Path, tag: str, max_rounds) -> dict:
    from llmtool.bench_agent.harness import load_tasks, run

    out = {}
    for mode in MODES:
        s = run(env_name, agent, mode, load_tasks(None, n_eval, seed + 1), work / f"{tag}-{env_name}-{mode}",
                history=history, overwrite=True, max_rounds=max_rounds)
        out[mode] = s
        print(f"  {tag:>10} {env_name} {mode:<15} SR {s['sr']:.2f} [{s['sr_lo']:.2f},{s['sr_hi']:.2f}] "
              f"orig {s['orig_calls']} alias {s['alias_calls']} dep {s['deprecated_rate']:.2f} "
              f"inv {s['invalid_rate']:.2f} ({s['seconds']:.0f}s)", flush=True)
    return out


def ir_of(work: Path, tag: str, env_name: str, seed: int) -> dict:
    from llmtool.bench_agent.metrics import interface_reliance

    def eps(mode):
        p = work / f"{tag}-{env_name}-{mode}" / "episodes.jsonl"
        return [json.loads(x) for x in p.read_text().splitlines()]

    return interface_reliance(eps("dual-ori-first"), eps("dual-syn-first"), seed=seed)


def oracle_examples(env_name: str, n_tasks: int, seed: int, tok, history: int, aliases: bool = False) -> list[dict]:
    """(prompt, completion) pairs from oracle episodes in the ORIGINAL interface only (``aliases``: the
    control's data — the same tasks and seeds, each episode under its own random alias names); prompts are
    the chat-templated, history-windowed messages the agent sees at evaluation time."""
    from llmtool.bench_agent.agents import make_agent, render_prompt
    from llmtool.bench_agent.control import control_episodes
    from llmtool.bench_agent.envs import make_env
    from llmtool.bench_agent.harness import run_episode, window

    ex = []
    oracle = make_agent("script:oracle")
    recs = control_episodes(env_name, n_tasks, seed, history) if aliases else None
    for i in range(n_tasks):
        env = make_env(env_name)
        rec = recs[i] if aliases else run_episode(env, oracle, "none", i, 10_000_000 + seed * 100003 + i,
                                                  env.default_rounds, history=history)
        msgs = rec["conversation"]
        for k, m in enumerate(msgs):
            if m["role"] == "assistant":
                prompt = render_prompt(tok, window(msgs[:k], history))
                ex.append({"prompt": prompt, "completion": m["content"]})
    return ex


UH_LABEL = {"oracle": "oracle (reads the truth)", "infer": "script:infer (from observations)",
            "random": "script:random"}
MENU = "menu: easier variant (closed menu)"


def uh_scripted(args, work: Path) -> tuple[list[dict], dict]:
    """The scripted explorers (oracle, infer, random) in every (env, R, context) cell: the menu variant with
    the rule judge, and the free report with ``--uh-judge`` when one is given."""
    from llmtool.bench_agent.uhrun import UHScript, make_judge, run_uh, score_runs

    protocols = [("menu", None)]
    if args.uh_judge:
        protocols.append(("free", make_judge(args.uh_judge, "free")))
    rows, raw = [], {}
    for report, judge in protocols:
        # an in-process LLM judge costs a generation per report: --uh-free-runs / --uh-free-cells small bound it
        free = report == "free"
        runs = args.uh_free_runs if free and args.uh_free_runs else args.uh_runs
        small = free and args.uh_free_cells == "small"
        for env_name in (args.uh_free_envs.split(",") if free else ("grid", "seq", "bio")):
            for steps in ((args.uh_small,) if small else (args.uh_small, args.uh_large)):
                for policy, window in ((("crnr", args.uh_window),) if small else
                                       (("crnr", args.uh_window), ("sliding", args.uh_window))):
                    for kind in ("oracle", "infer", "random"):
                        t0 = time.time()
                        evs = [run_uh(env_name, UHScript(kind, args.seed + i),
                                      work / f"uh-{report}-{kind}-{env_name}-{steps}-{policy}-{i}", steps=steps,
                                      seed=args.seed + i, policy=policy, window=window, report=report, judge=judge)
                               for i in range(runs)]
                        s = score_runs(evs)
                        dt = time.time() - t0
                        acts = sum(e["env_actions"] for e in evs)
                        key = f"{kind}-{env_name}-{steps}-{policy}" + ("" if report == "menu" else "-free")
                        raw[key] = {**s, "report": report, "judge": evs[0]["judge"]}
                        rows.append(_uh_row(UH_LABEL[kind], env_name, steps, policy, s, acts / dt,
                                            MENU if report == "menu" else f"free report, judge {evs[0]['judge']}"))
                    means = [raw[f"{k}-{env_name}-{steps}-{policy}" + ("" if report == "menu" else "-free")]["score"]["mean"]
                             for k in ("oracle", "infer", "random")]
                    print(f"  UltraHorizon scripted {report} {env_name} R={steps} {policy}: " + ", ".join(
                        f"{k} {'n/a (judge output unparseable)' if m is None else f'{m:.1f}'}"
                        for k, m in zip(("oracle", "infer", "random"), means)), flush=True)
    return rows, raw


def uh_gates(results: dict) -> None:
    """The scripted UltraHorizon gates (menu variant, rule judge)."""
    raw = results["ultrahorizon"]["raw"]
    menu = {k: v for k, v in raw.items() if not k.startswith("model-") and v.get("report", "menu") == "menu"}
    g = results["gates"]
    g["uh_oracle_scores_100"] = all(v["score"]["mean"] == 100 for k, v in menu.items() if k.startswith("oracle"))
    g["uh_random_scores_le_40"] = all(v["score"]["mean"] <= 40 for k, v in menu.items() if k.startswith("random"))
    inf = {k: v["score"]["mean"] for k, v in menu.items() if k.startswith("infer")}
    rnd = {k: v["score"]["mean"] for k, v in menu.items() if k.startswith("random")}
    g["uh_infer_above_random_every_cell"] = gate(
        "uh_infer_above_random_every_cell", all(inf[k] > rnd["random" + k[5:]] for k in inf),
        min((inf[k] - rnd["random" + k[5:]] for k in inf), default=None), precondition=bool(inf),
        reason="the inferring explorer was not run")
    free = {k: v for k, v in raw.items() if not k.startswith("model-") and v.get("report") == "free"}
    g["uh_free_judge_valid"] = free_judge_gate(free)


def free_judge_gate(free: dict) -> dict:
    """Is the free-report LLM judge usable? The oracle writes the hidden truth itself, so a valid judge gives it
    >= 90 in every cell and the random explorer less; a free-report model row means nothing otherwise."""
    orc = {k: v["score"]["mean"] for k, v in free.items() if k.startswith("oracle") and v["score"]["mean"] is not None}
    rnd = {k: v["score"]["mean"] for k, v in free.items() if k.startswith("random") and v["score"]["mean"] is not None}
    pairs = [(orc[k], rnd["random" + k[6:]]) for k in orc if "random" + k[6:] in rnd]
    return gate("uh_free_judge_valid: oracle report >= 90 and above random in every free-report cell",
                lambda: all(o >= 90 for o in orc.values()) and all(o > r for o, r in pairs),
                {"oracle": orc, "random": rnd}, precondition=bool(orc),
                reason="no free-report cell with a judged oracle report (pass --uh-judge)")


def uh_part(args, work: Path) -> dict:
    rows, raw = uh_scripted(args, work)
    print("  UltraHorizon scripted: done", flush=True)
    if args.uh_model_runs > 0:
        model_rows, model_raw = uh_model_part(args, work)
        rows += model_rows
        raw.update(model_raw)
    return {"rows": rows, "raw": raw}


def previous_results() -> dict:
    """The results a partial rerun (``--only ...``) updates: the existing JSON, or an empty skeleton."""
    prev = RESULTS / f"{STEM}.json"
    results = json.loads(prev.read_text()) if prev.is_file() else {"command": "", "config": {}, "gates": {}}
    results.setdefault("pipe", {})
    return results


def pipe_rerun_head(results: dict, env: str, command: str, config: dict) -> None:
    """The results file's head ``Command:`` for a ``--only pipe`` run on ``env``: this run's command when the file
    is new, or when ``env``'s rows were the only rows in it (the rerun replaces them, so the old head would name a
    command none of the file's rows come from); otherwise the head stays and this run's section says "Run alone"."""
    others = set(results.get("pipe", {})) - {env}
    if not results.get("command") or not (others or results.get("oracle") or results.get("ultrahorizon")):
        results.update(command=command, config=config)


_UH_AGENT = None


_UH_JUDGE = None


def _uh_worker_init(model: str, max_new_tokens: int, seed: int, threads: int, judge: str = "") -> None:
    global _UH_AGENT, _UH_JUDGE
    import torch

    from llmtool.bench_agent.agents import HFAgent
    from llmtool.core.models import resolve_model

    torch.set_num_threads(threads)
    _UH_AGENT = HFAgent(str(resolve_model(model)), max_new_tokens=max_new_tokens, temperature=0.3,
                        stop=("</tool_call>",), seed=seed)
    _UH_AGENT.uri = f"hf:{model}"
    if judge:
        from llmtool.bench_agent.uhrun import make_judge

        _UH_JUDGE = make_judge(judge, "free")


def _uh_model_run(job: tuple) -> dict:
    from llmtool.bench_agent.uhrun import run_uh

    env_name, steps, seed, policy, window, out = job
    return run_uh(env_name, _UH_AGENT, Path(out), steps=steps, seed=seed, policy=policy, window=window,
                  report="free" if _UH_JUDGE is not None else "menu", judge=_UH_JUDGE)


def uh_model_part(args, work: Path) -> tuple[list[dict], dict]:
    """The default model on the UltraHorizon environments: every (env, R, context policy) cell with
    ``--uh-model-runs`` runs (seeds seed..seed+n-1), spread over ``--workers`` processes of ``--threads``
    threads each (one model per process; a run is sequential, so processes use the cores better than threads)."""
    from concurrent.futures import ProcessPoolExecutor
    import multiprocessing as mp

    from llmtool.bench_agent.uhrun import score_runs

    cells = [(e, int(r), pol) for e in args.uh_model_envs.split(",") for r in str(args.uh_model_steps).split(",")
             for pol in args.uh_model_policies.split(",")]
    jobs = [(e, r, args.seed + i, pol, args.uh_model_window, str(work / f"uh-model-{e}-{r}-{pol}-{i}"))
            for e, r, pol in cells for i in range(args.uh_model_runs)]
    t0 = time.time()
    init = (args.model, args.uh_max_new_tokens, args.seed, args.threads, args.uh_judge)
    if args.workers > 1:
        with ProcessPoolExecutor(args.workers, mp.get_context("spawn"), initializer=_uh_worker_init,
                                 initargs=init) as pool:
            evs = []
            for k, ev in enumerate(pool.map(_uh_model_run, jobs)):
                evs.append(ev)
                print(f"  UltraHorizon {args.model}: {k + 1}/{len(jobs)} runs, {time.time() - t0:.0f}s", flush=True)
    else:
        _uh_worker_init(*init)
        evs = [_uh_model_run(j) for j in jobs]
    rows, raw = [], {}
    for e, r, pol in cells:
        cell = [ev for ev in evs if (ev["env"], ev["steps"], ev["policy"]) == (e, r, pol)]
        s = score_runs(cell)
        s["run_seconds"] = [ev["wall_s"] for ev in cell]
        s["turns"] = [ev["stats"]["turns"] for ev in cell]
        s["completion_tokens_per_s"] = sum(ev["token_statistics"]["completion"] for ev in cell) / sum(s["run_seconds"])
        s["entropy_slopes"] = [ev["entropy_slope"] for ev in cell]
        raw[f"model-{e}-{r}-{pol}"] = s
        rows.append(_uh_row(f"hf:{args.model}", e, r, pol, s, None,
                            f"free report, judge {cell[0]['judge']}" if args.uh_judge else MENU))
        print(f"  UltraHorizon {args.model} {e} R={r} {pol}: score {s['score']['mean']}, "
              f"tool calls {s['tool_calls']['mean']}, {sum(s['run_seconds']):.0f}s of runs", flush=True)
    return rows, raw


def only_uh_model(args) -> None:
    """``--only uh-model``: rerun the default model's UltraHorizon rows, keep every other part."""
    results = previous_results()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_agent_"))
    t = time.time()
    print("== UltraHorizon, default model (other parts kept from the previous run)", flush=True)
    rows, raw = uh_model_part(args, work)
    uh = results.setdefault("ultrahorizon", {"rows": [], "raw": {}})
    # cells of this run replace the same cells of an earlier one; on the first rerun the full command's
    # tiny-horizon model row goes too
    fresh = {(r["env"], r["R"], r["context"]) for r in rows}
    earlier = bool(results.get("uh_model_commands"))
    uh["rows"] = [r for r in uh["rows"] if not r["agent"].startswith("hf:")
                  or (earlier and (r["env"], r["R"], r["context"]) not in fresh)] + rows
    kept = {f"model-{r['env']}-{r['R']}-{r['context']}" for r in uh["rows"] if r["agent"].startswith("hf:")}
    uh["raw"] = {k: v for k, v in uh["raw"].items() if not k.startswith("model-") or k in kept}
    uh["raw"].update(raw)
    results.setdefault("phase_seconds", {})[f"ultrahorizon model R={args.uh_model_steps} {args.uh_model_policies}"] = round(time.time() - t, 1)
    model = f" --model {args.model}" if args.model != DEFAULT_MODEL else ""
    cmd = (f"python benchmarks/bench_agent.py --only uh-model{model} --uh-model-envs {args.uh_model_envs} "
           f"--uh-model-steps {args.uh_model_steps} --uh-model-policies {args.uh_model_policies} "
           f"--uh-model-runs {args.uh_model_runs} --uh-model-window {args.uh_model_window} "
           f"--uh-max-new-tokens {args.uh_max_new_tokens} --workers {args.workers} --threads {args.threads}")
    results["uh_model_commands"] = [c for c in results.get("uh_model_commands", []) if c != cmd] + [cmd]
    write(results)
    print(f"UltraHorizon model part {time.time() - t:.0f} s")


def only_uh_scripted(args) -> None:
    """``--only uh-scripted``: rerun the scripted explorers' UltraHorizon rows, keep every other part."""
    results = previous_results()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_agent_"))
    t = time.time()
    print("== UltraHorizon, scripted explorers (other parts kept from the previous run)", flush=True)
    rows, raw = uh_scripted(args, work)
    uh = results.setdefault("ultrahorizon", {"rows": [], "raw": {}})
    model_rows = [r for r in uh["rows"] if r["agent"].startswith("hf:")]
    for r in model_rows:            # runs before issue 42 always had the menu in the prompt
        r.setdefault("protocol", MENU)
    uh["rows"] = rows + model_rows
    uh["raw"] = {**{k: v for k, v in uh["raw"].items() if k.startswith("model-")}, **raw}
    uh_gates(results)
    results.setdefault("phase_seconds", {})["ultrahorizon scripted rerun alone"] = round(time.time() - t, 1)
    results["uh_scripted_command"] = (f"python benchmarks/bench_agent.py --only uh-scripted --uh-runs {args.uh_runs} "
                                      f"--uh-small {args.uh_small} --uh-large {args.uh_large} --uh-window {args.uh_window}"
                                      + (f" --uh-judge {args.uh_judge}" if args.uh_judge else "")
                                      + (f" --uh-free-runs {args.uh_free_runs}" if args.uh_free_runs else "")
                                      + (" --uh-free-cells small" if args.uh_free_cells == "small" else "")
                                      + (f" --uh-free-envs {args.uh_free_envs}" if args.uh_free_envs != "grid,seq,bio"
                                         else ""))
    write(results)
    print(f"UltraHorizon scripted part {time.time() - t:.0f} s")


def _ci(m) -> str:
    if m.get("mean") is None:
        return "n/a"
    return f"{m['mean']:.1f} ± {m['hi'] - m['mean']:.1f}"


def _uh_row(agent, env, steps, policy, s, steps_per_s, protocol=MENU) -> dict:
    return {"agent": agent, "protocol": protocol, "env": env, "R": steps, "context": policy, "runs": s["runs"],
            "score": _ci(s["score"]),
            "tool calls": _ci(s["tool_calls"]), "prompt tokens": _ci(s["prompt_tokens"]),
            "completion tokens": _ci(s["completion_tokens"]), "commit rate": s["commit_rate"],
            "refreshes": _ci(s["refreshes"]),
            "env steps/s": f"{steps_per_s:.0f}" if steps_per_s else ""}


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--model", default=DEFAULT_MODEL,
                    help="model alias or directory; a model other than the default writes its own results "
                         "(benchmarks/results/bench_agent-<model>.*)")
    ap.add_argument("--env", default="grid-nav", help="PIPE env for the model rows")
    ap.add_argument("--oracle-tasks", type=int, default=50)
    ap.add_argument("--external-tasks", type=int, default=20, help="oracle episodes per real game (TWX, ScienceWorld)")
    ap.add_argument("--only", default="", choices=["", "oracle", "pipe", "uh-model", "uh-scripted", "control"],
                    help="rerun only this part (oracle table, the model rows of PIPE with --sft/--control, the "
                         "default model's or the scripted explorers' UltraHorizon rows); the other parts' results "
                         "are kept from the existing JSON")
    ap.add_argument("--base-episodes", type=int, default=6)
    ap.add_argument("--max-rounds", type=int, default=8, help="rounds per episode; 0 = the environment's default")
    ap.add_argument("--history", type=int, default=1)
    ap.add_argument("--max-new-tokens", type=int, default=16)
    ap.add_argument("--sft", action="store_true", help="fine-tune on oracle trajectories and evaluate (slow on CPU)")
    ap.add_argument("--control", action="store_true",
                    help="also fine-tune the control agent (the same oracle episodes under random aliases, a fresh "
                         "copy of the base model, the same SFT settings) and evaluate it: its IR should be about 1")
    ap.add_argument("--train-tasks", type=int, default=60)
    ap.add_argument("--sft-steps", type=int, default=40)
    ap.add_argument("--sft-batch", type=int, default=8)
    ap.add_argument("--lr", type=float, default=2e-4)
    ap.add_argument("--uh-runs", type=int, default=8)
    ap.add_argument("--uh-free-runs", type=int, default=0, help="runs per free-report cell (default: --uh-runs)")
    ap.add_argument("--uh-free-cells", default="all", choices=["all", "small"],
                    help="free-report cells: all, or small (R = --uh-small, CRNR only: one judge call per run)")
    ap.add_argument("--uh-free-envs", default="grid,seq,bio", help="environments of the free-report cells")
    ap.add_argument("--uh-small", type=int, default=10)
    ap.add_argument("--uh-large", type=int, default=50)
    ap.add_argument("--uh-window", type=int, default=40)
    ap.add_argument("--uh-judge", default="", help="openai:URL#MODEL or hf:MODEL: also run the UltraHorizon rows "
                    "with the free-text report (the default protocol) scored by this LLM judge")
    ap.add_argument("--uh-model-runs", type=int, default=2)
    ap.add_argument("--uh-model-envs", default="seq")
    ap.add_argument("--uh-model-steps", default="5", help="comma-separated step budgets R")
    ap.add_argument("--uh-model-policies", default="crnr", help="comma-separated context policies (crnr, sliding)")
    ap.add_argument("--workers", type=int, default=1, help="processes for the model's UltraHorizon runs")
    ap.add_argument("--uh-model-window", type=int, default=12)
    ap.add_argument("--uh-max-new-tokens", type=int, default=96)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args(argv)
    global STEM
    STEM = results_stem(args.model)
    if args.only == "oracle":
        return only_oracle(args)
    if args.only == "uh-model":
        return only_uh_model(args)
    if args.only == "uh-scripted":
        return only_uh_scripted(args)
    if args.only == "control":
        return only_control(args)

    import torch

    torch.set_num_threads(args.threads)
    from llmtool.bench_agent.agents import HFAgent
    from llmtool.core.models import load_model, load_tokenizer, resolve_model

    t_start = time.time()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_agent_"))
    work.mkdir(parents=True, exist_ok=True)
    shown, skip = [], False          # the command without --work (a machine-local path)
    for a in sys.argv[1:]:
        if skip:
            skip = False
        elif a == "--work":
            skip = True
        elif not a.startswith("--work="):
            shown.append(a)
    command = " ".join(["python benchmarks/bench_agent.py", *shown])
    config = {k: v for k, v in vars(args).items() if k != "work"}
    if args.only == "pipe":
        results = previous_results()
        pipe_rerun_head(results, args.env, command, config)
        results["pipe"].pop(args.env, None)       # other environments' rows are kept
        if args.env == ACCEPTANCE_ENV:
            results["gates"] = {k: v for k, v in results["gates"].items()
                                if not k.startswith(("base_ir", "ft_", "sft_", "control_"))}
        results.setdefault("phase_seconds", {})
    else:
        results = {"command": command, "config": config, "pipe": {}, "gates": {}, "phase_seconds": {}}
    phase = results["phase_seconds"]
    if args.only != "pipe":
        t = time.time()
        print("== oracle under every rewrite", flush=True)
        results["oracle"] = oracle_rows(args.oracle_tasks, args.seed, work, args.external_tasks)
        results["gates"]["oracle_100pct_every_env_every_rewrite"] = oracle_gate(results["oracle"])
        phase["oracle"] = round(time.time() - t, 1)
        write(results)

        t = time.time()
        print("== UltraHorizon", flush=True)
        results["ultrahorizon"] = uh_part(args, work)
        phase["ultrahorizon"] = round(time.time() - t, 1)
        uh_gates(results)
        write(results)

    env_name = args.env
    path = resolve_model(args.model)
    tok = load_tokenizer(path)
    r = results["pipe"][env_name] = {"command": command, "config": config}
    # the gates are on grid navigation; other environments are reported with the same checks
    gates = results["gates"] if env_name == ACCEPTANCE_ENV else r.setdefault("checks", {})
    print(f"== {args.model} on {env_name}", flush=True)
    model = load_model(path, dtype="float32", device="cpu")
    agent = HFAgent(str(path), model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, stop=("\n",))
    agent.uri = f"hf:{args.model}"
    t0 = time.time()
    r["base"] = eval_agent(env_name, agent, args.base_episodes, args.seed, args.history, work, "base", args.max_rounds)
    r["base_seconds"] = time.time() - t0
    phase[f"base_model {env_name}"] = round(time.time() - t0, 1)
    r["base_ir"] = ir_of(work, "base", env_name, args.seed)
    r["base_tokens_per_s"] = sum(v["completion_tokens"] for v in r["base"].values()) / r["base_seconds"]
    r["kv_reused_tokens"] = agent.reused_tokens
    ir = r["base_ir"]
    gates["base_ir_in_[0.5,2]"] = base_ir_gate(r)
    print(f"  base IR {ir['ir']:.2f} [{ir['ir_lo']:.2f},{ir['ir_hi']:.2f}]", flush=True)
    write(results)

    if args.sft:
        ex = oracle_examples(env_name, args.train_tasks, args.seed, tok, args.history)
        t0 = time.time()
        r["sft"], r["sft_eval"], r["sft_ir"] = sft_and_evaluate(args, model, tok, path, ex, "finetuned", "sft", work, t0)
        phase[f"sft_train_and_eval {env_name}"] = round(time.time() - t0, 1)
        ft, fir = r["sft_eval"], r["sft_ir"]
        print(f"  fine-tuned IR {fir['ir']:.2f} [{fir['ir_lo']:.2f},{fir['ir_hi']:.2f}]", flush=True)
        gates["ft_sr_original>=0.8"] = gate("ft_sr_original>=0.8", ft["none"]["sr"] >= 0.8, ft["none"]["sr"])
        gates["ft_sr_obfuscate<=0.5*sr_original"] = gate(
            "ft_sr_obfuscate<=0.5*sr_original", ft["obfuscate"]["sr"] <= 0.5 * ft["none"]["sr"],
            [ft["obfuscate"]["sr"], ft["none"]["sr"]], precondition=ft["none"]["sr"] > 0,
            reason="the fine-tuned agent never succeeds in the original interface: nothing to lose under obfuscation")
        gates["ft_ir>2_with_ci"] = gate("ft_ir>2_with_ci", fir["ir_lo"] > 2, [fir["ir"], fir["ir_lo"], fir["ir_hi"]],
                                        precondition=dual_calls(ft) > 0,
                                        reason="the fine-tuned agent makes no valid tool call in the dual runs")
    else:
        gates["sft_experiment"] = gate("sft_experiment", False, precondition=False, reason="not run (pass --sft)")
    if args.control:
        run_control(args, r, work, phase)
    if args.control or env_name == ACCEPTANCE_ENV:
        gates["control_ir_in_[0.5,2]"] = control_ir_gate(r)
    wall = round(time.time() - t_start, 1)
    if args.only == "pipe":
        r["wall_seconds"] = wall       # the whole run's wall time stays that of the full command
    else:
        results["wall_seconds"] = wall
    write(results)
    print(json.dumps(results["gates"], indent=1, default=str))
    print(f"total {wall:.0f} s")


def sft_and_evaluate(args, model, tok, path, ex: list[dict], label: str, uri_tag: str, work: Path,
                     t0: float) -> tuple[dict, dict, dict]:
    """Fine-tune ``model`` in place on ``ex`` with the --sft settings and evaluate it like the base agent, under
    every rewrite: (SFT record, per-rewrite results, IR). ``seconds`` in the record counts from ``t0``. The
    fine-tuned agent and the control agent differ only in their examples and their starting copy."""
    from llmtool.bench_agent.agents import HFAgent
    from llmtool.core.trainer import TrainArgs, sft

    # long enough for the longest example: truncation would cut the completion, the only trained part
    longest = max(len(tok(e["prompt"] + e["completion"], add_special_tokens=False)["input_ids"]) for e in ex)
    targs = TrainArgs(lr=args.lr, max_steps=args.sft_steps, batch_size=args.sft_batch, max_length=max(384, longest + 8),
                      warmup_ratio=0.05, seed=args.seed, logging_steps=10)
    info = sft(model, tok, ex, targs)
    rec = {"examples": len(ex), "train_loss": info["train_loss"], "steps": info["steps"], "longest": longest,
           "seconds": time.time() - t0}
    print(f"  {'' if label == 'finetuned' else label + ' '}SFT {len(ex)} examples, {info['steps']} steps, "
          f"loss {info['train_loss']:.3f}, {time.time() - t0:.0f}s", flush=True)
    model.eval()
    agent = HFAgent(str(path), model=model, tokenizer=tok, max_new_tokens=args.max_new_tokens, stop=("\n",))
    agent.uri = f"hf:{args.model}+{uri_tag}"
    ev = eval_agent(args.env, agent, args.base_episodes, args.seed, args.history, work, label, args.max_rounds)
    return rec, ev, ir_of(work, label, args.env, args.seed)


def run_control(args, r: dict, work: Path, phase: dict) -> None:
    """The control agent: a fresh copy of the base model fine-tuned with the --sft settings on the same oracle
    episodes shown under fresh random aliases per episode, evaluated like the fine-tuned agent."""
    from llmtool.core.models import load_model, load_tokenizer, resolve_model

    env_name, path = args.env, resolve_model(args.model)
    tok = load_tokenizer(path)
    t0 = time.time()
    ex = oracle_examples(env_name, args.train_tasks, args.seed, tok, args.history, aliases=True)
    cmodel = load_model(path, dtype="float32", device="cpu")        # a fresh copy of the base model
    r["control_sft"], r["control_eval"], r["control_ir"] = sft_and_evaluate(args, cmodel, tok, path, ex, "control",
                                                                            "control", work, t0)
    r["control_sft"].update(train_tasks=args.train_tasks, batch=args.sft_batch, episodes=args.base_episodes)
    phase[f"control_train_and_eval {env_name}"] = round(time.time() - t0, 1)
    cir = r["control_ir"]
    print(f"  control IR {cir['ir']:.2f} [{cir['ir_lo']:.2f},{cir['ir_hi']:.2f}]", flush=True)


def only_control(args) -> None:
    """``--only control``: train and evaluate the control agent alone; every other part is kept (the base and
    fine-tuned rows of ``--env`` included)."""
    import torch

    torch.set_num_threads(args.threads)
    results = previous_results()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_agent_"))
    r = results["pipe"].setdefault(args.env, {})
    for k in ("control_sft", "control_eval", "control_ir"):
        r.pop(k, None)
    print(f"== control agent on {args.env} (other parts kept from the previous run)", flush=True)
    run_control(args, r, work, results.setdefault("phase_seconds", {}))
    model = f" --model {args.model}" if args.model != DEFAULT_MODEL else ""
    r["control_command"] = (f"python benchmarks/bench_agent.py --only control{model} --env {args.env} --sft-steps "
                            f"{args.sft_steps} --train-tasks {args.train_tasks} --sft-batch {args.sft_batch} "
                            f"--base-episodes {args.base_episodes} --max-rounds {args.max_rounds} --threads {args.threads}")
    gates = results["gates"] if args.env == ACCEPTANCE_ENV else r.setdefault("checks", {})
    gates["control_ir_in_[0.5,2]"] = control_ir_gate(r)
    write(results)


def dual_calls(evals: dict) -> int:
    """Valid tool calls (original or alias names) in the two dual-interface runs, from which IR is computed."""
    return sum(evals.get(m, {}).get(k, 0) for m in ("dual-ori-first", "dual-syn-first")
               for k in ("orig_calls", "alias_calls"))


def control_ir_gate(r: dict) -> dict:
    """IR of the control agent (fine-tuned under random aliases: it acts, but never saw the names) in
    [0.5, 2] (issue 42). Not tested when the control was not run or made no valid call in the dual runs."""
    if "control_ir" not in r:
        return gate("control_ir_in_[0.5,2]", False, precondition=False,
                    reason="not run (CPU budget): pass --control (a second SFT of the --sft size plus its evaluation)")
    ir = r["control_ir"]
    return gate("control_ir_in_[0.5,2]", 0.5 <= ir["ir"] <= 2, [ir["ir"], ir["ir_lo"], ir["ir_hi"]],
                precondition=dual_calls(r.get("control_eval", {})) > 0,
                reason="the control agent makes no valid tool call in the dual-interface runs")


def base_ir_gate(r: dict) -> dict:
    """IR of the base model in [0.5, 2] (no reliance on either name set). Tested only when the base model
    makes valid tool calls in the dual runs: a model that never acts has IR = 1 by definition (issue 42)."""
    ir = r["base_ir"]
    n = dual_calls(r.get("base", {}))
    return gate("base_ir_in_[0.5,2]", 0.5 <= ir["ir"] <= 2, ir["ir"], precondition=n > 0,
                reason="the base model makes no valid tool call in the dual-interface runs, so its IR is 1 by "
                       "definition (the control agent's gate, control_ir_in_[0.5,2], is the test that can fail)")


def oracle_gate(oracle: dict) -> bool:
    return all(v["sr"] == 1.0 and v["rewards_equal_to_none"] for e in oracle.values() for v in e.values())


def only_oracle(args) -> None:
    """``--only oracle``: rerun the oracle table, keep every other part of the previous results."""
    results = previous_results()
    work = Path(args.work or tempfile.mkdtemp(prefix="bench_agent_"))
    t = time.time()
    print("== oracle under every rewrite (other parts kept from the previous run)", flush=True)
    results["oracle"] = oracle_rows(args.oracle_tasks, args.seed, work, args.external_tasks)
    results["gates"]["oracle_100pct_every_env_every_rewrite"] = oracle_gate(results["oracle"])
    results.setdefault("phase_seconds", {})["oracle rerun alone"] = round(time.time() - t, 1)
    results["oracle_command"] = (f"python benchmarks/bench_agent.py --only oracle --oracle-tasks {args.oracle_tasks} "
                                 f"--external-tasks {args.external_tasks}")
    write(results)
    print(f"oracle part {time.time() - t:.0f} s")


def write(results: dict) -> None:
    from llmtool.core.console import markdown_table

    RESULTS.mkdir(parents=True, exist_ok=True)
    for env_name, r in results.get("pipe", {}).items():  # re-judged, so results stored before the precondition get it
        if "base_ir" in r and "base" in r:
            where = results["gates"] if env_name == ACCEPTANCE_ENV else r.setdefault("checks", {})
            where["base_ir_in_[0.5,2]"] = base_ir_gate(r)
            if env_name == ACCEPTANCE_ENV or "control_ir" in r:
                where["control_ir_in_[0.5,2]"] = control_ir_gate(r)
    (RESULTS / f"{STEM}.json").write_text(json.dumps(results, indent=2, default=str))
    lines = ["# bench-agent benchmark", "", f"Command: `{results['command']}`", ""]
    if results.get("oracle_command"):
        lines += [f"Oracle table rerun alone: `{results['oracle_command']}` (other parts from the command above).", ""]
    for c in results.get("uh_model_commands", []):
        lines += [f"UltraHorizon default-model rows rerun alone: `{c}`.", ""]
    if results.get("uh_model_note"):
        lines += [results["uh_model_note"], ""]
    if "oracle" in results:
        rows = [{"env": e, **{m: f"{v[m]['sr']:.2f} (n={v[m]['episodes']})" for m in MODES},
                 "env steps/s (none)": f"{v['none']['steps_per_s']:.0f}"} for e, v in results["oracle"].items()]
        lines += ["## PIPE: scripted oracle, success rate under every rewrite", "",
                  "`twx-coin` and `sciworld-find-living-thing` are the real TextWorldExpress / ScienceWorld games "
                  "(Java); env steps/s includes their per-episode game reset/load.", "", markdown_table(rows), ""]
    for env_name, r in results["pipe"].items():
        rows = []
        for tag, key in (("base", "base"), ("fine-tuned", "sft_eval"), ("control (random aliases)", "control_eval")):
            for mode, s in r.get(key, {}).items():
                rows.append({"agent": tag, "rewrite": mode, "episodes": s["episodes"], "SR": f"{s['sr']:.2f}",
                             "95% CI": f"[{s['sr_lo']:.2f}, {s['sr_hi']:.2f}]", "orig calls": s["orig_calls"],
                             "alias calls": s["alias_calls"], "deprecated rate": f"{s['deprecated_rate']:.2f}",
                             "invalid rate": f"{s['invalid_rate']:.2f}"})
        cfg = r.get("config", results["config"])
        lines += [f"## PIPE: {cfg.get('model')} on {env_name}", ""]
        if r.get("command") and r["command"] != results["command"]:
            lines += [f"Run alone: `{r['command']}`" + (" (the issue's acceptance environment)"
                                                          if env_name == ACCEPTANCE_ENV else " (reported, not gated)"), ""]
        lines += [markdown_table(rows), ""]
        for tag, key in (("base", "base_ir"), ("fine-tuned", "sft_ir"), ("control", "control_ir")):
            if key in r:
                ir = r[key]
                lines.append(f"- IR {tag}: {ir['ir']:.2f} (95% CI {ir['ir_lo']:.2f}–{ir['ir_hi']:.2f}; "
                             f"MD ori-first {ir['md_ori_first']:.2f}, syn-first {ir['md_syn_first']:.2f}; "
                             f"episodes {ir['episodes']})")
        if "sft" in r:
            lines.append(f"- SFT: {r['sft']['examples']} examples, {r['sft']['steps']} steps, "
                         f"loss {r['sft']['train_loss']:.3f}, {r['sft']['seconds']:.0f} s")
        if "control_sft" in r:
            c = r["control_sft"]
            lines.append(f"- control SFT (random aliases per episode): {c['examples']} examples, {c['steps']} steps, "
                         f"loss {c['train_loss']:.3f}, {c['seconds']:.0f} s of SFT"
                         + (f"; run alone: `{r['control_command']}`" if r.get("control_command") else ""))
        elif env_name == ACCEPTANCE_ENV and "base" in r:
            lines.append("- control agent (SFT under random aliases): not run (CPU budget); `--control` runs it")
        for k, v in r.get("checks", {}).items():
            lines.append(f"- {k} (reported, not gated): {_gate(v)}")
        if "base_tokens_per_s" in r:
            threads = cfg.get("threads", 1)
            lines.append(f"- agent throughput (base, CPU, {threads} thread(s)): {r['base_tokens_per_s']:.1f} generated tokens/s; "
                         f"KV-cache tokens reused across turns: {r['kv_reused_tokens']}")
        lines.append("")
    uh = results.get("ultrahorizon")
    if uh:
        if results.get("uh_scripted_command"):
            lines += [f"Scripted UltraHorizon rows rerun alone: `{results['uh_scripted_command']}`.", ""]
        lines += ["## UltraHorizon (mean ± 95% CI half-width)", "",
                  "Protocol `menu: easier variant (closed menu)`: the prompt lists the candidate rule IDs (grid, seq) "
                  "or report keys (bio) and the rule judge scores a JSON commit, so discovery is multiple choice. The "
                  "default protocol, a free-text report scored by an LLM judge, needs `--uh-judge`"
                  + (" (run below)." if any(not r.get("protocol", MENU).startswith("menu") for r in uh["rows"])
                     else "; not run here (no judge endpoint on this machine).")
                  + " `oracle (reads the truth)` commits the hidden truth (an upper bound, not an explorer); "
                  "`script:infer` infers the rules from its own observations by eliminating candidates of the menu's "
                  "rule space (grid, seq) and from designed crosses (bio).", "",
                  markdown_table([{**{"agent": r["agent"], "protocol": r.get("protocol", MENU)}, **r} for r in uh["rows"]]), ""]
    lines += ["## Gates", ""] + [f"- {k}: {_gate(v)}" for k, v in results["gates"].items()]
    if "wall_seconds" in results:
        ph = results.get("phase_seconds", {})
        lines += ["", f"Wall time of the full command: {results['wall_seconds']:.0f} s; phases, including the parts "
                  "rerun alone: " + ", ".join(f"{k} {v:.0f} s" for k, v in ph.items()) + "."]
    (RESULTS / f"{STEM}.md").write_text("\n".join(lines) + "\n")
    plot(results)


def _gate(v) -> str:
    if isinstance(v, dict) and "measured" in v:
        m = v["measured"]
        m = f"{m:.3g}" if isinstance(m, float) else json.dumps(m, default=lambda x: round(x, 3))
        return render({**v, "measured": m}, bold=False)
    return render(v, bold=False)


def plot(results: dict) -> None:
    """One panel per environment with model rows: success rate per interface rewrite for the scripted oracle, the
    base model and the fine-tuned model, with Wilson 95 % intervals where the run recorded them."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:  # pragma: no cover
        return
    envs = [e for e, r in results.get("pipe", {}).items() if "base" in r or "sft_eval" in r]
    if not envs:
        return
    fig, axes = plt.subplots(1, len(envs), figsize=(4.2 * len(envs), 3.8), sharey=True, squeeze=False)
    keys = {"oracle": None, "base": "base", "fine-tuned": "sft_eval", "control": "control_eval"}
    agents = [(a, c) for a, c in (("oracle", "C2"), ("base", "C7"), ("fine-tuned", "C0"), ("control", "C1"))
              if keys[a] is None or any(keys[a] in results["pipe"][e] for e in envs)]
    w = 0.8 / len(agents)
    for ax, env_name in zip(axes[0], envs):
        r = results["pipe"][env_name]
        rows = {"oracle": results.get("oracle", {}).get(env_name), "base": r.get("base"), "fine-tuned": r.get("sft_eval"),
                "control": r.get("control_eval")}
        for i, (agent, color) in enumerate(agents):
            cells = rows[agent]
            if not cells:
                continue
            xs = [j + (i - (len(agents) - 1) / 2) * w for j in range(len(MODES))]
            srs = [cells[m]["sr"] for m in MODES]
            err = [[max(0.0, cells[m]["sr"] - cells[m].get("sr_lo", cells[m]["sr"])) for m in MODES],
                   [max(0.0, cells[m].get("sr_hi", cells[m]["sr"]) - cells[m]["sr"]) for m in MODES]]
            ax.bar(xs, srs, w, color=color, label=agent, yerr=err, capsize=2, error_kw={"lw": 0.8})
        ax.set_xticks(range(len(MODES)), MODES, rotation=30, ha="right", fontsize=8)
        ax.set_title(env_name, fontsize=10)
        ax.set_ylim(0, 1.08)
    axes[0][0].set_ylabel("success rate")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.suptitle("bench-agent: success rate per interface rewrite (bars: Wilson 95 % CI)")
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=9, frameon=False)
    fig.savefig(RESULTS / f"{STEM}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    main()

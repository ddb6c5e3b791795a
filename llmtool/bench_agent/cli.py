"""`llmtool bench-agent ...`: PIPE interface rewrites + Interface Reliance over built-in agent
environments, and the UltraHorizon long-horizon rule-discovery environments.

Verbs: ``envs`` (list), ``rewrite-spec`` (show / validate a rewrite spec), ``run`` (PIPE episodes),
``report`` (SR per rewrite, drops, IR with bootstrap CI), ``uh-run`` / ``uh-score`` / ``uh-play``
(UltraHorizon). Runs are resumable: finished episodes are kept in a hidden sibling
``.OUT.partial/`` until the run completes, then OUT appears atomically (``core.job``). Heavy imports
stay inside the commands.
"""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Annotated, Optional

import typer

from llmtool.core.console import OPTIONS, UsageError, emit, info
from llmtool.core.options import OutDirArg, Overwrite

app = typer.Typer(no_args_is_help=True, help="Agent benchmarks: PIPE interface rewrites, UltraHorizon.")

MODES = ("none", "synonym", "obfuscate", "dual-ori-first", "dual-syn-first")
AgentArg = Annotated[str, typer.Argument(
    help="The agent: hf:DIR|alias (in-process transformers; a bare alias/dir also works), "
         "openai:URL#MODEL (OpenAI-compatible server, key from $LLMTOOL_API_KEY) or script:oracle|random "
         "(uh-run also script:infer).",
    metavar="MODEL")]
Concurrency = Annotated[int, typer.Option("--concurrency", min=1, help="Episodes in flight: threads for openai:/script:, "
                                          "lockstep batched generation for hf: (throughput only).")]
MaxNew = Annotated[int, typer.Option("--max-new-tokens", min=1, help="New tokens per agent turn.")]
Temperature = Annotated[float, typer.Option("--temperature", min=0.0, help="Sampling temperature (0 = greedy).")]
Restart = Annotated[bool, typer.Option("--restart", help="Discard the unfinished episodes of an interrupted run of OUT "
                                       "instead of resuming it.")]
OutFile = Annotated[Optional[Path], typer.Option("--out", "-o", help="Also write the result to this file (.json or .md).")]


# --------------------------------------------------------------------------------------------- helpers
def _agent(uri: str, *, max_new_tokens: int, temperature: float, protocol: str = "text", check: bool = True):
    """Build the agent (one-line errors for a bad URI, a missing model, an unreachable endpoint)."""
    from llmtool.bench_agent.agents import make_agent

    if ":" not in uri or uri.split(":", 1)[0] not in ("hf", "openai", "script"):
        uri = "hf:" + uri
    scheme, spec = uri.split(":", 1)
    if scheme == "hf":
        from llmtool.core.models import check_causal_lm, resolve_model

        path = resolve_model(spec)
        check_causal_lm(path)
        return make_agent(f"hf:{path}", max_new_tokens=max_new_tokens, temperature=temperature,
                          protocol=protocol, seed=OPTIONS.seed, stop=("\n\n",)), path
    agent = make_agent(uri, max_new_tokens=max_new_tokens, temperature=temperature, protocol=protocol,
                       seed=OPTIONS.seed)
    if scheme == "openai" and check:
        agent.check()
    return agent, None


def run_agents(agent, runs: int) -> list:
    """One agent per independent run. An endpoint agent (stateless, runs in parallel) is copied; an in-process
    model's agent is shared (its weights and KV cache; ``uh-run`` runs it one run at a time). ``run_uh`` sets
    the agent's sampling seed to the run's seed when the run starts."""
    import copy

    return [copy.copy(agent) if getattr(agent, "concurrent", False) else agent for _ in range(runs)]


def _preflight(uri: str, out: Path, inputs=(), overwrite: bool = False) -> None:
    """core.preflight before torch is imported: an hf: agent's model is a sane causal-LM checkpoint or a default
    alias, the input files exist, OUT is writable."""
    from llmtool.core.preflight import preflight

    scheme, _, spec = uri.partition(":") if uri.split(":", 1)[0] in ("hf", "openai", "script") else ("hf", ":", uri)
    model = spec if scheme == "hf" else None
    preflight(model, out, inputs=inputs, overwrite=overwrite)


def _partial(out: Path) -> Path:
    out = Path(out).resolve()
    return out.parent / f".{out.name}.partial"


def _open_partial(out: Path, overwrite: bool, restart: bool, config: dict) -> Path:
    """The resumable work directory of OUT: reused when it holds the same run, else refused."""
    from llmtool.core.checkpoint import check_output

    check_output(Path(out), overwrite)
    part = _partial(out)
    meta = part / "run.json"
    if part.exists() and restart:
        shutil.rmtree(part)
    if part.exists():
        try:
            old = json.loads(meta.read_text())
        except (OSError, json.JSONDecodeError):
            old = None
        if old != json.loads(json.dumps(config)):
            diff = sorted(k for k in set(config) | set(old or {}) if (old or {}).get(k) != config.get(k))
            raise UsageError(f"{part}: holds an interrupted run with different settings ({', '.join(diff)}); "
                             "pass --restart to discard it")
        info(f"resuming the interrupted run kept in {part}")
    part.mkdir(parents=True, exist_ok=True)
    meta.write_text(json.dumps(config, indent=2))
    return part


class _Bar:
    """A progress bar with the success rate (or mean score) so far, on stderr (hidden under --json/-q
    or without a terminal)."""

    def __init__(self, total: int, desc: str, done: int = 0):
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        from llmtool.core.console import stderr

        self.show = not (OPTIONS.json or OPTIONS.quiet) and stderr.is_terminal
        self.bar = None
        if self.show:
            self.bar = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                TextColumn("{task.fields[stat]}"), TimeElapsedColumn(), console=stderr,
                                transient=True)
            self.task = self.bar.add_task(desc, total=total, completed=done, stat="")

    def __enter__(self):
        if self.bar:
            self.bar.__enter__()
        return self

    def update(self, completed: int, stat: str) -> None:
        if self.bar:
            self.bar.update(self.task, completed=completed, stat=stat)

    def __exit__(self, *exc):
        if self.bar:
            self.bar.__exit__(*exc)


def _write_out(path: Path | None, result: dict, markdown: str) -> None:
    if path is None:
        return
    from llmtool.core.checkpoint import atomic_file

    with atomic_file(Path(path)) as tmp:
        tmp.write_text(markdown if Path(path).suffix == ".md" else json.dumps(result, indent=2, default=str))


# ------------------------------------------------------------------------------------------------ envs
@app.command("envs")
def envs_cmd() -> None:
    """List the built-in environments (PIPE suite and UltraHorizon) with their interface names."""
    from llmtool.bench_agent.envs import ENVS
    from llmtool.bench_agent.uh import UH_ENVS

    rows = []
    for name, cls in ENVS.items():
        rows.append({"env": name, "suite": "pipe", "identifiers": ", ".join(cls.IDENTIFIERS),
                     "synonyms": ", ".join(cls.SYNONYMS[a] for a in cls.IDENTIFIERS), "dual": cls.DUAL,
                     "rounds": cls.default_rounds, "help": cls.help})
    for name, cls in UH_ENVS.items():
        rows.append({"env": name, "suite": "ultrahorizon", "identifiers": ", ".join(cls.consuming), "synonyms": "",
                     "dual": "", "rounds": f"{cls.step_factor}R", "help": cls.help})
    emit({"envs": rows}, rows=rows, title="bench-agent environments")


@app.command("rewrite-spec")
def rewrite_spec_cmd(
    env: Annotated[str, typer.Option("--env", help="A PIPE environment (see `bench-agent envs`).")],
    spec: Annotated[Optional[Path], typer.Option("--spec", help="A rewrite spec file (.json/.yaml) to validate "
                                                 "instead of the built-in one.")] = None,
) -> None:
    """Show an environment's rewrite spec and validate it (injective, collision-free against task
    texts, round trip identity); an invalid spec is an error (exit 2)."""
    from llmtool.bench_agent.envs import make_env
    from llmtool.bench_agent.rewrite import RewriteSpec

    probe = make_env(env)
    rs = RewriteSpec.from_file(spec, probe) if spec else RewriteSpec.for_env(probe)
    rs.check(probe.sample_texts(8))
    d = rs.as_dict()
    rows = [{"identifier": a, "synonym": d["synonyms"][a], "obfuscated": d["obfuscation"][a]} for a in rs.actions]
    emit({**d, "sha": rs.digest(), "valid": True}, rows=rows, title=f"{env} rewrite spec {rs.digest()} (valid)")


# ------------------------------------------------------------------------------------------------- run
@app.command("run")
def run_cmd(
    model: AgentArg,
    out: OutDirArg,
    env: Annotated[str, typer.Option("--env", help="PIPE environment (see `bench-agent envs`).")] = "grid-nav",
    rewrite: Annotated[str, typer.Option("--rewrite", help="Interface rewrite: " + ", ".join(MODES) + ".")] = "none",
    episodes: Annotated[int, typer.Option("--episodes", min=1, help="Generated tasks (ids 0..N-1, seeds from --seed).")] = 20,
    tasks: Annotated[Optional[Path], typer.Option("--data", help="Task file (JSONL: item_id, optional integer seed) "
                                                  "instead of --episodes.")] = None,
    max_rounds: Annotated[Optional[int], typer.Option("--max-rounds", min=1, help="Agent turns per episode "
                                                      "(default: the env's).")] = None,
    strict: Annotated[bool, typer.Option("--strict/--no-strict", help="Synonym/obfuscate: answer original names "
                                         "with the deprecated-action observation.")] = True,
    history: Annotated[Optional[int], typer.Option("--history", min=0, help="Past exchanges shown to the agent "
                                                   "(default: the whole episode).")] = None,
    protocol: Annotated[str, typer.Option("--protocol", help="text (Action: lines) or tools (function calling; "
                                          "schemas also written into the prompt).")] = "text",
    rewrite_spec: Annotated[Optional[Path], typer.Option("--rewrite-spec", help="Rewrite spec file (.json/.yaml) "
                                                         "replacing the env's built-in one.")] = None,
    concurrency: Concurrency = 1,
    max_new_tokens: MaxNew = 64,
    temperature: Temperature = 0.0,
    restart: Restart = False,
    overwrite: Overwrite = False,
) -> None:
    """Run MODEL on ENV under one interface rewrite -> OUT/episodes.jsonl (one record per episode:
    conversation, reward, orig/alias/deprecated/invalid calls, tokens, wall time) and OUT/summary.json."""
    _preflight(model, out, (tasks, rewrite_spec), overwrite)
    from llmtool.bench_agent.harness import checked_spec, load_tasks, read_done, run_tasks
    from llmtool.core.job import job

    if rewrite not in MODES:
        raise UsageError(f"--rewrite {rewrite!r}: choose one of {', '.join(MODES)}")
    if protocol not in ("text", "tools"):
        raise UsageError(f"--protocol {protocol!r}: choose text or tools")
    spec = checked_spec(env, rewrite, strict, spec_file=rewrite_spec)
    task_list = load_tasks(tasks, episodes, OPTIONS.seed)
    config = {"command": "bench-agent run", "model": model, "env": env, "rewrite": rewrite, "strict": strict,
              "episodes": episodes if tasks is None else None, "data": str(tasks) if tasks else None,
              "max_rounds": max_rounds, "history": history, "protocol": protocol, "seed": OPTIONS.seed,
              "rewrite_spec_sha": spec.digest(), "max_new_tokens": max_new_tokens, "temperature": temperature}
    from llmtool.core.checkpoint import check_output

    check_output(Path(out), overwrite)
    agent, model_path = _agent(model, max_new_tokens=max_new_tokens, temperature=temperature, protocol=protocol)
    agent.uri = model
    if model_path is not None:  # a local model answers every turn: the long part
        from llmtool.bench_agent.envs import ENVS
        from llmtool.core import eta_plans as plans

        shape = plans.Shape.of(model_path)
        plans.announce(plans.bench_agent(shape, len(task_list), max_rounds or ENVS.get(env).default_rounds,
                                         max_new_tokens), shape, "bench-agent run")
    part = _open_partial(out, overwrite, restart, config)
    from llmtool.core.job import apply_threads

    apply_threads()
    path = part / "episodes.jsonl"
    already = len([t for t in task_list if str(t["item_id"]) in read_done(path)])
    with _Bar(len(task_list), f"{env}/{rewrite}", already) as bar:
        def on_episode(rec, done):
            vals = [done[str(t["item_id"])]["success"] for t in task_list if str(t["item_id"]) in done]
            bar.update(len(vals), f"SR {sum(vals) / len(vals):.2f}")

        summary = run_tasks(env, agent, rewrite, task_list, path, max_rounds=max_rounds, strict=strict,
                            history=history, concurrency=concurrency, on_episode=on_episode, spec=spec)
    with job("bench-agent run", out=out, overwrite=overwrite, config=None, model=None, inputs=(part,),
             seed=OPTIONS.seed) as j:
        shutil.copy2(path, j.dir / "episodes.jsonl")
        (j.dir / "summary.json").write_text(json.dumps(summary, indent=2))
        (j.dir / "rewrite_spec.json").write_text(json.dumps(spec.as_dict(), indent=2))
        j.report.update(summary)
        j.extra["run"] = config
        if model_path is not None:
            j.extra["model_path"] = str(model_path)
    shutil.rmtree(part, ignore_errors=True)
    row = {"env": env, "rewrite": rewrite, "episodes": summary["episodes"], "SR": summary["sr"],
           "95% CI": f"[{summary['sr_lo']:.2f}, {summary['sr_hi']:.2f}]",
           "orig/alias": f"{summary['orig_calls']}/{summary['alias_calls']}",
           "deprecated": summary["deprecated_rate"], "invalid": summary["invalid_rate"],
           "tokens": summary["prompt_tokens"] + summary["completion_tokens"], "resumed": summary["resumed"],
           "s": summary["seconds"]}
    emit(summary, rows=[row], title=f"bench-agent run {model}")


# ---------------------------------------------------------------------------------------------- report
@app.command("report")
def report_cmd(
    runs: Annotated[list[Path], typer.Argument(help="Run directories of `bench-agent run` (or folders holding them).",
                                               metavar="RUN...")],
    out: OutFile = None,
    draws: Annotated[int, typer.Option("--draws", min=100, help="Bootstrap draws for the IR CI.")] = 2000,
) -> None:
    """SR per (model, env, rewrite) with Wilson CIs, drops vs the original interface, and Interface
    Reliance (IR, 95 % bootstrap CI) from each dual-ori-first/dual-syn-first pair."""
    for r in runs:  # before torch is imported
        if not Path(r).exists():
            raise UsageError(f"{r}: no such run directory")
    from llmtool.bench_agent.metrics import interface_reliance
    from llmtool.core.console import markdown_table
    from llmtool.core.data import read_jsonl

    dirs: list[Path] = []
    for r in runs:
        if (r / "summary.json").is_file():
            dirs.append(r)
        elif r.is_dir():
            found = sorted(p.parent for p in r.rglob("summary.json"))
            if not found:
                raise UsageError(f"{r}: holds no bench-agent run (no summary.json)")
            dirs += found
        else:
            raise UsageError(f"{r}: no such run directory")
    groups: dict[tuple, dict] = {}
    for d in dirs:
        try:
            s = json.loads((d / "summary.json").read_text())
            key = (s["model"], s["env"])
            groups.setdefault(key, {})[s["rewrite"]] = (s, d)
        except (json.JSONDecodeError, KeyError) as e:
            raise UsageError(f"{d / 'summary.json'}: not a bench-agent summary ({e})") from None
    rows, irs = [], []
    for (model, env), by in sorted(groups.items()):
        base = by.get("none", (None,))[0]
        for mode in MODES:
            if mode not in by:
                continue
            s = by[mode][0]
            drop = base["sr"] - s["sr"] if base and mode != "none" else None
            rows.append({"model": model, "env": env, "rewrite": mode, "episodes": s["episodes"], "SR": s["sr"],
                         "SR 95% CI": f"[{s['sr_lo']:.2f}, {s['sr_hi']:.2f}]", "drop": "" if drop is None else drop,
                         "rel drop": drop / base["sr"] if drop is not None and base["sr"] else "",
                         "deprecated rate": s["deprecated_rate"], "invalid rate": s["invalid_rate"]})
        if "dual-ori-first" in by and "dual-syn-first" in by:
            os_ = read_jsonl(by["dual-ori-first"][1] / "episodes.jsonl", required=("orig_calls", "alias_calls"))
            so = read_jsonl(by["dual-syn-first"][1] / "episodes.jsonl", required=("orig_calls", "alias_calls"))
            ir = interface_reliance(os_, so, draws=draws, seed=OPTIONS.seed)
            irs.append({"model": model, "env": env, **ir})
    result = {"runs": rows, "interface_reliance": irs}
    md = "## Success rate per rewrite\n\n" + markdown_table(rows) + "\n"
    if irs:
        md += "\n## Interface Reliance\n\n" + markdown_table(
            [{"model": r["model"], "env": r["env"], "IR": r["ir"], "95% CI": f"[{r['ir_lo']:.3g}, {r['ir_hi']:.3g}]",
              "MD ori-first": r["md_ori_first"], "MD syn-first": r["md_syn_first"],
              "only-original share": r["share_only_original"]} for r in irs]) + "\n"
    _write_out(out, result, md)
    emit(result, rows=rows + [{"model": r["model"], "env": r["env"], "rewrite": "IR",
                               "SR": r["ir"], "SR 95% CI": f"[{r['ir_lo']:.3g}, {r['ir_hi']:.3g}]"} for r in irs],
         title="bench-agent report")


# ------------------------------------------------------------------------------------------- ultrahorizon
@app.command("uh-run")
def uh_run_cmd(
    model: AgentArg,
    out: OutDirArg,
    env: Annotated[str, typer.Option("--env", help="UltraHorizon environment: grid, seq or bio.")] = "grid",
    difficulty: Annotated[str, typer.Option("--difficulty", help="easy, medium or hard (the runner's default).")] = "hard",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Horizon R: environment actions required before a commit.")] = 50,
    runs: Annotated[int, typer.Option("--runs", min=1, help="Independent runs (seeds --seed .. --seed+N-1).")] = 8,
    context: Annotated[str, typer.Option("--context", help="Context policy: full, sliding or crnr.")] = "crnr",
    window: Annotated[int, typer.Option("--window", min=2, help="Messages kept (sliding) / refresh threshold (crnr).")] = 200,
    free: Annotated[bool, typer.Option("--free", help="Lift the commit/step gating.")] = False,
    report: Annotated[str, typer.Option("--report", help="free: a written report, no rule named in the prompt, LLM "
                                        "judge (the paper's protocol); menu: the easier variant (closed menu of rule "
                                        "IDs, JSON commit, rule judge).")] = "free",
    judge: Annotated[str, typer.Option("--judge", help="openai:URL#MODEL or hf:MODEL (LLM judge; required by --report "
                                       "free), or rule (--report menu; its default).")] = "",
    protocol: Annotated[str, typer.Option("--protocol", help="text (tool calls in the reply text) or tools "
                                          "(native function calling for openai:).")] = "text",
    concurrency: Concurrency = 1,
    max_new_tokens: MaxNew = 256,
    temperature: Annotated[float, typer.Option("--temperature", min=0.0, help="Sampling temperature (reference agent: 0.3).")] = 0.3,
    restart: Restart = False,
    overwrite: Overwrite = False,
) -> None:
    """Run MODEL on an UltraHorizon environment -> OUT/run-NNN/ (trajectory.jsonl, notes.txt,
    commit.txt, eval_output.json, env_truth.json) and OUT/scores.json."""
    _preflight(model, out, (), overwrite)
    from concurrent.futures import ThreadPoolExecutor

    from llmtool.bench_agent.uh import UH_ENVS
    from llmtool.bench_agent.uhrun import POLICIES, UHScript, make_judge, run_uh, score_runs
    from llmtool.core.job import job

    UH_ENVS.get(env)
    if difficulty not in ("easy", "medium", "hard"):
        raise UsageError(f"--difficulty {difficulty!r}: choose easy, medium or hard")
    if context not in POLICIES:
        raise UsageError(f"--context {context!r}: choose one of {', '.join(POLICIES)}")
    if protocol not in ("text", "tools"):
        raise UsageError(f"--protocol {protocol!r}: choose text or tools")
    judge_ep = make_judge(judge, report)
    config = {"command": "bench-agent uh-run", "model": model, "env": env, "difficulty": difficulty, "steps": steps,
              "runs": runs, "context": context, "window": window, "free": free, "report": report,
              "judge": judge or "rule",
              "seed": OPTIONS.seed, "max_new_tokens": max_new_tokens, "temperature": temperature, "protocol": protocol}
    from llmtool.core.checkpoint import check_output

    check_output(Path(out), overwrite)
    if model.startswith("script:"):
        agents = [UHScript(model.split(":", 1)[1], OPTIONS.seed + i) for i in range(runs)]
        model_path = None
    else:
        agent, model_path = _agent(model, max_new_tokens=max_new_tokens, temperature=temperature, protocol=protocol)
        if model_path is not None:
            agent.stop = ("</tool_call>",)
        agent.uri = model
        agents = run_agents(agent, runs)
    part = _open_partial(out, overwrite, restart, config)
    from llmtool.core.job import apply_threads

    apply_threads()
    seeds = [OPTIONS.seed + i for i in range(runs)]

    def finished(i):
        p = part / f"run-{i:03d}" / "eval_output.json"
        try:
            return json.loads(p.read_text())
        except (OSError, json.JSONDecodeError):
            return None

    evals = {i: e for i in range(runs) if (e := finished(i)) is not None}
    todo = [i for i in range(runs) if i not in evals]
    with _Bar(runs, f"uh {env} R={steps}", len(evals)) as bar:
        def one(i):
            d = part / f"run-{i:03d}"
            shutil.rmtree(d, ignore_errors=True)
            ev = run_uh(env, agents[i], d, difficulty=difficulty, steps=steps, seed=seeds[i], free=free,
                        policy=context, window=window, judge=judge_ep, report=report)
            evals[i] = ev
            sc = [e["judge_result"].get("final_score") for e in evals.values()]
            sc = [s for s in sc if s is not None]
            bar.update(len(evals), f"score {sum(sc) / len(sc):.1f}" if sc else "")

        workers = concurrency if (model.startswith(("script:", "openai:"))) else 1
        if workers > 1:
            with ThreadPoolExecutor(workers) as pool:
                list(pool.map(one, todo))
        else:
            for i in todo:
                one(i)
    scores = score_runs([evals[i] for i in range(runs)])
    with job("bench-agent uh-run", out=out, overwrite=overwrite, config=None, inputs=(part,), seed=OPTIONS.seed) as j:
        for i in range(runs):
            shutil.copytree(part / f"run-{i:03d}", j.dir / f"run-{i:03d}")
        (j.dir / "scores.json").write_text(json.dumps(scores, indent=2))
        j.report.update(scores)
        j.extra["run"] = config
        if model_path is not None:
            j.extra["model_path"] = str(model_path)
    shutil.rmtree(part, ignore_errors=True)
    emit(scores, rows=[_score_row(env, steps, context, scores)], title=f"UltraHorizon {env} ({model})")


def _fmt_ci(m: dict) -> str:
    if m.get("mean") is None:
        return "n/a"
    return f"{m['mean']:.1f} ± {(m['hi'] - m['mean']):.1f}"


def _score_row(env, steps, context, s) -> dict:
    return {"env": env, "R": steps, "context": context, "runs": s["runs"], "score": _fmt_ci(s["score"]),
            "tool calls": _fmt_ci(s["tool_calls"]), "prompt tokens": _fmt_ci(s["prompt_tokens"]),
            "completion tokens": _fmt_ci(s["completion_tokens"]), "commit rate": s["commit_rate"],
            "refreshes": _fmt_ci(s["refreshes"])}


@app.command("uh-score")
def uh_score_cmd(
    run_dir: Annotated[Path, typer.Argument(help="An OUT of `bench-agent uh-run` (or a folder of run-* dirs).",
                                            metavar="RUN")],
    out: OutFile = None,
) -> None:
    """Score summary of UltraHorizon runs: mean ± 95 % CI of score, tool calls and tokens, per criterion."""
    from llmtool.bench_agent.uhrun import score_runs
    from llmtool.core.console import markdown_table

    files = sorted(run_dir.glob("run-*/eval_output.json")) if run_dir.is_dir() else []
    if not files:
        raise UsageError(f"{run_dir}: holds no run-*/eval_output.json")
    evals = []
    for f in files:
        try:
            evals.append(json.loads(f.read_text()))
        except json.JSONDecodeError:
            raise UsageError(f"{f}: not JSON") from None
    s = score_runs(evals)
    e0 = evals[0]
    row = _score_row(e0.get("env"), e0.get("steps"), e0.get("policy"), s)
    _write_out(out, s, markdown_table([row]) + "\n")
    emit(s, rows=[row], title=f"UltraHorizon {run_dir}")


@app.command("uh-play")
def uh_play_cmd(
    env: Annotated[str, typer.Option("--env", help="grid, seq or bio.")] = "seq",
    steps: Annotated[int, typer.Option("--steps", min=1, help="Horizon R.")] = 20,
    difficulty: Annotated[str, typer.Option("--difficulty", help="easy, medium or hard.")] = "hard",
    free: Annotated[bool, typer.Option("--free", help="Lift the commit/step gating.")] = False,
    report: Annotated[str, typer.Option("--report", help="free (written report, LLM judge) or menu (closed menu, "
                                        "rule judge).")] = "free",
    judge: Annotated[str, typer.Option("--judge", help="openai:URL#MODEL or hf:MODEL; rule for --report menu.")] = "",
) -> None:
    """Play an UltraHorizon environment in the terminal: type `TOOL {json arguments}` per line
    (e.g. `move {"direction": "up"}`), `tools` to list them, `quit` to stop; the commit is scored
    with the LLM judge (--report free) or the rule judge (--report menu)."""
    import sys

    from llmtool.bench_agent.uh import make_uh_env
    from llmtool.bench_agent.uhrun import make_judge, score_commit

    if difficulty not in ("easy", "medium", "hard"):
        raise UsageError(f"--difficulty {difficulty!r}: choose easy, medium or hard")
    judge_ep = make_judge(judge, report)
    e = make_uh_env(env, difficulty=difficulty, steps=steps, seed=OPTIONS.seed, free=free, report=report)
    print(e.prompt())
    print("tools: " + ", ".join(e.tool_names()))
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        if line == "quit":
            break
        if line == "tools":
            for s in e.schemas():
                print(json.dumps(s["function"]))
            continue
        name, _, rest = line.partition(" ")
        try:
            args = json.loads(rest) if rest.strip() else {}
        except json.JSONDecodeError:
            print("error: arguments must be a JSON object")
            continue
        if not isinstance(args, dict):
            print("error: arguments must be a JSON object")
            continue
        print(e.call(name, args), flush=True)
        if e.committed is not None:
            break
    res = score_commit(e, e.committed, judge_ep)
    emit({"committed": e.committed is not None, "actions": e.used, **res},
         rows=[{"committed": e.committed is not None, "actions": e.used, "score": res["final_score"]}])


@app.command("uh-entropy")
def uh_entropy_cmd(
    run_dir: Annotated[Path, typer.Argument(help="An OUT of `bench-agent uh-run` with an hf: agent.", metavar="RUN")],
    out: OutFile = None,
) -> None:
    """Per-turn mean output entropy (in-context locking: a negative slope over the run) from the
    trajectories; -o FILE.csv writes run,turn,entropy rows (exact entropies need an hf: agent)."""
    files = sorted(run_dir.glob("run-*/trajectory.jsonl")) if run_dir.is_dir() else []
    if not files:
        raise UsageError(f"{run_dir}: holds no run-*/trajectory.jsonl")
    rows, slopes = [], []
    for f in files:
        ents = []
        for line in f.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("role") == "assistant" and rec.get("entropy") is not None:
                ents.append(rec["entropy"])
                rows.append({"run": f.parent.name, "turn": len(ents), "entropy": rec["entropy"]})
        if len(ents) >= 2:
            n = len(ents)
            mx, my = (n - 1) / 2, sum(ents) / n
            slopes.append(sum((i - mx) * (e - my) for i, e in enumerate(ents)) / sum((i - mx) ** 2 for i in range(n)))
    if not rows:
        raise UsageError(f"{run_dir}: no per-turn entropies recorded (run uh-run with an hf: agent)")
    result = {"turns": len(rows), "runs": len(files), "slopes": slopes,
              "mean_slope": sum(slopes) / len(slopes) if slopes else None,
              "share_negative_slope": sum(s < 0 for s in slopes) / len(slopes) if slopes else None}
    if out is not None:
        from llmtool.core.checkpoint import atomic_file

        with atomic_file(Path(out)) as tmp:
            if Path(out).suffix == ".csv":
                tmp.write_text("run,turn,entropy\n" + "".join(f"{r['run']},{r['turn']},{r['entropy']}\n" for r in rows))
            else:
                tmp.write_text(json.dumps({**result, "rows": rows}, indent=2))
    emit(result, rows=[{k: v for k, v in result.items() if k != "slopes"}], title="UltraHorizon output entropy")

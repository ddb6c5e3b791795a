"""UltraHorizon agent loop (ultrahorizon.md §4): one tool call per assistant turn, notes that survive
context refreshes, a sandboxed ``python_execute``, context policies, token/tool-call accounting and
per-turn output entropy.

Context policies: ``full`` (keep everything; a prompt beyond the model's window ends the run as an
overflow failure), ``sliding`` (system prompt + task message + the last W messages, cut at an
assistant message so no observation is orphaned), ``crnr`` (when the non-system history exceeds W
messages, drop all of it and insert one user message saying the context was cleared and the notes
must be read first; notes persist).

Report protocols (``report``, issue 42): ``free`` (default) — the prompt names no rule and an LLM judge
scores the written report; ``menu`` — the **easier variant (closed menu)**: the prompt lists the rule IDs
and the rule judge scores a JSON commit. :func:`make_judge` resolves ``--judge`` for a protocol. Without
``--judge``, ``free`` is refused with one line naming ``--judge``: the paper's judge is a strong LLM
(DeepSeek-R1 in the official runner) over an API, and no judge that fits this project's CPU defaults
(a 135M–0.5B model in-process) grades prose faithfully, so none is picked silently; ``--judge
hf:MODEL`` runs a judge in-process when the user has a capable local model (a GPU for 7B+), and the
rule judge is used for ``menu`` only.

Tool calls are parsed tolerantly (native ``tool_calls``, tagged ``<tool_call>`` JSON, bare JSON,
Python-call style); if several are emitted, the first runs and the agent is told the rest were
ignored; a reply with no call is an invalid call answered by an error observation.
"""
from __future__ import annotations

import json
import math
import random
import time
from pathlib import Path

from llmtool.bench_agent.agents import Turn
from llmtool.bench_agent.toolparse import parse_tool_calls
from llmtool.bench_agent.uh import MENU_LABEL, REPORTS, UHEnv, llm_judge, make_uh_env, rule_judge

POLICIES = ("full", "sliding", "crnr")
REFRESH = ("The context was cleared to save space. Before continuing, call check_notes to read your notes; "
           "they hold everything you recorded so far.")
NUDGE = ("Reply with a short Thought and Plan, then exactly one tool call as "
         '<tool_call>{"name": NAME, "arguments": {...}}</tool_call>. Keep your notes up to date.')

AUX_SCHEMAS = [
    {"type": "function", "function": {"name": "write_note", "description": "Append a note (notes survive context refreshes).",
                                      "parameters": {"type": "object", "properties": {"note": {"type": "string"}},
                                                     "required": ["note"]}}},
    {"type": "function", "function": {"name": "check_notes", "description": "Read all your notes.",
                                      "parameters": {"type": "object", "properties": {}, "required": []}}},
    {"type": "function", "function": {"name": "python_execute", "description": "Run Python code in a sandbox (10 s).",
                                      "parameters": {"type": "object", "properties": {"code": {"type": "string"}},
                                                     "required": ["code"]}}},
]


def apply_policy(messages: list[dict], policy: str, window: int) -> tuple[list[dict], bool]:
    """The message list after the context policy; ``True`` when a CRNR refresh happened."""
    if policy == "full":
        return messages, False
    if policy == "sliding":
        body = messages[2:]
        if len(body) <= window:
            return messages, False
        cut = len(body) - window
        while cut < len(body) and body[cut]["role"] != "assistant":
            cut += 1
        return messages[:2] + body[cut:], False
    if len(messages) - 1 > window:       # crnr
        return [messages[0], {"role": "user", "content": REFRESH}], True
    return messages, False


class HFJudge:
    """An in-process LLM judge (``--judge hf:MODEL``): greedy, the same prompt and parsing as the
    endpoint judge (:func:`llmtool.bench_agent.uh.llm_judge` calls :meth:`chat`)."""

    def __init__(self, spec: str, max_new_tokens: int = 1024):
        from llmtool.bench_agent.agents import HFAgent

        self.agent = HFAgent(spec, max_new_tokens=max_new_tokens, temperature=0.0, stop=())
        self.model, self.cap = f"hf:{spec}", max_new_tokens

    def chat(self, messages, temperature: float = 0.0, max_tokens: int = 2048) -> list[dict]:
        """One greedy answer; a prompt beyond the judge's window answers an error text (a null score)."""
        from llmtool.bench_agent.agents import ContextOverflow

        self.agent.reset()
        self.agent.max_new_tokens = min(max_tokens, self.cap)
        try:
            return [{"content": self.agent.act(messages).content}]
        except ContextOverflow as e:
            return [{"content": f"(the judge prompt does not fit the judge model: {e})"}]


def make_judge(spec: str | None, report: str = "free"):
    """The judge for ``--judge SPEC`` under ``--report REPORT``: None (the rule judge, menu only), an
    ``OpenAIEndpoint`` (checked) or an :class:`HFJudge`. One-line ``UsageError`` otherwise."""
    from llmtool.core.console import UsageError

    if report not in REPORTS:
        raise UsageError(f"--report {report!r}: free or menu")
    spec = (spec or "").strip()
    if spec in ("", "rule"):
        if report == "free":
            raise UsageError("--report free (the default) scores a written report with an LLM judge: pass --judge "
                             "openai:URL#MODEL (the paper's setup) or --judge hf:MODEL, or use --report menu "
                             f"(the {MENU_LABEL}, rule judge)")
        return None
    if spec.startswith("openai:") and "#" in spec:
        import os

        from llmtool.core.endpoint import OpenAIEndpoint

        url, name = spec[len("openai:"):].split("#", 1)
        ep = OpenAIEndpoint(url, name, api_key=os.environ.get("LLMTOOL_API_KEY"), timeout=300)
        ep.check()
        return ep
    if spec.startswith("hf:"):
        from llmtool.core.models import check_causal_lm, resolve_model

        path = resolve_model(spec[3:])
        check_causal_lm(path)
        return HFJudge(str(path))
    raise UsageError(f"--judge {spec!r}: openai:URL#MODEL, hf:MODEL or rule (--report menu only)")


def score_commit(env: UHEnv, commit: str | None, judge=None) -> dict:
    """Judge a commit: the rule judge when ``judge`` is None (menu only), else the LLM judge."""
    if judge is None:
        if env.report == "free":
            raise ValueError("a free-text report needs an LLM judge (report='menu' for the rule judge)")
        return rule_judge(env, commit)
    return llm_judge(env, commit, judge)


def judge_name(judge) -> str:
    if judge is None:
        return "rule"
    return judge.model if str(judge.model).startswith("hf:") else f"openai:{judge.model}"


class UHCtx:
    def __init__(self, env: UHEnv):
        self.env = env

    def tool_schemas(self) -> list[dict]:
        return self.env.schemas() + AUX_SCHEMAS


SCRIPTS = ("oracle", "infer", "random")


class UHScript:
    """Scripted explorers: ``oracle`` READS THE HIDDEN TRUTH (an upper bound, not an explorer: labelled
    "oracle (reads the truth)" in the benchmark), performs R valid consuming actions (writing a note on the
    way) and commits the true report; ``infer`` (:mod:`llmtool.bench_agent.uhinfer`) never touches the
    environment object: it reads only its own observations and eliminates hypotheses over the candidate rule
    space; ``random`` calls random tools with random arguments and commits a random report. Each commits
    JSON (menu) or prose (free) and answers in the tagged tool-call text format, so the loop parses them
    exactly like a model."""

    concurrent = True

    def __init__(self, kind: str, seed: int = 0):
        from llmtool.core.console import UsageError

        if kind not in SCRIPTS:
            raise UsageError(f"--model script:{kind}: scripted UltraHorizon agents are "
                             + ", ".join(f"script:{k}" for k in SCRIPTS))
        self.kind, self.uri = kind, f"script:{kind}"
        self.rng = random.Random(seed)
        self.seed = seed
        self.infer = None

    def reset(self) -> None:
        self.infer = None

    def act(self, messages, ctx: UHCtx) -> Turn:
        if self.kind == "infer":
            from llmtool.bench_agent.uhinfer import InferExplorer

            if self.infer is None:
                self.infer = InferExplorer(self.seed)
            return self.infer.act(messages, ctx)
        env = ctx.env
        if messages[-1]["content"].startswith(REFRESH[:20]):
            name, args = "check_notes", {}
        elif self.kind == "oracle":
            if env.may_commit():
                name, args = "commit_final_result", {"content": env.commit_text(env.oracle_report())}
            elif env.used and env.used % 10 == 0 and not messages[-1]["content"].startswith("Observation: Note saved"):
                name, args = "write_note", {"note": f"{env.used} actions done"}
            else:
                name, args = env.oracle_action()
        else:
            if env.may_commit() and self.rng.random() < 0.3:
                name, args = "commit_final_result", {"content": env.commit_text(env.random_report(self.rng))}
            elif self.rng.random() < 0.8:
                name, args = env.oracle_action()
            else:
                name = self.rng.choice(env.tool_names())
                args = {"content": "guess"} if name == "commit_final_result" else {}
        text = f"Thought: continue.\n<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"
        return Turn(text, {"prompt": sum(len(str(m["content"])) for m in messages) // 4 + 1,
                           "completion": len(text) // 4 + 1})


def _python(code: str) -> str:
    from llmtool.core.sandbox import SandboxLimits, run_python

    r = run_python(code, limits=SandboxLimits(cpu_seconds=10, wall_seconds=15, memory_mb=512, output_bytes=20_000))
    tail = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else ""
    return f"exit {r.returncode}; stdout: {r.stdout[-2000:]}" + (f"; stderr: {tail[:300]}" if r.returncode else "")


def system_prompt(env: UHEnv, ctx: "UHCtx") -> str:
    """The system prompt of a run: the environment's prompt, the tool schemas and the nudge."""
    tools_text = "\n".join(json.dumps(s["function"]) for s in ctx.tool_schemas())
    return env.prompt() + "\nTools:\n" + tools_text + "\n" + NUDGE


def run_uh(env_name: str, agent, out_dir: Path, *, difficulty: str = "hard", steps: int = 50, seed: int = 0,
           free: bool = False, policy: str = "crnr", window: int = 200, judge=None, report: str = "free") -> dict:
    """One run into ``out_dir`` (trajectory.jsonl, notes.txt, commit.txt, eval_output.json,
    env_truth.json); returns eval_output. ``judge``: None = rule judge (``report="menu"`` only), else an
    OpenAIEndpoint or :class:`HFJudge`. ``report``: ``free`` (written report, LLM judge) or ``menu``.

    An agent with a sampling ``seed`` (hf:, openai:) samples this run with ``seed``, as the environment does:
    with one sampling seed for every run, a model whose context never receives the environment's seed (no valid
    tool call yet) replays the same turns, and N runs are one sample. Runs in parallel need one agent each."""
    from llmtool.bench_agent.agents import ContextOverflow

    if hasattr(agent, "seed"):
        agent.seed = seed

    if judge is None and report == "free":
        raise ValueError("report='free' needs an LLM judge; report='menu' uses the rule judge")
    env = make_uh_env(env_name, difficulty=difficulty, steps=steps, seed=seed, free=free, report=report)
    ctx = UHCtx(env)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    known = {s["function"]["name"] for s in ctx.tool_schemas()}
    system = system_prompt(env, ctx)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "Begin. " + NUDGE}]
    notes: list[str] = []
    stats = {"tool_calls": 0, "invalid_calls": 0, "ignored_calls": 0, "refreshes": 0, "early_commit_attempts": 0,
             "prompt_tokens": 0, "completion_tokens": 0, "turns": 0, "overflow": False}
    entropies = []
    cap = env.step_factor * env.R
    agent.reset()
    t_run = time.time()
    with open(out_dir / "trajectory.jsonl", "w", encoding="utf-8") as traj:
        def log(**rec):
            traj.write(json.dumps(rec) + "\n")
            traj.flush()

        log(role="system", content=system, t=0.0)
        for turn_i in range(cap):
            if env.committed is not None:
                break
            messages, refreshed = apply_policy(messages, policy, window)
            if refreshed:
                stats["refreshes"] += 1
                log(role="user", content=REFRESH, event="refresh", t=round(time.time() - t_run, 3))
            t0 = time.time()
            try:
                turn = agent.act(messages, ctx)
            except ContextOverflow as e:
                stats["overflow"] = True
                log(event="overflow", detail=str(e), t=round(time.time() - t_run, 3))
                break
            stats["turns"] += 1
            stats["prompt_tokens"] += turn.usage.get("prompt", 0)
            stats["completion_tokens"] += turn.usage.get("completion", 0)
            if turn.entropy is not None:
                entropies.append(turn.entropy)
            log(role="assistant", content=turn.content, usage=turn.usage, entropy=turn.entropy,
                wall_s=round(time.time() - t0, 4), t=round(time.time() - t_run, 3))
            messages.append({"role": "assistant", "content": turn.content})
            calls = turn.tool_calls or parse_tool_calls(turn.content, known)
            calls = [c for c in calls if c.get("name")]
            if not calls or calls[0].get("error"):
                stats["invalid_calls"] += 1
                obs = ("Error: " + calls[0]["error"]) if calls else "Error: no tool call found."
                obs += " " + NUDGE
            else:
                c = calls[0]
                name, args = c["name"], c.get("arguments") or {}
                stats["tool_calls"] += 1
                if name == "write_note":
                    notes.append(str(args.get("note", "")))
                    obs = "Note saved."
                elif name == "check_notes":
                    obs = "Notes:\n" + ("\n".join(f"{i + 1}. {n}" for i, n in enumerate(notes)) or "(none)")
                elif name == "python_execute":
                    obs = _python(str(args.get("code", "")))
                else:
                    if name == "commit_final_result" and not env.may_commit():
                        stats["early_commit_attempts"] += 1
                    obs = env.call(name, args)
                if len(calls) > 1:
                    stats["ignored_calls"] += len(calls) - 1
                    obs += f" (Only the first tool call ran; {len(calls) - 1} more were ignored.)"
                log(role="tool", name=name, arguments=args, content=obs, t=round(time.time() - t_run, 3))
            messages.append({"role": "user", "content": "Observation: " + obs})
    (out_dir / "notes.txt").write_text("\n".join(notes) + ("\n" if notes else ""))
    (out_dir / "commit.txt").write_text(env.committed or "")
    (out_dir / "env_truth.json").write_text(json.dumps(env.truth(), indent=2))
    result = score_commit(env, env.committed, judge)
    slope = None
    if len(entropies) >= 2:
        xs = list(range(len(entropies)))
        mx, my = sum(xs) / len(xs), sum(entropies) / len(entropies)
        den = sum((x - mx) ** 2 for x in xs)
        slope = sum((x - mx) * (y - my) for x, y in zip(xs, entropies)) / den if den else None
    ev = {"judge_input": env.committed, "judge": judge_name(judge), "report": report,
          "protocol": "free report" if report == "free" else MENU_LABEL,
          "judge_result": result, "committed": env.committed is not None, "tool_calls": stats["tool_calls"],
          "env_actions": env.used, "token_statistics": {"prompt": stats["prompt_tokens"],
                                                        "completion": stats["completion_tokens"]},
          "stats": stats, "entropy_slope": slope, "env": env_name, "difficulty": difficulty, "steps": steps,
          "seed": seed, "policy": policy, "window": window, "free": free, "model": getattr(agent, "uri", ""),
          "wall_s": round(time.time() - t_run, 3)}
    (out_dir / "eval_output.json").write_text(json.dumps(ev, indent=2))
    return ev


def mean_ci(xs: list[float]) -> dict:
    """Mean, sd and a normal-approximation 95 % CI (t for small n would be wider; n is reported)."""
    xs = [x for x in xs if x is not None]
    n = len(xs)
    if not n:
        return {"n": 0, "mean": None, "sd": None, "lo": None, "hi": None}
    m = sum(xs) / n
    sd = math.sqrt(sum((x - m) ** 2 for x in xs) / (n - 1)) if n > 1 else 0.0
    h = 1.96 * sd / math.sqrt(n) if n > 1 else 0.0
    return {"n": n, "mean": m, "sd": sd, "lo": m - h, "hi": m + h}


def score_runs(evals: list[dict]) -> dict:
    """Aggregate eval_output records: score / tool calls / tokens (mean ± CI), commit and overflow rates,
    per-criterion mean points; null judge scores are excluded and counted."""
    scores = [e["judge_result"].get("final_score") for e in evals]
    crit: dict[str, list[float]] = {}
    for e in evals:
        for row in e["judge_result"].get("score_breakdown", []):
            crit.setdefault(row["criterion"], []).append(row["awarded_score"])
    return {"runs": len(evals), "score": mean_ci(scores), "null_scores": sum(1 for s in scores if s is None),
            "tool_calls": mean_ci([e["tool_calls"] for e in evals]),
            "prompt_tokens": mean_ci([e["token_statistics"]["prompt"] for e in evals]),
            "completion_tokens": mean_ci([e["token_statistics"]["completion"] for e in evals]),
            "commit_rate": sum(e["committed"] for e in evals) / len(evals) if evals else None,
            "overflow_rate": sum(e["stats"]["overflow"] for e in evals) / len(evals) if evals else None,
            "refreshes": mean_ci([e["stats"]["refreshes"] for e in evals]),
            "early_commit_attempts": mean_ci([e["stats"]["early_commit_attempts"] for e in evals]),
            "per_criterion": {k: sum(v) / len(v) for k, v in crit.items()}}

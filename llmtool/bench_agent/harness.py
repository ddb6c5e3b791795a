"""Episode loop and resumable runs for the PIPE suite.

One episode: the system turn is the environment's instructions plus the action list, both through the
rewriter (display side); each agent reply is parsed with the native text protocol, translated back
(alias → original, strict-mode refusal, dual counting at translation time) and forwarded; an
unparseable reply is an invalid call answered by an error observation, never a crash. Per-episode
records follow pipe-interface.md §2 (plus ``wall_s`` and ``entropy``).

Runs append one JSON line per finished episode to an ``episodes.jsonl`` (flushed after each line), so
an interrupted run resumes and skips finished item ids (a line cut by the interruption is redone);
:func:`run_tasks` does the loop, the CLI wraps it so that OUT itself appears atomically at the end.
``history`` [R] bounds the turns shown to the agent (``None`` = full conversation; ``k`` = system turn
plus the last k exchanges and the current observation) — small local models need short prompts.
"""
from __future__ import annotations

import json
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from llmtool.bench_agent.envs import Env, make_env
from llmtool.bench_agent.metrics import summarize
from llmtool.bench_agent.rewrite import RewriteSpec, Rewriter
from llmtool.bench_agent.toolparse import extract_action
from llmtool.core.console import UsageError


@dataclass
class EpisodeCtx:
    env: Env
    rewriter: Rewriter

    def tool_schemas(self) -> list[dict]:
        """``tools`` protocol: one function per (listed) name with a single string argument."""
        out = []
        for a in self.env.IDENTIFIERS:
            for name in self.rewriter.names(a):
                out.append({"type": "function", "function": {
                    "name": name, "description": self.rewriter.text(self.env.DOCS.get(a, "")),
                    "parameters": {"type": "object", "properties": {"argument": {"type": "string"}},
                                   "required": []}}})
        return out


def system_prompt(env: Env, rw: Rewriter) -> str:
    return rw.text(env.instructions()) + "\n" + rw.action_list(env.DOCS)


def window(messages: list[dict], history: int | None) -> list[dict]:
    if history is None:
        return messages
    keep = 1 + 2 * history + 1         # system, k (assistant, user) pairs, ... current user turn
    if len(messages) <= keep + 1:
        return messages
    return [messages[0]] + messages[-(2 * history + 1):]


class Episode:
    """One episode as a state machine, so several can advance in lockstep (batched generation)."""

    def __init__(self, env: Env, mode: str, item_id, seed: int, max_rounds: int, strict: bool = True,
                 history: int | None = None, spec: RewriteSpec | None = None):
        self.env, self.max_rounds, self.history = env, max_rounds, history
        self.rw = Rewriter(spec or RewriteSpec.for_env(env), mode, strict)
        self.names = {n for a in env.IDENTIFIERS for n in self.rw.names(a)} | set(env.IDENTIFIERS)
        obs = env.reset(seed)
        self.ctx = EpisodeCtx(env, self.rw)
        self.messages = [{"role": "system", "content": system_prompt(env, self.rw)},
                         {"role": "user", "content": self.rw.text(obs)}]
        self.rec = {"item_id": item_id, "env": env.name, "rewrite": mode,
                    "order": mode[5:] if mode.startswith("dual") else None, "reward": 0.0, "success": False,
                    "orig_calls": 0, "alias_calls": 0, "deprecated_calls": 0, "invalid_calls": 0, "rounds": 0,
                    "unparsed_calls": 0, "usage": {"prompt": 0, "completion": 0}, "entropy": [],
                    "seed": seed}
        self.done = False
        self.t0 = time.time()

    def view(self) -> list[dict]:
        return window(self.messages, self.history)

    def feed(self, turn) -> None:
        rec, rw = self.rec, self.rw
        rec["rounds"] += 1
        rec["usage"]["prompt"] += turn.usage.get("prompt", 0)
        rec["usage"]["completion"] += turn.usage.get("completion", 0)
        if turn.entropy is not None:
            rec["entropy"].append(round(turn.entropy, 4))
        self.messages.append({"role": "assistant", "content": turn.content})
        action, fmt = extract_action(turn.content, self.names, turn.tool_calls)
        tr = rw.translate(action)
        if action is None:
            rec["unparsed_calls"] += 1      # a format failure, reported apart from interface failures
        if tr.kind in ("invalid", "deprecated"):
            rec[f"{tr.kind}_calls"] += 1
            self.messages.append({"role": "user", "content": tr.message})
        else:
            rec["orig_calls" if tr.kind == "orig" else "alias_calls"] += 1
            try:
                res = self.env.step(tr.ident, tr.arg)
                self.messages.append({"role": "user", "content": rw.text(res.observation)})
                rec["reward"] += res.reward
                self.done = res.done
            except Exception as e:  # a backend exception becomes an error observation
                self.messages.append({"role": "user", "content": f"Error: {type(e).__name__}: {e}"})
        if rec["rounds"] >= self.max_rounds:
            self.done = True

    def record(self) -> dict:
        self.rec["success"] = self.rec["reward"] >= 1.0
        self.rec["wall_s"] = round(time.time() - self.t0, 4)
        self.rec["conversation"] = self.messages
        return self.rec


def run_episode(env: Env, agent, mode: str, item_id, seed: int, max_rounds: int, strict: bool = True,
                history: int | None = None, spec: RewriteSpec | None = None) -> dict:
    from llmtool.bench_agent.agents import ContextOverflow

    ep = Episode(env, mode, item_id, seed, max_rounds, strict, history, spec)
    agent.reset()
    while not ep.done:
        try:
            turn = agent.act(ep.view(), ep.ctx)
        except ContextOverflow as e:      # the conversation outgrew the model's window: a failed episode
            ep.rec["overflow"] = str(e)
            break
        ep.feed(turn)
    return ep.record()


def run_batched(episodes: list[Episode], agent) -> list[dict]:
    """Advance episodes in lockstep with one batched generation call per round (``agent.act_batch``)."""
    live = list(episodes)
    while live:
        turns = agent.act_batch([e.view() for e in live])
        for e, t in zip(live, turns):
            e.feed(t)
        live = [e for e in live if not e.done]
    return [e.record() for e in episodes]


def load_tasks(path: Path | None, n_tasks: int, seed: int) -> list[dict]:
    """Task list: ``path`` (JSONL with ``item_id`` and optional integer ``seed``; a malformed line is a
    one-line error naming it) or ``n_tasks`` generated ids with seeds derived from ``seed``."""
    if path is None:
        return [{"item_id": i, "seed": seed * 100003 + i} for i in range(n_tasks)]
    from llmtool.core.data import read_jsonl

    rows = read_jsonl(path, required=("item_id",))
    seen = set()
    for i, r in enumerate(rows, 1):
        s = r.get("seed", r["item_id"])
        if not isinstance(s, int) or isinstance(s, bool):
            raise UsageError(f"{path}:{i}: field 'seed' must be an integer (got {s!r})")
        if str(r["item_id"]) in seen:
            raise UsageError(f"{path}:{i}: duplicate item_id {r['item_id']!r}")
        seen.add(str(r["item_id"]))
        r["seed"] = s
    return rows


def checked_spec(env_name: str, mode: str, strict: bool = True, env_options: dict | None = None,
                 spec_file: Path | None = None) -> RewriteSpec:
    """The env's rewrite spec (or the one in ``spec_file``), validated against sampled task texts and
    refused with a one-line error when it is not injective / collision-free / round-trip exact."""
    probe = make_env(env_name, **(env_options or {}))
    spec = RewriteSpec.from_file(spec_file, probe) if spec_file else RewriteSpec.for_env(probe)
    spec.check(probe.sample_texts(8))
    Rewriter(spec, mode, strict)          # validates the mode for this env
    return spec


def read_done(path: Path) -> dict:
    """Finished episodes of an interrupted run (a cut last line is dropped and redone)."""
    done: dict = {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
                done[str(r["item_id"])] = r
            except (json.JSONDecodeError, KeyError, TypeError):
                continue
        path.write_text("".join(json.dumps(r) + "\n" for r in done.values()))
    return done


def run_tasks(env_name: str, agent, mode: str, tasks: list[dict], episodes_path: Path, *,
              max_rounds: int | None = None, strict: bool = True, history: int | None = None,
              concurrency: int = 1, env_options: dict | None = None, on_episode=None,
              spec: RewriteSpec | None = None) -> dict:
    """Run every task not yet in ``episodes_path`` (appending one line per finished episode) and return
    the summary over all ``tasks``. ``concurrency``: worker threads for thread-safe agents
    (``openai:``, ``script:``); lockstep batched generation for ``hf:``."""
    env_options = env_options or {}
    spec = spec or checked_spec(env_name, mode, strict, env_options)
    max_rounds = max_rounds or make_env(env_name, **env_options).default_rounds
    episodes_path = Path(episodes_path)
    episodes_path.parent.mkdir(parents=True, exist_ok=True)
    done = read_done(episodes_path)
    todo = [t for t in tasks if str(t["item_id"]) not in done]
    lock = threading.Lock()
    t0 = time.time()
    fh = open(episodes_path, "a", encoding="utf-8")

    def keep(rec):
        with lock:
            fh.write(json.dumps(rec) + "\n")
            fh.flush()
            done[str(rec["item_id"])] = rec
            if on_episode:
                on_episode(rec, done)

    def one(task):
        env = make_env(env_name, **env_options)
        keep(run_episode(env, agent, mode, task["item_id"], task["seed"], max_rounds, strict, history, spec))

    try:
        if hasattr(agent, "act_batch") and concurrency > 1:
            for s in range(0, len(todo), concurrency):
                eps = [Episode(make_env(env_name, **env_options), mode, t["item_id"], t["seed"], max_rounds,
                               strict, history, spec) for t in todo[s:s + concurrency]]
                for rec in run_batched(eps, agent):
                    keep(rec)
        elif concurrency > 1 and getattr(agent, "concurrent", False):
            with ThreadPoolExecutor(concurrency) as pool:
                list(pool.map(one, todo))
        else:
            for t in todo:
                one(t)
    finally:
        fh.close()
    seconds = time.time() - t0
    wanted = [done[str(t["item_id"])] for t in tasks]
    fresh = {str(t["item_id"]) for t in todo}
    steps = sum(r["rounds"] for r in wanted if str(r["item_id"]) in fresh)
    new_tokens = sum(r["usage"]["completion"] for r in wanted if str(r["item_id"]) in fresh)
    return {"env": env_name, "rewrite": mode, "strict": strict, "model": getattr(agent, "uri", ""),
            "rewrite_spec_sha": spec.digest(), "max_rounds": max_rounds, "history": history,
            **summarize(wanted), "resumed": len(tasks) - len(todo), "seconds": round(seconds, 3),
            "steps_per_s": round(steps / seconds, 2) if todo and seconds > 0 else None,
            "completion_tokens_per_s": round(new_tokens / seconds, 2) if todo and seconds > 0 else None}


def run(env_name: str, agent, mode: str, tasks: list[dict], out: Path, *, overwrite: bool = False,
        **kw) -> dict:
    """Library helper (benchmarks): :func:`run_tasks` into ``out/episodes.jsonl`` + ``out/summary.json``."""
    import shutil

    out = Path(out)
    if out.exists() and overwrite:
        shutil.rmtree(out)
    summary = run_tasks(env_name, agent, mode, tasks, out / "episodes.jsonl", **kw)
    (out / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary

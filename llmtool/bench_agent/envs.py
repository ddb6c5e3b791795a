"""Compact built-in environments for the PIPE suite (pipe-interface.md §3.5), text protocol.

Every environment speaks the same native format: the agent answers ``Action: <identifier> [argument]``;
its interface identifiers (``IDENTIFIERS``, ordered) are what PIPE renames. Observations carry the state
the agent needs; the backend never sees aliases (the translation layer maps them back).

Reconstructed choices [R]: the environments are our own small stand-ins of the paper's kinds —
``grid-nav`` (Maze/BabyAI-like move verbs), ``sqlite-qa`` (AgentBench DB / AgentGym SQLGym: SQL against an
in-memory SQLite), ``text-coin`` (TextWorldExpress ``coin``: explore rooms, take the coin), and
``os-files`` (AgentBench OS: shell-like file inspection over an in-memory file tree; commands are
interpreted, no process is spawned) and ``os-sandbox`` (AgentBench OS with real execution: the agent's
``run_python`` code runs in :mod:`llmtool.core.sandbox` — a fresh isolated, rlimited, seccomp- and
audit-hooked child per command, over a copy of the task's file tree — so an agent cannot read or
write the host). Task generation is seeded per item (``random.Random(seed)``), so
an item id fully determines a task. Each env has an ``oracle_action()`` used by ``script:oracle`` and to
produce SFT trajectories.
"""
from __future__ import annotations

import random
import sqlite3
from dataclasses import dataclass
from typing import ClassVar

from llmtool.core.registry import Registry

ENVS: Registry = Registry("bench-agent run", "environment")


@dataclass
class StepResult:
    observation: str
    reward: float = 0.0
    done: bool = False


class Env:
    """Base class: ``reset(seed) -> observation``; ``step(identifier, argument) -> StepResult``."""

    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    IDENTIFIERS: ClassVar[tuple[str, ...]] = ()
    DOCS: ClassVar[dict[str, str]] = {}
    SYNONYMS: ClassVar[dict[str, str]] = {}
    OBFUSCATION: ClassVar[dict[str, str]] = {}    # explicit overrides of the z{i} scheme
    DUAL: ClassVar[bool] = True
    INSTRUCTIONS: ClassVar[str] = ""
    default_rounds: ClassVar[int] = 12

    def __init__(self, **options):
        self.options = options

    def reset(self, seed: int) -> str:
        raise NotImplementedError

    def step(self, ident: str, arg: str) -> StepResult:
        raise NotImplementedError

    def oracle_action(self) -> tuple[str, str]:
        raise NotImplementedError

    def sample_texts(self, n: int = 5) -> list[str]:
        """Observations of a few tasks (used to check that aliases never occur in task data)."""
        out = []
        for s in range(n):
            out.append(self.reset(s))
            for _ in range(3):
                ident, arg = self.oracle_action()
                r = self.step(ident, arg)
                out.append(r.observation)
                if r.done:
                    break
        return out


def register(cls):
    ENVS.add(cls.name, cls)
    return cls


# --------------------------------------------------------------------------------------------- grid
@register
class GridNav(Env):
    name = "grid-nav"
    help = "Reach the goal cell on a small grid with four move verbs (Maze/BabyAI kind)."
    IDENTIFIERS = ("move_north", "move_south", "move_east", "move_west")
    DOCS = {"move_north": "y + 1", "move_south": "y - 1", "move_east": "x + 1", "move_west": "x - 1"}
    SYNONYMS = {"move_north": "go_up", "move_south": "go_down", "move_east": "go_right", "move_west": "go_left"}
    INSTRUCTIONS = ("You walk on a {n}x{n} grid (x from 0 to {m} grows eastward, y from 0 to {m} grows "
                    "northward). Reach the goal cell. Reply with exactly one line: Action: <action>.")
    default_rounds = 10
    DIRS = {"move_north": (0, 1), "move_south": (0, -1), "move_east": (1, 0), "move_west": (-1, 0)}

    def __init__(self, size: int = 4, **options):
        super().__init__(**options)
        self.size = int(size)

    def instructions(self) -> str:
        return self.INSTRUCTIONS.format(n=self.size, m=self.size - 1)

    def _obs(self, head: str = "") -> str:
        return (f"{head}Position: ({self.pos[0]}, {self.pos[1]}). Goal: ({self.goal[0]}, {self.goal[1]}). "
                f"Valid actions: {', '.join(self.IDENTIFIERS)}.")

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        cells = [(x, y) for x in range(self.size) for y in range(self.size)]
        self.pos, self.goal = rng.sample(cells, 2)
        return self._obs()

    def step(self, ident: str, arg: str) -> StepResult:
        dx, dy = self.DIRS[ident]
        x, y = self.pos[0] + dx, self.pos[1] + dy
        if not (0 <= x < self.size and 0 <= y < self.size):
            return StepResult(self._obs("You bump into the wall. "))
        self.pos = (x, y)
        if self.pos == self.goal:
            return StepResult(f"You reached the goal at ({x}, {y}).", 1.0, True)
        return StepResult(self._obs())

    def oracle_action(self) -> tuple[str, str]:
        (x, y), (gx, gy) = self.pos, self.goal
        if gx > x:
            return "move_east", ""
        if gx < x:
            return "move_west", ""
        return ("move_north", "") if gy > y else ("move_south", "")


# ---------------------------------------------------------------------------------------------- sql
NAMES = ["Ada", "Ben", "Cleo", "Dan", "Eve", "Finn", "Gus", "Hana", "Ivo", "Jun", "Kai", "Lea", "Mo", "Nia"]
DEPTS = ["sales", "research", "support", "finance"]


@register
class SqliteQA(Env):
    name = "sqlite-qa"
    help = "Answer a question by running SQL against an in-memory SQLite table (AgentBench DB kind)."
    IDENTIFIERS = ("run_sql", "submit_answer")
    DOCS = {"run_sql": "run_sql <one SQL statement> executes it and shows the rows",
            "submit_answer": "submit_answer <value> submits the final answer and ends the task"}
    SYNONYMS = {"run_sql": "execute_query", "submit_answer": "give_reply"}
    INSTRUCTIONS = ("A SQLite table staff(name TEXT, dept TEXT, salary INTEGER) holds the data. Answer the "
                    "question. Reply with exactly one line: Action: <action> <argument>.")
    default_rounds = 6

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.db = sqlite3.connect(":memory:")
        rows = [(n, rng.choice(DEPTS), rng.randrange(30, 120) * 1000) for n in rng.sample(NAMES, 8)]
        self.db.execute("CREATE TABLE staff(name TEXT, dept TEXT, salary INTEGER)")
        self.db.executemany("INSERT INTO staff VALUES (?,?,?)", rows)
        dept = rng.choice(sorted({r[1] for r in rows}))
        kind = rng.randrange(3)
        if kind == 0:
            self.question, self.sql = (f"How many people work in {dept}?",
                                       f"SELECT COUNT(*) FROM staff WHERE dept = '{dept}'")
        elif kind == 1:
            self.question, self.sql = (f"What is the total salary paid in {dept}?",
                                       f"SELECT SUM(salary) FROM staff WHERE dept = '{dept}'")
        else:
            self.question, self.sql = (f"Who has the highest salary in {dept}?",
                                       f"SELECT name FROM staff WHERE dept = '{dept}' ORDER BY salary DESC LIMIT 1")
        self.truth = str(self.db.execute(self.sql).fetchone()[0])
        self.queried = False
        return f"Question: {self.question}"

    def step(self, ident: str, arg: str) -> StepResult:
        if ident == "run_sql":
            try:
                rows = self.db.execute(arg.strip().strip("`").strip()).fetchmany(20)
            except sqlite3.Error as e:
                return StepResult(f"SQL error: {e}")
            self.queried = True
            return StepResult("Rows: " + "; ".join(", ".join(map(str, r)) for r in rows) if rows else "Rows: (none)")
        ok = arg.strip().strip("'\"").lower() == self.truth.lower()
        return StepResult("Correct." if ok else "Wrong answer.", float(ok), True)

    def oracle_action(self) -> tuple[str, str]:
        return ("submit_answer", self.truth) if self.queried else ("run_sql", self.sql)


# -------------------------------------------------------------------------------------------- text
ROOMS = ["kitchen", "hallway", "garden", "pantry", "cellar", "study", "attic", "porch"]
OPPOSITE = {"north": "south", "south": "north", "east": "west", "west": "east"}


@register
class TextCoin(Env):
    name = "text-coin"
    help = "Explore connected rooms and pick up the coin (TextWorldExpress coin kind)."
    IDENTIFIERS = ("walk", "pick_up", "look_around")
    DOCS = {"walk": "walk <direction> moves through an exit", "pick_up": "pick_up <item> takes an item here",
            "look_around": "look_around describes the room again"}
    SYNONYMS = {"walk": "stroll", "pick_up": "grab", "look_around": "survey"}
    INSTRUCTIONS = ("You are in a house. Find the coin and take it. Reply with exactly one line: "
                    "Action: <action> [argument].")
    default_rounds = 16

    def __init__(self, rooms: int = 5, **options):
        super().__init__(**options)
        self.n_rooms = int(rooms)

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        names = rng.sample(ROOMS, self.n_rooms)
        self.exits = {r: {} for r in names}
        for i in range(1, len(names)):            # random tree: attach room i to an earlier room
            while True:
                j = rng.randrange(i)
                free = [d for d in OPPOSITE if d not in self.exits[names[j]]]
                if free:
                    d = rng.choice(free)
                    self.exits[names[j]][d] = names[i]
                    self.exits[names[i]][OPPOSITE[d]] = names[j]
                    break
        self.room = names[0]
        self.coin = rng.choice(names[1:])
        return self._describe()

    def _describe(self) -> str:
        ex = ", ".join(f"{d} ({r})" for d, r in sorted(self.exits[self.room].items()))
        item = " There is a coin here." if self.room == self.coin else ""
        return f"You are in the {self.room}.{item} Exits: {ex}. Valid actions: {', '.join(self.IDENTIFIERS)}."

    def step(self, ident: str, arg: str) -> StepResult:
        arg = arg.strip().lower()
        if ident == "look_around":
            return StepResult(self._describe())
        if ident == "walk":
            if arg not in self.exits[self.room]:
                return StepResult(f"There is no exit '{arg}'. " + self._describe())
            self.room = self.exits[self.room][arg]
            return StepResult(self._describe())
        if arg == "coin" and self.room == self.coin:
            return StepResult("You take the coin.", 1.0, True)
        return StepResult(f"There is no {arg or 'item'} here.")

    def oracle_action(self) -> tuple[str, str]:
        if self.room == self.coin:
            return "pick_up", "coin"
        prev, queue = {self.room: None}, [self.room]
        while queue:                              # BFS over the (known to the oracle) map
            r = queue.pop(0)
            for d, nxt in sorted(self.exits[r].items()):
                if nxt not in prev:
                    prev[nxt] = (r, d)
                    queue.append(nxt)
        r = self.coin
        while prev[r][0] != self.room:
            r = prev[r][0]
        return "walk", prev[r][1]


# ---------------------------------------------------------------------------------------------- os
@register
class OsFiles(Env):
    name = "os-files"
    help = "Inspect a small file tree with shell-like commands and report a count (AgentBench OS kind)."
    IDENTIFIERS = ("list_dir", "read_file", "final_answer")
    DOCS = {"list_dir": "list_dir <path> lists a directory", "read_file": "read_file <path> prints a file",
            "final_answer": "final_answer <value> submits the answer and ends the task"}
    SYNONYMS = {"list_dir": "show_folder", "read_file": "print_file", "final_answer": "done_reply"}
    INSTRUCTIONS = ("A file tree is mounted at /data. Answer the question. Reply with exactly one line: "
                    "Action: <action> <argument>.")
    default_rounds = 8
    WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.files = {}
        for d in rng.sample(["logs", "notes", "tmp"], 2):
            for k in range(rng.randrange(2, 4)):
                words = [rng.choice(self.WORDS) for _ in range(rng.randrange(3, 7))]
                self.files[f"/data/{d}/f{k}.txt"] = " ".join(words)
        self.target = rng.choice(sorted(self.files))
        self.word = rng.choice(self.WORDS)
        self.truth = str(self.files[self.target].split().count(self.word))
        self.read = False
        return f"Question: how many times does the word '{self.word}' occur in {self.target}?"

    def step(self, ident: str, arg: str) -> StepResult:
        path = arg.strip().rstrip("/")
        if ident == "list_dir":
            kids = sorted({p[len(path) + 1:].split("/")[0] for p in self.files if p.startswith(path + "/")})
            return StepResult(" ".join(kids) if kids else f"No such directory: {path}")
        if ident == "read_file":
            if path not in self.files:
                return StepResult(f"No such file: {path}")
            self.read = path == self.target or self.read
            return StepResult(self.files[path])
        ok = arg.strip().strip("'\"") == self.truth
        return StepResult("Correct." if ok else "Wrong answer.", float(ok), True)

    def oracle_action(self) -> tuple[str, str]:
        return ("final_answer", self.truth) if self.read else ("read_file", self.target)


# ------------------------------------------------------------------------------------- os (sandbox)
@register
class OsSandbox(Env):
    name = "os-sandbox"
    help = "Answer a question about a file tree by running Python in the sandbox (AgentBench OS kind)."
    IDENTIFIERS = ("run_python", "submit_answer")
    DOCS = {"run_python": "run_python <one line of Python, statements joined by ;> runs it in the task "
                          "directory (files under data/) and shows stdout/stderr",
            "submit_answer": "submit_answer <value> submits the final answer and ends the task"}
    SYNONYMS = {"run_python": "exec_code", "submit_answer": "give_reply"}
    INSTRUCTIONS = ("A file tree lies under the relative directory data/. Answer the question by running "
                    "Python. Reply with exactly one line: Action: <action> <argument>.")
    default_rounds = 6
    WORDS = ["alpha", "beta", "gamma", "delta", "omega", "sigma"]

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def reset(self, seed: int) -> str:
        rng = random.Random(seed)
        self.files = {}
        for d in rng.sample(["logs", "notes", "tmp", "src"], 3):
            for k in range(rng.randrange(2, 5)):
                lines = [" ".join(rng.choice(self.WORDS) for _ in range(rng.randrange(2, 6)))
                         for _ in range(rng.randrange(1, 5))]
                self.files[f"data/{d}/f{k}.txt"] = "\n".join(lines) + "\n"
        self.word = rng.choice(self.WORDS)
        kind = rng.randrange(3)
        if kind == 0:
            self.question = f"How many files under data/ contain the word '{self.word}'?"
            self.truth = str(sum(1 for t in self.files.values() if self.word in t.split()))
            self.code = (f"import os;print(sum(1 for r,_,fs in os.walk('data') for f in fs "
                         f"if '{self.word}' in open(os.path.join(r,f)).read().split()))")
        elif kind == 1:
            self.question = "How many lines do the files under data/ have in total?"
            self.truth = str(sum(t.count("\n") for t in self.files.values()))
            self.code = ("import os;print(sum(open(os.path.join(r,f)).read().count(chr(10)) "
                         "for r,_,fs in os.walk('data') for f in fs))")
        else:
            self.question = f"How many times does the word '{self.word}' occur in all files under data/?"
            self.truth = str(sum(t.split().count(self.word) for t in self.files.values()))
            self.code = (f"import os;print(sum(open(os.path.join(r,f)).read().split().count('{self.word}') "
                         f"for r,_,fs in os.walk('data') for f in fs))")
        self.last_stdout = None
        return f"Question: {self.question}"

    def step(self, ident: str, arg: str) -> StepResult:
        if ident == "run_python":
            from llmtool.core.sandbox import SandboxLimits, run_python

            code = arg.strip().strip("`").strip()
            if not code:
                return StepResult("Error: no code given.")
            res = run_python(code, files=dict(self.files),
                             limits=SandboxLimits(cpu_seconds=5, wall_seconds=10, memory_mb=512,
                                                  output_bytes=20_000))
            self.last_stdout = res.stdout
            tail = res.stderr.strip().splitlines()[-1] if res.stderr.strip() else ""
            obs = f"Exit code {res.returncode}. Stdout: {res.stdout.strip()[:500] or '(empty)'}"
            if res.returncode != 0 or res.violation:
                obs += f" Stderr: {tail[:300]}"
            return StepResult(obs)
        ok = arg.strip().strip("'\"") == self.truth
        return StepResult("Correct." if ok else "Wrong answer.", float(ok), True)

    def oracle_action(self) -> tuple[str, str]:
        if self.last_stdout is None:
            return "run_python", self.code
        return "submit_answer", self.last_stdout.strip()   # the answer the sandboxed code printed

    def sample_texts(self, n: int = 5) -> list[str]:
        return [self.reset(s) + " " + " ".join(self.files.values()) for s in range(n)]


def make_env(name: str, **options) -> Env:
    return ENVS.get(name)(**options)


# the real games (TextWorldExpress, ScienceWorld) register here; their packages are imported on first use
from llmtool.bench_agent import envs_external  # noqa: E402,F401

BUILTIN = ("grid-nav", "sqlite-qa", "text-coin", "os-files", "os-sandbox")
EXTERNAL = tuple(n for n in ENVS.names() if n not in BUILTIN)

"""UltraHorizon (ultrahorizon.md): three hidden-rule discovery environments, the rule-based judge,
an LLM-judge option, and tool schemas generated from method signatures.

Each environment exposes methods tagged with :func:`tool`; :meth:`UHEnv.schemas` turns their
signatures into OpenAI tool schemas. ``R`` (``steps``) counts environment-consuming actions
(grid ``move``, seq ``input_sequences``, bio ``conduct_cross``): ``commit_final_result`` is refused
until R is reached (not in ``free`` mode; in grid also allowed once all 20 resets are used), further
consuming actions are refused after R, and only one commit is accepted. All randomness comes from a
per-environment ``random.Random(seed)``; the ground truth is :meth:`UHEnv.truth` (``env_truth.json``,
never shown to the agent).

Report protocols (issue 42): ``report="free"`` (the default, the paper's protocol) never names a rule:
the prompt asks for a written report in the agent's own words and an LLM judge scores it against the
ground truth (its text descriptions included). ``report="menu"`` is the **easier variant (closed
menu)**: the prompt lists every candidate rule ID (grid, seq) or the report keys (bio), so open
discovery becomes multiple choice, and the deterministic rule judge scores the JSON commit.
:data:`MENU_TERMS` holds every string the menu prompt adds; a test checks that no free-mode prompt
carries one.

Rule judge [R] (menu only): the commit is a JSON object (free text around it is ignored) —
grid ``{"A": "step_count", ...}`` (or ``{"A": {"rule": ...}}``), seq ``{"rule_1": "interleave_parity",
...}``, bio ``{"ploidy": 3, "gametes": ["1n", "2n"], ...}`` (see :data:`BIO_RUBRIC`) — each criterion
scored against the truth with the rubric weights of the spec (20 per grid letter / seq rule; bio
15/5/5/5/10/20/5/5/10/20). Reconstructed [R]: a grid move off the board or after the round ended is
refused without consuming a step; the grid score is per round (reset to 0 by ``reset``); the easy seq
rule 2 shows per-position sums as dash-separated numbers.
"""
from __future__ import annotations

import inspect
import json
import math
import random
import re
import typing
from typing import ClassVar

from llmtool.core.registry import Registry

UH_ENVS: Registry = Registry("bench-agent uh-run", "environment")
LETTERS = "ABCDE"
REPORTS = ("free", "menu")
MENU_LABEL = "easier variant (closed menu)"


def tool(fn):
    """Mark a method as an agent tool (its signature becomes the tool's JSON schema)."""
    fn._uh_tool = True
    return fn


class Refused(Exception):
    """An action the rules refuse (answered as an error observation, state unchanged)."""


_JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean"}


def schema_of(name: str, fn) -> dict:
    """OpenAI function schema from a method signature (typed parameters, required list)."""
    hints = typing.get_type_hints(fn)
    props, required = {}, []
    for p in inspect.signature(fn).parameters.values():
        if p.name == "self":
            continue
        tp = hints.get(p.name, str)
        if typing.get_origin(tp) is list:
            item = (typing.get_args(tp) or (str,))[0]
            props[p.name] = {"type": "array", "items": {"type": _JSON_TYPES.get(item, "string")}}
        else:
            props[p.name] = {"type": _JSON_TYPES.get(tp, "string")}
        if p.default is inspect.Parameter.empty:
            required.append(p.name)
    doc = (inspect.getdoc(fn) or "").split("\n")[0]
    return {"type": "function", "function": {"name": name, "description": doc,
                                             "parameters": {"type": "object", "properties": props,
                                                            "required": required}}}


class UHEnv:
    name: ClassVar[str] = ""
    help: ClassVar[str] = ""
    step_factor: ClassVar[int] = 4          # agent step cap = step_factor * R
    consuming: ClassVar[tuple[str, ...]] = ()

    def __init__(self, difficulty: str = "hard", steps: int = 50, seed: int = 0, free: bool = False,
                 report: str = "free"):
        if difficulty not in ("easy", "medium", "hard"):
            raise ValueError(f"difficulty {difficulty!r}: easy, medium or hard")
        if report not in REPORTS:
            raise ValueError(f"report {report!r}: free or menu")
        self.report = report
        self.difficulty, self.R, self.seed, self.free = difficulty, int(steps), int(seed), bool(free)
        self.rng = random.Random(seed)
        self.used = 0
        self.committed: str | None = None

    # ---- tools and gating
    def tool_names(self) -> list[str]:
        return [n for n, _ in inspect.getmembers(type(self), inspect.isfunction) if getattr(_, "_uh_tool", False)]

    def schemas(self) -> list[dict]:
        return [schema_of(n, getattr(type(self), n)) for n in self.tool_names()]

    def call(self, name: str, args: dict) -> str:
        """Run one tool call; a refused or malformed call becomes an error observation."""
        if name not in self.tool_names():
            return f"Error: unknown tool {name!r}; tools: {', '.join(self.tool_names())}"
        fn = getattr(self, name)
        try:
            sig = inspect.signature(fn)
            bound = sig.bind(**args)
        except TypeError as e:
            return f"Error: bad arguments for {name}: {e}"
        hints = typing.get_type_hints(getattr(type(self), name))
        for k, v in list(bound.arguments.items()):
            tp = hints.get(k)
            try:
                if tp is int and not isinstance(v, int):
                    bound.arguments[k] = int(v)
                elif typing.get_origin(tp) is list:
                    if isinstance(v, str):
                        v = [x for x in re.split(r"[,\s]+", v.strip("[] ")) if x]
                    bound.arguments[k] = [int(x) for x in v]
                elif tp is str and not isinstance(v, str):
                    bound.arguments[k] = json.dumps(v) if isinstance(v, (dict, list)) else str(v)
            except (TypeError, ValueError):
                return f"Error: argument {k!r} of {name} has the wrong type ({v!r})"
        try:
            out = fn(*bound.args, **bound.kwargs)
        except Refused as e:
            return f"Refused: {e}"
        return out if isinstance(out, str) else json.dumps(out)

    def consume(self) -> None:
        if self.committed is not None:
            raise Refused("the final result is already committed")
        if not self.free and self.used >= self.R:
            raise Refused(f"the budget of {self.R} actions is used up; commit your final result")
        self.used += 1

    def may_commit(self) -> bool:
        return self.free or self.used >= self.R

    @tool
    def commit_final_result(self, content: str) -> str:
        """Commit your final report of the hidden rules (one commit only; allowed after the required actions)."""
        if self.committed is not None:
            raise Refused("a final result was already committed")
        if not self.may_commit():
            raise Refused(f"explore more before committing: {self.used} of {self.R} required actions done")
        self.committed = content
        return "Final result committed."

    # ---- to implement
    def prompt(self) -> str:
        raise NotImplementedError

    def truth(self) -> dict:
        raise NotImplementedError

    def describe(self, report: dict) -> str:
        """A structured report written as prose (what a scripted agent commits in ``free`` mode)."""
        raise NotImplementedError

    def commit_text(self, report: dict) -> str:
        """The commit a scripted agent sends for ``report``: JSON (menu) or prose (free)."""
        return json.dumps(report) if self.report == "menu" else self.describe(report)

    def oracle_report(self) -> dict:
        raise NotImplementedError

    def oracle_action(self) -> tuple[str, dict]:
        """A valid environment-consuming action (scripted explorer)."""
        raise NotImplementedError

    def random_report(self, rng: random.Random) -> dict:
        raise NotImplementedError

    def judge(self, report: dict) -> dict:
        raise NotImplementedError


def register(cls):
    UH_ENVS.add(cls.name, cls)
    return cls


def parse_report(text: str | None) -> dict | None:
    """The JSON object of a commit (code fences and surrounding text ignored)."""
    if not text:
        return None
    text = re.sub(r"(?s)<think>.*?</think>", "", text)
    dec = json.JSONDecoder()
    for m in re.finditer(r"\{", text):
        try:
            obj, _ = dec.raw_decode(text[m.start():])
        except json.JSONDecodeError:
            continue
        if isinstance(obj, dict):
            return obj
    return None


def _breakdown(items: list[tuple[str, float, bool, str]]) -> dict:
    rows = [{"criterion": c, "max_score": m, "awarded_score": m if ok else 0, "comment": note}
            for c, m, ok, note in items]
    return {"final_score": sum(r["awarded_score"] for r in rows), "score_breakdown": rows}


# ============================================================================================ grid
GRID_EFFECTS = {
    "easy": {"A": "plus_score", "B": "plus_energy", "C": "parity", "D": "minus_score", "E": "energy_threshold"},
    "medium": {"A": "parity", "B": "energy_threshold", "C": "step_count", "D": "edge_corner", "E": "visit_parity"},
    "hard": {"A": "step_count", "B": "edge_corner", "C": "visit_parity", "D": "energy_management", "E": "coordinate"},
}
GRID_TEXT = {
    "step_count": "+2 score when the round's move count is a multiple of 3, else -1",
    "edge_corner": "+3 score when x or y is in {0,1,8,9}; the four corner cells add another +3 (+6 total)",
    "visit_parity": "+1 score on an odd-numbered entry onto this letter in the round, 0 on an even one",
    "energy_management": "energy below 10: -2 score and +10 energy; otherwise +1 score",
    "coordinate": "score changes by x - y",
    "parity": "+1 score when x + y is odd, else -1",
    "energy_threshold": "+2 score when energy >= 15, else -2",
    "plus_score": "+1 score", "plus_energy": "+1 energy", "minus_score": "-1 score",
}
DIRS = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}


@register
class MysteryGrid(UHEnv):
    name = "grid"
    help = "Mystery Grid: hidden effects of the letters A-E on a 10x10 board."
    consuming = ("move",)
    SIZE, ENERGY, MOVES, RESETS = 10, 20, 30, 20

    def __init__(self, **kw):
        super().__init__(**kw)
        self.effects = GRID_EFFECTS[self.difficulty]
        self.resets_left = self.RESETS
        self._new_round()

    def _new_round(self) -> None:
        self.board = [[self.rng.choice(LETTERS) for _ in range(self.SIZE)] for _ in range(self.SIZE)]  # [y][x]
        self.pos = (self.rng.randrange(self.SIZE), self.rng.randrange(self.SIZE))
        self.energy, self.score, self.steps = self.ENERGY, 0, 0
        self.entries = {c: 0 for c in LETTERS}
        self.over = False

    def apply_effect(self, letter: str) -> None:
        """The hidden effect of ``letter`` at the current position (after the move's step/energy update)."""
        x, y = self.pos
        e = self.effects[letter]
        self.entries[letter] += 1
        if e == "step_count":
            self.score += 2 if self.steps % 3 == 0 else -1
        elif e == "edge_corner":
            edge = {0, 1, self.SIZE - 2, self.SIZE - 1}
            if x in edge or y in edge:
                self.score += 3
            if x in (0, self.SIZE - 1) and y in (0, self.SIZE - 1):
                self.score += 3
        elif e == "visit_parity":
            self.score += 1 if self.entries[letter] % 2 == 1 else 0
        elif e == "energy_management":
            if self.energy < 10:
                self.score -= 2
                self.energy += 10
            else:
                self.score += 1
        elif e == "coordinate":
            self.score += x - y
        elif e == "parity":
            self.score += 1 if (x + y) % 2 == 1 else -1
        elif e == "energy_threshold":
            self.score += 2 if self.energy >= 15 else -2
        elif e == "plus_score":
            self.score += 1
        elif e == "plus_energy":
            self.energy += 1
        elif e == "minus_score":
            self.score -= 1

    def prompt(self) -> str:
        return ("You explore a 10x10 grid (x = column, y = row, origin bottom-left). Each cell holds a letter "
                "A-E or X. A round starts at a random cell with energy 20 and allows at most 30 moves; each move "
                "costs 1 energy. Entering a lettered cell triggers that letter's hidden, fixed effect on score "
                "and/or energy, then the cell becomes X. The round ends at energy <= 0 or after 30 moves; reset "
                f"starts a new random board (at most {self.RESETS} resets). Discover what each letter does "
                "(trigger condition and effect). You must make " + str(self.R) + " moves before you may commit. "
                + ("Commit a JSON object mapping each letter to its rule, one of: " + ", ".join(GRID_TEXT) + "."
                   if self.report == "menu" else
                   "Commit a written report that states, for each letter A-E, when its effect triggers and what it "
                   "does to score and energy."))

    @tool
    def move(self, direction: str) -> dict:
        """Move one cell: direction is up, down, left or right."""
        if direction not in DIRS:
            raise Refused(f"direction {direction!r}: use up, down, left or right")
        if self.over:
            raise Refused("the round is over; call reset")
        dx, dy = DIRS[direction]
        x, y = self.pos[0] + dx, self.pos[1] + dy
        if not (0 <= x < self.SIZE and 0 <= y < self.SIZE):
            raise Refused("that move leaves the board")
        self.consume()
        self.pos = (x, y)
        self.steps += 1
        self.energy -= 1
        ended = self.energy <= 0        # a move that brings energy to 0 ends the round even if restored
        letter = self.board[y][x]
        if letter != "X":
            self.apply_effect(letter)
            self.board[y][x] = "X"
        self.over = ended or self.energy <= 0 or self.steps >= self.MOVES
        return {"position": [x, y], "letter": letter, "energy": self.energy, "score": self.score,
                "steps": self.steps, "game_over": self.over, "resets_left": self.resets_left}

    @tool
    def get_current_state(self) -> dict:
        """Position, energy, score, steps and the cells at offsets -2, 0, +2 around you."""
        x, y = self.pos
        pat = []
        for dy in (2, 0, -2):
            row = []
            for dx in (-2, 0, 2):
                cx, cy = x + dx, y + dy
                row.append(self.board[cy][cx] if 0 <= cx < self.SIZE and 0 <= cy < self.SIZE else "#")
            pat.append("".join(row))
        return {"position": [x, y], "energy": self.energy, "score": self.score, "steps": self.steps,
                "pattern": pat, "game_over": self.over}

    @tool
    def get_full_map(self) -> dict:
        """The whole board, top row (y = 9) first."""
        return {"rows": ["".join(r) for r in reversed(self.board)], "position": list(self.pos)}

    @tool
    def reset(self) -> dict:
        """Start a new round on a new random board."""
        if self.resets_left <= 0:
            raise Refused("no resets left")
        self.resets_left -= 1
        self._new_round()
        return {"position": list(self.pos), "energy": self.energy, "resets_left": self.resets_left}

    def may_commit(self) -> bool:
        return super().may_commit() or self.resets_left == 0

    def truth(self) -> dict:
        return {"env": "grid", "difficulty": self.difficulty, "seed": self.seed,
                "rules": dict(self.effects), "text": {k: GRID_TEXT[v] for k, v in self.effects.items()}}

    def oracle_report(self) -> dict:
        return dict(self.effects)

    def describe(self, report: dict) -> str:
        return describe_report("grid", report)

    def random_report(self, rng) -> dict:
        return {c: rng.choice(sorted(GRID_TEXT)) for c in LETTERS}

    def oracle_action(self) -> tuple[str, dict]:
        if self.over:
            return "reset", {}
        x, y = self.pos
        ok = [d for d, (dx, dy) in DIRS.items() if 0 <= x + dx < self.SIZE and 0 <= y + dy < self.SIZE]
        return "move", {"direction": self.rng.choice(ok)}

    def judge(self, report: dict) -> dict:
        items = []
        for c in LETTERS:
            got = report.get(c)
            if isinstance(got, dict):
                got = got.get("rule")
            ok = isinstance(got, str) and got.strip().lower() == self.effects[c]
            items.append((f"letter {c}", 20, ok, f"truth {self.effects[c]}, reported {got!r}"))
        return _breakdown(items)


# ============================================================================================= seq
def _val(c: str) -> int:
    return ord(c) - 65


def _chr(v: int) -> str:
    return chr(65 + v % 26)


def _is_prime(n: int) -> bool:
    return n >= 2 and all(n % k for k in range(2, int(math.isqrt(n)) + 1))


SEQ_RULES = {"hard": ["interleave_parity", "reverse_shift_concat", "append_nth", "add_prev_main", "prime_most_frequent"],
             "easy": ["interleave", "position_sum", "position_max", "position_max", "sorted_concat"]}
SEQ_RULES["medium"] = SEQ_RULES["hard"]     # [R] the official runner uses hard; medium = hard here
SEQ_TEXT = {   # our wording of each candidate rule (ground truth for the LLM judge; scripted free reports)
    "interleave_parity": "interleave main and vice letter by letter, main first on odd steps and vice first on "
                         "even steps (step n counts inputs from 1)",
    "reverse_shift_concat": "reverse the string and shift every letter by n places (mod 26, n = step number); "
                            "output the shifted reversed string followed by the shifted original",
    "append_nth": "with a = n mod 10 (10 when 0), append the string's a-th letter a times",
    "add_prev_main": "add the previous step's main input letter by letter (A = 0, mod 26) to the first five "
                     "letters; unchanged at step 1",
    "prime_most_frequent": "when the step number is prime, replace every copy of the most frequent letter (ties: "
                           "the first to appear) by the next letter; otherwise unchanged",
    "interleave": "interleave main and vice letter by letter, main first",
    "position_sum": "per position, the sum of the letter values of main and vice (A = 0), dash-separated",
    "position_max": "per position, the later letter of main and vice",
    "sorted_concat": "main and vice concatenated and sorted alphabetically",
}


def seq_hard(main: str, vice: str, n: int, prev_main: str | None) -> list[str]:
    """The five hard-rule intermediate strings for step ``n`` (1-based)."""
    out = []
    a, b = (main, vice) if n % 2 == 1 else (vice, main)
    cur = "".join(x + y for x, y in zip(a, b))
    out.append(cur)
    cur = "".join(_chr(_val(c) + n) for c in cur[::-1]) + "".join(_chr(_val(c) + n) for c in cur)
    out.append(cur)
    k = n % 10 or 10
    if len(cur) >= k:
        cur = cur + cur[k - 1] * k
    out.append(cur)
    if prev_main is not None:
        cur = "".join(_chr(_val(c) + _val(p)) for c, p in zip(cur[:5], prev_main)) + cur[5:]
    out.append(cur)
    if _is_prime(n):
        counts = {c: cur.count(c) for c in cur}
        top = max(counts.values())
        letter = next(c for c in cur if counts[c] == top)
        cur = cur.replace(letter, _chr(_val(letter) + 1))
    out.append(cur)
    return out


def seq_easy(main: str, vice: str) -> list[str]:
    inter = "".join(x + y for x, y in zip(main, vice))
    sums = "-".join(str(_val(x) + _val(y)) for x, y in zip(main, vice))
    mx = "".join(max(x, y) for x, y in zip(main, vice))
    return [inter, sums, mx, mx, "".join(sorted(main + vice))]


@register
class SequenceExploration(UHEnv):
    name = "seq"
    help = "Sequence Exploration: a hidden chain of five string rules."
    consuming = ("input_sequences",)

    def __init__(self, **kw):
        super().__init__(**kw)
        self.n = 0
        self.prev_main: str | None = None

    def prompt(self) -> str:
        return ("Each action inputs two sequences (main, vice) of exactly 5 letters from A-E, each with at least "
                "2 distinct letters. A fixed chain of five hidden rules turns them into an output; you see every "
                f"intermediate string (rule_1..rule_5). Discover the five rules. Make {self.R} inputs before you "
                "may commit. " + ("Commit a JSON object {\"rule_1\": ID, ..., \"rule_5\": ID} with IDs from: "
                                  + ", ".join(sorted(set(SEQ_RULES["hard"] + SEQ_RULES["easy"]))) + "."
                                  if self.report == "menu" else
                                  "Commit a written report that states precisely what each of rule_1 .. rule_5 "
                                  "does."))

    @staticmethod
    def check_input(s) -> str:
        if not isinstance(s, str) or len(s) != 5 or any(c not in LETTERS for c in s) or len(set(s)) < 2:
            raise Refused(f"{s!r}: need exactly 5 letters from A-E with at least 2 distinct letters")
        return s

    @tool
    def input_sequences(self, main: str, vice: str) -> dict:
        """Input a main and a vice sequence (5 letters A-E each, >= 2 distinct) and see each rule's output."""
        main, vice = self.check_input(str(main).strip().upper()), self.check_input(str(vice).strip().upper())
        self.consume()
        self.n += 1
        steps = seq_hard(main, vice, self.n, self.prev_main) if self.difficulty != "easy" else seq_easy(main, vice)
        self.prev_main = main
        return {"step": self.n, **{f"rule_{i + 1}": s for i, s in enumerate(steps)}, "output": steps[-1]}

    def truth(self) -> dict:
        rules = {f"rule_{i + 1}": r for i, r in enumerate(SEQ_RULES[self.difficulty])}
        return {"env": "seq", "difficulty": self.difficulty, "seed": self.seed, "rules": rules,
                "text": {k: SEQ_TEXT[v] for k, v in rules.items()}}

    def describe(self, report: dict) -> str:
        return describe_report("seq", report)

    def oracle_report(self) -> dict:
        return self.truth()["rules"]

    def random_report(self, rng) -> dict:
        ids = sorted(set(SEQ_RULES["hard"] + SEQ_RULES["easy"]))
        return {f"rule_{i + 1}": rng.choice(ids) for i in range(5)}

    def oracle_action(self) -> tuple[str, dict]:
        def word():
            while True:
                w = "".join(self.rng.choice(LETTERS) for _ in range(5))
                if len(set(w)) >= 2:
                    return w
        return "input_sequences", {"main": word(), "vice": word()}

    def judge(self, report: dict) -> dict:
        truth = self.truth()["rules"]
        return _breakdown([(k, 20, isinstance(report.get(k), str) and report[k].strip().lower() == v,
                            f"truth {v}, reported {report.get(k)!r}") for k, v in truth.items()])


# ============================================================================================= bio
SIZE_VAL = {"S1": 200, "S2": 50, "S3": 10}
COLOR = {"C1": ("red", 95), "C2": ("blue", 60), "C3": ("white", 20)}
SHAPE = {"H1": "spiky", "H2": "smooth", "H3": "ridged"}
BEATS = {"H1": "H2", "H2": "H3", "H3": "H1"}      # cyclic dominance H1 > H2 > H3 > H1
FOUNDERS = {1: {"size": ("S1", "S1", "S2"), "color": ("C1",) * 3, "shell": ("H1",) * 3},
            2: {"size": ("S1", "S2", "S2"), "color": ("C2",) * 3, "shell": ("H2",) * 3},
            3: {"size": ("S3",) * 3, "color": ("C3",) * 3, "shell": ("H3",) * 3}}
BIO_RUBRIC = [  # (criterion, report key, max score)
    ("triploidy", "ploidy", 15), ("1n/2n gametes", "gametes", 5), ("only triploid viable", "viability", 5),
    ("size dosage/additivity", "size_mode", 5), ("size alleles", "size_alleles", 10),
    ("size quantitative values", "size_values", 20), ("color dominance hierarchy", "color_order", 5),
    ("complete dominance", "color_dominance", 5), ("shell cyclic dominance", "shell_dominance", 10),
    ("shell lethal combination", "shell_lethal", 20)]


def size_class(v: float) -> str:
    return ("extra_large" if v >= 250 else "large" if v >= 180 else "medium" if v >= 100 else
            "small" if v >= 50 else "tiny")


def phenotype(g: dict, rng: random.Random) -> dict:
    """Genotype → phenotype (noise from ``rng``)."""
    size = sum(SIZE_VAL[a] for a in g["size"]) * (1 + rng.uniform(-0.01, 0.01))
    color = min(g["color"], key=lambda a: int(a[1]))
    types = sorted(set(g["shell"]))
    if len(types) == 1:
        win, frac = types[0], 1.0
    else:                                   # two types (three are lethal): the cyclic winner
        a, b = types
        win = a if BEATS[a] == b else b
        frac = g["shell"].count(win) / 3
    return {"size": round(size, 1), "size_class": size_class(size), "color": COLOR[color][0],
            "color_intensity": COLOR[color][1], "shell": SHAPE[win],
            "shell_hardness": round(100 * frac * (1 + rng.uniform(-0.05, 0.05)), 1)}


def gamete(g: dict, rng: random.Random) -> dict:
    """Meiosis: per gene the three alleles split 1 + 2; the split is linked, so the gamete is haploid
    (one allele per gene) or diploid (two per gene)."""
    diploid = rng.random() < 0.5
    out = {}
    for gene, alleles in g.items():
        idx = rng.randrange(3)
        single = (alleles[idx],)
        pair = tuple(a for i, a in enumerate(alleles) if i != idx)
        out[gene] = pair if diploid else single
    return out


def zygote(g1: dict, g2: dict) -> tuple[dict | None, str]:
    z = {gene: tuple(sorted(g1[gene] + g2[gene])) for gene in g1}
    if any(len(v) != 3 for v in z.values()):
        return None, "ploidy"
    if set(z["shell"]) == {"H1", "H2", "H3"}:
        return None, "shell"
    return z, ""


@register
class AlienGenetics(UHEnv):
    name = "bio"
    help = "Alien Genetics Laboratory: infer a triploid organism's inheritance rules by crossing."
    step_factor = 8
    consuming = ("conduct_cross",)
    CAPACITY = 200

    def __init__(self, **kw):
        super().__init__(**kw)
        self.orgs: dict[int, dict] = {}
        self.next_id = 1
        for i in (1, 2, 3):
            self._add(FOUNDERS[i], 0, None)

    def _add(self, g: dict, generation: int, parents) -> int:
        oid = self.next_id
        self.next_id += 1
        self.orgs[oid] = {"genotype": g, "generation": generation, "parents": parents,
                          "phenotype": phenotype(g, self.rng)}
        return oid

    def prompt(self) -> str:
        return ("You run an alien genetics lab with founder organisms 1, 2 and 3 (capacity "
                f"{self.CAPACITY} organisms). Cross organisms and study offspring phenotypes (body size, color, "
                "shell) to infer the genetic basis, per-trait inheritance and lethal combinations. Genotypes are "
                f"never shown. Make {self.R} crosses before you may commit. "
                + ("Commit a JSON report with keys: " + ", ".join(k for _, k, _ in BIO_RUBRIC) + "."
                   if self.report == "menu" else
                   "Commit a written report with three sections: genetic basis, per-trait inheritance, lethal "
                   "combinations."))

    def _public(self, oid: int) -> dict:
        o = self.orgs[oid]
        p = o["phenotype"]
        return {"id": oid, "phenotype": p, "generation": o["generation"], "parents": o["parents"],
                "description": f"a {p['size_class']} {p['color']} organism with a {p['shell']} shell"}

    @tool
    def conduct_cross(self, parent1_id: int, parent2_id: int, num_offspring: int = 10) -> dict:
        """Cross two organisms and keep num_offspring (1-100) viable offspring."""
        for pid in (parent1_id, parent2_id):
            if pid not in self.orgs:
                raise Refused(f"no organism {pid}")
        if not 1 <= num_offspring <= 100:
            raise Refused("num_offspring must be 1-100")
        if len(self.orgs) + num_offspring > self.CAPACITY:
            raise Refused(f"lab capacity {self.CAPACITY} exceeded ({len(self.orgs)} organisms); remove some")
        self.consume()
        g1, g2 = self.orgs[parent1_id]["genotype"], self.orgs[parent2_id]["genotype"]
        gen = max(self.orgs[parent1_id]["generation"], self.orgs[parent2_id]["generation"]) + 1
        ids, lethal, attempts = [], 0, 0
        while len(ids) < num_offspring and attempts < 200 * num_offspring:
            attempts += 1
            z, why = zygote(gamete(g1, self.rng), gamete(g2, self.rng))
            if z is None:
                lethal += 1
                continue
            ids.append(self._add(z, gen, [parent1_id, parent2_id]))
        return {"offspring": [self._public(i) for i in ids], "lethal": lethal, "attempts": attempts,
                "viability_rate": round(len(ids) / attempts, 3)}

    @tool
    def query_organisms(self, start_id: int, end_id: int) -> dict:
        """Phenotype, generation, parents and description of organisms start_id..end_id (at most 50)."""
        ids = [i for i in range(start_id, min(end_id, start_id + 49) + 1) if i in self.orgs]
        return {"organisms": [self._public(i) for i in ids]}

    @tool
    def remove_organisms(self, ids: list[int]) -> dict:
        """Remove organisms by id to free lab capacity."""
        gone = [i for i in ids if self.orgs.pop(i, None) is not None]
        return {"removed": gone, "count": len(self.orgs)}

    @tool
    def get_lab_status(self) -> dict:
        """Organism count, capacity and crosses done."""
        return {"organisms": len(self.orgs), "capacity": self.CAPACITY, "crosses": self.used,
                "required_crosses": self.R, "ids": sorted(self.orgs)[:200]}

    def truth(self) -> dict:
        rep = self.oracle_report()
        return {"env": "bio", "seed": self.seed, "difficulty": self.difficulty, "report": rep,
                "text": self.describe(rep)}

    def describe(self, report: dict) -> str:
        return describe_report("bio", report)

    def oracle_report(self) -> dict:
        return {"ploidy": 3, "gametes": ["1n", "2n"], "viability": "only_triploid", "size_mode": "additive",
                "size_alleles": ["S1", "S2", "S3"], "size_values": dict(SIZE_VAL),
                "color_order": ["C1", "C2", "C3"], "color_dominance": "complete",
                "shell_dominance": "cyclic", "shell_lethal": ["H1", "H2", "H3"]}

    def random_report(self, rng) -> dict:
        return {"ploidy": rng.choice([2, 3, 4]), "gametes": rng.choice([["1n"], ["1n", "2n"], ["2n"]]),
                "viability": rng.choice(["all", "only_triploid"]), "size_mode": rng.choice(["additive", "dominant"]),
                "size_alleles": ["S1", "S2"], "size_values": {"S1": rng.randrange(300), "S2": rng.randrange(300)},
                "color_order": rng.sample(["C1", "C2", "C3"], 3), "color_dominance": rng.choice(["complete", "incomplete"]),
                "shell_dominance": rng.choice(["cyclic", "linear"]), "shell_lethal": rng.sample(["H1", "H2", "H3"], 2)}

    def oracle_action(self) -> tuple[str, dict]:
        if len(self.orgs) > self.CAPACITY - 20:
            return "remove_organisms", {"ids": sorted(self.orgs)[3:23]}
        ids = sorted(self.orgs)
        return "conduct_cross", {"parent1_id": self.rng.choice(ids), "parent2_id": self.rng.choice(ids),
                                 "num_offspring": 5}

    def judge(self, report: dict) -> dict:
        truth = self.oracle_report()
        items = []
        for crit, key, pts in BIO_RUBRIC:
            got, want = report.get(key), truth[key]
            if key == "size_values":
                ok = isinstance(got, dict) and all(
                    isinstance(got.get(a), (int, float)) and abs(got[a] - v) <= 0.1 * v for a, v in want.items())
            elif key in ("gametes", "size_alleles", "shell_lethal"):
                ok = isinstance(got, list) and sorted(map(str, got)) == sorted(want)
            elif key == "color_order":
                ok = isinstance(got, list) and list(map(str, got)) == want
            elif key == "ploidy":
                ok = got == 3 or got == "3" or (isinstance(got, str) and got.lower() in ("triploid", "3n"))
            else:
                ok = isinstance(got, str) and got.strip().lower() == want
            items.append((crit, pts, ok, f"reported {got!r}"))
        return _breakdown(items)


def describe_report(env_name: str, report: dict) -> str:
    """A structured report (the menu's JSON) written as prose: what a scripted agent commits in ``free``
    mode. Uses only the report and the candidate rules' wording, never an environment's state."""
    if env_name == "grid":
        return "\n".join(f"Letter {c}: " + GRID_TEXT.get(str(report.get(c)), "unknown") for c in LETTERS) + "\n"
    if env_name == "seq":
        return "\n".join(f"rule_{i}: " + SEQ_TEXT.get(str(report.get(f"rule_{i}")), "unknown")
                         for i in range(1, 6)) + "\n"
    r = report          # bio: the spec's three sections (genetic basis, per-trait inheritance, lethal)
    vals = r.get("size_values") or {}
    lethal = r.get("shell_lethal") or []
    return (f"Genetic basis: ploidy {r.get('ploidy')}; gametes {', '.join(map(str, r.get('gametes') or []))}; "
            f"viable zygotes: {r.get('viability')}.\n"
            f"Body size: {r.get('size_mode')} over alleles {', '.join(map(str, r.get('size_alleles') or []))} "
            "with values " + ", ".join(f"{a} = {v}" for a, v in vals.items()) + ".\n"
            f"Color: {r.get('color_dominance')} dominance, order {' > '.join(map(str, r.get('color_order') or []))} "
            "(allele Ck: the color allele founder k carries).\n"
            f"Shell: {r.get('shell_dominance')} dominance (allele Hk: the shell allele founder k carries).\n"
            "Lethal combinations: " + ("shell alleles " + " + ".join(map(str, lethal)) + " together" if lethal
                                       else "none found") + ".\n")


def make_uh_env(name: str, **kw) -> UHEnv:
    return UH_ENVS.get(name)(**kw)


# The strings the menu variant's prompts add: rule IDs, their descriptions, the bio report keys and
# categorical answers. No free-mode prompt (nor tool schema) may contain one.
MENU_TERMS = sorted({*GRID_TEXT, *GRID_TEXT.values(), *SEQ_TEXT, *SEQ_TEXT.values(), *(k for _, k, _ in BIO_RUBRIC),
                     "only_triploid", "triploid", "additive", "cyclic", "1n", "2n"})


# ============================================================================================ judges
def rule_judge(env: UHEnv, commit: str | None) -> dict:
    """The deterministic judge of the menu variant (a JSON commit of rule IDs / report keys)."""
    if commit is None:
        return {"final_score": 0, "score_breakdown": [], "comment": "no commit"}
    rep = parse_report(commit)
    if rep is None:
        return {"final_score": 0, "score_breakdown": [], "comment": "the commit holds no JSON object"}
    return env.judge(rep)


JUDGE_PROMPT = """You grade a report on hidden rules of an environment against the ground truth.
Ground truth (JSON): {truth}
Rubric: {rubric}
Award a criterion's points only when the report states the same trigger condition and effect (equivalent
wording accepted); vague explanations ("random", "complex") or several conflicting explanations get 0.
Report:
<<<
{report}
>>>
Answer with one JSON object: {{"final_score": N, "score_breakdown": [{{"criterion": ..., "max_score": ...,
"awarded_score": ..., "comment": ...}}]}}"""


def llm_judge(env: UHEnv, commit: str | None, endpoint, tries: int = 3) -> dict:
    """LLM judge over an OpenAI-compatible endpoint (temperature 0). Reasoning blocks and code fences
    are stripped; after ``tries`` unparseable answers the score is null (excluded and reported)."""
    if commit is None:
        return {"final_score": 0, "score_breakdown": [], "comment": "no commit"}
    if env.name == "bio":
        rubric = "; ".join(f"{c} ({p})" for c, _, p in BIO_RUBRIC)
    else:
        rubric = "20 points per " + ("letter" if env.name == "grid" else "rule")
    msg = JUDGE_PROMPT.format(truth=json.dumps(env.truth()), rubric=rubric, report=commit)
    raw = ""
    for _ in range(tries):
        raw = endpoint.chat([{"role": "user", "content": msg}], temperature=0.0, max_tokens=2048)[0].get("content") or ""
        got = parse_report(re.sub(r"```(?:json)?", "", raw))
        if got is not None and isinstance(got.get("final_score"), (int, float)):
            return {"final_score": float(got["final_score"]), "score_breakdown": got.get("score_breakdown", [])}
    return {"final_score": None, "score_breakdown": [], "raw_output": raw[:4000]}

"""``script:infer`` — a scripted UltraHorizon explorer that infers the hidden rules from its own
observations (issue 42), unlike ``script:oracle``, which reads the truth.

What it may use: the system prompt (which environment, R, whether the menu protocol asks for JSON), the
observations that come back in the conversation, and the *candidate rule space* — the rules the menu
variant lists (:data:`GRID_RULES`, :data:`SEQ_RULES`, written here from the rules' descriptions, not from
the environments' code) and, for bio, a small family of inheritance hypotheses. It never touches the
environment object (``ctx`` is not read; a test runs it against an environment proxy that raises on
every attribute). Its observations persist in its own state across context refreshes (a program's
perfect notes); the one observation a CRNR refresh drops is lost, and the explorer re-reads the state.

Inference:
- grid: per letter, hypothesis elimination over the 10 candidate effects: each entry onto a letter
  predicts (score change, energy change) from the position, the round's move count, the energy after
  paying for the move and the letter's entry count; inconsistent candidates are dropped. Moves head (BFS
  on the map from ``get_full_map``) for the nearest letter that is still ambiguous. Letters left ambiguous
  at R get a random surviving candidate; a letter never entered gets a random candidate.
- seq: per rule position, elimination over the 9 candidate string rules, each applied to the previous
  intermediate string, the inputs, the step number and the previous main input; random valid inputs.
- bio: designed crosses (1×2, 1×3, 2×3, 3×3, then F1 carriers of two shell types × the third founder)
  and inference: ploidy from the lattice of shell-hardness fractions; gamete types and viability from the
  viable fraction of the founder crosses; additive allele values by enumerating founder genotypes that
  explain every size class of the crosses with the true-breeding founder 3; color order and completeness
  from the F1; shell dominance (cyclic or linear) from the three pairwise winners; the lethal combination
  from a viability drop when all three shell types meet. Alleles are named after the founder that shows
  them (Ck, Hk) and, for size, by decreasing value (the naming the menu's answers use).
"""
from __future__ import annotations

import json
import random
import re
from collections import deque
from itertools import combinations_with_replacement as cwr

from llmtool.bench_agent.agents import Turn
from llmtool.bench_agent.uh import LETTERS, describe_report

DIRS = {"up": (0, 1), "down": (0, -1), "left": (-1, 0), "right": (1, 0)}
EDGE = {0, 1, 8, 9}


# ---------------------------------------------------------------------------------- candidate rule spaces
def _grid_effect(rule: str, x: int, y: int, steps: int, energy: int, k: int | None):
    """(score change, energy change) of ``rule`` for an entry at (x, y) on the round's move ``steps`` with
    ``energy`` after paying for the move and ``k`` = this letter's entries in the round (None: unknown)."""
    if rule == "step_count":
        return (2 if steps % 3 == 0 else -1), 0
    if rule == "edge_corner":
        return (3 if (x in EDGE or y in EDGE) else 0) + (3 if x in (0, 9) and y in (0, 9) else 0), 0
    if rule == "visit_parity":
        return (None if k is None else (1 if k % 2 else 0)), 0
    if rule == "energy_management":
        return (-2, 10) if energy < 10 else (1, 0)
    if rule == "coordinate":
        return x - y, 0
    if rule == "parity":
        return (1 if (x + y) % 2 else -1), 0
    if rule == "energy_threshold":
        return (2 if energy >= 15 else -2), 0
    return {"plus_score": (1, 0), "plus_energy": (0, 1), "minus_score": (-1, 0)}[rule]


GRID_RULES = ("step_count", "edge_corner", "visit_parity", "energy_management", "coordinate", "parity",
              "energy_threshold", "plus_score", "plus_energy", "minus_score")


def _v(c: str) -> int:
    return ord(c) - 65


def _c(v: int) -> str:
    return chr(65 + v % 26)


def _prime(n: int) -> bool:
    return n >= 2 and all(n % d for d in range(2, int(n ** 0.5) + 1))


def _seq_rule(rule: str, cur: str, main: str, vice: str, n: int, prev: str | None) -> str:
    if rule == "interleave":
        return "".join(a + b for a, b in zip(main, vice))
    if rule == "interleave_parity":
        a, b = (main, vice) if n % 2 else (vice, main)
        return "".join(p + q for p, q in zip(a, b))
    if rule == "reverse_shift_concat":
        return "".join(_c(_v(ch) + n) for ch in reversed(cur)) + "".join(_c(_v(ch) + n) for ch in cur)
    if rule == "append_nth":
        a = n % 10 or 10
        return cur + cur[a - 1] * a if len(cur) >= a else cur
    if rule == "add_prev_main":
        if prev is None:
            return cur
        return "".join(_c(_v(ch) + _v(p)) for ch, p in zip(cur[:5], prev)) + cur[5:]
    if rule == "prime_most_frequent":
        if not _prime(n) or not cur:
            return cur
        top = max(cur.count(ch) for ch in cur)
        best = next(ch for ch in cur if cur.count(ch) == top)
        return cur.replace(best, _c(_v(best) + 1))
    if rule == "position_sum":
        return "-".join(str(_v(a) + _v(b)) for a, b in zip(main, vice))
    if rule == "position_max":
        return "".join(max(a, b) for a, b in zip(main, vice))
    if rule == "sorted_concat":
        return "".join(sorted(main + vice))
    raise KeyError(rule)


SEQ_RULES = ("interleave_parity", "reverse_shift_concat", "append_nth", "add_prev_main", "prime_most_frequent",
             "interleave", "position_sum", "position_max", "sorted_concat")


# ------------------------------------------------------------------------------------------------ agent
class InferExplorer:
    def __init__(self, seed: int = 0):
        self.rng = random.Random(seed)
        self.env: str | None = None
        self.R = 0
        self.menu = False
        self.used = 0
        self.pending: tuple[str, dict] | None = None
        self.last_note = -1
        self.committed_refused = False

    # ---- protocol
    def act(self, messages, ctx=None) -> Turn:          # ctx is never read (see the module docstring)
        if self.env is None:
            self._setup(messages[0]["content"] if messages and messages[0]["role"] == "system" else "")
        last = str(messages[-1]["content"]) if messages else ""
        if self.pending is not None:
            if last.startswith("Observation: "):
                self._observe(*self.pending, last[len("Observation: "):])
            else:                                       # a context refresh dropped the observation
                self._lost(*self.pending)
        name, args = self._next()
        self.pending = (name, args)
        text = f"Thought: infer from observations.\n<tool_call>{json.dumps({'name': name, 'arguments': args})}</tool_call>"
        return Turn(text, {"prompt": sum(len(str(m["content"])) for m in messages) // 4 + 1,
                           "completion": len(text) // 4 + 1})

    def _setup(self, system: str) -> None:
        self.env = ("seq" if "input_sequences" in system else "bio" if "conduct_cross" in system else "grid")
        m = re.search(r"[Mm]ake (\d+) (?:moves|inputs|crosses)", system)
        self.R = int(m.group(1)) if m else 1
        self.menu = "Commit a JSON" in system
        getattr(self, f"_init_{self.env}")()

    def _observe(self, name: str, args: dict, obs: str) -> None:
        if name == "commit_final_result":
            m = re.search(r"(\d+) of (\d+) required", obs)
            if m:
                self.used, self.R = int(m.group(1)), int(m.group(2))
            return
        if obs.startswith(("Refused", "Error")):
            getattr(self, f"_refused_{self.env}")(name, args, obs)
            return
        try:
            data = json.loads(obs.split(" (Only the first tool call ran")[0])
        except json.JSONDecodeError:
            return
        if isinstance(data, dict):
            getattr(self, f"_obs_{self.env}")(name, args, data)

    def _lost(self, name: str, args: dict) -> None:
        if name in ("move", "input_sequences", "conduct_cross"):
            self.used += 1                              # a valid consuming action (re-synced at commit)
        getattr(self, f"_lost_{self.env}")(name, args)

    def _next(self) -> tuple[str, dict]:
        if self.used >= self.R or self._cannot_continue():
            return "commit_final_result", {"content": self._commit()}
        if self.used and self.used % 10 == 0 and self.last_note != self.used:
            self.last_note = self.used
            return "write_note", {"note": f"{self.used} actions done; hypotheses: {json.dumps(self.report())}"}
        return getattr(self, f"_next_{self.env}")()

    def _cannot_continue(self) -> bool:
        return self.env == "grid" and self.over and self.resets_left == 0

    def _commit(self) -> str:
        rep = self.report()
        return json.dumps(rep) if self.menu else describe_report(self.env, rep)

    def report(self) -> dict:
        return getattr(self, f"_report_{self.env}")()

    # ================================================================================== grid
    def _init_grid(self) -> None:
        self.cands = {c: set(GRID_RULES) for c in LETTERS}
        self.board = None          # [y][x]
        self.known = False         # position / energy / score / steps known
        self.over, self.resets_left = False, 20
        self.entries: dict[str, int] | None = {c: 0 for c in LETTERS}
        self.pos, self.energy, self.score, self.steps = (0, 0), 20, 0, 0

    def _next_grid(self) -> tuple[str, dict]:
        if self.over:
            return "reset", {}
        if not self.known:
            return "get_current_state", {}
        if self.board is None:
            return "get_full_map", {}
        return "move", {"direction": self._step_towards_ambiguous()}

    def _step_towards_ambiguous(self) -> str:
        want = {c for c, s in self.cands.items() if len(s) > 1}
        x0, y0 = self.pos
        seen, q = {(x0, y0): None}, deque([(x0, y0)])
        goal = None
        while q and want:
            x, y = q.popleft()
            if (x, y) != (x0, y0) and self.board[y][x] in want:
                goal = (x, y)
                break
            for d, (dx, dy) in DIRS.items():
                nx, ny = x + dx, y + dy
                if 0 <= nx < 10 and 0 <= ny < 10 and (nx, ny) not in seen:
                    seen[(nx, ny)] = (x, y, d)
                    q.append((nx, ny))
        if goal is None:
            ok = [d for d, (dx, dy) in DIRS.items() if 0 <= x0 + dx < 10 and 0 <= y0 + dy < 10]
            return self.rng.choice(ok)
        cell, first = goal, None
        while seen[cell] is not None:
            px, py, d = seen[cell]
            first, cell = d, (px, py)
        return first

    def _obs_grid(self, name: str, args: dict, d: dict) -> None:
        if name == "get_current_state":
            self.pos, self.energy, self.score, self.steps = tuple(d["position"]), d["energy"], d["score"], d["steps"]
            self.over, self.known = bool(d.get("game_over")), True
        elif name == "get_full_map":
            self.board = [list(r) for r in reversed(d["rows"])]
            self.pos = tuple(d["position"])
        elif name == "reset":
            self.resets_left = d.get("resets_left", self.resets_left)
            self.over, self.known, self.board = False, False, None
            self.entries = {c: 0 for c in LETTERS}
        elif name == "move":
            self.used += 1
            x, y = d["position"]
            letter = d["letter"]
            if letter in self.cands and self.known:
                e0 = self.energy - 1                                # energy after paying for the move
                k = None
                if self.entries is not None:
                    self.entries[letter] += 1
                    k = self.entries[letter]
                got = (d["score"] - self.score, d["energy"] - e0)
                keep = set()
                for r in self.cands[letter]:
                    ds, de = _grid_effect(r, x, y, d["steps"], e0, k)
                    if ds is None or (ds, de) == got:
                        keep.add(r)
                self.cands[letter] = keep
            elif letter in self.cands and self.entries is not None:
                self.entries[letter] += 1
            self.pos, self.energy, self.score, self.steps = (x, y), d["energy"], d["score"], d["steps"]
            self.over = bool(d.get("game_over"))
            self.resets_left = d.get("resets_left", self.resets_left)
            if self.board is not None:
                self.board[y][x] = "X"

    def _refused_grid(self, name: str, args: dict, obs: str) -> None:
        if "round is over" in obs:
            self.over = True
        elif "no resets left" in obs:
            self.resets_left, self.over = 0, True
        else:
            self.known, self.board = False, None

    def _lost_grid(self, name: str, args: dict) -> None:
        self.known, self.board = False, None
        if name == "move":
            self.entries = None          # this round's entry counts are no longer known
        if name == "reset":
            self.entries = {c: 0 for c in LETTERS}
            self.resets_left -= 1

    def _report_grid(self) -> dict:
        return {c: (self.rng.choice(sorted(s)) if s else "unknown") for c, s in self.cands.items()}

    # =================================================================================== seq
    def _init_seq(self) -> None:
        self.cands = {i: set(SEQ_RULES) for i in range(1, 6)}
        self.prev_main: str | None = None

    def _word(self) -> str:
        while True:
            w = "".join(self.rng.choice(LETTERS) for _ in range(5))
            if len(set(w)) >= 2:
                return w

    def _next_seq(self) -> tuple[str, dict]:
        return "input_sequences", {"main": self._word(), "vice": self._word()}

    def _obs_seq(self, name: str, args: dict, d: dict) -> None:
        if name != "input_sequences":
            return
        self.used += 1
        main, vice, n = args["main"], args["vice"], int(d["step"])
        cur = ""
        for i in range(1, 6):
            out = d[f"rule_{i}"]
            self.cands[i] = {r for r in self.cands[i] if _seq_rule(r, cur, main, vice, n, self.prev_main) == out}
            cur = out
        self.prev_main = main

    def _refused_seq(self, name: str, args: dict, obs: str) -> None:
        pass

    def _lost_seq(self, name: str, args: dict) -> None:
        if name == "input_sequences":
            self.prev_main = args["main"]

    def _report_seq(self) -> dict:
        return {f"rule_{i}": (self.rng.choice(sorted(s)) if s else "unknown") for i, s in self.cands.items()}

    # =================================================================================== bio
    def _init_bio(self) -> None:
        self.founders: dict[int, dict] | None = None
        self.crosses: list[dict] = []        # {p1, p2, offspring [phenotype...], ids, lethal, attempts}
        self.count: int | None = 3
        self.kept = {1, 2, 3}
        self.plan = [(1, 2, 20), (1, 3, 20), (2, 3, 20), (3, 3, 20)]
        self.removed: set[int] = set()

    def _carrier(self, a: int, b: int) -> int | None:
        """An offspring of founders a × b with a mixed shell (hardness well below 100: carries both types)."""
        for c in self.crosses:
            if {c["p1"], c["p2"]} == {a, b}:
                for oid, p in zip(c["ids"], c["offspring"]):
                    if p["shell_hardness"] < 85:
                        return oid
        return None

    def _next_bio(self) -> tuple[str, dict]:
        if self.founders is None:
            return "query_organisms", {"start_id": 1, "end_id": 3}
        if self.count is None:
            return "get_lab_status", {}
        k = len(self.crosses)
        if k < len(self.plan):
            p1, p2, n = self.plan[k]
        else:             # lethality tests: a carrier of two shell types × the founder with the third
            opts = [(self._carrier(1, 2), 3), (self._carrier(1, 3), 2), (self._carrier(2, 3), 1)]
            opts = [o for o in opts if o[0] is not None] or [(1, 2)]
            p1, p2 = opts[(k - len(self.plan)) % len(opts)]
            n = 30
        if self.count + n > 200:
            ids = sorted(i for c in self.crosses for i in c["ids"] if i not in self.kept and i not in self.removed)
            carriers = {self._carrier(1, 2), self._carrier(1, 3), self._carrier(2, 3)}
            drop = [i for i in ids if i not in carriers][: self.count + n - 200 + 20]
            if drop:
                return "remove_organisms", {"ids": drop}
        return "conduct_cross", {"parent1_id": p1, "parent2_id": p2, "num_offspring": n}

    def _obs_bio(self, name: str, args: dict, d: dict) -> None:
        if name == "query_organisms":
            got = {o["id"]: o["phenotype"] for o in d.get("organisms", [])}
            if {1, 2, 3} <= set(got):
                self.founders = {i: got[i] for i in (1, 2, 3)}
        elif name == "get_lab_status":
            self.count = d.get("organisms")
        elif name == "remove_organisms":
            self.removed |= set(args.get("ids", []))      # gone now, removed by this call or before
            self.count = d.get("count", self.count)
        elif name == "conduct_cross":
            self.used += 1
            offs = d.get("offspring", [])
            self.crosses.append({"p1": args["parent1_id"], "p2": args["parent2_id"],
                                 "offspring": [o["phenotype"] for o in offs], "ids": [o["id"] for o in offs],
                                 "lethal": d.get("lethal", 0), "attempts": d.get("attempts", 0)})
            if self.count is not None:
                self.count += len(offs)

    def _refused_bio(self, name: str, args: dict, obs: str) -> None:
        self.count = None                # re-read the lab status

    def _lost_bio(self, name: str, args: dict) -> None:
        if name in ("conduct_cross", "remove_organisms"):
            self.count = None
        if name == "remove_organisms":
            self.removed |= set(args.get("ids", []))
        if name == "conduct_cross":      # keep the plan position; nothing observed
            self.crosses.append({"p1": args["parent1_id"], "p2": args["parent2_id"], "offspring": [], "ids": [],
                                 "lethal": 0, "attempts": 0})
        if name == "query_organisms":
            self.founders = None

    def _of(self, a: int, b: int) -> list[dict]:
        return [p for c in self.crosses if {c["p1"], c["p2"]} == {a, b} for p in c["offspring"]]

    def _report_bio(self) -> dict:
        rng, F = self.rng, self.founders or {}
        rep: dict = {}
        # ploidy: the smallest denominator d whose multiples k/d explain every mixed-shell hardness
        fr = [p["shell_hardness"] / 100 for c in self.crosses for p in c["offspring"] if p["shell_hardness"] < 90]
        ploidy = None
        if fr:
            for d in range(2, 7):
                if all(abs(f - round(f * d) / d) < 0.06 and round(f * d) > 0 for f in fr):
                    ploidy = d
                    break
        rep["ploidy"] = ploidy if ploidy is not None else rng.choice([2, 3, 4])
        p = rep["ploidy"]
        # viability among crosses of founders (one shell type each: no three-type combination possible)
        base = [c for c in self.crosses if c["p1"] <= 3 and c["p2"] <= 3 and c["attempts"]]
        v = (sum(len(c["offspring"]) for c in base) / sum(c["attempts"] for c in base)) if base else None
        if v is None:
            rep["gametes"], rep["viability"] = rng.choice([["1n"], ["1n", "2n"]]), rng.choice(["all", "only_triploid"])
        elif v < 0.8:       # about half the zygotes die: 1n and 2n gametes, only the 1n + 2n zygotes live
            rep["gametes"], rep["viability"] = ["1n", "2n"], ("only_triploid" if p == 3 else f"only_{p}n")
        else:
            rep["gametes"], rep["viability"] = (["1n"] if p == 2 else ["1n", "2n"]), "all"
        rep.update(self._size(p, F))
        rep.update(self._dominance(F))
        # lethal combination: viability of carrier (two shell types) × third founder below the founder crosses'
        test = [c for c in self.crosses if max(c["p1"], c["p2"]) > 3 and c["attempts"]]
        if test and v is not None:
            vt = sum(len(c["offspring"]) for c in test) / sum(c["attempts"] for c in test)
            rep["shell_lethal"] = ["H1", "H2", "H3"] if vt < 0.8 * v else []
        else:
            rep["shell_lethal"] = []
        return rep

    def _size(self, p: int, F: dict) -> dict:
        """Additive allele values: founder 3 true-breeding (its self-cross shows one size class) gives its
        allele value; each other founder's genotype is the multiset of p values that sums to its size and
        predicts every size class of its cross with founder 3 (gametes of 1 .. p-1 alleles)."""
        if not F:
            return {"size_mode": "additive", "size_alleles": ["S1", "S2"], "size_values": {"S1": 100, "S2": 10}}
        v3 = F[3]["size"] / p        # founder 3 taken as true-breeding (its self-cross, when run, shows one class)
        values = [v3]
        additive = True
        for f in (1, 2):
            sizes = sorted({round(o["size"]) for o in self._of(f, 3)})
            levels = []
            for s in sizes:
                if not any(abs(s - l) <= 0.03 * l for l in levels):
                    levels.append(s)
            best = None
            if levels:
                singles = sorted({round(s - k * v3, 1) for s in levels for k in range(1, p) if s - k * v3 > 0})
                for combo in cwr(singles, p):
                    if abs(sum(combo) - F[f]["size"]) > 0.03 * F[f]["size"]:
                        continue
                    pred = set()
                    for g in range(1, p):          # a gamete of g alleles from f, p - g copies of v3
                        for sub in cwr(range(p), g):
                            if len(set(sub)) == g:
                                pred.add(sum(combo[i] for i in sub) + (p - g) * v3)
                    if all(any(abs(l - q) <= 0.03 * max(l, 1) for q in pred) for l in levels):
                        key = (len(set(combo)), combo)
                        if best is None or key < best:
                            best = key
            if best is None:
                additive = additive and not levels
                continue
            for a in best[1]:
                if not any(abs(a - w) <= 0.05 * w for w in values):
                    values.append(a)
        values = sorted(values, reverse=True)
        names = [f"S{i + 1}" for i in range(len(values))]
        return {"size_mode": "additive" if additive else "dominant", "size_alleles": names,
                "size_values": {n: round(v) for n, v in zip(names, values)}}

    def _dominance(self, F: dict) -> dict:
        color_wins, shell_beats, complete = {1: 0, 2: 0, 3: 0}, {}, True
        for a, b in ((1, 2), (1, 3), (2, 3)):
            offs = self._of(a, b)
            if not offs or not F:
                continue
            colors = [o["color"] for o in offs]
            top = max(set(colors), key=colors.count)
            for f in (a, b):
                if F[f]["color"] == top:
                    color_wins[f] += 1
                    if any(abs(o["color_intensity"] - F[f]["color_intensity"]) > 5 for o in offs if o["color"] == top):
                        complete = False
            shells = [o["shell"] for o in offs]
            win = max(set(shells), key=shells.count)
            for f, g in ((a, b), (b, a)):
                if F[f]["shell"] == win:
                    shell_beats[f] = g
        order = sorted((1, 2, 3), key=lambda f: -color_wins[f])
        cyclic = len(shell_beats) == 3 and len(set(shell_beats.values())) == 3
        return {"color_order": [f"C{f}" for f in order], "color_dominance": "complete" if complete else "incomplete",
                "shell_dominance": "cyclic" if cyclic else "linear"}

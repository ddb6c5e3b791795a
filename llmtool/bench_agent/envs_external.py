"""Two of the PIPE paper's real text-game environments, run offline through their PyPI packages
(optional extra ``llmtool[agent]``; both start a Java process, so a Java runtime is needed too):

- ``twx-coin`` — TextWorldExpress ``coin`` (``textworld-express``): 4 locations with doors, no
  distractor items; find the coin and take it. Task seed → the game's train-fold seed (``seed mod 2^31``).
- ``sciworld-find-living-thing`` — ScienceWorld ``find-living-thing`` (``scienceworld``, AgentGym's
  SciWorld, bundled jar): focus on a living thing and move it into the named box. Task seed → one of the
  task's train variations (``train[seed mod len(train)]``). Reward 1 only when the game reports the task
  complete (score 100), so success means reward == 1 as in the paper.

Interface (what PIPE renames): the game's action verbs — TWX: ``look around, inventory, move, take,
open, close``; ScienceWorld: its action templates (``activate … wait``, with ``go OBJ`` written
``go to``; ``reset task`` and ``wait1`` are left out). The argument (objects, directions, ``to``/``in``
/``on`` between objects) is never renamed. ScienceWorld has 24 verbs, so its obfuscated names are
zero-padded ``z01..z24`` (``z1`` would be a substring of ``z10``, which the spec validator refuses).

Surfaces rewritten — only names at *action positions* (``ACTION_POSITIONS``, passed to the display
side as ``RewriteSpec.positions``): after ``Action: ``, after ``Valid actions: `` and each ``; ``
separator of the valid-action list shown after every TWX observation, and after ``, `` (the imperative
clauses of the goal texts: "…, take it", "First, focus on …. Then, move it …"). Narrative game text
("You move to the kitchen.", "the door is open", "in inventory" inside an object phrase) is left as the
game wrote it, so object names and descriptions are never broken. The system prompt's action list shows
the aliases; its descriptions mention no verb. Actions from the agent are translated back to the
original verb (the argument is passed on unchanged) before they reach the game.

The oracle plays the game's own gold action sequence, one action per step, split into (verb, argument)
and written by ``script:oracle`` with the displayed name like any agent output. TWX's gold-path search is
random (the game itself is seeded), so the shortest of four searched paths is kept per seed and
replayed in every rewrite mode of the process. JVM start-up (1–4 s) is
paid once per worker thread: each thread keeps one game object per environment and reloads/resets it
per episode. Package imports happen on first use; a missing package or ``java`` is a one-line
``UsageError``.
"""
from __future__ import annotations

import shutil
import threading
from typing import ClassVar

from llmtool.bench_agent.envs import Env, StepResult, register
from llmtool.core.console import UsageError

_LOCAL = threading.local()
_TWX_GOLD: dict = {}          # (game params, seed) -> the gold action sequence replayed by the oracle
POSITIONS = r"Action: |Valid actions: |; |, "


def _game(key: str, factory):
    """The calling thread's game object for ``key`` (created once: one JVM per worker)."""
    games = getattr(_LOCAL, "games", None)
    if games is None:
        games = _LOCAL.games = {}
    if key not in games:
        games[key] = factory()
    return games[key]


def _require(module: str, env_name: str):
    if shutil.which("java") is None:
        raise UsageError(f"environment {env_name} needs a Java runtime on PATH: install llmtool[agent] "
                         "(and a Java runtime)")
    try:
        return __import__(module)
    except ImportError:
        raise UsageError(f"environment {env_name} needs the package {module!r}: install llmtool[agent] "
                         "(and a Java runtime)") from None


class _GoldEnv(Env):
    """Shared parts: gold-path oracle, verb/argument split, short task-text sample."""

    ACTION_POSITIONS: ClassVar[str] = POSITIONS
    step_limit: ClassVar[int] = 100

    def split(self, action: str) -> tuple[str, str]:
        low = action.strip().lower()
        for ident in sorted(self.IDENTIFIERS, key=len, reverse=True):
            if low == ident or low.startswith(ident + " "):
                return ident, action.strip()[len(ident):].strip()
        raise ValueError(f"gold action {action!r} starts with no known verb")

    def oracle_action(self) -> tuple[str, str]:
        if self.k >= len(self.gold):
            return "look around", ""
        return self.split(self.gold[self.k])

    def sample_texts(self, n: int = 5) -> list[str]:
        """Every observation of the gold episodes of two tasks (game episodes cost ~1 s each)."""
        out = []
        for s in range(min(n, 2)):
            out.append(self.reset(s))
            for _ in range(len(self.gold)):
                r = self.step(*self.oracle_action())
                out.append(r.observation)
                if r.done:
                    break
        return out


@register
class TwxCoin(_GoldEnv):
    name = "twx-coin"
    help = "TextWorldExpress coin (real game, Java): search the rooms, open doors, take the coin."
    IDENTIFIERS = ("look around", "inventory", "move", "take", "open", "close")
    DOCS = {"look around": "describe the current room again", "inventory": "list what you carry",
            "move": "<direction>: go through the exit in that direction",
            "take": "<item>: pick the item up", "open": "door to <direction>: open that door",
            "close": "door to <direction>: shut that door"}
    SYNONYMS = {"look around": "survey", "inventory": "belongings", "move": "walk", "take": "grab",
                "open": "unlatch", "close": "shut"}
    INSTRUCTIONS = ("You play a text game. Reply with exactly one line: Action: <action> [argument], using "
                    "one of the valid actions listed after each observation.")
    default_rounds = 24
    PARAMS = "numLocations=4,includeDoors=1,numDistractorItems=0"

    def __init__(self, **options):
        super().__init__(**options)
        _require("textworld_express", self.name)

        def make():
            from textworld_express import TextWorldExpressEnv

            g = TextWorldExpressEnv(envStepLimit=self.step_limit)
            g.load(gameName="coin", gameParams=self.PARAMS)
            return g

        self.game = _game(f"twx-coin:{self.PARAMS}", make)

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def _obs(self, text: str, infos: dict) -> str:
        valid = "; ".join(sorted(infos.get("validActions", [])))
        return f"{text.strip()}\nValid actions: {valid}"

    def reset(self, seed: int) -> str:
        seed = int(seed) % 2**31
        key = (self.PARAMS, seed)
        if key not in _TWX_GOLD:   # the game is seeded, its gold-path search is not: keep one, the shortest of 4
            paths = []
            for _ in range(4):
                self.game.reset(seed=seed, gameFold="train", generateGoldPath=True)
                paths.append(list(self.game.getGoldActionSequence()))
            _TWX_GOLD[key] = min(paths, key=len)
        obs, infos = self.game.reset(seed=seed, gameFold="train", generateGoldPath=False)
        self.gold, self.k = list(_TWX_GOLD[key]), 0
        return f"Task: {infos['taskDescription'].strip()}\n" + self._obs(obs, infos)

    def step(self, ident: str, arg: str) -> StepResult:
        self.k += 1
        obs, _, done, infos = self.game.step(f"{ident} {arg}".strip())
        won = bool(infos.get("tasksuccess"))
        done = bool(done or won or infos.get("taskfailure"))
        return StepResult(obs.strip() if done else self._obs(obs, infos), 1.0 if won else 0.0, done)


SW_VERBS = ("activate", "close", "connect", "deactivate", "disconnect", "dunk", "eat", "flush", "focus on",
            "go to", "inventory", "look around", "look at", "look in", "mix", "move", "open", "pick up",
            "pour", "put down", "read", "task", "use", "wait")


@register
class SciWorldFindLiving(_GoldEnv):
    name = "sciworld-find-living-thing"
    help = "ScienceWorld find-living-thing (real game, Java): focus on a living thing, move it to the box."
    IDENTIFIERS = SW_VERBS
    DOCS = {"activate": "OBJ: switch a device on", "close": "OBJ: shut a container or door",
            "connect": "OBJ to OBJ: join two electrical terminals", "deactivate": "OBJ: switch a device off",
            "disconnect": "OBJ: undo an electrical connection", "dunk": "OBJ in OBJ: submerge one thing in another",
            "eat": "OBJ: consume food", "flush": "OBJ: flush a toilet", "focus on": "OBJ: declare OBJ the object "
            "of the task (irreversible; a wrong one fails the task)", "go to": "LOCATION: walk to an adjacent room",
            "inventory": "list what you carry", "look around": "describe the current room",
            "look at": "OBJ: describe an object", "look in": "OBJ: describe a container's contents",
            "mix": "OBJ: stir a container's contents", "move": "OBJ to OBJ: transfer an object into a container",
            "open": "OBJ: unlatch a container or door", "pick up": "OBJ: put an object into your inventory",
            "pour": "OBJ in OBJ: empty a liquid into a container", "put down": "OBJ: drop an object here",
            "read": "OBJ: show the text on an object", "task": "repeat the task description",
            "use": "OBJ on OBJ: apply a tool to an object", "wait": "let ten time steps pass"}
    SYNONYMS = {"activate": "switch on", "close": "shut", "connect": "attach", "deactivate": "switch off",
                "disconnect": "detach", "dunk": "submerge", "eat": "consume", "flush": "drain",
                "focus on": "concentrate on", "go to": "travel to", "inventory": "belongings",
                "look around": "survey", "look at": "inspect", "look in": "peer into", "mix": "blend",
                "move": "relocate", "open": "unlatch", "pick up": "grab", "pour": "decant", "put down": "drop",
                "read": "scan", "task": "objective", "use": "employ", "wait": "idle"}
    OBFUSCATION = {a: f"z{i + 1:02d}" for i, a in enumerate(SW_VERBS)}
    INSTRUCTIONS = ("You play a science text game. Reply with exactly one line: Action: <action> [objects].")
    default_rounds = 30
    TASK = "find-living-thing"

    def __init__(self, **options):
        super().__init__(**options)
        _require("scienceworld", self.name)

        def make():
            from scienceworld import ScienceWorldEnv

            g = ScienceWorldEnv("", envStepLimit=self.step_limit)
            g.load(self.TASK, 0, "", generateGoldPath=False)
            return {"game": g, "train": list(g.get_variations_train())}

        self.box = _game(f"sciworld:{self.TASK}", make)
        self.game = self.box["game"]

    def instructions(self) -> str:
        return self.INSTRUCTIONS

    def reset(self, seed: int) -> str:
        train = self.box["train"]
        self.variation = train[int(seed) % len(train)]
        self.game.load(self.TASK, self.variation, "", generateGoldPath=True)
        obs, _ = self.game.reset()
        self.gold, self.k = list(self.game.get_gold_action_sequence()), 0
        return f"Task: {self.game.get_task_description().strip()}\n{obs.strip()}"

    def step(self, ident: str, arg: str) -> StepResult:
        self.k += 1
        obs, _, done, info = self.game.step(f"{ident} {arg}".strip())
        won = int(info.get("score", 0)) >= 100
        return StepResult(obs.strip(), 1.0 if won else 0.0, bool(done or won))

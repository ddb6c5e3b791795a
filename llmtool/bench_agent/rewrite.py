"""PIPE rewrite layer (pipe-interface.md §3.1–3.2): rewrite specs, their validation, display-side
renaming and action-side translation, strict mode and the dual interface.

Modes: ``none`` (O0), ``synonym`` (O1), ``obfuscate`` (O2: ``z1..zm`` in identifier order, env
overrides allowed), ``dual-ori-first`` / ``dual-syn-first`` (O3: original and synonym both accepted,
listing order counterbalanced). Strict mode (default on for O1/O2) answers an original identifier with
the fixed marker ``Invalid/Deprecated Action`` naming the alias, without touching env state.

Display rule (§3.2): originals are replaced longest first; an identifier of word characters matches
with ``\\b`` boundaries, one with spaces with ``(?<!\\w)…(?!\\w)``, anything else literally. Action
side: the identifier is the longest accepted name the action text starts with (case-insensitive),
followed by whitespace or the end.

Dual orders (AgentGym style): ori-first shows the original interface everywhere and lists each alias
second; syn-first rewrites the prompt and every observation to the aliases, lists each original second
and appends a mapping note. A policy that always copies the first-listed/displayed name therefore uses
originals in one order and aliases in the other, and its IR is exactly 1 (position bias cancels).

A spec is refused (``UsageError``) before any episode when it fails :meth:`RewriteSpec.validate`:
total and injective maps, aliases disjoint from originals, no alias a substring of another name or
of an original (case-insensitive), aliases absent from sampled task texts, display round trip = identity.
Specs may be loaded from a JSON/YAML file (``--rewrite-spec``) with the keys of :meth:`RewriteSpec.as_dict`.
"""
from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

from llmtool.core.console import UsageError

MODES = ("none", "synonym", "obfuscate", "dual-ori-first", "dual-syn-first")
DEPRECATED = "Invalid/Deprecated Action"


@dataclass
class RewriteSpec:
    env: str
    actions: tuple[str, ...]
    synonyms: dict[str, str]
    obfuscation: dict[str, str] = field(default_factory=dict)
    dual_supported: bool = True
    surfaces: tuple[str, ...] = ("instructions", "observations", "action_list")
    positions: str = ""       # regex of the prefixes after which a name is rewritten ("" = everywhere)

    @classmethod
    def for_env(cls, env) -> "RewriteSpec":
        return cls(env=env.name, actions=tuple(env.IDENTIFIERS), synonyms=dict(env.SYNONYMS),
                   obfuscation=dict(env.OBFUSCATION), dual_supported=env.DUAL,
                   positions=getattr(env, "ACTION_POSITIONS", ""))

    def obfuscated(self) -> dict[str, str]:
        return {a: self.obfuscation.get(a, f"z{i + 1}") for i, a in enumerate(self.actions)}

    def alias_map(self, mode: str) -> dict[str, str]:
        if mode == "synonym" or mode.startswith("dual"):
            return dict(self.synonyms)
        if mode == "obfuscate":
            return self.obfuscated()
        return {}

    def as_dict(self) -> dict:
        d = {"env": self.env, "actions": list(self.actions), "synonyms": self.synonyms,
             "obfuscation": self.obfuscated(), "dual_supported": self.dual_supported,
             "surfaces": list(self.surfaces)}
        if self.positions:       # only position-scoped specs carry the key (built-in digests unchanged)
            d["positions"] = self.positions
        return d

    def digest(self) -> str:
        return hashlib.sha256(json.dumps(self.as_dict(), sort_keys=True).encode()).hexdigest()[:16]

    @classmethod
    def from_file(cls, path, env) -> "RewriteSpec":
        """A user spec for ``env`` (keys: actions, synonyms, obfuscation, dual_supported, surfaces)."""
        from pathlib import Path

        path = Path(path)
        if not path.is_file():
            raise UsageError(f"--rewrite-spec {path}: no such file")
        try:
            text = path.read_bytes().decode("utf-8")
        except UnicodeDecodeError as e:
            raise UsageError(f"--rewrite-spec {path}: not UTF-8 text (byte {e.start})") from None
        try:
            if path.suffix in (".yaml", ".yml"):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except Exception as e:  # json.JSONDecodeError, yaml.YAMLError
            raise UsageError(f"--rewrite-spec {path}: cannot parse ({type(e).__name__}: {str(e)[:80]})") from None
        if not isinstance(data, dict):
            raise UsageError(f"--rewrite-spec {path}: expected a mapping")
        unknown = sorted(set(data) - {"env", "actions", "synonyms", "obfuscation", "dual_supported", "surfaces",
                                      "positions"})
        if unknown:
            raise UsageError(f"--rewrite-spec {path}: unknown keys {', '.join(unknown)}")
        actions = tuple(data.get("actions", env.IDENTIFIERS))
        if tuple(actions) != tuple(env.IDENTIFIERS):
            raise UsageError(f"--rewrite-spec {path}: actions {list(actions)} differ from the interface of "
                             f"{env.name} ({list(env.IDENTIFIERS)})")
        for key in ("synonyms", "obfuscation"):
            if not isinstance(data.get(key, {}), dict):
                raise UsageError(f"--rewrite-spec {path}: {key!r} must be a mapping")
        return cls(env=env.name, actions=actions, synonyms={str(k): str(v) for k, v in data.get("synonyms", env.SYNONYMS).items()},
                   obfuscation={str(k): str(v) for k, v in data.get("obfuscation", {}).items()},
                   dual_supported=bool(data.get("dual_supported", env.DUAL)),
                   surfaces=tuple(data.get("surfaces", ("instructions", "observations", "action_list"))),
                   positions=str(data.get("positions", getattr(env, "ACTION_POSITIONS", ""))))

    def check(self, task_texts: list[str] = (), what: str = "rewrite spec") -> None:
        """Raise a one-line ``UsageError`` when :meth:`validate` finds a problem."""
        problems = self.validate(task_texts)
        if problems:
            more = f" (and {len(problems) - 1} more)" if len(problems) > 1 else ""
            raise UsageError(f"{what} for {self.env} refused: {problems[0]}{more}")

    def validate(self, task_texts: list[str] = ()) -> list[str]:
        """Problems found (empty = valid): every map total and injective, aliases disjoint from
        originals, no alias a substring of another name, aliases absent from task data, display
        round trip identity."""
        problems = []
        for key, m in (("synonyms", self.synonyms), ("obfuscation", self.obfuscation)):
            extra = sorted(set(m) - set(self.actions))
            if extra:
                problems.append(f"{key}: unknown identifiers {extra}")
            for a, al in m.items():
                if not al or al != al.strip() or not re.fullmatch(r"[A-Za-z0-9_<>:. -]+", al):
                    problems.append(f"{key}: alias {al!r} of {a!r} is empty or has unsupported characters")
        for mode in ("synonym", "obfuscate"):
            m = self.alias_map(mode)
            missing = [a for a in self.actions if a not in m]
            if missing:
                problems.append(f"{mode}: no alias for {missing}")
                continue
            aliases = [m[a] for a in self.actions]
            if len(set(aliases)) != len(aliases):
                problems.append(f"{mode}: not injective ({aliases})")
            for al in aliases:
                if al in self.actions:
                    problems.append(f"{mode}: alias {al!r} is an original identifier")
                for other in [*aliases, *self.actions]:
                    if other != al and (al.lower() in other.lower() or other.lower() in al.lower()):
                        problems.append(f"{mode}: {al!r} and {other!r} overlap (substring)")
                for t in task_texts:
                    if _pattern(al).search(t):
                        problems.append(f"{mode}: alias {al!r} occurs in task data: {t[:60]!r}")
                        break
            probe = " ".join(f"Action: {a} x," for a in self.actions) + " " + " ".join(task_texts[:3])
            there = display(probe, m, self.positions)
            back = display(there, {v: k for k, v in m.items()}, self.positions)
            if back != probe:
                problems.append(f"{mode}: display round trip is not the identity")
        return list(dict.fromkeys(problems))


def _pattern(key: str) -> re.Pattern:
    if "<" in key or ">" in key:
        return re.compile(re.escape(key))
    if " " in key:
        return re.compile(r"(?<!\w)" + re.escape(key) + r"(?!\w)")
    if re.fullmatch(r"[A-Za-z0-9_]+", key):
        return re.compile(r"\b" + re.escape(key) + r"\b")
    return re.compile(re.escape(key))


def display(obj, mapping: dict[str, str], positions: str = ""):
    """Rewrite every string inside ``obj`` (str / list / dict, recursively), longest key first, in one
    pass (so a replacement is never rewritten again). ``positions`` (a regex, multiline) restricts the
    rewrite to names that directly follow a match of it (action positions: ``Action: ``, list
    separators, ...); empty = every occurrence."""
    if not mapping:
        return obj
    if isinstance(obj, dict):
        return {k: display(v, mapping, positions) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(display(v, mapping, positions) for v in obj)
    if not isinstance(obj, str):
        return obj
    keys = sorted(mapping, key=len, reverse=True)
    names = "|".join(f"(?:{_pattern(k).pattern})" for k in keys)
    lookup = {k: mapping[k] for k in keys}
    if positions:
        scoped = re.compile(f"((?:{positions}))({names})", re.M)
        return scoped.sub(lambda m: m.group(1) + lookup.get(m.group(2), m.group(2)), obj)
    combined = re.compile(names)
    return combined.sub(lambda m: lookup.get(m.group(0), m.group(0)), obj)


def parse_action(text: str) -> str | None:
    """The native text protocol: the text after the last ``Action:`` (first line), else the first
    non-empty line; ``None`` when the reply is empty."""
    if not text:
        return None
    hits = list(re.finditer(r"(?i)\baction\s*:\s*", text))
    if hits:
        body = text[hits[-1].end():]
    else:
        lines = [ln for ln in text.splitlines() if ln.strip()]
        if not lines:
            return None
        body = lines[0]
    body = body.strip().splitlines()[0].strip() if body.strip() else ""
    body = body.strip("`* ")
    return body or None


@dataclass
class Translation:
    ident: str | None          # original identifier to forward (None: not forwarded)
    arg: str
    kind: str                  # "orig" | "alias" | "deprecated" | "invalid"
    message: str = ""


class Rewriter:
    """Display/translate for one mode. ``strict`` applies to synonym/obfuscate."""

    def __init__(self, spec: RewriteSpec, mode: str = "none", strict: bool = True):
        if mode not in MODES:
            raise UsageError(f"--rewrite {mode!r}: choose one of {', '.join(MODES)}")
        if mode.startswith("dual") and not spec.dual_supported:
            raise UsageError(f"--rewrite {mode}: environment {spec.env} has no dual interface")
        self.spec, self.mode, self.strict = spec, mode, strict
        self.alias = spec.alias_map(mode)
        self.back = {v: k for k, v in self.alias.items()}
        self.dual = mode.startswith("dual")
        # display mapping: ori-first shows originals, syn-first (like synonym) shows the aliases
        self.show = {} if mode == "dual-ori-first" else self.alias

    def text(self, obj):
        return display(obj, self.show, self.spec.positions)

    def names(self, ident: str) -> list[str]:
        """The names listed for one identifier, in listing order."""
        if self.mode == "none":
            return [ident]
        if self.mode == "dual-ori-first":
            return [ident, self.alias[ident]]
        if self.mode == "dual-syn-first":
            return [self.alias[ident], ident]
        return [self.alias[ident]]

    def action_list(self, docs: dict[str, str]) -> str:
        lines = []
        for a in self.spec.actions:
            names = self.names(a)
            doc = self.text(docs.get(a, ""))
            lines.append(f"- {' or '.join(names)}" + (f": {doc}" if doc else ""))
        head = "Actions:"
        if self.dual:
            head = ("Actions (each has two equivalent names; use exactly one name per action, either is "
                    "accepted):")
        text = head + "\n" + "\n".join(lines)
        if self.mode == "dual-syn-first":
            note = ", ".join(f"{self.alias[a]} = {a}" for a in self.spec.actions)
            text += f"\nNote: the names are equivalent ({note})."
        return text

    def translate(self, action: str | None) -> Translation:
        if not action:
            return Translation(None, "", "invalid", "Invalid action: no action found. Reply with: Action: <action>.")
        accepted: dict[str, tuple[str, str]] = {}
        for a in self.spec.actions:
            accepted[a.lower()] = (a, "orig")
            if a in self.alias:
                accepted[self.alias[a].lower()] = (a, "alias")
        low = action.lower()
        best = None
        for name in sorted(accepted, key=len, reverse=True):
            if low.startswith(name) and (len(low) == len(name) or not (low[len(name)].isalnum() or low[len(name)] == "_")):
                best = name
                break
        if best is None:
            return Translation(None, "", "invalid", f"Invalid action: {action[:80]!r} is not one of the actions.")
        ident, kind = accepted[best]
        arg = action[len(best):].strip()
        if arg.startswith("(") and arg.endswith(")"):      # name(argument) style
            arg = arg[1:-1].strip()
        elif arg.startswith(":"):
            arg = arg[1:].strip()
        arg = arg.strip("`") if arg.startswith("`") and arg.endswith("`") else arg
        if self.mode == "none" and kind == "alias":
            kind = "invalid"
        if kind == "orig" and self.alias and not self.dual and self.strict:
            return Translation(None, arg, "deprecated",
                               f"{DEPRECATED}: '{ident}' is deprecated; use '{self.alias[ident]}'.")
        return Translation(ident, arg, kind)

    def render_action(self, ident: str, arg: str = "") -> str:
        """How an agent that knows the interface writes ``ident`` (first-listed name)."""
        name = self.names(ident)[0]
        return f"Action: {name}" + (f" {arg}" if arg else "")

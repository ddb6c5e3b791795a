"""Tolerant tool-call parser (pipe-interface.md §5), tried in order: tagged JSON
``<tool_call>{"name":…,"arguments":{…}}</tool_call>``; bare JSON with ``name`` and
``arguments``/``parameters``; Python-call style ``name(key=value, …)``. Returns a list of
``{"name", "arguments"}`` (possibly empty); malformed JSON yields an ``{"error": …}`` entry so the
caller can answer with an error observation instead of crashing."""
from __future__ import annotations

import ast
import json
import re

_TAG = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.S)
_CALL = re.compile(r"\b([A-Za-z_][A-Za-z0-9_]*)\s*\((.*?)\)", re.S)


def _norm(obj) -> dict | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError:
            return {"name": obj["name"], "error": f"arguments are not valid JSON: {args[:80]!r}"}
    if not isinstance(args, dict):
        return {"name": obj["name"], "error": "arguments must be a JSON object"}
    return {"name": obj["name"], "arguments": args}


def _json_objects(text: str) -> list:
    out, dec, i = [], json.JSONDecoder(), 0
    while True:
        j = text.find("{", i)
        if j < 0:
            return out
        try:
            obj, end = dec.raw_decode(text[j:])
            out.append(obj)
            i = j + end
        except json.JSONDecodeError:
            i = j + 1


def parse_tool_calls(text: str, known: set[str] | None = None) -> list[dict]:
    if not text:
        return []
    tagged = _TAG.findall(text)
    if tagged:
        calls = []
        for body in tagged:
            objs = _json_objects(body)
            got = _norm(objs[0]) if objs else None
            calls.append(got or {"name": "", "error": f"malformed tool call JSON: {body[:80]!r}"})
        return calls
    calls = [c for c in (_norm(o) for o in _json_objects(text)) if c]
    if calls:
        return calls
    for m in _CALL.finditer(text):
        name = m.group(1)
        if known is not None and name not in known:
            continue
        try:
            node = ast.parse(f"f({m.group(2)})", mode="eval").body
            args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords if kw.arg}
            if node.args and not args:
                args = {"_positional": [ast.literal_eval(a) for a in node.args]}
        except (SyntaxError, ValueError):
            continue
        calls.append({"name": name, "arguments": args})
        break
    return calls


def _arg_text(args: dict) -> str:
    if not args:
        return ""
    if "_positional" in args and len(args) == 1:
        return " ".join(str(v) for v in args["_positional"])
    return " ".join(str(v) for v in args.values())


def extract_action(text: str, names: set[str] | None = None, tool_calls: list | None = None) -> tuple[str | None, str]:
    """The action text (``"<name> <argument>"``) of one agent reply, and the format it was found in.

    Tried in order: native ``tool_calls`` (OpenAI ``tools`` protocol); the env's text protocol (the text
    after the last ``Action:``); a tagged ``<tool_call>`` JSON; bare JSON with ``name`` +
    ``arguments``/``parameters``; Python-call style ``name(arg)`` (``names``, when given, restricts the
    callable names); else the first non-empty line. ``(None, "none")`` for an empty reply;
    ``(None, "malformed")`` for a tool call whose JSON cannot be read (an invalid call, not a crash)."""
    from llmtool.bench_agent.rewrite import parse_action

    if tool_calls:
        c = tool_calls[0]
        if c.get("error") or not c.get("name"):
            return None, "malformed"
        arg = _arg_text(c.get("arguments") or {})
        return (c["name"] + (f" {arg}" if arg else "")), "tool_calls"
    if not text or not text.strip():
        return None, "none"
    if re.search(r"(?i)\baction\s*:", text):
        return parse_action(text), "text"
    if "<tool_call>" in text or "{" in text:
        calls = parse_tool_calls(text, names)
        if calls:
            return extract_action("", names, calls)
        if "<tool_call>" in text:
            return None, "malformed"
    calls = [c for c in parse_tool_calls(text, names) if c.get("name")] if "(" in text else []
    if calls and (names is None or calls[0]["name"] in names):
        return extract_action("", names, calls)
    return parse_action(text), "line"

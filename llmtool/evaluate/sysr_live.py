"""Live mode of `llmtool evaluate sysr`: models are loaded and asked to answer only the (model, query) pairs
the algorithm requests; answers are scored against the reference.

``models.yaml``: a list of entries ``{name, path, max_new_tokens?: 32, chat?: false}`` (``path`` = model dir or a
default alias). ``bench.jsonl``: ``{id, prompt, reference}`` per line. Scorers: ``exact_match`` (first line of
the greedy answer, stripped and case-folded, equals the reference) and ``contains`` (the reference occurs in
the answer, case-folded).
"""
from __future__ import annotations

from pathlib import Path
from typing import Callable

from llmtool.core.console import UsageError

SCORERS = ("exact_match", "contains")


def score_answer(answer: str, reference: str, scorer: str) -> float:
    if scorer == "exact_match":
        first = answer.strip().splitlines()[0] if answer.strip() else ""
        return float(first.strip().casefold() == reference.strip().casefold())
    if scorer == "contains":
        return float(reference.strip().casefold() in answer.casefold())
    raise UsageError(f"--scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")


def read_models_yaml(path: Path) -> list[dict]:
    import yaml

    if not Path(path).is_file():
        raise UsageError(f"{path}: no such file")
    try:
        doc = yaml.safe_load(Path(path).read_bytes().decode("utf-8"))
    except UnicodeDecodeError as e:
        raise UsageError(f"{path}: not UTF-8 text (byte {e.start})") from None
    except yaml.YAMLError as e:
        raise UsageError(f"{path}: malformed YAML ({str(e).splitlines()[0]})") from None
    except RecursionError:
        raise UsageError(f"{path}: malformed YAML (nested too deeply)") from None
    entries = doc.get("models") if isinstance(doc, dict) else doc
    if not isinstance(entries, list) or len(entries) < 2:
        raise UsageError(f"{path}: expected a list of at least two models (name, path)")
    names = set()
    for i, e in enumerate(entries, 1):
        if not isinstance(e, dict) or "name" not in e or "path" not in e:
            raise UsageError(f"{path}: entry {i}: needs fields 'name' and 'path'")
        if e["name"] in names:
            raise UsageError(f"{path}: entry {i}: duplicate model name {e['name']!r}")
        names.add(e["name"])
    return entries


def live_scorer(models_yaml: Path, queries: Path, scorer: str) -> tuple[list[str], list[str], Callable[[str, int], float]]:
    from llmtool.core.data import read_jsonl

    if scorer not in SCORERS:
        raise UsageError(f"--scorer must be one of {', '.join(SCORERS)}, got {scorer!r}")
    entries = read_models_yaml(models_yaml)
    items = read_jsonl(queries, required=("id", "prompt", "reference"))
    ids = [str(r["id"]) for r in items]
    if len(set(ids)) != len(ids):
        dup = next(i for i in ids if ids.count(i) > 1)
        raise UsageError(f"{queries}: duplicate id {dup!r}")
    by_name = {e["name"]: e for e in entries}
    loaded: dict[str, tuple] = {}

    def score(name: str, j: int) -> float:
        from llmtool.core.lm import chat_prompt, generate
        from llmtool.core.models import load_model, load_tokenizer

        entry = by_name[name]
        if name not in loaded:
            loaded.clear()                      # keep one model in memory at a time
            loaded[name] = (load_model(entry["path"]), load_tokenizer(entry["path"]))
        model, tok = loaded[name]
        prompt = str(items[j]["prompt"])
        if entry.get("chat"):
            prompt = chat_prompt(tok, prompt)
        (answer,), = generate(model, tok, [prompt], max_new_tokens=int(entry.get("max_new_tokens", 32)),
                              add_special_tokens=True)
        return score_answer(answer.text, str(items[j]["reference"]), scorer)

    return [e["name"] for e in entries], ids, score

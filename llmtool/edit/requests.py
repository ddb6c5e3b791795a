"""Edit requests: CounterFact / zsRE JSONL records parsed into one :class:`EditRequest` shape.

Accepted line layouts (one JSON object per line; blank lines are skipped; an empty file is an
empty request set):

* CounterFact: ``{"requested_rewrite": {"prompt": "The capital of {} is", "subject": "France",
  "target_new": {"str": "Rome"}, "target_true": {"str": "Paris"}}, "paraphrase_prompts": [...],
  "neighborhood_prompts": [...], "generation_prompts": [...]}``.
* Extension used by the packaged set: ``"neighborhood": [{"prompt": ..., "target": ...}]``
  (neighbourhood prompts with their own true answers, added to ``neighborhood_prompts``).
* Flat (the ``requested_rewrite`` object itself, optionally with the list fields beside it);
  ``target_new`` / ``target_true`` may be plain strings.
* zsRE (MEND split): ``{"src": question, "subject": ..., "alt": new answer, "answers": [old],
  "rephrase": paraphrase question, "loc": unrelated question, "loc_ans": its answer}``. The
  subject's first occurrence in ``src`` becomes the ``{}`` slot.

Every problem is a one-line :class:`UsageError` naming ``file:line`` and the field.
"""
from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from llmtool.core.console import UsageError
from llmtool.core.data import iter_jsonl


@dataclass
class EditRequest:
    prompt: str  # contains exactly one "{}" where the subject goes
    subject: str
    target_new: str
    target_true: str | None = None
    paraphrase_prompts: list[str] = field(default_factory=list)
    # (prompt, true answer) pairs whose prediction must not change
    neighborhood: list[tuple[str, str]] = field(default_factory=list)
    generation_prompts: list[str] = field(default_factory=list)

    def filled(self) -> str:
        return self.prompt.replace("{}", self.subject)

    def digest(self) -> str:
        payload = json.dumps([self.prompt, self.subject, self.target_new, self.target_true])
        return hashlib.sha256(payload.encode()).hexdigest()[:16]

    def to_json(self) -> dict:
        return asdict(self)


def _text(value, where: str, name: str) -> str:
    if isinstance(value, dict) and "str" in value:
        value = value["str"]
    if not isinstance(value, str) or not value.strip():
        raise UsageError(f"{where}: field {name!r} must be a non-empty string")
    return value


def _str_list(value, where: str, name: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(v, str) for v in value):
        raise UsageError(f"{where}: field {name!r} must be a list of strings")
    return list(value)


def _from_counterfact(row: dict, where: str) -> EditRequest:
    rw = row.get("requested_rewrite", row)
    if not isinstance(rw, dict):
        raise UsageError(f"{where}: field 'requested_rewrite' must be an object")
    prefix = "requested_rewrite." if "requested_rewrite" in row else ""
    for f in ("prompt", "subject", "target_new"):
        if f not in rw:
            raise UsageError(f"{where}: missing field {prefix + f!r}")
    prompt = _text(rw["prompt"], where, prefix + "prompt")
    if prompt.count("{}") != 1:
        raise UsageError(f"{where}: field {prefix + 'prompt'!r} must contain the subject slot '{{}}' exactly once")
    subject = _text(rw["subject"], where, prefix + "subject")
    new = _text(rw["target_new"], where, prefix + "target_new")
    true = _text(rw["target_true"], where, prefix + "target_true") if rw.get("target_true") is not None else None
    if true is not None and true.strip() == new.strip():
        raise UsageError(f"{where}: target_new equals target_true ({new!r})")
    neigh = _str_list(row.get("neighborhood_prompts"), where, "neighborhood_prompts")
    pairs = [(p, true.strip()) for p in neigh] if true is not None else []
    extra = row.get("neighborhood")
    if extra is not None:
        if not isinstance(extra, list):
            raise UsageError(f"{where}: field 'neighborhood' must be a list of {{prompt, target}} objects")
        for j, item in enumerate(extra):
            if not isinstance(item, dict) or "prompt" not in item or "target" not in item:
                raise UsageError(f"{where}: field 'neighborhood[{j}]' needs 'prompt' and 'target'")
            pairs.append((_text(item["prompt"], where, f"neighborhood[{j}].prompt"),
                          _text(item["target"], where, f"neighborhood[{j}].target").strip()))
    return EditRequest(
        prompt=prompt, subject=subject, target_new=new.strip(), target_true=None if true is None else true.strip(),
        paraphrase_prompts=_str_list(row.get("paraphrase_prompts"), where, "paraphrase_prompts"),
        neighborhood=pairs,
        generation_prompts=_str_list(row.get("generation_prompts"), where, "generation_prompts"),
    )


def _from_zsre(row: dict, where: str) -> EditRequest:
    for f in ("src", "subject", "alt"):
        if f not in row:
            raise UsageError(f"{where}: missing field {f!r}")
    src = _text(row["src"], where, "src")
    subject = _text(row["subject"], where, "subject")
    if subject not in src:
        raise UsageError(f"{where}: field 'subject' ({subject!r}) does not occur in 'src'")
    i = src.index(subject)
    prompt = (src[:i] + "{}" + src[i + len(subject):]).replace("{}", "\0", 1).replace("{", " ").replace("}", " ")
    prompt = prompt.replace("\0", "{}")
    answers = row.get("answers") or []
    true = answers[0] if isinstance(answers, list) and answers and isinstance(answers[0], str) else None
    para = [_text(row["rephrase"], where, "rephrase")] if row.get("rephrase") else []
    neigh = []
    if row.get("loc") is not None:
        loc = _text(row["loc"], where, "loc")
        neigh = [(loc, _text(row.get("loc_ans"), where, "loc_ans"))]
    return EditRequest(prompt=prompt, subject=subject, target_new=_text(row["alt"], where, "alt").strip(),
                       target_true=true, paraphrase_prompts=para, neighborhood=neigh)


def parse_request(row: dict, where: str) -> EditRequest:
    if "src" in row and "alt" in row:
        return _from_zsre(row, where)
    return _from_counterfact(row, where)


def read_requests(path: str | Path) -> list[EditRequest]:
    """All requests of a JSONL file (an empty file gives an empty list)."""
    path = Path(path)
    if not path.is_file():
        raise UsageError(f"{path}: no such requests file")
    return [parse_request(row, f"{path}:{i}") for i, row in iter_jsonl(path)]


PACKAGED = {"counterfact-smollm2": Path(__file__).parent / "data" / "counterfact_smollm2.jsonl",
            "counterfact-gemma3": Path(__file__).parent / "data" / "counterfact_gemma3.jsonl"}


def resolve_requests(source: str | Path) -> Path:
    """A requests argument is a JSONL path or the name of the packaged edit set."""
    return PACKAGED.get(str(source), Path(source))

"""`llmtool example-data`: the README's input files (issue 45)."""
from __future__ import annotations

import csv
import json

from conftest import run_cli


def test_generated_files_are_what_their_commands_read(tmp_path):
    code, out, err = run_cli("example-data", "kvcache-prompts", "-o", tmp_path / "p.jsonl", "--n", "3")
    assert code == 0, err
    rows = [json.loads(l) for l in (tmp_path / "p.jsonl").read_text().splitlines()]
    assert len(rows) == 3 and len({r["answer"] for r in rows}) == 3
    for r in rows:  # the needle is in the context, and the question asks for it
        assert f"is: {r['answer']}." in r["context"] and r["question"].strip().endswith("is:")
        assert r["question"].split("for ")[1].split(" is")[0] in r["context"]

    code, out, err = run_cli("--seed", "3", "example-data", "sft", "-o", tmp_path / "s.jsonl", "--n", "10")
    assert code == 0, err
    for r in map(json.loads, (tmp_path / "s.jsonl").read_text().splitlines()):
        x, op, y = r["prompt"].removeprefix("What is ").split("?")[0].split()
        assert int(r["completion"]) == (int(x) + int(y) if op == "+" else int(x) * int(y))


def test_packaged_files_copy_whole_and_outputs_follow_the_file_convention(tmp_path):
    out = tmp_path / "m.csv"
    code, _, err = run_cli("example-data", "score-matrix", "-o", out)
    assert code == 0, err
    with out.open() as fh:
        rows = list(csv.DictReader(fh))
    assert len(rows) > 100 and set(rows[0]) >= {"item_id", "as-shipped"}
    assert {v for r in rows for k, v in r.items() if k != "item_id"} <= {"0", "1"}
    before = out.read_bytes()
    code, _, err = run_cli("example-data", "score-matrix", "-o", out)
    assert code == 2 and "already exists" in err and out.read_bytes() == before
    code, _, err = run_cli("example-data", "score-matrix", "-o", out, "--n", "5")
    assert code == 2 and "--n does not apply" in err
    code, _, err = run_cli("example-data", "judge-pairs", "-o", tmp_path / "j.jsonl", "--n", "2")
    assert code == 0, err
    pairs = [json.loads(l) for l in (tmp_path / "j.jsonl").read_text().splitlines()]
    assert len(pairs) == 2 and all({"id", "prompt", "response_a", "response_b"} <= set(p) for p in pairs)
    code, _, err = run_cli("example-data", "nope", "-o", tmp_path / "x")
    assert code == 2 and "unknown example" in err and not (tmp_path / "x").exists()

"""The committed tree names no directory of the machine that produced it (benchmark results, docs, code)."""
from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# home/work directories, and mkdtemp-style scratch dirs (a fixed prefix plus a random 8-char tail)
LOCAL_PATH = re.compile(r"(?<![\w.])/(?:home|root|work|Users)/\w|/tmp/[\w.-]*?[-_](?=[a-z0-9_]*\d)[a-z0-9_]{8}(?![\w-])")


def tracked_text_files() -> list[Path]:
    try:
        out = subprocess.run(["git", "ls-files"], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        pytest.skip("not a git checkout")
    keep = (".py", ".md", ".json", ".jsonl", ".sh", ".toml", ".txt", ".csv", ".cfg", ".yaml", ".yml")
    return [ROOT / p for p in out.splitlines() if p.endswith(keep) or p in ("Makefile", ".ci/run")]


def test_no_machine_local_paths_in_tracked_files():
    hits = []
    for p in tracked_text_files():
        if p.name == Path(__file__).name or not p.is_file():
            continue
        for n, line in enumerate(p.read_text(errors="replace").splitlines(), 1):
            if LOCAL_PATH.search(line):
                hits.append(f"{p.relative_to(ROOT)}:{n}: {line.strip()[:120]}")
    assert not hits, "machine-local paths committed:\n" + "\n".join(hits[:20])


def test_pattern_catches_what_it_should():
    assert LOCAL_PATH.search('"python": "/work/main/.venv/bin/python"')
    assert LOCAL_PATH.search("blocked: /tmp/lp-bench-8ryvhwlh/hostile/x")
    assert not LOCAL_PATH.search("OUT=${OUT:-/tmp/llmtool-compress-example}")
    assert not LOCAL_PATH.search("https://github.com/owner/work/x")

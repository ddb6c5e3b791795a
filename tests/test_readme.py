"""The README runs as written (issue 45): every ```bash block of README.md and every examples/*.sh.

Each README section's blocks run in order, in one fresh temporary directory outside the repository (so a
repo-relative path fails), with the virtualenv's ``bin`` first on PATH (so ``llmtool`` is the installed
console script) and ``HF_HUB_OFFLINE=1``. A block fails the test on a non-zero exit; since each section
starts in an empty directory, an example that reads a file no earlier line of its section made fails too.

Conventions (written in the README's "How to read the commands below"):

- ``# not-run: REASON`` as a block's first line: never run (installs, GPU, servers, hours). The reason is
  required; the test counts the skipped blocks and fails on a marker with an empty reason.
- ``# full-size: ...`` as a block's first line: runs only with ``LLMTOOL_README_FULL=1`` (it reuses its
  section's quick-path files).
- every other block is a *quick path* and runs.

Two ways to run (the lines of a block are never rewritten, so what runs is what the README says):

- ``make test`` (fast): the packaged alias ``smollm2-135m`` resolves, through a private ``$LLMTOOL_HOME``,
  to a tiny random Llama (8 layers, hidden 64, a chat template) — the commands, files and options are the
  README's, only the weights are tiny. The text corpus cache is shared with the real home when present.
- ``make test-slow``: the same blocks on the real packaged SmolLM2-135M (the real ``$LLMTOOL_HOME``), then
  every ``examples/*.sh``, each in its own temporary directory with ``OUT``/``W`` pointing into it.

``python tests/test_readme.py [--real] [--section WORD] [--examples]`` runs the blocks outside pytest and
prints each command's wall time (``--real``: on the packaged model; that is how the README's quick-path
times were measured).
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
EXAMPLES = sorted((ROOT / "examples").glob("*.sh"))
BIN = Path(sys.executable).parent
# the real $LLMTOOL_HOME (the packaged model materialized once), as in conftest.py; the autouse fixture there
# points $LLMTOOL_HOME at an empty per-test directory, so the real-model tests name this one explicitly
REAL_HOME = Path(os.environ.get("LLMTOOL_REAL_HOME", "~/.cache/llmtool")).expanduser()
MARK = re.compile(r"^#\s*(not-run|full-size)\s*:?(.*)$")


@dataclass
class Block:
    section: str
    line: int
    text: str
    mark: str | None  # None (quick path), "not-run" or "full-size"
    reason: str


def readme_blocks(text: str | None = None) -> list[Block]:
    """Every ```bash block of the README, with the heading it stands under and its marker."""
    text = README.read_text() if text is None else text
    out, section, lines, i = [], "top", text.splitlines(), 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#") and not line.startswith("#!") and re.match(r"^#{1,4} ", line):
            section = line.lstrip("#").strip()
        if line.strip() == "```bash":
            j = i + 1
            while j < len(lines) and lines[j].strip() != "```":
                j += 1
            body = "\n".join(lines[i + 1:j]) + "\n"
            first = next((l.strip() for l in body.splitlines() if l.strip()), "")
            m = MARK.match(first)
            out.append(Block(section, i + 1, body, m.group(1) if m else None, m.group(2).strip() if m else ""))
            i = j
        i += 1
    return out


def sections(blocks: list[Block]) -> dict[str, list[Block]]:
    by: dict[str, list[Block]] = {}
    for b in blocks:
        by.setdefault(b.section, []).append(b)
    return by


def slug(section: str) -> str:
    return re.sub(r"[^a-z0-9]+", "-", section.lower()).strip("-")[:40]


# ----------------------------------------------------------------------------------------- the tiny model
CHAT_TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
                 "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def make_tiny_home(home: Path) -> Path:
    """$LLMTOOL_HOME whose `smollm2-135m` is a tiny random Llama with the default model's layout of layers
    the presets name (edit's layers 3-7 exist), a chat template and a real (tiny) BPE tokenizer."""
    from conftest import save_tiny

    d = home / "models" / "smollm2-135m"
    if not (d / "config.json").is_file():
        save_tiny(d, num_hidden_layers=8, max_position_embeddings=2048)
        import json

        cfg_path = d / "tokenizer_config.json"
        cfg = json.loads(cfg_path.read_text())
        cfg["chat_template"] = CHAT_TEMPLATE
        cfg_path.write_text(json.dumps(cfg))
    real_text = REAL_HOME / "text"
    if real_text.is_dir() and not (home / "text").exists():
        shutil.copytree(real_text, home / "text")
    for name in ("debs",):  # the Debian package once fetched: no second download
        src = real_text.parent / name
        if src.is_dir() and not (home / name).exists():
            (home / name).symlink_to(src)
    return home


# ----------------------------------------------------------------------------------------------- running
def block_env(home: Path | None, workdir: Path) -> dict:
    env = {**os.environ, "PATH": f"{BIN}{os.pathsep}{os.environ.get('PATH', '')}", "HF_HUB_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false", "OUT": str(workdir / "out"), "W": str(workdir / "w"),
           "PYTHONPATH": ""}
    env.setdefault("OMP_NUM_THREADS", "2")
    if home is not None:
        env["LLMTOOL_HOME"] = str(home)
    return env


def run_block(text: str, cwd: Path, env: dict, timeout: int, timings: list | None = None,
              args: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    """Run ``text`` with bash -euo pipefail in ``cwd``; each command's start is stamped on fd 3 (BASH_XTRACEFD)
    so that per-command wall times can be printed without changing what runs."""
    trace = cwd / ".xtrace"
    script = ("set -euo pipefail\nexec 3>>" + str(trace) + "\nBASH_XTRACEFD=3\n"
              "PS4='+@$(date +%s.%N)@ '\nset -x\n" + text + "\nset +x\n")
    import resource

    t0, r0 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    p = subprocess.run(["bash", "-c", script, "readme-block", *args], cwd=cwd, env=env, capture_output=True,
                       text=True, timeout=timeout)
    end, r1 = time.time(), resource.getrusage(resource.RUSAGE_CHILDREN)
    # CPU seconds of the block's processes (what an idle machine would need, over its cores); only exact when
    # one block runs at a time (RUSAGE_CHILDREN adds every finished child of this process)
    p.cpu = (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)  # type: ignore[attr-defined]
    if timings is not None and trace.exists():
        stamps = []
        for line in trace.read_text().splitlines():
            m = re.match(r"^\++@([0-9.]+)@ (.*)$", line)
            if m and not m.group(2).startswith(("set +x", "date ")):
                stamps.append((float(m.group(1)), m.group(2)))
        for k, (t, cmd) in enumerate(stamps):
            if cmd.startswith("llmtool") or cmd.startswith(("head", "cat", "python")):
                nxt = stamps[k + 1][0] if k + 1 < len(stamps) else end
                timings.append((round(nxt - t, 1), cmd))
        trace.unlink()
    p.wall = end - t0  # type: ignore[attr-defined]
    return p


def check(p: subprocess.CompletedProcess, where: str) -> None:
    assert p.returncode == 0, (f"{where}: exit {p.returncode}\n--- stdout (tail)\n{p.stdout[-3000:]}\n"
                               f"--- stderr (tail)\n{p.stderr[-3000:]}")


# -------------------------------------------------------------------------------------------------- tests
def test_every_block_is_run_or_skipped_with_a_reason():
    blocks = readme_blocks()
    assert len(blocks) >= 20
    bad = [f"README.md:{b.line}" for b in blocks if b.mark and not b.reason]
    assert not bad, f"a skip marker needs a reason: {bad}"
    skipped = [b for b in blocks if b.mark == "not-run"]
    quick = [b for b in blocks if b.mark is None]
    # every command area has a quick path that runs
    areas = [s for s in sections(blocks) if s.startswith("`llmtool ")]
    assert len(areas) >= 12
    assert all(any(b.section == s for b in quick) for s in areas), [s for s in areas if not any(b.section == s for b in quick)]
    print(f"{len(blocks)} bash blocks: {len(quick)} quick paths, "
          f"{sum(b.mark == 'full-size' for b in blocks)} full-size, {len(skipped)} not run")


def test_parser_reads_markers_and_sections():
    text = ("# t\n```bash\n# not-run: needs a GPU\nx\n```\n## `llmtool a`\n```bash\necho hi\n```\n"
            "```bash\n# full-size: 3 min\ny\n```\n```bash\n# not-run:\nz\n```\n```python\nnope\n```\n")
    b = readme_blocks(text)
    assert [(x.section, x.mark, x.reason) for x in b] == [
        ("t", "not-run", "needs a GPU"), ("`llmtool a`", None, ""), ("`llmtool a`", "full-size", "3 min"),
        ("`llmtool a`", "not-run", "")]


def test_no_block_uses_a_repository_path():
    """Run as written from any directory: no block reads a path inside the repository."""
    bad = []
    for b in readme_blocks():
        if b.mark == "not-run":
            continue
        code = "\n".join(re.sub(r"(^|\s)#.*$", "", l) for l in b.text.splitlines())  # comments may name files
        for tok in re.findall(r"(?<![\w/.-])((?:llmtool|benchmarks|tests|examples|docs)/[\w./-]+)", code):
            bad.append(f"README.md:{b.line}: {tok}")
    for script in EXAMPLES:  # the scripts too: nothing read relative to the checkout
        if 'dirname "$0"' in script.read_text() or "BASH_SOURCE" in script.read_text():
            bad.append(f"{script.name}: reads files relative to the checkout")
    assert not bad, bad


def _run_sections(home: Path | None, tmp_path: Path, full: bool, timeout: int, workers: int = 1) -> list[str]:
    """Run each section's blocks in order in its own directory; sections in parallel on ``workers``
    threads (``$LLMTOOL_README_WORKERS``; each section's commands stay sequential)."""
    from concurrent.futures import ThreadPoolExecutor

    def one(name: str, todo: list[Block]) -> str:
        work = tmp_path / slug(name)
        work.mkdir()
        env = block_env(home, work)
        for b in todo:
            p = run_block(b.text, work, env, timeout)
            check(p, f"README.md:{b.line} ({name})")
        return name

    jobs = [(n, [b for b in bs if b.mark is None or (b.mark == "full-size" and full)])
            for n, bs in sections(readme_blocks()).items()]
    jobs = [(n, todo) for n, todo in jobs if todo]
    workers = int(os.environ.get("LLMTOOL_README_WORKERS", workers))
    with ThreadPoolExecutor(max_workers=max(1, workers)) as pool:
        futures = [pool.submit(one, n, todo) for n, todo in jobs]
        errors, ran = [], []
        for f in futures:
            try:
                ran.append(f.result())
            except AssertionError as e:
                errors.append(str(e))
    assert not errors, "\n\n".join(errors)
    return ran


def test_readme_quick_paths_run_on_a_tiny_model(tmp_path):
    """Every quick path, as written, against a tiny random model behind the `smollm2-135m` alias."""
    home = make_tiny_home(tmp_path / "home")
    ran = _run_sections(home, tmp_path, full=os.environ.get("LLMTOOL_README_FULL") == "1", timeout=900, workers=2)
    assert len(ran) >= 12


@pytest.mark.slow
def test_readme_quick_paths_run_on_the_packaged_model(tmp_path):
    ran = _run_sections(REAL_HOME, tmp_path, full=os.environ.get("LLMTOOL_README_FULL") == "1", timeout=3600)
    assert len(ran) >= 12


@pytest.mark.slow
@pytest.mark.parametrize("script", EXAMPLES, ids=[p.name for p in EXAMPLES])
def test_examples_run_from_any_directory(script, tmp_path):
    env = block_env(REAL_HOME, tmp_path)
    p = run_block(f'bash "{script}" "$W"\n', tmp_path, env, timeout=7200)
    check(p, script.name)


def main(argv: list[str]) -> int:
    import argparse
    import tempfile

    ap = argparse.ArgumentParser(description="Run the README's bash blocks and print each command's time.")
    ap.add_argument("--real", action="store_true", help="Use the packaged model (real $LLMTOOL_HOME).")
    ap.add_argument("--section", default="", help="Only sections whose heading contains this word.")
    ap.add_argument("--full", action="store_true", help="Also the # full-size blocks.")
    ap.add_argument("--examples", action="store_true", help="Run examples/*.sh instead of the README.")
    a = ap.parse_args(argv)
    sys.path.insert(0, str(Path(__file__).parent))
    tmp = Path(tempfile.mkdtemp(prefix="llmtool-readme-"))
    home = None if a.real else make_tiny_home(tmp / "home")
    failed = 0
    jobs = ([(s.name, [Block(s.name, 0, f'bash "{s}" "$W"\n', None, "")]) for s in EXAMPLES
             if a.section in s.name] if a.examples else
            [(n, [b for b in bs if b.mark is None or (b.mark == "full-size" and a.full)])
             for n, bs in sections(readme_blocks()).items() if a.section in n])
    for name, blocks in jobs:
        if not blocks:
            continue
        work = tmp / slug(name)
        work.mkdir()
        env = block_env(home, work)
        for b in blocks:
            timings: list = []
            p = run_block(b.text, work, env, timeout=7200, timings=timings)
            print(f"== {name} (README.md:{b.line}) exit {p.returncode}, {p.wall:.0f} s wall, {p.cpu:.0f} s CPU",
                  flush=True)
            for t, cmd in timings:
                print(f"  {t:7.1f} s  {cmd[:160]}", flush=True)
            if p.returncode:
                failed += 1
                print(p.stderr[-2500:], flush=True)
                break
    print(f"workdir {tmp}; {failed} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

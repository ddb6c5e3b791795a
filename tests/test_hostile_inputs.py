"""The hostile-input suite through real `llmtool` processes (issue 39, "the residue of the exit-code contract").

`tests/test_reliability.py` walks every command in-process; this file runs `python -m llmtool` as a user would
for at least one case of each class the issue lists, because some failures only show in a real process: a
FIFO that blocks `open` forever, a SIGTERM, a rich markup error raised while printing, an exception that an
in-process runner would swallow. Every refusal must be: exit 2, exactly one `error:` line naming the file or
option, no traceback, no "internal error", nothing written (no OUT, no temp dir), inputs byte-identical, and
within a timeout (a hang fails the case).

Classes: user errors that used to end as `internal error` (config.json a JSON list / not UTF-8 / nested too
deeply, a weight file that is a directory, a symlink loop, non-UTF-8 CSV/spec/task files, a CSV field over
csv's default 131,072-character limit, zero attention heads, auto_map in a sub-config, OUT under /proc,
`judge-synth --tau nan`); tracebacks (rich markup in a path, before and after an output is written); hangs
(a FIFO as weight file); accepted garbage (int32 weights, a shard index pointing outside the checkpoint,
autograder fits on empty/NaN/string scores or `--levels 10:0`, non-UTF-8 task data, `--train 0`); option
values checked only after the model loaded (`route train --stage bogus`, `edit keystone find --score bogus`);
unbounded counts (`--threads 1000000`, batch sizes, worker processes); SIGTERM; stale `.OUT.old-*` and temp
dirs of killed writers.
"""
from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import save_tiny
from test_reliability import BAD_MODELS

ENV = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}


def llmtool(*args, timeout: float = 60, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python -m llmtool ARGS` in a fresh process; a run past ``timeout`` (a hang) fails the test."""
    try:
        return subprocess.run([sys.executable, "-m", "llmtool", *map(str, args)], capture_output=True, text=True,
                              timeout=timeout, env={**ENV, **(env or {})}, stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        pytest.fail(f"llmtool {' '.join(map(str, args))}: no answer within {timeout} s (a hang)")


def one_error_line(p: subprocess.CompletedProcess, code: int = 2) -> str:
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert p.returncode == code, (p.returncode, p.stderr[-2000:])
    assert "Traceback" not in p.stderr and "internal error" not in p.stderr, p.stderr[-2000:]
    assert len(lines) == 1 and lines[0].startswith("error:"), p.stderr[-2000:]
    return lines[0]


def sha_tree(path: Path) -> dict[str, str]:
    files = [path] if path.is_file() else sorted(p for p in path.rglob("*") if p.is_file())
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest() for p in files}


def nothing_written(where: Path, name: str = "out") -> None:
    assert not (where / name).exists(), f"{where / name} was written"
    assert not list(where.glob(f".{name}.*")), list(where.glob(f".{name}.*"))


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    return save_tiny(tmp_path_factory.mktemp("hostile") / "tiny")


# ------------------------------------------------------------------------------ hostile checkpoints, real process
# The classes added for issue 39 (the older ones run in test_reliability's in-process walk over every command).
NEW_CHECKPOINTS = ["config-is-a-list", "config-not-utf8", "config-too-deep", "weights-are-a-dir",
                   "weights-symlink-loop", "weights-fifo", "zero-heads", "nested-auto-map", "int32-weights",
                   "index-outside-dir", "tokenizer-fifo"]


@pytest.mark.parametrize("case", NEW_CHECKPOINTS)
def test_hostile_checkpoint_in_a_real_process(case, tiny, tmp_path):
    make, needle = BAD_MODELS[case]
    model = tmp_path / case
    shutil.copytree(tiny, model)
    make(model)
    before = sha_tree(model)
    t0 = time.time()
    p = llmtool("compress", model, tmp_path / "out", "--ratio", "0.2", timeout=60)
    line = one_error_line(p)
    assert needle in line and case in line, line
    assert time.time() - t0 < 60
    nothing_written(tmp_path)
    assert sha_tree(model) == before


# ------------------------------------------------------------------------------ data files and option values
def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _task_dir(root: Path, train: bytes) -> Path:
    d = root / "taskdata"
    _write(d / "train.txt", train)
    _write(d / "val.txt", b"0101 -> 0\n1100 -> 0\n")
    _write(d / "test.txt", b"1000 -> 1\n")
    return d


# name: (argv with {t} = tmp dir and {model}, files to create {name: bytes}, needle in the error line)
CASES: dict[str, tuple[list[str], dict[str, bytes], str]] = {
    "out-under-proc": (["compress", "{model}", "/proc/self/llmtool-out", "--ratio", "0.2"], {}, "/proc"),
    "judge-synth-tau-nan": (["evaluate", "judge-synth", "{t}/out", "--tau", "nan"], {}, "--tau"),
    "judge-synth-omega-inf": (["evaluate", "judge-synth", "{t}/out", "--omega", "inf"], {}, "--omega"),
    "csv-not-utf8-autograder": (["evaluate", "autograder", "fit", "--data", "{t}/grades.csv", "-o", "{t}/out"],
                                {"grades.csv": b"score,grader\n1,a\n2,\xff\xfe\n"}, "not UTF-8"),
    "csv-not-utf8-sysr": (["evaluate", "sysr", "--responses", "{t}/wide.csv"],
                          {"wide.csv": b"item_id,m1,m2\nq1,1,0\nq2,\xff,1\n"}, "not UTF-8"),
    "csv-field-over-131072": (["evaluate", "autograder", "fit", "--data", "{t}/long.csv", "-o", "{t}/out"],
                              {"long.csv": b"score,grader\n1,a\n" + b"x" * 140_000 + b",b\n"},
                              "non-numeric value"),
    "spec-not-utf8": (["bench-agent", "rewrite-spec", "--env", "grid-nav", "--spec", "{t}/spec.json"],
                      {"spec.json": b'{"synonyms": {"\xff": "x"}}'}, "not UTF-8"),
    "jsonl-nested-too-deeply": (["evade", "metrics", "{t}/deep.jsonl", "{t}/ok.jsonl"],
                                {"deep.jsonl": b"[" * 200_000 + b"]" * 200_000 + b"\n",
                                 "ok.jsonl": b'{"score": 1.5, "is_watermarked": false, "score_kind": "z"}\n'},
                                "nested too deeply"),
    "autograder-empty-csv": (["evaluate", "autograder", "fit", "--data", "{t}/empty.csv", "-o", "{t}/out"],
                             {"empty.csv": b"score,grader\n"}, "no rows"),
    "autograder-nan-score": (["evaluate", "autograder", "fit", "--data", "{t}/nan.csv", "-o", "{t}/out"],
                             {"nan.csv": b"score,grader\n1,a\nnan,b\n2,a\n"}, "non-finite"),
    "autograder-string-score": (["evaluate", "autograder", "fit", "--data", "{t}/str.csv", "-o", "{t}/out"],
                                {"str.csv": b"score,grader\n1,a\nabc,b\n2,a\n"}, "non-numeric"),
    "autograder-levels-reversed": (["evaluate", "autograder", "fit", "--data", "{t}/ok.csv", "--levels", "10:0",
                                    "-o", "{t}/out"], {"ok.csv": b"score,grader\n1,a\n2,b\n3,a\n"}, "--levels"),
    "task-data-not-utf8": (["learn-program", "run", "{t}/out", "--data", "{t}/taskdata", "--proposer", "mock:parity"],
                           {}, "not UTF-8"),
    "learn-program-train-0": (["learn-program", "run", "{t}/out", "--task", "parity_all", "--length", "8",
                               "--train", "0", "--proposer", "mock:parity"], {}, "--train"),
    "grpo-loss-bogus": (["train", "grpo", "{model}", "{t}/out", "--data", "gen:sum-two:8", "--loss", "bogus"], {},
                        "--loss 'bogus'"),
    "grpo-loss-agg-bogus": (["train", "grpo", "{model}", "{t}/out", "--data", "gen:sum-two:8", "--loss-agg", "x"],
                            {}, "--loss-agg 'x'"),
    "label-majority-keep-bogus": (["train", "label-majority", "{model}", "--data", "gen:sum-two:8", "--keep", "bogus",
                                   "-o", "{t}/rows.jsonl"], {}, "--keep 'bogus'"),
    "threads-beyond-cores": (["--threads", "1000000", "models", "list"], {}, "--threads 1000000"),
    "threads-after-command": (["evaluate", "ppl", "{model}", "--threads", "1000000"], {}, "--threads 1000000"),
    "batch-size-beyond-bound": (["evaluate", "ppl", "{model}", "--batch-size", "1000000000"], {}, "--batch-size"),
    "workers-beyond-cores": (["evaluate", "bai-sim", "--synthetic", "irt", "--workers", "100000", "-o",
                              "{t}/out.csv"], {}, "--workers 100000"),
    "calib-samples-beyond-bound": (["compress", "{model}", "{t}/out", "--ratio", "0.2", "--calib-samples",
                                    "100000000000"], {},
                                   "--calib-samples"),
    "route-train-stage-bogus": (["route", "train", "{t}/out", "--data", "{t}/rows.jsonl", "--stage", "bogus"],
                                {"rows.jsonl": b'{"prompt": "a", "response": "b"}\n'}, "--stage 'bogus'"),
    "keystone-find-score-bogus": (["edit", "keystone", "find", "{model}", "-o", "{t}/out", "--score", "bogus"], {},
                                  "--score 'bogus'"),
    "calib-data-unknown-name": (["compress", "{model}", "{t}/out", "--ratio", "0.2", "--calib-data", "bogus"], {},
                                "bogus: no such data file or dataset"),
    "eval-data-unknown-name": (["evaluate", "ppl", "{model}", "--data", "bogus"], {},
                               "bogus: no such data file or dataset"),
    "tasks-filler-unknown-name": (["evaluate", "tasks", "{model}", "--task", "ppl", "--filler", "bogus"], {},
                                  "bogus: no such data file or dataset"),
    "route-data-unknown-domain": (["route", "data", "{t}/out", "--domains", "bogus"], {}, "unknown domain 'bogus'"),
    "data-input-is-a-fifo": (["evaluate", "judge", "--votes", "{t}/votes.jsonl", "-o", "{t}/out"], {},
                             "votes.jsonl: not a regular file (a FIFO)"),
    "markup-in-a-missing-path": (["compress", "{t}/x[/bold]y", "{t}/out", "--ratio", "0.2"], {}, "x[/bold]y"),
}


def _setup(case: str, tmp_path: Path) -> None:
    for name, data in CASES[case][1].items():
        _write(tmp_path / name, data)
    if case == "task-data-not-utf8":
        _task_dir(tmp_path, b"0110 -> 0\n\xff\xfe10 -> 1\n")
    if case == "data-input-is-a-fifo":
        os.mkfifo(tmp_path / "votes.jsonl")


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_value_or_file_in_a_real_process(case, tiny, tmp_path):
    _setup(case, tmp_path)
    argv = [a.format(t=tmp_path, model=tiny) for a in CASES[case][0]]
    before = sha_tree(tmp_path)
    model_before = sha_tree(tiny)
    line = one_error_line(llmtool(*argv, timeout=120))
    assert CASES[case][2] in line, line
    assert len(line) < 400, "an error line quotes at most a short piece of a value"
    nothing_written(tmp_path)
    assert sha_tree(tmp_path) == before and sha_tree(tiny) == model_before


def test_threads_env_is_bounded_too(tiny):
    line = one_error_line(llmtool("evaluate", "ppl", tiny, "--max-tokens", "64", env={"LLMTOOL_THREADS": "1000000"}))
    assert "$LLMTOOL_THREADS 1000000" in line


def test_value_checks_come_before_heavy_imports(tiny, tmp_path):
    """Option values are refused before torch/transformers are imported (they took 54-57 s after the model
    loaded): the process makes importing either an error, so a check that comes after them fails the case."""
    fast = ["route-train-stage-bogus", "keystone-find-score-bogus", "autograder-levels-reversed",
            "threads-after-command", "batch-size-beyond-bound", "workers-beyond-cores", "judge-synth-tau-nan",
            "learn-program-train-0", "calib-samples-beyond-bound", "calib-data-unknown-name",
            "eval-data-unknown-name", "tasks-filler-unknown-name", "route-data-unknown-domain",
            "grpo-loss-bogus", "grpo-loss-agg-bogus", "label-majority-keep-bogus"]
    for case in fast:
        _setup(case, tmp_path)
    cases = {c: [a.format(t=tmp_path, model=tiny) for a in CASES[c][0]] for c in fast}
    code = ("import io, json, sys, contextlib\n"
            "sys.modules['torch'] = None\nsys.modules['transformers'] = None\n"
            "from llmtool.cli import main\n"
            f"cases = {cases!r}\nres = {{}}\n"
            "for name, argv in cases.items():\n"
            "    sys.argv = ['llmtool', *argv]\n    err = io.StringIO()\n    rc = 0\n"
            "    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):\n"
            "        try:\n            main()\n        except SystemExit as e:\n            rc = e.code\n"
            "    res[name] = [rc, err.getvalue()]\n"
            "print(json.dumps(res))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=ENV)
    assert p.returncode == 0, p.stderr[-3000:]
    res = json.loads(p.stdout.strip().splitlines()[-1])
    bad = {c: r for c, r in res.items()
           if r[0] != 2 or CASES[c][2] not in r[1] or len([l for l in r[1].splitlines() if l.strip()]) != 1}
    assert not bad, bad


def test_count_bounds_have_one_home():
    """Every bound comes from core/options.py's table; the CPU bound follows the process's affinity mask."""
    from llmtool.core.options import COUNT_BOUNDS, available_cpus, count_bound

    assert available_cpus() == len(os.sched_getaffinity(0))
    assert count_bound("threads")[0] == available_cpus() and count_bound("workers")[0] == available_cpus()
    assert count_bound("batch_size")[0] < 10**9 and count_bound("max_new_tokens")[0] < 10**9
    assert count_bound("steps")[0] >= 10**7  # generous: steps cost time, and a per-step record each
    assert count_bound("seed") is None  # not a count
    from llmtool.core.options import CORES, LIMITS, MEMORY_MB

    assert all(v in LIMITS or v in (CORES, MEMORY_MB) for v in COUNT_BOUNDS.values())


def test_keystone_score_choices_match_the_method():
    from llmtool.edit import keystone, keystone_cli

    assert keystone_cli.SCORES == keystone.SCORES


# ------------------------------------------------------------------------------ tracebacks from rich markup
def test_markup_in_the_output_path_never_crashes_after_writing(tiny, tmp_path):
    """`compress` wrote its whole output and then crashed on printing a path with rich markup in it."""
    where = tmp_path / "x[/bold]y"  # (also a sub-directory: x[ / bold]y)
    where.mkdir(parents=True)
    p = llmtool("compress", "--method", "svd", tiny, where / "out", "--ratio", "0.2", timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    assert "Traceback" not in p.stderr and "error" not in p.stderr, p.stderr[-2000:]
    assert "x[/bold]y" in p.stdout  # printed as typed, not interpreted
    assert (where / "out" / "llmtool.json").is_file()


# ------------------------------------------------------------------------------ SIGTERM and killed writers
SLOW_LOAD = """
import sys, time
import llmtool.core.models as models
def slow(*a, **k):
    open({ready!r}, "w").close()
    time.sleep(300)
models.load_model = slow
from llmtool.cli import main
sys.argv = ["llmtool", *{argv!r}]
main()
"""


def test_sigterm_is_handled_like_ctrl_c(tiny, tmp_path):
    """A writing command terminated mid-run (SIGTERM while the model loads, its temp dir existing): one line
    `error: terminated`, exit 143, no OUT and no temp dir, inputs unchanged."""
    ready = tmp_path / "ready"
    argv = ["compress", "--method", "svd", str(tiny), str(tmp_path / "out"), "--ratio", "0.2"]
    before = sha_tree(tiny)
    proc = subprocess.Popen([sys.executable, "-c", SLOW_LOAD.format(ready=str(ready), argv=argv)], env=ENV,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.time() + 120
        while not ready.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.2)
        assert ready.exists(), proc.communicate(timeout=5)[1][-2000:] if proc.poll() is not None else "no start"
        assert list(tmp_path.glob(".out.tmp-*")), "the temp dir must exist when the signal arrives"
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    lines = [line for line in err.splitlines() if line.strip()]
    assert proc.returncode == 143, err[-2000:]
    assert lines == ["error: terminated"], err[-2000:]
    nothing_written(tmp_path)
    assert sha_tree(tiny) == before


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_stale_old_dir_is_restored_when_out_is_missing(tmp_path):
    """Killed between the two renames of --overwrite: OUT is missing and `.OUT.old-PID` holds the previous
    result. The next run on that OUT (here refused, since OUT exists again) puts it back and removes the
    dead writer's temp dir."""
    pid = _dead_pid()
    old = tmp_path / f".out.old-{pid}"
    old.mkdir()
    (old / "votes.jsonl").write_text("previous\n")
    tmp = tmp_path / f".out.tmp-{pid}-abc"
    tmp.mkdir()
    (tmp / "half").write_text("x")
    line = one_error_line(llmtool("evaluate", "judge-synth", tmp_path / "out", "--items", "10"))
    assert "already exists" in line
    assert (tmp_path / "out" / "votes.jsonl").read_text() == "previous\n"
    assert not old.exists() and not tmp.exists()


def test_stale_old_dir_is_removed_when_out_exists(tmp_path):
    """Killed after the second rename: OUT is the new result and `.OUT.old-PID` is garbage; an --overwrite run
    removes it and writes OUT."""
    pid = _dead_pid()
    old = tmp_path / f".out.old-{pid}"
    old.mkdir()
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "votes.jsonl").write_text("new\n")
    p = llmtool("evaluate", "judge-synth", tmp_path / "out", "--items", "10", "--overwrite")
    assert p.returncode == 0, p.stderr[-2000:]
    assert not old.exists()
    assert (tmp_path / "out" / "votes.jsonl").read_text() != "new\n"
    assert [q.name for q in tmp_path.iterdir()] == ["out"]


def test_live_writers_temp_dirs_are_kept(tmp_path):
    """Only dead writers' leftovers are touched: a temp dir of a running process stays."""
    live = tmp_path / f".out.tmp-{os.getpid()}-live"
    live.mkdir()
    one_error_line(llmtool("evaluate", "judge-synth", tmp_path / "out", "--tau", "-1"))
    assert live.is_dir()


def test_swap_interrupted_between_renames_restores_previous_out(tmp_path, monkeypatch):
    """The in-process half of the --overwrite swap: an exception (SIGTERM) right after OUT was moved aside puts
    the previous OUT back before unwinding."""
    from llmtool.core import checkpoint
    from llmtool.core.console import Terminated

    out = tmp_path / "out"
    out.mkdir()
    (out / "f").write_text("previous")
    real_rename = Path.rename

    def rename(self, target):
        if self.name.startswith(".out.tmp-"):
            raise Terminated()
        return real_rename(self, target)

    monkeypatch.setattr(Path, "rename", rename)
    with pytest.raises(Terminated):
        with checkpoint.atomic_output(out, overwrite=True) as tmp:
            (tmp / "f").write_text("new")
    monkeypatch.setattr(Path, "rename", real_rename)
    assert (out / "f").read_text() == "previous"
    assert [q.name for q in tmp_path.iterdir()] == ["out"]


def test_csv_field_over_the_default_limit_is_data(tmp_path):
    """A field longer than csv's default 131,072-character limit was an internal `csv.Error`; the CLI raises
    the limit, so it is read as data (here an item id of 140,000 characters in a results matrix)."""
    rows = ["item_id,m1,m2", *(f"q{i},1,0" for i in range(20)), "q" + "x" * 140_000 + ",1,0"]
    (tmp_path / "wide.csv").write_text("\n".join(rows) + "\n")
    p = llmtool("evaluate", "sysr", "--responses", tmp_path / "wide.csv", "--budget", "10", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    assert json.loads(p.stdout)["best"] == "m1"  # m1 is right on every item, m2 on none


def test_forked_workers_get_the_default_sigterm():
    """Process-pool workers forked from a command must die on the SIGTERM their pool sends them, not unwind."""
    code = ("import os, signal\nimport llmtool.cli as c\n"
            "signal.signal(signal.SIGTERM, c._raise_terminated)\npid = os.fork()\n"
            "if pid == 0:\n    os._exit(0 if signal.getsignal(signal.SIGTERM) == signal.SIG_DFL else 3)\n"
            "_, status = os.waitpid(pid, 0)\nprint(os.waitstatus_to_exitcode(status))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, env=ENV)
    assert p.returncode == 0 and p.stdout.strip() == "0", (p.stdout, p.stderr[-2000:])


def test_user_errors_that_escape_a_command_are_still_one_line(monkeypatch, capsys, tmp_path):
    """The root's backstop: an OSError naming a path, a non-UTF-8 decode or a RecursionError that a command's own
    checks let through is exit 2 with one line (never `internal error`); anything else stays an internal error."""
    import errno

    import llmtool.evaluate.stats_cli  # noqa: F401  (registers `evaluate judge-synth`)
    from llmtool.cli import main, user_error_message
    from llmtool.evaluate import judge_btd

    assert user_error_message(IsADirectoryError(errno.EISDIR, "Is a directory", "in.csv")) == "in.csv: Is a directory"
    assert "nested too deeply" in user_error_message(RecursionError())
    assert "not UTF-8" in user_error_message(UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"))
    assert user_error_message(ValueError("x")) is None and user_error_message(OSError("no filename")) is None

    def deep(*a, **k):
        raise RecursionError("maximum recursion depth exceeded")

    monkeypatch.setattr(judge_btd, "synthetic_counts", deep)
    monkeypatch.setattr(sys, "argv", ["llmtool", "evaluate", "judge-synth", str(tmp_path / "out")])
    with pytest.raises(SystemExit) as e:
        main()
    err = capsys.readouterr().err
    assert e.value.code == 2, err
    assert [l for l in err.splitlines() if l.strip()] == [
        "error: an input is nested too deeply (structured data beyond Python's recursion limit)"]
    assert not (tmp_path / "out").exists()

    # a decode error names the file the innermost llmtool frame was reading (here a cached JSON)
    from llmtool.edit import prompts

    bad = tmp_path / "fp" / "templates-seed0.json"
    bad.parent.mkdir()
    bad.write_bytes(b'["\xff"]')
    monkeypatch.setattr(judge_btd, "synthetic_counts",
                        lambda *a, **k: prompts.cached_templates(None, None, "fp", 0, tmp_path))
    with pytest.raises(SystemExit) as e:
        main()
    line = one_error_line(subprocess.CompletedProcess([], e.value.code, "", capsys.readouterr().err))
    assert line.startswith(f"error: {bad}: not UTF-8 text"), line

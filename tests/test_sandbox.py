"""Tests for llmtool.core.sandbox: hostile programs blocked, call_many semantics, layers on their own."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from llmtool.core.sandbox import SandboxLimits, call_many, run_python, sandbox_available
from llmtool.learn_program.hostile import FILE_SECRET, PROGRAMS, run_hostile_suite

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rlimits/seccomp are Linux-only")


@linux_only
def test_every_hostile_program_is_blocked(tmp_path):
    records = run_hostile_suite(tmp_path)
    assert [r["name"] for r in records] == list(PROGRAMS)
    escaped = [(r["name"], r["escape"]) for r in records if not r["blocked"]]
    assert escaped == []
    by = {r["name"]: r for r in records}
    # spec 8.3 specifics
    assert by["infinite_loop"]["timed_out"] and by["infinite_loop"]["seconds"] < 3 + 2 + 1
    assert by["cpu_burn"]["violation"] == "cpu_time"
    assert by["print_100mb"]["violation"] == "output_limit"
    assert by["write_outside"]["violation"].startswith("blocked: open for writing outside")
    for name in ("os_system", "subprocess", "socket", "fork", "ctypes"):
        assert by[name]["returncode"] != 0 and by[name]["violation"], name
    # nothing outside the sandbox dir was touched: only the planted file exists in each outside dir
    for d in tmp_path.iterdir():
        assert sorted(p.name for p in d.iterdir()) == ["keep.txt"], d
        assert (d / "keep.txt").read_text() == FILE_SECRET


@linux_only
def test_seccomp_layer_alone_stops_fork_exec_socket_kill():
    if not sandbox_available()["seccomp"]:
        pytest.skip("pyseccomp/libseccomp not available")
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"], start_new_session=True)
    code = f"""
import os, socket, threading
def attempt(name, fn):
    try:
        fn()
        print(name, "OK")
    except OSError as e:
        print(name, "errno", e.errno)
attempt("fork", lambda: os.fork())
attempt("socket", lambda: socket.socket())
attempt("exec", lambda: os.execv("/bin/true", ["true"]))
attempt("kill", lambda: os.kill({victim.pid}, 9))
out = []
t = threading.Thread(target=lambda: out.append(41 + 1)); t.start(); t.join()
print("thread", out[0])
"""
    try:
        res = run_python(code, _audit_hook=False)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert lines == {"fork": "errno 1", "socket": "errno 1", "exec": "errno 1", "kill": "errno 1", "thread": "42"}, res


def test_threads_allowed_or_not():
    code = "import threading\nr=[]\nt=threading.Thread(target=lambda: r.append(1)); t.start(); t.join(); print(r)"
    assert run_python(code).stdout.strip() == "[1]"
    if sandbox_available()["seccomp"]:
        res = run_python(code, limits=SandboxLimits(allow_threads=False))
        assert res.returncode != 0 and "[1]" not in res.stdout


def test_run_python_stdin_files_and_cwd_cleanup():
    res = run_python(
        "import os, sys\nprint(sys.stdin.read().upper())\nprint(open('data/in.txt').read())\n"
        "open('made.txt','w').write('x')\nprint(os.getcwd())",
        stdin="hello", files={"data/in.txt": "payload"},
    )
    assert res.returncode == 0 and res.violation is None
    out = res.stdout.splitlines()
    assert out[:2] == ["HELLO", "payload"]
    import os

    assert not os.path.exists(out[2])  # temp cwd removed afterwards
    with pytest.raises(ValueError):
        run_python("pass", files={"../escape.txt": "x"})


def test_call_many_semantics():
    code = (
        "def f(x, k=1):\n"
        "    print('noise to stdout')\n"
        "    if x == 'boom':\n        raise ValueError('bad input')\n"
        "    if x == 'obj':\n        return object()\n"
        "    return (x.count('1') * k) % 2, x[::-1]\n"
    )
    res = call_many(code, "f", [["1101"], ("0110", 3), ["boom"], ["obj"], "111"])
    assert res[0].ok and res[0].value == [1, "1011"]  # tuple JSON round-tripped to a list
    assert res[1].ok and res[1].value == [0, "0110"]
    assert not res[2].ok and "ValueError: bad input" in res[2].error
    assert not res[3].ok and "unserialisable" in res[3].error
    assert res[4].ok and res[4].value == [1, "111"]  # a bare value is passed as the single argument
    assert call_many(code, "f", []) == []


def test_call_many_fatal_errors_fail_every_input():
    res = call_many("def f(x):\n    return x +\n", "f", [[1], [2]])
    assert all(not r.ok and "SyntaxError" in r.error for r in res)
    res = call_many("def g(x):\n    return x\n", "f", [[1]])
    assert not res[0].ok and "not defined" in res[0].error
    res = call_many("import os\nos.system('true')\ndef f(x):\n    return x\n", "f", [[1]])
    assert not res[0].ok and "blocked os.system" in res[0].error


def test_call_many_timeout_keeps_earlier_results():
    code = "def f(x):\n    while x == 2:\n        pass\n    return x * 10\n"
    t0 = time.monotonic()
    res = call_many(code, "f", [[0], [1], [2], [3]], limits=SandboxLimits(wall_seconds=2, cpu_seconds=30))
    assert time.monotonic() - t0 < 2 + 3
    assert [r.value for r in res[:2]] == [0, 10] and all(r.ok for r in res[:2])
    assert all(not r.ok and "timed out" in r.error for r in res[2:])


def test_call_many_crash_marks_remaining_failed():
    code = "import os\ndef f(x):\n    if x == 1:\n        os._exit(3)\n    return x\n"
    res = call_many(code, "f", [[0], [1], [2]])
    assert res[0].ok and res[0].value == 0
    assert not res[1].ok and "exit 3" in res[1].error and not res[2].ok


def test_call_many_ten_thousand_inputs_in_one_process():
    xs = [[format(i, "b").zfill(100)] for i in range(10_000)]
    t0 = time.monotonic()
    res = call_many("def f(x):\n    return x.count('1') % 2\n", "f", xs)
    dt = time.monotonic() - t0
    assert [r.value for r in res] == [x[0].count("1") % 2 for x in xs]
    assert dt < 20, dt  # seconds, not minutes (one process per candidate)


def test_wrapper_prefix_and_availability():
    info = sandbox_available()
    for key in ("seccomp", "audit_hook", "rlimits", "bwrap", "isolated_process", "empty_env"):
        assert key in info
    env = shutil.which("env")
    if env:
        res = run_python("print(6 * 7)", wrapper=[env])
        assert res.stdout.strip() == "42"


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap not installed")
def test_bwrap_wrapper(tmp_path):
    wrapper = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--bind", "{cwd}", "{cwd}",
               "--unshare-all", "--die-with-parent"]
    probe = subprocess.run(wrapper[:-1] + ["true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("bwrap cannot create namespaces here")
    res = run_python("open('x.txt','w').write('1'); print(open('x.txt').read())", wrapper=wrapper)
    assert res.stdout.strip() == "1"
    rec = run_hostile_suite(tmp_path, ["write_outside", "os_system"], wrapper=wrapper)
    assert all(r["blocked"] for r in rec)

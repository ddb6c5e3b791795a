"""Tests for llmtool.core.sandbox: hostile programs blocked (with and without the audit hook, each kernel
layer on its own), refusal without a kernel layer, the result channel and harness sentinel, call_many
semantics."""

from __future__ import annotations

import shutil
import subprocess
import sys
import time

import pytest

from llmtool.core.console import UsageError
from llmtool.core.sandbox import (DISABLE_ENV, SandboxLimits, active_layers, call_many, run_python,
                                  sandbox_available)
from llmtool.learn_program.hostile import FILE_SECRET, KERNEL_FILE_ATTACKS, PROGRAMS, run_hostile_suite

linux_only = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="rlimits/seccomp are Linux-only")


def _layers(disable: str = "") -> dict:
    import os

    old = os.environ.get(DISABLE_ENV)
    os.environ[DISABLE_ENV] = disable
    try:
        return active_layers()
    except UsageError:
        return {}
    finally:
        if old is None:
            os.environ.pop(DISABLE_ENV, None)
        else:
            os.environ[DISABLE_ENV] = old


# every test here runs generated code, which the sandbox refuses without a kernel containment layer
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux") or not _layers(),
                                reason="no kernel containment layer (Landlock or user+mount namespaces) here")


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
    # issue 39 classes: tampering with the hook is contained by the kernel (the hook itself was defeated
    # or not, nothing happened outside), forged results and early exits never complete the harness
    for name in ("result_forgery", "early_sys_exit", "early_os_exit", "always_equal", "patch_builtins"):
        assert not by[name]["completed"], name
    assert by["disk_fill"]["returncode"] == 0 and by["inode_fill"]["returncode"] == 0   # ran, cap held
    lay = by["write_outside"]["layers"]
    assert lay["landlock"] >= 1 or lay["mountns"]
    # nothing outside the sandbox dir was touched: only the planted file exists in each outside dir
    for d in tmp_path.iterdir():
        if d.name in ("secret", "canary"):
            continue
        assert sorted(p.name for p in d.iterdir()) == ["keep.txt"], d
        assert (d / "keep.txt").read_text() == FILE_SECRET
    assert (tmp_path / "secret" / "credentials.txt").read_text() == FILE_SECRET
    assert sorted(str(p.relative_to(tmp_path)) for p in (tmp_path / "canary").rglob("*")) == ["canary/sub",
                                                                                           "canary/sub/a.txt"]


def _assert_contained(records, names):
    assert [r["name"] for r in records] == list(names)
    escaped = [(r["name"], r["escape"]) for r in records if not r["blocked"]]
    assert escaped == []


@linux_only
def test_kernel_layers_alone_contain_the_file_attacks(tmp_path):
    """Audit hook DISABLED: Landlock + the mount namespace contain every file attack on their own."""
    lay = _layers()
    if not (lay.get("landlock") and lay.get("mountns")):
        pytest.skip("needs both Landlock and user+mount namespaces")
    records = run_hostile_suite(tmp_path, list(KERNEL_FILE_ATTACKS), audit_hook=False)
    _assert_contained(records, KERNEL_FILE_ATTACKS)
    assert all(r["violation"] is None for r in records if r["name"] != "disk_fill")   # no hook markers
    assert all(not r["layers"]["audit_hook"] and r["layers"]["landlock"] for r in records)


@linux_only
def test_landlock_alone_contains_the_file_attacks(tmp_path, monkeypatch):
    """No namespaces, no audit hook: Landlock by itself (stat probing is the documented residue)."""
    if not _layers("userns").get("landlock"):
        pytest.skip("Landlock unavailable")
    monkeypatch.setenv(DISABLE_ENV, "userns")
    names = [n for n in KERNEL_FILE_ATTACKS if n != "stat_probe"]
    records = run_hostile_suite(tmp_path, names, audit_hook=False)
    for r in records:   # the residue without a mount namespace: the tamper programs' own stat probe
        if r["escape"] and all(e.endswith(" stat") for e in r["escape"].split("; ")):
            r["blocked"], r["escape"] = True, None
    _assert_contained(records, names)
    lay = records[0]["layers"]
    assert lay["landlock"] >= 1 and not lay["mountns"] and lay["disk_cap"].startswith("no new files")


@linux_only
def test_mount_namespace_alone_contains_the_file_attacks(tmp_path, monkeypatch):
    """No Landlock, no audit hook: the user+mount namespace's minimal root by itself."""
    if not _layers("landlock").get("mountns"):
        pytest.skip("user+mount namespaces unavailable")
    monkeypatch.setenv(DISABLE_ENV, "landlock")
    records = run_hostile_suite(tmp_path, list(KERNEL_FILE_ATTACKS), audit_hook=False)
    _assert_contained(records, KERNEL_FILE_ATTACKS)
    lay = records[0]["layers"]
    assert lay["landlock"] == 0 and lay["mountns"] and lay["netns"]


@linux_only
def test_without_a_kernel_layer_running_refuses(tmp_path, monkeypatch):
    monkeypatch.setenv(DISABLE_ENV, "landlock,userns")
    marker = tmp_path / "ran.txt"
    code = f"open({str(marker)!r}, 'w').write('x')\ndef f(x):\n    return x\n"
    with pytest.raises(UsageError) as e:
        run_python(code, _audit_hook=False)
    msg = str(e.value)
    assert "Landlock" in msg and "namespaces" in msg and "--sandbox-cmd" in msg and "\n" not in msg
    with pytest.raises(UsageError):
        call_many(code, "f", [[1]])
    with pytest.raises(UsageError):
        run_hostile_suite(tmp_path / "suite", ["write_outside"])
    assert not marker.exists()                       # refused before any generated code ran
    # the way out: an outer wrapper (here a no-op one) makes the run proceed, reported as such
    env = shutil.which("env")
    res = run_python("print(6 * 7)", wrapper=[env])
    assert res.stdout.strip() == "42" and res.layers["wrapper"] and not res.layers["landlock"]


@linux_only
def test_landlock_ruleset_is_enforced_by_the_kernel(tmp_path):
    """The Landlock module on its own, in a plain subprocess: reads and writes outside the granted dir fail."""
    from llmtool.core import landlock

    if landlock.abi_version() < 1:
        pytest.skip("Landlock unavailable")
    inside, outside = tmp_path / "in", tmp_path / "out"
    inside.mkdir()
    outside.mkdir()
    (outside / "s.txt").write_text("secret")
    import os

    stdlib = os.path.dirname(os.__file__)
    prog = f"""
import os, sys
sys.path.insert(0, {str(__import__("pathlib").Path(landlock.__file__).parent)!r})
import landlock as L
abi = L.restrict([({stdlib!r}, L.READ_RIGHTS), ({str(inside)!r}, -1)])
open({str(inside / "w.txt")!r}, "w").write("ok")
for what, fn in (("read", lambda: open({str(outside / "s.txt")!r}).read()),
                 ("write", lambda: open({str(outside / "n.txt")!r}, "w")),
                 ("link", lambda: os.link({str(outside / "s.txt")!r}, {str(inside / "l")!r})),
                 ("rename", lambda: os.rename({str(inside / "w.txt")!r}, {str(outside / "m.txt")!r}))):
    try:
        fn(); print(what, "ALLOWED")
    except OSError as e:
        print(what, e.errno)
print("abi", abi)
"""
    out = subprocess.run([sys.executable, "-I", "-S", "-c", prog], capture_output=True, text=True, timeout=60)
    lines = dict(line.split(" ", 1) for line in out.stdout.split("\n") if line)
    assert lines["read"] == "13" and lines["write"] == "13" and lines["abi"] == str(landlock.abi_version()), out
    assert lines["link"] in ("13", "18") and lines["rename"] in ("13", "18"), out    # EACCES or EXDEV
    assert (inside / "w.txt").read_text() == "ok" and sorted(p.name for p in outside.iterdir()) == ["s.txt"]


@linux_only
def test_total_bytes_cap_holds_against_six_files_near_the_file_cap():
    lay = _layers()
    code = (
        "import os\nstopped = []\n"
        "for i in range(6):\n"
        "    try:\n"
        "        with open('f%d' % i, 'wb') as f:\n"
        "            f.write(b'x' * (2 * 1024 * 1024 - 4096))\n"
        "    except OSError as e:\n"
        "        stopped.append(e.errno)\n"
        "print(sum(os.path.getsize(n) for n in os.listdir('.')), stopped)\n"
    )
    res = run_python(code, limits=SandboxLimits(file_size_mb=2, disk_mb=5))
    total, stopped = res.stdout.split(" ", 1)
    assert int(total) <= 5 * 1024 * 1024, res
    assert stopped.strip() != "[]"                   # the kernel said no (ENOSPC with tmpfs, EACCES without)
    if lay.get("mountns"):
        assert int(total) > 4 * 1024 * 1024 and "28" in stopped   # filled up to the cap, then ENOSPC


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
        res = run_python(code, limits=SandboxLimits(allow_threads=True), _audit_hook=False)
        assert victim.poll() is None
    finally:
        victim.kill()
        victim.wait()
    lines = dict(line.split(" ", 1) for line in res.stdout.strip().splitlines())
    assert lines == {"fork": "errno 1", "socket": "errno 1", "exec": "errno 1", "kill": "errno 1", "thread": "42"}, res


def test_threads_denied_by_default_allowed_on_request():
    code = "import threading\nr=[]\nt=threading.Thread(target=lambda: r.append(1)); t.start(); t.join(); print(r)"
    assert SandboxLimits().allow_threads is False
    res = run_python(code)
    assert res.returncode != 0 and "[1]" not in res.stdout and not res.layers["threads_allowed"]
    res = run_python(code, limits=SandboxLimits(allow_threads=True))
    assert res.stdout.strip() == "[1]" and res.layers["threads_allowed"]


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
    probe = subprocess.run([a.replace("{cwd}", str(tmp_path)) for a in wrapper] + ["true"], capture_output=True)
    if probe.returncode != 0:
        pytest.skip("bwrap cannot create namespaces here")
    res = run_python("open('x.txt','w').write('1'); print(open('x.txt').read())", wrapper=wrapper)
    assert res.stdout.strip() == "1"
    assert res.layers["wrapper"] and res.layers["landlock"] == _layers().get("landlock", 0)
    rec = run_hostile_suite(tmp_path / "suite", ["write_outside", "os_system", "read_secret_file", "stat_probe"],
                            wrapper=wrapper)
    assert all(r["blocked"] for r in rec), rec


_FORGE = (
    "import os, json\n"
    "for fd in range(1, 40):\n"
    "    for rec in (dict(i=0, ok=True, value=999), dict(t='0' * 32, i=1, ok=True, value=999), dict(done=True)):\n"
    "        try:\n"
    "            os.write(fd, (json.dumps(rec) + '\\n').encode())\n"
    "        except OSError:\n"
    "            pass\n"
)


def test_call_many_result_channel_cannot_be_forged():
    # forged records on every fd (stdout, stderr, the result pipe): ignored, the real return values count
    res = call_many(_FORGE + "def f(x):\n    print(json.dumps(dict(i=x, ok=True, value=999)))\n    return x\n",
                    "f", [[0], [1], [2]])
    assert [(r.ok, r.value) for r in res] == [(True, 0), (True, 1), (True, 2)]
    # forged records, then an exit before any input ran: every input fails
    res = call_many(_FORGE + "os._exit(0)\ndef f(x):\n    return x\n", "f", [[0], [1]])
    assert all(not r.ok for r in res)
    assert all(r.layers and "landlock" in r.layers for r in res)


def test_call_many_any_violation_fails_every_input():
    code = ("def f(x):\n    if x == 0:\n        try:\n            open('/etc/hostname')\n"
            "        except OSError:\n            pass\n    return x * 2\n")
    res = call_many(code, "f", [[0], [1], [2]])
    assert all(not r.ok and "violation" in r.error for r in res), res
    assert [r.value for r in call_many("def f(x):\n    return x * 2\n", "f", [[0], [1]])] == [0, 2]


_CHECK = {"code": "def check(candidate):\n    assert abs(candidate(1) - 2) < 1e-9\n    assert candidate(2) == 4\n",
          "call": "check", "target": "f"}


@pytest.mark.parametrize("program,passes", [
    ("def f(x):\n    return 2 * x\n", True),
    ("def f(x):\n    return 2 * x\nprint('noise')\n", True),
    ("def f(x):\n    return x\n", False),                                      # wrong: check raises
    ("import sys\ndef f(x):\n    return x\nsys.exit(0)\n", False),             # exit before check
    ("import os\ndef f(x):\n    return x\nos._exit(0)\n", False),              # hard exit before check
    ("import sys\ndef f(x):\n    sys.exit(0)\n", False),                       # exit inside check
    ("import os\ndef f(x):\n    os._exit(0)\n", False),
    ("class E:\n    def __eq__(self, o):\n        return True\n    def __sub__(self, o):\n        return 0\n"
     "def f(x):\n    return E()\n", False),                                    # always-equal object
    ("class I(int):\n    def __eq__(self, o):\n        return True\ndef f(x):\n    return I(0)\n", False),
    ("import builtins\nbuiltins.abs = lambda v: 0\ndef f(x):\n    return 4\n", False),   # patched builtin
    ("abs = lambda v: 0\ndef f(x):\n    return 4\n", False),                  # shadowed builtin
    (_FORGE + "def f(x):\n    return x\nos._exit(0)\n", False),                # forged sentinels, then exit
    ("def f(x):\n    try:\n        open('/etc/hostname')\n    except OSError:\n        pass\n    return 2 * x\n",
     False),                                                                   # violation marker
])
def test_harness_sentinel_is_the_only_pass(program, passes):
    res = run_python(program, harness=_CHECK)
    assert res.completed is passes, res


def test_completed_means_the_program_ran_to_its_end():
    assert run_python("print(1)").completed
    res = run_python("import sys\nprint(1)\nsys.exit(0)\n")
    assert res.returncode == 0 and not res.completed          # exit status 0, but it did not reach its end
    res = run_python(_FORGE + "print('done')\nos._exit(0)\n")
    assert res.returncode == 0 and not res.completed


def test_layers_are_reported_and_printed():
    lay = active_layers()
    for key in ("landlock", "userns", "mountns", "netns", "seccomp", "audit_hook", "threads_allowed", "disk_cap",
                "wrapper"):
        assert key in lay
    assert run_python("pass").layers == lay
    from llmtool.core import landlock

    assert lay["landlock"] == (landlock.abi_version() if lay["landlock"] else 0)
    out = subprocess.run([sys.executable, "-m", "llmtool.core.sandbox"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "| Landlock |" in out.stdout, out
    assert ("ABI %d" % lay["landlock"] if lay["landlock"] else "| Landlock | no |") in out.stdout


@linux_only
def test_cli_refuses_with_one_error_line_and_the_wrapper_is_the_way_out(tmp_path):
    """A real `llmtool learn-program` process: no kernel layer -> exit 2 and one `error:` line naming the way
    out; `--sandbox-cmd` (here a no-op wrapper) or LLMTOOL_SANDBOX_CMD lets it run."""
    import json

    from conftest import run_cli_subprocess

    from llmtool.core.sandbox import WRAPPER_ENV
    from llmtool.learn_program.tasks import generate, write_dataset

    d = tmp_path / "data"
    d.mkdir()
    write_dataset(generate("parity_all", 10, 40, 40, 40, seed=1), d)
    replay = tmp_path / "r.jsonl"
    replay.write_text(json.dumps({"code": "def f(x):\n    return x.count('1') % 2\n"}) + "\n")
    off = {DISABLE_ENV: "landlock,userns", "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    p = run_cli_subprocess("learn-program", tmp_path / "a", "--data", d, "--proposer", f"replay:{replay}",
                           env=off, timeout=300)
    assert p.returncode == 2, p.stderr
    lines = [line for line in p.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and "--sandbox-cmd" in lines[0], p.stderr
    assert "Traceback" not in p.stderr
    env = shutil.which("env")
    p = run_cli_subprocess("learn-program", tmp_path / "b", "--data", d, "--proposer", f"replay:{replay}",
                           "--sandbox-cmd", env, env=off, timeout=300)
    assert p.returncode == 0, p.stderr
    summ = json.loads((tmp_path / "b" / "summary.json").read_text())
    assert summ["best_val"] == 1.0 and summ["sandbox_layers"]["wrapper"] and not summ["sandbox_layers"]["landlock"]
    p = run_cli_subprocess("learn-program", tmp_path / "c", "--data", d, "--proposer", f"replay:{replay}",
                           env={**off, WRAPPER_ENV: env}, timeout=300)
    assert p.returncode == 0, p.stderr


@linux_only
def test_the_suite_detects_escapes_when_the_kernel_layers_are_off(tmp_path, monkeypatch):
    """The hostile programs are real attacks: under a no-op wrapper with both kernel layers disabled they
    escape -- with the audit hook off all of them, with it on still the hook-tampering ones (PEP 578)."""
    monkeypatch.setenv(DISABLE_ENV, "landlock,userns")
    env = [shutil.which("env")]
    names = ["write_outside", "read_secret_file", "hook_tamper_traceback", "subclasses_traversal", "gc_traversal",
             "hard_link", "stat_probe", "disk_fill", "inode_fill"]
    records = run_hostile_suite(tmp_path / "off", names, wrapper=env, audit_hook=False)
    assert [r["name"] for r in records if r["blocked"]] == [], records
    assert all(r["layers"]["wrapper"] and not r["layers"]["landlock"] and not r["layers"]["mountns"]
               for r in records)
    records = run_hostile_suite(tmp_path / "hook", ["hook_tamper_traceback", "stat_probe"], wrapper=env)
    assert [r["name"] for r in records if r["blocked"]] == [], records


@linux_only
def test_half_built_namespaces_fall_back_to_landlock_once(monkeypatch):
    """A child that created its namespaces but could not set them up (e.g. uid_map not writable) runs
    nothing; the run is restarted without namespaces, and later runs skip them."""
    from llmtool.core import sandbox as sb

    if not _layers("userns").get("landlock") or not _layers().get("mountns"):
        pytest.skip("needs Landlock and user namespaces")
    ll, ns = sb._module_sources()
    broken = ns.replace('os.makedirs(newroot + "/.old-root")', 'raise OSError(1, "simulated")')
    assert broken != ns
    monkeypatch.setattr(sb, "_module_sources", lambda: (ll, broken))
    monkeypatch.setattr(sb, "_USERNS_BROKEN", [])
    res = run_python("print(open('in.txt').read())", files={"in.txt": "once"})
    assert res.stdout == "once\n" and res.layers["landlock"] and not res.layers["mountns"], res
    assert sb._USERNS_BROKEN and "simulated" in sb._USERNS_BROKEN[0]
    assert not run_python("pass").layers["userns"]


@linux_only
def test_issue_39_reproduction_learn_program_selects_no_escape(tmp_path):
    """The issue's end-to-end case: a replayed candidate walks a blocked call's traceback into the hook,
    empties its tables, then writes/deletes/lists outside. Now nothing outside changes and the candidate
    is failed (its blocked call left a violation)."""
    import json

    from llmtool.learn_program.tasks import generate, write_dataset

    from conftest import run_cli

    d = tmp_path / "data"
    d.mkdir()
    write_dataset(generate("parity_all", 10, 40, 40, 40, seed=1), d)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "keep.txt").write_text(FILE_SECRET)
    prog = (
        "import os\n"
        "try:\n    os.remove(%r)\nexcept BaseException as e:\n    tb = e.__traceback__\n"
        "while tb is not None:\n"
        "    for v in list(tb.tb_frame.f_locals.values()):\n"
        "        if isinstance(v, (dict, set)) and tb.tb_frame.f_code.co_name in ('hook', 'deny'):\n"
        "            v.clear()\n"
        "    tb = tb.tb_next\n"
        "for f in (lambda: open(%r, 'w').write('x'), lambda: os.remove(%r), lambda: os.listdir(%r)):\n"
        "    try:\n        f()\n    except OSError:\n        pass\n"
        "def f(x):\n    return x.count('1') %% 2\n"
    ) % (str(outside / "keep.txt"), str(outside / "pwned.txt"), str(outside / "keep.txt"), str(outside))
    replay = tmp_path / "r.jsonl"
    replay.write_text(json.dumps({"code": prog}) + "\n")
    code, _, err = run_cli("learn-program", tmp_path / "run", "--data", d, "--proposer", f"replay:{replay}")
    assert code == 0, err
    cand = json.loads((tmp_path / "run" / "candidates.jsonl").read_text())
    assert cand["error"] and "violation" in cand["error"] and cand["val_acc"] == 0.0, cand
    assert sorted(p.name for p in outside.iterdir()) == ["keep.txt"]
    assert (outside / "keep.txt").read_text() == FILE_SECRET
    layers = json.loads((tmp_path / "run" / "summary.json").read_text())["sandbox_layers"]
    assert layers == active_layers() and (layers["landlock"] or layers["mountns"])

"""Hostile programs for the sandbox (spec llm-pv §8.3 plus escape attempts of our own, issue 39).

Each program is run through :func:`llmtool.core.sandbox.run_python` with ``{outside}`` replaced by a
directory the parent owns outside the sandbox's working dir, ``{secret}`` by a planted secret file outside,
``{canary}`` by a canary dir outside, ``{victim}`` by the pid of a decoy process the parent started, and a
planted ``OPENAI_API_KEY`` in the parent environment. A program counts as *blocked* when its goal did not
happen: no file created/removed/changed/read outside the working dir, no outside path even *seen* (stat
probes), no process spawned or signalled, no secret leaked, the resource limit held, the result channel
not forged, the parent still alive. Besides each program's own goal, the parent snapshots the whole work
tree (names, types, sizes, modes, mtimes, contents, link targets) before and after every program: any
difference is an escape, and the planted secret must not appear in any output.

The escape classes of issue 39: hook-state tampering through traceback frames, ``__subclasses__`` and gc
traversal, directory-rename and symlink races with threads (those programs ask for threads), hard links,
stat probing of a planted secret path, disk fill (bytes and files), result forgery and early exit before a
harness ``check``. ``KERNEL_FILE_ATTACKS`` are the file attacks that must stay contained with the audit
hook disabled (the kernel layers alone). Used by the tests and by ``benchmarks/learn_program.py``.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from llmtool.core.sandbox import SandboxLimits, run_python

SECRET = "sk-planted-secret-0123456789"
FILE_SECRET = "TOP-SECRET-FILE-CONTENT"

# prepended to the new escape programs: ``attempt`` prints ESCAPED when an attack step succeeded
# (``fn`` returned a truthy value); the secret is recognised by a fragment, so that tracebacks echoing the
# program's source never contain the secret itself.
_PRE = (
    "import os, sys\n"
    "outside, secret, canary = {outside!r}, {secret!r}, {canary!r}\n"
    "def attempt(what, fn):\n"
    "    try:\n"
    "        r = fn()\n"
    "    except BaseException as e:\n"
    "        print('blocked', what, type(e).__name__)\n"
    "        return\n"
    "    print(('ESCAPED ' if r else 'no-effect ') + what)\n"
    "def is_secret(s):\n"
    "    return 'FILE-CONT' in s\n"
    "def attacks(tag):\n"
    "    attempt(tag + ' write', lambda: open(outside + '/' + tag + '.txt', 'w').write('x') and True)\n"
    "    attempt(tag + ' remove', lambda: os.remove(outside + '/keep.txt') or True)\n"
    "    attempt(tag + ' read', lambda: is_secret(open(secret).read()))\n"
    "    attempt(tag + ' list', lambda: 'keep.txt' in os.listdir(outside))\n"
    "    attempt(tag + ' stat', lambda: os.path.exists(secret))\n"
    "    attempt(tag + ' rename', lambda: os.rename(outside + '/keep.txt', 'stolen.txt') or True)\n"
    "    attempt(tag + ' mkdir', lambda: os.mkdir(canary + '/' + tag) or True)\n"
)

# name -> (code template, limits overrides)
PROGRAMS: dict[str, tuple[str, dict]] = {
    "infinite_loop": ("while True:\n    pass\n", {"wall_seconds": 3, "cpu_seconds": 60}),
    "cpu_burn": ("while True:\n    pass\n", {"wall_seconds": 60, "cpu_seconds": 1}),
    "allocate_4gib": ("x = bytearray(4 * 1024 ** 3)\nprint('ALLOCATED', len(x))\n", {}),
    "raise_rlimit_then_allocate": (
        "import resource\n"
        "try:\n    resource.setrlimit(resource.RLIMIT_AS, (-1, -1))\nexcept Exception as e:\n    print('setrlimit', e)\n"
        "x = bytearray(4 * 1024 ** 3)\nprint('ALLOCATED', len(x))\n", {}),
    "write_outside": ("open({outside!r} + '/write.txt', 'w').write('x')\n", {}),
    "append_outside_os_open": (
        "import os\nfd = os.open({outside!r} + '/osopen.txt', os.O_WRONLY | os.O_CREAT)\nos.write(fd, b'x')\n", {}),
    "symlink_escape": (
        "import os\nos.symlink({outside!r}, 'link')\nopen('link/symlink.txt', 'w').write('x')\n", {}),
    "dir_fd_escape": (
        "import os\nd = os.open({outside!r}, os.O_RDONLY)\n"
        "fd = os.open('dirfd.txt', os.O_WRONLY | os.O_CREAT, dir_fd=d)\nos.write(fd, b'x')\n", {}),
    "monkeypatch_then_write": (
        "import os, os.path, posixpath, builtins\n"
        "os.path.realpath = posixpath.realpath = lambda p, **k: os.getcwd()\n"
        "os.getcwd = lambda: '/'\nbuiltins.isinstance = lambda *a: False\n"
        "open({outside!r} + '/patched.txt', 'w').write('x')\n", {}),
    "delete_outside": ("import shutil\nshutil.rmtree({outside!r})\n", {}),
    "remove_outside": ("import os\nos.remove({outside!r} + '/keep.txt')\n", {}),
    "chmod_outside": ("import os\nos.chmod({outside!r} + '/keep.txt', 0o777)\n", {}),
    "read_secret_file": ("print(open({outside!r} + '/keep.txt').read())\n", {}),
    "os_system": ("import os\nos.system('touch ' + {outside!r} + '/system.txt')\n", {}),
    "subprocess": ("import subprocess\nsubprocess.run(['touch', {outside!r} + '/subprocess.txt'])\n", {}),
    "os_popen": ("import os\nos.popen('touch ' + {outside!r} + '/popen.txt').read()\n", {}),
    "os_exec": ("import os\nos.execv('/bin/sh', ['sh', '-c', 'touch ' + {outside!r} + '/exec.txt'])\n", {}),
    "posix_spawn": (
        "import os\nos.posix_spawn('/bin/sh', ['sh', '-c', 'touch ' + {outside!r} + '/spawn.txt'], {{}})\n", {}),
    "fork": ("import os\npid = os.fork()\nif pid == 0:\n    open({outside!r} + '/fork.txt', 'w').write('x')\n", {}),
    "fork_bomb": ("import os\nwhile True:\n    os.fork()\n", {"wall_seconds": 5}),
    "socket": ("import socket\ns = socket.socket()\nprint('SOCKET-OK')\n", {}),
    "ctypes": ("import ctypes\nctypes.CDLL(None).system(('touch ' + {outside!r} + '/ctypes.txt').encode())\n", {}),
    "multiprocessing": ("import multiprocessing\nprint('MP-OK')\n", {}),
    "kill_process": ("import os, signal\nos.kill({victim}, signal.SIGKILL)\n", {}),
    "find_and_disable_hook": (
        "import gc, os\n"
        "for o in gc.get_objects():\n"
        "    if callable(o) and getattr(o, '__name__', '') == 'hook':\n"
        "        o.__code__ = (lambda *a, **k: None).__code__\n"
        "os.system('touch ' + {outside!r} + '/hook.txt')\n", {}),
    "env_leak": ("import os\nprint(dict(os.environ))\n", {}),
    "print_100mb": ("import sys\nsys.stdout.write('x' * 100_000_000)\n", {"output_bytes": 1_000_000}),
    "big_file": ("open('big.bin', 'wb').write(b'x' * (64 * 1024 * 1024))\nprint('WROTE')\n", {"file_size_mb": 1}),
    # ---- issue 39: escapes of the audit hook and races the kernel layers must contain -------------
    "hook_tamper_traceback": (_PRE + (
        "try:\n    os.remove(outside + '/keep.txt')\nexcept BaseException as e:\n    tb = e.__traceback__\n"
        "while tb is not None:\n"
        "    f = tb.tb_frame\n"
        "    if f.f_code.co_name in ('hook', 'deny'):\n"
        "        for v in list(f.f_locals.values()):\n"
        "            if isinstance(v, (dict, set)):\n"
        "                v.clear()\n"
        "    tb = tb.tb_next\n"
        "attacks('hooktb')\n"), {}),
    "subclasses_traversal": (_PRE + (
        "subs, todo = [], [object]\n"
        "while todo:\n"
        "    for c in type.__subclasses__(todo.pop()):\n"
        "        if c not in subs:\n"
        "            subs.append(c); todo.append(c)\n"
        "fio = [c for c in subs if c.__name__ == 'FileIO'][0]\n"
        "attempt('FileIO write', lambda: fio(outside + '/subcls.txt', 'w').write(b'x') and True)\n"
        "attempt('FileIO read', lambda: is_secret(fio(secret, 'r').read().decode()))\n"
        "bi = [c for c in subs if c.__name__ == 'BuiltinImporter'][0]\n"
        "px = bi.load_module('posix')\n"
        "attempt('posix.open', lambda: px.write(px.open(outside + '/subcls2.txt', px.O_WRONLY | px.O_CREAT), b'x'))\n"
        "attempt('posix.unlink', lambda: px.unlink(outside + '/keep.txt') or True)\n"
        "attacks('subcls')\n"), {}),
    "gc_traversal": (_PRE + (
        "import gc\n"
        "def find():\n"
        "    for o in gc.get_objects():\n"
        "        if callable(o) and getattr(o, '__name__', '') == 'hook':\n"
        "            for d in o.__defaults__ or ():\n"
        "                if isinstance(d, (dict, set)):\n"
        "                    d.clear()\n"
        "            return True\n"
        "attempt('gc found the hook', find)\n"
        "attacks('gc')\n"), {}),
    "rename_race": (_PRE + (
        "import threading\n"
        "os.mkdir('d')\nos.symlink(outside, 'evil')\nstop = []\n"
        "def swap():\n"
        "    while not stop:\n"
        "        try:\n"
        "            os.rename('d', 'tmpd'); os.rename('evil', 'd'); os.rename('d', 'evil'); os.rename('tmpd', 'd')\n"
        "        except OSError:\n"
        "            pass\n"
        "t = threading.Thread(target=swap); t.start()\n"
        "for i in range(1500):\n"
        "    try:\n"
        "        open('d/race.txt', 'w').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        "        if is_secret(open('d/keep.txt').read()):\n"
        "            print('ESCAPED read through the race'); break\n"
        "    except OSError:\n"
        "        pass\n"
        "stop.append(1); t.join()\n"), {"allow_threads": True}),
    "symlink_race": (_PRE + (
        "import threading\n"
        "open('real.txt', 'w').write('inside')\nstop = []\n"
        "def flip():\n"
        "    while not stop:\n"
        "        for target in ('real.txt', secret, outside + '/symrace.txt'):\n"
        "            try:\n"
        "                os.remove('l')\n"
        "            except OSError:\n"
        "                pass\n"
        "            try:\n"
        "                os.symlink(target, 'l')\n"
        "            except OSError:\n"
        "                pass\n"
        "t = threading.Thread(target=flip); t.start()\n"
        "for i in range(1500):\n"
        "    try:\n"
        "        if is_secret(open('l').read()):\n"
        "            print('ESCAPED read through the symlink race'); break\n"
        "    except OSError:\n"
        "        pass\n"
        "    try:\n"
        "        open('l', 'a').write('x')\n"
        "    except OSError:\n"
        "        pass\n"
        "stop.append(1); t.join()\n"), {"allow_threads": True}),
    "hard_link": (_PRE + (
        "attempt('link secret in', lambda: os.link(secret, 'hl') or True)\n"
        "attempt('read via link', lambda: is_secret(open('hl').read()))\n"
        "attempt('link keep in', lambda: os.link(outside + '/keep.txt', 'hk') or True)\n"
        "attempt('write via link', lambda: os.path.exists('hk') and open('hk', 'a').write('x') and True)\n"
        "open('mine.txt', 'w').write('x')\n"
        "attempt('link out', lambda: os.link('mine.txt', outside + '/linked.txt') or True)\n"), {}),
    "stat_probe": (_PRE + (
        "attempt('stat', lambda: os.stat(secret) and True)\n"
        "attempt('lstat', lambda: os.lstat(secret) and True)\n"
        "attempt('exists', lambda: os.path.exists(secret))\n"
        "attempt('access', lambda: os.access(secret, os.F_OK))\n"
        "attempt('isdir canary', lambda: os.path.isdir(canary))\n"
        "attempt('list parent', lambda: 'canary' in os.listdir(os.path.dirname(canary)))\n"
        "attempt('scandir outside', lambda: any(True for _ in os.scandir(outside)))\n"
        "attempt('chdir outside', lambda: os.chdir(outside) or True)\n"), {}),
    # the read-only system files the child can see (writing /dev/null or /dev/urandom is harmless)
    "write_system_files": (_PRE + (
        "def touch_same(p):\n"
        "    st = os.stat(p)\n"
        "    os.utime(p, ns=(st.st_atime_ns, st.st_mtime_ns))\n"
        "    return True\n"
        "for p in ('/etc/ld.so.cache', os.__file__, '/usr/lib/os-release'):\n"
        "    attempt('open for writing ' + p, lambda p=p: os.close(os.open(p, os.O_WRONLY | os.O_APPEND)) or True)\n"
        "    attempt('utime ' + p, lambda p=p: touch_same(p))\n"
        "attempt('create next to the stdlib', lambda: os.close(os.open(os.path.dirname(os.__file__) + '/x.py', "
        "os.O_WRONLY | os.O_CREAT)) or True)\n"), {}),
    "disk_fill": (_PRE + (
        "for i in range(6):\n"
        "    try:\n"
        "        with open('fill%d.bin' % i, 'wb') as f:\n"
        "            f.write(b'x' * (4 * 1024 * 1024 - 4096))\n"
        "    except OSError as e:\n"
        "        print('stopped', i, e.errno)\n"
        "total = sum(os.path.getsize(n) for n in os.listdir('.') if n.startswith('fill'))\n"
        "print('TOTAL', total)\n"
        "if total > 10 * 1024 * 1024:\n    print('ESCAPED the total-bytes cap')\n"),
        {"file_size_mb": 4, "disk_mb": 10}),
    "inode_fill": (_PRE + (
        "n = 0\n"
        "for i in range(5000):\n"
        "    try:\n        open('f%d' % i, 'w').close(); n += 1\n"
        "    except OSError:\n        break\n"
        "print('FILES', n)\n"
        "if n > 300:\n    print('ESCAPED the file-count cap')\n"), {"max_files": 256}),
    "result_forgery": (_PRE + (
        "import json\n"
        "forged = [json.dumps(d) for d in (dict(done=True), dict(t='0' * 32, done=True), dict(i=0, ok=True))]\n"
        "print('\\n'.join(forged))\n"
        "for fd in range(1, 40):\n"
        "    for line in forged:\n"
        "        try:\n"
        "            os.write(fd, (line + '\\n').encode())\n"
        "        except OSError:\n"
        "            pass\n"
        "sys.stdout.flush()\nos._exit(0)\n"), {}),
    "early_sys_exit": ("import sys\ndef f(x):\n    return 0\nsys.exit(0)\n", {}),
    "early_os_exit": ("import os\ndef f(x):\n    return 0\nos._exit(0)\n", {}),
    "always_equal": ("class E:\n    def __eq__(self, o):\n        return True\n"
                     "def f(x):\n    return E()\n", {}),
    "patch_builtins": ("import builtins\nbuiltins.abs = lambda x: 0\nbuiltins.AssertionError = type('X', (Exception,), {{}})\n"
                       "def f(x):\n    return 0\n", {}),
}

# programs scored through a harness: a pass would be ``completed`` (the sentinel after check returned)
HARNESS = {"code": "def check(candidate):\n    assert abs(candidate(1) - 2) < 1e-9\n    assert candidate(2) == 4\n",
           "call": "check", "target": "f"}
HARNESSED = ("result_forgery", "early_sys_exit", "early_os_exit", "always_equal", "patch_builtins")

# file attacks that the kernel layers must contain on their own (audit hook disabled)
KERNEL_FILE_ATTACKS = ("write_outside", "append_outside_os_open", "symlink_escape", "dir_fd_escape",
                       "delete_outside", "remove_outside", "chmod_outside", "read_secret_file",
                       "hook_tamper_traceback", "subclasses_traversal", "gc_traversal", "rename_race",
                       "symlink_race", "hard_link", "stat_probe", "write_system_files", "disk_fill",
                       "inode_fill")

_TOUCHED = ("write.txt", "osopen.txt", "symlink.txt", "dirfd.txt", "patched.txt", "system.txt",
            "subprocess.txt", "popen.txt", "exec.txt", "spawn.txt", "fork.txt", "ctypes.txt", "hook.txt")


def _goal_reached(name: str, res, outside: Path, victim: subprocess.Popen, limits: SandboxLimits) -> str | None:
    """Return a description if the hostile program achieved its goal, else None."""
    out = res.stdout
    if name == "infinite_loop":
        if not res.timed_out or res.seconds > limits.wall_seconds + 2:
            return f"not killed in time ({res.seconds:.1f}s)"
    if name == "cpu_burn" and (res.returncode == 0 or res.timed_out):
        return "CPU limit did not stop the loop"
    if name in ("allocate_4gib", "raise_rlimit_then_allocate") and "ALLOCATED" in out:
        return "allocated 4 GiB"
    if name in ("delete_outside", "remove_outside") and not (outside / "keep.txt").exists():
        return "deleted a file outside"
    if name == "chmod_outside" and (outside / "keep.txt").stat().st_mode & 0o777 == 0o777:
        return "changed permissions outside"
    if name == "read_secret_file" and FILE_SECRET in out + res.stderr:
        return "read a file outside"
    if name == "socket" and "SOCKET-OK" in out:
        return "opened a socket"
    if name == "multiprocessing" and "MP-OK" in out:
        return "imported multiprocessing"
    if name == "kill_process" and victim.poll() is not None:
        return "killed another process"
    if name == "env_leak" and (SECRET in out or "OPENAI_API_KEY" in out):
        return "saw the parent's environment"
    if name == "print_100mb" and len(out) > limits.output_bytes:
        return f"captured {len(out)} bytes"
    if name == "big_file" and "WROTE" in out:
        return "wrote past the file-size limit"
    if "ESCAPED" in out:
        return "; ".join(line for line in out.splitlines() if line.startswith("ESCAPED"))[:300]
    if name in HARNESSED and res.completed:
        return "passed the harness without returning correct plain values from check"
    if FILE_SECRET in out + res.stderr:
        return "the planted secret appeared in the output"
    for f in _TOUCHED:
        if (outside / f).exists():
            return f"created {f} outside"
    return None


def snapshot(root: Path) -> dict:
    """Everything observable about the tree under ``root``: type, size, mode, mtime, content, link target."""
    snap = {}
    for dirpath, dirnames, filenames in os.walk(root, followlinks=False):
        for n in dirnames + filenames:
            p = Path(dirpath) / n
            st = p.lstat()
            entry = [stat.S_IFMT(st.st_mode), stat.S_IMODE(st.st_mode), st.st_size, st.st_mtime_ns, st.st_nlink]
            if stat.S_ISLNK(st.st_mode):
                entry.append(os.readlink(p))
            elif stat.S_ISREG(st.st_mode):
                entry.append(hashlib.sha256(p.read_bytes()).hexdigest())
            snap[str(p.relative_to(root))] = entry
    return snap


def _diff(before: dict, after: dict) -> str | None:
    changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
    return ("changed outside the sandbox: " + ", ".join(changed[:8])) if changed else None


def run_hostile_suite(workdir: Path, names: list[str] | None = None, wrapper: list[str] | None = None,
                      audit_hook: bool = True) -> list[dict]:
    """Run every hostile program; return one record per program with ``blocked`` and details.

    ``audit_hook=False`` runs them with the audit hook disabled (tests: the kernel layers on their own)."""
    workdir = Path(workdir)
    records = []
    old_key = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = SECRET
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    secret = workdir / "secret" / "credentials.txt"
    canary = workdir / "canary"
    secret.parent.mkdir(parents=True, exist_ok=True)
    secret.write_text(FILE_SECRET)
    secret.chmod(0o600)
    (canary / "sub").mkdir(parents=True, exist_ok=True)
    (canary / "sub" / "a.txt").write_text("canary")
    try:
        for name in names or list(PROGRAMS):
            template, over = PROGRAMS[name]
            outside = workdir / f"outside_{name}"
            outside.mkdir(parents=True, exist_ok=True)
            (outside / "keep.txt").write_text(FILE_SECRET)
            (outside / "keep.txt").chmod(0o600)
            limits = replace(SandboxLimits(wall_seconds=20), **over)
            code = template.format(outside=str(outside), victim=victim.pid, secret=str(secret), canary=str(canary))
            before = snapshot(workdir)
            t0 = time.monotonic()
            res = run_python(code, limits=limits, wrapper=wrapper, _audit_hook=audit_hook,
                             harness=HARNESS if name in HARNESSED else None)
            goal = _goal_reached(name, res, outside, victim, limits) or _diff(before, snapshot(workdir))
            records.append({
                "name": name,
                "blocked": goal is None,
                "escape": goal,
                "returncode": res.returncode,
                "timed_out": res.timed_out,
                "violation": res.violation,
                "seconds": round(time.monotonic() - t0, 3),
                "completed": res.completed,
                "layers": res.layers,
                "parent_alive": True,
            })
    finally:
        victim.kill()
        victim.wait()
        if old_key is None:
            os.environ.pop("OPENAI_API_KEY", None)
        else:
            os.environ["OPENAI_API_KEY"] = old_key
    return records

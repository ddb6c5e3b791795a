"""Hostile programs for the sandbox (spec llm-pv §8.3 plus escape attempts of our own).

Each program is run through :func:`llmtool.core.sandbox.run_python` with ``{outside}`` replaced by a
directory the parent owns outside the sandbox's temp dir, ``{victim}`` by the pid of a decoy process
the parent started, and a planted ``OPENAI_API_KEY`` in the parent environment. A program counts as
*blocked* when its goal did not happen: no file created/removed/read outside the temp dir, no process
spawned or signalled, no secret leaked, the resource limit held, the parent still alive. Used by the
tests and by ``benchmarks/learn_program.py`` (the count in the docs).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from dataclasses import replace
from pathlib import Path

from llmtool.core.sandbox import SandboxLimits, run_python

SECRET = "sk-planted-secret-0123456789"
FILE_SECRET = "TOP-SECRET-FILE-CONTENT"

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
}

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
    for f in _TOUCHED:
        if (outside / f).exists():
            return f"created {f} outside"
    return None


def run_hostile_suite(workdir: Path, names: list[str] | None = None, wrapper: list[str] | None = None) -> list[dict]:
    """Run every hostile program; return one record per program with ``blocked`` and details."""
    workdir = Path(workdir)
    records = []
    old_key = os.environ.get("OPENAI_API_KEY")
    os.environ["OPENAI_API_KEY"] = SECRET
    victim = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"], start_new_session=True)
    try:
        for name in names or list(PROGRAMS):
            template, over = PROGRAMS[name]
            outside = workdir / f"outside_{name}"
            outside.mkdir(parents=True, exist_ok=True)
            (outside / "keep.txt").write_text(FILE_SECRET)
            (outside / "keep.txt").chmod(0o600)
            limits = replace(SandboxLimits(wall_seconds=20), **over)
            code = template.format(outside=str(outside), victim=victim.pid)
            t0 = time.monotonic()
            res = run_python(code, limits=limits, wrapper=wrapper)
            goal = _goal_reached(name, res, outside, victim, limits)
            records.append({
                "name": name,
                "blocked": goal is None,
                "escape": goal,
                "returncode": res.returncode,
                "timed_out": res.timed_out,
                "violation": res.violation,
                "seconds": round(time.monotonic() - t0, 3),
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

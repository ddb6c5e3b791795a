"""Run untrusted (model-generated) Python in a separate, restricted process.

Shared by every area that executes generated code (``learn-program``, agent and code-scoring tasks).
Generated code never runs in the parent interpreter.

Layers (defence in depth, not a guarantee -- wrap with ``wrapper=["bwrap", ...]`` for hostile input at
scale):

1. A fresh ``python -I -S`` child (isolated mode, no site-packages, no user site), started with an empty
   environment in its own session (process group) and its own temporary working directory, which is
   deleted afterwards. Optional ``files`` are written into that directory first.
2. A bootstrap (run inside the child, before any untrusted code) that
   a. sets rlimits: CPU seconds (soft; hard = soft + 1), address space, file size, open files, no core
      files. RLIMIT_NPROC is deliberately *not* relied upon: it does not stop ``fork`` for root, and for
      non-root users it would also stop threads;
   b. installs a seccomp deny-list through PyPI ``pyseccomp`` when it is importable (the parent checks;
      if it was expected and fails in the child, the child refuses to run the code). Denied with EPERM:
      fork/vfork, any ``clone`` without ``CLONE_THREAD`` (so threads still work; with
      ``allow_threads=False`` every clone), execve/execveat, sockets, ptrace and process_vm_*, kill and
      signals to other processes, setrlimit and prlimit64 with a new limit, namespaces/mount/module/
      keyring/bpf/perf/io_uring/userfaultfd and identity changes. ``clone3`` is denied with ENOSYS so
      glibc falls back to ``clone`` (which the CLONE_THREAD rule can inspect; clone3 takes a struct
      pointer that seccomp cannot read). Only the native architecture is allowed (libseccomp's default
      bad-arch action kills), which closes the 32-bit syscall-table bypass;
   c. installs a ``sys.addaudithook`` guard (cannot be removed once installed) that raises
      ``PermissionError`` for: ``open`` for writing outside the temp dir (symlinks resolved by the hook's
      own resolver), reads outside the temp dir and the standard library, opening a directory outside
      the temp dir (closes ``dir_fd`` tricks), remove/rename/chmod/mkdir/... outside the temp dir or with a
      ``dir_fd``, ``os.system``, ``os.exec*``, ``os.spawn*``, ``os.posix_spawn``, ``os.fork``,
      ``subprocess.Popen``, ``socket.*``, ``ctypes.*``, ``os.kill``, ``resource.setrlimit``,
      ``gc.get_objects``/``get_referrers``/``get_referents`` (finding the hook) and rebinding a function's
      ``__code__``/``__defaults__``; and ``import`` of ctypes, socket, subprocess, multiprocessing, ssl,
      pty, asyncio. Everything the hook needs is bound as default arguments (immutable once bound, since
      rebinding ``__defaults__`` is itself audited), so monkeypatching ``os``/``builtins`` does not
      disable it. Each blocked event is reported to the parent by a marker line on stderr.
3. The parent enforces a wall-clock limit by killing the whole process group, caps captured stdout and
   stderr (the child is killed once a cap is exceeded) and treats crashes as failures.

``call_many`` defines the code once and calls one function on many inputs in the same process (one
process per candidate, not per input), streaming one JSON line per result so that a timeout or crash
keeps the results already produced and marks only the remaining inputs as failed.

Reconstructed choices (ours): reads outside the temp dir and the stdlib are blocked too (stricter than
the spec, stops reading secrets); ``TMPDIR``/``HOME`` are pointed at the temp dir inside the child;
``stdin`` is delivered as a string (``sys.stdin`` is a ``StringIO``), the real fd 0 is ``/dev/null``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass
from functools import lru_cache

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "CallResult",
    "run_python",
    "call_many",
    "sandbox_available",
    "VIOLATION_MARKER",
]

VIOLATION_MARKER = "@@LLMTOOL-SANDBOX-VIOLATION@@"


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 10
    wall_seconds: float = 20
    memory_mb: int = 1024
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1_000_000
    allow_threads: bool = True


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    violation: str | None


@dataclass
class CallResult:
    ok: bool
    value: object = None
    error: str | None = None


# --------------------------------------------------------------------------------------------------
# The bootstrap executed by the child interpreter (``python -I -S -c BOOTSTRAP``). It reads one JSON
# payload from stdin, locks itself down, then runs the untrusted code.
# --------------------------------------------------------------------------------------------------
_BOOTSTRAP = r'''
import sys, os, json, io, resource, stat, traceback, linecache
def _boot():
    P = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    tmp = P["tmp"]
    os.chdir(tmp)
    nul = os.open(os.devnull, os.O_RDONLY); os.dup2(nul, 0); os.close(nul)
    for k in list(os.environ):
        del os.environ[k]
    os.environ["TMPDIR"] = tmp; os.environ["HOME"] = tmp
    L = P["limits"]
    MB = 1024 * 1024
    def lim(res, soft, hard=None):
        try:
            resource.setrlimit(res, (soft, soft if hard is None else hard))
        except (ValueError, OSError):
            pass
    cpu = max(1, int(-(-L["cpu_seconds"] // 1)))
    lim(resource.RLIMIT_CPU, cpu, cpu + 1)
    lim(resource.RLIMIT_AS, int(L["memory_mb"]) * MB)
    lim(resource.RLIMIT_FSIZE, int(L["file_size_mb"]) * MB)
    lim(resource.RLIMIT_NOFILE, int(L["open_files"]))
    lim(resource.RLIMIT_CORE, 0)
    mode = P["mode"]
    rfd = None
    if mode == "call":
        rfd = os.dup(1)
        os.dup2(2, 1)
    if P["seccomp"]:
        try:
            import ctypes.util
            libs = P["libs"]
            ctypes.util.find_library = lambda n, _l=libs: _l.get(n)
            sys.path.insert(0, P["seccomp_dir"])
            try:
                import pyseccomp as S
            finally:
                del sys.path[0]
            EPERM, ENOSYS = 1, 38
            f = S.SyscallFilter(S.ALLOW)
            for name in P["deny"]:
                try:
                    f.add_rule(S.ERRNO(EPERM), name)
                except Exception:
                    pass
            f.add_rule(S.ERRNO(ENOSYS), "clone3")
            if L["allow_threads"]:
                f.add_rule(S.ERRNO(EPERM), "clone", S.Arg(0, S.MASKED_EQ, 0x10000, 0))
            else:
                f.add_rule(S.ERRNO(EPERM), "clone")
            f.add_rule(S.ERRNO(EPERM), "prlimit64", S.Arg(2, S.NE, 0))
            f.add_rule(S.ERRNO(EPERM), "tgkill", S.Arg(0, S.NE, os.getpid()))
            f.load()
            del f, S
        except BaseException as e:
            os.write(2, ("sandbox: seccomp setup failed: %r\n" % (e,)).encode())
            os._exit(121)
        for m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes", "pyseccomp")]:
            del sys.modules[m]
    ro = [os.path.realpath(os.path.dirname(os.__file__))]
    sys.path.append(tmp)
    if P.get("hook", True):
        _install_hook(tmp, tuple(ro), tuple(P["read_files"]))
    del P["limits"]
    code = P["code"]
    linecache.cache["<candidate>"] = (len(code), None, code.splitlines(True), "<candidate>")
    if mode == "run":
        sys.stdin = io.StringIO(P["stdin"])
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        del P
        try:
            exec(compile(code, "<candidate>", "exec"), ns)
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        return
    out = os.fdopen(rfd, "w", buffering=1, encoding="utf-8")
    dumps = json.dumps
    func, inputs = P["func"], P["inputs"]
    del P
    def err(e):
        s = "%s: %s" % (type(e).__name__, e)
        return s if len(s) <= 300 else s[:297] + "..."
    ns = {"__name__": "__candidate__", "__builtins__": __builtins__}
    try:
        exec(compile(code, "<candidate>", "exec"), ns)
        fn = ns.get(func)
        if not callable(fn):
            raise NameError("function %r is not defined" % (func,))
    except BaseException as e:
        out.write(dumps({"fatal": err(e)}) + "\n")
        out.flush()
        os._exit(0)
    for i, args in enumerate(inputs):
        try:
            v = fn(*args) if isinstance(args, list) else fn(args)
            try:
                s = dumps({"i": i, "ok": True, "value": v})
            except BaseException:
                s = dumps({"i": i, "ok": False, "error": "unserialisable return value of type %s" % type(v).__name__})
        except BaseException as e:
            s = dumps({"i": i, "ok": False, "error": err(e)})
        out.write(s + "\n")
    out.flush()
    os._exit(0)

def _install_hook(tmp, ro, read_files):
    _isinstance, _type, _str, _bytes, _int = isinstance, type, str, bytes, int
    _fspath, _lstat, _readlink, _getcwd, _write = os.fspath, os.lstat, os.readlink, os.getcwd, os.write
    _ISLNK, _ISDIR, _stat = stat.S_ISLNK, stat.S_ISDIR, os.stat
    _PE, _OSE = PermissionError, OSError
    WFLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC

    def resolve(p, _getcwd=_getcwd, _lstat=_lstat, _readlink=_readlink, _ISLNK=_ISLNK, _OSE=_OSE, _PE=_PE):
        if not p.startswith("/"):
            p = _getcwd() + "/" + p
        stack = p.split("/")[::-1]
        out = []
        hops = 0
        while stack:
            c = stack.pop()
            if c == "" or c == ".":
                continue
            if c == "..":
                if out:
                    out.pop()
                continue
            cand = "/" + "/".join(out + [c])
            try:
                st = _lstat(cand)
            except _OSE:
                out.append(c)
                continue
            if _ISLNK(st.st_mode):
                hops += 1
                if hops > 40:
                    raise _PE("sandbox: too many symlinks")
                t = _readlink(cand)
                if t.startswith("/"):
                    out = []
                stack.extend(t.split("/")[::-1])
                continue
            out.append(c)
        return "/" + "/".join(out)

    BLOCK_EXACT = frozenset((
        "os.system", "os.fork", "os.forkpty", "os.kill", "os.killpg", "subprocess.Popen",
        "signal.pthread_kill", "resource.setrlimit", "resource.prlimit", "gc.get_objects",
        "gc.get_referrers", "gc.get_referents", "os.startfile", "sys.remote_exec", "os.add_dll_directory",
    ))
    BLOCK_PREFIX = ("os.exec", "os.spawn", "os.posix_spawn", "socket.", "ctypes.", "subprocess.",
                    "_winapi.", "winreg.", "msvcrt.", "sys.remote_exec")
    BLOCK_MODS = frozenset(("ctypes", "_ctypes", "socket", "_socket", "subprocess", "_posixsubprocess",
                            "multiprocessing", "_multiprocessing", "ssl", "_ssl", "pty", "asyncio",
                            "pyseccomp", "_testcapi", "_testinternalcapi", "faulthandler"))
    # event -> (positions of path arguments, positions of dir_fd arguments)
    PATH_EV = {
        "os.remove": ((0,), (1,)), "os.rmdir": ((0,), (1,)), "os.rename": ((0, 1), (2, 3)),
        "os.link": ((0, 1), (2, 3)), "os.symlink": ((1,), (2,)), "os.truncate": ((0,), ()),
        "os.chmod": ((0,), (2,)), "os.chown": ((0,), (3,)), "os.utime": ((0,), (3,)),
        "os.mkdir": ((0,), (2,)), "shutil.rmtree": ((0,), (1,)), "os.chflags": ((0,), ()),
        "os.lchflags": ((0,), ()), "os.setxattr": ((0,), ()), "os.removexattr": ((0,), ()),
        "os.mkfifo": ((0,), (2,)), "os.mknod": ((0,), (3,)), "shutil.move": ((0, 1), ()),
        "shutil.copyfile": ((1,), ()), "shutil.copytree": ((1,), ()),
    }
    READ_EV = {"os.listdir": 0, "os.scandir": 0}
    tmpdir = tmp
    tmppre = tmp.rstrip("/") + "/"
    ropre = tuple(r.rstrip("/") + "/" for r in ro)
    noted = set()

    def hook(event, args, _isinstance=_isinstance, _str=_str, _bytes=_bytes, _int=_int, _type=_type,
             _fspath=_fspath, _write=_write, _stat=_stat, _readlink=_readlink, _ISDIR=_ISDIR, _PE=_PE, _OSE=_OSE,
             resolve=resolve, BLOCK_EXACT=BLOCK_EXACT, BLOCK_PREFIX=BLOCK_PREFIX, BLOCK_MODS=BLOCK_MODS,
             PATH_EV=PATH_EV, READ_EV=READ_EV, WFLAGS=WFLAGS, tmpdir=tmpdir, tmppre=tmppre, ro=ro,
             ropre=ropre, read_files=read_files, noted=noted, marker=%(marker)r):

        def deny(what):
            if what not in noted:
                noted.add(what)
                try:
                    _write(2, ("\n" + marker + " " + what + "\n").encode("utf-8", "replace"))
                except _OSE:
                    pass
            raise _PE("sandbox: blocked " + what)

        def norm(p):
            if _isinstance(p, _int) or p is None:
                return p
            try:
                p = _fspath(p)
            except BaseException:
                return None
            if _isinstance(p, _bytes):
                p = p.decode("utf-8", "surrogateescape")
            if not _isinstance(p, _str):
                return None
            return resolve(p)

        def inside(p):
            return p == tmpdir or p.startswith(tmppre)

        def readable(p):
            return inside(p) or p in ro or p.startswith(ropre) or p in read_files

        if event == "open":
            path, mode, flags = (list(args) + [None, None, None])[:3]
            if _isinstance(path, _int):
                return
            p = norm(path)
            if p is None:
                deny("open of an unrecognised path")
            write = False
            if _isinstance(mode, _str) and ("w" in mode or "a" in mode or "x" in mode or "+" in mode):
                write = True
            if _isinstance(flags, _int) and flags > 0 and (flags & WFLAGS):
                write = True
            if write:
                if not inside(p):
                    deny("open for writing outside the sandbox dir: " + p)
                return
            if not readable(p):
                deny("open for reading outside the sandbox dir: " + p)
            if not inside(p):
                try:
                    if _ISDIR(_stat(p).st_mode):
                        deny("open of a directory outside the sandbox dir: " + p)
                except _OSE:
                    pass
            return
        if event == "import":
            name = args[0] if args else ""
            if _isinstance(name, _str) and name.split(".")[0] in BLOCK_MODS:
                deny("import " + name)
            return
        if event in BLOCK_EXACT or event.startswith(BLOCK_PREFIX):
            deny(event)
        if event == "object.__setattr__":
            if len(args) >= 2 and args[1] in ("__code__", "__defaults__", "__kwdefaults__", "__globals__",
                                              "__closure__") and _type(args[0]).__name__ == "function":
                deny("rebinding a function's " + args[1])
            return
        if event in PATH_EV:
            pos, dfd = PATH_EV[event]
            base = None
            for j in dfd:
                if j < len(args) and args[j] is not None and args[j] not in (-1, -100):
                    try:
                        base = resolve(_readlink("/proc/self/fd/%d" % args[j]))
                    except BaseException:
                        base = None
                    if base is None or not inside(base):
                        deny(event + " with a dir_fd outside the sandbox dir")
            for j in pos:
                if j < len(args):
                    a = args[j]
                    if base is not None and _isinstance(a, (_str, _bytes)):
                        a = _fspath(a)
                        if _isinstance(a, _bytes):
                            a = a.decode("utf-8", "surrogateescape")
                        if not a.startswith("/"):
                            a = base + "/" + a
                    p = norm(a)
                    if p is None or _isinstance(p, _int) or not inside(p):
                        deny(event + " outside the sandbox dir: " + str(args[j]))
            return
        if event in READ_EV:
            a = args[READ_EV[event]] if args else None
            if a is None or _isinstance(a, _int):
                return
            p = norm(a)
            if p is None or not readable(p):
                deny(event + " outside the sandbox dir: " + str(a))
            return

    sys.addaudithook(hook)

_boot()
'''

_BOOTSTRAP = _BOOTSTRAP.replace("%(marker)r", repr(VIOLATION_MARKER))

# Syscalls denied with EPERM by the seccomp filter (clone/clone3/prlimit64/tgkill get argument rules).
_DENY_SYSCALLS = (
    "fork", "vfork", "execve", "execveat", "socket", "socketpair", "connect", "bind", "listen", "accept",
    "accept4", "ptrace", "process_vm_readv", "process_vm_writev", "kill", "tkill", "rt_sigqueueinfo",
    "rt_tgsigqueueinfo", "pidfd_open", "pidfd_send_signal", "pidfd_getfd", "mount", "umount2",
    "pivot_root", "chroot", "unshare", "setns", "reboot", "swapon", "swapoff", "init_module",
    "finit_module", "delete_module", "kexec_load", "kexec_file_load", "bpf", "perf_event_open", "keyctl",
    "add_key", "request_key", "userfaultfd", "io_uring_setup", "io_uring_enter", "io_uring_register",
    "setrlimit", "setuid", "setgid", "setreuid", "setregid", "setresuid", "setresgid", "setgroups",
    "setfsuid", "setfsgid", "capset", "personality", "acct", "settimeofday", "clock_settime", "adjtimex",
    "sethostname", "setdomainname", "iopl", "ioperm", "quotactl", "mknod", "mknodat",
    "open_by_handle_at", "name_to_handle_at", "fanotify_init", "syslog", "vhangup", "move_pages",
    "mbind", "migrate_pages", "uselib", "ustat", "sysfs", "fsopen", "fsmount", "fsconfig", "fspick",
    "move_mount", "open_tree", "mount_setattr", "lookup_dcookie", "nfsservctl",
)


@lru_cache(maxsize=1)
def _seccomp_info() -> dict:
    """Whether pyseccomp + libseccomp work in this environment (checked once, in the parent)."""
    if not sys.platform.startswith("linux"):
        return {"ok": False, "reason": "not Linux"}
    try:
        import ctypes.util
        import importlib.util

        spec = importlib.util.find_spec("pyseccomp")
        if spec is None or not spec.origin:
            return {"ok": False, "reason": "pyseccomp not installed"}
        libs = {"c": ctypes.util.find_library("c"), "seccomp": ctypes.util.find_library("seccomp")}
        if not libs["seccomp"]:
            return {"ok": False, "reason": "libseccomp not found"}
        return {"ok": True, "dir": os.path.dirname(spec.origin), "libs": libs}
    except Exception as e:  # pragma: no cover - platform specific
        return {"ok": False, "reason": f"{type(e).__name__}: {e}"}


def sandbox_available() -> dict:
    """Which protections are active on this machine."""
    sc = _seccomp_info()
    return {
        "platform": sys.platform,
        "python": sys.executable,
        "isolated_process": True,
        "empty_env": True,
        "rlimits": hasattr(os, "setsid") and sys.platform.startswith("linux"),
        "rlimit_as_effective": sys.platform.startswith("linux"),
        "audit_hook": hasattr(sys, "addaudithook"),
        "seccomp": bool(sc["ok"]),
        "seccomp_reason": None if sc["ok"] else sc.get("reason"),
        "bwrap": shutil.which("bwrap"),
        "running_as_root": hasattr(os, "geteuid") and os.geteuid() == 0,
    }


class _Reader(threading.Thread):
    """Drain a pipe, keeping at most ``cap`` bytes; ``on_overflow`` is called once when the cap is hit."""

    def __init__(self, stream, cap: int, on_overflow):
        super().__init__(daemon=True)
        self.stream, self.cap, self.on_overflow = stream, cap, on_overflow
        self.chunks: list[bytes] = []
        self.size = 0
        self.overflow = False

    def run(self):
        try:
            while True:
                b = self.stream.read1(65536) if hasattr(self.stream, "read1") else self.stream.read(65536)
                if not b:
                    break
                room = self.cap - self.size
                if room > 0:
                    self.chunks.append(b[:room])
                    self.size += min(len(b), room)
                if len(b) > room and not self.overflow:
                    self.overflow = True
                    self.on_overflow()
        except (OSError, ValueError):
            pass

    def data(self) -> bytes:
        return b"".join(self.chunks)


def _kill_group(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError, OSError):
        pass
    try:
        proc.kill()
    except OSError:
        pass


def _spawn(payload: dict, limits: SandboxLimits, files: dict[str, str] | None, wrapper: list[str] | None,
           stdout_cap: int, _audit_hook: bool = True):
    sc = _seccomp_info()
    tmp = os.path.realpath(tempfile.mkdtemp(prefix="llmtool-sbx-"))
    try:
        for name, content in (files or {}).items():
            target = os.path.realpath(os.path.join(tmp, name))
            if not target.startswith(tmp + os.sep):
                raise ValueError(f"sandbox file name escapes the sandbox dir: {name!r}")
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "w", encoding="utf-8") as fh:
                fh.write(content)
        payload = dict(payload)
        payload.update(
            tmp=tmp,
            limits=asdict(limits),
            seccomp=bool(sc["ok"]),
            seccomp_dir=sc.get("dir"),
            libs=sc.get("libs", {}),
            deny=list(_DENY_SYSCALLS),
            read_files=["/dev/null", "/dev/urandom", "/dev/random"],
            hook=bool(_audit_hook),
        )
        data = json.dumps(payload).encode("utf-8")
        cmd = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP]
        if wrapper:
            cmd = [a.replace("{cwd}", tmp) for a in wrapper] + cmd
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env={},
            start_new_session=True, close_fds=True,
        )
        overflow = {"hit": False}

        def on_overflow():
            overflow["hit"] = True
            _kill_group(proc)

        r_out = _Reader(proc.stdout, stdout_cap, on_overflow)
        r_err = _Reader(proc.stderr, limits.output_bytes, on_overflow)
        r_out.start()
        r_err.start()

        def feed():
            try:
                proc.stdin.write(data)
                proc.stdin.close()
            except (BrokenPipeError, OSError, ValueError):
                pass

        w = threading.Thread(target=feed, daemon=True)
        w.start()
        timed_out = False
        try:
            proc.wait(timeout=limits.wall_seconds)
        except subprocess.TimeoutExpired:
            timed_out = True
            _kill_group(proc)
            proc.wait()
        seconds = time.monotonic() - t0
        _kill_group(proc)  # anything left in the group (nothing should be)
        for t in (r_out, r_err, w):
            t.join(timeout=5)
        for s in (proc.stdin, proc.stdout, proc.stderr):
            try:
                s.close()
            except OSError:
                pass
        return proc.returncode, r_out.data(), r_err.data(), timed_out, seconds, overflow["hit"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _violation(rc: int, stderr: str, timed_out: bool, overflow: bool, limits: SandboxLimits) -> str | None:
    if timed_out:
        return "wall_time"
    if overflow:
        return "output_limit"
    for line in stderr.splitlines():
        if line.startswith(VIOLATION_MARKER):
            return "blocked: " + line[len(VIOLATION_MARKER):].strip()
    if rc == -signal.SIGXCPU or rc == -signal.SIGKILL and not timed_out:
        return "cpu_time"
    if rc == 121:
        return "seccomp_setup_failed"
    if rc != 0 and "MemoryError" in stderr:
        return "memory"
    if rc != 0 and "File too large" in stderr:
        return "file_size"
    return None


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None, wrapper: list[str] | None = None,
               _audit_hook: bool = True) -> SandboxResult:
    """Run ``code`` as a script in the sandbox; ``files`` are written into its temp cwd first.

    ``_audit_hook=False`` is for tests only: it checks that the seccomp layer stops fork/exec/socket on
    its own, as if the audit hook had been bypassed.
    """
    rc, out, err, timed_out, seconds, overflow = _spawn(
        {"mode": "run", "code": code, "stdin": stdin}, limits, files, wrapper, limits.output_bytes,
        _audit_hook,
    )
    err_s = _decode(err)
    return SandboxResult(
        returncode=rc,
        stdout=_decode(out),
        stderr=err_s,
        timed_out=timed_out,
        seconds=seconds,
        violation=_violation(rc, err_s, timed_out, overflow, limits),
    )


def call_many(code: str, func_name: str, inputs: list, *, limits: SandboxLimits = SandboxLimits(),
              wrapper: list[str] | None = None) -> list[CallResult]:
    """Define ``code`` once and call ``func_name(*args)`` for every input, all in ONE sandboxed process.

    Each input is a list/tuple of positional arguments (any other JSON value is passed as the single
    argument). Return values are JSON round-tripped (tuples become lists); an exception on one input is
    recorded for that input only; a crash, timeout or output overflow marks the remaining inputs failed.
    """
    inputs = [list(a) if isinstance(a, tuple) else a for a in inputs]
    if not inputs:
        return []
    cap = limits.output_bytes + 400 * len(inputs)
    rc, out, err, timed_out, seconds, overflow = _spawn(
        {"mode": "call", "code": code, "func": func_name, "inputs": inputs}, limits, None, wrapper, cap
    )
    err_s = _decode(err)
    results: list[CallResult | None] = [None] * len(inputs)
    fatal = None
    for line in _decode(out).splitlines():
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if not isinstance(rec, dict):
            continue
        if "fatal" in rec:
            fatal = str(rec["fatal"])
            break
        i = rec.get("i")
        if isinstance(i, int) and 0 <= i < len(inputs) and results[i] is None:
            results[i] = CallResult(True, rec.get("value")) if rec.get("ok") else CallResult(
                False, None, str(rec.get("error")))
    if fatal is not None:
        reason = fatal
    else:
        v = _violation(rc, err_s, timed_out, overflow, limits)
        tail = err_s.strip().splitlines()[-1][:300] if err_s.strip() else ""
        reason = f"process failed (exit {rc}{', ' + v if v else ''}){': ' + tail if tail else ''}"
        if timed_out:
            reason = f"timed out after {limits.wall_seconds:g}s"
        elif v == "cpu_time":
            reason = f"timed out: CPU limit of {limits.cpu_seconds:g}s reached (exit {rc})"
    return [r if r is not None else CallResult(False, None, reason) for r in results]

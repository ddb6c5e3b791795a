"""Run untrusted (model-generated) Python in a separate process whose containment the kernel enforces.

Shared by every area that executes generated code (``learn-program``, route's code and HumanEval scoring,
bench-agent's ``os-sandbox`` env and ``python_execute`` tool). Generated code never runs in the parent
interpreter. Threat model, per-layer guarantees and what is *not* isolated: ``docs/security.md``; the
layers active on this machine: ``python -m llmtool.core.sandbox``.

Layers, in the order the child applies them (all before any untrusted code runs):

1. A fresh ``python -I -S`` child (isolated mode, no site-packages) with an empty environment, in its own
   session, stdin ``/dev/null``, rlimits (CPU seconds soft/hard, address space, file size, open files,
   no core files). RLIMIT_NPROC is not relied upon (it does not stop ``fork`` for root).
2. **User + mount + network + IPC + UTS namespaces** (:mod:`llmtool.core.mountns`) where the kernel
   allows unprivileged user namespaces: the child ``pivot_root``\\ s into a minimal tree holding only the
   stdlib and system library dirs (read-only), ``/dev/null`` and ``/dev/urandom``, and its working dir,
   which is a fresh **size-limited tmpfs** (``disk_mb``, ``max_files``): the total bytes it can write are
   capped by the kernel, ``stat`` probes of any outside path see nothing, and there is no network.
3. **Landlock** (:mod:`llmtool.core.landlock`, ABI 1-7): every file-system right the ABI knows is denied
   except read on the stdlib/library dirs and the device files and full access below the working dir;
   TCP bind/connect denied (ABI >= 4); abstract unix sockets and signals scoped (ABI >= 6);
   ``PR_SET_NO_NEW_PRIVS``. Race-free (the kernel checks at resolution time: rename/symlink races and hard
   links cannot reach outside). Without a mount namespace the working dir is the host temp dir and the
   child may *not create* files in it (only the ``files`` written for it), so the bytes are still bounded
   by the kernel (``files`` x ``file_size_mb``).
4. **seccomp** (PyPI ``pyseccomp``, when importable) deny-list: fork/vfork, any ``clone`` (threads only
   with ``allow_threads=True``: then ``clone`` without ``CLONE_THREAD``), execve/execveat, sockets,
   ptrace/process_vm_*, kill/tgkill to others, setrlimit/prlimit64, mount/unshare/setns/pivot_root/bpf/
   io_uring/keyring/module/identity calls, and file metadata changes (chmod/chown/utime/xattr families,
   which Landlock does not cover); ``clone3`` returns ENOSYS (glibc falls back to ``clone``); only
   the native architecture (libseccomp's bad-arch action kills).
5. A ``sys.addaudithook`` guard, **defence in depth only** (PEP 578: audit hooks are not a security
   boundary; a candidate can reach the hook's state through frames): path checks for open/remove/rename/...,
   blocks os.system/exec/spawn/fork/subprocess/socket/ctypes/gc traversal/thread start (unless allowed) and
   imports of ctypes, socket, subprocess, multiprocessing, .... Each blocked event writes a marker line to
   stderr, and any marker fails the whole run.

**Refuse, never degrade**: when neither Landlock nor a mount namespace can be applied (old kernel, both
disabled), the child reports the missing layers and exits before running anything, and the parent raises
:class:`~llmtool.core.console.UsageError` naming the way out: an outer container/bwrap ``wrapper``
(``--sandbox-cmd`` of learn-program, or ``LLMTOOL_SANDBOX_CMD`` for every command), under which the run
proceeds with whatever layers the wrapper leaves. ``LLMTOOL_SANDBOX_DISABLE=landlock,userns`` simulates
missing layers (tests, docs).

**Result channel**: results never travel on the candidate's stdout. The parent passes a dedicated pipe fd;
every record on it carries a per-run random token; the first record reports the layers the child got
(``SandboxResult.layers``, ``CallResult.layers``). ``run_python`` sets ``completed`` only from a sentinel
the bootstrap writes *after* the program -- and, with ``harness=``, the test harness (e.g. HumanEval's
``check``) -- returned; ``sys.exit``/``os._exit`` before that, forged stdout lines and any violation
marker leave it false. ``call_many`` scores nothing: it returns JSON values, and callers compare them with
expected values in the parent. The per-run token stops forged lines on inherited fds; a candidate that
deliberately introspects the bootstrap's frames can still read it (same process): ``docs/security.md``.

``call_many`` defines the code once and calls one function on many inputs in the same process (one
process per candidate, not per input), streaming one record per result so that a timeout or crash keeps
the results already produced and marks only the remaining inputs as failed.

Reconstructed choices (ours): reads outside the working dir and the stdlib/system-library dirs are denied
too (stops reading secrets); ``TMPDIR``/``HOME`` point at the working dir; ``stdin`` is delivered as a
string (``sys.stdin`` is a ``StringIO``); the HumanEval harness runs with a snapshot of the builtins taken
before the candidate ran, and the function under test must return plain data (exact builtin types: an
``__eq__``-always-true object fails).
"""

from __future__ import annotations

import json
import os
import secrets
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from functools import lru_cache

__all__ = [
    "SandboxLimits",
    "SandboxResult",
    "CallResult",
    "run_python",
    "call_many",
    "sandbox_available",
    "active_layers",
    "VIOLATION_MARKER",
]

VIOLATION_MARKER = "@@LLMTOOL-SANDBOX-VIOLATION@@"
DISABLE_ENV = "LLMTOOL_SANDBOX_DISABLE"   # comma list of "landlock", "userns" (simulate missing layers)
WRAPPER_ENV = "LLMTOOL_SANDBOX_CMD"       # default outer wrapper command for every command
_REFUSED_RC = 122
# an outer wrapper that works here (``{cwd}`` = the per-run sandbox dir; ``--proc`` lets the child still
# create its own user/mount namespaces inside)
BWRAP_EXAMPLE = ("bwrap --unshare-all --die-with-parent --ro-bind / / --dev /dev --proc /proc "
                 "--bind {cwd} {cwd}")


@dataclass(frozen=True)
class SandboxLimits:
    cpu_seconds: float = 10
    wall_seconds: float = 20
    memory_mb: int = 1024
    file_size_mb: int = 16
    open_files: int = 64
    output_bytes: int = 1_000_000
    allow_threads: bool = False
    disk_mb: int = 32          # total bytes the child may hold in its working dir (tmpfs size)
    max_files: int = 256       # inodes of that tmpfs


@dataclass
class SandboxResult:
    returncode: int
    stdout: str
    stderr: str
    timed_out: bool
    seconds: float
    violation: str | None
    completed: bool = False    # the sentinel after the program (and harness) returned reached the parent
    layers: dict = field(default_factory=dict)


@dataclass
class CallResult:
    ok: bool
    value: object = None
    error: str | None = None
    layers: dict | None = None


# --------------------------------------------------------------------------------------------------
# The bootstrap executed by the child interpreter (``python -I -S -c BOOTSTRAP``). It reads one JSON
# payload from stdin, locks itself down (namespaces, Landlock, seccomp, audit hook), then runs the
# untrusted code. Nothing untrusted runs before the last lock is in place.
# --------------------------------------------------------------------------------------------------
_BOOTSTRAP = r'''
import sys, os, json, io, resource, stat, traceback, linecache, builtins
def _boot():
    P = json.loads(sys.stdin.buffer.read().decode("utf-8"))
    tmp, rfd = P["tmp"], P["rfd"]
    _tok, _dumps, _oswrite = P.pop("token"), json.dumps, os.write
    def emit(rec, _tok=_tok, _dumps=_dumps, _w=_oswrite, _rfd=rfd):
        rec["t"] = _tok
        b = (_dumps(rec) + "\n").encode("utf-8")
        while b:
            b = b[_w(_rfd, b):]
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
    lim(resource.RLIMIT_FSIZE, int(L["file_size_mb"]) * MB)
    lim(resource.RLIMIT_CORE, 0)
    layers = {"userns": False, "mountns": False, "netns": False, "landlock": 0, "seccomp": False,
              "audit_hook": bool(P["hook"]), "threads_allowed": bool(L["allow_threads"]), "disk_cap": None,
              "wrapper": bool(P["wrapped"])}
    why = []
    S = None
    import ctypes, ctypes.util
    if P["seccomp"]:
        try:
            libs = P["libs"]
            ctypes.util.find_library = lambda n, _l=libs: _l.get(n)
            sys.path.insert(0, P["seccomp_dir"])
            try:
                import pyseccomp as S
            finally:
                del sys.path[0]
        except BaseException as e:
            os.write(2, ("sandbox: seccomp setup failed: %r\n" % (e,)).encode())
            os._exit(121)
    ro = []
    for p in [os.path.dirname(os.__file__)] + list(sys.path) + P["sys_ro"]:
        if p and os.path.isdir(p):
            p = p if os.path.islink(p) else os.path.realpath(p)
            if p not in ro:
                ro.append(p)
    # outermost dirs only (a system Python's stdlib may live below /usr/lib)
    ro = [p for p in ro if not any(p.startswith(q.rstrip("/") + "/") for q in ro if q != p)]
    stdlib = [p for p in ro if p not in P["sys_ro"]]
    ro_files = [f for f in P["read_files"] if os.path.exists(f)]
    disk_kb = int(L["disk_mb"]) * 1024 + sum(-(-len(v.encode("utf-8")) // 4096) * 4 for v in P["files"].values())
    inodes = int(L["max_files"]) + len(P["files"]) + 16
    g = {}
    if "userns" not in P["disable"] and P.get("root"):
        try:
            exec(compile(P["mountns_src"], "llmtool/core/mountns.py", "exec"), g)
            g["enter"](P["root"], tmp, ro, ro_files, disk_kb, inodes)
            layers.update(userns=True, mountns=True, netns=True, disk_cap="tmpfs %d MB, %d files" % (
                L["disk_mb"], L["max_files"]))
        except g.get("HalfEntered", ()) as e:
            emit({"layers": layers, "retry_without_userns": str(e)})
            os._exit(%(refused_rc)d)
        except BaseException as e:
            why.append("user/mount namespaces: %s" % (e,))
            if os.getcwd() != tmp:
                try:
                    os.chdir(tmp)
                except OSError:
                    pass
    else:
        why.append("user/mount namespaces: disabled" if "userns" in P["disable"] else "no root dir")
    for name, content in P["files"].items():
        target = os.path.join(tmp, name)
        os.makedirs(os.path.dirname(target), exist_ok=True)
        with open(target, "w", encoding="utf-8") as fh:
            fh.write(content)
    if "landlock" not in P["disable"]:
        try:
            g = {}
            exec(compile(P["landlock_src"], "llmtool/core/landlock.py", "exec"), g)
            R = g["READ_RIGHTS"]
            work = -1 & ~(g["MAKE_CHAR"] | g["MAKE_BLOCK"] | g["IOCTL_DEV"])
            if not layers["mountns"]:
                # no kernel byte cap on the host temp dir: no new files, only the ones written above
                work = g["READ_RIGHTS"] | g["WRITE_FILE"] | g["TRUNCATE"]
                layers["disk_cap"] = "no new files (RLIMIT_FSIZE per file)"
            rules = [(p, R) for p in ro] + [(f, g["READ_FILE"]) for f in ro_files] + [(tmp, work)]
            layers["landlock"] = g["restrict"](rules)
        except BaseException as e:
            why.append("Landlock: %s" % (e,))
    else:
        why.append("Landlock: disabled")
    del g
    if not (layers["landlock"] or layers["mountns"]) and not P["wrapped"]:
        emit({"layers": layers, "refused": "; ".join(why)})
        os._exit(%(refused_rc)d)
    lim(resource.RLIMIT_AS, int(L["memory_mb"]) * MB)
    lim(resource.RLIMIT_NOFILE, int(L["open_files"]))
    if S is not None:
        try:
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
            del f
            layers["seccomp"] = True
        except BaseException as e:
            os.write(2, ("sandbox: seccomp setup failed: %r\n" % (e,)).encode())
            os._exit(121)
        del S
    for m in [m for m in sys.modules if m.split(".")[0] in ("ctypes", "_ctypes", "pyseccomp")]:
        del sys.modules[m]
    emit({"layers": layers})
    sys.path.append(tmp)
    B = dict(vars(builtins))
    if P["hook"]:
        _install_hook(tmp, tuple(stdlib), tuple(ro_files), bool(L["allow_threads"]))
    del P["limits"]
    code = P["code"]
    linecache.cache["<candidate>"] = (len(code), None, code.splitlines(True), "<candidate>")
    mode = P["mode"]
    if mode == "run":
        sys.stdin = io.StringIO(P["stdin"])
        H = P.get("harness")
        ns = {"__name__": "__main__", "__builtins__": __builtins__}
        del P
        try:
            exec(compile(code, "<candidate>", "exec"), ns)
            if H:
                target = ns.get(H["target"])
                if not callable(target):
                    raise NameError("function %r is not defined" % (H["target"],))
                hns = {k: v for k, v in ns.items() if k not in B}
                hns["__builtins__"] = dict(B)
                hns["__name__"] = "__main__"
                exec(compile(H["code"], "<harness>", "exec"), hns)
                hns[H["call"]](_plain(target))
            sys.stdout.flush()
        except SystemExit:
            raise
        except BaseException:
            traceback.print_exc()
            sys.stderr.flush()
            os._exit(1)
        emit({"done": True})
        return
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
        emit({"fatal": err(e)})
        os._exit(0)
    for i, args in enumerate(inputs):
        try:
            v = fn(*args) if isinstance(args, list) else fn(args)
            try:
                rec = {"i": i, "ok": True, "value": v}
                _dumps(rec)
            except BaseException:
                rec = {"i": i, "ok": False, "error": "unserialisable return value of type %s" % type(v).__name__}
        except BaseException as e:
            rec = {"i": i, "ok": False, "error": err(e)}
        emit(rec)
    emit({"done": True})
    sys.stdout.flush()
    os._exit(0)

def _plain(fn, _type=type, _len=len, _TE=TypeError, _dget=dict.__getitem__, _dict=dict,
           _ok=(int, float, complex, str, bytes, bool, type(None)), _seq=(list, tuple, set, frozenset)):
    """Wrap the function under test: its return values must be plain data of exact builtin types."""
    def check(v, depth, _type=_type, _ok=_ok, _seq=_seq, _TE=_TE, _dget=_dget, _dict=_dict):
        t = _type(v)
        if t in _ok:
            return
        if depth > 64:
            raise _TE("sandbox: return value nested too deeply")
        if t in _seq:
            for e in v:
                check(e, depth + 1)
            return
        if t is _dict:
            for k in v:
                check(k, depth + 1)
                check(_dget(v, k), depth + 1)
            return
        raise _TE("sandbox: the function under test returned a %s, not plain data" % (t.__name__,))
    def guarded(*a, **k):
        v = fn(*a, **k)
        check(v, 0)
        return v
    return guarded

def _install_hook(tmp, ro, read_files, allow_threads):
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
    if not allow_threads:
        BLOCK_EXACT = BLOCK_EXACT | frozenset(("_thread.start_new_thread",))
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



_BOOTSTRAP = _BOOTSTRAP.replace("%(marker)r", repr(VIOLATION_MARKER)).replace("%(refused_rc)d", str(_REFUSED_RC))

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
    # file metadata changes: Landlock (ABI <= 7) does not restrict them
    "chmod", "fchmod", "fchmodat", "fchmodat2", "chown", "fchown", "lchown", "fchownat", "utime", "utimes",
    "utimensat", "futimesat", "setxattr", "lsetxattr", "fsetxattr", "removexattr", "lremovexattr",
    "fremovexattr",
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



# read-only system dirs the child may load shared libraries from (lib-dynload modules link against them)
_SYS_RO = ("/lib", "/lib64", "/usr/lib", "/usr/lib64")
_READ_FILES = ("/dev/null", "/dev/urandom", "/etc/ld.so.cache")


@lru_cache(maxsize=1)
def _module_sources() -> tuple[str, str]:
    here = os.path.dirname(os.path.abspath(__file__))
    with open(os.path.join(here, "landlock.py"), encoding="utf-8") as f:
        ll = f.read()
    with open(os.path.join(here, "mountns.py"), encoding="utf-8") as f:
        ns = f.read()
    return ll, ns


# set once a child could create the namespaces but not set them up (e.g. uid_map not writable): later
# children of this process skip them instead of failing the same way
_USERNS_BROKEN: list[str] = []


def _disabled() -> list[str]:
    off = {s.strip() for s in os.environ.get(DISABLE_ENV, "").split(",") if s.strip()}
    return sorted(off | ({"userns"} if _USERNS_BROKEN else set()))


def default_wrapper() -> list[str] | None:
    """The outer wrapper from ``LLMTOOL_SANDBOX_CMD`` (shell-split), or None."""
    cmd = os.environ.get(WRAPPER_ENV, "").strip()
    return shlex.split(cmd) if cmd else None


def sandbox_available() -> dict:
    """Which protections this process can request (cheap, no child started; see :func:`active_layers`)."""
    from llmtool.core import landlock

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
        "landlock_abi": landlock.abi_version() if sys.platform.startswith("linux") else 0,
        "disabled": _disabled(),
        "bwrap": shutil.which("bwrap"),
        "wrapper_env": os.environ.get(WRAPPER_ENV) or None,
        "running_as_root": hasattr(os, "geteuid") and os.geteuid() == 0,
    }


def active_layers(wrapper: list[str] | None = None) -> dict:
    """The layers a sandboxed child actually gets on this machine: runs one trivial child and returns its
    report (``landlock`` = ABI version or 0, ``userns``/``mountns``/``netns``, ``seccomp``, ``audit_hook``,
    ``threads_allowed``, ``disk_cap``, ``wrapper``). Raises UsageError when the sandbox would refuse to run."""
    return _active_layers(tuple(wrapper or default_wrapper() or ()), tuple(_disabled()))


@lru_cache(maxsize=8)
def _active_layers(wrapper: tuple, disabled: tuple) -> dict:
    return dict(run_python("pass", wrapper=list(wrapper) or None).layers)


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


def _refusal(layers_rec: dict) -> None:
    from llmtool.core.console import UsageError

    raise UsageError(
        "refusing to run generated code: no kernel file-containment layer is available "
        f"({layers_rec.get('refused') or 'Landlock and user/mount namespaces unavailable'}); wrap it: "
        f"--sandbox-cmd '{BWRAP_EXAMPLE}' (learn-program) or {WRAPPER_ENV}='...' (every command), "
        "see docs/security.md")


def _spawn(payload: dict, limits: SandboxLimits, files: dict[str, str] | None, wrapper: list[str] | None,
           stdout_cap: int, result_cap: int, _audit_hook: bool = True):
    """Start the child, feed it the payload, collect stdout/stderr and the result channel.

    Returns ``(rc, stdout, stderr, timed_out, seconds, overflow, records)``; ``records`` are the result
    channel's JSON records carrying this run's token (anything else on that pipe is dropped)."""
    sc = _seccomp_info()
    args = (payload, limits, files, wrapper, stdout_cap, result_cap, _audit_hook)
    if wrapper is None:
        wrapper = default_wrapper()
    base = os.path.realpath(tempfile.mkdtemp(prefix="llmtool-sbx-"))
    tmp, root = os.path.join(base, "work"), os.path.join(base, "root")
    token = secrets.token_hex(16)
    rfd = wfd = None
    try:
        os.mkdir(tmp, 0o700)
        os.mkdir(root, 0o700)
        clean: dict[str, str] = {}
        for name, content in (files or {}).items():
            target = os.path.normpath(os.path.join(tmp, name))
            if not target.startswith(tmp + os.sep) or os.path.isabs(name):
                raise ValueError(f"sandbox file name escapes the sandbox dir: {name!r}")
            clean[os.path.relpath(target, tmp)] = str(content)
        ll_src, ns_src = _module_sources()
        rfd, wfd = os.pipe()
        payload = dict(payload)
        payload.update(
            tmp=tmp, root=root, rfd=wfd, token=token, files=clean,
            limits=asdict(limits),
            seccomp=bool(sc["ok"]),
            seccomp_dir=sc.get("dir"),
            libs=sc.get("libs", {}),
            deny=list(_DENY_SYSCALLS),
            sys_ro=[p for p in _SYS_RO if os.path.exists(p)],
            read_files=list(_READ_FILES),
            hook=bool(_audit_hook),
            wrapped=bool(wrapper),
            disable=_disabled(),
            landlock_src=ll_src, mountns_src=ns_src,
        )
        data = json.dumps(payload).encode("utf-8")
        cmd = [sys.executable, "-I", "-S", "-c", _BOOTSTRAP]
        if wrapper:
            cmd = [a.replace("{cwd}", base) for a in wrapper] + cmd
        t0 = time.monotonic()
        proc = subprocess.Popen(
            cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, cwd=tmp, env={},
            start_new_session=True, close_fds=True, pass_fds=(wfd,),
        )
        os.close(wfd)
        wfd = None
        overflow = {"hit": False}

        def on_overflow():
            overflow["hit"] = True
            _kill_group(proc)

        r_out = _Reader(proc.stdout, stdout_cap, on_overflow)
        r_err = _Reader(proc.stderr, limits.output_bytes, on_overflow)
        r_res = _Reader(os.fdopen(rfd, "rb", buffering=0), result_cap, on_overflow)
        rfd = None
        for t in (r_out, r_err, r_res):
            t.start()

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
        for t in (r_out, r_err, r_res, w):
            t.join(timeout=5)
        for s in (proc.stdin, proc.stdout, proc.stderr, r_res.stream):
            try:
                s.close()
            except OSError:
                pass
        records = []
        for line in _decode(r_res.data()).splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and rec.get("t") == token:
                records.append(rec)
        if records and "retry_without_userns" in records[0] and not _USERNS_BROKEN:
            _USERNS_BROKEN.append(str(records[0]["retry_without_userns"]))
        elif records and "refused" in records[0]:
            _refusal(records[0])
        else:
            return proc.returncode, r_out.data(), r_err.data(), timed_out, seconds, overflow["hit"], records
    finally:
        for fd in (rfd, wfd):
            if fd is not None:
                os.close(fd)
        shutil.rmtree(base, ignore_errors=True)
    return _spawn(*args)     # the namespaces were half set up: once more without them (no code ran)


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
    if rc == -signal.SIGSYS:
        return "seccomp_kill"
    if rc != 0 and "MemoryError" in stderr:
        return "memory"
    if rc != 0 and ("File too large" in stderr or "No space left on device" in stderr):
        return "file_size"
    return None


def _decode(b: bytes) -> str:
    return b.decode("utf-8", "replace")


def _layers_of(records: list[dict]) -> dict:
    return dict(records[0]["layers"]) if records and isinstance(records[0].get("layers"), dict) else {}


def run_python(code: str, *, stdin: str = "", limits: SandboxLimits = SandboxLimits(),
               files: dict[str, str] | None = None, wrapper: list[str] | None = None,
               harness: dict | None = None, _audit_hook: bool = True) -> SandboxResult:
    """Run ``code`` as a script in the sandbox; ``files`` are written into its working dir first.

    ``harness``: ``{"code": test_source, "call": "check", "target": "entry_point"}`` -- after ``code``
    returns, ``test_source`` is executed with a snapshot of the builtins taken before ``code`` ran and
    ``call(target)`` is called with ``target`` wrapped so that it must return plain data.
    ``completed`` is true only when the sentinel written after all that reached the parent on the
    result channel. ``_audit_hook=False`` is for tests only (kernel layers on their own).
    """
    payload = {"mode": "run", "code": code, "stdin": stdin}
    if harness is not None:
        payload["harness"] = {"code": str(harness["code"]), "call": str(harness["call"]),
                              "target": str(harness["target"])}
    rc, out, err, timed_out, seconds, overflow, records = _spawn(
        payload, limits, files, wrapper, limits.output_bytes, 64_000, _audit_hook,
    )
    err_s = _decode(err)
    violation = _violation(rc, err_s, timed_out, overflow, limits)
    done = any(r.get("done") is True for r in records[1:])
    return SandboxResult(
        returncode=rc,
        stdout=_decode(out),
        stderr=err_s,
        timed_out=timed_out,
        seconds=seconds,
        violation=violation,
        completed=bool(done and rc == 0 and violation is None and not timed_out),
        layers=_layers_of(records),
    )


def call_many(code: str, func_name: str, inputs: list, *, limits: SandboxLimits = SandboxLimits(),
              wrapper: list[str] | None = None, _audit_hook: bool = True) -> list[CallResult]:
    """Define ``code`` once and call ``func_name(*args)`` for every input, all in ONE sandboxed process.

    Each input is a list/tuple of positional arguments (any other JSON value is passed as the single
    argument). Return values are JSON round-tripped (tuples become lists); an exception on one input is
    recorded for that input only; a crash, timeout or output overflow marks the remaining inputs failed;
    a violation marker (a blocked operation) fails every input. Results come only from the token-carrying
    records of the dedicated result pipe: lines the candidate prints or writes to other fds are ignored.
    """
    inputs = [list(a) if isinstance(a, tuple) else a for a in inputs]
    if not inputs:
        return []
    cap = limits.output_bytes + 400 * len(inputs)
    rc, out, err, timed_out, seconds, overflow, records = _spawn(
        {"mode": "call", "code": code, "func": func_name, "inputs": inputs}, limits, None, wrapper,
        limits.output_bytes, cap, _audit_hook,
    )
    layers = _layers_of(records)
    err_s = _decode(err)
    results: list[CallResult | None] = [None] * len(inputs)
    fatal = None
    for rec in records[1:]:
        if "fatal" in rec:
            fatal = str(rec["fatal"])
            break
        i = rec.get("i")
        if isinstance(i, int) and 0 <= i < len(inputs) and results[i] is None:
            results[i] = CallResult(True, rec.get("value"), None, layers) if rec.get("ok") is True else \
                CallResult(False, None, str(rec.get("error")), layers)
    v = _violation(rc, err_s, timed_out, overflow, limits)
    if v is not None and v.startswith("blocked: "):
        # a blocked operation fails the candidate on every input, whatever its outputs were
        why = f"{fatal} (sandbox violation)" if fatal else "sandbox violation: " + v.replace("blocked: ", "blocked ", 1)
        return [CallResult(False, None, why, layers) for _ in inputs]
    if fatal is not None:
        reason = fatal
    else:
        tail = err_s.strip().splitlines()[-1][:300] if err_s.strip() else ""
        reason = f"process failed (exit {rc}{', ' + v if v else ''}){': ' + tail if tail else ''}"
        if timed_out:
            reason = f"timed out after {limits.wall_seconds:g}s"
        elif v == "cpu_time":
            reason = f"timed out: CPU limit of {limits.cpu_seconds:g}s reached (exit {rc})"
    return [r if r is not None else CallResult(False, None, reason, layers) for r in results]


def layers_table(layers: dict) -> str:
    """A markdown table of the layers a sandboxed child got (for docs/security.md and doctor output)."""
    rows = [
        ("Landlock", f"ABI {layers['landlock']}" if layers.get("landlock") else "no"),
        ("user namespace", "yes" if layers.get("userns") else "no"),
        ("mount namespace (minimal root, no stat probes outside)", "yes" if layers.get("mountns") else "no"),
        ("network namespace (no network)", "yes" if layers.get("netns") else "no"),
        ("seccomp deny-list", "yes" if layers.get("seccomp") else "no"),
        ("audit hook (defence in depth)", "yes" if layers.get("audit_hook") else "no"),
        ("threads for candidates", "allowed" if layers.get("threads_allowed") else "denied"),
        ("total-bytes cap of the working dir", layers.get("disk_cap") or "none"),
        ("outer wrapper", "yes" if layers.get("wrapper") else "no"),
    ]
    return "\n".join(["| layer | active |", "|---|---|"] + [f"| {a} | {b} |" for a, b in rows])


def _main(argv: list[str] | None = None) -> int:
    """``python -m llmtool.core.sandbox [--json]``: print the layers a sandboxed child gets here."""
    from llmtool.core.console import UsageError

    argv = sys.argv[1:] if argv is None else argv
    try:
        layers = active_layers()
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if "--json" in argv:
        print(json.dumps({"layers": layers, "available": sandbox_available()}, indent=2))
    else:
        print(layers_table(layers))
    return 0


if __name__ == "__main__":
    raise SystemExit(_main())

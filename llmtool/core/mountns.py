"""User + mount + network (+ IPC, UTS) namespaces for the sandbox child: a minimal file-system view.

Used by :mod:`llmtool.core.sandbox` inside the child interpreter (single-threaded, before any untrusted
code; stdlib + ``ctypes`` only). Kernel interfaces: unshare(2), user_namespaces(7) (``/proc/self/uid_map``,
``gid_map``, ``setgroups``), mount_namespaces(7), mount(2), pivot_root(2), capset(2).

``enter(newroot, work, ro_paths, dev_files, size_kb, inodes)``:

1. ``unshare(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)``; the process's own
   uid/gid is mapped to itself (one id, ``setgroups`` denied). A fresh network namespace has only a
   loopback interface that is down: no network at all.
2. Mount propagation of ``/`` is made private (nothing leaks back to the host), a small tmpfs is mounted
   on ``newroot`` (an empty dir the parent created), and only these are placed in it, at their own absolute
   paths: each of ``ro_paths`` (the interpreter's stdlib dirs, the system shared-library dirs) as a
   read-only recursive bind mount, each of ``dev_files`` (``/dev/null``, ``/dev/urandom``, the dynamic
   linker cache) as a read-only bind of the host's file, and ``work`` as a *fresh tmpfs* with ``size=size_kb`` and ``nr_inodes=inodes``: the kernel caps
   the total bytes and the number of files the child can write (ENOSPC past the cap).
3. ``pivot_root`` into the new root; the old root is detached (``umount2(MNT_DETACH)``), and the root
   skeleton is remounted read-only. Nothing else exists inside -- no ``/proc``, ``/sys``, home, project or
   data dir; of ``/tmp`` or a home dir only the empty directories leading to the working dir or the stdlib
   -- so ``stat`` probes of any other path see ENOENT.
4. All capabilities are dropped (``capset`` with empty sets), so the namespace's root cannot mount, unshare
   or change ids again (the sandbox's seccomp filter and Landlock deny those too).

Raises ``OSError`` on any failure; the caller decides whether to refuse or fall back. A failure *after*
``unshare`` succeeded raises :class:`HalfEntered` (the process is then in a half-built namespace and must
not go on: the sandbox restarts the run without namespaces).
"""

from __future__ import annotations

import ctypes
import os

__all__ = ["enter", "HalfEntered"]

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_NOATIME, MS_NODIRATIME, MS_BIND, MS_REC = 32, 1024, 2048, 4096, 16384
MS_PRIVATE, MS_RELATIME = 1 << 18, 1 << 21
ST_RELATIME = 4096
MNT_DETACH = 2
_PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "arm64": 41}


class HalfEntered(OSError):
    """The namespaces were created but setting them up failed."""


def _check(r: int, what: str, libc) -> None:
    if r != 0:
        e = ctypes.get_errno()
        raise OSError(e, f"{what}: {os.strerror(e)}")


def _write(path: str, text: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, text.encode())
    finally:
        os.close(fd)


def _locked_flags(path: str) -> int:
    """Flags of the mount that holds ``path`` that a remount inside a user namespace must keep (locked)."""
    f = os.statvfs(path).f_flag
    flags = f & (MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_NOATIME | MS_NODIRATIME)
    if f & ST_RELATIME:
        flags |= MS_RELATIME
    return flags


def enter(newroot: str, work: str, ro_paths: list[str], dev_files: list[str], size_kb: int, inodes: int) -> None:
    libc = ctypes.CDLL(None, use_errno=True)
    machine = os.uname().machine          # not platform.machine(): importing platform costs ~30 ms here
    pivot_nr = _PIVOT_ROOT.get(machine)
    if pivot_nr is None:
        raise OSError(38, f"pivot_root syscall number unknown for {machine}")
    uid, gid = os.getuid(), os.getgid()
    _check(libc.unshare(ctypes.c_int(CLONE_NEWUSER | CLONE_NEWNS | CLONE_NEWNET | CLONE_NEWIPC | CLONE_NEWUTS)),
           "unshare", libc)
    try:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{uid} {uid} 1\n")
        _write("/proc/self/gid_map", f"{gid} {gid} 1\n")

        def mount(src, tgt, fstype, flags, data=None):
            _check(libc.mount(src and src.encode(), tgt.encode(), fstype and fstype.encode(), ctypes.c_ulong(flags),
                              data and data.encode()), f"mount {tgt}", libc)

        mount(None, "/", None, MS_REC | MS_PRIVATE)
        mount("tmpfs", newroot, "tmpfs", MS_NOSUID | MS_NODEV, "size=1m,nr_inodes=1024,mode=0755")
        for p in ro_paths:
            if os.path.islink(p):           # merged-/usr systems: /lib -> usr/lib
                os.makedirs(newroot + os.path.dirname(p), exist_ok=True)
                os.symlink(os.readlink(p), newroot + p)
                continue
            if not os.path.isdir(p):
                continue
            os.makedirs(newroot + p, exist_ok=True)
            mount(p, newroot + p, None, MS_BIND | MS_REC)
            mount(None, newroot + p, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags(p))
        for f in dev_files:
            if not os.path.exists(f):
                continue
            os.makedirs(newroot + os.path.dirname(f), exist_ok=True)
            os.close(os.open(newroot + f, os.O_WRONLY | os.O_CREAT, 0o666))
            mount(f, newroot + f, None, MS_BIND)
            mount(None, newroot + f, None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | _locked_flags(f))
        os.makedirs(newroot + work, exist_ok=True)
        mount("tmpfs", newroot + work, "tmpfs", MS_NOSUID | MS_NODEV,
              f"size={max(int(size_kb), 4)}k,nr_inodes={max(int(inodes), 8)},mode=0700")
        os.makedirs(newroot + "/.old-root")
        libc.syscall.restype = ctypes.c_long
        _check(libc.syscall(ctypes.c_long(pivot_nr), newroot.encode(), (newroot + "/.old-root").encode()),
               "pivot_root", libc)
        os.chdir("/")
        _check(libc.umount2(b"/.old-root", ctypes.c_int(MNT_DETACH)), "umount2 old root", libc)
        os.rmdir("/.old-root")
        mount(None, "/", None, MS_BIND | MS_REMOUNT | MS_RDONLY | MS_NOSUID | MS_NODEV | _locked_flags("/"))
        os.chdir(work)
        # drop every capability of the namespace's root: struct __user_cap_header_struct {u32 version; int pid}
        # + two struct __user_cap_data_struct {u32 effective, permitted, inheritable} (version 3 = 0x20080522)
        hdr = (ctypes.c_uint32 * 2)(0x20080522, 0)
        data = (ctypes.c_uint32 * 6)()
        _check(libc.capset(hdr, data), "capset", libc)
    except OSError as e:
        raise HalfEntered(e.errno or 0, f"after unshare: {e}") from None

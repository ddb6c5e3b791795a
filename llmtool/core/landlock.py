"""Landlock: unprivileged, kernel-enforced file-system (and TCP / scope) restriction of the calling thread.

Used by :mod:`llmtool.core.sandbox` inside the child interpreter, after the child has imported what it needs
and *before* any untrusted code runs. Stdlib only (``ctypes`` + raw syscalls), because the child runs
``python -I -S`` without site-packages; the sandbox removes ``ctypes`` from ``sys.modules`` afterwards.

Kernel interface (Documentation/userspace-api/landlock.rst, include/uapi/linux/landlock.h):

- ``landlock_create_ruleset(attr, size, flags)`` (syscall 444 on every architecture that has it): with
  ``flags = LANDLOCK_CREATE_RULESET_VERSION`` (1) and a NULL attr it returns the ABI version.
  ``struct landlock_ruleset_attr {u64 handled_access_fs; u64 handled_access_net; u64 scoped;}``: the
  kernel reads ``size`` bytes, so the struct is passed truncated to what the ABI knows (8 bytes for ABI 1-3,
  16 for ABI 4-5, 24 for ABI >= 6).
- ``landlock_add_rule(ruleset_fd, LANDLOCK_RULE_PATH_BENEATH, &attr, 0)`` (445) with the packed
  ``struct landlock_path_beneath_attr {u64 allowed_access; s32 parent_fd;}`` (12 bytes) and an ``O_PATH``
  fd of the file or directory; a rule on a non-directory may only carry file rights.
- ``landlock_restrict_self(ruleset_fd, 0)`` (446) after ``prctl(PR_SET_NO_NEW_PRIVS, 1)``; irrevocable,
  inherited by every thread created afterwards and by children.

Access rights by ABI: 1 = EXECUTE .. MAKE_SYM (bits 0-12); 2 = REFER (13: link/rename across dirs,
denied unless granted, so a hard link or a rename can never move a file across a rule boundary);
3 = TRUNCATE (14); 4 = TCP bind/connect (``handled_access_net``); 5 = IOCTL_DEV (15);
6 = ``scoped`` abstract unix sockets and signals (a sandboxed process cannot connect to abstract sockets
or signal processes outside its own Landlock domain); 7 = audit-log flags only (nothing new to handle).

Every right the running ABI knows is *handled* (denied unless a rule grants it); TCP ports get no rule,
so every TCP bind/connect is denied from ABI 4 on.

What Landlock (ABI <= 7) does **not** restrict: ``stat``/``lstat``/``access``/``readlink`` and path walk
of arbitrary paths (metadata probing), ``chdir``, and operations on fds opened before the ruleset was
enforced. The sandbox closes the metadata probe with a mount namespace where the kernel allows one
(:mod:`llmtool.core.mountns`); ``docs/security.md`` lists what remains.
"""

from __future__ import annotations

import ctypes
import os
import struct

__all__ = ["abi_version", "restrict", "LandlockError", "FS_ACCESS_BY_ABI", "READ_RIGHTS", "FILE_RIGHTS"]

SYS_CREATE_RULESET, SYS_ADD_RULE, SYS_RESTRICT_SELF = 444, 445, 446
CREATE_RULESET_VERSION = 1
RULE_PATH_BENEATH = 1
PR_SET_NO_NEW_PRIVS = 38
O_PATH = getattr(os, "O_PATH", 0o10000000)

EXECUTE, WRITE_FILE, READ_FILE, READ_DIR = 1 << 0, 1 << 1, 1 << 2, 1 << 3
REMOVE_DIR, REMOVE_FILE, MAKE_CHAR, MAKE_DIR = 1 << 4, 1 << 5, 1 << 6, 1 << 7
MAKE_REG, MAKE_SOCK, MAKE_FIFO, MAKE_BLOCK, MAKE_SYM = 1 << 8, 1 << 9, 1 << 10, 1 << 11, 1 << 12
REFER, TRUNCATE, IOCTL_DEV = 1 << 13, 1 << 14, 1 << 15
NET_BIND_TCP, NET_CONNECT_TCP = 1 << 0, 1 << 1
SCOPE_ABSTRACT_UNIX_SOCKET, SCOPE_SIGNAL = 1 << 0, 1 << 1

_ABI1 = (1 << 13) - 1
FS_ACCESS_BY_ABI = {1: _ABI1, 2: _ABI1 | REFER, 3: _ABI1 | REFER | TRUNCATE, 4: _ABI1 | REFER | TRUNCATE,
                    5: _ABI1 | REFER | TRUNCATE | IOCTL_DEV}
# rights that make sense on a regular file / device (the kernel rejects directory rights on a file)
FILE_RIGHTS = EXECUTE | WRITE_FILE | READ_FILE | TRUNCATE | IOCTL_DEV
READ_RIGHTS = READ_FILE | READ_DIR
# the sandbox's writable dir: everything except device nodes and (for the no-create mode) creation rights
CREATE_RIGHTS = MAKE_CHAR | MAKE_DIR | MAKE_REG | MAKE_SOCK | MAKE_FIFO | MAKE_BLOCK | MAKE_SYM


class LandlockError(OSError):
    pass


def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _syscall(libc, nr, *args):
    libc.syscall.restype = ctypes.c_long
    r = libc.syscall(ctypes.c_long(nr), *args)
    if r < 0:
        e = ctypes.get_errno()
        raise LandlockError(e, os.strerror(e))
    return r


def abi_version() -> int:
    """The kernel's Landlock ABI version, 0 when Landlock is unsupported or disabled (ENOSYS/EOPNOTSUPP)."""
    if not os.uname().sysname == "Linux":
        return 0
    try:
        return int(_syscall(_libc(), SYS_CREATE_RULESET, None, ctypes.c_size_t(0),
                            ctypes.c_uint32(CREATE_RULESET_VERSION)))
    except (OSError, AttributeError):
        return 0


def fs_access(abi: int) -> int:
    return FS_ACCESS_BY_ABI[min(abi, 5)]


def restrict(rules: list[tuple[str, int]], *, abi: int | None = None) -> int:
    """Enforce a ruleset on the calling thread (and its future threads/children); returns the ABI used.

    ``rules``: ``(path, rights)`` pairs; rights are masked to what the ABI handles (and to file rights for a
    non-directory). A path that does not exist is skipped. Everything not granted is denied, including TCP
    bind/connect (ABI >= 4), abstract unix sockets and signals out of the domain (ABI >= 6).
    Raises :class:`LandlockError` when the kernel refuses; the caller must then not run untrusted code.
    """
    libc = _libc()
    abi = abi_version() if abi is None else abi
    if abi < 1:
        raise LandlockError(38, "Landlock is not supported by this kernel")
    handled = fs_access(abi)
    net = NET_BIND_TCP | NET_CONNECT_TCP if abi >= 4 else 0
    scoped = SCOPE_ABSTRACT_UNIX_SOCKET | SCOPE_SIGNAL if abi >= 6 else 0
    attr = struct.pack("<QQQ", handled, net, scoped)[: 8 if abi < 4 else 16 if abi < 6 else 24]
    buf = ctypes.create_string_buffer(attr, len(attr))
    rfd = _syscall(libc, SYS_CREATE_RULESET, buf, ctypes.c_size_t(len(attr)), ctypes.c_uint32(0))
    try:
        for path, rights in rules:
            try:
                fd = os.open(path, O_PATH | os.O_CLOEXEC)
            except FileNotFoundError:
                continue
            try:
                allowed = rights & handled
                if not os.path.isdir(path):
                    allowed &= FILE_RIGHTS
                rule = ctypes.create_string_buffer(struct.pack("<Qi", allowed, fd), 12)
                _syscall(libc, SYS_ADD_RULE, ctypes.c_int(rfd), ctypes.c_int(RULE_PATH_BENEATH), rule,
                         ctypes.c_uint32(0))
            finally:
                os.close(fd)
        libc.prctl.restype = ctypes.c_int
        if libc.prctl(ctypes.c_int(PR_SET_NO_NEW_PRIVS), ctypes.c_ulong(1), ctypes.c_ulong(0),
                      ctypes.c_ulong(0), ctypes.c_ulong(0)) != 0:
            e = ctypes.get_errno()
            raise LandlockError(e, "prctl(PR_SET_NO_NEW_PRIVS): " + os.strerror(e))
        _syscall(libc, SYS_RESTRICT_SELF, ctypes.c_int(rfd), ctypes.c_uint32(0))
    finally:
        os.close(rfd)
    return abi

"""A process that truly cannot read other processes' memory: a seccomp filter refusing ``process_vm_readv``.

What container runtimes' default profiles do on some kernels, installed here by the process itself
(``SECCOMP_FILTER_FLAG_TSYNC``: every thread of it, for the rest of its life).  Used by
tests/test_peermem.py (in a child process) and tests/reshard_workers.py (in a Ray worker).
"""

from __future__ import annotations

import ctypes
import errno
import platform

#: machine -> (AUDIT_ARCH_*, __NR_process_vm_readv, __NR_seccomp)
ARCHES = {"x86_64": (0xC000003E, 310, 317), "aarch64": (0xC00000B7, 270, 277)}


def supported() -> bool:
    return platform.system() == "Linux" and platform.machine() in ARCHES


class _Filter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_ushort), ("jt", ctypes.c_ubyte), ("jf", ctypes.c_ubyte), ("k", ctypes.c_uint)]


class _Prog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_Filter))]


def forbid_process_vm_readv(err: int = errno.EPERM) -> None:
    """Make every ``process_vm_readv`` of this process fail with ``err`` from now on."""
    arch, nr, nr_seccomp = ARCHES[platform.machine()]
    ld_abs, jeq, ret = 0x20, 0x15, 0x06
    program = [
        (ld_abs, 0, 0, 4),  # A = seccomp_data.arch
        (jeq, 0, 3, arch),  # another ABI: allow
        (ld_abs, 0, 0, 0),  # A = seccomp_data.nr
        (jeq, 0, 1, nr),
        (ret, 0, 0, 0x00050000 | err),  # SECCOMP_RET_ERRNO | err
        (ret, 0, 0, 0x7FFF0000),  # SECCOMP_RET_ALLOW
    ]
    filters = (_Filter * len(program))(*[_Filter(*i) for i in program])
    prog = _Prog(len(program), filters)
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS)")
    # seccomp(SECCOMP_SET_MODE_FILTER, SECCOMP_FILTER_FLAG_TSYNC, &prog)
    if libc.syscall(nr_seccomp, 1, 1, ctypes.byref(prog)) != 0:
        raise OSError(ctypes.get_errno(), "seccomp(SECCOMP_SET_MODE_FILTER)")

"""What a received fd must be before the keeper holds it or a client maps it: a sealed memfd, or a CUDA VMM
POSIX fd, of the segment its manifest describes.

The keeper checks every fd a publisher sends with :func:`verify_fd`; transports check again before mapping.
Layer L1: only the standard library (``fstat``, ``/proc/self/fd``, ``fcntl``): no torch, no CUDA context.
"""

from __future__ import annotations

import fcntl
import os
import stat
from collections.abc import Callable

from .errors import SegmentError
from .manifest import SegmentInfo

#: Seals a CPU segment must carry: nobody, its creator included, can write, shrink or grow it any more.
REQUIRED_SEALS = fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW
#: What /proc/self/fd/N points to for a VMM POSIX fd (seen with driver 580 on an H200).
VMM_FD_TARGET = "/dev/nvidiactl"


def inspect_fd(fd: int) -> tuple[os.stat_result, str]:
    """``fstat`` and the ``/proc/self/fd`` link of a received fd: what the checks below trust."""
    try:
        return os.fstat(fd), os.readlink(f"/proc/self/fd/{fd}")
    except OSError as exc:
        raise SegmentError(f"fd {fd} cannot be inspected: {exc}") from exc


def verify_memfd(fd: int, info: SegmentInfo) -> None:
    """``fd`` is a memfd of ``info.size`` bytes, sealed against writing, shrinking and growing."""
    st, target = inspect_fd(fd)
    if not stat.S_ISREG(st.st_mode) or not target.startswith("/memfd:"):
        raise SegmentError(f"expected a memfd for a CPU segment; fd {fd} is {target!r}")
    try:
        seals = fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError as exc:
        raise SegmentError(f"memfd {target!r} does not support sealing: {exc}") from exc
    if st.st_size != info.size:
        raise SegmentError(f"memfd holds {st.st_size} bytes; the manifest says {info.size}")
    if seals & REQUIRED_SEALS != REQUIRED_SEALS:
        raise SegmentError(
            f"memfd is not sealed against write/shrink/grow (seals {seals:#x}); refusing to share memory "
            "that its creator can still change"
        )


def verify_cuda_vmm(fd: int, info: SegmentInfo) -> None:
    """``fd`` is a CUDA VMM POSIX fd and ``info`` places it on a GPU UUID (its size only the driver knows)."""
    st, target = inspect_fd(fd)
    if not stat.S_ISCHR(st.st_mode) or target != VMM_FD_TARGET:
        raise SegmentError(
            f"expected a CUDA VMM POSIX fd (a handle on {VMM_FD_TARGET}) for a GPU segment; fd {fd} is {target!r}"
        )
    if not info.placement.startswith("GPU-"):
        raise SegmentError(f"a cuda_vmm segment must be placed on a GPU UUID; found {info.placement!r}")


_CHECKS: dict[str, Callable[[int, SegmentInfo], None]] = {"memfd": verify_memfd, "cuda_vmm": verify_cuda_vmm}


def verify_fd(fd: int, info: SegmentInfo) -> None:
    """Check that ``fd`` really is a sealed segment of ``info``'s kind and size; SegmentError otherwise."""
    check = _CHECKS.get(info.kind)
    if check is None:
        raise SegmentError(f"unknown segment kind {info.kind!r}; known: {sorted(_CHECKS)}")
    check(fd, info)


def committed_bytes(fd: int, info: SegmentInfo) -> int:
    """The memory a checked segment really holds: for a memfd, the bytes of its pages that were ever written
    (``st_blocks``; a sealed memfd cannot gain pages), at most its size; for a GPU segment, its size (the driver
    commits it whole). A memfd sized but never written holds next to nothing, whatever size it declares."""
    if info.kind != "memfd":
        return info.size
    return min(info.size, os.fstat(fd).st_blocks * 512)


__all__ = [
    "REQUIRED_SEALS",
    "VMM_FD_TARGET",
    "committed_bytes",
    "inspect_fd",
    "verify_cuda_vmm",
    "verify_fd",
    "verify_memfd",
]

"""What the keeper accepts as a segment fd: sealed memfds and CUDA VMM fds of the manifest's size, checked without
torch or CUDA."""

from __future__ import annotations

import fcntl
import os
import tempfile

import pytest

import weightcache as wc
from weightcache.fdcheck import verify_fd
from weightcache.manifest import SegmentInfo


def test_verify_fd_rejects_wrong_kinds() -> None:
    info = SegmentInfo("memfd", 4096, "cpu")
    with tempfile.TemporaryFile() as f:
        os.ftruncate(f.fileno(), 4096)
        with pytest.raises(wc.SegmentError, match="expected a memfd"):
            verify_fd(f.fileno(), info)
    r, w = os.pipe()
    with pytest.raises(wc.SegmentError):
        verify_fd(r, info)
    os.close(r)
    os.close(w)
    unsealed = os.memfd_create("weightcache", os.MFD_ALLOW_SEALING)
    os.ftruncate(unsealed, 4096)
    with pytest.raises(wc.SegmentError, match="not sealed"):
        verify_fd(unsealed, info)
    fcntl.fcntl(unsealed, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    verify_fd(unsealed, info)
    with pytest.raises(wc.SegmentError, match="4096 bytes"):
        verify_fd(unsealed, SegmentInfo("memfd", 8192, "cpu"))
    with pytest.raises(wc.SegmentError, match="unknown segment kind"):
        verify_fd(unsealed, SegmentInfo("floppy", 4096, "cpu"))
    os.close(unsealed)


def test_keeper_side_check_of_gpu_fds_needs_no_cuda() -> None:
    """The keeper verifies GPU segment fds without CUDA: anything but a VMM handle is refused."""
    info = SegmentInfo("cuda_vmm", 2 << 20, "GPU-00000000-0000-0000-0000-000000000000")
    with tempfile.TemporaryFile() as f, pytest.raises(wc.SegmentError, match="expected a CUDA VMM POSIX fd"):
        verify_fd(f.fileno(), info)
    fd = os.memfd_create("weightcache")
    with pytest.raises(wc.SegmentError, match="expected a CUDA VMM POSIX fd"):
        verify_fd(fd, info)
    os.close(fd)
    with pytest.raises(wc.SegmentError, match="cannot be inspected"):
        verify_fd(10**6, info)

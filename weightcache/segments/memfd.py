"""CPU segments: sealed memfds.

A publisher writes tensors into a memfd with ``pwrite`` (no mapping needed), then seals it against writing,
shrinking and growing. Sealing is what makes sharing safe: no process, however buggy, can change the bytes
other processes read or truncate the file under their mappings (which would kill them with SIGBUS).

Clients map the memfd ``MAP_PRIVATE``: reads hit the one shared copy in the page cache, and an engine that
writes to its weights gets a private copy of that page instead of corrupting everyone else's.

What a received memfd must be is :func:`weightcache.fdcheck.verify_memfd`'s (the keeper checks it without torch).
"""

from __future__ import annotations

import fcntl
import mmap
import os
from typing import ClassVar

import torch

from ..errors import SegmentError
from ..fdcheck import REQUIRED_SEALS
from ..manifest import SegmentInfo
from .base import Segment, Transport
from .dense import dense_bytes


class MemfdSegment(Segment):
    kind: ClassVar[str] = "memfd"

    def __init__(self, size: int, placement: str, name: str = "weightcache") -> None:
        super().__init__(size, placement)
        if placement != "cpu":
            raise SegmentError(f"memfd segments live on 'cpu'; asked for placement {placement!r}")
        try:
            self._fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        except OSError as exc:
            raise SegmentError(f"memfd_create failed: {exc}; this needs Linux >= 3.17") from exc
        try:
            os.ftruncate(self._fd, size)
            # Reserve the pages now: running out of memory becomes a clear error here instead of a SIGBUS
            # in some process that touches the page later.
            os.posix_fallocate(self._fd, 0, size)
        except OSError as exc:
            os.close(self._fd)
            raise SegmentError(
                f"cannot allocate a {size}-byte shared memory segment: {exc}. Free memory (evict entries with "
                "`weightcache evict`) or publish a smaller model."
            ) from exc
        self._sealed = False

    def write(self, offset: int, tensor: torch.Tensor) -> None:
        if self._sealed:
            raise SegmentError("segment is sealed; it cannot be written any more")
        data = dense_bytes(tensor)
        if data.device.type != "cpu":
            data = data.cpu()
        n = data.numel()
        if offset < 0 or offset + n > self.size:
            raise SegmentError(f"write of {n} bytes at {offset} overflows a {self.size}-byte segment")
        view = data.numpy().data if n else memoryview(b"")
        done = 0
        try:
            while done < n:
                done += os.pwrite(self._fd, view[done:], offset + done)
        except OSError as exc:
            raise SegmentError(
                f"writing {n} bytes into a memfd failed: {exc} (out of memory, or /dev/shm limits?)"
            ) from exc

    def seal(self) -> None:
        if not self._sealed:
            fcntl.fcntl(self._fd, fcntl.F_ADD_SEALS, REQUIRED_SEALS | fcntl.F_SEAL_SEAL)
            self._sealed = True

    def detach_fd(self) -> int:
        fd = self.fd
        self._fd = -1
        return fd

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1


class MemfdTransport(Transport):
    kind: ClassVar[str] = "memfd"
    #: 64 bytes would do for CPU kernels; 512 keeps offsets identical to the CUDA transport's rule.
    alignment: ClassVar[int] = 512

    def create(self, size: int, placement: str) -> MemfdSegment:
        return MemfdSegment(size, placement)

    def map(self, fd: int, info: SegmentInfo) -> torch.Tensor:
        self.verify_fd(fd, info)
        try:
            mapping = mmap.mmap(fd, info.size, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as exc:
            raise SegmentError(f"cannot map a {info.size}-byte memfd: {exc}") from exc
        # torch.frombuffer keeps `mapping` referenced for as long as the tensor or any view of it lives;
        # the mapping is unmapped only when the last of them is collected.
        return torch.frombuffer(mapping, dtype=torch.uint8)

"""The segment transport interface: how a region of shareable memory is created, filled, exported, checked
and mapped. One transport per file (``memfd.py`` for CPU; CUDA VMM drops in beside it).

The cut is here so that the keeper, the protocol and the cache never know which memory they move: they pass
around an fd, a :class:`~weightcache.manifest.SegmentInfo` and, in clients, a flat ``uint8`` tensor that owns
the mapping. Lifetime rule: the memory lives while any fd or mapping of it lives. A mapped base tensor keeps
its mapping alive through every view made of it, so dropping a Handle never pulls memory from under a model.
"""

from __future__ import annotations

import os
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import ClassVar

import torch

from .. import fdcheck
from ..errors import SegmentError
from ..manifest import SegmentInfo


class Segment(ABC):
    """A region being filled by a publisher. Write tensors at offsets, :meth:`seal`, then export :attr:`fd`."""

    kind: ClassVar[str]

    def __init__(self, size: int, placement: str) -> None:
        self.size = size
        self.placement = placement
        self._fd = -1
        self._sealed = False

    @abstractmethod
    def write(self, offset: int, tensor: torch.Tensor) -> None:
        """Copy ``tensor``'s bytes (in memory order, see :func:`weightcache.segments.dense_bytes`) to ``offset``."""

    @abstractmethod
    def seal(self) -> None:
        """Finish writing. After this the contents never change and :attr:`fd` can be shared."""

    @property
    def sealed(self) -> bool:
        """Whether :meth:`seal` has run: the contents are final."""
        return self._sealed

    @property
    def fd(self) -> int:
        """The shareable fd; owned by the segment until :meth:`close`."""
        if self._fd < 0:
            raise SegmentError("segment is closed")
        return self._fd

    def detach_fd(self) -> int:
        """Hand the fd over to the caller (who closes it) and release everything else this segment holds."""
        fd = os.dup(self.fd)
        self.close()
        return fd

    @abstractmethod
    def close(self) -> None:
        """Close this process's fd. Memory stays alive while the keeper or any mapping holds it."""

    def __enter__(self) -> Segment:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Transport(ABC):
    """Creates, verifies and maps segments of one kind."""

    #: ``SegmentInfo.kind`` this transport handles.
    kind: ClassVar[str]
    #: Tensors are packed at offsets that are multiples of this many bytes.
    alignment: ClassVar[int]

    @abstractmethod
    def create(self, size: int, placement: str) -> Segment:
        """A new writable segment of ``size`` bytes at ``placement``."""

    @abstractmethod
    def map(self, fd: int, info: SegmentInfo) -> torch.Tensor:
        """Map a received fd; return a flat ``uint8`` tensor over the whole segment that owns the mapping.

        Writes through the returned tensor must never reach other processes' view of the segment. The fd
        is not consumed: the caller still owns and closes it.
        """

    def map_all(self, fds: Sequence[int], infos: Sequence[SegmentInfo], entry: str = "") -> list[torch.Tensor]:
        """:meth:`map` each of one entry's segments (``fds[i]`` is ``infos[i]``'s); one by one unless a
        transport knows better. ``entry`` is the entry's digest, which a transport may use to place the mappings
        (CUDA: at the entry's home addresses). A failure leaves nothing mapped (the tensors mapped so far are
        dropped)."""
        return [self.map(fd, info) for fd, info in zip(fds, infos)]

    @staticmethod
    def verify_fd(fd: int, info: SegmentInfo) -> None:
        """Check that ``fd`` really is a sealed segment of ``info``'s kind and size; raise SegmentError otherwise.

        The check itself is :func:`weightcache.fdcheck.verify_fd`, which the keeper runs without this package.
        """
        fdcheck.verify_fd(fd, info)

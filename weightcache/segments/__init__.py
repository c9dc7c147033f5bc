"""Segment transports by kind and placement, and packing tensors into segments.

``"cpu"`` placements use sealed memfds; ``"GPU-<uuid>"`` placements use CUDA VMM allocations. Layer L3 (torch);
the keeper checks the fds it receives with :mod:`weightcache.fdcheck` and never imports this package.
"""

from __future__ import annotations

import attrs

from ..errors import SegmentError
from .base import Segment, Transport
from .cuda_vmm import CudaVmmTransport
from .dense import dense_bytes, is_dense, stored_stride
from .memfd import MemfdTransport

_TRANSPORTS: dict[str, Transport] = {"memfd": MemfdTransport(), "cuda_vmm": CudaVmmTransport()}


def transport(kind: str) -> Transport:
    """The transport for a segment kind (``"memfd"``, ``"cuda_vmm"``)."""
    try:
        return _TRANSPORTS[kind]
    except KeyError:
        raise SegmentError(f"unknown segment kind {kind!r}; known: {sorted(_TRANSPORTS)}") from None


def transport_for_placement(placement: str) -> Transport:
    """The transport that serves ``placement`` (``"cpu"`` or ``"GPU-<uuid>"``)."""
    if placement == "cpu":
        return transport("memfd")
    if placement.startswith("GPU-"):
        return transport("cuda_vmm")
    raise SegmentError(f"unknown placement {placement!r}; expected 'cpu' or 'GPU-<uuid>'")


@attrs.frozen
class Placement:
    """Where one tensor goes: segment index and byte offset."""

    segment: int
    offset: int


def pack(nbytes: list[int], alignment: int, max_segment_bytes: int) -> tuple[list[Placement], list[int]]:
    """Lay out tensors of ``nbytes`` each in order into segments of at most ``max_segment_bytes``
    (a larger tensor gets a segment of its own), at ``alignment``-byte offsets.

    Returns one :class:`Placement` per tensor and the size of each segment.
    """
    placements: list[Placement] = []
    sizes: list[int] = []
    used = 0
    for n in nbytes:
        aligned = -(-used // alignment) * alignment
        if not sizes or (aligned + n > max_segment_bytes and used > 0):
            sizes.append(0)
            aligned = 0
        placements.append(Placement(len(sizes) - 1, aligned))
        used = aligned + n
        sizes[-1] = max(used, 1)
    sizes = [-(-s // alignment) * alignment for s in sizes]
    return placements, sizes


__all__ = [
    "Placement",
    "Segment",
    "Transport",
    "dense_bytes",
    "is_dense",
    "pack",
    "stored_stride",
    "transport",
    "transport_for_placement",
]

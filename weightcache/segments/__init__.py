"""Segment transports by kind and placement, and packing tensors into segments.

``"cpu"`` placements use sealed memfds; ``"GPU-<uuid>"`` placements use CUDA VMM allocations.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import attrs

from ..errors import SegmentError
from .base import Segment, Transport
from .cuda_vmm import CudaVmmTransport
from .memfd import MemfdTransport

if TYPE_CHECKING:
    import torch

    from ..manifest import SegmentInfo

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


def verify_fd(fd: int, info: SegmentInfo) -> None:
    """Keeper-side check that a received fd is a sealed segment of ``info``'s kind and size (torch-free)."""
    transport(info.kind).verify_fd(fd, info)


def is_dense(tensor: torch.Tensor) -> bool:
    """True when the tensor's elements fill a contiguous block of memory in some dimension order
    (contiguous, transposed, permuted), so its bytes can be stored as they lie, strides kept."""
    dims = sorted((st, n) for n, st in zip(tensor.shape, tensor.stride()) if n != 1)
    expected = 1
    for st, n in dims:
        if st != expected:
            return False
        expected *= n
    return True


def dense_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat ``uint8`` view of ``tensor``'s bytes in memory order (copying only if it is not dense).

    Stored with :func:`stored_stride`, this gives an attached tensor the very layout of the published one,
    transposes included.
    """
    import torch

    t = tensor.detach()
    if t.numel() == 0:
        return torch.empty(0, dtype=torch.uint8, device=t.device)
    if not is_dense(t):
        t = t.contiguous()
    return t.as_strided((t.numel(),), (1,)).view(torch.uint8)


def stored_stride(tensor: torch.Tensor) -> tuple[int, ...]:
    """Strides the tensor has once stored by :func:`dense_bytes`."""
    t = tensor.detach()
    if t.numel() == 0 or is_dense(t):
        return tuple(t.stride())
    return tuple(t.contiguous().stride())


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
    "verify_fd",
]

"""A tensor's bytes as they lie in memory: what a segment stores, so an attached tensor keeps its layout."""

from __future__ import annotations

import torch


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


__all__ = ["dense_bytes", "is_dense", "stored_stride"]

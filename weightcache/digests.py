"""Content digests of tensors: what a manifest records per tensor and :meth:`Handle.verify` recomputes.

One definition for every publisher (``attach``, ``weightcache load``, engine adapters, CPU or GPU): SHA-256 of
the tensor's bytes in memory order, as :func:`weightcache.segments.dense_bytes` lays them out. Device tensors
are copied to the host in chunks of :data:`CHUNK_BYTES`, so hashing needs a few chunks of host memory per
thread, whatever the tensor's size.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .segments import dense_bytes

#: Bytes of a device tensor copied to the host at a time for hashing.
CHUNK_BYTES = 32 << 20


def content_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in memory order (what manifests record per tensor)."""
    data = dense_bytes(tensor)
    if data.device.type == "cpu":
        return hashlib.sha256(data.numpy().data if data.numel() else b"").hexdigest()
    digest = hashlib.sha256()
    for start in range(0, data.numel(), CHUNK_BYTES):
        digest.update(data[start : start + CHUNK_BYTES].cpu().numpy().data)
    return digest.hexdigest()


def content_digests(tensors: Sequence[torch.Tensor]) -> list[str]:
    """:func:`content_digest` of each tensor, in order, hashed by a few threads (hashing releases the GIL)."""
    if len(tensors) < 2:
        return [content_digest(t) for t in tensors]
    with ThreadPoolExecutor(max_workers=min(8, os.cpu_count() or 1)) as pool:
        return list(pool.map(content_digest, tensors))


__all__ = ["content_digest", "content_digests"]

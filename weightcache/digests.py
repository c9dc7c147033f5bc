"""Content digests of tensors: what a manifest records per tensor and :meth:`Handle.verify` recomputes.

One definition for every publisher (``attach``, ``weightcache load``, engine adapters, CPU or GPU): SHA-256 of
the tensor's bytes in memory order, as :func:`weightcache.segments.dense_bytes` lays them out.

A CUDA tensor is hashed in chunks of :data:`CHUNK_BYTES`: each call copies them into two page-locked host buffers
(from PyTorch's caching host allocator) on a side stream, and hashes one while the next is copied. So hashing
needs ``2 * CHUNK_BYTES`` of pinned host memory per thread whatever the tensor's size, threads do not queue behind
each other on the device's default stream, and a copy never waits for a hash nor a hash for a copy. (The first version
copied each chunk with ``.cpu()``: a fresh pageable buffer per chunk and a synchronous copy on the default
stream, which the benchmark in docs/benchmarks.md, "Hashing a GPU checkpoint", compares.)
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import torch

from .segments import dense_bytes

#: Bytes of a device tensor copied to the host at a time for hashing.
CHUNK_BYTES = 32 << 20

#: Threads that hash at once (hashlib and device copies release the GIL).
MAX_THREADS = 8


def _device_digest(data: torch.Tensor, after: torch.cuda.Stream) -> str:
    """SHA-256 of a flat ``uint8`` CUDA tensor, read once the work queued on ``after`` has run."""
    total = data.numel()
    if total == 0:
        return hashlib.sha256(b"").hexdigest()
    stream = torch.cuda.Stream(data.device)  # type: ignore[no-untyped-call]  # from PyTorch's stream pool
    stream.wait_stream(after)
    size = min(CHUNK_BYTES, total)
    # Page-locked, from PyTorch's caching host allocator: the next tensor's call gets them back without a new
    # cudaHostAlloc. Freed only after every copy into them has been waited for below.
    buffers = [torch.empty(size, dtype=torch.uint8, pin_memory=True) for _ in range(min(2, -(-total // size)))]
    starts = range(0, total, CHUNK_BYTES)
    copied: list[tuple[torch.Tensor, torch.cuda.Event]] = []

    def issue(k: int) -> None:
        start = starts[k]
        n = min(CHUNK_BYTES, total - start)
        chunk = buffers[k % len(buffers)][:n]
        with torch.cuda.stream(stream):
            chunk.copy_(data[start : start + n], non_blocking=True)
            done = torch.cuda.Event()  # type: ignore[no-untyped-call]
            done.record(stream)
        copied.append((chunk, done))

    digest = hashlib.sha256()
    issue(0)
    for k in range(len(starts)):
        if k + 1 < len(starts):
            issue(k + 1)  # into the other buffer, whose chunk was hashed in the last round
        chunk, done = copied.pop(0)
        done.synchronize()
        digest.update(chunk.numpy().data)  # hashing chunk k while chunk k + 1 is copied
    return digest.hexdigest()


def content_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in memory order (what manifests record per tensor).

    A CUDA tensor is read after the work already queued on the calling thread's current stream, the stream its
    producer is expected to have used.
    """
    after = torch.cuda.current_stream(tensor.device) if tensor.device.type == "cuda" else None
    return _digest(tensor, after)


def _digest(tensor: torch.Tensor, after: torch.cuda.Stream | None) -> str:
    """:func:`content_digest`, a CUDA tensor read after the work queued on ``after``."""
    if after is not None:
        with torch.cuda.stream(after):  # a copy dense_bytes makes is ordered after the producer too
            data = dense_bytes(tensor)
        return _device_digest(data, after)
    data = dense_bytes(tensor)
    if data.device.type == "cpu":
        return hashlib.sha256(data.numpy().data if data.numel() else b"").hexdigest()
    digest = hashlib.sha256()  # another device type: its tensors come to the host a chunk at a time
    for start in range(0, data.numel(), CHUNK_BYTES):
        digest.update(data[start : start + CHUNK_BYTES].cpu().numpy().data)
    return digest.hexdigest()


def content_digests(tensors: Sequence[torch.Tensor], progress: Callable[[int], None] | None = None) -> list[str]:
    """:func:`content_digest` of each tensor, in order, hashed by a few threads (the largest tensors first).

    CUDA tensors are read after the work queued on the caller's current stream of their device, as
    :func:`content_digest` called by the caller would read them. ``progress``, if given, is called in the
    caller's thread with each tensor's size in bytes once it is hashed.
    """

    def size(t: torch.Tensor) -> int:
        return t.numel() * t.element_size()

    after = {t.device: torch.cuda.current_stream(t.device) for t in tensors if t.device.type == "cuda"}
    # Largest first: a large tensor hashed last would leave the other threads idle while one thread hashes it.
    order = sorted(range(len(tensors)), key=lambda i: -size(tensors[i]))
    found: list[str] = [""] * len(tensors)
    workers = max(1, min(MAX_THREADS, os.cpu_count() or 1, len(tensors)))
    with ThreadPoolExecutor(max_workers=workers) as pool:
        hashed = pool.map(lambda i: _digest(tensors[i], after.get(tensors[i].device)), order)
        for i, digest in zip(order, hashed):
            found[i] = digest
            if progress is not None:
                progress(size(tensors[i]))
    return found


__all__ = ["CHUNK_BYTES", "MAX_THREADS", "content_digest", "content_digests"]

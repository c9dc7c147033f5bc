"""Packing weights into shareable segments, ready to hand to the keeper: :class:`Packed`.

Two ways in, one result:

- :func:`pack_state` copies a state dict (on any device) into segments of the placement's transport, one
  segment at a time; with ``consume`` each tensor leaves the dict once copied, so migrating a model needs one
  segment of extra memory, not a second copy. If packing fails part-way (a segment cannot be allocated), the
  tensors already moved are put back into the dict as views of their sealed segments: the caller still holds
  every loaded weight and can serve it.
- :func:`pack_checkpoint` streams a safetensors checkpoint, as stored, straight from its files into GPU
  segments: no intermediate copy on the device at any time.

Every pack records a SHA-256 content digest per tensor (:mod:`weightcache.digests`), whoever packs it, unless
the caller opts out. A :class:`Packed` that the keeper refused can still be served locally
(:meth:`Packed.local_tensors`): the weights live in this process's segments instead of the keeper's.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor

import attrs
import torch

from . import segments
from .binding import check_tensors
from .digests import content_digest, content_digests
from .errors import SegmentError, WeightCacheError
from .fingerprint import Fingerprint
from .loader import StoredTensor, pinned_staging, prefetch_head, stream_into
from .manifest import Manifest, SegmentInfo, TensorInfo
from .progress import byte_bar, wanted
from .protocol import MAX_FDS
from .segments.cuda_vmm import CudaVmmSegment, device_index
from .torch_dtypes import convertible
from .views import map_entry

#: Default upper bound on one CPU segment; a larger tensor gets a segment of its own.
DEFAULT_MAX_SEGMENT_BYTES = 8 << 30
#: Segments filled straight from a checkpoint need no spare memory, so they can be large: few imports per attach.
STREAM_SEGMENT_BYTES = 16 << 30


@attrs.define
class Packed:
    """Sealed, filled segments and the tensor table that describes them, not yet handed to the keeper."""

    fingerprint: Fingerprint
    transport: segments.Transport
    segments: list[segments.Segment]
    infos: list[TensorInfo]

    @property
    def manifest(self) -> Manifest:
        kind, placement = self.transport.kind, self.fingerprint.placement
        infos = [SegmentInfo(kind=kind, size=seg.size, placement=placement) for seg in self.segments]
        return Manifest.build(self.fingerprint, infos, self.infos)

    def fds(self) -> list[int]:
        """The segments' fds (still owned by the segments)."""
        return [seg.fd for seg in self.segments]

    def detach_fds(self) -> list[int]:
        """Take the segments' fds (the caller closes them); the segments are spent."""
        return [seg.detach_fd() for seg in self.segments]

    def local_tensors(self) -> dict[str, torch.Tensor]:
        """Map the segments in this process and return their tensors: the weights, served without a keeper."""
        return map_entry(self.manifest, self.fds())

    def close(self) -> None:
        """Close the segments: memory nobody maps is freed. Tensors from :meth:`local_tensors` stay valid."""
        for seg in self.segments:
            seg.close()
        self.segments = []


def default_segment_bytes(placement: str, nbytes: list[int], *, from_host: bool = False) -> int:
    """Segment size when none is given.

    CPU: up to 8 GiB (a memfd costs one mmap to attach, whatever its size). GPU: max(1 GiB, the largest
    tensor), so that migrating weights that already sit on the GPU needs at most one segment of extra memory;
    grown when needed to keep an entry within the fds one message can carry. Weights that come from host memory
    (``from_host``) need no spare GPU memory at all, so they get segments as large as a streamed checkpoint's
    (16 GiB): every segment costs each attach an import and a mapping (~0.3 ms on an H200), so fewer is faster.
    """
    if placement == "cpu":
        return DEFAULT_MAX_SEGMENT_BYTES
    total = sum(nbytes)
    smallest = STREAM_SEGMENT_BYTES if from_host else 1 << 30
    return max(smallest, max(nbytes, default=0), -(-total // (MAX_FDS - 10)))


def pack_state(
    fingerprint: Fingerprint,
    tensors: Mapping[str, torch.Tensor],
    *,
    digests: bool = True,
    max_segment_bytes: int | None = None,
    consume: bool = False,
    progress: bool | None = False,
) -> Packed:
    """Copy a state dict into sealed segments of the fingerprint's placement.

    Args:
        digests: record a SHA-256 per tensor (for :meth:`Handle.verify`): into host memory, each tensor as it
            is copied; into GPU segments, from the sealed segments once all are filled, each tensor coming to the
            host once in chunks through pinned buffers (:mod:`weightcache.digests`).
        max_segment_bytes: largest segment; default :func:`default_segment_bytes`.
        consume: remove each tensor from ``tensors`` (a mutable mapping) once its segment is sealed, returning
            GPU memory the originals held to the driver before the next segment is created. Only references
            held elsewhere (e.g. by a model) keep originals alive. If packing fails, the tensors already removed
            are put back as views of their sealed segments, and the error is raised.
        progress: a bar of the bytes packed, then (digests into GPU segments) one of the bytes hashed, on
            stderr (None: only on a terminal and for at least 1 GiB; see :mod:`weightcache.progress`): after a
            load's own bar, the copies and digests of a big CPU load take longer than the read.
    """
    transport = segments.transport_for_placement(fingerprint.placement)
    names = list(tensors)
    if not names:
        raise WeightCacheError("cannot publish an empty state dict")
    check_tensors(tensors)
    nbytes = [tensors[n].numel() * tensors[n].element_size() for n in names]
    if max_segment_bytes is None:
        from_host = not any(tensors[n].is_cuda for n in names)
        max_segment_bytes = default_segment_bytes(fingerprint.placement, nbytes, from_host=from_host)
    placements, sizes = segments.pack(nbytes, transport.alignment, max_segment_bytes)
    packed = Packed(fingerprint, transport, [], [])
    total = sum(nbytes)
    try:
        show = wanted(progress, total)
        # Host memory: each thread hashes the tensor it has just copied (while others copy), one segment after
        # another. A GPU: the copies are asynchronous, and hashing goes to the host through PCIe, so it waits
        # until every segment is sealed and takes all tensors at once (_digest_sealed).
        after_sealing = digests and packed.transport.kind != "memfd"
        with byte_bar(total, "publishing into the cache", show) as update:
            _fill(packed, sizes, names, placements, tensors, digests and not after_sealing, consume, update)
        if after_sealing:
            with byte_bar(total, "hashing what was published", show) as update:
                _digest_sealed(packed, update)
    except BaseException:
        if consume and isinstance(tensors, MutableMapping) and packed.segments:
            _restore(packed, tensors)
        packed.close()
        raise
    return packed


def _restore(packed: Packed, tensors: MutableMapping[str, torch.Tensor]) -> None:
    """Put the tensors of the sealed segments back into ``tensors`` as views (a pack that failed part-way)."""
    sealed = [seg for seg in packed.segments if seg.sealed]
    done = Packed(packed.fingerprint, packed.transport, sealed, [i for i in packed.infos if i.segment < len(sealed)])
    for name, view in done.local_tensors().items():
        tensors.setdefault(name, view)


def _fill(
    packed: Packed,
    sizes: list[int],
    names: list[str],
    placements: list[segments.Placement],
    tensors: Mapping[str, torch.Tensor],
    digests: bool,
    consume: bool,
    progress: Callable[[int], None] | None = None,
) -> None:
    """Create the segments one at a time and copy their tensors in (a few threads where copies or hashing block
    on the host), appending each segment and its tensors' rows to ``packed`` as it is sealed; with ``digests``
    each tensor is hashed as it is copied."""
    by_segment: list[list[int]] = [[] for _ in sizes]
    for i, where in enumerate(placements):
        by_segment[where.segment].append(i)

    def one(i: int) -> TensorInfo:
        name, where = names[i], placements[i]
        t = tensors[name]
        seg.write(where.offset, t)
        info = TensorInfo(
            name=name,
            segment=where.segment,
            offset=where.offset,
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stride=segments.stored_stride(t),
            kind="parameter" if isinstance(t, torch.nn.Parameter) else "tensor",
            requires_grad=bool(t.requires_grad),
            digest=content_digest(t) if digests else None,  # None: no digests, or _digest_sealed's, taken later
        )
        if progress is not None:
            progress(t.numel() * t.element_size())
        return info

    on_gpu = any(tensors[n].is_cuda for n in names)
    # Threads pay off where copies block on the host (page faults in mapped files, pwrite, hashing); copies
    # between device buffers are asynchronous launches, and threads would only fight over the GIL.
    host_work = digests or not all(tensors[n].is_cuda for n in names) or packed.transport.kind == "memfd"
    workers = min(8, os.cpu_count() or 1) if host_work else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for k, size in enumerate(sizes):
            seg = packed.transport.create(size, packed.fingerprint.placement)
            packed.segments.append(seg)
            rows = list(pool.map(one, by_segment[k]))
            seg.seal()
            packed.infos.extend(rows)
            if consume and isinstance(tensors, MutableMapping):
                for i in by_segment[k]:
                    tensors.pop(names[i], None)
                if on_gpu:
                    torch.cuda.empty_cache()


def _digest_sealed(packed: Packed, progress: Callable[[int], None] | None = None) -> None:
    """Record every tensor's content digest, hashed from ``packed``'s sealed segments (mapped read-only here):
    all tensors at once, so that no segment waits for its largest tensor's hash (GPU segments).

    Why: when each segment's tensors were hashed before the next segment was created, a publish of a Llama-3-8B
    on an H200 spent 5.1-5.9 s packing and hashing, where hashing its tensors at once took 2.8 s
    (docs/benchmarks.md, "Hashing a GPU checkpoint"); its 1 GiB embedding and output head each fill a 1 GiB
    segment, hashed by one thread while the others waited (the suspected cause; not measured on a GPU with this
    change yet). On the CPU the copy-and-hash of each tensor in turn was faster (0.69 against 0.80-0.93 s for
    1 GiB on two cores), so host memory keeps it. The bytes hashed are those the segments hold: the tensors'
    bytes in memory order."""
    views = map_entry(packed.manifest, packed.fds())
    try:
        sums = content_digests([views[info.name] for info in packed.infos], progress=progress)
    finally:
        views.clear()  # unmaps the segments here: the keeper's and the engine's mappings are their own
    packed.infos = [attrs.evolve(info, digest=digest) for info, digest in zip(packed.infos, sums)]


def pack_checkpoint(
    fingerprint: Fingerprint,
    layout: list[StoredTensor],
    *,
    digests: bool = True,
    progress: bool | None = False,
) -> Packed:
    """Stream a checkpoint, as stored (no dtype conversion, no transform), straight from its files into GPU
    segments of a ``GPU-<uuid>`` placement: the peak is the weights themselves.

    ``layout`` is the checkpoint's :func:`~weightcache.loader.checkpoint_layout`. ``progress``: a bar of the
    bytes streamed, on stderr (None: only on a terminal and for at least 1 GiB).
    """
    transport = segments.transport_for_placement(fingerprint.placement)
    if transport.kind != "cuda_vmm":
        raise SegmentError(f"pack_checkpoint streams into GPU segments; {fingerprint.placement} is not a GPU")
    if not layout:
        raise WeightCacheError("the checkpoint holds no tensors")
    staging = pinned_staging()  # before the prefetch starts: see pinned_staging
    prefetch_head(dict.fromkeys(t.file for t in layout))  # the disk reads while the segments are created
    nbytes = [t.nbytes for t in layout]
    placements, sizes = segments.pack(nbytes, transport.alignment, STREAM_SEGMENT_BYTES)
    packed = Packed(fingerprint, transport, [], [])
    try:
        for size in sizes:
            packed.segments.append(transport.create(size, fingerprint.placement))
        views: dict[str, torch.Tensor] = {}

        def destination(t: StoredTensor) -> torch.Tensor:
            p = placements[index[t.name]]
            seg = packed.segments[p.segment]
            assert isinstance(seg, CudaVmmSegment)
            views[t.name] = seg.destination(p.offset, t.nbytes)
            return views[t.name]

        index = {t.name: i for i, t in enumerate(layout)}
        device = torch.device("cuda", device_index(fingerprint.placement))
        total = sum(nbytes)
        with byte_bar(total, "loading checkpoint into the cache", wanted(progress, total)) as update:
            stream_into(layout, device, destination, update, staging)
        torch.cuda.synchronize(device)
        # Stored contiguous and unconverted, so the bytes streamed are the tensor's bytes in memory order.
        sums: list[str | None] = [None] * len(layout)
        if digests:
            with byte_bar(total, "hashing what was published", wanted(progress, total)) as update:
                sums = list(content_digests([views[t.name] for t in layout], progress=update))
        views.clear()
        for seg in packed.segments:
            seg.seal()
    except BaseException:
        packed.close()
        raise
    packed.infos = [
        TensorInfo(
            name=t.name,
            segment=placements[i].segment,
            offset=placements[i].offset,
            dtype=str(t.dtype).removeprefix("torch."),
            shape=t.shape,
            stride=contiguous_stride(t.shape),
            kind="tensor",
            requires_grad=False,
            digest=sums[i],
        )
        for i, t in enumerate(layout)
    ]
    return packed


def contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    """Strides of a contiguous tensor of ``shape``."""
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def stored_as_is(layout: list[StoredTensor], dtype: torch.dtype | None) -> bool:
    """Whether loading with ``dtype`` keeps every tensor exactly as the files store it."""
    return dtype is None or all(t.dtype == dtype or not convertible(t.dtype) for t in layout)


__all__ = [
    "DEFAULT_MAX_SEGMENT_BYTES",
    "STREAM_SEGMENT_BYTES",
    "Packed",
    "contiguous_stride",
    "default_segment_bytes",
    "pack_checkpoint",
    "pack_state",
    "stored_as_is",
]

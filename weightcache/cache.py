"""The host cache as a Python object: publish state dicts into segments, attach them back as tensors.

:class:`Cache` talks to the keeper; :class:`Handle` is what a caller holds while it uses attached weights.
A Handle's open keeper connection is its lease; closing the Handle releases the lease and closes its fds but
never unmaps memory: each tensor keeps its segment mapped for as long as the tensor (or a view) lives.
"""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Literal

import attrs
import torch

from . import quant as quant_registry
from . import republish
from . import segments as segment_transports
from .client import KeeperConnection, ensure_keeper
from .errors import KeeperError, ManifestError, SegmentError, WeightCacheError
from .fingerprint import Fingerprint, resolve_dtype
from .manifest import Manifest, SegmentInfo, TensorInfo
from .protocol import close_fds
from .segments.cuda_vmm import CudaVmmSegment

if TYPE_CHECKING:
    from .loader import StoredTensor

try:  # import the CUDA driver bindings with the library, not inside the first attach (~10 ms once)
    import cuda.bindings.driver  # noqa: F401
except ImportError:  # no GPU support installed: CPU segments only
    pass

#: Default upper bound on one segment; a larger tensor gets a segment of its own.
DEFAULT_MAX_SEGMENT_BYTES = 8 << 30
#: Segments filled straight from a checkpoint need no spare memory, so they can be large: few imports per attach.
STREAM_SEGMENT_BYTES = 16 << 30
Source = Literal["cache", "disk"]


def _torch_dtype(name: str) -> torch.dtype:
    try:
        dtype: torch.dtype = resolve_dtype(name)
    except ValueError:
        raise ManifestError(f"dtype {name!r} is not supported by torch {torch.__version__}") from None
    return dtype


class Handle:
    """Attached (or disk-loaded) weights.

    Attributes:
        source: ``"cache"`` when the tensors map a keeper's segments, ``"disk"`` when they were loaded from
            the checkpoint (mode ``off``, or a fallback).
        fingerprint: the :class:`Fingerprint` of these weights.
        tensors: name -> tensor, in manifest (or checkpoint) order.
        fallback_reason: why mode ``client`` loaded from disk, else None.

    While a cache handle is open it holds its entry's segment fds and a lease. If the keeper goes away, a
    background thread re-publishes the entry (those fds, no disk read) to the next keeper that serves the same
    socket directory, and takes the lease again (see :mod:`weightcache.republish`); the tensors are never
    affected.
    """

    def __init__(
        self,
        *,
        source: Source,
        fingerprint: Fingerprint,
        tensors: dict[str, torch.Tensor],
        manifest: Manifest | None = None,
        connection: KeeperConnection | None = None,
        fds: list[int] | None = None,
        fallback_reason: str | None = None,
        respawn: bool = False,
    ) -> None:
        self.source: Source = source
        self.fingerprint = fingerprint
        self.tensors = tensors
        self.manifest = manifest
        self.fallback_reason = fallback_reason
        self._lock = threading.RLock()
        self._closed = False
        self._connection = connection
        self._fds = fds or []
        self._socket_dir = connection.socket_dir if connection is not None else None
        self._explicit = connection.explicit if connection is not None else True
        #: Whether the re-publisher may spawn a keeper for this handle after a crash (Cache(spawn=True)).
        self._respawn = respawn
        if connection is not None and manifest is not None:
            republish.watch(self)

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    @property
    def leased(self) -> bool:
        """Whether this handle holds a lease in the keeper (False from the moment its keeper is found gone until
        the entry is re-published to a new one)."""
        return self._connection is not None and not self._connection.closed

    def verify(self) -> None:
        """Recompute every tensor's content digest and compare with the manifest's; raise on any difference."""
        if self.manifest is None:
            raise WeightCacheError("this handle was loaded from disk; there are no published digests to verify")
        bad = []
        for name, expected in zip(self.manifest.names, self.manifest.digest):
            if expected is not None and content_digest(self.tensors[name]) != expected:
                bad.append(name)
        if bad:
            raise WeightCacheError(
                f"{len(bad)} tensors differ from what was published: {', '.join(bad[:8])}. The shared memory "
                "was changed; evict the entry (`weightcache evict`) and load again."
            )

    def close(self) -> None:
        """Release the lease and this handle's fds. The tensors stay valid."""
        lock = getattr(self, "_lock", None)
        if lock is None:  # __init__ did not finish
            return
        republish.forget(self)
        with lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()
                self._connection = None
            close_fds(self._fds)
            self._fds = []

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"<Handle source={self.source} tensors={len(self.tensors)} digest={self.digest[:12]} "
            f"{'leased' if self.leased else 'unleased'}>"
        )


@attrs.frozen
class EntryInfo:
    """One entry the keeper holds, as :meth:`Cache.entries` reports it."""

    digest: str
    placement: str
    device: str
    model: str
    bytes: int
    tensors: int
    segments: int
    leases: int
    holders: tuple[tuple[int, float], ...]
    created: float
    last_used: float
    age_s: float
    fingerprint: Fingerprint

    @classmethod
    def from_json(cls, data: dict[str, object]) -> EntryInfo:
        holders = data.get("holders") or []
        assert isinstance(holders, list)
        return cls(
            digest=str(data["digest"]),
            placement=str(data["placement"]),
            device=str(data["device"]),
            model=str(data["model"]),
            bytes=int(data["bytes"]),  # type: ignore[call-overload]
            tensors=int(data["tensors"]),  # type: ignore[call-overload]
            segments=int(data["segments"]),  # type: ignore[call-overload]
            leases=int(data["leases"]),  # type: ignore[call-overload]
            holders=tuple((int(h["pid"]), float(h["since"])) for h in holders),
            created=float(data["created"]),  # type: ignore[arg-type]
            last_used=float(data["last_used"]),  # type: ignore[arg-type]
            age_s=float(data["age_s"]),  # type: ignore[arg-type]
            fingerprint=Fingerprint.from_json(data["fingerprint"]),
        )


def content_digest(tensor: torch.Tensor) -> str:
    """SHA-256 of a tensor's bytes in memory order (what manifests record per tensor)."""
    data = segment_transports.dense_bytes(tensor)
    if data.device.type != "cpu":
        data = data.cpu()
    return hashlib.sha256(data.numpy().data if data.numel() else b"").hexdigest()


class Cache:
    """The host keeper, seen from Python.

    Args:
        socket_dir: where the keeper's socket lives (default: ``$WEIGHTCACHE_DIR``, ``$XDG_RUNTIME_DIR``,
            ``/tmp/weightcache-<uid>``).
        spawn: start a detached keeper if none runs (exactly one, even when processes race); and if the keeper
            crashes while this process holds handles from this cache, start a new one to re-publish them to.
    """

    def __init__(self, socket_dir: str | os.PathLike[str] | None = None, *, spawn: bool = False) -> None:
        if spawn:
            ensure_keeper(socket_dir)
        # As given (None: the default location): whether the caller named it decides how much it is trusted.
        self.socket_dir = socket_dir
        #: Whether handles from this cache may spawn a keeper to re-publish to after a crash.
        self.respawn = spawn

    def _connect(self) -> KeeperConnection:
        return KeeperConnection.connect(self.socket_dir)

    # --- queries -----------------------------------------------------------------------------------------

    def keeper_info(self) -> dict[str, object]:
        """The keeper's pid, version, protocol, socket directory and uptime."""
        with self._connect() as conn:
            reply, _ = conn.request({"op": "list"})
        info = reply["keeper"]
        assert isinstance(info, dict)
        return info

    def entries(self) -> list[EntryInfo]:
        """Everything the keeper holds: digest, bytes, device, leases (and their holders), age."""
        with self._connect() as conn:
            reply, _ = conn.request({"op": "list"})
        return [EntryInfo.from_json(e) for e in reply["entries"]]

    def evict(self, fingerprint_or_digest: Fingerprint | str, *, force: bool = False) -> list[str]:
        """Drop entries from the keeper (by fingerprint, digest or unique digest prefix).

        Refused with KeeperError (code ``"leased"``) while a client holds a lease, unless ``force``. Memory
        that live clients map stays valid either way; it is freed when the last of them lets go.
        Returns the keys evicted.
        """
        if isinstance(fingerprint_or_digest, Fingerprint):  # exactly this entry: digest and placement
            digest = f"{fingerprint_or_digest.digest}@{fingerprint_or_digest.placement}"
        else:
            digest = fingerprint_or_digest
        with self._connect() as conn:
            reply, _ = conn.request({"op": "evict", "digest": digest, "force": force})
        return [str(k) for k in reply["evicted"]]

    def stop(self, *, wait: float | None = None) -> int:
        """Ask the keeper to exit; returns its pid. Attached clients keep working; unleased entries are freed.

        With ``wait`` (seconds), return only once the keeper process has exited (it replies first, then frees its
        entries and writes into its socket directory): do this before removing that directory. KeeperError
        (code ``"timeout"``) if it still runs after ``wait``.
        """
        from .client import stop_keeper

        return stop_keeper(self._connect(), wait=wait)

    # --- attach -----------------------------------------------------------------------------------------

    def get(self, fingerprint: Fingerprint) -> Handle | None:
        """Attach the entry with this fingerprint (and placement), or return None if the keeper has none.

        Raises UnsupportedQuantError for a refused quantization method and KeeperUnavailable when no keeper
        runs.
        """
        quant_registry.get(fingerprint.quant).check()
        conn = self._connect()
        try:
            reply, fds = conn.request({"op": "get", "digest": fingerprint.digest, "placement": fingerprint.placement})
        except BaseException:
            conn.close()
            raise
        if not reply.get("found"):
            conn.close()
            return None
        try:
            manifest = Manifest.from_keeper(reply.get("manifest"))
            if manifest.fingerprint != fingerprint:
                raise ManifestError(
                    f"the keeper answered digest {fingerprint.digest[:12]} with an entry whose fingerprint differs"
                )
            if len(fds) != len(manifest.segments):
                raise ManifestError(f"manifest lists {len(manifest.segments)} segments but {len(fds)} fds arrived")
            tensors = _views(manifest, fds)
        except BaseException:
            close_fds(fds)
            conn.close()
            raise
        return self._attached(fingerprint, manifest, tensors, conn, fds)

    def _attached(
        self,
        fingerprint: Fingerprint,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        conn: KeeperConnection,
        fds: list[int],
    ) -> Handle:
        """The Handle of an entry this process now maps: it owns the lease connection and the fds."""
        return Handle(
            source="cache",
            fingerprint=fingerprint,
            tensors=tensors,
            manifest=manifest,
            connection=conn,
            fds=fds,
            respawn=self.respawn,
        )

    # --- publish ----------------------------------------------------------------------------------------

    def put(
        self,
        fingerprint: Fingerprint,
        tensors: Mapping[str, torch.Tensor],
        *,
        digests: bool | None = None,
        max_segment_bytes: int | None = None,
        consume: bool = False,
    ) -> Handle:
        """Copy a state dict into shareable segments, publish it under ``fingerprint`` and return the
        attached Handle (its tensors map the published segments, not ``tensors``).

        The tensors may live on any device; they are copied to the fingerprint's placement. If the keeper
        already holds this fingerprint (another process won a race), the existing entry is attached instead.
        Raises UnsupportedQuantError for a refused method, before anything is copied.

        Args:
            digests: record a SHA-256 per tensor (for :meth:`Handle.verify`); default: when the tensors are
                on the CPU (elsewhere it costs a device-to-host copy).
            max_segment_bytes: largest segment; default :func:`default_segment_bytes`.
            consume: remove each tensor from ``tensors`` (a mutable mapping) once copied, freeing GPU memory
                as it goes, so that migrating a model needs one segment of extra memory, not two copies.
                Only references held elsewhere (e.g. by a model) keep originals alive.
        """
        quant_registry.get(fingerprint.quant).check()
        transport = segment_transports.transport_for_placement(fingerprint.placement)
        names = list(tensors)
        if not names:
            raise WeightCacheError("cannot publish an empty state dict")
        for name in names:
            if not isinstance(tensors[name], torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is {type(tensors[name]).__name__}; expected a torch.Tensor")
        nbytes = [tensors[n].numel() * tensors[n].element_size() for n in names]
        if max_segment_bytes is None:
            max_segment_bytes = default_segment_bytes(fingerprint.placement, nbytes)
        if digests is None:
            # Digests need the bytes on the host: free for CPU tensors, a device-to-host copy otherwise.
            digests = all(tensors[n].device.type == "cpu" for n in names)
        placements, sizes = segment_transports.pack(nbytes, transport.alignment, max_segment_bytes)
        segs: list[segment_transports.Segment] = []
        try:
            infos = _fill(transport, fingerprint.placement, segs, sizes, names, placements, tensors, digests, consume)
        except BaseException:
            for seg in segs:
                seg.close()
            raise
        return self._publish(fingerprint, transport, segs, infos)

    def _publish(
        self,
        fingerprint: Fingerprint,
        transport: segment_transports.Transport,
        segs: list[segment_transports.Segment],
        infos: list[TensorInfo],
    ) -> Handle:
        """Hand sealed, filled segments to the keeper and return the attached Handle. Consumes ``segs``."""
        try:
            manifest = Manifest.build(
                fingerprint,
                [SegmentInfo(kind=transport.kind, size=seg.size, placement=fingerprint.placement) for seg in segs],
                infos,
            )
            conn = self._connect()
            try:
                reply, _ = conn.request({"op": "publish", "manifest": manifest.to_json()}, [s.fd for s in segs])
            except BaseException:
                conn.close()
                raise
        except BaseException:
            for seg in segs:
                seg.close()
            raise
        if not reply.get("created"):
            # Someone published the same fingerprint first: use theirs, drop ours.
            conn.close()
            for seg in segs:
                seg.close()
            handle = self.get(fingerprint)
            if handle is None:
                raise KeeperError("the keeper reported the entry as existing, then could not find it", "race")
            return handle
        fds = [seg.detach_fd() for seg in segs]  # the handle owns them from here
        try:
            views = _views(manifest, fds)
        except BaseException:
            close_fds(fds)
            conn.close()
            raise
        return self._attached(fingerprint, manifest, views, conn, fds)

    def put_checkpoint(
        self,
        fingerprint: Fingerprint,
        checkpoint: str | os.PathLike[str] | list[StoredTensor],
        *,
        before_publish: Callable[[], object] | None = None,
        progress: bool | None = False,
    ) -> Handle:
        """Publish a safetensors checkpoint as stored (no dtype conversion, no transform) by streaming its files
        straight into GPU segments: no intermediate copy on the device, so the peak is the weights themselves,
        and segments can be large (few imports per attach). For a ``GPU-<uuid>`` placement.

        ``checkpoint`` may also be its :func:`~weightcache.loader.checkpoint_layout`, when the caller has it.
        ``before_publish`` runs once the segments are filled, before the keeper is contacted (mode daemon
        waits there for the keeper it started while the files were read). ``progress``: a bar of the bytes
        streamed, on stderr (None: only on a terminal and for at least 1 GiB; see :mod:`weightcache.progress`).
        """
        from .loader import checkpoint_layout, pinned_staging, prefetch_head, stream_into
        from .progress import byte_bar, wanted
        from .segments.cuda_vmm import device_index

        quant_registry.get(fingerprint.quant).check()
        transport = segment_transports.transport_for_placement(fingerprint.placement)
        if transport.kind != "cuda_vmm":
            raise SegmentError(f"put_checkpoint streams into GPU segments; {fingerprint.placement} is not a GPU")
        layout = checkpoint if isinstance(checkpoint, list) else checkpoint_layout(checkpoint)
        if not layout:
            raise WeightCacheError(f"checkpoint {checkpoint} holds no tensors")
        staging = pinned_staging()  # before the prefetch starts: see pinned_staging
        prefetch_head(dict.fromkeys(t.file for t in layout))  # the disk reads while the segments are created
        nbytes = [t.nbytes for t in layout]
        placements, sizes = segment_transports.pack(nbytes, transport.alignment, STREAM_SEGMENT_BYTES)
        segs: list[segment_transports.Segment] = []
        try:
            for size in sizes:
                segs.append(transport.create(size, fingerprint.placement))
            where = {t.name: placements[i] for i, t in enumerate(layout)}
            device = torch.device("cuda", device_index(fingerprint.placement))

            def destination(t: StoredTensor) -> torch.Tensor:
                p = where[t.name]
                seg = segs[p.segment]
                assert isinstance(seg, CudaVmmSegment)
                return seg.destination(p.offset, t.nbytes)

            total = sum(nbytes)
            with byte_bar(total, "loading checkpoint into the cache", wanted(progress, total)) as update:
                stream_into(layout, device, destination, update, staging)
            for seg in segs:
                seg.seal()
            if before_publish is not None:
                before_publish()
        except BaseException:
            for seg in segs:
                seg.close()
            raise
        infos = [
            TensorInfo(
                name=t.name,
                segment=placements[i].segment,
                offset=placements[i].offset,
                dtype=str(t.dtype).removeprefix("torch."),
                shape=t.shape,
                stride=_contiguous_stride(t.shape),
                kind="tensor",
                requires_grad=False,
                digest=None,
            )
            for i, t in enumerate(layout)
        ]
        return self._publish(fingerprint, transport, segs, infos)


def _contiguous_stride(shape: tuple[int, ...]) -> tuple[int, ...]:
    stride, acc = [], 1
    for n in reversed(shape):
        stride.append(acc)
        acc *= max(n, 1)
    return tuple(reversed(stride))


def default_segment_bytes(placement: str, nbytes: list[int]) -> int:
    """Segment size when none is given.

    CPU: up to 8 GiB (a memfd costs one mmap to attach, whatever its size). GPU: max(1 GiB, the largest
    tensor), so that migrating weights that already sit on the GPU needs at most one segment of extra memory;
    grown when needed to keep an entry within the fds one message can carry. Importing a VMM segment costs
    ~0.1 ms, so a few dozen segments still attach in milliseconds.
    """
    from .protocol import MAX_FDS

    if placement == "cpu":
        return DEFAULT_MAX_SEGMENT_BYTES
    total = sum(nbytes)
    return max(1 << 30, max(nbytes, default=0), -(-total // (MAX_FDS - 10)))


def _fill(
    transport: segment_transports.Transport,
    placement: str,
    segs: list[segment_transports.Segment],
    sizes: list[int],
    names: list[str],
    placements: list[segment_transports.Placement],
    tensors: Mapping[str, torch.Tensor],
    digests: bool,
    consume: bool,
) -> list[TensorInfo]:
    """Create the segments one at a time and copy their tensors in (a few threads: copies and hashing release
    the GIL), appending each created segment to ``segs`` so the caller can clean up on failure.

    With ``consume``, each tensor is removed from ``tensors`` once copied, and GPU memory the originals held is
    returned to the driver before the next segment is created: migrating weights from the caching allocator
    then needs one segment of extra memory, not a second copy of the model.
    """
    rows: list[TensorInfo | None] = [None] * len(names)
    by_segment: list[list[int]] = [[] for _ in sizes]
    for i, where in enumerate(placements):
        by_segment[where.segment].append(i)

    def one(i: int) -> None:
        name = names[i]
        t = tensors[name]
        where = placements[i]
        segs[where.segment].write(where.offset, t)
        rows[i] = TensorInfo(
            name=name,
            segment=where.segment,
            offset=where.offset,
            dtype=str(t.dtype).removeprefix("torch."),
            shape=tuple(t.shape),
            stride=segment_transports.stored_stride(t),
            kind="parameter" if isinstance(t, torch.nn.Parameter) else "tensor",
            requires_grad=bool(t.requires_grad),
            digest=content_digest(t) if digests else None,
        )

    on_gpu = any(tensors[n].is_cuda for n in names)
    # Threads pay off where copies block on the host (page faults in mapped files, pwrite, hashing); copies
    # between device buffers are asynchronous launches, and threads would only fight over the GIL.
    host_work = digests or not all(tensors[n].is_cuda for n in names) or transport.kind == "memfd"
    workers = min(8, os.cpu_count() or 1) if host_work else 1
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for k, size in enumerate(sizes):
            segs.append(transport.create(size, placement))
            list(pool.map(one, by_segment[k]))
            segs[k].seal()
            if consume and isinstance(tensors, MutableMapping):
                for i in by_segment[k]:
                    tensors.pop(names[i], None)
                if on_gpu:
                    torch.cuda.empty_cache()
    return [r for r in rows if r is not None]


def _views(manifest: Manifest, fds: list[int]) -> dict[str, torch.Tensor]:
    """Map every segment once and cut the tensors out of it: one ``as_strided`` per tensor."""
    bases = [segment_transports.transport(info.kind).map(fd, info) for fd, info in zip(fds, manifest.segments)]
    typed: dict[tuple[int, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    try:
        return _cut(manifest, bases, typed, out)
    except (RuntimeError, TypeError, ValueError) as exc:  # torch refused a view: the manifest is wrong
        raise ManifestError(f"cannot build the tensors this manifest describes: {exc}") from exc


def _cut(
    manifest: Manifest,
    bases: list[torch.Tensor],
    typed: dict[tuple[int, str], torch.Tensor],
    out: dict[str, torch.Tensor],
) -> dict[str, torch.Tensor]:
    last_seg: object = None
    last_dt: object = None
    base = torch.empty(0)
    itemsize = 1
    for name, seg, off, dt, shape, stride in zip(
        manifest.names, manifest.segment, manifest.offset, manifest.dtype, manifest.shape, manifest.stride
    ):
        if seg != last_seg or dt != last_dt:  # consecutive tensors mostly share both: look the base up only then
            last_seg, last_dt = seg, dt
            cached = typed.get((seg, dt))
            if cached is None:
                if not (isinstance(seg, int) and 0 <= seg < len(bases)):
                    raise ManifestError(f"tensor {name!r} names segment {seg!r}; the entry has {len(bases)}")
                cached = typed[(seg, dt)] = bases[seg].view(_torch_dtype(dt))
            base = cached
            itemsize = base.element_size()
        index, misaligned = divmod(off, itemsize)
        if misaligned:
            raise ManifestError(f"tensor {name!r} has offset {off}, not a multiple of its {dt} element size")
        out[name] = base.as_strided(shape, stride, index)  # torch checks the view lies inside the segment
    return out

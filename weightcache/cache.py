"""The host cache as a Python object: publish state dicts into segments, attach them back as tensors.

:class:`Cache` talks to the keeper; :class:`Handle` is what a caller holds while it uses attached weights.
A Handle's open keeper connection is its lease; closing the Handle releases the lease and closes its fds but
never unmaps memory: each tensor keeps its segment mapped for as long as the tensor (or a view) lives.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Mapping, MutableMapping
from concurrent.futures import ThreadPoolExecutor
from typing import Literal

import attrs
import torch

from . import quant as quant_registry
from . import segments as segment_transports
from .client import KeeperConnection, ensure_keeper
from .errors import KeeperError, ManifestError, SegmentError, WeightCacheError
from .fingerprint import Fingerprint
from .manifest import DTYPE_SIZES, Manifest, SegmentInfo, TensorInfo
from .protocol import close_fds

#: Default upper bound on one segment; a larger tensor gets a segment of its own.
DEFAULT_MAX_SEGMENT_BYTES = 8 << 30
Source = Literal["cache", "disk"]


def _torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ManifestError(f"dtype {name!r} is not supported by torch {torch.__version__}")
    return dtype


class Handle:
    """Attached (or disk-loaded) weights.

    Attributes:
        source: ``"cache"`` when the tensors map a keeper's segments, ``"disk"`` when they were loaded from
            the checkpoint (mode ``off``, or a fallback).
        fingerprint: the :class:`Fingerprint` of these weights.
        tensors: name -> tensor, in manifest (or checkpoint) order.
        fallback_reason: why mode ``client`` loaded from disk, else None.
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
    ) -> None:
        self.source: Source = source
        self.fingerprint = fingerprint
        self.tensors = tensors
        self.manifest = manifest
        self.fallback_reason = fallback_reason
        self._connection = connection
        self._fds = fds or []

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    @property
    def leased(self) -> bool:
        """Whether this handle still holds a lease in the keeper."""
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
        spawn: start a detached keeper if none runs (exactly one, even when processes race).
    """

    def __init__(self, socket_dir: str | os.PathLike[str] | None = None, *, spawn: bool = False) -> None:
        self.socket_dir = ensure_keeper(socket_dir) if spawn else socket_dir

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
        digest = (
            fingerprint_or_digest.digest if isinstance(fingerprint_or_digest, Fingerprint) else fingerprint_or_digest
        )
        with self._connect() as conn:
            reply, _ = conn.request({"op": "evict", "digest": digest, "force": force})
        return [str(k) for k in reply["evicted"]]

    def stop(self) -> None:
        """Ask the keeper to exit. Attached clients keep working; unleased entries are freed."""
        with self._connect() as conn:
            conn.request({"op": "stop"})

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
            manifest = Manifest.from_json(reply.get("manifest"))
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
        return Handle(
            source="cache", fingerprint=fingerprint, tensors=tensors, manifest=manifest, connection=conn, fds=fds
        )

    # --- publish ----------------------------------------------------------------------------------------

    def put(
        self,
        fingerprint: Fingerprint,
        tensors: Mapping[str, torch.Tensor],
        *,
        digests: bool = True,
        max_segment_bytes: int = DEFAULT_MAX_SEGMENT_BYTES,
    ) -> Handle:
        """Copy a state dict into shareable segments, publish it under ``fingerprint`` and return the
        attached Handle (its tensors map the published segments, not ``tensors``).

        If the keeper already holds this fingerprint (another process won a race), the existing entry is
        attached instead. Raises UnsupportedQuantError for a refused method, before anything is copied.
        """
        return self._put(fingerprint, tensors, digests=digests, max_segment_bytes=max_segment_bytes, consume=False)

    def _put(
        self,
        fingerprint: Fingerprint,
        tensors: Mapping[str, torch.Tensor],
        *,
        digests: bool,
        max_segment_bytes: int,
        consume: bool,
    ) -> Handle:
        quant_registry.get(fingerprint.quant).check()
        transport = segment_transports.transport_for_placement(fingerprint.placement)
        names = list(tensors)
        if not names:
            raise WeightCacheError("cannot publish an empty state dict")
        want = "cpu" if fingerprint.placement == "cpu" else "cuda"
        for name in names:
            t = tensors[name]
            if not isinstance(t, torch.Tensor):
                raise TypeError(f"state dict entry {name!r} is {type(t).__name__}; expected a torch.Tensor")
            if t.device.type != want:
                raise SegmentError(
                    f"tensor {name!r} is on {t.device} but the fingerprint places the entry on "
                    f"{fingerprint.placement}; create the fingerprint with the device the tensors live on"
                )
        nbytes = [tensors[n].numel() * tensors[n].element_size() for n in names]
        placements, sizes = segment_transports.pack(nbytes, transport.alignment, max_segment_bytes)
        segs = [transport.create(size, fingerprint.placement) for size in sizes]
        infos: list[TensorInfo] = []
        try:
            infos = _fill(segs, names, placements, tensors, digests=digests, consume=consume)
            for seg in segs:
                seg.seal()
            manifest = Manifest.build(
                fingerprint,
                [SegmentInfo(kind=transport.kind, size=s, placement=fingerprint.placement) for s in sizes],
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
        fds = [seg.fd for seg in segs]  # the handle owns them from here
        try:
            views = _views(manifest, fds)
        except BaseException:
            close_fds(fds)
            conn.close()
            raise
        return Handle(
            source="cache", fingerprint=fingerprint, tensors=views, manifest=manifest, connection=conn, fds=fds
        )


def _fill(
    segs: list[segment_transports.Segment],
    names: list[str],
    placements: list[segment_transports.Placement],
    tensors: Mapping[str, torch.Tensor],
    *,
    digests: bool,
    consume: bool,
) -> list[TensorInfo]:
    """Write every tensor into its segment (in a few threads: pwrite and hashing release the GIL) and
    return its manifest row. With ``consume``, entries are removed from ``tensors`` as they are written so
    the originals can be freed one at a time."""

    def one(i: int) -> TensorInfo:
        name = names[i]
        t = tensors[name]
        where = placements[i]
        segs[where.segment].write(where.offset, t)
        return TensorInfo(
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

    workers = min(4, os.cpu_count() or 1)
    rows: list[TensorInfo] = []
    with ThreadPoolExecutor(max_workers=workers) as pool:
        for i, row in enumerate(pool.map(one, range(len(names)))):
            rows.append(row)
            if consume and isinstance(tensors, MutableMapping):
                tensors.pop(names[i], None)
    return rows


def _views(manifest: Manifest, fds: list[int]) -> dict[str, torch.Tensor]:
    """Map every segment once and cut the tensors out of it: one ``as_strided`` per tensor."""
    bases = [segment_transports.transport(info.kind).map(fd, info) for fd, info in zip(fds, manifest.segments)]
    typed: dict[tuple[int, str], torch.Tensor] = {}
    out: dict[str, torch.Tensor] = {}
    for name, seg, off, dt, shape, stride in zip(
        manifest.names, manifest.segment, manifest.offset, manifest.dtype, manifest.shape, manifest.stride
    ):
        key = (seg, dt)
        base = typed.get(key)
        if base is None:
            base = typed[key] = bases[seg].view(_torch_dtype(dt))
        out[name] = base.as_strided(shape, stride, off // DTYPE_SIZES[dt])
    return out

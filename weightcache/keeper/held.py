"""What the keeper's entry store holds, as values: an entry (one published model on one placement, its manifest
and segment fds), an artifact (one sealed memfd an engine compiled), the leases on either, and what a ``get``,
``get_artifact`` or ``list`` hands back (:class:`Checkout`, :class:`ArtifactCheckout`, :class:`Snapshot`).

Each owns its fds and closes them in ``close()``; nothing here decides anything (leases, budgets, eviction are
:mod:`weightcache.keeper.store`'s and :mod:`weightcache.keeper.room`'s). Layer L2: never imports torch, opens no
socket, starts no thread.
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any

import attrs

from ..artifact_key import ArtifactKey
from ..manifest import Manifest
from ..messages import ArtifactInfo, EntryInfo


@attrs.define
class Lease:
    pid: int
    since: float


@attrs.define
class Entry:
    """What the store holds for one (digest, placement)."""

    digest: str
    #: The uid that published it; ``key`` carries it unless it is the keeper's owner.
    publisher: int
    key: str
    manifest: Manifest
    manifest_json: dict[str, Any]
    #: The manifest encoded once, at publish: every get sends these bytes instead of encoding it again.
    manifest_text: str
    fds: list[int]
    created: float
    last_used: float
    #: connection id -> lease
    leases: dict[int, Lease] = attrs.field(factory=dict)
    #: What it costs the budget: the memory its segments really hold (:func:`~weightcache.fdcheck.committed_bytes`);
    #: None: its declared size.
    committed: int | None = None

    @property
    def placement(self) -> str:
        return self.manifest.fingerprint.placement

    @property
    def charge(self) -> int:
        return self.size if self.committed is None else self.committed

    @property
    def size(self) -> int:
        return self.manifest.total_bytes

    def info(self, now: float) -> EntryInfo:
        fp = self.manifest.fingerprint
        return EntryInfo(
            digest=self.digest,
            placement=fp.placement,
            device=fp.device_kind if fp.placement == "cpu" else f"{fp.device_kind}:{fp.placement}",
            model=fp.architecture or Path(fp.model_path).name,
            bytes=self.size,
            tensors=len(self.manifest),
            segments=len(self.manifest.segments),
            leases=len(self.leases),
            holders=tuple((lease.pid, lease.since) for lease in self.leases.values()),
            created=self.created,
            last_used=self.last_used,
            age_s=round(now - self.created, 3),
            fingerprint=fp,
            tensor_bytes=self.manifest.tensor_bytes,
            publisher=self.publisher,
            key=self.key,
        )

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


#: Where an artifact's memory lives, for the budget: a memfd is host memory, whatever device it was compiled for.
ARTIFACT_PLACEMENT = "cpu"


@attrs.define
class Artifact:
    """What the store holds for one artifact: its key, publisher, the blob's size and SHA-256 (as the publisher
    recorded them; the store never reads the blob) and its one memfd."""

    weights: str
    artifact_key: ArtifactKey
    publisher: int
    key: str
    size: int
    sha256: str
    fd: int
    created: float
    last_used: float
    leases: dict[int, Lease] = attrs.field(factory=dict)
    #: What it costs the budget: the bytes of its memfd really written (None: its declared size).
    committed: int | None = None

    #: For the budget and eviction, which treat artifacts and entries alike.
    placement = ARTIFACT_PLACEMENT

    @property
    def charge(self) -> int:
        return self.size if self.committed is None else self.committed

    @property
    def fds(self) -> list[int]:
        return [self.fd] if self.fd >= 0 else []

    def info(self, now: float) -> ArtifactInfo:
        return ArtifactInfo(
            key=self.key,
            weights=self.weights,
            artifact_key=self.artifact_key,
            bytes=self.size,
            sha256=self.sha256,
            publisher=self.publisher,
            leases=len(self.leases),
            holders=tuple((lease.pid, lease.since) for lease in self.leases.values()),
            created=self.created,
            last_used=self.last_used,
            age_s=round(now - self.created, 3),
        )

    def close(self) -> None:
        if self.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(self.fd)
            self.fd = -1


#: Either kind of thing the store holds (what the budget, ``evict`` and leases treat alike).
Held = Entry | Artifact


@attrs.frozen
class ArtifactCheckout:
    """A found artifact for a ``get_artifact``: what ``list_artifacts`` says of it, and a dup of its memfd (the
    caller's to close)."""

    info: ArtifactInfo
    fd: int
    #: Whether this get took the lease (the connection did not hold it already): see :meth:`Store.unlease`.
    fresh: bool = False


@attrs.frozen
class Checkout:
    """A found entry for a ``get``: its key, publisher, encoded manifest, and dups of its fds (the caller's to
    close)."""

    key: str
    publisher: int
    manifest_text: str
    fds: list[int]
    #: Whether this get took the lease (the connection did not hold it already): see :meth:`Store.unlease`.
    fresh: bool = False


@attrs.frozen
class Snapshot:
    """One page of what the store holds at one instant, for ``list``."""

    #: Entries in key order, after the page's start; at most the page's limit.
    entries: tuple[EntryInfo, ...]
    #: Whether more entries follow the last of :attr:`entries`.
    more: bool
    #: connection id -> (keys of at most ``keys_per_conn`` of the entries it leases, how many it leases)
    leases: dict[int, tuple[tuple[str, ...], int]]
    bytes_by_placement: dict[str, int]

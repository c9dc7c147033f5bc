"""What a caller holds while it uses weights from weightcache: :class:`Handle`.

A Handle of cached weights owns a :class:`~weightcache.lease.Lease` (the keeper connection and the entry's fds);
closing the Handle releases the lease but never unmaps memory: each tensor keeps its segment mapped for as
long as the tensor (or a view) lives.
"""

from __future__ import annotations

from typing import Literal

import torch

from . import republish
from .errors import WeightCacheError
from .fingerprint import Fingerprint
from .lease import Lease
from .manifest import Manifest

Source = Literal["cache", "disk"]


class Handle:
    """Attached (or disk-loaded) weights.

    Attributes:
        source: ``"cache"`` when the tensors map a keeper's segments, ``"disk"`` when this process holds them
            privately (mode ``off``, a fallback, or a publish that failed after loading).
        fingerprint: the :class:`Fingerprint` of these weights.
        tensors: name -> tensor, in manifest (or checkpoint) order.
        manifest: the published manifest (None for weights this process holds privately).
        fallback_reason: why weightcache served weights from disk when the mode asked for the cache, else None
            (None too where ``WEIGHTCACHE_MODE=off`` switched weightcache off: nothing fell back).
        read_disk: whether this start read the checkpoint (True for every disk source, and for mode daemon's
            first start, which loads, publishes and then runs on the published copy).
        resident_before: whether the entry was in the keeper when this start first looked for it (a plain hit):
            False for weights held privately, for what this start published (``Cache.publish``, mode daemon's
            miss), and for an entry another engine published after that first look (while this start waited for
            its load, or before this start took the load lock: "hit, published meanwhile"), whose segments
            appeared during this start. An engine that sizes its caches from the free memory it sampled before
            loading counts only such an entry as preloaded.
        publisher: the uid that published the entry (as the keeper saw it); None for weights held privately.
        evicted: the keys of the entries the keeper evicted (unleased, least recently used) to make room under its
            budget when this process published these weights; empty otherwise.

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
        lease: Lease | None = None,
        fallback_reason: str | None = None,
        read_disk: bool | None = None,
        publisher: int | None = None,
        evicted: tuple[str, ...] = (),
    ) -> None:
        self.source: Source = source
        self.fingerprint = fingerprint
        self.tensors = tensors
        self.manifest = manifest
        self.fallback_reason = fallback_reason
        self.read_disk = source == "disk" if read_disk is None else read_disk
        #: (the pipeline sets it False for what this start published or waited for)
        self.resident_before = source == "cache" and not self.read_disk
        self.publisher = publisher
        self.evicted = evicted
        self._lease = lease
        if lease is not None:
            republish.watch(lease)

    @property
    def digest(self) -> str:
        return self.fingerprint.digest

    @property
    def leased(self) -> bool:
        """Whether this handle holds a lease in the keeper (False from the moment its keeper is found gone until
        the entry is re-published to a new one)."""
        return self._lease is not None and self._lease.held

    @property
    def nbytes(self) -> int:
        """Bytes of the entry's segments (cache), or of the tensors (disk)."""
        if self.manifest is not None:
            return self.manifest.total_bytes
        return sum(t.numel() * t.element_size() for t in self.tensors.values())

    def verify(self) -> None:
        """Recompute every tensor's content digest and compare with the manifest's; raise on any difference.

        Every publisher records the same digest (SHA-256 of the bytes, see :mod:`weightcache.digests`), so this
        checks the same thing whoever published the entry. Raises WeightCacheError for weights held privately
        (nothing was published) and for an entry published without digests (``weightcache load --no-digests``).
        """
        if self.manifest is None:
            raise WeightCacheError("this handle was loaded from disk; there are no published digests to verify")
        if any(d is None for d in self.manifest.digest):
            raise WeightCacheError(
                f"entry {self.digest[:12]} was published without per-tensor digests (weightcache load --no-digests), "
                "so there is nothing to verify against; publish it again without --no-digests"
            )
        from .digests import content_digest  # hashing is imported when a caller verifies, not with every attach

        bad = [
            name
            for name, expected in zip(self.manifest.names, self.manifest.digest)
            if content_digest(self.tensors[name]) != expected
        ]
        if bad:
            raise WeightCacheError(
                f"{len(bad)} tensors differ from what was published: {', '.join(bad[:8])}. The shared memory "
                "was changed; evict the entry (`weightcache evict`) and load again."
            )

    def close(self) -> None:
        """Release the lease and this handle's fds; returns once the keeper has released the lease (at most
        :data:`~weightcache.client.connection.CLOSE_TIMEOUT_S`). The tensors stay valid."""
        self._release(wait=True)

    def _release(self, *, wait: bool) -> None:
        lease = getattr(self, "_lease", None)
        if lease is None:  # weights held privately, or __init__ did not finish
            return
        republish.forget(lease)
        lease.close(wait=wait)

    def __enter__(self) -> Handle:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self._release(wait=False)  # collected anywhere: never wait on the keeper here
        except Exception:
            pass

    def __repr__(self) -> str:
        return (
            f"<Handle source={self.source} tensors={len(self.tensors)} digest={self.digest[:12]} "
            f"{'leased' if self.leased else 'unleased'}>"
        )


__all__ = ["Handle", "Source"]

"""The host cache as a Python object: :class:`Cache` asks the keeper for entries and hands it packed weights.

Packing (:mod:`weightcache.publish`), mapping (:mod:`weightcache.views`) and what a caller holds
(:class:`~weightcache.handle.Handle`) live in their own modules; this one only talks to the keeper.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING

import torch

from . import artifacts as artifact_ops
from . import quant as quant_registry
from .artifact_key import ArtifactKey
from .artifacts import Artifact, Fetched
from .client import KeeperConnection, ensure_keeper, stop_keeper
from .errors import KeeperError, ManifestError, WeightCacheError
from .fingerprint import Fingerprint
from .handle import Handle
from .lease import Lease
from .manifest import Manifest
from .messages import ArtifactInfo, EntryInfo
from .protocol import close_fds
from .rundir import resolve_user
from .views import map_entry

if TYPE_CHECKING:  # packing is imported when something is published: an attach never needs it
    from .loader import StoredTensor
    from .publish import Packed

#: How a miss reason begins when the keeper was there but failed to answer (logged as a warning).
KEEPER_FAILED = "the keeper failed to answer"

log = logging.getLogger("weightcache.artifacts")


def weights_digest(fingerprint: Fingerprint | str) -> str:
    """The weights digest an artifact is stored under: a fingerprint's digest, or a digest given as is."""
    return fingerprint.digest if isinstance(fingerprint, Fingerprint) else fingerprint


class Cache:
    """The host keeper, seen from Python.

    Args:
        socket_dir: where the keeper's socket lives (default: ``$WEIGHTCACHE_DIR``; else
            ``$XDG_RUNTIME_DIR/weightcache`` where that variable names an existing directory; else
            ``/tmp/weightcache-<uid>``).
        spawn: start a detached keeper if none runs (exactly one, even when processes race); and if the keeper
            crashes while this process holds handles from this cache, start a new one to re-publish them to.
        trusted_publishers: users (names or uids) whose published entries :meth:`get` also accepts. It always
            accepts entries published by this process's uid, then by the keeper's owner; a keeper shared with a
            group (``serve --allow-group``) may hold entries of its members under the same fingerprint, and those
            are attached only if named here (see docs/deployment.md, "Trust").

    Raises :class:`~weightcache.errors.InvalidArgument` (a ValueError) for a user name that does not exist on
    this host, and, with ``spawn``, :class:`~weightcache.errors.KeeperUnavailable` where no keeper runs and none
    may be started (one stopped on purpose, or another user's shared directory).
    """

    def __init__(
        self,
        socket_dir: str | os.PathLike[str] | None = None,
        *,
        spawn: bool = False,
        trusted_publishers: Iterable[int | str] = (),
    ) -> None:
        #: The uids named by ``trusted_publishers``.
        self.trusted_publishers = tuple(resolve_user(user) for user in trusted_publishers)
        if spawn:
            ensure_keeper(socket_dir)
        # As given (None: the default location): whether the caller named it decides how much it is trusted.
        self.socket_dir = socket_dir
        #: Whether handles from this cache may spawn a keeper to re-publish to after a crash.
        self.respawn = spawn
        # (weights, artifact key digest) -> SHA-256 of an artifact found corrupt: the next put of that key
        # replaces it (otherwise the keeper would keep the corrupt one and answer every later get with it).
        self._corrupt: dict[tuple[str, str], str] = {}
        # (weights, artifact key digest) -> why the last get or open of that artifact found nothing.
        self._misses: dict[tuple[str, str], str] = {}

    def _connect(self) -> KeeperConnection:
        return KeeperConnection.connect(self.socket_dir)

    def trust(self, conn: KeeperConnection) -> tuple[int, ...]:
        """The publishers this cache accepts through ``conn``, in order of preference: this process's uid, the
        keeper's owner, then :attr:`trusted_publishers`."""
        return tuple(dict.fromkeys((*conn.default_trust, *self.trusted_publishers)))

    # --- queries -----------------------------------------------------------------------------------------

    def keeper_info(self) -> dict[str, object]:
        """The keeper's pid, version, protocol, socket directory and uptime."""
        with self._connect() as conn:
            return conn.list().keeper.to_json()

    def entries(self) -> list[EntryInfo]:
        """Everything the keeper holds: digest, bytes, device, publisher, leases (and their holders), age."""
        with self._connect() as conn:
            return list(conn.list().entries)

    def entry(self, fingerprint: Fingerprint) -> EntryInfo | None:
        """The entry :meth:`get` would attach for ``fingerprint`` (its trusted publishers' first), without
        attaching it; None if there is none."""
        with self._connect() as conn:
            trust = self.trust(conn)
            found = [
                e
                for e in conn.list().entries
                if e.digest == fingerprint.digest and e.placement == fingerprint.placement and e.publisher in trust
            ]
        return min(found, key=lambda e: trust.index(e.publisher), default=None)

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
            return list(conn.evict(digest, force=force).evicted)

    # --- artifacts (what an engine compiled for these weights; see docs/concepts.md) --------------------------

    def artifacts(self, fingerprint: Fingerprint | str | None = None) -> list[ArtifactInfo]:
        """The compiled artifacts the keeper holds (of one fingerprint, or of weights digests starting with a
        given prefix), most recently used first: key, weights digest, kind, artifact key, bytes, publisher, leases.
        Empty from a keeper too old to hold artifacts."""
        with self._connect() as conn:
            prefix = None if fingerprint is None else weights_digest(fingerprint)
            return list(conn.list_artifacts(prefix).artifacts)

    def put_artifact(
        self,
        fingerprint: Fingerprint | str,
        key: ArtifactKey,
        data: bytes | bytearray | memoryview,
        *,
        hold: bool = False,
        replace: str | None = None,
    ) -> Artifact:
        """Publish ``data`` (an opaque blob, e.g. ``torch.compiler.save_cache_artifacts()[0]``) as the artifact of
        the weights ``fingerprint`` (or a weights digest) compiled for ``key``.

        The blob travels as a sealed memfd; the keeper never reads it. If the keeper already holds an artifact of
        this weights, key and publisher, that one stays and ``created`` is False, unless ``replace`` names its
        SHA-256 (one found corrupt or outdated; one this Cache's :meth:`get_artifact` found corrupt is replaced
        without being named). With ``hold``, the returned :class:`Artifact` stays leased (never
        evicted for the budget) and is re-published if the keeper restarts, until it is closed.

        Raises BudgetExceeded when it does not fit the keeper's ``cpu`` budget, KeeperUnavailable when no keeper
        runs, KeeperError (code ``"version"``) for a keeper too old to hold artifacts, InvalidArgument for a blob
        over 16 GiB.
        """
        weights = weights_digest(fingerprint)
        if replace is None:
            replace = self._corrupt.get((weights, key.digest))
        conn = self._connect()
        try:
            artifact = artifact_ops.put(conn, weights, key, data, replace=replace, hold=hold, respawn=self.respawn)
        except BaseException:
            conn.close()
            raise
        if not hold:
            conn.close()
        self._corrupt.pop((weights, key.digest), None)
        return artifact

    def get_artifact(self, fingerprint: Fingerprint | str, key: ArtifactKey) -> bytes | None:
        """The blob of the artifact of ``fingerprint`` (or a weights digest) compiled for ``key``, its SHA-256
        checked; None on any miss: no keeper, a keeper too old for artifacts, no artifact of a trusted publisher
        for exactly this key, or a corrupt blob. The reason is logged (logger ``weightcache.artifacts``, INFO; a
        corrupt blob at WARNING). Never raises for the keeper's sake: the caller compiles as it would have."""
        found = self._fetch(fingerprint, key, hold=False)
        if found is None:
            return None
        assert isinstance(found.data, bytes)  # fetched checked: read, not mapped
        return found.data

    def open_artifact(self, fingerprint: Fingerprint | str, key: ArtifactKey, *, check: bool = True) -> Artifact | None:
        """Like :meth:`get_artifact`, but the artifact stays held (leased, and re-published if the keeper
        restarts) until the returned :class:`Artifact` is closed; ``artifact.read()`` gives its bytes. An artifact
        another uid published is read but not held (``artifact.held`` is False): the keeper leases an artifact
        only to its publisher, whose processes alone load it.

        ``check=False``: the artifact is mapped, not read, and its SHA-256 is not checked here, so a large blob
        costs neither a copy nor a hash on the way; ``artifact.view()`` gives the mapping, and the caller checks
        what it uses (``read()`` still gives the bytes checked). A corrupt blob is then not a miss here."""
        found = self._fetch(fingerprint, key, hold=True, check=check)
        return found.artifact if found is not None else None

    def miss_reason(self, fingerprint: Fingerprint | str, key: ArtifactKey) -> str | None:
        """Why the last :meth:`get_artifact` or :meth:`open_artifact` of this Cache for ``fingerprint`` and ``key``
        found nothing (``"no keeper: ..."``, ``"no torch.compile artifact for weights ... and this key"``, ``"the
        keeper failed to answer: ..."``, a corrupt blob), or None after a hit or before any."""
        return self._misses.get((weights_digest(fingerprint), key.digest))

    def _fetch(
        self, fingerprint: Fingerprint | str, key: ArtifactKey, *, hold: bool, check: bool = True
    ) -> Fetched | None:
        weights = weights_digest(fingerprint)
        miss = self._get(weights, key, hold=hold, check=check)
        if isinstance(miss, artifact_ops.Miss):
            self._misses[(weights, key.digest)] = miss.reason
            if miss.corrupt is not None:
                self._corrupt[(weights, key.digest)] = miss.corrupt
            serious = miss.corrupt is not None or miss.reason.startswith(KEEPER_FAILED)
            (log.warning if serious else log.info)("weightcache: %s artifact miss: %s", key.kind, miss.reason)
            return None
        self._misses.pop((weights, key.digest), None)
        log.info(
            "weightcache: %s artifact hit: %s (%d bytes, publisher uid %d)",
            key.kind,
            miss.info.key[:24],
            miss.info.bytes,
            miss.info.publisher,
        )
        return miss

    def _get(self, weights: str, key: ArtifactKey, *, hold: bool, check: bool = True) -> Fetched | artifact_ops.Miss:
        conn = artifact_ops.connect_or_miss(self.socket_dir)
        if isinstance(conn, artifact_ops.Miss):
            return conn
        try:
            found = artifact_ops.get(
                conn, weights, key, trust=self.trust(conn), hold=hold, respawn=self.respawn, check=check
            )
        except (WeightCacheError, OSError) as exc:
            conn.close()
            return artifact_ops.Miss(f"{KEEPER_FAILED}: {exc}")
        if isinstance(found, artifact_ops.Miss) or found.artifact is None or not found.artifact.held:
            conn.close()
        return found

    def stop(self, *, wait: float | None = None) -> int:
        """Ask the keeper to exit; returns its pid. Attached clients keep working; unleased entries are freed.

        With ``wait`` (seconds), return only once the keeper process has exited (it replies first, then frees its
        entries and writes into its socket directory): do this before removing that directory. KeeperError
        (code ``"timeout"``) if it still runs after ``wait``.
        """
        return stop_keeper(self._connect(), wait=wait)

    # --- attach -----------------------------------------------------------------------------------------

    def get(self, fingerprint: Fingerprint) -> Handle | None:
        """Attach the entry with this fingerprint (and placement), or return None if the keeper has none published
        by a trusted user (see ``trusted_publishers``).

        Raises UnsupportedQuantError for a refused quantization method, KeeperUnavailable when no keeper runs and
        KeeperNotResponding when it does not answer in time.
        """
        quant_registry.get(fingerprint.quant).check()
        conn = self._connect()
        try:
            reply, fds = conn.get(fingerprint.digest, fingerprint.placement, trust=self.trust(conn))
        except BaseException:
            conn.close()
            raise
        if not reply.found:
            conn.close()
            return None
        try:
            manifest = Manifest.from_keeper(reply.manifest)
            if manifest.fingerprint != fingerprint:
                raise ManifestError(
                    f"the keeper answered digest {fingerprint.digest[:12]} with an entry whose fingerprint differs"
                )
            tensors = map_entry(manifest, fds)
        except BaseException:
            close_fds(fds)
            conn.close()
            raise
        return self._attached(manifest, tensors, conn, fds, reply.publisher)

    def _attached(
        self,
        manifest: Manifest,
        tensors: dict[str, torch.Tensor],
        conn: KeeperConnection,
        fds: list[int],
        publisher: int | None,
    ) -> Handle:
        """The Handle of an entry this process now maps: it owns the lease connection and the fds."""
        lease = Lease(conn, fds, manifest, respawn=self.respawn, publisher=publisher)
        return Handle(
            source="cache",
            fingerprint=manifest.fingerprint,
            tensors=tensors,
            manifest=manifest,
            lease=lease,
            publisher=publisher,
        )

    # --- publish ----------------------------------------------------------------------------------------

    def put(
        self,
        fingerprint: Fingerprint,
        tensors: Mapping[str, torch.Tensor],
        *,
        digests: bool = True,
        max_segment_bytes: int | None = None,
        consume: bool = False,
        progress: bool | None = False,
    ) -> Handle:
        """Copy a state dict into shareable segments, publish it under ``fingerprint`` and return the
        attached Handle (its tensors map the published segments, not ``tensors``).

        The tensors may live on any device; they are copied to the fingerprint's placement. If the keeper
        already holds this fingerprint (another process won a race), the existing entry is attached instead.
        Raises UnsupportedQuantError for a refused method, before anything is copied. The arguments are
        :func:`weightcache.publish.pack_state`'s.
        """
        quant_registry.get(fingerprint.quant).check()
        from .publish import pack_state

        packed = pack_state(
            fingerprint,
            tensors,
            digests=digests,
            max_segment_bytes=max_segment_bytes,
            consume=consume,
            progress=progress,
        )
        try:
            return self.publish(packed)
        finally:
            packed.close()

    def put_checkpoint(
        self, fingerprint: Fingerprint, layout: list[StoredTensor], *, progress: bool | None = False
    ) -> Handle:
        """Publish a safetensors checkpoint as stored, streamed straight into GPU segments (see
        :func:`weightcache.publish.pack_checkpoint`), and return the attached Handle."""
        quant_registry.get(fingerprint.quant).check()
        from .publish import pack_checkpoint

        packed = pack_checkpoint(fingerprint, layout, progress=progress)
        try:
            return self.publish(packed)
        finally:
            packed.close()

    def publish(self, packed: Packed) -> Handle:
        """Hand packed segments to the keeper and return the attached Handle.

        On success the segments' fds belong to the Handle (``packed`` is spent). On failure (BudgetExceeded,
        KeeperUnavailable, ...) ``packed`` is left as it was: its caller may still serve it locally
        (:meth:`Packed.local_tensors`) or close it.
        """
        manifest = packed.manifest
        conn = self._connect()
        try:
            reply = conn.publish(manifest.to_json(), packed.fds())
        except BaseException:
            conn.close()
            raise
        if not reply.created:
            # Someone published the same fingerprint first: use theirs, drop ours.
            conn.close()
            packed.close()
            handle = self.get(packed.fingerprint)
            if handle is None:
                raise KeeperError("the keeper reported the entry as existing, then could not find it", "race")
            handle.resident_before = False  # published while this call packed its own
            return handle
        fds = packed.detach_fds()  # the handle owns them from here
        try:
            views = map_entry(manifest, fds)
        except BaseException:
            close_fds(fds)
            conn.close()
            raise
        handle = self._attached(manifest, views, conn, fds, os.getuid())
        handle.evicted = reply.evicted
        handle.resident_before = False  # this call published it
        return handle


__all__ = ["Cache"]

"""The keeper's entry store: what it holds, who leases what, and what a memory budget evicts.

An entry is one published model on one placement, keyed ``<digest>@<placement>``: its checked manifest and the
fds of its segments, which the store owns and closes when the entry goes. A lease is held per connection id
(an opaque int the server picks); the server calls :meth:`Store.release` when that connection closes.

Every entry records its publisher (the uid the server saw through ``SO_PEERCRED``). Entries of one digest and
placement from different uids live side by side (keys ``<digest>@<placement>`` for the keeper's owner,
``...~<uid>`` for others): a publish never replaces or shadows another uid's entry, and a ``get`` returns only an
entry whose publisher the asker trusts.

Memory budgets are per placement: a publish that would exceed its placement's budget first evicts its own
publisher's unleased entries there, least recently used first, and is refused (``over_budget``) if even that
cannot make room; the owner's entries and leased ones are never evicted for another uid's publish. Members (uids
other than the owner) together hold at most ``1 - member_share`` of a budget, each at most its part of that
(``member_share``, and never more than the pool over the number of members holding there): a member under its part
evicts unleased entries of the members furthest over theirs, so no members can starve another.
The segment fds held are capped too
(``max_fds``), so that publishers cannot take the keeper to its open-file limit, and shared out per uid
(:class:`~weightcache.protocol.Shares`): another uid than the owner may hold at most ``member_share`` of them,
and all other uids together at most the rest, so that no member's entries can keep the owner from publishing.
Evicting only closes the store's fds; memory that clients map stays valid until they let go.

The store's second kind of entry is an **artifact** (:class:`Artifact`): an opaque blob in one sealed memfd that
an engine compiled for a set of weights (keys ``<weights digest>/<artifact key digest>``, ``~<uid>`` for other
publishers). The store checks the memfd's kind, size and seals, and never reads it. Artifacts follow the rules of
entries: leases per connection, the publisher's uid and trust, and the ``cpu`` budget (a memfd is host memory),
where both kinds are evicted together, least recently used first.

The values it holds (entries, artifacts, leases, what a get hands back) are :mod:`weightcache.keeper.held`'s;
the choice of what a budget evicts for a publish is :mod:`weightcache.keeper.room`'s (both re-exported here).

What this module must never do: open sockets, start threads, or touch process state (signals, files, the
socket directory). It takes plain values, returns plain values or raises
:class:`~weightcache.messages.RequestError` with a code, and is thread-safe through its own lock.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .. import fdcheck, messages
from ..artifact_key import ArtifactKey, artifact_entry_key, artifact_matches
from ..budget import Budget
from ..manifest import Manifest, SegmentInfo
from ..messages import (
    ArtifactInfo,
    InspectReply,
    PublishReply,
    PutArtifactReply,
    RequestError,
    entry_key,
)
from ..protocol import MAX_FDS as MAX_FRAME_FDS
from ..protocol import Shares, close_fds
from . import room
from .held import (
    ARTIFACT_PLACEMENT as ARTIFACT_PLACEMENT,
)
from .held import (
    Artifact as Artifact,
)
from .held import (
    ArtifactCheckout as ArtifactCheckout,
)
from .held import (
    Checkout as Checkout,
)
from .held import (
    Entry as Entry,
)
from .held import (
    Held as Held,
)
from .held import (
    Lease as Lease,
)
from .held import (
    Snapshot as Snapshot,
)

log = logging.getLogger("weightcache.keeper")


#: Default cap on the segment fds all entries together may hold.
MAX_FDS = 65536
#: Default share of the keeper's resources that one uid other than the owner may hold.
MEMBER_SHARE = 0.25


class Store:
    """Entries, leases and the budget. ``owner`` is the keeper's uid (its entries' keys carry no uid);
    ``max_fds`` caps the segment fds held, of which another uid may hold ``member_share``; ``clock`` gives the time
    that LRU order and ages are measured in."""

    def __init__(
        self,
        budget: Budget | None = None,
        *,
        owner: int | None = None,
        max_fds: int = MAX_FDS,
        member_share: float = MEMBER_SHARE,
        clock: Callable[[], float] = time.time,
    ) -> None:
        self.budget = budget or Budget()
        self.owner = os.getuid() if owner is None else owner
        self.member_share = member_share
        self._clock = clock
        self._entries: dict[str, Entry] = {}
        self._fds = Shares(max_fds, owner=self.owner, fraction=member_share, floor=MAX_FRAME_FDS)
        self._artifacts: dict[str, Artifact] = {}
        self._lock = threading.Lock()

    @property
    def max_fds(self) -> int:
        """The cap on the segment fds all entries hold (set it before anything is published)."""
        return self._fds.total

    @max_fds.setter
    def max_fds(self, value: int) -> None:
        self._fds = Shares(value, owner=self.owner, fraction=self.member_share, floor=MAX_FRAME_FDS)

    def fds_held(self, uid: int | None = None) -> int:
        """Segment fds the entries of ``uid`` (default: all) hold."""
        return self._fds.used(uid)

    def key(self, digest: str, placement: str, publisher: int) -> str:
        """The key of ``publisher``'s entry for ``digest`` on ``placement``."""
        return entry_key(digest, placement, None if publisher == self.owner else publisher)

    def __len__(self) -> int:
        with self._lock:
            return len(self._entries)

    def keys(self) -> list[str]:
        with self._lock:
            return list(self._entries)

    # --- publish and get ---------------------------------------------------------------------------------------

    def publish(
        self, conn: int, pid: int, manifest_json: dict[str, Any], fds: Sequence[int], *, uid: int | None = None
    ) -> PublishReply:
        """Check ``manifest_json`` and ``fds`` (one per segment) and hold them as an entry of publisher ``uid``
        (default: the owner) leased by ``conn``.

        The store owns ``fds`` from here on, whatever happens: it keeps them, or closes them when the entry
        already exists (``conn`` then leases that one) or the publish is refused.
        """
        try:
            manifest, kept, text = _checked(manifest_json, fds)
            return self._insert(conn, pid, self.owner if uid is None else uid, manifest, kept, text, fds)
        except BaseException:
            close_fds(fds)
            raise

    def _insert(
        self,
        conn: int,
        pid: int,
        uid: int,
        manifest: Manifest,
        manifest_json: dict[str, Any],
        text: str,
        fds: Sequence[int],
    ) -> PublishReply:
        digest, placement = manifest.fingerprint.digest, manifest.fingerprint.placement
        key = self.key(digest, placement, uid)
        now = self._clock()
        evicted: list[Held] = []
        with self._lock:
            existing = self._entries.get(key)
            if existing is not None:
                # Idempotent: the same weights published again by the same uid (a race, or clients re-publishing
                # after a keeper restart) make the publisher a lease holder of the entry that is already there.
                existing.last_used = now
                existing.leases.setdefault(conn, Lease(pid, now))
            else:
                if not self._fds.try_take(uid, len(fds)):
                    raise RequestError(
                        messages.OVER_BUDGET,
                        f"entry {key[:16]}... has {len(fds)} segments, but of the keeper's segment fds "
                        f"{self._fds.describe(uid)} (set by its open-file limit and --member-share). Evict entries "
                        "(`weightcache evict`), or publish with fewer, larger segments.",
                    )
                committed = sum(fdcheck.committed_bytes(fd, info) for fd, info in zip(fds, manifest.segments))
                try:
                    evicted = self._make_room(key, placement, committed, uid)
                except BaseException:
                    self._fds.give(uid, len(fds))
                    raise
                lease = {conn: Lease(pid, now)}
                entry = Entry(digest, uid, key, manifest, manifest_json, text, list(fds), now, now, lease, committed)
                self._entries[key] = entry
        if existing is not None:
            close_fds(fds)
            return PublishReply(digest=digest, key=key, created=False)
        for gone in evicted:
            log.info(
                "evicted %s (%d bytes, unleased, least recently used) to make room for %s", gone.key, gone.size, key
            )
        log.info(
            "published %s (%d bytes, %d tensors) from pid %d uid %d", key, manifest.total_bytes, len(manifest), pid, uid
        )
        return PublishReply(digest=digest, key=key, created=True, evicted=tuple(e.key for e in evicted))

    def _make_room(self, key: str, placement: str, needed: int, uid: int, leaving: Held | None = None) -> list[Held]:
        """Make ``needed`` more bytes fit ``placement``'s budget for a publish of ``uid`` (:func:`room.make_room`
        chooses what goes; ``leaving``, what the publish replaces, counts as gone), evict what it chose and return
        it; ``over_budget`` (nothing evicted) if nothing can. Called with the lock held."""
        limit = self.budget.limit(placement)
        if limit is None:
            return []
        held = [h for h in self._held() if h is not leaving]
        gone = room.make_room(
            held, key, placement, needed, uid, limit, owner=self.owner, member_share=self.member_share
        )
        for e in gone:
            self._drop(e)
        return gone

    def _drop(self, entry: Held, *, keep_fd_share: bool = False) -> None:
        """Forget ``entry`` (or artifact) and close its fds; its share of the segment fds goes back unless
        ``keep_fd_share`` (what replaces it takes that share over). Called with the lock held."""
        if isinstance(entry, Artifact):
            del self._artifacts[entry.key]
        else:
            del self._entries[entry.key]
        if not keep_fd_share:
            self._fds.give(entry.publisher, len(entry.fds))
        entry.close()

    def _held(self) -> list[Held]:
        """Every entry and artifact. Called with the lock held."""
        return [*self._entries.values(), *self._artifacts.values()]

    def get(
        self, conn: int, pid: int, digest: str, placement: str, trust: Sequence[int] | None = None
    ) -> Checkout | None:
        """The entry for ``digest`` on ``placement`` of the first publisher in ``trust`` (default: the owner only)
        that has one, leased by ``conn``, with dups of its fds; None if no trusted publisher has one (see
        :meth:`publishers`)."""
        with self._lock:
            entry = None
            for uid in (self.owner,) if trust is None else trust:
                entry = self._entries.get(self.key(digest, placement, uid))
                if entry is not None:
                    break
            if entry is None:
                return None
            now = self._clock()
            entry.last_used = now
            fresh = conn not in entry.leases
            entry.leases.setdefault(conn, Lease(pid, now))
            # dup under the lock: an evict racing with this get cannot close the fds we are about to hand out.
            out: list[int] = []
            try:
                for fd in entry.fds:
                    out.append(os.dup(fd))
            except OSError as exc:
                close_fds(out)
                if fresh:
                    entry.leases.pop(conn, None)
                raise RequestError(messages.BUSY, f"keeper is out of file descriptors ({exc}); retry later") from exc
            return Checkout(entry.key, entry.publisher, entry.manifest_text, out, fresh)

    def unlease(self, conn: int, key: str) -> None:
        """Drop ``conn``'s lease on entry or artifact ``key`` (a get whose reply could not be sent after all)."""
        with self._lock:
            held = self._entries.get(key) or self._artifacts.get(key)
            if held is not None:
                held.leases.pop(conn, None)

    def holds(self, conn: int) -> bool:
        """Whether ``conn`` leases any entry or artifact (the server never drops such a connection as idle)."""
        with self._lock:
            return any(conn in e.leases for e in self._held())

    def publishers(self, digest: str, placement: str) -> list[int]:
        """The uids that hold an entry for ``digest`` on ``placement``."""
        with self._lock:
            return sorted(
                e.publisher for e in self._entries.values() if e.digest == digest and e.placement == placement
            )

    def release(self, conn: int) -> None:
        """Drop every lease ``conn`` holds (its connection closed)."""
        with self._lock:
            ended = self._clock()
            for entry in self._held():
                if entry.leases.pop(conn, None) is not None:
                    entry.last_used = ended  # held until now: recently used, for the LRU order

    # --- artifacts ----------------------------------------------------------------------------------------------

    def artifact_key(self, weights: str, key: ArtifactKey, publisher: int) -> str:
        """The key of ``publisher``'s artifact for ``weights`` and ``key``."""
        return artifact_entry_key(weights, key.digest, None if publisher == self.owner else publisher)

    def put_artifact(
        self,
        conn: int,
        pid: int,
        weights: str,
        key: ArtifactKey,
        size: int,
        sha256: str,
        fd: int,
        *,
        uid: int | None = None,
        replace: str | None = None,
    ) -> PutArtifactReply:
        """Hold the sealed memfd ``fd`` (``size`` bytes, checked; never read) as publisher ``uid``'s artifact of
        ``weights`` for ``key``, leased by ``conn``.

        If that publisher already holds one: with ``replace`` equal to its SHA-256, the new one takes its place
        (its leases end); otherwise ``conn`` leases the existing one and ``fd`` is closed. The store owns ``fd``
        from here on, whatever happens.
        """
        uid = self.owner if uid is None else uid
        try:
            fdcheck.verify_memfd(fd, SegmentInfo(kind="memfd", size=size, placement=ARTIFACT_PLACEMENT))
            return self._insert_artifact(conn, pid, uid, weights, key, size, sha256, fd, replace)
        except BaseException:
            close_fds([fd])
            raise

    def _insert_artifact(
        self,
        conn: int,
        pid: int,
        uid: int,
        weights: str,
        key: ArtifactKey,
        size: int,
        sha256: str,
        fd: int,
        replace: str | None,
    ) -> PutArtifactReply:
        name = self.artifact_key(weights, key, uid)
        now = self._clock()
        evicted: list[Held] = []
        replaced: Artifact | None = None
        with self._lock:
            existing = self._artifacts.get(name)
            if existing is not None and replace is not None and existing.sha256 == replace:
                replaced, existing = existing, None  # dropped once its replacement is sure to fit
            if existing is not None:
                # Idempotent, as for entries: the same artifact published again (a race, or a re-publication after
                # a keeper restart) makes the publisher a lease holder of the one already here.
                existing.last_used = now
                existing.leases.setdefault(conn, Lease(pid, now))
            else:
                if replaced is None and not self._fds.try_take(uid, 1):
                    raise RequestError(
                        messages.OVER_BUDGET,
                        f"artifact {name[:16]}... needs one fd, but of the keeper's segment fds "
                        f"{self._fds.describe(uid)} (set by its open-file limit and --member-share). Evict entries "
                        "(`weightcache evict`).",
                    )
                info = SegmentInfo(kind="memfd", size=size, placement=ARTIFACT_PLACEMENT)
                committed = fdcheck.committed_bytes(fd, info)
                try:
                    evicted = self._make_room(name, ARTIFACT_PLACEMENT, committed, uid, leaving=replaced)
                except BaseException:
                    if replaced is None:
                        self._fds.give(uid, 1)
                    raise  # a refused replacement leaves the artifact it would have replaced as it was
                if replaced is not None:
                    self._drop(replaced, keep_fd_share=True)  # its fd's share goes to the new one
                lease = {conn: Lease(pid, now)}
                artifact = Artifact(weights, key, uid, name, size, sha256, fd, now, now, lease, committed)
                self._artifacts[name] = artifact
        if existing is not None:
            close_fds([fd])
            return PutArtifactReply(key=name, created=False)
        for e in evicted:
            log.info("evicted %s (%d bytes, unleased, least recently used) to make room for %s", e.key, e.size, name)
        log.info(
            "%s artifact %s (%s, %d bytes) from pid %d uid %d",
            "replaced" if replaced is not None else "published",
            name,
            key.kind,
            size,
            pid,
            uid,
        )
        return PutArtifactReply(
            key=name, created=True, replaced=replaced is not None, evicted=tuple(e.key for e in evicted)
        )

    def get_artifact(
        self,
        conn: int,
        pid: int,
        weights: str,
        key: ArtifactKey,
        trust: Sequence[int] | None = None,
        uid: int | None = None,
    ) -> ArtifactCheckout | None:
        """The artifact of ``weights`` for ``key`` of the first publisher in ``trust`` (default: the owner only)
        that has one, with a dup of its memfd; None if no trusted publisher has one. ``conn`` (of ``uid``) leases
        it only if ``uid`` published it (or ``uid`` is None): an artifact is compiled code that only its
        publisher's processes load, so another uid's lease would pin memory for nothing and keep its publisher
        from evicting it."""
        with self._lock:
            found = None
            for uid in (self.owner,) if trust is None else trust:
                found = self._artifacts.get(self.artifact_key(weights, key, uid))
                if found is not None:
                    break
            if found is None:
                return None
            now = self._clock()
            found.last_used = now
            lease = uid is None or uid == found.publisher
            fresh = lease and conn not in found.leases
            if lease:
                found.leases.setdefault(conn, Lease(pid, now))
            try:
                fd = os.dup(found.fd)  # under the lock: an evict racing with this get cannot close it first
            except OSError as exc:
                if fresh:
                    found.leases.pop(conn, None)
                raise RequestError(messages.BUSY, f"keeper is out of file descriptors ({exc}); retry later") from exc
            return ArtifactCheckout(found.info(now), fd, fresh)

    def artifact_misses(
        self, weights: str, key: ArtifactKey, trust: Sequence[int], limit: int
    ) -> tuple[list[int], list[ArtifactKey]]:
        """For a ``get_artifact`` that found nothing: the untrusted uids holding this artifact, and the keys of up
        to ``limit`` trusted artifacts of the same weights and kind (most recently used first)."""
        digest = key.digest
        with self._lock:
            same = [a for a in self._artifacts.values() if a.weights == weights and a.artifact_key.kind == key.kind]
        others = sorted({a.publisher for a in same if a.artifact_key.digest == digest and a.publisher not in trust})
        near = [a for a in same if a.publisher in trust and a.artifact_key.digest != digest]
        near.sort(key=lambda a: a.last_used, reverse=True)
        return others, [a.artifact_key for a in near[:limit]]

    def artifacts(
        self, weights: str | None = None, limit: int | None = None, after: str | None = None
    ) -> tuple[list[ArtifactInfo], bool]:
        """The artifacts (those whose weights digest starts with ``weights``): without ``after``, most recently
        used first; with ``after``, in key order from the first key past it (a page, as ``list_artifacts`` pages).
        At most ``limit``; and whether more matched."""
        with self._lock:
            now = self._clock()
            found = [a for a in self._artifacts.values() if weights is None or a.weights.startswith(weights)]
            if after is None:
                found.sort(key=lambda a: a.last_used, reverse=True)
            else:
                found = sorted((a for a in found if a.key > after), key=lambda a: a.key)
            shown = found if limit is None else found[:limit]
            return [a.info(now) for a in shown], len(shown) < len(found)

    # --- list, inspect, evict ----------------------------------------------------------------------------------

    def snapshot(self, after: str | None = None, limit: int = 1024, keys_per_conn: int = 16) -> Snapshot:
        """At most ``limit`` entries, in key order, whose keys follow ``after`` (None: from the first); the leases
        of every connection (at most ``keys_per_conn`` keys each, and their count); the bytes per placement.
        What it costs is proportional to the page, not to everything held."""
        with self._lock:
            now = self._clock()
            held: dict[int, list[str]] = {}
            counts: dict[int, int] = {}
            used: dict[str, int] = {}
            for e in self._held():
                for conn in e.leases:
                    counts[conn] = counts.get(conn, 0) + 1
                    keys = held.setdefault(conn, [])
                    if len(keys) < keys_per_conn:
                        keys.append(e.key)
                used[e.placement] = used.get(e.placement, 0) + e.charge  # what counts against the budget
            keys = sorted(k for k in self._entries if after is None or k > after)
            entries = tuple(self._entries[k].info(now) for k in keys[:limit])
        leases = {conn: (tuple(keys_), counts[conn]) for conn, keys_ in held.items()}
        return Snapshot(entries, len(keys) > limit, leases, used)

    def inspect(self, prefix: str) -> InspectReply:
        """The one entry ``prefix`` names (a key, a digest, or a prefix of either), with its manifest."""
        with self._lock:
            found = self._match(prefix)
            if len(found) != 1:
                raise _unmatched(prefix, found)
            entry = found[0]
            return InspectReply(entry=entry.info(self._clock()), manifest=entry.manifest_json)

    def evict(self, prefix: str, *, force: bool = False, every: bool = False) -> list[str]:
        """Drop the entry ``prefix`` names, or with ``every`` all it matches (``"*"``: all, none included);
        return their keys.

        Artifacts are matched too: by their key (``<weights>/<key digest>``), a prefix of it, or prefixes of both
        halves (``3f9a0c1e2b7d/9e1f2a3b4c5d``, as ``weightcache ls`` shows them). A prefix that
        matches weight entries names those alone, unless ``every``, which takes the artifacts of the same prefix
        with them. Refuses (``leased``) if any of them is leased, unless ``force``; then nothing is evicted.
        """
        with self._lock:
            everything = every and prefix == messages.EVERY_ENTRY
            found = self._held() if everything else self._match_held(prefix, every)
            if (not found and not everything) or (len(found) > 1 and not every):
                raise _unmatched(prefix, found)
            leased = [e for e in found if e.leases]
            if leased and not force:
                pids = sorted({str(lease.pid) for e in leased for lease in e.leases.values()})
                one = len(leased) == 1
                raise RequestError(
                    messages.LEASED,
                    f"entr{'y' if one else 'ies'} {', '.join(e.key[:16] for e in leased)} {'is' if one else 'are'} "
                    f"leased by pid {', '.join(pids)}; evict anyway with force=True (CLI: --force; memory stays "
                    "mapped in those processes until they exit)",
                )
            for e in found:
                self._drop(e)
        return [e.key for e in found]

    def _match_held(self, prefix: str, every: bool) -> list[Held]:
        """The entries ``prefix`` names (see :meth:`_match`), then, with ``every`` or when it names none, the
        artifacts whose key starts with it. Called with the lock held."""
        entries: list[Held] = list(self._match(prefix))
        if entries and not every:
            return entries
        if prefix in self._artifacts:
            return [*entries, self._artifacts[prefix]]
        return [*entries, *(a for k, a in self._artifacts.items() if artifact_matches(k, prefix))]

    def _match(self, prefix: str) -> list[Entry]:
        if not prefix:
            raise RequestError(messages.BAD_REQUEST, "empty digest")
        if prefix in self._entries:  # a full key names exactly one entry
            return [self._entries[prefix]]
        return [e for k, e in self._entries.items() if k.startswith(prefix) or e.digest.startswith(prefix)]

    def close(self) -> None:
        """Drop every entry, closing its fds."""
        with self._lock:
            for held in self._held():
                held.close()
            self._entries.clear()
            self._fds = Shares(self.max_fds, owner=self.owner, fraction=self.member_share, floor=MAX_FRAME_FDS)
            self._artifacts.clear()


#: Longest tensor name, and longest per-tensor digest, a manifest may hold (characters).
MAX_NAME_CHARS = 1024
MAX_DIGEST_CHARS = 128


def _checked(manifest_json: dict[str, Any], fds: Sequence[int]) -> tuple[Manifest, dict[str, Any], str]:
    """The parsed manifest, the JSON the store keeps of it and that JSON encoded, once it and ``fds`` are what a
    publish must send.

    What is kept is the manifest re-encoded from what was parsed, not what arrived: fields this keeper does not
    know never reach the clients that ``get`` or ``inspect`` it (another user may have published it).
    """
    manifest = Manifest.from_json(manifest_json)
    manifest.fingerprint.check_bounds()
    longest = max(map(len, manifest.names), default=0)
    digests = max((len(d) for d in manifest.digest if d is not None), default=0)
    if longest > MAX_NAME_CHARS or digests > MAX_DIGEST_CHARS:
        raise RequestError(
            messages.BAD_REQUEST,
            f"manifest holds a tensor name of {longest} characters and a digest of {digests}; at most "
            f"{MAX_NAME_CHARS} and {MAX_DIGEST_CHARS} are allowed",
        )
    manifest_json = manifest.to_json()
    text = json.dumps(manifest_json, separators=(",", ":"), allow_nan=False)
    if len(text) > messages.MAX_MANIFEST_BYTES:
        raise RequestError(
            messages.BAD_REQUEST,
            f"manifest is {len(text)} bytes; at most {messages.MAX_MANIFEST_BYTES} fit in a reply (fewer tensors "
            "per entry)",
        )
    if len(fds) != len(manifest.segments):
        raise RequestError(
            messages.BAD_REQUEST, f"manifest lists {len(manifest.segments)} segments but {len(fds)} fds arrived"
        )
    for fd, info in zip(fds, manifest.segments):
        fdcheck.verify_fd(fd, info)
    return manifest, manifest_json, text


def _unmatched(prefix: str, found: Sequence[Held]) -> RequestError:
    if not found:
        return RequestError(messages.NOT_FOUND, f"no entry matches {prefix!r}; `weightcache ls` lists the entries")
    return RequestError(
        messages.AMBIGUOUS,
        f"ambiguous: {prefix!r} matches {len(found)} entries ({', '.join(e.key[:20] for e in found)}); give more "
        "of the digest (or the full key digest@placement)",
    )

"""The shapes of the weights' ops: ``publish``, ``get``, ``list`` (with :class:`EntryInfo`, public API, and what
it says of the keeper and its clients), ``inspect`` and ``evict``.

Layer L1: never imports torch (the keeper and the CLI use it; tests/test_layers.py checks).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import attrs

from .. import protocol
from ..budget import Budget
from ..errors import ProtocolError
from ..fingerprint import Fingerprint
from ..protocol import field
from .base import EVICT, GET, INSPECT, LIST, PUBLISH, _float, _object, _ok, _strings, _trust, _uids

#: Largest manifest accepted: its get reply (manifest plus a few fields) must still fit in one frame.
MAX_MANIFEST_BYTES = protocol.MAX_PAYLOAD_BYTES - 64 * 1024


# --- publish and get ---------------------------------------------------------------------------------------------


class PublishRequest(NamedTuple):
    """Hand an entry to the keeper: its manifest, with one fd per segment (in manifest order) on the frame."""

    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"op": PUBLISH, "manifest": self.manifest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PublishRequest:
        return cls(manifest=field(data, "manifest", dict))


class PublishReply(NamedTuple):
    """``created`` is False when the keeper already held the entry: the publisher then leases that one."""

    digest: str
    key: str
    created: bool
    #: Keys evicted (unleased, least recently used) to make room; only when created.
    evicted: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "digest": self.digest, "key": self.key, "created": self.created}
        if self.created:
            out["evicted"] = list(self.evicted)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PublishReply:
        _ok(data)
        created = field(data, "created", bool)
        return cls(
            digest=field(data, "digest", str),
            key=field(data, "key", str),
            created=created,
            evicted=_strings(data, "evicted") if created else (),
        )


class GetRequest(NamedTuple):
    """Ask for an entry by digest and placement; when found, its fds (one per segment) ride on the reply.

    ``trust``: the uids whose publications the client accepts, in order of preference. Empty (or absent on the
    wire): the asking peer's own uid, then the keeper's owner.
    """

    digest: str
    placement: str
    trust: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        message: dict[str, Any] = {"op": GET, "digest": self.digest, "placement": self.placement}
        if self.trust:
            message["trust"] = list(self.trust)
        return message

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GetRequest:
        return cls(digest=field(data, "digest", str), placement=field(data, "placement", str), trust=_trust(data))


class GetReply(NamedTuple):
    """A get's answer. When found: the entry's key, manifest and ``publisher`` (the uid that published it, as
    the keeper saw it through SO_PEERCRED); ``others`` lists the uids whose entries of this digest and placement
    were passed over because the request did not trust them."""

    found: bool
    key: str | None = None
    manifest: dict[str, Any] | None = None
    publisher: int | None = None
    others: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        if not self.found:
            return {"ok": True, "found": False, "others": list(self.others)}
        return {"ok": True, "found": True, "key": self.key, "manifest": self.manifest, "publisher": self.publisher}

    @staticmethod
    def encode_found(key: str, manifest_text: str, publisher: int) -> bytes:
        """The found reply's payload around a manifest encoded once at publish: what every get sends."""
        head = f'{{"ok":true,"found":true,"key":{json.dumps(key)},"publisher":{int(publisher)},"manifest":'
        return f"{head}{manifest_text}}}".encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GetReply:
        _ok(data)
        if not field(data, "found", bool):
            return cls(found=False, others=_uids(data, "others"))
        return cls(
            found=True,
            key=field(data, "key", str),
            manifest=field(data, "manifest", dict),
            publisher=field(data, "publisher", int),
        )


# --- list --------------------------------------------------------------------------------------------------------


@attrs.frozen
class EntryInfo:
    """One entry the keeper holds, as ``list`` and ``inspect`` report it (and :meth:`Cache.entries`)."""

    digest: str
    placement: str
    device: str
    model: str
    bytes: int
    tensors: int
    segments: int
    leases: int
    #: ``(pid, since)`` of each lease holder.
    holders: tuple[tuple[int, float], ...]
    created: float
    last_used: float
    age_s: float
    fingerprint: Fingerprint
    tensor_bytes: int
    #: The uid that published it (SO_PEERCRED, as the keeper saw it).
    publisher: int
    #: ``<digest>@<placement>``, with ``~<uid>`` when another uid than the keeper's owner published it.
    key: str

    @property
    def model_path(self) -> str:
        return self.fingerprint.model_path

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "digest": self.digest,
            "placement": self.placement,
            "device": self.device,
            "model": self.model,
            "model_path": self.model_path,
            "bytes": self.bytes,
            "tensor_bytes": self.tensor_bytes,
            "tensors": self.tensors,
            "segments": self.segments,
            "leases": self.leases,
            "holders": [{"pid": pid, "since": since} for pid, since in self.holders],
            "created": self.created,
            "last_used": self.last_used,
            "age_s": self.age_s,
            "publisher": self.publisher,
            "fingerprint": self.fingerprint.to_json(),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EntryInfo:
        holders = []
        for h in field(data, "holders", list):
            if not isinstance(h, dict):
                raise ProtocolError(f"field 'holders' must hold objects; found {h!r:.100}")
            holders.append((field(h, "pid", int), _float(h, "since")))
        return cls(
            digest=field(data, "digest", str),
            placement=field(data, "placement", str),
            device=field(data, "device", str),
            model=field(data, "model", str),
            bytes=field(data, "bytes", int),
            tensors=field(data, "tensors", int),
            segments=field(data, "segments", int),
            leases=field(data, "leases", int),
            holders=tuple(holders),
            created=_float(data, "created"),
            last_used=_float(data, "last_used"),
            age_s=_float(data, "age_s"),
            fingerprint=Fingerprint.from_json(field(data, "fingerprint", dict)),
            tensor_bytes=field(data, "tensor_bytes", int),
            publisher=field(data, "publisher", int),
            key=field(data, "key", str),
        )


#: Most entry keys a ``list`` names per client connection (``leases`` counts them all).
MAX_CLIENT_KEYS = 16


class ClientInfo(NamedTuple):
    """One open connection: the client's pid (SO_PEERCRED), when it connected, the keys of (at most
    :data:`MAX_CLIENT_KEYS` of) the entries it leases, and how many it leases."""

    pid: int
    since: float
    entries: tuple[str, ...]
    #: How many entries it leases (None: as many as ``entries`` names).
    leases: int | None = None

    def to_json(self) -> dict[str, Any]:
        leases = len(self.entries) if self.leases is None else self.leases
        return {"pid": self.pid, "since": self.since, "entries": list(self.entries), "leases": leases}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ClientInfo:
        entries = _strings(data, "entries")
        leases = field(data, "leases", int, optional=True)
        return cls(
            pid=field(data, "pid", int),
            since=_float(data, "since"),
            entries=entries,
            leases=len(entries) if leases is None else leases,
        )


class KeeperInfo(NamedTuple):
    """The keeper itself, as ``list`` reports it."""

    pid: int
    version: str
    protocol: int
    socket_dir: str
    started: float
    uptime_s: float
    connections: int
    budget: Budget
    bytes_by_placement: dict[str, int]

    def to_json(self) -> dict[str, Any]:
        return {
            "pid": self.pid,
            "version": self.version,
            "protocol": self.protocol,
            "socket_dir": self.socket_dir,
            "started": self.started,
            "uptime_s": self.uptime_s,
            "connections": self.connections,
            "budget": self.budget.to_json(),
            "bytes_by_placement": dict(self.bytes_by_placement),
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> KeeperInfo:
        budget = field(data, "budget", dict)
        per = field(budget, "per_placement", dict)
        used = field(data, "bytes_by_placement", dict)
        if not all(isinstance(v, int) for v in (*per.values(), *used.values())):
            raise ProtocolError("fields 'per_placement' and 'bytes_by_placement' must map placements to byte counts")
        return cls(
            pid=field(data, "pid", int),
            version=field(data, "version", str),
            protocol=field(data, "protocol", int),
            socket_dir=field(data, "socket_dir", str),
            started=_float(data, "started"),
            uptime_s=_float(data, "uptime_s"),
            connections=field(data, "connections", int),
            budget=Budget(field(budget, "default", int, optional=True), dict(per)),
            bytes_by_placement=dict(used),
        )


#: Bytes of entries one ``list`` reply carries at most (at least one entry, whatever its size): the rest
#: follows in further pages (``after``).
LIST_PAGE_BYTES = 4 * 1024 * 1024


class ListRequest(NamedTuple):
    """One page of the keeper's entries, in key order: the first (``after`` None), or those after key ``after``
    (the previous reply's ``next``). Only the first page lists the client connections."""

    after: str | None = None

    def to_json(self) -> dict[str, Any]:
        return {"op": LIST} if self.after is None else {"op": LIST, "after": self.after}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ListRequest:
        return cls(after=field(data, "after", str, optional=True))


class ListReply(NamedTuple):
    """One page of ``list``: ``next`` is the key to ask ``after`` for the next page; None on the last."""

    keeper: KeeperInfo
    entries: tuple[EntryInfo, ...]
    clients: tuple[ClientInfo, ...]
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        out = {
            "ok": True,
            "keeper": self.keeper.to_json(),
            "entries": [e.to_json() for e in self.entries],
            "clients": [c.to_json() for c in self.clients],
        }
        if self.next is not None:
            out["next"] = self.next
        return out

    @staticmethod
    def encode(keeper: KeeperInfo, entries: list[str], clients: tuple[ClientInfo, ...], next: str | None) -> bytes:
        """The payload of a reply whose entries are already encoded (the keeper encodes them one at a time, to
        stop at :data:`LIST_PAGE_BYTES`)."""
        head = json.dumps({"ok": True, "keeper": keeper.to_json(), "clients": [c.to_json() for c in clients]})
        tail = "" if next is None else f',"next":{json.dumps(next)}'
        return f'{head[:-1]},"entries":[{",".join(entries)}]{tail}}}'.encode()

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ListReply:
        _ok(data)
        return cls(
            keeper=KeeperInfo.from_json(field(data, "keeper", dict)),
            entries=tuple(EntryInfo.from_json(_object(e, "entries")) for e in field(data, "entries", list)),
            clients=tuple(ClientInfo.from_json(_object(c, "clients")) for c in field(data, "clients", list)),
            next=field(data, "next", str, optional=True),
        )


# --- inspect, evict ----------------------------------------------------------------------------------------------


class InspectRequest(NamedTuple):
    """One entry by key, digest, or a prefix of either that matches exactly one entry."""

    digest: str

    def to_json(self) -> dict[str, Any]:
        return {"op": INSPECT, "digest": self.digest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InspectRequest:
        return cls(digest=field(data, "digest", str))


class InspectReply(NamedTuple):
    entry: EntryInfo
    manifest: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "entry": self.entry.to_json(), "manifest": self.manifest}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> InspectReply:
        _ok(data)
        return cls(entry=EntryInfo.from_json(field(data, "entry", dict)), manifest=field(data, "manifest", dict))


#: The digest that, with ``every``, names every entry.
EVERY_ENTRY = "*"


class EvictRequest(NamedTuple):
    """Drop entries: one (by key, digest or unique prefix), or with ``every`` all the prefix matches (``"*"``:
    all). Leased entries only with ``force``."""

    digest: str
    force: bool = False
    every: bool = False

    def to_json(self) -> dict[str, Any]:
        return {"op": EVICT, "digest": self.digest, "force": self.force, "all": self.every}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvictRequest:
        return cls(
            digest=field(data, "digest", str),
            force=bool(field(data, "force", bool, optional=True)),
            every=bool(field(data, "all", bool, optional=True)),
        )


class EvictReply(NamedTuple):
    evicted: tuple[str, ...]

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "evicted": list(self.evicted)}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> EvictReply:
        _ok(data)
        return cls(evicted=_strings(data, "evicted"))

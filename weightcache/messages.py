"""Every message between clients and the keeper, in one place: the op names, one typed shape per op's request
and reply, the error codes, and the key of an entry. Specified in docs/protocol.md.

Each shape is an immutable typed value with ``to_json()`` (what goes on the wire) and ``from_json()`` (what came
off it, checked field by field: a missing or mistyped field raises :class:`~weightcache.errors.ProtocolError`
naming it). The shapes are NamedTuples, not attrs classes: every attach imports this module, and defining twenty
attrs classes (which compile their methods) took ~6 ms more on a 2-core VM. :class:`EntryInfo` (public API) is
attrs.

Framing (bytes and fds) is :mod:`weightcache.protocol`'s job; what an error code means to a caller is the one
table in :mod:`weightcache.errors`. Layer L1: never imports torch (the keeper and the CLI use it;
tests/test_layers.py checks).
"""

from __future__ import annotations

import json
from typing import Any, NamedTuple

import attrs

from . import protocol
from .artifact_key import MAX_ARTIFACT_BYTES, ArtifactKey, check_sha256, check_weights_digest
from .budget import Budget
from .errors import ProtocolError, WeightCacheError
from .fingerprint import Fingerprint
from .protocol import field

# --- ops ------------------------------------------------------------------------------------------------------

HELLO = "hello"
PUBLISH = "publish"
GET = "get"
LIST = "list"
INSPECT = "inspect"
EVICT = "evict"
STOP = "stop"
PUT_ARTIFACT = "put_artifact"
GET_ARTIFACT = "get_artifact"
LIST_ARTIFACTS = "list_artifacts"
#: Every op a keeper serves, in the order docs/protocol.md lists them.
OPS: tuple[str, ...] = (HELLO, PUBLISH, GET, LIST, INSPECT, EVICT, STOP, PUT_ARTIFACT, GET_ARTIFACT, LIST_ARTIFACTS)
#: The ops that carry fds from client to keeper (one per segment; one memfd for an artifact).
FD_OPS: frozenset[str] = frozenset({PUBLISH, PUT_ARTIFACT})
#: The ops a keeper serves from protocol version 2 on (what a client may ask only once hello negotiated 2).
ARTIFACT_OPS: frozenset[str] = frozenset({PUT_ARTIFACT, GET_ARTIFACT, LIST_ARTIFACTS})
#: What only the keeper's own uid may do (not members of an allowed group).
OWNER_OPS: frozenset[str] = frozenset({EVICT, STOP})

# --- error codes (the "error" field of a failed reply) -----------------------------------------------------------

VERSION = "version"
BAD_FRAME = "bad_frame"
BAD_REQUEST = "bad_request"
FORBIDDEN = "forbidden"
BUSY = "busy"
NOT_FOUND = "not_found"
AMBIGUOUS = "ambiguous"
LEASED = "leased"
OVER_BUDGET = "over_budget"
INTERNAL = "internal"
#: Every code a keeper can answer with, in the order docs/protocol.md lists them.
ERROR_CODES: tuple[str, ...] = (
    VERSION,
    BAD_FRAME,
    BAD_REQUEST,
    FORBIDDEN,
    BUSY,
    NOT_FOUND,
    AMBIGUOUS,
    LEASED,
    OVER_BUDGET,
    INTERNAL,
)

#: Largest manifest accepted: its get reply (manifest plus a few fields) must still fit in one frame.
MAX_MANIFEST_BYTES = protocol.MAX_PAYLOAD_BYTES - 64 * 1024


#: Most uids a ``get`` may name as trusted publishers.
MAX_TRUSTED = 64
#: Most artifacts one ``list_artifacts`` reply carries (it must fit in a frame); ``truncated`` says when more exist.
MAX_LISTED_ARTIFACTS = 1024
#: Most keys of near misses a ``get_artifact`` reply names (artifacts of the same weights and kind, other keys).
MAX_NEAR_KEYS = 8


def entry_key(digest: str, placement: str, publisher: int | None = None) -> str:
    """The key of an entry: ``<digest>@<placement>`` for one the keeper's owner published, and
    ``<digest>@<placement>~<uid>`` for one published by another uid (``publisher``; see docs/protocol.md)."""
    return f"{digest}@{placement}" if publisher is None else f"{digest}@{placement}~{publisher}"


class RequestError(WeightCacheError):
    """A request the keeper refuses: answered with an error reply carrying ``code``; the connection stays open."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    def reply(self) -> ErrorReply:
        return ErrorReply(self.code, str(self))


def _float(data: dict[str, Any], key: str) -> float:
    return float(field(data, key, (int, float)))


def _strings(data: dict[str, Any], key: str) -> tuple[str, ...]:
    values = field(data, key, list)
    if not all(isinstance(v, str) for v in values):
        raise ProtocolError(f"field {key!r} must be a list of strings; found {values!r:.200}")
    return tuple(values)


def _trust(data: dict[str, Any]) -> tuple[int, ...]:
    trust = field(data, "trust", list, optional=True) or []
    if len(trust) > MAX_TRUSTED or not all(isinstance(u, int) and not isinstance(u, bool) and u >= 0 for u in trust):
        raise ProtocolError(f"field 'trust' must list at most {MAX_TRUSTED} uids (non-negative integers)")
    return tuple(trust)


def _uids(data: dict[str, Any], key: str) -> tuple[int, ...]:
    values = field(data, key, list, optional=True) or []
    if not all(isinstance(u, int) and not isinstance(u, bool) for u in values):
        raise ProtocolError(f"field {key!r} must list uids")
    return tuple(values)


def _ok(data: dict[str, Any]) -> None:
    if data.get("ok") is not True:
        raise ProtocolError(f'expected a successful reply ("ok": true); found {data!r:.200}')


# --- hello -----------------------------------------------------------------------------------------------------


class HelloRequest(NamedTuple):
    """The first message on every connection: the protocol versions the client speaks."""

    protocol: int
    min_protocol: int | None = None
    client_version: str | None = None
    pid: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": HELLO, "protocol": self.protocol}
        for key in ("min_protocol", "client_version", "pid"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HelloRequest:
        return cls(
            protocol=field(data, "protocol", int),
            min_protocol=field(data, "min_protocol", int, optional=True),
            client_version=field(data, "client_version", str, optional=True),
            pid=field(data, "pid", int, optional=True),
        )


class HelloReply(NamedTuple):
    protocol: int
    keeper_version: str
    pid: int
    uid: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, **self._asdict()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> HelloReply:
        _ok(data)
        return cls(
            protocol=field(data, "protocol", int),
            keeper_version=field(data, "keeper_version", str),
            pid=field(data, "pid", int),
            uid=field(data, "uid", int),
        )


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


def _object(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"field {key!r} must hold objects; found {type(value).__name__}")
    return value


# --- inspect, evict, stop ----------------------------------------------------------------------------------------


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


class StopRequest(NamedTuple):
    def to_json(self) -> dict[str, Any]:
        return {"op": STOP}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StopRequest:
        return cls()


class StopReply(NamedTuple):
    """The keeper's pid; it exits after sending this."""

    pid: int

    def to_json(self) -> dict[str, Any]:
        return {"ok": True, "pid": self.pid}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> StopReply:
        _ok(data)
        return cls(pid=field(data, "pid", int))


# --- artifacts (protocol 2) -------------------------------------------------------------------------------------


@attrs.frozen
class ArtifactInfo:
    """One compiled artifact the keeper holds, as ``list_artifacts`` and ``get_artifact`` report it (and
    :meth:`Cache.artifacts`): an opaque blob of ``bytes`` for the weights ``weights``, compiled for ``artifact_key``."""

    #: ``<weights>/<key digest>``, with ``~<uid>`` when another uid than the keeper's owner published it.
    key: str
    #: The digest of the weights' fingerprint the artifact belongs to.
    weights: str
    artifact_key: ArtifactKey
    bytes: int
    #: SHA-256 of the blob, as its publisher recorded it; a reader checks the bytes against it.
    sha256: str
    #: The uid that published it (SO_PEERCRED, as the keeper saw it).
    publisher: int
    leases: int
    #: ``(pid, since)`` of each lease holder.
    holders: tuple[tuple[int, float], ...]
    created: float
    last_used: float
    age_s: float

    @property
    def kind(self) -> str:
        return self.artifact_key.kind

    @property
    def key_digest(self) -> str:
        return self.artifact_key.digest

    def to_json(self) -> dict[str, Any]:
        return {
            "key": self.key,
            "weights": self.weights,
            "kind": self.kind,
            "artifact_key": self.artifact_key.to_json(),
            "bytes": self.bytes,
            "sha256": self.sha256,
            "publisher": self.publisher,
            "leases": self.leases,
            "holders": [{"pid": pid, "since": since} for pid, since in self.holders],
            "created": self.created,
            "last_used": self.last_used,
            "age_s": self.age_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ArtifactInfo:
        holders = []
        for h in field(data, "holders", list):
            if not isinstance(h, dict):
                raise ProtocolError(f"field 'holders' must hold objects; found {h!r:.100}")
            holders.append((field(h, "pid", int), _float(h, "since")))
        return cls(
            key=field(data, "key", str),
            weights=check_weights_digest(field(data, "weights", str)),
            artifact_key=ArtifactKey.from_json(field(data, "artifact_key", dict)),
            bytes=field(data, "bytes", int),
            sha256=check_sha256(field(data, "sha256", str)),
            publisher=field(data, "publisher", int),
            leases=field(data, "leases", int),
            holders=tuple(holders),
            created=_float(data, "created"),
            last_used=_float(data, "last_used"),
            age_s=_float(data, "age_s"),
        )


def _size(data: dict[str, Any]) -> int:
    size: int = field(data, "size", int)
    if not 0 <= size <= MAX_ARTIFACT_BYTES:
        raise ProtocolError(f"field 'size' must be 0..{MAX_ARTIFACT_BYTES} bytes; found {size}")
    return size


class PutArtifactRequest(NamedTuple):
    """Hand an artifact to the keeper: one sealed memfd of exactly ``size`` bytes rides on the frame.

    ``replace``: the SHA-256 of an artifact of the same weights and key (and publisher) that the client found
    corrupt or outdated; the keeper replaces that one only if it still holds exactly it. Without ``replace``, a
    publish of an artifact the keeper already holds makes the publisher a lease holder of that one.
    """

    weights: str
    key: ArtifactKey
    size: int
    sha256: str
    replace: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "op": PUT_ARTIFACT,
            "weights": self.weights,
            "key": self.key.to_json(),
            "size": self.size,
            "sha256": self.sha256,
        }
        if self.replace is not None:
            out["replace"] = self.replace
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PutArtifactRequest:
        replace = field(data, "replace", str, optional=True)
        return cls(
            weights=check_weights_digest(field(data, "weights", str)),
            key=ArtifactKey.from_json(field(data, "key", dict)),
            size=_size(data),
            sha256=check_sha256(field(data, "sha256", str)),
            replace=None if replace is None else check_sha256(replace),
        )


class PutArtifactReply(NamedTuple):
    """``created`` is False when the keeper already held the artifact (the publisher then leases that one);
    ``replaced`` when it replaced the one named by ``replace``."""

    key: str
    created: bool
    replaced: bool = False
    #: Keys evicted (unleased, least recently used) to make room; only when created.
    evicted: tuple[str, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"ok": True, "key": self.key, "created": self.created, "replaced": self.replaced}
        if self.created:
            out["evicted"] = list(self.evicted)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> PutArtifactReply:
        _ok(data)
        created = field(data, "created", bool)
        return cls(
            key=field(data, "key", str),
            created=created,
            replaced=bool(field(data, "replaced", bool, optional=True)),
            evicted=_strings(data, "evicted") if created else (),
        )


class GetArtifactRequest(NamedTuple):
    """Ask for the artifact of ``weights`` compiled for ``key``; when found, its memfd rides on the reply.
    ``trust`` as for :class:`GetRequest`."""

    weights: str
    key: ArtifactKey
    trust: tuple[int, ...] = ()

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": GET_ARTIFACT, "weights": self.weights, "key": self.key.to_json()}
        if self.trust:
            out["trust"] = list(self.trust)
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GetArtifactRequest:
        return cls(
            weights=check_weights_digest(field(data, "weights", str)),
            key=ArtifactKey.from_json(field(data, "key", dict)),
            trust=_trust(data),
        )


class GetArtifactReply(NamedTuple):
    """A ``get_artifact``'s answer. When found: the artifact (one fd on the frame). When not: ``others``, the uids
    whose artifact of this weights and key the request did not trust, and ``near``, the keys of up to
    :data:`MAX_NEAR_KEYS` trusted artifacts of the same weights and kind compiled for other keys (so that a miss
    can say which fields differ)."""

    found: bool
    artifact: ArtifactInfo | None = None
    others: tuple[int, ...] = ()
    near: tuple[ArtifactKey, ...] = ()

    def to_json(self) -> dict[str, Any]:
        if not self.found or self.artifact is None:
            return {"ok": True, "found": False, "others": list(self.others), "near": [k.to_json() for k in self.near]}
        return {"ok": True, "found": True, "artifact": self.artifact.to_json()}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> GetArtifactReply:
        _ok(data)
        if not field(data, "found", bool):
            near = field(data, "near", list, optional=True) or []
            return cls(
                found=False,
                others=_uids(data, "others"),
                near=tuple(ArtifactKey.from_json(k) for k in near[:MAX_NEAR_KEYS]),
            )
        return cls(found=True, artifact=ArtifactInfo.from_json(field(data, "artifact", dict)))


class ListArtifactsRequest(NamedTuple):
    """The artifacts the keeper holds; with ``weights``, only those whose weights digest starts with it. The keeper
    answers a page (in key order) of at most :data:`MAX_LISTED_ARTIFACTS`; ``after`` asks for the page that follows
    the key a reply named as ``next``."""

    weights: str | None = None
    after: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"op": LIST_ARTIFACTS}
        if self.weights is not None:
            out["weights"] = self.weights
        if self.after is not None:
            out["after"] = self.after
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ListArtifactsRequest:
        return cls(
            weights=field(data, "weights", str, optional=True),
            after=field(data, "after", str, optional=True),
        )


class ListArtifactsReply(NamedTuple):
    """One page of at most :data:`MAX_LISTED_ARTIFACTS` artifacts in key order; ``next`` (and ``truncated``) when
    more follow: ask again with ``after=next``. :meth:`~weightcache.client.KeeperConnection.list_artifacts` asks
    for every page and gives them most recently used first."""

    artifacts: tuple[ArtifactInfo, ...]
    truncated: bool = False
    next: str | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "ok": True,
            "artifacts": [a.to_json() for a in self.artifacts],
            "truncated": self.truncated,
        }
        if self.next is not None:
            out["next"] = self.next
        return out

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ListArtifactsReply:
        _ok(data)
        return cls(
            artifacts=tuple(ArtifactInfo.from_json(_object(a, "artifacts")) for a in field(data, "artifacts", list)),
            truncated=bool(field(data, "truncated", bool, optional=True)),
            next=field(data, "next", str, optional=True),
        )


# --- errors ------------------------------------------------------------------------------------------------------


#: Longest error message a client takes from a reply, in characters (the rest is cut).
MAX_ERROR_CHARS = 2000


class ErrorReply(NamedTuple):
    """A failed request: ``error`` is one of :data:`ERROR_CODES`; ``message`` says what to do."""

    error: str
    message: str

    def to_json(self) -> dict[str, Any]:
        return {"ok": False, "error": self.error, "message": self.message}

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> ErrorReply:
        if data.get("ok") is not False:
            raise ProtocolError(f'expected a failed reply ("ok": false); found {data!r:.200}')
        message = str(data.get("message", "keeper refused the request"))
        if len(message) > MAX_ERROR_CHARS:  # it may quote what another user published: a hint, not data
            message = f"{message[:MAX_ERROR_CHARS]}... ({len(message)} characters)"
        return cls(error=str(data.get("error"))[:64], message=message)


#: op -> (request shape, reply shape).
SHAPES: dict[str, tuple[type[Any], type[Any]]] = {
    HELLO: (HelloRequest, HelloReply),
    PUBLISH: (PublishRequest, PublishReply),
    GET: (GetRequest, GetReply),
    LIST: (ListRequest, ListReply),
    INSPECT: (InspectRequest, InspectReply),
    EVICT: (EvictRequest, EvictReply),
    STOP: (StopRequest, StopReply),
    PUT_ARTIFACT: (PutArtifactRequest, PutArtifactReply),
    GET_ARTIFACT: (GetArtifactRequest, GetArtifactReply),
    LIST_ARTIFACTS: (ListArtifactsRequest, ListArtifactsReply),
}

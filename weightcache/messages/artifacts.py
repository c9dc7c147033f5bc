"""The shapes of the artifacts' ops (protocol 2): ``put_artifact``, ``get_artifact`` and ``list_artifacts``, with
:class:`ArtifactInfo` (public API).

Layer L1: never imports torch (the keeper and the CLI use it; tests/test_layers.py checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs

from ..artifact_key import MAX_ARTIFACT_BYTES, ArtifactKey, check_sha256, check_weights_digest
from ..errors import ProtocolError
from ..protocol import field
from .base import GET_ARTIFACT, LIST_ARTIFACTS, PUT_ARTIFACT, _float, _object, _ok, _strings, _trust, _uids

#: Most artifacts one ``list_artifacts`` reply carries (it must fit in a frame); ``truncated`` says when more exist.
MAX_LISTED_ARTIFACTS = 1024
#: Most keys of near misses a ``get_artifact`` reply names (artifacts of the same weights and kind, other keys).
MAX_NEAR_KEYS = 8


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

"""Every message between clients and the keeper, in one place: the op names, one typed shape per op's request
and reply, the error codes, and the key of an entry. Specified in docs/protocol.md.

Each shape is an immutable typed value with ``to_json()`` (what goes on the wire) and ``from_json()`` (what came
off it, checked field by field: a missing or mistyped field raises :class:`~weightcache.errors.ProtocolError`
naming it). The shapes are NamedTuples, not attrs classes: every attach imports this module, and defining twenty
attrs classes (which compile their methods) took ~6 ms more on a 2-core VM. :class:`EntryInfo` (public API) is
attrs.

One module per family, re-exported here (import the names from ``weightcache.messages``):

- :mod:`~weightcache.messages.base`: the op names, the error codes, :class:`ErrorReply`, :class:`RequestError`,
  :func:`entry_key`, and the field readers the families share;
- :mod:`~weightcache.messages.session`: ``hello`` and ``stop``;
- :mod:`~weightcache.messages.weights`: ``publish``, ``get``, ``list``, ``inspect``, ``evict``;
- :mod:`~weightcache.messages.artifacts`: ``put_artifact``, ``get_artifact``, ``list_artifacts`` (protocol 2).

Framing (bytes and fds) is :mod:`weightcache.protocol`'s job; what an error code means to a caller is the one
table in :mod:`weightcache.errors`. Layer L1: never imports torch (the keeper and the CLI use it;
tests/test_layers.py checks).
"""

from __future__ import annotations

from typing import Any

from .artifacts import (
    MAX_LISTED_ARTIFACTS,
    MAX_NEAR_KEYS,
    ArtifactInfo,
    GetArtifactReply,
    GetArtifactRequest,
    ListArtifactsReply,
    ListArtifactsRequest,
    PutArtifactReply,
    PutArtifactRequest,
)
from .artifacts import _size as _size
from .base import (
    AMBIGUOUS,
    ARTIFACT_OPS,
    BAD_FRAME,
    BAD_REQUEST,
    BUSY,
    ERROR_CODES,
    EVICT,
    FD_OPS,
    FORBIDDEN,
    GET,
    GET_ARTIFACT,
    HELLO,
    INSPECT,
    INTERNAL,
    LEASED,
    LIST,
    LIST_ARTIFACTS,
    MAX_ERROR_CHARS,
    MAX_TRUSTED,
    NOT_FOUND,
    OPS,
    OVER_BUDGET,
    OWNER_OPS,
    PUBLISH,
    PUT_ARTIFACT,
    STOP,
    VERSION,
    ErrorReply,
    RequestError,
    entry_key,
)
from .base import _float as _float
from .base import _object as _object
from .base import _ok as _ok
from .base import _strings as _strings
from .base import _trust as _trust
from .base import _uids as _uids
from .session import HelloReply, HelloRequest, StopReply, StopRequest
from .weights import (
    EVERY_ENTRY,
    LIST_PAGE_BYTES,
    MAX_CLIENT_KEYS,
    MAX_MANIFEST_BYTES,
    ClientInfo,
    EntryInfo,
    EvictReply,
    EvictRequest,
    GetReply,
    GetRequest,
    InspectReply,
    InspectRequest,
    KeeperInfo,
    ListReply,
    ListRequest,
    PublishReply,
    PublishRequest,
)

# The underscore field readers (``_ok``, ``_strings``, ...) are imported above as ``x as x``: the families share
# them through .base, and they stay importable from here, as from the single module this package was.

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

__all__ = [
    # ops
    "HELLO",
    "PUBLISH",
    "GET",
    "LIST",
    "INSPECT",
    "EVICT",
    "STOP",
    "PUT_ARTIFACT",
    "GET_ARTIFACT",
    "LIST_ARTIFACTS",
    "OPS",
    "FD_OPS",
    "ARTIFACT_OPS",
    "OWNER_OPS",
    # error codes
    "VERSION",
    "BAD_FRAME",
    "BAD_REQUEST",
    "FORBIDDEN",
    "BUSY",
    "NOT_FOUND",
    "AMBIGUOUS",
    "LEASED",
    "OVER_BUDGET",
    "INTERNAL",
    "ERROR_CODES",
    # limits
    "MAX_MANIFEST_BYTES",
    "MAX_TRUSTED",
    "MAX_LISTED_ARTIFACTS",
    "MAX_NEAR_KEYS",
    "MAX_CLIENT_KEYS",
    "LIST_PAGE_BYTES",
    "MAX_ERROR_CHARS",
    # the key of an entry, a refused request
    "entry_key",
    "RequestError",
    "EVERY_ENTRY",
    # shapes
    "HelloRequest",
    "HelloReply",
    "PublishRequest",
    "PublishReply",
    "GetRequest",
    "GetReply",
    "EntryInfo",
    "ClientInfo",
    "KeeperInfo",
    "ListRequest",
    "ListReply",
    "InspectRequest",
    "InspectReply",
    "EvictRequest",
    "EvictReply",
    "StopRequest",
    "StopReply",
    "ArtifactInfo",
    "PutArtifactRequest",
    "PutArtifactReply",
    "GetArtifactRequest",
    "GetArtifactReply",
    "ListArtifactsRequest",
    "ListArtifactsReply",
    "ErrorReply",
    "SHAPES",
]

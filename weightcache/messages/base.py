"""The wire's shared vocabulary: the op names, the error codes, the error reply and :class:`RequestError`, the key
of an entry, and the field readers every family of shapes checks its JSON with (:mod:`weightcache.messages`
re-exports its public names).

The other modules of this package (one per family of ops) import this one and never each other, so no import
circle can form. Layer L1: never imports torch (the keeper and the CLI use it; tests/test_layers.py checks).
"""

from __future__ import annotations

from typing import Any, NamedTuple

from ..errors import ProtocolError, WeightCacheError
from ..protocol import field

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

#: Most uids a ``get`` may name as trusted publishers.
MAX_TRUSTED = 64


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


def _object(value: object, key: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise ProtocolError(f"field {key!r} must hold objects; found {type(value).__name__}")
    return value


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

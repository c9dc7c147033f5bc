"""The key of a compiled artifact: everything that decides whether a blob an engine compiled earlier is valid now.

An artifact entry in the keeper is an opaque byte blob (a torch.compile cache bundle, an engine's compile cache
directory packed as an archive, ...) stored for one set of weights. It is found by two values: the digest of the
weights' :class:`~weightcache.fingerprint.Fingerprint` and an :class:`ArtifactKey`, whose ``fields`` record what
the compiled result depends on (torch and Triton versions, GPU name and compute capability, CUDA version, compile
options, dtype, shapes or the dynamic spec, the engine's own cache key). A key that differs in any field is a
different artifact: a lookup with it misses, and the caller compiles as it would have.

Layer L1: plain values and checks, no torch (the keeper checks keys with them and never reads a blob).
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from typing import Any

import attrs

from .errors import InvalidArgument, InvalidArgumentType, ProtocolError
from .fingerprint import MAX_EXTRA_DEPTH, canonical_json

#: Deepest nesting of a key's fields (the fingerprint's limit on its ``extra``): a key nested ~1,000 deep made the
#: keeper's JSON encoder recurse past Python's limit, an ``internal`` error with a traceback in its log per request.
MAX_KEY_DEPTH = MAX_EXTRA_DEPTH

#: An artifact's kind: a short name of what produced it, e.g. ``"torch.compile"``, ``"vllm.compile_cache"``.
KIND_PATTERN = re.compile(r"[a-z0-9][a-z0-9._-]{0,63}")
#: Largest canonical JSON of a key: requests without fds carry at most 64 KiB, and a key rides in them.
MAX_KEY_BYTES = 16 * 1024
#: Largest blob one artifact may hold.
MAX_ARTIFACT_BYTES = 16 * 2**30
#: A weights digest: what :attr:`Fingerprint.digest` gives (hex SHA-256), or another hex digest of at most 128
#: characters (an engine that keys by its own hash).
WEIGHTS_PATTERN = re.compile(r"[0-9a-f]{8,128}")
#: The SHA-256 of a blob, as recorded at publish and checked on read.
SHA256_PATTERN = re.compile(r"[0-9a-f]{64}")


def _fields(value: Mapping[str, Any]) -> dict[str, Any]:
    if not isinstance(value, Mapping):
        raise InvalidArgumentType(f"artifact key fields must be a mapping of names to JSON values; found {value!r:.80}")
    fields = dict(value)
    depth = nesting(fields, MAX_KEY_DEPTH + 1)
    if depth > MAX_KEY_DEPTH:
        raise InvalidArgument(
            f"artifact key fields nest more than {MAX_KEY_DEPTH} levels deep; flatten them (or hash a deep value "
            "and put the hash in the key)"
        )
    key = _non_str_key(fields)
    if key is not None:  # (JSON would make it a string: two keys equal as JSON, unequal as fields)
        raise InvalidArgumentType(
            f"artifact key fields must have str keys at every level (JSON's object keys); found {key!r:.80} of type "
            f"{type(key).__name__}: name it with a string"
        )
    return fields


def _non_str_key(value: object) -> object | None:
    """The first key of a dict anywhere in ``value`` (dicts, lists, tuples) that is not a str, or None."""
    stack: list[object] = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, dict):
            keys: list[object] = list(item)
            for key in keys:
                if not isinstance(key, str):
                    return key
            stack.extend(item.values())
        elif isinstance(item, (list, tuple)):
            stack.extend(item)
    return None


def nesting(value: object, stop: int) -> int:
    """How deeply ``value`` nests dicts and lists (a dict of scalars is 1), counted without recursion and given up
    at ``stop`` (returned as soon as that depth is reached)."""
    deepest = 0
    stack: list[tuple[object, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: list[object] = list(item.values())
        elif isinstance(item, (list, tuple)):
            children = list(item)
        else:
            continue
        deepest = max(deepest, depth)
        if deepest >= stop:
            return deepest
        stack.extend((child, depth + 1) for child in children)
    return deepest


@attrs.frozen
class ArtifactKey:
    """What an artifact was compiled for, besides the weights.

    Attributes:
        kind: what produced it (``"torch.compile"``); see :data:`KIND_PATTERN`.
        fields: JSON values (str keys) that decide validity: versions, device, options, shapes. Two keys are the
            same artifact exactly when their kinds and fields are equal (compared as canonical JSON).

    Raises InvalidArgument for a kind that does not match :data:`KIND_PATTERN`, fields that are not JSON or nest
    deeper than :data:`MAX_KEY_DEPTH`, or a key larger than :data:`MAX_KEY_BYTES`.
    """

    kind: str
    fields: dict[str, Any] = attrs.field(factory=dict, converter=_fields)

    def __attrs_post_init__(self) -> None:
        if not isinstance(self.kind, str) or not KIND_PATTERN.fullmatch(self.kind):
            raise InvalidArgument(
                f"artifact kind must match {KIND_PATTERN.pattern} (e.g. 'torch.compile'); found {self.kind!r}"
            )
        try:
            text = canonical_json(self.to_json())
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"artifact key fields must be JSON values with str keys (no NaN); found {self.fields!r:.200}: {exc}"
            ) from exc
        if len(text) > MAX_KEY_BYTES:
            raise InvalidArgument(
                f"artifact key is {len(text)} bytes of JSON; at most {MAX_KEY_BYTES} are allowed (hash large values "
                "such as a whole config, and put the hash in the key)"
            )

    def to_json(self) -> dict[str, Any]:
        return {"kind": self.kind, "fields": self.fields}

    @classmethod
    def from_json(cls, data: object) -> ArtifactKey:
        """The key of a JSON object ``{"kind": ..., "fields": {...}}``; ProtocolError naming what is wrong."""
        if not isinstance(data, dict):
            raise ProtocolError(f"an artifact key must be an object; found {type(data).__name__}")
        kind, fields = data.get("kind"), data.get("fields")
        if not isinstance(fields, dict):
            raise ProtocolError(f"an artifact key's 'fields' must be an object; found {type(fields).__name__}")
        try:
            return cls(kind if isinstance(kind, str) else repr(kind), fields)
        except InvalidArgument as exc:
            raise ProtocolError(str(exc)) from None

    @property
    def canonical(self) -> str:
        """The canonical JSON of kind and fields: equal keys give equal text."""
        return canonical_json(self.to_json())

    @property
    def digest(self) -> str:
        """SHA-256 of :attr:`canonical`: what the keeper keys the artifact by (it computes it itself)."""
        return hashlib.sha256(self.canonical.encode()).hexdigest()

    def with_fields(self, **fields: Any) -> ArtifactKey:
        """A copy with ``fields`` added or replaced."""
        return ArtifactKey(self.kind, {**self.fields, **fields})

    def diff(self, other: ArtifactKey) -> list[tuple[str, object, object]]:
        """``(field, ours, theirs)`` for each field that differs (``kind`` included); None for a field one of them
        lacks."""
        out: list[tuple[str, object, object]] = []
        if self.kind != other.kind:
            out.append(("kind", self.kind, other.kind))
        for name in sorted(set(self.fields) | set(other.fields)):
            ours, theirs = self.fields.get(name), other.fields.get(name)
            if canonical_json(ours) != canonical_json(theirs):
                out.append((name, ours, theirs))
        return out


def check_weights_digest(value: object) -> str:
    """``value`` if it is a weights digest (:data:`WEIGHTS_PATTERN`); ProtocolError otherwise."""
    if not isinstance(value, str) or not WEIGHTS_PATTERN.fullmatch(value):
        raise ProtocolError(
            "field 'weights' must be the weights' fingerprint digest (8-128 lower-case hex digits); "
            f"found {value!r:.80}"
        )
    return value


def check_sha256(value: object) -> str:
    """``value`` if it is a hex SHA-256; ProtocolError otherwise."""
    if not isinstance(value, str) or not SHA256_PATTERN.fullmatch(value):
        raise ProtocolError(f"field 'sha256' must be 64 lower-case hex digits; found {value!r:.80}")
    return value


def artifact_entry_key(weights: str, key_digest: str, publisher: int | None = None) -> str:
    """The keeper's key of an artifact: ``<weights digest>/<key digest>``, with ``~<uid>`` when another uid than
    the keeper's owner published it (the same rule as weight entries; see docs/protocol.md)."""
    base = f"{weights}/{key_digest}"
    return base if publisher is None else f"{base}~{publisher}"


def artifact_matches(key: str, prefix: str) -> bool:
    """Whether ``prefix`` names the artifact whose keeper key is ``key``: a prefix of the key, or
    ``<weights prefix>/<key digest prefix>`` with ``~<uid>`` for another uid's (what ``weightcache ls`` shows:
    ``3f9a0c1e2b7d/9e1f2a3b4c5d``, ``3f9a0c1e2b7d/9e1f2a3b4c5d~1001``)."""
    if "/" not in prefix:
        return key.startswith(prefix)
    weights, _, rest = prefix.partition("/")
    theirs, _, their_rest = key.partition("/")
    if "~" in rest:  # a short digest and a publisher: the publisher must be the same
        digest, _, uid = rest.partition("~")
        their_digest, _, their_uid = their_rest.partition("~")
        return theirs.startswith(weights) and their_digest.startswith(digest) and their_uid == uid
    return theirs.startswith(weights) and their_rest.startswith(rest)


__all__ = [
    "KIND_PATTERN",
    "MAX_ARTIFACT_BYTES",
    "MAX_KEY_BYTES",
    "MAX_KEY_DEPTH",
    "ArtifactKey",
    "artifact_entry_key",
    "artifact_matches",
    "check_sha256",
    "check_weights_digest",
    "nesting",
]

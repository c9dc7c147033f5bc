"""The manifest: what an entry holds and where each tensor lives inside its segments.

JSON, never pickle. Tensors are stored column-wise (one list per field), which keeps a manifest of thousands of
tensors small and fast to parse. :meth:`Manifest.from_json` checks every field and that every tensor lies
inside its segment, because manifests arrive over a socket.

Layer L1: must never import torch (the keeper validates manifests; tests/test_layers.py checks).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from typing import Any

import attrs

from .dtypes import DTYPES
from .errors import ManifestError
from .fingerprint import Fingerprint, is_int

MANIFEST_VERSION = 1

TENSOR_KINDS = ("parameter", "buffer", "tensor")
SEGMENT_KINDS = ("memfd", "cuda_vmm")
MAX_TENSORS = 1_000_000
#: Segment sizes are multiples of this (and so of every dtype's size).
SEGMENT_ALIGNMENT = 512
MAX_NDIM = 16


@attrs.frozen
class SegmentInfo:
    """One shareable region: its transport kind, size in bytes and placement (``"cpu"`` or ``"GPU-<uuid>"``)."""

    kind: str
    size: int
    placement: str


@attrs.frozen
class TensorInfo:
    """Where one tensor lives: segment index, byte offset, dtype, shape, stride (in elements)."""

    name: str
    segment: int
    offset: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    kind: str
    requires_grad: bool
    digest: str | None

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize


def extent_bytes(shape: tuple[int, ...] | list[int], stride: tuple[int, ...] | list[int], itemsize: int) -> int:
    """Bytes spanned by a strided tensor from its first element (0 for an empty tensor)."""
    if any(s == 0 for s in shape):
        return 0
    return (1 + sum((n - 1) * st for n, st in zip(shape, stride))) * itemsize


@attrs.frozen
class Manifest:
    """Everything a client needs to rebuild an entry's tensors from its segments' fds."""

    fingerprint: Fingerprint
    segments: tuple[SegmentInfo, ...]
    names: tuple[str, ...]
    segment: tuple[int, ...]
    offset: tuple[int, ...]
    dtype: tuple[str, ...]
    shape: tuple[tuple[int, ...], ...]
    stride: tuple[tuple[int, ...], ...]
    kind: tuple[str, ...]
    requires_grad: tuple[bool, ...]
    digest: tuple[str | None, ...]

    @property
    def total_bytes(self) -> int:
        """Bytes of all segments (what the entry costs in memory)."""
        return sum(s.size for s in self.segments)

    @property
    def tensor_bytes(self) -> int:
        """Bytes of all tensors' data."""
        return sum(math.prod(s) * DTYPES[d].itemsize for s, d in zip(self.shape, self.dtype))

    def __len__(self) -> int:
        return len(self.names)

    def tensors(self) -> Iterator[TensorInfo]:
        for i in range(len(self.names)):
            yield TensorInfo(
                name=self.names[i],
                segment=self.segment[i],
                offset=self.offset[i],
                dtype=self.dtype[i],
                shape=self.shape[i],
                stride=self.stride[i],
                kind=self.kind[i],
                requires_grad=self.requires_grad[i],
                digest=self.digest[i],
            )

    @classmethod
    def build(cls, fingerprint: Fingerprint, segments: list[SegmentInfo], tensors: list[TensorInfo]) -> Manifest:
        return cls(
            fingerprint=fingerprint,
            segments=tuple(segments),
            names=tuple(t.name for t in tensors),
            segment=tuple(t.segment for t in tensors),
            offset=tuple(t.offset for t in tensors),
            dtype=tuple(t.dtype for t in tensors),
            shape=tuple(t.shape for t in tensors),
            stride=tuple(t.stride for t in tensors),
            kind=tuple(t.kind for t in tensors),
            requires_grad=tuple(t.requires_grad for t in tensors),
            digest=tuple(t.digest for t in tensors),
        )

    def to_json(self) -> dict[str, Any]:
        return {
            "version": MANIFEST_VERSION,
            "fingerprint": self.fingerprint.to_json(),
            "segments": [attrs.asdict(s) for s in self.segments],
            "tensors": {
                "name": list(self.names),
                "segment": list(self.segment),
                "offset": list(self.offset),
                "dtype": list(self.dtype),
                "shape": [list(s) for s in self.shape],
                "stride": [list(s) for s in self.stride],
                "kind": list(self.kind),
                "requires_grad": list(self.requires_grad),
                "digest": list(self.digest),
            },
        }

    def summary(self) -> dict[str, Any]:
        """Manifest without the per-tensor columns: what ``weightcache ls`` shows."""
        return {
            "fingerprint": self.fingerprint.to_json(),
            "segments": [attrs.asdict(s) for s in self.segments],
            "tensors": len(self.names),
            "bytes": self.total_bytes,
        }

    @classmethod
    def from_keeper(cls, data: object) -> Manifest:
        """Parse a manifest the keeper sent back in a ``get`` reply: the fast path of every attach.

        The keeper checked this manifest field by field when it was published (:meth:`from_json`), and the
        client has checked that the keeper runs as its own user. What is left to check here is done in bulk
        (columns present and of equal length); every tensor's bounds are then checked again by torch when its
        view is cut (``as_strided`` refuses a view outside its storage), so a manifest that does not fit its
        segments still fails cleanly, never reads outside them.
        """
        if not isinstance(data, dict) or data.get("version") != MANIFEST_VERSION:
            raise ManifestError("the keeper sent a manifest this weightcache cannot read; restart the keeper")
        fingerprint = Fingerprint.from_json(data.get("fingerprint"))
        try:
            segments = tuple(
                SegmentInfo(kind=s["kind"], size=s["size"], placement=s["placement"]) for s in data["segments"]
            )
            t = data["tensors"]
            names, shapes, strides = t["name"], t["shape"], t["stride"]
            columns = (
                names,
                t["segment"],
                t["offset"],
                t["dtype"],
                shapes,
                strides,
                t["kind"],
                t["requires_grad"],
                t["digest"],
            )
        except (KeyError, TypeError) as exc:
            raise ManifestError(f"the keeper sent a malformed manifest: missing {exc}") from exc
        if not all(isinstance(c, list) and len(c) == len(names) for c in columns):
            raise ManifestError("the keeper sent a manifest whose tensor columns differ in length")
        return cls(
            fingerprint=fingerprint,
            segments=segments,
            names=tuple(names),
            segment=tuple(t["segment"]),
            offset=tuple(t["offset"]),
            dtype=tuple(t["dtype"]),
            shape=tuple(map(tuple, shapes)),
            stride=tuple(map(tuple, strides)),
            kind=tuple(t["kind"]),
            requires_grad=tuple(t["requires_grad"]),
            digest=tuple(t["digest"]),
        )

    @classmethod
    def from_json(cls, data: object) -> Manifest:
        """Parse and check a manifest read off the wire. Raises :class:`ManifestError` naming the problem."""
        if not isinstance(data, dict):
            raise ManifestError(f"manifest must be a JSON object; found {type(data).__name__}")
        if data.get("version") != MANIFEST_VERSION:
            raise ManifestError(
                f"manifest version {data.get('version')!r}; this weightcache reads version {MANIFEST_VERSION}"
            )
        fingerprint = Fingerprint.from_json(data.get("fingerprint"))
        raw_segments = data.get("segments")
        if not isinstance(raw_segments, list) or not raw_segments:
            raise ManifestError("manifest must list at least one segment")
        segments = []
        for i, s in enumerate(raw_segments):
            if not isinstance(s, dict):
                raise ManifestError(f"segment {i} must be an object; found {type(s).__name__}")
            kind, size, placement = s.get("kind"), s.get("size"), s.get("placement")
            if not isinstance(kind, str) or kind not in SEGMENT_KINDS:
                raise ManifestError(f"segment {i} has kind {kind!r}; expected one of {SEGMENT_KINDS}")
            if not isinstance(size, int) or isinstance(size, bool) or size <= 0 or size % SEGMENT_ALIGNMENT:
                raise ManifestError(
                    f"segment {i} has size {size!r}; expected a positive multiple of {SEGMENT_ALIGNMENT}"
                )
            if placement != fingerprint.placement:
                raise ManifestError(
                    f"segment {i} is placed on {placement!r} but the fingerprint says {fingerprint.placement!r}"
                )
            expected = "memfd" if placement == "cpu" else "cuda_vmm"  # the one transport of each placement
            if kind != expected:
                raise ManifestError(f"segment {i} on {placement!r} has kind {kind!r}; expected {expected!r}")
            segments.append(SegmentInfo(kind=kind, size=size, placement=placement))
        t = data.get("tensors")
        if not isinstance(t, dict):
            raise ManifestError("manifest 'tensors' must be an object of columns")
        columns = ("name", "segment", "offset", "dtype", "shape", "stride", "kind", "requires_grad", "digest")
        cols = {}
        for c in columns:
            v = t.get(c)
            if not isinstance(v, list):
                raise ManifestError(f"manifest tensor column {c!r} must be a list; found {type(v).__name__}")
            cols[c] = v
        n = len(cols["name"])
        if n > MAX_TENSORS or any(len(v) != n for v in cols.values()):
            raise ManifestError(
                f"manifest tensor columns must all have the same length (at most {MAX_TENSORS}); found "
                + ", ".join(f"{c}={len(v)}" for c, v in cols.items())
            )
        seen: set[str] = set()
        shapes: list[tuple[int, ...]] = []
        strides: list[tuple[int, ...]] = []
        for i in range(n):
            name, seg, off, dt = cols["name"][i], cols["segment"][i], cols["offset"][i], cols["dtype"][i]
            shape, stride = cols["shape"][i], cols["stride"][i]
            if not isinstance(name, str) or not name or name in seen:
                raise ManifestError(f"tensor {i} has name {name!r}; expected a unique non-empty string")
            seen.add(name)
            if not is_int(seg) or not 0 <= seg < len(segments):
                raise ManifestError(f"tensor {name!r} names segment {seg!r}; the entry has {len(segments)}")
            if not isinstance(dt, str) or dt not in DTYPES:
                raise ManifestError(f"tensor {name!r} has dtype {dt!r}; expected one of {sorted(DTYPES)}")
            if (
                not isinstance(shape, list)
                or not isinstance(stride, list)
                or len(shape) != len(stride)
                or len(shape) > MAX_NDIM
                or not all(is_int(x) and x >= 0 for x in shape)
                or not all(is_int(x) and x >= 0 for x in stride)
            ):
                raise ManifestError(
                    f"tensor {name!r} has shape {shape!r} and stride {stride!r}; expected two lists of "
                    f"non-negative integers of equal length (at most {MAX_NDIM})"
                )
            itemsize = DTYPES[dt].itemsize
            if not is_int(off) or off < 0 or off % itemsize:
                raise ManifestError(f"tensor {name!r} has offset {off!r}; expected a multiple of {itemsize}")
            end = off + extent_bytes(shape, stride, itemsize)
            if end > segments[seg].size:
                raise ManifestError(
                    f"tensor {name!r} spans bytes {off}..{end} of segment {seg}, which has only "
                    f"{segments[seg].size} bytes"
                )
            if not isinstance(cols["kind"][i], str) or cols["kind"][i] not in TENSOR_KINDS:
                raise ManifestError(f"tensor {name!r} has kind {cols['kind'][i]!r}; expected {TENSOR_KINDS}")
            if not isinstance(cols["requires_grad"][i], bool):
                raise ManifestError(f"tensor {name!r}: requires_grad must be a boolean")
            d = cols["digest"][i]
            if d is not None and not isinstance(d, str):
                raise ManifestError(f"tensor {name!r}: digest must be a string or null")
            shapes.append(tuple(shape))
            strides.append(tuple(stride))
        return cls(
            fingerprint=fingerprint,
            segments=tuple(segments),
            names=tuple(cols["name"]),
            segment=tuple(cols["segment"]),
            offset=tuple(cols["offset"]),
            dtype=tuple(cols["dtype"]),
            shape=tuple(shapes),
            stride=tuple(strides),
            kind=tuple(cols["kind"]),
            requires_grad=tuple(cols["requires_grad"]),
            digest=tuple(cols["digest"]),
        )


__all__ = ["MANIFEST_VERSION", "Manifest", "SegmentInfo", "TensorInfo", "extent_bytes"]

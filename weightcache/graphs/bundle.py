"""The ``cuda.graphs`` artifact: the recorded graphs of one model and the machine code of their kernels, as bytes.

A :class:`GraphBundle` holds, in recording order, each graph's :class:`GraphRecord` (its name, its description,
where in the graph arena its memory lies, its outputs) and the address ranges the recording process reproduced
(the arena, the weights at their home addresses), plus one cubin image per module that defines a kernel of them
(:mod:`~weightcache.graphs.cubins`), by SHA-256.

:meth:`GraphBundle.to_bytes` writes ``MAGIC``; the lengths of a JSON header and of the graphs' descriptions
(:meth:`~weightcache.graphs.description.GraphDescription.to_binary`, one after the other); the SHA-256 of those two;
the header, the descriptions, and the images one after the other. :meth:`GraphBundle.from_bytes` reads that back
with every field and every length checked and the header's and descriptions' SHA-256 recomputed, so a blob from the
keeper is never more than data (no pickle). The images are not copied (each is a view of the blob) and are checked
against their own SHA-256 there too, unless the caller says it checks each one before it uses it
(:func:`image_matches`): a restore maps the artifact instead of reading it, and hashes each image on the worker
thread that loads it, so that no byte is hashed or copied on the way. Anything malformed is a
:class:`~weightcache.errors.GraphDescriptionError`.

Layer L3; imports no torch.
"""

from __future__ import annotations

import hashlib
import json
import re
import struct
from collections.abc import Mapping
from typing import Any

import attrs

from ..dtypes import DTYPES
from .check import AddressRange
from .description import GraphDescription, kernel_image
from .json_fields import FieldReader

MAGIC = b"WCGRAPH2"
#: The format of the artifact (its JSON header's ``format``, and part of its key); an artifact of another format is
#: not read. 3 when descriptions came to hold memcpy nodes (:data:`~weightcache.graphs.description.BINARY_FORMAT`
#: 2); 4 since 2026-12-05: a record's ``reach`` covers the pointers inside a kernel's structure parameters (a
#: format-3 artifact's may leave out a range a graph reads, which its restore would then not check), and kernels
#: may be named ``name@<SHA-256>``.
FORMAT = 4
#: Bytes before the header: the magic, the header's and the descriptions' lengths, their SHA-256.
PREFIX = len(MAGIC) + 8 + 8 + 32
#: Where the images start, and each image within them: at multiples of this many bytes from the blob's start (a
#: mapped blob starts on a page, so each image the driver loads from it is aligned as a compiled one is).
IMAGE_ALIGNMENT = 64


def _aligned(offset: int) -> int:
    return -(-offset // IMAGE_ALIGNMENT) * IMAGE_ALIGNMENT


_SHA = re.compile(r"[0-9a-f]{64}")


_read = FieldReader(
    "graph artifact", "the artifact is not used (the graphs are captured as usual and a new artifact is published)"
)
_fail, _int, _object, _list = _read.fail, _read.int, _read.fields, _read.list


def _str(value: object, where: str) -> str:
    if not isinstance(value, str) or not value or len(value) > 4096:
        raise _fail(where, "a non-empty string", value)
    return value


@attrs.frozen
class Output:
    """One tensor a graph returns: where it lies (an address in the arena) and what it is."""

    address: int
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]

    def to_json(self) -> dict[str, Any]:
        return {"address": self.address, "dtype": self.dtype, "shape": list(self.shape), "stride": list(self.stride)}

    @classmethod
    def from_json(cls, raw: object, where: str) -> Output:
        f = _object(raw, where, ("address", "dtype", "shape", "stride"))
        if not isinstance(f["dtype"], str) or f["dtype"] not in DTYPES:
            raise _fail(f"{where} dtype", "a dtype weightcache knows", f["dtype"])
        shape = tuple(_int(v, f"{where} shape") for v in _list(f["shape"], f"{where} shape"))
        stride = tuple(_int(v, f"{where} stride") for v in _list(f["stride"], f"{where} stride"))
        if len(shape) != len(stride) or len(shape) > 64:
            raise _fail(f"{where} shape and stride", "of one length (at most 64)", (shape, stride))
        return cls(_int(f["address"], f"{where} address"), f["dtype"], shape, stride)


@attrs.frozen
class GraphRecord:
    """One recorded graph.

    Attributes:
        name: what the caller named it (e.g. ``"batch-8"``).
        start, end: the graph arena's bump pointer before and after its capture (its memory lies in between, and
            a restore reproduces exactly that).
        description: its nodes and edges.
        outputs: the tensors it returns, in order.
        kernels: each kernel of the description (its name, or its
            :func:`~weightcache.graphs.description.qualified` name) -> SHA-256 of the image that defines it.
        reach: range name -> how far into that range its pointers reach (:func:`~weightcache.graphs.check.extents`).
    """

    name: str
    start: int
    end: int
    description: GraphDescription
    outputs: tuple[Output, ...]
    kernels: Mapping[str, str]
    reach: Mapping[str, int] = attrs.field(factory=dict)

    def to_json(self, description: tuple[int, int]) -> dict[str, Any]:
        """Its JSON in the header; ``description``: where its binary description lies (offset, size)."""
        return {
            "name": self.name,
            "start": self.start,
            "end": self.end,
            "description": list(description),
            "outputs": [o.to_json() for o in self.outputs],
            "kernels": dict(sorted(self.kernels.items())),
            "reach": dict(sorted(self.reach.items())),
        }

    @classmethod
    def from_json(cls, raw: object, where: str, descriptions: memoryview) -> GraphRecord:
        """The record of its header JSON; its description read from ``descriptions`` (every graph's, in order)."""
        f = _object(raw, where, ("name", "start", "end", "description", "outputs", "kernels", "reach"))
        start, end = _int(f["start"], f"{where} start"), _int(f["end"], f"{where} end")
        if end < start:
            raise _fail(f"{where} end", f"at least its start ({start})", end)
        span = _list(f["description"], f"{where} description")
        if len(span) != 2:
            raise _fail(f"{where} description", "[offset, size]", span)
        offset, size = _int(span[0], f"{where} description"), _int(span[1], f"{where} description")
        if offset + size > len(descriptions):
            raise _fail(f"{where} description", f"within the {len(descriptions)} bytes of descriptions", span)
        description = GraphDescription.from_binary(descriptions[offset : offset + size])
        kernels = f["kernels"]
        if not isinstance(kernels, Mapping) or not all(
            isinstance(k, str) and isinstance(v, str) and _SHA.fullmatch(v) for k, v in kernels.items()
        ):
            raise _fail(f"{where} kernels", "an object of kernel name -> SHA-256", kernels)
        missing = sorted(description.kernels() - set(kernels))
        if missing:
            raise _fail(f"{where} kernels", "an image for every kernel of the graph", f"none for {missing[0][:80]}")
        other = next((k for k, v in sorted(kernels.items()) if kernel_image(k) not in (None, v)), None)
        if other is not None:
            raise _fail(f"{where} kernels {other[:80]}", "the image its qualified name holds", kernels[other])
        outputs = tuple(Output.from_json(o, f"{where} output {i}") for i, o in enumerate(_list(f["outputs"], where)))
        reach = f["reach"]
        if not isinstance(reach, Mapping) or not all(isinstance(k, str) for k in reach):
            raise _fail(f"{where} reach", "an object of range name -> extent", reach)
        extents = {name: _int(value, f"{where} reach {name[:40]}") for name, value in reach.items()}
        return cls(_str(f["name"], f"{where} name"), start, end, description, outputs, dict(kernels), extents)


def image_matches(digest: str, image: bytes | memoryview) -> bool:
    """Whether ``image``'s SHA-256 is ``digest`` (hex): what a caller that took images unchecked
    (``GraphBundle.from_bytes(..., check_images=False)``) asks before it loads one."""
    return hashlib.sha256(image).hexdigest() == digest


@attrs.frozen
class GraphBundle:
    """The recorded graphs of one model (see the module's text)."""

    ranges: tuple[AddressRange, ...]
    graphs: tuple[GraphRecord, ...]
    images: Mapping[str, bytes | memoryview] = attrs.field(factory=dict)

    def to_bytes(self) -> bytes:
        order = sorted(self.images)
        offsets, at, data = [], 0, []
        for digest in order:
            image = self.images[digest]
            data += [bytes(_aligned(at) - at), image]
            at = _aligned(at)
            offsets.append({"sha256": digest, "offset": at, "size": len(image)})
            at += len(image)
        descriptions = [g.description.to_binary() for g in self.graphs]
        spans, at = [], 0
        for d in descriptions:
            spans.append((at, len(d)))
            at += len(d)
        header = json.dumps(
            {
                "format": FORMAT,
                "ranges": [
                    {"name": r.name, "base": r.base, "size": r.size, "own_mapping": r.own_mapping} for r in self.ranges
                ],
                "graphs": [g.to_json(span) for g, span in zip(self.graphs, spans, strict=True)],
                "images": offsets,
            },
            separators=(",", ":"),
        ).encode()
        tables = b"".join(descriptions)
        checked = hashlib.sha256(header)
        checked.update(tables)
        lengths = struct.pack("<QQ", len(header), len(tables))
        ahead = PREFIX + len(header) + len(tables)
        pad = bytes(_aligned(ahead) - ahead)
        return b"".join([MAGIC, lengths, checked.digest(), header, tables, pad, *data])

    @classmethod
    def from_bytes(cls, blob: bytes | memoryview, *, check_images: bool = True) -> GraphBundle:
        """What :meth:`to_bytes` wrote, every field checked; :class:`GraphDescriptionError` otherwise. The images
        are views of ``blob``, each checked against its SHA-256 unless ``check_images`` is False: then the caller
        checks each one (:func:`image_matches`) before it uses it."""
        view = memoryview(blob).cast("B")
        if len(view) < PREFIX or bytes(view[: len(MAGIC)]) != MAGIC:
            raise _fail("the blob", f"a graph artifact starting with {MAGIC!r} (format {FORMAT})", bytes(view[:16]))
        length, tables = struct.unpack_from("<QQ", view, len(MAGIC))
        body = PREFIX
        if length > len(view) - body or tables > len(view) - body - length:
            raise _fail("the header and description lengths", f"at most {len(view) - body} together", (length, tables))
        checked = hashlib.sha256(view[body : body + length + tables]).digest()
        if checked != bytes(view[PREFIX - 32 : PREFIX]):
            raise _fail("the header and descriptions", "bytes matching their SHA-256", checked.hex()[:12])
        try:
            top = json.loads(bytes(view[body : body + length]))
        except (UnicodeDecodeError, ValueError, RecursionError) as exc:
            raise _fail("the header", "JSON nested at most as deep as Python parses", str(exc)) from None
        top = _object(top, "the header", ("format", "ranges", "graphs", "images"))
        if top["format"] != FORMAT:
            raise _fail("format", str(FORMAT), top["format"])
        ranges = []
        for i, raw in enumerate(_list(top["ranges"], "ranges")):
            r = _object(raw, f"range {i}", ("name", "base", "size", "own_mapping"))
            if not isinstance(r["own_mapping"], bool):
                raise _fail(f"range {i} own_mapping", "true or false", r["own_mapping"])
            name = _str(r["name"], f"range {i} name")
            ranges.append(AddressRange(name, _int(r["base"], "base"), _int(r["size"], "size"), r["own_mapping"]))
        if len({r.name for r in ranges}) != len(ranges):
            raise _fail("ranges", "ranges of distinct names", sorted(r.name for r in ranges))
        descriptions = view[body + length : body + length + tables]
        data = view[min(_aligned(body + length + tables), len(view)) :]
        images: dict[str, bytes | memoryview] = {}
        for i, raw in enumerate(_list(top["images"], "images")):
            m = _object(raw, f"image {i}", ("sha256", "offset", "size"))
            offset, size = _int(m["offset"], f"image {i} offset"), _int(m["size"], f"image {i} size")
            if offset + size > len(data) or offset % IMAGE_ALIGNMENT:
                raise _fail(
                    f"image {i}",
                    f"within the {len(data)} bytes after the descriptions, at a multiple of {IMAGE_ALIGNMENT}",
                    (offset, size),
                )
            image = data[offset : offset + size]
            if not isinstance(m["sha256"], str) or not _SHA.fullmatch(m["sha256"]):
                raise _fail(f"image {i} sha256", "a hex SHA-256", m["sha256"])
            if check_images and not image_matches(m["sha256"], image):
                raise _fail(f"image {i} sha256", "the SHA-256 of its bytes", m["sha256"])
            images[m["sha256"]] = image
        graphs = tuple(
            GraphRecord.from_json(g, f"graph {i}", descriptions) for i, g in enumerate(_list(top["graphs"], "graphs"))
        )
        names = {r.name: r for r in ranges}
        for g in graphs:
            absent = sorted(set(g.kernels.values()) - set(images))
            if absent:
                raise _fail(f"graph {g.name!r} kernels", "images the artifact holds", absent[0])
            for name, extent in g.reach.items():
                if name not in names or not 0 < extent <= names[name].size:
                    raise _fail(f"graph {g.name!r} reach {name[:40]}", "within a range the artifact lists", extent)
        return cls(tuple(ranges), graphs, images)


__all__ = ["FORMAT", "IMAGE_ALIGNMENT", "MAGIC", "PREFIX", "GraphBundle", "GraphRecord", "Output", "image_matches"]

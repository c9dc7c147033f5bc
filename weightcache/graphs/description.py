"""A captured CUDA graph as values: what a later process needs to build the same graph node by node.

A :class:`GraphDescription` holds the graph's nodes in the driver's order and its edges by node index. A kernel
node (:class:`KernelNode`) is its function's name, its grid, block and dynamic shared memory, its launch attributes
and its argument bytes as the kernel reads them: either laid out parameter by parameter (``cuFuncGetParamInfo``'s
offsets and sizes, for a node launched with ``kernelParams``) or as one buffer (a node launched with ``extra``, the
form cuBLAS uses; its layout is unknown). A memset node is its destination and geometry; a memcpy node
(:class:`MemcpyNode`, what a captured ``copy_`` between device tensors becomes) its source, destination and
geometry, between device memory only; an empty node is nothing.
Edges carry the driver's 8 bytes of edge data (ports and type: a programmatic dependent launch has some).

Two serializations, each read back with every field checked, so a description from a file or the keeper is never
more than data: :meth:`GraphDescription.to_json` (plain JSON, bytes as hex: for files and people) and
:meth:`GraphDescription.to_binary` (fixed-size little-endian tables checked as arrays: what the graph artifact
holds, since a restore reads thousands of nodes and JSON cost it ~60 us each). Anything malformed is a
:class:`~weightcache.errors.GraphDescriptionError` naming the field.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

import attrs
import numpy as np

from .json_fields import FieldReader

#: The format of :meth:`GraphDescription.to_json`.
FORMAT = 2
#: What :meth:`GraphDescription.to_binary` writes first, and its format.
BINARY_MAGIC = b"WCGD"
BINARY_FORMAT = 2
#: How a kernel node's arguments were given at capture: ``params`` (``kernelParams``, one pointer per parameter;
#: :attr:`KernelNode.layout` holds their offsets and sizes) or ``buffer`` (``extra``: one argument buffer).
LAUNCH_FORMS: tuple[Literal["params"], Literal["buffer"]] = ("params", "buffer")
#: Bytes of one launch attribute's value (``CUlaunchAttributeValue`` is a 64-byte union) and of one edge's data.
ATTRIBUTE_BYTES = 64
EDGE_BYTES = 8
_U32 = 2**32
#: Where :meth:`GraphDescription.moved` (and :class:`~weightcache.graphs.check.Pointer`) points in a memset or
#: memcpy node instead of an argument byte: its destination (the first byte it writes), a memcpy's source.
DESTINATION, SOURCE = -1, -2


_read = FieldReader(
    "graph description", "the description is not used (capture the graph again, or publish a new description)"
)
_fail, _int, _fields = _read.fail, _read.int, _read.fields


def _triple(value: object, where: str) -> tuple[int, int, int]:
    if not isinstance(value, list | tuple) or len(value) != 3:
        raise _fail(where, "three integers", value)
    x, y, z = (_int(v, f"{where}[{i}]", _U32) for i, v in enumerate(value))
    return (x, y, z)


def _hex(value: object, where: str, size: int | None = None) -> bytes:
    if not isinstance(value, str):
        raise _fail(where, "a hex string", value)
    try:
        raw = bytes.fromhex(value)
    except ValueError:
        raise _fail(where, "a hex string", value) from None
    if size is not None and len(raw) != size:
        raise _fail(where, f"{size} bytes", f"{len(raw)} bytes")
    return raw


@attrs.frozen
class KernelNode:
    """One kernel launch of the graph.

    Attributes:
        function: the kernel's (mangled) name, as ``cuFuncGetName`` gives it; ``name@<SHA-256 of its image>``
            (:func:`qualified`) where the graph launches two different functions of that name (modules that name
            their kernels alike: torch.compile names the Triton kernels of pieces it compiles apart by pattern).
        grid, block: the launch's grid and block dimensions.
        shared_bytes: its dynamic shared memory.
        args: its argument bytes as the kernel reads them.
        layout: ``(offset, size)`` of each parameter within :attr:`args` (``launched_with == "params"``); empty for
            an argument buffer, whose layout the driver does not give.
        launched_with: :data:`LAUNCH_FORMS`.
        attributes: the launch attributes that were set (``CUlaunchAttributeID`` -> its 64-byte value), e.g. a
            cuBLAS GEMM's cluster dimension.
    """

    function: str
    grid: tuple[int, int, int]
    block: tuple[int, int, int]
    shared_bytes: int
    args: bytes
    layout: tuple[tuple[int, int], ...] = ()
    launched_with: Literal["params", "buffer"] = "params"
    attributes: tuple[tuple[int, bytes], ...] = ()

    def words(self) -> tuple[np.ndarray, np.ndarray]:
        """Byte offsets and values (``uint64`` arrays) of every argument that could be a device pointer: each
        8-aligned 8-byte word inside one parameter of a laid-out node (:func:`pointer_words`); every 8-aligned
        8-byte word of an argument buffer (its layout is unknown). Arrays, because a restore scans every word of
        every node of every graph."""
        every = np.frombuffer(self.args, dtype="<u8", count=len(self.args) // 8)
        if self.launched_with == "params":
            offsets = np.array(pointer_words(self.layout), dtype=np.intp) * 8
            return offsets.astype(np.uint64), every[offsets // 8]
        return np.arange(len(every), dtype=np.uint64) * 8, every


#: Between a kernel's name and the SHA-256 of its image in a qualified :attr:`KernelNode.function` (a mangled name,
#: a Triton or CUDA C name never holds it).
IMAGE_MARK = "@"


def qualified(name: str, digest: str) -> str:
    """``name`` as the kernel of that name in the image whose SHA-256 is ``digest``."""
    return f"{name}{IMAGE_MARK}{digest}"


def kernel_name(function: str) -> str:
    """The name a module knows a :attr:`KernelNode.function` by (a :func:`qualified` one without its image)."""
    return function.partition(IMAGE_MARK)[0]


def kernel_image(function: str) -> str | None:
    """The SHA-256 of the image a :func:`qualified` :attr:`KernelNode.function` names; None for a plain name."""
    return function.partition(IMAGE_MARK)[2] or None


def pointer_words(layout: Sequence[tuple[int, int]]) -> list[int]:
    """The index (byte offset / 8) of each 8-aligned 8-byte word that lies inside one parameter of ``layout``
    (offset, size): an 8-byte parameter, and every aligned word of a larger one (a structure passed by value, such
    as TensorIterator's ``Array<char*, N>`` of operand pointers). A word across two smaller parameters is no
    pointer: the compiler aligns a pointer, inside a structure too, to 8 bytes."""
    return [w for offset, size in layout for w in range((offset + 7) // 8, (offset + size) // 8)]


@attrs.frozen
class MemsetNode:
    """A memset node (``CUDA_MEMSET_NODE_PARAMS``): ``height`` rows of ``width`` elements of ``element_size``
    bytes set to ``value``, rows ``pitch`` bytes apart from ``dst``."""

    dst: int
    pitch: int
    value: int
    element_size: int
    width: int
    height: int


#: ``CUmemorytype`` values a memcpy node's side may have: device memory (``CU_MEMORYTYPE_DEVICE``) or a unified
#: address (``CU_MEMORYTYPE_UNIFIED``, what ``cudaMemcpyDefault`` captures). Host memory and arrays are not
#: described: no later process has them at the same address.
MEMORY_TYPES = {2: "device", 4: "unified"}


@attrs.frozen
class MemcpyNode:
    """A memcpy node (``CUDA_MEMCPY3D``) between device memory: ``depth`` slices of ``height`` rows of ``width``
    bytes from :attr:`src` to :attr:`dst`. On each side rows are ``pitch`` bytes apart and slices ``pitch *
    height`` bytes apart (that side's ``*_pitch`` and ``*_height``); :attr:`src` and :attr:`dst` are the first
    bytes copied (the driver's base address with its X, Y and Z offsets folded in). ``src_type`` and ``dst_type``:
    :data:`MEMORY_TYPES`."""

    src: int
    dst: int
    width: int
    height: int = 1
    depth: int = 1
    src_pitch: int = 0
    src_height: int = 0
    dst_pitch: int = 0
    dst_height: int = 0
    src_type: int = 2
    dst_type: int = 2

    def geometry_problem(self) -> str | None:
        """Why this geometry is not one a description holds, or None: rows that overlap (more than one row or
        slice with a side's pitch below the width) or slices that do (``depth > 1`` with a side's height below
        ``height``).
        ``cuMemcpy3D`` checks pitches and heights only where they are given, so such a node would copy what its
        fields do not say; it is captured instead."""
        if (self.height > 1 or self.depth > 1) and min(self.src_pitch, self.dst_pitch) < self.width:
            return f"rows {self.width} bytes wide {self.src_pitch}/{self.dst_pitch} bytes apart (source/destination)"
        if self.depth > 1 and min(self.src_height, self.dst_height) < self.height:
            return f"slices of {self.height} rows {self.src_height}/{self.dst_height} rows apart (source/destination)"
        return None

    def last_bytes(self) -> tuple[int, int] | None:
        """The addresses of the last source byte and the last destination byte the copy touches; None for a copy
        of nothing."""
        if not (self.width and self.height and self.depth):
            return None
        src = self.src + (self.depth - 1) * self.src_pitch * self.src_height + (self.height - 1) * self.src_pitch
        dst = self.dst + (self.depth - 1) * self.dst_pitch * self.dst_height + (self.height - 1) * self.dst_pitch
        return src + self.width - 1, dst + self.width - 1


@attrs.frozen
class EmptyNode:
    """An empty node (a join point of the graph's dependencies)."""


Node = KernelNode | MemsetNode | MemcpyNode | EmptyNode


@attrs.frozen
class Edge:
    """A dependency: node :attr:`dst` runs after node :attr:`src` (indices into the nodes); :attr:`data` is the
    driver's edge data (``CUgraphEdgeData``, 8 bytes: ports and type)."""

    src: int
    dst: int
    data: bytes = bytes(EDGE_BYTES)


class GraphDescription:
    """A graph's nodes (in the driver's order) and edges; see the module's text. Read from its binary form
    (:meth:`from_binary`), it holds the checked tables (:attr:`tables`) and makes the node and edge values only
    when :attr:`nodes` or :attr:`edges` is first asked for: a restore builds graphs from the tables
    (:meth:`~weightcache.graphs.driver.CudaGraphDriver.add_nodes`) and never needs them. Immutable; equal where the
    nodes and edges are."""

    __slots__ = ("_edges", "_nodes", "_tables")

    def __init__(self, nodes: tuple[Node, ...], edges: tuple[Edge, ...] = ()) -> None:
        self._nodes: tuple[Node, ...] | None = tuple(nodes)
        self._edges: tuple[Edge, ...] | None = tuple(edges)
        self._tables: DescriptionTables | None = None

    @classmethod
    def _of(cls, tables: DescriptionTables) -> GraphDescription:
        made = cls.__new__(cls)
        made._nodes = made._edges = None
        made._tables = tables
        return made

    @property
    def nodes(self) -> tuple[Node, ...]:
        """The nodes, in the driver's order."""
        if self._nodes is None:
            assert self._tables is not None
            self._nodes = self._tables.nodes()
        return self._nodes

    @property
    def edges(self) -> tuple[Edge, ...]:
        """The edges, by node index."""
        if self._edges is None:
            assert self._tables is not None
            self._edges = _edges(self._tables.edges)
        return self._edges

    @property
    def tables(self) -> DescriptionTables:
        """The description as checked tables (those it was read from, or made from its nodes once)."""
        if self._tables is None:
            self._tables = DescriptionTables.read(self.to_binary())
        return self._tables

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, GraphDescription):
            return NotImplemented
        if self._tables is not None and other._tables is not None and self._tables.data == other._tables.data:
            return True
        return self.nodes == other.nodes and self.edges == other.edges

    def __hash__(self) -> int:
        return hash((self.nodes, self.edges))

    def __repr__(self) -> str:
        return f"GraphDescription(nodes={self.nodes!r}, edges={self.edges!r})"

    def kernels(self) -> set[str]:
        """The names of the kernels the graph launches."""
        if self._nodes is None and self._tables is not None:
            return self._tables.kernels()
        return {n.function for n in self.nodes if isinstance(n, KernelNode)}

    def to_json(self) -> dict[str, Any]:
        """Plain JSON values (bytes as hex); :meth:`from_json` reads them back."""
        nodes: list[dict[str, Any]] = []
        for node in self.nodes:
            if isinstance(node, KernelNode):
                nodes.append(
                    {
                        "kind": "kernel",
                        "function": node.function,
                        "grid": list(node.grid),
                        "block": list(node.block),
                        "shared_bytes": node.shared_bytes,
                        "args": node.args.hex(),
                        "layout": [list(span) for span in node.layout],
                        "launched_with": node.launched_with,
                        "attributes": [[key, value.hex()] for key, value in node.attributes],
                    }
                )
            elif isinstance(node, MemsetNode):
                nodes.append({"kind": "memset", **{f: getattr(node, f) for f in _MEMSET_FIELDS}})
            elif isinstance(node, MemcpyNode):
                nodes.append({"kind": "memcpy", **{f: getattr(node, f) for f in _MEMCPY_FIELDS}})
            else:
                nodes.append({"kind": "empty"})
        return {
            "format": FORMAT,
            "nodes": nodes,
            "edges": [[e.src, e.dst, e.data.hex()] for e in self.edges],
        }

    @classmethod
    def from_json(cls, obj: object) -> GraphDescription:
        """The description :meth:`to_json` wrote, every field checked; :class:`GraphDescriptionError` otherwise."""
        top = _fields(obj, "the description", ("format", "nodes", "edges"))
        if top["format"] != FORMAT:
            raise _fail("format", str(FORMAT), top["format"])
        raw_nodes, raw_edges = top["nodes"], top["edges"]
        if not isinstance(raw_nodes, list) or not isinstance(raw_edges, list):
            raise _fail("nodes and edges", "lists", (type(raw_nodes).__name__, type(raw_edges).__name__))
        nodes = tuple(_node(raw, f"node {i}") for i, raw in enumerate(raw_nodes))
        edges = []
        for i, raw in enumerate(raw_edges):
            where = f"edge {i}"
            if not isinstance(raw, list) or len(raw) != 3:
                raise _fail(where, "[src, dst, data]", raw)
            src, dst = (_int(v, where, len(nodes)) for v in raw[:2])
            edges.append(Edge(src, dst, _hex(raw[2], f"{where} data", EDGE_BYTES)))
        return cls(nodes, tuple(edges))

    def moved(self, words: Sequence[tuple[int, int, int]]) -> GraphDescription:
        """A copy in which each ``(node, offset, delta)`` address is ``delta`` bytes further on: the 8-byte word at
        argument byte ``offset`` of kernel node ``node``, or (``offset`` :data:`DESTINATION` or :data:`SOURCE`)
        a memset's destination or a memcpy's destination or source. Each place is moved once, however often it is
        named. Made from the tables (no value per node); raises :class:`GraphDescriptionError` for a place the
        description does not have or an address moved below 0 or past 64 bits."""
        tables = self.tables.writable_copy()
        raw = np.frombuffer(tables.args, dtype=np.uint8)
        kinds = tables.table["kind"]
        copy_rows = np.cumsum(kinds == _MEMCPY) - 1
        done: set[tuple[int, int]] = set()
        firsts: list[tuple[int, int, int]] = []  # each place once, as first named
        for word in words:
            if (word[0], word[1]) not in done:
                done.add((word[0], word[1]))
                firsts.append(word)

        # kernel argument words, all at once (a restore moves hundreds a graph): checked, then read, moved, written
        kernel = [w for w in firsts if w[1] >= 0]
        if kernel:
            try:
                node, offset, delta = (np.array(column, dtype=np.int64) for column in zip(*kernel, strict=True))
            except OverflowError:  # a place or a move past 64 bits: named as one at a time would name it
                n, o, d = next(w for w in kernel if not all(-(2**63) <= v < 2**63 for v in w))
                raise _fail(node_place(n, o), "a node, an offset and a move within 64 bits", (n, o, d)) from None
            valid = (node >= 0) & (node < len(kinds))
            safe = np.where(valid, node, 0)
            valid &= (kinds[safe] == _KERNEL) & (offset % 8 == 0)
            valid &= offset + 8 <= tables.table["args"][safe].astype(np.int64)
            if not valid.all():
                bad = int(np.argmin(valid))
                n, o = int(node[bad]), int(offset[bad])
                if not 0 <= n < len(kinds):
                    raise _fail(node_place(n, o), f"a node of the {len(kinds)}", n)
                raise _fail(node_place(n, o), "an aligned 8-byte word of a kernel's arguments", o)
            at = tables.arg_starts[node].astype(np.int64) + offset
            spots = at[:, None] + np.arange(8)
            value = raw[spots].copy().view("<u8").reshape(-1)
            step = delta.astype(np.uint64)  # two's complement: adding it wraps as subtracting would
            moved = value + step
            wrapped = np.where(delta >= 0, moved < value, moved > value)
            if wrapped.any():
                bad = int(np.argmax(wrapped))
                _address(int(value[bad]) + int(delta[bad]), node_place(int(node[bad]), int(offset[bad])))
            raw[spots] = moved.astype("<u8").view(np.uint8).reshape(-1, 8)
        for node_, offset_, delta_ in (w for w in firsts if w[1] < 0):
            here = node_place(node_, offset_)
            if not 0 <= node_ < len(kinds):
                raise _fail(here, f"a node of the {len(kinds)}", node_)
            kind = int(kinds[node_])
            if kind == _MEMSET and offset_ == DESTINATION:
                row = tables.table["memset"][node_]
                row[0] = _address(int(row[0]) + delta_, here)
            elif kind == _MEMCPY and offset_ in (DESTINATION, SOURCE):
                field = _MEMCPY_FIELDS.index("dst" if offset_ == DESTINATION else "src")
                row = tables.copies[int(copy_rows[node_])]
                row[field] = _address(int(row[field]) + delta_, here)
            else:
                raise _fail(here, "a memset's destination or a memcpy's source or destination", offset_)
        return GraphDescription._of(tables)

    def to_binary(self) -> bytes:
        """The description as tables: :data:`BINARY_MAGIC`; seven little-endian u32 (:data:`BINARY_FORMAT`, then
        the counts of nodes, layout spans, attributes, edges, kernel names and memcpy nodes); the node, layout,
        attribute, edge and memcpy tables; each name's length (u32), the names (UTF-8); and the kernels' argument
        bytes one after the other. :meth:`from_binary` reads them back. A description read from such bytes gives
        those bytes back."""
        if self._tables is not None:
            return bytes(self._tables.data)
        names: dict[str, int] = {}
        table = np.zeros(len(self.nodes), dtype=_NODE)
        layout: list[tuple[int, int]] = []
        attributes: list[tuple[int, bytes]] = []
        copies: list[list[int]] = []
        args: list[bytes] = []
        for i, node in enumerate(self.nodes):
            row = table[i]
            if isinstance(node, KernelNode):
                row["kind"], row["form"] = _KERNEL, LAUNCH_FORMS.index(node.launched_with)
                row["name"] = names.setdefault(node.function, len(names))
                row["grid"], row["block"], row["shared"] = node.grid, node.block, node.shared_bytes
                row["args"], row["layout"], row["attributes"] = len(node.args), len(node.layout), len(node.attributes)
                args.append(node.args)
                layout.extend(node.layout)
                attributes.extend(node.attributes)
            elif isinstance(node, MemsetNode):
                row["kind"] = _MEMSET
                row["memset"] = [getattr(node, f) for f in _MEMSET_FIELDS]
            elif isinstance(node, MemcpyNode):
                row["kind"] = _MEMCPY
                copies.append([getattr(node, f) for f in _MEMCPY_FIELDS])
            else:
                row["kind"] = _EMPTY
        encoded = [n.encode() for n in names]
        spans = np.array(layout, dtype=_SPAN).reshape(-1) if layout else np.zeros(0, _SPAN)
        attrs_table = np.zeros(len(attributes), dtype=_ATTRIBUTE)
        for j, (key, value) in enumerate(attributes):
            attrs_table[j] = (key, np.frombuffer(value, dtype=np.uint8))
        edges = np.zeros(len(self.edges), dtype=_EDGE)
        for j, e in enumerate(self.edges):
            edges[j] = (e.src, e.dst, np.frombuffer(e.data, dtype=np.uint8))
        memcpy = np.array(copies, dtype="<u8").reshape(-1, len(_MEMCPY_FIELDS))
        counts = np.array(
            [BINARY_FORMAT, len(self.nodes), len(layout), len(attributes), len(self.edges), len(names), len(copies)],
            dtype="<u4",
        )
        lengths = np.array([len(n) for n in encoded], dtype="<u4")
        return b"".join(
            [
                BINARY_MAGIC,
                counts.tobytes(),
                table.tobytes(),
                spans.tobytes(),
                attrs_table.tobytes(),
                edges.tobytes(),
                memcpy.tobytes(),
                lengths.tobytes(),
                *encoded,
                *args,
            ]
        )

    @classmethod
    def from_binary(cls, data: bytes | memoryview) -> GraphDescription:
        """The description :meth:`to_binary` wrote, every field and length checked (as arrays; the node values
        are made when first asked for); :class:`GraphDescriptionError` otherwise."""
        return cls._of(DescriptionTables.read(data))


class DescriptionTables:
    """A binary description's tables, every count, index and span checked (:meth:`read`): what a restore builds a
    graph from without making a Python value per node. ``table`` holds a row per node (``kind``, ``form``,
    ``name`` index, ``grid``, ``block``, ``shared``, and counts of ``args`` bytes, ``layout`` spans and
    ``attributes``; a memset's fields); ``spans``, ``attributes``, ``edges`` and ``copies`` the other tables;
    ``names`` the kernel names; ``args`` every kernel's argument bytes one after the other, ``arg_starts`` where
    each node's begin (and ``span_starts``, ``attribute_starts`` likewise); ``kernel`` and ``memset`` which rows are
    kernel and memset nodes. ``data``: the bytes read (a view of them: of an artifact's mapping, in a restore)."""

    __slots__ = (
        "_words",
        "arg_starts",
        "args",
        "attribute_starts",
        "attributes",
        "copies",
        "data",
        "edges",
        "kernel",
        "memset",
        "names",
        "span_starts",
        "spans",
        "table",
    )

    def __init__(
        self,
        data: memoryview,
        table: np.ndarray,
        spans: np.ndarray,
        attributes: np.ndarray,
        edges: np.ndarray,
        copies: np.ndarray,
        names: list[str],
        args: memoryview,
    ) -> None:
        self.data, self.table, self.spans, self.attributes = data, table, spans, attributes
        self.edges, self.copies, self.names, self.args = edges, copies, names, args
        self.kernel = table["kind"] == _KERNEL
        self.memset = table["kind"] == _MEMSET
        self.arg_starts = _starts(table["args"])
        self.span_starts = _starts(table["layout"])
        self.attribute_starts = _starts(table["attributes"])
        self._words: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None

    @classmethod
    def read(cls, data: bytes | memoryview) -> DescriptionTables:
        """The tables of a binary description (:meth:`GraphDescription.to_binary`), every field and length
        checked; :class:`GraphDescriptionError` otherwise."""
        view = memoryview(data).cast("B")
        reader = _Tables(view)
        if bytes(reader.take(len(BINARY_MAGIC), "the magic")) != BINARY_MAGIC:
            raise _fail("the binary description", f"one starting with {BINARY_MAGIC!r}", bytes(data[:4]))
        version = int(reader.array(np.dtype("<u4"), 1, "the format")[0])
        if version != BINARY_FORMAT:
            raise _fail("format", str(BINARY_FORMAT), version)
        n_nodes, n_spans, n_attributes, n_edges, n_names, n_copies = (
            int(v) for v in reader.array(np.dtype("<u4"), 6, "the counts")
        )
        table = reader.array(_NODE, n_nodes, "the node table")
        spans = reader.array(_SPAN, n_spans, "the layout table")
        attributes = reader.array(_ATTRIBUTE, n_attributes, "the attribute table")
        edges = reader.array(_EDGE, n_edges, "the edge table")
        fields = len(_MEMCPY_FIELDS)
        copies = reader.array(_COPY, n_copies * fields, "the memcpy table").reshape(n_copies, fields)
        lengths = reader.array(np.dtype("<u4"), n_names, "the name lengths").astype(np.int64)
        names = []
        for j, size in enumerate(lengths.tolist()):
            raw = bytes(reader.take(size, f"name {j}"))
            try:
                names.append(raw.decode())
            except UnicodeDecodeError:
                raise _fail(f"name {j}", "UTF-8", raw) from None
            if not names[-1]:
                raise _fail(f"name {j}", "a kernel name", "")
        kinds = table["kind"]
        kernel = kinds == _KERNEL
        _check_tables(table, kernel, spans, attributes, edges, copies, n_names, reader.left())
        args = reader.take(reader.left(), "the argument bytes")
        return cls(view, table, spans, attributes, edges, copies, names, args)

    def writable_copy(self) -> DescriptionTables:
        """These tables over a copy of their bytes, the arrays writable: read as :meth:`read` reads them, without
        checking them again (they were checked) or decoding the names again (a relocation copies every graph's
        tables)."""
        view = memoryview(bytearray(self.data))
        reader = _Tables(view)
        reader.take(len(BINARY_MAGIC) + 7 * 4, "the header")
        table = reader.array(_NODE, len(self.table), "the node table")
        spans = reader.array(_SPAN, len(self.spans), "the layout table")
        attributes = reader.array(_ATTRIBUTE, len(self.attributes), "the attribute table")
        edges = reader.array(_EDGE, len(self.edges), "the edge table")
        copies = reader.array(_COPY, self.copies.size, "the memcpy table").reshape(self.copies.shape)
        args = view[len(view) - len(self.args) :]
        return DescriptionTables(view, table, spans, attributes, edges, copies, self.names, args)

    def argument_words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Node index, byte offset and value (``uint64``) of every kernel argument word that could be a device
        pointer, by node then offset: each whole 8-byte word of a node launched with one argument buffer, and of a
        node launched parameter by parameter the aligned words inside one parameter (:func:`pointer_words`).
        From the tables, without a value per node; worked out once (a restore's checks and relocation both read
        them), the arrays read-only."""
        if self._words is None:
            self._words = self._argument_words()
        return self._words

    def _argument_words(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        table = self.table
        kernels = np.flatnonzero(self.kernel)
        sizes = table["args"][kernels].astype(np.int64)
        buffer = table["form"][kernels] == LAUNCH_FORMS.index("buffer")
        whole = sizes[buffer] // 8
        nodes = [np.repeat(kernels[buffer], whole)]
        words = [_counting(whole)]
        params = kernels[~buffer]
        counts = table["layout"][params].astype(np.int64)
        span = np.repeat(self.span_starts[params], counts) + _counting(counts)
        offset = self.spans["offset"][span].astype(np.int64)
        first, end = (offset + 7) // 8, (offset + self.spans["size"][span].astype(np.int64)) // 8
        inside = np.maximum(end - first, 0)
        nodes.append(np.repeat(np.repeat(params, counts), inside))
        words.append(np.repeat(first, inside) + _counting(inside))
        node, word = np.concatenate(nodes), np.concatenate(words)
        within = word < table["args"][node].astype(np.int64) // 8  # (the read checked spans within the bytes)
        node, word = node[within], word[within]
        order = np.lexsort((word, node))
        node, word = node[order], word[order]
        if len(node) > 1:  # a word inside two spans (overlapping parameters) counted once
            fresh = np.ones(len(node), dtype=bool)
            fresh[1:] = (node[1:] != node[:-1]) | (word[1:] != word[:-1])
            node, word = node[fresh], word[fresh]
        at = self.arg_starts[node] + word * 8
        raw = np.frombuffer(self.args, dtype=np.uint8)
        values = raw[at[:, None] + np.arange(8)].copy().view("<u8").reshape(-1)
        found = (node.astype(np.intp), (word * 8).astype(np.intp), values)
        for array in found:
            array.setflags(write=False)
        return found

    def copy_addresses(self) -> list[tuple[int, int, int]]:
        """``(node, place, address)`` of every memset's destination and memcpy's source and destination (``place``
        :data:`DESTINATION` or :data:`SOURCE`), by node."""
        kinds = self.table["kind"]
        memsets = np.flatnonzero(kinds == _MEMSET).tolist()
        found = [
            (i, DESTINATION, int(a)) for i, a in zip(memsets, self.table["memset"][memsets, 0].tolist(), strict=True)
        ]
        src, dst = _MEMCPY_FIELDS.index("src"), _MEMCPY_FIELDS.index("dst")
        for i, row in zip(np.flatnonzero(kinds == _MEMCPY).tolist(), self.copies.tolist(), strict=True):
            found += [(i, SOURCE, int(row[src])), (i, DESTINATION, int(row[dst]))]
        return sorted(found)

    def kernels(self) -> set[str]:
        """The names of the kernels the graph launches."""
        return {self.names[i] for i in np.unique(self.table["name"][self.kernel]).tolist()}

    def copy_memory_types(self) -> set[int]:
        """The memory types (:data:`MEMORY_TYPES`) of every memcpy node's sides."""
        fields = [_MEMCPY_FIELDS.index("src_type"), _MEMCPY_FIELDS.index("dst_type")]
        return set(self.copies[:, fields].reshape(-1).tolist())

    def node(self, i: int) -> Node:
        """Node ``i`` as a value."""
        row = self.table[i]
        kind = int(row["kind"])
        if kind == _MEMSET:
            return MemsetNode(*row["memset"].tolist())
        if kind == _MEMCPY:
            return MemcpyNode(*self.copies[int((self.table["kind"][:i] == _MEMCPY).sum())].tolist())
        if kind == _EMPTY:
            return EmptyNode()
        a, s, t = int(self.arg_starts[i]), int(self.span_starts[i]), int(self.attribute_starts[i])
        grid, block = row["grid"].tolist(), row["block"].tolist()
        spans = self.spans[s : s + int(row["layout"])]
        attributes = self.attributes[t : t + int(row["attributes"])]
        return KernelNode(
            function=self.names[int(row["name"])],
            grid=(grid[0], grid[1], grid[2]),
            block=(block[0], block[1], block[2]),
            shared_bytes=int(row["shared"]),
            args=bytes(self.args[a : a + int(row["args"])]),
            layout=tuple(zip(spans["offset"].tolist(), spans["size"].tolist(), strict=True)),
            launched_with=LAUNCH_FORMS[int(row["form"])],
            attributes=tuple(zip(attributes["id"].tolist(), [v.tobytes() for v in attributes["value"]], strict=True)),
        )

    def nodes(self) -> tuple[Node, ...]:
        """Every node as a value."""
        return _nodes(self.table, self.kernel, self.spans, self.attributes, self.copies, self.names, self.args)


def node_place(node: int, offset: int, what: str | None = None) -> str:
    """How a message names a place of a description: node ``node`` (``what`` it launches, where given), its
    argument byte ``offset``, or (:data:`DESTINATION`, :data:`SOURCE`) a memset's or memcpy's side."""
    place = {DESTINATION: "its destination", SOURCE: "its source"}.get(offset, f"argument byte {offset}")
    return f"node {node}{f' ({what[:80]})' if what else ''}, {place}"


def _address(value: int, where: str) -> int:
    if not 0 <= value < 2**64:
        raise _fail(where, "an address moved within 64 bits", hex(value))
    return value


def _counting(counts: np.ndarray) -> np.ndarray:
    """``0 .. n-1`` for each ``n`` of ``counts``, one after the other (``int64``)."""
    counts = counts.astype(np.int64)
    steps: np.ndarray = np.arange(int(counts.sum()), dtype=np.int64) - np.repeat(_starts(counts), counts)
    return steps


def _starts(counts: np.ndarray) -> np.ndarray:
    """Where each row's entries begin in a table of rows' entries one after the other (``int64``)."""
    ends = np.cumsum(counts, dtype=np.int64)
    return ends - counts.astype(np.int64)


_KERNEL, _MEMSET, _EMPTY, _MEMCPY = 0, 1, 2, 3
_NODE = np.dtype(
    [
        ("kind", "u1"),
        ("form", "u1"),
        ("pad", "<u2"),
        ("name", "<u4"),
        ("grid", "<u4", 3),
        ("block", "<u4", 3),
        ("shared", "<u4"),
        ("args", "<u4"),
        ("layout", "<u4"),
        ("attributes", "<u4"),
        ("memset", "<u8", 6),
    ]
)
_SPAN = np.dtype([("offset", "<u4"), ("size", "<u4")])
_ATTRIBUTE = np.dtype([("id", "<u4"), ("value", "u1", ATTRIBUTE_BYTES)])
_EDGE = np.dtype([("src", "<u4"), ("dst", "<u4"), ("data", "u1", EDGE_BYTES)])
_COPY = np.dtype("<u8")  # a memcpy node: its _MEMCPY_FIELDS in order, one row each


class _Tables:
    """Consecutive reads of a binary description, each one checked to be within it."""

    def __init__(self, data: memoryview) -> None:
        self.data = data
        self.at = 0

    def left(self) -> int:
        return len(self.data) - self.at

    def take(self, size: int, what: str) -> memoryview:
        if size > self.left():
            raise _fail(what, f"{size} bytes", f"{self.left()} bytes left in the description")
        out = self.data[self.at : self.at + size]
        self.at += size
        return out

    def array(self, dtype: np.dtype[Any], count: int, what: str) -> np.ndarray:
        return np.frombuffer(self.take(count * dtype.itemsize, what), dtype=dtype, count=count)


def _first(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def _check_tables(
    table: np.ndarray,
    kernel: np.ndarray,
    spans: np.ndarray,
    attributes: np.ndarray,
    edges: np.ndarray,
    copies: np.ndarray,
    n_names: int,
    arg_bytes: int,
) -> None:
    """Every count, index and span of the tables within what the description holds."""
    kinds = table["kind"]
    if (bad := kinds > _MEMCPY).any():
        raise _fail(f"node {_first(bad)} kind", "kernel, memset, memcpy or empty", int(kinds[_first(bad)]))
    if (listed := int((kinds == _MEMCPY).sum())) != len(copies):
        raise _fail("the memcpy nodes", f"the {len(copies)} the memcpy table holds", listed)
    for j, row in zip(np.flatnonzero(kinds == _MEMCPY).tolist(), copies.tolist(), strict=True):  # few: one a graph
        node = MemcpyNode(*row)
        if node.src_type not in MEMORY_TYPES or node.dst_type not in MEMORY_TYPES:
            raise _fail(f"node {j} memory types", "device (2) or unified (4)", [node.src_type, node.dst_type])
        if (problem := node.geometry_problem()) is not None:
            raise _fail(f"node {j} geometry", "rows and slices that do not overlap", problem)
    if (bad := kernel & (table["form"] >= len(LAUNCH_FORMS))).any():
        raise _fail(f"node {_first(bad)} launched_with", " or ".join(LAUNCH_FORMS), int(table["form"][_first(bad)]))
    if (bad := kernel & (table["name"] >= n_names)).any():
        raise _fail(f"node {_first(bad)} function", f"a name of the {n_names} listed", int(table["name"][_first(bad)]))
    counts = table[["args", "layout", "attributes"]]
    if (bad := ~kernel & ((table["args"] > 0) | (table["layout"] > 0) | (table["attributes"] > 0))).any():
        raise _fail(f"node {_first(bad)}", "no arguments, layout or attributes (it is no kernel)", counts[_first(bad)])
    if (bad := kernel & (table["form"] == LAUNCH_FORMS.index("buffer")) & (table["layout"] > 0)).any():
        raise _fail(f"node {_first(bad)} layout", "empty for an argument buffer", int(table["layout"][_first(bad)]))
    memset = kinds == _MEMSET
    if (bad := memset & ~np.isin(table["memset"][:, 3], (1, 2, 4))).any():
        raise _fail(f"node {_first(bad)} element_size", "1, 2 or 4", int(table["memset"][_first(bad), 3]))
    for field, total, what in (
        ("args", arg_bytes, "argument bytes"),
        ("layout", len(spans), "layout entries"),
        ("attributes", len(attributes), "attributes"),
    ):
        if (listed := int(table[field].sum(dtype=np.int64))) != total:
            raise _fail(f"the nodes' {what}", f"the {total} the description holds", listed)
    owner = np.repeat(np.arange(len(table)), table["layout"].astype(np.intp))
    ends = spans["offset"].astype(np.int64) + spans["size"].astype(np.int64)
    if (bad := ends > table["args"][owner]).any():
        j = _first(bad)
        raise _fail(f"node {int(owner[j])} layout", "within its argument bytes", spans[j].tolist())
    if (bad := (edges["src"] >= len(table)) | (edges["dst"] >= len(table))).any():
        raise _fail(f"edge {_first(bad)}", f"between the {len(table)} nodes", edges[_first(bad)][["src", "dst"]])


def _nodes(
    table: np.ndarray,
    kernel: np.ndarray,
    spans: np.ndarray,
    attributes: np.ndarray,
    copies: np.ndarray,
    names: list[str],
    args: memoryview,
) -> tuple[Node, ...]:
    """The nodes of checked tables (:func:`_check_tables`)."""
    arg_ends = np.cumsum(table["args"], dtype=np.int64).tolist()
    span_ends = np.cumsum(table["layout"], dtype=np.int64).tolist()
    attr_ends = np.cumsum(table["attributes"], dtype=np.int64).tolist()
    pairs = list(zip(spans["offset"].tolist(), spans["size"].tolist(), strict=True))
    ids, values = attributes["id"].tolist(), [v.tobytes() for v in attributes["value"]]
    rows = zip(
        table["kind"].tolist(),
        table["form"].tolist(),
        table["name"].tolist(),
        table["grid"].tolist(),
        table["block"].tolist(),
        table["shared"].tolist(),
        table["memset"].tolist(),
        strict=True,
    )
    nodes: list[Node] = []
    copy_rows = iter(copies.tolist())
    a = s = t = 0
    for i, (kind, form, name, grid, block, shared, memset) in enumerate(rows):
        if kind == _KERNEL:
            nodes.append(
                KernelNode(
                    function=names[name],
                    grid=(grid[0], grid[1], grid[2]),
                    block=(block[0], block[1], block[2]),
                    shared_bytes=shared,
                    args=bytes(args[a : arg_ends[i]]),
                    layout=tuple(pairs[s : span_ends[i]]),
                    launched_with=LAUNCH_FORMS[form],
                    attributes=tuple(zip(ids[t : attr_ends[i]], values[t : attr_ends[i]], strict=True)),
                )
            )
        elif kind == _MEMSET:
            nodes.append(MemsetNode(*memset))
        elif kind == _MEMCPY:
            nodes.append(MemcpyNode(*next(copy_rows)))
        else:
            nodes.append(EmptyNode())
        a, s, t = arg_ends[i], span_ends[i], attr_ends[i]
    return tuple(nodes)


def _edges(edges: np.ndarray) -> tuple[Edge, ...]:
    data = [d.tobytes() for d in edges["data"]]
    return tuple(
        Edge(src, dst, d) for src, dst, d in zip(edges["src"].tolist(), edges["dst"].tolist(), data, strict=True)
    )


_MEMSET_FIELDS = ("dst", "pitch", "value", "element_size", "width", "height")
_MEMCPY_FIELDS = tuple(f.name for f in attrs.fields(MemcpyNode))


def _node(raw: object, where: str) -> Node:
    kind = _fields(raw, where, ("kind",))["kind"]
    if kind == "empty":
        return EmptyNode()
    if kind == "memset":
        f = _fields(raw, where, _MEMSET_FIELDS)
        dst, pitch, value, element_size, width, height = (_int(f[n], f"{where} {n}") for n in _MEMSET_FIELDS)
        if element_size not in (1, 2, 4):
            raise _fail(f"{where} element_size", "1, 2 or 4", element_size)
        return MemsetNode(dst, pitch, value, element_size, width, height)
    if kind == "memcpy":
        f = _fields(raw, where, _MEMCPY_FIELDS)
        values = {n: _int(f[n], f"{where} {n}") for n in _MEMCPY_FIELDS}
        for side in ("src_type", "dst_type"):
            if values[side] not in MEMORY_TYPES:
                raise _fail(f"{where} {side}", "device (2) or unified (4)", values[side])
        node = MemcpyNode(**values)
        if (problem := node.geometry_problem()) is not None:
            raise _fail(f"{where} geometry", "rows and slices that do not overlap", problem)
        return node
    if kind != "kernel":
        raise _fail(f"{where} kind", "kernel, memset, memcpy or empty", kind)
    names = ("function", "grid", "block", "shared_bytes", "args", "layout", "launched_with", "attributes")
    f = _fields(raw, where, names)
    if not isinstance(f["function"], str) or not f["function"]:
        raise _fail(f"{where} function", "a kernel name", f["function"])
    if f["launched_with"] not in LAUNCH_FORMS:
        raise _fail(f"{where} launched_with", " or ".join(LAUNCH_FORMS), f["launched_with"])
    args = _hex(f["args"], f"{where} args")
    if not isinstance(f["layout"], list) or not isinstance(f["attributes"], list):
        raise _fail(f"{where} layout and attributes", "lists", (f["layout"], f["attributes"]))
    layout = []
    for j, span in enumerate(f["layout"]):
        if not isinstance(span, list) or len(span) != 2:
            raise _fail(f"{where} layout[{j}]", "[offset, size]", span)
        offset, size = _int(span[0], f"{where} layout[{j}]"), _int(span[1], f"{where} layout[{j}]")
        if offset + size > len(args):
            raise _fail(f"{where} layout[{j}]", f"within the {len(args)} argument bytes", span)
        layout.append((offset, size))
    if f["launched_with"] == "buffer" and layout:
        raise _fail(f"{where} layout", "empty for an argument buffer", f["layout"])
    attributes = []
    for j, pair in enumerate(f["attributes"]):
        if not isinstance(pair, list) or len(pair) != 2:
            raise _fail(f"{where} attributes[{j}]", "[id, value]", pair)
        attributes.append((_int(pair[0], f"{where} attributes[{j}]", _U32), _hex(pair[1], where, ATTRIBUTE_BYTES)))
    return KernelNode(
        function=f["function"],
        grid=_triple(f["grid"], f"{where} grid"),
        block=_triple(f["block"], f"{where} block"),
        shared_bytes=_int(f["shared_bytes"], f"{where} shared_bytes", _U32),
        args=args,
        layout=tuple(layout),
        launched_with=f["launched_with"],
        attributes=tuple(attributes),
    )


__all__ = [
    "ATTRIBUTE_BYTES",
    "BINARY_FORMAT",
    "BINARY_MAGIC",
    "DESTINATION",
    "EDGE_BYTES",
    "FORMAT",
    "IMAGE_MARK",
    "LAUNCH_FORMS",
    "MEMORY_TYPES",
    "DescriptionTables",
    "Edge",
    "EmptyNode",
    "GraphDescription",
    "KernelNode",
    "MemcpyNode",
    "MemsetNode",
    "Node",
    "SOURCE",
    "kernel_image",
    "kernel_name",
    "node_place",
    "pointer_words",
    "qualified",
]

"""A captured CUDA graph as values: what a later process needs to build the same graph node by node.

A :class:`GraphDescription` holds the graph's nodes in the driver's order and its edges by node index. A kernel
node (:class:`KernelNode`) is its function's name, its grid, block and dynamic shared memory, its launch attributes
and its argument bytes as the kernel reads them: either laid out parameter by parameter (``cuFuncGetParamInfo``'s
offsets and sizes, for a node launched with ``kernelParams``) or as one buffer (a node launched with ``extra``, the
form cuBLAS uses; its layout is unknown). A memset node is its destination and geometry; an empty node is nothing.
Edges carry the driver's 8 bytes of edge data (ports and type: a programmatic dependent launch has some).

:meth:`GraphDescription.to_json` and :meth:`GraphDescription.from_json` are the only serialization: plain JSON
(bytes as hex), read back with every field checked, so a description from a file or the keeper is never more than
data. Anything malformed is a :class:`~weightcache.errors.GraphDescriptionError` naming the field.
"""

from __future__ import annotations

from typing import Any, Literal

import attrs
import numpy as np

from .json_fields import FieldReader

#: The format of :meth:`GraphDescription.to_json`.
FORMAT = 1
#: How a kernel node's arguments were given at capture: ``params`` (``kernelParams``, one pointer per parameter;
#: :attr:`KernelNode.layout` holds their offsets and sizes) or ``buffer`` (``extra``: one argument buffer).
LAUNCH_FORMS = ("params", "buffer")
#: Bytes of one launch attribute's value (``CUlaunchAttributeValue`` is a 64-byte union) and of one edge's data.
ATTRIBUTE_BYTES = 64
EDGE_BYTES = 8
_U32 = 2**32


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
        function: the kernel's (mangled) name, as ``cuFuncGetName`` gives it.
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
        8-byte, 8-aligned parameter of a laid-out node; every 8-aligned 8-byte word of an argument buffer (its
        layout is unknown). Arrays, because a restore scans every word of every node of every graph."""
        every = np.frombuffer(self.args, dtype="<u8", count=len(self.args) // 8)
        if self.launched_with == "params":
            offsets = np.array([o for o, s in self.layout if s == 8 and o % 8 == 0], dtype=np.uint64)
            return offsets, every[(offsets // 8).astype(np.intp)]
        return np.arange(len(every), dtype=np.uint64) * 8, every


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


@attrs.frozen
class EmptyNode:
    """An empty node (a join point of the graph's dependencies)."""


Node = KernelNode | MemsetNode | EmptyNode


@attrs.frozen
class Edge:
    """A dependency: node :attr:`dst` runs after node :attr:`src` (indices into the nodes); :attr:`data` is the
    driver's edge data (``CUgraphEdgeData``, 8 bytes: ports and type)."""

    src: int
    dst: int
    data: bytes = bytes(EDGE_BYTES)


@attrs.frozen
class GraphDescription:
    """A graph's nodes (in the driver's order) and edges; see the module's text."""

    nodes: tuple[Node, ...]
    edges: tuple[Edge, ...] = ()

    def kernels(self) -> set[str]:
        """The names of the kernels the graph launches."""
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


_MEMSET_FIELDS = ("dst", "pitch", "value", "element_size", "width", "height")


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
    if kind != "kernel":
        raise _fail(f"{where} kind", "kernel, memset or empty", kind)
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
    "EDGE_BYTES",
    "FORMAT",
    "LAUNCH_FORMS",
    "Edge",
    "EmptyNode",
    "GraphDescription",
    "KernelNode",
    "MemsetNode",
    "Node",
]

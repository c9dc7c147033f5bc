"""What describing and rebuilding a CUDA graph needs of the CUDA driver: :class:`GraphDriver`, and its ``libcuda``
implementation :class:`CudaGraphDriver`.

The protocol is small and in plain values (handles as integers, a node as its :mod:`description` value), so
that :mod:`~weightcache.graphs.record` and :mod:`~weightcache.graphs.check` run the same against the real driver
on a GPU and against a driver of the tests' own on a CPU. :class:`CudaGraphDriver` declares each call's C signature
on the ``libcuda.so.1`` the process has loaded (``ctypes``, as :mod:`weightcache.segments.cuda_import` does): the
kernel-node parameters are read through raw pointers (``kernelParams`` is an array of pointers to each argument,
``extra`` a list of key/value pointers), which is what ``ctypes`` structures express directly. The calls were first
run on an H200 (driver 580.159.04, CUDA 13.0) by ``benchmarks/graph_probe.py``: a graph rebuilt from its
description replayed bitwise equal. Every method needs the graph's context current on the calling thread.
"""

from __future__ import annotations

import ctypes
import logging
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

import numpy as np

from ..errors import GraphRestoreError
from .bundle import IMAGE_ALIGNMENT
from .cupti_shim import load_shim
from .description import (
    ATTRIBUTE_BYTES,
    EDGE_BYTES,
    LAUNCH_FORMS,
    MEMORY_TYPES,
    EmptyNode,
    GraphDescription,
    KernelNode,
    MemcpyNode,
    MemsetNode,
    Node,
)

log = logging.getLogger("weightcache.graphs")

#: ``CUgraphNodeType`` values by name (the ones a graph of an engine can hold).
NODE_KINDS = {
    0: "kernel",
    1: "memcpy",
    2: "memset",
    3: "host",
    4: "child graph",
    5: "empty",
    6: "event wait",
    7: "event record",
    8: "external semaphore signal",
    9: "external semaphore wait",
    10: "memory allocation",
    11: "memory free",
    12: "batch memory operation",
    13: "conditional",
}
#: The launch attributes a kernel node can carry that a rebuild sets again (``CUlaunchAttributeID``): cooperative
#: (2), cluster dimension (4), cluster scheduling policy (5), priority (8).
LAUNCH_ATTRIBUTES = (2, 4, 5, 8)
#: ``CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`` and ``CU_FUNC_ATTRIBUTE_NON_PORTABLE_CLUSTER_SIZE_ALLOWED``:
#: what a library sets on its own function before launching it with much shared memory or a large cluster, and a
#: function loaded from a kept image lacks.
MAX_DYNAMIC_SHARED, NON_PORTABLE_CLUSTER = 8, 14
#: Dynamic shared memory a function may use without :data:`MAX_DYNAMIC_SHARED` (48 KiB).
DEFAULT_DYNAMIC_SHARED = 48 << 10
#: ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE`` (stored only where it was set, i.e. nonzero).
_COOPERATIVE = 2
#: ``CU_LAUNCH_PARAM_END``, ``CU_LAUNCH_PARAM_BUFFER_POINTER``, ``CU_LAUNCH_PARAM_BUFFER_SIZE`` (``extra``'s keys).
_PARAM_END, _PARAM_BUFFER, _PARAM_SIZE = 0, 1, 2
#: ``CU_POINTER_ATTRIBUTE_RANGE_START_ADDR`` and ``CU_POINTER_ATTRIBUTE_RANGE_SIZE``.
_RANGE_START, _RANGE_SIZE = 11, 12


class GraphDriver(Protocol):
    """The driver calls of :mod:`~weightcache.graphs.record` and :mod:`~weightcache.graphs.check`. Handles are
    integers; a failing call raises :class:`~weightcache.errors.GraphRestoreError`."""

    def graph_nodes(self, graph: int) -> list[int]:
        """The graph's nodes, in the driver's order."""
        ...

    def node_kind(self, node: int) -> str:
        """The node's type, as :data:`NODE_KINDS` names it."""
        ...

    def kernel_node(self, node: int) -> tuple[int, KernelNode]:
        """A kernel node's function handle, and the node as a description holds it."""
        ...

    def memset_node(self, node: int) -> MemsetNode:
        """A memset node's parameters."""
        ...

    def memcpy_node(self, node: int) -> MemcpyNode:
        """A memcpy node's parameters; :class:`~weightcache.errors.GraphRestoreError` for a copy from or to host
        memory or an array (no later process has them at the same address), and for a geometry a description does
        not hold (:meth:`~weightcache.graphs.description.MemcpyNode.geometry_problem`; an offset on an axis
        whose pitch or height is 0)."""
        ...

    def graph_edges(self, graph: int) -> list[tuple[int, int, bytes]]:
        """Every edge: (from node, to node, its 8 bytes of edge data)."""
        ...

    def pointer_range(self, address: int) -> tuple[int, int] | None:
        """The start and size of the device allocation holding ``address``; None where it is no device address."""
        ...

    def module_functions(self, function: int) -> dict[str, int]:
        """Every function of the module that holds ``function``, by name."""
        ...

    def function_module(self, function: int) -> int:
        """The handle of the module that holds ``function`` (``cuFuncGetModule``)."""
        ...

    def create_graph(self) -> int:
        """A new, empty graph."""
        ...

    def add_kernel_node(self, graph: int, function: int, node: KernelNode) -> int:
        """A kernel node launching ``function`` as ``node`` says (geometry, argument bytes, attributes)."""
        ...

    def add_memset_node(self, graph: int, node: MemsetNode) -> int:
        """A memset node."""
        ...

    def add_memcpy_node(self, graph: int, node: MemcpyNode) -> int:
        """A memcpy node."""
        ...

    def add_empty_node(self, graph: int) -> int:
        """An empty node."""
        ...

    def add_edges(self, graph: int, edges: Sequence[tuple[int, int, bytes]]) -> None:
        """Dependencies between nodes of ``graph``, with their edge data."""
        ...

    def add_description(self, graph: int, description: GraphDescription, functions: Mapping[str, int]) -> None:
        """Every node of ``description`` (in its order; each kernel launching ``functions[name]``) and every edge
        added to the empty ``graph``. :func:`~weightcache.graphs.record.add_each` does it call by call, through
        the methods above; :class:`CudaGraphDriver` from the description's tables, without a Python value per
        node."""
        ...

    def destroy_graph(self, graph: int) -> None:
        """Free a graph this driver created (errors ignored)."""
        ...


def add_node(driver: GraphDriver, graph: int, node: Node, functions: Mapping[str, int]) -> int:
    """``node`` added to ``graph`` through the driver's method for its kind (a kernel launching
    ``functions[name]``); its handle."""
    if isinstance(node, KernelNode):
        return driver.add_kernel_node(graph, functions[node.function], node)
    if isinstance(node, MemsetNode):
        return driver.add_memset_node(graph, node)
    if isinstance(node, MemcpyNode):
        return driver.add_memcpy_node(graph, node)
    assert isinstance(node, EmptyNode)
    return driver.add_empty_node(graph)


class RestoreDriver(GraphDriver, Protocol):
    """What a restore needs beyond :class:`GraphDriver`: executable graphs, and modules loaded from kept images
    (:mod:`~weightcache.graphs.cubins`)."""

    def instantiate(self, graph: int) -> int:
        """An executable graph of ``graph`` (``cuGraphInstantiateWithFlags``)."""
        ...

    def launch(self, executable: int, stream: int) -> None:
        """Launch an executable graph on ``stream``."""
        ...

    def destroy_executable(self, executable: int) -> None:
        """Free an executable graph (errors ignored)."""
        ...

    def load_module(self, image: bytes | memoryview) -> int:
        """A module of this process loaded from a cubin ``image`` (``cuModuleLoadData``)."""
        ...

    def module_function(self, module: int, name: str) -> int | None:
        """The function ``name`` of ``module``; None where the module has none of that name."""
        ...

    def unload_module(self, module: int) -> None:
        """Unload a module :meth:`load_module` loaded (``cuModuleUnload``); no graph may use its functions then."""
        ...

    def set_function_attribute(self, function: int, attribute: int, value: int) -> None:
        """``cuFuncSetAttribute`` (e.g. :data:`MAX_DYNAMIC_SHARED` before a node asks for more shared memory than
        a function gets by default)."""
        ...


def _address_of(image: bytes | memoryview) -> bytes | ctypes.c_void_p:
    """What ctypes passes as a pointer to ``image``'s bytes: bytes as they are (Python aligns and NUL-ends them); a
    view (of an artifact's mapping, whose images start :data:`IMAGE_ALIGNMENT`-aligned) as a pointer into it, which
    keeps the view alive; a view that is not so aligned copied (the driver's loader is not promised to read
    unaligned images)."""
    if isinstance(image, bytes):
        return image
    array = np.frombuffer(image, dtype=np.uint8)
    if array.ctypes.data % IMAGE_ALIGNMENT:
        return array.tobytes()
    return array.ctypes.data_as(ctypes.c_void_p)


class KernelNodeParams(ctypes.Structure):
    """``CUDA_KERNEL_NODE_PARAMS_v2`` (cuda.h): a kernel node's function, grid, block, dynamic shared memory and
    arguments (``kernelParams``, a pointer to each parameter, or ``extra``, key/value pointers), as the driver's
    kernel-node calls take and give them."""

    _fields_ = [
        ("func", ctypes.c_void_p),
        ("gridDimX", ctypes.c_uint),
        ("gridDimY", ctypes.c_uint),
        ("gridDimZ", ctypes.c_uint),
        ("blockDimX", ctypes.c_uint),
        ("blockDimY", ctypes.c_uint),
        ("blockDimZ", ctypes.c_uint),
        ("sharedMemBytes", ctypes.c_uint),
        ("kernelParams", ctypes.POINTER(ctypes.c_void_p)),
        ("extra", ctypes.POINTER(ctypes.c_void_p)),
        ("kern", ctypes.c_void_p),
        ("ctx", ctypes.c_void_p),
    ]


#: :class:`KernelNodeParams` as a numpy record, at the same offsets: many nodes' parameters made at once.
_KERNEL_PARAMS = np.dtype(
    {
        "names": ["func", "grid", "block", "shared", "params", "extra", "kern", "ctx"],
        "formats": ["<u8", ("<u4", 3), ("<u4", 3), "<u4", "<u8", "<u8", "<u8", "<u8"],
        "offsets": [
            KernelNodeParams.func.offset,
            KernelNodeParams.gridDimX.offset,
            KernelNodeParams.blockDimX.offset,
            KernelNodeParams.sharedMemBytes.offset,
            KernelNodeParams.kernelParams.offset,
            KernelNodeParams.extra.offset,
            KernelNodeParams.kern.offset,
            KernelNodeParams.ctx.offset,
        ],
        "itemsize": ctypes.sizeof(KernelNodeParams),
    }
)


class _MemsetParams(ctypes.Structure):
    """``CUDA_MEMSET_NODE_PARAMS``."""

    _fields_ = [
        ("dst", ctypes.c_uint64),
        ("pitch", ctypes.c_size_t),
        ("value", ctypes.c_uint),
        ("elementSize", ctypes.c_uint),
        ("width", ctypes.c_size_t),
        ("height", ctypes.c_size_t),
    ]


#: ``CUDA_MEMSET_NODE_PARAMS`` as a row of a numpy table (the same layout as :class:`_MemsetParams`), its fields in
#: the order of a description's memset fields (``MemsetNode``'s).
_MEMSET_PARAMS = np.dtype(
    [("dst", "<u8"), ("pitch", "<u8"), ("value", "<u4"), ("elementSize", "<u4"), ("width", "<u8"), ("height", "<u8")]
)


class _Memcpy3D(ctypes.Structure):
    """``CUDA_MEMCPY3D`` (``_v2``)."""

    _fields_ = [
        ("srcXInBytes", ctypes.c_size_t),
        ("srcY", ctypes.c_size_t),
        ("srcZ", ctypes.c_size_t),
        ("srcLOD", ctypes.c_size_t),
        ("srcMemoryType", ctypes.c_int),
        ("srcHost", ctypes.c_void_p),
        ("srcDevice", ctypes.c_uint64),
        ("srcArray", ctypes.c_void_p),
        ("reserved0", ctypes.c_void_p),
        ("srcPitch", ctypes.c_size_t),
        ("srcHeight", ctypes.c_size_t),
        ("dstXInBytes", ctypes.c_size_t),
        ("dstY", ctypes.c_size_t),
        ("dstZ", ctypes.c_size_t),
        ("dstLOD", ctypes.c_size_t),
        ("dstMemoryType", ctypes.c_int),
        ("dstHost", ctypes.c_void_p),
        ("dstDevice", ctypes.c_uint64),
        ("dstArray", ctypes.c_void_p),
        ("reserved1", ctypes.c_void_p),
        ("dstPitch", ctypes.c_size_t),
        ("dstHeight", ctypes.c_size_t),
        ("WidthInBytes", ctypes.c_size_t),
        ("Height", ctypes.c_size_t),
        ("Depth", ctypes.c_size_t),
    ]


#: ``CU_MEMORYTYPE_HOST`` and ``CU_MEMORYTYPE_ARRAY``, by name (for the error of a copy that is not described).
_OTHER_MEMORY = {1: "host memory", 3: "an array"}


def _first_byte(device: int, x: int, y: int, z: int, pitch: int, height: int) -> int:
    """Where a side of a ``CUDA_MEMCPY3D`` starts: its base address with its X, Y and Z offsets (``cuMemcpy3D``:
    ``device + (z * height + y) * pitch + x``)."""
    return device + (z * height + y) * pitch + x


_p = ctypes.c_void_p
_pp = ctypes.POINTER(ctypes.c_void_p)
_ps = ctypes.POINTER(ctypes.c_size_t)
_SIGNATURES: dict[str, list[Any]] = {
    "cuGraphGetNodes": [_p, ctypes.POINTER(_p), _ps],
    "cuGraphNodeGetType": [_p, ctypes.POINTER(ctypes.c_int)],
    "cuGraphKernelNodeGetParams_v2": [_p, ctypes.POINTER(KernelNodeParams)],
    "cuGraphKernelNodeGetAttribute": [_p, ctypes.c_int, ctypes.c_char_p],
    "cuGraphKernelNodeSetAttribute": [_p, ctypes.c_int, ctypes.c_char_p],
    "cuGraphMemsetNodeGetParams": [_p, ctypes.POINTER(_MemsetParams)],
    "cuGraphMemcpyNodeGetParams": [_p, ctypes.POINTER(_Memcpy3D)],
    "cuGraphGetEdges_v2": [_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_char_p, _ps],
    "cuFuncGetName": [ctypes.POINTER(ctypes.c_char_p), _p],
    "cuFuncGetParamInfo": [_p, ctypes.c_size_t, _ps, _ps],
    "cuFuncGetModule": [ctypes.POINTER(_p), _p],
    "cuModuleGetFunctionCount": [ctypes.POINTER(ctypes.c_uint), _p],
    "cuModuleEnumerateFunctions": [ctypes.POINTER(_p), ctypes.c_uint, _p],
    "cuPointerGetAttribute": [_p, ctypes.c_int, ctypes.c_uint64],
    "cuGraphCreate": [ctypes.POINTER(_p), ctypes.c_uint],
    "cuGraphDestroy": [_p],
    "cuGraphAddKernelNode_v2": [_pp, _p, _pp, ctypes.c_size_t, ctypes.POINTER(KernelNodeParams)],
    "cuGraphAddMemsetNode": [_pp, _p, _pp, ctypes.c_size_t, ctypes.POINTER(_MemsetParams), _p],
    "cuGraphAddMemcpyNode": [_pp, _p, _pp, ctypes.c_size_t, ctypes.POINTER(_Memcpy3D), _p],
    "cuGraphAddEmptyNode": [ctypes.POINTER(_p), _p, ctypes.POINTER(_p), ctypes.c_size_t],
    "cuGraphAddDependencies_v2": [_p, ctypes.POINTER(_p), ctypes.POINTER(_p), ctypes.c_char_p, ctypes.c_size_t],
    "cuCtxGetCurrent": [ctypes.POINTER(_p)],
    "cuGetErrorName": [ctypes.c_int, ctypes.POINTER(ctypes.c_char_p)],
    "cuGraphInstantiateWithFlags": [ctypes.POINTER(_p), _p, ctypes.c_ulonglong],
    "cuGraphLaunch": [_p, _p],
    "cuGraphExecDestroy": [_p],
    "cuModuleLoadData": [ctypes.POINTER(_p), _p],  # bytes, or a pointer into a mapped artifact (_address_of)
    "cuModuleGetFunction": [ctypes.POINTER(_p), _p, ctypes.c_char_p],
    "cuModuleUnload": [_p],
    "cuFuncSetAttribute": [_p, ctypes.c_int, ctypes.c_int],
    "cuCtxSetCurrent": [_p],
}  # fmt: skip


class CudaGraphDriver:
    """:class:`GraphDriver` on ``libcuda`` (CUDA 12.4 or later: module enumeration and edge data). Raises
    :class:`~weightcache.errors.GraphRestoreError` when the library or a call is missing, or a call fails."""

    def __init__(self, lib: ctypes.CDLL | None = None) -> None:
        try:
            lib = lib if lib is not None else ctypes.CDLL("libcuda.so.1")
            for name, argtypes in _SIGNATURES.items():
                fn = getattr(lib, name)
                fn.argtypes = argtypes
                fn.restype = ctypes.c_int
        except (OSError, AttributeError) as exc:
            raise GraphRestoreError(
                f"the CUDA driver cannot describe or rebuild graphs here ({exc}); it needs libcuda.so.1 of CUDA "
                "12.4 or later (module enumeration, edge data). Graphs are captured as usual"
            ) from None
        self._lib = lib
        # cuGraphAddKernelNode_v2 again, taking the parameters' address as a plain integer (add_description)
        self._add_kernel_address = ctypes.cast(lib.cuGraphAddKernelNode_v2, _p).value or 0
        self._add_kernel_at = ctypes.CFUNCTYPE(ctypes.c_int, _pp, _p, _pp, ctypes.c_size_t, _p)(
            self._add_kernel_address
        )
        self._set_attribute_address = ctypes.cast(lib.cuGraphKernelNodeSetAttribute, _p).value or 0
        self._add_memset_address = ctypes.cast(lib.cuGraphAddMemsetNode, _p).value or 0
        self._loop: Any = None  # wc_add_nodes of weightcache's native library (_native_loop)
        self._loop_tried = False

    def _native_loop(self) -> Any:
        """``wc_add_nodes`` of weightcache's native library (:mod:`~weightcache.graphs.cupti_shim`), which adds a run
        of kernel and memset nodes, and sets the kernel nodes' launch attributes, in one call, letting go of the GIL
        once; None where the library cannot be built or loaded here (then one ``ctypes`` call a node and
        attribute, as before). Asked once a driver."""
        if not self._loop_tried:
            self._loop_tried = True
            try:
                self._loop = load_shim().wc_add_nodes
            except Exception as exc:  # (never the restore's problem: one call a node works everywhere)
                log.info("weightcache: graph nodes are added one call a node (%s: %s)", type(exc).__name__, exc)
        return self._loop

    def _call(self, name: str, *args: Any) -> None:
        try:
            code = getattr(self._lib, name)(*args)
        except ctypes.ArgumentError as exc:  # a binding that does not fit: the graph is captured, the engine starts
            raise GraphRestoreError(f"{name} could not be called: ctypes refused its arguments ({exc})") from None
        if code != 0:
            raise self._failed(name, code)

    def _failed(self, name: str, code: int) -> GraphRestoreError:
        text = ctypes.c_char_p()
        known = self._lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value
        return GraphRestoreError(f"{name} failed: {text.value.decode() if known and text.value else code}")

    def graph_nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetNodes", _p(graph), None, ctypes.byref(count))
        nodes = (_p * max(count.value, 1))()
        self._call("cuGraphGetNodes", _p(graph), nodes, ctypes.byref(count))
        return [int(nodes[i] or 0) for i in range(count.value)]

    def node_kind(self, node: int) -> str:
        kind = ctypes.c_int()
        self._call("cuGraphNodeGetType", _p(node), ctypes.byref(kind))
        return NODE_KINDS.get(kind.value, f"type {kind.value}")

    def function_name(self, function: int) -> str:
        name = ctypes.c_char_p()
        self._call("cuFuncGetName", ctypes.byref(name), _p(function))
        return (name.value or b"").decode()

    def _layout(self, function: int) -> list[tuple[int, int]]:
        layout = []
        for index in range(4096):  # cuFuncGetParamInfo fails past the last parameter
            offset, size = ctypes.c_size_t(), ctypes.c_size_t()
            if self._lib.cuFuncGetParamInfo(_p(function), index, ctypes.byref(offset), ctypes.byref(size)) != 0:
                break
            layout.append((offset.value, size.value))
        return layout

    def kernel_node(self, node: int) -> tuple[int, KernelNode]:
        p = KernelNodeParams()
        self._call("cuGraphKernelNodeGetParams_v2", _p(node), ctypes.byref(p))
        function = int(p.func or 0)
        name = self.function_name(function)
        layout: list[tuple[int, int]] = []
        if p.kernelParams:
            layout = self._layout(function)
            args = bytearray(max((o + s for o, s in layout), default=0))
            for i, (offset, size) in enumerate(layout):
                args[offset : offset + size] = ctypes.string_at(p.kernelParams[i], size)
            launched_with = "params"
        else:  # ``extra``: key/value pointers up to CU_LAUNCH_PARAM_END (cuBLAS launches its GEMMs so)
            buffer, length, i = None, 0, 0
            while p.extra and p.extra[i]:
                key, value = p.extra[i], p.extra[i + 1]
                if key == _PARAM_BUFFER:
                    buffer = value
                elif key == _PARAM_SIZE and value:
                    length = ctypes.c_size_t.from_address(value).value
                i += 2
            if buffer is None:
                raise GraphRestoreError(f"the kernel node of {name} has neither kernelParams nor an argument buffer")
            args = bytearray(ctypes.string_at(buffer, length))
            launched_with = "buffer"
        attributes = []
        for attribute in LAUNCH_ATTRIBUTES:
            value = ctypes.create_string_buffer(ATTRIBUTE_BYTES)
            if self._lib.cuGraphKernelNodeGetAttribute(_p(node), attribute, value) == 0 and any(value.raw):
                attributes.append((attribute, value.raw))
        described = KernelNode(
            function=name,
            grid=(p.gridDimX, p.gridDimY, p.gridDimZ),
            block=(p.blockDimX, p.blockDimY, p.blockDimZ),
            shared_bytes=p.sharedMemBytes,
            args=bytes(args),
            layout=tuple(layout),
            launched_with=launched_with,  # type: ignore[arg-type]
            attributes=tuple(attributes),
        )
        return function, described

    def memset_node(self, node: int) -> MemsetNode:
        m = _MemsetParams()
        self._call("cuGraphMemsetNodeGetParams", _p(node), ctypes.byref(m))
        return MemsetNode(m.dst, m.pitch, m.value, m.elementSize, m.width, m.height)

    def memcpy_node(self, node: int) -> MemcpyNode:
        m = _Memcpy3D()
        self._call("cuGraphMemcpyNodeGetParams", _p(node), ctypes.byref(m))
        for side, kind in (("source", m.srcMemoryType), ("destination", m.dstMemoryType)):
            if kind not in MEMORY_TYPES:
                what = _OTHER_MEMORY.get(kind, f"memory type {kind}")
                raise GraphRestoreError(
                    f"a memcpy node's {side} is {what}, which no later process has at the same address; this graph "
                    "is captured as usual"
                )
        if m.srcLOD or m.dstLOD:
            raise GraphRestoreError("a memcpy node has a level of detail (an array copy); this graph is captured")
        for side, (y, z, pitch, height) in (
            ("source", (m.srcY, m.srcZ, m.srcPitch, m.srcHeight)),
            ("destination", (m.dstY, m.dstZ, m.dstPitch, m.dstHeight)),
        ):
            if ((y or z) and not pitch) or (z and not height):  # cuMemcpy3D may read 0 as "not given"
                raise GraphRestoreError(
                    f"a memcpy node's {side} has Y/Z offsets {y}/{z} with pitch {pitch} and height {height}: where "
                    "it starts is ambiguous; this graph is captured as usual"
                )
        described = MemcpyNode(
            src=_first_byte(m.srcDevice, m.srcXInBytes, m.srcY, m.srcZ, m.srcPitch, m.srcHeight),
            dst=_first_byte(m.dstDevice, m.dstXInBytes, m.dstY, m.dstZ, m.dstPitch, m.dstHeight),
            width=m.WidthInBytes,
            height=m.Height,
            depth=m.Depth,
            src_pitch=m.srcPitch,
            src_height=m.srcHeight,
            dst_pitch=m.dstPitch,
            dst_height=m.dstHeight,
            src_type=m.srcMemoryType,
            dst_type=m.dstMemoryType,
        )
        if (problem := described.geometry_problem()) is not None:
            raise GraphRestoreError(f"a memcpy node copies {problem}: overlapping rows or slices; captured as usual")
        return described

    def graph_edges(self, graph: int) -> list[tuple[int, int, bytes]]:
        # without an edge-data array the query fails with CUDA_ERROR_LOSSY_QUERY when any edge carries data
        count = ctypes.c_size_t(0)
        self._call("cuGraphGetEdges_v2", _p(graph), None, None, None, ctypes.byref(count))
        n = count.value
        if n == 0:  # asked again with room for no edge, the driver answers CUDA_ERROR_INVALID_VALUE
            return []
        src, dst, data = (_p * n)(), (_p * n)(), ctypes.create_string_buffer(EDGE_BYTES * n)
        self._call("cuGraphGetEdges_v2", _p(graph), src, dst, data, ctypes.byref(count))
        raw = data.raw
        return [
            (int(src[i] or 0), int(dst[i] or 0), raw[EDGE_BYTES * i : EDGE_BYTES * (i + 1)]) for i in range(count.value)
        ]

    def pointer_range(self, address: int) -> tuple[int, int] | None:
        start, size = ctypes.c_uint64(), ctypes.c_size_t()
        if self._lib.cuPointerGetAttribute(ctypes.byref(start), _RANGE_START, address) != 0:
            return None
        if self._lib.cuPointerGetAttribute(ctypes.byref(size), _RANGE_SIZE, address) != 0:
            return None
        return int(start.value), int(size.value)

    def function_module(self, function: int) -> int:
        module = _p()
        self._call("cuFuncGetModule", ctypes.byref(module), _p(function))
        return int(module.value or 0)

    def module_functions(self, function: int) -> dict[str, int]:
        module, count = _p(), ctypes.c_uint()
        self._call("cuFuncGetModule", ctypes.byref(module), _p(function))
        self._call("cuModuleGetFunctionCount", ctypes.byref(count), module)
        functions = (_p * max(count.value, 1))()
        self._call("cuModuleEnumerateFunctions", functions, count, module)
        handles = [int(functions[i] or 0) for i in range(count.value)]
        return {self.function_name(h): h for h in handles}

    def create_graph(self) -> int:
        graph = _p()
        self._call("cuGraphCreate", ctypes.byref(graph), 0)
        return int(graph.value or 0)

    def destroy_graph(self, graph: int) -> None:
        self._lib.cuGraphDestroy(_p(graph))

    def add_kernel_node(self, graph: int, function: int, node: KernelNode) -> int:
        # every node's arguments as one buffer (CU_LAUNCH_PARAM_BUFFER_POINTER), whichever way they were given (but
        # a cooperative kernel's, below): the bytes are what the kernel reads, and the driver copies them into the
        # node, so the description's own bytes are passed where they lie. A restore adds every node of every graph
        # here: few ctypes objects per node (its Python cost, and what it feeds the garbage collector)
        args = node.args
        size = ctypes.c_size_t(len(args))
        buffer = ctypes.cast(ctypes.c_char_p(args), _p).value  # the bytes' own storage (node.args outlives the call)
        if node.layout and node.launched_with == "params" and any(a == _COOPERATIVE for a, _ in node.attributes):
            # cuda.h: CUDA_ERROR_INVALID_VALUE "if extra is used for a cooperative kernel" (documented for the add;
            # the attribute is set after it, and whether the driver checks then is not known): one pointer per
            # parameter into the same bytes, as it was captured, which is valid for every kernel
            params = (_p * len(node.layout))(*[(buffer or 0) + offset for offset, _ in node.layout])
            p = KernelNodeParams(function, *node.grid, *node.block, node.shared_bytes, params, None)
        else:
            extra = (_p * 5)(_PARAM_BUFFER, buffer, _PARAM_SIZE, ctypes.addressof(size), _PARAM_END)
            p = KernelNodeParams(function, *node.grid, *node.block, node.shared_bytes, None, extra)
        out = _p()
        self._call("cuGraphAddKernelNode_v2", ctypes.byref(out), _p(graph), None, 0, ctypes.byref(p))
        for attribute, value in node.attributes:
            self._call("cuGraphKernelNodeSetAttribute", out, attribute, value)
        return int(out.value or 0)

    def add_memset_node(self, graph: int, node: MemsetNode) -> int:
        m = _MemsetParams(node.dst, node.pitch, node.value, node.element_size, node.width, node.height)
        out = _p()
        ctx = _p(self.current_context())
        self._call("cuGraphAddMemsetNode", ctypes.byref(out), _p(graph), None, 0, ctypes.byref(m), ctx)
        return int(out.value or 0)

    def add_memcpy_node(self, graph: int, node: MemcpyNode) -> int:
        m = _Memcpy3D(
            srcMemoryType=node.src_type,
            srcDevice=node.src,
            srcPitch=node.src_pitch,
            srcHeight=node.src_height,
            dstMemoryType=node.dst_type,
            dstDevice=node.dst,
            dstPitch=node.dst_pitch,
            dstHeight=node.dst_height,
            WidthInBytes=node.width,
            Height=node.height,
            Depth=node.depth,
        )
        out = _p()
        ctx = _p(self.current_context())
        self._call("cuGraphAddMemcpyNode", ctypes.byref(out), _p(graph), None, 0, ctypes.byref(m), ctx)
        return int(out.value or 0)

    def add_empty_node(self, graph: int) -> int:
        out = _p()
        self._call("cuGraphAddEmptyNode", ctypes.byref(out), _p(graph), None, 0)
        return int(out.value or 0)

    def instantiate(self, graph: int) -> int:
        executable = _p()
        self._call("cuGraphInstantiateWithFlags", ctypes.byref(executable), _p(graph), 0)
        return int(executable.value or 0)

    def launch(self, executable: int, stream: int) -> None:
        self._call("cuGraphLaunch", _p(executable), _p(stream))

    def destroy_executable(self, executable: int) -> None:
        self._lib.cuGraphExecDestroy(_p(executable))

    def load_module(self, image: bytes | memoryview) -> int:
        module = _p()
        self._call("cuModuleLoadData", ctypes.byref(module), _address_of(image))
        return int(module.value or 0)

    def module_function(self, module: int, name: str) -> int | None:
        function = _p()
        if self._lib.cuModuleGetFunction(ctypes.byref(function), _p(module), name.encode()) != 0:
            return None
        return int(function.value or 0)

    def set_function_attribute(self, function: int, attribute: int, value: int) -> None:
        self._call("cuFuncSetAttribute", _p(function), attribute, value)

    def unload_module(self, module: int) -> None:
        self._call("cuModuleUnload", _p(module))

    def current_context(self) -> int:
        """The context current on this thread (0: none)."""
        ctx = _p()
        self._call("cuCtxGetCurrent", ctypes.byref(ctx))
        return int(ctx.value or 0)

    def make_current(self, context: int) -> None:
        """Make ``context`` current on this thread (for module loads on a worker thread)."""
        self._call("cuCtxSetCurrent", _p(context))

    def add_description(self, graph: int, description: GraphDescription, functions: Mapping[str, int]) -> None:
        # From the tables: every kernel node's CUDA_KERNEL_NODE_PARAMS_v2 and its `extra` (argument buffer pointer
        # into the description's own bytes, its size, end) and every memset node's parameters made as arrays, then
        # each run of such nodes added, and the kernels' launch attributes set, in one call of the native loop; the
        # edges in one call. A laid-out cooperative node (kernelParams, see add_kernel_node), a memcpy and an empty
        # node go through the methods one node at a time, as every node does where the loop cannot be had.
        t = description.tables
        n = len(t.table)
        fast = t.kernel.copy()
        owner = np.repeat(np.arange(n), t.table["attributes"].astype(np.intp))
        cooperative = np.zeros(n, dtype=bool)
        cooperative[owner[t.attributes["id"] == _COOPERATIVE]] = True
        fast &= ~(cooperative & (t.table["form"] == LAUNCH_FORMS.index("params")) & (t.table["layout"] > 0))
        rows = np.flatnonzero(fast)
        selected = t.table[rows]
        handles = np.array([functions.get(name, 0) for name in t.names], dtype=np.uint64)
        params = np.zeros(len(rows), dtype=_KERNEL_PARAMS)
        params["func"] = handles[selected["name"].astype(np.intp)]
        params["grid"], params["block"], params["shared"] = selected["grid"], selected["block"], selected["shared"]
        args = np.frombuffer(t.args, dtype=np.uint8)  # the bytes where they lie (the driver copies them)
        sizes = selected["args"].astype(np.uint64)  # size_t, read through a pointer
        extra = np.empty((len(rows), 5), dtype=np.uint64)
        extra[:, 0], extra[:, 2], extra[:, 4] = _PARAM_BUFFER, _PARAM_SIZE, _PARAM_END
        extra[:, 1] = args.ctypes.data + t.arg_starts[rows].astype(np.uint64)
        extra[:, 3] = sizes.ctypes.data + 8 * np.arange(len(rows), dtype=np.uint64)
        params["extra"] = extra.ctypes.data + extra.strides[0] * np.arange(len(rows), dtype=np.uint64)
        slot = np.full(n, -1, dtype=np.int64)
        slot[rows] = np.arange(len(rows))
        add, at, size = self._add_kernel_at, params.ctypes.data, params.itemsize
        out = _p()
        where, g = ctypes.byref(out), _p(graph)
        made: list[int] = []
        slots, counts = slot.tolist(), t.table["attributes"].tolist()
        loop = self._native_loop()
        # for the loop: each node's attribute count, the attribute rows (id, then the value at its offset), and the
        # memset nodes' CUDA_MEMSET_NODE_PARAMS, one row each in the nodes' order
        counts32 = t.table["attributes"].astype(np.uint32)
        attribute_rows = np.ascontiguousarray(t.attributes)
        rows_at, row = attribute_rows.ctypes.data, attribute_rows.dtype.itemsize
        fields = attribute_rows.dtype.fields
        # (what the loop reads of a row: a 32-bit id first, the 64-byte value at value_at)
        assert fields is not None and fields["id"][1] == 0 and fields["id"][0].itemsize == 4
        assert fields["value"][0].itemsize == ATTRIBUTE_BYTES == 64
        value_at = int(fields["value"][1])
        memset_rows = np.flatnonzero(t.memset)
        memsets = np.zeros(len(memset_rows), dtype=_MEMSET_PARAMS)
        for k, name in enumerate(_MEMSET_PARAMS.names or ()):
            memsets[name] = t.table["memset"][memset_rows, k]
        memset_slot = np.full(n, -1, dtype=np.int64)
        memset_slot[memset_rows] = np.arange(len(memset_rows))
        batched = fast | t.memset  # what the loop adds
        kinds = t.memset.astype(np.uint8)
        context = self.current_context() if len(memset_rows) and loop is not None else 0
        batched_list, memset_slots = batched.tolist(), memset_slot.tolist()
        i = 0
        while i < n:
            j, attributes = slots[i], counts[i]
            if batched_list[i] and loop is not None:  # a run of kernel and memset nodes in one call, without the GIL
                end = i + 1
                while end < n and batched_list[end]:
                    end += 1
                kernel = next((slots[k] for k in range(i, end) if slots[k] >= 0), 0)
                memset = next((memset_slots[k] for k in range(i, end) if memset_slots[k] >= 0), 0)
                nodes, failed, which = np.zeros(end - i, dtype=np.uint64), ctypes.c_size_t(0), ctypes.c_int(0)
                code = loop(self._add_kernel_address, self._set_attribute_address, self._add_memset_address, graph,
                            context, kinds[i:end].ctypes.data, end - i, at + size * kernel, size,
                            counts32[i:end].ctypes.data, rows_at + row * int(t.attribute_starts[i]), row, value_at,
                            memsets.ctypes.data + memsets.itemsize * memset, memsets.itemsize, nodes.ctypes.data,
                            ctypes.byref(failed), ctypes.byref(which))  # fmt: skip
                if code != 0:
                    call = ("cuGraphAddKernelNode_v2", "cuGraphKernelNodeSetAttribute", "cuGraphAddMemsetNode")
                    failure = self._failed(call[which.value], code)
                    raise GraphRestoreError(f"{failure} (node {i + failed.value} of the graph)")
                made.extend(nodes.tolist())
                i = end
            elif j < 0:  # one node at a time
                made.append(add_node(self, graph, t.node(i), functions))
                i += 1
            else:
                code = add(where, g, None, 0, at + size * j)
                if code != 0:
                    raise GraphRestoreError(f"{self._failed('cuGraphAddKernelNode_v2', code)} (node {i} of the graph)")
                if attributes:
                    first = int(t.attribute_starts[i])
                    for k in range(first, first + attributes):
                        value = t.attributes[k]
                        try:
                            self._call("cuGraphKernelNodeSetAttribute", out, int(value["id"]), value["value"].tobytes())
                        except GraphRestoreError as exc:
                            raise GraphRestoreError(f"{exc} (node {i} of the graph)") from None
                made.append(int(out.value or 0))
                i += 1
        if len(t.edges):
            nodes = np.array(made, dtype=np.uint64)
            src = np.ascontiguousarray(nodes[t.edges["src"].astype(np.intp)])
            dst = np.ascontiguousarray(nodes[t.edges["dst"].astype(np.intp)])
            data = np.ascontiguousarray(t.edges["data"]).tobytes()
            pointers = ctypes.POINTER(_p)
            self._call(
                "cuGraphAddDependencies_v2", g, src.ctypes.data_as(pointers), dst.ctypes.data_as(pointers), data,
                len(t.edges),
            )  # fmt: skip

    def add_edges(self, graph: int, edges: Sequence[tuple[int, int, bytes]]) -> None:
        if not edges:
            return
        n = len(edges)
        src = (_p * n)(*[_p(a) for a, _, _ in edges])
        dst = (_p * n)(*[_p(b) for _, b, _ in edges])
        data = ctypes.create_string_buffer(b"".join(d for _, _, d in edges), EDGE_BYTES * n)
        self._call("cuGraphAddDependencies_v2", _p(graph), src, dst, data, n)


__all__ = [
    "DEFAULT_DYNAMIC_SHARED",
    "LAUNCH_ATTRIBUTES",
    "MAX_DYNAMIC_SHARED",
    "NODE_KINDS",
    "NON_PORTABLE_CLUSTER",
    "CudaGraphDriver",
    "GraphDriver",
    "KernelNodeParams",
    "RestoreDriver",
    "add_node",
]

"""A captured CUDA graph walked into its description, and a graph built from a description node by node.

:func:`describe` reads a graph through a :class:`~weightcache.graphs.driver.GraphDriver` (its nodes, each kernel
node's function, geometry, argument bytes and launch attributes, each memset, each memcpy between device
memory, the edges with their data) and returns the :class:`~weightcache.graphs.description.GraphDescription` and
the function handle of each kernel name in this process. A node the description cannot hold (a memcpy from or to
host memory or an array, a host callback, an event, a child graph, a conditional) makes the graph not
describable: :class:`~weightcache.errors.GraphRestoreError` names it, and the caller keeps capturing that graph.

:func:`rebuild` makes a new graph from a description and a function handle for each kernel name; the caller
instantiates and launches it. :func:`resolve` finds those handles in a fresh process, from the handles it already
has: each known function's module is enumerated (``cuModuleEnumerateFunctions``), since the kernels of one
compilation unit share a module. On an H200 torch's kernels sat in modules of 112-184 functions, while each of
cuBLAS's GEMM kernels was alone in its module (docs/architecture.md), so a restore must still run each such kernel
once (e.g. a forward per GEMM shape) to learn its handle.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping

import attrs
import numpy as np

from ..errors import GraphRestoreError
from .description import IMAGE_MARK, Edge, EmptyNode, GraphDescription, KernelNode, Node, qualified
from .driver import (
    DEFAULT_DYNAMIC_SHARED,
    MAX_DYNAMIC_SHARED,
    NON_PORTABLE_CLUSTER,
    GraphDriver,
    RestoreDriver,
    add_node,
)


def describe(
    driver: GraphDriver, graph: int, image_of: Callable[[str, int], str | None] | None = None
) -> tuple[GraphDescription, dict[str, int]]:
    """``graph``'s description, and the function handle of each kernel it names (in this process).

    A kernel is named by its name, except where the graph launches two different functions of one name (two
    modules that name their kernels alike): each of those is :func:`~weightcache.graphs.description.qualified` by
    the SHA-256 of the image that defines it, which ``image_of(name, handle)`` gives (the recorder of this
    process's modules knows which module each was loaded into). Raises :class:`~weightcache.errors.GraphRestoreError`
    for a node the description cannot hold, or for two functions of one name whose images ``image_of`` cannot
    tell apart (none given, or one unknown)."""
    handles = driver.graph_nodes(graph)
    index = {handle: i for i, handle in enumerate(handles)}
    nodes: list[Node] = []
    kernels: dict[int, tuple[int, KernelNode]] = {}  # node index -> (function handle, node)
    named: dict[str, set[int]] = {}  # kernel name -> the function handles of that name
    for i, handle in enumerate(handles):
        kind = driver.node_kind(handle)
        if kind == "kernel":
            function, node = driver.kernel_node(handle)
            if IMAGE_MARK in node.function:
                raise GraphRestoreError(f"node {i}: the kernel name {node.function[:120]} holds {IMAGE_MARK!r}")
            kernels[i] = function, node
            named.setdefault(node.function, set()).add(function)
            nodes.append(node)
        elif kind == "memset":
            nodes.append(driver.memset_node(handle))
        elif kind == "memcpy":
            try:
                nodes.append(driver.memcpy_node(handle))
            except GraphRestoreError as exc:
                raise GraphRestoreError(f"node {i}: {exc}") from None
        elif kind == "empty":
            nodes.append(EmptyNode())
        else:
            raise GraphRestoreError(
                f"node {i} of the graph is a {kind} node, which a description does not hold (kernels, memsets, "
                "device-to-device memcpys and empty nodes only); this graph is captured as usual"
            )
    functions: dict[str, int] = {}
    keys = _keys(named, image_of)
    for i, (function, node) in kernels.items():
        key = keys.get((node.function, function), node.function)
        if key != node.function:
            nodes[i] = attrs.evolve(node, function=key)
        functions[key] = function
    edges = []
    for src, dst, data in driver.graph_edges(graph):
        if src not in index or dst not in index:
            raise GraphRestoreError("the driver reported an edge between nodes the graph does not list")
        edges.append(Edge(index[src], index[dst], data))
    return GraphDescription(tuple(nodes), tuple(edges)), functions


def _keys(
    named: Mapping[str, set[int]], image_of: Callable[[str, int], str | None] | None
) -> dict[tuple[str, int], str]:
    """(name, handle) -> its qualified name, for each name that several function handles share."""
    keys: dict[tuple[str, int], str] = {}
    for name, handles in sorted(named.items()):
        if len(handles) < 2:
            continue
        images = {h: image_of(name, h) if image_of is not None else None for h in handles}
        if None in images.values():  # (two handles of one image are the same code: one key serves both)
            raise GraphRestoreError(
                f"{len(handles)} different functions are named {name[:120]} in this graph and the image that defines "
                "each is not known (its module was loaded before kernel images were kept, or not through the "
                "driver's module API); this graph cannot be described and is captured as usual"
            )
        keys.update({(name, h): qualified(name, d) for h, d in images.items() if d is not None})
    return keys


def rebuild(driver: GraphDriver, description: GraphDescription, functions: Mapping[str, int]) -> int:
    """A new graph built from ``description``, each kernel launching ``functions[name]``; the caller owns it
    (instantiates, launches, destroys). Raises :class:`~weightcache.errors.GraphRestoreError` if a kernel has no
    handle in ``functions`` (checked before anything is built) or a driver call fails (the half-built graph is
    destroyed)."""
    missing = sorted(description.kernels() - set(functions))
    if missing:
        raise GraphRestoreError(
            f"{len(missing)} kernel(s) of the graph have no function handle in this process (e.g. "
            f"{missing[0][:120]}): run the model once so that their modules load, or capture as usual"
        )
    graph = driver.create_graph()
    try:
        driver.add_description(graph, description, functions)
    except BaseException:
        driver.destroy_graph(graph)
        raise
    return graph


def add_each(driver: GraphDriver, graph: int, description: GraphDescription, functions: Mapping[str, int]) -> None:
    """:meth:`~weightcache.graphs.driver.GraphDriver.add_description` one call at a time: each node through the
    driver's ``add_*_node`` method, then the edges (for a driver that has nothing faster)."""
    made = [add_node(driver, graph, node, functions) for node in description.nodes]
    driver.add_edges(graph, [(made[e.src], made[e.dst], e.data) for e in description.edges])


def resolve(driver: GraphDriver, wanted: Iterable[str], known: Iterable[int]) -> dict[str, int]:
    """The function handles of the ``wanted`` kernel names that the modules of the ``known`` function handles hold
    (every function of each module, by name); names found nowhere are left out (the caller decides: run the model
    once more, or capture as usual). Each module is enumerated once."""
    wanted = set(wanted)
    found: dict[str, int] = {}
    seen: set[frozenset[int]] = set()
    for function in known:
        if wanted <= set(found):
            break
        module = driver.module_functions(function)
        key = frozenset(module.values())
        if key in seen:
            continue
        seen.add(key)
        found.update({name: handle for name, handle in module.items() if name in wanted and name not in found})
    return found


#: ``CU_LAUNCH_ATTRIBUTE_CLUSTER_DIMENSION``; a cluster of more than 8 blocks is non-portable.
_CLUSTER_DIMENSION, _PORTABLE_CLUSTER = 4, 8


def shared_needs(descriptions: Iterable[GraphDescription]) -> dict[str, int]:
    """The largest dynamic shared memory any node of ``descriptions`` asks of each kernel (by name): what
    :func:`prepare` is given where graphs of one artifact are prepared and built side by side (graphs built
    ahead), since the limit is per function, not per graph, and one graph's smaller need must not undo another's
    larger one."""
    needs: dict[str, int] = {}
    for description in descriptions:
        t = description.tables
        if not t.kernel.any():
            continue
        shared = np.zeros(len(t.names), dtype=np.int64)
        np.maximum.at(shared, t.table["name"][t.kernel].astype(np.intp), t.table["shared"][t.kernel].astype(np.int64))
        for i, size in enumerate(shared.tolist()):
            needs[t.names[i]] = max(needs.get(t.names[i], 0), size)
    return needs


def prepare(
    driver: RestoreDriver,
    description: GraphDescription,
    functions: Mapping[str, int],
    shared: Mapping[str, int] | None = None,
) -> None:
    """Set on each function what its nodes need of it that a library sets on its own copy before launching: more
    dynamic shared memory than the default (cuBLAS's Hopper GEMMs ask for ~200 KiB), non-portable cluster sizes.
    A function loaded from a kept image (:mod:`~weightcache.graphs.cubins`) has neither, and a node asking for
    them is refused (``CUDA_ERROR_INVALID_VALUE``, seen on an H200). ``shared``: each kernel's need over every
    graph that may be built at the same time (:func:`shared_needs`); a kernel's limit is set to the larger of that
    and this graph's own, so that it is never lowered under another graph being built."""
    t = description.tables
    kernel = t.kernel
    if not kernel.any():
        return
    names = t.table["name"][kernel].astype(np.intp)
    needs = np.zeros(len(t.names), dtype=np.int64)
    np.maximum.at(needs, names, t.table["shared"][kernel].astype(np.int64))
    if shared is not None:  # every name of the table is a kernel's (to_binary lists no other)
        needs = np.maximum(needs, np.array([shared.get(name, 0) for name in t.names], dtype=np.int64))
    for i in np.flatnonzero(needs > DEFAULT_DYNAMIC_SHARED).tolist():
        driver.set_function_attribute(functions[t.names[i]], MAX_DYNAMIC_SHARED, int(needs[i]))
    owner = np.repeat(np.arange(len(t.table)), t.table["attributes"].astype(np.intp))
    cluster = t.attributes["id"] == _CLUSTER_DIMENSION
    if cluster.any():
        dims = t.attributes["value"][cluster][:, :12].copy().view("<u4").astype(np.int64)
        large = dims.prod(axis=1) > _PORTABLE_CLUSTER
        for i in np.unique(t.table["name"][owner[cluster][large]]).tolist():
            driver.set_function_attribute(functions[t.names[i]], NON_PORTABLE_CLUSTER, 1)


__all__ = ["add_each", "describe", "prepare", "rebuild", "resolve", "shared_needs"]

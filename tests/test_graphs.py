"""CUDA graphs described, checked and rebuilt (weightcache.graphs, issue 31), against a driver of this test's own
on the CPU (FakeDriver: graphs, nodes, edges, allocations and modules as the CUDA driver keeps them), and against
the real one on a GPU (the cuda test: a torch model's captured graph, rebuilt from its JSON description, replays
bitwise equal)."""

from __future__ import annotations

import itertools
import json
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from struct import pack as struct_pack
from typing import Any

import attrs
import numpy as np
import pytest

from weightcache.errors import GraphDescriptionError, GraphRestoreError
from weightcache.graphs import (
    AddressRange,
    CudaGraphDriver,
    Edge,
    EmptyNode,
    GraphDescription,
    KernelNode,
    MemcpyNode,
    MemsetNode,
    describe,
    pointers,
    rebuild,
    resolve,
    restore_problems,
)
from weightcache.graphs.check import (
    DESTINATION,
    NEAR_MOVED,
    SOURCE,
    extent_problems,
    extents,
    moved_ranges,
    moves,
    relocate,
    relocation_problems,
)
from weightcache.graphs.record import add_each

POOL = AddressRange("pool", 0x7F00_0000_0000, 1 << 30)
WEIGHTS = AddressRange("weights/0", 0x7E00_0000_0000, 1 << 28)
ELSEWHERE = 0x7A00_1234_0000  # torch's caching allocator, in this fake process


class FakeDriver:
    """The CUDA driver's graph bookkeeping in Python: what GraphDriver's calls read and write."""

    def __init__(self) -> None:
        self._ids = itertools.count(0x1000, 0x10)
        self.graphs: dict[int, list[int]] = {}
        self.edges: dict[int, list[tuple[int, int, bytes]]] = {}
        self.nodes: dict[int, tuple[str, Any]] = {}
        self.allocations = [(POOL.base, 64 << 20), (WEIGHTS.base, 1 << 28), (ELSEWHERE, 2 << 20)]
        self.modules: dict[int, dict[str, int]] = {}  # function handle -> its module's functions
        self.destroyed: list[int] = []
        self.fail_on: str | None = None

    def function(self, *names: str) -> list[int]:
        """Handles of ``names``, all in one new module."""
        handles = [next(self._ids) for _ in names]
        module = dict(zip(names, handles, strict=True))
        for h in handles:
            self.modules[h] = module
        return handles

    def new_graph(self, nodes: Sequence[tuple[str, Any]], edges: Sequence[tuple[int, int, bytes]]) -> int:
        graph = self.create_graph()
        for node in nodes:
            handle = next(self._ids)
            self.nodes[handle] = node
            self.graphs[graph].append(handle)
        made = self.graphs[graph]
        self.edges[graph] = [(made[a], made[b], d) for a, b, d in edges]
        return graph

    # GraphDriver
    def graph_nodes(self, graph: int) -> list[int]:
        return list(self.graphs[graph])

    def node_kind(self, node: int) -> str:
        return self.nodes[node][0]

    def kernel_node(self, node: int) -> tuple[int, KernelNode]:
        _, (function, described) = self.nodes[node]
        return function, described

    def memset_node(self, node: int) -> MemsetNode:
        return self.nodes[node][1]  # type: ignore[no-any-return]

    def memcpy_node(self, node: int) -> MemcpyNode:
        described = self.nodes[node][1]
        if isinstance(described, GraphRestoreError):  # what CudaGraphDriver raises for host memory or an array
            raise described
        return described  # type: ignore[no-any-return]

    def graph_edges(self, graph: int) -> list[tuple[int, int, bytes]]:
        return list(self.edges[graph])

    def pointer_range(self, address: int) -> tuple[int, int] | None:
        return next(((b, s) for b, s in self.allocations if b <= address < b + s), None)

    def module_functions(self, function: int) -> dict[str, int]:
        return dict(self.modules[function])

    def function_module(self, function: int) -> int:
        return id(self.modules[function])

    def create_graph(self) -> int:
        graph = next(self._ids)
        self.graphs[graph], self.edges[graph] = [], []
        return graph

    def _add(self, graph: int, node: tuple[str, Any]) -> int:
        if self.fail_on == node[0]:
            raise GraphRestoreError(f"cuGraphAdd{node[0]}Node failed: CUDA_ERROR_OUT_OF_MEMORY")
        handle = next(self._ids)
        self.nodes[handle] = node
        self.graphs[graph].append(handle)
        return handle

    def add_kernel_node(self, graph: int, function: int, node: KernelNode) -> int:
        return self._add(graph, ("kernel", (function, node)))

    def add_memset_node(self, graph: int, node: MemsetNode) -> int:
        return self._add(graph, ("memset", node))

    def add_memcpy_node(self, graph: int, node: MemcpyNode) -> int:
        return self._add(graph, ("memcpy", node))

    def add_empty_node(self, graph: int) -> int:
        return self._add(graph, ("empty", None))

    def add_edges(self, graph: int, edges: Sequence[tuple[int, int, bytes]]) -> None:
        self.edges[graph].extend(edges)

    def destroy_graph(self, graph: int) -> None:
        self.destroyed.append(graph)

    def add_description(self, graph: int, description: GraphDescription, functions: Mapping[str, int]) -> None:
        add_each(self, graph, description, functions)  # type: ignore[arg-type]


def u64(*values: int) -> bytes:
    return b"".join(v.to_bytes(8, "little") for v in values)


def mlp_graph(driver: FakeDriver) -> tuple[int, dict[str, int]]:
    """A captured MLP as torch and cuBLAS leave it: a GEMM launched with an argument buffer and a cluster
    attribute, an elementwise kernel with laid-out parameters (two pointers and a 4-byte scalar), a memset of the
    output, an empty join, a copy of the output into a static buffer (``out.copy_(y)``: a memcpy node), and an edge
    carrying programmatic-dependent-launch data."""
    gemm, gelu = driver.function("nvjet_sm90_tst_128x64", "vectorized_elementwise_kernel_gelu")
    cluster = (4).to_bytes(4, "little") + (1).to_bytes(4, "little") * 2 + bytes(52)
    gemm_node = KernelNode(
        "nvjet_sm90_tst_128x64", (16, 1, 1), (384, 1, 1), 200_704,
        u64(WEIGHTS.base + 0x100, POOL.base, POOL.base + 0x40000, 4096, 0), (), "buffer", ((4, cluster),),
    )  # fmt: skip
    gelu_node = KernelNode(
        "vectorized_elementwise_kernel_gelu", (64, 1, 1), (128, 1, 1), 0,
        (32768).to_bytes(4, "little") + bytes(4) + u64(POOL.base + 0x40000, POOL.base + 0x80000),
        ((0, 4), (8, 8), (16, 8)),
    )  # fmt: skip
    memset = MemsetNode(POOL.base + 0x80000, 0, 0, 4, 4096, 1)
    copy = MemcpyNode(POOL.base + 0x80000, POOL.base + 0xC0000, 16384)
    pdl = bytes([1, 0, 0, 0, 1, 0, 0, 0])
    graph = driver.new_graph(
        [("memset", memset), ("kernel", (gemm, gemm_node)), ("kernel", (gelu, gelu_node)), ("empty", None),
         ("memcpy", copy)],
        [(0, 1, bytes(8)), (1, 2, pdl), (2, 3, bytes(8)), (3, 4, bytes(8))],
    )  # fmt: skip
    return graph, {"nvjet_sm90_tst_128x64": gemm, "vectorized_elementwise_kernel_gelu": gelu}


def test_a_graph_described_and_rebuilt_from_its_json_is_the_same_graph() -> None:
    driver = FakeDriver()
    graph, handles = mlp_graph(driver)
    description, functions = describe(driver, graph)
    assert functions == handles
    assert [type(n) for n in description.nodes] == [MemsetNode, KernelNode, KernelNode, EmptyNode, MemcpyNode]
    assert description.kernels() == set(handles)
    again = GraphDescription.from_json(json.loads(json.dumps(description.to_json())))
    assert again == description

    rebuilt = rebuild(driver, again, functions)
    assert rebuilt != graph and driver.destroyed == []
    original, copy = driver.graph_nodes(graph), driver.graph_nodes(rebuilt)
    assert [driver.nodes[n] for n in copy] == [driver.nodes[n] for n in original]
    position = {n: i for i, n in enumerate(copy)}
    old_position = {n: i for i, n in enumerate(original)}
    assert [(position[a], position[b], d) for a, b, d in driver.graph_edges(rebuilt)] == [
        (old_position[a], old_position[b], d) for a, b, d in driver.graph_edges(graph)
    ]


def test_a_node_a_description_cannot_hold_keeps_the_graph_captured() -> None:
    driver = FakeDriver()
    graph = driver.new_graph([("empty", None), ("host", None)], [(0, 1, bytes(8))])
    with pytest.raises(GraphRestoreError, match="node 1 of the graph is a host node"):
        describe(driver, graph)
    host_copy = GraphRestoreError("a memcpy node's source is host memory, which no later process has")
    graph = driver.new_graph([("empty", None), ("memcpy", host_copy)], [(0, 1, bytes(8))])
    with pytest.raises(GraphRestoreError, match="node 1: a memcpy node's source is host memory"):
        describe(driver, graph)


def test_two_functions_of_one_name_are_told_apart_by_their_images_or_not_described() -> None:
    """torch.compile's Triton modules name their kernels alike (vLLM's FULL graphs, H100, 2026-12-05: 51 of 51 not
    describable, "two functions are named triton_red_fused_fused_add_rms_norm_0"). With the image of each handle
    known, each such node names its kernel qualified by its image's SHA-256 (a kernel of a name no other function
    shares keeps its plain name); with one unknown, the graph is not described."""
    from weightcache.graphs.description import kernel_image, kernel_name

    driver = FakeDriver()
    (a,), (b,), (c,) = driver.function("k"), driver.function("k"), driver.function("other")
    node, other = KernelNode("k", (1, 1, 1), (1, 1, 1), 0, b""), KernelNode("other", (1, 1, 1), (1, 1, 1), 0, b"")
    graph = driver.new_graph([("kernel", (a, node)), ("kernel", (c, other)), ("kernel", (b, node))], [])
    with pytest.raises(GraphRestoreError, match="2 different functions are named k in this graph"):
        describe(driver, graph)
    images = {a: "a" * 64, b: "b" * 64}
    with pytest.raises(GraphRestoreError, match="the image that defines each is not known"):
        describe(driver, graph, lambda name, handle: images.get(handle) if handle == a else None)
    asked: list[tuple[str, int]] = []

    def image_of(name: str, handle: int) -> str | None:
        asked.append((name, handle))
        return images.get(handle)

    description, functions = describe(driver, graph, image_of)
    names = [n.function for n in description.nodes if isinstance(n, KernelNode)]
    assert names == ["k@" + "a" * 64, "other", "k@" + "b" * 64]
    assert functions == {names[0]: a, "other": c, names[2]: b}
    assert sorted(asked) == sorted([("k", a), ("k", b)])  # only the names several functions share
    assert [kernel_name(n) for n in names] == ["k", "other", "k"]
    assert [kernel_image(n) for n in names] == ["a" * 64, None, "b" * 64]
    # one image loaded twice (two handles of the same code): one name serves both
    description, functions = describe(driver, graph, lambda name, handle: "a" * 64)
    assert functions["k@" + "a" * 64] in (a, b) and len(functions) == 2


def test_every_address_is_found_and_one_outside_the_ranges_stops_the_restore() -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    description, _ = describe(driver, graph)
    found, problems = pointers(description, [POOL, WEIGHTS], driver.pointer_range)
    assert problems == []
    # the memset's first and last byte, the GEMM's three pointers (4096 and 0 are scalars), the GELU's two, the
    # memcpy's first and last byte on each side
    assert [(p.node, p.offset, p.value - POOL.base if p.range == "pool" else p.range) for p in found] == [
        (0, -1, 0x80000), (0, -1, 0x83FFF), (1, 0, "weights/0"), (1, 8, 0), (1, 16, 0x40000), (2, 8, 0x40000),
        (2, 16, 0x80000), (4, -2, 0x80000), (4, -2, 0x83FFF), (4, -1, 0xC0000), (4, -1, 0xC3FFF),
    ]  # fmt: skip
    assert restore_problems([POOL, WEIGHTS], [POOL, WEIGHTS], found, driver.pointer_range) == []

    # one argument now points into memory no range reproduces (e.g. cuBLAS's workspace from torch's allocator)
    gemm = description.nodes[1]
    assert isinstance(gemm, KernelNode)
    stray = KernelNode(gemm.function, gemm.grid, gemm.block, gemm.shared_bytes,
                       gemm.args[:32] + u64(ELSEWHERE + 0x200), (), "buffer", gemm.attributes)  # fmt: skip
    leaking = GraphDescription((*description.nodes[:1], stray, *description.nodes[2:]), description.edges)
    tally: dict[tuple[int, int], list[int]] = {}
    found, problems = pointers(leaking, [POOL, WEIGHTS], driver.pointer_range, tally)
    assert len(problems) == 1 and "node 1 (nvjet_sm90_tst_128x64), argument byte 32" in problems[0]
    assert f"{ELSEWHERE + 0x200:#x}" in problems[0] and f"allocation {ELSEWHERE:#x}" in problems[0]
    assert tally == {driver.pointer_range(ELSEWHERE): [ELSEWHERE + 0x200]}  # the addresses, by allocation

    # a memset whose destination lies in no range is a problem even where the driver knows no allocation there
    lost = GraphDescription((MemsetNode(0x1234_0000, 0, 0, 1, 16, 1),))
    assert "node 0 (memset), its destination" in pointers(lost, [POOL], lambda a: None)[1][0]
    # so is a memcpy whose source lies in none (e.g. torch's allocator), and one that runs past its range's end
    stray_copy = GraphDescription((MemcpyNode(ELSEWHERE, POOL.base, 256),))
    (problem,) = pointers(stray_copy, [POOL], driver.pointer_range)[1][:1]
    assert "node 0 (memcpy), its source holds" in problem and f"allocation {ELSEWHERE:#x}" in problem
    end = POOL.base + POOL.size
    past = GraphDescription((MemcpyNode(POOL.base, end - 128, 64, height=2, src_pitch=64, dst_pitch=128),))
    assert [p.value for p in pointers(past, [POOL], driver.pointer_range)[0]] == [
        POOL.base, POOL.base + 127, end - 128
    ]  # the last byte written, end + 63, lies in no range  # fmt: skip
    assert "node 0 (memcpy), its destination holds" in pointers(past, [POOL], lambda a: None)[1][0]
    # a memset's last byte: its rows pitch bytes apart, each width elements of element_size bytes
    rows = GraphDescription((MemsetNode(POOL.base, 256, 0, 4, 16, 3),))
    assert [p.value - POOL.base for p in pointers(rows, [POOL], driver.pointer_range)[0]] == [0, 2 * 256 + 64 - 1]
    # slices: each side's last byte from its own pitch and height
    sliced = GraphDescription((MemcpyNode(POOL.base, POOL.base + 0x10000, 16, 2, 3, 32, 4, 64, 5),))
    assert [p.value - POOL.base for p in pointers(sliced, [POOL], driver.pointer_range)[0]] == [
        0, 2 * 32 * 4 + 32 + 15, 0x10000, 0x10000 + 2 * 64 * 5 + 64 + 15,
    ]  # fmt: skip
    # a copy whose ends lie in two ranges with memory between them that neither reproduces
    gap = POOL.base - (WEIGHTS.base + WEIGHTS.size)
    spanning = GraphDescription((MemcpyNode(WEIGHTS.base + WEIGHTS.size - 8, POOL.base + (1 << 20), 16 + gap),))
    found, problems = pointers(spanning, [POOL, WEIGHTS], driver.pointer_range)
    assert problems and "its source runs from" in problems[0] and "range 'weights/0'" in problems[0]


def test_a_range_elsewhere_smaller_or_unmapped_here_stops_the_restore() -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    description, _ = describe(driver, graph)
    found, _ = pointers(description, [POOL, WEIGHTS], driver.pointer_range)

    moved = AddressRange("pool", POOL.base + (2 << 20), POOL.size)
    (problem,) = restore_problems([POOL, WEIGHTS], [moved, WEIGHTS], found)
    assert f"range 'pool' was at {POOL.base:#x}" in problem and f"is at {moved.base:#x}" in problem
    smaller = AddressRange("weights/0", WEIGHTS.base, WEIGHTS.size // 2)
    assert len(restore_problems([POOL, WEIGHTS], [POOL, smaller], found)) == 1
    assert "is not in this process" in restore_problems([POOL, WEIGHTS], [POOL], found)[0]
    assert "not among the recorded ranges" in restore_problems([POOL], [POOL, WEIGHTS], found)[0]

    # the ranges are where they were, but the pool's memory from 256 KiB on is not mapped here: the memset's
    # two ends, the GEMM's output, both of the GELU's pointers and the memcpy's four ends lie there
    driver.allocations[0] = (POOL.base, 256 << 10)
    problems = restore_problems([POOL, WEIGHTS], [POOL, WEIGHTS], found, driver.pointer_range)
    assert len(problems) == 9 and all("not device memory mapped inside range 'pool'" in p for p in problems)
    assert problems[0].startswith("node 0, its destination points at")


def test_a_pointer_inside_a_structure_parameter_is_found_like_any_other() -> None:
    """A laid-out kernel's parameter larger than 8 bytes can hold pointers: TensorIterator's elementwise kernels get
    their operands as one ``Array<char*, N>`` parameter (``out + bias``: 24 bytes). Each 8-aligned word inside one
    parameter is scanned (on the H100, 2026-12-05, only 8-byte parameters were: a bias that had moved was not seen
    and the restore was refused only for the output a memcpy wrote); words across two small parameters are not."""
    driver = FakeDriver()
    bias = AddressRange("external/bias", ELSEWHERE + 0x1000, 4096, own_mapping=False)
    # int n at 0, a 4-byte functor at 4, the operands (out, in, bias) at 8..31; a 16-byte struct at 32 whose
    # pointer sits at its second word; two 4-byte ints at 48 and 52 that together read as an address in the pool
    args = (struct_pack("<iI", 64, 0) + u64(POOL.base + 0x100, POOL.base, bias.base) + u64(7, bias.base + 0x10)
            + struct_pack("<II", (POOL.base + 0x200) & 0xFFFFFFFF, (POOL.base + 0x200) >> 32))  # fmt: skip
    layout = ((0, 4), (4, 4), (8, 24), (32, 16), (48, 4), (52, 4))
    node = KernelNode("vectorized_elementwise_kernel", (1, 1, 1), (128, 1, 1), 0, args, layout)
    found, problems = pointers(GraphDescription((node,)), [POOL, bias], driver.pointer_range)
    assert problems == []
    assert [(p.offset, p.range) for p in found] == [
        (8, "pool"), (16, "pool"), (24, "external/bias"), (40, "external/bias"),
    ]  # fmt: skip
    offsets, values = node.words()
    assert offsets.tolist() == [8, 16, 24, 32, 40] and values.tolist()[2] == bias.base
    moved = AddressRange(bias.name, bias.base + 0x2000, bias.size, own_mapping=False)
    reach = extents(found, [POOL, bias])
    (problem,) = extent_problems([POOL, bias], [POOL, moved], reach, driver.pointer_range)
    assert "range 'external/bias' was at" in problem


def test_a_restore_checks_each_range_to_the_farthest_pointer_the_graph_has_in_it() -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    description, _ = describe(driver, graph)
    found, _ = pointers(description, [POOL, WEIGHTS], driver.pointer_range)
    reach = extents(found, [POOL, WEIGHTS])
    farthest = max(p.value for p in found if p.range == "pool")
    assert reach == {"pool": farthest - POOL.base + 1, "weights/0": max(p.value for p in found if p.range != "pool")
                     - WEIGHTS.base + 1}  # fmt: skip
    assert extent_problems([POOL, WEIGHTS], [POOL, WEIGHTS], reach, driver.pointer_range) == []
    moved = AddressRange("pool", POOL.base + (2 << 20), POOL.size)
    assert "was at" in extent_problems([POOL, WEIGHTS], [moved, WEIGHTS], reach, driver.pointer_range)[0]
    assert "is not in this process" in extent_problems([POOL, WEIGHTS], [POOL], reach, driver.pointer_range)[0]
    # the pool is where it was, but mapped here only up to just before its farthest pointer
    driver.allocations[0] = (POOL.base, farthest - POOL.base)
    (problem,) = extent_problems([POOL, WEIGHTS], [POOL, WEIGHTS], reach, driver.pointer_range)
    assert f"range 'pool': {farthest:#x}" in problem and "not device memory mapped" in problem


def test_a_tensor_of_another_allocator_is_checked_by_name_as_device_memory_in_one_allocation() -> None:
    """A range that is part of someone else's allocation (``own_mapping=False``: a tensor of torch's caching
    allocator, declared by name) holds pointers like any range; a restore needs it at the same base, its memory
    device memory, and what a graph reaches in it one allocation. The same range taken as a mapping of its own
    is refused: the driver reports the whole segment around it."""
    driver = FakeDriver()  # torch's 2 MiB segment at ELSEWHERE holds the tensor at +0x1000, 64 KiB
    tensor = AddressRange("external/kv", ELSEWHERE + 0x1000, 64 << 10, own_mapping=False)
    reads = KernelNode("k", (1, 1, 1), (1, 1, 1), 0, u64(tensor.base + 0x80, POOL.base), ((0, 8), (8, 8)))
    description = GraphDescription((reads,))
    found, problems = pointers(description, [POOL, tensor], driver.pointer_range)
    assert problems == [] and [p.range for p in found] == ["external/kv", "pool"]
    assert restore_problems([POOL, tensor], [POOL, tensor], found, driver.pointer_range) == []
    reach = extents(found, [POOL, tensor])
    assert extent_problems([POOL, tensor], [POOL, tensor], reach, driver.pointer_range) == []
    own = AddressRange("external/kv", tensor.base, tensor.size)
    (problem,) = restore_problems([POOL, own], [POOL, own], found, driver.pointer_range)
    assert "not device memory mapped inside range 'external/kv'" in problem
    moved = AddressRange("external/kv", tensor.base + 0x2000, tensor.size, own_mapping=False)
    (problem,) = extent_problems([POOL, tensor], [POOL, moved], reach, driver.pointer_range)
    assert "range 'external/kv' was at" in problem
    driver.allocations[2] = (ELSEWHERE, 0x1040)  # the tensor's start and its farthest pointer in two allocations
    driver.allocations.append((ELSEWHERE + 0x1040, 1 << 20))
    (problem,) = extent_problems([POOL, tensor], [POOL, tensor], reach, driver.pointer_range)
    assert "lie in two allocations in this process" in problem
    # every recorded byte, not only as far as a pointer reaches (a kernel is given the first byte and reads on)
    driver.allocations[2:] = [(ELSEWHERE, 0x1000 + 0x100), (ELSEWHERE + 0x1100, 1 << 20)]
    assert reach["external/kv"] < 0x100  # its pointer lies in the first allocation
    (problem,) = extent_problems([POOL, tensor], [POOL, tensor], reach, driver.pointer_range)
    assert f"its last {tensor.base + tensor.size - 1:#x}" in problem and "two allocations" in problem
    driver.allocations[2:] = [(ELSEWHERE, 2 << 20)]
    # the same name as a mapping of its own here: another kind of range, refused
    (problem,) = extent_problems([POOL, tensor], [POOL, own], reach, driver.pointer_range)
    assert "was part of another allocation when the graph was recorded and is a mapping of its own here" in problem
    driver.allocations[2:] = []  # freed here: no device memory there at all
    (problem,) = extent_problems([POOL, tensor], [POOL, tensor], reach, driver.pointer_range)
    assert f"range 'external/kv': {tensor.base:#x}" in problem and "not device memory" in problem


def test_a_part_of_another_allocation_the_driver_confirmed_is_not_asked_about_again() -> None:
    """With ``passed`` (a caller that keeps the tensors alive: a GraphCache), a part of another allocation whose
    ends the driver confirmed is not asked about for the next graph that reaches it as far; one reached farther,
    one that failed, and every range of its own (the arena grows between graphs) are asked again. vLLM's graphs
    reach a hundred and more of the runner's tensors, each of 51 graphs asking the driver twice for each."""
    driver = FakeDriver()
    tensor = AddressRange("external/kv", ELSEWHERE + 0x1000, 64 << 10, own_mapping=False)
    asked: list[int] = []

    def pointer_range(address: int) -> tuple[int, int] | None:
        asked.append(address)
        return driver.pointer_range(address)

    reach = {"pool": 0x100, "external/kv": 0x80}
    passed: set[tuple[AddressRange, int]] = set()
    assert extent_problems([POOL, tensor], [POOL, tensor], reach, pointer_range, passed) == []
    last = tensor.base + tensor.size - 1
    assert asked == [tensor.base, last, POOL.base, POOL.base + 0xFF] and passed == {(tensor, last)}
    asked.clear()
    assert extent_problems([POOL, tensor], [POOL, tensor], reach, pointer_range, passed) == []
    assert asked == [POOL.base, POOL.base + 0xFF]  # the pool again, the tensor not
    asked.clear()
    farther = AddressRange("external/kv", tensor.base, 4 << 20, own_mapping=False)  # past its 2 MiB allocation
    (problem,) = extent_problems([POOL, farther], [POOL, farther], reach, pointer_range, passed)
    assert "not device memory" in problem and asked[:2] == [farther.base, farther.base + farther.size - 1]
    assert passed == {(tensor, last)}  # a failure is not remembered


def test_a_tensor_of_another_allocator_declared_elsewhere_has_every_pointer_into_it_moved_with_it() -> None:
    """torch's allocator gives a fresh process's tensors other addresses (CUDA's address space is placed anew in
    each process): a range of someone else's allocation that a restoring process declares at another base, as
    large, is relocated: each pointer into it, in kernel arguments, a memset's destination and a memcpy's source,
    moves by as much, and nothing else does; the moved graph's pointers check as a recorded graph's do."""
    driver = FakeDriver()
    kv = AddressRange("external/kv", ELSEWHERE + 0x1000, 64 << 10, own_mapping=False)
    ids = AddressRange("external/ids", ELSEWHERE + 0x20000, 4096, own_mapping=False)
    reads = KernelNode(
        "k",
        (1, 1, 1),
        (1, 1, 1),
        0,
        u64(kv.base + 0x80, POOL.base, 12345, ids.base),
        ((0, 8), (8, 8), (16, 8), (24, 8)),
    )
    description = GraphDescription(
        (reads, MemsetNode(kv.base + 0x100, 0, 0, 4, 16, 1), MemcpyNode(kv.base, POOL.base + 0x1000, 256)),
        (Edge(0, 1), Edge(1, 2)),
    )
    recorded = [POOL, WEIGHTS, kv, ids]
    found, problems = pointers(description, recorded, driver.pointer_range)
    assert problems == []
    reach = extents(found, recorded)
    here = [POOL, WEIGHTS, attrs.evolve(kv, base=kv.base + 0x40000), ids]  # kv elsewhere, ids where it was
    moved, problems = moves(recorded, here, reach)
    assert moved == {"external/kv": 0x40000} and problems == []
    assert extent_problems(moved_ranges(recorded, moved), here, reach, driver.pointer_range) == []
    assert "was at" in extent_problems(recorded, here, reach, driver.pointer_range)[0]  # unmoved: refused

    relocated, count = relocate(description, recorded, moved)
    assert count == 3  # the kernel's kv pointer, the memset's destination, the memcpy's source (each once)
    node, memset, copy = relocated.nodes
    assert isinstance(node, KernelNode) and isinstance(memset, MemsetNode) and isinstance(copy, MemcpyNode)
    assert node.args == u64(kv.base + 0x40080, POOL.base, 12345, ids.base) and node.layout == reads.layout
    assert memset.dst == kv.base + 0x40100 and (copy.src, copy.dst) == (kv.base + 0x40000, POOL.base + 0x1000)
    assert relocated.edges == description.edges and description.nodes[1] == MemsetNode(kv.base + 0x100, 0, 0, 4, 16, 1)
    again, problems = pointers(relocated, here, driver.pointer_range)
    assert problems == [] and [(p.node, p.offset, p.range) for p in again] == [
        (p.node, p.offset, p.range) for p in found
    ]
    assert relocate(description, recorded, {}) == (description, 0)
    assert relocation_problems(description, recorded, moved) == []  # (ids, near kv, is a range of its own)

    # never relocated: a range of its own (the arena, a weights segment), one that is smaller here, and two
    # ranges that overlapped when recorded and moved apart (which one a pointer into both meant is not known)
    pool_moved = [attrs.evolve(POOL, base=POOL.base + (2 << 20)), WEIGHTS, kv, ids]
    assert moves(recorded, pool_moved, reach) == ({}, [])
    smaller = [POOL, WEIGHTS, attrs.evolve(kv, base=kv.base + 0x40000, size=kv.size // 2), ids]
    (problem,) = moves(recorded, smaller, reach)[1]
    assert "range 'external/kv' was at" in problem and "smaller" in problem
    head = AddressRange("external/kv-head", kv.base, 256, own_mapping=False)
    (problem,) = moves([*recorded, head], [*here, head], {**reach, head.name: 1})[1]
    assert (
        "ranges 'external/kv' and 'external/kv-head' overlapped when the graph was recorded and moved apart" in problem
    )
    same_base = [POOL, WEIGHTS, attrs.evolve(kv, size=kv.size // 2), ids]  # where it was, smaller
    assert extent_problems(recorded, same_base, reach, driver.pointer_range)[0].endswith(": smaller")


def words_by_node(description: GraphDescription) -> list[tuple[int, int, int]]:
    """The candidate pointer words as node values give them (each node's bytes, its layout's pointer_words): what
    the tables' vectorised reading must agree with."""
    from weightcache.graphs.description import pointer_words

    found = []
    for i, node in enumerate(description.nodes):
        if not isinstance(node, KernelNode):
            continue
        n = len(node.args) // 8
        chosen = (
            range(n) if node.launched_with == "buffer" else sorted({w for w in pointer_words(node.layout) if w < n})
        )
        found += [(i, 8 * w, int.from_bytes(node.args[8 * w : 8 * w + 8], "little")) for w in chosen]
    return found


def random_nodes(rng: Any, count: int, copies: float, kernel: Any) -> list[Any]:
    """``count`` random nodes: a memset with probability ``copies / 2``, a memcpy with as much, else ``kernel()``
    (a KernelNode); every address in POOL."""
    nodes: list[Any] = []
    for _ in range(count):
        kind = rng.random()
        if kind < copies / 2:
            nodes.append(MemsetNode(POOL.base + rng.randrange(1 << 20) * 4, 0, 0, 4, 16, 1))
        elif kind < copies:
            nodes.append(MemcpyNode(POOL.base + rng.randrange(1 << 20), POOL.base + rng.randrange(1 << 20), 64))
        else:
            nodes.append(kernel())
    return nodes


def test_the_tables_give_the_words_and_copy_addresses_the_nodes_do() -> None:
    """Relocation and the checks read candidate pointers from the tables (no value per node: 51 graphs of 480
    nodes relocated in 0.12 s instead of 0.59 s on the dev VM): buffers' every word, a parameter's aligned words
    only (a 24-byte structure's three, none across two 4-byte parameters), odd lengths, overlapping spans, and
    memsets' and memcpys' addresses, in many random graphs."""
    import random

    rng = random.Random(31)

    def kernel() -> KernelNode:
        size = rng.randint(0, 120)
        args = rng.randbytes(size)
        if rng.random() < 0.3:
            return KernelNode("k", (1, 1, 1), (1, 1, 1), 0, args, (), "buffer")
        layout, at = [], 0
        while at < size:
            width = min(rng.choice((1, 2, 4, 8, 8, 16, 24)), size - at)
            layout.append((at, width))
            at += width if rng.random() < 0.9 else 0  # now and then a span given twice
        return KernelNode("k", (1, 1, 1), (1, 1, 1), 0, args, tuple(layout))

    for _ in range(40):
        nodes = random_nodes(rng, rng.randint(1, 30), 0.2, kernel)
        description = GraphDescription(tuple(nodes))
        tables = GraphDescription.from_binary(description.to_binary()).tables
        node, offset, value = tables.argument_words()
        assert list(zip(node.tolist(), offset.tolist(), value.tolist(), strict=True)) == words_by_node(description)
        expected = []
        for i, n in enumerate(nodes):
            if isinstance(n, MemsetNode):
                expected.append((i, -1, n.dst))
            elif isinstance(n, MemcpyNode):
                expected += [(i, -2, n.src), (i, -1, n.dst)]
        assert tables.copy_addresses() == sorted(expected)


def test_moving_many_places_at_once_moves_each_as_moving_one_at_a_time_does() -> None:
    """A restore moves hundreds of kernel argument words a graph (vLLM's 51 FULL graphs on an H100: 40,851 in all),
    all at once from the tables; in random graphs the result is what moving each named place once, the first time
    it is named, by editing the nodes gives, and the description it came from is unchanged."""
    import random

    rng = random.Random(7)

    def kernel() -> KernelNode:
        words = [POOL.base + rng.randrange(1 << 30) for _ in range(rng.randint(1, 8))]
        return KernelNode("k", (1, 1, 1), (1, 1, 1), 0, u64(*words) + rng.randbytes(rng.choice((0, 4))), (), "buffer")

    for _ in range(40):
        nodes = random_nodes(rng, rng.randint(1, 20), 0.3, kernel)
        description = GraphDescription.from_binary(GraphDescription(tuple(nodes)).to_binary())
        places = []
        for i, node in enumerate(nodes):
            if isinstance(node, KernelNode):
                places += [(i, 8 * w) for w in range(len(node.args) // 8)]
            else:
                places += [(i, DESTINATION)] + ([(i, SOURCE)] if isinstance(node, MemcpyNode) else [])
        named = [(*rng.choice(places), rng.randrange(-(1 << 20), 1 << 20)) for _ in range(rng.randint(1, 40))]
        expected = list(nodes)
        done = set()
        for i, at, delta in named:
            if (i, at) in done:
                continue
            done.add((i, at))
            node = expected[i]
            if isinstance(node, KernelNode):
                value = int.from_bytes(node.args[at : at + 8], "little") + delta
                expected[i] = attrs.evolve(node, args=node.args[:at] + u64(value) + node.args[at + 8 :])
            elif isinstance(node, MemsetNode):
                expected[i] = attrs.evolve(node, dst=node.dst + delta)
            else:
                field = "dst" if at == DESTINATION else "src"
                expected[i] = attrs.evolve(node, **{field: getattr(node, field) + delta})
        assert description.moved(named).nodes == tuple(expected)
        assert description.nodes == tuple(nodes)


@pytest.mark.parametrize(
    "offset", [64 << 10, (64 << 10) + 512, -8, -(1 << 19)], ids=["end", "past", "before", "far-before"]
)
def test_a_word_just_outside_a_moved_range_refuses_relocation(offset: int) -> None:
    """Relocation moves the words inside a moved range. A word near it but outside every range (a tensor's end
    handed to a kernel as a bound, an address before its first byte) passed the recording's checks only because
    no device memory was there; moving the range without it would leave a stale pointer, so the graph is not
    relocated (captured instead). One farther than NEAR_MOVED is a scalar like any other."""
    kv = AddressRange("external/kv", ELSEWHERE + (2 << 20), 64 << 10, own_mapping=False)
    node = KernelNode("k", (1, 1, 1), (1, 1, 1), 0, u64(kv.base, kv.base + offset), ((0, 8), (8, 8)))
    description = GraphDescription((node,))
    (problem,) = relocation_problems(description, [POOL, kv], {kv.name: 0x40000})
    assert problem.startswith("node 0 (k), argument byte 8 holds") and f"{offset:+#x} bytes from" in problem
    assert "'external/kv'" in problem
    assert relocation_problems(description, [POOL, kv], {}) == []  # nothing moves: nothing is left behind
    far = GraphDescription((attrs.evolve(node, args=u64(kv.base, kv.base + kv.size + NEAR_MOVED)),))
    assert relocation_problems(far, [POOL, kv], {kv.name: 0x40000}) == []


@pytest.mark.parametrize(
    "words, field",
    [([(5, 0, 8)], "node 5"), ([(0, 4, 8)], "argument byte 4"), ([(0, 32, 8)], "argument byte 32"),
     ([(1, 0, 8)], "argument byte 0"), ([(0, -2, 8)], "its source"), ([(0, 0, -(1 << 63))], "argument byte 0"),
     ([(0, 0, 8), (0, 8, -8)], "argument byte 8"), ([(0, 0, 1 << 64)], "argument byte 0"),
     ([(0, 0, 8), (1, -1, -(1 << 62))], "its destination")],
    ids=["no-such-node", "unaligned", "past-the-arguments", "memset-argument", "kernel-source", "below-zero",
         "second-below-zero", "past-64-bits", "memset-below-zero"],
)  # fmt: skip
def test_moving_a_place_a_description_does_not_have_is_an_error_naming_it(words: Any, field: str) -> None:
    description = GraphDescription(
        (KernelNode("k", (1, 1, 1), (1, 1, 1), 0, u64(POOL.base, 7)), MemsetNode(POOL.base, 0, 0, 1, 16, 1))
    )
    with pytest.raises(GraphDescriptionError, match=field):
        description.moved(words)


def test_kernels_are_resolved_through_their_modules_and_a_missing_one_builds_nothing() -> None:
    driver = FakeDriver()
    graph, handles = mlp_graph(driver)
    description, _ = describe(driver, graph)
    torch_module = driver.function("a", "vectorized_elementwise_kernel_gelu", "b")
    found = resolve(driver, description.kernels(), [torch_module[0], torch_module[2]])
    assert found == {"vectorized_elementwise_kernel_gelu": torch_module[1]}  # the GEMM is alone in its module
    created = len(driver.graphs)
    with pytest.raises(GraphRestoreError, match=r"1 kernel\(s\) of the graph have no function handle.*nvjet"):
        rebuild(driver, description, found)
    assert len(driver.graphs) == created  # nothing built

    driver.fail_on = "kernel"
    with pytest.raises(GraphRestoreError, match="OUT_OF_MEMORY"):
        rebuild(driver, description, handles)
    assert len(driver.destroyed) == 1  # the half-built graph


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda d: d.update(format=1), "format"),
        (lambda d: d["nodes"][1].update(args="zz"), "node 1 args"),
        (lambda d: d["nodes"][2].update(grid=[1, 2]), "node 2 grid"),
        (lambda d: d["nodes"][2].update(grid=[1, 2, -1]), r"node 2 grid\[2\]"),
        (lambda d: d["nodes"][2].update(layout=[[16, 64]]), r"node 2 layout\[0\]"),
        (lambda d: d["nodes"][1].update(layout=[[0, 8]]), "node 1 layout"),
        (lambda d: d["nodes"][1].update(launched_with="cooperative"), "node 1 launched_with"),
        (lambda d: d["nodes"][1].update(attributes=[[4, "00"]]), "node 1"),
        (lambda d: d["nodes"][0].update(element_size=3), "node 0 element_size"),
        (lambda d: d["nodes"][3].update(kind="host"), "node 3 kind"),
        (lambda d: d["nodes"][2].pop("function"), "node 2"),
        (lambda d: d["edges"].append([0, 9, "00" * 8]), "edge 4"),
        (lambda d: d["edges"][0].__setitem__(2, "00"), "edge 0 data"),
        (lambda d: d.update(nodes={}), "nodes and edges"),
        (lambda d: d["nodes"][2].update(shared_bytes=True), "node 2 shared_bytes"),
        (lambda d: d["nodes"][4].update(src_type=1), "node 4 src_type"),
        (lambda d: d["nodes"][4].update(dst_type=3), "node 4 dst_type"),
        (lambda d: d["nodes"][4].pop("depth"), "node 4"),
        (lambda d: d["nodes"][4].update(width=-1), "node 4 width"),
        (lambda d: d["nodes"][4].update(height=2, src_pitch=64, dst_pitch=16384), "node 4 geometry"),
    ],
)
def test_a_malformed_description_is_an_error_naming_the_field(change: Any, field: str) -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    raw = describe(driver, graph)[0].to_json()
    change(raw)
    with pytest.raises(GraphDescriptionError, match=f"graph description: {field}"):
        GraphDescription.from_json(raw)


def test_a_graph_described_as_tables_comes_back_the_same() -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    description = describe(driver, graph)[0]
    assert GraphDescription.from_binary(description.to_binary()) == description
    assert GraphDescription.from_binary(memoryview(description.to_binary())) == description
    empty = GraphDescription(())
    assert GraphDescription.from_binary(empty.to_binary()) == empty


def _binary_tables(raw: bytearray, description: GraphDescription) -> dict[str, np.ndarray]:
    """Writable numpy views of the tables of ``raw`` (``description.to_binary()``), to corrupt one field."""
    from weightcache.graphs import description as module

    spans = sum(len(n.layout) for n in description.nodes if isinstance(n, KernelNode))
    attributes = sum(len(n.attributes) for n in description.nodes if isinstance(n, KernelNode))
    copies = sum(isinstance(n, MemcpyNode) for n in description.nodes)
    at, out = 4, {}
    for name, dtype, count in (
        ("counts", np.dtype("<u4"), 7),
        ("nodes", module._NODE, len(description.nodes)),
        ("spans", module._SPAN, spans),
        ("attributes", module._ATTRIBUTE, attributes),
        ("edges", module._EDGE, len(description.edges)),
        ("copies", np.dtype("<u8"), copies * len(module._MEMCPY_FIELDS)),
    ):
        out[name] = np.frombuffer(raw, dtype=dtype, count=count, offset=at)
        at += dtype.itemsize * count
    out["names"] = np.frombuffer(raw, dtype=np.uint8, offset=at)
    return out


@pytest.mark.parametrize(
    "change, field",
    [
        (lambda raw, t: raw.__setitem__(slice(0, 4), b"WCGX"), "the binary description"),
        (lambda raw, t: t["counts"].__setitem__(0, 1), "format"),
        (lambda raw, t: t["counts"].__setitem__(6, 1 << 28), "the memcpy table"),
        (lambda raw, t: t["nodes"]["kind"].__setitem__(3, 3), "the memcpy nodes"),
        (lambda raw, t: t["copies"].__setitem__(9, 1), "node 4 memory types"),
        (lambda raw, t: t["copies"].__setitem__(10, 3), "node 4 memory types"),
        (lambda raw, t: t["copies"].__setitem__(4, 2), "node 4 geometry"),  # depth 2, slices of height 0
        (lambda raw, t: t["copies"][3:8].__setitem__(slice(None), [2, 1, 16384, 0, 0]), "node 4 geometry"),
        (lambda raw, t: t["counts"].__setitem__(1, 1 << 20), "the node table"),
        (lambda raw, t: t["nodes"]["kind"].__setitem__(3, 7), "node 3 kind"),
        (lambda raw, t: t["nodes"]["form"].__setitem__(1, 5), "node 1 launched_with"),
        (lambda raw, t: t["nodes"]["name"].__setitem__(1, 9), "node 1 function"),
        (lambda raw, t: t["spans"]["size"].__setitem__(2, 64), "node 2 layout"),
        (lambda raw, t: t["nodes"]["memset"].__setitem__((0, 3), 3), "node 0 element_size"),
        (lambda raw, t: t["nodes"]["args"].__setitem__(0, 8), "node 0"),
        (lambda raw, t: t["nodes"]["layout"].__setitem__(1, 1), "node 1 layout"),
        (lambda raw, t: t["nodes"]["args"].__setitem__(2, 4), "the nodes' argument bytes"),
        (lambda raw, t: t["edges"]["dst"].__setitem__(2, 9), "edge 2"),
        (lambda raw, t: t["edges"]["src"].__setitem__(3, 5), "edge 3"),
        (lambda raw, t: t["names"].__setitem__(8, 0xFF), "name 0"),
        (lambda raw, t: bytes(raw) + b"x", "the nodes' argument bytes"),
        (lambda raw, t: bytes(raw[:-1]), "the nodes' argument bytes"),
    ],
)
def test_a_malformed_binary_description_is_an_error_naming_the_field(change: Any, field: str) -> None:
    driver = FakeDriver()
    graph, _ = mlp_graph(driver)
    description = describe(driver, graph)[0]
    raw = bytearray(description.to_binary())
    tables = _binary_tables(raw, description)
    changed = change(raw, tables)  # in place, or a new blob
    with pytest.raises(GraphDescriptionError, match=f"graph description: {field}"):
        GraphDescription.from_binary(changed if isinstance(changed, bytes) else bytes(raw))


def test_an_image_reaches_the_driver_without_a_copy_when_it_is_mapped_and_aligned() -> None:
    """cuModuleLoadData gets a pointer: to bytes as they are; into a mapped artifact itself (no copy) where the image
    starts aligned, as format 2 places each; to a copy where it does not."""
    import ctypes

    from weightcache.artifacts import map_blob, sealed_memfd
    from weightcache.graphs.bundle import IMAGE_ALIGNMENT
    from weightcache.graphs.driver import _address_of

    image = bytes(range(256)) * 64
    assert _address_of(image) is image
    fd, _ = sealed_memfd(bytes(IMAGE_ALIGNMENT) + image + b"x")
    try:
        mapped = map_blob(fd, IMAGE_ALIGNMENT + len(image) + 1)
    finally:
        os.close(fd)
    assert mapped.readonly
    view = mapped[IMAGE_ALIGNMENT : IMAGE_ALIGNMENT + len(image)]
    pointer = _address_of(view)
    assert isinstance(pointer, ctypes.c_void_p) and ctypes.string_at(pointer, len(image)) == image
    assert pointer.value == np.frombuffer(mapped, dtype=np.uint8).ctypes.data + IMAGE_ALIGNMENT  # the mapping
    del view, mapped
    assert ctypes.string_at(pointer, len(image)) == image  # the pointer keeps the mapping alive
    unaligned = memoryview(b"ab" + image)[1:]
    copied = _address_of(unaligned)
    assert isinstance(copied, bytes) and copied == b"b" + image


class FakeLibcuda:
    """libcuda's graph calls as real ctypes function pointers (Python callbacks), so that the argument conversions
    ctypes makes for :class:`CudaGraphDriver` run as they do against the driver: cuModuleLoadData records the image
    bytes it was given; every other call returns CUDA_SUCCESS."""

    def __init__(self, image_size: int) -> None:
        import ctypes

        self.images: list[bytes] = []
        self._functions: dict[str, Any] = {}

        def load(module: int, image: int) -> int:
            self.images.append(ctypes.string_at(image, image_size))
            ctypes.cast(module, ctypes.POINTER(ctypes.c_void_p))[0] = 42
            return 0

        self._load = load

    def __getattr__(self, name: str) -> Any:
        import ctypes

        from weightcache.graphs.driver import _SIGNATURES

        if name not in self._functions:
            count = len(_SIGNATURES.get(name, [ctypes.c_int, ctypes.c_void_p]))
            prototype = ctypes.CFUNCTYPE(ctypes.c_int, *[ctypes.c_void_p] * count)
            self._functions[name] = prototype(self._load if name == "cuModuleLoadData" else lambda *_: 0)
        return self._functions[name]


def test_the_driver_loads_an_image_from_bytes_from_a_mapping_and_from_a_copy() -> None:
    """Through ctypes' own argument conversions (on the H200, 2026-12-04, a mapped image failed there with
    ``ctypes.ArgumentError: argument 2: TypeError: wrong type``: cuModuleLoadData was declared to take a
    ``char *``, which refuses the pointer into the mapping)."""
    from weightcache.artifacts import map_blob, sealed_memfd
    from weightcache.graphs.bundle import IMAGE_ALIGNMENT

    image = bytes(range(256)) * 64
    lib = FakeLibcuda(len(image))
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    fd, _ = sealed_memfd(bytes(IMAGE_ALIGNMENT) + image + b"x")
    try:
        mapped = map_blob(fd, IMAGE_ALIGNMENT + len(image) + 1)
    finally:
        os.close(fd)
    aligned = mapped[IMAGE_ALIGNMENT : IMAGE_ALIGNMENT + len(image)]
    unaligned = memoryview(b"a" + image)[1:]
    assert [driver.load_module(x) for x in (image, aligned, unaligned)] == [42, 42, 42]
    assert lib.images == [image, image, image]


def test_a_graph_without_edges_is_described_without_a_second_query() -> None:
    """A graph of one node has no edges: the count query answers 0, and the driver refuses the second query with
    arrays of room for 0 edges (CUDA_ERROR_INVALID_VALUE from cuGraphGetEdges_v2, H100, driver 580.159.04,
    2026-12-05: the cooperative-kernel test failed there); with edges both queries are made and give them."""
    import ctypes

    lib = FakeLibcuda(0)
    edges: list[tuple[int, int]] = []
    queries: list[bool] = []

    def get_edges(graph: int, src: int, dst: int, data: int, count: int) -> int:
        counted = ctypes.cast(count, ctypes.POINTER(ctypes.c_size_t))
        queries.append(bool(src))
        if not src:
            counted[0] = len(edges)
            return 0
        if counted[0] == 0:
            return 1  # CUDA_ERROR_INVALID_VALUE
        for i, (a, b) in enumerate(edges):
            ctypes.cast(src, ctypes.POINTER(ctypes.c_void_p))[i] = a
            ctypes.cast(dst, ctypes.POINTER(ctypes.c_void_p))[i] = b
            ctypes.memmove(data + 8 * i, bytes([i + 1]) * 8, 8)
        return 0

    c = ctypes.c_void_p
    lib._functions["cuGraphGetEdges_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, c, c)(get_edges)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    assert driver.graph_edges(0xABC) == [] and queries == [False]
    edges[:] = [(0x10, 0x20), (0x20, 0x30)]
    queries.clear()
    assert driver.graph_edges(0xABC) == [(0x10, 0x20, b"\x01" * 8), (0x20, 0x30, b"\x02" * 8)]
    assert queries == [False, True]


def test_a_call_ctypes_refuses_is_a_restore_error_so_the_graph_is_captured() -> None:
    """A binding that does not fit (a wrong argument type) is a :class:`GraphRestoreError` naming the call, which a
    restore turns into a capture, not an exception out of the engine's start."""
    driver = CudaGraphDriver(FakeLibcuda(0))  # type: ignore[arg-type]
    with pytest.raises(GraphRestoreError, match="cuFuncSetAttribute could not be called.*wrong type"):
        driver.set_function_attribute(1, "an attribute", 2)  # type: ignore[arg-type]


def test_a_kernel_node_reaches_the_driver_as_its_description_says() -> None:
    """``add_kernel_node`` through ctypes: the driver gets the function, geometry, shared memory, the argument bytes
    as one buffer (``extra``: buffer pointer, buffer size, end) and each launch attribute, whatever the node's
    launch form; an empty argument list is a buffer of size 0."""
    import ctypes

    from weightcache.graphs.driver import KernelNodeParams

    lib = FakeLibcuda(0)
    seen: list[dict[str, Any]] = []
    attributes: list[tuple[int, int, bytes]] = []

    def add(out: int, _graph: int, _deps: int, _count: int, params: int) -> int:
        p = ctypes.cast(params, ctypes.POINTER(KernelNodeParams)).contents
        extra = [p.extra[i] or 0 for i in range(5)]
        assert (extra[0], extra[2], extra[4]) == (1, 2, 0)  # BUFFER_POINTER, BUFFER_SIZE, END
        assert not p.kern and not p.ctx  # the function is given as func: no kernel handle, no context
        size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t)).contents.value
        seen.append(
            {
                "func": p.func,
                "grid": (p.gridDimX, p.gridDimY, p.gridDimZ),
                "block": (p.blockDimX, p.blockDimY, p.blockDimZ),
                "shared": p.sharedMemBytes,
                "args": ctypes.string_at(extra[1], size),
                "kernelParams": bool(p.kernelParams),
            }
        )
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x1000 + len(seen)
        return 0

    def attribute(node: int, which: int, value: int) -> int:
        attributes.append((node, which, ctypes.string_at(value, 64)))
        return 0

    c = ctypes.c_void_p
    lib._functions["cuGraphAddKernelNode_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, ctypes.c_size_t, c)(add)
    lib._functions["cuGraphKernelNodeSetAttribute"] = ctypes.CFUNCTYPE(ctypes.c_int, c, ctypes.c_int, c)(attribute)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    laid_out = KernelNode("k", (7, 2, 1), (128, 1, 1), 4096, bytes(range(24)), ((0, 8), (8, 8), (16, 8)), "params")
    buffer = KernelNode("g", (1, 1, 1), (384, 1, 1), 0, b"\x01" * 1024, (), "buffer", ((4, b"\x02" * 64),))
    empty = KernelNode("e", (1, 1, 1), (1, 1, 1), 0, b"")
    calls = ((0x7F0000000010, laid_out), (0x20, buffer), (0x30, empty))
    nodes = [driver.add_kernel_node(0xABC, f, n) for f, n in calls]
    assert nodes == [0x1001, 0x1002, 0x1003]
    assert seen == [
        {"func": 0x7F0000000010, "grid": (7, 2, 1), "block": (128, 1, 1), "shared": 4096, "args": bytes(range(24))}
        | {"kernelParams": False},
        {"func": 0x20, "grid": (1, 1, 1), "block": (384, 1, 1), "shared": 0, "args": b"\x01" * 1024}
        | {"kernelParams": False},
        {"func": 0x30, "grid": (1, 1, 1), "block": (1, 1, 1), "shared": 0, "args": b"", "kernelParams": False},
    ]
    assert attributes == [(0x1002, 4, b"\x02" * 64)]


class RecordingLibcuda(FakeLibcuda):
    """FakeLibcuda whose graph-building calls record what reached them, decoded from the structures ctypes passed:
    kernel nodes (function, geometry, shared memory, argument bytes and how they were given), their attributes,
    memsets, memcpys, empty nodes and edges (from, to, data). Node handles count up from 0x5000."""

    def __init__(self) -> None:
        import ctypes

        from weightcache.graphs.driver import KernelNodeParams, _Memcpy3D, _MemsetParams

        super().__init__(0)
        self.calls: list[tuple[Any, ...]] = []
        c, p = ctypes.c_void_p, ctypes.POINTER(ctypes.c_void_p)

        def made(out: int) -> int:
            handle = 0x5000 + len(self.calls)
            ctypes.cast(out, p)[0] = handle
            return 0

        def kernel(out: int, _graph: int, _deps: int, _count: int, params: int) -> int:
            k = ctypes.cast(params, ctypes.POINTER(KernelNodeParams)).contents
            geometry = (k.func, (k.gridDimX, k.gridDimY, k.gridDimZ), (k.blockDimX, k.blockDimY, k.blockDimZ))
            if k.extra:
                extra = [k.extra[i] or 0 for i in range(5)]
                assert (extra[0], extra[2], extra[4]) == (1, 2, 0) and not k.kernelParams
                size = ctypes.cast(extra[3], ctypes.POINTER(ctypes.c_size_t)).contents.value
                given = ("extra", ctypes.string_at(extra[1], size))
            else:
                given = ("kernelParams", ctypes.string_at(k.kernelParams[0], 8))
            self.calls.append(("kernel", *geometry, k.sharedMemBytes, *given, k.kern, k.ctx))
            return made(out)

        def attribute(node: int, which: int, value: int) -> int:
            self.calls.append(("attribute", node, which, ctypes.string_at(value, 64)))
            return 0

        def memset(out: int, _graph: int, _deps: int, _count: int, params: int, _ctx: int) -> int:
            m = ctypes.cast(params, ctypes.POINTER(_MemsetParams)).contents
            self.calls.append(("memset", m.dst, m.pitch, m.value, m.elementSize, m.width, m.height))
            return made(out)

        def memcpy(out: int, _graph: int, _deps: int, _count: int, params: int, _ctx: int) -> int:
            m = ctypes.cast(params, ctypes.POINTER(_Memcpy3D)).contents
            self.calls.append(("memcpy", m.srcDevice, m.dstDevice, m.WidthInBytes, m.Height, m.Depth))
            return made(out)

        def empty(out: int, _graph: int, _deps: int, _count: int) -> int:
            self.calls.append(("empty",))
            return made(out)

        def edges(_graph: int, src: int, dst: int, data: int, count: int) -> int:
            a, b = ctypes.cast(src, p), ctypes.cast(dst, p)
            pairs = [(a[i], b[i]) for i in range(count)]
            self.calls.append(("edges", pairs, ctypes.string_at(data, 8 * count)))
            return 0

        z = ctypes.c_size_t
        self._functions["cuGraphAddKernelNode_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, z, c)(kernel)
        self._functions["cuGraphKernelNodeSetAttribute"] = ctypes.CFUNCTYPE(ctypes.c_int, c, ctypes.c_int, c)(attribute)
        self._functions["cuGraphAddMemsetNode"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, z, c, c)(memset)
        self._functions["cuGraphAddMemcpyNode"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, z, c, c)(memcpy)
        self._functions["cuGraphAddEmptyNode"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, z)(empty)
        self._functions["cuGraphAddDependencies_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, c, z)(edges)


def test_a_graph_built_from_its_tables_reaches_the_driver_as_one_built_node_by_node() -> None:
    """CudaGraphDriver.add_description (every kernel node's parameters made as arrays from the binary tables, one
    driver call a node) gives the driver exactly what adding each node through add_kernel_node and the other
    methods gives it: functions, geometry, shared memory, argument bytes (a buffer; a laid-out cooperative node
    parameter by parameter), attributes, memsets, memcpys, empty nodes, edges with their data; for a description
    read from its bytes (tables, no node values made) and for one made of node values."""
    fake = FakeDriver()
    graph, functions = mlp_graph(fake)
    description, _ = describe(fake, graph)
    cooperative = KernelNode(
        "grid_sync", (132, 1, 1), (256, 1, 1), 0, u64(POOL.base, 7), ((0, 8), (8, 8)), "params",
        ((2, (1).to_bytes(4, "little") + bytes(60)),),
    )  # fmt: skip
    empty_args = KernelNode("noargs", (1, 1, 1), (32, 1, 1), 0, b"")
    nodes = (*description.nodes, cooperative, empty_args, description.nodes[1])
    edges = (*description.edges, Edge(4, 5), Edge(5, 6, bytes([1] + [0] * 7)), Edge(6, 7))
    whole = GraphDescription(nodes, edges)
    functions = {**functions, "grid_sync": 0x77, "noargs": 0x78}
    read = GraphDescription.from_binary(memoryview(whole.to_binary()))

    def built(how: str, d: GraphDescription) -> list[tuple[Any, ...]]:
        lib = RecordingLibcuda()
        driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
        if how == "tables":
            driver.add_description(0xABC, d, functions)
        elif how == "tables, one call a node":
            driver._loop_tried = True  # (as where weightcache's native library cannot be built)
            driver.add_description(0xABC, d, functions)
        else:
            add_each(driver, 0xABC, d, functions)
        return lib.calls

    one_by_one = built("nodes", whole)
    assert [c[0] for c in one_by_one] == [
        "memset", "kernel", "attribute", "kernel", "empty", "memcpy", "kernel", "attribute", "kernel", "kernel",
        "attribute", "edges",
    ]  # fmt: skip
    assert one_by_one[6][5] == "kernelParams" and one_by_one[8][5:7] == ("extra", b"")
    assert built("tables", read) == one_by_one
    assert read._nodes is None  # no node value was made on the way
    assert built("tables", whole) == one_by_one
    assert built("tables, one call a node", read) == one_by_one


ADD_KERNEL_NODE = r"""
#include <stddef.h>
#include <stdint.h>
static int calls, fail_at = -1;
static uint64_t funcs[4096];
void reset(int at) { calls = 0; fail_at = at; }
int added(void) { return calls; }
uint64_t func_of(int i) { return funcs[i]; }
/* cuGraphAddKernelNode_v2: the node's handle 0x5000 + its number; the first field of the parameters (func) kept */
int cuGraphAddKernelNode_v2(void **node, void *graph, void *const *deps, size_t n, const void *params) {
    if (calls == fail_at) return 700;
    funcs[calls & 4095] = *(const uint64_t *)params;
    *node = (void *)(uintptr_t)(0x5000 + calls++);
    return 0;
}
/* cuGraphKernelNodeSetAttribute: node, id and the value's first 8 bytes kept; fails with 1 where attribute_fails */
static int set_calls, attribute_fails;
static uint64_t set_node[64], set_id[64], set_value[64];
void fail_attributes(int on) { set_calls = 0; attribute_fails = on; }
int attributes_set(void) { return set_calls; }
uint64_t set_of(int i, int what) { return what == 0 ? set_node[i] : what == 1 ? set_id[i] : set_value[i]; }
/* cuGraphAddMemsetNode: the node's handle 0x9000 + its number; its destination, value and context kept */
static int memset_calls, memset_fails;
static uint64_t memset_of[3];
void fail_memsets(int on) { memset_calls = 0; memset_fails = on; }
int memsets_added(void) { return memset_calls; }
uint64_t memset_field(int what) { return memset_of[what]; }
int cuGraphAddMemsetNode(void **node, void *graph, void *const *deps, size_t n, const void *params, void *ctx) {
    if (memset_fails) return 2;
    memset_of[0] = *(const uint64_t *)params; memset_of[1] = *(const uint32_t *)((const char *)params + 16);
    memset_of[2] = (uintptr_t)ctx;
    *node = (void *)(uintptr_t)(0x9000 + memset_calls++);
    return 0;
}
int cuGraphKernelNodeSetAttribute(void *node, int id, const void *value) {
    if (attribute_fails) return 1;
    set_node[set_calls & 63] = (uintptr_t)node; set_id[set_calls & 63] = (uint64_t)id;
    set_value[set_calls & 63] = *(const uint64_t *)value;
    set_calls++;
    return 0;
}
"""


@pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None, reason="needs a C compiler")
def test_runs_of_nodes_are_added_with_their_attributes_in_one_native_call_that_lets_go_of_the_gil(
    tmp_path: Path,
) -> None:
    """CudaGraphDriver.add_description adds each run of kernel and memset nodes, and sets the kernel nodes' launch
    attributes, in one call of weightcache's native loop (``wc_add_nodes``, made through ``ctypes``, which lets go
    of the GIL for the call): one ``ctypes`` call a node or attribute takes the GIL back after each, and a graph
    built on a worker thread then waits up to the switch interval (5 ms) each time another thread runs Python (an
    engine preparing its inputs while its graphs are built ahead; benchmarks/graph_restore_cpu.py models it). The
    loop first took only kernel nodes without attributes, and every kernel node described on the H200 and the H100
    has one (its cluster scheduling policy): vLLM's 51 graphs took 0.5-0.9 s to add on the build thread (H100,
    2026-12-06); a memset node still ended a run. Here a driver in C is called for a graph of 300 kernel nodes,
    two with attributes, a memset among them and an empty node: the memset and the kernels around it in one call
    of the loop, the empty node through the driver's method; the nodes come back in order, each kernel with its
    function, each attribute set on its node with its value, the memset with its fields in the current context; a
    failing node's or attribute's error names the call and the node."""
    import ctypes

    from weightcache.graphs.driver import _MEMSET_PARAMS, _MemsetParams

    assert _MEMSET_PARAMS.itemsize == ctypes.sizeof(_MemsetParams)
    assert [_MEMSET_PARAMS.fields[f[0]][1] for f in _MemsetParams._fields_] == [  # type: ignore[index]
        getattr(_MemsetParams, f[0]).offset for f in _MemsetParams._fields_
    ]
    source, library = tmp_path / "add.c", tmp_path / "add.so"
    source.write_text(ADD_KERNEL_NODE)
    subprocess.run([shutil.which("cc") or "gcc", "-shared", "-fPIC", "-o", str(library), str(source)], check=True)
    fake = ctypes.CDLL(str(library))
    fake.func_of.restype = fake.set_of.restype = fake.memset_field.restype = ctypes.c_uint64
    lib = RecordingLibcuda()
    for name in ("cuGraphAddKernelNode_v2", "cuGraphKernelNodeSetAttribute", "cuGraphAddMemsetNode"):
        lib._functions[name] = getattr(fake, name)

    def current(out: int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC7C
        return 0

    lib._functions["cuCtxGetCurrent"] = ctypes.CFUNCTYPE(ctypes.c_int, ctypes.c_void_p)(current)
    policy, cluster = (5, u64(1) + bytes(56)), (4, bytes.fromhex("020000000100000001000000") + bytes(52))
    nodes: list[KernelNode | MemsetNode | EmptyNode] = [
        KernelNode(f"k{i % 3}", (1, 1, 1), (32, 1, 1), 0, u64(i)) for i in range(300)
    ]
    nodes[120] = KernelNode("k0", (1, 1, 1), (32, 1, 1), 0, u64(7), (), "buffer", (policy,))
    nodes[250] = KernelNode("k1", (1, 1, 1), (32, 1, 1), 0, u64(8), (), "buffer", (cluster, policy))
    nodes.insert(200, MemsetNode(POOL.base, 0, 0xAB, 4, 16, 1))  # in the loop's run
    nodes.insert(280, EmptyNode())  # through the driver's method: ends the run
    edges = (Edge(0, 1), Edge(119, 120), Edge(199, 200), Edge(200, 201), Edge(279, 280), Edge(300, 301))
    description = GraphDescription.from_binary(GraphDescription(tuple(nodes), edges).to_binary())
    functions = {"k0": 0x70, "k1": 0x71, "k2": 0x72}
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    loop = driver._native_loop()
    assert loop is not None  # (built with the C compiler)
    runs: list[int] = []

    def counted(*args: Any) -> int:
        runs.append(args[6])
        return int(loop(*args))

    driver._loop = counted
    fake.reset(-1)
    fake.fail_attributes(0)
    fake.fail_memsets(0)
    driver.add_description(0xABC, description, functions)
    assert runs == [280, 21] and fake.added() == 300 and fake.memsets_added() == 1
    assert [fake.memset_field(w) for w in range(3)] == [POOL.base, 0xAB, 0xC7C]  # dst, value, context
    assert [c[0] for c in lib.calls] == ["empty", "edges"]
    set_calls = [tuple(fake.set_of(k, w) for w in range(3)) for k in range(fake.attributes_set())]
    assert set_calls == [(0x5000 + 120, 5, 1), (0x5000 + 250, 4, 2 | 1 << 32), (0x5000 + 250, 5, 1)]
    kernel = [0x5000 + i for i in range(300)]
    handles = [*kernel[:200], 0x9000, *kernel[200:279], 0x5000 + 1, *kernel[279:]]  # (empty: the fake's own count)
    assert lib.calls[1][1] == [(handles[e.src], handles[e.dst]) for e in edges]
    assert [fake.func_of(i) for i in range(300)] == [0x70 + i % 3 for i in range(300)]

    fake.fail_memsets(1)
    with pytest.raises(GraphRestoreError, match=r"cuGraphAddMemsetNode failed: 2 \(node 200 of the graph\)"):
        driver.add_description(0xABC, description, functions)
    fake.fail_memsets(0)
    for driver._loop in (counted, None):  # the loop, then one call a node and attribute (no native library)
        fake.reset(150)
        with pytest.raises(GraphRestoreError, match=r"cuGraphAddKernelNode_v2 failed: 700 \(node 150 of the graph\)"):
            driver.add_description(0xABC, description, functions)
        fake.reset(-1)
        fake.fail_attributes(1)
        match = r"cuGraphKernelNodeSetAttribute failed: 1 \(node 120 of the graph\)"
        with pytest.raises(GraphRestoreError, match=match):
            driver.add_description(0xABC, description, functions)
        fake.fail_attributes(0)


def test_prepare_gives_each_function_the_shared_memory_and_cluster_size_its_nodes_ask_for() -> None:
    """A function loaded from a kept image has the default limits: prepare sets the largest dynamic shared memory
    any of its nodes asks for, where that is above 48 KiB, and allows a non-portable cluster (more than 8 blocks)
    where a node asks for one; nothing else. The same from node values and from the binary tables."""
    from weightcache.graphs.driver import MAX_DYNAMIC_SHARED, NON_PORTABLE_CLUSTER
    from weightcache.graphs.record import prepare

    def cluster(x: int, y: int, z: int) -> tuple[int, bytes]:
        return 4, b"".join(v.to_bytes(4, "little") for v in (x, y, z)) + bytes(52)

    def node(name: str, shared: int, *attributes: tuple[int, bytes]) -> KernelNode:
        return KernelNode(name, (1, 1, 1), (128, 1, 1), shared, u64(1), ((0, 8),), "params", attributes)

    nodes = (
        node("gemm", 200_704), node("gemm", 100_000), node("small", 48 << 10),
        node("big_cluster", 0, cluster(4, 2, 2)), node("portable", 0, cluster(8, 1, 1)),
        MemsetNode(POOL.base, 0, 0, 4, 16, 1), node("both", 65_536, cluster(16, 1, 1)),
    )  # fmt: skip
    handles = {"gemm": 1, "small": 2, "big_cluster": 3, "portable": 4, "both": 5}

    class Attributes:
        def __init__(self) -> None:
            self.set: list[tuple[int, int, int]] = []

        def set_function_attribute(self, function: int, attribute: int, value: int) -> None:
            self.set.append((function, attribute, value))

    expected = [(1, MAX_DYNAMIC_SHARED, 200_704), (5, MAX_DYNAMIC_SHARED, 65_536), (3, NON_PORTABLE_CLUSTER, 1),
                (5, NON_PORTABLE_CLUSTER, 1)]  # fmt: skip
    for description in (GraphDescription(nodes), GraphDescription.from_binary(GraphDescription(nodes).to_binary())):
        driver = Attributes()
        prepare(driver, description, handles)  # type: ignore[arg-type]
        assert sorted(driver.set, key=lambda c: (c[1], c[0])) == expected


def test_a_cooperative_kernel_node_gets_its_parameters_one_by_one() -> None:
    """cuda.h: ``CUDA_ERROR_INVALID_VALUE`` if ``extra`` is used for a cooperative kernel. A laid-out node with the
    cooperative attribute reaches the driver with ``kernelParams`` (one pointer per parameter into its bytes) and
    no ``extra``; its attribute is set again after."""
    import ctypes

    from weightcache.graphs.driver import KernelNodeParams

    lib = FakeLibcuda(0)
    seen: list[tuple[bool, list[bytes]]] = []
    attributes: list[int] = []

    def add(out: int, _graph: int, _deps: int, _count: int, params: int) -> int:
        p = ctypes.cast(params, ctypes.POINTER(KernelNodeParams)).contents
        sizes = (8, 4, 8)
        seen.append((bool(p.extra), [ctypes.string_at(p.kernelParams[i], n) for i, n in enumerate(sizes)]))
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x3000
        return 0

    def attribute(_node: int, which: int, _value: int) -> int:
        attributes.append(which)
        return 0

    c = ctypes.c_void_p
    lib._functions["cuGraphAddKernelNode_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, ctypes.c_size_t, c)(add)
    lib._functions["cuGraphKernelNodeSetAttribute"] = ctypes.CFUNCTYPE(ctypes.c_int, c, ctypes.c_int, c)(attribute)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    args = u64(0x7F00_0000_0000) + (7).to_bytes(4, "little") + bytes(4) + u64(0x7F00_0000_1000)
    cooperative = (2, (1).to_bytes(4, "little") + bytes(60))
    node = KernelNode(
        "grid_sync", (132, 1, 1), (256, 1, 1), 0, args, ((0, 8), (8, 4), (16, 8)), "params", (cooperative,)
    )
    assert driver.add_kernel_node(0xABC, 0x40, node) == 0x3000
    assert seen == [(False, [args[:8], args[8:12], args[16:24]])]
    assert attributes == [2]
    # given as one buffer at capture (its layout unknown), or without parameters: one buffer, as any other node
    buffer = KernelNode("g", (1, 1, 1), (32, 1, 1), 0, args, (), "buffer", (cooperative,))
    bare = KernelNode("n", (1, 1, 1), (32, 1, 1), 0, b"", (), "params", (cooperative,))
    modes: list[bool] = []

    def extra_only(out: int, _graph: int, _deps: int, _count: int, params: int) -> int:
        p = ctypes.cast(params, ctypes.POINTER(KernelNodeParams)).contents
        modes.append(bool(p.extra) and not p.kernelParams)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x3001
        return 0

    lib._functions["cuGraphAddKernelNode_v2"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, ctypes.c_size_t, c)(extra_only)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    assert [driver.add_kernel_node(0xABC, 0x40, n) for n in (buffer, bare)] == [0x3001, 0x3001]
    assert modes == [True, True]


def test_the_memcpy_structure_is_laid_out_as_cuda_h_says() -> None:
    """``CUDA_MEMCPY3D`` as ctypes lays it out: the offsets and size gcc gives for CUDA 13.0's ``cuda.h``
    (``offsetof``, x86-64), so that the driver reads each field where the structure puts it."""
    import ctypes

    from weightcache.graphs.driver import _Memcpy3D

    cuda_h = {
        "srcXInBytes": 0, "srcY": 8, "srcZ": 16, "srcLOD": 24, "srcMemoryType": 32, "srcHost": 40, "srcDevice": 48,
        "srcArray": 56, "reserved0": 64, "srcPitch": 72, "srcHeight": 80, "dstXInBytes": 88, "dstY": 96,
        "dstZ": 104, "dstLOD": 112, "dstMemoryType": 120, "dstHost": 128, "dstDevice": 136, "dstArray": 144,
        "reserved1": 152, "dstPitch": 160, "dstHeight": 168, "WidthInBytes": 176, "Height": 184, "Depth": 192,
    }  # fmt: skip
    assert [name for name, _ in _Memcpy3D._fields_] == list(cuda_h)  # every field, in cuda.h's order
    assert {name: getattr(_Memcpy3D, name).offset for name in cuda_h} == cuda_h
    assert ctypes.sizeof(_Memcpy3D) == 200


def test_a_memcpy_node_is_read_with_its_offsets_folded_and_one_from_host_memory_is_refused() -> None:
    """``memcpy_node`` through ctypes: the first byte of each side is its base address plus its X, Y and Z offsets
    (``cuMemcpy3D``'s rule); a copy from or to host memory or an array is a restore error naming it."""
    import ctypes

    from weightcache.graphs.driver import _Memcpy3D

    lib = FakeLibcuda(0)
    filled: dict[str, int] = {}

    def get(_node: int, params: int) -> int:
        m = ctypes.cast(params, ctypes.POINTER(_Memcpy3D)).contents
        for name, value in filled.items():
            setattr(m, name, value)
        return 0

    c = ctypes.c_void_p
    lib._functions["cuGraphMemcpyNodeGetParams"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c)(get)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    good = dict(srcMemoryType=2, srcDevice=0x7F00_0000_0000, srcXInBytes=16, srcY=2, srcZ=1, srcPitch=256,
                srcHeight=4, dstMemoryType=4, dstDevice=0x7E00_0000_0000, dstXInBytes=8, dstY=3, dstZ=5,
                dstPitch=512, dstHeight=8, WidthInBytes=64, Height=3, Depth=2)  # fmt: skip
    filled.update(good)
    assert driver.memcpy_node(0x10) == MemcpyNode(
        src=0x7F00_0000_0000 + (1 * 4 + 2) * 256 + 16, dst=0x7E00_0000_0000 + (5 * 8 + 3) * 512 + 8, width=64,
        height=3, depth=2, src_pitch=256, src_height=4, dst_pitch=512, dst_height=8, src_type=2, dst_type=4,
    )  # fmt: skip
    refused = (
        ({"srcMemoryType": 1}, "source is host memory"),
        ({"dstMemoryType": 3}, "destination is an array"),
        ({"dstLOD": 1}, "level of detail"),
        ({"srcPitch": 0}, "source has Y/Z offsets 2/1 with pitch 0"),
        ({"dstHeight": 0}, "destination has Y/Z offsets 3/5 with pitch 512 and height 0"),
        ({"dstPitch": 32}, "rows 64 bytes wide 256/32 bytes apart"),
        ({"srcHeight": 2}, "slices of 3 rows 2/8 rows apart"),
    )
    for change, what in refused:
        filled.clear()
        filled.update(good | change)
        with pytest.raises(GraphRestoreError, match=what):
            driver.memcpy_node(0x10)
    # a contiguous 2D or 3D copy (pitch == width, slice height == height) is described; slices of one row need a
    # pitch too (cuMemcpy3D may read 0 as "not given", and step by the width)
    filled.clear()
    filled.update(good | {"srcPitch": 64, "dstPitch": 64, "srcHeight": 3, "dstHeight": 3, "dstY": 0, "dstZ": 0})
    assert driver.memcpy_node(0x10).dst_pitch == 64
    filled.clear()
    filled.update(good | {"srcY": 0, "srcZ": 0, "srcPitch": 0, "Height": 1})
    with pytest.raises(GraphRestoreError, match="rows 64 bytes wide 0/512 bytes apart"):
        driver.memcpy_node(0x10)


def test_a_memcpy_node_reaches_the_driver_as_its_description_says() -> None:
    """``add_memcpy_node`` through ctypes: both sides' device addresses, pitches, heights and memory types, the
    copy's width, height and depth, no offsets, no host pointer or array, and the current context."""
    import ctypes

    from weightcache.graphs.driver import _Memcpy3D

    lib = FakeLibcuda(0)
    seen: list[dict[str, int]] = []
    contexts: list[int] = []

    def current(out: int) -> int:
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0xC0FFEE
        return 0

    def add(out: int, graph: int, deps: int, count: int, params: int, ctx: int) -> int:
        m = ctypes.cast(params, ctypes.POINTER(_Memcpy3D)).contents
        seen.append({name: int(getattr(m, name) or 0) for name, _ in _Memcpy3D._fields_})
        contexts.append(ctx)
        assert (graph, deps, count) == (0xABC, None, 0)
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x2000 + len(seen)
        return 0

    c = ctypes.c_void_p
    lib._functions["cuCtxGetCurrent"] = ctypes.CFUNCTYPE(ctypes.c_int, c)(current)
    lib._functions["cuGraphAddMemcpyNode"] = ctypes.CFUNCTYPE(ctypes.c_int, c, c, c, ctypes.c_size_t, c, c)(add)
    driver = CudaGraphDriver(lib)  # type: ignore[arg-type]
    node = MemcpyNode(0x7F00_0000_0640, 0x7E00_0000_0008, 64, 3, 2, 256, 4, 512, 8, 2, 4)
    assert driver.add_memcpy_node(0xABC, node) == 0x2001
    assert contexts == [0xC0FFEE]
    (fields,) = seen
    assert {k: v for k, v in fields.items() if v} == {
        "srcMemoryType": 2, "srcDevice": 0x7F00_0000_0640, "srcPitch": 256, "srcHeight": 4,
        "dstMemoryType": 4, "dstDevice": 0x7E00_0000_0008, "dstPitch": 512, "dstHeight": 8,
        "WidthInBytes": 64, "Height": 3, "Depth": 2,
    }  # fmt: skip


def test_a_description_that_is_no_object_is_an_error() -> None:
    with pytest.raises(GraphDescriptionError, match="the description must be an object"):
        GraphDescription.from_json([1, 2])


GPU_REBUILD = r"""
import ctypes, json, sys, time
import torch
from weightcache.graphs import CudaGraphDriver, GraphDescription, MemcpyNode, describe, rebuild

torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024),
                            torch.nn.LayerNorm(1024)).to("cuda", torch.bfloat16)
x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
static = torch.empty(8, 1024, device="cuda", dtype=torch.bfloat16)  # the output copied here: a memcpy node
with torch.no_grad():
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            model(x)
    torch.cuda.current_stream().wait_stream(side)
    g = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(g):
        out = model(x)
        static.copy_(out)
    g.instantiate()
    g.replay()
    torch.cuda.synchronize()
    captured, copied = out.clone(), static.clone()
driver = CudaGraphDriver()
description, functions = describe(driver, g.raw_cuda_graph())
description = GraphDescription.from_json(json.loads(json.dumps(description.to_json())))
start = time.perf_counter()
graph = rebuild(driver, description, functions)
lib = ctypes.CDLL("libcuda.so.1")
exec_ = ctypes.c_void_p()
assert lib.cuGraphInstantiateWithFlags(ctypes.byref(exec_), ctypes.c_void_p(graph), ctypes.c_uint64(0)) == 0
out.zero_()
static.zero_()
assert lib.cuGraphLaunch(exec_, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)) == 0
torch.cuda.synchronize()
print(json.dumps({"equal": bool(torch.equal(out, captured)), "copied": bool(torch.equal(static, copied)),
                  "memcpys": sum(isinstance(n, MemcpyNode) for n in description.nodes),
                  "kernels": len(description.kernels()), "nodes": len(description.nodes),
                  "rebuild_s": time.perf_counter() - start}))
"""


@pytest.mark.cuda
def test_on_a_gpu_a_graph_rebuilt_from_its_json_description_replays_bitwise_equal() -> None:
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", GPU_REBUILD], capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.splitlines()[-1])
    # torch copies between contiguous tensors of one dtype with cudaMemcpyAsync: captured, a memcpy node
    assert result["equal"] and result["copied"] and result["memcpys"] == 1 and result["kernels"] >= 3, result


GPU_COOPERATIVE = r"""
import ctypes, json, sys
import torch
from weightcache.errors import GraphRestoreError
from weightcache.graphs import CudaGraphDriver, KernelNode, GraphDescription, describe, rebuild

lib = ctypes.CDLL("libcuda.so.1")
torch.zeros(1, device="cuda")  # torch's context, current on this thread
ptx = open(sys.argv[1], "rb").read() + b"\0"
module, fn = ctypes.c_void_p(), ctypes.c_void_p()
assert lib.cuModuleLoadData(ctypes.byref(module), ptx) == 0, "the PTX did not load"
assert lib.cuModuleGetFunction(ctypes.byref(fn), module, b"coop_sum") == 0
blocks, n = 64, 1 << 20
x = torch.rand(n, device="cuda", generator=torch.Generator("cuda").manual_seed(0))
partial, out = torch.zeros(blocks, device="cuda"), torch.zeros(1, device="cuda")
args = [ctypes.c_void_p(x.data_ptr()), ctypes.c_void_p(partial.data_ptr()), ctypes.c_void_p(out.data_ptr()),
        ctypes.c_int(n), ctypes.c_float(2.0)]
params = (ctypes.c_void_p * 5)(*[ctypes.cast(ctypes.pointer(a), ctypes.c_void_p) for a in args])
stream = torch.cuda.Stream()
launch = lambda: lib.cuLaunchCooperativeKernel(fn, blocks, 1, 1, 256, 1, 1, 0, ctypes.c_void_p(stream.cuda_stream),
                                               params)
torch.cuda.synchronize()  # x is written on torch's stream, the kernel runs on `stream`
assert launch() == 0
stream.synchronize()
eager = out.clone()
g = torch.cuda.CUDAGraph(keep_graph=True)
with torch.cuda.graph(g, stream=stream):
    captured_rc = launch()
g.instantiate()
driver = CudaGraphDriver()
description, functions = describe(driver, g.raw_cuda_graph())
kernels = [node for node in description.nodes if isinstance(node, KernelNode)]
out.zero_()
g.replay()
torch.cuda.synchronize()
replayed = out.clone()


def run(desc):
    graph = rebuild(driver, desc, functions)
    try:
        executable = driver.instantiate(graph)
    finally:
        driver.destroy_graph(graph)
    out.zero_()
    torch.cuda.synchronize()
    driver.launch(executable, stream.cuda_stream)
    stream.synchronize()
    driver.destroy_executable(executable)
    return out.clone()


if sys.argv[2] == "params":
    rebuilt_equal, buffer_result = bool(torch.equal(run(description), eager)), None
else:  # the same node given as one argument buffer (``extra``): what the driver does with it, for the record
    as_buffer = GraphDescription(tuple(KernelNode(k.function, k.grid, k.block, k.shared_bytes, k.args, (), "buffer",
                                                  k.attributes) for k in kernels), ())
    rebuilt_equal = None
    try:
        buffer_result = "equal" if torch.equal(run(as_buffer), eager) else "different"
    except GraphRestoreError as exc:
        buffer_result = str(exc)
print(json.dumps({"captured_rc": captured_rc, "kernels": len(kernels), "forms": [k.launched_with for k in kernels],
                  "attributes": [[a for a, _ in k.attributes] for k in kernels],
                  "replayed_equal": bool(torch.equal(replayed, eager)),
                  "rebuilt_equal": rebuilt_equal, "buffer_form": buffer_result}))
"""


@pytest.mark.cuda
def test_on_a_gpu_a_cooperative_kernel_node_is_rebuilt_and_replays_bitwise_equal() -> None:
    """A kernel that synchronizes its whole grid (tests/data/coop_sum.cu, ``grid.sync()``), launched cooperatively
    under stream capture: its node carries the cooperative attribute, is described with its parameters laid out, and
    the graph rebuilt from the description (``kernelParams``, as ``add_kernel_node`` gives a cooperative node)
    computes the same bytes as the eager launch. What the driver says to the same node as one argument buffer is
    printed, not asserted, from a process of its own (cuda.h documents a refusal for the add, the attribute comes
    after it, and a grid.sync() without a cooperative launch may fault or hang)."""
    import subprocess
    import sys
    from pathlib import Path

    ptx = str(Path(__file__).parent / "data" / "coop_sum.ptx")
    out = subprocess.run(
        [sys.executable, "-c", GPU_COOPERATIVE, ptx, "params"], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.splitlines()[-1])
    print(result)
    assert result["captured_rc"] == 0 and result["kernels"] == 1 and result["forms"] == ["params"], result
    assert 2 in result["attributes"][0], result  # CU_LAUNCH_ATTRIBUTE_COOPERATIVE
    assert result["replayed_equal"] and result["rebuilt_equal"], result
    try:
        other = subprocess.run(
            [sys.executable, "-c", GPU_COOPERATIVE, ptx, "buffer"], capture_output=True, text=True, timeout=60
        )
        said = (
            other.stdout.splitlines()[-1] if other.returncode == 0 else f"rc {other.returncode}: {other.stderr[-300:]}"
        )
    except subprocess.TimeoutExpired:
        said = "timed out after 60 s"
    print("the cooperative node given as one argument buffer:", said)


class FakeVmm:
    """cuMemAddressReserve and friends as bookkeeping: a hint is honoured unless the range is ``taken``."""

    def __init__(self, granularity: int = 2 << 20, taken: Sequence[tuple[int, int]] = ()) -> None:
        self.chunk = granularity
        self.taken = list(taken)
        self.reserved: dict[int, int] = {}
        self.maps: dict[int, tuple[int, int]] = {}
        self.handles: dict[int, int] = {}
        self._next = itertools.count(1)
        self.fail_map = False

    def granularity(self, device: int) -> int:
        return self.chunk

    def reserve(self, size: int, base: int) -> int:
        if any(b < base + size and base < b + s for b, s in self.taken + list(self.reserved.items())):
            base = 0x5000_0000_0000 + len(self.reserved) * (1 << 40)  # elsewhere, as the driver does
        self.reserved[base] = size
        return base

    def create(self, size: int, device: int) -> int:
        handle = next(self._next)
        self.handles[handle] = size
        return handle

    def map(self, address: int, size: int, handle: int, device: int) -> None:
        if self.fail_map:
            raise GraphRestoreError("cuMemMap failed: CUDA_ERROR_OUT_OF_MEMORY")
        self.maps[address] = (size, handle)

    def unmap(self, address: int, size: int) -> None:
        del self.maps[address]

    def release(self, handle: int) -> None:
        del self.handles[handle]

    def free_address(self, address: int, size: int) -> None:
        del self.reserved[address]


def test_an_arena_gives_the_same_addresses_for_the_same_requests_in_every_process() -> None:
    from weightcache.graphs.arena import ALIGNMENT, Arena

    requests = [4096, 1 << 20, 100, 3 << 20, 512]

    def addresses() -> tuple[list[int], FakeVmm]:
        vmm = FakeVmm()
        arena = Arena(vmm, "pool", 64 << 20, base=POOL.base)
        got = [arena.allocate(n) for n in requests]
        arena.free(got[1], requests[1])
        got.append(arena.allocate(64))  # freed memory is not reused: the next address follows the last
        assert arena.range() == AddressRange("pool", POOL.base, 64 << 20)
        assert sum(size for size, _ in vmm.maps.values()) == arena.mapped >= arena.used
        assert all(a % ALIGNMENT == 0 for a in got) and all(b >= a + n for a, b, n in zip(got, got[1:], requests))
        arena.close()
        assert not vmm.maps and not vmm.handles and not vmm.reserved
        return got, vmm

    assert addresses()[0] == addresses()[0]


def test_an_arena_elsewhere_full_or_unmappable_is_refused_and_gives_back_what_it_took() -> None:
    from weightcache.graphs.arena import Arena

    vmm = FakeVmm(taken=[(POOL.base + (4 << 20), 2 << 20)])
    with pytest.raises(GraphRestoreError, match=f"asked the driver for .* at {POOL.base:#x} and got 0x5"):
        Arena(vmm, "pool", 64 << 20, base=POOL.base)
    assert not vmm.reserved
    with pytest.raises(GraphRestoreError, match="multiples of the granularity"):
        Arena(vmm, "pool", 3 << 19, base=0x6000_0000_0000)

    arena = Arena(vmm, "pool", 8 << 20, base=0x6000_0000_0000)
    arena.allocate(3 << 20)  # maps the first 4 MiB
    with pytest.raises(GraphRestoreError, match="is full: 6291456 bytes asked, 5242880 of 8388608 left"):
        arena.allocate(6 << 20)
    vmm.fail_map = True
    with pytest.raises(GraphRestoreError, match="OUT_OF_MEMORY"):
        arena.allocate(2 << 20)  # needs the next chunk
    assert len(vmm.handles) == 1 and arena.used == 3 << 20  # the failed chunk released, nothing handed out
    with pytest.raises(GraphRestoreError, match="was not allocated from it"):
        arena.free(0x1234, 16)
    # a refused restore: moved past a recorded graph's memory, then back, the mapping kept, the next address as
    # the recording process's capture got it
    mapped = arena.mapped
    arena.skip_to(4 << 20)
    arena.rewind_to(3 << 20)
    assert (arena.used, arena.mapped) == (3 << 20, mapped)
    assert arena.allocate(4096) == 0x6000_0000_0000 + (3 << 20)
    with pytest.raises(GraphRestoreError, match="cannot move its pointer back from 3149824 to 3149825"):
        arena.rewind_to(arena.used + 1)
    arena.close()
    arena.close()
    assert not vmm.reserved and not vmm.handles


def test_an_arena_maps_ahead_without_moving_its_pointer_and_gives_back_what_was_not_used() -> None:
    """``Arena.map_ahead``: what a restore will reach mapped at once, a piece to each end (a GraphCache passes its
    artifact's graphs' ends when it loads it), the bump pointer left where it was, never past the arena's size; a
    failing driver leaves what was mapped before it. ``Arena.unmap_unused`` gives back the pieces wholly past the
    pointer (graphs not restored after all), and later requests map again."""
    from weightcache.graphs.arena import Arena

    vmm = FakeVmm()
    base = 0x6000_0000_0000
    arena = Arena(vmm, "pool", 16 << 20, base=base)
    assert arena.allocate(4096) == base and arena.mapped == 2 << 20
    vmm.fail_map = True
    assert not arena.map_ahead([5 << 20, 9 << 20]) and arena.mapped == 2 << 20 and len(vmm.handles) == 1
    vmm.fail_map = False
    assert arena.map_ahead([5 << 20, 9 << 20, 64 << 20]) and (arena.mapped, arena.used) == (16 << 20, 4096)
    assert sorted((a - base, size) for a, (size, _) in vmm.maps.items()) == [
        (0, 2 << 20), (2 << 20, 4 << 20), (6 << 20, 4 << 20), (10 << 20, 6 << 20)
    ]  # a piece to each end, rounded to the granularity, never past the arena  # fmt: skip
    arena.skip_to(5 << 20)
    assert len(vmm.maps) == 4  # mapped ahead: nothing to map
    assert arena.unmap_unused() == 10 << 20 and arena.mapped == 6 << 20 and len(vmm.handles) == 2
    assert arena.unmap_unused() == 0
    arena.skip_to(7 << 20)  # maps again as it goes
    assert arena.mapped == 8 << 20 and len(vmm.maps) == 3
    arena.close()
    assert not vmm.maps and not vmm.handles and not vmm.reserved


GPU_ARENA = r"""
import json
import torch
torch.zeros(1, device="cuda")  # torch's context, current on this thread
from weightcache.graphs.arena import Arena, CudaArenaDriver
try:
    arena = Arena(CudaArenaDriver(), "pool", 64 << 30)  # the driver ignored the base of a 64 MiB range on an H200
    first, second = arena.allocate(1 << 20), arena.allocate(3 << 20)
    print(json.dumps({"base": arena.base, "addresses": [first, second], "mapped": arena.mapped}))
    arena.close()
except Exception as exc:
    print(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
"""


@pytest.mark.cuda
def test_on_a_gpu_an_arena_gets_its_base_and_the_same_addresses_in_two_fresh_processes() -> None:
    import subprocess
    import sys

    runs = []
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", GPU_ARENA], capture_output=True, text=True, timeout=120)
        assert out.returncode == 0, out.stderr[-3000:]
        runs.append(json.loads(out.stdout.splitlines()[-1]))
    assert "error" not in runs[0] and runs[0] == runs[1], runs

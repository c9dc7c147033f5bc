"""What it costs the CUDA driver to make a graph's nodes again, by each way it offers (issue 31). Runs on a GPU;
prints one JSON record (and writes it to ``--json``).

On an H100 (2026-12-05, docs/benchmarks.md) the vLLM kind's restore spent ~17 us a node adding the FULL graphs'
kernel nodes on its build thread (``cuGraphAddKernelNode`` with the arguments as one buffer), ~0.4 s of the ~0.6 s
that are left of a restore of 51 graphs; weightcache's own Python is ~1.6 us of it (measured on a CPU against a
library of no-op functions). This asks which of the driver's ways makes the same graph for less. It captures a
model of ``--layers`` small layers (Linear, GELU, LayerNorm, bf16, batch 8) with ``torch.cuda.graph`` (kept), reads
its description (:func:`weightcache.graphs.record.describe`, the process's own kernels), and then, ``--repeat``
times, makes it again each way, timing each per node:

- ``tables``: :meth:`~weightcache.graphs.driver.CudaGraphDriver.add_description` (the restore's way: one
  ``cuGraphAddKernelNode_v2`` a node, arguments as one buffer, edges in one call);
- ``each``: :func:`~weightcache.graphs.record.add_each` (one node at a time through the driver's methods);
- ``params``: ``cuGraphAddKernelNode_v2`` with ``kernelParams`` (a pointer to each parameter, by its layout)
  instead of the buffer, edges in one call;
- ``clone``: ``cuGraphClone`` of the captured graph (the driver's own copy: a floor for any way of adding nodes);
- ``capture``: the kernels launched (``cuLaunchKernel``, arguments as one buffer) into a stream capturing in
  thread-local mode, where the graph is a chain of kernel nodes;
- ``instantiate``: ``cuGraphInstantiateWithFlags`` of the ``tables`` graph;
- ``update``: ``cuGraphExecKernelNodeSetParams_v2`` of every kernel node of that executable graph with its own
  parameters (what patching moved pointers into an instantiated graph would cost, instead of building again).

Every graph made is replayed against the captured one's outputs (bitwise), so a way that makes something else says
so. ``python benchmarks/graph_node_costs.py --layers 100 --repeat 5 --json out.json``
"""

from __future__ import annotations

import argparse
import ctypes
import json
import statistics
import time
from pathlib import Path
from typing import Any

from weightcache.graphs.driver import KernelNodeParams

#: ``CU_LAUNCH_PARAM_END``, ``CU_LAUNCH_PARAM_BUFFER_POINTER``, ``CU_LAUNCH_PARAM_BUFFER_SIZE``.
PARAM_END, PARAM_BUFFER, PARAM_SIZE = 0, 1, 2
#: ``CU_STREAM_CAPTURE_MODE_THREAD_LOCAL``, ``CU_STREAM_NON_BLOCKING``, ``CU_LAUNCH_ATTRIBUTE_COOPERATIVE``.
THREAD_LOCAL, NON_BLOCKING, COOPERATIVE = 1, 1, 2
p = ctypes.c_void_p
size_p = ctypes.POINTER(ctypes.c_size_t)


class Lib:
    """The driver calls this benchmark makes beyond weightcache's driver, checked."""

    def __init__(self) -> None:
        self.cu = ctypes.CDLL("libcuda.so.1")
        signatures: dict[str, list[Any]] = {
            "cuGraphClone": [ctypes.POINTER(p), p],
            "cuGraphDestroy": [p],
            "cuGraphCreate": [ctypes.POINTER(p), ctypes.c_uint],
            "cuGraphAddKernelNode_v2": [ctypes.POINTER(p), p, ctypes.POINTER(p), ctypes.c_size_t,
                                        ctypes.POINTER(KernelNodeParams)],
            "cuGraphAddDependencies_v2": [p, ctypes.POINTER(p), ctypes.POINTER(p), ctypes.c_char_p, ctypes.c_size_t],
            "cuGraphGetNodes": [p, ctypes.POINTER(p), ctypes.POINTER(ctypes.c_size_t)],
            "cuGraphExecKernelNodeSetParams_v2": [p, p, ctypes.POINTER(KernelNodeParams)],
            "cuStreamCreate": [ctypes.POINTER(p), ctypes.c_uint],
            "cuStreamDestroy_v2": [p],
            "cuStreamBeginCapture_v2": [p, ctypes.c_int],
            "cuStreamEndCapture": [p, ctypes.POINTER(p)],
            "cuLaunchKernel": [p, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint, ctypes.c_uint,
                               ctypes.c_uint, ctypes.c_uint, p, ctypes.POINTER(p), ctypes.POINTER(p)],
            "cuGraphKernelNodeSetAttribute": [p, ctypes.c_int, ctypes.c_char_p],
            "cuFuncGetParamInfo": [p, ctypes.c_size_t, size_p, size_p],
            "cuDriverGetVersion": [ctypes.POINTER(ctypes.c_int)],
        }  # fmt: skip
        for name, argtypes in signatures.items():
            fn = getattr(self.cu, name)
            fn.argtypes, fn.restype = argtypes, ctypes.c_int

    def __call__(self, name: str, *args: Any) -> None:
        code = getattr(self.cu, name)(*args)
        if code != 0:
            raise RuntimeError(f"{name} failed with CUresult {code}")

    def layout(self, function: int) -> list[tuple[int, int]]:
        """Each parameter's offset and size (``cuFuncGetParamInfo``, which fails past the last)."""
        found = []
        for index in range(4096):
            offset, size = ctypes.c_size_t(), ctypes.c_size_t()
            if self.cu.cuFuncGetParamInfo(p(function), index, ctypes.byref(offset), ctypes.byref(size)) != 0:
                break
            found.append((offset.value, size.value))
        return found

    def version(self) -> int:
        value = ctypes.c_int()
        self("cuDriverGetVersion", ctypes.byref(value))
        return value.value

    def nodes(self, graph: int) -> list[int]:
        count = ctypes.c_size_t(0)
        self("cuGraphGetNodes", p(graph), None, ctypes.byref(count))
        found = (p * max(count.value, 1))()
        self("cuGraphGetNodes", p(graph), found, ctypes.byref(count))
        return [int(found[i] or 0) for i in range(count.value)]


def kernel_params(function: int, node: Any, layout: list[tuple[int, int]] | None, keep: list[Any]) -> KernelNodeParams:
    """A kernel node's parameters for the driver: its arguments as one buffer, or (given the function's
    ``layout``) as a pointer to each parameter in that buffer; what must outlive the call is appended to ``keep``."""
    buffer = ctypes.create_string_buffer(node.args, max(len(node.args), 1))
    keep.append(buffer)
    params = KernelNodeParams(function, *node.grid, *node.block, node.shared_bytes, None, None)
    if layout is not None:
        pointers = (p * max(len(layout), 1))(*[ctypes.addressof(buffer) + offset for offset, _ in layout])
        keep.append(pointers)
        params.kernelParams = ctypes.cast(pointers, ctypes.POINTER(p))
    else:
        size = ctypes.c_size_t(len(node.args))
        extra = (p * 5)(PARAM_BUFFER, ctypes.addressof(buffer), PARAM_SIZE, ctypes.addressof(size), PARAM_END)
        keep += [size, extra]
        params.extra = ctypes.cast(extra, ctypes.POINTER(p))
    return params


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--width", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()

    import torch

    from weightcache.graphs.description import KernelNode
    from weightcache.graphs.driver import CudaGraphDriver
    from weightcache.graphs.record import add_each, describe

    torch.manual_seed(0)
    layers = [
        torch.nn.Sequential(torch.nn.Linear(args.width, args.width), torch.nn.GELU(), torch.nn.LayerNorm(args.width))
        for _ in range(args.layers)
    ]
    model = torch.nn.Sequential(*layers).cuda().to(torch.bfloat16)
    x = torch.randn(8, args.width, device="cuda", dtype=torch.bfloat16)
    side = torch.cuda.Stream()
    with torch.no_grad(), torch.cuda.stream(side):
        model(x)  # warm-up (cuBLAS handles, kernels loaded)
    torch.cuda.synchronize()
    captured = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.no_grad(), torch.cuda.graph(captured):
        y = model(x)
    captured.instantiate()
    captured.replay()
    torch.cuda.synchronize()
    expected = y.clone()

    driver, lib = CudaGraphDriver(), Lib()
    raw = int(captured.raw_cuda_graph())
    description, functions = describe(driver, raw)
    nodes = description.nodes
    kernels = [n for n in nodes if isinstance(n, KernelNode)]
    edges = [(e.src, e.dst) for e in description.edges]
    edge_data = b"".join(e.data for e in description.edges)  # (CUgraphEdgeData of each, as captured)
    chain = len(kernels) == len(nodes) and sorted(edges) == [(i, i + 1) for i in range(len(nodes) - 1)]
    stream = torch.cuda.current_stream().cuda_stream

    equal: dict[str, bool] = {}

    def check(executable: int, way: str) -> None:
        y.zero_()
        driver.launch(executable, stream)
        torch.cuda.synchronize()
        equal[way] = equal.get(way, True) and torch.equal(y, expected)

    # every node's parameters made once, outside the timings (the restore's tables are made once too)
    keep: list[Any] = []
    plain = len(kernels) == len(nodes)  # kernel nodes only (else the ways below but tables, each, clone are left out)
    layouts = {name: lib.layout(f) for name, f in functions.items()} if plain else {}
    fits = plain and all(
        max((o + n for o, n in layouts[k.function]), default=0) <= len(k.args) and (layouts[k.function] or not k.args)
        for k in kernels
    )  # every parameter inside the node's bytes, and a layout wherever there are bytes
    # cuda.h: CUDA_ERROR_INVALID_VALUE "if extra is used for a cooperative kernel": those by layout even here
    cooperative = [any(a == COOPERATIVE for a, _ in k.attributes) for k in kernels]
    plain &= fits or not any(cooperative)
    as_buffer = [
        kernel_params(functions[k.function], k, layouts[k.function] if co else None, keep)
        for k, co in zip(kernels, cooperative, strict=True)
    ] if plain else []  # fmt: skip
    as_layout = [kernel_params(functions[k.function], k, layouts[k.function], keep) for k in kernels] if fits else []
    chain &= plain and not any(k.attributes for k in kernels)  # (attributes would need cuLaunchKernelEx)

    def add_params(graph: int, made_with: list[KernelNodeParams]) -> list[int]:
        made = []
        for params, node in zip(made_with, kernels, strict=True):
            out = p()
            lib("cuGraphAddKernelNode_v2", ctypes.byref(out), p(graph), None, 0, ctypes.byref(params))
            for attribute, value in node.attributes:
                lib("cuGraphKernelNodeSetAttribute", out, attribute, value)
            made.append(out.value)
        if edges:
            n = len(edges)
            src, dst = (p * n)(*[made[a] for a, _ in edges]), (p * n)(*[made[b] for _, b in edges])
            lib("cuGraphAddDependencies_v2", p(graph), src, dst, edge_data, n)
        return made

    def capture() -> int:
        created, graph = p(), p()
        lib("cuStreamCreate", ctypes.byref(created), NON_BLOCKING)
        try:
            lib("cuStreamBeginCapture_v2", created, THREAD_LOCAL)
            try:
                for k in as_buffer:
                    lib("cuLaunchKernel", p(k.func), k.gridDimX, k.gridDimY, k.gridDimZ, k.blockDimX, k.blockDimY,
                        k.blockDimZ, k.sharedMemBytes, created, k.kernelParams, k.extra)  # fmt: skip
            except BaseException:  # the capture ended without a word of its own: the launch's error is the one
                lib.cu.cuStreamEndCapture(created, ctypes.byref(graph))
                raise
            lib("cuStreamEndCapture", created, ctypes.byref(graph))
        finally:
            lib("cuStreamDestroy_v2", created)
        return int(graph.value or 0)

    rounds: dict[str, list[float]] = {}

    def timed(way: str, seconds: float) -> None:
        rounds.setdefault(way, []).append(seconds)

    ways = ["tables", "each", "clone"] + ["params"] * fits + ["capture"] * chain
    for _ in range(args.repeat):
        for way in ways:
            t = time.perf_counter()
            if way == "clone":
                out = p()
                lib("cuGraphClone", ctypes.byref(out), p(raw))
                graph = int(out.value or 0)
            elif way == "capture":
                graph = capture()
            else:
                graph = driver.create_graph()
                if way == "tables":
                    driver.add_description(graph, description, functions)
                elif way == "each":
                    add_each(driver, graph, description, functions)
                else:
                    add_params(graph, as_layout)
            timed(way, time.perf_counter() - t)
            t = time.perf_counter()
            executable = driver.instantiate(graph)
            if way == "tables":
                timed("instantiate", time.perf_counter() - t)
            check(executable, way)
            driver.destroy_executable(executable)
            driver.destroy_graph(graph)
        if plain:  # every kernel node of an instantiated graph given its own parameters again
            graph = driver.create_graph()
            handles = add_params(graph, as_buffer)
            executable = driver.instantiate(graph)
            t = time.perf_counter()
            for handle, params in zip(handles, as_buffer, strict=True):
                lib("cuGraphExecKernelNodeSetParams_v2", p(executable), p(handle), ctypes.byref(params))
            timed("update", time.perf_counter() - t)
            check(executable, "update")
            driver.destroy_executable(executable)
            driver.destroy_graph(graph)

    count = len(nodes)
    record = {
        "device": torch.cuda.get_device_name(),
        "driver": lib.version(),
        "torch": torch.__version__,
        "nodes": count,
        "kernel_nodes": len(kernels),
        "kernels_only": plain,
        "layouts_fit": fits,
        "chain_without_attributes": chain,
        "repeat": args.repeat,
        "same_outputs": equal,
        "seconds": {way: [round(s, 6) for s in values] for way, values in rounds.items()},
        "us_a_node_median": {way: round(statistics.median(values) / count * 1e6, 2) for way, values in rounds.items()},
    }
    text = json.dumps(record, indent=1)
    print(text)
    if args.json:
        args.json.write_text(text)
    return 0 if all(equal.values()) else 1


if __name__ == "__main__":
    raise SystemExit(main())

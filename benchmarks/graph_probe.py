"""What the CUDA driver lets a process learn about a captured CUDA graph, and what a fresh process can rebuild from
it (issue 31's first step, research: nothing here is product code). Runs on a GPU; prints one JSON record.

``record`` (the default) captures a small model's forward with PyTorch, walks the graph with the driver API
(``cuGraphGetNodes``, ``cuGraphNodeGetType``, ``cuGraphKernelNodeGetParams``, ``cuFuncGetName``,
``cuFuncGetParamInfo``, ``cuGraphGetEdges``) into a description (each kernel node's function name, grid, block,
dynamic shared memory and argument bytes; memset nodes; edges), then rebuilds a second graph from that description
alone (``cuGraphAddKernelNode`` with the argument bytes as one buffer, ``CU_LAUNCH_PARAM_BUFFER_POINTER``) and
replays both: equal outputs mean the description is complete. It times capture against rebuild + instantiate.
Then it starts ``resolve`` in a fresh process with the description, which finds each recorded kernel by name
(the host stub by ``dlsym`` in the loaded libraries, then ``cudaGetFuncBySymbol``; and every function of the
modules found so, by ``cuFuncGetModule`` + ``cuModuleEnumerateFunctions``) and asks ``cuMemAddressReserve`` for
the first process's addresses: whether a fresh process gets them.

    python benchmarks/graph_probe.py [--out probe.json]
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

u64 = ctypes.c_uint64
KERNEL, MEMCPY, MEMSET, HOST, GRAPH, EMPTY = 0, 1, 2, 3, 4, 5


class KernelParams(ctypes.Structure):
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


MEMSET_FIELDS = [
    ("dst", u64),
    ("pitch", ctypes.c_size_t),
    ("value", ctypes.c_uint),
    ("elementSize", ctypes.c_uint),
    ("width", ctypes.c_size_t),
    ("height", ctypes.c_size_t),
]


class MemsetParams(ctypes.Structure):
    _fields_ = MEMSET_FIELDS


#: Launch attributes a kernel node can carry beside its parameters (cooperative, cluster dimension, cluster
#: scheduling preference, priority): CUlaunchAttributeID values; each value is a 64-byte union.
ATTRIBUTES = (2, 4, 5, 8)


def libcuda() -> ctypes.CDLL:
    return ctypes.CDLL("libcuda.so.1")


def entry(cu: ctypes.CDLL, name: str) -> Any:
    """The newest ABI of a driver entry point (``name_v2`` where the library still exports it)."""
    return getattr(cu, f"{name}_v2", None) or getattr(cu, name)


def check(code: int, what: str) -> None:
    if code != 0:
        raise RuntimeError(f"{what} returned CUresult {code}")


def func_name(cu: ctypes.CDLL, func: int) -> str:
    name = ctypes.c_char_p()
    check(cu.cuFuncGetName(ctypes.byref(name), ctypes.c_void_p(func)), "cuFuncGetName")
    return (name.value or b"").decode()


def param_layout(cu: ctypes.CDLL, func: int) -> list[tuple[int, int]]:
    layout = []
    for index in range(4096):
        offset, size = ctypes.c_size_t(), ctypes.c_size_t()
        if cu.cuFuncGetParamInfo(ctypes.c_void_p(func), index, ctypes.byref(offset), ctypes.byref(size)) != 0:
            break
        layout.append((offset.value, size.value))
    return layout


def describe(cu: ctypes.CDLL, graph: int) -> dict[str, Any]:
    count = ctypes.c_size_t(0)
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), None, ctypes.byref(count)), "cuGraphGetNodes")
    nodes = (ctypes.c_void_p * count.value)()
    check(cu.cuGraphGetNodes(ctypes.c_void_p(graph), nodes, ctypes.byref(count)), "cuGraphGetNodes")
    index = {int(n): i for i, n in enumerate(nodes)}
    described: list[dict[str, Any]] = []
    functions: dict[str, int] = {}
    for node in nodes:
        kind = ctypes.c_int()
        check(cu.cuGraphNodeGetType(ctypes.c_void_p(node), ctypes.byref(kind)), "cuGraphNodeGetType")
        if kind.value == KERNEL:
            p = KernelParams()
            check(entry(cu, "cuGraphKernelNodeGetParams")(ctypes.c_void_p(node), ctypes.byref(p)), "GetParams")
            name = func_name(cu, p.func)
            if not p.kernelParams:
                raise RuntimeError(f"kernel node {name} has no kernelParams (extra set: {bool(p.extra)})")
            attributes = {}
            for attr in ATTRIBUTES:
                value = ctypes.create_string_buffer(64)
                code = cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), attr, value)
                if code == 0 and any(value.raw):
                    attributes[str(attr)] = value.raw.hex()
            layout = param_layout(cu, p.func)
            size = max((o + s for o, s in layout), default=0)
            blob = bytearray(size)
            for i, (offset, length) in enumerate(layout):
                blob[offset : offset + length] = ctypes.string_at(p.kernelParams[i], length)
            functions[name] = p.func
            described.append(
                {
                    "type": "kernel",
                    "name": name,
                    "grid": [p.gridDimX, p.gridDimY, p.gridDimZ],
                    "block": [p.blockDimX, p.blockDimY, p.blockDimZ],
                    "smem": p.sharedMemBytes,
                    "layout": layout,
                    "args": blob.hex(),
                    "attributes": attributes,
                }
            )
        elif kind.value == MEMSET:
            m = MemsetParams()
            check(cu.cuGraphMemsetNodeGetParams(ctypes.c_void_p(node), ctypes.byref(m)), "MemsetNodeGetParams")
            described.append(
                {"type": "memset", **{f: getattr(m, f) for f, _ in MEMSET_FIELDS}}  # type: ignore[misc]
            )
        elif kind.value == EMPTY:
            described.append({"type": "empty"})
        else:
            described.append({"type": f"unsupported:{kind.value}"})
    edges = ctypes.c_size_t(0)
    get_edges = getattr(cu, "cuGraphGetEdges_v2", None)
    if get_edges is not None:
        check(get_edges(ctypes.c_void_p(graph), None, None, None, ctypes.byref(edges)), "cuGraphGetEdges_v2")
    else:
        check(cu.cuGraphGetEdges(ctypes.c_void_p(graph), None, None, ctypes.byref(edges)), "cuGraphGetEdges")
    src, dst = (ctypes.c_void_p * max(edges.value, 1))(), (ctypes.c_void_p * max(edges.value, 1))()
    if get_edges is not None:
        check(get_edges(ctypes.c_void_p(graph), src, dst, None, ctypes.byref(edges)), "cuGraphGetEdges_v2")
    else:
        check(cu.cuGraphGetEdges(ctypes.c_void_p(graph), src, dst, ctypes.byref(edges)), "cuGraphGetEdges")
    pairs = [[index[int(src[i])], index[int(dst[i])]] for i in range(edges.value)]
    return {"nodes": described, "edges": pairs, "functions": functions}


def topological(n: int, edges: list[list[int]]) -> list[int]:
    deps: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b in edges:
        deps[b].append(a)
    order, seen = [], set()

    def visit(i: int) -> None:
        if i in seen:
            return
        seen.add(i)
        for d in deps[i]:
            visit(d)
        order.append(i)

    for i in range(n):
        visit(i)
    return order


def rebuild(cu: ctypes.CDLL, desc: dict[str, Any], functions: dict[str, int]) -> tuple[int, list[Any]]:
    """A new graph from the description alone; returns (graph, buffers kept alive until instantiated)."""
    graph = ctypes.c_void_p()
    check(cu.cuGraphCreate(ctypes.byref(graph), 0), "cuGraphCreate")
    nodes = desc["nodes"]
    deps: dict[int, list[int]] = {i: [] for i in range(len(nodes))}
    for a, b in desc["edges"]:
        deps[b].append(a)
    made: dict[int, ctypes.c_void_p] = {}
    keep: list[Any] = []
    for i in topological(len(nodes), desc["edges"]):
        node = nodes[i]
        dep_array = (ctypes.c_void_p * max(len(deps[i]), 1))(*[made[d] for d in deps[i]])
        out = ctypes.c_void_p()
        if node["type"] == "kernel":
            blob = ctypes.create_string_buffer(bytes.fromhex(node["args"]), max(len(node["args"]) // 2, 1))
            size = ctypes.c_size_t(len(node["args"]) // 2)
            extra = (ctypes.c_void_p * 5)(
                ctypes.c_void_p(1), ctypes.cast(blob, ctypes.c_void_p), ctypes.c_void_p(2),
                ctypes.cast(ctypes.pointer(size), ctypes.c_void_p), ctypes.c_void_p(0),
            )  # fmt: skip
            keep += [blob, size, extra]
            p = KernelParams()
            p.func = functions[node["name"]]
            p.gridDimX, p.gridDimY, p.gridDimZ = node["grid"]
            p.blockDimX, p.blockDimY, p.blockDimZ = node["block"]
            p.sharedMemBytes = node["smem"]
            p.extra = ctypes.cast(extra, ctypes.POINTER(ctypes.c_void_p))
            check(
                entry(cu, "cuGraphAddKernelNode")(ctypes.byref(out), graph, dep_array, len(deps[i]), ctypes.byref(p)),
                f"cuGraphAddKernelNode({node['name'][:60]})",
            )
            for attr, value in node["attributes"].items():
                raw = ctypes.create_string_buffer(bytes.fromhex(value), 64)
                check(cu.cuGraphKernelNodeSetAttribute(out, int(attr), raw), f"cuGraphKernelNodeSetAttribute({attr})")
        elif node["type"] == "memset":
            m = MemsetParams(*(node[f] for f, _ in MEMSET_FIELDS))
            ctx = ctypes.c_void_p()
            check(cu.cuCtxGetCurrent(ctypes.byref(ctx)), "cuCtxGetCurrent")
            check(
                cu.cuGraphAddMemsetNode(ctypes.byref(out), graph, dep_array, len(deps[i]), ctypes.byref(m), ctx),
                "cuGraphAddMemsetNode",
            )
        elif node["type"] == "empty":
            check(cu.cuGraphAddEmptyNode(ctypes.byref(out), graph, dep_array, len(deps[i])), "cuGraphAddEmptyNode")
        else:
            raise RuntimeError(f"cannot rebuild a node of type {node['type']}")
        made[i] = out
    return graph.value or 0, keep


def record(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cu = libcuda()
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024), torch.nn.LayerNorm(1024)
    ).to("cuda", torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    with torch.no_grad():
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(3):
                model(x)
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        start = time.perf_counter()
        g = torch.cuda.CUDAGraph(keep_graph=True)
        with torch.cuda.graph(g):
            out = model(x)
        g.instantiate()
        torch.cuda.synchronize()
        capture_s = time.perf_counter() - start
    g.replay()
    torch.cuda.synchronize()
    captured = out.clone()
    desc = describe(cu, g.raw_cuda_graph())
    start = time.perf_counter()
    graph, _keep = rebuild(cu, desc, desc["functions"])  # its buffers live until instantiated
    exec_ = ctypes.c_void_p()
    check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), ctypes.c_void_p(graph), 0), "cuGraphInstantiate")
    torch.cuda.synchronize()
    rebuild_s = time.perf_counter() - start
    out.zero_()
    check(cu.cuGraphLaunch(exec_, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cuGraphLaunch")
    torch.cuda.synchronize()
    pointers = sorted({int(t.data_ptr()) for t in [x, out, *model.parameters()]})
    kinds: dict[str, int] = {}
    for node in desc["nodes"]:
        kinds[node["type"]] = kinds.get(node["type"], 0) + 1
    description = {k: v for k, v in desc.items() if k != "functions"}
    found = {
        "torch": torch.__version__,
        "driver": driver_version(cu),
        "node_types": kinds,
        "kernels": sorted({n["name"] for n in desc["nodes"] if n["type"] == "kernel"}),
        "capture_s": round(capture_s, 6),
        "rebuild_and_instantiate_s": round(rebuild_s, 6),
        "rebuilt_replay_bitwise_equal": bool(torch.equal(out, captured)),
        "tensor_pointers": [hex(p) for p in pointers],
    }
    path = args.out + ".desc.json"
    with open(path, "w") as f:
        json.dump({"description": description, "pointers": pointers}, f)
    child = subprocess.run(
        [sys.executable, __file__, "resolve", path], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    found["fresh_process"] = json.loads(child.stdout) if child.returncode == 0 else {"error": child.stderr[-3000:]}
    return found


def driver_version(cu: ctypes.CDLL) -> int:
    version = ctypes.c_int()
    cu.cuDriverGetVersion(ctypes.byref(version))
    return version.value


def loaded_libraries() -> list[str]:
    paths = []
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and ".so" in parts[5] and parts[5] not in paths:
                paths.append(parts[5])
    return paths


def resolve(path: str) -> dict[str, Any]:
    with open(path) as f:
        recorded = json.load(f)
    cu = libcuda()
    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    # Reserve the first process's addresses before anything else allocates here.
    reserved = {}
    for pointer in recorded["pointers"]:
        got = u64()
        code = cu.cuMemAddressReserve(ctypes.byref(got), 2 << 20, 0, u64(pointer & ~((2 << 20) - 1)), 0)
        reserved[hex(pointer)] = {"code": code, "got": hex(got.value), "same": got.value == pointer & ~((2 << 20) - 1)}
        if code == 0:
            cu.cuMemAddressFree(got, 2 << 20)
    import torch

    torch.zeros(1, device="cuda")  # the runtime registers the fatbins it holds
    names = sorted({n["name"] for n in recorded["description"]["nodes"] if n["type"] == "kernel"})
    cudart = next((p for p in loaded_libraries() if "libcudart" in p), None)
    by_dlsym: dict[str, str] = {}
    functions: dict[str, int] = {}
    if cudart is not None:
        rt = ctypes.CDLL(cudart)
        libs = [(p, ctypes.CDLL(p)) for p in loaded_libraries() if "torch" in p or "cublas" in p or "cudnn" in p]
        for name in names:
            for lib_path, lib in libs:
                try:
                    stub = ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                except AttributeError:
                    continue
                func = ctypes.c_void_p()
                code = rt.cudaGetFuncBySymbol(ctypes.byref(func), ctypes.c_void_p(stub))
                by_dlsym[name] = f"{os.path.basename(lib_path)}: cudaGetFuncBySymbol {code}"
                if code == 0 and func.value:
                    functions[name] = func.value
                break
    by_module: dict[str, int] = {}
    for func in list(functions.values()):
        module = ctypes.c_void_p()
        if cu.cuFuncGetModule(ctypes.byref(module), ctypes.c_void_p(func)) != 0:
            continue
        count = ctypes.c_uint()
        if cu.cuModuleGetFunctionCount(ctypes.byref(count), module) != 0:
            continue
        array = (ctypes.c_void_p * count.value)()
        if cu.cuModuleEnumerateFunctions(array, count.value, module) != 0:
            continue
        for other in array:
            by_module[func_name(cu, other)] = int(other)
    return {
        "recorded_kernels": len(names),
        "found_by_dlsym": len(functions),
        "dlsym_details": by_dlsym,
        "found_by_module_enumeration": sum(1 for n in names if n in by_module),
        "not_found": [n for n in names if n not in functions and n not in by_module],
        "address_reservations": reserved,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("mode", nargs="?", default="record", choices=("record", "resolve"))
    parser.add_argument("path", nargs="?")
    parser.add_argument("--out", default="graph_probe.json")
    args = parser.parse_args()
    if args.mode == "resolve":
        print(json.dumps(resolve(args.path)))
        return 0
    found = record(args)
    with open(args.out, "w") as f:
        json.dump(found, f, indent=1)
    print(json.dumps(found, indent=1)[:6000])
    return 0


if __name__ == "__main__":
    sys.exit(main())

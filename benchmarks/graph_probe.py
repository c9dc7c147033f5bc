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
        code = cu.cuFuncGetParamInfo(
            ctypes.c_void_p(func), ctypes.c_size_t(index), ctypes.byref(offset), ctypes.byref(size)
        )
        if code != 0:
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
            how = "kernelParams"
            if not p.kernelParams:
                # Launched with ``extra``: key/value pairs (1 = the argument buffer, 2 = a pointer to its size,
                # 0 = the end), the form cuBLAS uses; the buffer is the argument bytes as they are.
                buffer, length, i = None, 0, 0
                while p.extra and p.extra[i]:
                    key, value = p.extra[i], p.extra[i + 1]
                    if key == 1:
                        buffer = value
                    elif key == 2:
                        length = ctypes.c_size_t.from_address(value).value
                    i += 2
                if buffer is None:
                    described.append({"type": "kernel-unreadable", "name": name})
                    continue
                how = "extra"
            attributes = {}
            for attr in ATTRIBUTES:
                value = ctypes.create_string_buffer(64)
                code = cu.cuGraphKernelNodeGetAttribute(ctypes.c_void_p(node), attr, value)
                if code == 0 and any(value.raw):
                    attributes[str(attr)] = value.raw.hex()
            layout = param_layout(cu, p.func)
            if how == "extra":
                blob = bytearray(ctypes.string_at(buffer, length))
            else:
                size = max((o + s for o, s in layout), default=0)
                blob = bytearray(size)
                for i, (offset, length) in enumerate(layout):
                    blob[offset : offset + length] = ctypes.string_at(p.kernelParams[i], length)
            functions[name] = p.func
            described.append(
                {
                    "type": "kernel",
                    "name": name,
                    "has_kern": bool(p.kern),
                    "launched_with": how,
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
    # CUDA 12.3+ edges carry data (ports and a type, 8 bytes each: programmatic dependent launch); the query
    # without an edge-data array fails with CUDA_ERROR_LOSSY_QUERY (402) when any edge has some.
    edges = ctypes.c_size_t(0)
    get_edges = cu.cuGraphGetEdges_v2
    check(get_edges(ctypes.c_void_p(graph), None, None, None, ctypes.byref(edges)), "cuGraphGetEdges_v2")
    n = max(edges.value, 1)
    src, dst, data = (ctypes.c_void_p * n)(), (ctypes.c_void_p * n)(), ctypes.create_string_buffer(8 * n)
    check(get_edges(ctypes.c_void_p(graph), src, dst, data, ctypes.byref(edges)), "cuGraphGetEdges_v2")
    pairs = [[index[int(src[i])], index[int(dst[i])], data.raw[8 * i : 8 * i + 8].hex()] for i in range(edges.value)]
    return {"nodes": described, "edges": pairs, "functions": functions}


def topological(n: int, edges: list[list[int]]) -> list[int]:
    deps: dict[int, list[int]] = {i: [] for i in range(n)}
    for a, b, *_ in edges:
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
    for a, b, *_ in desc["edges"]:
        deps[b].append(a)
    made: dict[int, ctypes.c_void_p] = {}
    keep: list[Any] = []
    for i in topological(len(nodes), desc["edges"]):
        node = nodes[i]
        dep_array = (ctypes.c_void_p * 1)()  # edges are added below, with their data
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
                entry(cu, "cuGraphAddKernelNode")(ctypes.byref(out), graph, dep_array, 0, ctypes.byref(p)),
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
                cu.cuGraphAddMemsetNode(ctypes.byref(out), graph, dep_array, 0, ctypes.byref(m), ctx),
                "cuGraphAddMemsetNode",
            )
        elif node["type"] == "empty":
            check(cu.cuGraphAddEmptyNode(ctypes.byref(out), graph, dep_array, 0), "cuGraphAddEmptyNode")
        else:
            raise RuntimeError(f"cannot rebuild a node of type {node['type']}")
        made[i] = out
    count = len(desc["edges"])
    if count:
        src = (ctypes.c_void_p * count)(*[made[e[0]] for e in desc["edges"]])
        dst = (ctypes.c_void_p * count)(*[made[e[1]] for e in desc["edges"]])
        data = ctypes.create_string_buffer(b"".join(bytes.fromhex(e[2]) for e in desc["edges"]), 8 * count)
        check(cu.cuGraphAddDependencies_v2(graph, src, dst, data, ctypes.c_size_t(count)), "cuGraphAddDependencies_v2")
    return graph.value or 0, keep


def build_model(torch: Any) -> tuple[Any, Any]:
    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(1024, 4096), torch.nn.GELU(), torch.nn.Linear(4096, 1024), torch.nn.LayerNorm(1024)
    ).to("cuda", torch.bfloat16)
    x = torch.randn(8, 1024, device="cuda", dtype=torch.bfloat16)
    return model, x


def capture(torch: Any, model: Any, x: Any) -> tuple[Any, Any, float]:
    """Warm up on a side stream, then capture one forward; returns (graph, output, capture seconds)."""
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
        return g, out, time.perf_counter() - start


def device_bytes(cu: ctypes.CDLL, address: int, size: int) -> bytes:
    buffer = ctypes.create_string_buffer(size)
    check(entry(cu, "cuMemcpyDtoH")(buffer, u64(address), ctypes.c_size_t(size)), "cuMemcpyDtoH")
    return buffer.raw


def record(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    cu = libcuda()
    model, x = build_model(torch)
    g, out, capture_s = capture(torch, model, x)
    g.replay()
    torch.cuda.synchronize()
    captured = out.clone()
    desc = describe(cu, g.raw_cuda_graph())
    start = time.perf_counter()
    same_process: Any
    try:
        graph, _keep = rebuild(cu, desc, desc["functions"])  # its buffers live until instantiated
        exec_ = ctypes.c_void_p()
        flags = u64(0)
        check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), ctypes.c_void_p(graph), flags), "cuGraphInstantiate")
        torch.cuda.synchronize()
        rebuild_s = time.perf_counter() - start
        out.zero_()
        check(cu.cuGraphLaunch(exec_, ctypes.c_void_p(torch.cuda.current_stream().cuda_stream)), "cuGraphLaunch")
        torch.cuda.synchronize()
        same_process = bool(torch.equal(out, captured))
    except RuntimeError as exc:
        rebuild_s, same_process = -1.0, f"not rebuilt: {exc}"
        out.copy_(captured)
    kinds: dict[str, int] = {}
    for node in desc["nodes"]:
        kinds[node["type"]] = kinds.get(node["type"], 0) + 1
    # Every segment of torch's caching allocator (the weights, the input, the graph's private pool, cuBLAS's
    # workspace), with its bytes: what a fresh process must have at the same addresses to replay the graph.
    segments = [(int(s["address"]), int(s["total_size"])) for s in torch.cuda.memory_snapshot()]
    data_path = args.out + ".segments.bin"
    with open(data_path, "wb") as f:
        for address, size in segments:
            f.write(device_bytes(cu, address, size))
    found: dict[str, Any] = {
        "torch": torch.__version__,
        "driver": driver_version(cu),
        "node_types": kinds,
        "kernels": sorted({n["name"] for n in desc["nodes"] if n["type"].startswith("kernel")}),
        "capture_s": round(capture_s, 6),
        "rebuild_and_instantiate_s": round(rebuild_s, 6),
        "rebuilt_replay_bitwise_equal": same_process,
        "segments": [[hex(a), n] for a, n in segments],
        "out": [hex(out.data_ptr()), out.nbytes],
    }
    path = args.out + ".desc.json"
    description = {k: v for k, v in desc.items() if k != "functions"}
    with open(path, "w") as f:
        json.dump(
            {
                "description": description,
                "segments": segments,
                "data": data_path,
                "out": [out.data_ptr(), out.nbytes],
                "expected": captured.view(torch.uint8).cpu().numpy().tobytes().hex(),
                "capture_s": capture_s,
            },
            f,
        )
    child = subprocess.run(
        [sys.executable, __file__, "resolve", path], capture_output=True, text=True, timeout=300, env=dict(os.environ)
    )
    found["fresh_process"] = json.loads(child.stdout) if child.returncode == 0 else {"error": child.stderr[-4000:]}
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


def load_base(path: str) -> int:
    """Where ``path`` is mapped in this process: its first mapping's start less that mapping's file offset."""
    with open("/proc/self/maps") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 6 and parts[5] == path:
                return int(parts[0].split("-")[0], 16) - int(parts[2], 16)
    raise LookupError(path)


def elf_symbols(path: str, wanted: set[str]) -> tuple[dict[str, int], str]:
    """The values (offsets from the load base) of the ``wanted`` symbols in ``path``'s ``.symtab``, falling back
    to ``.dynsym``; and which tables the file has."""
    import mmap
    import struct

    with open(path, "rb") as f, mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as m:
        if m[:4] != b"\x7fELF" or m[4] != 2:
            return {}, "not a 64-bit ELF"
        (shoff,) = struct.unpack_from("<Q", m, 0x28)
        shentsize, shnum = struct.unpack_from("<HH", m, 0x3A)
        sections = [struct.unpack_from("<IIQQQQIIQQ", m, shoff + i * shentsize) for i in range(shnum)]
        tables = {2: "symtab", 11: "dynsym"}
        present = sorted(tables[s[1]] for s in sections if s[1] in tables)
        wanted_bytes = {w.encode(): w for w in wanted}
        found: dict[str, int] = {}
        for kind in (2, 11):
            for sec in sections:
                if sec[1] != kind:
                    continue
                strtab = sections[sec[6]]
                str_off = strtab[4]
                off, size, entsize = sec[4], sec[5], sec[9] or 24
                for i in range(size // entsize):
                    name_off, info, _other, shndx, value, _size = struct.unpack_from("<IBBHQQ", m, off + i * entsize)
                    if not value or not shndx or (info & 0xF) != 2:  # defined functions only
                        continue
                    start = str_off + name_off
                    stop = m.find(b"\0", start)
                    name = m[start:stop]
                    if name in wanted_bytes and wanted_bytes[name] not in found:
                        found[wanted_bytes[name]] = value
            if len(found) == len(wanted):
                break
        return found, ",".join(present) or "none"


def resolve(path: str) -> dict[str, Any]:
    """In a fresh process: the recorded segments' addresses reserved before anything else allocates, mapped and
    filled with the recorded bytes; each kernel found by name; the graph rebuilt from the description and replayed;
    its output compared with the first process's captured replay."""
    t0 = time.perf_counter()
    with open(path) as f:
        recorded = json.load(f)
    cu = libcuda()
    check(cu.cuInit(0), "cuInit")
    dev, ctx = ctypes.c_int(), ctypes.c_void_p()
    check(cu.cuDeviceGet(ctypes.byref(dev), 0), "cuDeviceGet")
    check(cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev), "cuDevicePrimaryCtxRetain")
    check(cu.cuCtxSetCurrent(ctx), "cuCtxSetCurrent")
    from cuda.bindings import driver as drv

    def ok(result: Any, what: str) -> Any:
        code, *rest = result
        if code != drv.CUresult.CUDA_SUCCESS:
            raise RuntimeError(f"{what}: {code}")
        return rest[0] if len(rest) == 1 else rest

    prop = drv.CUmemAllocationProp()
    prop.type = drv.CUmemAllocationType.CU_MEM_ALLOCATION_TYPE_PINNED
    prop.location.type = drv.CUmemLocationType.CU_MEM_LOCATION_TYPE_DEVICE
    prop.location.id = 0
    gran = ok(
        drv.cuMemGetAllocationGranularity(prop, drv.CUmemAllocationGranularity_flags.CU_MEM_ALLOC_GRANULARITY_MINIMUM),
        "granularity",
    )
    access = drv.CUmemAccessDesc()
    access.location = prop.location
    access.flags = drv.CUmemAccess_flags.CU_MEM_ACCESS_FLAGS_PROT_READWRITE
    reservations: list[dict[str, Any]] = []
    all_same = True
    with open(recorded["data"], "rb") as data:
        for address, size in recorded["segments"]:
            rounded = -(-size // gran) * gran
            code, got = drv.cuMemAddressReserve(rounded, 0, address, 0)
            same = code == drv.CUresult.CUDA_SUCCESS and int(got) == address
            reservations.append({"address": hex(address), "size": size, "code": int(code), "got": hex(int(got))})
            all_same &= same
            if not same:
                continue
            handle = ok(drv.cuMemCreate(rounded, prop, 0), "cuMemCreate")
            ok((drv.cuMemMap(address, rounded, 0, handle, 0)[0], None), "cuMemMap")
            ok((drv.cuMemSetAccess(address, rounded, [access], 1)[0], None), "cuMemSetAccess")
            chunk = data.read(size)
            ok((drv.cuMemcpyHtoD(address, chunk, size)[0], None), "cuMemcpyHtoD")
    reserve_s = time.perf_counter() - t0
    result: dict[str, Any] = {
        "granularity": gran,
        "all_addresses_obtained": all_same,
        "reservations": reservations,
        "reserve_map_fill_s": round(reserve_s, 6),
    }
    t1 = time.perf_counter()
    import torch

    torch.zeros(1, device="cuda")  # the runtime registers the fatbins it holds
    result["torch_import_and_context_s"] = round(time.perf_counter() - t1, 6)
    nodes = recorded["description"]["nodes"]
    names = sorted({n["name"] for n in nodes if n["type"].startswith("kernel")})
    t2 = time.perf_counter()
    cudart_path = next((p for p in loaded_libraries() if "libcudart" in p), None)
    rt = ctypes.CDLL(cudart_path) if cudart_path else None
    functions: dict[str, int] = {}
    how: dict[str, str] = {}
    tables: dict[str, str] = {}
    libraries = [p for p in loaded_libraries() if "/torch/" in p or "cublas" in p or "cudnn" in p or "nvidia" in p]
    for lib_path in libraries:
        missing = {n for n in names if n not in functions}
        if not missing or rt is None:
            break
        try:
            symbols, tables[os.path.basename(lib_path)] = elf_symbols(lib_path, missing)
        except (OSError, ValueError) as exc:
            tables[os.path.basename(lib_path)] = f"unreadable: {exc}"
            continue
        base = load_base(lib_path)
        for name, value in symbols.items():
            func = ctypes.c_void_p()
            code = rt.cudaGetFuncBySymbol(ctypes.byref(func), ctypes.c_void_p(base + value))
            how[name] = f"{os.path.basename(lib_path)} ELF symbol, cudaGetFuncBySymbol {code}"
            if code == 0 and func.value:
                functions[name] = func.value
    result["symbol_lookup_s"] = round(time.perf_counter() - t2, 6)
    result["symbol_tables"] = tables
    by_module = 0
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
            name = func_name(cu, other)
            if name in names and name not in functions:
                functions[name], how[name] = int(other), "module enumeration"
                by_module += 1
    missing = [n for n in names if n not in functions]
    result["found_by_symbol"] = sum(1 for v in how.values() if "ELF" in v and "Symbol 0" in v)
    result["found_by_module_enumeration"] = by_module
    result["not_found_by_name"] = missing
    if missing:
        # Last resort: capture the same model once here to learn the remaining handles (what the restore would
        # have to do for kernels that no symbol names, e.g. cuBLAS's): timed, because it is a capture after all.
        t3 = time.perf_counter()
        model, x = build_model(torch)
        g, _out, _ = capture(torch, model, x)
        here = describe(cu, g.raw_cuda_graph())["functions"]
        for name in missing:
            if name in here:
                functions[name], how[name] = here[name], "a throwaway capture"
        result["throwaway_capture_s"] = round(time.perf_counter() - t3, 6)
        # What the modules of those kernels hold: could one known kernel of a module name all the others?
        modules: dict[str, int] = {}
        for name, func in here.items():
            module = ctypes.c_void_p()
            code = cu.cuFuncGetModule(ctypes.byref(module), ctypes.c_void_p(func))
            count = ctypes.c_uint()
            if code == 0:
                code = cu.cuModuleGetFunctionCount(ctypes.byref(count), module)
            modules[name[:60]] = count.value if code == 0 else -int(code)
        result["functions_per_module_of_each_kernel"] = modules
    result["how"] = how
    unresolved = [n for n in names if n not in functions]
    result["unresolved"] = unresolved
    if unresolved or not all_same or any(n["type"] != "kernel" for n in nodes if n["type"].startswith("kernel")):
        result["replayed"] = False
        return result
    t4 = time.perf_counter()
    graph, _keep = rebuild(cu, recorded["description"], functions)
    exec_ = ctypes.c_void_p()
    check(cu.cuGraphInstantiateWithFlags(ctypes.byref(exec_), ctypes.c_void_p(graph), u64(0)), "cuGraphInstantiate")
    result["rebuild_and_instantiate_s"] = round(time.perf_counter() - t4, 6)
    out_address, out_bytes = recorded["out"]
    ok((drv.cuMemsetD8(out_address, 0, out_bytes)[0], None), "cuMemsetD8")
    stream = torch.cuda.Stream()
    check(cu.cuGraphLaunch(exec_, ctypes.c_void_p(stream.cuda_stream)), "cuGraphLaunch")
    torch.cuda.synchronize()
    got = device_bytes(cu, out_address, out_bytes)
    result["replayed"] = True
    result["replay_bitwise_equal_to_first_process"] = got.hex() == recorded["expected"]
    result["recorded_capture_s"] = recorded["capture_s"]
    result["total_s"] = round(time.perf_counter() - t0, 6)
    return result


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

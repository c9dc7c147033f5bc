"""``weightcache bench``: what a restarted engine pays to get its weights back, in fresh processes.

For each (size, tensor count) it fills a synthetic state dict (LLM-like: two thirds small tensors such as norms
and biases, the rest large matrices sharing the bytes; random bits) straight into segments on the device, no
checkpoint file, so that entries as large as the device can hold are cheap to set up, and publishes it into a
private keeper. Then ``--repeat`` fresh engine processes each:

1. start Python, import torch, initialise the device (CUDA) and build the model on the meta device: not timed
   by the clock of the attach, but reported (``torch import``);
2. ``import weightcache`` and look up ``weightcache.attach`` (``import``: whatever the first attach needs that
   an engine has not imported yet);
3. ``weightcache.attach(model, ..., mode="client", strict=True)``: fingerprint, connect, manifest, map, views,
   bind (``attach``). No garbage collection is forced before the clock; the time CPython spent collecting
   inside the import and inside the attach are columns of their own (``gc``), so that a full collection of
   torch's import-time objects landing in either is visible, not hidden; and so is what one full collection
   costs right after the attach (the library pauses the collector inside the attach: that moves such a
   collection to the engine's next allocations, it does not remove it);
4. the per-tensor floor, in the same process: one ``as_strided`` view per tensor over one flat tensor, wrapped
   as an ``nn.Parameter`` and set on a fresh meta module (``floor``). Attach can only approach it: it does
   that same work plus the keeper round trip and the checks;
5. the checkpoint's identity once more (``Fingerprint.create``, what attach derives first; warm now, so a lower
   bound of its share of the attach: ``identity again``);
6. a checksum of every attached tensor's bits, compared with the one computed when the entry was filled.

With a CUDA device it also measures the peer side by side: a holder process allocates the same tensors with
torch and exports them with torch's legacy CUDA IPC reductions (``torch.multiprocessing``, pickled, as the SGLang
and vLLM weight daemons do); ``--repeat`` fresh processes unpickle (rebuilding each tensor from its IPC handle)
and bind them as Parameters. Its checksum must equal ours.

With ``--real-checkpoint`` it also attaches what users attach: a safetensors file of the same layout and contents
on disk, published as ``weightcache load`` publishes it (read from disk, per-tensor digests recorded) and attached
by path (``wc.attach(model, ckpt_dir, mode="client")`` on the meta model) in as many fresh processes, alternating
with the synthetic entry's; so its identity is derived from the file's headers and stat in every process, as an
engine's is. Its columns are those of steps 2-6, on a line of its own.

Reported: median, min and max over the fresh processes of each column, the ratios (attach / floor as a ratio of
medians and as the median of each process's own ratio, peer / attach, import / torch import), flatness in size,
and whether every process saw identical bits. A table on
stdout and, with ``--json``, a JSON file; docs/benchmarks.md records the figures.
"""

from __future__ import annotations

import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file
from torch import nn

import weightcache as wc
from weightcache import segments
from weightcache.fingerprint import placement_of
from weightcache.manifest import TensorInfo
from weightcache.publish import Packed
from weightcache.units import format_bytes

#: What ``weightcache bench`` measures without ``--sizes`` and ``--tensors``.
DEFAULT_SIZES_GIB = (1.0, 8.0)
DEFAULT_TENSORS = (3000,)
#: Fresh engine processes per configuration (and per mechanism).
DEFAULT_REPEAT = 7
#: Segments the bench fills: as large as those ``weightcache load`` streams a checkpoint into on a GPU (few
#: imports per attach); on the CPU the library's default for a memfd.
CUDA_SEGMENT_BYTES = 16 << 30
CPU_SEGMENT_BYTES = 8 << 30


def layout(total_bytes: int, n: int, itemsize: int) -> list[int]:
    """Element counts of ``n`` tensors adding up to about ``total_bytes``."""
    small = (2 * n) // 3
    big = max(1, n - small)
    sizes = [4096] * small
    rest = total_bytes // itemsize - sum(sizes)
    sizes += [max(256, (rest // big) // 256 * 256)] * big
    return sizes


def report_path(json_out: str | os.PathLike[str] | None) -> Path | None:
    """Where ``--json`` writes, with its directory created now: before the work, not after it (a fresh clone
    has no ``bench-results/``). WeightCacheError when the directory cannot be created."""
    if json_out is None:
        return None
    path = Path(json_out)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise wc.WeightCacheError(
            f"--json {json_out}: cannot create its directory ({exc}); give a path in a writable directory"
        ) from exc
    return path


#: Memory a size needs, per byte of weights: the loaded or filled copy, and the keeper's copy while it is packed
#: (CPU); on a GPU the weights once, plus room for the CUDA context and staging.
CPU_FACTOR = 2.0
GPU_HEADROOM = 1 << 30


def memory_available(device: str) -> int:
    """Bytes free for the benchmark's weights: MemAvailable on CPU, the GPU's free memory on ``cuda:N``."""
    if device.startswith("cuda"):
        free, _ = torch.cuda.mem_get_info(device)
        return int(free)
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise wc.WeightCacheError("/proc/meminfo has no MemAvailable line: cannot tell how big a benchmark fits")


def memory_needed(gib: float, device: str = "cpu") -> int:
    """About how much memory a benchmark of ``gib`` GiB of weights takes at its peak."""
    size = int(gib * 2**30)
    return size + GPU_HEADROOM if device.startswith("cuda") else int(size * CPU_FACTOR)


def sizes_that_fit(
    sizes: Sequence[float], available: int, *, explicit: bool, device: str = "cpu"
) -> tuple[list[float], str | None]:
    """The sizes (GiB) to run with ``available`` bytes of memory, and a note of the ones left out.

    Sizes the user gave (``explicit``) are never changed: one that does not fit is a WeightCacheError, before
    anything is written. Default sizes that do not fit are left out (the note says which); none fitting is an
    error that says what to pass.
    """
    fit = [g for g in sizes if memory_needed(g, device) <= available]
    left = [g for g in sizes if g not in fit]
    if not left:
        return fit, None
    where = f"{format_bytes(available)} available on {device}"
    if explicit:
        g = left[0]
        raise wc.WeightCacheError(
            f"--sizes {g:g} GiB needs about {format_bytes(memory_needed(g, device))} of memory; this machine has "
            f"{where}. Give smaller --sizes"
        )
    if not fit:
        g = min(sizes)
        raise wc.WeightCacheError(
            f"even the smallest default size, {g:g} GiB, needs about {format_bytes(memory_needed(g, device))} of "
            f"memory; this machine has {where}. Give smaller --sizes, e.g. --sizes 0.25"
        )
    shown = ", ".join(f"{g:g} GiB" for g in left)
    return fit, (
        f"left out {shown}: needs about {format_bytes(memory_needed(max(left), device))} of memory, {where} "
        "(pass --sizes to choose)"
    )


def plan_sizes(
    sizes: Sequence[float] | None, defaults: Sequence[float], device: str, extra_copy: bool = False
) -> list[float]:
    """:func:`sizes_that_fit` for this machine: ``sizes`` as given, or the ``defaults`` that fit (printing what
    was left out). ``extra_copy``: a second entry of each size is held beside the first (a real checkpoint's),
    so only two thirds of the memory count as available (three copies at the CPU's peak instead of two)."""
    available = memory_available(device)
    if extra_copy:
        available = available * 2 // 3
    fit, note = sizes_that_fit(sizes or defaults, available, explicit=sizes is not None, device=device)
    if note:
        print(f"weightcache bench: {note}", flush=True)
    return fit


def meta_holder(shapes: list[int], dtype: torch.dtype, prefix: str = "p") -> nn.Module:
    """A module built on the meta device with one 1-D parameter ``{prefix}{i}`` of ``shapes[i]`` elements per
    tensor: what an engine's model is to :func:`weightcache.bind`, without the engine."""
    model = nn.Module()
    with torch.device("meta"):
        for i, n in enumerate(shapes):
            model.register_parameter(f"{prefix}{i}", nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False))
    return model


def pattern(i: int, numel: int, dtype: torch.dtype, device: str) -> torch.Tensor:
    """Tensor ``i``'s contents: random bits, the same on every call (a random block of at most 64 Ki elements
    from a generator seeded with ``i``, repeated). The peer's holder and our filler both use it."""
    gen = torch.Generator(device=device).manual_seed(i)
    block = torch.randint(-(2**15), 2**15, (min(numel, 1 << 16),), generator=gen, dtype=torch.int16, device=device)
    bits = block.repeat(-(-numel // block.numel()))[:numel] if numel > block.numel() else block
    itemsize = torch.empty(0, dtype=dtype).element_size()
    if itemsize == 2:
        return bits.view(dtype)
    return bits.to(dtype)


def checksum(tensors: Sequence[torch.Tensor]) -> str:
    """Per tensor the sum of its 16-bit words (on its device), hashed: equal for identical bits, and with
    random contents a tensor read from the wrong place changes it."""
    import hashlib

    with torch.no_grad():
        sums = torch.stack([t.reshape(-1).view(torch.int16).sum(dtype=torch.int64) for t in tensors])
    return hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()


def marker_checkpoint(directory: Path, gib: float, n: int, dtype_name: str) -> Path:
    """A tiny real checkpoint whose header names the configuration: ``attach`` fingerprints it as an engine
    would, and each configuration gets its own entry."""
    path = directory / f"marker-{gib:g}g-{n}-{dtype_name}"
    path.mkdir(exist_ok=True)
    save_file(
        {"marker": torch.zeros(1)}, str(path / "model.safetensors"), metadata={"bench": f"{gib}/{n}/{dtype_name}"}
    )
    return path


#: safetensors' names of the dtypes the bench writes into a real checkpoint.
_SAFETENSORS_DTYPES = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "float64": "F64"}


def real_checkpoint(directory: Path, gib: float, shapes: list[int], dtype_name: str, device: str = "cpu") -> Path:
    """A real safetensors checkpoint of the bench's layout (tensor ``p{i}`` of ``shapes[i]`` elements holding
    ``pattern(i)`` as made on ``device``, the synthetic entry's contents: a CUDA generator gives other bits than
    the CPU's), written one tensor at a time (the peak is one tensor, not the checkpoint): what a user's engine
    attaches in :func:`run`'s real-checkpoint mode, whose identity is derived from the file itself."""
    if dtype_name not in _SAFETENSORS_DTYPES:
        raise wc.WeightCacheError(
            f"--real-checkpoint writes {', '.join(_SAFETENSORS_DTYPES)} tensors; found --dtype {dtype_name}"
        )
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    path = directory / f"real-{gib:g}g-{len(shapes)}-{dtype_name}"
    path.mkdir(exist_ok=True)
    header: dict[str, Any] = {}
    offset = 0
    for i, n in enumerate(shapes):
        header[f"p{i}"] = {
            "dtype": _SAFETENSORS_DTYPES[dtype_name],
            "shape": [n],
            "data_offsets": [offset, offset + n * itemsize],
        }
        offset += n * itemsize
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # safetensors aligns the data to 8 bytes
    with open(path / "model.safetensors", "wb") as f:
        f.write(len(raw).to_bytes(8, "little") + raw)
        for i, n in enumerate(shapes):
            f.write(pattern(i, n, dtype, device).contiguous().view(torch.uint8).cpu().numpy().tobytes())
    return path


def publish_synthetic(
    cache: wc.Cache,
    fingerprint: wc.Fingerprint,
    shapes: list[int],
    dtype: torch.dtype,
    device: str,
    segment_bytes: int,
    seed: int = 0,
) -> tuple[int, int, str]:
    """Fill the tensors straight into segments of the fingerprint's placement (no state dict, no checkpoint:
    the peak is the entry plus one tensor) and publish them. Tensor ``i`` holds ``pattern(seed + i)`` (so that
    entries filled with other seeds, such as the shards of other ranks, differ). Returns (bytes, segments,
    checksum)."""
    transport = segments.transport_for_placement(fingerprint.placement)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    placements, sizes = segments.pack([n * itemsize for n in shapes], transport.alignment, segment_bytes)
    dtype_name = str(dtype).removeprefix("torch.")
    packed = Packed(fingerprint, transport, [], [])
    sums = []
    try:
        i = 0
        for k, size in enumerate(sizes):
            seg = transport.create(size, fingerprint.placement)
            packed.segments.append(seg)
            while i < len(shapes) and placements[i].segment == k:
                data = pattern(seed + i, shapes[i], dtype, device)
                seg.write(placements[i].offset, data)
                sums.append(data.reshape(-1).view(torch.int16).sum(dtype=torch.int64))
                packed.infos.append(
                    TensorInfo(
                        name=f"p{i}",
                        segment=k,
                        offset=placements[i].offset,
                        dtype=dtype_name,
                        shape=(shapes[i],),
                        stride=(1,),
                        kind="tensor",
                        requires_grad=False,
                        digest=None,
                    )
                )
                del data
                i += 1
            seg.seal()
        expected = _hash_sums(sums)
        total = sum(seg.size for seg in packed.segments)
        handle = cache.publish(packed)
        handle.close()
    finally:
        packed.close()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return total, len(sizes), expected


def _hash_sums(sums: list[Any]) -> str:
    import hashlib

    return hashlib.sha256(torch.stack(sums).cpu().numpy().tobytes()).hexdigest()


# What both fresh processes do before their clocks start: Python, torch, the CUDA context, the model on meta.
START = r"""
import sys, time
t_start = time.perf_counter()
import gc, json, pickle
import torch
t_torch = time.perf_counter()
spec = json.loads(sys.argv[1])
device = spec["device"]
if device.startswith("cuda"):
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
t_cuda = time.perf_counter()
dtype = getattr(torch, spec["dtype"])
model = torch.nn.Module()
with torch.device("meta"):
    for i, n in enumerate(spec["shapes"]):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.empty(n, dtype=dtype), requires_grad=False))
"""

# The fresh engine process: a script run with `python -c`, so that nothing of weightcache is imported before the
# clock of `import` starts (`python -m weightcache.tools.bench` would import the package first).
ENGINE = (
    START
    + r"""
gc_ns = {"import": [0, 0, 0], "attach": [0, 0, 0]}  # per phase: ns in collections, collections, full ones
phase_now = ["import"]
def on_gc(phase, info, _start=[0]):
    if phase == "start":
        _start[0] = time.perf_counter_ns()
    else:
        bucket = gc_ns[phase_now[0]]
        bucket[0] += time.perf_counter_ns() - _start[0]
        bucket[1] += 1
        bucket[2] += info["generation"] == 2
gc.callbacks.append(on_gc)
profile = None
if spec.get("profile"):
    import cProfile
    profile = cProfile.Profile()
    profile.enable()
t0 = time.perf_counter()
import weightcache as wc
attach = wc.attach
t1 = time.perf_counter()
phase_now[0] = "attach"
t2 = time.perf_counter()
handle = attach(model, spec["checkpoint"], mode="client", device=device, socket_dir=spec["socket_dir"], strict=True)
if device.startswith("cuda"):
    torch.cuda.synchronize(device)
t3 = time.perf_counter()
gc.callbacks.remove(on_gc)
if profile is not None:
    profile.disable()
    profile.dump_stats(spec["profile"])
t4 = time.perf_counter()
gc.collect()  # what a full collection costs at this point (CPython runs one when long-lived objects grew 25 %)
t5 = time.perf_counter()
t6 = time.perf_counter()
wc.Fingerprint.create(spec["checkpoint"], device=device)  # the checkpoint's identity again (warm: a lower bound)
t7 = time.perf_counter()
params = list(model.parameters())
from weightcache.tools.bench import checksum, floor_ms
sums = checksum(params)
floor = floor_ms(params, spec["shapes"], dtype)
print(json.dumps({
    "source": handle.source, "checksum": sums,
    "python_ms": (t_torch - t_start) * 1e3, "cuda_init_ms": (t_cuda - t_torch) * 1e3,
    "import_ms": (t1 - t0) * 1e3, "attach_ms": (t3 - t2) * 1e3, "gc_ms": gc_ns["attach"][0] / 1e6,
    "gc_collections": gc_ns["attach"][1], "gc_full": gc_ns["attach"][2], "gc_import_ms": gc_ns["import"][0] / 1e6,
    "gc_import_full": gc_ns["import"][2], "gc_after_ms": (t5 - t4) * 1e3, "floor_ms": floor,
    "identity_ms": (t7 - t6) * 1e3,
}), flush=True)
handle.close()
"""
)

# The peer's fresh engine process: unpickle what the holder exported with torch's CUDA IPC reductions (each
# tensor is rebuilt from its IPC handle) and bind the tensors as Parameters.
PEER = (
    START
    + r"""
t0 = time.perf_counter()
import torch.multiprocessing.reductions  # what unpickling the rebuild functions imports
t1 = time.perf_counter()
t2 = time.perf_counter()
with open(spec["exported"], "rb") as f:
    tensors = pickle.loads(f.read())
for name, tensor in tensors.items():
    setattr(model, name, torch.nn.Parameter(tensor, requires_grad=False))
if device.startswith("cuda"):
    torch.cuda.synchronize(device)
t3 = time.perf_counter()
from weightcache.tools.bench import checksum
sums = checksum(list(model.parameters()))
print(json.dumps({
    "checksum": sums, "python_ms": (t_torch - t_start) * 1e3, "cuda_init_ms": (t_cuda - t_torch) * 1e3,
    "import_ms": (t1 - t0) * 1e3, "attach_ms": (t3 - t2) * 1e3,
}), flush=True)
"""
)


def floor_ms(params: Sequence[torch.Tensor], shapes: list[int], dtype: torch.dtype) -> float:
    """The pure per-tensor floor of binding these tensors, in this process: over one flat tensor of their
    device, one ``as_strided`` view per tensor, wrapped as an ``nn.Parameter`` and set on a fresh module that
    holds the same meta parameters (what binding replaces), with the garbage collector paused. Milliseconds."""
    device = params[0].device if params else torch.device("cpu")
    flat = torch.empty(max(shapes, default=1), dtype=dtype, device=device)
    model = meta_holder(shapes, dtype)
    names = [f"p{i}" for i in range(len(shapes))]
    strides = [(1,)] * len(shapes)
    collecting = gc.isenabled()
    gc.disable()  # the pure per-tensor cost: no collection lands inside
    try:
        t0 = time.perf_counter()
        for name, n, stride in zip(names, shapes, strides):
            setattr(model, name, nn.Parameter(flat.as_strided((n,), stride, 0), requires_grad=False))
        elapsed = (time.perf_counter() - t0) * 1e3
    finally:
        if collecting:
            gc.enable()
    del model, flat
    return elapsed


def _child(code: str, spec: dict[str, Any], what: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, check=False, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def stats(runs: list[dict[str, Any]], key: str) -> dict[str, float]:
    """Median, min and max of column ``key`` over ``runs`` (one dict per process or round)."""
    values = [float(r[key]) for r in runs]
    return {
        "median": round(statistics.median(values), 3),
        "min": round(min(values), 3),
        "max": round(max(values), 3),
    }


def peer_attach(
    work: Path, shapes: list[int], dtype_name: str, device: str, repeat: int, expected: str
) -> dict[str, Any]:
    """The peer's attach of the same tensors, in ``repeat`` fresh processes while a holder exports them: on CUDA
    torch's legacy CUDA IPC (what the bench reports); on the CPU torch's shared-memory files (only so that the
    test suite can run this code without a GPU). ``expected``: the checksum every process must see."""
    exported = work / "peer.pkl"
    spec = {"device": device, "dtype": dtype_name, "shapes": shapes, "exported": str(exported)}
    holder = subprocess.Popen(
        [sys.executable, "-m", "weightcache.tools.bench", "holder", json.dumps(spec)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdin is not None
        ready = holder.stdout.readline()
        if not ready.startswith("ready"):
            raise SystemExit(f"peer holder failed (exit {holder.wait()})")
        runs = [_child(PEER, spec, "peer engine") for _ in range(repeat)]
    finally:
        if holder.stdin is not None:
            holder.stdin.close()
        holder.wait(120)
        exported.unlink(missing_ok=True)
    return {
        "attach_ms": stats(runs, "attach_ms"),
        "import_ms": stats(runs, "import_ms"),
        "identical": all(r["checksum"] == expected for r in runs),
        "runs": runs,
    }


def holder(spec_json: str) -> None:
    """The peer's holder, in its own process: allocate the tensors with torch, export them with torch's CUDA IPC
    reductions (pickled with ``ForkingPickler``, as SGLang's and vLLM's weight daemons send them), say ``ready``
    and hold them until stdin closes."""
    import io
    from multiprocessing.reduction import ForkingPickler

    from torch.multiprocessing import reductions

    # what importing torch.multiprocessing does: CUDA tensors pickle as IPC handles
    reductions.init_reductions()  # type: ignore[no-untyped-call]

    spec = json.loads(spec_json)
    if not spec["device"].startswith("cuda"):  # CPU tensors: shared memory files a fresh process can open by name
        torch.multiprocessing.set_sharing_strategy("file_system")  # type: ignore[no-untyped-call]
    dtype = getattr(torch, spec["dtype"])
    tensors = {f"p{i}": pattern(i, n, dtype, spec["device"]) for i, n in enumerate(spec["shapes"])}
    if spec["device"].startswith("cuda"):
        torch.cuda.synchronize(spec["device"])
    buf = io.BytesIO()
    ForkingPickler(buf).dump(tensors)
    Path(spec["exported"]).write_bytes(buf.getvalue())
    print("ready", flush=True)
    sys.stdin.read()


def _run_one(
    cache: wc.Cache,
    socket_dir: Path,
    tmp: Path,
    device: str,
    gib: float,
    n: int,
    dtype_name: str,
    repeat: int,
    peer: bool,
    profile_dir: Path | None,
    segment_gib: float | None = None,
    real_checkpoint_mode: bool = False,
) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shapes = layout(int(gib * 2**30), n, itemsize)
    marker = marker_checkpoint(tmp, gib, n, dtype_name)
    # exactly what attach() derives from (checkpoint, device): see weightcache.api
    fp = wc.Fingerprint.create(marker, device=torch.device(device))
    segment_bytes = CUDA_SEGMENT_BYTES if device.startswith("cuda") else CPU_SEGMENT_BYTES
    if segment_gib is not None:
        segment_bytes = int(segment_gib * 2**30)
    row: dict[str, Any] = {"gib": gib, "tensors": n}
    if peer and device.startswith("cuda"):  # first, alone on the device: at 120 GiB both would not fit
        expected_peer = _hash_sums(
            [pattern(i, s, dtype, device).view(torch.int16).sum(dtype=torch.int64) for i, s in enumerate(shapes)]
        )
        row["peer"] = peer_attach(tmp, shapes, dtype_name, device, repeat, expected_peer)
        torch.cuda.empty_cache()
    t0 = time.perf_counter()
    total, nseg, expected = publish_synthetic(cache, fp, shapes, dtype, device, segment_bytes)
    row.update({"bytes": total, "segments": nseg, "publish_s": round(time.perf_counter() - t0, 3)})
    spec = {"checkpoint": str(marker), "device": device, "dtype": dtype_name, "shapes": shapes}
    spec["socket_dir"] = str(socket_dir)
    real: dict[str, dict[str, Any]] = {}
    real_fp = None
    if real_checkpoint_mode:
        real_dir = real_checkpoint(tmp, gib, shapes, dtype_name, device)
        t0 = time.perf_counter()
        # as a user publishes a checkpoint (`weightcache load`): read from disk, digests recorded
        handle = wc.preload(real_dir, device=device, socket_dir=socket_dir, progress=False)
        real_fp = handle.fingerprint
        handle.close()
        row["real_publish_s"] = round(time.perf_counter() - t0, 3)
        real_spec = {**spec, "checkpoint": str(real_dir)}
        real = {"real": {"spec": real_spec, "runs": []}}
    runs = []
    for k in range(repeat):  # the variants alternate, so that the machine's load falls on each alike
        if profile_dir is not None:
            spec["profile"] = str(profile_dir / f"attach-{gib:g}g-{n}-{k}.prof")
        runs.append(_child(ENGINE, spec, "bench engine"))
        for name, variant in real.items():
            vspec = dict(variant["spec"])
            if profile_dir is not None:
                vspec["profile"] = str(profile_dir / f"attach-{name}-{gib:g}g-{n}-{k}.prof")
            variant["runs"].append(_child(ENGINE, vspec, f"bench engine ({name})"))
    cache.evict(fp, force=True)
    if real_fp is not None:
        cache.evict(real_fp, force=True)
        shutil.rmtree(real_dir, ignore_errors=True)
    row.update(_columns(runs, expected))
    for name, variant in real.items():
        row[name] = _columns(variant["runs"], expected)
        row[f"{name}_over_synthetic"] = round(row[name]["attach_ms"]["median"] / row["attach_ms"]["median"], 3)
    if "peer" in row:
        row["peer_over_attach"] = round(row["peer"]["attach_ms"]["median"] / row["attach_ms"]["median"], 2)
        row["identical"] = row["identical"] and row["peer"]["identical"] and expected == expected_peer
    row["identical"] = row["identical"] and all(row[name]["identical"] for name in real)
    return row


def _columns(runs: list[dict[str, Any]], expected: str) -> dict[str, Any]:
    """The reported columns of one mechanism's fresh processes: medians, ratios and whether all saw ``expected``."""
    row: dict[str, Any] = {"runs": runs}
    for key in ("attach_ms", "import_ms", "floor_ms", "gc_ms", "gc_import_ms", "gc_after_ms", "identity_ms"):
        row[key] = stats(runs, key)
    for key in ("python_ms", "cuda_init_ms", "gc_full", "gc_import_full"):
        row[key] = stats(runs, key)
    row["attach_over_floor"] = round(row["attach_ms"]["median"] / row["floor_ms"]["median"], 3)
    # per process (attach and floor of the same process share its moment of the machine's load): the median
    row["attach_over_floor_paired"] = round(statistics.median(r["attach_ms"] / r["floor_ms"] for r in runs), 3)
    row["import_over_torch"] = round(row["import_ms"]["median"] / row["python_ms"]["median"], 4)
    row["identical"] = all(r["checksum"] == expected and r["source"] == "cache" for r in runs)
    return row


#: The real-checkpoint rows of a configuration, as :func:`_lines` labels them.
REAL_VARIANTS = {"real": "real checkpoint"}


def _lines(r: dict[str, Any]) -> list[str]:
    """The synthetic row of a configuration, then its real-checkpoint rows (``--real-checkpoint``)."""
    lines = [_line(r)]
    for name, label in REAL_VARIANTS.items():
        if name in r:
            lines.append(_line({**r[name], "gib": r["gib"], "tensors": r["tensors"], "segments": r["segments"]}, label))
    return lines


def _line(r: dict[str, Any], label: str = "synthetic") -> str:
    a, imp, fl, g = r["attach_ms"], r["import_ms"], r["floor_ms"], r["gc_ms"]
    text = (
        f"{r['gib']:>6g} GiB {r['tensors']:>5} tensors, {label} | attach median {a['median']:7.2f} ms "
        f"({a['min']:.2f}-{a['max']:.2f}) | import {imp['median']:6.2f} ms ({imp['min']:.1f}-{imp['max']:.1f}; "
        f"gc in it {r['gc_import_ms']['median']:.1f}; torch {r['python_ms']['median']:.0f} ms) | "
        f"floor {fl['median']:.2f} ms, attach/floor {r['attach_over_floor']:.2f}x "
        f"(per process {r['attach_over_floor_paired']:.2f}x) | "
        f"gc in attach {g['median']:.2f} ms (max {g['max']:.1f}; full collections in it: "
        f"{r['gc_full']['max']:g} at most); "
        f"a full collection after it {r['gc_after_ms']['median']:.0f} ms | "
        f"identity again {r['identity_ms']['median']:.2f} ms"
    )
    if "peer" in r:
        p = r["peer"]["attach_ms"]
        text += f" | peer {p['median']:.2f} ms ({p['min']:.1f}-{p['max']:.1f}), {r['peer_over_attach']:.1f}x"
    return text + f" | {r['segments']} segments | identical {r['identical']}"


def run(
    *,
    device: str = "cpu",
    sizes: Sequence[float] | None = None,
    tensors: Sequence[int] = DEFAULT_TENSORS,
    repeat: int = DEFAULT_REPEAT,
    dtype: str = "bfloat16",
    json_out: str | os.PathLike[str] | None = None,
    peer: bool = True,
    profile_dir: str | os.PathLike[str] | None = None,
    segment_gib: float | None = None,
    real_checkpoint: bool = False,
) -> int:
    """Publish a synthetic entry of each size (GiB) and tensor count into a private keeper and time its attach in
    ``repeat`` fresh engine processes (on CUDA, with ``peer``, also the legacy CUDA IPC attach of the same
    tensors); print a line per configuration and the flatness in size; write the report to ``json_out`` (after
    every configuration) when given. ``profile_dir``: each engine dumps a cProfile of its import and attach
    there. ``segment_gib``: largest segment (default 16 GiB on a GPU, as ``weightcache load`` streams a
    checkpoint; 8 GiB on the CPU). ``real_checkpoint``: also write a safetensors file of the same layout and
    contents, publish it as ``weightcache load`` does, and time its attach in as many fresh processes, alternating
    with the synthetic ones (row ``real``). Without ``sizes``, the
    defaults that fit in memory; given sizes that do not fit are refused before anything is written, as is a
    device this process lacks. Returns 0 when every process saw the published bits, else 1."""
    placement_of(device)  # InvalidArgument for a device this process lacks, before any work
    report_path(json_out)  # its directory exists before the work starts
    sizes = plan_sizes(sizes, DEFAULT_SIZES_GIB, device, extra_copy=real_checkpoint)
    if sys.flags.dont_write_bytecode:
        print(
            "note: PYTHONDONTWRITEBYTECODE is set: modules without a cached .pyc are compiled at every import, "
            "so the import column includes compiling them",
            file=sys.stderr,
        )
    tmp = Path(tempfile.mkdtemp(prefix="wc-bench-"))
    socket_dir = tmp / "sock"
    cache = wc.Cache(socket_dir, spawn=True)  # starts the private keeper
    results: list[dict[str, Any]] = []
    profiles = Path(profile_dir) if profile_dir else None
    if profiles is not None:
        profiles.mkdir(parents=True, exist_ok=True)
    try:
        # one untimed engine first: writes the .pyc files an installed package would have
        warm = marker_checkpoint(tmp, 0, 1, dtype)
        warm_fp = wc.Fingerprint.create(warm, device=torch.device(device))
        publish_synthetic(cache, warm_fp, [256], getattr(torch, dtype), device, CPU_SEGMENT_BYTES)
        warm_spec = {"checkpoint": str(warm), "device": device, "dtype": dtype, "shapes": [256]}
        _child(ENGINE, {**warm_spec, "socket_dir": str(socket_dir)}, "warm-up engine")
        cache.evict(warm_fp, force=True)
        for n in tensors:
            for gib in sizes:
                r = _run_one(
                    cache, socket_dir, tmp, device, gib, n, dtype, repeat, peer, profiles, segment_gib, real_checkpoint
                )
                results.append(r)
                for text in _lines(r):
                    print(text, flush=True)
                if json_out:
                    Path(json_out).write_text(json.dumps(_report(device, results, tensors), indent=2))
    finally:
        cache.stop(wait=30)  # it writes into socket_dir until it exits
        shutil.rmtree(tmp, ignore_errors=True)
    report = _report(device, results, tensors)
    for f in report.get("flatness", []):
        print(
            f"{f['tensors']} tensors: attach at {f['to_gib']:g} GiB is {f['ratio']:.2f}x the time at "
            f"{f['from_gib']:g} GiB (medians)"
        )
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_out}")
    return 0 if all(r["identical"] for r in results) else 1


def _report(device: str, results: list[dict[str, Any]], counts: Sequence[int]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "bytecode_cached": not sys.flags.dont_write_bytecode,
        "env": {k: v for k, v in sorted(os.environ.items()) if k.startswith("WEIGHTCACHE_")},
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "results": results,
    }
    for n in counts:
        series = [r for r in results if r["tensors"] == n]
        if len(series) > 1:
            small, large = series[0], series[-1]
            ratio = large["attach_ms"]["median"] / small["attach_ms"]["median"]
            report.setdefault("flatness", []).append(
                {"tensors": n, "from_gib": small["gib"], "to_gib": large["gib"], "ratio": round(ratio, 3)}
            )
    return report


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "holder":
        holder(sys.argv[2])
    else:
        raise SystemExit("usage: python -m weightcache.tools.bench holder SPEC (use `weightcache bench`)")

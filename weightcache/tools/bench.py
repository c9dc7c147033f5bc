"""``weightcache bench``: how long does attaching take, and is it flat in model size?

For each size it builds a synthetic state dict (LLM-like: two thirds small tensors such as norms and biases,
the rest large matrices sharing the bytes), publishes it into a private keeper, and then, in a fresh process
(a restarted engine), times attach: ``Cache.get`` (connect, hello, manifest, map, views) plus ``bind`` into a
model built on the meta device. Every run checks that the attached data equals what was published.

The result is a table on stdout and, with ``--json``, a JSON file; docs/benchmarks.md records the figures.
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
from weightcache.fingerprint import placement_of
from weightcache.units import format_bytes

#: What ``weightcache bench`` measures without ``--sizes`` and ``--tensors``.
DEFAULT_SIZES_GIB = (1.0, 2.0, 8.0)
DEFAULT_TENSORS = (500,)


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


def plan_sizes(sizes: Sequence[float] | None, defaults: Sequence[float], device: str) -> list[float]:
    """:func:`sizes_that_fit` for this machine: ``sizes`` as given, or the ``defaults`` that fit (printing what
    was left out)."""
    fit, note = sizes_that_fit(sizes or defaults, memory_available(device), explicit=sizes is not None, device=device)
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


def _marker_checkpoint(directory: Path) -> Path:
    """A tiny real checkpoint that gives the synthetic weights a genuine fingerprint."""
    path = directory / "marker"
    path.mkdir(exist_ok=True)
    save_file({"marker": torch.zeros(1)}, str(path / "model.safetensors"))
    return path


def _fingerprint(marker: Path, device: str, gib: float, n: int, dtype: str) -> wc.Fingerprint:
    return wc.Fingerprint.create(marker, device=device, dtype=dtype, extra={"bench_gib": gib, "bench_tensors": n})


def client(spec_path: str) -> None:
    """Runs in the fresh process: attach ``repeat`` times, print one JSON line of timings."""
    spec = json.loads(Path(spec_path).read_text())
    dtype = getattr(torch, spec["dtype"])
    fp = _fingerprint(Path(spec["marker"]), spec["device"], spec["gib"], spec["n"], spec["dtype"])
    cache = wc.Cache(spec["socket_dir"])
    runs = []
    # A fresh interpreter that imported torch owes CPython one full garbage collection of the import-time
    # objects (~60 ms here); whichever allocation comes next pays it. An engine pays it during its own start
    # either way, so settle it before timing instead of charging it to the first attach.
    gc.collect()
    for _ in range(spec["repeat"]):
        model = meta_holder(spec["shapes"], dtype)
        t0 = time.perf_counter()
        handle = cache.get(fp)
        t1 = time.perf_counter()
        assert handle is not None, "entry vanished"
        wc.bind(model, handle.tensors, device=spec["device"])
        if spec["device"] != "cpu":
            torch.cuda.synchronize()
        t2 = time.perf_counter()
        first, last = model.get_parameter("p0"), model.get_parameter(f"p{len(spec['shapes']) - 1}")
        check = [float(first.float().sum()), float(last[:4096].float().sum())]
        if check != spec["check"]:
            raise SystemExit(f"attached data differs from what was published: {check} != {spec['check']}")
        runs.append({"get_ms": (t1 - t0) * 1e3, "bind_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3})
        handle.close()
        del model, handle
    print(json.dumps(runs))


def _run_one(
    socket_dir: Path, marker: Path, device: str, gib: float, n: int, dtype_name: str, repeat: int
) -> dict[str, Any]:
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    shapes = layout(int(gib * 2**30), n, itemsize)
    fp = _fingerprint(marker, device, gib, n, dtype_name)
    cache = wc.Cache(socket_dir)
    t0 = time.perf_counter()
    state = {}
    for i, numel in enumerate(shapes):
        state[f"p{i}"] = torch.full((numel,), float((i % 7) + 1) / 8, dtype=dtype, device=device)
    check = [float(state["p0"].float().sum()), float(state[f"p{n - 1}"][:4096].float().sum())]
    t1 = time.perf_counter()
    handle = cache.put(fp, state, digests=False, consume=True)
    t2 = time.perf_counter()
    assert handle.manifest is not None
    total = handle.manifest.total_bytes
    handle.close()
    del handle, state
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(
            {
                "socket_dir": str(socket_dir),
                "marker": str(marker),
                "device": device,
                "gib": gib,
                "n": n,
                "dtype": dtype_name,
                "shapes": shapes,
                "repeat": repeat,
                "check": check,
            },
            f,
        )
        spec = f.name
    try:
        out = subprocess.run(
            [sys.executable, "-m", "weightcache.tools.bench", "client", spec],
            capture_output=True,
            text=True,
            check=False,
        )
    finally:
        os.unlink(spec)
    if out.returncode != 0:
        raise SystemExit(f"bench client failed:\n{out.stderr[-3000:]}")
    runs = json.loads(out.stdout.strip().splitlines()[-1])
    cache.evict(fp, force=True)
    totals = [r["total_ms"] for r in runs]
    return {
        "gib": gib,
        "tensors": n,
        "bytes": total,
        "fill_s": round(t1 - t0, 3),
        "publish_s": round(t2 - t1, 3),
        "attach_ms_median": round(statistics.median(totals), 3),
        "attach_ms_first": round(totals[0], 3),
        "attach_ms_min": round(min(totals), 3),
        "get_ms_median": round(statistics.median(r["get_ms"] for r in runs), 3),
        "bind_ms_median": round(statistics.median(r["bind_ms"] for r in runs), 3),
        "runs": runs,
    }


def run(
    *,
    device: str = "cpu",
    sizes: Sequence[float] | None = None,
    tensors: Sequence[int] = DEFAULT_TENSORS,
    repeat: int = 7,
    dtype: str = "bfloat16",
    json_out: str | os.PathLike[str] | None = None,
) -> int:
    """Publish a synthetic state dict of each size (GiB; default :data:`DEFAULT_SIZES_GIB`, those that fit in
    memory) and tensor count into a private keeper and time
    ``repeat`` attaches of it in a fresh process; print a line per configuration and the flatness in size, and
    write the report to ``json_out`` when given (its directory is created first). Returns the exit status (0)."""
    placement_of(device)  # InvalidArgument for a device this process lacks, before any work
    report_file = report_path(json_out)
    sizes = plan_sizes(sizes, DEFAULT_SIZES_GIB, device)
    tmp = Path(tempfile.mkdtemp(prefix="wc-bench-"))
    socket_dir = tmp / "sock"
    wc.Cache(socket_dir, spawn=True)  # starts the private keeper
    marker = _marker_checkpoint(tmp)
    results = []
    try:
        for n in tensors:
            for gib in sizes:
                r = _run_one(socket_dir, marker, device, gib, n, dtype, repeat)
                results.append(r)
                summary = (
                    f"first {r['attach_ms_first']:.2f}, min {r['attach_ms_min']:.2f}; "
                    f"get {r['get_ms_median']:.2f} + bind {r['bind_ms_median']:.2f}"
                )
                print(
                    f"{gib:>6g} GiB {n:>6} tensors  attach median {r['attach_ms_median']:7.2f} ms ({summary})"
                    f"  publish {r['publish_s']:.2f} s",
                    flush=True,
                )
    finally:
        wc.Cache(socket_dir).stop(wait=30)  # it writes into socket_dir until it exits
        shutil.rmtree(tmp, ignore_errors=True)
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "results": results,
    }
    for n in tensors:
        series = [r for r in results if r["tensors"] == n]
        if len(series) > 1:
            small, large = series[0], series[-1]
            ratio = large["attach_ms_median"] / small["attach_ms_median"]
            report.setdefault("flatness", []).append(
                {"tensors": n, "from_gib": small["gib"], "to_gib": large["gib"], "ratio": round(ratio, 3)}
            )
            print(f"{n} tensors: attach at {large['gib']:g} GiB is {ratio:.2f}x the time at {small['gib']:g} GiB")
    if report_file is not None:
        report_file.write_text(json.dumps(report, indent=2))
        print(f"wrote {json_out}")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "client":
        client(sys.argv[2])
    else:
        raise SystemExit("usage: python -m weightcache.tools.bench client SPEC.json (use `weightcache bench`)")

"""``weightcache bench --restart``: what an engine restart costs with and without the cache, in one run.

For each (size, tensor count) it writes a synthetic safetensors checkpoint, then measures:

a. the disk's sequential read bandwidth with the page cache dropped, and pinned host-to-device bandwidth;
b. mode ``off`` with the page cache dropped (an engine loading from disk);
c. mode ``daemon``'s first start with the page cache dropped (load, publish, attach; spawns the keeper);
d. mode ``client`` attach in a new process (the restarted engine);
e. that all three hold identical weights (a checksum of every tensor's bits, computed on the device).

Each engine is a fresh process that imports torch and initialises the device before the clock starts, then
times ``attach()`` to the point where the weights are on the device. Results: a table and, with ``--json``,
a JSON file.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import os
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

import weightcache as wc
from weightcache.checkpoint import drop_page_cache
from weightcache.client import KeeperConnection
from weightcache.fingerprint import placement_of
from weightcache.messages import EVERY_ENTRY
from weightcache.progress import byte_bar

from .bench import layout, meta_holder, plan_sizes, report_path

#: What ``weightcache bench --restart`` measures without ``--sizes`` and ``--tensors``.
DEFAULT_SIZES_GIB = (1.0, 8.0, 32.0)
DEFAULT_TENSORS = (300, 3000)

#: Checkpoint shards are at most this big, like the files real checkpoints ship in.
SHARD_BYTES = 4 << 30


def write_checkpoint(path: Path, shapes: list[int], dtype_name: str, progress: bool) -> int:
    """A synthetic checkpoint of 1-D tensors ``w{i}`` with deterministic contents, sharded, with an index."""
    dtype = getattr(torch, dtype_name)
    itemsize = torch.empty(0, dtype=dtype).element_size()
    path.mkdir(parents=True, exist_ok=True)
    shards: list[list[int]] = [[]]
    used = 0
    for i, numel in enumerate(shapes):
        if used and used + numel * itemsize > SHARD_BYTES:
            shards.append([])
            used = 0
        shards[-1].append(i)
        used += numel * itemsize
    total = sum(shapes) * itemsize
    with byte_bar(total, "writing checkpoint", progress) as update:
        weight_map = {}
        gen = torch.Generator().manual_seed(0)
        for k, members in enumerate(shards):
            name = f"model-{k + 1:05d}-of-{len(shards):05d}.safetensors"
            part = {}
            for i in members:
                # random bits, cheap to make: a random base row repeated, offset by the tensor index
                base = torch.randint(-1000, 1000, (min(shapes[i], 1 << 20),), generator=gen, dtype=torch.int16)
                t = base.repeat(-(-shapes[i] // base.numel()))[: shapes[i]].add_(i % 97)
                part[f"w{i}"] = t.view(dtype) if itemsize == 2 else t.to(dtype)
            save_file(part, str(path / name))
            weight_map.update(dict.fromkeys(part, name))
            if update is not None:
                update(sum(shapes[i] for i in members) * itemsize)
            del part
    (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    (path / "config.json").write_text(json.dumps({"architectures": ["Synthetic"], "shapes": shapes}))
    return total


def disk_read_gbps(path: Path, drop_caches: bool = False) -> float:
    """Sequential read of every file with 64 MiB reads, the files' pages dropped from the page cache first (with
    ``drop_caches``, the whole machine's page cache: see :func:`run`)."""
    drop_page_cache(path, system=drop_caches)
    buf = bytearray(64 << 20)
    total = 0
    t0 = time.perf_counter()
    for f in sorted(path.glob("*.safetensors")):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
            while n := os.readv(fd, [buf]):
                total += n
        finally:
            os.close(fd)
    return total / (time.perf_counter() - t0) / 1e9


def h2d_gbps(device: str) -> float:
    host = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
    dev = torch.empty(1 << 30, dtype=torch.uint8, device=device)
    dev.copy_(host)
    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    for _ in range(4):
        dev.copy_(host, non_blocking=True)
    torch.cuda.synchronize(device)
    return 4 * (1 << 30) / (time.perf_counter() - t0) / 1e9


def engine(spec_json: str) -> None:
    """One engine start, in its own process. Prints one JSON line."""
    spec = json.loads(spec_json)
    device = spec["device"]
    if device.startswith("cuda"):
        torch.zeros(1, device=device)
        torch.cuda.synchronize(device)
    shapes = json.loads((Path(spec["checkpoint"]) / "config.json").read_text())["shapes"]
    model = meta_holder(shapes, getattr(torch, spec["dtype"]), prefix="w")
    attach = wc.attach  # an engine imported this at its start, not inside the timed region
    gc.collect()  # likewise the first full collection of torch's import-time objects (see docs/benchmarks.md)
    t0 = time.perf_counter()
    handle = attach(model, spec["checkpoint"], mode=spec["mode"], device=device, socket_dir=spec["socket_dir"])
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    elapsed = time.perf_counter() - t0
    with torch.no_grad():
        sums = torch.stack([p.view(-1).view(torch.int16).sum(dtype=torch.int64) for p in model.parameters()])
        checksum = hashlib.sha256(sums.cpu().numpy().tobytes()).hexdigest()
    free, total = torch.cuda.mem_get_info(device) if device.startswith("cuda") else (0, 0)
    print(
        json.dumps(
            {
                "mode": spec["mode"],
                "source": handle.source,
                "seconds": elapsed,
                "checksum": checksum,
                "device_used_gib": (total - free) / 2**30,
            }
        ),
        flush=True,
    )
    if spec.get("hold"):
        sys.stdin.readline()
    handle.close()


def _run_engine(spec: dict[str, Any]) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-m", "weightcache.tools.bench_restart", "engine", json.dumps(spec)],
        capture_output=True,
        text=True,
        check=False,
    )
    if out.returncode != 0:
        raise SystemExit(f"engine in mode {spec['mode']} failed:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def run(
    *,
    device: str = "cpu",
    sizes: Sequence[float] | None = None,
    tensors: Sequence[int] = DEFAULT_TENSORS,
    repeat: int = 7,
    dtype: str = "bfloat16",
    json_out: str | os.PathLike[str] | None = None,
    workdir: str | os.PathLike[str] | None = None,
    keep: bool = False,
    progress: bool = False,
    drop_caches: bool = False,
) -> int:
    """The restart benchmark for each size (GiB) and tensor count: write a synthetic checkpoint under
    ``workdir`` (default a temporary directory; removed afterwards unless ``keep``), measure the disk and H2D
    bandwidth, mode off, mode daemon's first start and ``repeat`` mode client attaches, each in a fresh process.
    Prints a line per configuration; writes the report to ``json_out`` after each one. Returns 0 when every
    configuration's engines held identical weights, else 1. ``progress`` shows progress bars without a
    terminal.

    Sizes: default :data:`DEFAULT_SIZES_GIB`, those that fit this machine's memory; given ones that do not fit
    are an error before anything is written. Before each cold load only the checkpoint's own pages are dropped
    from the page cache (``posix_fadvise``); with ``drop_caches`` (root only) also the whole machine's page cache,
    libraries included, as after a reboot: that slows every other process on the machine, so it is asked for.
    """
    placement_of(device)  # InvalidArgument for a device this process lacks, before any work
    report_file = report_path(json_out)  # its directory exists before the first minute of work
    sizes = plan_sizes(sizes, DEFAULT_SIZES_GIB, device)
    if drop_caches:
        print("weightcache bench: dropping the whole machine's page cache before each cold load (--drop-caches)")
    work = Path(workdir or tempfile.mkdtemp(prefix="wc-restart-"))
    work.mkdir(parents=True, exist_ok=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-")) / "s"
    itemsize = torch.empty(0, dtype=getattr(torch, dtype)).element_size()
    h2d = h2d_gbps(device) if device.startswith("cuda") else None
    rows = []
    progress = sys.stderr.isatty() or progress
    try:
        for n in tensors:
            for gib in sizes:
                ckpt = work / f"ckpt-{gib:g}g-{n}"
                shapes = layout(int(gib * 2**30), n, itemsize)
                total = write_checkpoint(ckpt, shapes, dtype, progress)
                disk = disk_read_gbps(ckpt, drop_caches)
                spec = {"checkpoint": str(ckpt), "device": device, "dtype": dtype, "socket_dir": str(socket_dir)}
                dropped = drop_page_cache(ckpt, system=drop_caches)
                off = _run_engine({**spec, "mode": "off"})
                drop_page_cache(ckpt, system=drop_caches)
                first = _run_engine({**spec, "mode": "daemon"})
                # several fresh client processes: one attach is a few ms, so host noise matters
                clients = [_run_engine({**spec, "mode": "client"}) for _ in range(max(1, repeat))]
                attach_ms = sorted(c["seconds"] * 1e3 for c in clients)
                same = off["checksum"] == first["checksum"] and all(c["checksum"] == off["checksum"] for c in clients)
                row = {
                    "gib": gib,
                    "tensors": n,
                    "bytes": total,
                    "disk_read_gbps": round(disk, 3),
                    "h2d_pinned_gbps": None if h2d is None else round(h2d, 2),
                    "page_cache_drop": dropped,
                    "off_s": round(off["seconds"], 3),
                    "off_gbps": round(total / off["seconds"] / 1e9, 3),
                    "off_vs_disk": round(total / off["seconds"] / 1e9 / disk, 3),
                    "daemon_first_s": round(first["seconds"], 3),
                    "daemon_vs_off": round(first["seconds"] / off["seconds"], 3),
                    "client_attach_ms": round(statistics.median(attach_ms), 2),
                    "client_attach_ms_min": round(attach_ms[0], 2),
                    "client_attach_ms_max": round(attach_ms[-1], 2),
                    "client_attaches": len(attach_ms),
                    "sources": [off["source"], first["source"], *sorted({c["source"] for c in clients})],
                    "identical": same,
                }
                rows.append(row)
                if report_file is not None:  # after every configuration: a run cut short keeps what it measured
                    report_file.write_text(json.dumps(_report(device, h2d, rows, tensors), indent=2))
                print(
                    f"{gib:>5g} GiB {n:>5} tensors | disk {disk:5.2f} GB/s | off {row['off_s']:7.2f} s "
                    f"({row['off_vs_disk'] * 100:4.0f}% of disk) | daemon first {row['daemon_first_s']:7.2f} s "
                    f"({row['daemon_vs_off']:.2f}x off) | client attach {row['client_attach_ms']:7.2f} ms "
                    f"(median of {len(attach_ms)}, {attach_ms[0]:.1f}-{attach_ms[-1]:.1f}) | "
                    f"identical {same}",
                    flush=True,
                )
                _evict_all(socket_dir)
                if not keep:
                    shutil.rmtree(ckpt, ignore_errors=True)
    finally:
        with contextlib.suppress(Exception):
            wc.Cache(socket_dir).stop(wait=30)  # it writes into socket_dir until it exits
        shutil.rmtree(socket_dir.parent, ignore_errors=True)
        if not workdir and not keep:
            shutil.rmtree(work, ignore_errors=True)
    if report_file is not None:
        report_file.write_text(json.dumps(_report(device, h2d, rows, tensors), indent=2))
        print(f"wrote {json_out}")
    return 0 if all(r["identical"] for r in rows) else 1


def _report(device: str, h2d: float | None, rows: list[dict[str, Any]], counts: Sequence[int]) -> dict[str, Any]:
    report: dict[str, Any] = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "h2d_pinned_gbps": h2d,
        "results": rows,
    }
    for n in counts:
        series = [r for r in rows if r["tensors"] == n]
        if len(series) > 1:
            report.setdefault("attach_flatness", []).append(
                {
                    "tensors": n,
                    "from_gib": series[0]["gib"],
                    "to_gib": series[-1]["gib"],
                    "ratio": round(series[-1]["client_attach_ms"] / series[0]["client_attach_ms"], 3),
                }
            )
    return report


def _evict_all(socket_dir: Path) -> None:
    with KeeperConnection.connect(socket_dir) as conn:
        conn.evict(EVERY_ENTRY, force=True, every=True)


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "engine":
        engine(sys.argv[2])
    else:
        raise SystemExit(
            "usage: python -m weightcache.tools.bench_restart engine SPEC (use `weightcache bench --restart`)"
        )

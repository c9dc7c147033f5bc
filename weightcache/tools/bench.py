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

This module runs the configurations (:func:`run`). What a configuration is and how its entry is filled is
:mod:`weightcache.tools.bench_setup`'s, the fresh processes and the floor :mod:`weightcache.tools.bench_processes`'s,
the table and the JSON report :mod:`weightcache.tools.bench_report`'s; their names are re-exported here, so each
keeps its old import path. Layer L5 (a tool); ``python -m weightcache.tools.bench holder SPEC`` is the peer's
holder process, nothing else.
"""

from __future__ import annotations

import json
import os
import shutil
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

import weightcache as wc
from weightcache.fingerprint import placement_of

from .bench_processes import ENGINE, PEER, START, floor_ms, holder, peer_attach, run_child
from .bench_report import REAL_VARIANTS, columns_of, make_report, report_lines, report_path, stats
from .bench_setup import (
    CPU_FACTOR,
    CPU_SEGMENT_BYTES,
    CUDA_SEGMENT_BYTES,
    DEFAULT_REPEAT,
    DEFAULT_SIZES_GIB,
    DEFAULT_TENSORS,
    GPU_HEADROOM,
    checksum,
    hash_sums,
    layout,
    marker_checkpoint,
    memory_available,
    memory_needed,
    meta_holder,
    pattern,
    plan_sizes,
    publish_synthetic,
    real_checkpoint,
    sizes_that_fit,
)


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
        expected_peer = hash_sums(
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
        runs.append(run_child(ENGINE, spec, "bench engine"))
        for name, variant in real.items():
            vspec = dict(variant["spec"])
            if profile_dir is not None:
                vspec["profile"] = str(profile_dir / f"attach-{name}-{gib:g}g-{n}-{k}.prof")
            variant["runs"].append(run_child(ENGINE, vspec, f"bench engine ({name})"))
    cache.evict(fp, force=True)
    if real_fp is not None:
        cache.evict(real_fp, force=True)
        shutil.rmtree(real_dir, ignore_errors=True)
    row.update(columns_of(runs, expected))
    for name, variant in real.items():
        row[name] = columns_of(variant["runs"], expected)
        row[f"{name}_over_synthetic"] = round(row[name]["attach_ms"]["median"] / row["attach_ms"]["median"], 3)
    if "peer" in row:
        row["peer_over_attach"] = round(row["peer"]["attach_ms"]["median"] / row["attach_ms"]["median"], 2)
        row["identical"] = row["identical"] and row["peer"]["identical"] and expected == expected_peer
    row["identical"] = row["identical"] and all(row[name]["identical"] for name in real)
    return row


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
        run_child(ENGINE, {**warm_spec, "socket_dir": str(socket_dir)}, "warm-up engine")
        cache.evict(warm_fp, force=True)
        for n in tensors:
            for gib in sizes:
                r = _run_one(
                    cache, socket_dir, tmp, device, gib, n, dtype, repeat, peer, profiles, segment_gib, real_checkpoint
                )
                results.append(r)
                for text in report_lines(r):
                    print(text, flush=True)
                if json_out:
                    Path(json_out).write_text(json.dumps(make_report(device, results, tensors), indent=2))
    finally:
        cache.stop(wait=30)  # it writes into socket_dir until it exits
        shutil.rmtree(tmp, ignore_errors=True)
    report = make_report(device, results, tensors)
    for f in report.get("flatness", []):
        print(
            f"{f['tensors']} tensors: attach at {f['to_gib']:g} GiB is {f['ratio']:.2f}x the time at "
            f"{f['from_gib']:g} GiB (medians)"
        )
    if json_out:
        Path(json_out).write_text(json.dumps(report, indent=2))
        print(f"wrote {json_out}")
    return 0 if all(r["identical"] for r in results) else 1


#: Every name this module had before it was divided, each importable from here (the fresh processes import
#: ``checksum`` and ``floor_ms`` from this module; benchmarks/ and tests/ import others).
__all__ = [
    "CPU_FACTOR",
    "CPU_SEGMENT_BYTES",
    "CUDA_SEGMENT_BYTES",
    "DEFAULT_REPEAT",
    "DEFAULT_SIZES_GIB",
    "DEFAULT_TENSORS",
    "ENGINE",
    "GPU_HEADROOM",
    "PEER",
    "REAL_VARIANTS",
    "START",
    "checksum",
    "floor_ms",
    "holder",
    "layout",
    "marker_checkpoint",
    "memory_available",
    "memory_needed",
    "meta_holder",
    "pattern",
    "peer_attach",
    "plan_sizes",
    "publish_synthetic",
    "real_checkpoint",
    "report_path",
    "run",
    "sizes_that_fit",
    "stats",
]


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "holder":
        holder(sys.argv[2])
    else:
        raise SystemExit("usage: python -m weightcache.tools.bench holder SPEC (use `weightcache bench`)")

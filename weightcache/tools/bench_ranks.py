"""``weightcache bench --ranks N``: a tensor-parallel restart, n rank processes attaching from one keeper at once.

An engine spanning n GPUs (tensor parallel n) restarts as n rank processes, which all ask the host's one keeper for
their shards at the same moment. This benchmark reproduces that with synthetic shards, one private keeper and fresh
processes, for each n of ``--ranks`` (default: every visible GPU; on the CPU 2):

1. **publish**: n rank processes, started together, each fill their own shard (``layout`` and ``pattern`` of
   :mod:`weightcache.tools.bench_setup`, seeded by rank, so the shards differ) straight into segments and publish
   it under ``Fingerprint.create(checkpoint, parallel={"tp": (rank, n)})``; each reports the checksum of what it
   filled;
2. **rounds** (``--repeat``, fresh processes every time, side by side): one rank alone (rank ``k mod n`` in round
   k), then all n ranks together. Each attaches with ``weightcache.attach(model, checkpoint, mode="client",
   parallel={"tp": (rank, n)}, strict=True)`` into a model built on the meta device and checks the bits it got
   against the checksum its publisher filled. Reported: each rank's attach time, the slowest of the n per round
   against the one alone (goal: within 1.5x, medians over the rounds), the CPU time each rank's process spent in
   its attach (when the wall time grows and this does not, the ranks waited for a CPU or for the keeper), how far
   apart the n attaches started (skew), and the keeper's CPU time per attach (utime + stime of the keeper process,
   from ``/proc/<pid>/stat``, before and after each round, in clock ticks: the per-attach figure is the sum over
   all rounds divided by the attaches);
3. **keeper kill**: n fresh ranks attach and hold their shards; the keeper is SIGKILLed and a new one started; each
   holder re-publishes its shard (:mod:`weightcache.republish`: its fds, no copy), and n new rank processes attach
   every shard from the cache.

"Together" means a real barrier: every rank process imports torch, initialises CUDA, builds its model on the meta
device and imports weightcache (timed, reported as ``import``), says it is ready, then blocks reading a pipe
that the parent closes once all n are ready: all n wake at once and attach. The barrier sits right before the
attach so that the n attaches reach the keeper at the same moment (the keeper's worst case; in a real restart the
ranks' imports spread them out somewhat). A second gate, opened once every rank has attached, holds back what
comes after (the checksum, its imports), so that nothing but attaches runs while the n are timed.

Each rank sees only its GPU (``CUDA_VISIBLE_DEVICES`` set to the UUID of visible GPU ``rank mod G``) and calls it
``cuda:0``. With more ranks than GPUs ranks share GPUs: that measures the keeper serving n ranks at once, not n
GPUs, and the report says so. On the CPU the ranks see no GPU (``CUDA_VISIBLE_DEVICES`` empty) and their shards
are memfds.

This module plans and measures the configurations (:func:`run`, :func:`measure`, :func:`keeper_kill`). The rank
processes, their barrier and the keeper seen from outside are :mod:`weightcache.tools.bench_ranks_processes`'s, the
text and JSON report :mod:`weightcache.tools.bench_ranks_report`'s; their names are re-exported here, so each keeps
its old import path. Layer L5 (a tool).
"""

from __future__ import annotations

import json
import math
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
from weightcache.units import format_bytes

from .bench_ranks_processes import (
    RANK,
    REPUBLISH_TIMEOUT_S,
    RankGroup,
    cpu_seconds,
    keeper_pid,
    kill_keeper,
    leased,
    process_gone,
    rank_env,
    rank_spec,
    run_ranks,
    visible_gpus,
)
from .bench_ranks_processes import RANK_TIMEOUT_S as RANK_TIMEOUT_S  # re-exported: the old path
from .bench_ranks_processes import TAG as TAG  # re-exported: the old path
from .bench_ranks_processes import Role as Role  # re-exported: the old path
from .bench_ranks_report import GOAL_RATIO, lines, make_report, row_ok
from .bench_report import report_path, stats
from .bench_setup import (
    CPU_SEGMENT_BYTES,
    CUDA_SEGMENT_BYTES,
    DEFAULT_REPEAT,
    DEFAULT_TENSORS,
    GPU_HEADROOM,
    layout,
    marker_checkpoint,
    memory_available,
    memory_needed,
)

#: Ranks on the CPU without ``--ranks N`` (on CUDA: one per visible GPU).
DEFAULT_CPU_RANKS = 2
#: Size of each rank's shard without ``--sizes``, in GiB.
DEFAULT_SIZES_GIB = (1.0,)
#: Pause after a round's processes exited before the keeper's CPU time is read again: the keeper notices the
#: closed lease connections and releases the leases asynchronously.
SETTLE_S = 0.05


def plan_ranks(ranks: Sequence[int] | None, device: str, gpus: Sequence[str]) -> list[int]:
    """The rank counts to run: ``ranks`` as given, else one per visible GPU on CUDA and
    :data:`DEFAULT_CPU_RANKS` on the CPU. WeightCacheError for a count below 1, or CUDA without a GPU."""
    if device.startswith("cuda") and not gpus:
        raise wc.WeightCacheError(f"--device {device}: this process sees no GPU; give --device cpu")
    planned = list(ranks) if ranks else [len(gpus) if device.startswith("cuda") else DEFAULT_CPU_RANKS]
    bad = [n for n in planned if n < 1]
    if bad:
        raise wc.WeightCacheError(f"--ranks takes counts of 1 or more, e.g. --ranks 1,2,8; found {bad[0]}")
    return planned


def per_device(n: int, gpus: Sequence[str]) -> int:
    """How many of ``n`` ranks share the busiest device: ranks go round the GPUs; on the CPU all share it."""
    return math.ceil(n / len(gpus)) if gpus else n


def check_memory(sizes: Sequence[float], ranks: Sequence[int], device: str, gpus: Sequence[str]) -> None:
    """WeightCacheError, before anything is written, when the shards (and on a GPU one CUDA context per rank)
    of the largest configuration do not fit in the memory ``device`` has free (on CUDA: GPU 0's, taken as every
    GPU's)."""
    available = memory_available(device)
    for n in ranks:
        for gib in sizes:
            share = per_device(n, gpus)
            needed = memory_needed(gib * share, device)
            if device.startswith("cuda"):
                needed += (share - 1) * GPU_HEADROOM
            if needed > available:
                raise wc.WeightCacheError(
                    f"--ranks {n} with --sizes {gib:g}: {share} shards of {gib:g} GiB on one device need about "
                    f"{format_bytes(needed)} of memory; {device} has {format_bytes(available)} available. Give "
                    "smaller --sizes or fewer --ranks"
                )


def _identical(runs: Sequence[dict[str, Any]], expected: dict[int, str]) -> bool:
    return all(r["checksum"] == expected[r["rank"]] and r.get("source", "cache") == "cache" for r in runs)


def _round(runs: list[dict[str, Any]], cpu_s: float) -> dict[str, Any]:
    go = [r["go_at"] for r in runs]
    return {
        "runs": runs,
        "slowest_ms": round(max(r["attach_ms"] for r in runs), 3),
        "skew_ms": round((max(go) - min(go)) * 1e3, 3),
        "span_ms": round((max(r["done_at"] for r in runs) - min(go)) * 1e3, 3),
        "keeper_cpu_ms": round(cpu_s * 1e3, 1),
    }


def _attach_round(
    socket_dir: Path, size: int, spec: dict[str, Any], gpus: Sequence[str], ranks: Sequence[int] | None
) -> dict[str, Any]:
    """One round of fresh rank processes attaching together, with the keeper's CPU time around it."""
    pid = keeper_pid(socket_dir)
    before = cpu_seconds(pid)
    runs = run_ranks("attach", size, spec, gpus, ranks=ranks)
    time.sleep(SETTLE_S)
    return _round(runs, cpu_seconds(pid) - before)


def keeper_kill(
    socket_dir: Path, size: int, spec: dict[str, Any], gpus: Sequence[str], expected: dict[int, str]
) -> dict[str, Any]:
    """n fresh ranks attach and hold their shards; the keeper is SIGKILLed and a new one spawned; once every
    holder has re-published its shard, n new ranks attach them all. Returns the times (``keeper_start_s``: the new
    keeper serving; ``republish_s``: every shard leased again, both from the start of the restart; the new ranks'
    attaches) and whether every rank, old and new, saw its publisher's bits from the cache."""
    with RankGroup("attach", size, spec, gpus, hold=True) as holders:
        held = holders.release()
        old = kill_keeper(socket_dir)
        t0 = time.perf_counter()
        wc.Cache(socket_dir, spawn=True)  # a new keeper (detached), as a supervisor would restart it
        t1 = time.perf_counter()
        deadline = time.monotonic() + REPUBLISH_TIMEOUT_S
        while not (republished := leased(socket_dir, held)) and time.monotonic() < deadline:
            time.sleep(0.01)
        t2 = time.perf_counter()
        again = run_ranks("attach", size, spec, gpus) if republished else []
        checks = holders.check()
    return {
        "holders": size,
        "killed_pid": old,
        "keeper_pid": keeper_pid(socket_dir),
        "keeper_start_s": round(t1 - t0, 3),
        "republished": republished,
        "republish_s": round(t2 - t0, 3),
        "attach_ms": stats(again, "attach_ms") if again else None,
        "sources": [r["source"] for r in again],
        "holders_leased": all(c["leased"] for c in checks),
        "identical": republished
        and _identical(held, expected)
        and _identical(again, expected)
        and all(c["checksum"] == expected[c["rank"]] for c in checks),
    }


def measure(
    socket_dir: Path,
    tmp: Path,
    device: str,
    gpus: Sequence[str],
    n: int,
    gib: float,
    tensors: int,
    dtype_name: str,
    repeat: int,
    segment_bytes: int,
    kill: bool = True,
) -> dict[str, Any]:
    """One configuration: n ranks publish their shards of ``gib`` GiB and ``tensors`` tensors together; then
    ``repeat`` rounds of one rank alone and all n together, in fresh processes; then (``kill``) the keeper kill.
    Returns the row of the report (see the module docstring); the entries are evicted afterwards."""
    itemsize = torch.empty(0, dtype=getattr(torch, dtype_name)).element_size()
    shapes = layout(int(gib * 2**30), tensors, itemsize)
    marker = marker_checkpoint(tmp, gib, tensors, dtype_name)
    spec = rank_spec(marker, socket_dir, device, dtype_name, shapes, segment_bytes)
    t0 = time.perf_counter()
    published = run_ranks("publish", n, spec, gpus)
    publish_s = time.perf_counter() - t0
    expected = {p["rank"]: p["checksum"] for p in published}
    run_ranks("attach", n, spec, gpus, ranks=[0])  # untimed: writes the .pyc files an installed package has
    alone, together = [], []
    for k in range(repeat):  # side by side: one alone, then all together, each round
        alone.append(_attach_round(socket_dir, n, spec, gpus, [k % n]))
        together.append(_attach_round(socket_dir, n, spec, gpus, None))
    all_runs = [r for t in together for r in t["runs"]]
    alone_runs = [r for a in alone for r in a["runs"]]
    row: dict[str, Any] = {
        "ranks": n,
        "gpus": len(gpus),
        "ranks_per_device": per_device(n, gpus),
        "shared_gpu": bool(gpus) and n > len(gpus),
        "gib": gib,
        "tensors": tensors,
        "bytes": published[0]["bytes"],
        "segments": published[0]["segments"],
        "publish_s": round(publish_s, 3),
        "shards_differ": len(set(expected.values())) == n,
        "alone": {
            "attach_ms": stats(alone_runs, "attach_ms"),
            "attach_cpu_ms": stats(alone_runs, "attach_cpu_ms"),
            "import_ms": stats(alone_runs, "import_ms"),
        },
        "together": {
            "attach_ms": stats(all_runs, "attach_ms"),
            "attach_cpu_ms": stats(all_runs, "attach_cpu_ms"),
            "import_ms": stats(all_runs, "import_ms"),
            "slowest_ms": stats(together, "slowest_ms"),
            "skew_ms": stats(together, "skew_ms"),
            "span_ms": stats(together, "span_ms"),
        },
        "per_rank": [
            {
                "rank": r,
                "attach_ms": stats([x for x in all_runs if x["rank"] == r], "attach_ms"),
                "attach_cpu_ms": stats([x for x in all_runs if x["rank"] == r], "attach_cpu_ms"),
                "import_ms": stats([x for x in all_runs if x["rank"] == r], "import_ms"),
            }
            for r in range(n)
        ],
    }
    ratio = row["together"]["slowest_ms"]["median"] / row["alone"]["attach_ms"]["median"]
    row["slowest_over_alone"] = round(ratio, 3)
    row["goal_ratio"] = GOAL_RATIO
    row["goal_met"] = ratio <= GOAL_RATIO
    tick_ms = 1e3 / os.sysconf("SC_CLK_TCK")
    row["keeper"] = {
        "cpu_ms_per_attach": round(sum(t["keeper_cpu_ms"] for t in together) / len(all_runs), 3),
        "alone_cpu_ms_per_attach": round(sum(a["keeper_cpu_ms"] for a in alone) / len(alone_runs), 3),
        "tick_ms": tick_ms,
        "cpu_ms_per_round": [t["keeper_cpu_ms"] for t in together],
    }
    row["identical"] = _identical(all_runs + alone_runs, expected) and row["shards_differ"]
    if kill:
        row["keeper_kill"] = keeper_kill(socket_dir, n, spec, gpus, expected)
    row["published"] = published
    row["alone"]["rounds"] = alone
    row["together"]["rounds"] = together
    cache = wc.Cache(socket_dir)
    for p in published:
        cache.evict(f"{p['digest']}@{p['placement']}", force=True)
    return row


def run(
    *,
    ranks: Sequence[int] | None = None,
    device: str = "cpu",
    sizes: Sequence[float] | None = None,
    tensors: Sequence[int] | None = None,
    repeat: int = DEFAULT_REPEAT,
    dtype: str = "bfloat16",
    json_out: str | os.PathLike[str] | None = None,
    segment_gib: float | None = None,
    kill: bool = True,
) -> int:
    """For each rank count of ``ranks`` (default: every visible GPU on CUDA, 2 on the CPU), shard size (GiB per
    rank) of ``sizes`` (default 1) and tensor count of ``tensors`` (default 3000), measure n ranks attaching from
    one private keeper at once against one alone, over ``repeat`` rounds of fresh processes, then (``kill``) the
    keeper kill and re-publication (see the module docstring). Prints the report and writes it to ``json_out``
    (after every configuration) when given. Refused before any work: a device this process lacks, shards that do
    not fit. Returns 0 when every rank saw its publisher's bits from the cache, and every shard came back after
    the keeper kill; else 1."""
    placement_of(device)  # InvalidArgument for a device this process lacks, before any work
    report_path(json_out)
    gpus = visible_gpus(device)
    counts = plan_ranks(ranks, device, gpus)
    sizes = list(sizes or DEFAULT_SIZES_GIB)
    check_memory(sizes, counts, device, gpus)
    if repeat < 1:
        raise wc.WeightCacheError(f"--repeat takes 1 or more rounds; found {repeat}")
    if sys.flags.dont_write_bytecode:
        print(
            "note: PYTHONDONTWRITEBYTECODE is set: modules without a cached .pyc are compiled at every import, "
            "so the attach column includes compiling what the attach imports",
            file=sys.stderr,
        )
    segment_bytes = CUDA_SEGMENT_BYTES if device.startswith("cuda") else CPU_SEGMENT_BYTES
    if segment_gib is not None:
        segment_bytes = int(segment_gib * 2**30)
    for n in counts:
        if gpus and n > len(gpus):
            print(
                f"note: {n} ranks share {len(gpus)} GPU(s) (rank r uses GPU r mod {len(gpus)}): this measures one "
                f"keeper serving {n} ranks at once, not {n} GPUs",
                flush=True,
            )
    tmp = Path(tempfile.mkdtemp(prefix="wc-ranks-"))
    socket_dir = tmp / "sock"
    cache = wc.Cache(socket_dir, spawn=True)  # the private keeper
    results: list[dict[str, Any]] = []
    try:
        for n in counts:
            for count in tensors or DEFAULT_TENSORS:
                for gib in sizes:
                    row = measure(socket_dir, tmp, device, gpus, n, gib, count, dtype, repeat, segment_bytes, kill)
                    results.append(row)
                    print("\n".join(lines(row)), flush=True)
                    if json_out:
                        Path(json_out).write_text(json.dumps(make_report(device, gpus, results), indent=2))
    finally:
        cache.stop(wait=30)  # the keeper of the moment (a new one after a keeper kill)
        shutil.rmtree(tmp, ignore_errors=True)
    if json_out:
        Path(json_out).write_text(json.dumps(make_report(device, gpus, results), indent=2))
        print(f"wrote {json_out}")
    return 0 if all(row_ok(r) for r in results) else 1


__all__ = [
    "RANK",
    "RankGroup",
    "check_memory",
    "cpu_seconds",
    "keeper_kill",
    "keeper_pid",
    "kill_keeper",
    "leased",
    "lines",
    "measure",
    "plan_ranks",
    "process_gone",
    "rank_env",
    "rank_spec",
    "run",
    "run_ranks",
    "visible_gpus",
]

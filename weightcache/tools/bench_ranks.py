"""``weightcache bench --ranks N``: a tensor-parallel restart, n rank processes attaching from one keeper at once.

An engine spanning n GPUs (tensor parallel n) restarts as n rank processes, which all ask the host's one keeper for
their shards at the same moment. This benchmark reproduces that with synthetic shards, one private keeper and fresh
processes, for each n of ``--ranks`` (default: every visible GPU; on the CPU 2):

1. **publish**: n rank processes, started together, each fill their own shard (``layout`` and ``pattern`` of
   :mod:`weightcache.tools.bench`, seeded by rank, so the shards differ) straight into segments and publish it under
   ``Fingerprint.create(checkpoint, parallel={"tp": (rank, n)})``; each reports the checksum of what it filled;
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
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import platform
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import IO, Any, Literal

import torch

import weightcache as wc
from weightcache.fingerprint import placement_of
from weightcache.units import format_bytes

from .bench_processes import START
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
#: The goal: the slowest of n ranks attaching together within this factor of one rank alone (medians).
GOAL_RATIO = 1.5
#: Longest a rank process may take to become ready, or to finish once released, before it is killed.
RANK_TIMEOUT_S = 600.0
#: Longest the holders may take to re-publish their shards to a restarted keeper (they retry at most every 1 s).
REPUBLISH_TIMEOUT_S = 60.0
#: Pause after a round's processes exited before the keeper's CPU time is read again: the keeper notices the
#: closed lease connections and releases the leases asynchronously.
SETTLE_S = 0.05
#: What a rank process prefixes its report lines with (anything else on its stdout is not ours).
TAG = "WCRANK "

Role = Literal["publish", "attach"]

# A rank process: START (torch, CUDA, the model on meta) and weightcache imported, then the barrier, then the work.
# A rank process: START (torch, CUDA, the model on meta) and weightcache imported, then the barrier (gate 0), then
# the work. Once every rank has reported its work done, gate 1 opens and each checks the bits it got: checking
# (imports, a pass over every tensor) never lands inside another rank's attach.
RANK = (
    START
    + r"""
import os
t0 = time.perf_counter()
import weightcache as wc
t1 = time.perf_counter()
if spec["role"] == "publish":
    from weightcache.tools.bench import publish_synthetic
rank, size, shapes = spec["rank"], spec["size"], spec["shapes"]
parallel = {"tp": (rank, size)}
def say(what, **fields):
    print("WCRANK " + json.dumps({"what": what, "rank": rank, **fields}), flush=True)
ready_at = time.monotonic()
say("ready", ready_at=ready_at)
os.read(spec["gates"][0], 1)  # b"" once the parent closes the gate's write end: every rank wakes at once
go_at = time.monotonic()
if spec["role"] == "publish":
    cache = wc.Cache(spec["socket_dir"])
    t2 = time.perf_counter()
    fp = wc.Fingerprint.create(spec["checkpoint"], device=torch.device(device), parallel=parallel)
    total, nseg, sums = publish_synthetic(
        cache, fp, shapes, dtype, device, spec["segment_bytes"], seed=rank * len(shapes)
    )
    t3 = time.perf_counter()
    done_at = time.monotonic()
    result = {"publish_ms": (t3 - t2) * 1e3, "bytes": total, "segments": nseg}
else:
    c2 = time.process_time()
    t2 = time.perf_counter()
    handle = wc.attach(
        model, spec["checkpoint"], mode="client", device=device, parallel=parallel, socket_dir=spec["socket_dir"],
        strict=True,
    )
    if device.startswith("cuda"):
        torch.cuda.synchronize(device)
    t3 = time.perf_counter()
    c3 = time.process_time()
    done_at = time.monotonic()
    result = {"attach_ms": (t3 - t2) * 1e3, "attach_cpu_ms": (c3 - c2) * 1e3, "source": handle.source}
say("done", done_at=done_at, **result)
os.read(spec["gates"][1], 1)  # every rank is done
from weightcache.tools.bench import checksum
if spec["role"] == "publish":
    handle = cache.get(fp) if spec["hold"] else None
    held = [handle.tensors[f"p{i}"] for i in range(len(shapes))] if handle is not None else []
else:
    fp = handle.fingerprint
    held = list(model.parameters())
    sums = checksum(held)
say(
    "checked", checksum=sums, digest=fp.digest, placement=fp.placement, parallel=[list(p) for p in fp.parallel],
    pid=os.getpid(), visible=os.environ.get("CUDA_VISIBLE_DEVICES"), ready_at=ready_at, go_at=go_at,
    python_ms=(t_torch - t_start) * 1e3, cuda_init_ms=(t_cuda - t_torch) * 1e3, import_ms=(t1 - t0) * 1e3,
)
if spec["hold"]:
    for _ in sys.stdin:  # one line: check again; end of input: let go
        say("check", checksum=checksum(held), leased=handle.leased)
if handle is not None:
    handle.close()
"""
)


def visible_gpus(device: str) -> list[str]:
    """``GPU-<uuid>`` of every GPU this process sees when ``device`` is a CUDA device (what a rank's
    ``CUDA_VISIBLE_DEVICES`` names, so that it means the same GPU whatever this process's own setting); [] on
    the CPU."""
    if not device.startswith("cuda"):
        return []
    return [f"GPU-{torch.cuda.get_device_properties(i).uuid}" for i in range(torch.cuda.device_count())]


def rank_env(rank: int, gpus: Sequence[str]) -> dict[str, str]:
    """The environment of rank ``rank``'s process: this one's, seeing only GPU ``rank mod len(gpus)``, or no GPU
    when ``gpus`` is empty."""
    return {**os.environ, "CUDA_VISIBLE_DEVICES": gpus[rank % len(gpus)] if gpus else ""}


def rank_spec(
    checkpoint: str | os.PathLike[str],
    socket_dir: str | os.PathLike[str],
    device: str,
    dtype_name: str,
    shapes: list[int],
    segment_bytes: int = CPU_SEGMENT_BYTES,
) -> dict[str, Any]:
    """What every rank process of one configuration is told: the checkpoint its fingerprint names, the keeper's
    socket directory, its device as it sees it (``cpu`` or ``cuda:0``: each rank sees only its GPU), and the
    shard's dtype, tensor sizes (elements) and largest segment."""
    return {
        "checkpoint": str(checkpoint),
        "socket_dir": str(socket_dir),
        "device": "cuda:0" if device.startswith("cuda") else "cpu",
        "dtype": dtype_name,
        "shapes": shapes,
        "segment_bytes": segment_bytes,
    }


class RankGroup:
    """Rank processes that start together: one per rank of ``ranks`` (default all ``size``), each its own fresh
    Python with its own ``CUDA_VISIBLE_DEVICES`` (:func:`rank_env`), publishing (``role="publish"``) or attaching
    (``"attach"``) its shard of ``parallel={"tp": (rank, size)}``.

    Constructing the group starts the processes and returns once every one of them is ready (torch imported,
    CUDA initialised, model built on meta, weightcache imported): :attr:`ready` holds their ready reports.
    :meth:`release` lets them all go at once and returns their results. With ``hold`` they then keep their
    Handles (leases) until :meth:`close`, and :meth:`check` has each recompute its checksum. A process that fails
    or exceeds ``timeout`` seconds raises WeightCacheError with its stderr. Use it as a context manager.
    """

    def __init__(
        self,
        role: Role,
        size: int,
        spec: dict[str, Any],
        gpus: Sequence[str],
        *,
        ranks: Sequence[int] | None = None,
        hold: bool = False,
        timeout: float = RANK_TIMEOUT_S,
    ) -> None:
        self.role = role
        self.ranks = list(range(size)) if ranks is None else list(ranks)
        self.hold = hold
        self.timeout = timeout
        self.ready: list[dict[str, Any]] = []
        self._procs: list[subprocess.Popen[str]] = []
        self._errors: list[IO[str]] = []
        self._files = contextlib.ExitStack()  # the stderr files: they live as long as the group
        self._timed_out = False
        self._released = False
        #: The barriers: the rank processes block reading each pipe until its write end here is closed.
        gates = [os.pipe(), os.pipe()]
        reads = [r for r, _ in gates]
        self._gates: list[int | None] = [w for _, w in gates]
        try:
            for rank in self.ranks:
                err = self._files.enter_context(tempfile.TemporaryFile(mode="w+"))  # noqa: SIM115 (closed by close())
                self._errors.append(err)
                child = {**spec, "role": role, "rank": rank, "size": size, "hold": hold, "gates": reads}
                self._procs.append(
                    subprocess.Popen(
                        [sys.executable, "-c", RANK, json.dumps(child)],
                        pass_fds=reads,
                        stdin=subprocess.PIPE if hold else subprocess.DEVNULL,
                        stdout=subprocess.PIPE,
                        stderr=err,
                        text=True,
                        env=rank_env(rank, gpus),
                    )
                )
            self.ready = self._collect("ready")
        except BaseException:
            self.close()
            raise
        finally:
            for fd in reads:  # the children hold them now
                os.close(fd)

    def release(self) -> list[dict[str, Any]]:
        """Let every rank go at once (open the first gate); once all have done their work, let them check it (the
        second gate); return their results, in rank order; without ``hold``, once each process has exited
        cleanly."""
        self._open(0)
        self._released = True
        done = self._collect("done")
        self._open(1)
        results = [{**d, **c} for d, c in zip(done, self._collect("checked"))]
        for r in results:
            del r["what"]
        if not self.hold:
            for i, proc in enumerate(self._procs):
                try:
                    status = proc.wait(self.timeout)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    status = proc.wait()
                if status != 0:
                    raise self._failure(i, f"exit status {status} after its report")
        return results

    def check(self) -> list[dict[str, Any]]:
        """Holders only: each recomputes the checksum of the tensors it holds and says whether its Handle holds a
        lease in the keeper now (``checksum``, ``leased``), in rank order."""
        for proc in self._procs:
            assert proc.stdin is not None
            proc.stdin.write("check\n")
            proc.stdin.flush()
        return self._collect("check")

    @property
    def pids(self) -> list[int]:
        """The rank processes' pids, in rank order."""
        return [proc.pid for proc in self._procs]

    def close(self) -> None:
        """Let go: close the holders' input and wait for every process (killing any that lingers). Processes
        never released are killed, not released: they did nothing yet."""
        if not self._released:
            self._kill_all()
        self._open(0)
        self._open(1)
        for proc in self._procs:
            if proc.stdin is not None and not proc.stdin.closed:
                try:
                    proc.stdin.close()
                except BrokenPipeError:
                    pass
        for proc in self._procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
            if proc.stdout is not None:
                proc.stdout.close()
        self._errors = []
        self._files.close()

    def __enter__(self) -> RankGroup:
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        self.close()

    def _open(self, gate: int) -> None:
        fd = self._gates[gate]
        if fd is not None:
            os.close(fd)
            self._gates[gate] = None

    def _expire(self) -> None:
        self._timed_out = True
        self._kill_all()

    def _kill_all(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()

    def _collect(self, what: str) -> list[dict[str, Any]]:
        """Each process's next report, which must be ``what``; a watchdog kills them all after ``timeout``."""
        watchdog = threading.Timer(self.timeout, self._expire)
        watchdog.start()
        try:
            return [self._report(i, what) for i in range(len(self._procs))]
        finally:
            watchdog.cancel()

    def _report(self, i: int, what: str) -> dict[str, Any]:
        stdout = self._procs[i].stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith(TAG):
                report: dict[str, Any] = json.loads(line[len(TAG) :])
                if report["what"] != what:
                    raise self._failure(i, f"said {report['what']!r} where {what!r} was expected")
                return report
        status = self._procs[i].wait()
        why = f"timed out after {self.timeout:g} s" if self._timed_out else f"exit status {status}"
        raise self._failure(i, f"{why} before saying {what!r}")

    def _failure(self, i: int, why: str) -> wc.WeightCacheError:
        err = self._errors[i] if i < len(self._errors) else None
        text = ""
        if err is not None:
            err.seek(0)
            text = err.read()[-4000:]
        return wc.WeightCacheError(f"rank {self.ranks[i]} ({self.role}) failed: {why}:\n{text}")


def run_ranks(
    role: Role, size: int, spec: dict[str, Any], gpus: Sequence[str], *, ranks: Sequence[int] | None = None
) -> list[dict[str, Any]]:
    """Start the ranks (default all ``size``) together as a :class:`RankGroup`, release them at once and return
    their results in rank order, once every process has exited."""
    with RankGroup(role, size, spec, gpus, ranks=ranks) as group:
        return group.release()


def keeper_pid(socket_dir: str | os.PathLike[str]) -> int:
    """The pid of the keeper serving ``socket_dir`` (its own answer to ``list``)."""
    pid = wc.Cache(socket_dir).keeper_info()["pid"]
    assert isinstance(pid, int)
    return pid


def cpu_seconds(pid: int) -> float:
    """CPU time process ``pid`` (all its threads, living or gone) has used: utime + stime of ``/proc/<pid>/stat``,
    in seconds, with the resolution of one clock tick (usually 10 ms)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie not reaped yet counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return True
    return state in ("Z", "X")


def kill_keeper(socket_dir: str | os.PathLike[str], timeout: float = 10.0) -> int:
    """SIGKILL the keeper serving ``socket_dir`` and wait until it is gone; returns its pid."""
    pid = keeper_pid(socket_dir)
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + timeout
    while not process_gone(pid):
        if time.monotonic() > deadline:
            raise wc.WeightCacheError(f"the keeper (pid {pid}) still runs {timeout:g} s after SIGKILL")
        time.sleep(0.01)
    return pid


def leased(socket_dir: str | os.PathLike[str], shards: Sequence[dict[str, Any]]) -> bool:
    """Whether the keeper of ``socket_dir`` holds every shard (``digest`` and ``placement`` of a rank's result)
    with at least one lease; False while no keeper answers."""
    try:
        entries = wc.Cache(socket_dir).entries()
    except wc.KeeperUnavailable:
        return False
    held = {(e.digest, e.placement) for e in entries if e.leases > 0}
    return all((s["digest"], s["placement"]) in held for s in shards)


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


def lines(row: dict[str, Any]) -> list[str]:
    """The report of one configuration as text: the headline, one line per rank, the keeper kill."""
    a, t = row["alone"]["attach_ms"], row["together"]
    where = f"{row['ranks']} ranks"
    if row["gpus"]:
        where += f" on {min(row['ranks'], row['gpus'])} GPU(s)"
        if row["shared_gpu"]:
            where += f" (shared: up to {row['ranks_per_device']} ranks per GPU: the keeper's concurrency, not the"
            where += f" {row['ranks']}-GPU case)"
    else:
        where += " on the CPU"
    k = row["keeper"]
    out = [
        f"{where} | {row['gib']:g} GiB and {row['tensors']} tensors per rank, {row['segments']} segments | "
        f"alone {a['median']:.2f} ms ({a['min']:.2f}-{a['max']:.2f}) | together: slowest "
        f"{t['slowest_ms']['median']:.2f} ms ({t['slowest_ms']['min']:.2f}-{t['slowest_ms']['max']:.2f}), "
        f"{row['slowest_over_alone']:.2f}x alone "
        f"(goal {GOAL_RATIO}x: {'met' if row['goal_met'] else 'missed'}), every rank {t['attach_ms']['median']:.2f} "
        f"ms (CPU {t['attach_cpu_ms']['median']:.2f}, alone {row['alone']['attach_cpu_ms']['median']:.2f}), started "
        f"within {t['skew_ms']['median']:.2f} ms | keeper CPU {k['cpu_ms_per_attach']:.2f} ms per attach "
        f"(alone {k['alone_cpu_ms_per_attach']:.2f}; ticks of {k['tick_ms']:g} ms) | identical {row['identical']}"
    ]
    for r in row["per_rank"]:
        ra, ri = r["attach_ms"], r["import_ms"]
        out.append(
            f"    rank {r['rank']}: attach {ra['median']:.2f} ms ({ra['min']:.2f}-{ra['max']:.2f}; CPU "
            f"{r['attach_cpu_ms']['median']:.2f}), import {ri['median']:.1f} ms"
        )
    kk = row.get("keeper_kill")
    if kk is not None:
        tail = f"{kk['attach_ms']['median']:.2f} ms median" if kk["attach_ms"] else "not run"
        back = (
            f"all {kk['holders']} shards re-published {kk['republish_s']:.2f} s after the restart began"
            if kk["republished"]
            else f"NOT every shard re-published within {REPUBLISH_TIMEOUT_S:g} s"
        )
        out.append(
            f"    keeper SIGKILLed under {kk['holders']} holding ranks, a new one serving in "
            f"{kk['keeper_start_s']:.2f} s, {back}; {kk['holders']} new ranks attached from the cache ({tail}) | "
            f"identical {kk['identical']}"
        )
    return out


def _ok(row: dict[str, Any]) -> bool:
    kk = row.get("keeper_kill")
    return bool(row["identical"] and (kk is None or (kk["identical"] and kk["holders_leased"])))


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
                        Path(json_out).write_text(json.dumps(_report(device, gpus, results), indent=2))
    finally:
        cache.stop(wait=30)  # the keeper of the moment (a new one after a keeper kill)
        shutil.rmtree(tmp, ignore_errors=True)
    if json_out:
        Path(json_out).write_text(json.dumps(_report(device, gpus, results), indent=2))
        print(f"wrote {json_out}")
    return 0 if all(_ok(r) for r in results) else 1


def _report(device: str, gpus: Sequence[str], results: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": device,
        "device_name": torch.cuda.get_device_name(device) if device.startswith("cuda") else "cpu",
        "gpus": list(gpus),
        "host": platform.node(),
        "cpu": platform.processor() or platform.machine(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "weightcache": wc.__version__,
        "command": "weightcache bench " + " ".join(sys.argv[2:]),
        "goal_ratio": GOAL_RATIO,
        "results": results,
    }


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

"""``weightcache bench --ranks``'s processes: n rank processes started together behind a real barrier, and the
keeper seen from outside (its pid, its CPU time, its SIGKILL, its leases).

:data:`RANK` is a rank process's script: :data:`~weightcache.tools.bench_processes.START`, weightcache imported,
then gate 0 (a pipe every rank blocks reading until the parent closes its write end: all n wake at once), its work
(publish or attach its shard), gate 1, then the check of the bits it got; it reports on stdout lines tagged
:data:`TAG`. :class:`RankGroup` starts and releases a group of them, each seeing only its GPU (:func:`rank_env`);
:func:`run_ranks` is one group, released once. :func:`keeper_pid`, :func:`cpu_seconds`, :func:`kill_keeper` and
:func:`leased` read and kill the keeper a configuration runs against.

Layer L5 (a tool). Starts and watches processes only: what a configuration measures is
:mod:`weightcache.tools.bench_ranks`'s, which re-exports these names, and its text and JSON report
:mod:`weightcache.tools.bench_ranks_report`'s.
"""

from __future__ import annotations

import contextlib
import json
import os
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

from .bench_processes import START
from .bench_setup import CPU_SEGMENT_BYTES

#: Longest a rank process may take to become ready, or to finish once released, before it is killed.
RANK_TIMEOUT_S = 600.0
#: Longest the holders may take to re-publish their shards to a restarted keeper (they retry at most every 1 s).
REPUBLISH_TIMEOUT_S = 60.0


#: What a rank process prefixes its report lines with (anything else on its stdout is not ours).
TAG = "WCRANK "

Role = Literal["publish", "attach"]


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


__all__ = [
    "RANK",
    "RANK_TIMEOUT_S",
    "REPUBLISH_TIMEOUT_S",
    "TAG",
    "RankGroup",
    "Role",
    "cpu_seconds",
    "keeper_pid",
    "kill_keeper",
    "leased",
    "process_gone",
    "rank_env",
    "rank_spec",
    "run_ranks",
    "visible_gpus",
]

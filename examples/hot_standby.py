"""A hot standby takes over the instant its primary dies, and how long that takes.

The primary engine attaches the weights in mode "daemon" (the first one loads and publishes them) and serves a
request every few milliseconds. The hot standby attaches the same entry in mode "client", builds and warms its
model with one forward pass, then waits for leadership (weightcache.Leadership: a flock in the keeper's socket
directory; the kernel releases a dead process's flock and wakes the waiter, so nothing polls). The example
SIGKILLs the primary and measures the takeover: from the kill to the standby's first forward result (finished
on the host). CLOCK_MONOTONIC (time.monotonic) is one clock for every process on a Linux host, so the parent's
kill time and the standby's result time compare directly.

For comparison, in the same run:
- cold attach: the leader is killed and a fresh process starts, attaches in mode client and runs its first
  forward pass (what a supervisor restarting the engine gets from weightcache);
- disk (unless --no-disk): the same with mode "off", from the checkpoint with its page cache dropped (what a
  restart costs without weightcache).

Each repetition uses a fresh primary and standby. The weights stay resident throughout: the keeper is a
detached process (spawned by the first primary, in its own session) and the standby holds a lease. The keeper
and its socket directory live in a temporary directory, removed at the end. Engines end when this script does,
however it ends: each exits when its stdin, a pipe from this script, closes.

    python examples/hot_standby.py [--device cpu|cuda:N] [--size-mib 64] [--repeat 3] [--threads 1] [--no-disk] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import torch
from toymodel import make_checkpoint, meta_model, request, run

import weightcache as wc
from weightcache.checkpoint import drop_page_cache

LEADERSHIP = "toy-model"  # the name primary and standbys compete for


def say(**event: Any) -> None:
    print(json.dumps(event), flush=True)


def exit_with_parent() -> None:
    """End this process as soon as the script that started it is gone (its end of our stdin closes), whatever
    the engine is doing then: serving, or blocked in the kernel in Leadership.acquire()."""

    def watch() -> None:
        sys.stdin.read()  # the parent never writes: this returns at EOF
        os._exit(0)

    threading.Thread(target=watch, daemon=True).start()


def engine(role: str, checkpoint: str, socket_dir: str, device: str, threads: str) -> None:
    """One engine process. primary: lead at once, serve. standby: attach and warm, then wait to lead.
    cold / disk: a restarted engine (mode client / off) that leads as soon as it starts."""
    t_start = time.monotonic()  # Python has started and imported torch and weightcache
    exit_with_parent()
    torch.set_num_threads(int(threads))
    dev = torch.device(device)
    leader = wc.Leadership(LEADERSHIP, socket_dir=socket_dir)
    model = meta_model(checkpoint)
    x = request(checkpoint, dev)
    if role == "standby":
        handle = wc.attach(model, checkpoint, mode="client", device=dev, strict=True, socket_dir=socket_dir)
        output = run(model, x)  # the warm-up: the first forward pass happens here
        t0 = time.monotonic()
        run(model, x)
        say(event="warm", output=output, source=handle.source, forward_ms=(time.monotonic() - t0) * 1e3)
        leader.acquire()  # blocks in the kernel until the primary is gone
        t_acquired = time.monotonic()
        output = run(model, x)
        say(event="leader", t_acquired=t_acquired, t_result=time.monotonic(), output=output)
    else:  # attach first (mode daemon starts the keeper, whose directory holds the lock), then lead
        mode = {"primary": "daemon", "cold": "client", "disk": "off"}[role]
        handle = wc.attach(model, checkpoint, mode=mode, device=dev, strict=True, socket_dir=socket_dir)  # type: ignore[arg-type]
        t_attached = time.monotonic()
        leader.acquire()
        t_acquired = time.monotonic()
        output = run(model, x)
        t_result = time.monotonic()
        say(
            event="leader",
            source=handle.source,
            output=output,
            t_start=t_start,
            t_attached=t_attached,
            t_acquired=t_acquired,
            t_result=t_result,
        )
    while True:  # serve until killed (or the parent is gone), holding the lease (the handle) and the leadership
        run(model, x)
        time.sleep(0.01)


class Engine:
    def __init__(self, role: str, checkpoint: Path, socket_dir: Path, device: str, threads: int) -> None:
        self.role = role
        cmd = [sys.executable, __file__, "--engine", role, str(checkpoint), str(socket_dir), device, str(threads)]
        # stdin: a pipe that closes when this script ends, however it ends (see exit_with_parent)
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)

    def event(self, expected: str) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"{self.role} engine failed (exit code {self.proc.wait()}); see its stderr")
        event: dict[str, Any] = json.loads(line)
        assert event["event"] == expected, event
        return event

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.kill(self.proc.pid, signal.SIGKILL)
        self.proc.wait()
        if self.proc.stdin is not None:
            self.proc.stdin.close()


def wait_blocked(leadership: wc.Leadership, pid: int, timeout: float = 60.0) -> None:
    """Wait until ``pid`` sits in the kernel's queue for the leadership lock."""
    deadline = time.monotonic() + timeout
    while pid not in leadership.waiters():
        if time.monotonic() > deadline:
            raise SystemExit(f"the standby (pid {pid}) never blocked on the leadership lock")
        time.sleep(0.005)


def resident(socket_dir: Path) -> list[tuple[str, int]]:
    """The entries the keeper holds: digest and bytes of each."""
    return sorted((e.digest, e.bytes) for e in wc.Cache(socket_dir).entries())


def repetition(checkpoint: Path, socket_dir: Path, device: str, threads: int, disk: bool) -> dict[str, Any]:
    """Primary + standby, kill, takeover; then kill the new leader and restart cold (and from disk)."""
    observer = wc.Leadership(LEADERSHIP, socket_dir=socket_dir)  # only looks at the lock table
    engines: list[Engine] = []
    try:
        primary = Engine("primary", checkpoint, socket_dir, device, threads)
        engines.append(primary)
        served = primary.event("leader")
        standby = Engine("standby", checkpoint, socket_dir, device, threads)
        engines.append(standby)
        warm = standby.event("warm")
        wait_blocked(observer, standby.proc.pid)
        assert observer.holder() == primary.proc.pid
        before = resident(socket_dir)

        t_kill = time.monotonic()
        primary.kill()
        t_reaped = time.monotonic()  # the kernel has torn the primary down (its flock goes with it)
        took = standby.event("leader")
        out: dict[str, Any] = {
            "takeover_ms": (took["t_result"] - t_kill) * 1e3,
            "lock_handover_ms": (took["t_acquired"] - t_kill) * 1e3,
            "standby_forward_ms": (took["t_result"] - took["t_acquired"]) * 1e3,
            "primary_exit_ms": (t_reaped - t_kill) * 1e3,
            "steady_forward_ms": warm["forward_ms"],
            "primary_source": served["source"],
            "standby_source": warm["source"],
            "outputs": {"primary": served["output"], "standby_warm": warm["output"], "standby": took["output"]},
            "entry_resident_after_kill": bool(before) and resident(socket_dir) == before,  # same entries, same sizes
            "new_leader_is_standby": observer.holder() == standby.proc.pid,
        }

        restarts = [("cold", "cold_attach_ms")] + ([("disk", "disk_ms")] if disk else [])
        leader = standby
        for role, key in restarts:
            if role == "disk":
                drop_page_cache(checkpoint)  # a restart from disk really reads the disk
            t_kill = time.monotonic()
            leader.kill()
            leader = Engine(role, checkpoint, socket_dir, device, threads)
            engines.append(leader)
            first = leader.event("leader")
            out[key] = (first["t_result"] - t_kill) * 1e3
            out[f"{role}_phases_ms"] = {  # where a restart's time goes
                "python_and_imports": (first["t_start"] - t_kill) * 1e3,
                "weights": (first["t_attached"] - first["t_start"]) * 1e3,
                "lead_and_forward": (first["t_result"] - first["t_attached"]) * 1e3,
            }
            out["outputs"][role] = first["output"]
            out[f"{role}_source"] = first["source"]
        return out
    finally:
        for e in engines:
            e.kill()


def summary(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    parser.add_argument("--size-mib", type=int, default=64, help="checkpoint size (default 64 MiB)")
    parser.add_argument("--repeat", type=int, default=3, help="repetitions, each with a fresh pair (default 3)")
    parser.add_argument(
        "--threads",
        type=int,
        default=1,
        help="torch threads per engine (default 1: primary and standby share the cores)",
    )
    parser.add_argument("--no-disk", action="store_true", help="skip the restart from disk")
    parser.add_argument("--json", action="store_true", help="print one JSON object of results")
    parser.add_argument(
        "--engine", nargs=5, metavar=("ROLE", "CKPT", "SOCKET_DIR", "DEVICE", "THREADS"), help=argparse.SUPPRESS
    )
    args = parser.parse_args()
    if args.engine:
        engine(*args.engine)
        return 0

    work = Path(tempfile.mkdtemp(prefix="wc-standby-"))
    checkpoint, socket_dir = work / "checkpoint", work / "sock"
    make_checkpoint(checkpoint, args.size_mib)
    runs = []
    keeper_pids = set()
    try:
        for _ in range(args.repeat):
            runs.append(repetition(checkpoint, socket_dir, args.device, args.threads, not args.no_disk))
            keeper_pids.add(wc.Cache(socket_dir).keeper_info()["pid"])
    finally:
        # wait: the keeper writes into socket_dir until it exits, so remove the directory only then
        with contextlib.suppress(wc.WeightCacheError):  # no keeper (any more): nothing to stop
            wc.Cache(socket_dir).stop(wait=30)
        shutil.rmtree(work, ignore_errors=True)

    outputs = {o for r in runs for o in r["outputs"].values()}
    result: dict[str, Any] = {
        "device": args.device,
        "size_mib": args.size_mib,
        "repeat": args.repeat,
        "threads": args.threads,
        "takeover_ms": summary([r["takeover_ms"] for r in runs]),
        "lock_handover_ms": summary([r["lock_handover_ms"] for r in runs]),
        "standby_forward_ms": summary([r["standby_forward_ms"] for r in runs]),
        "primary_exit_ms": summary([r["primary_exit_ms"] for r in runs]),
        "steady_forward_ms": summary([r["steady_forward_ms"] for r in runs]),
        "cold_attach_ms": summary([r["cold_attach_ms"] for r in runs]),
        "outputs_identical": len(outputs) == 1,
        "standby_served": all(r["new_leader_is_standby"] and r["outputs"]["standby"] for r in runs),
        "entry_resident_after_kill": all(r["entry_resident_after_kill"] for r in runs),
        "one_keeper_throughout": len(keeper_pids) == 1,
        "runs": runs,
    }
    if not args.no_disk:
        result["disk_ms"] = summary([r["disk_ms"] for r in runs])
    for role in ("cold", "disk") if not args.no_disk else ("cold",):
        phases = runs[0][f"{role}_phases_ms"]
        result[f"{role}_phases_median_ms"] = {
            k: statistics.median(r[f"{role}_phases_ms"][k] for r in runs) for k in phases
        }
    if args.json:
        print(json.dumps(result))
    else:
        print(f"{args.repeat} repetitions, {args.size_mib} MiB of weights on {args.device}; times from SIGKILL of the")
        print("leader to the first forward result of the process that takes over:")
        print(f"{'':<38}{'median':>10}{'min':>10}{'max':>10}")
        rows = [
            ("hot standby (blocked on the lock)", "takeover_ms"),
            ("  of which: lock handed over", "lock_handover_ms"),
            ("  of which: first forward pass", "standby_forward_ms"),
            ("(the primary's exit, kill to reaped)", "primary_exit_ms"),
            ("(a forward pass while warm)", "steady_forward_ms"),
            ("cold restart, attaches (mode client)", "cold_attach_ms"),
        ] + ([("cold restart from disk (mode off)", "disk_ms")] if not args.no_disk else [])
        for label, key in rows:
            s = result[key]
            print(f"{label:<38}{s['median']:>7.1f} ms{s['min']:>7.1f} ms{s['max']:>7.1f} ms")
        for role in ("cold", "disk") if not args.no_disk else ("cold",):
            phases = ", ".join(
                f"{k.replace('_', ' ')} {v:.0f} ms" for k, v in result[f"{role}_phases_median_ms"].items()
            )
            print(f"{role} restart, median phases: {phases}")
        print(f"outputs identical: {result['outputs_identical']}; the standby served: {result['standby_served']}")
    ok = result["outputs_identical"] and result["standby_served"] and result["entry_resident_after_kill"]
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""Two engines on one device serve from ONE copy of the weights.

Engine 1 starts in mode "daemon": it loads the checkpoint, publishes it into the keeper and runs on the published
copy. Engine 2 starts in mode "client" while engine 1 keeps serving, and attaches the same memory. Both then
answer the same request, and the example checks the outputs are identical and measures that the weights exist
once:

- CPU: both processes map the same memfd inodes (/proc/PID/maps); in /proc/PID/smaps the weight pages count as
  shared in both, and engine 2's private memory (smaps_rollup Private_*) grew by far less than the weight bytes.
- GPU: free device memory (cudaMemGetInfo) before and after engine 2 attaches differs by far less than the
  weight bytes (the mapping imports the segments; it allocates nothing).

Each engine is a fresh process that builds its model on the meta device. The keeper and its socket directory
live in a temporary directory, removed at the end: the user's own keeper is never touched.

    python examples/two_engines.py [--device cpu|cuda:N] [--size-mib 64] [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch
from toymodel import make_checkpoint, meta_model, request, run, weight_bytes

import weightcache as wc

MEMFD = "/memfd:weightcache"


def smaps_rollup(pid: int | str = "self") -> dict[str, int]:
    """/proc/PID/smaps_rollup as bytes per field (Rss, Pss, Shared_Clean, Private_Dirty, Anonymous, ...)."""
    out = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, value = line.partition(":")
        parts = value.split()
        if len(parts) == 2 and parts[1] == "kB":
            out[key] = int(parts[0]) * 1024
    return out


def private_bytes(rollup: dict[str, int]) -> int:
    return rollup["Private_Clean"] + rollup["Private_Dirty"]


def weight_mappings(pid: int) -> dict[str, Any]:
    """The weight segments process ``pid`` maps (memfds the library created), from /proc/PID/smaps: their
    inodes, and how many of their resident bytes are shared with other processes or private to this one."""
    inodes: set[int] = set()
    totals = {"rss": 0, "shared": 0, "private": 0}
    inside = False
    for line in Path(f"/proc/{pid}/smaps").read_text().splitlines():
        fields = line.split()
        if "-" in fields[0] and len(fields) >= 5 and ":" not in fields[0]:  # a mapping's header line
            inside = len(fields) >= 6 and fields[5].startswith(MEMFD)
            if inside:
                inodes.add(int(fields[4]))
        elif inside and fields[0] in ("Rss:", "Shared_Clean:", "Shared_Dirty:", "Private_Clean:", "Private_Dirty:"):
            key = {"Rss:": "rss"}.get(fields[0], fields[0].split("_")[0].lower())
            totals[key] += int(fields[1]) * 1024
    return {"inodes": sorted(inodes), **totals}


def engine(checkpoint: str, mode: str, socket_dir: str, device: str) -> None:
    """One engine process: build on meta, attach in ``mode``, answer a request, then serve one request per
    line on stdin. Reports JSON lines on stdout."""
    dev = torch.device(device)
    model = meta_model(checkpoint)
    x = request(checkpoint, dev)
    gpu_free_before = gpu_free_after = None
    if dev.type == "cuda":
        torch.zeros(1, device=dev)  # create the CUDA context first: its memory is not the weights'
        torch.cuda.synchronize(dev)
        gpu_free_before = torch.cuda.mem_get_info(dev)[0]
    before = smaps_rollup()
    handle = wc.attach(model, checkpoint, mode=mode, device=dev, strict=mode == "client", socket_dir=socket_dir)  # type: ignore[arg-type]
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
        gpu_free_after = torch.cuda.mem_get_info(dev)[0]
    output = run(model, x)
    after = smaps_rollup()
    report = {
        "pid": os.getpid(),
        "mode": mode,
        "source": handle.source,
        "output": output,
        "weight_bytes": weight_bytes(model),
        "private_growth_bytes": private_bytes(after) - private_bytes(before),
        "anonymous_growth_bytes": after["Anonymous"] - before["Anonymous"],
        "rss_growth_bytes": after["Rss"] - before["Rss"],
        "gpu_free_before": gpu_free_before,
        "gpu_free_after": gpu_free_after,
    }
    print(json.dumps(report), flush=True)
    for _ in sys.stdin:  # each line is a request; the handle (the lease) stays open while serving
        print(json.dumps({"output": run(model, x)}), flush=True)
    handle.close()


class Engine:
    """An engine process, seen from the parent."""

    def __init__(self, checkpoint: Path, mode: str, socket_dir: Path, device: str) -> None:
        cmd = [sys.executable, __file__, "--engine", str(checkpoint), mode, str(socket_dir), device]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self.reply()

    def reply(self) -> dict[str, Any]:
        assert self.proc.stdout is not None
        line = self.proc.stdout.readline()
        if not line:
            raise SystemExit(f"engine {self.proc.args[3]} failed (exit code {self.proc.wait()}); see its stderr")
        return json.loads(line)  # type: ignore[no-any-return]

    def send(self) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write("request\n")
        self.proc.stdin.flush()

    def stop(self) -> None:
        if self.proc.stdin is not None:
            self.proc.stdin.close()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="cpu or cuda:N (default cpu)")
    parser.add_argument("--size-mib", type=int, default=64, help="checkpoint size (default 64 MiB)")
    parser.add_argument("--json", action="store_true", help="print one JSON object of results")
    parser.add_argument("--engine", nargs=4, metavar=("CKPT", "MODE", "SOCKET_DIR", "DEVICE"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(*args.engine)
        return 0

    work = Path(tempfile.mkdtemp(prefix="wc-two-"))
    checkpoint, socket_dir = work / "checkpoint", work / "sock"
    make_checkpoint(checkpoint, args.size_mib)
    engines: list[Engine] = []
    try:
        engines.append(Engine(checkpoint, "daemon", socket_dir, args.device))  # loads, publishes, serves
        engines.append(Engine(checkpoint, "client", socket_dir, args.device))  # attaches while engine 1 serves
        for e in engines:  # both serve the same request at the same time
            e.send()
        outputs = [e.info["output"] for e in engines] + [e.reply()["output"] for e in engines]
        first, second = (e.info for e in engines)
        wbytes = second["weight_bytes"]
        result: dict[str, Any] = {
            "device": args.device,
            "weight_bytes": wbytes,
            "sources": [first["source"], second["source"]],
            "outputs": outputs,
            "outputs_identical": len(set(outputs)) == 1,
            "engines": [first, second],
        }
        if args.device == "cpu":
            maps = [weight_mappings(e.proc.pid) for e in engines]
            result["weight_mappings"] = maps
            result["same_inodes"] = bool(maps[0]["inodes"]) and maps[0]["inodes"] == maps[1]["inodes"]
            result["second_private_growth_fraction"] = second["private_growth_bytes"] / wbytes
            one_copy = result["same_inodes"] and result["second_private_growth_fraction"] < 0.1
        else:
            used = second["gpu_free_before"] - second["gpu_free_after"]
            result["second_attach_gpu_bytes"] = used
            result["second_attach_gpu_fraction"] = used / wbytes
            one_copy = used < 0.01 * wbytes
        result["one_copy"] = one_copy
    finally:
        for e in engines:
            e.stop()
        # wait: the keeper writes into socket_dir until it exits, so remove the directory only then
        with contextlib.suppress(wc.WeightCacheError):  # no keeper (any more): nothing to stop
            wc.Cache(socket_dir).stop(wait=30)
        shutil.rmtree(work, ignore_errors=True)

    if args.json:
        print(json.dumps(result))
    else:
        mib = 2**20
        print(f"weights: {wbytes / mib:.1f} MiB on {args.device}; sources: {', '.join(result['sources'])}")
        print(
            f"outputs (engine 1, engine 2, then both serving at once): {outputs}; "
            f"identical: {result['outputs_identical']}"
        )
        if args.device == "cpu":
            m1, m2 = result["weight_mappings"]
            print(f"memfd inodes mapped: engine 1 {m1['inodes']}, engine 2 {m2['inodes']}")
            for i, m in enumerate((m1, m2), 1):
                print(
                    f"engine {i} weight mappings: {m['rss'] / mib:.1f} MiB resident, {m['shared'] / mib:.1f} MiB "
                    f"shared, {m['private'] / mib:.1f} MiB private"
                )
            print(
                f"engine 2's private memory grew by {second['private_growth_bytes'] / mib:.1f} MiB while attaching and "
                f"serving ({100 * result['second_private_growth_fraction']:.1f} % of the weights)"
            )
        else:
            print(
                f"free GPU memory fell by {result['second_attach_gpu_bytes'] / mib:.2f} MiB when engine 2 attached "
                f"({100 * result['second_attach_gpu_fraction']:.3f} % of the weights)"
            )
        print(f"one copy of the weights: {one_copy}")
    return 0 if result["outputs_identical"] and one_copy and result["sources"] == ["cache", "cache"] else 1


if __name__ == "__main__":
    raise SystemExit(main())

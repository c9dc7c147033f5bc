"""A separate process that plays an engine: attach, compute, report as JSON on stdout.

python tests/worker.py attach '{"checkpoint": ..., "mode": ..., "socket_dir": ...}'
python tests/worker.py hold '{...}'     # attach, print "ready", then compute each time a line arrives
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import torch
from models import INPUT_IDS, meta_model, model_kwargs

import weightcache as wc

torch.set_num_threads(1)


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def run(model: torch.nn.Module) -> str:
    device = next(model.parameters()).device
    with torch.no_grad():
        out = model(INPUT_IDS.to(device))
    return digest(out.cpu())


def smaps_for_memfd() -> dict[str, int]:
    """kB totals of /proc/self/smaps fields over the mappings of weightcache memfds."""
    totals: dict[str, int] = {}
    inside = False
    with open("/proc/self/smaps") as f:
        for line in f:
            parts = line.split()
            if "-" in parts[0] and len(parts) >= 5:
                inside = "/memfd:weightcache" in line
            elif inside and len(parts) >= 2 and parts[0].endswith(":") and parts[1].isdigit():
                totals[parts[0][:-1]] = totals.get(parts[0][:-1], 0) + int(parts[1])
    return totals


def touch(model: torch.nn.Module) -> dict[str, int]:
    """Read every page of every parameter, then report how the weightcache mappings are backed."""
    for p in model.parameters():
        float(p.float().sum())
    return smaps_for_memfd()


def attach(spec: dict) -> tuple[torch.nn.Module, wc.Handle, dict]:
    model = meta_model(**model_kwargs(spec["checkpoint"]))
    if spec.get("fsize_limit"):
        # A real allocation failure for shared memory: a memfd cannot grow past RLIMIT_FSIZE (EFBIG; Python
        # ignores SIGXFSZ), so segments fail while the checkpoint still reads.
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], resource.RLIM_INFINITY))
    if spec.get("barrier"):  # racing workers start together once all have imported: a file each, then all go
        barrier = Path(spec["barrier"])
        (barrier / str(os.getpid())).touch()
        deadline = time.monotonic() + 120
        while len(list(barrier.iterdir())) < spec["barrier_count"] and time.monotonic() < deadline:
            time.sleep(0.005)
    start_lines: list[str] = []  # the start's log line ("hit", "hit, after another engine's load", "miss, ...")
    line_handler = logging.Handler()
    line_handler.emit = lambda record: start_lines.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("weightcache").addHandler(line_handler)
    logging.getLogger("weightcache").setLevel(logging.INFO)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        device = spec.get("device")
        if device and device.startswith("cuda"):
            model.positions = model.positions.to(device)
        handle = wc.attach(
            model,
            spec["checkpoint"],
            mode=spec.get("mode", "client"),
            device=device,
            dtype=spec.get("dtype"),
            socket_dir=spec.get("socket_dir"),
            strict=spec.get("strict", False),
        )
        elapsed = time.perf_counter() - t0
    info = {
        "source": handle.source,
        "digest": handle.fingerprint.digest,
        "attach_ms": elapsed * 1e3,
        "warnings": [str(w.message) for w in caught if issubclass(w.category, wc.FallbackWarning)],
        "fallback_reason": handle.fallback_reason,
        "read_disk": handle.read_disk,
        "resident_before": handle.resident_before,
        "start_line": next((line for line in start_lines if " (mode " in line), None),
        "pid": os.getpid(),
    }
    return model, handle, info


def main() -> None:
    command, spec = sys.argv[1], json.loads(sys.argv[2])
    if command == "attach":
        try:
            model, handle, info = attach(spec)
        except wc.WeightCacheError as exc:
            print(json.dumps({"error": type(exc).__name__, "message": str(exc)}))
            return
        info["output"] = run(model)
        if spec.get("touch"):
            info["smaps"] = touch(model)
        if spec.get("write"):
            with torch.no_grad():
                model.embed.weight.add_(1.0)
            info["output_after_write"] = run(model)
        handle.close()
        print(json.dumps(info), flush=True)
    elif command == "hold":
        model, handle, info = attach(spec)
        info["output"] = run(model)
        if spec.get("touch"):
            info["smaps"] = touch(model)
        if spec.get("release"):
            handle.close()
        print(json.dumps(info), flush=True)
        for _line in sys.stdin:
            print(json.dumps({"output": run(model), "leased": handle.leased}), flush=True)
    else:
        raise SystemExit(f"unknown command {command}")


if __name__ == "__main__":
    main()

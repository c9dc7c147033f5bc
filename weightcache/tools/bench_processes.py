"""``weightcache bench``'s fresh processes: the engine that attaches, the peer that unpickles CUDA IPC handles,
the peer's holder, and the per-tensor floor they are measured against.

:data:`START` is what both fresh processes do before their clocks start (Python, torch, the CUDA context, the
model on meta); :data:`ENGINE` then imports weightcache and attaches, timing each step and the garbage collector
inside it, and :data:`PEER` unpickles what :func:`holder` exported with torch's CUDA IPC reductions. Each runs
with ``python -c`` (:func:`run_child`), so nothing of weightcache is imported before its clock starts; its last
line of stdout is its report. :func:`floor_ms` is the floor, in the engine's own process; :func:`peer_attach` runs
the holder (``python -m weightcache.tools.bench holder``) and the peer's processes.

Layer L5 (a tool). Measures only: what a configuration holds is :mod:`weightcache.tools.bench_setup`'s, the
tables :mod:`weightcache.tools.bench_report`'s. Its names are re-exported by :mod:`weightcache.tools.bench`,
which the fresh processes import their helpers from.
"""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .bench_report import stats
from .bench_setup import meta_holder, pattern

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


def run_child(code: str, spec: dict[str, Any], what: str) -> dict[str, Any]:
    out = subprocess.run(
        [sys.executable, "-c", code, json.dumps(spec)], capture_output=True, text=True, check=False, timeout=600
    )
    if out.returncode != 0:
        raise SystemExit(f"{what} failed (exit status {out.returncode}):\n{out.stdout[-2000:]}{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


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
        runs = [run_child(PEER, spec, "peer engine") for _ in range(repeat)]
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


__all__ = ["ENGINE", "PEER", "START", "floor_ms", "holder", "peer_attach", "run_child"]

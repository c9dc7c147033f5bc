"""CUDA graphs restored instead of captured (issue 31), plain PyTorch, in fresh processes.

A stack of Llama-shaped MLP blocks (RMSNorm, gate/up/down projections, SiLU; bf16) is saved as a safetensors
checkpoint; a keeper holds its weights. Then, each a fresh process that attaches the weights from the keeper:

- ``record``: keeps kernel images, captures one graph per batch size through a GraphCache and publishes them;
- ``plain``: captures the same graphs the usual way (a warm-up call on a side stream, then ``torch.cuda.graph``),
  into torch's own pool: the baseline;
- ``restore``: the same calls through a GraphCache, which rebuilds each graph from the keeper's artifact (built
  ahead on worker threads from the moment the artifact is loaded, taken once each graph's checks passed); with
  ``--serial``, also a restore that builds each graph when asked for (``build_ahead=False``), in every repeat.

Each replays every graph on the same inputs and reports the SHA-256 of each output, the time of its graph phase
(from the first graph asked for to the last one ready, synchronized) and of the whole process. The parent runs
``record`` once, then ``plain`` and ``restore`` alternately ``--repeat`` times, and prints medians. Each process
also reports when each graph was asked for (``graph_at_ms``) and every pause of Python's garbage collector during
the graph phase (``gc_ms``: generation, ms into the phase, duration), which a graph's time may hold::

    python benchmarks/graph_restore.py bench --layers 16 --sizes 1 2 4 8 16 32 64 128 --repeat 3 --json out.json

``--variant shift`` (restore only) asks for one more static input before the graphs, so that the graphs' memory
would start at another arena offset; ``--variant home-taken`` reserves the weights' home address range before
attaching, so that the weights land elsewhere; ``--variant driver-fault`` makes every kernel image load fail with
an error that is no :class:`~weightcache.errors.GraphRestoreError` (as a binding that does not fit the driver
would); ``--variant foreign`` captures a graph of its own with ``GraphCache.pool`` before the others (an
engine's capture in the arena). Each must capture instead of restoring.

``--external`` (every process of the run) makes the graphs also read and write memory of torch's own caching
allocator, declared with ``GraphCache.external``: each graph adds a bias tensor to the model's output and copies
the sum into an output tensor of its own (a memcpy node), both made with ``torch.full``/``torch.empty`` first
thing in the process. torch's allocator gives a fresh process other addresses for them (CUDA places its address
space anew in each process): a restore moves every pointer into them with them (``relocated``: how many).
``--variant external-moved`` allocates 1 MiB more before them, so that they move within torch's segment too:
every graph must still be restored, its outputs the same.

``--engine`` (every process of the run) captures the graphs as an engine that runs its own capture loop does:
``GraphCache.restore`` for each graph, and where it returns None a warm-up and ``torch.cuda.graph`` into
``GraphCache.pool`` inside ``GraphCache.capturing``, recorded with ``capture.record``.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

STARTED = time.perf_counter()

import torch  # noqa: E402
from torch import nn  # noqa: E402


class Block(nn.Module):
    def __init__(self, hidden: int, inter: int) -> None:
        super().__init__()
        self.norm = nn.Parameter(torch.ones(hidden))
        self.gate = nn.Linear(hidden, inter, bias=False)
        self.up = nn.Linear(hidden, inter, bias=False)
        self.down = nn.Linear(inter, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + 1e-6)).to(x.dtype) * self.norm
        return x + self.down(nn.functional.silu(self.gate(h)) * self.up(h))


class Model(nn.Module):
    def __init__(self, layers: int, hidden: int, inter: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(hidden, inter) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


def write_checkpoint(path: Path, layers: int, hidden: int, inter: int) -> None:
    from safetensors.torch import save_file

    torch.manual_seed(0)
    model = Model(layers, hidden, inter).to(torch.bfloat16)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02) if p.dim() > 1 else p.fill_(1.0)
    path.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"layers": layers, "hidden": hidden, "inter": inter}))


def child(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    import weightcache as wc
    from weightcache.segments import cuda_import, cuda_vmm
    from weightcache.torch_graphs import GraphCache, keep_kernel_images

    imported = time.perf_counter() - STARTED
    if role != "plain":
        keep_kernel_images()  # before the first kernel: the load below runs some
    torch.cuda.init()
    ckpt, socket_dir = spec["checkpoint"], spec["socket_dir"]
    config = json.loads((Path(ckpt) / "config.json").read_text())
    externals: dict[str, torch.Tensor] = {}
    if spec.get("external"):  # before anything else allocates from torch's allocator: the same calls in every role
        if spec.get("variant") == "external-moved":
            externals["pad"] = torch.empty(1 << 20, dtype=torch.uint8, device="cuda")
        externals["bias"] = torch.full((config["hidden"],), 0.5, dtype=torch.bfloat16, device="cuda")
        for b in spec["sizes"]:
            externals[f"out{b}"] = torch.empty((b, config["hidden"]), dtype=torch.bfloat16, device="cuda")
    taken = 0
    if spec.get("variant") == "home-taken":
        [entry] = wc.Cache(socket_dir=socket_dir).entries()
        home = cuda_vmm.home_addresses(entry.digest, [2 << 20])[0]
        torch.zeros(1, device="cuda")  # torch's context, current on this thread
        drv = cuda_import.driver()
        assert drv is not None
        taken = drv.reserve(cuda_vmm.HOME_RESERVE, home)
    with torch.device("meta"):
        model = Model(config["layers"], config["hidden"], config["inter"]).to(torch.bfloat16)
    t = time.perf_counter()
    mode = "daemon" if role == "record" else "client"
    handle = wc.attach(model, ckpt, mode=mode, device="cuda:0", socket_dir=socket_dir)
    attach_s = time.perf_counter() - t
    sizes = spec["sizes"]
    hidden = config["hidden"]
    torch.cuda.synchronize()
    collections: list[list[float]] = []  # Python's garbage collector during the graph phase: [generation, at, ms]
    collecting: list[float] = []

    def collector(phase: str, info: dict[str, int]) -> None:
        if phase == "start":
            collecting[:] = [time.perf_counter()]
        elif collecting:
            now = time.perf_counter()
            collections.append(
                [
                    info["generation"],
                    round((collecting[0] - graph_start) * 1e3, 2),
                    round((now - collecting[0]) * 1e3, 2),
                ]
            )

    graph_start = time.perf_counter()
    gc.callbacks.append(collector)
    graph_at: list[float] = []  # when each graph was asked for, ms into the graph phase
    graphs: list[Any] = []
    inputs: list[torch.Tensor] = []
    cache = None
    foreign: list[Any] = []  # --variant foreign: a graph captured through the pool, and its memory

    def forward(b: int, x: torch.Tensor) -> torch.Tensor:
        out = model(x)
        if not externals:
            return out
        return externals[f"out{b}"].copy_(out + externals["bias"])  # an external input and output, a memcpy node

    with torch.no_grad():
        if role == "plain":
            pool = torch.cuda.graph_pool_handle()
            for b in sizes:
                graph_at.append(round((time.perf_counter() - graph_start) * 1e3, 2))
                x = torch.empty((b, hidden), dtype=torch.bfloat16, device="cuda")
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    forward(b, x)
                torch.cuda.current_stream().wait_stream(side)
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g, pool=pool):
                    out = forward(b, x)
                graphs.append((g, (out,)))
                inputs.append(x)
        else:
            if spec.get("variant") == "driver-fault":
                from weightcache.graphs import CudaGraphDriver

                def fault(*_: object) -> int:
                    raise RuntimeError("a kernel image load failed (injected by the benchmark's driver-fault run)")

                setattr(CudaGraphDriver, "load_module", fault)  # noqa: B010 (a method replaced, for this process only)
            cache = GraphCache(
                handle,
                {"benchmark": "graph_restore", **config, "sizes": sizes},
                device="cuda:0",
                socket_dir=socket_dir,
                build_ahead=spec.get("variant") != "serial",
            )
            if spec.get("variant") == "shift":
                cache.empty((1024,), torch.bfloat16)
            for name, tensor in externals.items():
                if name != "pad":
                    cache.external(name, tensor)
            cache.start_builds()  # (every tensor declared: with --external the builds start here, not at b1)
            if spec.get("variant") == "foreign":  # a capture of someone else's in the arena, through the pool
                foreign.append(torch.cuda.CUDAGraph())
                with torch.cuda.graph(foreign[0], pool=cache.pool):
                    foreign.append(torch.ones(1 << 20, device="cuda"))
            for b in sizes:
                graph_at.append(round((time.perf_counter() - graph_start) * 1e3, 2))
                x = cache.empty((b, hidden), torch.bfloat16)
                if spec.get("engine"):  # captured by the caller, as an engine captures its own graphs
                    graphs.append(engine_graph(cache, f"b{b}", lambda b=b, x=x: forward(b, x)))
                else:
                    g = cache.graph(f"b{b}", lambda b=b, x=x: forward(b, x))
                    graphs.append((g, g.outputs))
                inputs.append(x)
        torch.cuda.synchronize()
        graph_s = time.perf_counter() - graph_start
        gc.callbacks.remove(collector)
        published = cache.publish() if cache is not None and role == "record" else False
        digests = []
        for b, x, (g, outputs) in zip(sizes, inputs, graphs):
            gen = torch.Generator().manual_seed(b)
            x.copy_(torch.randn(x.shape, generator=gen).to(torch.bfloat16))
            g.replay()
            torch.cuda.synchronize()
            digests.append(
                hashlib.sha256(outputs[0].contiguous().view(torch.uint8).cpu().numpy().tobytes()).hexdigest()
            )
    result = {
        "role": role,
        "variant": spec.get("variant"),
        "external": {name: [t.data_ptr(), t.nbytes] for name, t in externals.items()},
        "imported_s": imported,
        "attach_s": attach_s,
        "weights": handle.source,
        "graph_s": graph_s,
        "total_s": time.perf_counter() - STARTED,
        "digests": digests,
        "restored": [getattr(g, "restored", False) for g, _ in graphs],
        "reasons": [getattr(g, "reason", None) for g, _ in graphs],
        "recorded": [getattr(g, "recorded", False) for g, _ in graphs],
        "record_problems": [getattr(g, "record_problem", None) for g, _ in graphs],
        "graph_ms": [getattr(g, "seconds", 0.0) * 1e3 for g, _ in graphs],
        "graph_at_ms": graph_at,
        "gc_ms": collections,
        "cache_reason": cache.reason if cache is not None else None,
        "relocated": cache.relocated if cache is not None else 0,
        "published": published,
        "home_ranges": len(cuda_vmm.home_ranges()),
        "home_taken": taken,
        "kept_images": keep_kernel_images().counts() if role != "plain" else None,
        "phases_ms": [{k: round(v * 1e3, 2) for k, v in getattr(g, "phases", {}).items()} for g, _ in graphs],
        "images_loaded": [cache.images_loaded, cache.image_bytes, round(cache.image_seconds * 1e3, 1)]
        if cache
        else None,
        "image_steps_ms": {k: round(v * 1e3, 1) for k, v in cache.image_steps.items()} if cache else None,
        "start_phases_ms": {k: round(v * 1e3, 1) for k, v in cache.phases.items()} if cache else None,
    }
    handle.close()
    return result


class EngineGraph:
    """A graph the caller captured itself through ``GraphCache.capturing`` (``--engine``), reported as a
    ``CudaGraph`` is."""

    def __init__(self, graph: Any, capture: Any, seconds: float, reason: str | None) -> None:
        self.graph, self.restored, self.seconds, self.reason = graph, False, seconds, reason
        self.recorded, self.record_problem = capture.recorded, capture.problem

    def replay(self) -> None:
        self.graph.replay()


def engine_graph(cache: Any, name: str, fn: Any) -> tuple[Any, tuple[torch.Tensor, ...]]:
    """``--engine``: the graph restored with ``GraphCache.restore``, else captured as an engine captures one (a
    warm-up on a side stream, then ``torch.cuda.graph`` into ``GraphCache.pool`` with ``keep_graph=True`` inside
    ``GraphCache.capturing``) and recorded with ``capture.record``."""
    started = time.perf_counter()
    restored = cache.restore(name)
    if restored is not None:
        return restored, restored.outputs
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        fn()
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with cache.capturing(name) as capture:
        with torch.cuda.graph(graph, pool=cache.pool):
            out = fn()
        capture.record(graph, (out,))
    return EngineGraph(graph, capture, time.perf_counter() - started, cache.reason), (out,)


def probe_va() -> dict[str, Any]:
    """Which reservation sizes the driver places at the address asked for (a fresh process, torch's context)."""
    from weightcache.segments import cuda_import

    torch.zeros(1, device="cuda")
    drv = cuda_import.driver()
    assert drv is not None
    got = {}
    for i, size in enumerate([2 << 20, 64 << 20, 512 << 20, 1 << 30, 2 << 30, 4 << 30, 16 << 30, 64 << 30]):
        want = 0x6800_0000_0000 + i * (1 << 40)
        ptr = drv.reserve(size, want)
        got[str(size)] = ptr == want
        drv.free_address(ptr, size)
    return got


def run_child(role: str, spec: dict[str, Any]) -> dict[str, Any]:
    env = dict(os.environ)
    out = subprocess.run(
        [sys.executable, __file__, "child", role, json.dumps(spec)],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
    )
    if out.returncode != 0:
        raise RuntimeError(f"{role} failed ({out.returncode}):\n{out.stderr[-6000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def bench(args: argparse.Namespace) -> dict[str, Any]:
    if "external-moved" in args.variants and not args.external:
        raise SystemExit("--variants external-moved moves the tensors of --external: give --external too")
    work = Path(tempfile.mkdtemp(prefix="wc-graphs-"))
    ckpt, socket_dir = work / "ckpt", work / "sock"
    write_checkpoint(ckpt, args.layers, args.hidden, args.inter)
    subprocess.run(
        [sys.executable, "-m", "weightcache", "serve", "--detach", "--socket-dir", str(socket_dir)],
        check=True,
        capture_output=True,
        timeout=60,
    )
    spec = {
        "checkpoint": str(ckpt),
        "socket_dir": str(socket_dir),
        "sizes": args.sizes,
        "external": args.external,
        "engine": args.engine,
    }
    runs: list[dict[str, Any]] = []
    try:
        runs.append(run_child("record", spec))
        for _ in range(args.repeat):
            runs.append(run_child("plain", spec))
            runs.append(run_child("restore", spec))
            if args.serial:  # each graph built when asked for, after its checks, alternating with the others
                runs.append(run_child("restore", {**spec, "variant": "serial"}))
        for variant in args.variants:
            runs.append(run_child("restore", {**spec, "variant": variant}))
    finally:
        subprocess.run(
            [sys.executable, "-m", "weightcache", "stop", "--socket-dir", str(socket_dir)],
            capture_output=True,
            timeout=60,
        )
    plain = [r for r in runs if r["role"] == "plain"]
    restore = [r for r in runs if r["role"] == "restore" and not r["variant"]]
    serial = [r for r in runs if r["role"] == "restore" and r["variant"] == "serial"]
    reference = runs[0]["digests"]
    summary = {
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
        "device": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "layers": args.layers,
        "external": args.external,
        "hidden": args.hidden,
        "inter": args.inter,
        "sizes": args.sizes,
        "record_graph_s": runs[0]["graph_s"],
        "plain_graph_s_median": statistics.median(r["graph_s"] for r in plain) if plain else None,
        "restore_graph_s_median": statistics.median(r["graph_s"] for r in restore) if restore else None,
        "restore_serial_graph_s_median": statistics.median(r["graph_s"] for r in serial) if serial else None,
        "plain_total_s_median": statistics.median(r["total_s"] for r in plain) if plain else None,
        "restore_total_s_median": statistics.median(r["total_s"] for r in restore) if restore else None,
        "all_restored": all(all(r["restored"]) for r in restore + serial),
        "outputs_equal": all(r["digests"] == reference for r in runs),
        "runs": runs,
    }
    if summary["plain_graph_s_median"] and summary["restore_graph_s_median"]:
        summary["ratio"] = summary["restore_graph_s_median"] / summary["plain_graph_s_median"]
    return summary


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    b = sub.add_parser("bench")
    b.add_argument("--layers", type=int, default=16)
    b.add_argument("--hidden", type=int, default=2048)
    b.add_argument("--inter", type=int, default=5632)
    b.add_argument("--sizes", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32, 64, 128])
    b.add_argument("--repeat", type=int, default=3)
    b.add_argument(
        "--variants",
        nargs="*",
        default=[],
        choices=["shift", "home-taken", "driver-fault", "external-moved", "foreign"],
    )
    b.add_argument("--external", action="store_true", help="graphs that read and write torch-allocated tensors too")
    b.add_argument(
        "--engine",
        action="store_true",
        help="the graphs captured by the caller (GraphCache.capturing, .restore), as an engine captures its own",
    )
    b.add_argument(
        "--serial",
        action="store_true",
        help="also a restore that builds each graph when asked for (GraphCache(build_ahead=False)), every repeat",
    )
    b.add_argument("--json", type=Path)
    c = sub.add_parser("child")
    c.add_argument("role", choices=["record", "plain", "restore"])
    c.add_argument("spec")
    sub.add_parser("probe-va")
    args = parser.parse_args()
    if args.command == "probe-va":
        print(json.dumps(probe_va()), flush=True)
        return 0
    if args.command == "child":
        print(json.dumps(child(args.role, json.loads(args.spec))), flush=True)
        return 0
    summary = bench(args)
    if args.json:
        args.json.write_text(json.dumps(summary, indent=1))
    short = {k: v for k, v in summary.items() if k != "runs"}
    for r in summary["runs"]:
        print(json.dumps({k: r[k] for k in ("role", "variant", "graph_s", "total_s", "restored", "cache_reason")}))
    print(json.dumps(short, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

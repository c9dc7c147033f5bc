"""Time to first output of a torch.compile-d transformers model in a fresh process: cold, warm local disk, and warm
from the keeper with an empty local cache directory.

Two models (``--shape``), random weights, nothing downloaded, the checkpoint saved once under ``--workdir``:

    tiny       (default) a Llama of ``--layers`` layers (default 1) and width ``--hidden`` (default 64),
               vocabulary 128, float32, built from a ``LlamaConfig``
    llama3-8b  Llama-3-8B's shapes (benchmarks/restart_llama.py's ``LLAMA3_8B``: 32 layers, hidden 4096, MLP 14336,
               32 heads of which 8 KV heads, vocabulary 128,256; 16 GB in bf16), made on ``--device`` and saved in
               bf16 by ``restart_llama.build_checkpoint`` (in a child process, so that this one holds no CUDA
               context); ``--layers N`` keeps N layers of that width (default 32; the checkpoint is per N)

Each run is a fresh process (``worker``) that goes, with a timestamp (``time.time()``) after each step, the GPU
synchronised before the marks that follow GPU work:

    launch (the parent's clock) -> start (this file's standard-library imports done) -> torch imported -> CUDA
    context created (``--device cuda:N``; nothing on the CPU) -> transformers imported -> weightcache imported ->
    config read and model built on meta -> attach (from the keeper) -> artifact loaded (way keeper; nothing for
    the others) -> ``torch.compile`` and the first forward pass of an 8-token prompt, its greedy next token on
    the host

and reports torch's cache counters (FX graph and AOTAutograd cache hits and misses), its graph and graph-break
counts, and the seconds torch's ``dynamo_timed`` sections took (``weightcache.torch_compile.compile_metrics``:
e.g. ``_compile.compile_inner`` is dynamo with everything under it, ``OutputGraph.call_user_compiler`` the
backend, i.e. AOTAutograd and inductor; the names are torch's and vary by release). Four ways:

    cold        an empty inductor cache directory, no artifact loaded (what every container start pays today)
    local       the cache directory a cold compile filled, no artifact loaded (torch's own warm local disk cache)
    keeper      an empty inductor cache directory, and ``wc.compile_cache`` loads the keeper's artifact first
    precompile  an empty inductor cache directory, and ``wc.precompile`` loads the forward compiled ahead of time
                from the keeper (no dynamo trace, no compile; "artifact load" is that load, "compile + first
                forward" the first call)

Every way calls the model with ``use_cache=False`` (the first forward's logits do not depend on it; the AOT path
compiles the forward for exactly the inputs it is given). Before the cold compile, one worker compiles ahead of
time with ``wc.precompile`` and publishes that artifact.

``TORCHINDUCTOR_CACHE_DIR`` and ``TRITON_CACHE_DIR`` (its ``triton/``) are set per way. Before the measured runs:
one worker attaches in mode daemon without compiling, which loads the checkpoint and publishes the weights into
the keeper (so that every measured run attaches them from the keeper: the point is compile time); then one worker
compiles cold with ``wc.compile_cache``, which publishes the keeper's artifact, and its cache directory, filled by
that cold compile, is the one every ``local`` run reuses. Then ``--runs`` rounds of cold, local, keeper (cold only
in the first ``--cold-runs``). Reports the median of each way and of each step (wall time from ``subprocess``
start to the process reporting its first output, and inside the process), the artifact's size, and whether all
logits were bitwise equal (on a GPU, cold compiles may autotune kernels differently: the greedy tokens are compared
too). ``--json`` is written after every round; ``--deadline-s`` leaves out any run that would end past that many
seconds from the start, judged by the slowest run of its way so far (before the first, by the publishing cold
compile, half of it for a warm way), so that a time limit leaves a complete report of the runs that fitted.

    PYTHONPATH=$PWD python benchmarks/compile_restart.py bench --workdir /tmp/wc-compile --runs 5 --json out.json
    PYTHONPATH=$PWD python benchmarks/compile_restart.py bench --shape llama3-8b --device cuda:0 --runs 3 \\
        --cold-runs 2 --deadline-s 510 --workdir /tmp/wc-compile-8b --json out.json

How the time grows with layers, measured on the dev VM (2 vCPUs, torch 2.13.0+cpu, tiny model of width 64, one
process per figure, 2026-12-01): dynamo's trace (``_compile.compile_inner`` less the backend) 1.0-1.7 s at 1 layer,
1.7-1.9 s at 4, 4.5-5.5 s at 16, 7.2-8.2 s at 32 (~0.2 s per layer: dynamo traces every layer again, and every
process, the keeper's included, pays it); inductor's cold backend 17-18 s, 24-28 s, 31-39 s, 53-65 s (lowering,
scheduling and code generation are per layer too; identical kernels are compiled once); a backend served from a
cache ~2 s at any depth. Whole processes at 32 layers: cold 70-86 s, local 17 s, keeper 20 s.

Duration of the second command on an H200 (an estimate, not measured): the checkpoint ~45 s (34 s measured there
for restart_llama.py), publishing the weights ~35 s, a cold process ~65-90 s (imports ~9 s there, trace ~8 s,
inductor and Triton ~45-70 s), a warm one ~20-27 s (imports, trace, cache hit, first forward); so ~45 + 35 + 80 +
2 x 80 + 6 x 25 = ~470 s, and the deadline cuts what does not fit. The checkpoint can be written ahead in a call of
its own (``checkpoint --path /tmp/wc-compile-8b/llama3-8b-32l --layers 32 --device cuda:0``); bench then reuses it.
GPU memory: the keeper's 16 GB of weights, each worker's context and compile work (``max_memory_allocated`` in the
report), ~48 GB while the checkpoint is made (float32, then bf16); disk: 16 GB. Needs transformers (and accelerate
on a GPU: the publishing worker loads with ``device_map``). ``worker`` is also what tests/test_torch_compile.py runs.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

_STARTED = time.time()  # the worker's "start" mark: the interpreter is up and this file's imports are done

WAYS = ("cold", "local", "keeper", "precompile")
SHAPES = ("tiny", "llama3-8b")
#: (step, from mark, to mark); "launch" is the parent's clock just before it starts the process.
STEPS = (
    ("python start", "launch", "start"),
    ("torch import", "start", "torch"),
    ("CUDA init", "torch", "cuda"),
    ("transformers import", "cuda", "transformers"),
    ("weightcache import", "transformers", "weightcache"),
    ("meta model", "weightcache", "model"),
    ("attach", "model", "attach"),
    ("artifact load", "attach", "artifact"),
    ("compile + first forward", "artifact", "first_output"),
    ("total to first output", "launch", "first_output"),
)
#: torch's dynamo_timed sections worth a column: dynamo with everything under it, and the backend under that.
DYNAMO_TOTAL = "_compile.compile_inner"
BACKEND = "OutputGraph.call_user_compiler"


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One engine start: attach, compile, first output. ``args.keeper``: load/publish through wc.compile_cache;
    ``args.precompile``: the forward from wc.precompile (loaded from the keeper, or compiled ahead of time and
    published); ``args.attach_only``: attach (mode daemon: load and publish on a miss) and stop there."""
    marks = {"start": _STARTED}
    import hashlib

    import torch

    marks["torch"] = time.time()
    device = torch.device(args.device)

    def synchronize() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    if device.type == "cuda":
        torch.zeros(1, device=device)
        synchronize()
    marks["cuda"] = time.time()
    import transformers

    marks["transformers"] = time.time()
    import weightcache as wc

    marks["weightcache"] = time.time()
    config = transformers.AutoConfig.from_pretrained(args.checkpoint)
    build = {"dtype": getattr(torch, args.dtype)} if args.dtype else {}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config, **build)
    marks["model"] = time.time()
    handle = wc.attach(
        model, args.checkpoint, mode="daemon", device=args.device, socket_dir=args.socket_dir, dtype=args.dtype
    )
    synchronize()
    marks["attach"] = time.time()
    report: dict[str, Any] = {"weights": handle.fingerprint.digest, "source": handle.source, "marks": marks}
    if args.attach_only:
        handle.close()
        return report
    model.eval()
    options = json.loads(args.options)
    compile_args = {"backend": "inductor", **({"options": options} if options else {})}
    ids = torch.arange(8, device=device).reshape(1, 8)
    cc = None
    precompiled = None
    with torch.no_grad(), contextlib.ExitStack() as stack:
        if args.precompile:
            precompiled = wc.precompile(
                handle,
                model,
                (ids,),
                {"use_cache": False},
                options=compile_args,
                device=args.device,
                socket_dir=args.socket_dir,
            )
            marks["artifact"] = time.time()
            logits = precompiled(ids, use_cache=False).logits
        if args.keeper:
            cc = stack.enter_context(
                wc.compile_cache(
                    handle,
                    options=compile_args,
                    shapes=[list(ids.shape)],
                    device=args.device,
                    socket_dir=args.socket_dir,
                )
            )
        if precompiled is None:
            marks["artifact"] = time.time()
            compiled = torch.compile(model, **compile_args)
            logits = compiled(ids, use_cache=False).logits
        token = int(logits[0, -1].argmax())  # on the host: the first token
        synchronize()
        marks["first_output"] = time.time()
    # leaving the ExitStack published the artifact on a miss (after the mark: an engine would be serving by then)
    stats = None if cc is None else _stats(cc.stats)
    if cc is not None:
        cc.close()
    if precompiled is not None:
        stats = _stats(precompiled.stats)
        precompiled.close()
    from weightcache.torch_compile import compile_metrics, torch_cache_counters

    handle.close()
    report.update(
        first_output_s=round(marks["first_output"] - marks["start"], 3),
        token=token,
        logits_sha256=hashlib.sha256(logits.float().cpu().contiguous().numpy().tobytes()).hexdigest(),
        stats=stats,
        counters=torch_cache_counters(),
        **compile_metrics(),
        max_memory_allocated=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None,
        device_name=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        torch=torch.__version__,
        transformers=transformers.__version__,
    )
    return report


def _stats(stats: Any) -> dict[str, Any]:
    import attrs

    return attrs.asdict(stats)


def make_checkpoint(path: Path, layers: int, hidden: int) -> Path:
    """A random Llama of ``layers`` layers and width ``hidden``, saved (float32) under ``path`` once."""
    if (path / "config.json").exists():
        return path
    import torch
    import transformers

    config = transformers.LlamaConfig(
        vocab_size=128,
        hidden_size=hidden,
        intermediate_size=hidden * 3 // 2,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(path)
    return path


def _restart_llama() -> Any:
    """benchmarks/restart_llama.py as a module (this file is also loaded by path, where benchmarks/ is no package)."""
    spec = importlib.util.spec_from_file_location("restart_llama", Path(__file__).with_name("restart_llama.py"))
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_llama3_8b(path: Path, layers: int, device: str, *, here: bool = False) -> Path:
    """The Llama-3-8B-shaped checkpoint of ``layers`` layers (bf16, random) under ``path`` once, written to
    ``path``'s ``.partial`` sibling and renamed when complete; by a child process (``checkpoint``) unless ``here``,
    so that this process creates no CUDA context."""
    if (path / "config.json").exists():
        return path
    if not here:
        cmd = [sys.executable, __file__, "checkpoint", "--path", str(path), "--layers", str(layers)]
        subprocess.run([*cmd, "--device", device], check=True, timeout=900)
        return path
    partial = path.with_name(path.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    _restart_llama().build_checkpoint(partial, device, {"num_hidden_layers": layers})
    partial.rename(path)
    return path


def run_worker(
    checkpoint: Path,
    socket_dir: Path,
    cache_dir: Path,
    *,
    keeper: bool,
    precompile: bool = False,
    options: dict[str, Any] | None = None,
    dtype: str | None = None,
    device: str = "cpu",
    attach_only: bool = False,
    timeout: float = 600,
) -> dict[str, Any]:
    """One fresh worker process with ``cache_dir`` as its inductor cache; its report plus its wall time and the
    seconds of each step (``steps_s``)."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    cmd = [sys.executable, __file__, "worker", "--checkpoint", str(checkpoint), "--socket-dir", str(socket_dir)]
    cmd += ["--options", json.dumps(options or {}), "--device", device] + (["--keeper"] if keeper else [])
    cmd += (["--dtype", dtype] if dtype else []) + (["--attach-only"] if attach_only else [])
    cmd += ["--precompile"] if precompile else []
    launch = time.time()
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    report["wall_s"] = round(wall, 3)
    marks = {"launch": launch, **report["marks"]}
    report["steps_s"] = {step: round(marks[b] - marks[a], 3) for step, a, b in STEPS if a in marks and b in marks}
    return report


def _median(runs: list[dict[str, Any]], field: str, key: str | None = None) -> float | None:
    values = [r[field] if key is None else r[field].get(key) for r in runs]
    present = [v for v in values if v is not None]
    return round(statistics.median(present), 3) if present else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 2) if a is not None and b else None


def bench(
    workdir: Path,
    runs: int,
    layers: int | None = None,
    hidden: int = 64,
    *,
    shape: str = "tiny",
    device: str = "cpu",
    dtype: str | None = None,
    options: dict[str, Any] | None = None,
    cold_runs: int | None = None,
    deadline_s: float | None = None,
    json_path: Path | None = None,
) -> dict[str, Any]:
    """Set up (checkpoint, keeper, weights, artifact), then ``runs`` rounds of the three ways (cold only in the
    first ``cold_runs``). With ``deadline_s``, a run that would end past that many seconds from the start (by the
    slowest run of its way so far) is left out. With ``json_path``, the report is written after every round."""
    from weightcache.client import KeeperConnection, ensure_keeper, stop_keeper

    cold_runs = runs if cold_runs is None else min(cold_runs, runs)
    workdir.mkdir(parents=True, exist_ok=True)
    began = time.perf_counter()
    if shape == "llama3-8b":
        layers = 32 if layers is None else layers
        dtype = dtype or "bfloat16"
        checkpoint = make_llama3_8b(workdir / f"llama3-8b-{layers}l", layers, device)
    else:
        layers = 1 if layers is None else layers
        checkpoint = make_checkpoint(workdir / f"ckpt-{layers}l-{hidden}", layers, hidden)
    setup = {
        "shape": shape,
        "layers": layers,
        "hidden": hidden if shape == "tiny" else None,
        "device": device,
        "dtype": dtype,
        "runs": runs,
        "cold_runs": cold_runs,
        "deadline_s": deadline_s,
        "checkpoint_bytes": sum(f.stat().st_size for f in checkpoint.glob("*.safetensors")),
        "timings": {"checkpoint_s": round(time.perf_counter() - began, 1)},
    }
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-bench-", dir="/tmp")) / "s"
    ensure_keeper(socket_dir)
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    skipped: list[str] = []  # "way round" of the runs the deadline left out
    setup["skipped"] = skipped

    def run(cache_dir: Path, **kwargs: Any) -> dict[str, Any]:
        return run_worker(checkpoint, socket_dir, cache_dir, options=options, dtype=dtype, device=device, **kwargs)

    report: dict[str, Any] = {}
    try:
        t0 = time.perf_counter()
        weights = run(workdir / "weights-cache", keeper=False, attach_only=True)  # loads, publishes the weights
        setup["timings"]["publish_weights_s"] = round(time.perf_counter() - t0, 1)
        local = workdir / "local-cache"
        shutil.rmtree(local, ignore_errors=True)
        publisher = run(local, keeper=True)  # a cold compile fills `local` and publishes the keeper's artifact
        aot = workdir / "precompile-publish"
        shutil.rmtree(aot, ignore_errors=True)
        setup["precompile_publisher"] = run(aot, keeper=False, precompile=True)  # compiles ahead of time, publishes
        shutil.rmtree(aot, ignore_errors=True)
        print(f"published: wall s {publisher['wall_s']}", file=sys.stderr, flush=True)
        # before a way's first run, its expected time is the publishing cold compile's (half of it for a warm way)
        guess = {way: publisher["wall_s"] * (1.0 if way == "cold" else 0.5) for way in WAYS}
        for i in range(runs):
            done: dict[str, float] = {}
            for way in WAYS if i < cold_runs else ("local", "keeper", "precompile"):
                expected = max([r["wall_s"] for r in results[way]] or [guess[way]])  # its slowest run so far
                if deadline_s is not None and time.perf_counter() - began + expected > deadline_s:
                    skipped.append(f"{way} {i + 1}")
                    continue
                if way == "local":  # the directory the cold compile above filled, as it is
                    results[way].append(run(local, keeper=False))
                else:
                    fresh = workdir / f"{way}-cache"
                    shutil.rmtree(fresh, ignore_errors=True)
                    results[way].append(run(fresh, keeper=way == "keeper", precompile=way == "precompile"))
                    shutil.rmtree(fresh, ignore_errors=True)
                done[way] = results[way][-1]["wall_s"]
            print(f"round {i + 1}/{runs}: wall s {done}; skipped {skipped}", file=sys.stderr, flush=True)
            report = _report(setup, weights, publisher, results, began, complete=False)
            if json_path is not None:
                json_path.write_text(json.dumps(report, indent=2))
    finally:
        stop_keeper(KeeperConnection.connect(socket_dir), wait=30)
        shutil.rmtree(socket_dir.parent, ignore_errors=True)
        shutil.rmtree(workdir / "weights-cache", ignore_errors=True)
    report = _report(setup, weights, publisher, results, began, complete=True)
    if json_path is not None:
        json_path.write_text(json.dumps(report, indent=2))
    return report


def _report(
    setup: dict[str, Any],
    weights: dict[str, Any],
    publisher: dict[str, Any],
    results: dict[str, list[dict[str, Any]]],
    began: float,
    *,
    complete: bool,
) -> dict[str, Any]:
    """The bench's report from the runs so far (``complete``: the keeper was stopped, nothing more will run)."""
    every = [publisher, *(r for rs in results.values() for r in rs)]
    medians = {way: _median(rs, "wall_s") for way, rs in results.items()}
    inside = {way: _median(rs, "first_output_s") for way, rs in results.items()}
    steps = {way: {step: _median(rs, "steps_s", step) for step, _, _ in STEPS} for way, rs in results.items()}
    compiling = {way: steps[way]["compile + first forward"] for way in WAYS}
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "complete": complete,
        **{k: v for k, v in setup.items() if k not in ("timings", "precompile_publisher")},
        "device_name": publisher["device_name"],
        "torch": publisher["torch"],
        "transformers": publisher["transformers"],
        "runs_done": {way: len(rs) for way, rs in results.items()},
        "weights_source": sorted({r["source"] for r in every}),
        "bitwise_equal": len({r["logits_sha256"] for r in every}) == 1,
        "logits_per_way": {way: sorted({r["logits_sha256"][:12] for r in rs}) for way, rs in results.items()},
        "same_token": len({r["token"] for r in every}) == 1,
        "artifact_bytes": publisher["stats"]["published_bytes"],
        "median_wall_s": medians,
        "median_first_output_s": inside,
        "median_steps_s": steps,
        "ratios": {
            "keeper/local wall": _ratio(medians["keeper"], medians["local"]),
            "cold/keeper wall": _ratio(medians["cold"], medians["keeper"]),
            "keeper/local compile + first forward": _ratio(compiling["keeper"], compiling["local"]),
            "cold/keeper compile + first forward": _ratio(compiling["cold"], compiling["keeper"]),
            "precompile/keeper wall": _ratio(medians["precompile"], medians["keeper"]),
            "precompile/local wall": _ratio(medians["precompile"], medians["local"]),
        },
        "median_compile_times_s": {
            way: {name: _median(rs, "compile_times_s", name) for name in (DYNAMO_TOTAL, BACKEND)}
            for way, rs in results.items()
        },
        "keeper_counters": [
            {k: r["stats"][k] for k in ("source", "loaded_bytes", "hits", "misses", "kernels_restored")}
            for r in results["keeper"]
        ],
        "precompile_counters": [
            {k: r["stats"][k] for k in ("source", "loaded_bytes", "kernels_restored", "load_s", "reason")}
            for r in results["precompile"]
        ],
        "precompile_publisher": setup.get("precompile_publisher"),
        "graph_breaks": sorted({r["graph_breaks"] for r in every}),
        "max_memory_allocated": max((r["max_memory_allocated"] or 0) for r in every) or None,
        "timings": {**setup["timings"], "total_s": round(time.perf_counter() - began, 1)},
        "weights_run": weights,
        "publisher": publisher,
        "runs_detail": results,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    w = sub.add_parser("worker")
    w.add_argument("--checkpoint", required=True)
    w.add_argument("--socket-dir", required=True)
    w.add_argument("--options", default="{}")
    w.add_argument("--dtype", default=None)
    w.add_argument("--device", default="cpu")
    w.add_argument("--keeper", action="store_true")
    w.add_argument("--attach-only", action="store_true")
    w.add_argument("--precompile", action="store_true")
    c = sub.add_parser("checkpoint", help="write the llama3-8b-shaped checkpoint (what bench runs in a child)")
    c.add_argument("--path", type=Path, required=True)
    c.add_argument("--layers", type=int, default=32)
    c.add_argument("--device", default="cuda:0")
    b = sub.add_parser("bench")
    b.add_argument("--workdir", type=Path, default=Path("/tmp/wc-compile-bench"))
    b.add_argument("--runs", type=int, default=5, help="rounds of cold, local, keeper (default 5)")
    b.add_argument("--shape", choices=SHAPES, default="tiny")
    b.add_argument("--layers", type=int, default=None, help="layers (default: tiny 1, llama3-8b 32)")
    b.add_argument("--hidden", type=int, default=64, help="width of the tiny model (default 64)")
    b.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    b.add_argument("--dtype", default=None, help="dtype to attach in (default: tiny float32, llama3-8b bfloat16)")
    b.add_argument("--cold-runs", type=int, default=None, help="rounds that include a cold run (default: --runs)")
    b.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="leave out any run that would end past this many seconds from the start",
    )
    b.add_argument("--json", type=Path, default=None, help="the report, written after every round")
    args = parser.parse_args()
    if args.command == "worker":
        print(json.dumps(worker(args)))
        return 0
    if args.command == "checkpoint":
        make_llama3_8b(args.path, args.layers, args.device, here=True)
        return 0
    result = bench(
        args.workdir,
        args.runs,
        args.layers,
        args.hidden,
        shape=args.shape,
        device=args.device,
        dtype=args.dtype,
        cold_runs=args.cold_runs,
        deadline_s=args.deadline_s,
        json_path=args.json,
    )
    summary = {k: v for k, v in result.items() if k not in ("runs_detail", "publisher", "weights_run")}
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

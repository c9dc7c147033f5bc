"""Time to first output of a torch.compile-d transformers model in a fresh process: cold, warm local disk, and warm
from the keeper with an empty local cache directory.

The model is a tiny random Llama (``--layers``, ``--hidden``; built from a ``LlamaConfig`` and saved once in
``--workdir``; nothing is downloaded), attached from the keeper (mode daemon) and compiled with inductor. Each run
is a fresh process (``worker``) that goes: start Python -> import torch, transformers, weightcache -> build the
model on meta -> attach -> ``torch.compile`` -> first forward pass of an 8-token prompt. Three ways:

    cold     an empty inductor cache directory, no artifact loaded (what every container start pays today)
    local    the cache directory a cold run filled, no artifact loaded (torch's own warm local disk cache)
    keeper   an empty inductor cache directory, and ``wc.compile_cache`` loads the keeper's artifact first

The keeper's artifact is published once, by a run with ``wc.compile_cache`` before the measured keeper runs.
Every run's logits are hashed: all must be bitwise equal. Reports the median of ``--runs`` fresh processes per way
(wall time from ``subprocess`` start to the process reporting its first output) and torch's cache counters.

    PYTHONPATH=$PWD python benchmarks/compile_restart.py --workdir /tmp/wc-compile --runs 5 --json out.json

``worker`` is also what tests/test_torch_compile.py runs.
"""

from __future__ import annotations

import argparse
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

WAYS = ("cold", "local", "keeper")


def worker(args: argparse.Namespace) -> dict[str, Any]:
    """One engine start: attach, compile, first output. ``args.keeper``: load/publish through wc.compile_cache."""
    start = time.perf_counter()
    import hashlib

    import torch
    import transformers

    import weightcache as wc

    config = transformers.AutoConfig.from_pretrained(args.checkpoint)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    handle = wc.attach(model, args.checkpoint, mode="daemon", socket_dir=args.socket_dir, dtype=args.dtype)
    model.eval()
    options = json.loads(args.options)
    compile_args = {"backend": "inductor", **({"options": options} if options else {})}
    ids = torch.arange(8).reshape(1, 8)
    stats = None
    with torch.no_grad():
        if args.keeper:
            with wc.compile_cache(
                handle, options=compile_args, shapes=[list(ids.shape)], socket_dir=args.socket_dir
            ) as cc:
                compiled = torch.compile(model, **compile_args)
                logits = compiled(ids).logits
            stats = cc.stats
            cc.close()
        else:
            compiled = torch.compile(model, **compile_args)
            logits = compiled(ids).logits
    first_output = time.perf_counter() - start
    from weightcache.torch_compile import torch_cache_counters

    handle.close()
    return {
        "first_output_s": round(first_output, 3),
        "logits_sha256": hashlib.sha256(logits.float().contiguous().numpy().tobytes()).hexdigest(),
        "weights": handle.fingerprint.digest,
        "source": handle.source,
        "stats": None if stats is None else _stats(stats),
        "counters": torch_cache_counters(),
    }


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


def run_worker(
    checkpoint: Path,
    socket_dir: Path,
    cache_dir: Path,
    *,
    keeper: bool,
    options: dict[str, Any] | None = None,
    dtype: str | None = None,
    timeout: float = 600,
) -> dict[str, Any]:
    """One fresh worker process with ``cache_dir`` as its inductor cache; its report plus its wall time."""
    env = {
        **os.environ,
        "TORCHINDUCTOR_CACHE_DIR": str(cache_dir),
        "TRITON_CACHE_DIR": str(cache_dir / "triton"),
        "TORCHINDUCTOR_FX_GRAPH_CACHE": "1",
        "TORCHINDUCTOR_AUTOGRAD_CACHE": "1",
    }
    cmd = [sys.executable, __file__, "worker", "--checkpoint", str(checkpoint), "--socket-dir", str(socket_dir)]
    cmd += ["--options", json.dumps(options or {})] + (["--keeper"] if keeper else [])
    cmd += ["--dtype", dtype] if dtype else []
    started = time.perf_counter()
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=timeout)
    wall = time.perf_counter() - started
    if out.returncode != 0:
        raise RuntimeError(f"worker failed ({out.returncode}):\n{out.stderr[-4000:]}")
    report: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    report["wall_s"] = round(wall, 3)
    return report


def bench(workdir: Path, runs: int, layers: int, hidden: int) -> dict[str, Any]:
    from weightcache.client import KeeperConnection, ensure_keeper, stop_keeper

    workdir.mkdir(parents=True, exist_ok=True)
    checkpoint = make_checkpoint(workdir / "ckpt", layers, hidden)
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-bench-", dir="/tmp")) / "s"
    ensure_keeper(socket_dir)
    results: dict[str, list[dict[str, Any]]] = {way: [] for way in WAYS}
    try:
        local = workdir / "local-cache"
        shutil.rmtree(local, ignore_errors=True)
        run_worker(checkpoint, socket_dir, local, keeper=False)  # fills the local cache: what "local" reuses
        publisher = run_worker(checkpoint, socket_dir, workdir / "publish-cache", keeper=True)
        shutil.rmtree(workdir / "publish-cache", ignore_errors=True)
        for _ in range(runs):
            for way in WAYS:
                if way == "local":  # the directory the cold run above filled, as it is
                    results[way].append(run_worker(checkpoint, socket_dir, local, keeper=False))
                    continue
                fresh = workdir / f"{way}-cache"
                shutil.rmtree(fresh, ignore_errors=True)
                results[way].append(run_worker(checkpoint, socket_dir, fresh, keeper=way == "keeper"))
                shutil.rmtree(fresh, ignore_errors=True)
        hashes = {r["logits_sha256"] for rs in results.values() for r in rs} | {publisher["logits_sha256"]}
        artifact_bytes = publisher["stats"]["published_bytes"]
    finally:
        stop_keeper(KeeperConnection.connect(socket_dir), wait=10)
        shutil.rmtree(socket_dir.parent, ignore_errors=True)
    return {
        "layers": layers,
        "hidden": hidden,
        "runs": runs,
        "bitwise_equal": len(hashes) == 1,
        "artifact_bytes": artifact_bytes,
        "median_wall_s": {way: statistics.median(r["wall_s"] for r in rs) for way, rs in results.items()},
        "median_first_output_s": {
            way: statistics.median(r["first_output_s"] for r in rs) for way, rs in results.items()
        },
        "keeper_stats": [r["stats"] for r in results["keeper"]],
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
    w.add_argument("--keeper", action="store_true")
    b = sub.add_parser("bench")
    b.add_argument("--workdir", type=Path, default=Path("/tmp/wc-compile-bench"))
    b.add_argument("--runs", type=int, default=5)
    b.add_argument("--layers", type=int, default=1)
    b.add_argument("--hidden", type=int, default=64)
    b.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    if args.command == "worker":
        print(json.dumps(worker(args)))
        return 0
    result = bench(args.workdir, args.runs, args.layers, args.hidden)
    summary = {k: v for k, v in result.items() if k not in ("runs_detail", "keeper_stats")}
    print(json.dumps(summary, indent=2))
    if args.json:
        args.json.write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The main job of weightcache, on CPU: an engine loads a model from disk once; a restarted engine attaches it.

Three separate processes play the engine, each building the model on the meta device:

1. mode "off"    - the ordinary way: read the safetensors checkpoint from disk.
2. mode "daemon" - first start with weightcache: read from disk, publish into the keeper (spawned on demand).
3. mode "client" - the restart: attach the keeper's copy zero-copy, read nothing from disk.

It prints the time each took and checks that all three compute bitwise-identical outputs.

    python examples/demo.py [--size-mib 512] [--keep]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch
from toymodel import make_checkpoint, meta_model

import weightcache as wc
from weightcache.checkpoint import drop_page_cache

#: Width of the model's residual MLP blocks (examples/toymodel.py): big enough that reading it takes visible time.
HIDDEN = 2048


def engine(checkpoint: str, mode: str, socket_dir: str) -> None:
    """One engine start: build on meta, attach, run one forward pass. Prints a JSON line."""
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    model = meta_model(checkpoint)
    handle = wc.attach(model, checkpoint, mode=mode, socket_dir=socket_dir)  # type: ignore[arg-type]
    t1 = time.perf_counter()
    torch.manual_seed(1)
    with torch.no_grad():
        out = model(torch.randn(4, HIDDEN, dtype=torch.bfloat16))
    t2 = time.perf_counter()
    result = {
        "mode": mode,
        "source": handle.source,
        "weights_s": t1 - t0,
        "first_output_s": t2 - t0,
        "output": hashlib.sha256(out.float().numpy().tobytes()).hexdigest()[:16],
    }
    handle.close()
    print(json.dumps(result), flush=True)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-mib", type=int, default=512, help="checkpoint size (default 512 MiB)")
    parser.add_argument("--keep", action="store_true", help="leave the keeper running afterwards")
    parser.add_argument("--engine", nargs=3, metavar=("CKPT", "MODE", "SOCKET_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.engine:
        engine(*args.engine)
        return 0

    work = Path(tempfile.mkdtemp(prefix="wc-demo-"))
    checkpoint, socket_dir = work / "checkpoint", work / "sock"
    print(f"writing a {args.size_mib} MiB bf16 checkpoint to {checkpoint} ...", flush=True)
    layers = make_checkpoint(checkpoint, args.size_mib, HIDDEN)
    print(f"  {layers} MLP blocks of width {HIDDEN}", flush=True)

    def start(mode: str) -> dict[str, object]:
        out = subprocess.run(
            [sys.executable, __file__, "--engine", str(checkpoint), mode, str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=600,
        )
        if out.returncode != 0:
            raise SystemExit(f"engine in mode {mode} failed:\n{out.stderr}")
        return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]

    try:
        drop_page_cache(checkpoint)
        off = start("off")
        drop_page_cache(checkpoint)
        first = start("daemon")
        restart = start("client")
        print()
        print(f"{'engine start':<44}{'weights ready':>15}{'first output':>15}  source  output")
        rows = [
            ("1. plain load from disk (mode off)", off),
            ("2. first start, publishes (mode daemon)", first),
            ("3. restarted engine attaches (mode client)", restart),
        ]
        for label, r in rows:
            w, f = r["weights_s"] * 1e3, r["first_output_s"] * 1e3  # type: ignore[operator]
            print(f"{label:<44}{w:>12.1f} ms{f:>12.1f} ms  {r['source']:<6}  {r['output']}")
        same = off["output"] == first["output"] == restart["output"]
        disk_ms, attach_ms = off["weights_s"] * 1e3, restart["weights_s"] * 1e3  # type: ignore[operator]
        print(
            f"\nsame model, side by side: load from disk {disk_ms:.1f} ms | attach from the cache {attach_ms:.1f} ms "
            f"({disk_ms / attach_ms:.1f}x)"
        )
        speedup = off["first_output_s"] / restart["first_output_s"]  # type: ignore[operator]
        print(
            f"the restarted engine has its first output {speedup:.1f}x sooner than a load from disk "
            f"(safetensors maps the file lazily, so part of its load happens during the first forward pass); "
            f"outputs identical: {same}"
        )
        print("\nwhat the keeper holds (`weightcache ls`):")
        subprocess.run([sys.executable, "-m", "weightcache", "ls", "--socket-dir", str(socket_dir)], check=False)
        return 0 if same and restart["source"] == "cache" else 1
    finally:
        if not args.keep:
            # wait: the keeper writes into socket_dir until it exits, so remove the directory only then
            with contextlib.suppress(wc.WeightCacheError):  # no keeper (any more): nothing to stop
                wc.Cache(socket_dir).stop(wait=30)
            shutil.rmtree(work, ignore_errors=True)
        else:
            print(f"\nkeeper left running: weightcache ls --socket-dir {socket_dir}")


if __name__ == "__main__":
    raise SystemExit(main())

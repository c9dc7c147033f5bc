"""What does a restarted engine's first attach cost in a new process, imports included? (CPU)

The attach benchmarks (``weightcache bench``) time repeated attaches in one process that has already imported
weightcache's torch side; a restarted engine pays that import once. This writes a synthetic bf16 checkpoint,
publishes it into a private keeper, then starts ``runs`` fresh processes that each import torch and build the
model on the meta device (not timed), then time the first use of ``weightcache.attach`` (the import of its
torch side) and ``attach(mode="client")`` itself. One JSON line per process.

python benchmarks/first_attach.py [GiB] [tensors] [runs]
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import weightcache as wc
from weightcache.tools.bench import layout
from weightcache.tools.bench_restart import write_checkpoint

ENGINE = r"""
import json, sys, time, torch
from weightcache.tools.bench import meta_holder
ckpt, sock = sys.argv[1], sys.argv[2]
shapes = json.loads(open(ckpt + "/config.json").read())["shapes"]
model = meta_holder(shapes, torch.bfloat16, prefix="w")
t0 = time.perf_counter()
import weightcache as wc
attach = wc.attach  # the first use imports the torch side
t1 = time.perf_counter()
handle = attach(model, ckpt, mode="client", socket_dir=sock, strict=True)
t2 = time.perf_counter()
ms = lambda s: round(s * 1e3, 1)
times = {"import_ms": ms(t1 - t0), "attach_ms": ms(t2 - t1), "total_ms": ms(t2 - t0)}
print(json.dumps({**times, "source": handle.source}))
"""


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 2.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 500
    runs = int(sys.argv[3]) if len(sys.argv) > 3 else 7
    tmp = Path(tempfile.mkdtemp(prefix="wc-first-attach-"))
    sock = tmp / "sock"
    try:
        ckpt = tmp / "ckpt"
        write_checkpoint(ckpt, layout(int(gib * 2**30), n, 2), "bfloat16", progress=False)
        wc.preload(ckpt, socket_dir=sock, digests=False).close()
        for _ in range(runs):
            out = subprocess.run(
                [sys.executable, "-c", ENGINE, str(ckpt), str(sock)], capture_output=True, text=True, check=True
            )
            print(out.stdout.strip().splitlines()[-1], flush=True)
    finally:
        wc.Cache(sock).stop(wait=30)
        shutil.rmtree(tmp, ignore_errors=True)
    print(json.dumps({"gib": gib, "tensors": n, "runs": runs}))


if __name__ == "__main__":
    main()

"""Where does an engine start go in modes off and daemon? (a diagnostic: cProfile of ``attach`` in a fresh
process, page cache dropped, no keeper running before mode daemon)

python benchmarks/profile_start.py [GiB] [tensors]
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

import weightcache as wc
from weightcache.checkpoint import drop_page_cache
from weightcache.tools.bench import layout
from weightcache.tools.bench_restart import write_checkpoint

ENGINE = r"""
import cProfile, gc, json, pstats, sys, time, torch
import weightcache as wc
from weightcache.tools.bench import meta_holder
ckpt, sock, mode = sys.argv[1], sys.argv[2], sys.argv[3]
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
shapes = json.loads(open(ckpt + "/config.json").read())["shapes"]
model = meta_holder(shapes, torch.bfloat16, prefix="w")
attach = wc.attach
gc.collect()
pr = cProfile.Profile(); pr.enable()
t0 = time.perf_counter(); h = attach(model, ckpt, mode=mode, device="cuda:0", socket_dir=sock); torch.cuda.synchronize()
dt = time.perf_counter() - t0
pr.disable()
print(f"mode {mode}: attach() {dt:.3f} s, source {h.source}")
pstats.Stats(pr).sort_stats("cumulative").print_stats(35)
"""


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    work = Path(tempfile.mkdtemp(prefix="wc-start-"))
    ckpt = work / "ckpt"
    write_checkpoint(ckpt, layout(int(gib * 2**30), n, 2), "bfloat16", False)
    sock = work / "s"
    for mode in ("off", "daemon"):
        drop_page_cache(ckpt, system=True)
        out = subprocess.run([sys.executable, "-c", ENGINE, str(ckpt), str(sock), mode], capture_output=True, text=True)
        print(out.stdout[-9000:], out.stderr[-3000:], flush=True)
    wc.Cache(sock).stop()


if __name__ == "__main__":
    main()

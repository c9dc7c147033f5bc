# ruff: noqa: E501  (the profiled client is an embedded script of long one-liners)
"""Where does GPU load and attach time go? (a diagnostic; prints timings and profiles)

python benchmarks/profile_gpu.py [GiB] [tensors]
"""

from __future__ import annotations

import cProfile
import gc
import pstats
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

import weightcache as wc
from weightcache import loader
from weightcache.checkpoint import drop_page_cache
from weightcache.tools.bench import layout
from weightcache.tools.bench_restart import write_checkpoint

CLIENT = r"""
import cProfile, gc, json, os, pstats, sys, time, torch
import weightcache as wc
from weightcache.client import KeeperConnection
from weightcache.manifest import Manifest
from weightcache.tools.bench import meta_holder
from weightcache.views import map_entry
ckpt, sock = sys.argv[1], sys.argv[2]
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
shapes = json.loads(open(ckpt + "/config.json").read())["shapes"]
attach = wc.attach
for rep in range(3):
    model = meta_holder(shapes, torch.bfloat16, prefix="w")
    gc.collect()
    t = {}
    t0 = time.perf_counter()
    fp = wc.Fingerprint.create(ckpt, device="cuda:0"); t["fingerprint"] = time.perf_counter() - t0
    t1 = time.perf_counter(); conn = KeeperConnection.connect(sock); t["connect"] = time.perf_counter() - t1
    t1 = time.perf_counter(); reply, fds = conn.get(fp.digest, fp.placement); t["request"] = time.perf_counter() - t1
    t1 = time.perf_counter(); m = Manifest.from_keeper(reply.manifest); t["parse"] = time.perf_counter() - t1
    t1 = time.perf_counter(); views = map_entry(m, fds); t["map_views"] = time.perf_counter() - t1
    t1 = time.perf_counter(); wc.bind(model, views, device="cuda:0"); torch.cuda.synchronize(); t["bind"] = time.perf_counter() - t1
    print(json.dumps({k: round(v * 1e3, 2) for k, v in t.items()} | {"segments": len(m.segments)}), flush=True)
    for fd in fds: os.close(fd)  # the mappings keep the memory; the lease ends with the connection
    conn.close()
model = meta_holder(shapes, torch.bfloat16, prefix="w")
gc.collect()
pr = cProfile.Profile(); pr.enable()
t0 = time.perf_counter(); h = attach(model, ckpt, mode="client", device="cuda:0", socket_dir=sock); torch.cuda.synchronize()
dt = time.perf_counter() - t0
pr.disable()
print("attach() total ms", round(dt * 1e3, 2), h.source)
pstats.Stats(pr).sort_stats("tottime").print_stats(25)
"""


def main() -> None:
    gib = float(sys.argv[1]) if len(sys.argv) > 1 else 1.0
    n = int(sys.argv[2]) if len(sys.argv) > 2 else 3000
    work = Path(tempfile.mkdtemp(prefix="wc-prof-"))
    ckpt = work / "ckpt"
    shapes = layout(int(gib * 2**30), n, 2)
    write_checkpoint(ckpt, shapes, "bfloat16", False)
    torch.zeros(1, device="cuda:0")
    t0 = time.perf_counter()
    bufs = torch.empty(loader.STAGING_BUFFERS * loader.CHUNK_BYTES, dtype=torch.uint8).pin_memory()
    print("pin staging buffers ms", round((time.perf_counter() - t0) * 1e3, 1))
    del bufs
    for _ in range(2):
        drop_page_cache(ckpt, system=True)
        pr = cProfile.Profile()
        pr.enable()
        t0 = time.perf_counter()
        state = loader.load_to_device(ckpt, torch.device("cuda:0"))
        dt = time.perf_counter() - t0
        pr.disable()
        print(f"load_to_device {dt:.3f} s = {gib * 2**30 / dt / 1e9:.2f} GB/s")
        del state
    pstats.Stats(pr).sort_stats("tottime").print_stats(15)
    sock = work / "s"
    cache = wc.Cache(sock, spawn=True)
    model_fp = wc.Fingerprint.create(ckpt, device="cuda:0")
    drop_page_cache(ckpt, system=True)
    t0 = time.perf_counter()
    state = loader.load_to_device(ckpt, torch.device("cuda:0"))
    t1 = time.perf_counter()
    h = cache.put(model_fp, state, consume=True)
    t2 = time.perf_counter()
    print(f"daemon parts: load {t1 - t0:.3f} s, put {t2 - t1:.3f} s ({len(h.manifest.segments)} segments)")
    h.close()
    gc.collect()
    out = subprocess.run([sys.executable, "-c", CLIENT, str(ckpt), str(sock)], capture_output=True, text=True)
    print(out.stdout[-6000:], out.stderr[-3000:])
    t0 = time.perf_counter()
    subprocess.run([sys.executable, "-c", "import weightcache.keeper"], check=True)
    print("python + import weightcache.keeper s", round(time.perf_counter() - t0, 3))
    cache.stop()


if __name__ == "__main__":
    main()

"""How long does pinning the loader's staging buffers take, alone and while the kernel reads a file ahead?
(a diagnostic for the fixed cost of a GPU load)

python benchmarks/probe_pin.py FILE
"""

from __future__ import annotations

import subprocess
import sys

CHILD = r"""
import sys, time, torch
from weightcache import loader
from weightcache.checkpoint import drop_page_cache
from pathlib import Path
f = Path(sys.argv[1]); how = sys.argv[2]
torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
nbytes = loader.STAGING_BUFFERS * loader.CHUNK_BYTES
if how == "prefetching":
    drop_page_cache(f.parent, system=True)
    loader.prefetch_head([f])
t0 = time.perf_counter()
if how == "register":
    buf = torch.empty(nbytes, dtype=torch.uint8)
    torch.cuda.cudart().cudaHostRegister(buf.data_ptr(), nbytes, 0)
else:
    buf = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
t1 = time.perf_counter()
buf2 = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
t2 = time.perf_counter()
print(f"{how:12s} first pin {(t1 - t0) * 1e3:7.1f} ms, second pin {(t2 - t1) * 1e3:7.1f} ms ({nbytes >> 20} MiB each)")
"""

if __name__ == "__main__":
    for how in ("alone", "prefetching", "register", "alone", "prefetching"):
        out = subprocess.run([sys.executable, "-c", CHILD, sys.argv[1], how], capture_output=True, text=True)
        print(out.stdout.strip(), out.stderr.strip()[-500:], flush=True)

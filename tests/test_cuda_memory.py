"""GPU memory of a first start (marked cuda): mode daemon releases what it loaded while it publishes.

- An adapter-style engine (examples/custom_adapter.py: fused q/k/v, post-processed linear layers) on cuda:0 in
  mode daemon's first start peaks at no more than the weights plus one segment plus 5 % of device memory.
- ``weightcache load --device cuda:0`` peaks there too, and its host memory grows by at most one segment plus
  1 GiB (it streams the files into the segments instead of reading the checkpoint into host memory).

Device memory is sampled in a thread of this process (``cudaMemGetInfo`` every ~0.5 ms: it sees every
allocation on the device, the VMM segments too, which the caching allocator's counters do not); the engine's
own ``torch.cuda.max_memory_allocated`` is reported beside it. The checkpoint is ``WEIGHTCACHE_PEAK_GIB`` GiB
(default 16) of float32 q/k/v/o projections, dim 8192.

Run on a GPU machine with: python -m pytest -m cuda -v tests/test_cuda_memory.py
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

import weightcache as wc
from weightcache.publish import default_segment_bytes

pytestmark = pytest.mark.cuda
HERE = Path(__file__).parent
ROOT = HERE.parent
GiB = 1 << 30
DIM = 8192


class DeviceMemoryWatch:
    """The most device memory in use on GPU 0 while it runs, sampled from a thread."""

    def __init__(self) -> None:
        self.total = torch.cuda.mem_get_info(0)[1]
        self.baseline = self.used()
        self.peak = self.baseline
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def used(self) -> int:
        free, total = torch.cuda.mem_get_info(0)
        return total - free

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, self.used())
            time.sleep(0.0005)

    def __enter__(self) -> DeviceMemoryWatch:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, self.used())

    @property
    def growth(self) -> int:
        return self.peak - self.baseline


@pytest.fixture(scope="module")
def big_checkpoint(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A ToyEngine checkpoint of WEIGHTCACHE_PEAK_GIB GiB (4 float32 DIM x DIM matrices = 1 GiB per layer), made
    in WEIGHTCACHE_PEAK_DIR if that is set (and reused from there when it exists), else in a temporary directory."""
    from safetensors.torch import save_file

    layers = int(os.environ.get("WEIGHTCACHE_PEAK_GIB", "16"))
    given = os.environ.get("WEIGHTCACHE_PEAK_DIR")
    path = Path(given) if given else tmp_path_factory.mktemp("big") / "checkpoint"
    if (path / "config.json").exists():
        yield path
        return
    path.mkdir(parents=True, exist_ok=True)
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {}
    for i in range(layers):
        for n in ("q_proj", "k_proj", "v_proj", "o_proj"):
            state[f"layers.{i}.{n}.weight"] = (torch.randn(DIM, DIM, device="cuda", generator=g) / DIM**0.5).cpu()
    save_file(state, str(path / "model.safetensors"))
    del state
    (path / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "dim": DIM, "layers": layers}))
    yield path


def weights_bytes(checkpoint: Path) -> int:
    layers = json.loads((checkpoint / "config.json").read_text())["layers"]
    return layers * 4 * DIM * DIM * 4


def segment_bytes(checkpoint: Path) -> int:
    """The largest segment a publish of these weights makes on a GPU (3 fused projections are its largest tensor)."""
    return default_segment_bytes("GPU-x", [3 * DIM * DIM * 4])


def run(args: list[str], timeout: float = 600) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": f"{ROOT}:{os.environ.get('PYTHONPATH', '')}"}
    return subprocess.run(args, capture_output=True, text=True, timeout=timeout, env=env)


ENGINE = """
import json, sys, torch
sys.path.insert(0, sys.argv[4])
torch.zeros(1, device="cuda:0")
import custom_adapter
result = custom_adapter.serve(sys.argv[1], sys.argv[2], sys.argv[3], "cuda:0")
result["max_memory_allocated"] = torch.cuda.max_memory_allocated(0)
print("RESULT " + json.dumps(result))
"""


def test_adapter_daemon_first_start_peaks_at_weights_plus_one_segment(big_checkpoint: Path, socket_dir: Path) -> None:
    weights, segment = weights_bytes(big_checkpoint), segment_bytes(big_checkpoint)
    args = [sys.executable, "-c", ENGINE, str(big_checkpoint), "daemon", str(socket_dir), str(ROOT / "examples")]
    with DeviceMemoryWatch() as watch:
        out = run(args)
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    report = (
        f"peak growth {watch.growth / GiB:.2f} GiB; weights {weights / GiB:.2f} GiB, segment {segment / GiB:.2f} "
        f"GiB, 5 % of the device {0.05 * watch.total / GiB:.2f} GiB; engine max_memory_allocated "
        f"{result['max_memory_allocated'] / GiB:.2f} GiB"
    )
    print(report)
    assert result["source"] == "cache" and result["layers_post_processed_here"] > 0
    assert watch.growth <= weights + segment + 0.05 * watch.total, report
    assert result["max_memory_allocated"] <= weights + segment + 0.05 * watch.total, report
    # The entry stays in the keeper (which holds fds only: no device memory of its own beyond the segments).
    [entry] = wc.Cache(socket_dir).entries()
    assert entry.bytes >= weights
    client = run([sys.executable, "-c", ENGINE, str(big_checkpoint), "client", str(socket_dir), str(ROOT / "examples")])
    assert client.returncode == 0, client.stderr[-4000:]
    attached = json.loads(client.stdout.split("RESULT ", 1)[1])
    assert attached["source"] == "cache" and attached["layers_post_processed_here"] == 0
    assert attached["output"] == result["output"]


# VmHWM, not ru_maxrss: the kernel carries the parent's peak RSS into a child's ru_maxrss across fork and exec
# (the test process itself held the whole checkpoint while writing it), while VmHWM belongs to the new image.
LOAD = """
import json, sys, torch
torch.zeros(1, device="cuda:0")
def status(field):
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) for line in f if line.startswith(field + ":")) * 1024
before = status("VmRSS")
from weightcache.tools.cli import main
code = main(["load", sys.argv[1], "--device", "cuda:0", "--socket-dir", sys.argv[2]])
print("RESULT " + json.dumps({"status": code, "rss_before": before, "rss_peak": status("VmHWM")}))
"""


def test_load_on_a_gpu_peaks_at_weights_plus_one_segment_on_device_and_little_on_the_host(
    big_checkpoint: Path, socket_dir: Path
) -> None:
    weights, segment = weights_bytes(big_checkpoint), segment_bytes(big_checkpoint)
    with DeviceMemoryWatch() as watch:
        out = run([sys.executable, "-c", LOAD, str(big_checkpoint), str(socket_dir)])
    assert out.returncode == 0, out.stderr[-4000:]
    result = json.loads(out.stdout.split("RESULT ", 1)[1])
    host = result["rss_peak"] - result["rss_before"]
    report = (
        f"device peak growth {watch.growth / GiB:.2f} GiB (weights {weights / GiB:.2f} GiB, segment "
        f"{segment / GiB:.2f} GiB, 5 % {0.05 * watch.total / GiB:.2f} GiB); host RSS growth {host / GiB:.2f} GiB"
    )
    print(report)
    assert result["status"] == 0 and "published" in out.stdout
    assert watch.growth <= weights + segment + 0.05 * watch.total, report
    assert host <= segment + GiB, report
    [entry] = wc.Cache(socket_dir).entries()
    assert entry.leases == 0 and entry.bytes >= weights

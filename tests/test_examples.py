"""The examples, run as a user runs them (a subprocess each, --json), and what their results must show.

Each runs with TMPDIR set to a fresh short directory, so the test can check that the example removed its
temporary directories and stopped its keeper. Timing targets are not asserted here (they belong in
docs/benchmarks.md); only that the times were measured.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import wait_until

EXAMPLES = Path(__file__).parent.parent / "examples"


def processes_mentioning(text: str) -> list[int]:
    pids = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if text.encode() in cmdline:
            pids.append(int(pid))
    return pids


@pytest.fixture
def tmp() -> Iterator[Path]:
    """A short temporary directory (the keeper's socket path must fit in 107 bytes), for the example's TMPDIR."""
    path = Path(tempfile.mkdtemp(prefix="wc-ex-", dir="/tmp"))
    yield path
    # After a failure or a timeout (which kills only the example's own process), its engines and its detached
    # keeper may still run: end them, so a failed test leaves no load behind.
    for pid in processes_mentioning(str(path)):
        if pid != os.getpid():
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
    shutil.rmtree(path, ignore_errors=True)


def run_example(name: str, tmp: Path, *args: str, timeout: float = 600) -> dict[str, Any]:
    """Run examples/<name> --json; return its JSON, after checking it cleaned up after itself."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / name), "--json", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert out.returncode == 0, f"{name} failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    # Processes first: a keeper or engine still running could still write into tmp.
    assert wait_until(lambda: processes_mentioning(str(tmp)) == [], timeout=10), "a keeper or engine survived"
    assert list(tmp.iterdir()) == [], "the example left temporary files behind"
    return json.loads(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return]


def test_demo_shows_disk_and_attach_side_by_side(tmp: Path) -> None:
    """`make demo` (examples/demo.py): three engine processes; the restart attaches; outputs identical."""
    out = subprocess.run(
        [sys.executable, str(EXAMPLES / "demo.py"), "--size-mib", "32"],
        capture_output=True,
        text=True,
        timeout=600,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert out.returncode == 0, f"demo failed ({out.returncode}):\n{out.stdout[-2000:]}\n{out.stderr[-4000:]}"
    rows = {line[:2]: line.split() for line in out.stdout.splitlines() if line[:2] in ("1.", "2.", "3.")}
    assert rows["1."][-2] == "disk" and rows["2."][-2] == "cache" and rows["3."][-2] == "cache", out.stdout
    assert len({r[-1] for r in rows.values()}) == 1, "the three engines' outputs differ"
    assert "side by side: load from disk" in out.stdout and "attach from the cache" in out.stdout
    assert "outputs identical: True" in out.stdout
    assert wait_until(lambda: processes_mentioning(str(tmp)) == [], timeout=10), "the demo's keeper survived"
    assert list(tmp.iterdir()) == [], "the demo left temporary files behind"


def test_two_engines_share_one_copy(tmp: Path) -> None:
    # 64 MiB: the example's one-copy check allows 10 % of the weights for everything else engine 2 allocates while
    # attaching (~3.5 MiB here, mostly the modules attach imports, whatever the size), which 32 MiB left no room for.
    r = run_example("two_engines.py", tmp, "--size-mib", "64")
    weights = r["weight_bytes"]
    assert weights > 60 * 2**20
    assert r["sources"] == ["cache", "cache"]
    assert r["outputs_identical"] and len(r["outputs"]) == 4
    first, second = r["engines"]
    assert first["mode"] == "daemon" and second["mode"] == "client"
    # Both map the same memfd(s)...
    assert r["same_inodes"] and r["weight_mappings"][0]["inodes"]
    # ...the weight pages are resident in both and shared, not private to either...
    for m in r["weight_mappings"]:
        assert m["shared"] >= 0.95 * weights and m["private"] < 0.05 * weights
    # ...and the second engine's private memory grew by far less than the weights (a copy would be all of them).
    assert second["private_growth_bytes"] < 0.25 * weights
    # The measurement can see a copy: while engine 1 was the only process mapping the weights, they counted as
    # its private memory.
    assert first["private_growth_bytes"] > 0.9 * weights
    assert r["one_copy"]


def test_hot_standby_takes_over(tmp: Path) -> None:
    r = run_example("hot_standby.py", tmp, "--size-mib", "16", "--repeat", "2")
    assert r["repeat"] == 2 and len(r["runs"]) == 2
    for run in r["runs"]:
        assert run["primary_source"] == "cache" and run["standby_source"] == "cache"
        assert run["cold_source"] == "cache" and run["disk_source"] == "disk"
        assert run["new_leader_is_standby"] and run["entry_resident_after_kill"]
        # The standby's first result came after the kill, and after it took the lock.
        assert 0 <= run["lock_handover_ms"] < run["takeover_ms"]
        assert run["standby_forward_ms"] > 0 and run["cold_attach_ms"] > 0 and run["disk_ms"] > 0
        assert len(set(run["outputs"].values())) == 1
    for key in ("takeover_ms", "cold_attach_ms", "disk_ms"):
        s = r[key]
        assert 0 < s["min"] <= s["median"] <= s["max"]
    assert r["standby_served"] and r["outputs_identical"]
    assert r["entry_resident_after_kill"] and r["one_keeper_throughout"]


def test_inspect_cache_reads_the_quantized_entry(tmp: Path) -> None:
    r = run_example("inspect_cache.py", tmp)
    assert r["source"] == "cache" and r["quant"] == "fp8_block"
    [entry] = r["entries"]
    assert entry["quant"] == "fp8_block" and entry["digest"] == r["published"][:12] and entry["bytes"] > 0
    table = {t["name"]: t for t in r["tensor_table"]}
    fp8 = [n for n, t in table.items() if t["dtype"] == "float8_e4m3fn"]
    assert len(fp8) == 4
    for name in fp8:
        scale = table[f"{name}_scale_inv"]
        assert scale["dtype"] == "float32"
        assert [s * 128 for s in scale["shape"]] == table[name]["shape"]
        assert table[name]["bytes"] == table[name]["shape"][0] * table[name]["shape"][1]  # one byte per weight
    # FP8 e4m3 keeps 3 mantissa bits: a few percent of relative error, never zero, never garbage.
    assert set(r["quantization_error"]) == set(fp8)
    for e in r["quantization_error"].values():
        assert e["block"] == [128, 128]
        assert 0.005 < e["relative_error"] < 0.06 and 0.005 < e["first_block_relative_error"] < 0.06
    ro = r["read_only"]
    assert ro["mapping_perms"] == ["rw-p"]  # private: copy-on-write, never a shared writable mapping
    assert ro["seals"] == ["grow", "shrink", "write"]
    assert ro["write_through_fd"] == "EPERM"
    assert ro["fresh_attach_sees_original"] and ro["fresh_attach_verifies"]
    assert ro["written_mapping_verifies"] is False  # the write did happen, in the writer's own page


def test_custom_adapter_client_attaches_post_processed_weights(tmp: Path) -> None:
    r = run_example("custom_adapter.py", tmp)
    daemon, client = r["runs"]
    assert daemon["mode"] == "daemon" and client["mode"] == "client"
    assert daemon["source"] == client["source"] == "cache"
    assert daemon["layers_post_processed_here"] == 8 and client["layers_post_processed_here"] == 0
    assert "toyengine" in client["registered"] and client["engine"] == "toyengine"
    assert client["tensors"] == ["layers.0.o.weight_t", "layers.0.qkv.weight_t"]  # the post-processed layout
    assert r["outputs_identical"]


@pytest.mark.cuda
def test_two_engines_share_one_copy_on_gpu(tmp: Path) -> None:
    r = run_example("two_engines.py", tmp, "--device", "cuda:0", "--size-mib", "256")
    assert r["sources"] == ["cache", "cache"] and r["outputs_identical"]
    assert r["second_attach_gpu_bytes"] < 0.01 * r["weight_bytes"] and r["one_copy"]


@pytest.mark.cuda
def test_hot_standby_takes_over_on_gpu(tmp: Path) -> None:
    r = run_example("hot_standby.py", tmp, "--device", "cuda:0", "--repeat", "2", "--no-disk")
    assert r["standby_served"] and r["outputs_identical"] and r["entry_resident_after_kill"]
    for run in r["runs"]:
        assert 0 <= run["lock_handover_ms"] < run["takeover_ms"] and run["cold_source"] == "cache"

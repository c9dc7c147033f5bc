"""A tensor-parallel restart on the CPU: n rank processes publish and attach their shards through one keeper, all
at once (tests/ranks.py; the same on GPUs in tests/test_cuda.py), and ``weightcache bench --ranks``."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from ranks import start_together, survive_keeper_kill

import weightcache as wc
from weightcache.tools import bench_ranks
from weightcache.tools.bench import marker_checkpoint

RANKS = 4


def test_four_ranks_start_together_and_each_attaches_its_own_shard(tmp_path: Path, socket_dir: Path) -> None:
    start_together(tmp_path, socket_dir, "cpu", RANKS, [])


def test_ranks_holding_their_shards_republish_them_to_a_restarted_keeper(tmp_path: Path, socket_dir: Path) -> None:
    survive_keeper_kill(tmp_path, socket_dir, "cpu", RANKS, [])


def test_a_failing_rank_is_reported_with_its_stderr(tmp_path: Path, socket_dir: Path) -> None:
    """No keeper serves socket_dir: the rank's strict attach fails, and the error names the rank and says why."""
    marker = marker_checkpoint(tmp_path, 0.001, 1, "bfloat16")
    spec = bench_ranks.rank_spec(marker, socket_dir, "cpu", "bfloat16", [256])
    with pytest.raises(wc.WeightCacheError, match=r"rank 1 \(attach\) failed: exit status 1 (.|\n)*KeeperUnavailable"):
        bench_ranks.run_ranks("attach", 2, spec, [], ranks=[1])


def test_rank_counts_default_to_the_devices() -> None:
    assert bench_ranks.plan_ranks(None, "cpu", []) == [2]
    assert bench_ranks.plan_ranks(None, "cuda:0", ["GPU-a", "GPU-b", "GPU-c"]) == [3]
    assert bench_ranks.plan_ranks([1, 2, 8], "cuda:0", ["GPU-a"]) == [1, 2, 8]
    assert bench_ranks.per_device(8, ["GPU-a", "GPU-b"]) == 4 and bench_ranks.per_device(3, []) == 3
    assert bench_ranks.rank_env(3, ["GPU-a", "GPU-b"])["CUDA_VISIBLE_DEVICES"] == "GPU-b"
    assert bench_ranks.rank_env(3, [])["CUDA_VISIBLE_DEVICES"] == ""
    with pytest.raises(wc.WeightCacheError, match="--ranks takes counts of 1 or more"):
        bench_ranks.plan_ranks([2, 0], "cpu", [])
    with pytest.raises(wc.WeightCacheError, match="sees no GPU"):
        bench_ranks.plan_ranks(None, "cuda:0", [])


def test_bench_ranks_runs_small_on_cpu(tmp_path: Path) -> None:
    """The report's fields, not its timings: per rank and together against alone, the keeper's CPU time, bitwise
    identity, and the keeper kill with re-publication."""
    report = tmp_path / "results" / "ranks.json"
    args = ["--ranks", "2", "--sizes", "0.01", "--tensors", "30", "--repeat", "1", "--json", str(report)]
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "bench", *args], capture_output=True, text=True, timeout=300
    )
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2 ranks on the CPU" in out.stdout and "identical True" in out.stdout and "rank 1: attach" in out.stdout
    data = json.loads(report.read_text())
    assert data["device"] == "cpu" and data["gpus"] == [] and data["goal_ratio"] == 1.5
    [row] = data["results"]
    assert (row["ranks"], row["gpus"], row["shared_gpu"], row["tensors"]) == (2, 0, False, 30)
    assert row["identical"] is True and row["shards_differ"] is True
    assert [p["parallel"] for p in row["published"]] == [[["tp", 0, 2]], [["tp", 1, 2]]]
    [alone] = row["alone"]["rounds"]
    [together] = row["together"]["rounds"]
    assert len(alone["runs"]) == 1 and [r["rank"] for r in together["runs"]] == [0, 1]
    assert all(r["source"] == "cache" for r in alone["runs"] + together["runs"])
    assert row["alone"]["attach_cpu_ms"]["median"] > 0 and row["per_rank"][0]["attach_cpu_ms"]["median"] > 0
    for column in ("attach_ms", "attach_cpu_ms", "slowest_ms", "skew_ms", "span_ms"):
        c = row["together"][column]
        assert 0 <= c["min"] <= c["median"] <= c["max"], column
    assert [r["rank"] for r in row["per_rank"]] == [0, 1] and row["per_rank"][1]["attach_ms"]["median"] > 0
    assert row["slowest_over_alone"] > 0 and isinstance(row["goal_met"], bool)
    keeper = row["keeper"]
    assert keeper["cpu_ms_per_attach"] >= 0 and keeper["tick_ms"] > 0 and len(keeper["cpu_ms_per_round"]) == 1
    kill = row["keeper_kill"]
    assert kill["republished"] is True and kill["identical"] is True and kill["holders_leased"] is True
    assert kill["sources"] == ["cache", "cache"] and kill["killed_pid"] != kill["keeper_pid"]


@pytest.mark.parametrize("flag", ["--restart", "--profile=/tmp/x", "--drop-caches", "--no-peer"])
def test_bench_ranks_refuses_flags_it_has_no_use_for(flag: str) -> None:
    """A flag the multi-rank benchmark would ignore is an error naming it, before anything runs."""
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "bench", "--ranks", "2", flag],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert out.returncode != 0 and f"{flag.split('=')[0]} does not go with --ranks" in out.stderr

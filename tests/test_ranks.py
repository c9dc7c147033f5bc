"""A tensor-parallel restart on the CPU: n rank processes publish and attach their shards through one keeper, all
at once (tests/ranks.py; the same on GPUs in tests/test_cuda.py), and ``weightcache bench --ranks``."""

from __future__ import annotations

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

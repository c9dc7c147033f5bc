"""Tensor-parallel restarts, shared by the CPU tests (tests/test_ranks.py) and the GPU tests (tests/test_cuda.py):
n rank processes, each seeing only its GPU (or none), publish and attach their shards through one real keeper,
started together by weightcache.tools.bench_ranks.RankGroup's barrier."""

from __future__ import annotations

import signal
import subprocess
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from conftest import start_keeper, wait_until

import weightcache as wc
from weightcache.tools import bench_ranks
from weightcache.tools.bench import layout, marker_checkpoint

#: Each rank's shard: 12 bf16 tensors, about 1 MiB (what bench's layout makes of it: norms and matrices).
SHAPES = layout(1 << 20, 12, 2)
#: How long holders may take to notice a new keeper and re-publish (they retry at most once a second).
REPUBLISH_S = 20.0


def spec(tmp_path: Path, socket_dir: Path, device: str) -> dict[str, Any]:
    marker = marker_checkpoint(tmp_path, 0.001, len(SHAPES), "bfloat16")
    return bench_ranks.rank_spec(marker, socket_dir, device, "bfloat16", SHAPES)


def entries(socket_dir: Path) -> list[wc.EntryInfo]:
    try:
        return wc.Cache(socket_dir).entries()
    except wc.KeeperUnavailable:
        return []


def check_shards(
    published: Sequence[dict[str, Any]], attached: Sequence[dict[str, Any]], n: int, gpus: Sequence[str]
) -> None:
    """Rank r attached its own shard from the cache, bitwise what its publisher filled, on the GPU it sees (or
    the CPU), and no two ranks' shards are alike."""
    assert [p["rank"] for p in published] == [a["rank"] for a in attached] == list(range(n))
    assert len({p["checksum"] for p in published}) == n, "every rank has a shard of its own"
    for rank, (p, a) in enumerate(zip(published, attached)):
        assert a["source"] == "cache" and a["checksum"] == p["checksum"], f"rank {rank}"
        assert a["parallel"] == p["parallel"] == [["tp", rank, n]]
        assert a["digest"] == p["digest"] and a["placement"] == p["placement"]
        seen = gpus[rank % len(gpus)] if gpus else ""
        assert a["visible"] == seen and a["placement"] == (seen or "cpu")


def start_together(tmp_path: Path, socket_dir: Path, device: str, n: int, gpus: Sequence[str]) -> None:
    """n ranks publish their shards together, then n fresh ranks attach them together, through one keeper."""
    keeper = start_keeper(socket_dir)
    try:
        assert bench_ranks.keeper_pid(socket_dir) == keeper.pid
        s = spec(tmp_path, socket_dir, device)
        published = bench_ranks.run_ranks("publish", n, s, gpus)
        # The publishers have exited; the keeper releases their leases as it notices their connections close.
        assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [0] * n, 10)
        with bench_ranks.RankGroup("attach", n, s, gpus) as group:
            assert len(group.ready) == n and all(e.leases == 0 for e in entries(socket_dir)), "none went early"
            attached = group.release()
        # The barrier: no rank went before every rank was ready.
        assert max(a["ready_at"] for a in attached) <= min(a["go_at"] for a in attached)
        assert len({a["pid"] for a in attached}) == n
        check_shards(published, attached, n, gpus)
        assert {(e.digest, e.placement) for e in entries(socket_dir)} == {
            (p["digest"], p["placement"]) for p in published
        }
    finally:
        keeper.terminate()
        keeper.wait(30)


def survive_keeper_kill(tmp_path: Path, socket_dir: Path, device: str, n: int, gpus: Sequence[str]) -> None:
    """n ranks publish their shards and keep them (Handles, leases); the keeper is SIGKILLed and a new one
    started; every rank re-publishes its shard, and n new rank processes attach all of them from the cache."""
    keeper: subprocess.Popen[bytes] = start_keeper(socket_dir)
    s = spec(tmp_path, socket_dir, device)
    try:
        with bench_ranks.RankGroup("publish", n, s, gpus, hold=True) as holders:
            published = holders.release()
            # One lease each: the one it publishes with is released as the keeper notices that connection close.
            assert wait_until(lambda: [e.leases for e in entries(socket_dir)] == [1] * n, 10)
            keeper.send_signal(signal.SIGKILL)
            keeper.wait(10)
            assert entries(socket_dir) == []
            # Each holder notices (its republish thread, asynchronously); its tensors live on.
            assert wait_until(lambda: not any(c["leased"] for c in holders.check()), 10)
            assert [c["checksum"] for c in holders.check()] == [p["checksum"] for p in published]
            keeper = start_keeper(socket_dir)
            assert wait_until(lambda: sorted(e.leases for e in entries(socket_dir)) == [1] * n, REPUBLISH_S)
            assert {pid for e in entries(socket_dir) for pid, _ in e.holders} == set(holders.pids)
            assert bench_ranks.leased(socket_dir, published)
            attached = bench_ranks.run_ranks("attach", n, s, gpus)
            check_shards(published, attached, n, gpus)
            # the keeper counts a re-published lease as the publish ends, its holder a moment later
            assert wait_until(lambda: all(c["leased"] for c in holders.check()), 10)
            checks = holders.check()
            assert [c["leased"] for c in checks] == [True] * n
            assert [c["checksum"] for c in checks] == [p["checksum"] for p in published]
    finally:
        keeper.terminate()
        keeper.wait(30)

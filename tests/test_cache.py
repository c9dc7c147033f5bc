"""Cache.put / get / entries / evict against a real keeper."""

from __future__ import annotations

import gc
import os
from pathlib import Path

import attrs
import pytest
import torch
from conftest import all_threads_stopped, start_keeper, terminate_keeper, wait_until

import weightcache as wc


def sample_state() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    return {
        "w.bf16": torch.randn(33, 17, generator=g).to(torch.bfloat16),
        "w.f32.t": torch.randn(16, 8, generator=g).t(),  # transposed view: layout kept
        "w.fp8": torch.randn(64, generator=g).to(torch.float8_e4m3fn),
        "w.f16": torch.randn(5, 5, 5, generator=g).half(),
        "i64": torch.arange(11),
        "mask": torch.tensor([True, False, True]),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "param": torch.nn.Parameter(torch.randn(4, 4, generator=g)),
    }


@pytest.fixture
def cache(socket_dir: Path) -> wc.Cache:
    return wc.Cache(socket_dir, spawn=True)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return (
        a.dtype == b.dtype
        and a.shape == b.shape
        and a.stride() == b.stride()
        and torch.equal(
            a.view(torch.uint8) if a.dtype == torch.float8_e4m3fn else a,
            b.view(torch.uint8) if b.dtype == torch.float8_e4m3fn else b,
        )
    )


def test_put_then_get_round_trips_every_dtype_and_layout(cache: wc.Cache, checkpoint: Path) -> None:
    state = sample_state()
    fp = wc.Fingerprint.create(checkpoint)
    with cache.put(fp, state, progress=False) as published:  # put takes pack_state's arguments, progress too
        assert published.source == "cache"
        assert list(published.tensors) == list(state)
        for name, t in state.items():
            assert same(published.tensors[name], t), name
    assert cache.get(wc.Fingerprint.create(checkpoint, dtype="float16")) is None
    with cache.get(fp) as got:  # type: ignore[union-attr]
        for name, t in state.items():
            assert same(got.tensors[name], t), name
        got.verify()
        assert got.manifest is not None and got.manifest.kind[list(state).index("param")] == "parameter"


def test_put_splits_into_segments(cache: wc.Cache, checkpoint: Path) -> None:
    state = {f"t{i}": torch.full((1000,), float(i)) for i in range(10)}
    handle = cache.put(wc.Fingerprint.create(checkpoint), state, max_segment_bytes=8192)
    assert handle.manifest is not None and len(handle.manifest.segments) == 5
    [entry] = cache.entries()
    assert entry.segments == 5 and entry.tensors == 10
    with cache.get(handle.fingerprint) as again:  # type: ignore[union-attr]
        assert all(torch.equal(again.tensors[k], v) for k, v in state.items())
    handle.close()


def test_second_put_of_same_fingerprint_attaches_the_first(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    first = cache.put(fp, {"w": torch.ones(8)})
    second = cache.put(fp, {"w": torch.full((8,), 2.0)})  # someone else won the race: theirs is served
    assert torch.equal(second.tensors["w"], torch.ones(8))
    assert len(cache.entries()) == 1
    first.close()
    second.close()


def test_entries_report_what_is_held(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint, dtype="bfloat16")
    with cache.put(fp, {"w": torch.zeros(1000, dtype=torch.bfloat16)}):
        [e] = cache.entries()
        assert e.digest == fp.digest and e.placement == "cpu" and e.device == "cpu"
        assert e.bytes >= 2000 and e.tensors == 1 and e.leases == 1 and e.holders[0][0] == os.getpid()
        assert e.fingerprint == fp and e.model == "TinyLM" and e.age_s >= 0
    info = cache.keeper_info()
    assert info["version"] == wc.__version__ and isinstance(info["pid"], int)


def test_evict_refuses_leased_entries_and_keeps_mapped_memory(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    handle = cache.put(fp, {"w": torch.arange(100.0)})
    with pytest.raises(wc.KeeperError, match=f"leased by pid {os.getpid()}") as info:
        cache.evict(fp)
    assert info.value.code == "leased"
    assert cache.evict(fp.digest[:10], force=True) == [f"{fp.digest}@cpu"]
    assert cache.entries() == [] and cache.get(fp) is None
    assert torch.equal(handle.tensors["w"], torch.arange(100.0))  # still mapped here
    handle.close()
    with pytest.raises(wc.EntryNotFound, match="no entry matches") as missing:
        cache.evict(fp)
    assert isinstance(missing.value, wc.KeeperError) and missing.value.code == "not_found"


def test_evict_unleased(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    cache.put(fp, {"w": torch.ones(3)}).close()
    assert wait_until(lambda: cache.entries()[0].leases == 0)
    assert cache.evict(fp) == [f"{fp.digest}@cpu"]


def test_evict_right_after_close_finds_the_lease_released(cache: wc.Cache, checkpoint: Path) -> None:
    """``close`` returns once the keeper has released the lease, so an ``evict`` right after it is never refused
    as leased (the keeper serves each connection on a thread of its own; a close that only dropped the socket
    raced it, and CI lost that race)."""
    fp = wc.Fingerprint.create(checkpoint)
    for i in range(40):
        handle = cache.put(fp, {"w": torch.full((64,), float(i))})
        again = cache.get(fp)
        assert again is not None
        again.close()
        handle.close()
        assert cache.evict(fp) == [f"{fp.digest}@cpu"], i


def test_close_waits_for_a_stopped_keeper_at_most_its_timeout_and_a_collected_handle_never_waits(
    socket_dir: Path, checkpoint: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A keeper that does not answer (SIGSTOP) holds an explicit close up to CLOSE_TIMEOUT_S, and a handle that the
    garbage collector drops not at all: collection may run anywhere."""
    import signal
    import time
    import weakref

    from weightcache.client import connection

    monkeypatch.setattr(connection, "CLOSE_TIMEOUT_S", 3.0)  # far above what collection takes on a slow machine
    keeper = start_keeper(socket_dir)
    try:
        cache = wc.Cache(socket_dir)
        fp = wc.Fingerprint.create(checkpoint)
        closed, dropped = cache.put(fp, {"w": torch.ones(8)}), cache.get(fp)
        assert dropped is not None
        collected = weakref.ref(dropped)
        keeper.send_signal(signal.SIGSTOP)
        try:
            assert wait_until(lambda: all_threads_stopped(keeper.pid), 10)  # SIGSTOP reaches each thread in turn
            began = time.monotonic()
            del dropped
            gc.collect()
            assert collected() is None and time.monotonic() - began < 1.5
            began = time.monotonic()
            closed.close()
            assert 2.9 < time.monotonic() - began < 8.0
        finally:
            keeper.send_signal(signal.SIGCONT)
        assert wait_until(lambda: cache.entries()[0].leases == 0)  # both released once the keeper runs again
    finally:
        terminate_keeper(keeper)


def test_handle_close_keeps_tensors_valid(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    handle = cache.put(fp, {"w": torch.arange(1000.0)})
    w = handle.tensors["w"]
    handle.close()
    handle.close()  # idempotent
    del handle
    gc.collect()
    assert float(w.sum()) == sum(range(1000))
    assert cache.entries()[0].leases == 0  # close returned once the keeper released the lease
    again = cache.get(fp)
    assert again is not None and again.leased
    again.close()
    assert not again.leased


def test_verify_detects_a_locally_modified_tensor(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    with cache.put(fp, {"w": torch.zeros(16), "v": torch.ones(2)}):
        pass
    with cache.get(fp) as handle:  # type: ignore[union-attr]
        handle.tensors["w"].add_(1)  # a private copy-on-write page: only this process sees it
        with pytest.raises(wc.WeightCacheError, match="1 tensors differ.*w"):
            handle.verify()
    with cache.get(fp) as clean:  # type: ignore[union-attr]
        clean.verify()


def test_put_rejects_bad_input(cache: wc.Cache, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    with pytest.raises(wc.WeightCacheError, match="empty"):
        cache.put(fp, {})
    with pytest.raises(wc.InvalidArgumentType, match="expected a torch.Tensor"):
        cache.put(fp, {"w": [1, 2]})  # type: ignore[dict-item]
    gpu_fp = attrs.evolve(fp, placement="GPU-0")
    with pytest.raises(wc.SegmentError, match="GPU-0"):
        cache.put(gpu_fp, {"w": torch.ones(2)})
    assert cache.entries() == []


def test_evict_by_ambiguous_prefix_is_refused(cache: wc.Cache, checkpoint: Path) -> None:
    handles = []
    for i in range(12):  # with 12 digests, some share a first hex digit
        fp = wc.Fingerprint.create(checkpoint, extra={"i": i})
        handles.append(cache.put(fp, {"w": torch.ones(2)}))
    digests = [h.digest for h in handles]
    first = next(d[0] for d in digests if sum(x[0] == d[0] for x in digests) > 1)
    with pytest.raises(wc.KeeperError, match="^ambiguous: .* matches") as info:
        cache.evict(first, force=True)
    assert info.value.code == "ambiguous" and len(cache.entries()) == 12
    assert "--all" not in str(info.value)  # which would evict every entry, not the one meant
    assert cache.evict(handles[0].fingerprint, force=True) == [f"{digests[0]}@cpu"]
    for h in handles:
        h.close()


def _entry_state(i: int) -> dict[str, torch.Tensor]:
    return {"w": torch.full((1024,), float(i))}  # one 4 KiB segment


def test_budget_evicts_unleased_entries_least_recently_used_first(socket_dir: Path, checkpoint: Path) -> None:
    proc = start_keeper(socket_dir, "--max-bytes", "cpu=12K")
    try:
        cache = wc.Cache(socket_dir)
        fps = [wc.Fingerprint.create(checkpoint, extra={"i": i}) for i in range(4)]
        kept = []
        for i in range(3):
            handle = cache.put(fps[i], _entry_state(i))
            kept.append(handle.tensors["w"])  # still mapped here after the lease is gone
            handle.close()
        assert wait_until(lambda: all(e.leases == 0 for e in cache.entries()))
        cache.get(fps[0]).close()  # type: ignore[union-attr]  # entry 0 is now more recent than entry 1
        with cache.put(fps[3], _entry_state(3)):
            held = {e.digest for e in cache.entries()}
        assert held == {fps[0].digest, fps[2].digest, fps[3].digest}, "entry 1 was the least recently used"
        assert cache.get(fps[1]) is None
        # Eviction only dropped the keeper's fds: memory this process maps is intact.
        assert all(torch.equal(t, torch.full((1024,), float(i))) for i, t in enumerate(kept))
        assert cache.keeper_info()["bytes_by_placement"] == {"cpu": 12288}
    finally:
        proc.terminate()
        proc.wait(10)


def test_budget_counts_a_lease_ending_as_use(socket_dir: Path, checkpoint: Path) -> None:
    """An entry held until a moment ago is recent, however long ago it was published: LRU by last use."""
    proc = start_keeper(socket_dir, "--max-bytes", "cpu=12K")
    try:
        cache = wc.Cache(socket_dir)
        fps = [wc.Fingerprint.create(checkpoint, extra={"i": i}) for i in range(4)]
        held = cache.put(fps[0], _entry_state(0))  # published first, held while the others come and go
        for i in (1, 2):
            cache.put(fps[i], _entry_state(i)).close()
        held.close()
        assert wait_until(lambda: all(e.leases == 0 for e in cache.entries()))
        with cache.put(fps[3], _entry_state(3)):
            kept = {e.digest for e in cache.entries()}
        assert kept == {fps[0].digest, fps[2].digest, fps[3].digest}, "entry 1 was the least recently used"
    finally:
        proc.terminate()
        proc.wait(10)


def test_budget_refuses_what_cannot_fit_and_evicts_nothing(socket_dir: Path, checkpoint: Path) -> None:
    proc = start_keeper(socket_dir, "--max-bytes", "8K")
    try:
        cache = wc.Cache(socket_dir)
        fps = [wc.Fingerprint.create(checkpoint, extra={"i": i}) for i in range(3)]
        leased = cache.put(fps[0], _entry_state(0))
        cache.put(fps[1], _entry_state(1)).close()
        assert wait_until(lambda: sum(e.leases for e in cache.entries()) == 1)
        with pytest.raises(
            wc.BudgetExceeded, match=r"needs 8.0 KiB on cpu.*budget there is 8.0 KiB.*--max-bytes"
        ) as info:
            cache.put(fps[2], {"w": torch.zeros(2048)})
        assert info.value.code == "over_budget"
        assert {e.digest for e in cache.entries()} == {fps[0].digest, fps[1].digest}, "nothing evicted in vain"
        with cache.put(fps[2], _entry_state(2)):  # 4 KiB fits once the unleased entry 1 goes
            assert {e.digest for e in cache.entries()} == {fps[0].digest, fps[2].digest}
        leased.close()
    finally:
        proc.terminate()
        proc.wait(10)


def test_a_dropped_handle_releases_its_lease(cache: wc.Cache, checkpoint: Path) -> None:
    """A handle its owner drops without closing is collected at once and its lease released: the thread that
    watches leases for re-publication must not keep it alive while it waits."""
    fp = wc.Fingerprint.create(checkpoint)
    kept = cache.put(fp, {"w": torch.ones(16)})
    dropped = cache.get(fp)
    assert dropped is not None
    assert wait_until(lambda: cache.entries()[0].leases == 2)
    del dropped
    gc.collect()
    assert wait_until(lambda: cache.entries()[0].leases == 1), "the dropped handle still holds its lease"
    kept.close()

"""The keeper's entry store alone: no keeper process, no socket, no thread. Real sealed memfds stand for segments;
connection ids are plain ints, as the server hands them out."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import one_tensor_manifest, sealed_memfd

from weightcache import messages
from weightcache.budget import Budget
from weightcache.errors import SegmentError
from weightcache.fingerprint import Fingerprint
from weightcache.keeper.store import Store
from weightcache.messages import RequestError
from weightcache.protocol import close_fds


class Clock:
    """A clock the test moves by hand, so that LRU order does not depend on timer resolution."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def is_open(fd: int) -> bool:
    try:
        os.fstat(fd)
    except OSError:
        return False
    return True


@pytest.fixture(scope="module")
def base_fingerprint(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from models import make_checkpoint

    return Fingerprint.create(make_checkpoint(tmp_path_factory.mktemp("ckpt") / "ckpt")).to_json()


@pytest.fixture
def make(base_fingerprint: dict[str, Any]) -> Iterator[Any]:
    """``make(name, size)``: a manifest for a distinct entry (its own digest) and a sealed memfd of ``size``."""
    opened: list[int] = []

    def make(name: str, size: int = 512) -> tuple[dict[str, Any], int]:
        fd = sealed_memfd(size)
        opened.append(fd)
        return one_tensor_manifest({**base_fingerprint, "extra": name}, size=size), fd

    yield make
    for fd in opened:  # the store closed what it took; close only what is still ours
        if is_open(fd):
            os.close(fd)


def digest_of(manifest: dict[str, Any]) -> str:
    return Fingerprint.from_json(manifest["fingerprint"]).digest


def test_publish_get_and_leases_released_on_disconnect(make: Any) -> None:
    clock = Clock()
    store = Store(clock=clock)
    manifest, fd = make("a")
    reply = store.publish(1, 111, manifest, [fd])
    digest = digest_of(manifest)
    assert reply == messages.PublishReply(digest, f"{digest}@cpu", True, ())
    [entry] = store.snapshot().entries
    assert entry.key == reply.key and entry.leases == 1 and entry.holders[0][0] == 111 and entry.bytes == 512
    assert store.snapshot().leases == {1: ((reply.key,), 1)}

    found = store.get(2, 222, digest, "cpu")
    assert found is not None and found.key == reply.key
    [dup] = found.fds
    assert dup != fd and os.fstat(dup).st_ino == os.fstat(fd).st_ino  # a dup of the store's fd, the caller's to close
    os.close(dup)
    assert messages.GetReply.encode_found(found.key, found.manifest_text, found.publisher).startswith(
        b'{"ok":true,"found":true'
    )
    assert store.get(2, 222, digest, "GPU-elsewhere") is None
    assert store.snapshot().leases == {1: ((reply.key,), 1), 2: ((reply.key,), 1)}

    store.release(1)
    [entry] = store.snapshot().entries
    assert [pid for pid, _ in entry.holders] == [222]
    store.release(2)
    [entry] = store.snapshot().entries
    assert entry.leases == 0 and store.snapshot().leases == {}
    assert entry.last_used > entry.created  # held until the release: recently used
    assert is_open(fd)  # releasing leases never drops the entry
    store.close()
    assert not is_open(fd) and len(store) == 0


def test_publishing_again_is_idempotent_and_takes_a_lease(make: Any) -> None:
    store = Store()
    manifest, fd = make("a")
    first = store.publish(1, 111, manifest, [fd])
    _, again = make("a")
    second = store.publish(2, 222, manifest, [again])
    assert second == messages.PublishReply(first.digest, first.key, False)
    assert not is_open(again) and is_open(fd)  # the duplicate's fds are closed; the entry keeps the first ones
    [entry] = store.snapshot().entries
    assert entry.leases == 2
    store.close()


def test_budget_evicts_unleased_entries_least_recently_used_first(make: Any) -> None:
    clock = Clock()
    store = Store(Budget(None, {"cpu": 1536}), clock=clock)
    fds = {}
    keys = {}
    for name in ("a", "b", "c"):
        manifest, fds[name] = make(name)
        keys[name] = store.publish(ord(name), 1, manifest, [fds[name]]).key
    store.release(ord("a"))
    store.release(ord("b"))  # c stays leased
    found = store.get(9, 9, keys["a"].split("@")[0], "cpu")  # a used again, then let go: b is the least recent
    assert found is not None
    for dup in found.fds:
        os.close(dup)
    store.release(9)

    manifest, fd_d = make("d")
    reply = store.publish(4, 4, manifest, [fd_d])
    assert reply.created and reply.evicted == (keys["b"],)
    assert not is_open(fds["b"]) and is_open(fds["a"]) and is_open(fds["c"])
    store.release(4)  # d, released now, is more recent than a
    manifest, fd_e = make("e")
    reply = store.publish(5, 5, manifest, [fd_e])
    assert reply.evicted == (keys["a"],) and not is_open(fds["a"]) and is_open(fd_d)  # c is leased: never evicted
    assert len(store) == 3 and {keys["c"], reply.key} <= set(store.keys())
    assert store.snapshot().bytes_by_placement == {"cpu": 1536}
    store.close()


def test_over_budget_refuses_and_changes_nothing(make: Any) -> None:
    store = Store(Budget(1024))
    for name in ("a", "b"):
        manifest, fd = make(name)
        store.publish(1, 1, manifest, [fd])

    def state() -> tuple[object, ...]:
        now = store.snapshot()
        return tuple(e.to_json() | {"age_s": None} for e in now.entries), now.leases, now.bytes_by_placement

    before = state()
    manifest, fd = make("c")
    with pytest.raises(RequestError, match="budget there is 1.0 KiB") as info:
        store.publish(2, 2, manifest, [fd])
    assert info.value.code == messages.OVER_BUDGET
    assert not is_open(fd)  # refused: the store closed what it was given
    assert state() == before
    store.close()


def test_a_refused_publish_closes_its_fds_and_holds_nothing(make: Any) -> None:
    store = Store()
    manifest, _ = make("a")
    unsealed = sealed_memfd(512, seal=False)
    with pytest.raises(SegmentError):
        store.publish(1, 1, manifest, [unsealed])
    assert not is_open(unsealed)
    extra = [sealed_memfd(512), sealed_memfd(512)]
    with pytest.raises(RequestError, match="lists 1 segments but 2 fds arrived") as info:
        store.publish(1, 1, manifest, extra)
    assert info.value.code == messages.BAD_REQUEST and not any(is_open(fd) for fd in extra)
    assert len(store) == 0


def test_evicting_a_leased_entry_needs_force(make: Any) -> None:
    store = Store()
    manifest, fd = make("a")
    key = store.publish(1, 4242, manifest, [fd]).key
    with pytest.raises(RequestError, match="leased by pid 4242") as info:
        store.evict(key)
    assert info.value.code == messages.LEASED and is_open(fd) and store.keys() == [key]
    assert store.evict(key, force=True) == [key]
    assert not is_open(fd) and len(store) == 0
    store.release(1)  # the connection closing later is harmless


def test_prefixes_name_one_entry_or_are_refused(make: Any) -> None:
    store = Store()
    by_first: dict[str, list[str]] = {}
    i = 0
    while not any(len(keys) > 1 for keys in by_first.values()):  # until two digests share a first hex digit
        manifest, fd = make(f"n{i}")
        key = store.publish(1, 1, manifest, [fd]).key
        by_first.setdefault(key[0], []).append(key)
        i += 1
    store.release(1)
    shared = next(keys for keys in by_first.values() if len(keys) > 1)
    one = shared[0]
    assert store.inspect(one).entry.key == one  # a full key
    assert store.inspect(one.split("@")[0]).entry.key == one  # a full digest
    assert store.inspect(one[:20]).manifest["segments"][0]["size"] == 512  # a unique prefix
    for prefix, code in ((one[0], messages.AMBIGUOUS), ("zz", messages.NOT_FOUND), ("", messages.BAD_REQUEST)):
        with pytest.raises(RequestError) as info:
            store.inspect(prefix)
        assert info.value.code == code
        with pytest.raises(RequestError):
            store.evict(prefix)
    assert sorted(store.evict(one[0], every=True)) == sorted(shared)  # every entry the prefix matches
    left = len(store)
    assert len(store.evict(messages.EVERY_ENTRY, every=True)) == left and len(store) == 0
    assert store.evict(messages.EVERY_ENTRY, every=True) == []  # all of none: not an error
    with pytest.raises(RequestError) as info:
        store.evict(messages.EVERY_ENTRY)  # without every, "*" is just a prefix that matches nothing
    assert info.value.code == messages.NOT_FOUND


def test_close_closes_every_fd(make: Any) -> None:
    store = Store()
    fds = []
    for name in ("a", "b"):
        manifest, fd = make(name)
        store.publish(1, 1, manifest, [fd])
        fds.append(fd)
    store.close()
    assert not any(is_open(fd) for fd in fds) and store.snapshot().entries == ()


def test_entry_info_is_the_shape_list_sends(make: Any) -> None:
    store = Store()
    manifest, fd = make("a")
    store.publish(1, 1, manifest, [fd])
    [entry] = store.snapshot().entries
    assert messages.EntryInfo.from_json(entry.to_json()) == entry
    assert entry.to_json()["fingerprint"] == manifest["fingerprint"]
    shown = store.inspect(entry.digest)
    assert (
        shown.entry == entry.__class__(**{**_fields(entry), "age_s": shown.entry.age_s}) and shown.manifest == manifest
    )
    store.close()


def _fields(entry: messages.EntryInfo) -> dict[str, Any]:
    import attrs

    return attrs.asdict(entry, recurse=False)


def test_store_imports_no_sockets_or_threads_machinery() -> None:
    source = (Path(__file__).resolve().parent.parent / "weightcache" / "keeper" / "store.py").read_text()
    for name in ("import socket", "import signal", "threading.Thread", "import torch"):
        assert name not in source


def test_publishers_live_side_by_side_and_get_follows_trust(make: Any) -> None:
    """A member's publish of the owner's digest is its own entry: it never replaces or shadows the owner's, and
    a get returns an entry only of a publisher it trusts, in the order it names them."""
    store = Store(owner=0)
    manifest, fd = make("a")
    digest = digest_of(manifest)
    member = store.publish(1, 111, manifest, [fd], uid=1000)
    assert member.created and member.key == f"{digest}@cpu~1000"
    assert store.get(2, 222, digest, "cpu", (0,)) is None  # the owner trusts only itself
    assert store.publishers(digest, "cpu") == [1000]
    manifest, owner_fd = make("a")
    owner = store.publish(3, 333, manifest, [owner_fd], uid=0)
    assert owner.created and owner.key == f"{digest}@cpu"  # beside the member's, not replaced by it
    assert sorted(e.publisher for e in store.snapshot().entries) == [0, 1000]
    for trust, expected in [((0,), 0), ((1000, 0), 1000), ((0, 1000), 0), ((5,), None)]:
        found = store.get(4, 444, digest, "cpu", trust)
        assert (found and found.publisher) == expected
        if found is not None:
            close_fds(found.fds)
    store.close()


def test_budget_eviction_takes_only_the_publishers_own_entries(make: Any) -> None:
    # A member's share of the budget (550 B) that fits its 512 B entry: the rule under test is the one beyond it.
    store = Store(Budget(None, {"cpu": 1000}), owner=0, member_share=0.55)
    manifest, fd = make("a")
    owners = store.publish(1, 1, manifest, [fd], uid=0)
    store.release(1)  # unleased: evictable, but only for the owner's own publishes
    manifest, fd = make("b")
    with pytest.raises(RequestError, match="uid 1000 needs .* other uids 512 B") as info:
        store.publish(2, 2, manifest, [fd], uid=1000)
    assert info.value.code == messages.OVER_BUDGET and store.keys() == [owners.key]
    manifest, fd = make("c")
    reply = store.publish(3, 3, manifest, [fd], uid=0)
    assert reply.evicted == (owners.key,)  # the owner's own unleased entry made room
    store.close()


def test_segment_fds_held_are_capped(make: Any) -> None:
    store = Store(max_fds=1)
    manifest, fd = make("a")
    store.publish(1, 1, manifest, [fd])
    manifest, fd = make("b")
    with pytest.raises(RequestError, match=r"the owner holds 1 of its share of 1 \(all uids: 1 of 1\)") as info:
        store.publish(1, 1, manifest, [fd])
    assert info.value.code == messages.OVER_BUDGET and not is_open(fd)
    store.evict("*", every=True, force=True)
    manifest, fd = make("b")
    assert store.publish(1, 1, manifest, [fd]).created  # evicting gave the fd back
    store.close()


def test_a_members_segment_fds_are_capped_to_its_share(make: Any) -> None:
    """Issue 22, finding 3: another uid's entries hold at most its share of the segment fds, so the owner can
    still publish when a member has published all it may."""
    store = Store(max_fds=1000, owner=0)  # a member's share: 250 (a quarter, at least one frame's 250 fds)
    member = 65534
    for i in range(250):
        manifest, fd = make(f"m{i}")
        store.publish(1, 1, manifest, [fd], uid=member)
    manifest, fd = make("one-more")
    with pytest.raises(RequestError, match="uid 65534 holds 250 of its share of 250") as info:
        store.publish(1, 1, manifest, [fd], uid=member)
    assert info.value.code == messages.OVER_BUDGET and not is_open(fd)
    manifest, fd = make("owners")
    assert store.publish(2, 2, manifest, [fd], uid=0).created
    assert store.fds_held(member) == 250 and store.fds_held(0) == 1
    store.close()


def test_members_are_bounded_against_each_other(make: Any) -> None:
    """Issue 33, item 8: members together hold at most ``1 - member_share`` of a budget (the owner keeps the rest),
    and while k members hold entries on a placement each may hold only its part of that pool, so no members can
    starve another: a member whose publish fits its part evicts the least recently used unleased entries of
    members over theirs, never the owner's and never a leased one."""
    kib = 1024
    store = Store(Budget(None, {"cpu": 64 * kib}), owner=0, clock=Clock())  # a member's share 16 KiB, pool 48
    first = []
    for member in (1001, 1002, 1003):
        manifest, fd = make(f"m{member}", 16 * kib)
        first.append(store.publish(member, 1, manifest, [fd], uid=member).key)
        store.release(member)  # unleased
    manifest, fd = make("fourth-whole", 16 * kib)
    with pytest.raises(RequestError, match="4 members hold entries there, so each may hold 12.0 KiB") as info:
        store.publish(4, 1, manifest, [fd], uid=1004)  # its share, but more than its part of the pool now
    assert info.value.code == messages.OVER_BUDGET and not is_open(fd)
    manifest, fd = make("fourth", 12 * kib)
    reply = store.publish(4, 1, manifest, [fd], uid=1004)
    assert reply.created and reply.evicted == (first[0],)  # the least recently used member over its part
    manifest, fd = make("owners", 16 * kib)
    assert store.publish(5, 1, manifest, [fd], uid=0).created  # the owner's quarter stays free for it
    manifest, fd = make("again-1001", 12 * kib)
    assert store.publish(6, 1, manifest, [fd], uid=1001).evicted == (first[1],)
    # Leased entries never give way: once the last member over its part holds a lease, a fifth is refused.
    third = store.get(8, 1, first[2].partition("@")[0], "cpu", trust=[1003])
    assert third is not None
    close_fds(third.fds)
    manifest, fd = make("fifth", 12 * kib)
    with pytest.raises(RequestError, match="members of the keeper's group hold .* leased or within its part"):
        store.publish(7, 1, manifest, [fd], uid=1005)
    assert len(store) == 4 and not is_open(fd)
    store.close()


def test_a_refused_publish_evicts_nothing(make: Any) -> None:
    """A member's publish whose own older entry fit its share, but whose placement's budget was full of the
    owner's leased entries: the member's entry, chosen to make room within its share, used to be evicted before
    the placement's check refused the publish. Now nothing is evicted unless the publish goes through."""
    kib = 1024
    store = Store(Budget(None, {"cpu": 256 * kib}), owner=0, clock=Clock())  # a member's share 64 KiB
    manifest, fd = make("owners", 208 * kib)
    store.publish(1, 1, manifest, [fd], uid=0)  # leased by connection 1
    manifest, fd = make("old", 32 * kib)
    old = store.publish(2, 1, manifest, [fd], uid=1001).key
    store.release(2)
    manifest, fd = make("held", 16 * kib)
    store.publish(3, 1, manifest, [fd], uid=1001)  # leased
    manifest, fd = make("new", 40 * kib)
    with pytest.raises(RequestError, match="needs 40.0 KiB") as info:
        store.publish(4, 1, manifest, [fd], uid=1001)
    assert info.value.code == messages.OVER_BUDGET and store.keys().count(old) == 1 and len(store) == 3
    store.close()


def test_members_over_their_part_give_way_the_furthest_over_first(make: Any) -> None:
    """Room in the members' pool is taken from the member furthest over its part (its least recently used entry
    first), not merely from the least recently used entry of any member over it: one just over its part keeps its
    entry."""
    kib = 1024
    store = Store(Budget(None, {"cpu": 80 * kib}), owner=0, member_share=0.5, clock=Clock())  # pool 40 KiB
    far = []
    for i in range(3):
        manifest, fd = make(f"far-over-{i}", 8 * kib)
        far.append(store.publish(2, 1, manifest, [fd], uid=1003).key)
    manifest, fd = make("a-little-over", 16 * kib)
    little = store.publish(1, 1, manifest, [fd], uid=1002).key
    store.release(1)  # 1002's entry is now the least recently used
    store.release(2)
    # a third member: each may hold 13.3 KiB of the 40; 1002 holds 16 (2.7 over), 1003 holds 24 (10.7 over)
    manifest, fd = make("newcomer", 4 * kib)
    reply = store.publish(3, 1, manifest, [fd], uid=1001)
    assert reply.evicted == (far[0],) and store.keys().count(little) == 1
    store.close()

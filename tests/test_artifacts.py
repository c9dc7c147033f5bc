"""Artifact entries: opaque blobs an engine compiled for a set of weights, held by the keeper as sealed memfds.

The store alone (no sockets), then a real keeper process through the client and ``Cache``: hits return the bytes
published, any mismatch or a corrupt blob is a miss (None, never an error), artifacts share the budget, the trust
rules and the re-publication after a keeper restart with weight entries, and ``ls``/``inspect``/``evict`` show
them. tests/test_torch_compile.py has torch.compile on top of this.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import (
    keeper_pid,
    one_tensor_manifest,
    process_gone,
    sealed_memfd,
    serve_detached,
    start_keeper,
    terminate_keeper,
    wait_until,
)

import weightcache as wc
from weightcache import artifacts as artifact_ops
from weightcache import messages, protocol
from weightcache.artifact_key import ArtifactKey, artifact_matches
from weightcache.budget import Budget
from weightcache.client import KeeperConnection
from weightcache.errors import KeeperError, ProtocolError
from weightcache.keeper.store import Store
from weightcache.messages import RequestError

WEIGHTS = "ab" * 32
OTHER_WEIGHTS = "cd" * 32
KEY = ArtifactKey("torch.compile", {"torch": "2.13.0", "device": "cpu", "options": {"mode": "default"}})


def blob_fd(data: bytes) -> tuple[int, str]:
    return artifact_ops.sealed_memfd(data)


def cli(socket_dir: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "weightcache", *args, "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=60,
    )


# --- the key -----------------------------------------------------------------------------------------------------


def test_keys_are_values_with_a_canonical_digest() -> None:
    same = ArtifactKey("torch.compile", {"options": {"mode": "default"}, "device": "cpu", "torch": "2.13.0"})
    assert same == KEY and same.digest == KEY.digest
    other = KEY.with_fields(dtype="bfloat16")
    assert other.digest != KEY.digest
    assert KEY.diff(other) == [("dtype", None, "bfloat16")]
    assert ArtifactKey.from_json(json.loads(json.dumps(KEY.to_json()))) == KEY
    with pytest.raises(wc.InvalidArgument, match="artifact kind must match"):
        ArtifactKey("Torch Compile!")
    with pytest.raises(wc.InvalidArgument, match="JSON values"):
        ArtifactKey("x", {"nan": float("nan")})
    with pytest.raises(wc.InvalidArgument, match="at most 16384"):
        ArtifactKey("x", {"big": "y" * 20000})
    with pytest.raises(ProtocolError, match="'fields' must be an object"):
        ArtifactKey.from_json({"kind": "x", "fields": []})
    # a key that is no str at any level: JSON would make it one, so that two keys unequal as fields had one digest
    for fields in ({1: "a"}, {"a": {2: "b"}}, {"a": [{"x": 1, 3: 4}]}):
        with pytest.raises(wc.InvalidArgumentType, match="str keys at every level.* of type int"):
            ArtifactKey("x", fields)
    with pytest.raises(wc.InvalidArgumentType, match="must be a mapping of names to JSON values; found 5"):
        ArtifactKey("x", 5)  # type: ignore[arg-type]
    key = f"{WEIGHTS}/{KEY.digest}~1000"
    assert artifact_matches(key, WEIGHTS[:6]) and artifact_matches(key, f"{WEIGHTS[:12]}/{KEY.digest[:12]}")
    assert not artifact_matches(key, f"{WEIGHTS[:12]}/{'0' * 12}")
    # issue 33, item 7: the name `ls` prints for another uid's artifact (`~uid` after the short key digest)
    assert artifact_matches(key, f"{WEIGHTS[:12]}/{KEY.digest[:12]}~1000")
    assert not artifact_matches(key, f"{WEIGHTS[:12]}/{KEY.digest[:12]}~1001")
    assert not artifact_matches(f"{WEIGHTS}/{KEY.digest}", f"{WEIGHTS[:12]}/{KEY.digest[:12]}~1000")


# --- the store alone ---------------------------------------------------------------------------------------------


def test_store_holds_artifacts_beside_entries_with_leases_trust_and_replacement() -> None:
    store = Store(owner=1000)
    fd, sha = blob_fd(b"compiled" * 100)
    made = store.put_artifact(1, 11, WEIGHTS, KEY, 800, sha, fd, uid=1000)
    assert made.created and made.key == f"{WEIGHTS}/{KEY.digest}"
    # the same artifact again: a lease on the one there, the new fd closed
    fd2, _ = blob_fd(b"compiled" * 100)
    again = store.put_artifact(2, 12, WEIGHTS, KEY, 800, sha, fd2, uid=1000)
    assert not again.created and again.key == made.key
    with pytest.raises(OSError):
        os.fstat(fd2)
    # another uid's artifact of the same weights and key lives beside it, and is found only when trusted
    fd3, sha3 = blob_fd(b"forged" * 10)
    theirs = store.put_artifact(3, 13, WEIGHTS, KEY, 60, sha3, fd3, uid=2000)
    assert theirs.key == f"{WEIGHTS}/{KEY.digest}~2000"
    got = store.get_artifact(4, 14, WEIGHTS, KEY, trust=(2000,))
    assert got is not None and got.info.publisher == 2000 and got.info.sha256 == sha3
    os.close(got.fd)
    assert store.get_artifact(4, 14, WEIGHTS, KEY.with_fields(dtype="x"), trust=(1000,)) is None
    others, near = store.artifact_misses(WEIGHTS, KEY.with_fields(dtype="x"), (1000,), 8)
    assert others == [] and near == [KEY]
    others, near = store.artifact_misses(WEIGHTS, KEY, (3000,), 8)
    assert others == [1000, 2000] and near == []
    listed, truncated = store.artifacts()
    assert {a.key for a in listed} == {made.key, theirs.key} and not truncated
    assert {a.key: a.leases for a in listed} == {made.key: 2, theirs.key: 2}
    store.release(1)
    store.release(2)
    # replacing needs the SHA-256 of the one held: a stale one does not replace it
    fd4, sha4 = blob_fd(b"better" * 10)
    kept = store.put_artifact(5, 15, WEIGHTS, KEY, 60, sha4, fd4, uid=1000, replace="0" * 64)
    assert not kept.created
    fd5, sha5 = blob_fd(b"better" * 10)
    replaced = store.put_artifact(5, 15, WEIGHTS, KEY, 60, sha5, fd5, uid=1000, replace=sha)
    assert replaced.created and replaced.replaced
    got = store.get_artifact(6, 16, WEIGHTS, KEY, trust=(1000,))
    assert got is not None and got.info.sha256 == sha5 and got.info.bytes == 60
    os.close(got.fd)
    store.close()


def test_a_refused_replacement_leaves_the_artifact_it_would_have_replaced() -> None:
    """A replacing publish that does not fit the budget used to drop the artifact it replaced first, so the
    refusal lost both; now the one held stays, leased as it was, and its fd's share is still counted."""
    store = Store(Budget(None, {"cpu": 16 << 10}), owner=1000)
    fd, sha = blob_fd(b"x" * (8 << 10))
    store.put_artifact(1, 11, WEIGHTS, KEY, 8 << 10, sha, fd, uid=1000)
    fd2, sha2 = blob_fd(b"y" * (20 << 10))  # more than the whole budget
    with pytest.raises(RequestError) as info:
        store.put_artifact(1, 11, WEIGHTS, KEY, 20 << 10, sha2, fd2, uid=1000, replace=sha)
    assert info.value.code == messages.OVER_BUDGET
    got = store.get_artifact(2, 12, WEIGHTS, KEY, trust=(1000,))
    assert got is not None and got.info.sha256 == sha and store.fds_held(1000) == 1
    os.close(got.fd)
    fd3, sha3 = blob_fd(b"z" * (4 << 10))  # one that fits takes its place, and its fd's share
    assert store.put_artifact(1, 11, WEIGHTS, KEY, 4 << 10, sha3, fd3, uid=1000, replace=sha).replaced
    assert store.fds_held(1000) == 1
    store.close()


def test_store_checks_the_memfd_and_owns_it_whatever_happens() -> None:
    store = Store(owner=1000)
    unsealed = sealed_memfd(512, seal=False)
    with pytest.raises(wc.SegmentError, match="not sealed"):
        store.put_artifact(1, 11, WEIGHTS, KEY, 512, "0" * 64, unsealed)
    with pytest.raises(OSError):
        os.fstat(unsealed)  # closed by the store
    fd, sha = blob_fd(b"x" * 100)
    with pytest.raises(wc.SegmentError, match="holds 100 bytes; the manifest says 99"):
        store.put_artifact(1, 11, WEIGHTS, KEY, 99, sha, fd)
    with pytest.raises(OSError):
        os.fstat(fd)
    assert store.artifacts() == ([], False)


def test_artifacts_and_entries_share_the_budget_least_recently_used_first(checkpoint: Path) -> None:
    now = [100.0]
    store = Store(Budget(None, {"cpu": 4096}), owner=1000, clock=lambda: now[0])
    manifest = one_tensor_manifest(wc.Fingerprint.create(checkpoint).to_json(), size=2048)
    entry = store.publish(1, 11, manifest, [sealed_memfd(2048)])
    store.release(1)
    now[0] += 1
    fd, sha = blob_fd(b"a" * 1500)
    store.put_artifact(2, 12, WEIGHTS, KEY, 1500, sha, fd)
    store.release(2)
    now[0] += 1
    # 2048 + 1500 held; 1000 more needs the least recently used out: the weight entry, not the artifact
    fd, sha = blob_fd(b"b" * 1000)
    made = store.put_artifact(3, 13, OTHER_WEIGHTS, KEY, 1000, sha, fd)
    assert made.evicted == (entry.key,)
    assert len(store) == 0 and len(store.artifacts()[0]) == 2
    # the leased one (conn 3 holds it) and the other cannot make room for 4000 bytes
    fd, sha = blob_fd(b"c" * 4000)
    with pytest.raises(RequestError, match="budget") as refused:
        store.put_artifact(4, 14, OTHER_WEIGHTS, KEY.with_fields(dtype="x"), 4000, sha, fd)
    assert refused.value.code == messages.OVER_BUDGET
    assert len(store.artifacts()[0]) == 2
    assert store.snapshot().bytes_by_placement == {"cpu": 2500}


def test_evict_names_artifacts_by_key_or_with_their_weights(checkpoint: Path) -> None:
    store = Store(owner=1000)
    manifest = one_tensor_manifest(wc.Fingerprint.create(checkpoint).to_json())
    entry = store.publish(1, 11, manifest, [sealed_memfd(512)])
    digest = entry.digest
    fd, sha = blob_fd(b"a" * 10)
    art = store.put_artifact(1, 11, digest, KEY, 10, sha, fd)
    store.release(1)
    # a digest names the weight entry alone, as it always did
    assert store.evict(digest[:12]) == [entry.key]
    assert [a.key for a in store.artifacts()[0]] == [art.key]
    # the artifact by `ls`'s short name
    assert store.evict(f"{digest[:12]}/{KEY.digest[:12]}") == [art.key]
    # with every: the weights and their artifacts
    store.publish(2, 12, manifest, [sealed_memfd(512)])
    fd, sha = blob_fd(b"a" * 10)
    store.put_artifact(2, 12, digest, KEY, 10, sha, fd)
    with pytest.raises(RequestError, match="leased"):
        store.evict(digest, every=True)
    assert sorted(store.evict(digest, every=True, force=True)) == sorted([entry.key, art.key])
    assert len(store) == 0 and store.artifacts() == ([], False)


# --- through a keeper ------------------------------------------------------------------------------------------


def test_put_and_get_through_the_keeper(keeper: subprocess.Popen[bytes], socket_dir: Path) -> None:
    cache = wc.Cache(socket_dir)
    data = os.urandom(300_000)
    made = cache.put_artifact(WEIGHTS, KEY, data)
    assert made.created and not made.held and made.info.sha256 == hashlib.sha256(data).hexdigest()
    assert cache.get_artifact(WEIGHTS, KEY) == data
    again = cache.put_artifact(WEIGHTS, KEY, b"something else")
    assert not again.created  # the first stays
    assert cache.get_artifact(WEIGHTS, KEY) == data
    # the keeper lets go of a closed connection's lease when it notices the close, asynchronously
    assert wait_until(lambda: [a.leases for a in cache.artifacts()] == [0], 10)
    [info] = cache.artifacts()
    assert (info.weights, info.kind, info.bytes, info.leases, info.publisher) == (
        WEIGHTS,
        "torch.compile",
        300_000,
        0,
        os.getuid(),
    )
    assert cache.artifacts(OTHER_WEIGHTS) == []
    assert cache.entries() == []  # weights and artifacts are listed apart
    # ls and inspect show it; evict drops it by the name ls shows
    ls = cli(socket_dir, "ls")
    assert ls.returncode == 0, ls.stderr
    short = f"{WEIGHTS[:12]}/{KEY.digest[:12]}"
    assert short in ls.stdout and "torch.compile" in ls.stdout and "293.0 KiB" in ls.stdout, ls.stdout
    listed = json.loads(cli(socket_dir, "ls", "--json").stdout)
    assert [a["key"] for a in listed["artifacts"]] == [info.key]
    inspected = cli(socket_dir, "inspect", short)
    assert inspected.returncode == 0, inspected.stderr
    assert info.sha256 in inspected.stdout and 'key.options  {"mode": "default"}' in inspected.stdout
    assert json.loads(cli(socket_dir, "inspect", short, "--json").stdout)["artifact"]["key"] == info.key
    evicted = cli(socket_dir, "evict", short)
    assert evicted.returncode == 0 and f"evicted {info.key}" in evicted.stdout, evicted.stderr
    assert cache.artifacts() == [] and cache.get_artifact(WEIGHTS, KEY) is None


def test_a_mismatch_is_a_miss_that_names_the_fields(
    keeper: subprocess.Popen[bytes], socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    cache = wc.Cache(socket_dir)
    cache.put_artifact(WEIGHTS, KEY, b"fp32 graphs")
    caplog.set_level(logging.INFO, logger="weightcache.artifacts")
    assert cache.get_artifact(WEIGHTS, KEY.with_fields(dtype="bfloat16")) is None
    assert "dtype: wanted 'bfloat16', cached None" in caplog.text
    assert cache.get_artifact(OTHER_WEIGHTS, KEY) is None
    # a second artifact for the changed key lives beside the first
    assert cache.put_artifact(WEIGHTS, KEY.with_fields(dtype="bfloat16"), b"bf16 graphs").created
    assert cache.get_artifact(WEIGHTS, KEY.with_fields(dtype="bfloat16")) == b"bf16 graphs"
    assert cache.get_artifact(WEIGHTS, KEY) == b"fp32 graphs"
    assert len(cache.artifacts(WEIGHTS)) == 2


def test_a_corrupt_blob_is_a_miss_and_the_next_put_replaces_it(
    keeper: subprocess.Popen[bytes], socket_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    good = b"compiled graphs" * 1000
    fd, _ = artifact_ops.sealed_memfd(b"X" + good[1:])  # one byte off what the recorded SHA-256 says
    with KeeperConnection.connect(socket_dir) as conn:
        conn.put_artifact(WEIGHTS, KEY, fd, len(good), hashlib.sha256(good).hexdigest())
    os.close(fd)
    cache = wc.Cache(socket_dir)
    caplog.set_level(logging.INFO, logger="weightcache.artifacts")
    assert cache.get_artifact(WEIGHTS, KEY) is None
    assert "is corrupt" in caplog.text
    assert cache.open_artifact(WEIGHTS, KEY) is None
    made = cache.put_artifact(WEIGHTS, KEY, good)  # replaces the corrupt one without being told
    assert made.created and made.replaced
    assert cache.get_artifact(WEIGHTS, KEY) == good
    assert len(cache.artifacts()) == 1


def test_an_artifact_opened_unchecked_is_mapped_not_read_and_read_still_checks(
    keeper: subprocess.Popen[bytes], socket_dir: Path
) -> None:
    """``open_artifact(check=False)`` maps the memfd (no copy, no hash: a 57 MB graph artifact spent ~150 ms on
    both); ``view()`` gives the mapping, valid after close; ``read()`` still checks the bytes against the SHA-256."""
    import mmap

    good = b"kernel images " * 10_000
    cache = wc.Cache(socket_dir)
    cache.put_artifact(WEIGHTS, KEY, good).close()
    artifact = cache.open_artifact(WEIGHTS, KEY, check=False)
    assert artifact is not None and artifact.held
    view = artifact.view()
    assert view is not None and isinstance(view.obj, mmap.mmap) and view == good
    artifact.close()
    assert view == good  # the mapping outlives the lease
    again = cache.open_artifact(WEIGHTS, KEY, check=False)
    assert again is not None and again.read() == good
    again.close()

    bad = KEY.with_fields(options={"mode": "corrupt"})
    fd, _ = artifact_ops.sealed_memfd(b"X" + good[1:])  # one byte off what the recorded SHA-256 says
    with KeeperConnection.connect(socket_dir) as conn:
        conn.put_artifact(WEIGHTS, bad, fd, len(good), hashlib.sha256(good).hexdigest())
    os.close(fd)
    corrupt = cache.open_artifact(WEIGHTS, bad, check=False)  # not checked: no miss
    assert corrupt is not None
    with pytest.raises(wc.SegmentError, match="do not match its SHA-256"):
        corrupt.read()
    corrupt.close()
    unchecked = cache.open_artifact(WEIGHTS, bad, check=False)
    assert unchecked is not None
    view = unchecked.view()
    assert view is not None and view[:1] == b"X" and view[1:] == good[1:]  # the caller's to check
    unchecked.close()
    assert cache.open_artifact(WEIGHTS, bad) is None  # checked: a miss, as before


def deep(levels: int) -> object:
    """A JSON value of lists nested ``levels`` deep."""
    value: object = 0
    for _ in range(levels - 1):
        value = [value]
    return value


def test_bad_artifact_requests_are_refused_and_the_keeper_goes_on(
    keeper: subprocess.Popen[bytes], socket_dir: Path
) -> None:
    with KeeperConnection.connect(socket_dir) as conn:
        base = {"op": "put_artifact", "weights": WEIGHTS, "key": KEY.to_json(), "size": 4, "sha256": "0" * 64}
        fd, _ = artifact_ops.sealed_memfd(b"abcd")
        cases = [
            ({**base, "weights": "../../etc"}, [fd], "fingerprint digest"),
            ({**base, "key": {"kind": "x", "fields": "no"}}, [fd], "'fields' must be an object"),
            ({**base, "size": -1}, [fd], "field 'size' must be"),
            (base, [], "exactly one fd"),
            ({**base, "size": 5}, [fd], "holds 4 bytes"),
            ({"op": "get_artifact", "weights": WEIGHTS, "key": KEY.to_json()}, [fd], "carries no fds"),
            # issue 33: a key nested ~1,000 deep was an internal error with a traceback in the keeper's log
            ({**base, "key": {"kind": "x", "fields": {"a": deep(500)}}}, [fd], "nest more than 64 levels"),
            ({"op": "get_artifact", "weights": WEIGHTS, "key": {"kind": "x", "fields": {"a": deep(900)}}}, [], "nest"),
        ]
        for message, fds, error in cases:
            with pytest.raises(wc.KeeperError, match=error) as refused:
                conn.request(message, fds)
            assert refused.value.code == messages.BAD_REQUEST
        os.close(fd)
        assert conn.list_artifacts().artifacts == ()
    assert wc.Cache(socket_dir).get_artifact(WEIGHTS, KEY) is None  # still serving


def test_a_keeper_of_protocol_1_is_a_miss(keeper: subprocess.Popen[bytes], socket_dir: Path) -> None:
    with KeeperConnection.connect(socket_dir, protocol_version=1) as conn:
        assert not conn.serves_artifacts
        miss = artifact_ops.get(conn, WEIGHTS, KEY)
        assert isinstance(miss, artifact_ops.Miss) and "protocol 1" in miss.reason
        assert conn.list_artifacts().artifacts == ()
        with pytest.raises(wc.KeeperError, match="no 'put_artifact'"):
            artifact_ops.put(conn, WEIGHTS, KEY, b"x")


def test_no_keeper_is_a_miss(socket_dir: Path) -> None:
    assert wc.Cache(socket_dir).get_artifact(WEIGHTS, KEY) is None


#: Holds an artifact (published or got) until stdin closes: ``HOLDER socket_dir put|get``.
HOLDER = r"""
import json, sys
import weightcache as wc
from weightcache.artifact_key import ArtifactKey
socket_dir, action, key = sys.argv[1], sys.argv[2], ArtifactKey.from_json(json.loads(sys.argv[3]))
cache = wc.Cache(socket_dir)
if action == "put":
    artifact = cache.put_artifact("ab" * 32, key, b"held blob" * 1000, hold=True)
else:
    artifact = cache.open_artifact("ab" * 32, key)
print(json.dumps({"held": artifact.held, "data": artifact.read() == b"held blob" * 1000}), flush=True)
sys.stdin.read()
artifact.close()
"""


def end_holders(holders: list[subprocess.Popen[str]], keeper: subprocess.Popen[bytes]) -> None:
    """Kill what :func:`start_holders` started and is still running, then stop ``keeper``."""
    for proc in holders:
        if proc.poll() is None:
            proc.kill()
    terminate_keeper(keeper)


def start_holders(socket_dir: Path, holders: list[subprocess.Popen[str]]) -> None:
    """Two processes holding the artifact of KEY, one that published it and one that got it (appended to
    ``holders`` as each starts, so that the caller can end them whatever happens); returns once both hold it."""
    for action in ("put", "get"):
        proc = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(socket_dir), action, json.dumps(KEY.to_json())],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        holders.append(proc)
        assert proc.stdout is not None
        assert json.loads(proc.stdout.readline()) == {"held": True, "data": True}


def test_a_held_artifact_is_leased_and_republished_to_a_restarted_keeper(socket_dir: Path) -> None:
    keeper = start_keeper(socket_dir)
    holders: list[subprocess.Popen[str]] = []
    try:
        start_holders(socket_dir, holders)
        cache = wc.Cache(socket_dir)
        [info] = cache.artifacts()
        assert info.leases == 2 and {pid for pid, _ in info.holders} == {p.pid for p in holders}
        with pytest.raises(wc.KeeperError, match="leased"):
            cache.evict(info.key)
        pid = keeper_pid(socket_dir)
        assert pid
        os.kill(pid, signal.SIGKILL)
        keeper.wait(10)
        assert wait_until(lambda: process_gone(pid))
        keeper = start_keeper(socket_dir)
        assert wait_until(lambda: [a.leases for a in cache.artifacts()] == [2], 10)
        assert cache.get_artifact(WEIGHTS, KEY) == b"held blob" * 1000
        for proc in holders:
            assert proc.stdin is not None
            proc.stdin.close()
            proc.wait(30)
        assert wait_until(lambda: [a.leases for a in cache.artifacts()] == [0])
    finally:
        end_holders(holders, keeper)


def test_a_connection_that_holds_only_an_artifact_is_never_dropped_as_idle(socket_dir: Path) -> None:
    """A connection whose only lease is an artifact's stays open past the keeper's idle timeout (as one holding
    weights does): its artifact stays leased (a plain evict refuses it) and its holder never sees the keeper go
    away. Before, the keeper counted only weight leases and dropped it after ``--idle-timeout``."""
    keeper = start_keeper(socket_dir, "--idle-timeout", "0.5")
    holders: list[subprocess.Popen[str]] = []
    try:
        start_holders(socket_dir, holders)
        time.sleep(2.5)  # five idle timeouts
        cache = wc.Cache(socket_dir)
        [info] = cache.artifacts()
        assert info.leases == 2
        with pytest.raises(wc.KeeperError, match="leased"):
            cache.evict(info.key)
        for proc in holders:
            _, err = proc.communicate("", timeout=30)
            assert proc.returncode == 0 and "went away" not in err, err
        log = (socket_dir / "keeper.log").read_text() if (socket_dir / "keeper.log").exists() else ""
        assert "idle, holding no lease: dropped" not in log
    finally:
        end_holders(holders, keeper)


def test_an_artifacts_reply_fd_counts_against_the_reply_shares(socket_dir: Path, checkpoint: Path) -> None:
    """A get_artifact's reply carries a dup of the blob's memfd: like a get's segment fds, it is counted against
    its uid's share of reply fds until the reply is read. With the share held by replies nobody reads, the
    keeper answers busy (a miss for the reader, the lease not taken) and goes on; once they are read, it answers."""
    sys.path.insert(0, str(Path(__file__).parent))
    import hostile

    keeper = start_keeper(socket_dir, nofile=2048)  # 250 reply fds for the owner (the floor: protocol.MAX_FDS)
    try:
        cache = wc.Cache(socket_dir)
        key = ArtifactKey("test.kind", {"n": 1})
        weights = "ab" * 32
        cache.put_artifact(weights, key, b"blob").close()
        with KeeperConnection.connect(socket_dir) as conn:
            digest = hostile.publish(conn, wc.Fingerprint.create(checkpoint).to_json(), 125).partition("@")[0]
        # two gets of 125 fds each whose replies are never read: all 250 of the owner's reply fds
        request = json.dumps({"op": "get", "digest": digest, "placement": "cpu"}).encode()
        frame = protocol.HEADER.pack(protocol.MAGIC, protocol.WIRE_VERSION, 0, len(request)) + request
        stalled = [hostile.raw_connection(str(socket_dir)) for _ in range(2)]
        for sock in stalled:
            assert sock is not None
            sock.sendall(frame)
        # both replies sent before this uid asks for anything else: a get_artifact answered between the two would
        # hold one reply fd of the share, and the second get would be refused busy instead of filling it
        assert wait_until(lambda: len(select.select(stalled, [], [], 0.1)[0]) == 2, timeout=10)
        with KeeperConnection.connect(socket_dir) as conn:

            def refused() -> bool:
                try:
                    _, fd = conn.get_artifact(weights, key)
                except KeeperError as exc:
                    assert exc.code == "busy" and "replies not read yet hold the keeper's fds" in str(exc)
                    return True
                if fd is not None:
                    os.close(fd)
                return False

            assert wait_until(refused, timeout=10)
        assert cache.get_artifact(weights, key) is None  # busy: a miss, logged
        assert [a.leases for a in cache.artifacts()] == [0]
        for sock in stalled:
            assert sock is not None
            sock.close()
        assert wait_until(lambda: cache.get_artifact(weights, key) == b"blob", timeout=10)
        assert keeper.poll() is None
    finally:
        terminate_keeper(keeper)


def test_every_artifact_is_listed_inspected_and_evicted_however_many_there_are(socket_dir: Path) -> None:
    """Issue 33, finding 3: 1,100 newer artifacts under the same weights pushed an older one out of the one
    capped reply of ``list_artifacts``: ``ls``, ``ls --json``, ``Cache.artifacts()`` and ``inspect`` lost it, and
    ``evict --all`` exited 0 leaving 77 behind. The keeper pages; every reader walks every page."""
    cache = wc.Cache(socket_dir, spawn=True)  # detached: its log is a file (1,101 log lines)
    oldest = cache.put_artifact(WEIGHTS, ArtifactKey("test.old", {"n": 0}), b"the first one")
    with KeeperConnection.connect(socket_dir) as conn:
        for i in range(messages.MAX_LISTED_ARTIFACTS + 76):
            artifact_ops.put(conn, WEIGHTS, ArtifactKey("test.flood", {"i": i}), b"x")
        first = messages.ListArtifactsReply.from_json(conn._ask(messages.ListArtifactsRequest().to_json()))
        assert len(first.artifacts) == messages.MAX_LISTED_ARTIFACTS and first.next is not None  # one page
    listed = cache.artifacts()
    assert len(listed) == messages.MAX_LISTED_ARTIFACTS + 77 and oldest.info.key in {a.key for a in listed}
    assert listed[-1].key == oldest.info.key  # most recently used first, the first one last

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        command = [sys.executable, "-m", "weightcache", *args, "--socket-dir", str(socket_dir)]
        return subprocess.run(command, capture_output=True, text=True, timeout=120)

    as_json = json.loads(cli("ls", "--json").stdout)
    assert len(as_json["artifacts"]) == messages.MAX_LISTED_ARTIFACTS + 77
    name = f"{WEIGHTS[:12]}/{oldest.info.key_digest[:12]}"
    assert name in cli("ls").stdout
    shown = cli("inspect", name)
    assert shown.returncode == 0 and "test.old" in shown.stdout, shown.stderr
    gone = cli("evict", "--all")
    assert gone.returncode == 0, gone.stderr
    assert cache.artifacts() == []


def test_a_memfd_sized_but_never_written_costs_the_budget_nothing(socket_dir: Path) -> None:
    """Issue 33, finding 2: the store counted declared sizes, so memfds that were sized but never written (no
    memory at all) filled the budget and every later publish failed with BudgetExceeded. The budget counts what a
    segment really holds."""
    serve_detached(socket_dir, "--max-bytes", "cpu=8M")
    size = 6 << 20
    hollow = os.memfd_create("hollow", os.MFD_ALLOW_SEALING)
    os.ftruncate(hollow, size)  # 6 MiB declared, not a page written
    fcntl.fcntl(hollow, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    zeros = hashlib.sha256(bytes(size)).hexdigest()
    with KeeperConnection.connect(socket_dir) as holder:  # holds its lease while this block runs
        holder.put_artifact(WEIGHTS, ArtifactKey("test.hollow"), hollow, size, zeros)
        os.close(hollow)
        real = wc.Cache(socket_dir).put_artifact(WEIGHTS, KEY, os.urandom(4 << 20))  # 4 MiB written
        assert real.created
        [line] = [
            x
            for x in subprocess.run(
                [sys.executable, "-m", "weightcache", "ls", "--socket-dir", str(socket_dir)],
                capture_output=True,
                text=True,
                timeout=60,
            ).stdout.splitlines()
            if "budget" in x
        ]
        assert "cpu 4.0 MiB of 8.0 MiB" in line, line

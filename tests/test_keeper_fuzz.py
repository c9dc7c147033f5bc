"""Property-based attacks on a real keeper: whatever arrives, it answers or drops that connection, and keeps
serving everyone else (truncated frames, huge lengths, wrong types, wrong or missing fds, unknown versions)."""

from __future__ import annotations

import array
import contextlib
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import one_tensor_manifest, open_fds, sealed_memfd, start_keeper, stop_keeper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.client import KeeperConnection
from weightcache.errors import WeightCacheError
from weightcache.fingerprint import Fingerprint

OPS = [
    "hello",
    "publish",
    "get",
    "list",
    "inspect",
    "evict",
    "put_artifact",
    "get_artifact",
    "list_artifacts",
    "explode",
    None,
    7,
]

json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False) | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)
messages = st.fixed_dictionaries(
    {"op": st.sampled_from(OPS)},
    optional={
        "protocol": json_values | st.integers(-3, 5),
        "min_protocol": json_values,
        "digest": json_values | st.text(max_size=70),
        "placement": json_values,
        "manifest": json_values,
        "force": json_values,
        "all": json_values,
        "weights": json_values | st.sampled_from(["ab" * 32, "0" * 8]),
        "key": json_values | st.just({"kind": "torch.compile", "fields": {}}),
        "size": json_values | st.integers(-1, 1 << 40),
        "sha256": json_values | st.just("0" * 64),
        "replace": json_values,
        "trust": json_values,
    },
)


@pytest.fixture(scope="module")
def fuzz_keeper() -> Iterator[tuple[Path, subprocess.Popen[bytes]]]:
    base = Path(tempfile.mkdtemp(prefix="wc-", dir="/tmp"))
    socket_dir = base / "s"
    proc = start_keeper(socket_dir)
    yield socket_dir, proc
    stop_keeper(socket_dir)
    proc.wait(10)
    shutil.rmtree(base, ignore_errors=True)


def frame(payload: bytes, nfds: int, version: int = 1, magic: bytes = b"WC", length: int | None = None) -> bytes:
    return magic + bytes([version, nfds]) + struct.pack("!I", len(payload) if length is None else length) + payload


def some_fds(kinds: list[str]) -> list[int]:
    fds = []
    for kind in kinds:
        if kind == "pipe":
            r, w = os.pipe()
            os.close(w)
            fds.append(r)
        elif kind == "memfd":
            fd = os.memfd_create("weightcache")
            os.ftruncate(fd, 4096)
            fds.append(fd)
        else:
            with tempfile.TemporaryFile() as f:
                fds.append(os.dup(f.fileno()))
    return fds


def exchange(socket_dir: Path, chunks: list[bytes], fds: list[int]) -> None:
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(5)
    try:
        s.connect(str(socket_dir / "keeper.sock"))
        for i, chunk in enumerate(chunks):
            anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds and i == 0 else []
            s.sendmsg([chunk], anc)
        s.shutdown(socket.SHUT_WR)
        while s.recv(65536):
            pass
    except OSError:
        pass  # the keeper may close on us mid-conversation: that is an allowed answer
    finally:
        s.close()
        for fd in fds:
            os.close(fd)


def assert_serving(socket_dir: Path, proc: subprocess.Popen[bytes]) -> None:
    assert proc.poll() is None, "the keeper died"
    with KeeperConnection.connect(socket_dir) as conn:
        assert conn.request({"op": "list"})[0]["ok"]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(
    hello_first=st.booleans(),
    message=messages,
    fd_kinds=st.lists(st.sampled_from(["pipe", "memfd", "file"]), max_size=3),
    announce=st.integers(0, 4),
    cut=st.integers(0, 40),
    version=st.sampled_from([1, 1, 1, 0, 2, 255]),
)
def test_structured_garbage(
    fuzz_keeper: tuple[Path, subprocess.Popen[bytes]],
    hello_first: bool,
    message: dict,
    fd_kinds: list[str],
    announce: int,
    cut: int,
    version: int,
) -> None:
    socket_dir, proc = fuzz_keeper
    chunks = []
    if hello_first:
        chunks.append(frame(json.dumps({"op": "hello", "protocol": 1}).encode(), 0))
    payload = json.dumps(message).encode()
    data = frame(payload, announce, version=version)
    if cut:  # truncate the frame somewhere
        data = data[: max(1, len(data) - cut)]
    chunks.append(data)
    exchange(socket_dir, chunks, some_fds(fd_kinds))
    assert_serving(socket_dir, proc)


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(raw=st.binary(max_size=200), length=st.one_of(st.none(), st.integers(0, 2**32 - 1)))
def test_raw_bytes_and_lengths(
    fuzz_keeper: tuple[Path, subprocess.Popen[bytes]], raw: bytes, length: int | None
) -> None:
    socket_dir, proc = fuzz_keeper
    exchange(socket_dir, [frame(raw, 0, length=length)] if length is not None else [raw or b"\0"], [])
    assert_serving(socket_dir, proc)


@pytest.fixture(scope="module")
def fingerprint_json() -> Iterator[dict]:
    from models import make_checkpoint

    base = Path(tempfile.mkdtemp(prefix="wc-fuzz-"))
    yield Fingerprint.create(make_checkpoint(base / "ckpt")).to_json()
    shutil.rmtree(base, ignore_errors=True)


def _valid_manifest(fingerprint: dict, placement: str = "cpu") -> dict:
    # a deep copy of the fingerprint, to mutate
    return one_tensor_manifest(json.loads(json.dumps(fingerprint)), placement=placement)


MANIFEST_PATHS = [
    ("version",),
    ("fingerprint",),
    ("fingerprint", "model_path"),
    ("fingerprint", "placement"),
    ("segments",),
    ("segments", 0),
    ("segments", 0, "size"),
    ("segments", 0, "kind"),
    ("tensors",),
    ("tensors", "name"),
    ("tensors", "segment", 0),
    ("tensors", "offset", 0),
    ("tensors", "dtype", 0),
    ("tensors", "shape", 0),
    ("tensors", "stride", 0),
    ("tensors", "kind", 0),
    ("tensors", "requires_grad"),
    ("tensors", "digest", 0),
]


#: What a client can send (the library refuses to encode NaN or infinity).
finite_json = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12,
)


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(path=st.sampled_from(MANIFEST_PATHS), value=finite_json, seal=st.booleans())
def test_mutated_publish(
    fuzz_keeper: tuple[Path, subprocess.Popen[bytes]], fingerprint_json: dict, path: tuple, value: object, seal: bool
) -> None:
    """A valid publish with one field replaced by anything: refused with an error reply, or (if still valid)
    published; either way the keeper keeps serving, and every entry it lists has a manifest that parses."""

    from weightcache.manifest import Manifest

    socket_dir, proc = fuzz_keeper
    manifest = _valid_manifest(fingerprint_json)
    target = manifest
    for key in path[:-1]:
        target = target[key]
    target[path[-1]] = value
    fd = sealed_memfd(512, seal)
    try:
        with KeeperConnection.connect(socket_dir) as conn:
            try:
                conn.request({"op": "publish", "manifest": manifest}, [fd])
            except WeightCacheError as exc:
                assert str(exc)  # an error that says something
            for entry in conn.request({"op": "list"})[0]["entries"]:
                shown = conn.request({"op": "inspect", "digest": entry["key"]})[0]
                Manifest.from_json(shown["manifest"])
                conn.request({"op": "evict", "digest": entry["key"], "force": True})
    finally:
        os.close(fd)
    assert_serving(socket_dir, proc)


# --- hostile peers: what one connection may cost the keeper --------------------------------------------------


def greeted(socket_dir: Path) -> socket.socket:
    """A raw connection that has said hello (so the keeper treats it as a client)."""
    s = socket.socket(socket.AF_UNIX)
    s.settimeout(10)
    s.connect(str(socket_dir / "keeper.sock"))
    s.sendall(frame(json.dumps({"op": "hello", "protocol": 1}).encode(), 0))
    header = s.recv(8)
    s.recv(struct.unpack("!I", header[4:])[0])
    return s


def keeper_status(pid: int, key: str) -> int:
    """A ``/proc/<pid>/status`` value in kB (VmRSS, VmHWM)."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise KeyError(key)


def test_stalled_peers_cannot_exhaust_the_keepers_fds(tmp_path: Path) -> None:
    """fds riding on the one-byte pieces of a frame header are refused at once, and a connection that sends
    more than a frame may carry is dropped: a dozen stalled peers leave the keeper far from its fd limit, and a
    legitimate client gets in at once."""
    socket_dir = tmp_path / "s"
    proc = start_keeper(socket_dir, nofile=16384)
    memfd = os.memfd_create("weightcache")
    peers = []
    try:
        rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd] * 250))]
        for _ in range(12):
            s = greeted(socket_dir)
            peers.append(s)
            with contextlib.suppress(OSError):
                for piece in frame(b"{}", 250)[:7]:  # the header, byte by byte, each with 250 fds; never finished
                    s.sendmsg([bytes([piece])], rights)
                    time.sleep(0.005)
        time.sleep(0.5)
        assert open_fds(proc.pid) < 4096, "the keeper holds the stalled peers' fds"
        start = time.monotonic()
        with KeeperConnection.connect(socket_dir) as conn:
            conn.list()
        assert time.monotonic() - start < 5
    finally:
        for s in peers:
            s.close()
        os.close(memfd)
        stop_keeper(socket_dir)
        proc.wait(10)


@pytest.mark.parametrize("kind", ["list", "publish"])
def test_big_frames_cost_the_keeper_little_memory(tmp_path: Path, kind: str) -> None:
    """16 peers at once each send a 64 MiB frame (the largest a publish may be): frames of ops other than
    publish are refused from their header, and the bytes in flight across connections are capped."""
    socket_dir = tmp_path / "s"
    proc = start_keeper(socket_dir)
    body = b'{"op":"' + kind.encode() + b'","pad":['
    payload = body + b"0," * ((64 * 2**20 - len(body) - 4) // 2) + b"0]}"
    memfd = os.memfd_create("weightcache")
    try:
        before = keeper_status(proc.pid, "VmRSS")

        def send() -> None:
            with contextlib.suppress(OSError), greeted(socket_dir) as s:
                rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))]
                data = frame(payload, 1 if kind == "publish" else 0)
                s.sendmsg([data[:8]], rights if kind == "publish" else [])
                s.sendall(data[8:])
                s.recv(4096)

        threads = [threading.Thread(target=send) for _ in range(16)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        peak = keeper_status(proc.pid, "VmHWM")
        assert peak - before < 512 * 1024, f"the keeper grew by {(peak - before) // 1024} MiB"
        assert proc.poll() is None
        with KeeperConnection.connect(socket_dir) as conn:
            conn.list()
    finally:
        os.close(memfd)
        stop_keeper(socket_dir)
        proc.wait(10)


def test_deeply_nested_json_is_a_bad_frame_not_a_traceback(tmp_path: Path) -> None:
    socket_dir = tmp_path / "s"
    proc = start_keeper(socket_dir)
    try:
        with greeted(socket_dir) as s:
            s.sendall(frame(b'{"op":"list","x":' + b"[" * 30000 + b"]" * 30000 + b"}", 0))
            header = s.recv(8)
            reply = json.loads(s.recv(struct.unpack("!I", header[4:])[0]))
        assert reply["ok"] is False and reply["error"] == "bad_frame" and "nested" in reply["message"]
        with KeeperConnection.connect(socket_dir) as conn:
            conn.list()
    finally:
        stop_keeper(socket_dir)
        proc.wait(10)
    assert proc.stderr is not None
    log = proc.stderr.read().decode()
    assert "Traceback" not in log and "RecursionError" not in log

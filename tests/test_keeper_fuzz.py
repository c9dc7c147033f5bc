"""Property-based attacks on a real keeper: whatever arrives, it answers or drops that connection, and keeps
serving everyone else (truncated frames, huge lengths, wrong types, wrong or missing fds, unknown versions)."""

from __future__ import annotations

import array
import json
import os
import shutil
import socket
import struct
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import one_tensor_manifest, sealed_memfd, start_keeper, stop_keeper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.client import KeeperConnection
from weightcache.errors import WeightCacheError
from weightcache.fingerprint import Fingerprint

OPS = ["hello", "publish", "get", "list", "inspect", "evict", "explode", None, 7]

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

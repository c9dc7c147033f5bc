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
from conftest import start_keeper, stop_keeper
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from weightcache.client import KeeperConnection

OPS = ["hello", "publish", "get", "release", "list", "inspect", "evict", "explode", None, 7]

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

"""What a hostile member of a keeper's ``--allow-group`` does to try to starve the owner (issue 22, finding 3).

Torch-free, so a process that dropped to another uid runs it fast. ``python hostile.py SOCKET_DIR DIGEST`` drops to
uid 65534 (group 4242), takes every keeper-wide resource it can, prints what it got as one JSON line, and holds
everything until its stdin closes.
"""

from __future__ import annotations

import array
import fcntl
import json
import os
import socket
import sys
import threading
from typing import Any

from weightcache import artifacts, protocol
from weightcache.artifact_key import ArtifactKey
from weightcache.client import KeeperConnection
from weightcache.errors import KeeperError, WeightCacheError
from weightcache.manifest import MANIFEST_VERSION


def sealed_memfd(size: int = 512) -> int:
    fd = os.memfd_create("weightcache", os.MFD_ALLOW_SEALING)
    os.ftruncate(fd, size)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW)
    return fd


def manifest(
    fingerprint: dict[str, Any], segments: int, tensors: int = 1, name_chars: int = 8, prefix: str = ""
) -> dict[str, Any]:
    """A valid manifest of ``segments`` 512-byte memfd segments and ``tensors`` float32[4] tensors named with
    ``prefix`` and ``name_chars`` digits each."""
    n = tensors
    return {
        "version": MANIFEST_VERSION,
        "fingerprint": fingerprint,
        "segments": [{"kind": "memfd", "size": 512, "placement": "cpu"}] * segments,
        "tensors": {
            "name": [f"{prefix}{i:0{name_chars}d}" for i in range(n)],
            "segment": [i % segments for i in range(n)],
            "offset": [0] * n,
            "dtype": ["float32"] * n,
            "shape": [[4]] * n,
            "stride": [[1]] * n,
            "kind": ["tensor"] * n,
            "requires_grad": [False] * n,
            "digest": [None] * n,
        },
    }


def publish(conn: KeeperConnection, fingerprint: dict[str, Any], segments: int, **kw: Any) -> str:
    fds = [sealed_memfd() for _ in range(segments)]
    try:
        return conn.publish(manifest(fingerprint, segments, **kw), fds).key
    finally:
        protocol.close_fds(fds)


def raw_connection(socket_dir: str) -> socket.socket | None:
    """A connection that said hello, as a raw socket; None if the keeper refused it."""
    try:
        conn = KeeperConnection.connect(socket_dir)
    except WeightCacheError:
        return None
    sock: socket.socket = conn._sock  # from here this side speaks the protocol by hand
    return sock


def starve(socket_dir: str, digest: str, fingerprint: dict[str, Any]) -> dict[str, int]:
    got: dict[str, int] = {}
    held: list[Any] = []
    # Segment fds: entries of 200 tiny segments each, until the keeper refuses.
    conn = KeeperConnection.connect(socket_dir)
    held.append(conn)
    got["entries"] = got["entries_refused"] = 0
    for i in range(10):
        try:
            publish(conn, {**fingerprint, "extra": f"m{i}"}, 200)
            got["entries"] += 1
        except WeightCacheError:
            got["entries_refused"] += 1
    # Bytes in flight: one connection announces a 64 MiB publish and sends nothing, one sends 60 MiB of it.
    memfd = os.memfd_create("x")
    header = protocol.HEADER.pack(protocol.MAGIC, protocol.WIRE_VERSION, 1, protocol.MAX_PAYLOAD_BYTES)
    rights = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [memfd]))]
    got["stalled"] = 0
    for sent in (0, 60 << 20):
        sock = raw_connection(socket_dir)
        if sock is None:
            continue
        held.append(sock)
        sock.sendmsg([header], rights)
        if sent:
            sock.settimeout(5)
            threading.Thread(target=_send_quietly, args=(sock, b"0" * sent), daemon=True).start()
        got["stalled"] += 1
    # Replies never read: gets of an entry with many segments and a large manifest.
    got["gets"] = got["gets_refused"] = 0
    request = json.dumps({"op": "get", "digest": digest, "placement": "cpu"}).encode()
    get = protocol.HEADER.pack(protocol.MAGIC, protocol.WIRE_VERSION, 0, len(request)) + request
    for _ in range(30):
        sock = raw_connection(socket_dir)
        if sock is None:
            got["gets_refused"] += 1
            continue
        held.append(sock)
        sock.sendall(get)
        got["gets"] += 1
    # Connections: as many idle ones as the keeper admits.
    got["idle"] = got["idle_refused"] = 0
    for _ in range(80):
        sock = raw_connection(socket_dir)
        if sock is None:
            got["idle_refused"] += 1
        else:
            held.append(sock)
            got["idle"] += 1
    print(json.dumps(got), flush=True)
    sys.stdin.read()
    return got


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.sendall(data)
    except OSError:
        pass


def list_flood(socket_dir: str, unread: int) -> dict[str, Any]:
    """Issue 33, finding 1: publish ~1,000 tiny artifacts with ~15 KiB keys, send ``list_artifacts`` on
    ``unread`` connections and read nothing, then ask once more on a connection that reads its replies."""
    got: dict[str, Any] = {"published": 0}
    with KeeperConnection.connect(socket_dir) as conn:
        for i in range(1000):
            key = ArtifactKey("hostile.flood", {"i": i, "pad": "x" * 15_000})
            artifacts.put(conn, "ab" * 32, key, b"tiny")
            got["published"] += 1
    request = json.dumps({"op": "list_artifacts"}).encode()
    frame = protocol.HEADER.pack(protocol.MAGIC, protocol.WIRE_VERSION, 0, len(request)) + request
    held = []
    for _ in range(unread):
        sock = raw_connection(socket_dir)
        if sock is not None:
            sock.sendall(frame)
            held.append(sock)
    got["unread"] = len(held)
    try:
        with KeeperConnection.connect(socket_dir) as reader:
            got["listed"] = len(reader.list_artifacts().artifacts)
        got["busy"] = False
    except KeeperError as exc:
        got["busy"], got["code"], got["message"] = True, exc.code, str(exc)
    print(json.dumps(got), flush=True)
    sys.stdin.read()
    return got


#: What a terminal acts on: set its title, ring, return the cursor, a C1 CSI, a bidi override, a lone surrogate.
EVIL = "\x1b]0;owned\x07\r\x9b2J\u202e\ud800"


def publish_evil(socket_dir: str, fingerprint: dict[str, Any]) -> None:
    """Publish an entry whose strings a terminal would act on (architecture, parallel axis, tensor names)."""
    evil = {**fingerprint, "architecture": f"Evil{EVIL}", "parallel": [[f"tp{EVIL}", 0, 1]], "extra": "evil"}
    with KeeperConnection.connect(socket_dir) as conn:
        print(json.dumps({"key": publish(conn, evil, 1, tensors=2, prefix=EVIL)}), flush=True)


if __name__ == "__main__":
    os.setgroups([4242])
    os.setgid(65534)
    os.setuid(65534)
    if sys.argv[1] == "starve":
        starve(sys.argv[2], sys.argv[3], json.loads(sys.argv[4]))
    elif sys.argv[1] == "list-flood":
        list_flood(sys.argv[2], int(sys.argv[3]))
    else:
        publish_evil(sys.argv[2], json.loads(sys.argv[3]))

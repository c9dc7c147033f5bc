"""Frames on a real socket pair: round trips with fds, and every malformed input rejected cleanly."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from weightcache import protocol
from weightcache.errors import ProtocolError


def pair() -> tuple[socket.socket, socket.socket]:
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_round_trip_with_fds() -> None:
    a, b = pair()
    r, w = os.pipe()
    protocol.send_frame(a, {"op": "x", "n": [1, 2, 3]}, [r, w])
    msg, fds = protocol.recv_frame(b)
    assert msg == {"op": "x", "n": [1, 2, 3]} and len(fds) == 2
    os.write(fds[1], b"hi")
    assert os.read(r, 2) == b"hi"
    protocol.close_fds([r, w, *fds])


def test_large_payload() -> None:
    a, b = pair()
    import threading

    big = {"blob": "x" * (8 << 20)}
    t = threading.Thread(target=protocol.send_frame, args=(a, big))
    t.start()
    msg, _ = protocol.recv_frame(b)
    t.join()
    assert msg == big


def raw(a: socket.socket, data: bytes, fds: list[int] | None = None) -> None:
    anc = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, __import__("array").array("i", fds))] if fds else []
    a.sendmsg([data], anc)


@pytest.mark.parametrize(
    "data, match",
    [
        (b"XX" + bytes([1, 0]) + struct.pack("!I", 2) + b"{}", "magic"),
        (b"WC" + bytes([9, 0]) + struct.pack("!I", 2) + b"{}", "version"),
        (b"WC" + bytes([1, 0]) + struct.pack("!I", 2**31), "limit"),
        (b"WC" + bytes([1, 0]) + struct.pack("!I", 3) + b"[1]", "JSON object"),
        (b"WC" + bytes([1, 0]) + struct.pack("!I", 2) + b"\xff\xfe", "UTF-8 JSON"),
        (b"WC" + bytes([1, 2]) + struct.pack("!I", 2) + b"{}", "announces 2 fds but 0"),
        (b"WC" + bytes([1, 0]) + struct.pack("!I", 10) + b"{}", "closed the connection after 2"),
        (b"WC\x01", "middle of a frame header"),
    ],
)
def test_malformed_frames(data: bytes, match: str) -> None:
    a, b = pair()
    raw(a, data)
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(ProtocolError, match=match):
        protocol.recv_frame(b)


def test_unannounced_fds_are_closed() -> None:
    a, b = pair()
    r, w = os.pipe()
    before = open_fds()
    raw(a, b"WC" + bytes([1, 0]) + struct.pack("!I", 2) + b"{}", [r, w])
    with pytest.raises(ProtocolError, match="announces 0 fds but 2"):
        protocol.recv_frame(b)
    assert open_fds() == before  # the received duplicates were closed


def test_clean_close_between_frames() -> None:
    a, b = pair()
    a.close()
    with pytest.raises(protocol.PeerClosed):
        protocol.recv_frame(b)


def test_send_limits() -> None:
    a, _ = pair()
    with pytest.raises(ProtocolError, match="at most"):
        protocol.send_frame(a, {}, list(range(protocol.MAX_FDS + 1)))


def test_field_checks() -> None:
    msg = {"op": "get", "digest": "ab", "n": True}
    assert protocol.field(msg, "digest", str) == "ab"
    with pytest.raises(ProtocolError, match="lacks the field 'placement'"):
        protocol.field(msg, "placement", str)
    with pytest.raises(ProtocolError, match="boolean"):
        protocol.field(msg, "n", int)
    assert protocol.field(msg, "missing", str, optional=True) is None


def test_peer_credentials() -> None:
    a, _b = pair()
    pid, uid, gid = protocol.peer_credentials(a)
    assert (pid, uid, gid) == (os.getpid(), os.getuid(), os.getgid())


def test_members_share_the_others_pool_fairly() -> None:
    """Issue 33, item 8: three members holding their quarter each used to starve a fourth for good (whatever one
    gave back, it took again). A member that was refused counts among those sharing the members' pool, so the
    others take nothing more until they are back under their part, and what they give back goes to it."""
    now = [0.0]
    shares = protocol.Shares(64, owner=0, fraction=0.25, clock=lambda: now[0])  # a member 16, all members 48
    for member in (1, 2, 3):
        assert all(shares.try_take(member, 1) for _ in range(16))
    assert not shares.try_take(4, 1)  # the pool is full
    assert "4 members share 48, so each may take up to 12 now" in shares.describe(1)
    shares.give(1, 1)
    assert not shares.try_take(1, 1)  # 15 is over its part of 12: what it gave back waits for the fourth
    assert shares.try_take(4, 1)
    assert shares.try_take(0, 16)  # the owner's quarter stays free whatever the members do
    shares.give(4, 1)
    assert not shares.try_take(5, 2)  # a fifth is refused (47 of 48 held): it counts among the sharing
    now[0] += protocol.WAITING_S - 1
    assert not shares.try_take(1, 1)  # still within the minute: 15 is over a part of 12
    now[0] += 1  # the fifth asked a minute ago, the fourth holds nothing: three members share again
    assert shares.try_take(1, 1) and shares.used(1) == 16

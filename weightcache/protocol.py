"""The wire protocol between clients and the keeper: length-prefixed JSON frames, fds over SCM_RIGHTS.

Specified in docs/protocol.md. A frame is an 8-byte header followed by a UTF-8 JSON object::

    magic b"WC" | wire version (u8) | number of fds attached (u8) | payload length (u32, big endian)

The fds ride as SCM_RIGHTS ancillary data on the first byte of the header (a sender passes header and payload
to one ``sendmsg``); the header's count lets the receiver check that exactly the announced fds arrived. fds on
any later piece of a frame, or more than the receiver allows, are closed at once and end the connection. Every
length is bounded before anything is allocated, and nothing received is ever unpickled or evaluated: JSON is
parsed into plain values and checked field by field.

Layer L1: never imports torch (the keeper uses it; tests/test_layers.py checks).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from .errors import ProtocolError

MAGIC = b"WC"
#: Version of the frame layout (the 8-byte header). Changes only if the framing itself changes.
WIRE_VERSION = 1
#: Version of the message vocabulary; negotiated in ``hello``. A keeper serves clients whose range overlaps.
#: 2 added the artifact ops (``put_artifact``, ``get_artifact``, ``list_artifacts``); 1 is still served.
PROTOCOL_VERSION = 2
MIN_PROTOCOL_VERSION = 1

HEADER = struct.Struct("!2sBBI")
#: Largest JSON payload accepted (a manifest of ~100k tensors fits).
MAX_PAYLOAD_BYTES = 64 * 1024 * 1024
#: Most fds in one frame (the kernel's SCM_MAX_FD is 253).
MAX_FDS = 250
#: Largest payload accepted before a peer has said hello.
MAX_HELLO_BYTES = 64 * 1024
#: Largest payload the keeper accepts in a frame without fds (every op but ``publish``).
MAX_REQUEST_BYTES = 64 * 1024
#: Seconds a peer may take to deliver a whole frame once its first byte arrived.
FRAME_TIMEOUT_S = 30.0
#: Payload bytes read (and taken from an allowance) at a time.
CHUNK_BYTES = 1 << 20
_FD_SIZE = array.array("i").itemsize


class PeerClosed(ProtocolError):
    """The peer closed the connection cleanly between frames."""


class NoFrame(ProtocolError):
    """Nothing arrived within the idle timeout: the peer is silent (not: it sent part of a frame)."""


class Busy(ProtocolError):
    """The receiver cannot take this frame now: the bytes in flight across its connections are at their cap."""


#: Seconds a uid that was refused (or is waiting) still counts among the members that share the others' pool.
WAITING_S = 60.0


class Shares:
    """One capped resource of a receiver shared out per uid, so that no other user can starve its owner, and no
    member another.

    The owner's uid may use all of ``total``. Every other uid (a member) may hold at most ``fraction`` of it, and
    all members together at most ``1 - fraction``, so that at least ``fraction`` stays for the owner whatever the
    others do. Members are bounded against each other too: while ``k`` members hold some of the resource, wait
    for it, or were refused it in the last :data:`WAITING_S` seconds, each may take only up to its fair part of
    the members' pool (``(1 - fraction) / k``, never more than ``fraction``). A member that already holds more
    keeps it, but takes nothing more until it is back under its part, so what the others give back goes to the
    one that was refused. ``floor`` is the least any one uid may hold (one largest frame, say), so that a small
    total never makes a request impossible. Thread-safe; :meth:`take` can wait for room until a deadline.
    """

    def __init__(
        self,
        total: int,
        *,
        owner: int | None = None,
        fraction: float = 0.25,
        floor: int = 1,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.total = total
        self.owner = owner
        self.floor = floor
        self.per_uid = min(total, max(floor, int(total * fraction)))
        self.others = min(total, max(floor, int(total * (1 - fraction))))
        self._used: dict[int | None, int] = {}
        self._others_used = 0
        self._all = 0
        self._clock = clock
        #: members refused or waiting, and when they last were: they count among those sharing the pool.
        self._wanting: dict[int, float] = {}
        self._cond = threading.Condition()

    def used(self, uid: int | None = None) -> int:
        """What ``uid`` holds now; with no uid, what all hold."""
        with self._cond:
            return self._all if uid is None else self._used.get(uid, 0)

    def _is_member(self, uid: int | None) -> bool:
        return uid is not None and uid != self.owner

    def _members(self, uid: int | None) -> int:
        """How many members share the pool now, counting ``uid``. Called with the lock held."""
        now = self._clock()
        for gone in [u for u, when in self._wanting.items() if now - when >= WAITING_S]:
            del self._wanting[gone]
        sharing = {u for u, n in self._used.items() if n > 0 and self._is_member(u)}
        sharing.update(self._wanting)
        if uid is not None and uid != self.owner:
            sharing.add(uid)
        return max(1, len(sharing))

    def _part(self, uid: int | None) -> int:
        """The most member ``uid`` may hold after a take now: its fair part of the pool. Lock held."""
        return min(self.per_uid, max(self.floor, self.others // self._members(uid)))

    def _room(self, uid: int | None, n: int) -> bool:
        if self._all + n > self.total:
            return False
        if not self._is_member(uid):
            return True
        return self._used.get(uid, 0) + n <= self._part(uid) and self._others_used + n <= self.others

    def _wants(self, uid: int | None) -> None:
        """Record that member ``uid`` was refused or waits (it counts among those sharing). Lock held."""
        if uid is not None and uid != self.owner:
            self._wanting[uid] = self._clock()

    def cap(self, uid: int | None) -> int:
        """The most ``uid`` may ever hold."""
        return self.total if not self._is_member(uid) else self.per_uid

    def try_take(self, uid: int | None, n: int) -> bool:
        """Take ``n`` for ``uid`` if there is room now; whether it was taken."""
        with self._cond:
            if not self._room(uid, n):
                if n <= self.cap(uid):  # a request that can never fit does not make the others share
                    self._wants(uid)
                return False
            self._add(uid, n)
            return True

    def take(self, uid: int | None, n: int, deadline: float) -> bool:
        """Take ``n`` for ``uid``, waiting for room until ``deadline`` (``time.monotonic()``); whether it was
        taken. ``n`` beyond what ``uid`` may ever hold is refused at once."""
        with self._cond:
            if n > self.cap(uid):
                return False
            while not self._room(uid, n):
                self._wants(uid)
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    return False
                self._cond.wait(remaining)
            self._add(uid, n)
            return True

    def give(self, uid: int | None, n: int) -> None:
        """Give back ``n`` that ``uid`` took."""
        if n:
            with self._cond:
                self._add(uid, -n)
                self._cond.notify_all()

    def _add(self, uid: int | None, n: int) -> None:
        left = self._used.get(uid, 0) + n
        if left:
            self._used[uid] = left
        else:
            self._used.pop(uid, None)
        self._all += n
        if uid is not None and uid != self.owner:
            self._others_used += n
            if n > 0:
                self._wanting.pop(uid, None)

    def describe(self, uid: int | None) -> str:
        """``uid 1000 holds 12 of its share of 16 (all: 40 of 64)``, for a refusal."""
        with self._cond:
            mine = self._used.get(uid, 0)
            all_ = self._all
            members = self._members(uid) if self._is_member(uid) else 0
            part = self._part(uid) if members else 0
        if not members:
            return f"the owner holds {mine} of its share of {self.total} (all uids: {all_} of {self.total})"
        shared = f"; {members} members share {self.others}, so each may take up to {part} now" if members > 1 else ""
        return f"uid {uid} holds {mine} of its share of {self.per_uid}{shared} (all uids: {all_} of {self.total})"


class _Pool:
    """Payload bytes of the frames of one class of peers being received: at most ``cap`` held at once.

    Bytes are taken as they arrive. A chunk is granted only if, after it, the frames in progress can still all
    complete one after another within the cap (each frame's remaining need is known from its header, and a
    finished frame gives back all it held): so frames that each hold part of their bytes never wait for each
    other forever, and a frame whose peer sent nothing holds nothing.
    """

    def __init__(self, cap: int) -> None:
        self.cap = cap
        #: frame token -> [bytes received, bytes announced]
        self.frames: dict[int, list[int]] = {}
        self.held = 0

    def safe_with(self, token: int, n: int) -> bool:
        if self.held + n > self.cap:
            return False
        free = self.cap - self.held - n
        needs = sorted(
            (announced - received - (n if t == token else 0), announced)
            for t, (received, announced) in self.frames.items()
        )
        for need, announced in needs:
            if need > free:
                return False
            free += announced - need  # it completes and gives back all it held
        return True


class Allowance:
    """Payload bytes and fds that frames being received may hold at once, across every connection of a receiver.

    Payload bytes are taken as they arrive, a chunk at a time, not when a header announces them, so a peer that
    announces a large frame and sends nothing holds nothing. The owner's peers and other uids' peers have a
    pool of ``max_bytes`` each (with ``owner`` None: one pool), so another uid's frames never keep the owner's
    waiting. A chunk that does not fit waits (for at most its frame's deadline): a frame that would never fit, or
    a wait that runs out, is :class:`Busy`. fds are taken as they arrive, shared out per uid
    (:class:`Shares`), and given back when the frame is returned (or refused); over the cap they are closed at
    once (:class:`Busy`, no waiting: they are already here).
    """

    def __init__(self, max_bytes: int, max_fds: int, *, owner: int | None = None, fraction: float = 1.0) -> None:
        self.max_bytes = max_bytes
        self.max_fds = max_fds
        self.owner = owner
        self.fds = Shares(max_fds, owner=owner, fraction=fraction, floor=MAX_FDS)
        self._pools = {True: _Pool(max_bytes), False: _Pool(max_bytes)}
        self._next = 0
        self._cond = threading.Condition()

    @property
    def used(self) -> tuple[int, int]:
        """``(bytes, fds)`` held now, by all uids."""
        with self._cond:
            return sum(p.held for p in self._pools.values()), self.fds.used()

    def _pool(self, uid: int | None) -> _Pool:
        return self._pools[self.owner is None or uid is None or uid == self.owner]

    def take_fds(self, count: int, uid: int | None = None) -> None:
        if not self.fds.try_take(uid, count):
            raise Busy(f"the receiver holds too many fds of frames in flight: {self.fds.describe(uid)}; retry")

    def give_fds(self, count: int, uid: int | None = None) -> None:
        self.fds.give(uid, count)

    def begin(self, nbytes: int, uid: int | None = None) -> int:
        """Announce a frame of ``nbytes`` from ``uid``; returns its token. Nothing is taken yet."""
        pool = self._pool(uid)
        if nbytes > pool.cap:
            raise Busy(f"a frame of {nbytes} bytes never fits the receiver's {pool.cap} bytes in flight")
        with self._cond:
            self._next += 1
            pool.frames[self._next] = [0, nbytes]
            return self._next

    def take(self, token: int, nbytes: int, deadline: float, uid: int | None = None) -> None:
        """Take ``nbytes`` more for frame ``token``, waiting for room until ``deadline``."""
        pool = self._pool(uid)
        with self._cond:
            while not pool.safe_with(token, nbytes):
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    raise Busy(
                        f"the receiver holds {pool.held} bytes of frames in flight (cap {pool.cap}); {nbytes} more "
                        "did not fit in time: retry"
                    )
                self._cond.wait(remaining)
            pool.frames[token][0] += nbytes
            pool.held += nbytes

    def give(self, token: int, nbytes: int, uid: int | None = None) -> None:
        """Give back ``nbytes`` of frame ``token`` that did not arrive after all."""
        pool = self._pool(uid)
        with self._cond:
            pool.frames[token][0] -= nbytes
            pool.held -= nbytes
            self._cond.notify_all()

    def end(self, token: int, uid: int | None = None) -> None:
        """Frame ``token`` is parsed (or failed): give back all it held."""
        pool = self._pool(uid)
        with self._cond:
            received, _ = pool.frames.pop(token, (0, 0))
            pool.held -= received
            self._cond.notify_all()


def send_frame(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> None:
    """Send one frame: ``message`` as JSON with ``fds`` attached. The fds stay open on this side."""
    send_payload(sock, json.dumps(message, separators=(",", ":"), allow_nan=False).encode(), fds)


def send_payload(sock: socket.socket, payload: bytes, fds: Sequence[int] = ()) -> None:
    """Send one frame whose payload is already-encoded JSON (the keeper caches its manifests this way)."""
    if len(fds) > MAX_FDS:
        raise ProtocolError(f"a frame carries at most {MAX_FDS} fds; tried to send {len(fds)}")
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise ProtocolError(
            f"message of {len(payload)} bytes exceeds the {MAX_PAYLOAD_BYTES}-byte limit "
            "(too many tensors in one entry?)"
        )
    data = HEADER.pack(MAGIC, WIRE_VERSION, len(fds), len(payload)) + payload
    ancillary = [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds))] if fds else []
    sent = sock.sendmsg([data], ancillary)
    if sent < len(data):
        sock.sendall(data[sent:])


def close_fds(fds: Sequence[int]) -> None:
    """Close every fd, ignoring ones already closed."""
    for fd in fds:
        try:
            os.close(fd)
        except OSError:
            pass


def _fds_from_ancillary(ancdata: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            usable = len(data) - len(data) % _FD_SIZE
            fds.extend(array.array("i", data[:usable]))
    return fds


def recv_frame(
    sock: socket.socket,
    *,
    idle_timeout: float | None = None,
    max_payload: int = MAX_PAYLOAD_BYTES,
    max_plain_payload: int | None = None,
    max_fds: int = MAX_FDS,
    allowance: Allowance | None = None,
    uid: int | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Receive one frame: ``(message, fds)``. The caller owns (and must close) the returned fds.

    ``idle_timeout`` bounds the wait for the first byte (None: forever; past it :class:`NoFrame`); once it
    arrived, the whole frame must follow within :data:`FRAME_TIMEOUT_S`. Limits: ``max_payload`` bytes, or
    ``max_plain_payload`` for a frame without fds; ``max_fds`` fds, all on the frame's first byte; and, with an
    ``allowance``, the payload bytes and fds in flight across the receiver's connections, in ``uid``'s share
    (frames of at most :data:`MAX_REQUEST_BYTES` do not count): taken as they arrive, so the receiver's memory
    grows with what was sent, not with what a header announced. Raises :class:`PeerClosed` if the peer closed
    between frames and :class:`ProtocolError` for anything malformed; in every case every fd received so far is
    closed first.
    """
    sock.settimeout(idle_timeout)
    fds: list[int] = []
    deadline = 0.0
    taken_fds = 0
    token: int | None = None

    def arm() -> None:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise TimeoutError
        sock.settimeout(remaining)

    try:
        header = b""
        while len(header) < HEADER.size:
            try:
                data, ancdata, flags, _ = sock.recvmsg(
                    HEADER.size - len(header), socket.CMSG_SPACE(MAX_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
                )
            except TimeoutError:
                if not header:
                    raise NoFrame(f"nothing arrived within {idle_timeout:g} s") from None
                raise
            arrived = _fds_from_ancillary(ancdata)
            fds.extend(arrived)
            if arrived and allowance is not None:
                allowance.take_fds(len(arrived), uid)
                taken_fds += len(arrived)
            if arrived and header:
                raise ProtocolError("fds arrived after the first byte of a frame; they ride on its first byte only")
            if len(fds) > max_fds:
                raise ProtocolError(f"a frame here carries at most {max_fds} fds; {len(fds)} arrived")
            if flags & socket.MSG_CTRUNC:
                raise ProtocolError(
                    f"fds were dropped from a frame: the peer sent more than {MAX_FDS}, or this process "
                    "reached its open-file limit (ulimit -n)"
                )
            if not data:
                if header or fds:
                    raise ProtocolError("peer closed the connection in the middle of a frame header")
                raise PeerClosed("peer closed the connection")
            if not header:
                deadline = time.monotonic() + FRAME_TIMEOUT_S
            header += data
            arm()
        magic, wire, nfds, length = HEADER.unpack(header)
        if magic != MAGIC:
            raise ProtocolError(f"bad frame magic {magic!r}; expected {MAGIC!r} (not a weightcache peer?)")
        if wire != WIRE_VERSION:
            raise ProtocolError(f"frame format version {wire}; this side speaks {WIRE_VERSION}")
        if length > max_payload:
            raise ProtocolError(f"frame announces {length} payload bytes; the limit here is {max_payload}")
        if nfds != len(fds):
            raise ProtocolError(f"frame announces {nfds} fds but {len(fds)} arrived")
        if not fds and max_plain_payload is not None and length > max_plain_payload:
            raise ProtocolError(
                f"frame without fds announces {length} payload bytes; only a publish (which carries fds) may exceed "
                f"{max_plain_payload}"
            )
        if allowance is not None and length > MAX_REQUEST_BYTES:
            token = allowance.begin(length, uid)
        # Unmetered (a client reading the keeper's reply, or a small frame): one buffer of the announced length,
        # filled in place. Metered: grown as bytes arrive, each chunk taken from the allowance before it is read,
        # so a peer that announces much and sends little holds little.
        payload = bytearray(length if token is None else 0)
        view = memoryview(payload) if token is None else None
        received = 0
        while received < length:
            arm()
            want = min(length - received, CHUNK_BYTES)
            if token is not None:
                assert allowance is not None
                allowance.take(token, want, deadline, uid)
                arm()
                data, ancdata, flags, _ = sock.recvmsg(
                    want, socket.CMSG_SPACE(MAX_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
                )
                if len(data) < want:  # give back what was taken for bytes that did not come
                    allowance.give(token, want - len(data), uid)
                payload += data
                count = len(data)
            else:
                assert view is not None
                count, ancdata, flags, _ = sock.recvmsg_into(
                    [view[received : received + want]], socket.CMSG_SPACE(MAX_FDS * _FD_SIZE), socket.MSG_CMSG_CLOEXEC
                )
            stray = _fds_from_ancillary(ancdata)
            if stray:
                fds.extend(stray)
                raise ProtocolError("fds arrived in the middle of a frame payload")
            if not count:
                raise ProtocolError(f"peer closed the connection after {received} of {length} payload bytes")
            received += count
        if view is not None:
            view.release()
        try:
            message = json.loads(payload)
        except (UnicodeDecodeError, ValueError) as exc:
            raise ProtocolError(f"frame payload is not UTF-8 JSON: {exc}") from exc
        except RecursionError:
            raise ProtocolError("frame payload is JSON nested too deeply (messages are a few levels deep)") from None
        if not isinstance(message, dict):
            raise ProtocolError(f"frame payload must be a JSON object; found {type(message).__name__}")
        return message, fds
    except TimeoutError as exc:
        close_fds(fds)
        raise ProtocolError(f"peer sent a partial frame and did not finish it within {FRAME_TIMEOUT_S:.0f} s") from exc
    except OSError as exc:
        close_fds(fds)
        raise ProtocolError(f"connection failed while reading a frame: {exc}") from exc
    except BaseException:
        close_fds(fds)
        raise
    finally:
        if allowance is not None:
            if token is not None:
                allowance.end(token, uid)
            if taken_fds:
                allowance.give_fds(taken_fds, uid)


# --- field checks for messages read off the wire -----------------------------------------------------------


def field(message: dict[str, Any], key: str, kind: type | tuple[type, ...], *, optional: bool = False) -> Any:
    """``message[key]``, checked to be of ``kind``; ProtocolError naming the field otherwise."""
    if key not in message or message[key] is None:
        if optional:
            return None
        raise ProtocolError(f"message {message.get('op', '?')!r} lacks the field {key!r}")
    value = message[key]
    kinds = kind if isinstance(kind, tuple) else (kind,)
    if isinstance(value, bool) and bool not in kinds:
        raise ProtocolError(f"field {key!r} must be {_names(kinds)}; found a boolean")
    if not isinstance(value, kinds):
        raise ProtocolError(f"field {key!r} must be {_names(kinds)}; found {type(value).__name__}")
    return value


def _names(kinds: tuple[type, ...]) -> str:
    return " or ".join(k.__name__ for k in kinds)


def peer_credentials(sock: socket.socket) -> tuple[int, int, int]:
    """``(pid, uid, gid)`` of the process at the other end of a Unix socket (SO_PEERCRED)."""
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("iII"))
    pid, uid, gid = struct.unpack("iII", creds)
    return pid, uid, gid


__all__ = [
    "Allowance",
    "Busy",
    "CHUNK_BYTES",
    "FRAME_TIMEOUT_S",
    "MAX_FDS",
    "MAX_PAYLOAD_BYTES",
    "MAX_REQUEST_BYTES",
    "MIN_PROTOCOL_VERSION",
    "NoFrame",
    "PROTOCOL_VERSION",
    "PeerClosed",
    "Shares",
    "WIRE_VERSION",
    "close_fds",
    "field",
    "peer_credentials",
    "recv_frame",
    "send_frame",
    "send_payload",
]

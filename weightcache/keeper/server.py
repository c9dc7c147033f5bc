"""The keeper's server: who gets in, and what each request is answered with.

An accept loop admits a connection after checking its peer's credentials (``SO_PEERCRED``: the keeper's own
uid, or a member of ``--allow-group``) and the connection limit, then serves it on a thread of its own.

Every keeper-wide resource a peer can hold is shared out per uid (:class:`~weightcache.protocol.Shares`: each uid
other than the owner at most ``member_share`` of it, all of them together at most the rest), so that no member can
starve the owner: connections, payload bytes and fds of frames being received, the segment fds of entries (the
store's), and the fds duplicated for replies and the bytes of replies that are not read yet. A connection holding
no lease is dropped after ``idle_timeout`` without a request; a reply must be sent within :data:`SEND_TIMEOUT_S`
(a peer that does not read is dropped), and a peer must read a reply before it sends its next request (one
request at a time: a request that arrives while the previous reply is unread ends the connection). Each
frame read is one request; :data:`HANDLERS` maps its op to the method that answers it, using the entry
:class:`~weightcache.keeper.store.Store` for everything about entries. An open connection is the client's
lease on the entries it got or published; when it closes, the store releases them.

Bad input never takes the keeper down: a malformed frame closes that one connection, an invalid request gets
an error reply, a bug of ours costs one request (``internal``), and nothing received is unpickled or evaluated.
What this module must never do: touch process state (signals, rlimits, the instance lock, the socket file):
that is :mod:`weightcache.keeper.daemon`'s job.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import select
import socket
import struct
import termios
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from .. import messages, protocol
from .._version import __version__
from ..errors import ManifestError, ProtocolError, SegmentError
from ..messages import (
    ArtifactInfo,
    ClientInfo,
    ErrorReply,
    EvictReply,
    EvictRequest,
    GetArtifactReply,
    GetArtifactRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    InspectRequest,
    KeeperInfo,
    ListArtifactsReply,
    ListArtifactsRequest,
    ListReply,
    ListRequest,
    PublishRequest,
    PutArtifactRequest,
    RequestError,
    StopReply,
)
from ..protocol import close_fds, peer_credentials, recv_frame, send_frame
from .store import MEMBER_SHARE, Store

log = logging.getLogger("weightcache.keeper")

MAX_CONNECTIONS = 1024
#: Payload bytes of large frames (publishes) being received at once, across all connections: one frame of the
#: largest size, or several smaller ones; the rest wait their turn (see :class:`~weightcache.protocol.Allowance`).
MAX_INFLIGHT_BYTES = protocol.MAX_PAYLOAD_BYTES
#: Default cap on the fds of frames being received at once, across all connections (the daemon sizes it from its
#: open-file limit).
MAX_INFLIGHT_FDS = 4096
#: Default cap on the fds duplicated for replies that are not sent or read yet (the daemon sizes it too).
MAX_REPLY_FDS = 4096
#: Cap on the bytes of replies that are not sent or read yet (a get's manifest, a list page, an inspect).
MAX_REPLY_BYTES = 4 * protocol.MAX_PAYLOAD_BYTES
#: Seconds a connection that holds no lease may stay silent after hello before it is dropped.
IDLE_TIMEOUT_S = 30.0
#: Seconds a reply may take to be sent (the peer must read it): past it, the connection is dropped.
SEND_TIMEOUT_S = protocol.FRAME_TIMEOUT_S
#: Most entries one ``list`` page takes from the store (the page usually ends earlier, at its byte size).
LIST_PAGE_ENTRIES = 1024
#: Replies this small are not counted against a share: a connection has at most one unread (see above).
SMALL_REPLY_BYTES = protocol.MAX_REQUEST_BYTES

#: A reply: a JSON object, or a payload already encoded (a get's manifest is encoded once, at publish).
Reply = dict[str, Any] | bytes


@attrs.define
class Peer:
    """One admitted connection: its id (the store's lease holder), socket and peer credentials."""

    id: int
    sock: socket.socket
    pid: int
    #: The peer's uid (SO_PEERCRED): what its publications are recorded under.
    uid: int
    #: Whether the peer runs as the keeper's own uid (else: a member of the allowed group).
    owner: bool
    since: float
    greeted: bool = False
    #: What the reply last sent holds of the reply shares until the peer's next request shows it was read.
    reply_fds: int = 0
    reply_bytes: int = 0


class Server:
    """Serves ``listener`` (bound and listening) until :meth:`stop`; entries live in ``store``."""

    def __init__(
        self,
        store: Store,
        listener: socket.socket,
        *,
        socket_dir: Path,
        allow_group: int | None = None,
        max_connections: int = MAX_CONNECTIONS,
        max_inflight_fds: int = MAX_INFLIGHT_FDS,
        max_reply_fds: int = MAX_REPLY_FDS,
        idle_timeout: float = IDLE_TIMEOUT_S,
        member_share: float = MEMBER_SHARE,
    ) -> None:
        self.store = store
        self.socket_dir = socket_dir
        #: A gid whose members may connect besides our own uid (``--allow-group``); they may not evict or stop.
        self.allow_group = allow_group
        self.max_connections = max_connections
        self.idle_timeout = idle_timeout
        owner = store.owner
        self._connections = protocol.Shares(max_connections, owner=owner, fraction=member_share)
        self._reply_fds = protocol.Shares(max_reply_fds, owner=owner, fraction=member_share, floor=protocol.MAX_FDS)
        self._reply_bytes = protocol.Shares(
            MAX_REPLY_BYTES, owner=owner, fraction=member_share, floor=protocol.MAX_PAYLOAD_BYTES
        )
        self.started = time.time()
        self._listener = listener
        self._lock = threading.Lock()
        self._peers: dict[int, Peer] = {}
        self._next_id = 0
        self._stopping = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):
            os.set_blocking(fd, False)  # signal.set_wakeup_fd needs it; a full pipe already wakes the loop
        self._allowance = protocol.Allowance(MAX_INFLIGHT_BYTES, max_inflight_fds, owner=owner, fraction=member_share)

    # --- the accept loop ---------------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        while not self._stopping.is_set():
            waitables: list[Any] = [self._listener, self._wake_r]
            ready, _, _ = select.select(waitables, [], [])
            if self._stopping.is_set():
                break
            if self._wake_r in ready:
                with contextlib.suppress(OSError):
                    os.read(self._wake_r, 4096)  # woken by a signal: its handler runs on this thread, now
            if self._listener not in ready:
                continue
            try:
                sock, _ = self._listener.accept()
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)  # e.g. out of fds: let connections drain instead of spinning
                continue
            self._admit(sock)

    @property
    def wakeup_fd(self) -> int:
        """A non-blocking fd whose writes wake the accept loop (for :func:`signal.set_wakeup_fd`: the kernel may
        deliver a signal to any thread, and Python runs its handler on the main thread, waiting in select)."""
        return self._wake_w

    @property
    def stop_requested(self) -> bool:
        """Whether :meth:`stop` was called (a ``stop`` request, SIGTERM, SIGINT): the keeper ends on purpose."""
        return self._stopping.is_set()

    def stop(self) -> None:
        """Ask the accept loop to exit (thread- and signal-safe)."""
        self._stopping.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def close(self) -> None:
        """Stop listening and shut every connection down (their threads then end and release their leases)."""
        self._listener.close()
        with self._lock:
            for peer in self._peers.values():
                with contextlib.suppress(OSError):
                    peer.sock.shutdown(socket.SHUT_RDWR)
        for fd in (self._wake_r, self._wake_w):
            with contextlib.suppress(OSError):
                os.close(fd)

    def _admit(self, sock: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(sock)
        except OSError:
            sock.close()
            return
        owner = uid == os.getuid()
        if not owner and (self.allow_group is None or self.allow_group not in peer_groups(pid, gid)):
            log.warning("refused connection from pid %d uid %d gid %d", pid, uid, gid)
            allowed = f"uid {os.getuid()}" + (f" and group {self.allow_group}" if self.allow_group is not None else "")
            _refuse(sock, messages.FORBIDDEN, f"this keeper serves {allowed} only; you are uid {uid} (gid {gid})")
            return
        if not self._connections.try_take(uid, 1):
            log.warning("refused connection from pid %d uid %d: %s", pid, uid, self._connections.describe(uid))
            _refuse(
                sock,
                messages.BUSY,
                f"over {self.max_connections} connections, or over this uid's share of them: of the keeper's "
                f"connections {self._connections.describe(uid)}. Close idle connections, or retry later",
            )
            return
        with self._lock:
            self._next_id += 1
            peer = self._peers[self._next_id] = Peer(self._next_id, sock, pid, uid, owner, time.time())
        try:
            threading.Thread(target=self._serve, args=(peer,), daemon=True).start()
        except RuntimeError as exc:  # thread or pid limit reached: refuse this one, keep serving
            log.warning("cannot start a thread for pid %d: %s", pid, exc)
            with self._lock:
                self._peers.pop(peer.id, None)
            self._connections.give(uid, 1)
            _refuse(sock, messages.BUSY, f"keeper cannot start a thread: {exc}")

    # --- one connection ----------------------------------------------------------------------------------------

    def _serve(self, peer: Peer) -> None:
        try:
            while not self._stopping.is_set():
                received = self._receive(peer)
                self._release_reply(peer)  # a new request (or the end): the last reply was read
                if received is None:
                    return
                if unread_bytes(peer.sock):
                    _dropped(peer, "sent a request before reading the previous reply")
                    close_fds(received[1])
                    return
                message, fds = received
                reply, out, last = self._answer(peer, message, fds)
                try:
                    # A peer that does not read its reply is dropped after the deadline, freeing what it held.
                    peer.sock.settimeout(SEND_TIMEOUT_S)
                    if isinstance(reply, bytes):
                        protocol.send_payload(peer.sock, reply, out)
                    else:
                        send_frame(peer.sock, reply, out)
                finally:
                    close_fds(out)
                if last:
                    if message.get("op") == messages.STOP:
                        self.stop()  # only now that the reply is out: the daemon then closes every connection
                    return
                if not self._await_read(peer):
                    return
        except (OSError, ProtocolError) as exc:
            log.info("connection %d (pid %d) failed: %s", peer.id, peer.pid, exc)
        finally:
            self._release_reply(peer)
            with self._lock:
                self._peers.pop(peer.id, None)
            self._connections.give(peer.uid, 1)
            self.store.release(peer.id)
            peer.sock.close()

    def _reserve_reply(self, peer: Peer, nfds: int, nbytes: int) -> None:
        """Count a reply of ``nfds`` fds and ``nbytes`` bytes against ``peer``'s uid's reply shares until the peer
        has read it; RequestError ``busy`` if they are full (replies of that uid are not read yet)."""
        nbytes = 0 if nbytes <= SMALL_REPLY_BYTES else nbytes
        if not self._reply_fds.try_take(peer.uid, nfds):
            raise RequestError(
                messages.BUSY,
                f"replies not read yet hold the keeper's fds: {self._reply_fds.describe(peer.uid)}. Read replies "
                "before asking again, or retry later",
            )
        if not self._reply_bytes.try_take(peer.uid, nbytes):
            self._reply_fds.give(peer.uid, nfds)
            raise RequestError(
                messages.BUSY,
                f"replies not read yet hold the keeper's memory: {self._reply_bytes.describe(peer.uid)} bytes. Read "
                "replies before asking again, or retry later",
            )
        peer.reply_fds += nfds
        peer.reply_bytes += nbytes

    def _await_read(self, peer: Peer) -> bool:
        """After a reply that holds reservations (a ``get``'s segment fds, a large reply's bytes): wait until the
        peer has read it, then release them: True. False (the connection ends, freeing them) when it has not read
        it within :data:`SEND_TIMEOUT_S`, or sent another request first. An engine reads its reply and then sends
        nothing for as long as it holds the entry: without this the reservation lasted as long, and a few such
        engines filled the uid's share of reply fds (``busy`` for every later ``get``)."""
        if not (peer.reply_fds or peer.reply_bytes):
            return True
        deadline = time.monotonic() + SEND_TIMEOUT_S
        pause = 0.0002
        while unread_bytes(peer.sock):
            left = deadline - time.monotonic()
            if left <= 0 or self._stopping.is_set():
                _dropped(peer, f"did not read its reply within {SEND_TIMEOUT_S:.0f} s")
                return False
            readable, _, _ = select.select([peer.sock], [], [], min(pause, left))
            if readable and unread_bytes(peer.sock):  # a request (or its end) before the reply was read
                _dropped(peer, "sent a request before reading the previous reply")
                return False
            pause = min(pause * 2, 0.05)
        self._release_reply(peer)
        return True

    def _release_reply(self, peer: Peer) -> None:
        self._reply_fds.give(peer.uid, peer.reply_fds)
        self._reply_bytes.give(peer.uid, peer.reply_bytes)
        peer.reply_fds = peer.reply_bytes = 0

    def _receive(self, peer: Peer) -> tuple[dict[str, Any], list[int]] | None:
        """The next request, or None when the connection is over (closed, or a broken frame answered)."""
        try:
            # Until hello, a silent peer is dropped after the frame timeout, and no fds are taken; after it, an
            # idle connection that holds a lease may stay open for as long as its engine runs, one that holds
            # none is dropped after the idle timeout. Only a publish (the one op with fds) may be larger than a
            # small request, and large frames share one allowance.
            if not peer.greeted:
                idle: float | None = protocol.FRAME_TIMEOUT_S
            else:
                idle = None if self.store.holds(peer.id) else self.idle_timeout
            return recv_frame(
                peer.sock,
                idle_timeout=idle,
                max_payload=protocol.MAX_PAYLOAD_BYTES if peer.greeted else protocol.MAX_HELLO_BYTES,
                max_plain_payload=protocol.MAX_REQUEST_BYTES,
                max_fds=protocol.MAX_FDS if peer.greeted else 0,
                allowance=self._allowance,
                uid=peer.uid,
            )
        except protocol.PeerClosed:
            return None
        except protocol.NoFrame:
            log.info("connection %d (pid %d uid %d) idle, holding no lease: dropped", peer.id, peer.pid, peer.uid)
            return None
        except ProtocolError as exc:
            log.info("connection %d (pid %d): %s", peer.id, peer.pid, exc)
            code = messages.BUSY if isinstance(exc, protocol.Busy) else messages.BAD_FRAME
            with contextlib.suppress(OSError):
                send_frame(peer.sock, ErrorReply(code, str(exc)).to_json())
            return None

    def _answer(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int], bool]:
        """``(reply, fds to send, whether the connection ends after it: a version mismatch, or a stop)``.

        Closes ``fds`` unless a handler took them."""
        op = message.get("op")
        try:
            if not peer.greeted and op != messages.HELLO:
                raise RequestError(messages.BAD_REQUEST, f"the first message must be 'hello'; got {op!r}")
            if op in messages.OWNER_OPS and not peer.owner:
                raise RequestError(
                    messages.FORBIDDEN,
                    f"{op!r} is for the keeper's owner (uid {os.getuid()}); members of the allowed group may "
                    "publish, get, list and inspect. Ask the owner.",
                )
            if fds and op not in messages.FD_OPS:
                raise RequestError(messages.BAD_REQUEST, f"message {op!r} carries no fds; {len(fds)} arrived")
            handler = HANDLERS.get(op) if isinstance(op, str) else None
            if handler is None:
                raise RequestError(messages.BAD_REQUEST, f"unknown op {op!r}; expected one of {sorted(messages.OPS)}")
            taken, fds = fds, []
            reply, out = handler(self, peer, message, taken)
            peer.greeted = True
            return reply, out, op == messages.STOP
        except RequestError as exc:
            # a version mismatch ends the connection: nothing else it could say would be understood
            return exc.reply().to_json(), [], exc.code == messages.VERSION
        except (ProtocolError, ManifestError, SegmentError) as exc:
            return ErrorReply(messages.BAD_REQUEST, str(exc)).to_json(), [], False
        except Exception as exc:  # a bug of ours must cost one request, never the keeper
            log.exception("connection %d (pid %d): internal error in %r", peer.id, peer.pid, op)
            return ErrorReply(messages.INTERNAL, f"keeper internal error: {exc!r}").to_json(), [], False
        finally:
            close_fds(fds)

    # --- the ops (see HANDLERS) --------------------------------------------------------------------------------

    def _hello(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = HelloRequest.from_json(message)
        theirs = request.protocol
        their_min = request.min_protocol or theirs
        lo, hi = max(their_min, protocol.MIN_PROTOCOL_VERSION), min(theirs, protocol.PROTOCOL_VERSION)
        if lo > hi:
            raise RequestError(
                messages.VERSION,
                f"protocol mismatch: this keeper (weightcache {__version__}, pid {os.getpid()}) speaks "
                f"protocol {protocol.MIN_PROTOCOL_VERSION}..{protocol.PROTOCOL_VERSION}, the client speaks "
                f"{their_min}..{theirs}. Run the same weightcache version on both sides, or stop the keeper "
                "(`weightcache stop`) so a matching one is started.",
            )
        return HelloReply(protocol=hi, keeper_version=__version__, pid=os.getpid(), uid=os.getuid()).to_json(), []

    def _publish(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        try:
            request = PublishRequest.from_json(message)
        except BaseException:
            close_fds(fds)
            raise
        # the store owns fds from here
        return self.store.publish(peer.id, peer.pid, request.manifest, fds, uid=peer.uid).to_json(), []

    def _get(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = GetRequest.from_json(message)
        # Unless the client names whom it trusts: its own publications, then the owner's.
        trust = request.trust or (peer.uid, self.store.owner)
        found = self.store.get(peer.id, peer.pid, request.digest, request.placement, trust)
        if found is None:
            others = tuple(self.store.publishers(request.digest, request.placement))
            return GetReply(found=False, others=others).to_json(), []
        payload = GetReply.encode_found(found.key, found.manifest_text, found.publisher)
        try:
            self._reserve_reply(peer, len(found.fds), len(payload))
        except RequestError:
            close_fds(found.fds)
            if found.fresh:
                self.store.unlease(peer.id, found.key)
            raise
        return payload, found.fds

    def _list(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = ListRequest.from_json(message)
        held = self.store.snapshot(request.after, LIST_PAGE_ENTRIES, messages.MAX_CLIENT_KEYS)
        with self._lock:
            peers = list(self._peers.values()) if request.after is None else []
        now = time.time()
        keeper = KeeperInfo(
            pid=os.getpid(),
            version=__version__,
            protocol=protocol.PROTOCOL_VERSION,
            socket_dir=str(self.socket_dir),
            started=self.started,
            uptime_s=round(now - self.started, 3),
            connections=self._connections.used(),
            budget=self.store.budget,
            bytes_by_placement=held.bytes_by_placement,
        )
        clients = tuple(ClientInfo(p.pid, p.since, *held.leases.get(p.id, ((), 0))) for p in peers)
        # Entries are encoded one at a time and the page ends at LIST_PAGE_BYTES (always at least one entry):
        # a reply, and what the keeper holds to send it, stays bounded however large or many the entries are.
        encoded: list[str] = []
        size = 0
        next_key = held.entries[-1].key if held.more else None
        for i, info in enumerate(held.entries):
            text = json.dumps(info.to_json(), separators=(",", ":"), allow_nan=False)
            if encoded and size + len(text) > messages.LIST_PAGE_BYTES:
                next_key = held.entries[i - 1].key
                break
            encoded.append(text)
            size += len(text)
        payload = ListReply.encode(keeper, encoded, clients, next_key)
        self._reserve_reply(peer, 0, len(payload))
        return payload, []

    def _inspect(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        payload = encode(self.store.inspect(InspectRequest.from_json(message).digest).to_json())
        self._reserve_reply(peer, 0, len(payload))
        return payload, []

    def _evict(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = EvictRequest.from_json(message)
        evicted = self.store.evict(request.digest, force=request.force, every=request.every)
        return EvictReply(evicted=tuple(evicted)).to_json(), []

    def _stop(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        return StopReply(pid=os.getpid()).to_json(), []

    # --- artifacts -----------------------------------------------------------------------------------------------

    def _put_artifact(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        try:
            request = PutArtifactRequest.from_json(message)
            if len(fds) != 1:
                raise RequestError(
                    messages.BAD_REQUEST,
                    f"put_artifact carries exactly one fd (a sealed memfd holding the blob); {len(fds)} arrived",
                )
        except BaseException:
            close_fds(fds)
            raise
        # the store owns the fd from here
        reply = self.store.put_artifact(
            peer.id,
            peer.pid,
            request.weights,
            request.key,
            request.size,
            request.sha256,
            fds[0],
            uid=peer.uid,
            replace=request.replace,
        )
        return reply.to_json(), []

    def _get_artifact(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = GetArtifactRequest.from_json(message)
        trust = request.trust or (peer.uid, self.store.owner)
        found = self.store.get_artifact(peer.id, peer.pid, request.weights, request.key, trust, peer.uid)
        if found is None:
            others, near = self.store.artifact_misses(request.weights, request.key, trust, messages.MAX_NEAR_KEYS)
            return GetArtifactReply(found=False, others=tuple(others), near=tuple(near)).to_json(), []
        reply = GetArtifactReply(found=True, artifact=found.info).to_json()
        try:  # its memfd's dup is a reply fd like a get's: shared out per uid until the peer reads it
            self._reserve_reply(peer, 1, len(json.dumps(reply)))
        except RequestError:
            os.close(found.fd)
            if found.fresh:
                self.store.unlease(peer.id, found.info.key)
            raise
        return reply, [found.fd]

    def _list_artifacts(self, peer: Peer, message: dict[str, Any], fds: list[int]) -> tuple[Reply, list[int]]:
        request = ListArtifactsRequest.from_json(message)
        # Pages in key order ("" sorts before every key: the first page), so that a client walking them sees every
        # artifact once however many there are (the first page of an earlier release was the most recently used).
        after = request.after if request.after is not None else ""
        shown, truncated = self.store.artifacts(request.weights, messages.MAX_LISTED_ARTIFACTS, after)
        listed: tuple[ArtifactInfo, ...] = tuple(shown)
        following = listed[-1].key if truncated and listed else None
        # Up to 1,024 keys of up to 16 KiB each: held for a peer that may never read it, like a list's page.
        payload = encode(ListArtifactsReply(artifacts=listed, truncated=truncated, next=following).to_json())
        self._reserve_reply(peer, 0, len(payload))
        return payload, []


Handler = Callable[[Server, Peer, dict[str, Any], list[int]], tuple[Reply, list[int]]]

#: op -> the method that answers it. Only ``publish`` and ``put_artifact`` receive fds; the others are refused if
#: any arrive.
HANDLERS: dict[str, Handler] = {
    messages.HELLO: Server._hello,
    messages.PUBLISH: Server._publish,
    messages.GET: Server._get,
    messages.LIST: Server._list,
    messages.INSPECT: Server._inspect,
    messages.EVICT: Server._evict,
    messages.STOP: Server._stop,
    messages.PUT_ARTIFACT: Server._put_artifact,
    messages.GET_ARTIFACT: Server._get_artifact,
    messages.LIST_ARTIFACTS: Server._list_artifacts,
}


def encode(reply: dict[str, Any]) -> bytes:
    """A reply's payload, as :func:`~weightcache.protocol.send_frame` would encode it."""
    return json.dumps(reply, separators=(",", ":"), allow_nan=False).encode()


def _dropped(peer: Peer, why: str) -> None:
    log.info("connection %d (pid %d uid %d) %s; dropped", peer.id, peer.pid, peer.uid, why)


def unread_bytes(sock: socket.socket) -> int:
    """Bytes this side sent on ``sock`` that the peer has not read yet (SIOCOUTQ)."""
    try:
        out = fcntl.ioctl(sock.fileno(), termios.TIOCOUTQ, struct.pack("i", 0))
    except OSError:
        return 0
    return int(struct.unpack("i", out)[0])


def _refuse(sock: socket.socket, code: str, message: str) -> None:
    """Answer a connection that is not admitted with one error reply, and close it."""
    with contextlib.suppress(OSError):
        send_frame(sock, ErrorReply(code, message).to_json())
    sock.close()


def peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's gid (SO_PEERCRED) and its supplementary groups (/proc/<pid>/status)."""
    groups = {gid}
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Groups:"):
                groups.update(int(g) for g in line.split()[1:])
                break
    return groups

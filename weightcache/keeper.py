"""The keeper: a small host daemon that holds segment fds and manifests, keyed by fingerprint.

It never maps segment memory and never imports torch or CUDA, so it costs no GPU memory and starts instantly.
One keeper serves one socket directory (one per host and user). Each client connection is a thread; an open
connection is the client's lease on the entries it got or published, and closing it releases them.

Readiness is atomic: the keeper takes an exclusive lock for its lifetime (so a second keeper refuses to
start, and a crashed one leaves no stale lock), binds its socket under a temporary name, and renames it into
place only once it listens. A client that connects to ``keeper.sock`` therefore always reaches a serving
keeper, and a socket file left by a dead keeper refuses connections and is replaced on the next start.

Bad input never takes the keeper down: a malformed frame closes that one connection, an invalid request gets
an error reply, and nothing received is unpickled or evaluated.

Memory budgets (``weightcache serve --max-bytes``) are per placement: a publish that would exceed its
placement's budget first evicts unleased entries there, least recently used first, and is refused
(``over_budget``) if even that cannot make room. Evicting only closes the keeper's fds; memory that clients
map stays valid until they let go.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import resource
import select
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any

import attrs

from . import protocol, segments
from ._version import __version__
from .budget import Budget, format_bytes
from .errors import (
    KeeperAlreadyRunning,
    ManifestError,
    ProtocolError,
    SegmentError,
    SocketDirError,
    WeightCacheError,
)
from .manifest import Manifest
from .pidlock import close_lock_file, open_lock_file, write_pid
from .protocol import field, peer_credentials, recv_frame, send_frame
from .rundir import (
    INSTANCE_LOCK_NAME,
    STOPPED_NAME,
    ensure_private_dir,
    ensure_shared_dir,
    resolve_socket_dir,
    socket_path,
)

log = logging.getLogger("weightcache.keeper")

MAX_CONNECTIONS = 1024
#: Largest manifest accepted: its get reply (manifest plus a few fields) must still fit in one frame.
MAX_MANIFEST_BYTES = protocol.MAX_PAYLOAD_BYTES - 64 * 1024


@attrs.define
class Lease:
    pid: int
    since: float


@attrs.define
class Entry:
    """What the keeper holds for one (digest, placement)."""

    digest: str
    manifest: Manifest
    manifest_json: dict[str, Any]
    #: The manifest encoded once, at publish: every get sends these bytes instead of encoding it again.
    manifest_text: str
    fds: list[int]
    created: float
    last_used: float
    #: connection id -> lease
    leases: dict[int, Lease] = attrs.field(factory=dict)

    @property
    def key(self) -> str:
        return entry_key(self.digest, self.manifest.fingerprint.placement)

    def describe(self, now: float) -> dict[str, Any]:
        fp = self.manifest.fingerprint
        return {
            "key": self.key,
            "digest": self.digest,
            "placement": fp.placement,
            "device": fp.device_kind if fp.placement == "cpu" else f"{fp.device_kind}:{fp.placement}",
            "model": fp.architecture or Path(fp.model_path).name,
            "model_path": fp.model_path,
            "bytes": self.manifest.total_bytes,
            "tensor_bytes": self.manifest.tensor_bytes,
            "tensors": len(self.manifest),
            "segments": len(self.manifest.segments),
            "leases": len(self.leases),
            "holders": [{"pid": lease.pid, "since": lease.since} for lease in self.leases.values()],
            "created": self.created,
            "last_used": self.last_used,
            "age_s": round(now - self.created, 3),
            "fingerprint": fp.to_json(),
        }

    def close(self) -> None:
        for fd in self.fds:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.fds = []


def entry_key(digest: str, placement: str) -> str:
    return f"{digest}@{placement}"


class RequestError(WeightCacheError):
    """An invalid request: answered with an error reply, the connection stays open."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class Keeper:
    """The keeper process's state and server loop. Use :func:`serve` to run one."""

    def __init__(self, socket_dir: Path, budget: Budget | None = None, allow_group: int | None = None) -> None:
        self.socket_dir = socket_dir
        self.budget = budget or Budget()
        #: A gid whose members may connect besides our own uid (``--allow-group``); they may not evict or stop.
        self.allow_group = allow_group
        self.max_connections = MAX_CONNECTIONS
        self.started = time.time()
        self.entries: dict[str, Entry] = {}
        self.lock = threading.Lock()
        self._stop = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        self._next_conn = 0
        self._connections: dict[int, socket.socket] = {}
        #: connection id -> (peer pid, connect time)
        self._peers: dict[int, tuple[int, float]] = {}
        self._lock_fd = -1
        self._listener: socket.socket | None = None
        self._sock_ino: int | None = None

    # --- lifecycle --------------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the instance lock, bind and listen, then publish the socket atomically (rename)."""
        prepare_dir(self.socket_dir, self.allow_group)
        # Every segment of every entry is an open fd here: take all the fds the system allows us, and admit
        # no more connections than leave room for them.
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if hard == resource.RLIM_INFINITY or hard > soft:
            with contextlib.suppress(ValueError, OSError):
                resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.max_connections = max(16, min(MAX_CONNECTIONS, soft // 4))
        lock_path = self.socket_dir / INSTANCE_LOCK_NAME
        self._lock_fd = open_lock_file(lock_path)
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            other = os.pread(self._lock_fd, 64, 0).decode(errors="replace").strip() or "?"
            os.close(self._lock_fd)
            self._lock_fd = -1
            raise KeeperAlreadyRunning(
                f"a keeper (pid {other}) already serves {self.socket_dir}; use it, or stop it first with "
                f"`weightcache stop --socket-dir {self.socket_dir}`"
            ) from None
        try:
            write_pid(self._lock_fd)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.socket_dir / STOPPED_NAME)
        except OSError as exc:
            self._release_lock()
            raise SocketDirError(
                f"cannot write in the socket directory {self.socket_dir}: {exc}. Free space there (or pick "
                "another socket_dir / $WEIGHTCACHE_DIR) and start the keeper again."
            ) from exc
        final = socket_path(self.socket_dir)
        # Bound under a temporary name, then renamed into place. The name is no longer than SOCKET_NAME, so every
        # directory that passes ensure_private_dir's length check can hold it (at most 10 bytes: pid <= 2**22).
        tmp = self.socket_dir / f".k{os.getpid():x}.s"
        with contextlib.suppress(FileNotFoundError):
            os.unlink(tmp)
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old_umask = os.umask(0o177)
        try:
            listener.bind(str(tmp))
            if self.allow_group is None:
                os.chmod(tmp, 0o600)
            else:  # the group connects; the directory (2750) keeps it from touching the socket file itself
                os.chown(tmp, -1, self.allow_group)
                os.chmod(tmp, 0o660)
            listener.listen(128)
            # We hold the instance lock, so whatever sits at `final` is a dead keeper's socket: replace it.
            os.replace(tmp, final)
        except OSError as exc:
            listener.close()
            with contextlib.suppress(OSError):
                os.unlink(tmp)
            self._release_lock()
            raise SocketDirError(
                f"cannot create the keeper's socket in {self.socket_dir}: {exc}. Make room there (or pick another "
                "socket_dir / $WEIGHTCACHE_DIR) and start the keeper again."
            ) from exc
        finally:
            os.umask(old_umask)
        self._sock_ino = os.stat(final).st_ino
        self._listener = listener
        log.info("keeper %d serving %s (weightcache %s)", os.getpid(), final, __version__)

    def stop(self) -> None:
        """Ask the server loop to exit (thread- and signal-safe)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            os.write(self._wake_w, b"x")

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            close_lock_file(self._lock_fd)
            self._lock_fd = -1

    def close(self) -> None:
        """Remove our socket (only if it is still ours), drop all entries and release the instance lock.

        Leaves a ``keeper.stopped`` marker: clients that lose their lease then know the keeper was stopped on
        purpose (and do not spawn a new one), unlike after a crash.
        """
        final = socket_path(self.socket_dir)
        with contextlib.suppress(OSError):
            (self.socket_dir / STOPPED_NAME).write_text(f"{os.getpid()}\n")
        try:
            if self._sock_ino is not None and os.stat(final).st_ino == self._sock_ino:
                os.unlink(final)
        except FileNotFoundError:
            pass
        if self._listener is not None:
            self._listener.close()
            self._listener = None
        with self.lock:
            for conn in list(self._connections.values()):
                with contextlib.suppress(OSError):
                    conn.shutdown(socket.SHUT_RDWR)
            for entry in self.entries.values():
                entry.close()
            self.entries.clear()
        self._release_lock()

    def serve_forever(self) -> None:
        assert self._listener is not None, "call start() first"
        listener = self._listener
        while not self._stop.is_set():
            waitables: list[Any] = [listener, self._wake_r]
            ready, _, _ = select.select(waitables, [], [])
            if self._stop.is_set():
                break
            if listener not in ready:
                continue
            try:
                conn, _ = listener.accept()
            except OSError as exc:
                log.warning("accept failed: %s", exc)
                time.sleep(0.05)  # e.g. out of fds: let connections drain instead of spinning
                continue
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            pid, uid, gid = peer_credentials(conn)
        except OSError:
            conn.close()
            return
        owner = uid == os.getuid()
        if not owner and (self.allow_group is None or self.allow_group not in peer_groups(pid, gid)):
            log.warning("refused connection from pid %d uid %d gid %d", pid, uid, gid)
            allowed = f"uid {os.getuid()}" + (f" and group {self.allow_group}" if self.allow_group is not None else "")
            with contextlib.suppress(OSError):
                send_frame(
                    conn,
                    {
                        "ok": False,
                        "error": "forbidden",
                        "message": f"this keeper serves {allowed} only; you are uid {uid} (gid {gid})",
                    },
                )
            conn.close()
            return
        with self.lock:
            if len(self._connections) >= self.max_connections:
                busy = True
            else:
                busy = False
                self._next_conn += 1
                cid = self._next_conn
                self._connections[cid] = conn
                self._peers[cid] = (pid, time.time())
        if busy:
            with contextlib.suppress(OSError):
                send_frame(conn, {"ok": False, "error": "busy", "message": f"over {self.max_connections} connections"})
            conn.close()
            return
        try:
            threading.Thread(target=self._serve_connection, args=(cid, conn, pid, owner), daemon=True).start()
        except RuntimeError as exc:  # thread or pid limit reached: refuse this one, keep serving
            log.warning("cannot start a thread for pid %d: %s", pid, exc)
            with self.lock:
                self._connections.pop(cid, None)
                self._peers.pop(cid, None)
            with contextlib.suppress(OSError):
                send_frame(conn, {"ok": False, "error": "busy", "message": f"keeper cannot start a thread: {exc}"})
            conn.close()

    # --- one connection ---------------------------------------------------------------------------------

    def _serve_connection(self, cid: int, conn: socket.socket, pid: int, owner: bool) -> None:
        greeted = False
        try:
            while not self._stop.is_set():
                try:
                    # Until hello, a silent peer is dropped after the frame timeout; after it, an idle
                    # connection is a lease and may stay open for as long as its engine runs.
                    message, fds = recv_frame(
                        conn,
                        idle_timeout=None if greeted else protocol.FRAME_TIMEOUT_S,
                        max_payload=protocol.MAX_PAYLOAD_BYTES if greeted else protocol.MAX_HELLO_BYTES,
                    )
                except protocol.PeerClosed:
                    return
                except ProtocolError as exc:
                    log.info("connection %d (pid %d): %s", cid, pid, exc)
                    with contextlib.suppress(OSError):
                        send_frame(conn, {"ok": False, "error": "bad_frame", "message": str(exc)})
                    return
                try:
                    op = message.get("op")
                    if not greeted and op != "hello":
                        raise RequestError("bad_request", f"the first message must be 'hello'; got {op!r}")
                    if op in OWNER_OPS and not owner:
                        raise RequestError(
                            "forbidden",
                            f"{op!r} is for the keeper's owner (uid {os.getuid()}); members of the allowed group may "
                            "publish, get, list and inspect. Ask the owner.",
                        )
                    reply, out_fds = self._handle(cid, pid, op, message, fds)
                    fds = []  # ownership taken by the handler
                    greeted = True
                except (RequestError, ProtocolError, ManifestError, SegmentError) as exc:
                    code = exc.code if isinstance(exc, RequestError) else "bad_request"
                    reply, out_fds = {"ok": False, "error": code, "message": str(exc)}, []
                    if code == "version":
                        send_frame(conn, reply)
                        return
                except Exception as exc:  # a bug of ours must cost one request, never the keeper
                    log.exception("connection %d (pid %d): internal error in %r", cid, pid, message.get("op"))
                    reply = {"ok": False, "error": "internal", "message": f"keeper internal error: {exc!r}"}
                    out_fds = []
                finally:
                    protocol.close_fds(fds)
                try:
                    if isinstance(reply, bytes):
                        protocol.send_payload(conn, reply, out_fds)
                    else:
                        send_frame(conn, reply, out_fds)
                finally:
                    protocol.close_fds(out_fds)
                if op == "stop" and isinstance(reply, dict) and reply.get("ok"):
                    self.stop()
                    return
        except (OSError, ProtocolError) as exc:
            log.info("connection %d (pid %d) failed: %s", cid, pid, exc)
        finally:
            with self.lock:
                self._connections.pop(cid, None)
                self._peers.pop(cid, None)
                ended = time.time()
                for entry in self.entries.values():
                    if entry.leases.pop(cid, None) is not None:
                        entry.last_used = ended  # held until now: recently used, for the LRU order
            conn.close()

    def _handle(
        self, cid: int, pid: int, op: object, message: dict[str, Any], fds: list[int]
    ) -> tuple[dict[str, Any] | bytes, list[int]]:
        if op != "publish" and fds:
            raise RequestError("bad_request", f"message {op!r} carries no fds; {len(fds)} arrived")
        if op == "hello":
            return self._hello(message), []
        if op == "publish":
            return self._publish(cid, pid, message, fds), []
        if op == "get":
            return self._get(cid, pid, message)
        if op == "release":
            return self._release(cid, message), []
        if op == "list":
            return self._list(), []
        if op == "inspect":
            return self._inspect(message), []
        if op == "evict":
            return self._evict(message), []
        if op == "stop":
            return {"ok": True, "pid": os.getpid()}, []
        raise RequestError("bad_request", f"unknown op {op!r}; expected one of {sorted(OPS)}")

    def _hello(self, message: dict[str, Any]) -> dict[str, Any]:
        theirs = field(message, "protocol", int)
        their_min = field(message, "min_protocol", int, optional=True) or theirs
        lo, hi = max(their_min, protocol.MIN_PROTOCOL_VERSION), min(theirs, protocol.PROTOCOL_VERSION)
        if lo > hi:
            raise RequestError(
                "version",
                f"protocol mismatch: this keeper (weightcache {__version__}, pid {os.getpid()}) speaks "
                f"protocol {protocol.MIN_PROTOCOL_VERSION}..{protocol.PROTOCOL_VERSION}, the client speaks "
                f"{their_min}..{theirs}. Run the same weightcache version on both sides, or stop the keeper "
                "(`weightcache stop`) so a matching one is started.",
            )
        return {
            "ok": True,
            "protocol": hi,
            "keeper_version": __version__,
            "pid": os.getpid(),
            "uid": os.getuid(),
        }

    def _publish(self, cid: int, pid: int, message: dict[str, Any], fds: list[int]) -> dict[str, Any]:
        # On error the caller closes `fds`; on success this handler owns them.
        manifest_json = field(message, "manifest", dict)
        manifest = Manifest.from_json(manifest_json)
        manifest_text = json.dumps(manifest_json, separators=(",", ":"), allow_nan=False)
        encoded = len(manifest_text)
        if encoded > MAX_MANIFEST_BYTES:
            raise RequestError(
                "bad_request",
                f"manifest is {encoded} bytes; at most {MAX_MANIFEST_BYTES} fit in a reply (fewer tensors per entry)",
            )
        if len(fds) != len(manifest.segments):
            raise RequestError(
                "bad_request", f"manifest lists {len(manifest.segments)} segments but {len(fds)} fds arrived"
            )
        for fd, info in zip(fds, manifest.segments):
            segments.verify_fd(fd, info)
        digest = manifest.fingerprint.digest
        placement = manifest.fingerprint.placement
        key = entry_key(digest, placement)
        now = time.time()
        evicted: list[Entry] = []
        with self.lock:
            existing = self.entries.get(key)
            if existing is not None:
                # Idempotent: the same weights published again (a race, or clients re-publishing after a keeper
                # restart) make the publisher a lease holder of the entry that is already there.
                existing.last_used = now
                existing.leases.setdefault(cid, Lease(pid, now))
            else:
                evicted = self._make_room(key, placement, manifest.total_bytes)
                self.entries[key] = Entry(
                    digest=digest,
                    manifest=manifest,
                    manifest_json=manifest_json,
                    manifest_text=manifest_text,
                    fds=list(fds),
                    created=now,
                    last_used=now,
                    leases={cid: Lease(pid, now)},
                )
        for entry in evicted:
            log.info(
                "evicted %s (%d bytes, unleased, least recently used) to make room for %s",
                entry.key,
                entry.manifest.total_bytes,
                key,
            )
        if existing is not None:
            protocol.close_fds(fds)
            return {"ok": True, "digest": digest, "key": key, "created": False}
        log.info("published %s (%d bytes, %d tensors) from pid %d", key, manifest.total_bytes, len(manifest), pid)
        return {"ok": True, "digest": digest, "key": key, "created": True, "evicted": [e.key for e in evicted]}

    def _make_room(self, key: str, placement: str, needed: int) -> list[Entry]:
        """Evict unleased entries on ``placement``, least recently used first, until ``needed`` more bytes fit
        its budget; return them (their fds closed). Evicts nothing and raises ``over_budget`` if even evicting
        every unleased entry there would not be enough. Called with the lock held."""
        limit = self.budget.limit(placement)
        if limit is None:
            return []
        here = [e for e in self.entries.values() if e.manifest.fingerprint.placement == placement]
        held = sum(e.manifest.total_bytes for e in here)
        if held + needed <= limit:
            return []
        leased = sum(e.manifest.total_bytes for e in here if e.leases)
        if leased + needed > limit:
            need, have, pinned, spare = (format_bytes(n) for n in (needed, limit, leased, held - leased))
            raise RequestError(
                "over_budget",
                f"entry {key[:16]}... needs {need} on {placement}, but the keeper's budget there is {have} and leased "
                f"entries hold {pinned} of it ({spare} more is unleased and could be evicted, which is not enough). "
                "Release or evict entries (`weightcache ls`, `weightcache evict --force`), publish a smaller model, "
                "or restart the keeper with a larger `weightcache serve --max-bytes`.",
            )
        out: list[Entry] = []
        for e in sorted((e for e in here if not e.leases), key=lambda e: e.last_used):
            if held + needed <= limit:
                break
            del self.entries[e.key]
            e.close()
            held -= e.manifest.total_bytes
            out.append(e)
        return out

    def _get(self, cid: int, pid: int, message: dict[str, Any]) -> tuple[dict[str, Any] | bytes, list[int]]:
        digest = field(message, "digest", str)
        placement = field(message, "placement", str)
        key = entry_key(digest, placement)
        with self.lock:
            entry = self.entries.get(key)
            if entry is None:
                return {"ok": True, "found": False}, []
            now = time.time()
            entry.last_used = now
            entry.leases.setdefault(cid, Lease(pid, now))
            # dup under the lock: an evict racing with this get cannot close the fds we are about to send.
            out: list[int] = []
            try:
                for fd in entry.fds:
                    out.append(os.dup(fd))
            except OSError as exc:
                protocol.close_fds(out)
                entry.leases.pop(cid, None)
                raise RequestError("busy", f"keeper is out of file descriptors ({exc}); retry later") from exc
            manifest_text = entry.manifest_text
        reply = f'{{"ok":true,"found":true,"key":{json.dumps(key)},"manifest":{manifest_text}}}'
        return reply.encode(), out

    def _release(self, cid: int, message: dict[str, Any]) -> dict[str, Any]:
        key = entry_key(field(message, "digest", str), field(message, "placement", str))
        with self.lock:
            entry = self.entries.get(key)
            released = entry is not None and entry.leases.pop(cid, None) is not None
        return {"ok": True, "released": released}

    def _list(self) -> dict[str, Any]:
        now = time.time()
        with self.lock:
            entries = [e.describe(now) for e in self.entries.values()]
            connections = len(self._connections)
            held: dict[int, list[str]] = {}
            for e in self.entries.values():
                for cid in e.leases:
                    held.setdefault(cid, []).append(e.key)
            clients = [
                {"pid": pid, "since": since, "entries": held.get(cid, [])} for cid, (pid, since) in self._peers.items()
            ]
            used: dict[str, int] = {}
            for e in self.entries.values():
                p = e.manifest.fingerprint.placement
                used[p] = used.get(p, 0) + e.manifest.total_bytes
        return {
            "ok": True,
            "keeper": {
                "pid": os.getpid(),
                "version": __version__,
                "protocol": protocol.PROTOCOL_VERSION,
                "socket_dir": str(self.socket_dir),
                "started": self.started,
                "uptime_s": round(now - self.started, 3),
                "connections": connections,
                "budget": self.budget.to_json(),
                "bytes_by_placement": used,
            },
            "entries": entries,
            "clients": clients,
        }

    def _match(self, prefix: str) -> list[Entry]:
        if not prefix:
            raise RequestError("bad_request", "empty digest")
        if prefix in self.entries:  # a full key names exactly one entry
            return [self.entries[prefix]]
        return [e for k, e in self.entries.items() if k.startswith(prefix) or e.digest.startswith(prefix)]

    def _inspect(self, message: dict[str, Any]) -> dict[str, Any]:
        prefix = field(message, "digest", str)
        with self.lock:
            found = self._match(prefix)
            if len(found) != 1:
                raise self._ambiguous(prefix, found)
            entry = found[0]
            return {"ok": True, "entry": entry.describe(time.time()), "manifest": entry.manifest_json}

    def _evict(self, message: dict[str, Any]) -> dict[str, Any]:
        prefix = field(message, "digest", str)
        force = bool(field(message, "force", bool, optional=True))
        every = bool(field(message, "all", bool, optional=True))
        with self.lock:
            found = list(self.entries.values()) if every and prefix == "*" else self._match(prefix)
            if not found or (len(found) > 1 and not every):
                raise self._ambiguous(prefix, found)
            leased = [e for e in found if e.leases]
            if leased and not force:
                raise RequestError(
                    "leased",
                    "entr{} {} {} leased by pid {}; evict anyway with force (memory stays mapped in those "
                    "processes until they exit)".format(
                        "y" if len(leased) == 1 else "ies",
                        ", ".join(e.key[:16] for e in leased),
                        "is" if len(leased) == 1 else "are",
                        ", ".join(sorted({str(lease.pid) for e in leased for lease in e.leases.values()})),
                    ),
                )
            for e in found:
                del self.entries[e.key]
                e.close()
        return {"ok": True, "evicted": [e.key for e in found]}

    @staticmethod
    def _ambiguous(prefix: str, found: list[Entry]) -> RequestError:
        if not found:
            return RequestError("not_found", f"no entry matches {prefix!r}; `weightcache ls` lists the entries")
        return RequestError(
            "ambiguous",
            f"{prefix!r} matches {len(found)} entries ({', '.join(e.key[:20] for e in found)}); give more of the "
            "digest (or the full key digest@placement), or --all",
        )


OPS = ("hello", "publish", "get", "release", "list", "inspect", "evict", "stop")
#: What only the keeper's own uid may do (not members of an allowed group).
OWNER_OPS = ("evict", "stop")


def peer_groups(pid: int, gid: int) -> set[int]:
    """The peer's gid (SO_PEERCRED) and its supplementary groups (/proc/<pid>/status)."""
    groups = {gid}
    with contextlib.suppress(OSError, ValueError), open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("Groups:"):
                groups.update(int(g) for g in line.split()[1:])
                break
    return groups


def prepare_dir(directory: Path, allow_group: int | None) -> Path:
    """The keeper's socket directory: private (0700), or shared with ``allow_group`` (2750)."""
    return ensure_private_dir(directory) if allow_group is None else ensure_shared_dir(directory, allow_group)


def serve(
    socket_dir: str | os.PathLike[str] | None = None,
    *,
    ready_fd: int | None = None,
    budget: Budget | None = None,
    allow_group: int | None = None,
) -> None:
    """Run a keeper in this process until it is stopped (``weightcache stop``, SIGTERM or SIGINT).

    ``ready_fd``, when given, receives ``b"ok\\n"`` once the socket is live, or ``b"error: ...\\n"``.
    ``budget`` limits the bytes held per placement (see :class:`Budget`); default unlimited. ``allow_group``
    lets members of that gid connect too, through a shared socket directory (see :mod:`weightcache.rundir`).
    """
    directory = resolve_socket_dir(socket_dir)
    keeper = Keeper(directory, budget, allow_group)
    try:
        keeper.start()
    except Exception as exc:
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, f"error: {exc}\n".encode())
                os.close(ready_fd)
        raise
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: keeper.stop())
    if ready_fd is not None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, b"ok\n")
            os.close(ready_fd)
    try:
        keeper.serve_forever()
    finally:
        keeper.close()
        log.info("keeper %d stopped", os.getpid())


def detach_and_serve(
    socket_dir: str | None, ready_fd: int | None, budget: Budget | None = None, allow_group: int | None = None
) -> None:
    """Fork into the background (new session, stdio to the log), then :func:`serve`. The caller returns."""
    directory = prepare_dir(resolve_socket_dir(socket_dir), allow_group)
    try:
        log_fd = os.open(directory / "keeper.log", os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        message = f"cannot open {directory / 'keeper.log'}: {exc}; make room in or fix the socket directory"
        if ready_fd is not None:
            with contextlib.suppress(OSError):
                os.write(ready_fd, f"error: {message}\n".encode())
        raise SocketDirError(message) from exc
    if os.fork() != 0:
        os._exit(0)  # the spawner waits for this intermediate process only; the keeper is re-parented
    os.setsid()
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(log_fd, 1)
    os.dup2(log_fd, 2)
    os.close(devnull)
    os.close(log_fd)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    logging.basicConfig(stream=sys.stderr, level=logging.INFO, format="%(asctime)s %(name)s %(message)s", force=True)
    try:
        serve(directory, ready_fd=ready_fd, budget=budget, allow_group=allow_group)
    except KeeperAlreadyRunning as exc:
        log.info("%s", exc)
        os._exit(0)
    except Exception:
        log.exception("keeper failed")
        os._exit(1)
    os._exit(0)

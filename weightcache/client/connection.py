"""A connection to the keeper: connecting (socket directory checks, peer credentials, the version negotiated in
``hello``) and one typed method per op (docs/protocol.md), each with its deadline.

Every failed reply becomes an exception through :func:`weightcache.errors.keeper_error`, the one table of
error codes. Layer L2: torch-free, so the CLI's ``ls``/``stop``/``evict`` start fast. It never starts or stops a
keeper process itself (:mod:`weightcache.client.lifecycle` does).
"""

from __future__ import annotations

import contextlib
import os
import select
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import protocol
from .._version import __version__
from ..artifact_key import ArtifactKey
from ..errors import (
    KeeperError,
    KeeperNotResponding,
    KeeperUnavailable,
    PeerRejected,
    ProtocolError,
    keeper_error,
)
from ..messages import (
    ErrorReply,
    EvictReply,
    EvictRequest,
    GetArtifactReply,
    GetArtifactRequest,
    GetReply,
    GetRequest,
    HelloReply,
    HelloRequest,
    InspectReply,
    InspectRequest,
    ListArtifactsReply,
    ListArtifactsRequest,
    ListReply,
    ListRequest,
    PublishReply,
    PublishRequest,
    PutArtifactReply,
    PutArtifactRequest,
    StopReply,
    StopRequest,
)
from ..rundir import (
    MissingSocketDir,
    check_socket_dir,
    is_explicit,
    resolve_socket_dir,
    socket_path,
    stopped_message,
    stopped_on_purpose,
)

#: Seconds to wait for the keeper to accept a connection (a full listen backlog is retried until then).
CONNECT_TIMEOUT_S = 10.0
#: Seconds the keeper has to answer a request (hello, get, list, inspect, evict, stop) once it was sent.
REPLY_TIMEOUT_S = 10.0
#: How long :meth:`KeeperConnection.close` waits for the keeper to release the connection's leases (seconds).
CLOSE_TIMEOUT_S = 5.0
#: Most pages :meth:`KeeperConnection.list` asks for (each at most 4 MiB of entries).
MAX_LIST_PAGES = 100_000
#: A publish gets :data:`REPLY_TIMEOUT_S` plus this many seconds per GiB of its segments (the keeper checks each
#: segment's kind, size and seals; it copies nothing), plus the keeper's own longest wait (see below).
PUBLISH_S_PER_GIB = 0.25


def publish_timeout(nbytes: int) -> float:
    """Seconds the keeper has to answer a publish of ``nbytes`` of segments.

    A keeper reads a large publish frame only as its allowance of bytes in flight has room, and waits for that
    room at most :data:`~weightcache.protocol.FRAME_TIMEOUT_S` before it answers ``busy``: the client waits
    longer than that, so an honest publish slowed by others' is answered (done, or ``busy``), never cut off.
    """
    return protocol.FRAME_TIMEOUT_S + REPLY_TIMEOUT_S + PUBLISH_S_PER_GIB * nbytes / 2**30


def _silent(op: str, waited: float, path: Path | str) -> KeeperNotResponding:
    return KeeperNotResponding(
        f"the keeper at {path} did not answer {op!r} within {waited:.0f} s: it accepted the connection but sends "
        "nothing (stopped with SIGSTOP or a debugger, or its host is wedged). Check it (`weightcache doctor`, its "
        "keeper.log); `kill -CONT` a stopped keeper, or restart it"
    )


def _connect_socket(path: Path, timeout: float) -> socket.socket:
    """A socket connected to ``path``. A full listen backlog (EAGAIN: the keeper is busy for a moment) is retried,
    with growing pauses, until ``timeout``; anything else is raised at once."""
    deadline = time.monotonic() + timeout
    pause = 0.001
    while True:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.settimeout(max(0.001, deadline - time.monotonic()))
        try:
            sock.connect(str(path))
            return sock
        except BlockingIOError:
            sock.close()
            if time.monotonic() + pause > deadline:
                raise KeeperNotResponding(
                    f"the keeper at {path} did not accept the connection within {timeout:.0f} s: its listen backlog "
                    "stayed full (it is stopped, wedged, or overwhelmed by connections)"
                ) from None
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        except BaseException:
            sock.close()
            raise


class KeeperConnection:
    """One connection to the keeper. Entries got or published over it stay leased until it closes."""

    def __init__(self, sock: socket.socket, socket_dir: Path, hello: dict[str, Any], explicit: bool = True) -> None:
        self._sock = sock
        self._pid = os.getpid()
        self.socket_dir = socket_dir
        #: The keeper's answer to ``hello``: pid, version, negotiated protocol.
        self.hello = hello
        #: Whether the socket directory was named by the caller (a shared directory is trusted only then).
        self.explicit = explicit

    @classmethod
    def connect(
        cls,
        socket_dir: str | os.PathLike[str] | None = None,
        *,
        protocol_version: int = protocol.PROTOCOL_VERSION,
        min_protocol_version: int = protocol.MIN_PROTOCOL_VERSION,
        explicit: bool | None = None,
    ) -> KeeperConnection:
        """Connect and say hello. Raises KeeperUnavailable when no keeper serves ``socket_dir``.

        The keeper must run as our own uid, or, through another user's shared directory that was named
        explicitly (``explicit``; default: whether ``socket_dir`` or ``$WEIGHTCACHE_DIR`` is given), as that
        directory's owner (see :mod:`weightcache.rundir`).
        """
        explicit = is_explicit(socket_dir) if explicit is None else explicit
        directory = resolve_socket_dir(socket_dir)
        path = socket_path(directory)
        try:
            keeper_uid, _ = check_socket_dir(directory, explicit=explicit)
        except MissingSocketDir:
            # Also when a racing engine creates it meanwhile: either way no keeper serves it yet.
            raise KeeperUnavailable(
                f"no keeper runs for {directory} (the directory does not exist); start one with "
                f"`weightcache serve --socket-dir {directory}`, or start an engine in mode daemon, which starts one"
            ) from None
        try:
            sock = _connect_socket(path, CONNECT_TIMEOUT_S)
        except (FileNotFoundError, ConnectionRefusedError) as exc:
            what = "no socket" if isinstance(exc, FileNotFoundError) else "a stale socket (its keeper died)"
            if stopped_on_purpose(directory):
                raise KeeperUnavailable(
                    f"no keeper is running at {path} ({what}): {stopped_message(directory)}"
                ) from None
            raise KeeperUnavailable(
                f"no keeper is running at {path} ({what}); start one with `weightcache serve --detach --socket-dir "
                f"{directory}`, or start an engine in mode daemon, which starts one"
            ) from None
        except OSError as exc:
            raise KeeperUnavailable(f"cannot connect to the keeper at {path}: {exc}") from exc
        try:
            _, uid, _ = protocol.peer_credentials(sock)
            if uid != keeper_uid:
                raise PeerRejected(
                    f"the process serving {path} runs as uid {uid}, not as uid {keeper_uid} (this user, or the owner "
                    "of the shared socket directory); refusing to trust it"
                )
            hello = HelloRequest(protocol_version, min_protocol_version, __version__, os.getpid())
            try:
                protocol.send_frame(sock, hello.to_json())
            except (BrokenPipeError, ConnectionResetError):
                # A keeper that does not admit this connection (busy, forbidden) answers at once and closes, maybe
                # before the hello arrives: its refusal is still waiting to be read, and says why.
                pass
            reply, fds = protocol.recv_frame(sock, idle_timeout=REPLY_TIMEOUT_S)
            protocol.close_fds(fds)
            if reply.get("ok") is not False:
                HelloReply.from_json(reply)  # check it
        except (ProtocolError, OSError) as exc:
            sock.close()
            if isinstance(exc, protocol.NoFrame):
                raise _silent("hello", REPLY_TIMEOUT_S, path) from None
            if isinstance(exc, ProtocolError):
                raise KeeperUnavailable(f"the keeper at {path} did not answer hello: {exc}") from exc
            raise KeeperUnavailable(f"the keeper at {path} failed during hello: {exc}") from exc
        except BaseException:
            sock.close()
            raise
        if reply.get("ok") is False:
            sock.close()
            error = ErrorReply.from_json(reply)
            raise keeper_error(error.error, error.message)
        return cls(sock, directory, reply, explicit)

    def request(
        self, message: dict[str, Any], fds: Sequence[int] = (), *, timeout: float = REPLY_TIMEOUT_S
    ) -> tuple[dict[str, Any], list[int]]:
        """Send one request and return ``(reply, fds)``; the caller owns the returned fds.

        Raises what :func:`~weightcache.errors.keeper_error` makes of a failed reply (KeeperError carrying the
        keeper's error code, BudgetExceeded for ``over_budget``, ...), KeeperNotResponding when no reply starts
        within ``timeout`` seconds (the connection is then closed: a late reply would answer the wrong request),
        and KeeperUnavailable when the connection breaks.
        """
        try:
            self._sock.settimeout(timeout)  # sending waits too, while the keeper reads slowly (a publish it paces)
            protocol.send_frame(self._sock, message, fds)
            reply, out = protocol.recv_frame(self._sock, idle_timeout=timeout)
        except protocol.NoFrame:
            self.close(wait=False)  # it did not answer: waiting for it to close would only add CLOSE_TIMEOUT_S
            raise _silent(str(message.get("op")), timeout, socket_path(self.socket_dir)) from None
        except TimeoutError:
            self.close(wait=False)
            raise _silent(str(message.get("op")), timeout, socket_path(self.socket_dir)) from None
        except protocol.PeerClosed as exc:
            raise KeeperUnavailable("the keeper closed the connection (stopped or crashed)") from exc
        except (ProtocolError, OSError) as exc:
            raise KeeperUnavailable(f"lost the connection to the keeper: {exc}") from exc
        if not reply.get("ok"):
            protocol.close_fds(out)
            error = ErrorReply.from_json({**reply, "ok": False})
            raise keeper_error(error.error, error.message)
        return reply, out

    # --- one typed method per op (docs/protocol.md) --------------------------------------------------------------

    def publish(
        self, manifest_json: dict[str, Any], fds: Sequence[int], *, timeout: float | None = None
    ) -> PublishReply:
        """Hand an entry (its manifest, one fd per segment) to the keeper; this connection then leases it. The
        fds stay open on this side. ``timeout``: seconds for the reply (default :func:`publish_timeout` of the
        manifest's segment bytes)."""
        if timeout is None:
            sizes = [s.get("size", 0) for s in manifest_json.get("segments", ()) if isinstance(s, dict)]
            timeout = publish_timeout(sum(n for n in sizes if isinstance(n, int)))
        reply, out = self.request(PublishRequest(manifest_json).to_json(), fds, timeout=timeout)
        protocol.close_fds(out)
        return PublishReply.from_json(reply)

    def get(self, digest: str, placement: str, *, trust: Sequence[int] = ()) -> tuple[GetReply, list[int]]:
        """The entry for ``digest`` on ``placement`` and its segments' fds (the caller's to close); this connection
        then leases it. ``trust``: the uids whose publications to accept, in order of preference (default: this
        process's uid, then the keeper's owner). ``reply.found`` is False (and no fds come) when no trusted
        publisher has one; ``reply.others`` then names the uids that do.

        Raises PeerRejected if the keeper answers with an entry of a publisher not trusted.
        """
        reply, fds = self.request(GetRequest(digest, placement, tuple(trust)).to_json())
        try:
            found = GetReply.from_json(reply)
            allowed = tuple(trust) or self.default_trust
            if found.found and found.publisher not in allowed:
                raise PeerRejected(
                    f"the keeper answered with an entry published by uid {found.publisher}, which this client does "
                    f"not trust (it trusts {', '.join(map(str, allowed))}); refusing it"
                )
            return found, fds
        except BaseException:
            protocol.close_fds(fds)
            raise

    @property
    def default_trust(self) -> tuple[int, ...]:
        """The publishers trusted when none are named: this process's uid, then the keeper's owner (the keeper
        applies the same default to a ``get`` without ``trust``)."""
        return tuple(dict.fromkeys((os.getuid(), self.keeper_uid)))

    @property
    def keeper_uid(self) -> int:
        """The uid the keeper runs as (its owner), from its hello reply."""
        uid = self.hello.get("uid")
        return uid if isinstance(uid, int) else os.getuid()

    def inspect(self, prefix: str) -> InspectReply:
        """One entry (by key, digest or unique prefix) with its manifest."""
        return InspectReply.from_json(self._ask(InspectRequest(prefix).to_json()))

    def evict(self, prefix: str, *, force: bool = False, every: bool = False) -> EvictReply:
        """Drop one entry (key, digest or unique prefix), or with ``every`` all that ``prefix`` matches (``"*"``:
        all); leased ones only with ``force``."""
        return EvictReply.from_json(self._ask(EvictRequest(prefix, force=force, every=every).to_json()))

    def stop(self) -> StopReply:
        """Ask the keeper to exit; see :func:`stop_keeper` to also wait for it."""
        return StopReply.from_json(self._ask(StopRequest().to_json()))

    def list(self) -> ListReply:
        """What the keeper holds: itself, its entries (with their holders), its connections.

        The keeper answers in pages of at most :data:`~weightcache.messages.LIST_PAGE_BYTES` of entries; this
        asks for every page and returns them as one reply.
        """
        first = ListReply.from_json(self._ask(ListRequest().to_json()))
        entries = list(first.entries)
        page = first
        for _ in range(MAX_LIST_PAGES):
            if page.next is None:
                return first._replace(entries=tuple(entries), next=None)
            after = page.next
            page = ListReply.from_json(self._ask(ListRequest(after).to_json()))
            if page.next is not None and page.next <= after:
                raise KeeperError(f"the keeper's list pages do not advance (after {after!r:.80}); restart it", "list")
            entries.extend(page.entries)
        raise KeeperError(f"the keeper's list has more than {MAX_LIST_PAGES} pages; evict entries", "list")

    # --- artifacts (protocol 2) ------------------------------------------------------------------------------------

    @property
    def protocol(self) -> int:
        """The protocol version negotiated in hello."""
        version = self.hello.get("protocol")
        return version if isinstance(version, int) else 1

    @property
    def serves_artifacts(self) -> bool:
        """Whether the keeper speaks protocol 2 (the artifact ops); an older keeper holds weights only."""
        return self.protocol >= 2

    def _need_artifacts(self, op: str) -> None:
        if not self.serves_artifacts:
            raise KeeperError(
                f"the keeper at {self.socket_dir} (weightcache {self.hello.get('keeper_version')}) speaks protocol "
                f"{self.protocol}, which has no {op!r}: it holds weights only. Restart it with this weightcache "
                "version (`weightcache stop`; engines in mode daemon start a new one)",
                "version",
            )

    def put_artifact(
        self,
        weights: str,
        key: ArtifactKey,
        fd: int,
        size: int,
        sha256: str,
        *,
        replace: str | None = None,
        timeout: float | None = None,
    ) -> PutArtifactReply:
        """Hand an artifact to the keeper: ``fd``, a sealed memfd of ``size`` bytes whose SHA-256 is ``sha256``
        (the fd stays open on this side); this connection then leases it. ``replace``: the SHA-256 of the
        artifact of this weights and key that it replaces (one the caller found corrupt or outdated)."""
        self._need_artifacts("put_artifact")
        request = PutArtifactRequest(weights, key, size, sha256, replace)
        reply, out = self.request(
            request.to_json(), [fd], timeout=publish_timeout(size) if timeout is None else timeout
        )
        protocol.close_fds(out)
        return PutArtifactReply.from_json(reply)

    def get_artifact(
        self, weights: str, key: ArtifactKey, *, trust: Sequence[int] = ()
    ) -> tuple[GetArtifactReply, int | None]:
        """The artifact of ``weights`` compiled for ``key``, and its memfd (the caller's to close; None when not
        found); this connection then leases it. ``trust`` as for :meth:`get`; PeerRejected if the keeper answers
        with an artifact of a publisher not trusted."""
        self._need_artifacts("get_artifact")
        reply, fds = self.request(GetArtifactRequest(weights, key, tuple(trust)).to_json())
        try:
            found = GetArtifactReply.from_json(reply)
            if found.artifact is None:
                if fds:
                    raise ProtocolError(f"the keeper sent {len(fds)} fds with a get_artifact that found nothing")
                return found, None
            allowed = tuple(trust) or self.default_trust
            if found.artifact.publisher not in allowed:
                raise PeerRejected(
                    f"the keeper answered with an artifact published by uid {found.artifact.publisher}, which this "
                    f"client does not trust (it trusts {', '.join(map(str, allowed))}); refusing it"
                )
            if len(fds) != 1:
                raise ProtocolError(f"a found artifact comes with one fd; {len(fds)} arrived")
            return found, fds[0]
        except BaseException:
            protocol.close_fds(fds)
            raise

    def list_artifacts(self, weights: str | None = None) -> ListArtifactsReply:
        """The artifacts the keeper holds (those of weights whose digest starts with ``weights``), most recently
        used first; empty from a keeper that holds weights only (protocol 1).

        The keeper answers in pages of at most :data:`~weightcache.messages.MAX_LISTED_ARTIFACTS`; this asks for
        every page and returns them as one reply (``truncated`` only from a keeper that does not page)."""
        if not self.serves_artifacts:
            return ListArtifactsReply(artifacts=())
        page = ListArtifactsReply.from_json(self._ask(ListArtifactsRequest(weights).to_json()))
        found = list(page.artifacts)
        for _ in range(MAX_LIST_PAGES):
            if page.next is None:
                found.sort(key=lambda a: a.last_used, reverse=True)
                return ListArtifactsReply(artifacts=tuple(found), truncated=page.truncated)
            after = page.next
            page = ListArtifactsReply.from_json(self._ask(ListArtifactsRequest(weights, after).to_json()))
            if page.next is not None and page.next <= after:
                stuck = f"the keeper's artifact pages do not advance (after {after!r:.80}); restart it"
                raise KeeperError(stuck, "list")
            found.extend(page.artifacts)
        raise KeeperError(f"the keeper lists more than {MAX_LIST_PAGES} pages of artifacts; evict some", "list")

    def _ask(self, message: dict[str, Any]) -> dict[str, Any]:
        reply, fds = self.request(message)
        protocol.close_fds(fds)  # none of these ops sends fds
        return reply

    @property
    def greeting(self) -> HelloReply:
        """:attr:`hello`, typed."""
        return HelloReply.from_json(self.hello)

    @property
    def peer_pid(self) -> int:
        """The keeper's pid as this process's pid namespace sees it (SO_PEERCRED; 0 when it is not visible)."""
        return protocol.peer_credentials(self._sock)[0]

    def fileno(self) -> int:
        """The socket's fd (for polling: it turns readable when the keeper closes the connection)."""
        return self._sock.fileno()

    def peer_closed(self) -> bool:
        """Whether the keeper closed this connection (or it broke), without blocking or consuming anything.

        The keeper never speaks first, so an idle connection that turns readable was closed by the keeper.
        """
        # poll, not a non-blocking recv: a socket with a timeout set waits for that timeout even then
        poller = select.poll()
        try:
            poller.register(self._sock.fileno(), select.POLLIN)
        except ValueError:  # closed here
            return True
        # Readable: EOF, or bytes that the keeper never sends unasked: either way this connection is no lease any
        # more.
        return bool(poller.poll(0))

    def close(self, *, wait: bool = True) -> None:
        """Close the connection, ending the leases it holds; with ``wait``, returns once the keeper has released
        them.

        The keeper serves each connection on a thread of its own: it releases the leases, then closes its end. So
        this process says it is done (half-close), waits up to :data:`CLOSE_TIMEOUT_S` for that close and only then
        returns: an ``evict`` or a publish that follows never finds the entry still leased by us. A copy of the
        connection inherited over ``fork`` is only closed here, never shut down: the socket still belongs to the
        process that opened it.
        """
        if self._sock.fileno() < 0:
            return
        try:
            if wait and os.getpid() == self._pid:
                self._sock.shutdown(socket.SHUT_WR)
                _wait_for_eof(self._sock, CLOSE_TIMEOUT_S)
        except OSError:
            pass  # broken already: nothing is leased over it any more
        finally:
            with contextlib.suppress(OSError):
                self._sock.close()

    @property
    def closed(self) -> bool:
        return self._sock.fileno() < 0

    def __enter__(self) -> KeeperConnection:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _wait_for_eof(sock: socket.socket, timeout: float) -> None:
    """Read and drop what ``sock`` still receives (a reply never read) until the peer closes it, at most
    ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while (left := deadline - time.monotonic()) > 0:
        sock.settimeout(left)
        try:
            if not sock.recv(65536):
                return
        except TimeoutError:
            return

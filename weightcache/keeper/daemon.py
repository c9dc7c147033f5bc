"""The keeper process: its instance lock, limits, socket file, signals, detaching and logging.

Readiness is atomic: the keeper takes an exclusive lock for its lifetime (so a second keeper refuses to start,
and a crashed one leaves no stale lock), binds its socket under a temporary name, and renames it into place
only once it listens. A client that connects to ``keeper.sock`` therefore always reaches a serving keeper, and
a socket file left by a dead keeper refuses connections and is replaced on the next start.

What this module must never do: decide anything about entries or requests (that is the store's and the
server's job); it wires a :class:`~weightcache.keeper.store.Store` and a
:class:`~weightcache.keeper.server.Server` into a process.
"""

from __future__ import annotations

import contextlib
import faulthandler
import fcntl
import logging
import os
import resource
import signal
import socket
import sys
from pathlib import Path

import attrs

from .. import protocol
from .._version import __version__
from ..budget import Budget
from ..errors import KeeperAlreadyRunning, SocketDirError, WeightCacheError
from ..pidlock import close_lock_file, open_lock_file, write_pid
from ..rundir import (
    INSTANCE_LOCK_NAME,
    LOG_NAME,
    STOPPED_NAME,
    ensure_private_dir,
    ensure_shared_dir,
    filesystem_problem,
    resolve_socket_dir,
    socket_path,
)
from .server import IDLE_TIMEOUT_S, MAX_CONNECTIONS, Server
from .store import MEMBER_SHARE, Store

log = logging.getLogger("weightcache.keeper")


def prepare_dir(directory: Path, allow_group: int | None) -> Path:
    """The keeper's socket directory: private (0700), or shared with ``allow_group`` (2750)."""
    return ensure_private_dir(directory) if allow_group is None else ensure_shared_dir(directory, allow_group)


@attrs.frozen
class FdLimits:
    """How the keeper shares its open-file limit: connections, entries' segment fds, fds of frames in flight, and
    fds duplicated for replies. Together they stay under the limit, less a few dozen for the process itself.
    """

    connections: int
    entry_fds: int
    inflight_fds: int
    reply_fds: int


@attrs.frozen
class Limits:
    """The keeper's settings for sharing itself (``weightcache serve`` flags; docs/protocol.md lists them).

    ``max_connections``: None for the default (1,024, or a quarter of the open-file limit, whichever is lower);
    ``idle_timeout``: seconds a connection that holds no lease may stay silent after hello; ``member_share``: the
    fraction of each keeper-wide resource that one uid other than the owner may hold (all of them together: the
    rest, so that at least this fraction stays for the owner).
    """

    max_connections: int | None = None
    idle_timeout: float = IDLE_TIMEOUT_S
    member_share: float = MEMBER_SHARE

    def __attrs_post_init__(self) -> None:
        if self.max_connections is not None and self.max_connections < 1:
            raise ValueError(f"max_connections must be at least 1; found {self.max_connections}")
        if not self.idle_timeout > 0:
            raise ValueError(f"idle_timeout must be a positive number of seconds; found {self.idle_timeout}")
        if not 0 < self.member_share <= 0.5:
            raise ValueError(
                f"member_share must be above 0 and at most 0.5 (the owner keeps at least as much); found "
                f"{self.member_share}"
            )


def fd_limits() -> FdLimits:
    """Raise the open-file limit to its hard limit and share it out: a quarter for connections, half for the
    segments of entries, an eighth for fds arriving in frames, the last eighth (less 64 for the process itself)
    for fds duplicated for replies; each at least one frame's fds."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        with contextlib.suppress(ValueError, OSError):
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 1 << 20, hard))
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return FdLimits(
        connections=max(16, min(MAX_CONNECTIONS, soft // 4)),
        entry_fds=max(protocol.MAX_FDS, soft // 2),
        inflight_fds=max(protocol.MAX_FDS, soft // 8),
        reply_fds=max(protocol.MAX_FDS, soft // 8 - 64),
    )


def take_instance_lock(directory: Path) -> int:
    """Lock ``directory``'s instance lock for this process's lifetime and note our pid in it; returns its fd.

    Raises KeeperAlreadyRunning if another keeper holds it.
    """
    fd = open_lock_file(directory / INSTANCE_LOCK_NAME)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        other = os.pread(fd, 64, 0).decode(errors="replace").strip() or "?"
        os.close(fd)
        raise KeeperAlreadyRunning(
            f"a keeper (pid {other}) already serves {directory}; use it, or stop it first with "
            f"`weightcache stop --socket-dir {directory}`"
        ) from None
    try:
        write_pid(fd)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(directory / STOPPED_NAME)
    except OSError as exc:
        close_lock_file(fd)
        raise SocketDirError(
            f"cannot write in the socket directory {directory}: {exc}{filesystem_problem(exc)}. Free space there (or "
            "pick another socket_dir / $WEIGHTCACHE_DIR) and start the keeper again."
        ) from exc
    return fd


def bind_socket(directory: Path, allow_group: int | None) -> socket.socket:
    """A listening socket at ``directory``'s socket path, put there atomically (bound under a temporary name,
    then renamed). Call it holding the instance lock: whatever sits at the path is a dead keeper's socket."""
    final = socket_path(directory)
    # The temporary name is no longer than SOCKET_NAME, so every directory that passes ensure_private_dir's
    # length check can hold it (at most 10 bytes: pid <= 2**22).
    tmp = directory / f".k{os.getpid():x}.s"
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    old_umask = os.umask(0o177)
    try:
        listener.bind(str(tmp))
        if allow_group is None:
            os.chmod(tmp, 0o600)
        else:  # the group connects; the directory (2750) keeps it from touching the socket file itself
            os.chown(tmp, -1, allow_group)
            os.chmod(tmp, 0o660)
        # A deep backlog: a burst of engines starting while the keeper is busy queues instead of failing (the
        # kernel caps it at net.core.somaxconn); clients also retry a full backlog within their connect timeout.
        listener.listen(max(socket.SOMAXCONN, 4096))
        os.replace(tmp, final)
    except OSError as exc:
        listener.close()
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise SocketDirError(
            f"cannot create the keeper's socket in {directory}: {exc}{filesystem_problem(exc)}. Make room there (or "
            "pick another socket_dir / $WEIGHTCACHE_DIR) and start the keeper again."
        ) from exc
    finally:
        os.umask(old_umask)
    return listener


class Daemon:
    """One keeper's process resources: the instance lock, the socket file, the store and the server."""

    def __init__(
        self,
        socket_dir: Path,
        budget: Budget | None = None,
        allow_group: int | None = None,
        limits: Limits | None = None,
    ) -> None:
        self.socket_dir = socket_dir
        self.budget = budget
        self.allow_group = allow_group
        self.limits = limits or Limits()
        # its fd cap is set in start(), from the open-file limit
        self.store = Store(budget, member_share=self.limits.member_share)
        self.server: Server | None = None
        self._lock_fd = -1
        self._sock_ino: int | None = None

    def start(self) -> Server:
        """Take the instance lock, raise the fd limit, bind and listen, then publish the socket (rename)."""
        prepare_dir(self.socket_dir, self.allow_group)
        limits = fd_limits()
        self.store.max_fds = limits.entry_fds
        self._lock_fd = take_instance_lock(self.socket_dir)
        try:
            listener = bind_socket(self.socket_dir, self.allow_group)
        except BaseException:
            self._release_lock()
            raise
        self._sock_ino = os.stat(socket_path(self.socket_dir)).st_ino
        self.server = Server(
            self.store,
            listener,
            socket_dir=self.socket_dir,
            allow_group=self.allow_group,
            max_connections=self.limits.max_connections or limits.connections,
            max_inflight_fds=limits.inflight_fds,
            max_reply_fds=limits.reply_fds,
            idle_timeout=self.limits.idle_timeout,
            member_share=self.limits.member_share,
        )
        log.info("keeper %d serving %s (weightcache %s)", os.getpid(), socket_path(self.socket_dir), __version__)
        return self.server

    def close(self, *, deliberate: bool = True) -> None:
        """Remove our socket (only if it is still ours), drop all entries and release the instance lock.

        ``deliberate`` (a stop asked for): leaves a ``keeper.stopped`` marker, so that clients that lose their lease
        know the keeper was stopped on purpose (and do not spawn a new one). A keeper that ends otherwise (an
        unexpected error) leaves none: as after a crash, mode-daemon engines start another and re-publish.
        """
        final = socket_path(self.socket_dir)
        if deliberate:
            with contextlib.suppress(OSError):
                (self.socket_dir / STOPPED_NAME).write_text(f"{os.getpid()}\n")
        try:
            if self._sock_ino is not None and os.stat(final).st_ino == self._sock_ino:
                os.unlink(final)
        except FileNotFoundError:
            pass
        if self.server is not None:
            self.server.close()
        self.store.close()
        self._release_lock()

    def _release_lock(self) -> None:
        if self._lock_fd >= 0:
            close_lock_file(self._lock_fd)
            self._lock_fd = -1


def _report(ready_fd: int | None, status: str) -> None:
    """Tell whoever started us (``--ready-fd``) that we serve (``ok``) or failed (``error: ...``)."""
    if ready_fd is not None:
        with contextlib.suppress(OSError):
            os.write(ready_fd, f"{status}\n".encode())
            os.close(ready_fd)


def serve(
    socket_dir: str | os.PathLike[str] | None = None,
    *,
    ready_fd: int | None = None,
    budget: Budget | None = None,
    allow_group: int | None = None,
    limits: Limits | None = None,
) -> None:
    """Run a keeper in this process until it is stopped (``weightcache stop``, SIGTERM or SIGINT).

    SIGUSR1 writes every thread's stack to stderr (the keeper's log when detached) and the keeper serves on.

    ``ready_fd``, when given, receives ``b"ok\\n"`` once the socket is live, or ``b"error: ...\\n"``.
    ``budget`` limits the bytes held per placement (see :class:`Budget`); default unlimited. ``allow_group``
    lets members of that gid connect too, through a shared socket directory (see :mod:`weightcache.rundir`).
    ``limits``: how the keeper shares itself between its users (see :class:`Limits`).
    """
    daemon = Daemon(resolve_socket_dir(socket_dir), budget, allow_group, limits)
    try:
        server = daemon.start()
    except Exception as exc:
        _report(ready_fd, f"error: {exc}")
        raise
    try:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: server.stop())
        # A signal may reach any thread; the main thread, waiting in select, runs the handler only once woken.
        signal.set_wakeup_fd(server.wakeup_fd, warn_on_full_buffer=False)
        try:
            faulthandler.register(signal.SIGUSR1, file=sys.stderr, all_threads=True)  # stacks into the log
        except (AttributeError, ValueError, OSError, RuntimeError) as exc:  # no stderr with a file descriptor
            log.warning("SIGUSR1 will not write the threads' stacks: %s", exc)
            signal.signal(signal.SIGUSR1, signal.SIG_IGN)
        _report(ready_fd, "ok")
        server.serve_forever()
    finally:
        with contextlib.suppress(RuntimeError):
            faulthandler.unregister(signal.SIGUSR1)
        signal.set_wakeup_fd(-1)
        deliberate = server.stop_requested
        daemon.close(deliberate=deliberate)
        log.info("keeper %d stopped%s", os.getpid(), "" if deliberate else " by an error: left no keeper.stopped")


def detach_and_serve(
    socket_dir: str | None,
    ready_fd: int | None,
    budget: Budget | None = None,
    allow_group: int | None = None,
    limits: Limits | None = None,
) -> None:
    """Fork into the background (new session, stdio to the log), then :func:`serve`.

    The caller returns once the keeper serves, or raises what stopped it (KeeperAlreadyRunning when another keeper
    serves the directory, with the message the foreground ``serve`` gives): a detached start fails exactly as a
    foreground one does. ``ready_fd``, when given, receives the keeper's status line as well.
    """
    directory = prepare_dir(resolve_socket_dir(socket_dir), allow_group)
    try:
        log_fd = os.open(directory / LOG_NAME, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_CLOEXEC, 0o600)
    except OSError as exc:
        message = f"cannot open {directory / LOG_NAME}: {exc}; make room in or fix the socket directory"
        _report(ready_fd, f"error: {message}")
        raise SocketDirError(message) from exc
    status_r, status_w = os.pipe()
    if os.fork() != 0:
        os.close(log_fd)
        os.close(status_w)
        _relay_status(status_r, ready_fd)
        return
    os.close(status_r)
    if ready_fd is not None:
        os.close(ready_fd)  # the parent relays our status to it
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
        serve(directory, ready_fd=status_w, budget=budget, allow_group=allow_group, limits=limits)
    except KeeperAlreadyRunning as exc:
        log.info("%s", exc)
        os._exit(1)
    except Exception:
        log.exception("keeper failed")
        os._exit(1)
    os._exit(0)


def _relay_status(status_r: int, ready_fd: int | None) -> None:
    """In ``serve --detach``'s foreground process: wait for the keeper's status line, pass it on to ``ready_fd``,
    and raise its error, if any."""
    status = b""
    with os.fdopen(status_r, "rb") as pipe:
        status = pipe.readline()  # EOF without a line: the keeper died before it could say anything
    text = status.decode(errors="replace").strip()
    _report(ready_fd, text or "error: the keeper exited before it served; see its log")
    if text == "ok":
        return
    message = text[len("error:") :].strip() if text.startswith("error:") else ""
    if "already serves" in message:
        raise KeeperAlreadyRunning(message)
    raise WeightCacheError(message or "the detached keeper exited before it served; see keeper.log in its directory")

"""A keeper's life, seen from a client: spawning a detached one on demand (:func:`ensure_keeper`, racing
callers serialised on a file lock) and stopping one, waiting for its exit (:func:`stop_keeper`).

Layer L2: torch-free; filelock is imported only to spawn. It speaks to a keeper only through
:class:`~weightcache.client.connection.KeeperConnection`, never on a socket of its own.
"""

from __future__ import annotations

import contextlib
import os
import select
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from ..errors import KeeperError, KeeperUnavailable, WeightCacheError
from ..rundir import (
    LOG_NAME,
    SPAWN_LOCK_NAME,
    check_socket_dir,
    ensure_private_dir,
    is_explicit,
    resolve_socket_dir,
    stopped_message,
    stopped_on_purpose,
)
from .connection import KeeperConnection

#: Seconds to wait for a spawned keeper to report readiness.
SPAWN_TIMEOUT_S = 30.0


def stop_keeper(
    conn: KeeperConnection, *, wait: float | None = None, stopping: Callable[[int], object] | None = None
) -> int:
    """Ask the keeper behind ``conn`` to exit, close ``conn``, and return the keeper's pid.

    The keeper replies before it frees its entries and writes ``keeper.stopped`` and its last log line: with
    ``wait`` (seconds), return only once the keeper process has exited, as a caller about to remove the socket
    directory must; KeeperError (code ``"timeout"``) if it still runs then. ``stopping(pid)`` is called when the
    keeper has accepted the request, before the wait.
    """
    keeper_exit = None
    try:
        # Opened while the keeper still serves this connection, so its pid cannot have been reused yet.
        keeper_exit = _ProcessExit(conn.peer_pid) if wait is not None else None
        pid = conn.stop().pid
    except BaseException:
        if keeper_exit is not None:
            keeper_exit.close()
        raise
    finally:
        conn.close()
    if stopping is not None:
        stopping(pid)
    if keeper_exit is None or wait is None:
        return pid
    with contextlib.closing(keeper_exit):
        if not keeper_exit.wait(wait):
            raise KeeperError(
                f"keeper pid {pid} still runs {wait:g} s after it was asked to stop; see keeper.log in its socket "
                f"directory, or end it with `kill {pid}`",
                "timeout",
            )
    return pid


class _ProcessExit:
    """The exit of process ``pid``, to wait for: through a pidfd (readable once the process has exited, reaped or
    not), or, where the kernel has none (before Linux 5.3), by polling the pid."""

    def __init__(self, pid: int) -> None:
        if pid <= 0:  # SO_PEERCRED gives 0 for a process outside our pid namespace
            raise WeightCacheError(
                "the keeper runs in another pid namespace, so its exit cannot be seen from here; stop it without "
                "waiting"
            )
        self.pid, self.fd, self.gone = pid, -1, False
        try:
            self.fd = os.pidfd_open(pid)
        except ProcessLookupError:
            self.gone = True
        except OSError:
            pass

    def wait(self, timeout: float) -> bool:
        """Whether the process has exited within ``timeout`` seconds."""
        if self.gone:
            return True
        if self.fd >= 0:
            return bool(select.select([self.fd], [], [], timeout)[0])
        deadline = time.monotonic() + timeout
        while True:
            try:
                os.kill(self.pid, 0)
            except ProcessLookupError:
                return True
            if time.monotonic() >= deadline:
                return False
            time.sleep(0.01)

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def ensure_keeper(
    socket_dir: str | os.PathLike[str] | None = None, *, timeout: float = SPAWN_TIMEOUT_S, explicit: bool | None = None
) -> Path:
    """Make sure a keeper serves ``socket_dir``, spawning a detached one if none does. Returns the directory.

    Racing callers serialise on a file lock, so exactly one keeper is started; the keeper's own instance
    lock backs this up for keepers started by hand. Where the last keeper was stopped on purpose
    (:func:`~weightcache.rundir.stopped_on_purpose`), none is spawned: KeeperUnavailable says how to start one.
    In our own shared directory the keeper is spawned for its group again; in another user's, only that user can
    start one (KeeperUnavailable says so).
    """
    explicit = is_explicit(socket_dir) if explicit is None else explicit
    directory = resolve_socket_dir(socket_dir)
    with contextlib.suppress(KeeperUnavailable):
        KeeperConnection.connect(directory, explicit=explicit).close()
        return directory
    if stopped_on_purpose(directory):  # a deliberate stop stays a stop: only `weightcache serve` undoes it
        raise KeeperUnavailable(stopped_message(directory))
    owner, group = check_socket_dir(directory, explicit=explicit) if os.path.lexists(directory) else (os.getuid(), None)
    if owner != os.getuid():
        raise KeeperUnavailable(
            f"no keeper serves the shared socket directory {directory}, and only its owner (uid {owner}) can "
            f"start one: `weightcache serve --allow-group {group} --socket-dir {directory}`"
        )
    if group is None:
        ensure_private_dir(directory)  # creates it, and checks that we can write there
    # Imported here, not with the module: only spawning needs it, and it costs a restarted engine ~10 ms.
    from filelock import FileLock
    from filelock import Timeout as LockTimeout

    try:
        with FileLock(str(directory / SPAWN_LOCK_NAME), timeout=timeout):
            with contextlib.suppress(KeeperUnavailable):
                KeeperConnection.connect(directory, explicit=explicit).close()
                return directory
            _spawn(directory, timeout, group)
    except LockTimeout:
        raise KeeperUnavailable(
            f"waited {timeout:.0f} s for another process to start the keeper in {directory}; see {directory / LOG_NAME}"
        ) from None
    KeeperConnection.connect(directory, explicit=explicit).close()
    return directory


def _spawn(directory: Path, timeout: float, group: int | None = None) -> None:
    read_fd, write_fd = os.pipe()
    try:
        cmd = [sys.executable, "-m", "weightcache", "serve", "--socket-dir", str(directory), "--detach"]
        cmd += ["--ready-fd", str(write_fd)] + ([] if group is None else ["--allow-group", str(group)])
        env = dict(os.environ)
        # The keeper never needs a GPU: hide them so that nothing it imports can create a CUDA context.
        env["CUDA_VISIBLE_DEVICES"] = ""
        proc = subprocess.Popen(
            cmd,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            pass_fds=(write_fd,),
            env=env,
            start_new_session=True,
        )
        os.close(write_fd)
        write_fd = -1
        _, err = proc.communicate(timeout=timeout)  # the intermediate process exits right after forking
        deadline = time.monotonic() + timeout
        status = b""
        while not status.endswith(b"\n") and time.monotonic() < deadline:
            ready, _, _ = select.select([read_fd], [], [], max(0.0, deadline - time.monotonic()))
            if not ready:
                break
            chunk = os.read(read_fd, 4096)
            if not chunk:
                break
            status += chunk
    except subprocess.TimeoutExpired:
        proc.kill()
        raise KeeperUnavailable(f"the keeper process did not detach within {timeout:.0f} s") from None
    finally:
        os.close(read_fd)
        if write_fd >= 0:
            os.close(write_fd)
    text = status.decode(errors="replace").strip()
    if text == "ok":
        return
    if text.startswith("error:"):
        if "already serves" in text:
            return  # a keeper started by hand won the race: use it
        raise KeeperUnavailable(f"the keeper failed to start: {text[6:].strip()}")
    detail = err.decode(errors="replace").strip()[-2000:] if err else ""
    raise KeeperUnavailable(
        f"the keeper did not become ready within {timeout:.0f} s (exit status {proc.returncode}); see "
        f"{directory / LOG_NAME}" + (f"\n{detail}" if detail else "")
    )

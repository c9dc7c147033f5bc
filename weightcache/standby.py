"""Leadership between an engine and its hot standbys: one lock file, one holder, handed over by the kernel.

A hot standby attaches the same cached weights as the engine it backs up (mode client), builds and warms its
model, then blocks in :meth:`Leadership.acquire`. The lock is a ``flock`` on a file in the keeper's socket
directory (or a path given): the kernel releases a process's ``flock`` when the process dies, however it dies
(SIGKILL, OOM kill, a crash), and wakes the next waiter at once. So a standby takes over without polling,
heartbeats or timeouts, and never while the old leader still runs.

>>> leader = Leadership("my-model", socket_dir=sock)
>>> leader.acquire()          # blocks until no other process holds it; returns True
>>> ...serve...
>>> leader.release()          # or let the process end: the kernel releases it

What this module must never do: poll, or decide leadership by anything other than the kernel's lock (a pid
file or a timestamp can say a dead process leads, or two processes lead at once).

Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import re
import stat
from pathlib import Path

from .errors import SocketDirError
from .rundir import check_socket_dir, is_explicit, resolve_socket_dir

#: Lock file name inside the socket directory: ``leader-<name>.lock``.
LOCK_PREFIX = "leader-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")


class Leadership:
    """An exclusive, process-wide lock that the kernel hands to the next waiter when its holder dies.

    Args:
        name: which leadership this is (one per model or service), letters, digits, ``.``, ``_`` and ``-``.
            Processes that use the same name and directory compete for the same lock.
        socket_dir: the keeper's socket directory, where the lock file lives (default: the keeper's default
            directory, see :mod:`weightcache.rundir`). It must exist and be private (or the keeper's shared
            directory, for its owner): a lock file others can open is a lock others can hold.
        path: the lock file itself, instead of one in ``socket_dir``. Its directory must exist; the file is
            created (0600) if missing and must then be a regular file owned by this user.

    Raises:
        SocketDirError: the directory is missing, insecure, or the lock file cannot be used (at the first
            :meth:`acquire` or :meth:`try_acquire`, which open the file).
        ValueError: ``name`` is not a plain name, or both ``socket_dir`` and ``path`` are given.

    The lock belongs to this object's open file: a second ``Leadership`` in the same process is a competitor
    like any other process. Children started with ``exec`` do not inherit it (the fd is close-on-exec); a
    child forked without exec shares it and keeps it held until both have exited or released it.
    """

    def __init__(
        self,
        name: str = "default",
        *,
        socket_dir: str | os.PathLike[str] | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not _NAME.fullmatch(name):
            raise ValueError(
                f"leadership name {name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter "
                "or digit"
            )
        if path is not None and socket_dir is not None:
            raise ValueError("give either socket_dir (the lock file lives there) or path (the lock file), not both")
        self.name = name
        self._socket_dir = socket_dir
        if path is not None:
            self.path = Path(path).absolute()
        else:
            self.path = resolve_socket_dir(socket_dir) / f"{LOCK_PREFIX}{name}.lock"
        self._in_socket_dir = path is None
        self._fd = -1

    # --- the lock ----------------------------------------------------------------------------------------

    @property
    def held(self) -> bool:
        """Whether this object holds the leadership."""
        return self._fd >= 0

    def acquire(self) -> bool:
        """Block until this process leads, then return True.

        Waits in the kernel (``flock``), not in a polling loop: it returns as soon as the holder releases the
        lock or dies. A signal handler that raises (Ctrl-C: KeyboardInterrupt) ends the wait.
        """
        return self._lock(block=True)

    def try_acquire(self) -> bool:
        """Take the leadership if nobody holds it; return whether this object now holds it. Never blocks."""
        return self._lock(block=False)

    def release(self) -> None:
        """Give the leadership up (a waiter takes it at once). Does nothing when not held."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            with contextlib.suppress(OSError):
                os.ftruncate(fd, 0)  # the holder's pid, written on acquiring, no longer applies
            os.close(fd)  # closing the last fd of the open file releases the flock

    close = release

    def __enter__(self) -> Leadership:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):
            self.release()

    def __repr__(self) -> str:
        return f"<Leadership {self.name!r} {'held' if self.held else 'not held'} at {self.path}>"

    # --- who leads, who waits ----------------------------------------------------------------------------

    def holder(self) -> int | None:
        """The pid of the process holding this leadership (None when free), from the kernel's lock table."""
        holders, _ = self._lock_table()
        return holders[0] if holders else None

    def waiters(self) -> list[int]:
        """Pids of the processes blocked in :meth:`acquire` on this leadership, from the kernel's lock table."""
        return self._lock_table()[1]

    def _lock_table(self) -> tuple[list[int], list[int]]:
        """(holders, waiters) of the flock on our lock file, read from /proc/locks."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return [], []
        key = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
        holders: list[int] = []
        waiters: list[int] = []
        with open("/proc/locks") as table:
            for line in table:
                fields = line.split()
                blocked = len(fields) > 1 and fields[1] == "->"
                rest = fields[2:] if blocked else fields[1:]
                # FLOCK ADVISORY WRITE <pid> <maj:min:inode> <start> <end>
                if len(rest) >= 5 and rest[0] == "FLOCK" and rest[4] == key and rest[3].isdigit():
                    (waiters if blocked else holders).append(int(rest[3]))
        return holders, waiters

    # --- mechanics ---------------------------------------------------------------------------------------

    def _lock(self, *, block: bool) -> bool:
        if self._fd >= 0:
            raise RuntimeError(f"{self!r} is already held by this object; release it before acquiring it again")
        fd = self._open()
        try:
            fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        except BaseException:
            os.close(fd)
            raise
        self._fd = fd
        with contextlib.suppress(OSError):  # for people reading the file; holder() asks the kernel instead
            os.ftruncate(fd, 0)
            os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)
        return True

    def _open(self) -> int:
        directory = self.path.parent
        if self._in_socket_dir:
            if not os.path.lexists(directory):
                raise SocketDirError(
                    f"cannot take leadership {self.name!r}: socket directory {directory} does not exist. Start the "
                    "keeper first (`weightcache serve`, or mode='daemon'), or give Leadership(path=...)"
                )
            check_socket_dir(directory, explicit=is_explicit(self._socket_dir))
        elif not directory.is_dir():
            raise SocketDirError(f"cannot take leadership {self.name!r}: directory {directory} does not exist")
        try:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        except OSError as exc:
            why = "it is a symlink" if exc.errno == errno.ELOOP else str(exc)
            raise SocketDirError(f"cannot open the leadership lock file {self.path}: {why}") from exc
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            os.close(fd)
            raise SocketDirError(
                f"leadership lock file {self.path} is not a regular file owned by this user (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}); another user could hold the lock forever. Remove it, or give "
                "Leadership a path in a private directory."
            )
        return fd


__all__ = ["LOCK_PREFIX", "Leadership"]

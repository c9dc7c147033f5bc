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
import weakref
from pathlib import Path

from .errors import InvalidArgument, SocketDirError
from .pidlock import close_lock_file, open_lock_file, write_pid
from .rundir import check_socket_dir, is_explicit, resolve_socket_dir

#: Lock file name inside the socket directory: ``leader-<name>.lock``.
LOCK_PREFIX = "leader-"
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,99}")
#: How often one acquire re-opens a lock file that was replaced while it waited, before it gives up.
_MAX_REOPEN = 100

#: Leadership objects that hold their lock, so a forked child can drop its copies (see _close_in_child).
_holding: weakref.WeakSet[Leadership] = weakref.WeakSet()


def _close_in_child() -> None:
    """After fork: close the child's copies of the lock fds without unlocking them.

    A ``flock`` belongs to the open file description, which parent and child share after fork: the kernel frees
    it only when every fd on it is closed. A child that kept its copy would keep the lock after its parent died
    (a SIGKILLed leader whose worker lives on), and the standby would never lead. Closing one copy does not
    unlock the others, so the parent still leads; ``LOCK_UN`` would unlock them all, so it is never used here.
    """
    for leadership in list(_holding):
        leadership._forget()


os.register_at_fork(after_in_child=_close_in_child)


class Leadership:
    """An exclusive, process-wide lock that the kernel hands to the next waiter when its holder dies.

    Args:
        name: which leadership this is (one per model or service), letters, digits, ``.``, ``_`` and ``-``.
            Processes that use the same name and directory compete for the same lock.
        socket_dir: the keeper's socket directory, where the lock file lives (default: the keeper's default
            directory, see :mod:`weightcache.rundir`). It must exist and be private (or the keeper's shared
            directory, for its owner): a lock file others can open is a lock others can hold.
        path: the lock file itself, instead of one in ``socket_dir``. Its directory must exist, belong to this
            user or root, and be writable by nobody else unless it is sticky (like ``/tmp``): whoever can delete
            the file can make a second leader. The file is created (0600) if missing and must then be a regular
            file owned by this user that group and others cannot open (``flock`` works on a read-only fd).

    Raises:
        SocketDirError: the directory is missing, insecure, or the lock file cannot be used (at the first
            :meth:`acquire` or :meth:`try_acquire`, which open the file; a relative ``$WEIGHTCACHE_DIR`` already
            here).
        InvalidArgument: (a ValueError) ``name`` is not a plain name, or both ``socket_dir`` and ``path`` are
            given.

    The lock belongs to this object's open file: a second ``Leadership`` in the same process is a competitor
    like any other process. Children do not keep it: one started with ``exec`` does not inherit the fd
    (close-on-exec), and one forked without exec (``os.fork``, multiprocessing's fork) closes its copy at once,
    so when the leader dies its standby takes over even while such children live. (A fork from C code that
    skips Python's fork hooks keeps the copy.)

    Deleting or replacing the lock file of a live leader is not supported: a process that opens the new file
    leads too. Only the owner of the socket directory can do so there; this module never deletes it. A waiter
    that wakes on a file that was deleted or replaced while it waited opens the current file and waits again.
    """

    def __init__(
        self,
        name: str = "default",
        *,
        socket_dir: str | os.PathLike[str] | None = None,
        path: str | os.PathLike[str] | None = None,
    ) -> None:
        if not isinstance(name, str) or not _NAME.fullmatch(name):
            raise InvalidArgument(
                f"leadership name {name!r} must be 1-100 letters, digits, '.', '_' or '-', starting with a letter "
                "or digit"
            )
        if path is not None and socket_dir is not None:
            raise InvalidArgument(
                "give either socket_dir (the lock file lives there) or path (the lock file), not both"
            )
        self.name = name
        self._socket_dir = socket_dir
        if path is not None:
            self.path = Path(path).absolute()
        else:
            self.path = resolve_socket_dir(socket_dir) / f"{LOCK_PREFIX}{name}.lock"
        self._in_socket_dir = path is None
        self._fd = -1
        self._pid = -1  # the process that took the lock: only it writes the file

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
        """Take the leadership if nobody holds it; return whether this object now holds it. Never blocks.
        RuntimeError where this object holds it already (as :meth:`acquire`)."""
        return self._lock(block=False)

    def release(self) -> None:
        """Give the leadership up (a waiter takes it at once). Does nothing when not held."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _holding.discard(self)
            close_lock_file(fd, clear=self._pid == os.getpid())  # a forked copy must not erase the leader's pid

    def _forget(self) -> None:
        """In a forked child: close our copy of the fd. The parent's lock stays (see _close_in_child)."""
        if self._fd >= 0:
            fd, self._fd = self._fd, -1
            _holding.discard(self)
            with contextlib.suppress(OSError):
                os.close(fd)

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
        for _ in range(_MAX_REOPEN):
            fd = self._open()
            try:
                fcntl.flock(fd, fcntl.LOCK_EX if block else fcntl.LOCK_EX | fcntl.LOCK_NB)
                locked = os.fstat(fd)
                try:
                    current = os.stat(self.path, follow_symlinks=False)
                except FileNotFoundError:
                    current = None
            except BlockingIOError:
                os.close(fd)
                return False
            except BaseException:
                os.close(fd)
                raise
            if current is not None and (current.st_dev, current.st_ino) == (locked.st_dev, locked.st_ino):
                break
            # The file was deleted or replaced while we waited: our lock is on an inode nobody else will open,
            # and whoever opened the new file may lead. Compete for the file that is there now.
            os.close(fd)
        else:
            raise SocketDirError(
                f"leadership lock file {self.path} was replaced {_MAX_REOPEN} times while this process waited for it; "
                "something keeps deleting it. Only Leadership may touch its lock file: stop whatever removes it."
            )
        self._fd = fd
        self._pid = os.getpid()
        _holding.add(self)
        with contextlib.suppress(OSError):  # for people reading the file; holder() asks the kernel instead
            write_pid(fd)
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
        else:
            self._check_directory(directory)
        try:
            fd = open_lock_file(self.path)
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
        if st.st_mode & 0o077:
            os.close(fd)
            raise SocketDirError(
                f"leadership lock file {self.path} has mode {stat.S_IMODE(st.st_mode):04o}; expected 0600: a user who "
                f"can open it, even read-only, can hold the lock forever. Run: chmod 600 {self.path} (if another "
                "user may have opened it already, stop the processes that use this leadership and remove the file "
                "instead: a new one is created 0600)"
            )
        return fd

    def _check_directory(self, directory: Path) -> None:
        """The directory of an explicit ``path``: nobody but us (or root) may delete or replace the lock file."""
        try:
            st = os.stat(directory)
        except OSError as exc:
            why = "does not exist" if isinstance(exc, FileNotFoundError) else f"cannot be inspected: {exc}"
            raise SocketDirError(f"cannot take leadership {self.name!r}: directory {directory} {why}") from None
        if not stat.S_ISDIR(st.st_mode):
            raise SocketDirError(f"cannot take leadership {self.name!r}: {directory} is not a directory")
        sticky = bool(st.st_mode & stat.S_ISVTX)
        if st.st_uid not in (os.getuid(), 0) or (st.st_mode & 0o022 and not sticky):
            raise SocketDirError(
                f"cannot take leadership {self.name!r}: directory {directory} (uid {st.st_uid}, mode "
                f"{stat.S_IMODE(st.st_mode):04o}) lets another user delete and recreate the lock file, and so lead "
                f"too. Expected a directory of this user or root that only its owner can write (or a sticky one, "
                f"like /tmp). Run: chmod go-w {directory}, or give a path in a private directory."
            )


__all__ = ["LOCK_PREFIX", "Leadership"]

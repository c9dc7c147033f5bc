"""The lock files the keeper and :class:`~weightcache.standby.Leadership` share the mechanics of: a ``flock``
on a 0600 file that also holds the holder's pid, for people reading it.

Only the open and the pid bookkeeping live here; each caller takes the ``flock`` itself and decides what a
held lock means. What this module must never do: decide who holds a lock from the pid in the file (the kernel's
lock table says that; the pid is a note that a crash leaves behind).
"""

from __future__ import annotations

import contextlib
import os

#: O_NOFOLLOW: a symlink planted at the lock's name must not redirect it; O_CLOEXEC: an exec'd child must not
#: inherit the lock (Python makes fds non-inheritable anyway; this keeps it so for any caller).
_FLAGS = os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW


def open_lock_file(path: str | os.PathLike[str]) -> int:
    """Open (creating it 0600 if missing) the lock file at ``path``, never through a symlink; returns the fd."""
    return os.open(path, _FLAGS, 0o600)


def write_pid(fd: int) -> None:
    """Replace the file's contents with this process's pid (call it holding the lock). Raises OSError."""
    os.ftruncate(fd, 0)
    os.pwrite(fd, f"{os.getpid()}\n".encode(), 0)


def close_lock_file(fd: int, *, clear: bool = True) -> None:
    """Close the lock fd, first emptying the file when ``clear`` (its pid no longer applies). Closing the last
    fd on the open file releases the ``flock``."""
    if clear:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, 0)
    os.close(fd)

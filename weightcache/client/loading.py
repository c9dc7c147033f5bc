"""One load per entry: engines in mode daemon that miss the same entry at once wait for the first one's load.

Without it, every engine that starts while nothing is cached reads the checkpoint and post-processes it, each into
memory of its own, and all but one then find the entry published and drop their copy: the checkpoint is read N
times at once (N times slower from a shared disk), and N copies stand on the device for a moment. SGLang's
daemon-mode engines share one daemon's load; with this, weightcache's do too. (Measured on the H200, two
Llama-3-8B-shaped engines started at once: each read 16 GB, 37.9 and 40.7 s to the first token, against 33.8 and
35.8 s for SGLang's; docs/benchmarks.md.)

The first engine takes an exclusive file lock named after the entry (its digest and placement) in the socket
directory and holds it while it loads and publishes; the others block on it, then look in the keeper again and
attach. A waiter waits for one load only: if it ends without an entry (the publish failed, the loader died: the
kernel drops a dead process's lock), the waiter loads its own at once rather than queueing behind another waiter.
Where no lock can be taken (a directory this user cannot write), every engine loads, as before.

Layer L2: never imports torch (tests/test_layers.py checks).
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
from collections.abc import Callable, Iterator
from pathlib import Path

from ..errors import WeightCacheError
from ..rundir import ensure_private_dir

#: Seconds an engine waits for another engine's load of the same entry before it loads its own (a 235B FP8
#: model's load took 306-327 s in SGLang's published figures).
LOAD_WAIT_S = 600.0
#: Lock files of loads in progress: ``load-<key>.lock`` in the socket directory, removed when the load ends.
LOAD_LOCK_PREFIX = "load-"

_log = logging.getLogger("weightcache")


def load_key(digest: str, placement: str) -> str:
    """The lock's name for an entry: its digest and its placement (two GPUs load their own copies at once)."""
    return hashlib.sha256(f"{digest}\0{placement}".encode()).hexdigest()[:32]


class LoadTurn:
    """What :func:`first_load` yields. ``first``: this process loads the entry, and others wait for it; else another
    process's load has ended (or the wait was given up): look in the keeper again, and load only on a miss.
    :meth:`done` lets the waiters go at once (call it once the entry is published, or its publish failed, before
    the weights are put to use); leaving the ``with`` block does it too."""

    def __init__(self, first: bool, release: Callable[[], None] | None = None) -> None:
        self.first = first
        self._release = release

    def done(self) -> None:
        """End this process's turn: the lock is released and its file removed (idempotent)."""
        release, self._release = self._release, None
        if release is not None:
            release()


@contextlib.contextmanager
def first_load(directory: Path, key: str, *, wait: float = LOAD_WAIT_S, what: str = "") -> Iterator[LoadTurn]:
    """Yield a :class:`LoadTurn`: ``first`` while this process holds the load of entry ``key`` (load and publish
    inside the block, then :meth:`LoadTurn.done`: others wait for it), or not first once another process's load of
    it has ended, or ``wait`` seconds passed: the caller looks in the keeper again, and loads its own only if the
    entry is still missing. First also where no lock can be taken in ``directory`` (created, private, if
    missing). ``what``: the entry as the log line that says this process waits names it (default: ``key``)."""
    from filelock import FileLock
    from filelock import Timeout as LockTimeout

    path = directory / f"{LOAD_LOCK_PREFIX}{key}.lock"
    try:
        if not os.path.lexists(directory):
            ensure_private_dir(directory)
        lock = FileLock(str(path), mode=0o660)
        try:
            lock.acquire(timeout=0)
            held = True
        except LockTimeout:
            held = False  # another engine loads this entry: wait for it below
    except (OSError, WeightCacheError) as exc:  # no lock here: every engine loads, as without one
        _log.debug("weightcache: no load lock in %s (%s); loading without waiting for others", directory, exc)
        yield LoadTurn(True)
        return
    if held:

        def release() -> None:
            lock.release()
            # The file goes with the load. A waiter still blocked on it gets it next, and one that comes later
            # makes a new one: either looks in the keeper before it loads, so at worst a failed publish is
            # followed by two loads instead of one.
            with contextlib.suppress(OSError):
                path.unlink()

        turn = LoadTurn(True, release)
        try:
            yield turn
        finally:
            turn.done()
        return
    _log.info("weightcache: another engine is loading %s; waiting for it (at most %.0f s)", what or key[:12], wait)
    waiter = FileLock(str(path), mode=0o660)
    with contextlib.suppress(LockTimeout, OSError):
        waiter.acquire(timeout=wait)
        waiter.release()
        path.unlink()  # made again if the loader had removed it already
    yield LoadTurn(False)

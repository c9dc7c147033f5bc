"""Keeping the cache across keeper restarts: clients re-publish the entries they hold to a new keeper.

One daemon thread per process, started with the first :class:`~weightcache.lease.Lease` (what an attached
:class:`~weightcache.handle.Handle` holds), watches every lease connection. When the keeper closes one (it
crashed, was stopped or upgraded), the thread waits for a keeper to serve the same socket directory again, then
publishes the lease's manifest with the segment fds the lease still holds (no disk read, no copy: the kernel or
driver keeps the memory alive through those fds) and so takes the lease again. The keeper treats a publish of an
entry it already holds as one more lease, so any number of clients may re-publish the same entry.

Re-publication never changes who published: the keeper records the uid of whoever publishes, so a process
re-publishes only entries its own uid published (:attr:`Lease.republishable`). An entry it attached from another
user it trusted stays mapped here but is not re-published; else that user's bytes would come back as this uid's
entry, which every engine that trusts only this uid would attach.

A new keeper is spawned by this thread only for leases whose :class:`~weightcache.cache.Cache` may spawn
(``spawn=True``, mode daemon), only after a crash (a keeper stopped on purpose leaves ``keeper.stopped``), and
only while the socket directory still exists.

This thread must never disturb the engine: it raises into nothing, kills nothing, never touches the memory the
engine maps, and only logs (logger ``weightcache.republish``) and retries with backoff. It moves only fds, so
it serves every segment transport alike.
"""

from __future__ import annotations

import atexit
import logging
import os
import select
import threading
import time
import weakref

import attrs

from .client import KeeperConnection, ensure_keeper
from .errors import KeeperError, KeeperUnavailable, WeightCacheError
from .lease import BaseLease
from .protocol import close_fds
from .rundir import stopped_on_purpose

log = logging.getLogger("weightcache.republish")

#: First wait before trying again after the keeper went away; doubled each time.
FIRST_RETRY_S = 0.05
#: Longest wait between attempts while no keeper answers (one cheap connect attempt).
MAX_RETRY_S = 1.0
#: Longest wait between attempts while a keeper answers but refuses the publish (budget, version), or cannot
#: be started.
MAX_REFUSED_RETRY_S = 30.0


@attrs.define
class _Watched:
    lease: weakref.ref[BaseLease]
    lost: bool = False
    next_try: float = 0.0
    delay: float = FIRST_RETRY_S
    last_error: str | None = None


class Republisher:
    """The per-process watcher of lease connections. Use :func:`watch` and :func:`forget`."""

    def __init__(self) -> None:
        self._lock = threading.RLock()  # re-entrant: a Handle collected inside this thread forgets itself
        self._watched: dict[int, _Watched] = {}
        self._wake_r, self._wake_w = os.pipe2(os.O_NONBLOCK | os.O_CLOEXEC)
        self._thread: threading.Thread | None = None
        self._stopping = False

    def watch(self, lease: BaseLease) -> None:
        with self._lock:
            self._watched[id(lease)] = _Watched(weakref.ref(lease))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="weightcache-republish", daemon=True)
                self._thread.start()
        self._wake()

    def forget(self, lease: BaseLease) -> None:
        with self._lock:
            w = self._watched.get(id(lease))
            if w is not None and w.lease() in (lease, None):
                del self._watched[id(lease)]
        self._wake()

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread; called at interpreter exit. A daemon thread still running while Python finalises is
        killed wherever it is, and when that is inside native code (e.g. a tensor freed with the last Handle),
        the process aborts ("terminate called without an active exception") instead of exiting."""
        with self._lock:
            self._stopping = True
            thread = self._thread
        self._wake()
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)

    def _wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the pipe is full: the thread is awake anyway

    # --- the thread -------------------------------------------------------------------------------------

    def _run(self) -> None:
        while not self._stopping:
            try:
                self._once()
            except Exception:  # a bug here must never reach the engine: log it and keep going
                log.exception("weightcache: unexpected error while watching keeper leases; continuing")
                time.sleep(1.0)

    def _once(self) -> None:
        poller = select.poll()
        poller.register(self._wake_r, select.POLLIN)
        watching: dict[int, int] = {}
        timeout: float | None = None
        now = time.monotonic()
        with self._lock:
            for key, w in list(self._watched.items()):
                lease = w.lease()
                if lease is None:
                    del self._watched[key]
                elif w.lost:
                    wait = max(0.0, w.next_try - now)
                    timeout = wait if timeout is None else min(timeout, wait)
                else:
                    fd = lease.fileno()
                    if fd is not None:
                        poller.register(fd, select.POLLIN | select.POLLPRI)
                        watching[fd] = key
            # Hold no lease while waiting: one its owner dropped must be collected (and released) now, in the
            # owner's thread, not when this thread next wakes up.
            lease = None
        events = poller.poll(None if timeout is None else timeout * 1000)
        for fd, _ in events:
            if fd == self._wake_r:
                try:
                    while os.read(self._wake_r, 4096):
                        pass
                except BlockingIOError:
                    pass
            elif fd in watching and not self._stopping:
                self._check(watching[fd])
        if not self._stopping:
            self._retry_due()

    def _check(self, key: int) -> None:
        with self._lock:
            w = self._watched.get(key)
            lease = w.lease() if w is not None else None
        if w is None or lease is None:
            return
        if not lease.check_lost():
            return  # closed by its owner meanwhile, or a spurious wake-up
        if not lease.republishable:
            with self._lock:
                if self._watched.get(key) is w:
                    del self._watched[key]
            log.warning(
                "weightcache: the keeper at %s went away; entry %s stays mapped here but is not re-published: uid %s "
                "published it, not this process's uid %d, and a re-publication would record it as ours",
                lease.socket_dir,
                lease.digest[:12],
                lease.publisher,
                os.getuid(),
            )
            return
        w.lost, w.next_try, w.delay, w.last_error = True, time.monotonic(), FIRST_RETRY_S, None
        log.warning(
            "weightcache: the keeper at %s went away; entry %s stays mapped here and will be re-published when a "
            "keeper serves that directory again",
            lease.socket_dir,
            lease.digest[:12],
        )

    def _retry_due(self) -> None:
        now = time.monotonic()
        with self._lock:
            due = [(k, w) for k, w in self._watched.items() if w.lost and w.next_try <= now]
        for key, w in due:
            lease = w.lease()
            if lease is None:
                continue
            try:
                done = self._republish(lease)
            except KeeperUnavailable as exc:
                self._backoff(w, str(exc), MAX_RETRY_S, quiet=True)
                continue
            except (WeightCacheError, OSError) as exc:
                self._backoff(w, f"{type(exc).__name__}: {exc}", MAX_REFUSED_RETRY_S, quiet=False)
                continue
            with self._lock:
                if done and self._watched.get(key) is w:
                    w.lost = False

    @staticmethod
    def _backoff(w: _Watched, error: str, ceiling: float, *, quiet: bool) -> None:
        if error != w.last_error:
            (log.debug if quiet else log.warning)("weightcache: re-publishing failed (%s); retrying", error)
        w.last_error = error
        w.next_try = time.monotonic() + w.delay
        w.delay = min(ceiling, w.delay * 2)

    @staticmethod
    def _republish(lease: BaseLease) -> bool:
        """Publish ``lease``'s entry to the keeper that now serves its directory; True once leased again."""
        directory = lease.socket_dir
        try:
            conn = KeeperConnection.connect(directory, explicit=lease.explicit)
        except KeeperUnavailable:
            if not (lease.respawn and directory.is_dir() and not stopped_on_purpose(directory)):
                raise
            log.info("weightcache: spawning a keeper in %s to re-publish %s", directory, lease.digest[:12])
            try:
                ensure_keeper(directory, explicit=lease.explicit)
                conn = KeeperConnection.connect(directory, explicit=lease.explicit)
            except KeeperUnavailable as exc:  # not a keeper that is merely absent: retry rarely, and say why
                raise KeeperError(f"could not start a keeper: {exc}", "spawn") from exc
        try:
            fds = lease.dup_fds()
            if fds is None:  # closed by its owner meanwhile
                conn.close()
                return True
            try:
                # the deadline of every publish (client.publish_timeout): longer than any wait of the keeper's
                created = lease.publish_to(conn, fds)
            finally:
                close_fds(fds)
        except BaseException:
            conn.close()
            raise
        if not lease.renew(conn):
            return True  # closed while we published: the lease went with that connection
        log.info(
            "weightcache: re-published %s to the keeper (pid %s) at %s (%s)",
            lease.digest[:12],
            conn.hello.get("pid"),
            directory,
            "new entry" if created else "already there; lease taken",
        )
        return True


_republisher = Republisher()


def _after_fork() -> None:
    # The thread does not exist in a forked child; the child starts its own when it holds a handle.
    global _republisher
    _republisher = Republisher()


os.register_at_fork(after_in_child=_after_fork)


@atexit.register
def _stop_at_exit() -> None:
    _republisher.stop()


def watch(lease: BaseLease) -> None:
    """Re-publish ``lease``'s entry whenever its keeper goes away, for as long as the lease is open."""
    _republisher.watch(lease)


def forget(lease: BaseLease) -> None:
    """Stop watching ``lease`` (it is being closed)."""
    _republisher.forget(lease)

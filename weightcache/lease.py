"""A client's lease on one keeper entry: the open keeper connection (which is the lease) and the entry's
segment fds, which keep the memory alive and let the entry be re-published to a new keeper.

Torch-free. :class:`~weightcache.handle.Handle` owns one; :mod:`weightcache.republish` watches it through the
public methods below and nothing else.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .client import KeeperConnection
from .manifest import Manifest
from .protocol import close_fds


class Lease:
    """The connection that holds an entry leased in the keeper, and the entry's segment fds.

    Args:
        connection: the connection the entry was got or published over.
        fds: the entry's segment fds, in manifest order (owned by the lease from here).
        manifest: the entry's manifest (what a re-publication sends).
        respawn: whether a keeper may be spawned to re-publish to after a crash (mode daemon).
        publisher: the uid that published the entry, as the keeper reported it (None: not known). Only an entry
            this process's own uid published is ever re-published (see :attr:`republishable`).
    """

    def __init__(
        self, connection: KeeperConnection, fds: list[int], manifest: Manifest, *, respawn: bool, publisher: int | None
    ) -> None:
        self.manifest = manifest
        self.publisher = publisher
        self.socket_dir: Path = connection.socket_dir
        #: Whether the socket directory was named by the caller (a shared directory is trusted only then).
        self.explicit = connection.explicit
        self.respawn = respawn
        self._lock = threading.RLock()
        self._connection: KeeperConnection | None = connection
        self._fds = fds
        self._closed = False

    @property
    def digest(self) -> str:
        return self.manifest.fingerprint.digest

    @property
    def republishable(self) -> bool:
        """Whether this process may re-publish the entry to a new keeper: only if its own uid published it.

        A keeper records the uid of whoever publishes, so re-publishing another user's entry (one this process
        attached because it trusted that user) would record that user's bytes as ours, and every engine that
        trusts only us would then attach them: re-publication must never change who published.
        """
        return self.publisher == os.getuid()

    @property
    def held(self) -> bool:
        """Whether the keeper holds this lease now (False once its keeper is found gone, until re-published)."""
        conn = self._connection
        return conn is not None and not conn.closed

    @property
    def closed(self) -> bool:
        return self._closed

    def fileno(self) -> int | None:
        """The lease connection's fd, to poll for the keeper closing it; None when there is none."""
        conn = self._connection
        return conn.fileno() if conn is not None and not conn.closed else None

    def check_lost(self) -> bool:
        """Whether the keeper closed the lease connection; if so it is closed here too (True once, then the
        lease is no longer held)."""
        with self._lock:
            conn = self._connection
            if conn is None or not conn.peer_closed():
                return False
            conn.close()
            self._connection = None
            return True

    def dup_fds(self) -> list[int] | None:
        """Copies of the segment fds to publish with (the caller closes them); None once the lease is closed."""
        with self._lock:
            if self._closed:
                return None
            return [os.dup(fd) for fd in self._fds]

    def renew(self, connection: KeeperConnection) -> bool:
        """Hold the lease through ``connection`` (a re-publication succeeded over it). False, and ``connection``
        closed, if the lease was closed meanwhile."""
        with self._lock:
            if self._closed:
                connection.close()
                return False
            self._connection = connection
            return True

    def close(self) -> None:
        """Release the lease (close the connection) and the fds. Memory mapped from them stays valid."""
        with self._lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close()
                self._connection = None
            close_fds(self._fds)
            self._fds = []


__all__ = ["Lease"]

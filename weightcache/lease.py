"""A client's lease on one keeper entry: the open keeper connection (which is the lease) and the entry's
segment fds, which keep the memory alive and let the entry be re-published to a new keeper.

Torch-free. :class:`~weightcache.handle.Handle` owns a :class:`Lease` (weights), a held
:class:`~weightcache.artifacts.Artifact` an ``ArtifactLease``; :mod:`weightcache.republish` watches both through
the public methods of :class:`BaseLease` and nothing else.
"""

from __future__ import annotations

import os
import threading
from pathlib import Path

from .client import KeeperConnection
from .manifest import Manifest
from .protocol import close_fds


class BaseLease:
    """The connection that holds something leased in the keeper, and the fds that let it be re-published.

    Args:
        connection: the connection it was got or published over.
        fds: its fds (owned by the lease from here).
        respawn: whether a keeper may be spawned to re-publish to after a crash (mode daemon).
        publisher: the uid that published what is leased, as the keeper reported it (None: not known). Only what
            this process's own uid published is ever re-published (see :attr:`republishable`).

    Subclasses say what they hold (:attr:`digest`, for log lines) and how to publish it again
    (:meth:`publish_to`).
    """

    def __init__(self, connection: KeeperConnection, fds: list[int], *, respawn: bool, publisher: int | None) -> None:
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
        """What is leased, for log lines (a digest or a key)."""
        raise NotImplementedError

    def publish_to(self, connection: KeeperConnection, fds: list[int], *, timeout: float | None = None) -> bool:
        """Publish what this lease holds over ``connection`` with ``fds`` (dups of its own), within ``timeout``
        seconds (default: the client's publish deadline); whether the keeper created it (False: it held it
        already, and ``connection`` now leases that one)."""
        raise NotImplementedError

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

    def close(self, *, wait: bool = True) -> None:
        """Release the lease (close the connection; with ``wait``, return once the keeper has released it) and the
        fds. Memory mapped from them stays valid."""
        with self._lock:
            self._closed = True
            if self._connection is not None:
                self._connection.close(wait=wait)
                self._connection = None
            close_fds(self._fds)
            self._fds = []


class Lease(BaseLease):
    """The lease of a weights entry: its connection, its segment fds (in manifest order) and its manifest (what a
    re-publication sends)."""

    def __init__(
        self, connection: KeeperConnection, fds: list[int], manifest: Manifest, *, respawn: bool, publisher: int | None
    ) -> None:
        super().__init__(connection, fds, respawn=respawn, publisher=publisher)
        self.manifest = manifest

    @property
    def digest(self) -> str:
        return self.manifest.fingerprint.digest

    def publish_to(self, connection: KeeperConnection, fds: list[int], *, timeout: float | None = None) -> bool:
        return connection.publish(self.manifest.to_json(), fds, timeout=timeout).created


__all__ = ["BaseLease", "Lease"]

"""Talking to the keeper: connecting (with credential and version checks), one typed method per op, and
spawning a keeper on demand.

Every failed reply becomes an exception through :func:`weightcache.errors.keeper_error`, the one table of
error codes. Torch-free, so the CLI's ``ls``/``stop``/``evict`` start fast.

One module per seam, re-exported here (import the names from ``weightcache.client``):

- :mod:`~weightcache.client.connection`: :class:`KeeperConnection` (connecting, one typed method per op) and the
  deadlines of its requests;
- :mod:`~weightcache.client.lifecycle`: :func:`ensure_keeper` (spawning a keeper on demand) and
  :func:`stop_keeper` (stopping one, waiting for its exit);
- :mod:`~weightcache.client.loading`: :func:`first_load` (engines that miss one entry at once wait for one load).

Layer L2: never imports torch (tests/test_layers.py checks).
"""

from __future__ import annotations

from .connection import (
    CONNECT_TIMEOUT_S,
    MAX_LIST_PAGES,
    PUBLISH_S_PER_GIB,
    REPLY_TIMEOUT_S,
    KeeperConnection,
    publish_timeout,
)
from .connection import _connect_socket as _connect_socket
from .connection import _silent as _silent
from .lifecycle import SPAWN_TIMEOUT_S, ensure_keeper, stop_keeper
from .lifecycle import _ProcessExit as _ProcessExit
from .lifecycle import _spawn as _spawn
from .loading import LOAD_WAIT_S, LoadTurn, first_load, load_key

# The underscore helpers are imported above as ``x as x``: they stay importable from here, as from the single
# module this package was.

__all__ = [
    "CONNECT_TIMEOUT_S",
    "KeeperConnection",
    "LOAD_WAIT_S",
    "LoadTurn",
    "MAX_LIST_PAGES",
    "PUBLISH_S_PER_GIB",
    "REPLY_TIMEOUT_S",
    "SPAWN_TIMEOUT_S",
    "ensure_keeper",
    "first_load",
    "load_key",
    "publish_timeout",
    "stop_keeper",
]

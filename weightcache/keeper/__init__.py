"""The keeper: a small host daemon that holds segment fds and manifests, keyed by fingerprint.

It never maps segment memory and never imports torch or CUDA, so it costs no GPU memory and starts instantly.
One keeper serves one socket directory (one per host and user). It is three parts, each testable alone:

- :mod:`.store`: the entries, their leases and the memory budget (no sockets, no threads);
- :mod:`.server`: admission (SO_PEERCRED, ``--allow-group``), one thread per connection, dispatch of each op;
- :mod:`.daemon`: the process (instance lock, rlimits, the socket file, signals, detaching, logging).

Run one with :func:`serve` (or ``weightcache serve``); every message is specified in
:mod:`weightcache.messages` and docs/protocol.md.
"""

from __future__ import annotations

from .daemon import Daemon, Limits, detach_and_serve, prepare_dir, serve
from .server import HANDLERS, MAX_CONNECTIONS, Server, peer_groups
from .store import Store

__all__ = [
    "HANDLERS",
    "MAX_CONNECTIONS",
    "Daemon",
    "Limits",
    "Server",
    "Store",
    "detach_and_serve",
    "peer_groups",
    "prepare_dir",
    "serve",
]

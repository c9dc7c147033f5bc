"""The CLI's commands that start and stop the keeper: ``serve`` (foreground, or ``--detach``) and ``stop``.

Layer L5 (tools), on the library's public API. Never imports torch: ``serve`` imports the keeper's server at its
start (only it runs it), ``stop`` the keeper client; neither needs the other's.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable

import weightcache as wc
from weightcache.budget import parse_budget
from weightcache.rundir import resolve_group

from .cli_common import connect


def cmd_serve(args: argparse.Namespace) -> int:
    from weightcache import keeper  # the server: only this command runs it

    try:
        budget = parse_budget(args.max_bytes, args.max_fraction)
    except (ValueError, OSError) as exc:
        raise wc.WeightCacheError(f"bad budget: {exc}") from exc
    try:
        group = None if args.allow_group is None else resolve_group(args.allow_group)
    except ValueError as exc:
        raise wc.WeightCacheError(f"--allow-group: {exc}") from exc
    try:
        limits = keeper.Limits(args.max_connections, args.idle_timeout, args.member_share)
    except ValueError as exc:
        raise wc.WeightCacheError(f"bad limit: {exc}") from exc
    if args.detach:
        keeper.detach_and_serve(args.socket_dir, args.ready_fd, budget, group, limits)
        _say_detached(args.socket_dir)
        return 0
    logging.basicConfig(
        stream=sys.stderr,
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(name)s %(message)s",
    )
    keeper.serve(args.socket_dir, ready_fd=args.ready_fd, budget=budget, allow_group=group, limits=limits)
    return 0


def _say_detached(socket_dir: str | None) -> None:
    """What ``serve --detach`` started: the keeper's pid (from its instance lock, which it holds while it serves),
    its socket and its log."""
    from weightcache.rundir import INSTANCE_LOCK_NAME, LOG_NAME, SOCKET_NAME, resolve_socket_dir

    directory = resolve_socket_dir(socket_dir)
    try:
        pid = (directory / INSTANCE_LOCK_NAME).read_text().strip() or "?"
    except OSError:
        pid = "?"
    print(
        f"keeper pid {pid} serving {directory / SOCKET_NAME} (log {directory / LOG_NAME}); `weightcache stop` stops it"
    )


def cmd_stop(args: argparse.Namespace) -> int:
    from weightcache.client import stop_keeper

    try:
        conn = connect(args)
    except wc.KeeperUnavailable as exc:
        print(f"weightcache stop: no keeper to stop: {exc}", file=sys.stderr)
        return 1
    pid = stop_keeper(
        conn,
        wait=args.timeout if args.wait else None,
        stopping=lambda pid: print(f"keeper pid {pid} stopping", flush=True),
    )
    if args.wait:
        print(f"keeper pid {pid} stopped")
    return 0


def add_serve(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``serve`` to the CLI, through its ``add`` (which gives each command ``--socket-dir``)."""
    p = add("serve", "run the keeper in the foreground (or --detach)")
    p.add_argument("--detach", action="store_true", help="fork into the background, log to keeper.log")
    p.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    p.add_argument(
        "--max-bytes",
        action="append",
        metavar="[PLACEMENT=]SIZE",
        help="memory budget, e.g. 40G (every placement) or cpu=8G, GPU-<uuid>=60G (one placement; repeatable): "
        "a publish beyond it evicts unleased entries, least recently used first, or is refused",
    )
    p.add_argument(
        "--max-fraction", type=float, default=None, metavar="F", help="CPU budget as a fraction of host memory"
    )
    p.add_argument(
        "--allow-group",
        default=None,
        metavar="GROUP",
        help="also serve members of GROUP (name or gid): the socket directory becomes group GROUP, mode 2750, the "
        "socket 0660; members may publish, get, list and inspect, not evict or stop",
    )
    p.add_argument(
        "--max-connections",
        type=int,
        default=None,
        metavar="N",
        help="most client connections at once (default 1024, or a quarter of the open-file limit if lower)",
    )
    p.add_argument(
        "--idle-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="drop a connection that holds no lease after this long without a request (default 30)",
    )
    p.add_argument(
        "--member-share",
        type=float,
        default=0.25,
        metavar="F",
        help="with --allow-group: the fraction of each keeper-wide resource (connections, segment fds, bytes and "
        "fds in flight, unread replies) one member uid may hold; all members together hold at most 1-F, so F stays "
        "for the owner (default 0.25, at most 0.5)",
    )
    p.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    p.set_defaults(func=cmd_serve)


def add_stop(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``stop`` to the CLI, through its ``add``."""
    p = add("stop", "stop the keeper (attached clients keep working)")
    p.add_argument(
        "--wait",
        action="store_true",
        help="return once the keeper process has exited (it has then written everything it writes into its socket "
        "directory): exit status 1 if it still runs after --timeout",
    )
    p.add_argument("--timeout", type=float, default=30.0, metavar="SECONDS", help="with --wait: how long (default 30)")
    p.set_defaults(func=cmd_stop)

"""The CLI's warm-process commands: ``weightcache run -- CMD`` and ``weightcache warm start|stop|ls``.

Kept apart from the keeper's commands (:mod:`weightcache.tools.cli`): they talk to another process
(:mod:`weightcache.warm`), and ``run`` must stay lean, since its own start is on every command's path.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

from weightcache.errors import InvalidArgument
from weightcache.warm import identity, launcher, server
from weightcache.warm.server import DEFAULT_IDLE_TIMEOUT_S
from weightcache.warm.target import NotWarmable, default_preloads, resolve

#: Seconds ``warm start`` waits for the imports by default (vLLM's take ~15 s on a fast host).
DEFAULT_START_TIMEOUT_S = 300.0


def _command(args: argparse.Namespace) -> list[str]:
    command = list(args.cmd)
    return command[1:] if command[:1] == ["--"] else command


def _named(args: argparse.Namespace) -> tuple[str, ...]:
    """The preloads ``--preload`` names (repeated, or comma-separated), in order."""
    return tuple(p for spec in args.preload or () for p in spec.split(",") if p)


def _preloads(args: argparse.Namespace, command: Sequence[str]) -> tuple[str, ...]:
    if args.preload:
        return _named(args)
    if not command:
        raise SystemExit("weightcache warm: name the command it will start (-- CMD ...) or --preload MODULE")
    try:
        target = resolve(command, env=os.environ, cwd=os.getcwd(), executable=sys.executable)
    except NotWarmable as exc:
        raise SystemExit(f"weightcache warm: {exc}") from None
    return default_preloads(target)


def cmd_run(args: argparse.Namespace) -> int:
    return launcher.run(
        _command(args), socket_dir=args.socket_dir, preloads=_named(args) or None, idle_timeout=args.idle_timeout
    )


def cmd_warm_start(args: argparse.Namespace) -> int:
    preloads = _preloads(args, _command(args))
    directory = identity.warm_dir(args.socket_dir)
    start = time.monotonic()
    try:
        found = launcher.ensure(directory, preloads, idle_timeout=args.idle_timeout, timeout=args.timeout)
    except launcher.WarmUnavailable as exc:
        print(f"weightcache warm start: {exc}", file=sys.stderr)
        return 1
    print(
        f"warm process {found['pid']} ready ({time.monotonic() - start:.1f} s), slot {found['slot']}: "
        f"{', '.join(found['preloads']) or 'no preloads'}"
    )
    return 0


def _all_hellos(directory: Any) -> list[dict[str, Any]]:
    found = []
    for path in sorted(directory.glob("*.sock")):
        try:
            reply = launcher.hello(path)
        except launcher.WarmUnavailable:
            continue
        if reply is not None:
            found.append(reply)
    return found


def cmd_warm_stop(args: argparse.Namespace) -> int:
    directory = identity.warm_dir(args.socket_dir)
    command = _command(args)
    if args.all or not (command or args.preload):
        slots = [h["slot"] for h in _all_hellos(directory)]
    else:
        slots = [identity.slot(sys.executable, _preloads(args, command))]
    stopped = 0
    for slot in slots:
        reply = launcher.stop(directory / f"{slot}.sock")
        if reply is not None:
            stopped += 1
            print(f"stopped the warm process of slot {slot} ({reply.get('children', 0)} command(s) still running)")
    if not stopped:
        print("no warm process was running")
    return 0


def cmd_warm_serve(args: argparse.Namespace) -> int:
    directory = Path(args.dir)
    if not directory.is_dir():
        found = "is not a directory" if directory.exists() else "does not exist"
        raise InvalidArgument(
            f"--dir {directory} {found}; pass the warm processes' directory (<socket dir>/warm), which "
            "`weightcache run` and `weightcache warm start` make before they spawn this command"
        )
    return server.serve(directory, _named(args), args.idle_timeout)


def cmd_warm_ls(args: argparse.Namespace) -> int:
    directory = identity.warm_dir(args.socket_dir)
    found = _all_hellos(directory)
    if args.json:
        print(json.dumps(found, indent=1))
        return 0
    if not found:
        print(f"no warm process (in {directory})")
        return 0
    for h in found:
        age = time.time() - float(h.get("started", time.time()))
        print(
            f"{h['slot']}  pid {h['pid']}  up {age:.0f} s  running {h['children']}  {h['python']}  "
            f"preloads: {', '.join(h['preloads']) or '-'}"
        )
    return 0


def add_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``run`` and ``warm`` to the CLI, through its ``add`` (which gives each command ``--socket-dir``)."""

    def common(p: argparse.ArgumentParser) -> None:
        p.add_argument(
            "--preload",
            action="append",
            metavar="MODULE[:ATTR]",
            help="what the warm process imports (repeatable or comma-separated; default: the command's engine, "
            "see docs/guides/warm.md)",
        )
        p.add_argument(
            "--idle-timeout",
            type=float,
            default=DEFAULT_IDLE_TIMEOUT_S,
            metavar="S",
            help="a warm process this command starts exits after S seconds unused "
            f"(default {DEFAULT_IDLE_TIMEOUT_S:.0f})",
        )
        p.add_argument("cmd", nargs=argparse.REMAINDER, help="the command and its arguments, after --")

    p = add("run", "start a command from its warm, pre-imported process, or directly when there is none")
    common(p)
    p.set_defaults(func=cmd_run)

    p = add("warm", "manage warm processes: start one and wait, list them, stop them, or serve one")
    sub = p.add_subparsers(dest="warm_command", required=True, help="start, ls, stop or serve")

    def socket_dir(s: argparse.ArgumentParser) -> None:  # after the subcommand too, never clobbering one before it
        s.add_argument("--socket-dir", default=argparse.SUPPRESS, help="as for weightcache warm")

    s = sub.add_parser("start", help="start the warm process for a command (or --preload) and wait until ready")
    common(s)
    s.add_argument("--timeout", type=float, default=DEFAULT_START_TIMEOUT_S, help="seconds to wait for the imports")
    socket_dir(s)
    s.set_defaults(func=cmd_warm_start)
    s = sub.add_parser("stop", help="stop the warm process of a command (or --preload), or --all")
    s.add_argument("--all", action="store_true", help="every warm process of this socket directory")
    common(s)
    socket_dir(s)
    s.set_defaults(func=cmd_warm_stop)
    s = sub.add_parser("serve", help="run a warm process in the foreground (what run and start spawn)")
    s.add_argument("--dir", required=True, help="its directory (<socket dir>/warm)")
    s.add_argument("--preload", action="append", metavar="MODULE[:ATTR]", help="what it imports (repeatable)")
    s.add_argument("--idle-timeout", type=float, default=DEFAULT_IDLE_TIMEOUT_S, metavar="S", help="exit when unused")
    s.set_defaults(func=cmd_warm_serve)
    s = sub.add_parser("ls", help="list the running warm processes")
    s.add_argument("--json", action="store_true")
    socket_dir(s)
    s.set_defaults(func=cmd_warm_ls)


__all__ = ["add_commands"]

"""The ``weightcache`` command: serve | load | ls | inspect | evict | stop | parity | doctor | bench, and the warm
process's run | warm (:mod:`weightcache.tools.cli_warm`).

Argument parsing and the commands; each command translates its arguments into calls of the library's public
API (``weightcache.attach``/``preload``/``Cache``, :class:`weightcache.client.KeeperConnection` for the keeper
commands) or of the other tools (doctor, bench, engine parity).

Keeper commands (serve, ls, inspect, evict, stop) do not import torch, so they answer in milliseconds; nor do
doctor (but for its GPU and engine checks), parity of two tables (``parity --engine`` runs the engine, and so
torch, in processes of its own) and the warm commands. So a command imports at its start what only it needs: torch
(load, through ``wc.preload``; bench; doctor's GPU checks), the keeper's server (serve), and the keeper client with
filelock, which ``serve`` has no use for (~20-60 ms of every keeper start).

This module holds the parser and :func:`main`; the commands live by group, each group adding its own to the parser
(in the order ``weightcache --help`` lists them), and are re-exported here:
:mod:`~weightcache.tools.cli_keeper` (serve, stop), :mod:`~weightcache.tools.cli_load` (load),
:mod:`~weightcache.tools.cli_entries` (ls, inspect, evict), :mod:`~weightcache.tools.cli_checks` (parity, doctor),
:mod:`~weightcache.tools.cli_bench` (bench), :mod:`~weightcache.tools.cli_warm` (run, warm), and what they share,
:mod:`~weightcache.tools.cli_common`. Layer L5: nothing in the library imports it.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import sys
from collections.abc import Sequence

import weightcache as wc

from . import cli_bench, cli_checks, cli_entries, cli_keeper, cli_load, cli_warm
from .cli_bench import cmd_bench
from .cli_checks import cmd_doctor, cmd_parity
from .cli_common import printable
from .cli_entries import ARTIFACT_SUMMARY, INSPECTED, artifact_name, cmd_evict, cmd_inspect, cmd_ls, user_name
from .cli_keeper import cmd_serve, cmd_stop
from .cli_load import cmd_load


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="weightcache", description="Keep post-processed model weights resident; attach them in milliseconds."
    )
    parser.add_argument("--version", action="version", version=f"weightcache {wc.__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    def add(name: str, help: str) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help, description=help)
        p.add_argument(
            "--socket-dir",
            default=None,
            help="the keeper's socket directory (default: $WEIGHTCACHE_DIR, else $XDG_RUNTIME_DIR/weightcache where "
            "$XDG_RUNTIME_DIR names an existing directory, else /tmp/weightcache-<uid>)",
        )
        return p

    cli_keeper.add_serve(add)
    cli_load.add_commands(add)
    cli_entries.add_commands(add)
    cli_keeper.add_stop(add)
    cli_checks.add_commands(add, sub.add_parser)
    cli_bench.add_commands(sub.add_parser)
    cli_warm.add_commands(add)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run one command; its exit status. Output closed early (``weightcache ls | head -0``): status 141, as a
    process killed by SIGPIPE, and nothing printed about it."""
    for stream in (sys.stdout, sys.stderr):  # never a UnicodeEncodeError, whatever a string holds
        if hasattr(stream, "reconfigure"):
            stream.reconfigure(errors="backslashreplace")
    args = build_parser().parse_args(argv)
    try:
        try:
            result: int = args.func(args)
        except wc.WeightCacheError as exc:
            print(f"weightcache {args.command}: {printable(exc, newlines=True)}", file=sys.stderr)
            result = 1
        except KeyboardInterrupt:
            print(f"weightcache {args.command}: interrupted", file=sys.stderr)
            result = 130
        except ModuleNotFoundError as exc:
            if (exc.name or "").partition(".")[0] != "torch":
                raise
            print(
                f"weightcache {args.command}: needs torch, which is not installed here (only the keeper's commands "
                "serve, ls, inspect, evict and stop, doctor, parity of two tables and the warm commands run without "
                "it): pip install torch",
                file=sys.stderr,
            )
            result = 1
        sys.stdout.flush()
        return result
    except BrokenPipeError:
        # Whoever read our output stopped: point stdout at /dev/null so that the flush at exit is quiet too.
        with contextlib.suppress(OSError, ValueError):
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
            os.close(devnull)
        return 141


__all__ = [
    "ARTIFACT_SUMMARY",
    "INSPECTED",
    "artifact_name",
    "build_parser",
    "cmd_bench",
    "cmd_doctor",
    "cmd_evict",
    "cmd_inspect",
    "cmd_load",
    "cmd_ls",
    "cmd_parity",
    "cmd_serve",
    "cmd_stop",
    "main",
    "printable",
    "user_name",
]

"""The spawn launcher: what multiprocessing's ``spawn`` runs, in a warm process's children, instead of the
interpreter.

A child of a warm process that starts a process with multiprocessing's ``spawn`` (or its ``forkserver``, or its
resource tracker) would start a fresh interpreter that imports everything again: vLLM spawns its engine core and
workers this way (``vllm serve`` always, and on CPUs every time). So :mod:`weightcache.warm.child` points
multiprocessing at ``<slot>.spawn``, a script the warm process writes beside its socket, which calls :func:`main`:
it asks the same warm process to fork ``python [flags] -c <multiprocessing's code> --multiprocessing-fork`` with
this process's arguments, environment and inheritable fds (multiprocessing's pipes among them, at their numbers),
and stands in for it as ``weightcache run`` does (signals forwarded, exit status returned), so multiprocessing's
parent sees its process, its pipes and its exit as usual. When the warm process cannot serve, it ``exec``s the
interpreter with the same arguments: a spawn as usual, after a line on stderr.

Layer L2: standard library and the warm package.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from .launcher import note, start
from .target import NotWarmable, resolve


def main(socket_path: str) -> int:
    """Start ``sys.argv[1:]`` (interpreter arguments) from the warm process at ``socket_path``; its status."""
    python = sys.executable
    command = [python, *sys.argv[1:]]
    env = dict(os.environ)
    cwd = os.getcwd()

    def interpreter(_why: str) -> int:
        os.execv(python, command)

    try:
        target = resolve(command, env=env, cwd=cwd, executable=python)
    except NotWarmable as exc:
        note(f"spawn: {exc}; starting the interpreter directly")
        return interpreter(str(exc))
    return start(Path(socket_path), target, env, cwd, interpreter)


__all__ = ["main"]

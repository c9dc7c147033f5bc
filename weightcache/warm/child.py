"""The forked child of a warm process: become the process the launcher would have started, run it, exit.

Called once, right after ``fork()``, and never returns. In order:

1. close the warm process's sockets, make the child a process group of its own, give it the signal state a direct
   start would have: the launcher's ignored signals and blocked mask, every other disposition the default (SIGINT
   raising KeyboardInterrupt, SIGPIPE and SIGXFSZ ignored, as the interpreter starts);
2. take the launcher's inheritable fds at their numbers (standard input, output and error, and any other fd a
   direct start would inherit: a socket-activation listener, multiprocessing's pipes), working directory, umask,
   resource limits and environment (``os.environ`` is replaced, so the C environment too); point multiprocessing's
   ``spawn`` at the warm process's spawn launcher (:mod:`weightcache.warm.spawn`), so that what the command spawns
   is forked from the warm process too;
3. rebuild ``sys.stdin``/``stdout``/``stderr`` as the interpreter would for those fds (line-buffered on a
   terminal, stderr always; ``-u`` unbuffered), set ``sys.argv`` and ``sys.path[0]``;
4. reseed what a fresh interpreter seeds from the OS (``random``, NumPy's global generator if it is imported;
   torch's default generator starts from a fixed seed in every process and the warm process never used it) and
   turn the collector back on (the warm process froze its import-time objects);
5. run the target as ``python`` would (``runpy`` for a script or ``-m``, ``exec`` for ``-c``), then exit the way
   the interpreter exits: non-daemon threads joined, ``atexit`` functions run, streams flushed, the exit status
   of ``SystemExit`` (printed if it is not a number), 1 after an uncaught exception (traceback printed), and
   death by SIGINT after an uncaught ``KeyboardInterrupt``.

What it cannot give a child, and the guide says: a new ``PYTHONHASHSEED`` (the key keeps it equal), interpreter
options other than ``-u``, a controlling terminal (job control), and the launcher's pid.

Layer L2: standard library only; the target imports what it imports.
"""

from __future__ import annotations

import atexit
import ctypes
import fcntl
import gc
import io
import multiprocessing
import os
import random
import resource
import runpy
import signal
import sys
import threading
import traceback
import types
from collections.abc import Mapping, Sequence
from typing import NoReturn

from .target import Target

#: prctl's option that names the calling thread (the process's comm, 15 bytes).
PR_SET_NAME = 15

#: Resource limits a launcher sends and a child takes, by name of the ``resource`` constant.
LIMITS = ("RLIMIT_NOFILE", "RLIMIT_CORE", "RLIMIT_MEMLOCK", "RLIMIT_STACK", "RLIMIT_AS", "RLIMIT_DATA", "RLIMIT_FSIZE")


def current_limits() -> dict[str, list[int]]:
    """This process's limits of :data:`LIMITS`, as a launcher sends them."""
    return {name: list(resource.getrlimit(getattr(resource, name))) for name in LIMITS if hasattr(resource, name)}


def _settable_signals() -> list[int]:
    """Every valid signal but SIGKILL and SIGSTOP, whose dispositions no process can set (``signal.signal`` may
    still refuse the first real-time signals, which the C library keeps for itself)."""
    return sorted(s for s in signal.valid_signals() if s not in (signal.SIGKILL, signal.SIGSTOP))


def current_signals() -> dict[str, list[int]]:
    """What of this process's signal state a command started by ``exec`` would inherit, as a launcher sends it:
    the signals it ignores (``nohup`` ignores SIGHUP; a shell ignores SIGINT and SIGQUIT in a background job) and
    the signals its main thread blocks. A handler is not inherited (``exec`` resets it), so it is not sent."""
    ignored = [int(s) for s in _settable_signals() if _disposition(s) is signal.SIG_IGN]
    return {"ignored": ignored, "blocked": sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, []))}


def _disposition(signum: int) -> object:
    try:
        return signal.getsignal(signum)
    except (OSError, ValueError):
        return None


#: What the interpreter itself ignores at start, whatever it inherited.
_IGNORED_AT_START = (signal.SIGPIPE, signal.SIGXFSZ)


def _apply_signals(signals: Mapping[str, Sequence[int]]) -> None:
    """Give this process the signal state a direct start of the command would have: every disposition the default
    (the warm process's own handlers, and what it inherited ignored, are not the launcher's), except what the
    launcher ignores, which stays ignored, and what the interpreter sets at start (SIGPIPE and SIGXFSZ ignored;
    SIGINT raises KeyboardInterrupt unless it was ignored); then the launcher's mask of blocked signals."""
    ignored = set(signals.get("ignored", ())) | set(_IGNORED_AT_START)
    for signum in _settable_signals():
        if signum in ignored:
            handler: object = signal.SIG_IGN
        elif signum == signal.SIGINT:
            handler = signal.default_int_handler
        else:
            handler = signal.SIG_DFL
        try:
            signal.signal(signum, handler)  # type: ignore[arg-type]
        except (OSError, ValueError, RuntimeError):
            pass  # one the C library keeps (the first real-time signals)
    valid = signal.valid_signals()
    signal.pthread_sigmask(signal.SIG_SETMASK, [s for s in signals.get("blocked", ()) if s in valid])


def _apply_limits(limits: Mapping[str, Sequence[int]]) -> None:
    for name, (soft, hard) in limits.items():
        if name not in LIMITS or not hasattr(resource, name):
            continue
        which = getattr(resource, name)
        try:
            resource.setrlimit(which, (soft, hard))
        except (ValueError, OSError) as exc:
            # A hard limit above the warm process's cannot be raised by an unprivileged child: keep its own.
            print(
                f"weightcache run: could not set {name} to {soft}/{hard} ({exc}); keeping the warm process's "
                f"{resource.getrlimit(which)}",
                file=sys.stderr,
            )


def _stream(fd: int, write: bool, unbuffered: bool, encoding: str, errors: str) -> io.TextIOWrapper:
    if write and unbuffered:
        raw = io.FileIO(fd, "w", closefd=False)
        return io.TextIOWrapper(raw, encoding=encoding, errors=errors, newline="\n", write_through=True)
    line = write and (fd == 2 or os.isatty(fd))
    buffered: io.BufferedIOBase
    if write:
        buffered = io.BufferedWriter(io.FileIO(fd, "w", closefd=False))
    else:
        buffered = io.BufferedReader(io.FileIO(fd, "r", closefd=False))
    return io.TextIOWrapper(buffered, encoding=encoding, errors=errors, newline="\n", line_buffering=line)


def _reopen_stdio(unbuffered: bool, env: Mapping[str, str]) -> None:
    override = env.get("PYTHONIOENCODING", "")
    wanted_encoding, _, wanted_errors = override.partition(":")
    for fd, name in ((0, "stdin"), (1, "stdout"), (2, "stderr")):
        old = getattr(sys, f"__{name}__") or getattr(sys, name)
        encoding = wanted_encoding or getattr(old, "encoding", None) or "utf-8"
        errors = wanted_errors or ("backslashreplace" if fd == 2 else getattr(old, "errors", None) or "strict")
        stream = _stream(fd, fd != 0, unbuffered or bool(env.get("PYTHONUNBUFFERED")), encoding, errors)
        setattr(sys, name, stream)
        setattr(sys, f"__{name}__", stream)


def _name_process(target: Target) -> None:
    """Name the process as ``ps -o comm`` and ``top`` show it (the script's or module's name, or ``python``): its
    command line is still the warm process's, which only a new interpreter could change."""
    name = {"script": os.path.basename(target.value), "module": target.value}.get(target.kind, "python")
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_NAME, name.encode()[:15], 0, 0, 0)
    except (OSError, AttributeError):
        pass


def _reseed() -> None:
    random.seed()
    numpy_random = sys.modules.get("numpy.random")
    if numpy_random is not None:
        numpy_random.seed()  # the legacy global generator, seeded from the OS in a fresh process


def _run(target: Target) -> None:
    if target.kind == "script":
        runpy.run_path(target.value, run_name="__main__")
    elif target.kind == "module":
        runpy.run_module(target.value, run_name="__main__", alter_sys=True)
    else:
        main = types.ModuleType("__main__")
        main.__dict__["__builtins__"] = __builtins__
        sys.modules["__main__"] = main
        exec(compile(target.value, "<string>", "exec"), main.__dict__)


def _exit_status(code: object) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1


def _finish(status: int) -> NoReturn:
    """Exit as the interpreter does: wait for non-daemon threads, run atexit, flush, leave."""
    shutdown = getattr(threading, "_shutdown", None)
    try:
        if shutdown is not None:
            shutdown()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(status)


def place_fds(fds: Sequence[tuple[int, int]]) -> None:
    """Put each received fd at the number it had in the launcher (``(number, fd)`` pairs), inheritable, as a
    direct start inherits it; the received copies are closed. Works whatever numbers overlap: every fd is first
    moved above all of them."""
    floor = max([n for pair in fds for n in pair], default=2) + 1
    high = [(number, fcntl.fcntl(fd, fcntl.F_DUPFD, floor)) for number, fd in fds]
    for _, fd in fds:
        os.close(fd)
    for number, fd in high:
        os.dup2(fd, number, inheritable=True)
        os.close(fd)


def run_child(
    target: Target,
    *,
    fds: Sequence[tuple[int, int]],
    env: Mapping[str, str],
    cwd: str,
    umask: int,
    limits: Mapping[str, Sequence[int]],
    base_path: Sequence[str],
    close: Sequence[int],
    signals: Mapping[str, Sequence[int]] | None = None,
    spawn_executable: str | None = None,
) -> NoReturn:
    """Turn this freshly forked process into ``target`` started by the launcher (see the module docstring):
    ``fds`` are the launcher's inheritable fds, ``(number, received fd)``, standard streams first; ``signals``
    what the launcher ignores and blocks (:func:`current_signals`);
    ``spawn_executable``, if given, is what multiprocessing's ``spawn`` and ``forkserver`` start instead of the
    interpreter, so that the processes the command spawns come from the warm process too."""
    status = 1
    try:
        for fd in close:
            try:
                os.close(fd)
            except OSError:
                pass
        os.setpgid(0, 0)
        _apply_signals(signals or {})
        place_fds(fds)
        if spawn_executable is not None:
            multiprocessing.set_executable(spawn_executable)
        os.chdir(cwd)
        mp_process = sys.modules.get("multiprocessing.process")
        if mp_process is not None:  # captured when the warm process imported it; spawn resolves __main__ by it
            mp_process.ORIGINAL_DIR = os.getcwd()  # type: ignore[attr-defined]
        os.umask(umask)
        _apply_limits(limits)
        os.environ.clear()
        os.environ.update(env)
        _reopen_stdio(target.unbuffered, env)
        sys.argv = list(target.argv)
        sys.path[:] = [target.path0, *base_path]
        _reseed()
        _name_process(target)
        gc.enable()  # the frozen import-time objects stay frozen: collections never touch (copy) their pages
    except BaseException:
        traceback.print_exc()
        print("weightcache run: the warm process's child could not take the launcher's place", file=sys.stderr)
        os._exit(1)
    try:
        _run(target)
        status = 0
    except SystemExit as exc:
        status = _exit_status(exc.code)
    except KeyboardInterrupt:
        traceback.print_exc()
        sys.stderr.flush()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
        status = 128 + signal.SIGINT
    except BaseException:
        sys.excepthook(*sys.exc_info())
        status = 1
    _finish(status)


__all__ = ["LIMITS", "current_limits", "current_signals", "run_child"]

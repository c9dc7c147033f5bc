"""``weightcache run -- CMD ...``: start a command from its warm process, or directly when there is none.

The launcher works out what the command runs (:func:`weightcache.warm.target.resolve`), which warm process serves
it (:mod:`weightcache.warm.identity`), and asks that process to fork the command with the launcher's arguments,
environment, working directory, umask, resource limits and standard streams. Then it stands in for the command:
signals it receives go to the command (SIGINT, SIGQUIT and SIGHUP to its process group, as a terminal sends them;
every other forwarded signal to its pid), and it exits with the command's status, or dies of the command's signal.

When the warm process cannot serve, the command still starts, directly (``exec``, so in this very process), after
one line on stderr that says why (with ``WEIGHTCACHE_WARM=0``, the switch, without one):

- a command the warm process cannot start (another interpreter, ``-X`` options, a binary): the line says so;
- no warm process of this slot yet: one is started in the background for the next start;
- a warm process whose key differs (an upgrade, another ``sys.path``): it is stopped, a new one started;
- a warm process that refuses or fails the request: its reason.

Layer L2: standard library and the warm package; never imports torch or an engine.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import socket
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

from .. import protocol
from ..errors import ProtocolError, SocketDirError
from . import identity
from .child import current_limits, current_signals
from .server import DEFAULT_IDLE_TIMEOUT_S
from .target import NotWarmable, Target, default_preloads, resolve

#: The switch: ``WEIGHTCACHE_WARM=0`` starts every command directly.
WARM_ENV = "WEIGHTCACHE_WARM"
#: Sent to the command's process group, as a terminal does; other forwarded signals go to its pid.
GROUP_SIGNALS = (signal.SIGINT, signal.SIGQUIT, signal.SIGHUP)
FORWARDED = (*GROUP_SIGNALS, signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGWINCH, signal.SIGALRM)
#: Seconds to wait for a warm process's reply to ``hello`` or ``run``.
REPLY_TIMEOUT_S = 10.0


class WarmUnavailable(Exception):
    """The warm process cannot start this command (the message says why)."""


def enabled(env: Mapping[str, str]) -> bool:
    """Whether the switch leaves the warm process on (anything but ``0``, ``off``, ``false``, ``no``)."""
    return env.get(WARM_ENV, "1").strip().lower() not in ("0", "off", "false", "no")


def note(message: str) -> None:
    print(f"weightcache run: {message}", file=sys.stderr, flush=True)


def exec_directly(command: Sequence[str], env: Mapping[str, str]) -> int:
    """Replace this process with ``command``; 127 (and a line on stderr) if it cannot be found, 126 if it cannot
    be run, as a shell answers."""
    try:
        os.execvpe(command[0], list(command), dict(env))
    except FileNotFoundError:
        note(f"{command[0]}: command not found")
        return 127
    except OSError as exc:
        note(f"{command[0]}: {exc.strerror}")
        return 126


def connect(path: Path, timeout: float = REPLY_TIMEOUT_S) -> socket.socket | None:
    """A connection to the warm process at ``path``, or None if none listens there."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(timeout)
    try:
        sock.connect(str(path))
    except (FileNotFoundError, ConnectionRefusedError):
        sock.close()
        return None
    _, uid, _ = protocol.peer_credentials(sock)
    if uid != os.getuid():
        sock.close()
        raise WarmUnavailable(f"the warm socket {path} is served by uid {uid}, not by this user ({os.getuid()})")
    return sock


def ask(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> dict[str, Any]:
    """Send one request and read one reply; an ``error`` reply raises WarmUnavailable with its message."""
    try:
        protocol.send_frame(sock, message, fds)
        reply, extra = protocol.recv_frame(sock, idle_timeout=REPLY_TIMEOUT_S, max_fds=0)
    except (ProtocolError, OSError) as exc:
        raise WarmUnavailable(f"the warm process did not answer {message['op']!r}: {exc}") from exc
    protocol.close_fds(extra)
    if reply.get("op") == "error":
        raise WarmUnavailable(str(reply.get("message", "refused")))
    return reply


def hello(path: Path) -> dict[str, Any] | None:
    """The ``hello`` of the warm process at ``path``, or None if none listens there."""
    sock = connect(path)
    if sock is None:
        return None
    with sock:
        return ask(sock, {"op": "hello"})


def stop(path: Path) -> dict[str, Any] | None:
    """Ask the warm process at ``path`` to stop (it frees its slot at once and exits once its children have);
    its reply, or None if none listens there."""
    sock = connect(path)
    if sock is None:
        return None
    with sock:
        return ask(sock, {"op": "stop"})


def spawn(directory: Path, preloads: Sequence[str], idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S) -> Path:
    """Start a warm process for ``preloads`` in the background (its own session, detached from this process by a
    double fork, logging to ``<slot>.log``); returns the log's path. Returns at once: it imports in the background.
    """
    slot = identity.slot(sys.executable, preloads)
    log = directory / f"{slot}.log"
    # The warm process runs this process's own weightcache (``-m weightcache`` from "/" could find another copy
    # on the path than the one this process imported, e.g. a checkout in the working directory: their keys would
    # never match). It replaces sys.path[0], which for ``-c`` is the working directory and no key counts.
    root = str(Path(__file__).resolve().parents[2])
    code = f"import sys; sys.path[0] = {root!r}; from weightcache.tools.cli import main; sys.exit(main())"
    argv = [sys.executable, "-c", code, "warm", "serve", "--dir", str(directory)]
    argv += ["--idle-timeout", str(idle_timeout), *(f"--preload={p}" for p in preloads)]
    env = warm_environment(os.environ, os.getcwd())
    log_fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_APPEND | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        first = os.fork()
        if first == 0:
            try:
                os.setsid()
                if os.fork() == 0:
                    null = os.open(os.devnull, os.O_RDONLY)
                    os.dup2(null, 0)
                    os.dup2(log_fd, 1)
                    os.dup2(log_fd, 2)
                    # nothing the launcher inherited (a supervisor's sockets, pipes) stays open in a process that
                    # may outlive it by an hour
                    os.closerange(3, os.sysconf("SC_OPEN_MAX"))
                    os.chdir("/")
                    os.execve(sys.executable, argv, env)
            finally:
                os._exit(0)
        os.waitpid(first, 0)
    finally:
        os.close(log_fd)
    return log


def warm_environment(environ: Mapping[str, str], cwd: str) -> dict[str, str]:
    """The environment a warm process spawned from ``cwd`` starts with: ``environ``, with every relative entry of
    ``PYTHONPATH`` (an empty one too) made absolute against ``cwd``. The launcher read them against its working
    directory; the warm process runs in ``/``, where ``PYTHONPATH=.`` would name another directory, its sys.path
    (part of its key) would never match the launcher's, and every command would start directly. The commands it
    forks get the launcher's environment as it is."""
    env = dict(environ)
    value = env.get("PYTHONPATH")
    if value:  # Python ignores an empty PYTHONPATH
        entries = value.split(os.pathsep)
        env["PYTHONPATH"] = os.pathsep.join(os.path.normpath(os.path.join(cwd, entry)) for entry in entries)
    return env


#: Seconds after which a slot whose lock nobody holds means the warm process started for it has exited.
LOCK_GRACE_S = 5.0


def _slot_held(lock: Path) -> bool:
    """Whether a process holds the slot's lock (a warm process takes it first thing, and holds it while it lives)."""
    try:
        fd = os.open(lock, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def wait_ready(directory: Path, preloads: Sequence[str], timeout: float) -> dict[str, Any]:
    """Wait until the warm process of this slot answers ``hello`` with the current key; its hello. Raises
    WarmUnavailable with the end of its log if it does not within ``timeout`` seconds, or if no process holds the
    slot any more (it exited: a failed preload that created a CUDA context, say)."""
    slot = identity.slot(sys.executable, preloads)
    key = identity.key(sys.executable, preloads, identity.base_path())
    began = time.monotonic()
    log = directory / f"{slot}.log"
    while True:
        try:
            found = hello(directory / f"{slot}.sock")
        except WarmUnavailable:  # one that is stopping, or not yet listening
            found = None
        if found is not None and found.get("key") == key:
            return found
        waited = time.monotonic() - began
        gone = waited > LOCK_GRACE_S and not _slot_held(directory / f"{slot}.lock")
        if gone or waited > timeout:
            tail = log.read_text(errors="replace")[-2000:] if log.exists() else "(no log)"
            why = "the warm process exited" if gone else f"no warm process answered within {timeout:.0f} s"
            raise WarmUnavailable(f"{why}; the end of {log}:\n{tail}")
        time.sleep(0.1)


def ensure(directory: Path, preloads: Sequence[str], *, idle_timeout: float, timeout: float) -> dict[str, Any]:
    """A warm process of this slot with the current key, started (or replaced) and waited for; its hello."""
    path = directory / f"{identity.slot(sys.executable, preloads)}.sock"
    try:
        found = hello(path)
    except WarmUnavailable:
        found = None
    if found is not None and found.get("key") != identity.key(sys.executable, preloads, identity.base_path()):
        stop(path)
        found = None
    if found is None:
        spawn(directory, preloads, idle_timeout)
    return wait_ready(directory, preloads, timeout)


def inherited_fds() -> list[tuple[int, int]]:
    """``(number, fd)`` for every fd a direct start of the command would inherit from this process: 0, 1 and 2
    (``/dev/null`` where one is closed), then every other open fd without close-on-exec (Python opens its own
    with it), in order. Raises WarmUnavailable past what one frame carries."""
    fds: list[tuple[int, int]] = []
    for number in (0, 1, 2):
        try:
            os.fstat(number)
            fds.append((number, number))
        except OSError:  # closed in the launcher: the command gets /dev/null there
            fds.append((number, os.open(os.devnull, os.O_RDWR)))
    for name in sorted(os.listdir("/proc/self/fd"), key=int):
        number = int(name)
        if number <= 2:
            continue
        try:
            inheritable = not fcntl.fcntl(number, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        except OSError:  # the directory's own fd, closed by now
            continue
        if inheritable:
            fds.append((number, number))
    if len(fds) > protocol.MAX_FDS:
        raise WarmUnavailable(f"the command would inherit {len(fds)} fds; one request carries {protocol.MAX_FDS}")
    return fds


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def _request(target: Target, env: Mapping[str, str], cwd: str, numbers: Sequence[int]) -> dict[str, Any]:
    return {
        "op": "run",
        "fd_numbers": list(numbers),
        "target": target.to_wire(),
        "env": dict(env),
        "cwd": cwd,
        "umask": _umask(),
        "limits": current_limits(),
        "signals": current_signals(),
    }


class _Forwarder:
    """Forwards the launcher's signals to the command. Installed before the request is sent, so that a signal that
    arrives between the fork and the reply is held, then delivered once the command's pid is known, instead of
    killing the launcher (and with it the command).

    A signal's C-level handler can run on another thread than the main one, or just before the main thread blocks
    in a system call: either way a main thread blocked in ``recvmsg`` would run the Python handler (and forward)
    only once the command had exited on its own. So the launcher waits for the command on its socket and on a
    signal wakeup fd together (:meth:`wait_readable`): every signal wakes it, and its handler runs at once. A signal
    the launcher inherited as ignored (``nohup``) is left ignored, as it is for the command."""

    def __init__(self) -> None:
        self.pid = 0
        self.pending: list[int] = []
        self.taken: list[int] = []
        self._wake_r, self._wake_w = socket.socketpair()
        self._previous_wakeup = -1

    def __enter__(self) -> _Forwarder:
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._previous_wakeup = signal.set_wakeup_fd(self._wake_w.fileno(), warn_on_full_buffer=False)
        for signum in FORWARDED:
            if signal.getsignal(signum) is signal.SIG_IGN:
                continue
            signal.signal(signum, self._forward)
            self.taken.append(signum)
        return self

    def __exit__(self, *exc: object) -> None:
        for signum in self.taken:
            signal.signal(signum, signal.SIG_DFL if signum != signal.SIGINT else signal.default_int_handler)
        signal.set_wakeup_fd(self._previous_wakeup)
        self._wake_r.close()
        self._wake_w.close()

    def wait_readable(self, sock: socket.socket) -> None:
        """Return once ``sock`` has something to read; signals that arrive meanwhile are forwarded as they come."""
        with selectors.DefaultSelector() as selector:
            selector.register(sock, selectors.EVENT_READ)
            selector.register(self._wake_r, selectors.EVENT_READ)
            while True:
                for key, _ in selector.select():
                    if key.fileobj is sock:
                        return
                    try:
                        self._wake_r.recv(4096)  # the signal numbers; their handlers run (and forward) on return
                    except BlockingIOError:
                        pass

    def started(self, pid: int) -> None:
        self.pid = pid
        for signum in self.pending:
            self._deliver(signum)
        self.pending.clear()

    def _forward(self, signum: int, _frame: object) -> None:
        if self.pid:
            self._deliver(signum)
        else:
            self.pending.append(signum)

    def _deliver(self, signum: int) -> None:
        try:
            if signum in GROUP_SIGNALS:
                os.killpg(self.pid, signum)
            else:
                os.kill(self.pid, signum)
        except ProcessLookupError:
            pass


def _wait(sock: socket.socket, forwarder: _Forwarder) -> int:
    """Wait (forwarding signals) until the warm process says the command exited; its status (or this process dies
    of its signal)."""
    pid = forwarder.pid
    try:
        forwarder.wait_readable(sock)
        reply, extra = protocol.recv_frame(sock, idle_timeout=None, max_fds=0)
        protocol.close_fds(extra)
    except (ProtocolError, OSError) as exc:
        note(f"the warm process went away while the command (pid {pid}) ran ({exc}); its exit status is lost")
        return 1
    if "signal" in reply:
        died_of = int(reply["signal"])
        if died_of not in (signal.SIGKILL, signal.SIGSTOP):  # the two whose disposition cannot be set
            signal.signal(died_of, signal.SIG_DFL)
        os.kill(os.getpid(), died_of)
        return 128 + died_of
    return int(reply.get("code", 1))


def run(
    command: Sequence[str],
    *,
    socket_dir: str | os.PathLike[str] | None = None,
    preloads: Sequence[str] | None = None,
    idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S,
) -> int:
    """Start ``command`` from its warm process, or directly (see the module docstring); its exit status."""
    env = dict(os.environ)
    if not command:
        note("no command given: weightcache run -- CMD [ARGS...]")
        return 2
    if not enabled(env):
        return exec_directly(command, env)
    cwd = os.getcwd()
    try:
        target = resolve(command, env=env, cwd=cwd, executable=sys.executable)
        wanted = tuple(preloads) if preloads else default_preloads(target)
        directory = identity.warm_dir(socket_dir)
        slot = identity.slot(sys.executable, wanted)
        path = directory / f"{slot}.sock"
        found = hello(path)
        if found is None:
            log = spawn(directory, wanted, idle_timeout)
            raise WarmUnavailable(f"no warm process for this command yet; one is starting (log: {log})")
        if found.get("key") != identity.key(sys.executable, wanted, identity.base_path()):
            stop(path)
            log = spawn(directory, wanted, idle_timeout)
            raise WarmUnavailable(
                f"the warm process (pid {found.get('pid')}) imported other versions of its packages, another "
                "sys.path, or other values of the variables its packages read at import; stopped it, a new one is "
                f"starting (log: {log})"
            )
    except (NotWarmable, WarmUnavailable, SocketDirError, OSError) as exc:
        note(f"{exc}; starting the command directly")
        return exec_directly(command, env)
    return start(path, target, env, cwd, lambda why: exec_directly(command, env))


def start(path: Path, target: Target, env: Mapping[str, str], cwd: str, fallback: Callable[[str], int]) -> int:
    """Ask the warm process at ``path`` to start ``target`` with this process's inheritable fds, then stand in for
    it (signals, exit status); ``fallback(why)`` (after a line saying why) if it cannot."""
    try:
        sock = connect(path)
        if sock is None:
            raise WarmUnavailable("the warm process went away")
        fds = inherited_fds()
    except (WarmUnavailable, OSError) as exc:
        note(f"{exc}; starting the command directly")
        return fallback(str(exc))
    refused: WarmUnavailable | None = None
    with sock:
        with _Forwarder() as forwarder:
            try:
                started = ask(sock, _request(target, env, cwd, [n for n, _ in fds]), [fd for _, fd in fds])
            except WarmUnavailable as exc:
                refused = exc
            finally:
                protocol.close_fds([fd for number, fd in fds if fd != number])
            if refused is None:
                forwarder.started(int(started["pid"]))
                return _wait(sock, forwarder)
        for signum in forwarder.pending:  # what a direct start would have received before it ran: now, to us
            os.kill(os.getpid(), signum)
        note(f"{refused}; starting the command directly")
        return fallback(str(refused))


__all__ = [
    "WARM_ENV",
    "WarmUnavailable",
    "enabled",
    "ensure",
    "exec_directly",
    "hello",
    "inherited_fds",
    "run",
    "spawn",
    "start",
    "stop",
    "wait_ready",
]

"""The warm process: imports an engine once, then forks each start of it from that image (``weightcache warm serve``).

One process per slot (:mod:`weightcache.warm.identity`): it takes the slot's lock (a second one exits at once),
imports its preloads, and checks that nothing created a CUDA context (a context does not survive ``fork()``; if one
exists the process refuses to serve and exits, its log says which preload did it). Then it freezes the collector
(``gc.freeze``: the import-time objects are never collected, so children never copy their pages) and serves a
Unix socket, 0600 in a 0700 directory, to its own uid only (SO_PEERCRED; any other peer gets a refusal and the
connection is closed).

Requests are JSON frames (:mod:`weightcache.protocol`): ``hello`` (the key, pid, preloads and what was found at
import), ``run`` (a :class:`~weightcache.warm.target.Target`, environment, working directory, umask, limits, the signals
the launcher ignores and blocks, with
the launcher's inheritable fds attached, stdin, stdout and stderr first, and ``fd_numbers`` saying the number each
had) and ``stop``. Beside its socket it writes ``<slot>.spawn``, the launcher that multiprocessing's ``spawn``
runs in its children (:mod:`weightcache.warm.spawn`). For ``run`` it forks; the child becomes the
command (:mod:`weightcache.warm.child`) and the reply says ``started`` with its pid; when the child exits, the
reply ``exited`` carries its exit code or signal. If the launcher's connection closes while the child runs, the
child's process group is killed (SIGKILL): a command dies with its launcher, as under a supervisor.

It is single-threaded (a ``fork()`` copies only the calling thread, so a warm process keeps no other) and waits
with one ``selectors`` loop on the listening socket, the connections and each child's pidfd. ``stop`` (or SIGTERM)
closes the socket and releases the lock at once, so a new warm process can take the slot, then waits for its
running children before it exits. Idle (no connection, no child) for ``idle_timeout`` seconds, it exits.

Layer L2: never imports torch or an engine by an import statement; it imports what it is told by name, and asks
torch (if imported) whether CUDA is initialised through ``sys.modules``.
"""

from __future__ import annotations

import fcntl
import gc
import importlib
import json
import os
import selectors
import signal
import socket
import sys
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .. import protocol
from ..errors import ProtocolError
from ..pidlock import close_lock_file, open_lock_file, write_pid
from . import identity
from .child import run_child
from .target import Target

#: Seconds a warm process with no connection and no child waits before it exits (``--idle-timeout``).
DEFAULT_IDLE_TIMEOUT_S = 3600.0
#: The most concurrent connections (each running command holds one).
MAX_CONNECTIONS = 64
#: Largest request frame (an environment of a few hundred variables fits many times over).
MAX_REQUEST_BYTES = 4 * 1024 * 1024


def cuda_initialized() -> bool:
    """Whether torch (if this process imported it) has created a CUDA context."""
    torch = sys.modules.get("torch")
    cuda = getattr(torch, "cuda", None)
    is_initialized = getattr(cuda, "is_initialized", None)
    return bool(is_initialized()) if callable(is_initialized) else False


def driver_files() -> list[str]:
    """The NVIDIA device files this process holds open (``/dev/nvidia*``): a CUDA driver initialised here (or NVML)
    opens them. For the log and ``hello``: what a child inherits."""
    found = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            path = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if path.startswith("/dev/nvidia"):
            found.append(path)
    return sorted(found)


def import_preloads(preloads: Sequence[str], log: Any) -> dict[str, object]:
    """Import each ``module`` or ``module:attr``; what happened to each (seconds, or the error), for ``hello``."""
    found: dict[str, object] = {}
    for spec in preloads:
        name, _, attr = spec.partition(":")
        start = time.perf_counter()
        try:
            obj: object = importlib.import_module(name)
            for part in filter(None, attr.split(".")):
                obj = getattr(obj, part)
        except Exception as exc:  # a preload that fails is skipped: the child imports it (or fails) as usual
            found[spec] = f"{type(exc).__name__}: {exc}"
            print(f"warm: preload {spec} failed, skipped: {type(exc).__name__}: {exc}", file=log, flush=True)
        else:
            seconds = round(time.perf_counter() - start, 3)
            found[spec] = seconds
            print(f"warm: imported {spec} in {seconds:.2f} s", file=log, flush=True)
        if cuda_initialized():  # after a failed preload too: it may have created a context before it failed
            raise RuntimeError(
                f"importing {spec} created a CUDA context, which no forked child could use; start this command "
                "without the warm process (WEIGHTCACHE_WARM=0) or leave that module out of --preload"
            )
    return found


#: The spawn launcher a warm process writes beside its socket (see :mod:`weightcache.warm.spawn`).
SPAWN_LAUNCHER = """#!{python}
# Written by the warm process of this slot: what multiprocessing's spawn runs in its children, instead of the
# interpreter, so that a spawned process is forked from the warm process too. Falls back to the interpreter.
import os, sys
try:
    from weightcache.warm.spawn import main
except ImportError:
    os.execv(sys.executable, [sys.executable, *sys.argv[1:]])
sys.exit(main({socket!r}))
"""


def write_spawn_launcher(path: Path, python: str, socket_path: Path) -> None:
    """Write the spawn launcher (0700, replaced atomically)."""
    aside = path.with_name(path.name + ".new")
    fd = os.open(aside, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(SPAWN_LAUNCHER.format(python=python, socket=str(socket_path)))
    os.replace(aside, path)


class _Conn:
    def __init__(self, sock: socket.socket) -> None:
        self.sock = sock
        self.pid = 0
        self.pidfd = -1


class WarmServer:
    """The warm process's state and loop (see the module docstring)."""

    def __init__(self, directory: Path, executable: str, preloads: Sequence[str], idle_timeout: float) -> None:
        self.directory = directory
        self.preloads = tuple(preloads)
        self.slot = identity.slot(executable, self.preloads)
        self.key = identity.key(executable, self.preloads, identity.base_path())
        self.base_path = identity.base_path()
        self.idle_timeout = idle_timeout
        self.socket_path = directory / f"{self.slot}.sock"
        self.lock_path = directory / f"{self.slot}.lock"
        self.spawn_path = directory / f"{self.slot}.spawn"
        self.selector = selectors.DefaultSelector()
        self.listener: socket.socket | None = None
        self.lock_fd = -1
        self.conns: dict[int, _Conn] = {}  # by socket fd
        self.children: dict[int, _Conn] = {}  # by pidfd
        self.imported: dict[str, object] = {}
        self.started = time.time()
        self.stopping = False
        self.stop_reason = ""  # why it stops: what its log's last line says
        self.last_active = time.monotonic()

    # -- setup -------------------------------------------------------------------------------------------------

    def take_slot(self) -> bool:
        """Take the slot's lock; False if another warm process holds it."""
        fd = open_lock_file(self.lock_path)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        write_pid(fd)
        self.lock_fd = fd
        return True

    def listen(self) -> None:
        try:
            os.unlink(self.socket_path)  # a dead warm process's socket: we hold the slot's lock
        except FileNotFoundError:
            pass
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            listener.bind(str(self.socket_path))
        finally:
            os.umask(old)
        listener.listen(16)
        listener.setblocking(False)
        write_spawn_launcher(self.spawn_path, sys.executable, self.socket_path)
        self.listener = listener
        self.selector.register(listener, selectors.EVENT_READ)

    def release_slot(self) -> None:
        """Close the socket and release the lock: a new warm process may take the slot now."""
        if self.listener is not None:
            self.selector.unregister(self.listener)
            self.listener.close()
            self.listener = None
            for path in (self.socket_path, self.spawn_path):
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
        if self.lock_fd >= 0:
            close_lock_file(self.lock_fd)
            self.lock_fd = -1

    # -- the loop ----------------------------------------------------------------------------------------------

    def stop(self, why: str) -> None:
        """Stop taking commands (the first reason is the one kept); the loop ends once the running ones ended."""
        if not self.stopping:
            self.stopping, self.stop_reason = True, why

    def serve(self) -> str:
        """Serve until stopped (SIGTERM, a ``stop`` request) and every command ended, or idle for the idle
        timeout; why it ended."""
        signal.signal(signal.SIGTERM, lambda *_: self.stop("SIGTERM"))
        while True:
            if self.stopping and self.listener is not None:
                self.release_slot()
            if self.stopping and not self.children:
                return self.stop_reason
            if not self.conns and not self.children and time.monotonic() - self.last_active > self.idle_timeout:
                return f"idle for {self.idle_timeout:g} s (--idle-timeout)"
            for selected, _ in self.selector.select(timeout=1.0):
                # An event of this batch may be stale: handling an earlier one can drop a connection or reap a
                # child, and a new one can take its fd number.
                if selected.fileobj is self.listener:
                    self._accept()
                elif selected.data == "child":
                    if selected.fd in self.children:
                        self._reap(selected.fd)
                else:
                    conn = self.conns.get(selected.fd)
                    if conn is not None and conn.sock is selected.fileobj:
                        self._request(conn)

    def _accept(self) -> None:
        assert self.listener is not None
        try:
            sock, _ = self.listener.accept()
        except (BlockingIOError, InterruptedError):
            return
        self.last_active = time.monotonic()
        sock.setblocking(True)
        _, uid, _ = protocol.peer_credentials(sock)
        if uid != os.getuid() or len(self.conns) >= MAX_CONNECTIONS:
            reason = (
                f"this warm process serves uid {os.getuid()} only; the peer runs as uid {uid}"
                if uid != os.getuid()
                else f"the warm process already serves {MAX_CONNECTIONS} commands"
            )
            self._reply(sock, {"op": "error", "code": "refused", "message": reason})
            sock.close()
            return
        conn = _Conn(sock)
        self.conns[sock.fileno()] = conn
        self.selector.register(sock, selectors.EVENT_READ, "conn")

    def _drop(self, conn: _Conn) -> None:
        self.selector.unregister(conn.sock)
        del self.conns[conn.sock.fileno()]
        if conn.pid and conn.pidfd >= 0:
            # The launcher went away while its command runs: the command goes with it.
            try:
                os.killpg(conn.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        conn.sock.close()
        if conn.pidfd >= 0:
            self.children.pop(conn.pidfd, None)
            self.selector.unregister(conn.pidfd)
            os.waitpid(conn.pid, 0)
            os.close(conn.pidfd)
            conn.pidfd = -1

    @staticmethod
    def _reply(sock: socket.socket, message: dict[str, Any], fds: Sequence[int] = ()) -> bool:
        try:
            protocol.send_frame(sock, message, fds)
            return True
        except OSError:
            return False

    def _request(self, conn: _Conn) -> None:
        self.last_active = time.monotonic()
        try:
            message, fds = protocol.recv_frame(
                conn.sock, idle_timeout=protocol.FRAME_TIMEOUT_S, max_payload=MAX_REQUEST_BYTES
            )
        except (ProtocolError, OSError):
            self._drop(conn)
            return
        op = message.get("op")
        try:
            if op == "hello":
                self._reply(conn.sock, self.hello())
            elif op == "stop":
                self.stop(f"a stop request (weightcache warm stop) with {len(self.children)} command(s) running")
                self.release_slot()  # before the reply: whoever asked may start the slot's next process at once
                self._reply(conn.sock, {"op": "stopping", "children": len(self.children)})
            elif op == "run" and conn.pid == 0:
                taken, fds = fds, []  # _run owns them (closes them after the fork; their numbers are then reused)
                self._run(conn, message, taken)
            else:
                self._reply(conn.sock, {"op": "error", "code": "bad_request", "message": f"unexpected op {op!r}"})
        finally:
            protocol.close_fds(fds)

    def hello(self) -> dict[str, Any]:
        return {
            "op": "hello",
            "key": self.key,
            "slot": self.slot,
            "pid": os.getpid(),
            "python": sys.executable,
            "preloads": list(self.preloads),
            "imported": self.imported,
            "children": len(self.children),
            "threads": threading.active_count(),
            "cuda_initialized": cuda_initialized(),
            "driver_files": driver_files(),
            "started": self.started,
            "stopping": self.stopping,
        }

    def _run(self, conn: _Conn, message: dict[str, Any], fds: list[int]) -> None:
        try:
            numbers = protocol.field(message, "fd_numbers", list)
            if len(numbers) != len(fds) or not all(isinstance(n, int) and 0 <= n < 65536 for n in numbers):
                raise ProtocolError(f"fd_numbers must give a number for each of the {len(fds)} fds attached")
            if numbers[:3] != [0, 1, 2] or len(set(numbers)) != len(numbers):
                raise ProtocolError("run needs the launcher's stdin, stdout and stderr first, and no number twice")
            target = Target.from_wire(protocol.field(message, "target", dict))
            env = protocol.field(message, "env", dict)
            if not all(isinstance(k, str) and isinstance(v, str) and "=" not in k for k, v in env.items()):
                raise ProtocolError("env must map variable names to strings")
            cwd = protocol.field(message, "cwd", str)
            umask = protocol.field(message, "umask", int)
            limits = protocol.field(message, "limits", dict)
            if not all(
                isinstance(v, list) and len(v) == 2 and all(isinstance(n, int) for n in v) for v in limits.values()
            ):
                raise ProtocolError("limits must map names to [soft, hard]")
            signals = message.get("signals", {})
            if not isinstance(signals, dict) or not all(
                key in ("ignored", "blocked")
                and isinstance(v, list)
                and all(isinstance(n, int) and 0 < n < 128 for n in v)
                for key, v in signals.items()
            ):
                raise ProtocolError("signals must map 'ignored' and 'blocked' to lists of signal numbers")
            if self.stopping:
                raise ProtocolError("this warm process is stopping; start the command directly")
            if cuda_initialized():
                raise ProtocolError("this warm process has a CUDA context, which a forked child cannot use")
        except (ProtocolError, ValueError) as exc:
            protocol.close_fds(fds)
            self._reply(conn.sock, {"op": "error", "code": "bad_request", "message": str(exc)})
            return
        # The child keeps none of the warm process's fds: not the lock (a child that outlives its warm process
        # would hold the slot), not the sockets, not the selector.
        close = [self.selector.fileno(), *(c.sock.fileno() for c in self.conns.values()), *self.children]
        close += [self.listener.fileno()] if self.listener is not None else []
        close += [self.lock_fd] if self.lock_fd >= 0 else []
        gc.freeze()
        pid = os.fork()
        if pid == 0:
            run_child(
                target,
                fds=list(zip(numbers, fds)),
                spawn_executable=str(self.spawn_path),
                env=env,
                cwd=cwd,
                umask=umask,
                limits=limits,
                base_path=self.base_path,
                close=close,
                signals=signals,
            )
        protocol.close_fds(fds)
        conn.pid = pid
        conn.pidfd = os.pidfd_open(pid)
        self.children[conn.pidfd] = conn
        self.selector.register(conn.pidfd, selectors.EVENT_READ, "child")
        if not self._reply(conn.sock, {"op": "started", "pid": pid}):
            self._drop(conn)

    def _reap(self, pidfd: int) -> None:
        conn = self.children[pidfd]
        pid, status = os.waitpid(conn.pid, os.WNOHANG)
        if pid == 0:  # a stale event (its pidfd number reused by a child that still runs)
            return
        del self.children[pidfd]
        self.selector.unregister(pidfd)
        os.close(pidfd)
        conn.pidfd = -1
        if os.WIFSIGNALED(status):
            reply: dict[str, Any] = {"op": "exited", "signal": os.WTERMSIG(status)}
        else:
            reply = {"op": "exited", "code": os.waitstatus_to_exitcode(status)}
        self._reply(conn.sock, reply)
        conn.pid = 0
        self._drop(conn)
        self.last_active = time.monotonic()


def serve(directory: Path, preloads: Sequence[str], idle_timeout: float = DEFAULT_IDLE_TIMEOUT_S) -> int:
    """Run one warm process in this process (``weightcache warm serve``, which :func:`~weightcache.warm.launcher.spawn`
    starts detached): take the slot, import, serve until stopped or idle; its exit status (0, or 2 with the reason
    in the log on stderr)."""
    gc.disable()  # import-time objects are frozen before the first fork, never collected here
    # torch.cuda.is_available() in a preload must not initialise the driver (which no forked child could use):
    # torch then asks NVML instead. Children get the launcher's environment, not this one.
    os.environ["PYTORCH_NVML_BASED_CUDA_CHECK"] = "1"  # whatever the launcher had: never the driver here
    server = WarmServer(directory, sys.executable, preloads, idle_timeout)
    log = sys.stderr
    if not server.take_slot():
        print(f"warm: slot {server.slot} is served already; exiting", file=log, flush=True)
        return 0
    try:
        start = time.perf_counter()
        server.imported = import_preloads(server.preloads, log)
        print(
            f"warm: pid {os.getpid()} ready in {time.perf_counter() - start:.2f} s: "
            f"{json.dumps(server.imported)}; threads {threading.active_count()}; NVIDIA device files open: "
            f"{driver_files() or 'none'}",
            file=log,
            flush=True,
        )
        server.listen()
        why = server.serve()
        print(f"warm: pid {os.getpid()} exited: {why}", file=log, flush=True)
    except Exception as exc:
        print(f"warm: {type(exc).__name__}: {exc}", file=log, flush=True)
        return 2
    finally:
        server.release_slot()
    return 0


__all__ = ["DEFAULT_IDLE_TIMEOUT_S", "WarmServer", "cuda_initialized", "import_preloads", "serve"]

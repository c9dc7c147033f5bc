"""Where the keeper's socket lives, and the checks that keep that place private.

Resolution order: the ``socket_dir`` argument, else ``$WEIGHTCACHE_DIR``, else ``$XDG_RUNTIME_DIR/weightcache``,
else ``/tmp/weightcache-<uid>``. The directory must be a real directory (not a symlink), owned by this user,
with no access for group or others (0700); it is created so when missing. The socket inside is 0600.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

from .errors import SocketDirError

SOCKET_NAME = "keeper.sock"
INSTANCE_LOCK_NAME = "keeper.lock"
SPAWN_LOCK_NAME = "spawn.lock"
LOG_NAME = "keeper.log"
#: Written by a keeper that stops on request (``weightcache stop``, SIGTERM), removed by the next one that starts:
#: clients that lose their keeper spawn a new one only after a crash, never after a deliberate stop.
STOPPED_NAME = "keeper.stopped"
#: sun_path is 108 bytes on Linux, including the terminating NUL.
MAX_SOCKET_PATH = 107


def resolve_socket_dir(socket_dir: str | os.PathLike[str] | None = None) -> Path:
    """The socket directory to use, by the resolution order in the module docstring (not created)."""
    if socket_dir is not None:
        return Path(socket_dir).absolute()
    env = os.environ.get("WEIGHTCACHE_DIR")
    if env:
        return Path(env).absolute()
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime).absolute() / "weightcache"
    return Path(f"/tmp/weightcache-{os.getuid()}")


def check_private_dir(path: Path) -> None:
    """Raise SocketDirError unless ``path`` is a directory, not a symlink, owned by us, mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise SocketDirError(f"socket directory {path} does not exist") from None
    except OSError as exc:
        raise SocketDirError(f"cannot inspect socket directory {path}: {exc}") from exc
    if stat.S_ISLNK(st.st_mode):
        raise SocketDirError(
            f"socket directory {path} is a symlink; expected a real directory (a symlink could redirect the "
            "keeper's socket to a place another user controls). Remove it or pick another socket_dir."
        )
    if not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(f"socket directory {path} exists but is not a directory")
    if st.st_uid != os.getuid():
        raise SocketDirError(
            f"socket directory {path} is owned by uid {st.st_uid}, not by this user (uid {os.getuid()}); "
            "another user could impersonate the keeper there. Pick another socket_dir or $WEIGHTCACHE_DIR."
        )
    if st.st_mode & 0o077:
        raise SocketDirError(
            f"socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; expected 0700 (private). "
            f"Run: chmod 700 {path}"
        )


def ensure_private_dir(path: Path) -> Path:
    """Create ``path`` (mode 0700) if missing, then :func:`check_private_dir` it. Returns ``path``."""
    if len(str(path / SOCKET_NAME)) > MAX_SOCKET_PATH:
        raise SocketDirError(
            f"socket path {path / SOCKET_NAME} is {len(str(path / SOCKET_NAME))} bytes; Unix sockets allow "
            f"{MAX_SOCKET_PATH}. Pick a shorter socket_dir."
        )
    if not os.path.lexists(path):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            os.mkdir(path, 0o700)
        except FileExistsError:
            pass  # created by a racing process; checked below
        except OSError as exc:
            raise SocketDirError(
                f"cannot create socket directory {path}: {exc}. Pick a writable socket_dir or set $WEIGHTCACHE_DIR."
            ) from exc
    check_private_dir(path)
    if not os.access(path, os.W_OK | os.X_OK):
        raise SocketDirError(f"socket directory {path} is not writable by this user; fix its permissions")
    return path


def socket_path(socket_dir: Path) -> Path:
    return socket_dir / SOCKET_NAME

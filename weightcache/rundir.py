"""Where the keeper's socket lives, and the checks that keep that place private.

Resolution order: the ``socket_dir`` argument, else ``$WEIGHTCACHE_DIR`` (an absolute path: a relative one is
refused, since each process would resolve it against its own working directory), else
``$XDG_RUNTIME_DIR/weightcache``, else ``/tmp/weightcache-<uid>``. The directory must be a real directory (not a
symlink), owned by this user, with no access for group or others (0700); it is created so when missing. The socket
inside is 0600.

A keeper shared with one group (``weightcache serve --allow-group GROUP``) uses a *shared* directory instead:
owned by the keeper's user, group GROUP, mode 2750 (the group may enter and connect, but never create, rename
or delete anything there, so nobody else can put a socket in the keeper's place; others get nothing). Its
socket is 0660. A client of another user accepts such a directory only when it was named explicitly (the
argument or ``$WEIGHTCACHE_DIR``; never a default location, which another user could have squatted), only if
it is in that group, and only if the keeper serving it runs as the directory's owner: pointing a client there
means trusting that user with the weights it serves.
"""

from __future__ import annotations

import errno
import grp
import os
import pwd
import stat
from collections.abc import Callable
from pathlib import Path

from .errors import InvalidArgument, SocketDirError

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
        if not os.path.isabs(env):
            # Each process would resolve it against its own working directory: engines started from different
            # directories would each find (or spawn) another keeper, and never share an entry.
            raise SocketDirError(
                f"WEIGHTCACHE_DIR={env!r} is a relative path, which every process resolves against its own working "
                f"directory (this one: {Path(env).absolute()}), so processes started elsewhere would use another "
                f"keeper; expected an absolute path: export WEIGHTCACHE_DIR={Path(env).absolute()}"
            )
        return Path(env)
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and Path(runtime).is_dir():
        return Path(runtime).absolute() / "weightcache"
    return Path(f"/tmp/weightcache-{os.getuid()}")


class MissingSocketDir(SocketDirError):
    """The socket directory does not exist (yet): to a client, no keeper runs there."""


def check_private_dir(path: Path) -> None:
    """Raise SocketDirError unless ``path`` is a directory, not a symlink, owned by us, mode 0700 or stricter."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        raise MissingSocketDir(f"socket directory {path} does not exist") from None
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


def is_explicit(socket_dir: str | os.PathLike[str] | None) -> bool:
    """Whether the socket directory was named by the caller (argument or ``$WEIGHTCACHE_DIR``)."""
    return socket_dir is not None or bool(os.environ.get("WEIGHTCACHE_DIR"))


def resolve_user(user: str | int) -> int:
    """A user name or number -> uid (numbers need not have a name)."""
    return _resolve_id(user, lambda name: pwd.getpwnam(name).pw_uid, "user", "/etc/passwd", "uid")


def resolve_group(group: str | int) -> int:
    """A group name or number -> gid (numbers need not have a name)."""
    return _resolve_id(group, lambda name: grp.getgrnam(name).gr_gid, "group", "/etc/group", "gid")


def _resolve_id(value: str | int, lookup: Callable[[str], int], kind: str, table: str, number: str) -> int:
    if isinstance(value, int) or value.isdigit():
        return int(value)
    try:
        return lookup(value)
    except KeyError:
        raise InvalidArgument(
            f"no {kind} named {value!r} on this host; give a {kind} name from {table} or a {number}"
        ) from None


def my_groups() -> set[int]:
    return {os.getegid(), *os.getgroups()}


def check_shared_dir(path: Path, gid: int, owner: int | None = None) -> None:
    """Raise SocketDirError unless ``path`` is a real directory owned by ``owner`` (default: us), group ``gid``,
    with no write access for the group and no access at all for others (2750 or stricter)."""
    owner = os.getuid() if owner is None else owner
    try:
        st = os.lstat(path)
    except OSError as exc:
        raise SocketDirError(f"cannot inspect socket directory {path}: {exc}") from exc
    fix = f"Run: chown {owner}:{gid} {path} && chmod 2750 {path}"
    if stat.S_ISLNK(st.st_mode) or not stat.S_ISDIR(st.st_mode):
        raise SocketDirError(
            f"shared socket directory {path} is a symlink or not a directory; expected a real directory"
        )
    if st.st_uid != owner or st.st_gid != gid:
        raise SocketDirError(
            f"shared socket directory {path} belongs to uid {st.st_uid} gid {st.st_gid}; expected uid {owner} gid "
            f"{gid}. {fix}"
        )
    if st.st_mode & 0o027 or not st.st_mode & 0o010:
        raise SocketDirError(
            f"shared socket directory {path} has mode {stat.S_IMODE(st.st_mode):04o}; expected 2750 (the group may "
            f"enter but not write, others nothing). {fix}"
        )


def ensure_shared_dir(path: Path, gid: int) -> Path:
    """Create ``path`` as a shared socket directory for group ``gid`` if missing, then check it (the keeper's
    side of ``--allow-group``). An existing directory is never loosened: it must already be set up so."""
    if not os.path.lexists(path):
        ensure_private_dir(path)
        try:
            os.chown(path, -1, gid)
            os.chmod(path, 0o2750)
        except OSError as exc:
            raise SocketDirError(
                f"cannot give socket directory {path} to group {gid}: {exc}. Only members of a group (or root) can "
                "give it files; pick a group you are in."
            ) from exc
    check_shared_dir(path, gid)
    return path


def check_socket_dir(path: Path, *, explicit: bool) -> tuple[int, int | None]:
    """Check the directory a client is about to connect through: ``(uid its keeper must run as, shared gid)``.

    Our own private directory: ``(our uid, None)``. Our own shared directory: ``(our uid, its gid)``. Another
    user's shared directory (see the module docstring): ``(that uid, its gid)``, only if ``explicit`` and we
    are in its group. Anything else raises SocketDirError.
    """
    try:
        check_private_dir(path)
        return os.getuid(), None
    except SocketDirError as exc:
        private_error = exc
    try:
        st = os.lstat(path)
    except OSError:
        raise private_error from None
    if not stat.S_ISDIR(st.st_mode):
        raise private_error
    if st.st_uid == os.getuid():
        try:
            check_shared_dir(path, st.st_gid)
        except SocketDirError:
            raise private_error from None
        return st.st_uid, st.st_gid
    if st.st_gid not in my_groups():
        raise private_error
    if not explicit:
        raise SocketDirError(
            f"socket directory {path} is shared by uid {st.st_uid}; a shared directory is used only when named "
            "explicitly (socket_dir= or $WEIGHTCACHE_DIR), never as a default location"
        )
    check_shared_dir(path, st.st_gid, owner=st.st_uid)
    return st.st_uid, st.st_gid


def ensure_private_dir(path: Path, socket_name: str = SOCKET_NAME) -> Path:
    """Create ``path`` (mode 0700) if missing, then :func:`check_private_dir` it. Returns ``path``.
    ``socket_name``: the longest name of a socket that will be made in it (its path must fit a Unix socket)."""
    if len(str(path / socket_name)) > MAX_SOCKET_PATH:
        raise SocketDirError(
            f"socket path {path / socket_name} is {len(str(path / socket_name))} bytes; Unix sockets allow "
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
                f"cannot create socket directory {path}: {exc}{filesystem_problem(exc)}. Pick a writable socket_dir "
                "or set $WEIGHTCACHE_DIR."
            ) from exc
    check_private_dir(path)
    if not os.access(path, os.W_OK | os.X_OK):
        if os.statvfs(path).f_flag & os.ST_RDONLY:
            raise SocketDirError(
                f"socket directory {path} is on a read-only file system; pick a socket_dir on a writable one "
                "(e.g. under $XDG_RUNTIME_DIR) or set $WEIGHTCACHE_DIR"
            )
        raise SocketDirError(f"socket directory {path} is not writable by this user; fix its permissions")
    return path


def filesystem_problem(exc: OSError) -> str:
    """What an error of the file system itself means, for messages (empty for other errors)."""
    if exc.errno == errno.EROFS:
        return " (the directory is on a read-only file system)"
    if exc.errno in (errno.ENOSPC, errno.EDQUOT):
        return " (the file system is full: free space there)"
    return ""


def stopped_on_purpose(socket_dir: Path) -> bool:
    """Whether the last keeper of ``socket_dir`` was stopped on request (``weightcache stop``, SIGTERM) rather than
    crashing: it left :data:`STOPPED_NAME`, which the next keeper that starts there removes."""
    return (socket_dir / STOPPED_NAME).exists()


def stopped_message(socket_dir: Path) -> str:
    """What to say when something would start a keeper where one was stopped on purpose: it will not, and how to."""
    return (
        f"the keeper was stopped on purpose (`weightcache stop` or SIGTERM left {socket_dir / STOPPED_NAME}), and "
        f"nothing starts it again by itself; start it: `weightcache serve --detach --socket-dir {socket_dir}` (or "
        "its systemd unit)"
    )


def socket_path(socket_dir: Path) -> Path:
    return socket_dir / SOCKET_NAME

"""Which warm process serves a command, and whether the one running is still the right one.

A warm process is one per *slot*: an interpreter (the file of one environment's ``bin``) and the modules it
preloads. Its socket, lock and log live in the private directory ``<socket dir>/warm/`` (0700, whatever the keeper's
directory is shared with), named by the slot's digest.

Its *key* says what it imported and how it runs: the slot, the Python version, ``sys.path`` (so ``PYTHONPATH``
too), ``PYTHONHASHSEED``, the variables preloaded packages read at import (:data:`IMPORT_TIME_VARIABLES`), the
interpreter's settings (``-B``, ``-O``, ``-X``, ``-W``, from options or variables),
and the size and modification time of each preloaded package's ``__init__`` and of weightcache's own warm
modules. An upgrade or a reinstall of any of them changes the key, so a launcher that finds a warm process of its
slot with another key stops it and starts a new one: a child never runs code older than what a direct start would
import.

Layer L2: standard library only; nothing here imports a preloaded module.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import sys
from collections.abc import Sequence
from pathlib import Path

from ..rundir import ensure_private_dir, resolve_socket_dir
from .target import interpreter_flags

#: The subdirectory of the socket directory that holds the warm processes' sockets, locks and logs.
WARM_DIR_NAME = "warm"
#: Environment variables that a preloaded package reads while it is imported, not when it is used, so that a fork
#: would keep the warm process's value whatever the command's environment says: vLLM before 0.32 configures its
#: logging when ``vllm`` is imported (from these variables; 0.32 configures it on demand), and torch reads its
#: logging variables when imported. A warm process's key holds their values, so a command whose environment sets
#: other values gets a warm process of its own, started with them.
IMPORT_TIME_VARIABLES = (
    "TORCH_LOGS",
    "TORCH_LOGS_OUT",
    "TORCH_LOGS_FORMAT",
    "NO_COLOR",
    "VLLM_CONFIGURE_LOGGING",
    "VLLM_LOGGING_CONFIG_PATH",
    "VLLM_LOGGING_LEVEL",
    "VLLM_LOGGING_PREFIX",
    "VLLM_LOGGING_STREAM",
    "VLLM_LOGGING_COLOR",
)


def warm_dir(socket_dir: str | os.PathLike[str] | None = None) -> Path:
    """``<socket dir>/warm``, created 0700 if missing and checked private (SocketDirError otherwise)."""
    base = resolve_socket_dir(socket_dir)
    if not base.exists():
        ensure_private_dir(base)
    return ensure_private_dir(base / WARM_DIR_NAME, socket_name=f"{'0' * 16}.sock")  # a slot's socket


def slot(executable: str, preloads: Sequence[str]) -> str:
    """The digest naming the warm process of this interpreter and these preloads (16 hex digits). The interpreter
    is its environment's ``bin`` directory and the file it names there: ``python``, ``python3`` and ``python3.11``
    of one venv are one slot; the base interpreter a venv links to is another (it runs with other packages)."""
    where = os.path.abspath(executable)
    text = json.dumps([[os.path.dirname(where), os.path.realpath(where)], sorted(preloads)])
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _stamp(path: str | None) -> list[object]:
    if not path:
        return [None]
    try:
        st = os.stat(path)
    except OSError:
        return [path, None]
    return [path, st.st_size, st.st_mtime_ns]


def _origin(package: str) -> str | None:
    try:
        spec = importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None
    return spec.origin if spec is not None else None


def key(executable: str, preloads: Sequence[str], path: Sequence[str]) -> str:
    """The key of a warm process of this slot with ``path`` as its ``sys.path`` (less the entry Python puts
    first for the program it was started with): see the module docstring."""
    packages = sorted({spec.split(":")[0].split(".")[0] for spec in preloads})
    here = Path(__file__).parent
    text = json.dumps(
        {
            "slot": slot(executable, preloads),
            "python": sys.version,
            "path": list(path),
            "hashseed": os.environ.get("PYTHONHASHSEED"),
            "import_time": {name: os.environ.get(name) for name in IMPORT_TIME_VARIABLES},
            "flags": interpreter_flags(),  # -B, -O, -X, -W: what an interpreter started here would run with
            "packages": {p: _stamp(_origin(p)) for p in packages},
            "warm": [_stamp(str(here / name)) for name in ("server.py", "child.py", "target.py", "identity.py")],
        }
    )
    return hashlib.sha256(text.encode()).hexdigest()


def base_path() -> list[str]:
    """This process's ``sys.path`` without its first entry (the script's directory, or the working directory for
    ``-m``): what a warm process and a launcher of the same environment share."""
    return list(sys.path[1:])


__all__ = ["IMPORT_TIME_VARIABLES", "WARM_DIR_NAME", "base_path", "key", "slot", "warm_dir"]

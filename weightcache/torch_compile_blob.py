"""The blob of a torch.compile artifact: torch's portable cache bundle and the C++ kernels inductor built, in one
byte string, and the kernels' place under the local inductor cache directory.

A blob (:func:`pack`) is :data:`MAGIC`, a JSON header (the bundle's size, each kernel's path and size, the keys of
torch's cache entries the bundle holds, the generation), then the bytes. :func:`unpack` and :func:`blob_info`
refuse anything else with a ValueError that names what is wrong, before a byte is written: a kernel path outside
inductor's layout (:data:`KERNEL_PATH`), a kernel that is no shared library of this machine, sizes that do not
add up. :func:`loaded_kernels` finds the kernels this process loaded (and the ISA probes inductor built), and
:func:`restore_kernels` writes a blob's kernels where torch looks for them, never over a file that is there.

Layer L3 (the torch side). Never loads anything into torch and never talks to the keeper: that is
:mod:`weightcache.torch_compile`'s, which re-exports these names.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import struct
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from .artifacts import write_whole

#: The first bytes of a blob :func:`pack` makes: torch's bundle, then the C++ kernels inductor built.
MAGIC = b"WCTC\x01"
_HEADER = struct.Struct("!5sI")
#: Largest JSON header of a blob (the list of kernels).
MAX_HEADER_BYTES = 1 << 20
#: What a kernel's path under the inductor cache directory looks like (``<2 chars>/<hash>[.main].so``): anything
#: else in a blob is refused, so that a blob can only ever write kernels where torch itself looks for them.
KERNEL_PATH = re.compile(r"[a-z0-9_]{2}/[a-z0-9_]{8,128}(\.main)?\.so")


def inductor_cache_dir() -> Path:
    """Where inductor keeps its local caches (``TORCHINDUCTOR_CACHE_DIR``, else its default)."""
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


def loaded_kernels(cache_dir: Path | None = None, since: float | None = None) -> dict[str, Path]:
    """The C++ kernels of the inductor cache directory that this process has loaded (from ``/proc/self/maps``),
    and, with ``since``, every kernel written there since that time (``time.time()``): relative path -> file.

    The second kind matters: inductor checks which vector ISA the host supports by building a small library per
    ISA and loading it in a subprocess, so it never shows in this process's maps, and without those a process with
    an empty cache directory spent ~16 s of its ~38 s start in ``g++`` on the dev VM."""
    root = (cache_dir or inductor_cache_dir()).resolve()
    found: dict[str, Path] = {}
    if since is not None:
        for file in root.glob("??/*.so"):
            relative = f"{file.parent.name}/{file.name}"
            with contextlib.suppress(OSError):
                stat = file.stat()  # another user's file in a shared cache directory never joins this user's blob
                if KERNEL_PATH.fullmatch(relative) and stat.st_mtime >= since and stat.st_uid == os.getuid():
                    found[relative] = file
    try:
        with open("/proc/self/maps") as f:
            for line in f:
                path = line.rstrip("\n").split(maxsplit=5)[-1]
                if not path.endswith(".so") or not path.startswith(str(root) + "/"):
                    continue
                relative = path[len(str(root)) + 1 :]
                if KERNEL_PATH.fullmatch(relative):
                    found[relative] = Path(path)
    except OSError:
        pass
    return dict(sorted(found.items()))


def pack(
    bundle: bytes,
    kernels: Mapping[str, bytes],
    *,
    entries: Mapping[str, list[str]] | None = None,
    generation: int = 0,
) -> bytes:
    """A blob: ``MAGIC``, a JSON header (the bundle's size, each kernel's path and size, the keys of torch's cache
    entries the bundle holds per cache (``entries``), and the ``generation``: 0 for a blob a process published
    after compiling with nothing loaded, n + 1 for one published after loading a blob of generation n), then the
    bytes."""
    header = json.dumps(
        {
            "bundle": len(bundle),
            "kernels": [[path, len(data)] for path, data in kernels.items()],
            "entries": {kind: sorted(keys) for kind, keys in (entries or {}).items()},
            "generation": generation,
        }
    )
    head = header.encode()
    return b"".join([_HEADER.pack(MAGIC, len(head)), head, bundle, *kernels.values()])


@attrs.frozen
class BlobInfo:
    """What a blob's header says besides its parts (:func:`blob_info`).

    Attributes:
        entries: the keys of torch's cache entries its bundle holds, per cache (``{"inductor": [...], ...}``).
        kernels: the paths of the C++ kernels it carries.
        generation: 0 for a blob published by a process that loaded none; n + 1 for one published by a process
            that loaded a blob of generation n and still compiled.
    """

    entries: dict[str, frozenset[str]]
    kernels: frozenset[str]
    generation: int


def blob_info(blob: bytes) -> BlobInfo:
    """The header of a blob :func:`pack` made (:class:`BlobInfo`); ValueError for anything else (see
    :func:`unpack`). A blob of an earlier release, without entries or generation, reads as generation 0 with none."""
    header, _ = _header(blob)
    entries = header.get("entries", {})
    generation = header.get("generation", 0)
    if not isinstance(entries, dict) or not isinstance(generation, int) or generation < 0:
        raise ValueError("the artifact's header has malformed entries or generation")
    return BlobInfo(
        entries={str(kind): frozenset(map(str, keys)) for kind, keys in entries.items() if isinstance(keys, list)},
        kernels=frozenset(str(item[0]) for item in header.get("kernels", []) if isinstance(item, list) and item),
        generation=generation,
    )


def _header(blob: bytes) -> tuple[dict[str, Any], int]:
    if len(blob) < _HEADER.size:
        raise ValueError(f"a torch.compile artifact starts with a {_HEADER.size}-byte header; this one has {len(blob)}")
    magic, length = _HEADER.unpack_from(blob)
    if magic != MAGIC:
        raise ValueError(f"a torch.compile artifact starts with {MAGIC!r}; this one with {magic!r}")
    if length > MAX_HEADER_BYTES or _HEADER.size + length > len(blob):
        raise ValueError(f"the artifact's header claims {length} bytes; it has {len(blob) - _HEADER.size}")
    header = json.loads(blob[_HEADER.size : _HEADER.size + length])
    if not isinstance(header, dict) or not isinstance(header.get("bundle"), int):
        raise ValueError("the artifact's header lacks the bundle's size")
    return header, _HEADER.size + length


def _is_shared_library(data: bytes) -> bool:
    """Whether ``data`` starts as a 64-bit ELF shared object of this byte order (what inductor's C++ kernels are):
    garbage in a kernel's place is refused before it is written, rather than failing torch's compile later."""
    if len(data) < 64 or data[:4] != b"\x7fELF" or data[4] != 2:  # ELFCLASS64
        return False
    order = "<" if data[5] == 1 else ">"
    (e_type,) = struct.unpack_from(order + "H", data, 16)
    return bool(e_type == 3 and order == ("<" if sys.byteorder == "little" else ">"))  # ET_DYN


def unpack(blob: bytes) -> tuple[bytes, dict[str, bytes]]:
    """torch's bundle and the kernels of a blob :func:`pack` made; ValueError naming what is wrong otherwise (a
    kernel that is not a shared library among them)."""
    header, offset = _header(blob)
    bundle_size = header["bundle"]
    bundle = blob[offset : offset + bundle_size]
    offset += bundle_size
    kernels: dict[str, bytes] = {}
    listed = header.get("kernels", [])
    if not isinstance(listed, list):
        raise ValueError("the artifact's header must list its kernels")
    for item in listed:
        if not (isinstance(item, list) and len(item) == 2 and isinstance(item[0], str) and isinstance(item[1], int)):
            raise ValueError(f"a kernel of the artifact's header must be [path, size]; found {item!r:.100}")
        path, size = item
        if not KERNEL_PATH.fullmatch(path) or size < 0:
            raise ValueError(f"the artifact names a kernel {path!r:.100}, which is no inductor kernel path")
        kernels[path] = blob[offset : offset + size]
        offset += size
    if offset != len(blob) or len(bundle) != bundle_size:
        raise ValueError(f"the artifact's header accounts for {offset} bytes; it has {len(blob)}")
    for path, data in kernels.items():
        if not _is_shared_library(data):
            raise ValueError(
                f"the artifact's kernel {path} is no shared library of this machine ({len(data)} bytes starting "
                f"{data[:8]!r}); it was damaged before it was published"
            )
    return bundle, kernels


def restore_kernels(kernels: Mapping[str, bytes], cache_dir: Path | None = None) -> int:
    """Write each kernel at its path under the inductor cache directory unless a file is there; how many were
    written. Each file appears whole (written aside, then renamed)."""
    root = cache_dir or inductor_cache_dir()
    return sum(write_whole(root / relative, data, 0o755, within=root) for relative, data in kernels.items())


__all__ = [
    "KERNEL_PATH",
    "MAGIC",
    "MAX_HEADER_BYTES",
    "BlobInfo",
    "blob_info",
    "inductor_cache_dir",
    "loaded_kernels",
    "pack",
    "restore_kernels",
    "unpack",
]

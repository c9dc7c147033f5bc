"""Safetensors checkpoints: which files make one up, their headers, their identity and the model's config.

The identity (:func:`checkpoint_files`) reads only file metadata and the safetensors headers, never tensor
data, so computing a fingerprint costs milliseconds even for a terabyte checkpoint. A file rewritten in place
with the same shapes but other values still changes identity: its ctime (which no user call can set back)
and, usually, its mtime and inode change with it.

Layer L1: never reads tensor data and never imports torch or safetensors (loading is :mod:`weightcache.loader`'s).
"""

from __future__ import annotations

import hashlib
import json
import os
import struct
from pathlib import Path
from typing import Any

import attrs

from .errors import CheckpointError

#: safetensors itself refuses headers above 100 MB; so do we, before allocating anything.
MAX_HEADER_BYTES = 100 * 1024 * 1024
INDEX_SUFFIX = ".safetensors.index.json"


@attrs.frozen
class CheckpointFile:
    """Identity of one safetensors file: enough to notice any rewrite without reading tensor data."""

    name: str
    size: int
    mtime_ns: int
    ctime_ns: int
    inode: int
    header_sha256: str

    def to_json(self) -> dict[str, object]:
        return attrs.asdict(self)


def _index_file(directory: Path) -> Path | None:
    found = sorted(p for p in directory.iterdir() if p.name.endswith(INDEX_SUFFIX))
    if len(found) > 1:
        raise CheckpointError(
            f"checkpoint {directory} has {len(found)} index files ({', '.join(p.name for p in found)}); "
            "expected at most one. Remove the stale one."
        )
    return found[0] if found else None


def safetensors_files(checkpoint: str | os.PathLike[str]) -> list[Path]:
    """The safetensors files that make up ``checkpoint``, in a stable order.

    ``checkpoint`` is a directory holding one or more ``.safetensors`` files, with or without a
    ``*.safetensors.index.json`` (whose ``weight_map`` then names the files), or a single ``.safetensors`` file.
    """
    path = Path(checkpoint)
    if path.is_file():
        if path.suffix != ".safetensors":
            raise CheckpointError(
                f"{path} is not a .safetensors file; weightcache reads safetensors checkpoints (a file, or a directory "
                f"of them) only. {_CONVERT}"
            )
        return [path]
    if not path.is_dir():
        raise _missing(path, "a directory of .safetensors files")
    index = _index_file(path)
    if index is not None:
        try:
            weight_map = _parse_json(index.read_bytes(), index)["weight_map"]
            names = sorted(set(weight_map.values()))
        except CheckpointError:
            raise
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(
                f"index {index} is not a valid safetensors index (expected a JSON object with a "
                f"'weight_map' of tensor name -> file name): {exc}"
            ) from exc
        files = []
        for name in names:
            if not isinstance(name, str) or "/" in name or name.startswith("."):
                raise CheckpointError(f"index {index} names file {name!r}; expected a file name in {path}")
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"index {index} names {name}, which does not exist in {path}")
            files.append(file)
        if not files:
            raise CheckpointError(f"index {index} maps no tensor to a file; expected a 'weight_map' of tensor names")
        return files
    files = sorted(p for p in path.iterdir() if p.suffix == ".safetensors" and p.is_file())
    if not files:
        names = sorted(p.name for p in path.iterdir())
        pickled = any(n.endswith((".bin", ".pt", ".pth")) for n in names)
        raise CheckpointError(
            f"checkpoint directory {path} holds no .safetensors files ({_found(names)}); pass a directory of "
            ".safetensors files" + (f". {_CONVERT}" if pickled else "")
        )
    return files


#: What a transformers model is built and loaded from (:func:`model_config_file`).
_SAVE_PRETRAINED = "the directory that model.save_pretrained() wrote (config.json beside the .safetensors files)"


def model_config_file(checkpoint: str | os.PathLike[str]) -> Path:
    """The ``config.json`` of ``checkpoint``, a Hugging Face ``save_pretrained`` directory, which a transformers
    model is built from (:func:`weightcache.backends.transformers.build_on_meta`). Raises :class:`CheckpointError`
    where the checkpoint does not exist (in the words :func:`safetensors_files` uses), is not a directory, or holds
    no ``config.json``, saying what it found and what to pass instead. Reads nothing but the directory's listing."""
    path = Path(checkpoint)
    if not path.exists():
        raise _missing(path, _SAVE_PRETRAINED)
    if not path.is_dir():
        raise CheckpointError(
            f"checkpoint {path} is a file, not a directory; a transformers model is built from the config.json of "
            f"its checkpoint directory: pass {_SAVE_PRETRAINED}"
        )
    config = path / "config.json"
    if not config.is_file():
        names = sorted(p.name for p in path.iterdir())
        raise CheckpointError(
            f"checkpoint directory {path} has no config.json ({_found(names)}), which a transformers model is built "
            f"from: pass {_SAVE_PRETRAINED}; the checkpoint of a plain module (no config.json) loads as one "
            "(`weightcache load` without --engine transformers, `weightcache.preload`)"
        )
    return config


def _missing(path: Path, expected: str) -> CheckpointError:
    """The error for a checkpoint path that does not exist; ``expected``: what to pass instead."""
    return CheckpointError(f"checkpoint {path} does not exist; pass {expected}")


def _found(names: list[str]) -> str:
    """What a checkpoint directory holds (its file ``names``), for an error that says what it lacks."""
    return f"found {_listing(names)}" if names else "it is empty"


#: How to turn a pickled PyTorch checkpoint into safetensors, once (weightcache never unpickles).
_CONVERT = (
    'To convert a PyTorch .bin/.pt checkpoint once: `python -c "import torch; from safetensors.torch import '
    "save_file; save_file(torch.load('pytorch_model.bin', weights_only=True), 'model.safetensors')\"` (a model "
    "with tied weights: load it with transformers and `model.save_pretrained(OUT_DIR)`, which writes safetensors)"
)


def _listing(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" and {len(names) - limit} more" if len(names) > limit else "")


def read_header(file: Path) -> tuple[bytes, dict[str, object]]:
    """Raw bytes and parsed JSON of a safetensors header, with its length and every tensor's data offsets
    checked against the file."""
    raw = _raw_header(file)
    size = os.stat(file).st_size
    length = len(raw)
    header = _parse_json(raw, file, "safetensors header")
    if not isinstance(header, dict):
        raise CheckpointError(f"{file} has a corrupt safetensors header: it is not a JSON object")
    data_bytes = size - 8 - length
    for name, info in header.items():
        if name == "__metadata__":
            continue
        offsets = info.get("data_offsets") if isinstance(info, dict) else None
        if (
            not isinstance(offsets, list)
            or len(offsets) != 2
            or not all(isinstance(o, int) for o in offsets)
            or not 0 <= offsets[0] <= offsets[1] <= data_bytes
        ):
            raise CheckpointError(
                f"{file}: tensor {name!r} has data_offsets {offsets!r} outside the {data_bytes} data bytes "
                "(the file is truncated or corrupt); re-download or re-save the checkpoint"
            )
    return raw, header


def _raw_header(file: Path) -> bytes:
    """The header bytes, length-checked but not parsed: all that identity needs (parsing thousands of entries
    would cost milliseconds on every attach; loading parses and checks them)."""
    try:
        with open(file, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            prefix = f.read(8)
            if len(prefix) < 8:
                raise CheckpointError(f"{file} is {size} bytes, too short for a safetensors header (truncated?)")
            (length,) = struct.unpack("<Q", prefix)
            if length > MAX_HEADER_BYTES or 8 + length > size:
                raise CheckpointError(
                    f"{file} declares a {length}-byte header in a {size}-byte file; expected at most "
                    f"{min(MAX_HEADER_BYTES, size - 8)} (the file is truncated or not safetensors)"
                )
            return f.read(length)
    except OSError as exc:
        raise CheckpointError(f"cannot read checkpoint file {file}: {exc}") from exc


def file_identity(file: Path) -> CheckpointFile:
    raw = _raw_header(file)
    st = os.stat(file)
    return CheckpointFile(
        name=file.name,
        size=st.st_size,
        mtime_ns=st.st_mtime_ns,
        ctime_ns=st.st_ctime_ns,
        inode=st.st_ino,
        header_sha256=hashlib.sha256(raw).hexdigest(),
    )


def checkpoint_files(checkpoint: str | os.PathLike[str]) -> tuple[CheckpointFile, ...]:
    """Identity of every file of the checkpoint, without reading tensor data."""
    return tuple(file_identity(f) for f in safetensors_files(checkpoint))


def read_model_config(checkpoint: str | os.PathLike[str]) -> dict[str, object]:
    """``config.json`` next to the weights (Hugging Face layout), or ``{}`` when there is none."""
    path = Path(checkpoint)
    config = (path if path.is_dir() else path.parent) / "config.json"
    if not config.is_file():
        return {}
    try:
        text = config.read_bytes()
    except OSError as exc:
        raise CheckpointError(f"cannot read {config}: {exc}") from exc
    data = _parse_json(text, config)
    return data if isinstance(data, dict) else {}


def _parse_json(data: bytes, file: Path, what: str = "JSON file") -> Any:
    """``data`` (read from ``file``) parsed as JSON; anything malformed, nested too deeply for the parser (a
    RecursionError) or too large for memory is a :class:`CheckpointError` naming the file, never another
    exception."""
    try:
        return json.loads(data)
    except (ValueError, RecursionError, MemoryError) as exc:  # UnicodeDecodeError is a ValueError
        detail = "nested too deeply" if isinstance(exc, RecursionError) else str(exc) or type(exc).__name__
        raise CheckpointError(
            f"{file} is not a valid {what} ({detail[:200]}); the checkpoint is corrupt or not a Hugging Face "
            "safetensors checkpoint: re-download or re-save it"
        ) from None


def drop_page_cache(checkpoint: str | os.PathLike[str], *, system: bool = False) -> str:
    """Evict the checkpoint's files from the page cache, so that the next load really reads the disk.

    Per file with ``posix_fadvise(DONTNEED)`` (any user; clean pages only, hence the fsync). With ``system``,
    also the machine's whole page cache through ``/proc/sys/vm/drop_caches`` when running as root: a cold start
    after a reboot, libraries included (the restart benchmark does this); it affects every process on the
    machine. Returns which methods were used.
    """
    for f in safetensors_files(checkpoint):
        fd = os.open(f, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)
    if not system:
        return "fadvise"
    try:
        os.sync()
        with open("/proc/sys/vm/drop_caches", "w") as knob:
            knob.write("1\n")
        return "fadvise+drop_caches"
    except OSError:
        return "fadvise"


def qualified_name(fn: object) -> str:
    """``module.qualname`` of a callable: what the fingerprint records for a transform."""
    module = getattr(fn, "__module__", None) or "?"
    name = getattr(fn, "__qualname__", None) or type(fn).__qualname__
    return f"{module}.{name}"

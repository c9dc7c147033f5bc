"""The fingerprint: everything that decides whether cached weights are exactly the weights an engine wants.

A fingerprint is a frozen value. Its :attr:`~Fingerprint.digest` (SHA-256 of the canonical JSON of the identity
fields) keys entries in the keeper. ``placement`` (``"cpu"`` or a GPU UUID) says where the segments live; it
selects the copy but is not part of the identity, so the same model on two GPUs has one digest.

Layer L1: never imports torch, not even inside a function (the keeper and the CLI read fingerprints;
tests/test_layers.py checks). What a fingerprint records about torch (its version, a CUDA device's UUID and
compute capability) comes from the torch the calling process has imported: a caller naming a CUDA device holds it.
"""

from __future__ import annotations

import functools
import hashlib
import inspect
import json
import operator
import os
import re
import sys
import types
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import attrs

from . import quant as quant_registry
from .checkpoint import CheckpointFile, checkpoint_files, qualified_name, read_model_config
from .dtypes import dtype_name
from .errors import InvalidArgument, InvalidArgumentType, ManifestError, WeightCacheError

#: Bumped whenever the layout of cached data or the meaning of a field changes: old entries stop matching.
FORMAT_VERSION = 1

# Bounds on what a fingerprint read off the wire may hold. Another user of a shared keeper writes the fingerprints
# of its entries, and they reach every client that lists them or explains a miss with them: each field is
# bounded here (the keeper refuses a publish beyond them), so no fingerprint can flood or crash its reader.
#: Longest string field (paths, names, versions, hashes, file names), in characters; not ``extra``.
MAX_FIELD_CHARS = 4096
#: Longest ``extra``, in characters (an engine's whole model config fits many times over).
MAX_EXTRA_CHARS = 256 * 1024
#: Deepest nesting of the JSON in ``extra`` (model configs nest a few levels).
MAX_EXTRA_DEPTH = 64
#: Most checkpoint files, and most parallel axes, a fingerprint may name.
MAX_CHECKPOINT_FILES = 16384
MAX_PARALLEL_AXES = 16
#: Longest name of a parallel axis.
MAX_AXIS_NAME = 64
#: Largest fingerprint, as canonical JSON (what a ``list`` reply carries per entry), in bytes.
MAX_FINGERPRINT_BYTES = 1024 * 1024
#: How much of one value :func:`format_differences` shows, in characters.
MAX_SHOWN_CHARS = 120

ParallelLayout = tuple[tuple[str, int, int], ...]


def canonical_json(value: object) -> str:
    """JSON with sorted keys and no whitespace: equal values give equal bytes."""
    return json.dumps(value, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=False)


def config_hash(config: Mapping[str, Any] | None) -> str | None:
    """SHA-256 of the canonical JSON of a (quantization) config, or None when there is none."""
    if config is None:
        return None
    try:
        text = canonical_json(dict(config))
    except (TypeError, ValueError) as exc:
        raise InvalidArgumentType(
            f"config must be JSON-serialisable (str keys, plain values); found {config!r}"
        ) from exc
    return hashlib.sha256(text.encode()).hexdigest()


def normalise_parallel(parallel: Mapping[str, tuple[int, int] | list[int]] | None) -> ParallelLayout:
    """``{"tp": (rank, size), ...}`` -> a sorted tuple ``(("tp", rank, size), ...)``, validated."""
    if not parallel:
        return ()
    if len(parallel) > MAX_PARALLEL_AXES:
        raise InvalidArgument(f"parallel has {len(parallel)} axes; at most {MAX_PARALLEL_AXES} are allowed")
    out = []
    for axis, value in parallel.items():
        if not isinstance(axis, str) or not 0 < len(axis) <= MAX_AXIS_NAME:
            raise InvalidArgument(f"a parallel axis must be a name of 1-{MAX_AXIS_NAME} characters; found {axis!r:.80}")
        try:
            rank, size = value
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(f"parallel[{axis!r}] must be (rank, size); found {value!r}") from exc
        try:  # integers of any type (numpy's, a 0-d integer tensor), never a float, a string or a bool
            if isinstance(rank, bool) or isinstance(size, bool):
                raise TypeError("a bool")
            rank, size = operator.index(rank), operator.index(size)
        except TypeError as exc:
            raise InvalidArgument(f"parallel[{axis!r}] must be (rank, size) of integers; found {value!r}") from exc
        if size < 1 or not 0 <= rank < size:
            raise InvalidArgument(f"parallel[{axis!r}] = ({rank}, {size}): expected 0 <= rank < size")
        out.append((str(axis), rank, size))
    return tuple(sorted(out))


def transform_identity(transform: Callable[..., Any] | str) -> str:
    """What the fingerprint records for a transform: its qualified name plus a hash of its code, so that
    editing the function's body changes the fingerprint.

    A transform may state its identity itself with a ``weightcache_id`` string attribute (do that for callable
    objects, bound methods and closures, whose captured state no name reveals). ``functools.partial`` records
    its function and its (JSON-serialisable) arguments. Lambdas are refused: two lambdas in one module share
    a name.
    """
    if isinstance(transform, str):
        return transform
    explicit = getattr(transform, "weightcache_id", None)
    if isinstance(explicit, str) and explicit:
        return explicit
    if isinstance(transform, functools.partial):
        try:
            arguments = canonical_json({"args": list(transform.args), "keywords": dict(transform.keywords)})
        except (TypeError, ValueError) as exc:
            raise InvalidArgument(
                f"transform {transform!r} binds arguments that are not JSON-serialisable; set its weightcache_id "
                "attribute to a string that names what it does"
            ) from exc
        return f"{transform_identity(transform.func)}({arguments})"
    name = qualified_name(transform)
    hint = "define a module-level function, or set transform.weightcache_id = 'name-v1'"
    if "<lambda>" in name:
        raise InvalidArgument(f"transform {name} is a lambda, which has no stable identity; {hint}")
    if inspect.ismethod(transform) or getattr(transform, "__closure__", None):
        raise InvalidArgument(
            f"transform {name} carries state (a bound method or closure) that no name reveals; {hint}"
        )
    code = getattr(transform, "__code__", None)
    if code is None:
        raise InvalidArgument(f"transform {name} is a callable object whose state no name reveals; {hint}")
    return f"{name}#{_code_hash(code)[:16]}"


def _code_hash(code: types.CodeType) -> str:
    h = hashlib.sha256(code.co_code)
    h.update(repr(code.co_names).encode())
    for const in code.co_consts:
        h.update(_code_hash(const).encode() if isinstance(const, types.CodeType) else repr(const).encode())
    return h.hexdigest()


def _device_markers(device: object) -> tuple[str, str, str | None]:
    """(device kind, placement, compute capability) for a device spec; InvalidArgument for a device that is no
    device, or a CUDA device this process cannot use (a CPU build of torch, an index past its last GPU)."""
    text = "cpu" if device is None else str(device)
    if text == "cpu":
        return "cpu", "cpu", None
    if text == "cuda" or text.startswith("cuda:"):
        torch: Any = sys.modules.get("torch")  # a CUDA device is torch's: its caller has imported torch
        if torch is None:
            raise InvalidArgument(f"device {text!r} is a torch CUDA device: import torch before fingerprinting for it")
        try:
            dev = torch.device(text)
        except RuntimeError:
            raise InvalidArgument(_not_a_device(text)) from None
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            build = "has no CUDA" if torch.version.cuda is None else "sees no GPU"
            raise InvalidArgument(
                f"device {text!r} needs a CUDA build of PyTorch and a visible NVIDIA GPU; this torch "
                f"({torch.__version__}) {build}. Use device 'cpu', or install a CUDA build of torch "
                "(`weightcache doctor` checks the GPU set-up)"
            )
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= count:
            raise InvalidArgument(
                f"device {text!r} does not exist: this process sees {count} GPU(s), cuda:0 to cuda:{count - 1} "
                "(CUDA_VISIBLE_DEVICES decides which). Use one of those, or device 'cpu'"
            )
        props = torch.cuda.get_device_properties(index)
        return "cuda", f"GPU-{props.uuid}", f"{props.major}.{props.minor}"
    raise InvalidArgument(_not_a_device(text))


def placement_of(device: object) -> str:
    """Where weights for ``device`` live: ``"cpu"`` or ``"GPU-<uuid>"``; InvalidArgument for a device that is no
    device or that this process cannot use (what :meth:`Fingerprint.create` checks)."""
    return _device_markers(device)[1]


def _not_a_device(text: str) -> str:
    return f"device {text!r} is not a device weightcache can place weights on: expected 'cpu' or 'cuda:N' (e.g. cuda:0)"


def torch_version() -> str:
    """The version of torch in this process: ``torch.__version__`` once torch is imported, else the version
    its installed distribution declares (the same string), read without importing torch."""
    torch: Any = sys.modules.get("torch")
    if torch is not None:
        return str(torch.__version__)
    return _installed_torch_version()


@functools.cache
def _installed_torch_version() -> str:
    import importlib.metadata  # lazy: ~20 ms to import, needed only in a process that has not imported torch

    try:
        return importlib.metadata.version("torch")
    except importlib.metadata.PackageNotFoundError:
        raise WeightCacheError(
            "a fingerprint records the torch version that produces the weights; torch is not installed"
        ) from None


@attrs.frozen
class Fingerprint:
    """Identity of a set of post-processed weights. Build it with :meth:`create`."""

    #: Absolute path of the checkpoint.
    model_path: str
    #: ``architectures[0]`` from config.json, when present.
    architecture: str | None
    #: Revision (e.g. a git commit of the hub repository), when known.
    revision: str | None
    #: Identity of every safetensors file (name, size, mtime, ctime, inode, header hash).
    checkpoint: tuple[CheckpointFile, ...]
    #: ``(("tp", rank, size), ...)``, sorted by axis name.
    parallel: ParallelLayout
    #: Quantization method name (see :mod:`weightcache.quant`).
    quant: str
    #: SHA-256 of the canonical JSON of the quantization config, or None.
    quant_config_hash: str | None
    #: dtype the floating point weights were converted to, or None when kept as stored.
    dtype: str | None
    #: Identity of the transform applied before publishing (its qualified name and a hash of its code, or its
    #: ``weightcache_id``; see :func:`transform_identity`), or None.
    transform: str | None
    #: Engine that produced the weights (``"torch"`` for plain nn.Module) and its version.
    engine: str
    engine_version: str
    #: Environment markers: device kind (``"cpu"``/``"cuda"``), compute capability, torch and format version.
    device_kind: str
    compute_capability: str | None
    torch_version: str
    format_version: int
    #: Free-form identity fields supplied by the caller or an engine adapter (canonical JSON).
    extra: str
    #: Where the weights live: ``"cpu"`` or ``"GPU-<uuid>"``. Not part of :attr:`digest`.
    placement: str = attrs.field(default="cpu", eq=False)

    @classmethod
    def create(
        cls,
        checkpoint: str | os.PathLike[str],
        *,
        dtype: object = None,
        quant: str = "none",
        quant_config: Mapping[str, Any] | None = None,
        parallel: Mapping[str, tuple[int, int] | list[int]] | None = None,
        transform: Callable[..., Any] | str | None = None,
        device: object = None,
        extra: Mapping[str, Any] | None = None,
        engine: str = "torch",
        engine_version: str | None = None,
    ) -> Fingerprint:
        """Compute the fingerprint of ``checkpoint`` as it would be loaded with these settings.

        Reads file metadata and safetensors headers only, never tensor data.

        Args:
            checkpoint: directory of ``.safetensors`` files (with or without an index), or one such file.
            dtype: dtype floating point weights are converted to (``torch.bfloat16`` or ``"bfloat16"``).
            quant: quantization method name; see :func:`weightcache.quant.get`.
            quant_config: the method's configuration; only its hash is kept.
            parallel: ``{"tp": (rank, size), "pp": (rank, size), ...}``.
            transform: the callable (or its name) applied to the state dict before publishing; see
                :func:`transform_identity` for what is recorded.
            device: ``"cpu"`` or ``"cuda:N"``; the device kind and compute capability join the identity,
                the GPU UUID becomes the placement.
            extra: further identity fields (JSON-serialisable), e.g. an engine's model config.
            engine: the name of the producer of the weights (default ``"torch"``); adapters set it.
            engine_version: the producer's version (default: torch's version); adapters set it.
        """
        # every argument first: a wrong one is the caller's first problem, before anything is read
        strategy = quant_registry.get(quant)
        device_kind, placement, capability = _device_markers(device)
        transform_name = None if transform is None else transform_identity(transform)
        try:
            extra_json = canonical_json(dict(extra or {}))
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentType(f"extra must be JSON-serialisable; found {extra!r}") from exc
        layout, quant_hash, dtype_text = normalise_parallel(parallel), config_hash(quant_config), dtype_name(dtype)
        path = Path(checkpoint).resolve()
        files = checkpoint_files(path)
        config = read_model_config(path)
        archs = config.get("architectures")
        architecture = archs[0] if isinstance(archs, list) and archs and isinstance(archs[0], str) else None
        revision = config.get("_commit_hash")
        version = torch_version()
        return cls(
            model_path=str(path),
            architecture=architecture,
            revision=revision if isinstance(revision, str) else None,
            checkpoint=files,
            parallel=layout,
            quant=strategy.name,
            quant_config_hash=quant_hash,
            dtype=dtype_text,
            transform=transform_name,
            engine=engine,
            engine_version=engine_version if engine_version is not None else version,
            device_kind=device_kind,
            compute_capability=capability,
            torch_version=version,
            format_version=FORMAT_VERSION,
            extra=extra_json,
            placement=placement,
        )

    def with_extra(self, **fields: Any) -> Fingerprint:
        """This fingerprint with ``fields`` added to :attr:`extra` (e.g. ``structure=...``, known only once a
        model is built). Raises ValueError for a field ``extra`` already holds with another value: an identity
        is extended, never rewritten."""
        extra = json.loads(self.extra)
        try:  # compared as the digest sees them: 1, 1.0 and true are three values
            clashes = sorted(
                k for k, v in fields.items() if k in extra and canonical_json(extra[k]) != canonical_json(v)
            )
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentType(f"extra must be JSON-serialisable; found {fields!r}") from exc
        if clashes:
            raise InvalidArgument(
                f"the fingerprint's extra already holds {', '.join(clashes)} with another value; extend it with "
                "keys it does not hold (the key structure is the engine adapters' own)"
            )
        try:
            extra_json = canonical_json({**extra, **fields})
        except (TypeError, ValueError) as exc:
            raise InvalidArgumentType(f"extra must be JSON-serialisable; found {fields!r}") from exc
        return attrs.evolve(self, extra=extra_json)

    # --- serialisation ----------------------------------------------------------------------------------

    def identity(self) -> dict[str, Any]:
        """The identity fields as plain JSON values (everything but ``placement``)."""
        out = {f.name: getattr(self, f.name) for f in attrs.fields(Fingerprint) if f.name != "placement"}
        out["checkpoint"] = [c.to_json() for c in self.checkpoint]
        out["parallel"] = [list(p) for p in self.parallel]
        return out

    def canonical_json(self) -> str:
        """Canonical JSON of the identity: what :attr:`digest` hashes."""
        return canonical_json(self.identity())

    @property
    def digest(self) -> str:
        """SHA-256 (hex) of :meth:`canonical_json`: the key of this entry in the keeper."""
        return hashlib.sha256(self.canonical_json().encode()).hexdigest()

    def to_json(self) -> dict[str, Any]:
        """Identity plus placement, as sent on the wire and stored in manifests."""
        return {**self.identity(), "placement": self.placement}

    @classmethod
    def from_json(cls, data: object) -> Fingerprint:
        """Parse :meth:`to_json` output, checking every field's type (the data may come from a socket)."""
        if not isinstance(data, dict):
            raise ManifestError(f"fingerprint must be a JSON object; found {type(data).__name__}")
        files_json, parallel_json = _typed(data, "checkpoint", list), _typed(data, "parallel", list)
        if len(files_json) > MAX_CHECKPOINT_FILES or len(parallel_json) > MAX_PARALLEL_AXES:
            raise ManifestError(
                f"fingerprint names {len(files_json)} checkpoint files and {len(parallel_json)} parallel axes; at "
                f"most {MAX_CHECKPOINT_FILES} and {MAX_PARALLEL_AXES} are allowed"
            )
        try:
            files = tuple(
                CheckpointFile(
                    name=_typed(c, "name", str),
                    size=_typed(c, "size", int),
                    mtime_ns=_typed(c, "mtime_ns", int),
                    ctime_ns=_typed(c, "ctime_ns", int),
                    inode=_typed(c, "inode", int),
                    header_sha256=_typed(c, "header_sha256", str),
                )
                for c in files_json
            )
            parallel = []
            for p in parallel_json:
                if not (isinstance(p, list) and len(p) == 3 and isinstance(p[0], str) and len(p[0]) <= MAX_AXIS_NAME):
                    raise ManifestError(f"fingerprint parallel entry must be [axis, rank, size]; found {p!r:.100}")
                parallel.append((p[0], _int(p[1]), _int(p[2])))
            fp = cls(
                model_path=_typed(data, "model_path", str),
                architecture=_typed(data, "architecture", str, optional=True),
                revision=_typed(data, "revision", str, optional=True),
                checkpoint=files,
                parallel=tuple(parallel),
                quant=_typed(data, "quant", str),
                quant_config_hash=_typed(data, "quant_config_hash", str, optional=True),
                dtype=_typed(data, "dtype", str, optional=True),
                transform=_typed(data, "transform", str, optional=True),
                engine=_typed(data, "engine", str),
                engine_version=_typed(data, "engine_version", str),
                device_kind=_typed(data, "device_kind", str),
                compute_capability=_typed(data, "compute_capability", str, optional=True),
                torch_version=_typed(data, "torch_version", str),
                format_version=_typed(data, "format_version", int),
                extra=_typed(data, "extra", str, limit=MAX_EXTRA_CHARS),
                placement=_typed(data, "placement", str),
            )
        except AttributeError as exc:  # a checkpoint entry that is not an object
            raise ManifestError(f"malformed fingerprint: {exc}") from exc
        return fp

    # --- comparison -------------------------------------------------------------------------------------

    def diff(self, other: Fingerprint) -> list[tuple[str, object, object]]:
        """``(field, self's value, other's value)`` for every identity field that differs.

        The checkpoint is compared per file, so a rewritten shard is named, e.g.
        ``("checkpoint[model-00002-of-00004.safetensors].mtime_ns", 1700..., 1712...)``, and ``extra`` per
        key, e.g. ``("extra.structure", "9f2c...", "41ab...")`` or
        ``("extra.transformers.config.rope_parameters.rope_theta", 10000.0, 500000.0)``.
        """
        out: list[tuple[str, object, object]] = []
        for f in attrs.fields(Fingerprint):
            if f.name in ("placement", "checkpoint"):
                continue
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if mine != theirs and f.name == "extra":
                try:
                    if json_depth(mine) > MAX_EXTRA_DEPTH or json_depth(theirs) > MAX_EXTRA_DEPTH:
                        raise ValueError("nested too deeply")  # json.loads would raise RecursionError
                    _diff_json("extra", json.loads(mine), json.loads(theirs), out)
                except ValueError:  # a peer's extra that is no JSON, or too deep: named whole
                    out.append((f.name, mine, theirs))
            elif mine != theirs:
                out.append((f.name, mine, theirs))
        mine_files = {c.name: c for c in self.checkpoint}
        their_files = {c.name: c for c in other.checkpoint}
        for name in sorted(mine_files.keys() | their_files.keys()):
            a, b = mine_files.get(name), their_files.get(name)
            if a is None or b is None:
                out.append((f"checkpoint[{name}]", "present" if a else "absent", "present" if b else "absent"))
                continue
            for field in attrs.fields(CheckpointFile):
                va, vb = getattr(a, field.name), getattr(b, field.name)
                if va != vb:
                    out.append((f"checkpoint[{name}].{field.name}", va, vb))
        return out

    def check_bounds(self) -> None:
        """Raise :class:`ManifestError` unless ``extra`` is JSON nested at most :data:`MAX_EXTRA_DEPTH` deep and the
        whole fingerprint encodes to at most :data:`MAX_FINGERPRINT_BYTES`.

        :meth:`from_json` bounds every field's size; this is the rest of what the keeper checks before it stores a
        fingerprint that other users' engines will read (they parse ``extra`` to explain a miss).
        """
        depth = json_depth(self.extra)
        if depth > MAX_EXTRA_DEPTH:
            raise ManifestError(
                f"fingerprint field 'extra' is JSON nested {depth} levels deep; at most {MAX_EXTRA_DEPTH} are "
                "allowed (model configs nest a few levels)"
            )
        size = len(self.canonical_json())
        if size > MAX_FINGERPRINT_BYTES:
            raise ManifestError(
                f"the fingerprint encodes to {size} bytes; at most {MAX_FINGERPRINT_BYTES} are allowed (a fingerprint "
                "names a model, it does not carry data)"
            )

    def describe(self) -> str:
        """One line for humans: model, dtype, quant, layout and placement."""
        model = self.architecture or Path(self.model_path).name
        layout = ",".join(f"{a}{r}/{s}" for a, r, s in self.parallel) or "-"
        return (
            f"{model} ({self.model_path}) dtype={self.dtype or 'as-stored'} quant={self.quant} "
            f"parallel={layout} on {self.placement}"
        )


#: What :meth:`Fingerprint.diff` names a key of ``extra`` that one side lacks where the other holds null (a key
#: one side lacks is None there otherwise).
ABSENT = "<absent>"


def _diff_json(path: str, mine: object, theirs: object, out: list[tuple[str, object, object]]) -> None:
    """The leaves where two JSON values differ, named by their dotted path (objects are compared per key; a key
    one side lacks is None there, or :data:`ABSENT` where the other side holds null). Leaves are compared as the
    digest sees them: 1, 1.0 and true differ."""
    if isinstance(mine, dict) and isinstance(theirs, dict):
        for key in sorted(mine.keys() | theirs.keys()):
            _diff_json(f"{path}.{key}", mine.get(key, _MISSING), theirs.get(key, _MISSING), out)
    elif mine is _MISSING or theirs is _MISSING:
        if mine is not theirs:
            lacking = ABSENT if (theirs if mine is _MISSING else mine) is None else None
            out.append((path, lacking if mine is _MISSING else mine, lacking if theirs is _MISSING else theirs))
    elif canonical_json(mine) != canonical_json(theirs):
        out.append((path, mine, theirs))


_MISSING = object()  # a key one side of a diff lacks


def json_depth(text: str) -> int:
    """How deeply the JSON in ``text`` nests arrays and objects, found without parsing it (so without the
    recursion that parsing something nested 100,000 deep would take); brackets inside strings do not count."""
    depth = deepest = 0
    for token in _JSON_TOKENS.finditer(text):
        bracket = token.group()
        if bracket in "[{":
            depth += 1
            deepest = max(deepest, depth)
        elif bracket in "]}":
            depth -= 1
    return deepest


#: A JSON string (skipped whole) or one bracket.
_JSON_TOKENS = re.compile(r'"(?:[^"\\]|\\.)*"|[\[\]{}]')


def _shown(value: object) -> str:
    """``repr(value)``, cut to :data:`MAX_SHOWN_CHARS` characters: a value in a message is a hint, not data."""
    if isinstance(value, str) and len(value) > MAX_SHOWN_CHARS:
        return f"{value[:MAX_SHOWN_CHARS]!r}... ({len(value)} characters)"
    text = repr(value)
    return text if len(text) <= MAX_SHOWN_CHARS else f"{text[:MAX_SHOWN_CHARS]}... ({len(text)} characters)"


def format_differences(diffs: list[tuple[str, object, object]], limit: int = 6) -> str:
    """``dtype: requested 'bfloat16', cached 'float16'; ...`` for a warning or error message: at most ``limit``
    differences, each name and value cut to :data:`MAX_SHOWN_CHARS` characters (a cached fingerprint may come
    from another user)."""
    parts = [f"{name[:MAX_SHOWN_CHARS]}: requested {_shown(a)}, cached {_shown(b)}" for name, a, b in diffs[:limit]]
    if len(diffs) > limit:
        parts.append(f"and {len(diffs) - limit} more")
    return "; ".join(parts)


def _typed(data: object, key: str, kind: type, optional: bool = False, limit: int = MAX_FIELD_CHARS) -> Any:
    if not isinstance(data, dict):
        raise ManifestError(f"expected a JSON object holding {key!r}; found {type(data).__name__}")
    if key not in data:
        raise ManifestError(f"fingerprint field {key!r} is missing")
    value = data[key]
    if value is None and optional:
        return None
    if kind is int:
        return _int(value, key)
    if not isinstance(value, kind):
        raise ManifestError(f"fingerprint field {key!r} must be {kind.__name__}; found {type(value).__name__}")
    if isinstance(value, str) and len(value) > limit:
        raise ManifestError(
            f"fingerprint field {key!r} holds {len(value)} characters; at most {limit} are allowed (a fingerprint "
            "names a model, it does not carry data)"
        )
    return value


def is_int(value: object) -> bool:
    """An int from JSON, not a bool (which Python counts as an int)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _int(value: object, key: str = "value") -> int:
    if not is_int(value):
        raise ManifestError(f"fingerprint field {key!r} must be an integer; found {value!r:.100}")
    assert isinstance(value, int)
    return value


__all__ = [
    "FORMAT_VERSION",
    "Fingerprint",
    "canonical_json",
    "config_hash",
    "format_differences",
    "json_depth",
    "torch_version",
    "transform_identity",
]

"""torch.compile from the keeper: load what an earlier process compiled for these weights before the first compile,
and publish what this one compiled after warm-up on a miss.

:func:`compile_cache` gives a :class:`CompileCache`, a context manager::

    with wc.attach(model, ckpt, mode="daemon") as handle:
        with wc.compile_cache(handle, options={"backend": "inductor"}) as cc:
            compiled = torch.compile(model, backend="inductor")
            compiled(example)                 # compiles: from the keeper's artifact if there is one
        cc.stats                               # torch's own cache-hit and -miss counters, what was loaded/published

On entry it asks the keeper for the ``torch.compile`` artifact of the weights' fingerprint and this process's key
(:func:`compile_key`: torch and Triton versions, Python, device and CPU ISA or GPU and compute capability, CUDA,
the compile options the caller names, dtype, shapes) and hands torch's portable cache bundle to
``torch.compiler.load_cache_artifacts``, which fills the local inductor and AOTAutograd caches; a compile then hits
them. On a CPU, inductor's C++ kernels are shared libraries that torch's bundle does not carry; the artifact
carries the ones this process loaded, restored under the local cache directory at the path torch derives from each
kernel's source and compile command (so a kernel of another source or command is never found there), together
with the small libraries inductor builds to probe the host's vector ISA. On exit,
if anything missed (no artifact, or torch compiled graphs the artifact did not hold), it publishes
``torch.compiler.save_cache_artifacts()`` with those kernels, replacing the artifact it loaded.

A miss of any kind (no keeper, no artifact for this key, a corrupt blob, a bundle torch refuses) only means that
torch compiles as it would have: nothing here raises for the cache's sake; reasons go to the log (logger
``weightcache.artifacts``). The artifact is code: only artifacts of trusted publishers are loaded (this uid, the
keeper's owner and ``trusted_publishers`` are not enough here): only artifacts this uid published itself are
loaded, the same user whose local inductor cache torch unpickles and loads kernels from anyway. An artifact of any
other publisher is a miss, and this process compiles (and publishes its own).
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import platform
import re
import struct
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs
import torch

from .artifact_key import ArtifactKey
from .artifacts import Artifact, write_whole
from .cache import Cache, weights_digest
from .errors import WeightCacheError
from .fingerprint import Fingerprint
from .handle import Handle
from .pipeline import SWITCH_ENV, switched_off

log = logging.getLogger("weightcache.artifacts")

#: The artifact kind this module publishes.
KIND = "torch.compile"
#: The first bytes of a blob this module writes: torch's bundle, then the C++ kernels inductor built.
MAGIC = b"WCTC\x01"
_HEADER = struct.Struct("!5sI")
#: Largest JSON header of a blob (the list of kernels).
MAX_HEADER_BYTES = 1 << 20
#: What a kernel's path under the inductor cache directory looks like (``<2 chars>/<hash>[.main].so``): anything
#: else in a blob is refused, so that a blob can only ever write kernels where torch itself looks for them.
KERNEL_PATH = re.compile(r"[a-z0-9_]{2}/[a-z0-9_]{8,128}(\.main)?\.so")
#: torch's counters of its caches that decide whether a compile was served from them.
HIT_COUNTERS = (("inductor", "fxgraph_cache_hit"), ("aot_autograd", "autograd_cache_hit"))
MISS_COUNTERS = (("inductor", "fxgraph_cache_miss"), ("aot_autograd", "autograd_cache_miss"))


@attrs.frozen
class CompileCacheStats:
    """What one :class:`CompileCache` did, from torch's own counters (``torch._dynamo.utils.counters``), counted
    from its entry to its exit.

    Attributes:
        source: ``"keeper"`` when an artifact was loaded, else ``"none"``.
        loaded_bytes: size of the artifact loaded (0 for none).
        loaded: torch's CacheInfo of what it loaded, per cache (``{"inductor": 1, "aot_autograd": 1}``).
        kernels_restored: C++ kernels (CPU) written into the local cache directory from the artifact.
        hits: compiled graphs torch served from its caches (FX graph cache and AOTAutograd cache hits).
        misses: compiled graphs torch had to compile (their misses).
        published_bytes: size of the artifact published on exit (0 for none).
        miss_reason: why nothing was loaded (None after a load).
    """

    source: str = "none"
    loaded_bytes: int = 0
    loaded: dict[str, int] = attrs.field(factory=dict)
    kernels_restored: int = 0
    hits: int = 0
    misses: int = 0
    published_bytes: int = 0
    miss_reason: str | None = None


def torch_cache_counters() -> dict[str, dict[str, int]]:
    """torch's counters of its compile caches in this process (``torch._dynamo.utils.counters``, groups
    ``inductor`` and ``aot_autograd``): e.g. ``{"inductor": {"fxgraph_cache_hit": 1, ...}, ...}``."""
    from torch._dynamo.utils import counters

    return {group: dict(counters[group]) for group in ("inductor", "aot_autograd") if group in counters}


def compile_metrics() -> dict[str, Any]:
    """What torch's dynamo recorded of the compiles in this process: ``graphs`` (its ``stats`` counters: frames
    and graphs seen), ``graph_breaks`` (their total) and ``compile_times_s`` (seconds per timed section, e.g.
    ``_compile.compile_inner``, summed). For reports and benchmarks; torch keeps these in private modules."""
    from torch._dynamo.utils import compilation_time_metrics, counters

    return {
        "graphs": dict(counters["stats"]),
        "graph_breaks": sum(counters["graph_break"].values()),
        "compile_times_s": {name: round(sum(values), 3) for name, values in compilation_time_metrics.items()},
    }


def _counter_totals() -> tuple[int, int]:
    from torch._dynamo.utils import counters

    hits = sum(counters[group][name] for group, name in HIT_COUNTERS)
    misses = sum(counters[group][name] for group, name in MISS_COUNTERS)
    return hits, misses


def _saved_keys(info: object) -> dict[str, list[str]]:
    """The keys of torch's cache entries a CacheInfo names, per cache (empty where a release gives none)."""
    artifacts = getattr(info, "artifacts", None)
    if not isinstance(artifacts, Mapping):
        return {}
    return {
        str(kind): sorted(map(str, keys)) for kind, keys in artifacts.items() if isinstance(keys, (list, tuple, set))
    }


def _package_version(name: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def device_fields(device: torch.device | str | None = None) -> dict[str, Any]:
    """What a compiled artifact depends on about the device: CPU model and vector ISA, or GPU name and compute
    capability with the CUDA version."""
    dev = torch.device(device) if device is not None else torch.device("cpu")
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        props = torch.cuda.get_device_properties(index)
        return {
            "device": "cuda",
            "gpu": props.name,
            "compute_capability": f"{props.major}.{props.minor}",
            "cuda": torch.version.cuda,
            "triton": _package_version("triton"),
        }
    return {"device": dev.type, "cpu": _cpu_model(), "isa": torch.backends.cpu.get_cpu_capability()}


def _loaded_counts(info: object) -> dict[str, int]:
    """What ``torch.compiler.load_cache_artifacts`` says it loaded, per cache (its CacheInfo's ``artifacts``);
    empty where a torch release returns something else (the load itself has worked)."""
    artifacts = getattr(info, "artifacts", None)
    if not isinstance(artifacts, Mapping):
        return {}
    return {str(kind): len(keys) for kind, keys in artifacts.items() if isinstance(keys, (list, tuple, set))}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def compile_key(
    fingerprint: Fingerprint | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    shapes: object = None,
    extra: Mapping[str, Any] | None = None,
) -> ArtifactKey:
    """The :class:`ArtifactKey` of a torch.compile artifact: torch, Triton and Python versions, the device
    (:func:`device_fields`; default: the fingerprint's), the compile ``options`` (what the caller passes to
    ``torch.compile``: backend, mode, dynamic, fullgraph, options), ``dtype`` (default: the fingerprint's),
    ``shapes`` (the example shapes or the dynamic spec) and any ``extra`` JSON fields (e.g. an engine's own cache
    key). Values that are not JSON (a dtype, a backend callable) are recorded by ``str``."""
    if device is None and fingerprint is not None and fingerprint.device_kind != "cpu":
        device = fingerprint.device_kind
    fields: dict[str, Any] = {
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        **device_fields(device),
        "options": _jsonable(dict(options or {})),
        "dtype": str(dtype) if dtype is not None else (fingerprint.dtype if fingerprint is not None else None),
        "shapes": _jsonable(shapes),
    }
    fields.update(_jsonable(dict(extra or {})))
    return ArtifactKey(KIND, fields)


def _jsonable(value: object) -> Any:
    """``value`` as JSON: containers kept, anything else not JSON by ``str``."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, Mapping):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, torch.Size):
        return list(value)
    return str(value)


# --- the blob --------------------------------------------------------------------------------------------------


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


# --- the context manager ---------------------------------------------------------------------------------------


class CompileCache:
    """Load a torch.compile artifact of these weights from the keeper (:meth:`load`, on entry) and publish one
    after warm-up on a miss (:meth:`publish`, on a clean exit). See :func:`compile_cache`.

    Attributes:
        key: the artifact's key (:func:`compile_key`).
        stats: what was loaded and published, and torch's cache hits and misses since :meth:`load`.
        artifact: the artifact held while the CompileCache is open (re-published if the keeper restarts).
    """

    def __init__(self, fingerprint: Fingerprint | str, key: ArtifactKey, cache: Cache, *, hold: bool = True) -> None:
        self.fingerprint = fingerprint
        self.key = key
        self.cache = cache
        self.hold = hold
        self.stats = CompileCacheStats()
        self.artifact: Artifact | None = None
        #: The SHA-256 of the keeper's blob for this key that a publish replaces: the one loaded, or one that could
        #: not be loaded (garbage at the key must not outlive the next good publish).
        self._replace: str | None = None
        #: The header of the blob loaded (None: none was).
        self._loaded: BlobInfo | None = None
        self._grad_enabled = True
        self._counters = (0, 0)
        self._started = time.time()

    @property
    def weights(self) -> str:
        return weights_digest(self.fingerprint)

    def load(self) -> bool:
        """Hand the keeper's artifact for this key to torch before the first compile; whether one was loaded.
        Starts counting torch's cache hits and misses."""
        self._counters = _counter_totals()
        self._started = time.time() - 1.0  # mtimes have coarse clocks on some file systems
        self._grad_enabled = torch.is_grad_enabled()
        if switched_off():
            self.stats = attrs.evolve(self.stats, miss_reason=f"{SWITCH_ENV}=off")
            return False
        found = self.cache.open_artifact(self.fingerprint, self.key)
        if found is not None and found.info.publisher != os.getuid():
            # An artifact is code (pickles, shared libraries): only this user's own are ever loaded.
            log.info(
                "weightcache: %s artifact for %s was published by uid %d, not this uid; compiling",
                KIND,
                self.weights[:12],
                found.info.publisher,
            )
            found.close()
            self.stats = attrs.evolve(
                self.stats, miss_reason=f"the keeper's {KIND} artifact was published by another user"
            )
            return False
        blob = found.read() if found is not None else None
        if found is not None and not self.hold:
            found.close()
            found = None
        if blob is None:
            if found is not None:
                found.close()
            reason = self.cache.miss_reason(self.fingerprint, self.key) if found is None else None
            self.stats = attrs.evolve(
                self.stats, miss_reason=reason or f"no {KIND} artifact in the keeper for this key"
            )
            return False
        self._replace = hashlib.sha256(blob).hexdigest()
        try:
            info = blob_info(blob)
            bundle, kernels = unpack(blob)
            restored = restore_kernels(kernels)
            loaded_info = torch.compiler.load_cache_artifacts(bundle)
        except Exception as exc:  # a bundle torch or we refuse is a miss: compile as usual, publish in its place
            log.warning(
                "weightcache: %s artifact for %s could not be loaded (%s); compiling, and the next publish replaces it",
                KIND,
                self.weights[:12],
                exc,
            )
            if found is not None:
                found.close()
            self.stats = attrs.evolve(self.stats, miss_reason=f"the artifact could not be loaded: {exc}")
            return False
        self.artifact = found
        self._loaded = info
        loaded = _loaded_counts(loaded_info)
        self.stats = attrs.evolve(
            self.stats, source="keeper", loaded_bytes=len(blob), loaded=loaded, kernels_restored=restored
        )
        log.info(
            "weightcache: loaded %s artifact for %s (%d bytes: %s, %d C++ kernels restored)",
            KIND,
            self.weights[:12],
            len(blob),
            loaded,
            restored,
        )
        return True

    def update_counts(self) -> CompileCacheStats:
        """:attr:`stats` with torch's hits and misses counted up to now."""
        hits, misses = _counter_totals()
        self.stats = attrs.evolve(self.stats, hits=hits - self._counters[0], misses=misses - self._counters[1])
        return self.stats

    def publish(self, *, force: bool = False) -> Artifact | None:
        """After warm-up: if anything missed (no artifact was loaded, or torch compiled graphs it did not hold), or
        with ``force``, publish ``torch.compiler.save_cache_artifacts()`` and the C++ kernels this process loaded,
        in place of the blob loaded (or of one that could not be loaded). Returns the artifact published (held
        while this CompileCache is), or None: nothing to publish, all hits, or the keeper refused it (logged).

        A blob is not re-published for nothing: after a load, only if torch compiled a cache entry or a kernel
        the blob lacked, and only once (generation 1): if torch still misses after loading a blob published
        after a load, loading does not work for this program (a warning says so, and why torch may miss), and
        re-publishing on every start would only churn the keeper."""
        stats = self.update_counts()
        if switched_off() or (not force and stats.source == "keeper" and stats.misses == 0):
            return None
        saved = torch.compiler.save_cache_artifacts()
        if saved is None:
            log.info("weightcache: torch recorded nothing to save for %s; nothing published", self.weights[:12])
            return None
        bundle, saved_info = saved
        entries = _saved_keys(saved_info)
        kernels = {path: file.read_bytes() for path, file in loaded_kernels(since=self._started).items()}
        generation = 0
        if self._loaded is not None and not force:
            if self._not_worth_publishing(entries, kernels):
                return None
            generation = self._loaded.generation + 1
        blob = pack(bundle, kernels, entries=entries, generation=generation)
        try:
            artifact = self.cache.put_artifact(self.fingerprint, self.key, blob, hold=self.hold, replace=self._replace)
        except WeightCacheError as exc:
            log.warning("weightcache: could not publish the %s artifact for %s: %s", KIND, self.weights[:12], exc)
            return None
        if self.artifact is not None:
            self.artifact.close()
        self.artifact = artifact if self.hold else None
        self.stats = attrs.evolve(self.stats, published_bytes=len(blob))
        log.info(
            "weightcache: published %s artifact %s (%d bytes, %d C++ kernels)%s",
            KIND,
            artifact.info.key[:24],
            len(blob),
            len(kernels),
            "" if artifact.created else "; the keeper already held one for this key",
        )
        return artifact

    def _not_worth_publishing(self, entries: Mapping[str, list[str]], kernels: Mapping[str, bytes]) -> bool:
        """After a load and misses: whether a publish would add nothing (logged), or would be the second
        re-publish in a row (a warning)."""
        assert self._loaded is not None
        held = self._loaded.entries
        new = sum(len(set(keys) - held.get(kind, frozenset())) for kind, keys in entries.items())
        new += len(set(kernels) - self._loaded.kernels)
        hint = (
            " Grad was enabled: torch puts no AOTAutograd entry of a graph compiled with grad enabled into its cache "
            "bundle, so that stage compiles again on every start; run inference under torch.no_grad() or "
            "torch.inference_mode()."
            if self._grad_enabled
            else ""
        )
        if new == 0:
            log.info(
                "weightcache: torch missed %d time(s) for %s although the %s artifact loaded, and compiled nothing "
                "it lacks; nothing published.%s",
                self.stats.misses,
                self.weights[:12],
                KIND,
                hint,
            )
            return True
        if self._loaded.generation >= 1:
            log.warning(
                "weightcache: torch compiled %d cache entr(ies) or kernel(s) for %s that the %s artifact lacks, "
                "although that artifact was itself published after a load that missed: loading it does not serve "
                "this program, so it is kept as it is rather than re-published on every start.%s",
                new,
                self.weights[:12],
                KIND,
                hint,
            )
            return True
        return False

    def close(self) -> None:
        """Let go of the artifact held (it stays in the keeper, unleased)."""
        if self.artifact is not None:
            self.artifact.close()
            self.artifact = None

    def __enter__(self) -> CompileCache:
        self.load()
        return self

    def __exit__(self, exc_type: type[BaseException] | None, *exc: object) -> None:
        if exc_type is None:
            self.publish()
        else:
            self.update_counts()


def compile_cache(
    weights: Handle | Fingerprint | str,
    *,
    options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    shapes: object = None,
    extra: Mapping[str, Any] | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    hold: bool = True,
) -> CompileCache:
    """A :class:`CompileCache` for ``weights`` (an attached :class:`Handle`, a :class:`Fingerprint`, or a weights
    digest): use it as a context manager around the first call of a ``torch.compile``-d model.

    On entry it loads the keeper's ``torch.compile`` artifact of these weights for this key (torch's cache bundle
    and, on CPU, inductor's C++ kernels) into the local inductor cache; the first call then compiles from it. On a
    clean exit, if anything missed, it publishes what this process compiled. ``options``, ``dtype``, ``shapes`` and
    ``extra`` join the key (see :func:`compile_key`): pass the arguments you give ``torch.compile`` and whatever
    else decides what it compiles, so that a change is a miss (a second artifact) rather than a useless load.
    ``hold``: keep the artifact leased (and re-published if the keeper restarts) until :meth:`CompileCache.close`.

    Nothing here raises for the cache's sake: no keeper, a miss, a corrupt or refused artifact only mean that
    torch compiles as it would have (the reasons are logged, logger ``weightcache.artifacts``).
    """
    if isinstance(weights, Handle):
        fingerprint: Fingerprint | str = weights.fingerprint
    else:
        fingerprint = weights
    fp = fingerprint if isinstance(fingerprint, Fingerprint) else None
    key = compile_key(fp, options=options, device=device, dtype=dtype, shapes=shapes, extra=extra)
    cache = Cache(socket_dir)
    return CompileCache(fingerprint, key, cache, hold=hold)


__all__ = [
    "CompileCache",
    "BlobInfo",
    "CompileCacheStats",
    "blob_info",
    "compile_cache",
    "compile_key",
    "compile_metrics",
    "device_fields",
    "torch_cache_counters",
]

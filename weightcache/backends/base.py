"""The engine adapter interface: what every backend (vLLM, SGLang, plain torch, yours) provides, and the cache
half of modes daemon and client that they all share.

An adapter translates between an engine and weightcache, nothing more:

- which engine it is and which version runs (:meth:`Backend.version`: part of every fingerprint);
- how the engine describes quantization, mapped to a :mod:`weightcache.quant` strategy (:meth:`Backend.quant`),
  checked in both modes before anything is loaded;
- where the engine lets a loader in (a loader class, a plugin entry point): that part is engine-specific and
  lives in the adapter's own module, built from :func:`fetch` and :func:`publish` below.

This module must not import any engine: adapters import theirs lazily, so that ``weightcache.backends`` works
(and lists every adapter) where no engine is installed.
"""

from __future__ import annotations

import abc
import importlib
import importlib.util
import os
import warnings
from collections.abc import Mapping
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, Literal

import attrs

from ..errors import (
    BackendConfigError,
    EngineNotInstalled,
    EntryNotFound,
    FallbackWarning,
    FingerprintMismatch,
    KeeperUnavailable,
    WeightCacheError,
)

if TYPE_CHECKING:
    import torch

    from ..cache import Handle
    from ..fingerprint import Fingerprint

EngineMode = Literal["daemon", "client"]
ENGINE_MODES: tuple[EngineMode, ...] = ("daemon", "client")


@attrs.frozen
class QuantSpec:
    """An engine's quantization, as weightcache sees it: a strategy name and the config whose hash joins the
    fingerprint (JSON-serialisable, or None)."""

    method: str
    config: dict[str, Any] | None = None


@attrs.frozen
class LoaderOptions:
    """The options every engine loader takes (vLLM: ``--model-loader-extra-config``; SGLang: keyword arguments).

    Attributes:
        mode: ``"daemon"`` (default: attach if cached, else load from disk, publish and attach) or ``"client"``
            (attach; fall back to disk with a FallbackWarning, or raise with ``strict``).
        socket_dir: the keeper's socket directory (default: see :mod:`weightcache.rundir`).
        strict: in mode client, raise instead of falling back to disk.
    """

    mode: EngineMode = "daemon"
    socket_dir: str | None = None
    strict: bool = False

    @classmethod
    def parse(cls, raw: Mapping[str, object] | None, *, where: str) -> LoaderOptions:
        """Validate user-supplied options; ``where`` names their origin in error messages.

        Raises BackendConfigError for an unknown key or a wrong value, naming the accepted ones.
        """
        raw = dict(raw or {})
        known = {f.name for f in attrs.fields(cls)}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise BackendConfigError(
                f"{where}: unknown key(s) {', '.join(map(repr, unknown))}; weightcache accepts "
                f'{", ".join(sorted(known))} (e.g. {{"mode": "client", "strict": true}})'
            )
        mode = raw.get("mode", "daemon")
        if mode not in ENGINE_MODES:
            raise BackendConfigError(
                f"{where}: mode must be one of {', '.join(ENGINE_MODES)}; found {mode!r} "
                "(mode off is the engine's own load format)"
            )
        socket_dir = raw.get("socket_dir")
        if socket_dir is not None and not isinstance(socket_dir, (str, os.PathLike)):
            raise BackendConfigError(f"{where}: socket_dir must be a path string; found {socket_dir!r}")
        strict = raw.get("strict", False)
        if not isinstance(strict, bool):
            raise BackendConfigError(f"{where}: strict must be true or false; found {strict!r}")
        return cls(mode=mode, socket_dir=None if socket_dir is None else os.fspath(socket_dir), strict=strict)


class Backend(abc.ABC):
    """An engine adapter. Subclass it, set the class attributes, implement :meth:`quant`, and
    :func:`weightcache.backends.register` the class.

    Class attributes:
        name: the adapter's name (``"vllm"``), also the ``engine`` field of the fingerprints it makes.
        module: the engine's top-level module, imported lazily by :meth:`require`.
        install_hint: what to run when the engine is missing.
    """

    name: ClassVar[str]
    module: ClassVar[str]
    install_hint: ClassVar[str] = ""

    def available(self) -> bool:
        """Whether the engine can be imported here (without importing it)."""
        try:
            return importlib.util.find_spec(self.module) is not None
        except (ImportError, ValueError):
            return False

    def require(self) -> ModuleType:
        """Import the engine, or raise :class:`EngineNotInstalled` saying how to install it."""
        try:
            return importlib.import_module(self.module)
        except ImportError as exc:
            raise EngineNotInstalled(
                f"the weightcache {self.name} adapter needs the {self.module!r} package, which cannot be imported "
                f"here ({type(exc).__name__}: {exc}). {self.install_hint}".rstrip()
            ) from exc

    def version(self) -> str:
        """The engine's version, recorded in fingerprints (weights made by another version never match)."""
        version = getattr(self.require(), "__version__", None)
        return str(version) if version is not None else "unknown"

    @abc.abstractmethod
    def quant(self, engine_quant: object) -> QuantSpec:
        """Map the engine's description of quantization (a config object, a method name, or None) to a
        weightcache strategy. Raise UnsupportedQuantError for a method weightcache has no strategy for."""

    def check_quant(self, engine_quant: object) -> QuantSpec:
        """:meth:`quant`, then the strategy's check: raises UnsupportedQuantError for refused methods. Adapters
        call it on both sides (publish and attach) before anything is loaded."""
        from .. import quant as quant_registry

        spec = self.quant(engine_quant)
        quant_registry.get(spec.method).check(spec.config)
        return spec

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({'available' if self.available() else 'not installed'})>"


# --- the cache half of modes daemon and client --------------------------------------------------------------


def fetch(fingerprint: Fingerprint, options: LoaderOptions) -> Handle | None:
    """The attached entry for ``fingerprint``, or None when the engine must load from disk.

    Mode daemon ensures a keeper runs (spawning one) and returns None on a miss: the caller loads, then
    :func:`publish` es. Mode client never starts a keeper; on a miss it warns with a FallbackWarning that says
    why and returns None (the caller loads from disk and publishes nothing), or with ``strict`` raises
    KeeperUnavailable, EntryNotFound or FingerprintMismatch.
    """
    from ..attach import why_missing
    from ..cache import Cache
    from ..client import ensure_keeper

    if options.mode == "daemon":
        cache = Cache(ensure_keeper(options.socket_dir))
        return cache.get(fingerprint)
    try:
        cache = Cache(options.socket_dir)
        handle = cache.get(fingerprint)
        if handle is not None:
            return handle
        reason, diffs = why_missing(cache, fingerprint)
    except KeeperUnavailable as exc:
        if options.strict:
            raise
        reason, diffs = f"no keeper is available ({exc})", []
    except WeightCacheError as exc:
        if options.strict or isinstance(exc, (EngineNotInstalled, BackendConfigError)):
            raise
        reason, diffs = f"the cache could not serve this request ({type(exc).__name__}: {exc})", []
    if options.strict:
        if diffs:
            raise FingerprintMismatch(reason, tuple(diffs))
        raise EntryNotFound(reason)
    warnings.warn(f"weightcache: loading from disk: {reason}", FallbackWarning, stacklevel=2)
    return None


def publish(fingerprint: Fingerprint, tensors: Mapping[str, torch.Tensor], options: LoaderOptions) -> Handle:
    """Publish a post-processed state dict (mode daemon, after a miss) and return the attached Handle."""
    from ..cache import Cache

    return Cache(options.socket_dir, spawn=True).put(fingerprint, tensors)


def entry_bytes(fingerprint: Fingerprint, options: LoaderOptions) -> int:
    """Bytes of the keeper's entry for ``fingerprint`` (0 when no keeper runs or it holds no such entry): the
    memory an engine attaching it will map rather than allocate."""
    from ..cache import Cache

    try:
        entries = Cache(options.socket_dir).entries()
    except KeeperUnavailable:
        return 0
    for entry in entries:
        if entry.digest == fingerprint.digest and entry.placement == fingerprint.placement:
            return entry.bytes
    return 0


__all__ = [
    "ENGINE_MODES",
    "Backend",
    "EngineMode",
    "LoaderOptions",
    "QuantSpec",
    "entry_bytes",
    "fetch",
    "publish",
]

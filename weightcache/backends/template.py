"""The engine adapter interface: a template that owns the sequence of an engine's load, and the hooks each
engine fills in.

An adapter translates between an engine and weightcache, nothing more:

- which engine it is and which version runs (:meth:`Backend.version`: part of every fingerprint);
- how the engine describes quantization, mapped to a :mod:`weightcache.quant` strategy (:meth:`Backend.quant`),
  checked in both modes before anything is loaded;
- four hooks of the load itself: build the engine's model on the meta device (:meth:`Backend.build_model`),
  load and post-process it from disk with the engine's own loader (:meth:`Backend.load_from_disk`), the tensors
  to share (:meth:`Backend.shareable_state`), and fix-ups after binding (:meth:`Backend.after_bind`);
- for engines that register a built model's layers outside it (vLLM, by layer name), how to forget a model that
  will not run (:meth:`Backend.release_model`) and how to build one that leaves nothing behind
  (:meth:`Backend.scratch_build`).

:meth:`Backend.load_model` runs the sequence through :mod:`weightcache.pipeline`, the one mode engine: modes,
fallbacks, keeper spawning, the bounded-memory publish and the warnings are never written in an adapter. Where
the engine lets a loader in (a loader class, a plugin entry point) is engine-specific and lives in the
adapter's own module; it calls :meth:`Backend.load_model`.

The fingerprint records the structure of the model the engine builds (:func:`~weightcache.structure.structure_digest`
of :meth:`Backend.build_model`'s model, before anything is bound: every parameter and buffer's name, dtype and
shape), under the ``extra`` key ``structure``. An engine setting that changes the layout, whether or not the
adapter's identity names it, then makes a miss whose reason names ``extra.structure``, never an attach into a
model the entry was not made for. :meth:`Backend.load_model` builds that model once, before the keeper is asked,
and on a hit binds into that very model.

This module must not import any engine: adapters import theirs lazily, so that ``weightcache.backends`` works
(and lists every adapter) where no engine is installed.
"""

from __future__ import annotations

import abc
import contextlib
import importlib
import importlib.util
import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from types import ModuleType
from typing import Any, ClassVar, Literal

import attrs
import torch
from torch import nn

from .. import pipeline
from .. import quant as quant_registry
from ..cache import Cache
from ..errors import (
    BackendConfigError,
    EngineNotInstalled,
    KeeperNotResponding,
    KeeperUnavailable,
    UnsupportedQuantError,
    WeightCacheError,
)
from ..fingerprint import Fingerprint
from ..handle import Handle
from ..pipeline import SWITCH_ENV
from ..rundir import resolve_user
from ..structure import structure_digest
from .engine_config import QuantSpec, device_spec
from .engine_steps import EngineSteps, drop_parameters
from .releases import ReleaseRange

EngineMode = Literal["daemon", "client"]
ENGINE_MODES: tuple[EngineMode, ...] = ("daemon", "client")

#: The kill switch (:data:`weightcache.pipeline.SWITCH_ENV`), read at every load (not at registration, so the load
#: format stays valid): ``off`` makes every engine adapter the engine's own loader; ``daemon`` or ``client``
#: overrides the mode the launch command gave.
MODE_ENV = SWITCH_ENV


@attrs.frozen
class LoaderOptions:
    """The options every engine loader takes (vLLM: ``--model-loader-extra-config``; SGLang: keyword arguments).

    Attributes:
        mode: ``"daemon"`` (default: attach if cached, else load from disk, publish and attach) or ``"client"``
            (attach; fall back to disk with a FallbackWarning, or raise with ``strict``).
        socket_dir: the keeper's socket directory (default: see :mod:`weightcache.rundir`).
        strict: in mode client, raise instead of falling back to disk; in mode daemon, raise the error that
            stopped publishing (or made the keeper unusable) instead of serving the weights loaded from disk.
        trusted_publishers: other users (names or uids) whose published entries may be attached, besides the
            engine's own uid and the keeper's owner (see :class:`~weightcache.cache.Cache`).
    """

    mode: EngineMode = "daemon"
    socket_dir: str | None = None
    strict: bool = False
    trusted_publishers: tuple[int, ...] = ()

    @classmethod
    def parse(cls, raw: Mapping[str, object] | None, *, where: str) -> LoaderOptions:
        """Validate user-supplied options; ``where`` names their origin in error messages.

        Raises BackendConfigError for something other than a mapping (a JSON object), an unknown key or a wrong
        value, naming the accepted ones.
        """
        if raw is not None and not isinstance(raw, Mapping):
            raise BackendConfigError(
                f'{where}: must be a JSON object of options (e.g. {{"mode": "client"}}); found {raw!r}'
            )
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
        users = raw.get("trusted_publishers", [])
        if not isinstance(users, (list, tuple)) or not all(isinstance(u, (str, int)) for u in users):
            raise BackendConfigError(
                f"{where}: trusted_publishers must be a list of user names or uids; found {users!r}"
            )
        try:
            trusted = tuple(resolve_user(u) for u in users)
        except ValueError as exc:
            raise BackendConfigError(f"{where}: trusted_publishers: {exc}") from None
        return cls(
            mode=mode,
            socket_dir=None if socket_dir is None else os.fspath(socket_dir),
            strict=strict,
            trusted_publishers=trusted,
        )


class Backend(abc.ABC):
    """An engine adapter. Subclass it, set the class attributes, implement :meth:`quant`, and
    :func:`weightcache.backends.register` the class.

    Class attributes:
        name: the adapter's name (``"vllm"``), also the ``engine`` field of the fingerprints it makes.
        module: the engine's top-level module, imported lazily by :meth:`require`.
        install_hint: what to run when the engine is missing.
        records_structure: whether :meth:`load_model` adds the structure of :meth:`build_model`'s model to the
            fingerprint (default True; the torch adapter, whose entries :func:`weightcache.attach` shares, does
            not).
    """

    name: ClassVar[str]
    module: ClassVar[str]
    install_hint: ClassVar[str] = ""
    records_structure: ClassVar[bool] = True
    #: The engine releases the adapter supports (None: any). Outside them the engine loads with its own loader.
    releases: ClassVar[ReleaseRange | None] = None

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

    def unsupported(self) -> str | None:
        """Why the cache cannot be used with the installed engine (a release outside :attr:`releases`, an engine
        API the adapter needs and cannot find), or None. Adapters with release differences extend it with their
        probes. Never raises: whatever goes wrong while asking is the answer."""
        if self.releases is None:
            return None
        try:
            return self.releases.problem(self.version())
        except Exception as exc:
            return f"the installed {self.name} cannot be inspected ({type(exc).__name__}: {exc})"

    @abc.abstractmethod
    def quant(self, engine_quant: object) -> QuantSpec:
        """Map the engine's description of quantization (a config object, a method name, or None) to a
        weightcache strategy. Raise UnsupportedQuantError for a method weightcache has no strategy for."""

    def check_quant(self, engine_quant: object) -> QuantSpec:
        """:meth:`quant`, then the strategy's check: raises UnsupportedQuantError for refused methods. Adapters
        call it on both sides (publish and attach) before anything is loaded."""
        spec = self.quant(engine_quant)
        quant_registry.get(spec.method).check(spec.config)
        return spec

    def make_fingerprint(
        self,
        checkpoint: str,
        *,
        dtype: object,
        engine_quant: object,
        parallel: Callable[[], Mapping[str, tuple[int, int]]],
        device: torch.device | str,
        identity: Mapping[str, Any],
    ) -> Fingerprint:
        """The fingerprint of weights this engine loads from ``checkpoint``: the quantization is checked first
        (UnsupportedQuantError before anything is read or asked of the engine, hence ``parallel`` is a function
        that reads this rank's layout), ``identity`` (the engine's model config, as plain JSON) is recorded under
        the adapter's name where it holds anything (an engine without a config of its own, the torch adapter's plain
        modules, then has :func:`weightcache.attach`'s fingerprint and shares its entries), and the engine's name
        and version are the producer.

        This is the fingerprint before a model is built: :meth:`load_model` adds the structure of the model it
        builds; :meth:`complete_fingerprint` tells the same without loading."""
        spec = self.check_quant(engine_quant)
        return Fingerprint.create(
            checkpoint,
            dtype=dtype,
            quant=spec.method,
            quant_config=spec.config,
            parallel=parallel(),
            device=device_spec(device),
            extra={self.name: dict(identity)} if identity else None,
            engine=self.name,
            engine_version=self.version(),
        )

    # --- the load: one sequence, its hooks ----------------------------------------------------------------

    def serve_engine(
        self,
        context: Any,
        *,
        describe: Callable[[], Fingerprint],
        device: torch.device | str,
        options: LoaderOptions,
    ) -> Loaded:
        """What an engine's loader calls: :meth:`load_model` when the cache can be used here, else the engine's
        own loader, and never an engine that does not start because of weightcache.

        In order: the kill switch (:data:`MODE_ENV`: ``off`` loads with the engine's own loader and only logs
        it; ``daemon`` or ``client`` overrides ``options.mode``); :meth:`unsupported` (an engine release or API
        the adapter cannot use: a FallbackWarning, ``strict``: BackendError); ``describe()``, which returns the
        fingerprint (:meth:`make_fingerprint`). A refused quantization method raises UnsupportedQuantError, and
        bad options BackendConfigError, as always; any other error while describing the engine's model (an
        engine API that moved or changed its signature) is a fallback as above.
        """
        effective = self.effective_options(options)
        if effective is None:
            return self.unserved(context, f"{MODE_ENV}=off", strict=False, switched_off=True)
        options = effective
        try:
            reason = self.unsupported()
        except Exception as exc:  # an adapter's probe that broke on this engine is itself a reason
            reason = f"the installed {self.name} cannot be inspected ({type(exc).__name__}: {exc})"
        if reason is None:
            try:
                fingerprint = describe()
            except (UnsupportedQuantError, BackendConfigError):
                raise
            except Exception as exc:
                reason = (
                    f"the weightcache {self.name} adapter could not describe this model with the installed "
                    f"{self.name} ({type(exc).__name__}: {exc})"
                )
        if reason is not None:
            return self.unserved(context, reason, strict=options.strict)
        return self.load_model(context, fingerprint=fingerprint, device=device, options=options)

    def effective_options(self, options: LoaderOptions) -> LoaderOptions | None:
        """``options`` with the mode :data:`MODE_ENV` sets, if it is set; None when it says ``off``.

        Raises BackendConfigError for another value."""
        value = pipeline.switch_value()
        if not value:
            return options
        if value == "off":
            return None
        if value not in ENGINE_MODES:
            raise BackendConfigError(
                f"{MODE_ENV} must be one of off, {', '.join(ENGINE_MODES)}; found {value!r} (unset it to use the "
                "mode of the launch command)"
            )
        return attrs.evolve(options, mode=value)

    def unserved(self, context: Any, reason: str, *, strict: bool, switched_off: bool = False) -> Loaded:
        """The engine's own load, without the cache, because of ``reason`` (see
        :func:`weightcache.pipeline.without_cache`)."""
        model = pipeline.without_cache(
            reason, lambda: self.load_from_disk(context), strict=strict, switched_off=switched_off
        )
        return Loaded(model=model, handle=None, source="disk")

    def load_model(
        self, context: Any, *, fingerprint: Fingerprint, device: torch.device | str, options: LoaderOptions
    ) -> Loaded:
        """Give the engine its model, with weights from the cache or from disk, in ``options.mode``.

        The sequence is :func:`weightcache.pipeline.run`'s; this method only connects it to the hooks below.
        ``context`` is whatever the engine's loader was given (configs, prefixes): it is passed to every hook
        and never looked at here. ``fingerprint`` comes from :meth:`make_fingerprint`.

        In modes daemon and client the engine's model is built on meta first, once: its structure joins the
        fingerprint (unless :attr:`records_structure` is False) before the keeper is asked; a model that cannot
        be built on meta makes the engine load from disk, with a FallbackWarning saying why (``strict``:
        BackendError). On a hit the entry's tensors take that
        model's published layout, are bound into it and :meth:`after_bind` runs. On a miss the model is released
        (:meth:`release_model`) before the engine's own loader builds its model; after publishing, the model
        served is built again, and must have the structure the fingerprint records. When the engine loads from
        disk without the cache (mode client's fallback) its own model is returned as is.
        """
        steps = EngineSteps(self, context, torch.device(device))
        try:
            request = pipeline.Request(
                fingerprint, options.mode, options.strict, options.socket_dir, trusted=options.trusted_publishers
            )
            model = pipeline.run(request, steps)
        except BaseException:
            steps.release_built()  # an engine that does not start keeps nothing registered
            raise
        return Loaded(model=model, handle=steps.handle, source=steps.source)

    def complete_fingerprint(self, fingerprint: Fingerprint, context: Any) -> Fingerprint:
        """The fingerprint :meth:`load_model` would look up for ``context``, without loading: ``fingerprint``
        with the structure of a model built in :meth:`scratch_build` and dropped (for engines that ask about an
        entry before the load, as vLLM's ``get_external_weight_memory`` does to size its caches)."""
        if not self.records_structure:
            return fingerprint
        with self.scratch_build(context):
            return fingerprint.with_extra(structure=structure_digest(self.build_meta(context)))

    def build_meta(self, context: Any) -> nn.Module:
        """:meth:`build_model` under the meta device."""
        with torch.device("meta"):
            return self.build_model(context)

    @abc.abstractmethod
    def build_model(self, context: Any) -> nn.Module:
        """The engine's model for ``context``, built on the meta device (no weights): what tensors are bound
        into on a cache hit."""

    @abc.abstractmethod
    def load_from_disk(self, context: Any) -> nn.Module:
        """The engine's own load: read, shard, quantize and post-process the weights; return the model as the
        engine would run it."""

    def published_state(self, context: Any) -> dict[str, torch.Tensor]:
        """What mode daemon publishes after a miss: :meth:`load_from_disk` in :meth:`scratch_build`, then
        :meth:`shareable_state` of that model. The model is dropped before this returns, so that publishing
        releases the loaded copy as it goes (the peak stays the weights plus one segment), and so are its
        registrations with the engine, so that the model served next can be built; an override must keep it
        that way."""
        with self.scratch_build(context):
            model = self.load_from_disk(context)
            state = self.shareable_state(model, context)
            drop_parameters(model)
            return state

    def cannot_serve(self, model: nn.Module, context: Any) -> str | None:
        """Why cached weights cannot be served into ``model`` (just built on meta by :meth:`build_model`) with the
        installed engine, or None (the default). A reason makes the engine load from disk, with a FallbackWarning
        saying it (``strict``: BackendError), before a keeper is asked."""
        return None

    def release_model(self, model: nn.Module, context: Any) -> None:
        """Undo whatever building ``model`` (by :meth:`build_model`) registered with the engine outside the
        model, because it will not run: on a miss, before the engine's own loader builds a model of the same
        names. vLLM registers each attention and MoE layer by name and refuses a second of the same name.
        Default: nothing."""
        return None

    @contextlib.contextmanager
    def scratch_build(self, context: Any) -> Iterator[None]:
        """A block in which models are built and dropped: whatever they register with the engine is forgotten
        afterwards, and what the engine had registered before (a model it runs) neither hinders building them
        nor is lost. Default: nothing to do."""
        yield

    def shareable_state(self, model: nn.Module, context: Any) -> dict[str, torch.Tensor]:
        """The tensors to publish from a post-processed model: every parameter and buffer (tied ones once).
        Raise BackendError when post-processing left state that a client cannot re-create from tensors."""
        return dict([*model.named_parameters(), *model.named_buffers()])

    def after_bind(self, model: nn.Module, handle: Handle, context: Any) -> None:
        """Re-create Python-side state after the published tensors were bound into :meth:`build_model`'s model
        (views engines keep as plain attributes, kernel handles). Default: nothing."""
        return None

    def external_bytes(self, context: Any, *, describe: Callable[[], Fingerprint], options: LoaderOptions) -> int:
        """Bytes of weights a load of ``context`` (as :meth:`serve_engine` would run it) will map from the keeper
        rather than allocate: :meth:`cached_bytes` of the fingerprint :meth:`load_model` will look up; 0 when the
        load will not attach (the kill switch, an unsupported engine, a model the engine cannot serve cached
        weights into). For engines that size their memory before the load. Raises only what :meth:`serve_engine`
        would raise itself (a refused quantization, bad options, ``strict`` errors)."""
        effective = self.effective_options(options)
        if effective is None:
            return 0
        try:
            if self.unsupported() is not None:
                return 0
            fingerprint = describe()
            with self.scratch_build(context):
                model = self.build_meta(context)
                if self.cannot_serve(model, context) is not None:
                    return 0
                if self.records_structure:
                    fingerprint = fingerprint.with_extra(structure=structure_digest(model))
        except (UnsupportedQuantError, BackendConfigError):
            raise
        except Exception:  # the load itself says why, with a FallbackWarning
            return 0
        return self.cached_bytes(fingerprint, effective)

    def cached_bytes(self, fingerprint: Fingerprint, options: LoaderOptions) -> int:
        """Bytes of the keeper's entry for ``fingerprint`` (0 when no keeper runs or it holds no such entry): the
        memory an engine attaching it will map rather than allocate, for engines that size caches first."""
        try:
            entry = Cache(options.socket_dir, trusted_publishers=options.trusted_publishers).entry(fingerprint)
        except KeeperUnavailable as exc:
            if not isinstance(exc, KeeperNotResponding):  # none runs: nothing cached, nothing to say
                return 0
            if options.strict:  # one that runs and does not answer: as any other failure to answer
                raise
            warnings.warn(f"weightcache: cannot size the cached entry ({type(exc).__name__}: {exc})", stacklevel=2)
            return 0
        except WeightCacheError as exc:  # asked before loading: the load itself falls back (or raises if strict)
            if options.strict:
                raise
            warnings.warn(f"weightcache: cannot size the cached entry ({type(exc).__name__}: {exc})", stacklevel=2)
            return 0
        return 0 if entry is None else entry.bytes

    def __repr__(self) -> str:
        return f"<{type(self).__name__} {self.name!r} ({'available' if self.available() else 'not installed'})>"


@attrs.frozen
class Loaded:
    """What :meth:`Backend.load_model` gives an engine's loader.

    Attributes:
        model: the model to run.
        handle: the Handle of the weights it runs on (None when the engine loaded from disk by itself); the
            model keeps it alive (``model.weightcache_handle``), and with it the lease.
        source: ``"cache"`` or ``"disk"``.
    """

    model: nn.Module
    handle: Handle | None
    source: str

    @property
    def preloaded_bytes(self) -> int:
        """Bytes of weights that were already resident before this load began (a plain cache hit:
        :attr:`Handle.resident_before`), else 0: a disk load, a publish of this load, or a hit on an entry another
        engine published while this load waited for it, whose memory appeared during this load."""
        if self.handle is None or not self.handle.resident_before or self.handle.manifest is None:
            return 0
        return self.handle.manifest.total_bytes


__all__ = ["ENGINE_MODES", "MODE_ENV", "Backend", "EngineMode", "Loaded", "LoaderOptions"]

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
import json
import os
import warnings
import weakref
from collections.abc import Callable, Iterator, Mapping, MutableMapping
from types import ModuleType
from typing import Any, ClassVar, Literal

import attrs
import torch
from torch import nn

from .. import quant as quant_registry
from ..binding import bind, set_tensor_attributes
from ..cache import Cache
from ..errors import (
    BackendConfigError,
    BackendError,
    BindError,
    EngineNotInstalled,
    KeeperUnavailable,
    UnsupportedQuantError,
    WeightCacheError,
)
from ..fingerprint import Fingerprint
from ..handle import Handle
from ..pipeline import Request, Steps, run
from ..rundir import resolve_user
from ..structure import structure_digest

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
        the adapter's name, and the engine's name and version are the producer.

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
            extra={self.name: dict(identity)},
            engine=self.name,
            engine_version=self.version(),
        )

    # --- the load: one sequence, its hooks ----------------------------------------------------------------

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
        steps = _EngineSteps(self, context, torch.device(device))
        try:
            request = Request(
                fingerprint, options.mode, options.strict, options.socket_dir, trusted=options.trusted_publishers
            )
            model = run(request, steps)
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
            return self.shareable_state(self.load_from_disk(context), context)

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

    def cached_bytes(self, fingerprint: Fingerprint, options: LoaderOptions) -> int:
        """Bytes of the keeper's entry for ``fingerprint`` (0 when no keeper runs or it holds no such entry): the
        memory an engine attaching it will map rather than allocate, for engines that size caches first."""
        try:
            entry = Cache(options.socket_dir, trusted_publishers=options.trusted_publishers).entry(fingerprint)
        except KeeperUnavailable:
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
        """Bytes of weights that were already resident before this load (a cache hit), else 0."""
        if self.handle is None or self.handle.read_disk or self.handle.manifest is None:
            return 0
        return self.handle.manifest.total_bytes


class _EngineSteps(Steps[nn.Module]):
    """:meth:`Backend.load_model`'s steps: the hooks of one backend, for one load.

    The model built before the lookup (:meth:`complete`) is kept for :meth:`serve` on a hit and released
    before anything loads from disk; one built later is checked against the structure the fingerprint holds."""

    def __init__(self, backend: Backend, context: Any, device: torch.device) -> None:
        self.backend = backend
        self.context = context
        self.device = device
        self.handle: Handle | None = None
        self.source = "disk"
        self.built: nn.Module | None = None
        self.structure: str | None = None

    def complete(self, fingerprint: Fingerprint) -> Fingerprint:
        """``fingerprint`` with the structure of the engine's model, built on meta now (it waits for
        :meth:`serve`); BackendError when it cannot be built there."""
        if not self.backend.records_structure:
            return fingerprint
        try:
            self.built = self.backend.build_meta(self.context)
        except Exception as exc:  # the engine's own load may still work: the pipeline falls back to it
            raise BackendError(
                f"the {self.backend.name} engine's model cannot be built on the meta device, so cached weights "
                f"cannot be bound into it ({type(exc).__name__}: {exc})"
            ) from exc
        self.structure = structure_digest(self.built)
        return fingerprint.with_extra(structure=self.structure)

    def release_built(self) -> None:
        """Release the model built before the lookup, if it is still waiting (it will not be served)."""
        model, self.built = self.built, None
        if model is not None:
            self.backend.release_model(model, self.context)

    def load_state(self) -> MutableMapping[str, torch.Tensor]:
        self.release_built()
        return self.backend.published_state(self.context)

    def serve_disk(self, reason: str | None) -> nn.Module:
        self.release_built()
        self.handle, self.source = None, "disk"
        return self.backend.load_from_disk(self.context)

    def serve(self, handle: Handle) -> nn.Module:
        model, self.built = self.built, None
        if model is None:  # released for a load from disk: build it again, as it was fingerprinted
            model = self.backend.build_meta(self.context)
            if self.structure is not None and structure_digest(model) != self.structure:
                self.backend.release_model(model, self.context)
                raise BackendError(
                    f"the {self.backend.name} engine built two different models for one configuration (structure "
                    f"{self.structure[:12]} when fingerprinted, {structure_digest(model)[:12]} after loading), so the "
                    "weights cannot be bound safely. Report it: the adapter's build_model is not deterministic."
                )
        attributes = adopt_published_layout(model, handle)
        bind(model, {n: t for n, t in handle.tensors.items() if n not in attributes}, device=self.device)
        set_tensor_attributes(model, {n: handle.tensors[n] for n in attributes})
        self.backend.after_bind(model, handle, self.context)
        model.__dict__["weightcache_handle"] = handle  # the lease lives as long as the model
        self.handle, self.source = handle, handle.source
        return model


def config_json(config: Any) -> Any:
    """An engine's Hugging Face config (``PretrainedConfig``) as plain JSON, as it was the first time this
    process asked about that config object.

    Engines rewrite their config while building a model (vLLM's and SGLang's DeepSeek-V2/V3 set
    ``rope_parameters["rope_type"]`` from ``"yarn"`` to ``"deepseek_yarn"``), so the same engine would otherwise
    describe itself one way before its model is built (when vLLM sizes its caches, when the load looks up the
    keeper) and another way after (a second question from the same process, a second load). Every adapter asks
    before the engine builds anything, so the first answer is the configuration as loaded from the checkpoint.
    """
    key = id(config)
    cached = _CONFIG_JSON.get(key)
    if cached is not None and cached[0]() is config:
        return json.loads(cached[1])
    text = config.to_json_string(use_diff=False)
    try:
        ref = weakref.ref(config, lambda _: _CONFIG_JSON.pop(key, None))
    except TypeError:  # not weak-referenceable: no memory of it
        return json.loads(text)
    _CONFIG_JSON[key] = (ref, text)
    return json.loads(text)


#: :func:`config_json`'s memory: id of a config object -> (a weak reference to it, its JSON when first asked).
_CONFIG_JSON: dict[int, tuple[weakref.ref[Any], str]] = {}


def device_spec(device: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a torch device (an index-less CUDA device is the current one)."""

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return dev.type


#: Engine quantization methods (``QuantizationConfig.get_name()`` in vLLM and SGLang) and the weightcache
#: strategy for each. ``fp8``
#: depends on its config (block-wise or per-tensor) and is handled separately; anything else is refused.
QUANT_METHODS: dict[str, str] = {
    "awq": "awq",
    "auto_awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "auto_gptq": "gptq",
    "gptq_marlin": "gptq",
    "gptq_marlin_24": "marlin",
    "marlin": "marlin",
}
#: FP8 methods: block-wise when the config carries ``weight_block_size``, else per-tensor or per-channel.
FP8_METHODS = ("fp8", "fp8_per_block", "fp8_per_tensor", "fp8_per_channel", "fbgemm_fp8")


def quant_spec_from_config(engine: str, engine_quant: object) -> QuantSpec:
    """Map an engine's quantization config object (vLLM's or SGLang's ``QuantizationConfig``, with
    ``get_name()``; None: unquantized) to a weightcache strategy.

    FP8 is block-wise (``fp8_block``) when the config carries ``weight_block_size``, else per-tensor (refused by
    its strategy). The config hashed into the fingerprint holds the engine's method name, the block size, and
    every plain-JSON attribute of the config object. Raises UnsupportedQuantError for unmapped methods.
    """
    if engine_quant is None:
        return QuantSpec("none")
    get_name = getattr(engine_quant, "get_name", None)
    method = get_name() if callable(get_name) else None
    if not isinstance(method, str):
        raise TypeError(f"{engine} adapter: expected a QuantizationConfig or None; found {engine_quant!r}")
    config: dict[str, Any] = {"engine_method": method, "config": _json_attributes(engine_quant)}
    if method in FP8_METHODS:
        block = getattr(engine_quant, "weight_block_size", None)
        if block:
            config["weight_block_size"] = [int(b) for b in block]
            return QuantSpec("fp8_block", config)
        return QuantSpec("fp8_per_tensor", config)
    strategy = QUANT_METHODS.get(method)
    if strategy is None:
        mapped = ", ".join(sorted([*FP8_METHODS, *QUANT_METHODS]))
        raise UnsupportedQuantError(
            f"{engine} quantization method {method!r} has no weightcache strategy, so its post-processed weights "
            f"cannot be shared safely (mapped methods: {mapped}). Load this model without weightcache, or add a "
            "strategy (weightcache.quant.register) after checking it with `weightcache parity`."
        )
    return QuantSpec(strategy, config)


def plain_json(value: object) -> Any:
    """``value`` if it is plain JSON, else None: reprs of objects can hold addresses, which differ per process."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError):
        return None


def _json_attributes(obj: object) -> dict[str, Any]:
    """The attributes of a config object that are plain JSON (the rest cannot be compared across processes)."""
    out = {}
    for key, value in sorted(vars(obj).items()):
        plain = plain_json(value)
        if plain is not None or value is None:
            out[key] = plain
    return out


# --- binding an engine's published state into its meta model ------------------------------------------------


def own_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers ``module`` itself registers (not its children's), by full name."""
    dot = f"{prefix}." if prefix else ""
    for attr, p in module._parameters.items():
        if p is not None:
            yield dot + attr, p
    for attr, b in module._buffers.items():
        if b is not None:
            yield dot + attr, b


def adopt_published_layout(model: nn.Module, handle: Handle) -> frozenset[str]:
    """Make a model built on meta hold exactly the tensors that were published, before binding them; return the
    published names that are plain tensor attributes of their module (see
    :func:`~weightcache.binding.tensor_attributes`: the module has an attribute of that name that is neither a
    parameter, a buffer nor a submodule, e.g. ``self.w_kc = None``), for the caller to set rather than bind.

    Post-processing may replace a parameter by one of another shape or dtype (e.g. a transposed or re-scaled
    FP8 weight), register new ones, or drop some. The published tensors are that result, so their layout
    wins: a meta placeholder is re-made with the published shape and dtype (keeping its Parameter class and
    attributes), a published name the model lacks is registered on its module, and a model tensor that was
    not published (and is not tied to one that was) is removed.

    Only quantized weights change layout in post-processing: for ``quant == "none"`` a published tensor whose
    shape or dtype differs from the model's is a BindError, never adopted. Such a difference means the entry
    was made under a setting the fingerprint does not capture (e.g. another expert-parallel layout), and
    adopting it would serve wrong weights.
    """
    may_relayout = handle.fingerprint.quant != "none"
    refused: list[str] = []

    manifest = handle.manifest
    kinds = dict(zip(manifest.names, manifest.kind)) if manifest is not None else {}
    modules = dict(model.named_modules(remove_duplicate=False))
    present: dict[str, torch.Tensor] = {}
    owners: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in own_tensors(module, prefix):
            present[name] = tensor
            owners.setdefault(id(tensor), []).append(name)
    published = handle.tensors
    if not may_relayout:  # checked before anything changes: a refusal leaves the model as it was
        for name, tensor in published.items():
            current = present.get(name)
            if (
                current is not None
                and current.is_meta
                and (current.shape != tensor.shape or current.dtype != tensor.dtype)
            ):
                refused.append(
                    f"{name}: published {tuple(tensor.shape)} {tensor.dtype}, model {tuple(current.shape)} "
                    f"{current.dtype}"
                )
    if refused:
        raise BindError(
            f"the cached entry {handle.digest[:12]} does not fit this {type(model).__name__}: "
            + "; ".join(refused[:8])
            + (f" and {len(refused) - 8} more" if len(refused) > 8 else "")
            + ". Unquantized weights never change shape in post-processing, so the entry was made under a "
            "setting its fingerprint does not record; evict it (`weightcache evict`) and report the setting."
        )
    attributes: set[str] = set()
    for name, tensor in published.items():
        current = present.get(name)
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise BindError(f"published tensor {name!r} has no module {module_name!r} in {type(model).__name__}")
        if current is None and leaf in vars(module):
            attributes.add(name)
            continue
        if current is not None and current.shape == tensor.shape and current.dtype == tensor.dtype:
            continue
        if current is not None and not current.is_meta:
            continue  # materialised (e.g. a computed buffer): bind reports any mismatch
        placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if current is not None and leaf in module._parameters:
            new = torch.Tensor._make_subclass(type(current), placeholder, False)
            new.__dict__.update(current.__dict__)
            for alias in owners.get(id(current), [name]):
                alias_module, _, alias_leaf = alias.rpartition(".")
                modules[alias_module]._parameters[alias_leaf] = new
        elif current is not None:
            for alias in owners.get(id(current), [name]):
                alias_module, _, alias_leaf = alias.rpartition(".")
                modules[alias_module]._buffers[alias_leaf] = placeholder
        elif kinds.get(name) == "parameter":
            module.register_parameter(leaf, nn.Parameter(placeholder, requires_grad=False))
        else:
            module.register_buffer(leaf, placeholder)
    for name, tensor in present.items():
        if not tensor.is_meta or any(alias in published for alias in owners.get(id(tensor), [])):
            continue
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        # Dropped by post-processing where the weights were made: the engine does not read it afterwards.
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
    return frozenset(attributes)


__all__ = [
    "ENGINE_MODES",
    "FP8_METHODS",
    "QUANT_METHODS",
    "Backend",
    "EngineMode",
    "LoaderOptions",
    "QuantSpec",
    "Loaded",
    "adopt_published_layout",
    "config_json",
    "own_tensors",
    "plain_json",
    "quant_spec_from_config",
]

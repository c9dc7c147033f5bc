"""A module's forward compiled ahead of time, kept in the keeper: a restart loads it and runs no dynamo trace and no
inductor compile (torch's AOT path: ``torch.compile(...).aot_compile`` and ``torch.compiler.load_compiled_function``).

:func:`precompile` gives a :class:`Precompiled`, a callable that stands for ``module(*args, **kwargs)``::

    with wc.attach(model, ckpt, mode="daemon") as handle:
        forward = wc.precompile(handle, model, (example,), options={"backend": "inductor"})
        out = forward(example)            # the compiled forward; model's own weights (the keeper's)
        forward.stats                      # where it came from: "keeper", "compiled", or "torch.compile"

Where :func:`~weightcache.torch_compile.compile_cache` makes ``torch.compile`` find its caches filled (dynamo
still traces the model in every process: ~0.2 s a layer on a CPU, 3-4 s for an 8B model on a GPU),
``precompile`` skips dynamo: on a hit it deserializes the compiled function (its guards, bytecode and inductor's
output code, with the C++ kernels on a CPU and the Triton kernels on a GPU) and calls it. On a miss it compiles
``type(module).forward`` with ``fullgraph=True`` for the example ``args``/``kwargs`` and publishes the result at
once. The weights are inputs of the compiled function, never part of it: the artifact is keyed on the weights'
fingerprint as compile_cache's is, but holds no tensor data.

What the AOT path cannot do, and what happens then (``stats.source == "torch.compile"``, ``stats.reason`` says
why, logged once as a warning):

- a forward with a graph break (``fullgraph=True`` fails: data-dependent control flow, an unsupported call),
  a torch release without the AOT path (no ``torch.compiler.load_compiled_function``; checked at run time,
  tested with torch 2.13), or
  an AOT compile that fails for any other reason: the module is compiled with plain ``torch.compile(module,
  **options)`` (compile_cache's path, without its artifact);
- a call whose inputs the compiled function's guards refuse (another shape, dtype or device, grad mode switched):
  that call, and every later one, goes through the same plain ``torch.compile``, which compiles for it as usual.

The key is compile_cache's (:func:`~weightcache.torch_compile_key.compile_key`: torch, Triton, Python, device,
options, dtype) under the kind ``"torch.aot_compile"``, with the example inputs' shapes, dtypes and devices, the
grad mode, and a digest of the source of every class the module is made of (a code change is a miss, not a
stale function). The trust rule is compile_cache's: the artifact is code (torch pickles it), so only artifacts
this uid published are loaded. Nothing here raises for the cache's sake. Layer L3.
"""

from __future__ import annotations

import hashlib
import importlib
import inspect
import io
import json
import logging
import os
import sys
import tempfile
import time
import types
from collections.abc import Callable, Mapping, Sequence
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
from .torch_compile_blob import loaded_kernels, pack, restore_kernels, unpack
from .torch_compile_key import compile_key, refuse_clashes

log = logging.getLogger("weightcache.artifacts")

#: The artifact kind :func:`precompile` publishes.
PRECOMPILE_KIND = "torch.aot_compile"


@attrs.frozen
class PrecompileStats:
    """What one :func:`precompile` did.

    Attributes:
        source: ``"keeper"`` (loaded: no trace, no compile), ``"compiled"`` (compiled ahead of time here, and
            published unless ``published_bytes`` is 0: no keeper, or it refused), or ``"torch.compile"`` (the AOT
            path did not apply: plain ``torch.compile``; see ``reason``).
        loaded_bytes: size of the artifact loaded (0 for none).
        kernels_restored: C++ kernels (CPU) written into the local inductor cache directory from the artifact.
        load_s: seconds to load the compiled function from the artifact (0 for none).
        compile_s: seconds the AOT compile took here (0 on a load).
        published_bytes: size of the artifact published (0 for none).
        reason: why nothing was loaded (a miss), or why the AOT path does not apply; None after a load.
        fallback_calls: calls run through plain ``torch.compile`` because the compiled function's guards refused
            one: the refused call and every call after it.
    """

    source: str = "compiled"
    loaded_bytes: int = 0
    kernels_restored: int = 0
    load_s: float = 0.0
    compile_s: float = 0.0
    published_bytes: int = 0
    reason: str | None = None
    fallback_calls: int = 0


#: The guard types torch cannot serialize with a compiled function.
_UNSERIALIZABLE = (
    "DICT_VERSION", "NN_MODULE", "ID_MATCH", "FUNCTION_MATCH", "CLASS_MATCH", "MODULE_MATCH", "CLOSURE_MATCH",
    "WEAKREF_ALIVE",
)  # fmt: skip


def guard_filter(closure: Sequence[str] = ()) -> Callable[[Sequence[Any]], list[bool]]:
    """Which of dynamo's guards a precompiled forward keeps (torch's ``guard_filter_fn`` protocol): every guard but
    those on globals, those that name an object's identity (``ID_MATCH`` and the other types torch cannot
    serialize, as a guard's own type or one it derives from: identities differ in every process), and those on the
    traced function's ``closure`` variables (a decorator's wrapped function: torch cannot rebuild them when it
    loads). What they guarded is in the key instead: the source of the module's classes, their decorators
    included. Tensor, shape, constant, type and global-state guards (grad mode, autocast) stay and are checked on
    every call."""
    unserializable = set(_UNSERIALIZABLE)
    names = set(closure)
    prefixes = tuple(f"{name}{sep}" for name in closure for sep in (".", "[")) + tuple(f"L[{n!r}]" for n in closure)

    def keep(guard_entries: Sequence[Any]) -> list[bool]:
        kept = []
        for entry in guard_entries:
            types_ = {entry.guard_type, *(getattr(entry, "derived_guard_types", ()) or ())}
            on_closure = str(entry.name) in names or (bool(prefixes) and str(entry.name).startswith(prefixes))
            kept.append(not (entry.is_global or types_ & unserializable or on_closure))
        return kept

    return keep


def join_saved(modules: Mapping[str, str], saved: bytes) -> bytes:
    """The artifact's bundle: a JSON line naming the modules dynamo installed as globals of the compiled
    bytecode (``{"modules": {global name: module name}}``), a NUL byte, then torch's saved function."""
    return json.dumps({"modules": dict(modules)}, sort_keys=True).encode() + b"\0" + saved


def split_saved(bundle: bytes) -> tuple[dict[str, str], bytes]:
    """:func:`join_saved`'s parts; ValueError if the bundle is not one."""
    head, sep, saved = bundle.partition(b"\0")
    if not sep:
        raise ValueError("the artifact's bundle has no header line (not a precompiled forward)")
    try:
        modules = json.loads(head)["modules"]
    except (ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"the artifact's header is not JSON naming its modules: {exc}") from exc
    if not isinstance(modules, dict) or not all(
        isinstance(k, str) and k.startswith("_") and isinstance(v, str) for k, v in modules.items()
    ):
        raise ValueError("the artifact's header must map dynamo's global names to module names")
    return modules, saved


def _global_names() -> dict[int, set[str]]:
    """The global names of every imported module, by the id of its namespace."""
    return {id(m.__dict__): set(m.__dict__) for m in list(sys.modules.values()) if isinstance(m, types.ModuleType)}


def _installed_modules(before: Mapping[int, set[str]]) -> dict[str, str]:
    """The globals that hold a module and were not there ``before`` (:func:`_global_names`), by name: what dynamo
    installed in the namespaces of the functions it traced (``___module_<name>_<id>_c0``, ``_<id>_c0``), which
    its compiled bytecode and guards look up by those names. Process-specific names, so the artifact carries them
    with the module each names, and a load puts them in the compiled function's globals."""
    found: dict[str, str] = {}
    for module in list(sys.modules.values()):
        if not isinstance(module, types.ModuleType):
            continue
        scope = module.__dict__
        old = before.get(id(scope), set())
        for name, value in list(scope.items()):
            if name not in old and isinstance(value, types.ModuleType) and name.startswith("_"):
                found[name] = value.__name__
    return found


def resolve_module(name: str) -> types.ModuleType:
    """The module called ``name`` in this process: imported, or reached by attributes from the longest prefix that
    imports (``torch.ops._quantized`` is an attribute of ``torch.ops``, not an importable module)."""
    found = sys.modules.get(name)
    if isinstance(found, types.ModuleType):
        return found
    parts = name.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value: object = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for attr in parts[cut:]:
            value = getattr(value, attr)
        if not isinstance(value, types.ModuleType):
            raise ImportError(f"{name} is a {type(value).__name__} here, not a module")
        return value
    raise ImportError(f"no module {name} here")


def wrapped_functions(module: torch.nn.Module) -> dict[str, object]:
    """The functions that decorators hide behind the methods of ``module``'s classes (``functools.wraps``'s
    ``__wrapped__`` chain; transformers decorates ``forward``), by a name that is the same in every process: dynamo
    traces the inner function, which pickle cannot name (its qualified name leads to the wrapper). They travel as
    torch's ``external_data``: named when saved, supplied from this process's classes when loaded."""
    found: dict[str, object] = {}
    for sub in module.modules():
        for cls in type(sub).__mro__:
            if cls in (torch.nn.Module, object):
                continue
            for attr, value in vars(cls).items():
                inner, depth = getattr(value, "__wrapped__", None), 1
                while inner is not None and depth <= 8:
                    found.setdefault(f"{cls.__module__}.{cls.__qualname__}.{attr}#wrapped{depth}", inner)
                    inner, depth = getattr(inner, "__wrapped__", None), depth + 1
    return found


def _source_digest(module: torch.nn.Module) -> dict[str, str]:
    """``{qualified class name: SHA-256 of its source}`` for every class ``module`` is made of; a class whose
    source cannot be read is recorded by its name alone (``"unreadable"``)."""
    digests: dict[str, str] = {}
    for sub in module.modules():
        cls = type(sub)
        name = f"{cls.__module__}.{cls.__qualname__}"
        if name in digests:
            continue
        try:
            digests[name] = hashlib.sha256(inspect.getsource(cls).encode()).hexdigest()[:16]
        except (OSError, TypeError):
            digests[name] = "unreadable"
    return dict(sorted(digests.items()))


def _describe(value: object) -> object:
    """What of an example input decides the compiled function: a tensor's shape, dtype, device and grad flag;
    containers walked; anything else by type and value (``repr``, cut at 200 characters)."""
    if isinstance(value, torch.Tensor):
        return [list(value.shape), str(value.dtype), str(value.device), bool(value.requires_grad)]
    if isinstance(value, Mapping):
        return {str(k): _describe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_describe(v) for v in value]
    return f"{type(value).__name__}:{value!r:.200}"


def precompile_key(
    fingerprint: Fingerprint | None,
    module: torch.nn.Module,
    args: Sequence[Any],
    kwargs: Mapping[str, Any] | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    extra: Mapping[str, Any] | None = None,
) -> ArtifactKey:
    """The :class:`ArtifactKey` of a precompiled forward: compile_cache's fields (:func:`compile_key`) with the
    example inputs as ``shapes``, plus the grad mode and the digest of the module's classes' source."""
    sources = hashlib.sha256(repr(_source_digest(module)).encode()).hexdigest()[:32]
    refuse_clashes(extra, {"forward", "source", "grad"})
    base = compile_key(
        fingerprint,
        options=options,
        device=device,
        dtype=dtype,
        shapes=_describe([list(args), dict(kwargs or {})]),
        extra={
            "forward": f"{type(module).__module__}.{type(module).__qualname__}",
            "source": sources,
            "grad": torch.is_grad_enabled(),
            **dict(extra or {}),
        },
    )
    return ArtifactKey(PRECOMPILE_KIND, base.fields)


def aot_available() -> str | None:
    """None where this torch has the AOT path; otherwise why not."""
    if not hasattr(torch.compiler, "load_compiled_function"):
        return f"torch {torch.__version__} has no torch.compiler.load_compiled_function, the AOT path's loader"
    if not hasattr(torch._dynamo.config, "enable_aot_compile"):
        return f"torch {torch.__version__} has no torch._dynamo.config.enable_aot_compile, the AOT path's switch"
    return None


def _aot_compile(compile_options: Mapping[str, Any], forward: Any, example: tuple[Any, ...]) -> Any:
    """``torch.compile(forward).aot_compile(example)``. A compiled function has ``aot_compile`` only while
    ``torch._dynamo.config.enable_aot_compile`` is on at the compile: torch 2.13 turns it on by default, torch 2.11
    (what the H200 has) off, so it is switched on for this one call."""
    with torch._dynamo.config.patch(enable_aot_compile=True):
        compiled: Any = torch.compile(forward, fullgraph=True, **compile_options)
    return compiled.aot_compile(example)


class Precompiled:
    """``module``'s forward, compiled ahead of time or loaded from the keeper (see :func:`precompile`). Call it as
    you would call the module.

    Attributes:
        key: the artifact's key (:func:`precompile_key`).
        stats: where the forward came from, and how many calls fell back to plain ``torch.compile``.
        artifact: the artifact held (leased, re-published if the keeper restarts) until :meth:`close`.
    """

    def __init__(
        self,
        fingerprint: Fingerprint | str,
        module: torch.nn.Module,
        key: ArtifactKey,
        cache: Cache,
        options: Mapping[str, Any],
        *,
        hold: bool = True,
    ) -> None:
        self.fingerprint = fingerprint
        self.module = module
        self.key = key
        self.cache = cache
        self.options = {k: v for k, v in options.items() if k != "fullgraph"}
        self.hold = hold
        self.stats = PrecompileStats()
        self.artifact: Artifact | None = None
        self._function: Any = None
        self._fallback: Callable[..., Any] | None = None
        #: The SHA-256 of a blob at this key that could not be loaded: the publish replaces it.
        self._replace: str | None = None

    @property
    def weights(self) -> str:
        return weights_digest(self.fingerprint)

    # -- building ---------------------------------------------------------------------------------------------

    def build(self, args: Sequence[Any], kwargs: Mapping[str, Any]) -> None:
        """Load the forward from the keeper, or compile it for ``args``/``kwargs`` and publish it, or (where the
        AOT path does not apply) settle for plain ``torch.compile``."""
        unavailable = aot_available()
        if unavailable is not None:
            self._settle_for_torch_compile(unavailable)
            return
        reason = self._load()
        if self._function is not None:
            return
        started = time.perf_counter()
        before = _global_names()
        try:
            closure = type(self.module).forward.__code__.co_freevars
            extra = {"guard_filter_fn": guard_filter(closure)}
            options = {**self.options, "options": {**dict(self.options.get("options") or {}), **extra}}
            self._take(_aot_compile(options, type(self.module).forward, ((self.module, *args), dict(kwargs))))
        except Exception as exc:  # a graph break, an unsupported construct: torch.compile as usual
            self._settle_for_torch_compile(
                f"the AOT compile of {type(self.module).__qualname__}.forward failed "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}): the AOT path needs the "
                "forward as one graph (no graph break) with guards torch can save"
            )
            return
        compile_s = time.perf_counter() - started
        self.stats = attrs.evolve(self.stats, source="compiled", compile_s=round(compile_s, 3), reason=reason)
        self._publish(started_wall=time.time() - compile_s - 1.0, modules=_installed_modules(before))

    def _take(self, function: Any) -> None:
        """Call ``function`` from now on. :meth:`__call__` checks its guards once, before each call (a refusal goes to
        torch.compile), so the function's own second check of the same guards is turned off."""
        function.disable_guard_check()
        self._function = function

    def _settle_for_torch_compile(self, reason: str) -> None:
        log.warning("weightcache: %s; using torch.compile instead (compiled in this process)", reason)
        self._function = None
        self.stats = attrs.evolve(self.stats, source="torch.compile", reason=reason)

    def _load(self) -> str | None:
        """Load the keeper's artifact into :attr:`_function`; the reason for a miss, or None after a load."""
        if switched_off():
            return f"{SWITCH_ENV}=off"
        found = self.cache.open_artifact(self.fingerprint, self.key)
        if found is None:
            reason = self.cache.miss_reason(self.fingerprint, self.key)
            return reason or f"no {PRECOMPILE_KIND} artifact in the keeper for this key"
        if found.info.publisher != os.getuid():
            found.close()
            return f"the keeper's {PRECOMPILE_KIND} artifact was published by uid {found.info.publisher}, not this uid"
        blob = found.read()
        if blob is None:
            found.close()
            return f"the keeper's {PRECOMPILE_KIND} artifact could not be read"
        started = time.perf_counter()
        try:
            data, kernels = unpack(blob)
            modules, saved = split_saved(data)
            restored = restore_kernels(kernels)
            scope = {**type(self.module).forward.__globals__}
            scope.update({name: resolve_module(module) for name, module in modules.items()})
            function = torch.compiler.load_compiled_function(
                io.BytesIO(saved), f_globals=scope, external_data=wrapped_functions(self.module)
            )
        except Exception as exc:  # refused: compile, and the publish replaces it
            found.close()
            log.warning(
                "weightcache: %s artifact for %s could not be loaded (%s); compiling ahead of time again",
                PRECOMPILE_KIND,
                self.weights[:12],
                exc,
            )
            self._replace = hashlib.sha256(blob).hexdigest()
            return f"the artifact could not be loaded: {exc}"
        self._take(function)
        if self.hold:
            self.artifact = found
        else:
            found.close()
        self.stats = attrs.evolve(
            self.stats,
            source="keeper",
            loaded_bytes=len(blob),
            kernels_restored=restored,
            load_s=round(time.perf_counter() - started, 3),
            reason=None,
        )
        log.info("weightcache: loaded %s artifact for %s (%d bytes)", PRECOMPILE_KIND, self.weights[:12], len(blob))
        return None

    def _publish(self, started_wall: float, modules: Mapping[str, str]) -> None:
        if switched_off():
            return
        with tempfile.TemporaryDirectory(prefix="wc-precompile-") as scratch:
            path = os.path.join(scratch, "forward.pt2")
            try:
                self._function.save_compiled_function(path, external_data=wrapped_functions(self.module))
            except Exception as exc:
                log.warning("weightcache: the compiled forward could not be saved (%s); nothing published", exc)
                return
            with open(path, "rb") as f:
                data = join_saved(modules, f.read())
        kernels = {path: file.read_bytes() for path, file in loaded_kernels(since=started_wall).items()}
        blob = pack(data, kernels)
        try:
            artifact = self.cache.put_artifact(self.fingerprint, self.key, blob, hold=self.hold, replace=self._replace)
        except WeightCacheError as exc:
            log.warning(
                "weightcache: could not publish the %s artifact for %s: %s", PRECOMPILE_KIND, self.weights[:12], exc
            )
            return
        self.artifact = artifact if self.hold else None
        self.stats = attrs.evolve(self.stats, published_bytes=len(blob))
        log.info(
            "weightcache: published %s artifact (%d bytes, %d C++ kernels)", PRECOMPILE_KIND, len(blob), len(kernels)
        )

    # -- calling ----------------------------------------------------------------------------------------------

    def _torch_compile(self) -> Callable[..., Any]:  # (options without fullgraph: the reason it fell back)
        if self._fallback is None:
            self._fallback = torch.compile(self.module, **self.options)
        return self._fallback

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        function = self._function
        if function is None:
            if self.stats.fallback_calls:  # after a refusal: every call is a fallback call
                self.stats = attrs.evolve(self.stats, fallback_calls=self.stats.fallback_calls + 1)
            return self._torch_compile()(*args, **kwargs)
        if not function.guard_check(self.module, *args, **kwargs):
            if self.stats.fallback_calls == 0:
                log.warning(
                    "weightcache: the precompiled forward of %s does not serve this call (its guards refuse these "
                    "inputs: another shape, dtype, device or grad mode than the example); this and later calls go "
                    "through torch.compile",
                    type(self.module).__qualname__,
                )
            self._function = None
            self.stats = attrs.evolve(self.stats, fallback_calls=self.stats.fallback_calls + 1)
            return self._torch_compile()(*args, **kwargs)
        return function(self.module, *args, **kwargs)

    def close(self) -> None:
        """Let go of the artifact held (it stays in the keeper, unleased)."""
        if self.artifact is not None:
            self.artifact.close()
            self.artifact = None

    def __enter__(self) -> Precompiled:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def precompile(
    weights: Handle | Fingerprint | str,
    module: torch.nn.Module,
    args: Sequence[Any] = (),
    kwargs: Mapping[str, Any] | None = None,
    *,
    options: Mapping[str, Any] | None = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    extra: Mapping[str, Any] | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    hold: bool = True,
) -> Precompiled:
    """``module``'s forward for inputs like ``args``/``kwargs``, loaded from the keeper (no dynamo trace, no
    inductor compile) or compiled ahead of time here and published: a :class:`Precompiled`, called as the module
    is. ``weights``: an attached :class:`Handle`, a :class:`Fingerprint` or a weights digest (the artifact is
    filed under them). ``options``: what you would give ``torch.compile`` (``backend``, ``mode``, ``dynamic``,
    ``options``; ``fullgraph`` is always on); they, ``dtype`` and ``extra`` join the key. ``hold``: keep the
    artifact leased until :meth:`Precompiled.close`.

    Where the AOT path does not apply (a graph break, a torch without it), the result calls plain
    ``torch.compile(module, **options)`` and ``stats.reason`` says why; nothing here raises for the cache's sake.
    Run it under the grad mode you will call it in (``torch.no_grad()`` for inference): the compiled function's
    guards hold it."""
    if isinstance(weights, Handle):
        fingerprint: Fingerprint | str = weights.fingerprint
    else:
        fingerprint = weights
    fp = fingerprint if isinstance(fingerprint, Fingerprint) else None
    kwargs = dict(kwargs or {})
    options = dict(options or {})
    key = precompile_key(fp, module, args, kwargs, options=options, device=device, dtype=dtype, extra=extra)
    result = Precompiled(fingerprint, module, key, Cache(socket_dir), options, hold=hold)
    try:
        result.build(args, kwargs)
    except WeightCacheError as exc:  # the keeper went away mid-way: the module still runs
        result._settle_for_torch_compile(f"the keeper failed: {exc}")
    return result


__all__ = ["PRECOMPILE_KIND", "PrecompileStats", "Precompiled", "aot_available", "precompile", "precompile_key"]

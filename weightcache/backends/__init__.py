"""Engine adapters, one module per engine, behind one interface (:class:`~weightcache.backends.base.Backend`).

>>> import weightcache.backends as backends
>>> backends.names()
['sglang', 'torch', 'vllm']
>>> backends.get("vllm").available()      # is vLLM importable here? (vLLM itself is not imported)

Built-in adapters: ``torch`` (plain ``nn.Module``: :func:`weightcache.attach`), ``vllm`` (a model loader under
the load format ``weightcache``, registered by a ``vllm.general_plugins`` entry point) and ``sglang`` (a loader
class to pass as ``LoadConfig(load_format=...)``). Other engines add theirs with :func:`register`. Importing
this package never imports an engine. See docs/backends.md.
"""

from __future__ import annotations

import importlib
import typing

from .. import errors as _errors
from .engine_config import QuantSpec
from .template import Backend, LoaderOptions

_builtin: dict[str, str] = {
    "torch": "weightcache.backends.torch:TorchBackend",
    "vllm": "weightcache.backends.vllm:VllmBackend",
    "sglang": "weightcache.backends.sglang:SglangBackend",
}
_registry: dict[str, Backend] = {}
_B = typing.TypeVar("_B", bound=type[Backend])


def register(cls: _B, *, replace: bool = False) -> _B:
    """Register an adapter class under its ``name`` (usable as a decorator). Returns the class.

    Raises :class:`~weightcache.errors.InvalidArgument` (a ValueError) if the name is taken (pass ``replace=True``
    to override on purpose) and :class:`~weightcache.errors.InvalidArgumentType` (also a TypeError) if ``cls`` is
    not a complete :class:`Backend` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, Backend)):
        raise _errors.InvalidArgumentType(f"register() expects a weightcache.backends.Backend subclass; found {cls!r}")
    for attr in ("name", "module"):
        if not isinstance(getattr(cls, attr, None), str) or not getattr(cls, attr):
            raise _errors.InvalidArgumentType(
                f"{cls.__qualname__} must set the class attribute {attr} to a non-empty string"
            )
    if getattr(cls, "__abstractmethods__", None):
        missing = ", ".join(sorted(cls.__abstractmethods__))
        raise _errors.InvalidArgumentType(f"{cls.__qualname__} does not implement {missing}")
    name = cls.name
    if (name in _registry or name in _builtin) and not replace:
        raise _errors.InvalidArgument(
            f"an engine adapter named {name!r} is already registered; pass replace=True to override it"
        )
    _builtin.pop(name, None)
    _registry[name] = cls()
    return cls


def get(name: str) -> Backend:
    """The adapter registered under ``name``. Raises KeyError naming the known adapters."""
    backend = _registry.get(name)
    if backend is not None:
        return backend
    target = _builtin.get(name)
    if target is None:
        raise KeyError(f"no engine adapter named {name!r}; known adapters: {', '.join(names())}")
    module_name, _, cls_name = target.partition(":")
    cls: type[Backend] = getattr(importlib.import_module(module_name), cls_name)
    backend = _registry[name] = cls()
    return backend


def names() -> list[str]:
    """Names of every registered adapter (built-in ones included, whether or not their engine is installed)."""
    return sorted(set(_registry) | set(_builtin))


__all__ = ["Backend", "LoaderOptions", "QuantSpec", "get", "names", "register"]

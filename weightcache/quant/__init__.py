"""Quantization strategies: which methods' output may be shared between processes, and why not.

>>> import weightcache.quant as q
>>> q.get("fp8_block").ipc_safe
True
>>> q.get("gptq").check()  # raises UnsupportedQuantError naming the method and the reason

Engines add methods with :func:`register`.
"""

from __future__ import annotations

from typing import TypeVar

from .. import errors as _errors
from ..errors import UnsupportedQuantError
from .awq import AWQ
from .base import QuantStrategy
from .fp8 import FP8Block, FP8PerTensor
from .gptq import GPTQ
from .marlin import Marlin
from .unquantized import Unquantized

_registry: dict[str, QuantStrategy] = {}
S = TypeVar("S", bound=type[QuantStrategy])


def register(cls: S, *, replace: bool = False) -> S:
    """Register a strategy class under its ``name`` (usable as a decorator). Returns the class.

    Raises :class:`~weightcache.errors.InvalidArgument` (a ValueError) if the name is taken (pass
    ``replace=True`` to override on purpose) or the class is incomplete (no ``name``/``ipc_safe``, or refused
    without a ``reason``), and :class:`~weightcache.errors.InvalidArgumentType` (also a TypeError) if ``cls`` is
    not a :class:`QuantStrategy` subclass.
    """
    if not (isinstance(cls, type) and issubclass(cls, QuantStrategy)):
        raise _errors.InvalidArgumentType(f"register() expects a QuantStrategy subclass; found {cls!r}")
    name = getattr(cls, "name", None)
    if not isinstance(name, str) or not name:
        raise _errors.InvalidArgument(f"{cls.__qualname__} must set the class attribute name to a non-empty string")
    if not isinstance(getattr(cls, "ipc_safe", None), bool):
        raise _errors.InvalidArgument(f"{cls.__qualname__} must set the class attribute ipc_safe to True or False")
    if not cls.ipc_safe and not cls.reason:
        raise _errors.InvalidArgument(f"{cls.__qualname__} is not ipc_safe, so it must say why in the attribute reason")
    if name in _registry and not replace:
        raise _errors.InvalidArgument(
            f"quantization method {name!r} is already registered ({type(_registry[name]).__qualname__}); "
            "pass replace=True to override it"
        )
    _registry[name] = cls()
    return cls


def get(name: str) -> QuantStrategy:
    """The strategy registered under ``name``; UnsupportedQuantError if there is none."""
    try:
        return _registry[name]
    except (KeyError, TypeError):
        raise UnsupportedQuantError(
            f"unknown quantization method {name!r}; known methods: {', '.join(sorted(_registry))}. "
            "Register new ones with weightcache.quant.register()."
        ) from None


def methods() -> dict[str, QuantStrategy]:
    """All registered strategies by name."""
    return dict(_registry)


def safe_methods() -> list[str]:
    """Names of the methods whose output may be shared."""
    return sorted(n for n, s in _registry.items() if s.ipc_safe)


for _cls in (Unquantized, FP8Block, FP8PerTensor, Marlin, AWQ, GPTQ):
    register(_cls)

__all__ = [
    "AWQ",
    "FP8Block",
    "FP8PerTensor",
    "GPTQ",
    "Marlin",
    "QuantStrategy",
    "Unquantized",
    "get",
    "methods",
    "register",
    "safe_methods",
]

"""The plain ``torch.nn.Module`` adapter: :func:`weightcache.attach` seen as a backend.

A model written directly in torch has no loader of its own, so :func:`weightcache.attach` is the whole
integration for most users: build the model on the meta device, attach, run. This adapter names that engine in
the registry, maps quantization the way ``attach(quant=...)`` does (by weightcache strategy name), and
implements the backend hooks for a model given as a factory (:class:`ModuleLoad`), so that code written against
:class:`~weightcache.backends.Backend` serves plain modules too. Both paths make the same fingerprint for the
same checkpoint and settings, so they share entries.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from ..api import attach
from ..binding import bind
from ..errors import InvalidArgumentType
from ..loader import load_weights
from .engine_config import QuantSpec
from .template import Backend


@attrs.frozen
class ModuleLoad:
    """The torch adapter's context: how to build the model, and where its weights are.

    Attributes:
        build: makes the model (called under ``torch.device("meta")``).
        checkpoint: the safetensors checkpoint.
        device: where the weights live.
        dtype: convert floating point weights to this dtype on load.
    """

    build: Callable[[], nn.Module]
    checkpoint: str | os.PathLike[str]
    device: torch.device = attrs.field(default=torch.device("cpu"), converter=torch.device)
    dtype: torch.dtype | None = None


class TorchBackend(Backend):
    """Plain torch models, through :func:`weightcache.attach` (or :meth:`load_model` with a :class:`ModuleLoad`)."""

    name: ClassVar[str] = "torch"
    module: ClassVar[str] = "torch"
    install_hint: ClassVar[str] = "Install PyTorch (`pip install torch`)."
    #: A plain module's entry is the checkpoint's tensors whatever model they go to (binding checks each one),
    #: and :func:`weightcache.attach` shares these entries: no structure in the fingerprint, as there.
    records_structure: ClassVar[bool] = False

    def quant(self, engine_quant: object) -> QuantSpec:
        """``None`` or a strategy name (``"fp8_block"``), optionally as ``(name, config)``."""
        if engine_quant is None:
            return QuantSpec("none")
        if isinstance(engine_quant, str):
            return QuantSpec(engine_quant)
        if isinstance(engine_quant, tuple) and len(engine_quant) == 2 and isinstance(engine_quant[0], str):
            config = engine_quant[1]
            return QuantSpec(engine_quant[0], dict(config) if config is not None else None)
        raise InvalidArgumentType(
            f"torch adapter: quantization must be None, a method name or (name, config); found {engine_quant!r}"
        )

    def build_model(self, context: ModuleLoad) -> nn.Module:
        return context.build()

    def load_from_disk(self, context: ModuleLoad) -> nn.Module:
        # Built on the real device, so that buffers the model computes when built (rotary tables, masks) are
        # real too; the checkpoint's tensors then replace the initialised ones.
        with torch.device(context.device):
            model = context.build()
        bind(model, load_weights(context.checkpoint, context.device, context.dtype), device=context.device)
        return model

    @staticmethod
    def attach(*args: Any, **kwargs: Any) -> Any:
        """:func:`weightcache.attach`."""
        return attach(*args, **kwargs)


__all__ = ["ModuleLoad", "TorchBackend"]

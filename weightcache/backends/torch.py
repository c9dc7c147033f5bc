"""The plain ``torch.nn.Module`` adapter: :func:`weightcache.attach` seen as a backend.

A model written directly in torch has no loader of its own, so :func:`weightcache.attach` is the whole
integration: build the model on the meta device, attach, run. This adapter names that engine in the registry
and maps quantization the way ``attach(quant=...)`` does: by weightcache strategy name.
"""

from __future__ import annotations

from typing import Any, ClassVar

from .base import Backend, QuantSpec


class TorchBackend(Backend):
    """Plain torch models, through :func:`weightcache.attach`."""

    name: ClassVar[str] = "torch"
    module: ClassVar[str] = "torch"
    install_hint: ClassVar[str] = "Install PyTorch (`pip install torch`)."

    def quant(self, engine_quant: object) -> QuantSpec:
        """``None`` or a strategy name (``"fp8_block"``), optionally as ``(name, config)``."""
        if engine_quant is None:
            return QuantSpec("none")
        if isinstance(engine_quant, str):
            return QuantSpec(engine_quant)
        if isinstance(engine_quant, tuple) and len(engine_quant) == 2 and isinstance(engine_quant[0], str):
            config = engine_quant[1]
            return QuantSpec(engine_quant[0], dict(config) if config is not None else None)
        raise TypeError(
            f"torch adapter: quantization must be None, a method name or (name, config); found {engine_quant!r}"
        )

    @staticmethod
    def attach(*args: Any, **kwargs: Any) -> Any:
        """:func:`weightcache.attach`."""
        from ..attach import attach

        return attach(*args, **kwargs)

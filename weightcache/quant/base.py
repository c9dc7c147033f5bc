"""The quantization strategy interface: one class per method, declaring whether its output may be shared.

Sharing is safe only when everything the engine needs after post-processing lives in the tensors that are
published. A method that keeps Python-side state (repacked layouts recorded in attributes, mutable workspaces,
shuffled index tables built at load time) cannot be re-created by binding tensors alone, so it is refused.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, ClassVar

from ..errors import UnsupportedQuantError


class QuantStrategy:
    """Base class of quantization strategies. Subclass it and :func:`weightcache.quant.register` the class.

    Class attributes:
        name: the method name used in fingerprints and by ``attach(quant=...)``.
        ipc_safe: whether the post-processed tensors alone reproduce the method's state in another process.
        reason: why the method is refused (required when ``ipc_safe`` is False).
    """

    name: ClassVar[str]
    ipc_safe: ClassVar[bool]
    reason: ClassVar[str | None] = None

    def check(self, config: Mapping[str, Any] | None = None) -> None:
        """Raise :class:`UnsupportedQuantError` unless weights quantized this way (with ``config``) can be
        published and attached. Subclasses that are safe only for some configs extend this."""
        if not self.ipc_safe:
            raise UnsupportedQuantError(
                f"quantization method {self.name!r} cannot be shared through weightcache: {self.reason}. "
                "Use mode='off' for this model, or a method from weightcache.quant.safe_methods()."
            )

    def __repr__(self) -> str:
        state = "ipc_safe" if self.ipc_safe else f"refused: {self.reason}"
        return f"<{type(self).__name__} {self.name!r} {state}>"

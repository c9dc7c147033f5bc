"""weightcache: keep post-processed model weights resident outside the engine and attach them zero-copy.

The public names are re-exported here. Names that need torch (``attach``, ``Cache``, ``Handle``, ``bind``)
load on first use, so that the keeper and the CLI's keeper commands start without importing torch.
"""

from __future__ import annotations

import sys
import types
from typing import TYPE_CHECKING, Any

from . import quant
from ._version import __version__
from .errors import (
    BackendConfigError,
    BackendError,
    BindError,
    BudgetExceeded,
    CheckpointError,
    EngineNotInstalled,
    EntryNotFound,
    FallbackWarning,
    FingerprintMismatch,
    KeeperAlreadyRunning,
    KeeperError,
    KeeperForbidden,
    KeeperUnavailable,
    ManifestError,
    PeerRejected,
    ProtocolError,
    ProtocolVersionError,
    SegmentError,
    SocketDirError,
    UnsupportedQuantError,
    WeightCacheError,
)
from .fingerprint import Fingerprint
from .manifest import Manifest
from .standby import Leadership

if TYPE_CHECKING:
    from .attach import attach
    from .binding import bind
    from .cache import Cache, EntryInfo, Handle

_LAZY = {
    "attach": "attach",
    "bind": "binding",
    "Cache": "cache",
    "EntryInfo": "cache",
    "Handle": "cache",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'weightcache' has no attribute {name!r}")
    import importlib

    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


class _Package(types.ModuleType):
    """Keeps ``weightcache.attach`` the function when the submodule of the same name is first imported directly
    (``from weightcache.attach import ...``): the import system then binds the submodule on the package, which
    would shadow the function for everyone after."""

    def __setattr__(self, name: str, value: Any) -> None:
        if isinstance(value, types.ModuleType) and _LAZY.get(name) == name and value.__name__ == f"{__name__}.{name}":
            value = getattr(value, name)
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package


__all__ = [
    "BackendConfigError",
    "BackendError",
    "BindError",
    "BudgetExceeded",
    "Cache",
    "CheckpointError",
    "EngineNotInstalled",
    "EntryInfo",
    "EntryNotFound",
    "FallbackWarning",
    "Fingerprint",
    "FingerprintMismatch",
    "Handle",
    "KeeperAlreadyRunning",
    "KeeperError",
    "KeeperForbidden",
    "KeeperUnavailable",
    "Leadership",
    "Manifest",
    "ManifestError",
    "PeerRejected",
    "ProtocolError",
    "ProtocolVersionError",
    "SegmentError",
    "SocketDirError",
    "UnsupportedQuantError",
    "WeightCacheError",
    "__version__",
    "attach",
    "bind",
    "quant",
]

"""weightcache: keep post-processed model weights resident outside the engine and attach them zero-copy.

The public names are re-exported here. Names that need torch (``attach``, ``Cache``, ``Handle``, ``bind``)
load on first use, so that the keeper and the CLI's keeper commands start without importing torch.
"""

from __future__ import annotations

import importlib
import typing

from . import quant
from ._version import __version__
from .artifact_key import ArtifactKey
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
    GraphDescriptionError,
    GraphRestoreError,
    InvalidArgument,
    InvalidArgumentType,
    KeeperAlreadyRunning,
    KeeperError,
    KeeperForbidden,
    KeeperNotResponding,
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
from .messages import ArtifactInfo, EntryInfo

if typing.TYPE_CHECKING:
    from .api import attach, preload
    from .artifacts import Artifact
    from .binding import bind
    from .cache import Cache
    from .handle import Handle
    from .standby import Leadership
    from .torch_compile import CompileCache, compile_cache
    from .torch_graphs import CudaGraph, GraphCache, keep_kernel_images, stop_keeping_kernel_images
    from .torch_precompile import Precompiled, precompile

# Names imported on first use (PEP 562): those that need torch, so that the keeper and the CLI's keeper commands
# import this package without importing torch, and those a restarted engine's attach does not need, so that it
# does not pay for importing them. No submodule is named like one of these, so none can shadow it.
_LAZY = {
    "attach": "api",
    "preload": "api",
    "bind": "binding",
    "Cache": "cache",
    "Artifact": "artifacts",
    "CompileCache": "torch_compile",
    "compile_cache": "torch_compile",
    "Precompiled": "torch_precompile",
    "precompile": "torch_precompile",
    "Handle": "handle",
    "Leadership": "standby",
    "CudaGraph": "torch_graphs",
    "GraphCache": "torch_graphs",
    "keep_kernel_images": "torch_graphs",
    "stop_keeping_kernel_images": "torch_graphs",
}


#: The submodules the docs name through ``wc.``: imported on first use like the names above.
_SUBMODULES = frozenset({"backends", "graphs", "loaders", "quant", "torch_compile", "torch_graphs", "torch_precompile"})


def __getattr__(name: str) -> typing.Any:
    module = _LAZY.get(name)
    if module is None:
        if name in _SUBMODULES:  # not imported yet (``wc.torch_compile.compile_key``): as ``import weightcache.NAME``
            return importlib.import_module(f".{name}", __name__)
        raise AttributeError(f"module 'weightcache' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{module}", __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))


__all__ = [
    "Artifact",
    "ArtifactInfo",
    "ArtifactKey",
    "BackendConfigError",
    "BackendError",
    "BindError",
    "BudgetExceeded",
    "Cache",
    "CheckpointError",
    "CompileCache",
    "CudaGraph",
    "EngineNotInstalled",
    "EntryInfo",
    "EntryNotFound",
    "FallbackWarning",
    "Fingerprint",
    "FingerprintMismatch",
    "GraphCache",
    "GraphDescriptionError",
    "GraphRestoreError",
    "Handle",
    "InvalidArgument",
    "InvalidArgumentType",
    "KeeperAlreadyRunning",
    "KeeperError",
    "KeeperForbidden",
    "KeeperNotResponding",
    "KeeperUnavailable",
    "Leadership",
    "Manifest",
    "ManifestError",
    "PeerRejected",
    "Precompiled",
    "ProtocolError",
    "ProtocolVersionError",
    "SegmentError",
    "SocketDirError",
    "UnsupportedQuantError",
    "WeightCacheError",
    "__version__",
    "attach",
    "bind",
    "compile_cache",
    "keep_kernel_images",
    "precompile",
    "preload",
    "quant",
    "stop_keeping_kernel_images",
]

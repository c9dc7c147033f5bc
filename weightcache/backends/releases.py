"""The releases of an engine that an adapter supports, and the words for an engine outside them.

Engines change their loader internals every release, and operators pin a release to their CUDA and PyTorch. An
adapter therefore declares a :class:`ReleaseRange`; an engine outside it loads with its own loader, with a
FallbackWarning that names the release and the range (``strict``: a BackendError), unless the operator sets
:data:`UNTESTED_ENGINES_ENV`. What differs between releases inside the range lives in one module per engine
(``vllm_releases``, ``sglang_releases``), which probes for features rather than comparing versions.

Imports no engine and no torch.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
from collections.abc import Iterable

import attrs
from packaging.version import InvalidVersion, Version

#: Set to 1 to let adapters run on engine releases outside their declared range (at your own risk: every feature
#: is still probed, and a missing one still falls back to the engine's own loader).
UNTESTED_ENGINES_ENV = "WEIGHTCACHE_UNTESTED_ENGINES"


@attrs.frozen
class ReleaseRange:
    """Releases ``oldest`` to ``newest`` of ``engine``, inclusive. ``newest`` may name a minor release
    (``"0.33"``: every 0.33.x). Local and development suffixes are ignored (``0.32.0+cpu`` is 0.32.0).

    Attributes:
        engine: the engine's name as users know it (``"vLLM"``).
        oldest: the oldest supported release.
        newest: the newest supported release (or minor series).
        tested: where each end is tested, for the docs and ``weightcache doctor``.
    """

    engine: str
    oldest: str
    newest: str
    tested: str = ""

    def __str__(self) -> str:
        newest = self.newest if self.newest.count(".") >= 2 else f"{self.newest}.x"
        return f"{self.engine} {self.oldest} to {newest}"

    def contains(self, version: str) -> bool:
        """Whether ``version`` lies in the range (False for a version that cannot be parsed)."""
        try:
            release = Version(version).release
        except InvalidVersion:
            return False
        top = Version(self.newest).release
        return Version(self.oldest).release <= release and release[: len(top)] <= top

    def problem(self, version: str) -> str | None:
        """None when the adapter supports ``version``; else why not, naming the release and the range, and
        what the operator can do."""
        if self.contains(version):
            return None
        if os.environ.get(UNTESTED_ENGINES_ENV) == "1":
            return None
        return (
            f"{self.engine} {version} is outside the releases this weightcache supports ({self}); install a "
            f"supported {self.engine} (or set {UNTESTED_ENGINES_ENV}=1 to try it anyway)"
        )


def missing_api(engine: str, required: Iterable[tuple[str, str]]) -> str | None:
    """The first ``(module, name)`` of ``required`` that the installed engine lacks, as a reason naming it; None
    when every one is there. Imports the modules (an adapter asks only when a load needs the engine anyway)."""
    for module_name, name in required:
        try:
            module = importlib.import_module(module_name)
        except Exception as exc:
            return f"the installed {engine} cannot import {module_name} ({type(exc).__name__}: {exc})"
        if hasattr(module, name):
            continue
        submodule = hasattr(module, "__path__") and importlib.util.find_spec(f"{module_name}.{name}") is not None
        if not submodule:
            return f"the installed {engine} has no {module_name}.{name}, which the weightcache adapter needs"
    return None


__all__ = ["UNTESTED_ENGINES_ENV", "ReleaseRange", "missing_api"]

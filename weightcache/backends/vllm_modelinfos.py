"""vLLM's model-info cache from the keeper: what vLLM learned of a model class, kept across an empty disk.

vLLM inspects a model class in a subprocess that imports the model's module (~12-14 s on an H200 when
``$VLLM_CACHE_ROOT/modelinfos`` is empty) and keeps what it found there, one JSON file per class with the hash of
the class's source file that vLLM checks before using it. :func:`restore_modelinfos` writes the keeper's files
where none are before vLLM looks; :func:`publish_modelinfos` publishes them after the engine started. The artifact
(kind :data:`MODELINFO_KIND`) is filed under :data:`MODELINFO_WEIGHTS`, not a weights digest: what vLLM learns of
a class does not depend on the weights.

Layer L4 (an engine adapter's). Packs and unpacks with :mod:`weightcache.backends.vllm_archive`, obeys the same
switches as the compile cache (:func:`~weightcache.backends.vllm_compile_key.switched_off`), imports vLLM only
inside functions, and never raises: a miss is logged and vLLM inspects the class as it would have. Its names are
re-exported by :mod:`weightcache.backends.vllm_compile`.
"""

from __future__ import annotations

import hashlib
import logging
import os
import sys
from pathlib import Path

from ..artifact_key import ArtifactKey
from ..cache import Cache
from .vllm_archive import pack, unpack_into
from .vllm_compile_key import switched_off

log = logging.getLogger("weightcache.artifacts")

#: The artifact kind of vLLM's model-info cache (``$VLLM_CACHE_ROOT/modelinfos``).
MODELINFO_KIND = "vllm.modelinfos"
#: What vLLM learns of a model class does not depend on weights: its artifact is filed under this constant
#: instead of a weights digest (the SHA-256 of ``b"vllm.modelinfos"``).
MODELINFO_WEIGHTS = hashlib.sha256(b"vllm.modelinfos").hexdigest()


def modelinfo_dir() -> Path:
    """vLLM's model-info cache: ``$VLLM_CACHE_ROOT/modelinfos`` (one JSON file per model class, with the hash of
    the class's source file that vLLM checks before using it)."""
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT) / "modelinfos"


def modelinfo_key() -> ArtifactKey:
    """The key of the model-info artifact: vLLM's and Python's versions (vLLM checks each file's source hash)."""
    import vllm

    return ArtifactKey(
        MODELINFO_KIND, {"vllm": vllm.__version__, "python": f"{sys.version_info[0]}.{sys.version_info[1]}"}
    )


def restore_modelinfos(cache: Cache) -> int:
    """Before vLLM inspects the model class (it does so in a subprocess that imports the model's module, ~12-14 s
    on the H200 when ``modelinfos`` is empty): write the keeper's model-info files where none are; how many were
    written. Never raises."""
    try:
        if switched_off() is not None:
            return 0
        found = cache.open_artifact(MODELINFO_WEIGHTS, modelinfo_key())
        if found is None:
            return 0
        try:
            if found.info.publisher != os.getuid():
                return 0
            blob = found.read()
        finally:
            found.close()
        written = unpack_into(blob or b"", modelinfo_dir()) if blob else {}
    except Exception as exc:
        log.warning("weightcache: vLLM's model-info cache was not restored (%s: %s)", type(exc).__name__, exc)
        return 0
    if written:
        log.info("weightcache: restored %d of vLLM's model-info files from the keeper", len(written))
    return len(written)


def publish_modelinfos(cache: Cache) -> bool:
    """After the engine started: publish vLLM's model-info files if the keeper's artifact lacks any of them (or
    holds other bytes); whether one was published. Never raises."""
    try:
        directory = modelinfo_dir()
        if switched_off() is not None or not directory.is_dir():
            return False
        blob, held = pack(directory, [directory], "")
        if not held:
            return False
        key = modelinfo_key()
        current = cache.get_artifact(MODELINFO_WEIGHTS, key)
        if current == blob:
            return False
        replace = hashlib.sha256(current).hexdigest() if current is not None else None
        artifact = cache.put_artifact(MODELINFO_WEIGHTS, key, blob, replace=replace)
        artifact.close()
    except Exception as exc:
        log.warning("weightcache: vLLM's model-info cache was not published (%s: %s)", type(exc).__name__, exc)
        return False
    log.info("weightcache: published vLLM's model-info cache (%d files)", len(held))
    return True


__all__ = [
    "MODELINFO_KIND",
    "MODELINFO_WEIGHTS",
    "modelinfo_dir",
    "modelinfo_key",
    "publish_modelinfos",
    "restore_modelinfos",
]

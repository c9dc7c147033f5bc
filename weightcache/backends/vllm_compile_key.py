"""vLLM's compile cache, what it is valid for: its artifact key, where vLLM keeps it, and when the adapter leaves it
alone.

:func:`artifact_key` is what a compile cache is valid for besides the weights (vLLM, torch, Triton and Python
versions; the device; vLLM's own config hash and compile-environment hash; both AOT switches; the rank; not the cache
root, whose absolute paths a restore relocates). :func:`switched_off` and :func:`not_compiled` say why an engine's
cache is left alone; :func:`vllm_counters` reads vLLM's own counters of what it compiled or loaded.

Layer L4 (an engine adapter's). Asks vLLM (imported inside the functions that need it) and never touches the cache
directory or the keeper: restoring and publishing are :mod:`weightcache.backends.vllm_compile`'s. Its names are
re-exported there.
"""

from __future__ import annotations

import hashlib
import os
import sys
from pathlib import Path
from typing import Any

import torch

from ..artifact_key import ArtifactKey
from ..torch_compile_key import device_fields

#: The artifact kind :mod:`weightcache.backends.vllm_compile` publishes.
KIND = "vllm.compile_cache"
#: ``0``/``off``/``false``: the adapter neither restores nor publishes vLLM's compile cache.
SWITCH_ENV = "WEIGHTCACHE_VLLM_COMPILE_CACHE"
#: Where vLLM keeps its compile cache under ``VLLM_CACHE_ROOT``.
SUBDIR = "torch_compile_cache"
#: vLLM's counters (``vllm.compilation.counter.compilation_counter``) that say whether it compiled or loaded.
COUNTERS = (
    "num_inductor_compiles",
    "num_compiled_artifacts_loaded",
    "num_compiled_artifacts_saved",
    "num_aot_compiles",
    "num_aot_artifacts_loaded",
    "num_aot_artifacts_saved",
)


def vllm_counters() -> dict[str, int]:
    """vLLM's own compile counters in this process (:data:`COUNTERS`; those a release lacks are left out)."""
    try:
        from vllm.compilation.counter import compilation_counter
    except Exception:
        return {}
    return {name: int(getattr(compilation_counter, name)) for name in COUNTERS if hasattr(compilation_counter, name)}


def switched_off() -> str | None:
    """Why the adapter leaves vLLM's compile cache alone in this process, or None."""
    if os.environ.get(SWITCH_ENV, "1").strip().lower() in ("0", "off", "false", "no"):
        return f"{SWITCH_ENV}={os.environ[SWITCH_ENV]}"
    try:
        import vllm.envs as envs

        if envs.VLLM_DISABLE_COMPILE_CACHE:
            return "VLLM_DISABLE_COMPILE_CACHE is set"
    except Exception:  # an attribute a release lacks: vLLM's own default (enabled) applies
        pass
    return None


def cache_root() -> Path:
    """vLLM's compile cache directory: ``$VLLM_CACHE_ROOT/torch_compile_cache``."""
    import vllm.envs as envs

    return Path(envs.VLLM_CACHE_ROOT) / SUBDIR


def not_compiled(vllm_config: Any) -> str | None:
    """Why this engine compiles nothing that vLLM caches (or caches where weightcache does not look), or None."""
    compilation = vllm_config.compilation_config
    mode = getattr(compilation, "mode", None)
    if mode is None:
        mode = getattr(compilation, "level", None)
    if mode is None or int(mode) == 0:
        return "the engine compiles nothing (compilation mode NONE, e.g. enforce_eager)"
    if getattr(compilation, "cache_dir", ""):
        return f"compilation_config.cache_dir is set ({compilation.cache_dir}): a directory the user keeps"
    return None


def _env_hash() -> str | None:
    """vLLM's hash of the environment variables that decide what it compiles (``envs.compile_factors`` since
    0.26-ish; ``envs.compute_hash`` before)."""
    import vllm.envs as envs

    factors = getattr(envs, "compile_factors", None)
    if callable(factors):
        items = sorted((str(k), str(v)) for k, v in factors().items())
        return hashlib.sha256(repr(items).encode()).hexdigest()
    compute = getattr(envs, "compute_hash", None)
    return str(compute()) if callable(compute) else None


def rank_of(vllm_config: Any) -> tuple[int, int]:
    """This engine's rank and data-parallel rank (``rank_<r>_<d>``, the subdirectory vLLM keeps per rank)."""
    parallel = vllm_config.parallel_config
    dp = getattr(parallel, "data_parallel_index", None)
    if dp is None:
        dp = getattr(parallel, "data_parallel_rank", 0)
    return int(parallel.rank), int(dp or 0)


def artifact_key(vllm_config: Any, device: torch.device) -> ArtifactKey:
    """What a vLLM compile cache is valid for, besides the weights: vLLM, torch, Triton and Python versions, the
    device (:func:`~weightcache.torch_compile.device_fields`), vLLM's config hash (``vllm_config.compute_hash()``:
    model, cache, parallel, scheduler, compilation configs), its compile-environment hash, both AOT switches and this
    rank. Not the cache root: the absolute paths vLLM records under it are relocated on restore (:data:`META`)."""
    import vllm
    import vllm.envs as envs

    rank, dp_rank = rank_of(vllm_config)
    fields: dict[str, Any] = {
        "vllm": vllm.__version__,
        "torch": torch.__version__,
        "python": f"{sys.version_info[0]}.{sys.version_info[1]}",
        **device_fields(device),
        "config": vllm_config.compute_hash(),
        "env": _env_hash(),
        "aot": bool(getattr(envs, "VLLM_USE_AOT_COMPILE", False)),
        # the mega AOT artifact changes what the AOT file holds; vLLM also counts it among its compile factors
        "mega": bool(getattr(envs, "VLLM_USE_MEGA_AOT_ARTIFACT", False)),
        "rank": rank,
        "dp_rank": dp_rank,
    }
    return ArtifactKey(KIND, fields)


__all__ = [
    "COUNTERS",
    "KIND",
    "SUBDIR",
    "SWITCH_ENV",
    "artifact_key",
    "cache_root",
    "not_compiled",
    "rank_of",
    "switched_off",
    "vllm_counters",
]

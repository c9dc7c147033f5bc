"""The names a vLLM model build registers, kept apart: a model built on meta, or in scratch, and dropped leaves
vLLM's compilation config as it found it.

Every vLLM model build registers its attention and MoE layers by name in the compilation config
(``static_forward_context``, ``static_all_moe_layers``), adds to its counts of custom ops
(:data:`CUSTOM_OP_COUNTERS`, part of the config hash that keys vLLM's compile cache before 0.32) and caches its
rotary embeddings (``_ROPE_DICT``). The adapter builds models that vLLM never runs (on meta before the lookup, a
scratch copy to publish from): :func:`scratch_registrations` and :func:`rotary_cache_kept` set aside and put back
what such a build adds, and :data:`REGISTERED` and :data:`COUNTED_OPS` are where
:meth:`~weightcache.backends.vllm.VllmBackend.build_model` remembers a model's own, for ``release_model``.

Layer L4 (an engine adapter's). Imports vLLM only inside functions; never builds or loads a model itself.
"""

from __future__ import annotations

import contextlib
from collections import Counter
from collections.abc import Iterator
from typing import Any

#: Where :meth:`~weightcache.backends.vllm.VllmBackend.build_model` keeps the layer names a model registered with vLLM.
REGISTERED = "_weightcache_registered_layers"
#: Where it keeps the custom ops the build counted (:func:`custom_op_counts`).
COUNTED_OPS = "_weightcache_counted_custom_ops"
#: The counters of custom ops in vLLM's CompilationConfig that every model build adds to.
CUSTOM_OP_COUNTERS = ("enabled_custom_ops", "disabled_custom_ops")


def custom_op_counts(compilation: Any) -> dict[str, Counter[str]]:
    """Copies of vLLM's counts of the custom ops its models' layers use (``enabled_custom_ops``,
    ``disabled_custom_ops``: each layer built adds one). Before vLLM 0.32 they are part of the config hash that
    keys vLLM's compile cache, so a model built and dropped must take its counts back, or the engine's key is not
    the one a plain start computes and its compile cache misses."""
    return {
        name: Counter(value)
        for name in CUSTOM_OP_COUNTERS
        if isinstance(value := getattr(compilation, name, None), Counter)
    }


@contextlib.contextmanager
def scratch_registrations(vllm_config: Any) -> Iterator[None]:
    """Models built inside register their layers with vLLM (by name, in the compilation config) as if no other
    model were registered, and are forgotten afterwards: the registrations from before (the model the engine
    runs, when asked after the load) are set aside meanwhile and put back as they were, and so are the custom-op
    counts (:func:`custom_op_counts`) and vLLM's cache of rotary embeddings (:func:`rotary_cache_kept`: the
    engine's model then makes and counts its own, as in a plain start). So a scratch model can
    be built before the engine's model (which then registers the same names) or while it runs."""
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    kept = dict(context)
    kept_ops = custom_op_counts(compilation)
    moe_layers = getattr(compilation, "static_all_moe_layers", None)
    kept_moe = list(moe_layers) if moe_layers is not None else []
    context.clear()
    if moe_layers is not None:
        moe_layers.clear()
    try:
        with rotary_cache_kept():  # a rotary embedding cached by a scratch build would skip the engine's count
            yield
    finally:
        context.clear()
        context.update(kept)
        if moe_layers is not None:
            moe_layers[:] = kept_moe
        for name, counts in kept_ops.items():
            getattr(compilation, name).clear()
            getattr(compilation, name).update(counts)


@contextlib.contextmanager
def rotary_cache_kept() -> Iterator[None]:
    """vLLM shares one rotary embedding module among every layer and model built with the same settings (its
    ``_ROPE_DICT``). One made while building on meta holds its cos/sin table on meta: if it stayed cached, the
    model vLLM's own loader builds next (a miss) would share it and publish a tensor without data. So what a
    build inside adds to the cache is forgotten afterwards (the layers of that one model still share theirs)."""
    from vllm.model_executor.layers import rotary_embedding

    cache = getattr(rotary_embedding, "_ROPE_DICT", None)
    kept = dict(cache) if isinstance(cache, dict) else None
    try:
        yield
    finally:
        if cache is not None and kept is not None:
            cache.clear()
            cache.update(kept)


__all__ = [
    "COUNTED_OPS",
    "CUSTOM_OP_COUNTERS",
    "REGISTERED",
    "custom_op_counts",
    "rotary_cache_kept",
    "scratch_registrations",
]

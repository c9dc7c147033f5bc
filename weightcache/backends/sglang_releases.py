"""What differs between the SGLang releases the adapter supports, in one place.

SGLang 0.5.16 to 0.5.23 offer the adapter the same loader layer: ``model_loader.loader``'s
``_get_quantization_config``, ``_initialize_model`` and ``DefaultModelLoader`` (whose ``_prepare_weights`` gained
an optional fourth argument in 0.5.20, which the adapter does not pass), a loader class accepted as ``load_format``,
``runtime_context``'s ``get_parallel`` and ``get_server_args``, and ``plugins.hook_registry``. What changed inside
that range does not reach the adapter: 0.5.21 added a ``dp`` rank to ``get_parallel()`` (the adapter records it
where present), 0.5.22 a ``load_group`` field to ``LoadConfig`` (``dataclasses.replace`` keeps it).

Four features differ, and are probed here, never inferred from the version:

- SGLang's helper that rebuilds the views some modules keep of their weights (:func:`stale_views_rebuilder`:
  ``weight_cache.ipc_loader.IpcModelLoader._rebuild_stale_views``, from 0.5.17; 0.5.16 has no ``weight_cache``
  package). Without it a model with such views (``RadixLinearAttention``'s ``conv_weights``) loads from disk;

- where ``--load-format`` choices are added (:func:`load_format_choices`): ``arg_groups.choices`` from 0.5.20,
  ``server_args`` before (0.5.16 to 0.5.19 define ``LOAD_FORMAT_CHOICES`` and ``add_load_format_choices`` there);
- whether SGLang counts a loader's ``preloaded_weights_bytes`` in its pre-load memory baseline
  (:func:`counts_preloaded_bytes`; from 0.5.19, where ``BaseModelLoader`` declares it). 0.5.16 and 0.5.17 do
  not: an engine that attaches weights already resident sizes its KV cache with less headroom than after a disk
  load, which the adapter says in a warning (see :mod:`weightcache.backends.sglang`);
- whether SGLang's process-wide cache of rotary embeddings (``rotary_embedding.factory._ROPE_DICT``) tells an
  entry built on meta from a live one (:func:`rope_cache_checks_meta`; from 0.5.20). 0.5.16 and 0.5.17 hand the
  model their own loader builds next the one a meta build cached, whose cos/sin table has no data: the adapter
  drops what its meta builds cached there, as 0.5.17's own loaders do after theirs.

This module's layer: below the adapter, above SGLang. Imports SGLang only inside functions.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from . import releases
from .releases import ReleaseRange

#: The releases the adapter supports, and where each is tested.
RELEASES = ReleaseRange(
    "SGLang",
    "0.5.16",
    "0.5.23",
    tested="0.5.23 and 0.5.16 in CI (make test-engines: their model-loader layer on CPUs, both on PyTorch 2.14.1; "
    "0.5.16 and 0.5.17 pin 2.11.0); 0.5.17 and 0.5.20 by hand on a CPU (see docs/backends.md); 0.5.17 whole engines "
    "on an H200 (PyTorch 2.11.0, tests/backends/test_sglang_cuda.py, by hand)",
)

#: What the adapter imports from every supported release: (module, name).
REQUIRED_API = (
    ("sglang.srt.model_loader.loader", "_get_quantization_config"),
    ("sglang.srt.model_loader.loader", "_initialize_model"),
    ("sglang.srt.model_loader.loader", "DefaultModelLoader"),
    ("sglang.srt.model_loader.utils", "set_default_torch_dtype"),
    ("sglang.srt.runtime_context", "get_parallel"),
    ("sglang.srt.runtime_context", "get_server_args"),
)


#: Where a ``--load-format`` choice is added, newest first: (module, list of choices, function that adds).
LOAD_FORMAT_CHOICES_API = (
    ("sglang.srt.arg_groups.choices", "LOAD_FORMAT_CHOICES", "add_load_format_choices"),  # 0.5.20 on
    ("sglang.srt.server_args", "LOAD_FORMAT_CHOICES", "add_load_format_choices"),  # 0.5.16 to 0.5.19
)


def missing_api() -> str | None:
    """The first name of :data:`REQUIRED_API` the installed SGLang lacks, as a reason; None when all are there."""
    return releases.missing_api("SGLang", REQUIRED_API)


def load_format_choices() -> tuple[list[str], Callable[[list[str]], None]]:
    """SGLang's list of ``--load-format`` choices and its function that adds to it, from the first module of
    :data:`LOAD_FORMAT_CHOICES_API` that has both.

    Raises ImportError naming every place looked in when none has them."""
    found = []
    for module_name, choices, add in LOAD_FORMAT_CHOICES_API:
        module = _module(module_name)
        if module is not None and hasattr(module, choices) and hasattr(module, add):
            return getattr(module, choices), getattr(module, add)
        found.append(f"{module_name}.{add}")
    raise ImportError(
        f"the installed SGLang has none of {', '.join(found)} to add a --load-format choice with (SGLang "
        f"0.5.16 to 0.5.23 have one); pass LoadConfig(load_format=WeightCacheLoader) instead"
    )


def counts_preloaded_bytes() -> bool:
    """Whether the installed SGLang adds a loader's ``preloaded_weights_bytes`` to its pre-load memory baseline
    (``BaseModelLoader`` declares the attribute where it does: 0.5.19 on)."""
    from sglang.srt.model_loader.loader import BaseModelLoader

    return hasattr(BaseModelLoader, "preloaded_weights_bytes")


def stale_views_rebuilder() -> Callable[[Any], None] | None:
    """SGLang's ``IpcModelLoader._rebuild_stale_views`` (0.5.17 on), which re-creates the views of weights some
    modules keep as plain attributes after attaching; None where the installed SGLang has none."""
    module = _module("sglang.srt.weight_cache.ipc_loader")
    loader = getattr(module, "IpcModelLoader", None)
    rebuild = getattr(loader, "_rebuild_stale_views", None)
    return rebuild if callable(rebuild) else None


def rope_cache_checks_meta() -> bool:
    """Whether the installed SGLang's rotary-embedding cache drops a dead or meta entry before a real build
    reuses it (``factory._get_live_rope_cache_entry``: 0.5.20 on)."""
    from sglang.srt.layers.rotary_embedding import factory

    return hasattr(factory, "_get_live_rope_cache_entry")


def _module(name: str) -> ModuleType | None:
    """The module ``name``, or None where the installed SGLang has no such module."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


__all__ = [
    "LOAD_FORMAT_CHOICES_API",
    "RELEASES",
    "REQUIRED_API",
    "counts_preloaded_bytes",
    "load_format_choices",
    "missing_api",
    "rope_cache_checks_meta",
    "stale_views_rebuilder",
]

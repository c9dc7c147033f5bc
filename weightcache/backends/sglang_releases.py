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
  (:func:`counts_preloaded_bytes`; from 0.5.19, where ``BaseModelLoader`` declares it and
  ``ModelRunner.account_preloaded_weights`` adds it). 0.5.16 and 0.5.17 do not: there the adapter adds the
  attached bytes to the baseline of the ``ModelRunner`` whose ``load_model`` called it, as 0.5.19 does
  (:func:`account_preloaded_bytes`), so the KV cache is sized as after a disk load; where no such runner is
  found (a loader called by other code), a warning says how much less headroom the KV cache keeps (see
  :mod:`weightcache.backends.sglang`);
- whether SGLang's process-wide cache of rotary embeddings (``rotary_embedding.factory._ROPE_DICT``) tells an
  entry built on meta from a live one (:func:`rope_cache_checks_meta`; from 0.5.20). 0.5.16 and 0.5.17 hand the
  model their own loader builds next the one a meta build cached, whose cos/sin table has no data: the adapter
  drops what its meta builds cached there, as 0.5.17's own loaders do after theirs.

This module's layer: below the adapter, above SGLang. Imports SGLang only inside functions.
"""

from __future__ import annotations

import importlib
import logging
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any

from . import releases
from .releases import ReleaseRange

log = logging.getLogger(__name__)

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


#: The attribute :func:`account_preloaded_bytes` keeps on a ModelRunner: the GiB it added to its baseline so far.
ACCOUNTED_ATTRIBUTE = "_weightcache_preloaded_gib"


def calling_model_runner() -> Any | None:
    """The SGLang ``ModelRunner`` whose ``load_model`` is on the calling stack (SGLang 0.5.16 to 0.5.23 call a
    loader from ``ModelRunner.load_model`` through ``load_model_with_memory_saver``), or None: SGLang's model
    runner module not imported, or the loader called by other code (SGLang's weight-cache daemon, a test)."""
    module = sys.modules.get("sglang.srt.model_executor.model_runner")
    runner_class = getattr(module, "ModelRunner", None)
    if not isinstance(runner_class, type):
        return None
    frame: FrameType | None = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == "load_model":
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, runner_class):
                return candidate
        frame = frame.f_back
    return None


def account_preloaded_bytes(preloaded_bytes: int) -> bool:
    """Count ``preloaded_bytes`` of attached weights, resident before SGLang sampled its pre-load memory
    baseline, in that baseline, as SGLang 0.5.19 and later do themselves (``ModelRunner.account_preloaded_weights``:
    ``pre_model_load_memory += preloaded_weights_bytes / 2**30``). SGLang reads the baseline only after the load
    (the KV cache's size, its resize after graph capture), so adding to it during the load is what 0.5.19 does
    right after it. Called on every load of a release that does not count them itself
    (:func:`counts_preloaded_bytes` false); a runner that loads again (a reload) has what an earlier load added
    replaced, not added twice.

    Returns True when the bytes are counted: a calling ``ModelRunner`` was found (:func:`calling_model_runner`)
    with a numeric ``pre_model_load_memory``, or there was nothing to count; False otherwise (the caller warns)."""
    runner = calling_model_runner()
    baseline = getattr(runner, "pre_model_load_memory", None)
    if runner is None or isinstance(baseline, bool) or not isinstance(baseline, int | float):
        return preloaded_bytes == 0
    added = float(getattr(runner, ACCOUNTED_ATTRIBUTE, 0.0))
    gib = preloaded_bytes / (1 << 30)
    if gib == added:
        return True
    runner.pre_model_load_memory = baseline - added + gib
    setattr(runner, ACCOUNTED_ATTRIBUTE, gib)
    log.info(
        "weightcache: %.2f GiB of attached weights were resident before SGLang sampled its pre-load memory "
        "baseline; added to it (%.2f -> %.2f GB), as SGLang 0.5.19 and later do, so the KV cache is sized as "
        "after a disk load",
        gib,
        baseline,
        runner.pre_model_load_memory,
    )
    return True


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
    "ACCOUNTED_ATTRIBUTE",
    "LOAD_FORMAT_CHOICES_API",
    "RELEASES",
    "REQUIRED_API",
    "account_preloaded_bytes",
    "calling_model_runner",
    "counts_preloaded_bytes",
    "load_format_choices",
    "missing_api",
    "rope_cache_checks_meta",
    "stale_views_rebuilder",
]

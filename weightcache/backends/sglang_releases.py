"""What differs between the SGLang releases the adapter supports, in one place.

SGLang 0.5.20 to 0.5.23 offer the adapter the same loader layer: ``model_loader.loader``'s
``_get_quantization_config``, ``_initialize_model`` and ``DefaultModelLoader`` (whose ``_prepare_weights`` gained
an optional fourth argument in 0.5.20, which the adapter does not pass), a loader class accepted as ``load_format``
with ``preloaded_weights_bytes`` counted in SGLang's memory baseline (from 0.5.19), ``weight_cache.ipc_loader``'s
``IpcModelLoader._rebuild_stale_views`` (from 0.5.17), ``runtime_context``'s ``get_parallel`` and
``get_server_args``, and the plugin registries (``arg_groups.choices.add_load_format_choices``, from 0.5.20;
``plugins.hook_registry``). What changed inside that range does not reach the adapter: 0.5.21 added a ``dp``
rank to ``get_parallel()`` (the adapter records it where present), 0.5.22 a ``load_group`` field to
``LoadConfig`` (``dataclasses.replace`` keeps it).

Features are probed (:data:`REQUIRED_API`), not inferred from the version. Imports SGLang only inside functions.
"""

from __future__ import annotations

from . import releases
from .releases import ReleaseRange

#: The releases the adapter supports, and where each is tested.
RELEASES = ReleaseRange(
    "SGLang",
    "0.5.20",
    "0.5.23",
    tested="0.5.23 in CI (make test-engines: its model-loader layer on CPUs); 0.5.20 by hand on a CPU (see "
    "docs/backends.md)",
)

#: What the adapter imports from every supported release: (module, name).
REQUIRED_API = (
    ("sglang.srt.model_loader.loader", "_get_quantization_config"),
    ("sglang.srt.model_loader.loader", "_initialize_model"),
    ("sglang.srt.model_loader.loader", "DefaultModelLoader"),
    ("sglang.srt.model_loader.utils", "set_default_torch_dtype"),
    ("sglang.srt.weight_cache.ipc_loader", "IpcModelLoader"),
    ("sglang.srt.runtime_context", "get_parallel"),
    ("sglang.srt.runtime_context", "get_server_args"),
)


def missing_api() -> str | None:
    """The first name of :data:`REQUIRED_API` the installed SGLang lacks, as a reason; None when all are there."""
    return releases.missing_api("SGLang", REQUIRED_API)


__all__ = ["RELEASES", "REQUIRED_API", "missing_api"]

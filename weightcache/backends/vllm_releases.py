"""What differs between the vLLM releases the adapter supports, in one place.

The loader interface the adapter registers against (``register_model_loader``, ``BaseModelLoader``,
``DefaultModelLoader``, ``initialize_model``, ``process_weights_after_loading``, plugin loading) is the same from
vLLM 0.26 to 0.33. What changed around it, and what the adapter does on each side:

- **0.30** added ``vllm.model_executor.utils.weights_already_processed``: post-processing under it skips tensor
  transforms (each quant method opts in) and only re-creates Python-side state. From 0.30 on, weights are
  published post-processed (except :data:`RERUN_METHODS`, published as loaded and re-processed on attach, as
  vLLM re-runs them in full anyway). Before 0.30 post-processing always runs in full, so an attach re-runs it from
  the tensors as loaded: only for the methods of :data:`LEGACY_RERUN_METHODS`, whose post-processing builds its
  result beside the loaded tensors and never writes into them (the shared weights are read-only). A model with
  any other method (FP8, ...) loads from disk with a FallbackWarning that says why (:func:`cannot_attach`).
- **0.31** made ``DefaultModelLoader._prepare_weights`` return four values instead of three (the adapter reads
  only the first).
- **0.32** added ``BaseModelLoader.get_external_weight_memory``: vLLM asks the loader how many bytes of weights
  it will map rather than allocate, before it sizes its KV cache. Before 0.32 vLLM never asks, and weights
  mapped from the keeper (allocated before the engine started) would be counted by nobody: the engine would ask
  for its full ``gpu_memory_utilization`` on top of them (and refuse to start when that much is not free), then
  size its KV cache as if the weights took no memory. :func:`count_external_weights` makes those releases ask,
  as 0.32 does (on CUDA; vLLM's CPU backend sizes its KV cache from ``VLLM_CPU_KVCACHE_SPACE``).

- **0.26 on torch 2.10/2.11** loads its AOT-compiled function on a restart but, without vLLM's "mega" AOT
  artifact (on by default only from torch 2.12), splits the graph again and runs every piecewise subgraph back
  through the compiler: vLLM keeps one artifact per distinct subgraph, so on a Llama the 30 isometric ones are
  each re-traced by AOTAutograd to find their key (``num_inductor_compiles`` 30 on a full hit).
  :func:`prefer_mega_aot_artifact` turns the mega artifact on for an engine whose compile cache the keeper holds,
  where the release has it and the user has not chosen.

Features are probed, not inferred from the version: the version decides only whether the release is inside
:data:`RELEASES` (and the log line). Imports vLLM only inside functions.
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
import math
import os
import threading
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any

import attrs
from torch import nn

from . import releases
from .releases import ReleaseRange

#: The releases the adapter supports, and where each end is tested.
RELEASES = ReleaseRange(
    "vLLM",
    "0.26.0",
    "0.33",
    tested="0.26.0 (GPU build) on an NVIDIA H200; vllm-cpu 0.27.0 and 0.32.0 in CI (make test-engines)",
)

#: Quant method classes whose ``process_weights_after_loading`` vLLM re-runs in full even under
#: ``weights_already_processed()`` (their transforms are repeatable from the loaded weights). Their layers are
#: published as loaded, before post-processing.
RERUN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")

#: Before 0.30: the quant methods whose post-processing, run again on an attach, rebuilds its result from the
#: loaded tensors without writing into them (on CUDA: nothing for linear layers and embeddings; the MoE experts'
#: kernel format is made in new tensors). Every layer is published as loaded.
LEGACY_RERUN_METHODS = (*RERUN_METHODS, "UnquantizedFusedMoEMethod")

#: What the adapter imports from every supported release: (module, name).
REQUIRED_API = (
    ("vllm.model_executor.model_loader", "register_model_loader"),
    ("vllm.model_executor.model_loader.base_loader", "BaseModelLoader"),
    ("vllm.model_executor.model_loader.default_loader", "DefaultModelLoader"),
    ("vllm.model_executor.model_loader.utils", "initialize_model"),
    ("vllm.model_executor.model_loader.utils", "process_weights_after_loading"),
    ("vllm.utils.torch_utils", "set_default_torch_dtype"),
    ("vllm.distributed", "parallel_state"),
    ("vllm.platforms", "current_platform"),
    ("vllm.model_executor.layers", "rotary_embedding"),
)

log = logging.getLogger(__name__)


@attrs.frozen
class VllmFeatures:
    """What the installed vLLM offers the adapter.

    Attributes:
        version: ``vllm.__version__``.
        pre_processed: ``weights_already_processed`` (0.30+), or None.
        asks_external_memory: whether vLLM asks the loader about weights it maps (0.32+).
    """

    version: str
    pre_processed: Callable[[], AbstractContextManager[object]] | None
    asks_external_memory: bool

    @property
    def rerun_methods(self) -> tuple[str, ...]:
        """The quant method classes whose layers are published as loaded and re-processed on attach."""
        return RERUN_METHODS if self.pre_processed is not None else LEGACY_RERUN_METHODS

    def post_processing(self) -> AbstractContextManager[object]:
        """The block an attach runs vLLM's ``process_weights_after_loading`` in."""
        return self.pre_processed() if self.pre_processed is not None else contextlib.nullcontext()

    def describe(self) -> str:
        """One line for logs and ``weightcache doctor``."""
        processed = "weights_already_processed" if self.pre_processed is not None else "full post-processing"
        memory = "asks the loader" if self.asks_external_memory else "counted by weightcache"
        return f"vLLM {self.version}: attach with {processed}; external weight memory {memory}"


@functools.lru_cache(maxsize=1)
def features() -> VllmFeatures:
    """Probe the installed vLLM (once per process)."""
    import vllm
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader

    utils = importlib.import_module("vllm.model_executor.utils")
    pre_processed = getattr(utils, "weights_already_processed", None)
    return VllmFeatures(
        version=str(getattr(vllm, "__version__", "unknown")),
        pre_processed=pre_processed if callable(pre_processed) else None,
        asks_external_memory=callable(getattr(BaseModelLoader, "get_external_weight_memory", None)),
    )


def missing_api() -> str | None:
    """The first name of :data:`REQUIRED_API` the installed vLLM lacks, as a reason; None when all are there."""
    return releases.missing_api("vLLM", REQUIRED_API)


def cannot_attach(model: nn.Module, found: VllmFeatures) -> str | None:
    """Why weights for ``model`` (built on meta) cannot be attached with this release, or None."""
    if found.pre_processed is not None:
        return None
    methods = sorted(
        {
            type(method).__name__
            for module in model.modules()
            if (method := getattr(module, "quant_method", None)) is not None
            and type(method).__name__ not in LEGACY_RERUN_METHODS
        }
    )
    if methods:
        return (
            f"vLLM {found.version} has no weights_already_processed (added in vLLM 0.30), so the post-processed "
            f"weights of {', '.join(methods)} cannot be attached without processing them again; upgrade vLLM to "
            "0.30 or later to attach this model"
        )
    if os.environ.get("VLLM_CPU_SGL_KERNEL") == "1" and any(
        type(getattr(m, "quant_method", None)).__name__ == "UnquantizedFusedMoEMethod" for m in model.modules()
    ):
        return (
            f"vLLM {found.version} with VLLM_CPU_SGL_KERNEL=1 repacks MoE experts in place while post-processing, "
            "which cached (read-only) weights cannot take before vLLM 0.30; unset it or upgrade vLLM"
        )
    return None


# --- before 0.32: make vLLM's memory budget count the weights it maps ------------------------------------------

_installed = False
_current = threading.local()


def count_external_weights(load_format: str) -> None:
    """On a release without ``get_external_weight_memory`` (before 0.32), on CUDA: make each GPU worker of an
    engine with ``load_format`` ask the loader, as 0.32 does, before it takes its memory budget. The budget
    (``gpu_memory_utilization`` of the device) then holds the mapped weights once: the worker asks for that much
    less, and its KV cache is sized exactly as if it had loaded the weights itself.

    Installed by the plugin in each vLLM process; idempotent; never raises (without it an engine still starts,
    counting the weights as memory of other processes)."""
    global _installed
    if _installed or features().asks_external_memory:
        return
    try:
        from vllm.platforms import current_platform

        if not current_platform.is_cuda_alike():
            return
        gpu_worker = importlib.import_module("vllm.v1.worker.gpu_worker")
        worker_cls = gpu_worker.Worker
        original_request = gpu_worker.request_memory
        original_init = worker_cls.init_device
    except Exception as exc:
        log.warning("weightcache: cannot make this vLLM count cached weights in its memory budget (%s)", exc)
        return

    def init_device(self: Any) -> Any:
        _current.worker = self
        try:
            return original_init(self)
        finally:
            _current.worker = None

    def request_memory(init_snapshot: Any, cache_config: Any, *args: Any, **kwargs: Any) -> Any:
        worker = getattr(_current, "worker", None)
        external = 0
        if worker is not None and getattr(worker.load_config, "load_format", None) == load_format:
            from vllm.model_executor.model_loader import get_model_loader

            external = int(get_model_loader(worker.load_config).get_external_weight_memory(worker.vllm_config))
        if external <= 0:
            return original_request(init_snapshot, cache_config, *args, **kwargs)
        return _budget_without(init_snapshot, cache_config, external)

    worker_cls.init_device = init_device
    setattr(gpu_worker, "request_memory", request_memory)  # noqa: B010 (a module found at run time)
    _installed = True


def _budget_without(init_snapshot: Any, cache_config: Any, external: int) -> int:
    """vLLM 0.32's budget for an engine whose ``external`` bytes of weights are held outside it."""
    gib = 2**30
    requested = math.ceil(init_snapshot.total_memory * cache_config.gpu_memory_utilization)
    engine = int(requested - external)
    if engine <= 0:
        raise ValueError(
            f"the weights weightcache maps ({external / gib:.2f} GiB) exceed the GPU memory utilization "
            f"({cache_config.gpu_memory_utilization}: {requested / gib:.2f} GiB); raise gpu_memory_utilization"
        )
    if init_snapshot.free_memory < engine:
        raise ValueError(
            f"free memory on the device ({init_snapshot.free_memory / gib:.2f} GiB) is less than the engine's "
            f"budget after the {external / gib:.2f} GiB of weights weightcache maps ({engine / gib:.2f} GiB); lower "
            "gpu_memory_utilization or free memory used by other processes"
        )
    log.info(
        "weightcache: of the %.2f GiB budget (gpu_memory_utilization %s), %.2f GiB are weights mapped from the "
        "keeper and %.2f GiB remain for the engine",
        requested / gib,
        cache_config.gpu_memory_utilization,
        external / gib,
        engine / gib,
    )
    return engine


#: vLLM's switch for its mega AOT artifact (every compiled piecewise subgraph saved with its AOT function).
MEGA_AOT_ENV = "VLLM_USE_MEGA_AOT_ARTIFACT"


def prefer_mega_aot_artifact() -> str | None:
    """Turn vLLM's mega AOT artifact on in this process where vLLM compiles with AOT and standalone compile but
    left it off (vLLM 0.26 on torch 2.10/2.11: its default needs torch 2.12), so that a restart served from the
    keeper rebuilds its piecewise backends from the loaded artifact instead of compiling each subgraph again.
    Call before vLLM compiles and before the compile cache's key is computed (the switch is one of vLLM's
    compile factors), in the publisher and its clients alike. A value the user set (``VLLM_USE_MEGA_AOT_ARTIFACT=0``
    or ``1``) is left alone, as is a release without the switch. Returns what was done, for the log; None when
    nothing changed."""
    if MEGA_AOT_ENV in os.environ:
        return None
    try:
        import vllm.envs as envs
        from vllm.utils.torch_utils import is_torch_equal_or_newer
    except ImportError:
        return None
    if MEGA_AOT_ENV not in getattr(envs, "environment_variables", {}):
        return None
    if not (envs.VLLM_USE_AOT_COMPILE and envs.VLLM_USE_STANDALONE_COMPILE and is_torch_equal_or_newer("2.10.0")):
        return None
    if envs.VLLM_USE_MEGA_AOT_ARTIFACT:
        return None
    os.environ[MEGA_AOT_ENV] = "1"
    if not envs.VLLM_USE_MEGA_AOT_ARTIFACT:  # vLLM cached its environment already: too late for this process
        del os.environ[MEGA_AOT_ENV]
        return None
    return (
        f"{MEGA_AOT_ENV}=1 for this engine (vLLM's default on this torch is 0): a restart rebuilds its compiled "
        f"subgraphs from the artifact instead of compiling each again; set {MEGA_AOT_ENV}=0 to keep vLLM's default"
    )


__all__ = [
    "LEGACY_RERUN_METHODS",
    "MEGA_AOT_ENV",
    "RELEASES",
    "REQUIRED_API",
    "RERUN_METHODS",
    "VllmFeatures",
    "cannot_attach",
    "count_external_weights",
    "features",
    "missing_api",
    "prefer_mega_aot_artifact",
]

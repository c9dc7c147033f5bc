"""What identifies the weights vLLM would load, besides the checkpoint: the parts of vLLM's config, environment
and process groups that decide the post-processed tensors (the fingerprint's ``extra`` and ``parallel``).

:func:`model_identity` is the fingerprint's ``extra`` (the model's config as loaded, dtype, quantization, load
device, platform, kernel backends, expert layout, :data:`PROCESSING_ENV`); :func:`parallel_layout` is this rank's
place in every process group. :class:`~weightcache.backends.vllm.VllmBackend` joins them into its fingerprint.

Layer L4 (an engine adapter's). Reads vLLM's config and state, imported inside the functions; never loads, builds
or changes anything. Its names are re-exported by :mod:`weightcache.backends.vllm`.
"""

from __future__ import annotations

import os
from typing import Any

from .engine_config import config_json, plain_json

#: Environment variables that change what vLLM's post-processing produces; their values join the fingerprint.
PROCESSING_ENV = (
    "VLLM_XPU_FORCE_N_CONTIG_WEIGHT",
    "VLLM_ZENTORCH_WEIGHT_PREPACK",
    "VLLM_CPU_SGL_KERNEL",
    # the FP8 MoE and GEMM backend choice, which decides the layout (and scale format) post-processing leaves
    "VLLM_USE_DEEP_GEMM",
    "VLLM_MOE_USE_DEEP_GEMM",
    "VLLM_USE_DEEP_GEMM_E8M0",
    "VLLM_ROCM_USE_AITER",
    "VLLM_ROCM_USE_AITER_MOE",
    "VLLM_ROCM_USE_AITER_LINEAR",
)
#: ParallelConfig fields that change how experts are sharded, beyond the process groups' ranks and sizes (vLLM
#: creates its EP group for every MoE model, whether experts are sharded by EP or by TP).
EXPERT_LAYOUT_FIELDS = (
    "enable_expert_parallel",
    "enable_eplb",
    "expert_placement_strategy",
    "num_redundant_experts",
)
#: KernelConfig fields that pick the kernels post-processing prepares weights for.
KERNEL_FIELDS = ("linear_backend", "moe_backend")


def parallel_layout() -> dict[str, tuple[int, int]]:
    """This rank's place in every initialised vLLM process group: tp, pp, dp, ep, pcp, dcp as (rank, size)."""
    from vllm.distributed import parallel_state as ps

    layout = {}
    for axis, attr in (("tp", "_TP"), ("pp", "_PP"), ("dp", "_DP"), ("ep", "_EP"), ("pcp", "_PCP"), ("dcp", "_DCP")):
        group = getattr(ps, attr, None)
        if group is not None:
            layout[axis] = (int(group.rank_in_group), int(group.world_size))
    return layout


def model_identity(vllm_config: Any, model_config: Any) -> dict[str, Any]:
    """The parts of vLLM's config that decide the post-processed weights (the fingerprint's ``extra``)."""
    import vllm.envs as envs
    from vllm.platforms import current_platform

    hf_config = config_json(model_config.hf_config)  # as before vLLM's model rewrote it (DeepSeek's rope_type)
    load = vllm_config.load_config
    kernels = getattr(vllm_config, "kernel_config", None)
    return {
        "hf_config": hf_config,
        "model": str(model_config.model),
        "revision": model_config.revision,
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "hf_overrides": plain_json(getattr(model_config, "hf_overrides", None)),
        "load_device": None if load.device is None else str(load.device),
        "platform": str(current_platform.device_type),
        "kernels": {f: plain_json(getattr(kernels, f, None)) for f in KERNEL_FIELDS},
        "experts": _expert_layout(vllm_config.parallel_config),
        "env": {name: str(getattr(envs, name, os.environ.get(name))) for name in PROCESSING_ENV},
    }


def _expert_layout(parallel_config: Any) -> dict[str, Any]:
    out = {f: plain_json(getattr(parallel_config, f, None)) for f in EXPERT_LAYOUT_FIELDS}
    eplb = getattr(parallel_config, "eplb_config", None)
    if eplb is not None and out["num_redundant_experts"] is None:
        out["num_redundant_experts"] = plain_json(getattr(eplb, "num_redundant_experts", None))
    return out


__all__ = ["EXPERT_LAYOUT_FIELDS", "KERNEL_FIELDS", "PROCESSING_ENV", "model_identity", "parallel_layout"]

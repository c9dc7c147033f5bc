"""The SGLang adapter: a model loader class to pass as ``LoadConfig(load_format=WeightCacheLoader)``.

SGLang instantiates a loader class given as ``load_format`` itself, with the ``LoadConfig`` as its only
argument, so the options travel in ``model_loader_extra_config`` (``mode``, ``socket_dir``, ``strict``,
``trusted_publishers``; any other key is an error) or are fixed on a subclass made by
:meth:`WeightCacheLoader.configure`::

    from weightcache.backends.sglang import WeightCacheLoader
    LoadConfig(load_format=WeightCacheLoader.configure(mode="client", strict=True))

- mode daemon: if the keeper holds these weights, attach them. Else SGLang's own ``DefaultModelLoader`` runs
  (read, TP shard, quantize, ``process_weights_after_loading``); its result is published and the engine runs
  on the published copy, bound into a model built on the meta device exactly as a client builds it.
- mode client: the model is built on the meta device and the published tensors are bound into it; SGLang's
  post-processing is skipped, as its own weight-cache loader does: its result is what was published. If the
  keeper does not hold the weights: a FallbackWarning and SGLang's own disk load (``strict``: an error).

The loader reports the attached bytes of an entry that was resident before the load (``Handle.resident_before``;
none where this load published the entry or attached one published during it) as ``preloaded_weights_bytes``,
which SGLang's memory accounting adds to its pre-load baseline (from 0.5.19), so the KV cache is sized as after a
disk load. SGLang 0.5.16 and 0.5.17 do
not count them; there the loader adds them to the baseline of the ``ModelRunner`` whose ``load_model`` called it,
as 0.5.19 does (:func:`~weightcache.backends.sglang_releases.account_preloaded_bytes`). A loader called by other
code on those releases still attaches, and a warning says how much less headroom the KV cache of whatever sizes
one from that baseline would keep (see :func:`uncounted_preload_warning`).

This module imports SGLang only inside functions: ``weightcache.backends.sglang`` imports without SGLang
(tests/test_layers.py checks).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
import warnings
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from ..binding import tensor_attributes
from ..errors import BackendConfigError, BackendError, UnsupportedQuantError
from ..fingerprint import Fingerprint
from ..handle import Handle
from . import sglang_releases
from .engine_config import QuantSpec, config_json, plain_json, quant_spec_from_config
from .releases import ReleaseRange
from .template import Backend, LoaderOptions

#: SGLang's parallel widths (``runtime_context.get_parallel()``) that decide which shard a rank holds, as
#: fingerprint axis -> (rank attribute, size attribute).
PARALLEL_AXES: dict[str, tuple[str, str]] = {
    "tp": ("tp_rank", "tp_size"),
    "pp": ("pp_rank", "pp_size"),
    "dp": ("dp_rank", "dp_size"),
    "ep": ("moe_ep_rank", "moe_ep_size"),
    "moe_dp": ("moe_dp_rank", "moe_dp_size"),
    "attn_dp": ("attn_dp_rank", "attn_dp_size"),
    "attn_cp": ("attn_cp_rank", "attn_cp_size"),
}

#: Axes every rank must know: without them all ranks would share one fingerprint.
REQUIRED_AXES = ("tp", "pp")
#: ServerArgs fields that change the post-processed weights (MoE kernel layout, shared-expert fusion into the
#: expert tensors, redundant experts).
SERVER_FIELDS = (
    "moe_runner_backend",
    "moe_a2a_backend",
    "disable_shared_experts_fusion",
    "enable_eplb",
    "ep_num_redundant_experts",
)
#: Environment variables that change what the loader produces.
PROCESSING_ENV = ("SGLANG_EMBEDDINGS_SPARSE_HEAD",)


class SglangBackend(Backend):
    """SGLang (``sglang``)."""

    name: ClassVar[str] = "sglang"
    module: ClassVar[str] = "sglang"
    install_hint: ClassVar[str] = "Install SGLang (`pip install sglang`) in the same environment as weightcache."
    releases: ClassVar[ReleaseRange | None] = sglang_releases.RELEASES

    def unsupported(self) -> str | None:
        """A release outside :data:`~weightcache.backends.sglang_releases.RELEASES`, or a loader API the adapter
        needs and the installed SGLang lacks."""
        return super().unsupported() or sglang_releases.missing_api()

    def quant(self, engine_quant: object) -> QuantSpec:
        """Map an SGLang ``QuantizationConfig`` (None: unquantized) to a strategy (see
        :func:`~weightcache.backends.base.quant_spec_from_config`).

        An ``fp8`` config whose MoE experts run FP4 kernels is refused, not mapped to ``fp8_block``: SGLang marks
        it ``is_fp4_experts`` (routed experts stored as MXFP4, e.g. ``routed_experts_quant_method: mxfp4``, or
        DeepSeek-V4's layout) unless they are dequantized to FP8 (``dequant_fp4_to_fp8``), and wraps it in a
        hybrid config for NVFP4 experts. Those expert weights are FP4 kernels' layouts, which no strategy covers.
        """
        fp4 = getattr(engine_quant, "is_fp4_experts", False) and not getattr(engine_quant, "dequant_fp4_to_fp8", False)
        nvfp4 = getattr(engine_quant, "nvfp4_config", None) is not None
        if fp4 or nvfp4:
            kind = "NVFP4" if nvfp4 else "MXFP4"
            raise UnsupportedQuantError(
                f"SGLang's {type(engine_quant).__name__} runs this model's MoE experts with {kind} kernels "
                f"({'nvfp4_config' if nvfp4 else 'is_fp4_experts'} is set): those expert weights are not block "
                "FP8, and no weightcache strategy covers FP4 layouts, so they cannot be shared safely. Load this "
                "model without weightcache."
            )
        return quant_spec_from_config("SGLang", engine_quant)

    def quant_config(self, model_config: Any, load_config: Any) -> Any:
        """The QuantizationConfig SGLang builds for this model (None when unquantized)."""
        from sglang.srt.model_loader.loader import _get_quantization_config

        return _get_quantization_config(model_config, load_config)

    def fingerprint(self, model_config: Any, load_config: Any, device: torch.device) -> Fingerprint:
        """The fingerprint of the weights SGLang would load for this config on this rank, before the structure
        of the model SGLang builds joins it (:meth:`~weightcache.backends.base.Backend.load_model` adds it).

        Raises UnsupportedQuantError for a refused quantization method before anything is read (or downloaded).
        """
        engine_quant = self.quant_config(model_config, load_config)
        self.check_quant(engine_quant)  # before checkpoint_dir, which downloads a hub model
        return self.make_fingerprint(
            self.checkpoint_dir(model_config, load_config),
            dtype=model_config.dtype,
            engine_quant=engine_quant,
            parallel=parallel_layout,
            device=device,
            identity=model_identity(model_config, load_config),
        )

    def checkpoint_dir(self, model_config: Any, load_config: Any) -> str:
        """The local directory of the checkpoint (downloaded by SGLang's own loader if it is a hub name)."""
        if os.path.isdir(model_config.model_path):
            return str(model_config.model_path)
        from sglang.srt.model_loader.loader import DefaultModelLoader

        folder, *_ = DefaultModelLoader(_disk_load_config(load_config))._prepare_weights(
            model_config.model_path, model_config.revision, True
        )
        return str(folder)

    # --- the hooks of the load (the sequence is Backend.load_model's) -------------------------------------

    def build_model(self, context: SglangLoad) -> nn.Module:
        """SGLang's model for this config, on the meta device (the template enters it)."""
        from sglang.srt.model_loader.loader import _initialize_model

        quant_config = self.quant_config(context.model_config, context.load_config)
        with _engine_dtype(context.model_config.dtype), _meta_rope_entries_dropped():
            model: nn.Module = _initialize_model(context.model_config, context.load_config, quant_config)
        return model

    def load_from_disk(self, context: SglangLoad) -> nn.Module:
        """SGLang's own ``DefaultModelLoader`` (load format auto): read, shard, quantize, post-process."""
        from sglang.srt.model_loader.loader import DefaultModelLoader

        model: nn.Module = DefaultModelLoader(_disk_load_config(context.load_config)).load_model(
            model_config=context.model_config, device_config=context.device_config
        )
        return model

    def shareable_state(self, model: nn.Module, context: SglangLoad) -> dict[str, torch.Tensor]:
        """:func:`shareable_state`."""
        return shareable_state(model)

    def cannot_serve(self, model: nn.Module, context: SglangLoad) -> str | None:
        """Where the installed SGLang has no helper to rebuild the views some modules keep of their weights
        (0.5.16: no ``weight_cache`` package), a model with such views (``RadixLinearAttention``'s
        ``conv_weights``, rebuilt by 0.5.17's helper) cannot be served cached weights: they would still point at
        meta storage."""
        if sglang_releases.stale_views_rebuilder() is not None:
            return None
        try:
            from sglang.srt.layers.radix_linear_attention import RadixLinearAttention
        except ImportError:
            return None
        stale = [name for name, module in model.named_modules() if isinstance(module, RadixLinearAttention)]
        if not stale:
            return None
        return (
            f"this SGLang has no sglang.srt.weight_cache.ipc_loader.IpcModelLoader._rebuild_stale_views (SGLang "
            f"0.5.17 and later have it), which rebuilds the conv_weights views of this model's {len(stale)} "
            f"RadixLinearAttention layers (e.g. {stale[0]}) after attaching; without it they would point at meta "
            "storage. Use SGLang 0.5.17 or later to attach this model"
        )

    def after_bind(self, model: nn.Module, handle: Handle, context: SglangLoad) -> None:
        """Views some modules keep of their weights as plain attributes still point at meta storage; SGLang's own
        weight-cache loader knows which, and rebuilds them (where it has none, :meth:`cannot_serve` refused the
        models that have such views)."""
        rebuild = sglang_releases.stale_views_rebuilder()
        if rebuild is not None:
            rebuild(model)
        model.eval()


@attrs.frozen
class SglangLoad:
    """The context of one SGLang load, handed to every hook."""

    model_config: Any
    load_config: Any
    device_config: Any


def parallel_layout() -> dict[str, tuple[int, int]]:
    """This rank's place in SGLang's parallel layout: tp, pp, dp, ep, moe_dp, attn_dp, attn_cp as (rank, size).

    SGLang answers from its runtime context (published by the scheduler, or by whoever initialised model
    parallelism); a width it cannot tell here is left out.
    """
    from sglang.srt.runtime_context import get_parallel

    parallel = get_parallel()
    layout = {}
    for axis, (rank_attr, size_attr) in PARALLEL_AXES.items():
        try:
            rank, size = int(getattr(parallel, rank_attr)), int(getattr(parallel, size_attr))
        except Exception as exc:  # SGLang raises its own errors for widths not derivable in this process
            if axis in REQUIRED_AXES:
                # Without them every rank would get the same fingerprint and attach rank 0's shard.
                raise BackendError(
                    f"SGLang's parallel context does not tell this process's {axis} rank and size "
                    f"({type(exc).__name__}: {exc}); weightcache needs them to tell shards apart. Initialise "
                    "model parallelism (as SGLang's scheduler does) before loading the model."
                ) from exc
            continue
        layout[axis] = (rank, size)
    return layout


def model_identity(model_config: Any, load_config: Any) -> dict[str, Any]:
    """The parts of SGLang's config that decide the post-processed weights (the fingerprint's ``extra``)."""
    hf_config = _hf_config_json(model_config.hf_config)  # as before SGLang's model rewrote it (DeepSeek's rope_type)
    return {
        "hf_config": hf_config,
        "model_path": str(model_config.model_path),
        "revision": model_config.revision,
        "dtype": str(model_config.dtype),
        "quantization": model_config.quantization,
        "load_device": plain_json(getattr(load_config, "device", None)),
        # which MTP draft layer this loader keeps (and renames to layer 0): same shapes, other weights
        "draft_model_idx": plain_json(getattr(load_config, "draft_model_idx", None)),
        "server": _server_settings(),
        "env": {name: os.environ.get(name) for name in PROCESSING_ENV},
    }


#: What SGLang before 0.5.20 writes into a checkpoint's own ``quantization_config`` dict while it builds the quant
#: config (``weight_utils.get_quant_config``): a mapping from the model class (0.5.16 on) and the HF config itself
#: (0.5.17), which JSON cannot hold. Neither is the checkpoint's.
SGLANG_QUANT_ADDITIONS = ("hf_config", "packed_modules_mapping")


def _hf_config_json(hf_config: Any) -> Any:
    """:func:`~weightcache.backends.engine_config.config_json` of ``hf_config`` without what SGLang wrote into its
    ``quantization_config`` (:data:`SGLANG_QUANT_ADDITIONS`), so that a quantized checkpoint is described the same
    before and after SGLang built its quant config (on SGLang 0.5.17 the dict held the config itself after that,
    and describing the model failed: the engine loaded from disk; on 0.5.16 the description differed). A dict
    without them is described as it is."""
    quant = getattr(hf_config, "quantization_config", None)
    if not isinstance(quant, dict) or not any(key in quant for key in SGLANG_QUANT_ADDITIONS):
        return config_json(hf_config)
    hf_config.quantization_config = {k: v for k, v in quant.items() if k not in SGLANG_QUANT_ADDITIONS}
    try:
        return config_json(hf_config)
    finally:
        hf_config.quantization_config = quant


def _server_settings() -> dict[str, Any]:
    """Server settings that change post-processed weights (MoE kernels, shared-expert fusion, expert layout),
    when SGLang has published them in this process (None where it has not)."""
    try:
        from sglang.srt.runtime_context import get_server_args

        args = get_server_args()
    except Exception:  # not set up in this process (e.g. the loader layer used on its own)
        return {}
    return {f: plain_json(getattr(args, f, None)) for f in SERVER_FIELDS}


def _disk_load_config(load_config: Any) -> Any:
    """SGLang's LoadConfig for its own loader: load format auto, none of weightcache's options."""
    return dataclasses.replace(load_config, load_format="auto", model_loader_extra_config={})


def shareable_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """What mode daemon publishes: every parameter and buffer (tied ones once) after post-processing, and the
    tensors ``post_load_weights`` leaves as plain attributes (MLA's ``w_kc``/``w_vc``, split from ``kv_b_proj``),
    which attaching sets again on the meta-built model.

    Raises BackendError when post-processing left state outside the tensors that attaching cannot re-create
    (SGLang's AMX packing on CPU marks layers with ``use_intel_amx_backend``).
    """
    flagged = [name for name, module in model.named_modules() if getattr(module, "use_intel_amx_backend", False)]
    if flagged:
        raise BackendError(
            f"SGLang packed {len(flagged)} layers for Intel AMX (e.g. {flagged[0]}) and marked them in Python "
            "attributes, which a client cannot re-create from the published tensors. Run without weightcache here, "
            "or disable AMX packing."
        )
    state = dict([*model.named_parameters(), *model.named_buffers()])
    for name, tensor in tensor_attributes(model).items():
        state.setdefault(name, tensor)
    return state


@contextlib.contextmanager
def _meta_rope_entries_dropped() -> Iterator[None]:
    """Where SGLang's rotary-embedding cache does not tell a meta entry from a live one (before 0.5.20), forget the
    entries a build inside cached on meta (the model built keeps its own): else the model SGLang's own loader
    builds next (mode daemon's miss) would share a cos/sin table without data, and publishing it would fail.
    Elsewhere, nothing (SGLang checks its entries itself)."""
    if sglang_releases.rope_cache_checks_meta():
        yield
        return
    from sglang.srt.layers.rotary_embedding.factory import _ROPE_DICT

    before = set(_ROPE_DICT)
    try:
        yield
    finally:
        for key in [k for k in _ROPE_DICT if k not in before]:
            tensors = [*_ROPE_DICT[key].parameters(), *_ROPE_DICT[key].buffers()]
            if any(t.device.type == "meta" for t in tensors):
                del _ROPE_DICT[key]


@contextlib.contextmanager
def _engine_dtype(dtype: torch.dtype) -> Iterator[None]:
    from sglang.srt.model_loader.utils import set_default_torch_dtype

    with set_default_torch_dtype(dtype):
        yield


#: The ``--load-format`` that :func:`register` adds to ``sglang.launch_server`` (and ``sglang serve``).
LOAD_FORMAT = "weightcache"


def register() -> None:
    """The ``sglang.srt.plugins`` entry point: make ``--load-format weightcache`` available to
    ``python -m sglang.launch_server`` and ``sglang serve``, with the options in ``--model-loader-extra-config``
    (JSON, e.g. ``'{"mode": "client"}'``).

    SGLang runs its general plugins in every process before it parses arguments. This adds the load format to
    the accepted choices and wraps ``LoadConfig._verify_load_format`` so that the name becomes
    :class:`WeightCacheLoader` (a loader class, which SGLang's ``get_model_loader`` instantiates) instead of one
    of SGLang's own formats. A failure here is logged, not raised: engines that do not ask for weightcache keep
    working.
    """
    try:
        from sglang.srt.plugins.hook_registry import HookRegistry, HookType

        choices, add_load_format_choices = sglang_releases.load_format_choices()
        if LOAD_FORMAT not in choices:
            add_load_format_choices([LOAD_FORMAT])
        HookRegistry.register(
            "sglang.srt.configs.load_config.LoadConfig._verify_load_format", _verify_load_format, HookType.AROUND
        )
    except Exception as exc:
        logging.getLogger(__name__).warning(
            "weightcache could not register --load-format %s with this SGLang (%s: %s); weightcache supports %s. "
            "Use LoadConfig(load_format=WeightCacheLoader) instead.",
            LOAD_FORMAT,
            type(exc).__name__,
            exc,
            sglang_releases.RELEASES,
        )


def _verify_load_format(original: Any, load_config: Any) -> Any:
    """Around ``LoadConfig._verify_load_format``: ``"weightcache"`` becomes :class:`WeightCacheLoader`."""
    if isinstance(load_config.load_format, str) and load_config.load_format.lower() == LOAD_FORMAT:
        load_config.load_format = WeightCacheLoader
        return None
    return original(load_config)


class WeightCacheLoader:
    """SGLang model loader backed by the weightcache keeper (see :mod:`weightcache.backends.sglang`).

    It has SGLang's loader interface (``download_model``, ``load_model(*, model_config, device_config)``,
    ``preloaded_weights_bytes``) without subclassing SGLang's ``BaseModelLoader``, so that it can be imported
    (and named in a config) where SGLang is not installed.
    """

    #: Options fixed by :meth:`configure`; ``model_loader_extra_config`` entries override them.
    options_override: ClassVar[Mapping[str, object]] = {}
    #: Bytes of attached weights already resident before SGLang's pre-load memory baseline was sampled.
    preloaded_weights_bytes: int = 0

    def __init__(self, load_config: Any) -> None:
        self.load_config = load_config
        where = "weightcache's SGLang loader (model_loader_extra_config)"
        extra = load_config.model_loader_extra_config or {}
        if isinstance(extra, str):
            try:
                extra = json.loads(extra)
            except ValueError as exc:
                raise BackendConfigError(f"{where}: not JSON ({exc}); give a JSON object of options") from None
        if not isinstance(extra, Mapping):
            LoaderOptions.parse(extra, where=where)  # BackendConfigError: not a JSON object
        self.options = LoaderOptions.parse({**self.options_override, **extra}, where=where)
        self.backend = SglangBackend()
        self.backend.require()
        self.preloaded_weights_bytes = 0
        #: The Handle of the attached weights (its lease lasts as long as the loader or the model holds it).
        self.handle: Handle | None = None
        #: ``"cache"`` or ``"disk"``: where the last load_model took the weights from.
        self.source: str | None = None

    @classmethod
    def configure(
        cls,
        *,
        mode: str = "daemon",
        socket_dir: str | os.PathLike[str] | None = None,
        strict: bool = False,
        trusted_publishers: Sequence[str | int] = (),
    ) -> type[WeightCacheLoader]:
        """A subclass with these options fixed, to pass as ``load_format`` (options are validated here: a
        :class:`~weightcache.errors.BackendConfigError` for a wrong value)."""
        users = [trusted_publishers] if isinstance(trusted_publishers, (str, int)) else list(trusted_publishers)
        options = {
            "mode": mode,
            "socket_dir": None if socket_dir is None else os.fspath(socket_dir),
            "strict": strict,
            "trusted_publishers": users,  # one user named alone is one user (a string is a sequence of characters)
        }
        LoaderOptions.parse(options, where="WeightCacheLoader.configure()")
        return type(f"{cls.__name__}[{mode}]", (cls,), {"options_override": options})

    def download_model(self, model_config: Any) -> None:
        from sglang.srt.model_loader.loader import DefaultModelLoader

        DefaultModelLoader(_disk_load_config(self.load_config)).download_model(model_config)

    def load_model(self, *, model_config: Any, device_config: Any) -> nn.Module:
        device = torch.device(device_config.device)
        context = SglangLoad(model_config, self.load_config, device_config)
        loaded = self.backend.serve_engine(
            context,
            describe=lambda: self.backend.fingerprint(model_config, self.load_config, device),  # quant refused here
            device=device,
            options=self.options,
        )
        # SGLang adds this to a memory baseline sampled before load_model: only an entry that was resident then
        # counts; segments that appeared during this call (its own publish, or another engine's that it waited
        # for) were allocated after the sample and are already in its measure (Handle.resident_before).
        self.preloaded_weights_bytes = loaded.preloaded_bytes
        self.handle, self.source = loaded.handle, loaded.source
        # SGLang 0.5.19 on add it to that baseline themselves; before, the adapter adds it to the calling
        # ModelRunner's, and warns where it finds none
        if not sglang_releases.counts_preloaded_bytes() and not sglang_releases.account_preloaded_bytes(
            loaded.preloaded_bytes
        ):
            warnings.warn(uncounted_preload_warning(loaded.preloaded_bytes), stacklevel=2)
        return loaded.model


def uncounted_preload_warning(preloaded_bytes: int) -> str:
    """What to tell an operator whose SGLang (before 0.5.19) does not add ``preloaded_weights_bytes`` to its
    pre-load memory baseline, when the loader was not called by a ``ModelRunner`` whose baseline it could add them
    to itself: the weights were attached, and the KV cache leaves less headroom than usual."""
    gib = preloaded_bytes / (1 << 30)
    return (
        f"weightcache: attached {gib:.2f} GiB of weights that were resident before SGLang sampled its pre-load "
        "memory baseline; this SGLang does not count a loader's preloaded_weights_bytes (SGLang 0.5.19 and later "
        "do), and no SGLang ModelRunner.load_model called this loader for weightcache to add them to its baseline: "
        f"a KV cache sized from that baseline keeps about {gib:.2f} GiB x (1 - mem_fraction_static) less headroom "
        "than after a disk load. If the engine runs out of memory, lower --mem-fraction-static by "
        f"{gib:.2f} GiB / the GPU's memory, or use SGLang 0.5.19 or later."
    )


__all__ = [
    "LOAD_FORMAT",
    "PARALLEL_AXES",
    "SglangBackend",
    "SglangLoad",
    "WeightCacheLoader",
    "model_identity",
    "parallel_layout",
    "register",
    "shareable_state",
    "uncounted_preload_warning",
]

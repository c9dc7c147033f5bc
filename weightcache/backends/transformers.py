"""The Hugging Face transformers adapter: a transformers model given to :func:`weightcache.attach` gets what
transformers' own ``from_pretrained`` makes of the checkpoint.

``from_pretrained`` is the disk path (same class, same configuration, the dtype of the model built): key
renames, load-time conversions (fused MoE experts), tied weights and transformers' quantizers all run as they
would without weightcache, and the published entry holds every parameter and buffer of the loaded model,
computed buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) included, each computed buffer in the dtype of the
model given (a model ``.to(torch.bfloat16)``'d on meta holds ``inv_freq`` in bfloat16, which transformers
computes in float32: :func:`weightcache.loaders.in_model_dtypes`). A model built on meta, as the README shows,
then gets every one of them bound, and is left in evaluation mode, as ``from_pretrained`` leaves its models.
:func:`from_pretrained` here is the same in one call.

Quantization comes from the model's ``quantization_config``: fine-grained block FP8 (``quant_method`` ``fp8``
with ``weight_block_size``) is shared; per-tensor FP8, GPTQ and AWQ map to strategies that refuse them, and
every other method (bitsandbytes, torchao, compressed-tensors, ...) has none. Refused methods raise
UnsupportedQuantError in every mode (mode off included: binding their loaded tensors into a model built on meta
would lose the Python-side state they are refused for), before anything is loaded; load such a model with
transformers' ``from_pretrained`` directly.

Registered for models of the ``transformers`` package by :mod:`weightcache.loaders` (by name); importing this
module never imports transformers: each function imports it where it needs it.
"""

from __future__ import annotations

import copy
import json
import os
from typing import TYPE_CHECKING, Any, ClassVar

import torch
from torch import nn

from .. import loaders
from .. import quant as quant_registry
from ..api import attach
from ..checkpoint import model_config_file
from ..errors import CheckpointError, InvalidArgumentType, UnsupportedQuantError
from ..fingerprint import placement_of
from ..handle import Handle
from ..loaders import ModelIdentity, ModuleLoader
from ..pipeline import Request, refuse_if_switched_off, run
from ..torch_dtypes import resolve_dtype

if TYPE_CHECKING:
    from ..pipeline import Mode

#: Configuration keys that do not decide the weights: where the config was read, the release that wrote it, and
#: its dtype (the model's structure, also in the fingerprint, records every tensor's dtype).
_NOT_IDENTITY = frozenset({"_name_or_path", "transformers_version", "dtype", "torch_dtype"})

#: transformers ``quant_method`` -> weightcache strategy (``fp8`` depends on its block size; see quant_spec).
QUANT_METHODS: dict[str, str] = {"gptq": "gptq", "awq": "awq"}


def quant_spec(quantization_config: object) -> tuple[str, dict[str, Any] | None]:
    """(strategy name, config) for a transformers ``quantization_config`` (a dict or a config object; None:
    unquantized). Raises UnsupportedQuantError for a method without a weightcache strategy."""
    if quantization_config is None:
        return "none", None
    to_dict = getattr(quantization_config, "to_dict", None)
    raw = to_dict() if callable(to_dict) else quantization_config
    if not isinstance(raw, dict):
        raise InvalidArgumentType(f"quantization_config must be a dict or a transformers config; found {raw!r}")
    config = json.loads(json.dumps(raw, sort_keys=True, default=str))
    method = str(config.get("quant_method", "")).lower()
    if method == "fp8":
        return ("fp8_block" if config.get("weight_block_size") else "fp8_per_tensor"), config
    strategy = QUANT_METHODS.get(method)
    if strategy is None:
        raise UnsupportedQuantError(
            f"transformers quantization method {method!r} has no weightcache strategy, so its loaded weights cannot "
            "be shared safely (shared: fp8 with weight_block_size; refused by their strategies: fp8 per tensor, "
            "gptq, awq). Load this model with transformers' from_pretrained directly, without weightcache."
        )
    return strategy, config


def config_identity(config: Any) -> dict[str, Any]:
    """The configuration as plain JSON, without the keys that do not decide the weights."""
    full = json.loads(config.to_json_string(use_diff=False))
    return {k: v for k, v in full.items() if k not in _NOT_IDENTITY}


def _apply_dtype_plan(model: nn.Module, plan: dict[str, torch.dtype]) -> None:
    """Give the meta tensors that ``plan`` (name patterns -> dtype, transformers' own) names their dtype."""
    from transformers.core_model_loading import build_glob_alternation

    pattern, by_group, _ = build_glob_alternation(list(plan))
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for table in (module._parameters, module._buffers):
            for attr, tensor in table.items():
                match = None if tensor is None or not tensor.is_meta else pattern.search(dot + attr)
                if tensor is None or match is None or not tensor.is_floating_point():
                    continue
                want = plan[by_group[str(match.lastgroup)]]
                if tensor.dtype == want:
                    continue
                placeholder = torch.empty_like(tensor, dtype=want)
                if isinstance(tensor, nn.Parameter):
                    placeholder = nn.Parameter(placeholder, requires_grad=tensor.requires_grad)
                table[attr] = placeholder


def _quantization_config(config: Any) -> object:
    found = getattr(config, "quantization_config", None)
    if found is None and hasattr(config, "get_text_config"):
        found = getattr(config.get_text_config(decoder=True), "quantization_config", None)
    return found


class TransformersLoader(ModuleLoader):
    """transformers' ``from_pretrained`` as a :class:`~weightcache.loaders.ModuleLoader`."""

    name: ClassVar[str] = "transformers"

    def version(self) -> str:
        import transformers

        return str(transformers.__version__)

    def prepare(self, model: nn.Module, checkpoint: str | os.PathLike[str], dtype: torch.dtype | None) -> None:
        """Make a model built on meta hold what ``from_pretrained`` builds before it loads: the dtypes its
        ``keep_in_fp32`` plan decides (DeepSeek-V3's ``e_score_correction_bias`` stays float32 in a bfloat16
        model), and for a pre-quantized model the modules its quantizer substitutes (once)."""
        get_plan = getattr(model, "_get_dtype_plan", None)
        plan = get_plan(dtype) if dtype is not None and callable(get_plan) else {}
        if plan:
            _apply_dtype_plan(model, plan)
        config = getattr(model, "config", None)
        if _quantization_config(config) is None or getattr(model, "quantization_method", None) is not None:
            return
        from transformers.quantizers.auto import get_hf_quantizer

        quantizer, _, device_map = get_hf_quantizer(copy.deepcopy(config), None, None, True, {})
        if quantizer is None:
            return
        with torch.device("meta"):
            quantizer.preprocess_model(model=model, dtype=dtype, device_map=device_map, checkpoint_files=None)

    def identify(self, model: nn.Module, checkpoint: str | os.PathLike[str]) -> ModelIdentity:
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "to_json_string"):
            raise InvalidArgumentType(f"{type(model).__name__} is no transformers PreTrainedModel (it has no config)")
        method, quant_config = quant_spec(_quantization_config(config))
        # Refused in every mode, mode off included: binding a refused method's loaded tensors into a model built
        # on meta would lose the Python-side state that makes it refused (transformers' own load keeps it).
        try:
            quant_registry.get(method).check(quant_config)
        except UnsupportedQuantError as exc:
            raise UnsupportedQuantError(
                f"{type(model).__name__} is quantized as weightcache's {method!r}, which cannot be shared "
                f"({exc}). weightcache.attach refuses it for "
                "transformers models in every mode: load this model with transformers' from_pretrained directly."
            ) from None
        cls = type(model)
        fields = {"class": f"{cls.__module__}.{cls.__qualname__}", "config": config_identity(config)}
        return ModelIdentity(method, quant_config, fields)

    def after_bind(self, model: nn.Module) -> None:
        """Evaluation mode (dropout off), as ``from_pretrained`` returns its models; ``from_config`` builds them in
        training mode. Call ``model.train()`` after attaching to train."""
        model.eval()

    def default_dtype(self, model: nn.Module) -> torch.dtype | None:
        dtype = getattr(model, "dtype", None)  # PreTrainedModel.dtype: that of its first floating point tensor
        return dtype if isinstance(dtype, torch.dtype) else super().default_dtype(model)

    def load(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], device: torch.device, dtype: torch.dtype | None
    ) -> dict[str, torch.Tensor]:
        loaded = type(model).from_pretrained(  # type: ignore[attr-defined]
            os.fspath(checkpoint),
            config=copy.deepcopy(model.config),
            dtype=dtype if dtype is not None else "auto",
            # on the CPU without a device map, which would need accelerate; on a GPU straight to it
            device_map=None if device.type == "cpu" else str(device),
        )
        # Each tensor once (under its first name): tied names share it again when bound into a model tied alike.
        state: dict[str, torch.Tensor] = dict(loaded.named_parameters())
        state.update(loaded.named_buffers())
        del loaded
        return state


def build_on_meta(
    checkpoint: str | os.PathLike[str], model_class: Any = None, dtype: torch.dtype | str | None = None
) -> Any:
    """The model of ``checkpoint``'s ``config.json`` built on the meta device, as the README shows:
    ``model_class.from_config(config)`` (``model_class`` default ``AutoModelForCausalLM``), with ``dtype=`` when
    given (else in the configuration's dtype).

    Raises :class:`~weightcache.errors.CheckpointError` where ``checkpoint`` is not a directory holding a
    ``config.json`` (:func:`weightcache.checkpoint.model_config_file`) or transformers cannot read that file."""
    import transformers

    cls = model_class if model_class is not None else transformers.AutoModelForCausalLM
    config_file = model_config_file(checkpoint)
    try:
        config = transformers.AutoConfig.from_pretrained(os.fspath(checkpoint))
    except (OSError, ValueError, KeyError) as exc:  # malformed JSON; no model_type, or one it does not know
        lines = str(exc).strip().splitlines()
        detail = " ".join(lines[0].split())[:300].rstrip(".") if lines else type(exc).__name__
        raise CheckpointError(
            f"transformers cannot read {config_file}: {detail}. Expected a model's configuration as "
            f"save_pretrained() writes it, of a model_type that transformers {transformers.__version__} knows: "
            "re-save the model with save_pretrained(), or upgrade transformers for a newer model"
        ) from exc
    build = getattr(cls, "from_config", None) or cls._from_config
    with torch.device("meta"):
        return build(config, dtype=resolve_dtype(dtype)) if dtype is not None else build(config)


def from_pretrained(
    checkpoint: str | os.PathLike[str],
    *,
    model_class: Any = None,
    mode: Mode = "off",
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    **options: Any,
) -> Any:
    """A transformers model with the weights of ``checkpoint``, from the cache or from disk by ``mode``: the
    README's pattern (build on meta, :func:`weightcache.attach`) in one call, shaped like ``from_pretrained``.

    Args:
        checkpoint: a local ``save_pretrained`` directory.
        model_class: a transformers model class or auto class (default ``AutoModelForCausalLM``).
        mode: as for :func:`weightcache.attach`.
        device: as for :func:`weightcache.attach`.
        dtype: the dtype to build and load in (default: the configuration's).
        options: further keyword arguments of :func:`weightcache.attach` (``socket_dir``, ``strict``, ...).

    Returns:
        The model, in eval mode; ``model.weightcache_handle`` is the :class:`~weightcache.Handle` of its weights
        (the lease lives as long as the model).
    """
    model = build_on_meta(checkpoint, model_class, dtype)
    handle = attach(model, checkpoint, mode=mode, device=device, dtype=dtype, **options)
    model.__dict__["weightcache_handle"] = handle
    return model


def preload(
    checkpoint: str | os.PathLike[str],
    *,
    model_class: Any = None,
    device: torch.device | str | None = None,
    dtype: torch.dtype | str | None = None,
    socket_dir: str | os.PathLike[str] | None = None,
    progress: bool | None = None,
    digests: bool = True,
    max_segment_bytes: int | None = None,
) -> Handle:
    """Publish into the keeper (starting one if none runs) the entry that a transformers model of ``checkpoint``,
    built as :func:`build_on_meta` builds it, attaches: ``weightcache load --engine transformers``. Mode daemon's
    first start without an engine, strict (a refused budget raises). Arguments as for :func:`from_pretrained`
    and :func:`weightcache.preload`. Returns the attached Handle (``read_disk`` False when the keeper already
    held the entry). Raises WeightCacheError where ``WEIGHTCACHE_MODE=off`` switched weightcache off."""
    refuse_if_switched_off()
    model = build_on_meta(checkpoint, model_class, dtype)
    loader = TransformersLoader()
    placement_of(device)  # InvalidArgument for a device that is none or that this process lacks
    dev = torch.device(device) if device is not None else torch.device("cpu")
    load_dtype, fingerprint, identity = loaders.identify(
        loader, model, checkpoint, device=dev, dtype=resolve_dtype(dtype), parallel=None, transform=None
    )
    steps = loaders.LoaderSteps(loader, model, checkpoint, dev, load_dtype, None)
    request = Request(
        fingerprint, "daemon", True, socket_dir, progress, digests, max_segment_bytes, identity.quant_config
    )
    return run(request, steps)


__all__ = [
    "QUANT_METHODS",
    "TransformersLoader",
    "build_on_meta",
    "config_identity",
    "from_pretrained",
    "preload",
    "quant_spec",
]

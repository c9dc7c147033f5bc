"""What an engine adapter records about the engine's configuration: its quantization mapped to a
:mod:`weightcache.quant` strategy (:class:`QuantSpec`, :func:`quant_spec_from_config`), its Hugging Face config as
plain JSON as first seen (:func:`config_json`), and the device as a fingerprint names it (:func:`device_spec`).

Shared by the vLLM and SGLang adapters (both describe quantization with a ``QuantizationConfig``). Imports no
engine.
"""

from __future__ import annotations

import json
import weakref
from typing import Any

import attrs
import torch

from ..errors import InvalidArgumentType, UnsupportedQuantError


@attrs.frozen
class QuantSpec:
    """An engine's quantization, as weightcache sees it: a strategy name and the config whose hash joins the
    fingerprint (JSON-serialisable, or None)."""

    method: str
    config: dict[str, Any] | None = None


def config_json(config: Any) -> Any:
    """An engine's Hugging Face config (``PretrainedConfig``) as plain JSON, as it was the first time this
    process asked about that config object.

    Engines rewrite their config while building a model (vLLM's and SGLang's DeepSeek-V2/V3 set
    ``rope_parameters["rope_type"]`` from ``"yarn"`` to ``"deepseek_yarn"``), so the same engine would otherwise
    describe itself one way before its model is built (when vLLM sizes its caches, when the load looks up the
    keeper) and another way after (a second question from the same process, a second load). Every adapter asks
    before the engine builds anything, so the first answer is the configuration as loaded from the checkpoint.
    """
    key = id(config)
    cached = _CONFIG_JSON.get(key)
    if cached is not None and cached[0]() is config:
        return json.loads(cached[1])
    text = config.to_json_string(use_diff=False)
    try:
        ref = weakref.ref(config, lambda _: _CONFIG_JSON.pop(key, None))
    except TypeError:  # not weak-referenceable: no memory of it
        return json.loads(text)
    _CONFIG_JSON[key] = (ref, text)
    return json.loads(text)


#: :func:`config_json`'s memory: id of a config object -> (a weak reference to it, its JSON when first asked).
_CONFIG_JSON: dict[int, tuple[weakref.ref[Any], str]] = {}


def device_spec(device: torch.device | str) -> str:
    """``"cpu"`` or ``"cuda:N"`` for a torch device (an index-less CUDA device is the current one)."""

    dev = torch.device(device)
    if dev.type == "cuda":
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        return f"cuda:{index}"
    return dev.type


#: Engine quantization methods (``QuantizationConfig.get_name()`` in vLLM and SGLang) and the weightcache
#: strategy for each. ``fp8``
#: depends on its config (block-wise or per-tensor) and is handled separately; anything else is refused.
QUANT_METHODS: dict[str, str] = {
    "awq": "awq",
    "auto_awq": "awq",
    "awq_marlin": "awq",
    "gptq": "gptq",
    "auto_gptq": "gptq",
    "gptq_marlin": "gptq",
    "gptq_marlin_24": "marlin",
    "marlin": "marlin",
}
#: FP8 methods: block-wise when the config carries ``weight_block_size``, else per-tensor or per-channel.
FP8_METHODS = ("fp8", "fp8_per_block", "fp8_per_tensor", "fp8_per_channel", "fbgemm_fp8")


def quant_spec_from_config(engine: str, engine_quant: object) -> QuantSpec:
    """Map an engine's quantization config object (vLLM's or SGLang's ``QuantizationConfig``, with
    ``get_name()``; None: unquantized) to a weightcache strategy.

    FP8 is block-wise (``fp8_block``) when the config carries ``weight_block_size``, else per-tensor (refused by
    its strategy). The config hashed into the fingerprint holds the engine's method name, the block size, and
    every plain-JSON attribute of the config object. Raises UnsupportedQuantError for unmapped methods.
    """
    if engine_quant is None:
        return QuantSpec("none")
    get_name = getattr(engine_quant, "get_name", None)
    method = get_name() if callable(get_name) else None
    if not isinstance(method, str):
        raise InvalidArgumentType(f"{engine} adapter: expected a QuantizationConfig or None; found {engine_quant!r}")
    config: dict[str, Any] = {"engine_method": method, "config": _json_attributes(engine_quant)}
    if method in FP8_METHODS:
        block = getattr(engine_quant, "weight_block_size", None)
        if block:
            config["weight_block_size"] = [int(b) for b in block]
            return QuantSpec("fp8_block", config)
        return QuantSpec("fp8_per_tensor", config)
    strategy = QUANT_METHODS.get(method)
    if strategy is None:
        mapped = ", ".join(sorted([*FP8_METHODS, *QUANT_METHODS]))
        raise UnsupportedQuantError(
            f"{engine} quantization method {method!r} has no weightcache strategy, so its post-processed weights "
            f"cannot be shared safely (mapped methods: {mapped}). Load this model without weightcache, or add a "
            "strategy (weightcache.quant.register) after checking it with `weightcache parity`."
        )
    return QuantSpec(strategy, config)


def plain_json(value: object) -> Any:
    """``value`` if it is plain JSON, else None: reprs of objects can hold addresses, which differ per process."""
    try:
        return json.loads(json.dumps(value, sort_keys=True))
    except (TypeError, ValueError):
        return None


def _json_attributes(obj: object) -> dict[str, Any]:
    """The attributes of a config object that are plain JSON (the rest cannot be compared across processes)."""
    out = {}
    for key, value in sorted(vars(obj).items()):
        plain = plain_json(value)
        if plain is not None or value is None:
            out[key] = plain
    return out


__all__ = [
    "FP8_METHODS",
    "QUANT_METHODS",
    "QuantSpec",
    "config_json",
    "device_spec",
    "plain_json",
    "quant_spec_from_config",
]

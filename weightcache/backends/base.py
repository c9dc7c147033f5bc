"""The engine adapter interface, as one import: everything an adapter needs, from the modules it lives in.

- :mod:`weightcache.backends.template`: the :class:`Backend` template that owns the sequence of an engine's
  load, the hooks each engine fills in, and :class:`LoaderOptions`;
- :mod:`weightcache.backends.engine_steps`: the steps the one mode engine drives for an adapter, and how published
  tensors are fitted into the engine's meta model (:func:`adopt_published_layout`);
- :mod:`weightcache.backends.engine_config`: quantization mapped to strategies, configs as plain JSON;
- :mod:`weightcache.backends.releases`: the releases of an engine an adapter supports.

Each engine's hooks live in its own module (``vllm``, ``sglang``, ``transformers``, ``torch``), and what differs
between an engine's releases in one module named for it (``vllm_releases``, ``sglang_releases``).

This module must not import any engine.
"""

from __future__ import annotations

from .engine_config import (
    FP8_METHODS,
    QUANT_METHODS,
    QuantSpec,
    config_json,
    device_spec,
    plain_json,
    quant_spec_from_config,
)
from .engine_steps import EngineSteps, adopt_published_layout, own_tensors
from .releases import UNTESTED_ENGINES_ENV, ReleaseRange
from .template import ENGINE_MODES, MODE_ENV, Backend, EngineMode, Loaded, LoaderOptions

__all__ = [
    "ENGINE_MODES",
    "FP8_METHODS",
    "MODE_ENV",
    "QUANT_METHODS",
    "UNTESTED_ENGINES_ENV",
    "Backend",
    "EngineMode",
    "EngineSteps",
    "Loaded",
    "LoaderOptions",
    "QuantSpec",
    "ReleaseRange",
    "adopt_published_layout",
    "config_json",
    "device_spec",
    "own_tensors",
    "plain_json",
    "quant_spec_from_config",
]

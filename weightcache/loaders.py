"""Module loaders: a framework's own loader, for :func:`weightcache.attach` of that framework's models.

The weights of a plain ``nn.Module`` are its checkpoint's tensors. A framework with its own loader makes more of
the files than that: transformers' ``from_pretrained`` renames, converts and fuses tensors (MoE experts), ties
weights, runs quantizers, and the model computes buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) when it
is built. For such a model the entry holds what the framework's loader produced, every parameter and buffer of
the loaded model, just as an engine adapter publishes its post-processed model; a model built on meta then gets
all of them bound, computed buffers included.

A :class:`ModuleLoader` says how, for the models of one framework; :func:`for_model` finds it by the package that
defines the model's class. The built-in table names the transformers adapter's module
(``weightcache.backends.transformers``) as text and imports it on the first model of that package: the one
place where this layer reaches an adapter, by name and only at run time, the way :func:`weightcache.backends.get`
does, so that it works from a source checkout (entry points would need an installed distribution). Other
frameworks :func:`register` theirs.

The fingerprint of such a model records the framework and its version, the loader's description of the model
(its configuration), and the :func:`~weightcache.structure.structure_digest` of the model as built: another
configuration or build is a miss that names the difference, never an entry bound into a model it was not made
for. This module never decides a mode: :mod:`weightcache.pipeline` does.
"""

from __future__ import annotations

import abc
import importlib
import os
from collections.abc import Callable, Mapping, MutableMapping
from typing import Any, ClassVar

import attrs
import torch
from torch import nn

from .binding import bind, check_fit
from .errors import InvalidArgumentType
from .fingerprint import Fingerprint
from .handle import Handle
from .pipeline import Steps
from .structure import structure_digest

Transform = Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]]


@attrs.frozen
class ModelIdentity:
    """What a module loader says about a model: its quantization (a :mod:`weightcache.quant` strategy name and
    the config whose hash joins the fingerprint) and plain-JSON identity fields (the model's configuration)."""

    quant: str = "none"
    quant_config: Mapping[str, Any] | None = None
    fields: Mapping[str, Any] = attrs.field(factory=dict)


class ModuleLoader(abc.ABC):
    """A framework's loader, for models of that framework given to :func:`weightcache.attach`.

    Class attributes:
        name: the framework's name; the ``engine`` of the fingerprints made for its models.
    """

    name: ClassVar[str]

    @abc.abstractmethod
    def version(self) -> str:
        """The framework's version (weights made by another version never match)."""

    def prepare(  # noqa: B027 (an optional hook)
        self, model: nn.Module, checkpoint: str | os.PathLike[str], dtype: torch.dtype | None
    ) -> None:
        """Give a model built on meta the structure the loader's own model has before weights load, for loading
        in ``dtype`` (tensors it keeps in another dtype, modules a quantizer substitutes), so that the loaded
        tensors fit it. Default: nothing."""

    @abc.abstractmethod
    def identify(self, model: nn.Module, checkpoint: str | os.PathLike[str]) -> ModelIdentity:
        """The model's quantization and identity. Raises UnsupportedQuantError for a quantization method that
        has no weightcache strategy, before anything is loaded."""

    @abc.abstractmethod
    def load(
        self, model: nn.Module, checkpoint: str | os.PathLike[str], device: torch.device, dtype: torch.dtype | None
    ) -> dict[str, torch.Tensor]:
        """Load ``checkpoint`` with the framework's own loader into a model like ``model`` (same class and
        configuration) on ``device`` and return every parameter and buffer it holds, each tensor once under
        its first name. The loaded model is dropped before this returns (publishing releases its tensors as it
        goes)."""

    def after_bind(self, model: nn.Module) -> None:  # noqa: B027 (an optional hook)
        """Leave ``model``, its weights bound, as the framework's own loader leaves the models it loads (in every
        mode, on every path). Default: nothing."""

    def default_dtype(self, model: nn.Module) -> torch.dtype | None:
        """The dtype to load in when :func:`~weightcache.attach` is given none: that of the model's first
        floating point parameter (None for a model without one)."""
        for p in model.parameters():
            if p.is_floating_point():
                return p.dtype
        return None


#: Package of a model's class -> "module:attribute" of its loader, imported on first use.
_BUILTIN: dict[str, str] = {"transformers": "weightcache.backends.transformers:TransformersLoader"}
_registry: dict[str, ModuleLoader] = {}


def register(package: str, loader: ModuleLoader) -> None:
    """Use ``loader`` for models whose class (or a base class) is defined in top-level package ``package``."""
    if not isinstance(loader, ModuleLoader):
        raise InvalidArgumentType(f"register() expects a weightcache.loaders.ModuleLoader; found {loader!r}")
    _registry[package] = loader


def for_model(model: nn.Module) -> ModuleLoader | None:
    """The loader for ``model``'s framework (by the packages of its class and base classes), or None for a
    plain module, whose weights are its checkpoint's tensors."""
    for cls in type(model).__mro__:
        package = cls.__module__.partition(".")[0]
        loader = _registry.get(package)
        if loader is not None:
            return loader
        target = _BUILTIN.get(package)
        if target is not None:
            module_name, _, attr = target.partition(":")
            made: ModuleLoader = getattr(importlib.import_module(module_name), attr)()
            _registry[package] = made
            return made
    return None


def identify(
    loader: ModuleLoader,
    model: nn.Module,
    checkpoint: str | os.PathLike[str],
    *,
    device: torch.device,
    dtype: torch.dtype | None,
    parallel: Mapping[str, tuple[int, int]] | None,
    transform: Transform | None,
) -> tuple[torch.dtype | None, Fingerprint, ModelIdentity]:
    """Prepare ``model`` and compute the fingerprint of what ``loader`` makes of ``checkpoint`` for it: the dtype
    to load in, the fingerprint, and the loader's identity of the model (its quantization)."""
    identity = loader.identify(model, checkpoint)  # refuses an unsupported quantization before anything else
    load_dtype = dtype if dtype is not None else loader.default_dtype(model)
    loader.prepare(model, checkpoint, load_dtype)
    fingerprint = Fingerprint.create(
        checkpoint,
        dtype=load_dtype,
        quant=identity.quant,
        quant_config=identity.quant_config,
        parallel=parallel,
        transform=transform,
        device=device,
        extra={loader.name: dict(identity.fields), "structure": structure_digest(model)},
        engine=loader.name,
        engine_version=loader.version(),
    )
    return load_dtype, fingerprint, identity


class LoaderSteps(Steps[Handle]):
    """:func:`weightcache.attach`'s steps for a model with a module loader: the weights are what the loader
    makes of the checkpoint for this model; serving them is binding them into it."""

    def __init__(
        self,
        loader: ModuleLoader,
        model: nn.Module,
        checkpoint: str | os.PathLike[str],
        device: torch.device,
        dtype: torch.dtype | None,
        transform: Transform | None,
    ) -> None:
        self.loader = loader
        self.model = model
        self.checkpoint = checkpoint
        self.device = device
        self.dtype = dtype
        self.transform = transform

    def load_state(self) -> MutableMapping[str, torch.Tensor]:
        state = in_model_dtypes(self.model, self.loader.load(self.model, self.checkpoint, self.device, self.dtype))
        return self.transform(state) if self.transform is not None else state

    def serve(self, handle: Handle) -> Handle:
        bind(self.model, handle.tensors, device=self.device)
        self.loader.after_bind(self.model)
        return handle

    def check_fit(self, tensors: Mapping[str, torch.Tensor] | None) -> None:
        # What the loader makes is known only once it ran: the pipeline checks it then, before publishing.
        if tensors is not None:
            check_fit(self.model, tensors)


def in_model_dtypes(model: nn.Module, state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """``state`` with each floating point buffer in the dtype that ``model``'s buffer of that name has.

    A framework's loader computes buffers (rotary ``inv_freq``, Gemma's ``embed_scale``) with the model's own
    code, in the dtype that code picks (float32 for ``inv_freq``, whatever the weights' dtype). A model built on
    meta and then converted (``model.to(torch.bfloat16)``, as the PyTorch docs show) holds them in the dtype it
    was converted to, and would have held the same values, rounded alike, had it been built for real: so the
    loaded values are converted to the model's dtype, exactly what its own ``.to()`` would have made of them.
    Parameters are never converted: one of another dtype than the loaded weights is a BindError that names the
    dtype to build or to load in.
    """
    wanted: dict[str, torch.dtype] = {}
    for name, buffer in model.named_buffers(remove_duplicate=False):
        if buffer.is_floating_point():
            wanted[name] = buffer.dtype
    for name, tensor in state.items():
        dtype = wanted.get(name)
        if dtype is not None and tensor.dtype != dtype and tensor.is_floating_point():
            state[name] = tensor.to(dtype)
    return state


__all__ = ["LoaderSteps", "ModelIdentity", "ModuleLoader", "for_model", "identify", "in_model_dtypes", "register"]

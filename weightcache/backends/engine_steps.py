"""The engine steps the one mode engine drives for an adapter (:class:`EngineSteps`), and how an engine's
published tensors are fitted into the model it built on meta (:func:`adopt_published_layout`).

:meth:`weightcache.backends.template.Backend.load_model` hands :class:`EngineSteps` to
:func:`weightcache.pipeline.run`; the steps call the adapter's hooks and never decide a mode or a fallback.
Imports no engine.
"""

from __future__ import annotations

from collections.abc import Iterator, MutableMapping
from typing import Any, Protocol

import torch
from torch import nn

from ..binding import bind, set_tensor_attributes
from ..errors import BackendError, BindError, WeightCacheError
from ..fingerprint import Fingerprint
from ..handle import Handle
from ..pipeline import Steps
from ..structure import structure_digest


class EngineHooks(Protocol):
    """What :class:`EngineSteps` asks of an adapter: the hooks of
    :class:`~weightcache.backends.template.Backend`, which provides them all (this module names them here, so that
    it needs nothing from the module that uses it)."""

    @property
    def name(self) -> str: ...

    @property
    def records_structure(self) -> bool: ...

    def build_meta(self, context: Any) -> nn.Module: ...

    def cannot_serve(self, model: nn.Module, context: Any) -> str | None: ...

    def release_model(self, model: nn.Module, context: Any) -> None: ...

    def published_state(self, context: Any) -> MutableMapping[str, torch.Tensor]: ...

    def load_from_disk(self, context: Any) -> nn.Module: ...

    def after_bind(self, model: nn.Module, handle: Handle, context: Any) -> None: ...


class EngineSteps(Steps[nn.Module]):
    """:meth:`~weightcache.backends.template.Backend.load_model`'s steps: the hooks of one backend, for one load.

    The model built before the lookup (:meth:`complete`) is kept for :meth:`serve` on a hit and released
    before anything loads from disk; one built later is checked against the structure the fingerprint holds."""

    def __init__(self, backend: EngineHooks, context: Any, device: torch.device) -> None:
        self.backend = backend
        self.context = context
        self.device = device
        self.handle: Handle | None = None
        self.source = "disk"
        self.built: nn.Module | None = None
        self.structure: str | None = None

    def complete(self, fingerprint: Fingerprint) -> Fingerprint:
        """``fingerprint`` with the structure of the engine's model, built on meta now (it waits for
        :meth:`serve`); BackendError when it cannot be built there."""
        if not self.backend.records_structure:
            return fingerprint
        try:
            self.built = self.backend.build_meta(self.context)
        except Exception as exc:  # the engine's own load may still work: the pipeline falls back to it
            raise BackendError(
                f"the {self.backend.name} engine's model cannot be built on the meta device, so cached weights "
                f"cannot be bound into it ({type(exc).__name__}: {exc})"
            ) from exc
        reason = self.backend.cannot_serve(self.built, self.context)
        if reason is not None:
            self.release_built()
            raise BackendError(reason)
        self.structure = structure_digest(self.built)
        return fingerprint.with_extra(structure=self.structure)

    def release_built(self) -> None:
        """Release the model built before the lookup, if it is still waiting (it will not be served)."""
        model, self.built = self.built, None
        if model is not None:
            self.backend.release_model(model, self.context)

    def load_state(self) -> MutableMapping[str, torch.Tensor]:
        self.release_built()
        return self.backend.published_state(self.context)

    def serve_disk(self, reason: str | None) -> nn.Module:
        self.release_built()
        self.handle, self.source = None, "disk"
        return self.backend.load_from_disk(self.context)

    def serve(self, handle: Handle) -> nn.Module:
        model, self.built = self.built, None
        if model is None:  # released for a load from disk: build it again, as it was fingerprinted
            model = self.backend.build_meta(self.context)
            if self.structure is not None and structure_digest(model) != self.structure:
                self.backend.release_model(model, self.context)
                raise BackendError(
                    f"the {self.backend.name} engine built two different models for one configuration (structure "
                    f"{self.structure[:12]} when fingerprinted, {structure_digest(model)[:12]} after loading), so the "
                    "weights cannot be bound safely. Report it: the adapter's build_model is not deterministic."
                )
        attributes = adopt_published_layout(model, handle)
        buffers = {name for name, _ in model.named_buffers(remove_duplicate=False)}
        bound = {n: private_if(n in buffers, t) for n, t in handle.tensors.items() if n not in attributes}
        bind(model, bound, device=self.device)
        set_tensor_attributes(model, {n: handle.tensors[n] for n in attributes})
        try:
            self.backend.after_bind(model, handle, self.context)
        except WeightCacheError:
            raise
        except Exception as exc:  # an engine API that moved or refuses: the pipeline loads from disk instead
            self.backend.release_model(model, self.context)
            raise BackendError(
                f"the installed {self.backend.name} could not finish a model built around cached weights "
                f"({type(exc).__name__}: {exc})"
            ) from exc
        model.__dict__["weightcache_handle"] = handle  # the lease lives as long as the model
        self.handle, self.source = handle, handle.source
        return model


def drop_parameters(model: nn.Module) -> None:
    """Replace every parameter of ``model`` by a meta placeholder of its shape and dtype, so that the model no
    longer keeps the weights' memory.

    For a model loaded only to publish its tensors: publishing releases each tensor as it is copied into a
    segment, which frees memory only where nothing else holds it, and an engine may keep a reference to a model
    it built (vLLM 0.26's compiled-module wrappers do, so that a mode daemon engine on a GPU held a second copy
    of the weights for its lifetime). Buffers are left alone: an engine may share them between models (vLLM's
    rotary tables)."""
    for module in model.modules():
        for name, param in module._parameters.items():
            if param is not None and not param.is_meta:
                placeholder = torch.empty(param.shape, dtype=param.dtype, device="meta")
                module._parameters[name] = nn.Parameter(placeholder, requires_grad=False)


def private_if(copy: bool, tensor: torch.Tensor) -> torch.Tensor:
    """``tensor``, or a private copy of it when ``copy``.

    Engines bind buffers privately: they write into some after loading (vLLM's attention layers reset their
    ``_k_scale``/``_v_scale``/... buffers with ``fill_`` in every post-processing), and a GPU mapping of the
    keeper's memory is read-only, where such a write is an illegal memory access that ends the engine's CUDA
    context. Buffers are small (scales, rotary tables); parameters, the weights, stay shared."""
    return tensor.clone() if copy else tensor


def own_tensors(module: nn.Module, prefix: str) -> Iterator[tuple[str, torch.Tensor]]:
    """The parameters and buffers ``module`` itself registers (not its children's), by full name."""
    dot = f"{prefix}." if prefix else ""
    for attr, p in module._parameters.items():
        if p is not None:
            yield dot + attr, p
    for attr, b in module._buffers.items():
        if b is not None:
            yield dot + attr, b


def adopt_published_layout(model: nn.Module, handle: Handle) -> frozenset[str]:
    """Make a model built on meta hold exactly the tensors that were published, before binding them; return the
    published names that are plain tensor attributes of their module (see
    :func:`~weightcache.binding.tensor_attributes`: the module has an attribute of that name that is neither a
    parameter, a buffer nor a submodule, e.g. ``self.w_kc = None``), for the caller to set rather than bind.

    Post-processing may replace a parameter by one of another shape or dtype (e.g. a transposed or re-scaled
    FP8 weight), register new ones, or drop some. The published tensors are that result, so their layout
    wins: a meta placeholder is re-made with the published shape and dtype (keeping its Parameter class and
    attributes), a published name the model lacks is registered on its module, and a model tensor that was
    not published (and is not tied to one that was) is removed.

    Only quantized weights change layout in post-processing: for ``quant == "none"`` a published tensor whose
    shape or dtype differs from the model's is a BindError, never adopted. Such a difference means the entry
    was made under a setting the fingerprint does not capture (e.g. another expert-parallel layout), and
    adopting it would serve wrong weights.
    """
    may_relayout = handle.fingerprint.quant != "none"
    refused: list[str] = []

    manifest = handle.manifest
    kinds = dict(zip(manifest.names, manifest.kind)) if manifest is not None else {}
    modules = dict(model.named_modules(remove_duplicate=False))
    present: dict[str, torch.Tensor] = {}
    owners: dict[int, list[str]] = {}
    for prefix, module in model.named_modules(remove_duplicate=False):
        for name, tensor in own_tensors(module, prefix):
            present[name] = tensor
            owners.setdefault(id(tensor), []).append(name)
    published = handle.tensors
    if not may_relayout:  # checked before anything changes: a refusal leaves the model as it was
        for name, tensor in published.items():
            current = present.get(name)
            if (
                current is not None
                and current.is_meta
                and (current.shape != tensor.shape or current.dtype != tensor.dtype)
            ):
                refused.append(
                    f"{name}: published {tuple(tensor.shape)} {tensor.dtype}, model {tuple(current.shape)} "
                    f"{current.dtype}"
                )
    if refused:
        raise BindError(
            f"the cached entry {handle.digest[:12]} does not fit this {type(model).__name__}: "
            + "; ".join(refused[:8])
            + (f" and {len(refused) - 8} more" if len(refused) > 8 else "")
            + ". Unquantized weights never change shape in post-processing, so the entry was made under a "
            "setting its fingerprint does not record; evict it (`weightcache evict`) and report the setting."
        )
    attributes: set[str] = set()
    for name, tensor in published.items():
        current = present.get(name)
        module_name, _, leaf = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise BindError(f"published tensor {name!r} has no module {module_name!r} in {type(model).__name__}")
        if current is None and leaf in vars(module):
            attributes.add(name)
            continue
        if current is not None and current.shape == tensor.shape and current.dtype == tensor.dtype:
            continue
        if current is not None and not current.is_meta:
            continue  # materialised (e.g. a computed buffer): bind reports any mismatch
        placeholder = torch.empty(tensor.shape, dtype=tensor.dtype, device="meta")
        if current is not None and leaf in module._parameters:
            new = torch.Tensor._make_subclass(type(current), placeholder, False)
            new.__dict__.update(current.__dict__)
            for alias in owners.get(id(current), [name]):
                alias_module, _, alias_leaf = alias.rpartition(".")
                modules[alias_module]._parameters[alias_leaf] = new
        elif current is not None:
            for alias in owners.get(id(current), [name]):
                alias_module, _, alias_leaf = alias.rpartition(".")
                modules[alias_module]._buffers[alias_leaf] = placeholder
        elif kinds.get(name) == "parameter":
            module.register_parameter(leaf, nn.Parameter(placeholder, requires_grad=False))
        else:
            module.register_buffer(leaf, placeholder)
    for name, tensor in present.items():
        if not tensor.is_meta or any(alias in published for alias in owners.get(id(tensor), [])):
            continue
        module_name, _, leaf = name.rpartition(".")
        module = modules[module_name]
        # Dropped by post-processing where the weights were made: the engine does not read it afterwards.
        module._parameters.pop(leaf, None)
        module._buffers.pop(leaf, None)
    return frozenset(attributes)


__all__ = ["EngineHooks", "EngineSteps", "adopt_published_layout", "drop_parameters", "own_tensors", "private_if"]

"""Binding tensors into a model built on the meta device, without copying them.

Parameters stay ``nn.Parameter`` (same ``requires_grad``, same Python attributes an engine set on them),
buffers stay buffers with their persistence, and tied weights stay tied: every name of one tensor object in
the model gets the same new tensor, and the checkpoint may hold any one of those names. Anything that does
not fit (a missing name, an unexpected one, a shape or dtype that differs, a tensor left on meta) is an error
that lists every problem at once.
"""

from __future__ import annotations

from collections.abc import Mapping

import torch
from torch import nn

from .errors import BindError, InvalidArgumentType
from .torch_dtypes import convertible

_MAX_LISTED = 8


def _listing(names: list[str]) -> str:
    shown = ", ".join(names[:_MAX_LISTED])
    return shown + (f" and {len(names) - _MAX_LISTED} more" if len(names) > _MAX_LISTED else "")


class _Slot:
    """One tensor object of the model and every (module, attribute, full name) it is registered under."""

    __slots__ = ("is_param", "names", "original", "persistent", "places")

    def __init__(self, original: torch.Tensor, is_param: bool, persistent: bool) -> None:
        self.original = original
        self.is_param = is_param
        self.persistent = persistent
        self.places: list[tuple[nn.Module, str]] = []
        self.names: list[str] = []


# One registration of a tensor: (tensor, is_param, persistent, module, attribute, full name). A tuple, not an
# object: attach of thousands of tensors pays for every Python object made per tensor.
_Place = tuple[torch.Tensor, bool, bool, nn.Module, str, str]


def _places(model: nn.Module) -> tuple[list[_Place], bool]:
    """Every parameter and buffer registration, in module order, and whether any tensor is registered twice."""
    places: list[_Place] = []
    seen: set[int] = set()
    count = 0
    for prefix, module in model.named_modules(remove_duplicate=False):
        dot = f"{prefix}." if prefix else ""
        for attr, p in module._parameters.items():
            if p is not None:
                places.append((p, True, True, module, attr, dot + attr))
                seen.add(id(p))
                count += 1
        if module._buffers:
            non_persistent = module._non_persistent_buffers_set
            for attr, b in module._buffers.items():
                if b is not None:
                    places.append((b, False, attr not in non_persistent, module, attr, dot + attr))
                    seen.add(id(b))
                    count += 1
    return places, len(seen) < count


def _slots(places: list[_Place]) -> list[_Slot]:
    """Group the registrations by tensor object (tied weights share one slot), in first-seen order."""
    slots: dict[int, _Slot] = {}
    for tensor, is_param, persistent, module, attr, name in places:
        slot = slots.get(id(tensor))
        if slot is None:
            slot = slots[id(tensor)] = _Slot(tensor, is_param, persistent)
        slot.places.append((module, attr))
        slot.names.append(name)
    return list(slots.values())


def bind(model: nn.Module, tensors: Mapping[str, torch.Tensor], *, device: torch.device | str | None = None) -> None:
    """Replace the model's parameters and buffers by ``tensors`` (by state-dict name), sharing their memory.

    Args:
        model: typically built under ``torch.device("meta")``; a materialised model works too.
        tensors: name -> tensor, e.g. a Handle's ``tensors``. Must cover every parameter and persistent
            buffer; a non-persistent buffer that is still on meta must be covered too.
        device: when given, every bound tensor must be on this device.

    Raises:
        BindError: listing every missing or unexpected name, shape, dtype or device mismatch, and any
            tensor left on the meta device. The model is left unchanged in that case.
        InvalidArgumentType: a value of ``tensors`` that is not a tensor (nothing is bound).
    """
    check_tensors(tensors)
    want_device = torch.device(device) if device is not None else None
    places, tied = _places(model)
    if not tied and _bind_untied(places, tensors, want_device):
        return
    # Tied weights, or something does not fit: group by tensor object and explain every problem.
    for slot, tensor in _plan(model, places, tensors, want_device, stand_ins=False):
        if slot.is_param:
            new = _parameter_like(slot.original, tensor)
            for module, attr in slot.places:
                module._parameters[attr] = new  # type: ignore[assignment]
        else:
            for module, attr in slot.places:
                module._buffers[attr] = tensor
    # Nothing is left on meta by construction: every slot was bound, or skipped as a materialised
    # non-persistent buffer; slots on meta without data were reported as missing above.


def check_fit(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Raise the BindError that :func:`bind` would raise for tensors of these names, shapes and dtypes, without
    binding anything. ``tensors`` may be stand-ins on the meta device (e.g. made from a checkpoint's headers):
    what is checked is that the weights fit the model, not where they are."""
    places, _ = _places(model)
    _plan(model, places, tensors, None, stand_ins=True)


def _plan(
    model: nn.Module,
    places: list[_Place],
    tensors: Mapping[str, torch.Tensor],
    want_device: torch.device | None,
    stand_ins: bool,
) -> list[tuple[_Slot, torch.Tensor]]:
    """Which tensor goes into which slot; BindError listing every problem when something does not fit."""
    missing: list[str] = []
    computed: list[str] = []  # non-persistent buffers left on meta: checkpoints do not hold them
    mismatched: list[str] = []
    dtypes: set[tuple[torch.dtype, torch.dtype]] = set()  # (weights, model) of each dtype mismatch
    dtype_only = 0  # mismatched tensors whose one problem is their dtype
    used = 0
    plan: list[tuple[_Slot, torch.Tensor]] = []
    for slot in _slots(places):
        names = slot.names
        if len(names) == 1:
            source_name = names[0]
            tensor = tensors.get(source_name)
            if tensor is not None:
                used += 1
        else:
            present = [n for n in names if n in tensors]
            used += len(present)
            source_name = present[0] if present else names[0]
            tensor = tensors[source_name] if present else None
        if tensor is None:
            if not slot.persistent and not slot.original.is_meta:
                continue  # a buffer the model computes itself (e.g. rotary inv_freq), already materialised
            (missing if slot.persistent else computed).append(" = ".join(names))
            continue
        orig = slot.original
        if len(names) > 1 or _misfits(tensor, orig, want_device, stand_ins):
            problems = _problems(tensor, orig, want_device, source_name, names, tensors, stand_ins)
            if problems:
                mismatched.append(f"{source_name}: " + "; ".join(problems))
                if tensor.dtype != orig.dtype:
                    dtypes.add((tensor.dtype, orig.dtype))
                    dtype_only += len(problems) == 1
                continue
        plan.append((slot, tensor))
    unexpected = sorted(set(tensors) - {place[5] for place in places}) if used < len(tensors) else []
    errors = []
    if missing:
        errors.append(f"{len(missing)} model tensors have no data: {_listing(missing)}")
    if computed:
        errors.append(
            f"{len(computed)} non-persistent buffers are still on the meta device and no checkpoint holds them: "
            f"{_listing(computed)} (compute them on the real device before attaching, e.g. re-create the module "
            "that owns them there, or add them with transform=)"
        )
    if mismatched:
        errors.append(f"{len(mismatched)} tensors do not fit the model: {_listing(mismatched)}")
    if unexpected:
        errors.append(
            f"{len(unexpected)} tensors are not in the model: {_listing(unexpected)} "
            "(drop or rename them with transform=)"
        )
    if errors:
        advice = "Build the model with the same architecture and parallel layout as the weights."
        if len(dtypes) == 1:
            [(theirs, ours)] = dtypes
            advice = f"The weights are {theirs} where the model has {ours}: build the model in {theirs}"
            if convertible(theirs) and convertible(ours):
                advice += (
                    f", or load the weights with dtype={ours} (attach, preload and `weightcache load --dtype` convert "
                    "floating point weights)."
                )
            elif not convertible(theirs):  # quantized data (FP8, integers) is never converted
                advice += f" ({theirs} weights are stored data that dtype= does not convert)."
            else:
                advice += f" (dtype= does not convert to {ours}, which is stored data, not a floating point type)."
            if len(mismatched) > dtype_only or missing or unexpected or computed:
                advice += " Otherwise the model needs the same architecture and parallel layout as the weights."
        elif dtypes:
            advice = "Build the model with the same architecture, dtypes and parallel layout as the weights."
        raise BindError(f"cannot bind weights into {type(model).__name__}: " + ". ".join(errors) + ". " + advice)
    return plan


_make_subclass = torch.Tensor._make_subclass


def check_tensors(tensors: Mapping[str, object]) -> None:
    """:class:`~weightcache.errors.InvalidArgumentType` naming the first value of ``tensors`` that is not a
    tensor (a transform's result, a state dict given to :func:`bind` or ``Cache.put``)."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise InvalidArgumentType(f"state dict entry {name!r} is {type(value).__name__}; expected a torch.Tensor")


def _parameter_like(orig: torch.Tensor, tensor: torch.Tensor) -> torch.Tensor:
    """A parameter of ``orig``'s class over ``tensor``'s memory (no copy), with ``orig``'s Python attributes.

    Engines subclass ``nn.Parameter`` and hang attributes on it (e.g. vLLM's ``weight_loader``); the class is
    kept without running its constructor.
    """
    cls = type(orig) if isinstance(orig, nn.Parameter) else nn.Parameter
    new: torch.Tensor = _make_subclass(cls, tensor, orig.requires_grad and _grad_ok(tensor))
    if orig.__dict__:
        new.__dict__.update(orig.__dict__)
    return new


def _bind_untied(places: list[_Place], tensors: Mapping[str, torch.Tensor], want_device: torch.device | None) -> bool:
    """Bind a model without tied weights in one pass, if everything fits; return False, touching nothing,
    at the first thing that does not (the caller then explains every problem).

    This is the path of every attach, so it checks in bulk (a list per property, compared by C code) and makes no
    Python object per tensor beyond the new parameter: thousands of tensors must bind in a few milliseconds.
    """
    get = tensors.get
    found = [get(place[5]) for place in places]
    if any(t is None for t in found):
        pairs = []
        for place, t in zip(places, found):
            if t is not None:
                pairs.append((place, t))
            elif place[2] or place[0].is_meta:
                return False  # missing data
            # else: a non-persistent buffer the model computed itself (e.g. rotary inv_freq)
        places = [place for place, _ in pairs]
        found = [t for _, t in pairs]
    if len(found) != len(tensors):
        return False  # names that are not in the model
    bound: list[torch.Tensor] = found  # type: ignore[assignment]  # no None left
    origs = [place[0] for place in places]
    if [t.shape for t in bound] != [o.shape for o in origs] or [t.dtype for t in bound] != [o.dtype for o in origs]:
        return False
    if any(t.is_meta for t in bound):
        return False
    if want_device is not None:
        for dev in {t.device for t in bound}:
            if dev != want_device and not _same_device(dev, want_device):
                return False
    parameter = nn.Parameter
    for (orig, is_param, _, module, attr, _), tensor in zip(places, bound):
        if is_param:
            cls: type[torch.Tensor] = type(orig) if isinstance(orig, parameter) else parameter
            new: torch.Tensor
            if orig.requires_grad:
                new = _make_subclass(cls, tensor, _grad_ok(tensor))
            else:  # what _make_subclass does for requires_grad=False, in two cheaper steps (a third of the time)
                new = tensor.detach()
                try:
                    new.__class__ = cls
                except TypeError:  # a parameter class whose layout differs from Tensor's
                    new = _make_subclass(cls, tensor, False)
            if orig.__dict__:  # an engine's attributes on its parameter (e.g. vLLM's weight_loader)
                new.__dict__.update(orig.__dict__)
            module._parameters[attr] = new  # type: ignore[assignment]  # an nn.Parameter (subclass) by now
        else:
            module._buffers[attr] = tensor
    return True


def _misfits(
    tensor: torch.Tensor, orig: torch.Tensor, want_device: torch.device | None, stand_ins: bool = False
) -> bool:
    """Whether ``tensor`` cannot stand in for ``orig`` (shape, dtype, meta, device); :func:`_problems` says why."""
    return (
        tensor.shape != orig.shape
        or tensor.dtype != orig.dtype
        or (tensor.is_meta and not stand_ins)
        or (want_device is not None and tensor.device != want_device and not _same_device(tensor.device, want_device))
    )


def _problems(
    tensor: torch.Tensor,
    orig: torch.Tensor,
    want_device: torch.device | None,
    source_name: str,
    names: list[str],
    tensors: Mapping[str, torch.Tensor],
    stand_ins: bool = False,
) -> list[str]:
    problems = []
    if tensor.shape != orig.shape:
        problems.append(f"shape {tuple(tensor.shape)} vs model {tuple(orig.shape)}")
    if tensor.dtype != orig.dtype:
        problems.append(f"dtype {tensor.dtype} vs model {orig.dtype}")
    if want_device is not None and not _same_device(tensor.device, want_device):
        problems.append(f"device {tensor.device}, expected {want_device}")
    if tensor.is_meta and not stand_ins:
        problems.append("the given tensor is on meta")
    for other in names:
        if other != source_name and other in tensors:
            t2 = tensors[other]
            if t2.shape != tensor.shape or t2.dtype != tensor.dtype:
                problems.append(f"tied name {other} has {tuple(t2.shape)} {t2.dtype}")
    return problems


def _grad_ok(tensor: torch.Tensor) -> bool:
    return tensor.is_floating_point() or tensor.is_complex()


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    return a.index == b.index or a.index is None or b.index is None


def tensor_attributes(model: nn.Module) -> dict[str, torch.Tensor]:
    """Tensors that modules keep as plain attributes (neither parameters nor buffers), by full name.

    Post-processing derives such tensors and engines read them directly: SGLang's and vLLM's MLA attention keep
    ``w_kc``/``w_vc`` this way, split from ``kv_b_proj`` after loading. Tensors on the meta device (placeholders
    never filled) are left out.
    """
    found: dict[str, torch.Tensor] = {}
    for prefix, module in model.named_modules():
        dot = f"{prefix}." if prefix else ""
        for attr, value in vars(module).items():
            if isinstance(value, torch.Tensor) and not isinstance(value, nn.Parameter) and not value.is_meta:
                found[dot + attr] = value
    return found


def set_tensor_attributes(model: nn.Module, tensors: Mapping[str, torch.Tensor]) -> None:
    """Set each ``"module.path.attr"`` of ``tensors`` as a plain attribute of its module (the inverse of
    :func:`tensor_attributes`). Raises BindError for a name whose module is not in ``model``."""
    modules = dict(model.named_modules())
    for name, tensor in tensors.items():
        module_name, _, attr = name.rpartition(".")
        module = modules.get(module_name)
        if module is None:
            raise BindError(
                f"published attribute {name!r} has no module {module_name!r} in {type(model).__name__}; the entry "
                "was made from another model structure"
            )
        module.__dict__[attr] = tensor

"""bind(): parameters, buffers, ties, and clear errors."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from models import TinyLM, meta_model
from torch import nn

import weightcache as wc


def full_state() -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    return {k: v for k, v in TinyLM().state_dict().items() if k != "head.weight"}


def test_binds_without_copying() -> None:
    state = full_state()
    model = meta_model()
    wc.bind(model, state)
    assert model.embed.weight.data_ptr() == state["embed.weight"].data_ptr()
    assert model.head.weight is model.embed.weight
    assert model.scale.data_ptr() == state["scale"].data_ptr()
    assert all(p.requires_grad for p in model.parameters())


def test_tied_weight_under_either_name() -> None:
    state = full_state()
    state["head.weight"] = state.pop("embed.weight")
    model = meta_model()
    wc.bind(model, state)
    assert model.head.weight is model.embed.weight


def test_tied_names_both_present_must_agree() -> None:
    state = full_state()
    state["head.weight"] = torch.zeros(3, 3)
    with pytest.raises(wc.BindError, match="tied name head.weight"):
        wc.bind(meta_model(), state)


def test_all_problems_are_listed_and_model_is_untouched() -> None:
    state = full_state()
    del state["blocks.0.up.bias"]
    state["blocks.1.norm.weight"] = torch.zeros(3)
    state["scale"] = state["scale"].double()
    state["lm.extra"] = torch.zeros(1)
    model = meta_model()
    with pytest.raises(wc.BindError) as info:
        wc.bind(model, state)
    text = str(info.value)
    assert "blocks.0.up.bias" in text and "have no data" in text
    assert "blocks.1.norm.weight: shape (3,) vs model (64,)" in text
    assert "scale: dtype torch.float64 vs model torch.float32" in text
    assert "lm.extra" in text and "transform=" in text
    assert model.embed.weight.is_meta, "a failed bind must not half-bind the model"


def test_non_persistent_buffer_left_on_meta_is_an_error() -> None:
    with torch.device("meta"):
        model = TinyLM()  # positions (non-persistent) still on meta
    with pytest.raises(wc.BindError, match="non-persistent buffers are still on the meta device.*positions"):
        wc.bind(model, full_state())
    state = full_state()
    state["positions"] = torch.arange(16)
    wc.bind(model, state)  # supplying it works
    assert torch.equal(model.positions, torch.arange(16))
    assert "positions" in model._non_persistent_buffers_set


def test_parameter_attributes_and_requires_grad_survive() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(2, device="meta"), requires_grad=False)
            self.w.weight_loader = "custom"  # type: ignore[attr-defined]
            self.register_buffer("b", torch.empty(2, device="meta"))

    m = M()
    wc.bind(m, {"w": torch.ones(2), "b": torch.zeros(2)})
    assert isinstance(m.w, nn.Parameter) and m.w.requires_grad is False
    assert m.w.weight_loader == "custom"  # type: ignore[attr-defined]
    assert "b" in m._buffers


def test_device_check() -> None:
    with pytest.raises(wc.BindError, match="expected meta"):
        wc.bind(meta_model(), full_state(), device="meta")


def test_shared_submodule() -> None:
    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.a = nn.Linear(2, 2, device="meta")
            self.b = self.a  # the same module twice

    m = M()
    wc.bind(m, {"a.weight": torch.ones(2, 2), "a.bias": torch.zeros(2)})
    assert m.b.weight is m.a.weight and not m.a.weight.is_meta


def test_parameter_subclasses_survive() -> None:
    class EngineParam(nn.Parameter):
        def loader(self) -> str:
            return "engine"

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = EngineParam(torch.empty(3, device="meta"))
            self.w.output_dim = 0  # type: ignore[attr-defined]

    m = M()
    data = torch.arange(3.0)
    wc.bind(m, {"w": data})
    assert type(m.w) is EngineParam and m.w.loader() == "engine" and m.w.output_dim == 0  # type: ignore[attr-defined]
    assert m.w.data_ptr() == data.data_ptr()


def test_the_advice_fits_the_problem() -> None:
    """A dtype mismatch names both dtypes and the two ways out; a shape mismatch does not talk about dtype=."""
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in full_state().items()}
    with pytest.raises(wc.BindError) as info:
        wc.bind(meta_model(), state)
    text = str(info.value)
    assert "weights are torch.bfloat16 where the model has torch.float32" in text, text
    assert "build the model in torch.bfloat16, or load the weights with dtype=torch.float32" in text, text
    assert "pass dtype=" not in text
    assert "Otherwise" not in text  # every tensor differs only in its dtype (several of them: one pair)
    fp8 = {k: v.to(torch.float8_e4m3fn) if v.is_floating_point() else v for k, v in full_state().items()}
    with pytest.raises(wc.BindError) as info:
        wc.bind(meta_model(), fp8)
    text = str(info.value)  # FP8 is stored data: dtype= does not convert it, so it is not offered
    assert "build the model in torch.float8_e4m3fn" in text and "dtype=torch.float32" not in text, text
    fp8_model = meta_model()
    fp8_model.to(torch.float8_e4m3fn)
    with pytest.raises(wc.BindError) as info:
        wc.bind(fp8_model, full_state())
    text = str(info.value)  # the model's side is the stored data this time: said of the model, not the weights
    assert "dtype= does not convert to torch.float8_e4m3fn" in text and "weights are stored data" not in text, text
    with pytest.raises(wc.BindError) as info:
        wc.bind(meta_model(dim=32), full_state())
    assert "dtype=" not in str(info.value) and "same architecture" in str(info.value)


@pytest.mark.parametrize("requires_grad", [False, True])
def test_parameters_are_new_objects_over_the_given_memory(requires_grad: bool) -> None:
    """A bound parameter is a new object of the model's parameter class (also one whose layout differs from
    Tensor's, which cannot take a class assignment), not a view of the given tensor and not that tensor itself:
    the caller's tensors are never changed."""

    class SlottedParam(nn.Parameter):
        __slots__ = ("tag",)

    class M(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.w = nn.Parameter(torch.empty(4, device="meta"), requires_grad=requires_grad)
            self.s = SlottedParam(torch.empty(4, device="meta"), requires_grad=requires_grad)

    flat = torch.arange(8.0)
    given = dict(zip(("w", "s"), flat.split_with_sizes([4, 4])))
    m = M()
    wc.bind(m, given)
    for name, cls in (("w", nn.Parameter), ("s", SlottedParam)):
        p = m._parameters[name]
        assert type(p) is cls and p is not given[name] and type(given[name]) is torch.Tensor
        assert p.data_ptr() == given[name].data_ptr() and p.requires_grad is requires_grad
        assert not p._is_view()  # a view would keep autograd's view bookkeeping on the model's weights
    m.s.tag = "x"


def test_values_that_are_not_tensors_are_an_argument_error_naming_the_entry(checkpoint: Path, socket_dir: Path) -> None:
    """A state dict with a value that is not a tensor, given to bind or returned by a transform, is an
    InvalidArgumentType naming the entry (it was an AttributeError from deep inside the binding); in mode daemon
    too, at once: not taken for a failed publish (a FallbackWarning, then the checkpoint read and the transform run
    a second time)."""
    import warnings

    calls = []

    def listify(state: dict) -> dict:
        calls.append(1)
        first = sorted(state)[0]
        return {**state, first: [1, 2]}

    listify.weightcache_id = "listify-v1"  # type: ignore[attr-defined]  # (a closure: its identity, stated)
    with warnings.catch_warnings():
        warnings.simplefilter("error", wc.FallbackWarning)
        with pytest.raises(wc.InvalidArgumentType, match="is list; expected a torch.Tensor"):
            wc.attach(meta_model(), checkpoint, transform=listify, mode="daemon", socket_dir=socket_dir)
    assert len(calls) == 1

    with pytest.raises(wc.InvalidArgumentType, match="state dict entry 'w' is list; expected a torch.Tensor"):
        wc.bind(meta_model(), {**full_state(), "w": [1, 2]})
    with pytest.raises(wc.InvalidArgumentType, match="is list; expected a torch.Tensor"):
        wc.attach(meta_model(), checkpoint, transform=listify)

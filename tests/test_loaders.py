"""Module loaders (weightcache/loaders.py) and the structure digest (weightcache/structure.py), without any
framework installed: a loader registered for a package of this test fills TinyLM its own way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
from models import INPUT_IDS, TinyLM, model_kwargs, reference_output

import weightcache as wc
from weightcache import loaders
from weightcache.loader import load_weights
from weightcache.structure import structure_digest


class FrameworkLM(TinyLM):
    """A model of a pretend framework (its own package name), whose computed buffer ``positions`` is on meta
    when built there: the plain path would refuse it (BindError)."""


FrameworkLM.__module__ = "wcframework.models"


class FrameworkLoader(loaders.ModuleLoader):
    name = "wcframework"
    loads = 0

    def version(self) -> str:
        return "1.0"

    def identify(self, model: torch.nn.Module, checkpoint: str | os.PathLike[str]) -> loaders.ModelIdentity:
        return loaders.ModelIdentity(fields={"vocab": model.embed.num_embeddings})  # type: ignore[union-attr]

    def load(
        self,
        model: torch.nn.Module,
        checkpoint: str | os.PathLike[str],
        device: torch.device,
        dtype: torch.dtype | None,
    ) -> dict[str, torch.Tensor]:
        type(self).loads += 1
        with torch.device(device):
            loaded = FrameworkLM(**model_kwargs(checkpoint))
        state = load_weights(checkpoint, device, dtype)
        loaded.load_state_dict(state, strict=False)
        return {**dict(loaded.named_parameters()), **dict(loaded.named_buffers())}


loaders.register("wcframework", FrameworkLoader())


def meta_framework_model(checkpoint: Path) -> FrameworkLM:
    with torch.device("meta"):
        return FrameworkLM(**model_kwargs(checkpoint))


def test_a_registered_loader_fills_its_models_computed_buffers_included(checkpoint: Path, socket_dir: Path) -> None:
    with torch.device("meta"):
        plain = TinyLM(**model_kwargs(checkpoint))
    with pytest.raises(wc.BindError, match="positions"):
        wc.attach(plain, checkpoint)  # the plain path: a computed buffer left on meta
    assert loaders.for_model(plain) is None

    expected = reference_output(checkpoint)
    for mode, source, read_disk in [("off", "disk", True), ("daemon", "cache", True), ("client", "cache", False)]:
        before = FrameworkLoader.loads
        model = meta_framework_model(checkpoint)
        with wc.attach(model, checkpoint, mode=mode, socket_dir=socket_dir, strict=True) as handle:  # type: ignore[arg-type]
            assert (handle.source, handle.read_disk) == (source, read_disk)
            assert handle.fingerprint.engine == "wcframework" and handle.fingerprint.engine_version == "1.0"
            assert FrameworkLoader.loads == before + read_disk
            assert "positions" in handle.tensors and torch.equal(model.positions, torch.arange(16))
            assert model.head.weight is model.embed.weight
            assert torch.equal(model(INPUT_IDS), expected)


def test_the_structure_of_the_built_model_is_part_of_the_fingerprint(checkpoint: Path, socket_dir: Path) -> None:
    wc.attach(meta_framework_model(checkpoint), checkpoint, mode="daemon", socket_dir=socket_dir).close()
    model = meta_framework_model(checkpoint)
    model.positions = torch.empty(32, device="meta")  # another computed buffer: same checkpoint, same config
    with pytest.raises(wc.FingerprintMismatch, match=r"extra\.structure: requested '[0-9a-f]{64}'"):
        wc.attach(model, checkpoint, mode="client", socket_dir=socket_dir, strict=True)


def test_structure_digest() -> None:
    def build(**kw: int) -> TinyLM:
        with torch.device("meta"):
            return TinyLM(**kw)

    assert structure_digest(build()) == structure_digest(build())
    assert structure_digest(build()) == structure_digest(TinyLM())  # the device does not count, nor the data
    assert structure_digest(build()) != structure_digest(build(dim=32))
    assert structure_digest(build()) != structure_digest(build().to(torch.bfloat16))
    untied = build()
    untied.head.weight = torch.nn.Parameter(torch.empty_like(untied.embed.weight))
    assert structure_digest(untied) != structure_digest(build())
    kept = build()
    kept.register_buffer("positions", torch.arange(16, device="meta"))  # now persistent
    assert structure_digest(kept) != structure_digest(build())


def test_an_argument_of_the_wrong_type_is_an_invalid_argument_type_naming_what_is_expected() -> None:
    """docs/reference/errors.md: every error derives from WeightCacheError, and a class or value of the wrong type
    is an InvalidArgumentType (also a TypeError). These raised bare TypeErrors."""
    from weightcache.backends.engine_config import quant_spec_from_config
    from weightcache.backends.torch import TorchBackend
    from weightcache.backends.transformers import quant_spec

    cases = [
        (lambda: loaders.register("pkg", object()), "expects a weightcache.loaders.ModuleLoader"),  # type: ignore[arg-type]
        (lambda: TorchBackend().quant(3.5), "quantization must be None, a method name or"),
        (lambda: quant_spec_from_config("vllm", object()), "expected a QuantizationConfig or None"),
        (lambda: quant_spec(["gptq"]), "quantization_config must be a dict or a transformers config"),
    ]
    for call, message in cases:
        with pytest.raises(wc.InvalidArgumentType, match=message) as raised:
            call()
        assert isinstance(raised.value, TypeError) and isinstance(raised.value, wc.WeightCacheError)

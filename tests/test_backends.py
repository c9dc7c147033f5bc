"""The engine adapter registry and interface (weightcache.backends), where no engine is installed.

The adapters themselves are tested against the real engines in tests/backends/ (make test-engines).
"""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from models import INPUT_IDS, TinyLM, meta_model, model_kwargs, reference_output

import weightcache as wc
from weightcache import backends
from weightcache.backends.base import Backend, Loaded, LoaderOptions, QuantSpec, adopt_published_layout
from weightcache.backends.torch import ModuleLoad


def test_builtin_adapters_are_listed_without_importing_their_engines() -> None:
    code = (
        "import sys, weightcache.backends as b; names = b.names(); "
        "[b.get(n) for n in names]; print(names, 'vllm' in sys.modules, 'sglang' in sys.modules)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "['sglang', 'torch', 'vllm'] False False"


def test_torch_adapter_is_attach() -> None:
    torch_backend = backends.get("torch")
    assert torch_backend.available() and torch_backend.version() == torch.__version__
    assert torch_backend.check_quant(None) == QuantSpec("none")
    assert torch_backend.check_quant(("fp8_block", {"weight_block_size": [128, 128]})).method == "fp8_block"
    with pytest.raises(wc.UnsupportedQuantError, match="'gptq' cannot be shared"):
        torch_backend.check_quant("gptq")


def test_attach_through_the_torch_adapter(checkpoint: Path, socket_dir: Path) -> None:
    model = meta_model(**model_kwargs(checkpoint))
    attach = backends.get("torch").attach  # type: ignore[attr-defined]
    with attach(model, checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
        assert handle.source == "cache"
        with torch.no_grad():
            assert torch.equal(model(INPUT_IDS), reference_output(checkpoint))


@pytest.mark.skipif(importlib.util.find_spec("vllm") is not None, reason="vLLM is installed here")
def test_adapter_without_its_engine_says_how_to_install_it() -> None:
    vllm_backend = backends.get("vllm")
    assert not vllm_backend.available()
    with pytest.raises(wc.EngineNotInstalled, match=r"needs the 'vllm' package.*pip install vllm"):
        vllm_backend.version()
    with pytest.raises(ImportError):  # EngineNotInstalled is an ImportError too
        vllm_backend.require()


class Toy(Backend):
    name: ClassVar[str] = "toy"
    module: ClassVar[str] = "json"

    def quant(self, engine_quant: object) -> QuantSpec:
        return QuantSpec("none" if engine_quant is None else str(engine_quant))

    def build_model(self, context: object) -> torch.nn.Module:
        return torch.nn.Linear(2, 2)

    def load_from_disk(self, context: object) -> torch.nn.Module:
        return torch.nn.Linear(2, 2)


def test_register_a_third_party_adapter() -> None:
    try:
        assert backends.register(Toy) is Toy
        assert isinstance(backends.get("toy"), Toy) and "toy" in backends.names()
        assert backends.get("toy").version() == "unknown" or backends.get("toy").available()
        with pytest.raises(ValueError, match="already registered"):
            backends.register(Toy)
        backends.register(Toy, replace=True)
    finally:
        backends._registry.pop("toy", None)
    with pytest.raises(KeyError, match="known adapters: sglang, torch, vllm"):
        backends.get("toy")


def test_register_rejects_incomplete_adapters() -> None:
    class NoName(Backend):
        module: ClassVar[str] = "json"

        def quant(self, engine_quant: object) -> QuantSpec:
            return QuantSpec("none")

    class NoQuant(Backend):
        name: ClassVar[str] = "noquant"
        module: ClassVar[str] = "json"

    class NoHooks(Backend):
        name: ClassVar[str] = "nohooks"
        module: ClassVar[str] = "json"

        def quant(self, engine_quant: object) -> QuantSpec:
            return QuantSpec("none")

    with pytest.raises(TypeError, match="name"):
        backends.register(NoName)
    with pytest.raises(TypeError, match="does not implement build_model, load_from_disk, quant"):
        backends.register(NoQuant)
    with pytest.raises(TypeError, match="does not implement build_model, load_from_disk$"):
        backends.register(NoHooks)
    with pytest.raises(TypeError, match="Backend subclass"):
        backends.register(dict)  # type: ignore[type-var]


@pytest.mark.parametrize(
    ("raw", "message"),
    [
        (
            {"mode": "client", "sokcet_dir": "/x"},
            "unknown key(s) 'sokcet_dir'; weightcache accepts mode, socket_dir, strict",
        ),
        ({"mode": "off"}, "mode must be one of daemon, client; found 'off'"),
        ({"strict": 1}, "strict must be true or false; found 1"),
        ({"socket_dir": 3}, "socket_dir must be a path string; found 3"),
    ],
)
def test_loader_options_are_validated(raw: dict, message: str) -> None:
    with pytest.raises(wc.BackendConfigError) as info:
        LoaderOptions.parse(raw, where="--model-loader-extra-config")
    assert str(info.value).startswith("--model-loader-extra-config: ")
    assert message in str(info.value)
    assert isinstance(info.value, ValueError)


def test_loader_options_defaults() -> None:
    assert LoaderOptions.parse(None, where="x") == LoaderOptions(mode="daemon", socket_dir=None, strict=False)
    assert LoaderOptions.parse({"socket_dir": Path("/s")}, where="x").socket_dir == "/s"


def test_backend_template_runs_every_mode(checkpoint: Path, socket_dir: Path) -> None:
    """Backend.load_model: the sequence an adapter inherits, driven through the torch adapter's hooks."""
    backend = backends.get("torch")
    kw = model_kwargs(checkpoint)
    context = ModuleLoad(lambda: TinyLM(**kw), checkpoint)
    fp = wc.Fingerprint.create(checkpoint, device="cpu")

    def load(mode: str, strict: bool = False) -> Loaded:
        options = LoaderOptions(mode=mode, socket_dir=str(socket_dir), strict=strict)  # type: ignore[arg-type]
        return backend.load_model(context, fingerprint=fp, device="cpu", options=options)

    with pytest.warns(wc.FallbackWarning, match="no keeper is available"):
        fallback = load("client")
    assert (fallback.source, fallback.handle) == ("disk", None)
    with pytest.raises(wc.KeeperUnavailable):
        load("client", strict=True)
    first = load("daemon")  # spawns a keeper, loads, publishes, serves the published copy
    assert first.source == "cache" and first.handle is not None and first.handle.read_disk
    assert first.preloaded_bytes == 0  # allocated by this very load
    again = load("client")
    assert again.source == "cache" and again.handle is not None and not again.handle.read_disk
    assert again.preloaded_bytes == again.handle.nbytes > 0
    assert again.model.weightcache_handle is again.handle  # the lease lives as long as the model
    for loaded in (first, fallback, again):
        with torch.no_grad():
            assert torch.equal(loaded.model(INPUT_IDS), reference_output(checkpoint))
    again.handle.verify()


def test_adopt_published_layout_takes_the_published_shapes(socket_dir: Path, checkpoint: Path) -> None:
    # What post-processing can do to a layer: transpose a weight, add a scale, drop a tensor.
    with torch.device("meta"):
        model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model[0].weight.loader_note = "kept"  # type: ignore[union-attr]
    published = {
        "0.weight": torch.arange(12.0).reshape(4, 3),  # transposed
        "0.weight_scale": torch.tensor([0.5]),  # new
        "1.weight": torch.ones(3),
        "1.bias": torch.zeros(3),
    }  # 0.bias dropped
    fp = wc.Fingerprint.create(
        checkpoint,
        device="cpu",
        quant="fp8_block",  # only quantized weights change layout in post-processing
        quant_config={"weight_block_size": [128, 128]},
        engine="toy",
        engine_version="1",
    )
    with wc.Cache(socket_dir, spawn=True).put(fp, published) as handle:
        adopt_published_layout(model, handle)
        wc.bind(model, handle.tensors, device="cpu")
        assert model[0].weight.shape == (4, 3) and model[0].weight.loader_note == "kept"
        assert torch.equal(model[0].weight_scale, published["0.weight_scale"])
        assert set(dict(model.named_parameters())) == {"0.weight", "1.weight", "1.bias"}  # 0.bias was dropped
        assert set(dict(model.named_buffers())) == {"0.weight_scale"}


def test_adopt_published_layout_refuses_new_shapes_for_unquantized_weights(socket_dir: Path, checkpoint: Path) -> None:
    """Unquantized post-processing never changes a layout: a published tensor of another shape means the entry
    was made under a setting the fingerprint misses (e.g. another expert-parallel layout), never adopted."""
    with torch.device("meta"):
        model = torch.nn.Linear(4, 3)
    published = {"weight": torch.zeros(4, 3), "bias": torch.zeros(3)}
    fp = wc.Fingerprint.create(checkpoint, device="cpu", engine="toy", engine_version="1")
    with wc.Cache(socket_dir, spawn=True).put(fp, published) as handle:
        with pytest.raises(wc.BindError, match=r"weight: published \(4, 3\).*model \(3, 4\).*evict"):
            adopt_published_layout(model, handle)
        assert model.weight.shape == (3, 4) and model.weight.is_meta  # untouched

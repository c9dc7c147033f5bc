"""The engine adapter registry and interface (weightcache.backends), where no engine is installed.

The adapters themselves are tested against the real engines in tests/backends/ (make test-engines).
"""

from __future__ import annotations

import contextlib
import importlib.util
import subprocess
import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any, ClassVar

import attrs
import pytest
import torch
from models import INPUT_IDS, TinyLM, meta_model, model_kwargs, reference_output

import weightcache as wc
from weightcache import backends
from weightcache.backends.base import (
    MODE_ENV,
    UNTESTED_ENGINES_ENV,
    Backend,
    Loaded,
    LoaderOptions,
    QuantSpec,
    ReleaseRange,
    adopt_published_layout,
)
from weightcache.backends.torch import ModuleLoad
from weightcache.binding import bind
from weightcache.loader import load_weights
from weightcache.structure import structure_digest


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
        with pytest.raises(wc.InvalidArgument, match="already registered"):
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

    with pytest.raises(wc.InvalidArgumentType, match="name"):
        backends.register(NoName)
    with pytest.raises(wc.InvalidArgumentType, match="does not implement build_model, load_from_disk, quant"):
        backends.register(NoQuant)
    with pytest.raises(wc.InvalidArgumentType, match="does not implement build_model, load_from_disk$"):
        backends.register(NoHooks)
    with pytest.raises(wc.InvalidArgumentType, match="Backend subclass"):
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
        (["mode"], "must be a JSON object of options"),
        ("client", "must be a JSON object of options"),
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


def test_sglang_loader_options_are_checked_before_sglang_is_needed() -> None:
    """SGLang's loader class takes its options from ``model_loader_extra_config`` (a dict or a JSON string) or from
    ``configure()``, which takes every option an adapter has: a string that is not JSON, or JSON that is not an
    object, is a BackendConfigError naming the origin (it was a JSONDecodeError or a TypeError)."""
    import os
    import types

    from weightcache.backends.sglang import WeightCacheLoader

    for extra in ("{bad", '["mode"]'):
        with pytest.raises(wc.BackendConfigError, match="model_loader_extra_config"):
            WeightCacheLoader(types.SimpleNamespace(model_loader_extra_config=extra))
    configured = WeightCacheLoader.configure(mode="client", trusted_publishers=[os.getuid()])
    assert configured.options_override["trusted_publishers"] == [os.getuid()]
    import pwd

    me = pwd.getpwuid(os.getuid()).pw_name  # one user named alone is that user, not its letters
    assert WeightCacheLoader.configure(trusted_publishers=me).options_override["trusted_publishers"] == [me]
    with pytest.raises(wc.BackendConfigError, match="trusted_publishers"):
        WeightCacheLoader.configure(trusted_publishers=["no-such-user-here"])


def test_a_keeper_that_does_not_answer_the_size_question_is_said_so(
    checkpoint: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An engine sizing its caches asks the keeper how much of the weights it will map: a keeper that runs but
    does not answer (SIGSTOP) makes it warn and count 0 (strict: raise), as any other failure to answer does; no
    keeper at all is 0 without a word (nothing is cached)."""
    import signal

    from conftest import all_threads_stopped, start_keeper, terminate_keeper, wait_until

    from weightcache.client import connection

    backend = backends.get("torch")
    fp = wc.Fingerprint.create(checkpoint)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert backend.cached_bytes(fp, LoaderOptions(socket_dir=str(socket_dir))) == 0  # no keeper
    monkeypatch.setattr(connection, "REPLY_TIMEOUT_S", 1.0)
    keeper = start_keeper(socket_dir)
    try:
        keeper.send_signal(signal.SIGSTOP)
        try:
            assert wait_until(lambda: all_threads_stopped(keeper.pid), 10)
            with pytest.warns(UserWarning, match="cannot size the cached entry.*KeeperNotResponding"):
                assert backend.cached_bytes(fp, LoaderOptions(socket_dir=str(socket_dir))) == 0
            with pytest.raises(wc.KeeperNotResponding):
                backend.cached_bytes(fp, LoaderOptions(socket_dir=str(socket_dir), strict=True))
        finally:
            keeper.send_signal(signal.SIGCONT)
    finally:
        terminate_keeper(keeper)


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
    assert first.handle.fingerprint == fp  # no structure added: attach() makes the same fingerprint, shares entries
    described = backend.make_fingerprint(  # and so does the adapter's own fingerprint, without an engine config
        str(checkpoint), dtype=None, engine_quant=None, parallel=lambda: {}, device="cpu", identity={}
    )
    assert described == fp and described.digest == fp.digest
    assert first.preloaded_bytes == 0  # allocated by this very load
    again = load("client")
    assert again.source == "cache" and again.handle is not None and not again.handle.read_disk
    assert again.preloaded_bytes == again.handle.nbytes > 0
    again.handle.resident_before = False  # as for an entry another engine published while this load waited
    assert again.preloaded_bytes == 0  # its memory appeared during this load: already in an engine's own measure
    again.handle.resident_before = True
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


# --- the structure of the engine's model in the fingerprint --------------------------------------------------


@attrs.define
class EngineLoad:
    """An engine's load of a TinyLM checkpoint. ``dtype`` is a setting that changes the model the engine builds
    but that the engine's identity (``make_fingerprint``) does not record, as vLLM's ``model_impl`` is not.
    ``registered`` stands for vLLM's registry of layers by name (with ``registers``): a second live model of the
    same names is an error, as vLLM's "Duplicate layer name"."""

    checkpoint: Path
    dtype: torch.dtype = torch.float32
    registered: set[str] = attrs.field(factory=set)
    builds: int = 0
    registers: bool = True
    #: The model needs real memory to be built (as SGLang's Transformers backend puts its parameters on an
    #: accelerator): building it on meta fails.
    meta_fails: bool = False


class RegisteringEngine(Backend):
    name: ClassVar[str] = "registering"
    module: ClassVar[str] = "torch"

    def quant(self, engine_quant: object) -> QuantSpec:
        return QuantSpec("none")

    def build_model(self, context: EngineLoad) -> torch.nn.Module:
        context.builds += 1
        if context.meta_fails and torch.empty(0).is_meta:
            raise RuntimeError("this model allocates real memory while it is built")
        if context.registers:
            if "model" in context.registered:
                raise RuntimeError("Duplicate layer name: model")
            context.registered.add("model")
        return TinyLM(**model_kwargs(context.checkpoint)).to(context.dtype)

    def load_from_disk(self, context: EngineLoad) -> torch.nn.Module:
        with torch.device("cpu"):
            model = self.build_model(context)
        bind(model, load_weights(context.checkpoint, torch.device("cpu"), context.dtype), device="cpu")
        return model

    def release_model(self, model: torch.nn.Module, context: EngineLoad) -> None:
        context.registered.discard("model")

    @contextlib.contextmanager
    def scratch_build(self, context: EngineLoad) -> Iterator[None]:
        kept = set(context.registered)
        context.registered.clear()
        try:
            yield
        finally:
            context.registered.clear()
            context.registered.update(kept)


def engine_fingerprint(backend: Backend, context: EngineLoad) -> wc.Fingerprint:
    """What an engine's loader makes before the structure joins it."""
    return backend.make_fingerprint(
        str(context.checkpoint),
        dtype=None,
        engine_quant=None,
        parallel=lambda: {"tp": (0, 1)},
        device="cpu",
        identity={"checkpoint": str(context.checkpoint)},
    )


def engine_load(
    backend: Backend, context: EngineLoad, socket_dir: Path, mode: str, strict: bool = False
) -> tuple[Loaded, wc.Fingerprint]:
    fp = engine_fingerprint(backend, context)
    options = LoaderOptions(mode=mode, socket_dir=str(socket_dir), strict=strict)  # type: ignore[arg-type]
    return backend.load_model(context, fingerprint=fp, device="cpu", options=options), fp


def test_a_setting_the_identity_misses_but_the_built_model_shows_is_a_miss_naming_the_structure(
    checkpoint: Path, socket_dir: Path
) -> None:
    """The engine's model is built (on meta) before the keeper is asked, and its structure joins the fingerprint:
    a start whose model differs (here in dtype) from the one the entry was made for misses the entry, and the
    fallback names ``extra.structure``: never an attach into a model the entry was not made for."""
    backend = RegisteringEngine()
    published, _ = engine_load(backend, EngineLoad(checkpoint, registers=False), socket_dir, "daemon")
    assert published.source == "cache" and published.handle is not None
    extra = published.handle.fingerprint.extra
    assert f'"structure":"{structure_digest(meta_model(**model_kwargs(checkpoint)))}"' in extra
    with pytest.warns(wc.FallbackWarning, match=r"extra\.structure: requested '[0-9a-f]{12,}"):
        other, _ = engine_load(
            backend, EngineLoad(checkpoint, dtype=torch.bfloat16, registers=False), socket_dir, "client"
        )
    assert other.source == "disk" and other.model.embed.weight.dtype == torch.bfloat16
    with torch.no_grad():
        expected = reference_output(checkpoint, torch.bfloat16)
        assert torch.equal(other.model(INPUT_IDS), expected)
    with pytest.raises(wc.FingerprintMismatch, match=r"extra\.structure"):
        bf16 = EngineLoad(checkpoint, dtype=torch.bfloat16, registers=False)
        engine_load(backend, bf16, socket_dir, "client", strict=True)
    assert [e.digest for e in wc.Cache(socket_dir).entries()] == [published.handle.digest]


def test_the_engine_model_is_built_once_on_a_hit_and_released_before_a_disk_load(
    checkpoint: Path, socket_dir: Path
) -> None:
    """One meta build per load: a hit serves the model whose structure was fingerprinted (its registrations
    stay); a miss releases it before the engine's own loader builds a model of the same names. Asking for the
    fingerprint without loading (what vLLM's get_external_weight_memory needs) builds in scratch and leaves the
    engine's registrations as they were, before or after a load."""
    backend = RegisteringEngine()
    first = EngineLoad(checkpoint)
    published, fp = engine_load(backend, first, socket_dir, "daemon")
    assert first.builds == 3  # fingerprinted, released; loaded from disk in scratch; served after publishing
    assert first.registered == {"model"}  # the served model's
    assert published.handle is not None and backend.complete_fingerprint(fp, first) == published.handle.fingerprint
    assert first.registered == {"model"} and first.builds == 4

    restart = EngineLoad(checkpoint)
    assert backend.complete_fingerprint(fp, restart) == published.handle.fingerprint and not restart.registered
    restart.builds = 0
    hit, _ = engine_load(backend, restart, socket_dir, "client", strict=True)
    assert hit.source == "cache" and restart.builds == 1 and restart.registered == {"model"}
    with torch.no_grad():
        assert torch.equal(hit.model(INPUT_IDS), reference_output(checkpoint))

    fallback = EngineLoad(checkpoint, dtype=torch.bfloat16)
    with pytest.warns(wc.FallbackWarning, match=r"extra\.structure"):
        engine_load(backend, fallback, socket_dir, "client")
    assert fallback.builds == 2 and fallback.registered == {"model"}  # the disk model's, built after the release
    refused = EngineLoad(checkpoint, dtype=torch.bfloat16)
    with pytest.raises(wc.FingerprintMismatch):
        engine_load(backend, refused, socket_dir, "client", strict=True)
    assert refused.builds == 1 and not refused.registered  # an engine that does not start keeps nothing registered


@pytest.mark.parametrize("mode", ["client", "daemon"])
def test_an_engine_whose_model_cannot_be_built_on_meta_starts_from_disk(
    checkpoint: Path, socket_dir: Path, mode: str
) -> None:
    """The structure needs the engine's model built on meta before the keeper is asked; an engine whose model
    cannot be built there still starts, from disk, with a warning that says why (and publishes nothing: no model
    could take the published weights); strict refuses to start instead."""
    wc.Cache(socket_dir, spawn=True)
    backend = RegisteringEngine()
    load = EngineLoad(checkpoint, meta_fails=True)
    with pytest.warns(wc.FallbackWarning, match="cannot be built on the meta device.*allocates real memory"):
        loaded, _ = engine_load(backend, load, socket_dir, mode)
    assert loaded.source == "disk" and loaded.handle is None and load.registered == {"model"}
    with torch.no_grad():
        assert torch.equal(loaded.model(INPUT_IDS), reference_output(checkpoint))
    assert wc.Cache(socket_dir).entries() == []
    with pytest.raises(wc.BackendError, match="cannot be built on the meta device"):
        engine_load(backend, EngineLoad(checkpoint, meta_fails=True), socket_dir, mode, strict=True)


def test_mode_off_builds_no_meta_model(checkpoint: Path, socket_dir: Path) -> None:
    """Mode off never asks a keeper, so it builds only the engine's own model (no meta model for the structure)."""
    load = EngineLoad(checkpoint)
    loaded, _ = engine_load(RegisteringEngine(), load, socket_dir, "off")
    assert loaded.source == "disk" and load.builds == 1


# --- the engine always starts: serve_engine ---------------------------------------------------------------------


class RangedEngine(RegisteringEngine):
    """An engine whose adapter supports releases 1.0 to 1.2 (the engine, here torch, reports ``version``)."""

    name: ClassVar[str] = "ranged"
    releases: ClassVar[ReleaseRange | None] = ReleaseRange("Ranged", "1.0", "1.2")
    installed: ClassVar[str] = "1.1.0"
    fail_after_bind: ClassVar[bool] = False

    def version(self) -> str:
        return self.installed

    def after_bind(self, model: torch.nn.Module, handle: wc.Handle, context: EngineLoad) -> None:
        if self.fail_after_bind:
            raise AttributeError("module 'engine' has no attribute 'moved_function'")
        for buffer in model.buffers():  # as vLLM's attention layers reset their scales: a write into a buffer
            buffer.add_(0)


def serve(
    backend: Backend, context: EngineLoad, socket_dir: Path, mode: str, strict: bool = False, describe: Any = None
) -> Loaded:
    options = LoaderOptions(mode=mode, socket_dir=str(socket_dir), strict=strict)  # type: ignore[arg-type]
    describe = describe or (lambda: engine_fingerprint(backend, context))
    return backend.serve_engine(context, describe=describe, device="cpu", options=options)


def test_an_engine_release_outside_the_range_starts_from_disk(
    checkpoint: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Outside the declared releases: the engine's own loader, a FallbackWarning that names the release and the
    range, no keeper asked; strict: a BackendError saying the same; the override variable lets it try."""
    backend = RangedEngine()
    monkeypatch.setattr(RangedEngine, "installed", "2.0.1")
    with pytest.warns(
        wc.FallbackWarning, match=r"Ranged 2\.0\.1 is outside the releases .* \(Ranged 1\.0 to 1\.2\.x\)"
    ):
        loaded = serve(backend, EngineLoad(checkpoint), socket_dir, "daemon")
    assert loaded.source == "disk" and loaded.handle is None and not socket_dir.exists()
    with torch.no_grad():
        assert torch.equal(loaded.model(INPUT_IDS), reference_output(checkpoint))
    with pytest.raises(wc.BackendError, match=r"Ranged 2\.0\.1 is outside"):
        serve(backend, EngineLoad(checkpoint), socket_dir, "daemon", strict=True)
    monkeypatch.setenv(UNTESTED_ENGINES_ENV, "1")
    assert serve(backend, EngineLoad(checkpoint), socket_dir, "daemon").source == "cache"


def test_an_engine_api_the_adapter_cannot_use_starts_from_disk(checkpoint: Path, socket_dir: Path) -> None:
    """Describing the model fails (a moved or changed engine function): from disk, saying why; an engine API that
    fails after the cached weights were bound: the model is released, and the engine's own loader runs."""
    backend = RangedEngine()

    def moved() -> wc.Fingerprint:
        raise ImportError("cannot import name 'parallel_state' from 'engine.distributed'")

    with pytest.warns(wc.FallbackWarning, match=r"could not describe this model .*ImportError: cannot import name"):
        loaded = serve(backend, EngineLoad(checkpoint), socket_dir, "client", describe=moved)
    assert loaded.source == "disk"
    with pytest.raises(wc.BackendError, match="could not describe"):
        serve(backend, EngineLoad(checkpoint), socket_dir, "client", strict=True, describe=moved)

    serve(backend, EngineLoad(checkpoint), socket_dir, "daemon")  # published
    RangedEngine.fail_after_bind = True
    try:
        load = EngineLoad(checkpoint)
        with pytest.warns(wc.FallbackWarning, match=r"could not finish a model .*AttributeError: .*moved_function"):
            loaded = serve(backend, load, socket_dir, "client")
        assert loaded.source == "disk" and load.registered == {"model"}  # the bound model was released
        with torch.no_grad():
            assert torch.equal(loaded.model(INPUT_IDS), reference_output(checkpoint))
    finally:
        RangedEngine.fail_after_bind = False


def test_the_kill_switch(checkpoint: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """WEIGHTCACHE_MODE=off: the engine's own loader, no warning, no keeper, whatever the options say; daemon or
    client override the options' mode; another value is a clear error."""
    backend = RangedEngine()
    monkeypatch.setenv(MODE_ENV, "off")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        loaded = serve(backend, EngineLoad(checkpoint), socket_dir, "daemon", strict=True)
    assert loaded.source == "disk" and not socket_dir.exists()
    monkeypatch.setenv(MODE_ENV, "daemon")
    assert serve(backend, EngineLoad(checkpoint), socket_dir, "client", strict=True).source == "cache"
    monkeypatch.setenv(MODE_ENV, "of")
    with pytest.raises(wc.BackendConfigError, match=r"WEIGHTCACHE_MODE must be one of off, daemon, client; found 'of'"):
        serve(backend, EngineLoad(checkpoint), socket_dir, "client")


def test_engines_get_private_buffers_and_shared_parameters(checkpoint: Path, socket_dir: Path) -> None:
    """An engine may write into buffers after loading (RangedEngine.after_bind does, as vLLM does); buffers are
    bound as private copies, parameters as the keeper's memory."""
    backend = RangedEngine()
    serve(backend, EngineLoad(checkpoint), socket_dir, "daemon")
    hit = serve(backend, EngineLoad(checkpoint), socket_dir, "client", strict=True)
    assert hit.source == "cache" and hit.handle is not None
    shared = {t.data_ptr() for t in hit.handle.tensors.values()}
    assert all(p.data_ptr() in shared for p in hit.model.parameters())
    buffers = list(hit.model.buffers())
    assert buffers and not any(b.data_ptr() in shared for b in buffers)


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_refused_quantization_is_refused_before_the_checkpoint_is_looked_for(
    engine: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """For a hub model name the engine adapters' ``checkpoint_dir`` downloads the weights: a quantization method
    weightcache refuses (AWQ here) is refused before it is asked for (it was asked first, so the refusal came after
    the download)."""
    import types

    class AWQ:
        def get_name(self) -> str:
            return "awq"

    backend = backends.get(engine)
    looked: list[object] = []
    monkeypatch.setattr(type(backend), "checkpoint_dir", lambda self, *args: looked.append(args) or "/nowhere")
    model_config = types.SimpleNamespace(model="org/model-on-the-hub", dtype=torch.bfloat16)
    with pytest.raises(wc.UnsupportedQuantError, match="AWQ|awq"):
        if engine == "vllm":
            backend.fingerprint(types.SimpleNamespace(quant_config=AWQ()), model_config, torch.device("cpu"))
        else:
            monkeypatch.setattr(type(backend), "quant_config", lambda self, model_config, load_config: AWQ())
            backend.fingerprint(model_config, types.SimpleNamespace(), torch.device("cpu"))
    assert looked == []

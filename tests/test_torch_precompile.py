"""A forward compiled ahead of time, from the keeper (weightcache.torch_precompile): a tiny transformers Llama on the
CPU, in fresh processes with a real keeper. Process A compiles ahead of time and publishes; process B, with an
empty local inductor cache directory, loads the forward and runs it with no dynamo trace and no compile (torch's
own counters), with the same logits bit for bit. A forward with a graph break, and a call the compiled guards
refuse, go through plain torch.compile. The workers are benchmarks/compile_restart.py's."""

from __future__ import annotations

import hashlib
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest
from conftest import benchmark

import weightcache as wc
from weightcache.torch_compile_blob import unpack
from weightcache.torch_precompile import (
    PRECOMPILE_KIND,
    guard_filter,
    join_saved,
    precompile_key,
    resolve_module,
    split_saved,
)

compile_restart = benchmark("compile_restart")

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")


def test_the_bundle_names_the_modules_dynamo_installed() -> None:
    modules = {"___module_collections_1_c0": "collections", "_2_c0": "torch.ops._quantized"}
    assert split_saved(join_saved(modules, b"\x80torch")) == (modules, b"\x80torch")
    with pytest.raises(ValueError, match="no header line"):
        split_saved(b"\x80just a pickle")
    with pytest.raises(ValueError, match="not JSON"):
        split_saved(b"{oops\0data")
    with pytest.raises(ValueError, match="global names to module names"):
        split_saved(b'{"modules": {"os": 3}}\0data')
    # a module that is an attribute, not an importable module (torch's op namespaces)
    import torch

    assert resolve_module("torch.ops._quantized") is torch.ops._quantized
    assert resolve_module("collections") is __import__("collections")
    with pytest.raises(ImportError):
        resolve_module("torch.nn.Linear")  # a class, not a module


def test_the_guard_filter_keeps_what_a_fresh_process_can_check() -> None:
    def entry(name: str, guard_type: str, derived: tuple[str, ...] = (), is_global: bool = False) -> object:
        return SimpleNamespace(name=name, guard_type=guard_type, derived_guard_types=derived, is_global=is_global)

    entries = [
        entry("L['input_ids']", "TENSOR_MATCH"),
        entry("", "GLOBAL_STATE"),
        entry("L['self'].config.use_return_dict", "CONSTANT_MATCH", ("BOOL_MATCH",)),
        entry("L['self']._modules['lm_head']", "ID_MATCH"),
        entry("L['self'].rotary", "TYPE_MATCH", ("ID_MATCH",)),  # derived from an identity
        entry("G['torch']", "CONSTANT_MATCH", is_global=True),
        entry("func.__defaults__", "SEQUENCE_LENGTH", ("TYPE_MATCH",)),  # a decorator's closure variable
        entry("func", "TYPE_MATCH"),
        entry("functional.x", "TYPE_MATCH"),  # not the closure variable, though it starts alike
    ]
    assert guard_filter(("func",))(entries) == [True, True, True, False, False, False, False, False, True]
    assert guard_filter(())(entries)[6] is True


def test_the_key_records_the_source_the_inputs_and_the_grad_mode(checkpoint: Path) -> None:
    import torch

    fp = wc.Fingerprint.create(checkpoint)
    model = torch.nn.Linear(4, 4)
    x = torch.zeros(2, 4)
    key = precompile_key(fp, model, (x,), options={"backend": "inductor"})
    assert key.kind == PRECOMPILE_KIND and key.fields["forward"] == "torch.nn.modules.linear.Linear"
    assert key.fields["shapes"] == [[[[2, 4], "torch.float32", "cpu", False]], {}]
    assert precompile_key(fp, model, (torch.zeros(3, 4),), options={"backend": "inductor"}) != key
    with torch.no_grad():
        assert precompile_key(fp, model, (x,), options={"backend": "inductor"}).diff(key) == [("grad", False, True)]
    other = torch.nn.Sequential(torch.nn.Linear(4, 4))
    assert precompile_key(fp, other, (x,), options={"backend": "inductor"}).fields["source"] != key.fields["source"]
    with pytest.raises(wc.InvalidArgument, match="extra names grad, source"):  # it would hide a change of either
        precompile_key(fp, model, (x,), extra={"source": "mine", "grad": True})


def test_a_graph_break_means_plain_torch_compile(socket_dir: Path, checkpoint: Path) -> None:
    """A forward that cannot be one graph (data-dependent control flow) cannot be compiled ahead of time: the
    result runs it through torch.compile, and says why."""
    import torch

    class Branchy(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.linear = torch.nn.Linear(4, 4)

        def forward(self, x: torch.Tensor) -> torch.Tensor:
            y = self.linear(x)
            if y.sum().item() > 0:  # a graph break: the branch depends on the data
                return y * 2
            return y

    model = Branchy()
    x = torch.ones(2, 4)
    fp = wc.Fingerprint.create(checkpoint)
    with torch.no_grad():
        forward = wc.precompile(fp, model, (x,), options={"backend": "eager"}, socket_dir=socket_dir)
        assert forward.stats.source == "torch.compile", forward.stats
        assert "Branchy.forward failed" in str(forward.stats.reason) and "one graph" in str(forward.stats.reason)
        assert torch.equal(forward(x), model(x))


@pytest.mark.slow
@needs_compiler
def test_a_call_its_guards_refuse_goes_through_torch_compile(socket_dir: Path, checkpoint: Path) -> None:
    """No keeper: compiled ahead of time here, nothing published, and the reason says so. A call with another
    shape than the example is refused by the compiled function's guards: it, and every later call, runs through
    torch.compile, with the right result."""
    import torch

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 8)).eval()
    x = torch.randn(2, 8)
    with torch.no_grad():
        forward = wc.precompile(wc.Fingerprint.create(checkpoint), model, (x,), socket_dir=socket_dir)
        assert forward.stats.source == "compiled" and forward.stats.published_bytes == 0, forward.stats
        assert str(forward.stats.reason).startswith("no keeper"), forward.stats
        torch.testing.assert_close(forward(x), model(x))
        assert forward.stats.fallback_calls == 0
        y = torch.randn(5, 8)
        torch.testing.assert_close(forward(y), model(y))
        torch.testing.assert_close(forward(x), model(x))
        assert forward.stats.fallback_calls == 2  # the refused call and every later one (the guide)


@pytest.mark.slow
@needs_compiler
def test_a_fresh_process_loads_the_forward_and_traces_nothing(tmp_path: Path, socket_dir: Path) -> None:
    checkpoint = compile_restart.make_checkpoint(tmp_path / "ckpt", layers=1, hidden=64)
    wc.Cache(socket_dir, spawn=True)

    def run(cache_dir: str) -> dict:
        return compile_restart.run_worker(
            checkpoint, socket_dir, tmp_path / cache_dir, keeper=False, precompile=True, timeout=900
        )

    first = run("a")  # compiles ahead of time, publishes at once
    assert first["stats"]["source"] == "compiled" and first["stats"]["published_bytes"] > 0, first["stats"]
    assert first["graphs"].get("unique_graphs", 0) >= 1  # dynamo traced here
    cache = wc.Cache(socket_dir)
    [artifact] = cache.artifacts()
    assert artifact.kind == PRECOMPILE_KIND and artifact.bytes == first["stats"]["published_bytes"]
    assert artifact.leases == 0  # the worker has exited

    second = run("b")  # an empty inductor cache directory: the forward from the keeper
    stats = second["stats"]
    assert stats["source"] == "keeper" and stats["loaded_bytes"] == artifact.bytes, stats
    assert stats["kernels_restored"] > 0 and stats["published_bytes"] == 0 and stats["reason"] is None
    assert second["graphs"] == {} and second["compile_times_s"].get("_compile.compile_inner") is None, second
    assert second["counters"].get("inductor", {}).get("fxgraph_cache_miss", 0) == 0
    assert second["logits_sha256"] == first["logits_sha256"]

    # Garbage at the key (this uid's, its SHA-256 intact) is a miss: compiled again and replaced.
    good = cache.get_artifact(artifact.weights, artifact.artifact_key)
    assert good is not None and split_saved(unpack(good)[0])[1]
    cache.put_artifact(artifact.weights, artifact.artifact_key, b"garbage", replace=hashlib.sha256(good).hexdigest())
    mended = run("c")
    assert mended["stats"]["source"] == "compiled" and "could not be loaded" in mended["stats"]["reason"], mended
    again = cache.get_artifact(artifact.weights, artifact.artifact_key)
    assert again is not None and again != b"garbage"
    assert mended["logits_sha256"] == first["logits_sha256"]


@pytest.mark.cuda
def test_on_a_gpu_a_fresh_process_loads_the_forward_or_says_why_it_compiles(tmp_path: Path, socket_dir: Path) -> None:
    """The same on cuda:0 (bf16): process B, with empty inductor and Triton cache directories, runs the forward
    from the keeper with no dynamo trace and no inductor compile, and gives the same logits. torch 2.11 (the
    H200's) refuses the AOT compile of transformers' forward ("Missing required external references: ['type']",
    its check of the globals the graph reads, which does not count builtins): there both processes say so and use
    plain torch.compile, with the same logits."""
    checkpoint = compile_restart.make_checkpoint(tmp_path / "ckpt", layers=1, hidden=64)
    wc.Cache(socket_dir, spawn=True)

    def run(cache_dir: str) -> dict:
        return compile_restart.run_worker(
            checkpoint, socket_dir, tmp_path / cache_dir, keeper=False, precompile=True, device="cuda:0",
            dtype="bfloat16", timeout=900,
        )  # fmt: skip

    import torch

    first = run("a")
    second = run("b")
    assert second["logits_sha256"] == first["logits_sha256"]
    if tuple(int(p) for p in torch.__version__.split(".")[:2]) < (2, 13):
        for report in (first, second):
            stats = report["stats"]
            assert stats["source"] == "torch.compile" and "external references" in stats["reason"], str(stats)
            assert stats["published_bytes"] == 0
        return
    assert first["stats"]["source"] == "compiled" and first["stats"]["published_bytes"] > 0, str(first["stats"])
    stats = second["stats"]
    assert stats["source"] == "keeper" and stats["reason"] is None and stats["fallback_calls"] == 0, str(stats)
    assert second["graphs"] == {} and second["compile_times_s"].get("_compile.compile_inner") is None, second
    assert second["counters"].get("inductor", {}).get("fxgraph_cache_miss", 0) == 0

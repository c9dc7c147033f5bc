"""torch.compile from the keeper (weightcache.torch_compile): a tiny transformers Llama compiled with inductor on
the CPU, in fresh processes with a real keeper. Process A compiles and publishes; process B, with an empty local
inductor cache directory, gets every compiled graph from the keeper (torch's cache-hit counters, no misses) and
the same logits bit for bit; a changed compile option is a miss that compiles and publishes a second artifact.
The workers are benchmarks/compile_restart.py's (the benchmark of docs/benchmarks.md)."""

from __future__ import annotations

import hashlib
import shutil
import struct
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import benchmark

import weightcache as wc
from weightcache.torch_compile import KIND, blob_info, compile_key, pack, unpack

compile_restart = benchmark("compile_restart")

needs_compiler = pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")


def shared_library(tail: bytes = b"") -> bytes:
    """The first bytes of a 64-bit little-endian ELF shared object (e_type ET_DYN), then ``tail``."""
    head = b"\x7fELF" + bytes([2, 1, 1, 0]) + bytes(8) + struct.pack("<H", 3)
    return head + bytes(64 - len(head)) + tail


def test_the_key_records_what_decides_validity(checkpoint: Path) -> None:
    import torch

    fp = wc.Fingerprint.create(checkpoint)
    key = compile_key(fp, options={"backend": "inductor", "mode": None}, shapes=[[1, 8]])
    assert key.kind == KIND
    fields = key.fields
    assert fields["torch"] == torch.__version__ and fields["device"] == "cpu" and fields["isa"]
    assert fields["options"] == {"backend": "inductor", "mode": None} and fields["shapes"] == [[1, 8]]
    # a changed option, dtype or shape is another key (a miss, then a second artifact)
    assert compile_key(fp, options={"backend": "inductor", "mode": "max-autotune"}, shapes=[[1, 8]]) != key
    assert compile_key(fp, options={"backend": "inductor", "mode": None}, shapes=[[1, 8]], dtype="bfloat16") != key
    bf16 = wc.Fingerprint.create(checkpoint, dtype=torch.bfloat16)
    assert compile_key(bf16, options={"backend": "inductor", "mode": None}, shapes=[[1, 8]]).diff(key) == [
        ("dtype", "bfloat16", None)
    ]
    # one dtype is one key however it is spelled (torch.bfloat16 was 'torch.bfloat16', missing the default's)
    spelled = {compile_key(bf16, dtype=d).fields["dtype"] for d in (torch.bfloat16, "bfloat16", "bf16", None)}
    assert spelled == {"bfloat16"}
    # extra adds fields; it cannot replace the key's own (a torch upgrade would have loaded a stale artifact)
    assert compile_key(fp, extra={"engine": "x"}).fields["engine"] == "x"
    with pytest.raises(wc.InvalidArgument, match="extra names torch"):
        compile_key(fp, extra={"torch": "2.0"})
    with pytest.raises(wc.InvalidArgument, match="extra names triton"):  # a GPU's field: refused on a CPU too
        compile_key(fp, extra={"triton": "3.0"})
    assert compile_key(fp, dtype=torch.quint8).fields["dtype"] == "torch.quint8"  # outside the table: by str, as before
    # the key function as the guide names it, before anything imported its module
    out = subprocess.run(
        [sys.executable, "-c", "import weightcache as wc; print(wc.torch_compile.compile_key.__name__)"],
        capture_output=True,
        text=True,
    )
    assert out.stdout.strip() == "compile_key", out.stderr


def test_the_blob_carries_the_bundle_and_only_kernel_paths() -> None:
    elf = shared_library(b"code")
    blob = pack(b"bundle", {"ab/cabcdefgh12.main.so": elf, "cd/cxyzxyzxy.so": shared_library()})
    assert unpack(blob) == (b"bundle", {"ab/cabcdefgh12.main.so": elf, "cd/cxyzxyzxy.so": shared_library()})
    assert blob_info(blob).generation == 0 and blob_info(blob).kernels == {"ab/cabcdefgh12.main.so", "cd/cxyzxyzxy.so"}
    again = pack(b"bundle", {}, entries={"inductor": ["k2", "k1"]}, generation=1)
    assert blob_info(again).entries == {"inductor": {"k1", "k2"}} and blob_info(again).generation == 1
    bad = pack(b"bundle", {"../../etc/cron.d/x.so": elf})
    with pytest.raises(ValueError, match="no inductor kernel path"):
        unpack(bad)
    with pytest.raises(ValueError, match="accounts for"):
        unpack(blob + b"tail")
    with pytest.raises(ValueError, match="starts with"):
        unpack(b"pickle-or-anything-else")


@pytest.mark.parametrize(
    "kernel",
    [b"garbage" * 20, b"", shared_library()[:40], shared_library().replace(b"\x03\x00", b"\x02\x00", 1)],
    ids=["garbage", "empty", "cut", "executable-not-library"],
)
def test_a_kernel_that_is_no_shared_library_is_a_miss_not_a_crash(
    kernel: bytes, socket_dir: Path, checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Issue 33, item 6: C++ kernels replaced by garbage were restored unchecked and the first compiled call
    raised BackendCompilerFailed. Such a blob is refused before anything is written: a miss, and the next publish
    replaces it."""
    monkeypatch.setenv("TORCHINDUCTOR_CACHE_DIR", str(tmp_path / "inductor"))
    with pytest.raises(ValueError, match="no shared library"):
        unpack(pack(b"", {"ab/cabcdefgh12.so": kernel}))
    fp = wc.Fingerprint.create(checkpoint)
    cache = wc.Cache(socket_dir, spawn=True)
    key = compile_key(fp)
    cache.put_artifact(fp, key, pack(b"", {"ab/cabcdefgh12.so": kernel}))
    with wc.compile_cache(fp, socket_dir=socket_dir) as cc:
        pass
    assert cc.stats.source == "none" and "no shared library" in str(cc.stats.miss_reason), cc.stats
    assert not (tmp_path / "inductor" / "ab").exists()  # nothing of the blob was written


def test_no_keeper_or_a_foreign_blob_only_means_compiling(socket_dir: Path, checkpoint: Path) -> None:
    fp = wc.Fingerprint.create(checkpoint)
    with wc.compile_cache(fp, socket_dir=socket_dir) as cc:  # no keeper: a miss, nothing raised
        pass
    assert cc.stats.source == "none" and cc.stats.published_bytes == 0
    assert str(cc.stats.miss_reason).startswith("no keeper"), cc.stats.miss_reason  # the real cause
    cache = wc.Cache(socket_dir, spawn=True)
    with wc.compile_cache(fp, socket_dir=socket_dir) as empty:
        pass
    assert f"no {KIND} artifact for weights {fp.digest[:12]}" in str(empty.stats.miss_reason), empty.stats
    cache.put_artifact(fp, cc.key, b"not a torch.compile artifact")
    with wc.compile_cache(fp, socket_dir=socket_dir) as again:
        assert again.stats.source == "none" and "could not be loaded" in str(again.stats.miss_reason)


@pytest.mark.slow
@needs_compiler
def test_a_fresh_process_with_an_empty_cache_dir_gets_every_graph_from_the_keeper(
    tmp_path: Path, socket_dir: Path
) -> None:
    checkpoint = compile_restart.make_checkpoint(tmp_path / "ckpt", layers=1, hidden=64)
    wc.Cache(socket_dir, spawn=True)

    def run(cache_dir: str, **kwargs: object) -> dict:
        return compile_restart.run_worker(checkpoint, socket_dir, tmp_path / cache_dir, keeper=True, **kwargs)

    first = run("a")  # compiles (torch misses), publishes
    assert first["stats"]["source"] == "none" and first["stats"]["misses"] > 0, first
    assert first["stats"]["published_bytes"] > 0
    cache = wc.Cache(socket_dir)
    [artifact] = cache.artifacts()
    assert artifact.kind == KIND and artifact.weights == first["weights"] and artifact.leases == 0
    assert artifact.bytes == first["stats"]["published_bytes"]

    second = run("b")  # an empty local cache directory: everything from the keeper
    stats = second["stats"]
    assert stats["source"] == "keeper" and stats["loaded_bytes"] == artifact.bytes, second
    assert stats["hits"] > 0 and stats["misses"] == 0, second
    assert second["counters"]["inductor"].get("fxgraph_cache_hit", 0) > 0
    assert second["counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert second["counters"]["aot_autograd"].get("autograd_cache_miss", 0) == 0
    assert stats["kernels_restored"] > 0 and stats["published_bytes"] == 0
    assert second["logits_sha256"] == first["logits_sha256"]

    # Garbage at the key (published by this uid, its SHA-256 intact) is a miss, and the next good publish
    # replaces it: the keeper used to keep the first blob of a key, and every later start compiled cold.
    good = cache.get_artifact(first["weights"], artifact.artifact_key)
    assert good is not None
    cache.put_artifact(first["weights"], artifact.artifact_key, b"garbage", replace=hashlib.sha256(good).hexdigest())
    mended = run("c")
    assert mended["stats"]["source"] == "none" and "could not be loaded" in mended["stats"]["miss_reason"], mended
    assert mended["stats"]["published_bytes"] > 0
    again = cache.get_artifact(first["weights"], artifact.artifact_key)
    assert again is not None and again != b"garbage" and unpack(again)[0]

    third = run("b", options={"epilogue_fusion": False})  # another compile option: another key
    assert third["stats"]["source"] == "none" and third["stats"]["misses"] > 0, third
    assert third["stats"]["published_bytes"] > 0
    assert third["logits_sha256"] == first["logits_sha256"]
    artifacts = cache.artifacts(first["weights"])
    fusion = {a.artifact_key.fields["options"].get("options", {}).get("epilogue_fusion") for a in artifacts}
    assert len(artifacts) == 2 and fusion == {None, False}
    listed = subprocess.run(
        [sys.executable, "-m", "weightcache", "ls", "--socket-dir", str(socket_dir)], capture_output=True, text=True
    )
    assert listed.stdout.count(KIND) == 2, listed.stdout


@pytest.mark.cuda
def test_on_a_gpu_an_empty_cache_dir_gets_every_graph_and_triton_kernel_from_the_keeper(
    tmp_path: Path, socket_dir: Path
) -> None:
    """The same on cuda:0 (bf16): inductor's Triton kernels travel in torch's bundle; process B with an empty
    inductor and Triton cache directory compiles nothing (torch's counters) and gives the same logits."""
    checkpoint = compile_restart.make_checkpoint(tmp_path / "ckpt", layers=1, hidden=64)
    wc.Cache(socket_dir, spawn=True)

    def run(cache_dir: str) -> dict:
        return compile_restart.run_worker(
            checkpoint, socket_dir, tmp_path / cache_dir, keeper=True, device="cuda:0", dtype="bfloat16"
        )

    first = run("a")
    assert first["stats"]["source"] == "none" and first["stats"]["misses"] > 0, first
    assert first["stats"]["published_bytes"] > 0
    second = run("b")
    stats = second["stats"]
    assert stats["source"] == "keeper" and stats["hits"] > 0 and stats["misses"] == 0, second
    assert second["counters"]["inductor"].get("fxgraph_cache_miss", 0) == 0
    assert stats["published_bytes"] == 0
    assert second["logits_sha256"] == first["logits_sha256"]

"""GPU tests: CUDA VMM segments on a real GPU (marked cuda; skipped where there is none).

Run on a GPU machine with: python -m pytest -m cuda -v
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch
from conftest import Holder, run_worker, start_keeper, stop_keeper, wait_until
from models import make_checkpoint
from ranks import start_together, survive_keeper_kill

import weightcache as wc
from weightcache.tools import bench_ranks

pytestmark = pytest.mark.cuda
HERE = Path(__file__).parent


def used_gib() -> float:
    free, total = torch.cuda.mem_get_info(0)
    return (total - free) / 2**30


def python(code: str, env: dict[str, str] | None = None, timeout: float = 300) -> dict:
    """Run code in a fresh process (the tests' own directory on the path); return its last JSON line."""
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env={**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}", **(env or {})},
    )
    if out.returncode != 0:
        raise AssertionError(f"child failed ({out.returncode}):\n{out.stderr[-4000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def test_put_get_round_trip_on_gpu(checkpoint: Path, socket_dir: Path) -> None:
    cache = wc.Cache(socket_dir, spawn=True)
    fp = wc.Fingerprint.create(checkpoint, device="cuda:0")
    assert fp.placement.startswith("GPU-") and fp.device_kind == "cuda" and fp.compute_capability
    g = torch.Generator(device="cuda").manual_seed(0)
    state = {
        "a": torch.randn(1000, 17, device="cuda", generator=g).to(torch.bfloat16),
        "t": torch.randn(64, 32, device="cuda", generator=g).t(),  # strides kept
        "i": torch.arange(10, device="cuda"),
        "cpu_source": torch.randn(33),  # published from host memory
        "fp8": torch.randn(256, device="cuda", generator=g).to(torch.float8_e4m3fn),
    }
    expected = {k: v.to("cuda") for k, v in state.items()}
    with cache.put(fp, state) as h:
        assert h.manifest is not None and {s.kind for s in h.manifest.segments} == {"cuda_vmm"}
        for k, v in expected.items():
            got = h.tensors[k]
            assert got.is_cuda and got.stride() == v.stride() and got.dtype == v.dtype
            assert torch.equal(
                got.view(torch.uint8) if got.dtype == torch.float8_e4m3fn else got,
                v.view(torch.uint8) if v.dtype == torch.float8_e4m3fn else v,
            )
    with cache.get(fp) as again:  # type: ignore[union-attr]
        assert torch.equal(again.tensors["a"], expected["a"])
    [entry] = cache.entries()
    assert entry.placement == fp.placement and entry.device.startswith("cuda")


def test_client_in_other_process_is_bitwise_equal_on_gpu(checkpoint: Path, socket_dir: Path) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "device": "cuda:0"}
    off = run_worker("attach", {**spec, "mode": "off"})
    daemon = run_worker("attach", {**spec, "mode": "daemon"})
    client = run_worker("attach", {**spec, "mode": "client", "strict": True})
    assert [off["source"], daemon["source"], client["source"]] == ["disk", "cache", "cache"]
    assert off["output"] == daemon["output"] == client["output"]


def test_clients_map_read_only(checkpoint: Path, socket_dir: Path) -> None:
    """A client that writes into attached weights faults in its own process; everyone else's data is intact."""
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "device": "cuda:0"}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    code = f"""
        import torch, weightcache as wc
        from models import meta_model
        m = meta_model()
        h = wc.attach(
            m, {str(checkpoint)!r}, mode="client", device="cuda:0", socket_dir={str(socket_dir)!r}, strict=True
        )
        with torch.no_grad():
            m.embed.weight.add_(1.0)
        torch.cuda.synchronize()
        print("WROTE")
    """
    out = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": f"{HERE}:{os.environ.get('PYTHONPATH', '')}"},
    )
    assert out.returncode != 0 and "WROTE" not in out.stdout, out.stdout + out.stderr[-2000:]
    after = run_worker("attach", {**spec, "mode": "client", "strict": True})
    assert after["output"] == first["output"]


def test_keeper_sigkill_leaves_gpu_clients_computing(checkpoint: Path, socket_dir: Path) -> None:
    proc = start_keeper(socket_dir)
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "device": "cuda:0"}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    holder = Holder({**spec, "mode": "client"})
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for _ in range(3):
            assert holder.compute()["output"] == first["output"]
    finally:
        holder.close()


def test_restarted_keeper_gets_gpu_entries_back(checkpoint: Path, socket_dir: Path) -> None:
    """The CPU test of re-publication (tests/test_faults.py) on a GPU: the holder re-publishes its VMM fds to a
    new keeper, and a third engine attaches them."""
    proc = start_keeper(socket_dir)
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "device": "cuda:0"}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    holder = Holder({**spec, "mode": "client"})
    try:
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        proc = start_keeper(socket_dir)
        assert wait_until(lambda: [e.leases for e in wc.Cache(socket_dir).entries()] == [1], timeout=15)
        third = run_worker("attach", {**spec, "mode": "client", "strict": True})
        assert third["source"] == "cache" and third["output"] == first["output"]
        assert holder.leased_again()
        assert holder.compute() == {"output": first["output"], "leased": True}
    finally:
        holder.close()
        proc.terminate()
        proc.wait(10)


def test_gpu_memory_is_returned_when_the_last_holder_exits(tmp_path: Path, socket_dir: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "big", dim=1024, vocab=32768)  # ~130 MB of fp32 weights
    torch.zeros(1, device="cuda")
    torch.cuda.synchronize()
    baseline = used_gib()
    proc = start_keeper(socket_dir)
    spec = {"checkpoint": str(ckpt), "socket_dir": str(socket_dir), "device": "cuda:0"}
    run_worker("attach", {**spec, "mode": "daemon"})  # publisher exits; the keeper's fd keeps the memory
    holder = Holder({**spec, "mode": "client"})
    size_gib = wc.Cache(socket_dir).entries()[0].bytes / 2**30
    held = used_gib()
    assert held - baseline >= 0.9 * size_gib
    proc.send_signal(signal.SIGKILL)  # keeper gone: the client's mapping still holds it
    proc.wait(10)
    time.sleep(0.5)
    assert used_gib() - baseline >= 0.9 * size_gib
    holder.close()  # last holder gone: the driver frees the memory
    wait_until(lambda: used_gib() - baseline <= 0.05, timeout=10)
    assert used_gib() - baseline <= 0.05, f"{used_gib() - baseline:.3f} GiB not returned"


def test_attach_detach_cycles_leak_nothing(checkpoint: Path, socket_dir: Path) -> None:
    cache = wc.Cache(socket_dir, spawn=True)
    fp = wc.Fingerprint.create(checkpoint, device="cuda:0")
    cache.put(fp, {f"t{i}": torch.randn(1 << 18, device="cuda") for i in range(8)}).close()
    for _ in range(3):
        cache.get(fp).close()  # type: ignore[union-attr]
    torch.cuda.synchronize()
    import gc

    gc.collect()
    fds, mem = len(os.listdir("/proc/self/fd")), used_gib()
    for _ in range(100):
        h = cache.get(fp)
        assert h is not None
        float(h.tensors["t3"].sum())
        h.close()
        del h
    gc.collect()
    torch.cuda.synchronize()
    assert len(os.listdir("/proc/self/fd")) == fds
    assert abs(used_gib() - mem) < 0.01
    cache.evict(fp, force=True)
    gc.collect()
    time.sleep(0.2)
    assert used_gib() < mem - 0.005  # the 8 MiB entry is gone once nobody holds it


def test_visible_devices_by_uuid(checkpoint: Path, socket_dir: Path) -> None:
    """A client that names the GPU by UUID in CUDA_VISIBLE_DEVICES finds the publisher's segment; one that
    sees no GPU gets a clear fallback reason."""
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "device": "cuda:0"}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    uuid = str(torch.cuda.get_device_properties(0).uuid)
    code = f"""
        import json, torch, weightcache as wc
        from models import meta_model
        m = meta_model()
        h = wc.attach(
            m, {str(checkpoint)!r}, mode="client", device="cuda:0", socket_dir={str(socket_dir)!r}, strict=True
        )
        print(json.dumps({{"source": h.source, "placement": h.fingerprint.placement}}))
    """
    got = python(code, env={"CUDA_VISIBLE_DEVICES": f"GPU-{uuid}"})
    assert got == {"source": "cache", "placement": f"GPU-{uuid}"}
    assert first["source"] == "cache"


def test_cuda_graphs_and_torch_compile(checkpoint: Path, socket_dir: Path) -> None:
    from models import INPUT_IDS, meta_model

    with wc.attach(meta_model(), checkpoint, mode="daemon", device="cuda:0", socket_dir=socket_dir):
        pass
    model = meta_model()
    model.positions = model.positions.cuda()
    handle = wc.attach(model, checkpoint, mode="client", device="cuda:0", socket_dir=socket_dir, strict=True)
    ids = INPUT_IDS.cuda()
    with torch.no_grad():
        eager = model(ids)
        static = ids.clone()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            model(static)  # warm-up
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured = model(static)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(captured, eager)
        compiled = torch.compile(model)
        assert torch.allclose(compiled(ids), eager, rtol=1e-4, atol=1e-4)
    handle.close()


def test_publish_migrates_gpu_weights_with_bounded_memory(checkpoint: Path, socket_dir: Path) -> None:
    """8 GiB of weights in the caching allocator are migrated into segments one at a time: peak use stays
    within weights + max(1 GiB, largest tensor) + 5 %."""
    cache = wc.Cache(socket_dir, spawn=True)
    fp = wc.Fingerprint.create(checkpoint, device="cuda:0", extra={"test": "migrate"})
    torch.cuda.synchronize()
    base = used_gib()
    state = {f"w{i}": torch.full((64 << 20,), float(i), dtype=torch.bfloat16, device="cuda") for i in range(64)}
    weights = sum(t.numel() * t.element_size() for t in state.values()) / 2**30  # 8 GiB, 128 MiB tensors
    peak = [0.0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            peak[0] = max(peak[0], used_gib() - base)
            time.sleep(0.001)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        handle = cache.put(fp, state, consume=True)
    finally:
        stop.set()
        sampler.join()
    assert not state, "consume empties the source dict"
    bound = weights + max(1.0, 128 / 1024) + 0.05 * weights
    assert peak[0] <= bound, f"peak {peak[0]:.2f} GiB > bound {bound:.2f} GiB"
    assert float(handle.tensors["w63"][0]) == 63.0
    handle.close()
    print(f"publish peak {peak[0]:.2f} GiB for {weights:.2f} GiB of weights (bound {bound:.2f})")


def test_transformers_llama_greedy_generation_matches(tmp_path: Path, socket_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=512,
        hidden_size=128,
        intermediate_size=256,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(config).save_pretrained(tmp_path / "llama", safe_serialization=True)
    code = """
        import json, sys, torch, transformers, weightcache as wc
        mode, ckpt, sock = sys.argv[1:4]
        config = transformers.AutoConfig.from_pretrained(ckpt)
        with torch.device("meta"):
            model = transformers.LlamaForCausalLM(config)
        handle = wc.attach(model, ckpt, mode=mode, device="cuda:0", socket_dir=sock, strict=mode == "client")
        assert model.lm_head.weight is model.model.embed_tokens.weight
        model.eval()
        ids = torch.tensor([[1, 17, 42, 99, 7]], device="cuda:0")
        out = model.generate(ids, max_new_tokens=24, do_sample=False, pad_token_id=0)
        print(json.dumps({"source": handle.source, "tokens": out[0].tolist()}))
    """
    runs = {}
    for mode in ("off", "daemon", "client"):
        out = subprocess.run(
            [sys.executable, "-c", textwrap.dedent(code), mode, str(tmp_path / "llama"), str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr[-4000:]
        runs[mode] = json.loads(out.stdout.strip().splitlines()[-1])
    assert [runs[m]["source"] for m in ("off", "daemon", "client")] == ["disk", "cache", "cache"]
    assert runs["off"]["tokens"] == runs["daemon"]["tokens"] == runs["client"]["tokens"]
    assert len(runs["off"]["tokens"]) == 5 + 24


def rank_gpus() -> tuple[int, list[str]]:
    """One rank per visible GPU, and at least two: on one GPU two ranks share it. The GPUs as ``GPU-<uuid>``."""
    gpus = bench_ranks.visible_gpus("cuda:0")
    return max(2, len(gpus)), gpus


def test_ranks_start_together_each_on_their_gpu(tmp_path: Path, socket_dir: Path) -> None:
    """A tensor-parallel restart across every visible GPU (tests/ranks.py): rank r's process sees only GPU r mod G
    (CUDA_VISIBLE_DEVICES is its UUID), so every rank calls it cuda:0 and segments are told apart by UUID. The n
    ranks publish tp r/n together, then n fresh ones attach together through one keeper: each gets its own shard,
    bitwise, on its GPU."""
    n, gpus = rank_gpus()
    start_together(tmp_path, socket_dir, "cuda:0", n, gpus)


def test_ranks_on_gpus_get_their_shards_back_from_a_restarted_keeper(tmp_path: Path, socket_dir: Path) -> None:
    """The keeper SIGKILLed while n ranks (one per GPU, at least two) hold their VMM shards; a new keeper gets
    every shard back from its rank, and n new rank processes attach all of them from the cache, bitwise."""
    n, gpus = rank_gpus()
    survive_keeper_kill(tmp_path, socket_dir, "cuda:0", n, gpus)


def test_second_engine_adds_almost_no_gpu_memory(tmp_path: Path, socket_dir: Path) -> None:
    """Each engine process attaches the same entry; what its attach adds to the device's memory use (measured
    inside the process, after its CUDA context exists) is under 1 % of the weight bytes."""
    ckpt = make_checkpoint(tmp_path / "big", dim=1024, vocab=65536)  # ~300 MB of fp32 weights
    run_worker("attach", {"checkpoint": str(ckpt), "socket_dir": str(socket_dir), "device": "cuda:0", "mode": "daemon"})
    weights = wc.Cache(socket_dir).entries()[0].bytes
    code = f"""
        import json, torch, weightcache as wc
        from models import meta_model, model_kwargs
        torch.zeros(1, device="cuda:0"); torch.cuda.synchronize()
        free0, _ = torch.cuda.mem_get_info(0)
        m = meta_model(**model_kwargs({str(ckpt)!r}))
        h = wc.attach(m, {str(ckpt)!r}, mode="client", device="cuda:0", socket_dir={str(socket_dir)!r}, strict=True)
        torch.cuda.synchronize()
        free1, _ = torch.cuda.mem_get_info(0)
        print(json.dumps({{"added": free0 - free1}}))
    """
    first = python(code)
    second = python(code)
    for r in (first, second):
        assert r["added"] < 0.01 * weights, f"attach added {r['added']} bytes for {weights} bytes of weights"


def test_attach_load_and_an_adapter_publish_the_same_entry_on_gpu(checkpoint: Path, tmp_path: Path) -> None:
    """On a GPU the three publishers take three paths (attach and load stream the files into segments, the
    adapter packs the tensors of the model it loaded), and still record the same entry and per-tensor digests."""
    from models import TinyLM, meta_model, model_kwargs

    from weightcache import backends
    from weightcache.backends import LoaderOptions
    from weightcache.backends.torch import ModuleLoad

    dirs = {name: tmp_path / name for name in ("attach", "load", "adapter")}
    kw = model_kwargs(checkpoint)
    handles: dict[str, wc.Handle] = {}
    try:
        model = meta_model(**kw)
        model.positions = model.positions.to("cuda:0")  # a buffer the model computes, not the checkpoint's
        handles["attach"] = wc.attach(model, checkpoint, mode="daemon", device="cuda:0", socket_dir=dirs["attach"])
        load = ["load", str(checkpoint), "--device", "cuda:0", "--socket-dir", str(dirs["load"])]
        out = subprocess.run(
            [sys.executable, "-m", "weightcache", *load],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stdout + out.stderr
        loaded_by_cli = wc.Cache(dirs["load"]).get(handles["attach"].fingerprint)
        assert loaded_by_cli is not None
        handles["load"] = loaded_by_cli
        loaded = backends.get("torch").load_model(
            ModuleLoad(lambda: TinyLM(**kw), checkpoint, device=torch.device("cuda:0")),
            fingerprint=wc.Fingerprint.create(checkpoint, device="cuda:0"),
            device="cuda:0",
            options=LoaderOptions(mode="daemon", socket_dir=str(dirs["adapter"])),
        )
        assert loaded.handle is not None
        handles["adapter"] = loaded.handle
        assert len({h.digest for h in handles.values()}) == 1
        digests = {name: dict(zip(h.manifest.names, h.manifest.digest)) for name, h in handles.items()}  # type: ignore[union-attr]
        assert digests["attach"] == digests["load"] and None not in digests["attach"].values()
        shared = set(digests["attach"]) & set(digests["adapter"])
        assert len(shared) >= len(digests["attach"]) - 1  # the tied head is published under one of its names
        assert all(digests["attach"][n] == digests["adapter"][n] for n in shared)
        for handle in handles.values():
            handle.verify()
    finally:
        for handle in handles.values():
            handle.close()
        for directory in dirs.values():
            stop_keeper(directory)


def test_a_client_maps_through_ctypes_without_importing_cuda_bindings(checkpoint: Path, socket_dir: Path) -> None:
    """A restarted engine maps GPU segments through the ctypes declarations (weightcache/segments/cuda_import.py),
    never importing cuda-bindings; with WEIGHTCACHE_CUDA_DRIVER=bindings it maps through cuda-bindings, with
    WEIGHTCACHE_CUDA_MAP_THREADS=4 several segments at once: all see the published bits (read-only mappings
    through ctypes: test_clients_map_read_only)."""
    cache = wc.Cache(socket_dir, spawn=True)
    fp = wc.Fingerprint.create(checkpoint, device="cuda:0")
    g = torch.Generator(device="cuda").manual_seed(1)
    state = {f"w{i}": torch.randn(4096 + i, device="cuda", generator=g).to(torch.bfloat16) for i in range(40)}
    expected = sum(int(t.view(torch.int16).sum(dtype=torch.int64)) for t in state.values())
    code = f"""
        import json, sys, torch
        torch.zeros(1, device="cuda:0")
        import weightcache as wc
        from weightcache.segments import cuda_import
        fp = wc.Fingerprint.create({str(checkpoint)!r}, device="cuda:0")
        h = wc.Cache({str(socket_dir)!r}).get(fp)
        total = sum(int(t.view(torch.int16).sum(dtype=torch.int64)) for t in h.tensors.values())
        print(json.dumps({{"sum": total, "bindings": "cuda.bindings.driver" in sys.modules,
                          "ctypes": cuda_import.driver() is not None}}))
    """
    with cache.put(fp, state, digests=False, max_segment_bytes=64 << 10) as h:  # several segments
        assert h.manifest is not None and len(h.manifest.segments) > 3
        fast = python(code)
        slow = python(code, env={"WEIGHTCACHE_CUDA_DRIVER": "bindings"})
        threaded = python(code, env={"WEIGHTCACHE_CUDA_MAP_THREADS": "4"})
    assert fast["sum"] == slow["sum"] == threaded["sum"] == expected
    assert fast["ctypes"] is True and fast["bindings"] is False
    assert slow["ctypes"] is False and slow["bindings"] is True


def test_segments_are_created_rdma_capable_where_the_gpu_supports_it() -> None:
    """A segment's allocation carries ``allocFlags.gpuDirectRDMACapable`` exactly where the device reports
    GPUDirect RDMA with VMM (read back from the allocation by the driver), with the POSIX-fd handle type still
    requested, and it still exports, verifies and maps through its fd as engines map it.

    Read back from the creating handle: a handle imported from the fd reported ``allocFlags`` as 0 (and, in
    another process, the handle type as none), whatever the allocation was created with (seen on an H200, CUDA
    driver API 13.0, cuda-bindings 13.3.1)."""
    from cuda.bindings import driver as cu

    from weightcache.manifest import SegmentInfo
    from weightcache.segments.cuda_vmm import CudaVmmSegment, CudaVmmTransport, granularity, placement_of, rdma_capable

    torch.zeros(1, device="cuda:0")
    ok = cu.CUresult.CUDA_SUCCESS
    err, device = cu.cuDeviceGet(0)
    assert err == ok
    attribute = cu.CUdevice_attribute.CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WITH_CUDA_VMM_SUPPORTED
    err, supported = cu.cuDeviceGetAttribute(attribute, device)
    assert err == ok
    assert rdma_capable(0) is bool(supported)
    placement = placement_of(0)
    segment = CudaVmmSegment(3 << 20, placement)
    try:
        assert segment.rdma_capable is bool(supported)
        assert segment.size % granularity(0) == 0
        err, prop = cu.cuMemGetAllocationPropertiesFromHandle(segment._handle)
        assert err == ok
        assert prop.allocFlags.gpuDirectRDMACapable == int(bool(supported))
        posix_fd = cu.CUmemAllocationHandleType.CU_MEM_HANDLE_TYPE_POSIX_FILE_DESCRIPTOR
        assert prop.requestedHandleTypes == posix_fd
        data = torch.arange(4096, device="cuda:0").to(torch.uint8)
        segment.write(1 << 20, data)
        segment.seal()
        info = SegmentInfo("cuda_vmm", segment.size, placement)
        CudaVmmTransport.verify_fd(segment.fd, info)
        mapped, read_only = CudaVmmTransport().map_checked(segment.fd, info)
        assert read_only and torch.equal(mapped[1 << 20 : (1 << 20) + data.numel()], data)
        del mapped
    finally:
        segment.close()


def test_bench_real_checkpoint_holds_the_synthetic_entrys_bits_on_gpu(tmp_path: Path) -> None:
    """`bench --real-checkpoint` on a GPU: the safetensors file holds the synthetic entry's contents (made with the
    GPU's generator, whose bits differ from the CPU's), so every process of both variants sees the same bits and
    the row is `identical True` (the H200 run of 2026-12-01 reported False: the file was made on the CPU)."""
    report = tmp_path / "bench.json"
    args = ["--device", "cuda:0", "--sizes", "0.01", "--tensors", "30", "--repeat", "2", "--real-checkpoint"]
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "bench", *args, "--json", str(report)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stdout + out.stderr
    [row] = json.loads(report.read_text())["results"]
    assert row["real"]["identical"] is True and row["identical"] is True
    assert {run["checksum"] for run in row["real"]["runs"]} == {run["checksum"] for run in row["runs"]}


def test_gpu_digests_equal_the_host_bytes_digests_and_follow_the_callers_stream() -> None:
    """content_digest(s) of CUDA tensors (empty, one byte, a chunk's edges, several chunks, not dense, bf16, a
    transpose) equal the digests of the same tensors copied to the host (strides kept: bytes in memory order);
    and a tensor still being written on the caller's current stream when hashing starts is hashed as written
    (the copies wait for that stream, not only for the default one)."""
    import hashlib

    from weightcache.digests import CHUNK_BYTES, content_digest, content_digests

    def host_sha(t: torch.Tensor) -> str:
        return content_digest(t.detach().cpu())  # .cpu() keeps a dense tensor's strides (its memory order)

    g = torch.Generator(device="cuda:0").manual_seed(3)
    sizes = [0, 1, CHUNK_BYTES - 1, CHUNK_BYTES, CHUNK_BYTES + 1, 2 * CHUNK_BYTES + 5]
    tensors = [torch.randint(0, 256, (n,), dtype=torch.uint8, device="cuda:0", generator=g) for n in sizes]
    tensors.append(torch.randn(512, 768, device="cuda:0", generator=g).to(torch.bfloat16)[:, ::3])  # not dense
    tensors.append(torch.randn(1000, 3000, device="cuda:0", generator=g).t())  # a transpose: dense, other order
    expected = [host_sha(t) for t in tensors]
    assert [content_digest(t) for t in tensors] == expected
    assert content_digests(tensors) == expected

    side = torch.cuda.Stream()
    late = [torch.zeros(3 * CHUNK_BYTES, dtype=torch.uint8, device="cuda:0") for _ in range(4)]
    with torch.cuda.stream(side):
        torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU time before the writes below run on this stream
        for i, t in enumerate(late):
            t.fill_(i + 1)
        hashed = content_digests(late)
        single = content_digest(late[0])
    torch.cuda.synchronize()
    assert hashed == [host_sha(t) for t in late]
    assert single == hashed[0]
    assert hashed[0] != hashlib.sha256(bytes(3 * CHUNK_BYTES)).hexdigest()

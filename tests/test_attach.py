"""attach() end to end, with real keeper processes, real sockets and real shared memory."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch
from conftest import (
    Holder,
    keeper_pid,
    one_tensor_manifest,
    process_gone,
    run_worker,
    sealed_memfd,
    start_keeper,
    terminate_keeper,
    wait_until,
)
from models import INPUT_IDS, TinyLM, make_checkpoint, meta_model, reference_output
from worker import digest

import weightcache as wc
from weightcache.pipeline import MAX_REASON


def output_digest(model: torch.nn.Module) -> str:
    torch.set_num_threads(1)
    with torch.no_grad():
        return digest(model(INPUT_IDS))


def test_mode_off_loads_from_disk_without_a_keeper(checkpoint: Path, socket_dir: Path) -> None:
    model = meta_model()
    with wc.attach(model, checkpoint, mode="off", socket_dir=socket_dir) as handle:
        assert handle.source == "disk"
        assert isinstance(handle.fingerprint, wc.Fingerprint)
        with torch.no_grad():
            assert torch.equal(model(INPUT_IDS), reference_output(checkpoint))
    assert not socket_dir.exists(), "mode off must not involve a keeper"


def test_binding_keeps_parameters_buffers_and_ties(checkpoint: Path, socket_dir: Path) -> None:
    model = meta_model()
    with wc.attach(model, checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
        assert handle.source == "cache"
        assert model.head.weight is model.embed.weight
        assert isinstance(model.embed.weight, torch.nn.Parameter)
        assert isinstance(model.blocks[0].up.bias, torch.nn.Parameter)
        assert "scale" in model._buffers and "scale" not in model._parameters
        assert "positions" in model._non_persistent_buffers_set
        assert set(model.state_dict()) == set(TinyLM().state_dict())
        assert not any(t.is_meta for t in model.state_dict().values())


def test_client_in_other_process_is_bitwise_equal_to_disk(checkpoint: Path, socket_dir: Path) -> None:
    disk = run_worker("attach", {"checkpoint": str(checkpoint), "mode": "off"})
    daemon = run_worker("attach", {"checkpoint": str(checkpoint), "mode": "daemon", "socket_dir": str(socket_dir)})
    client = run_worker("attach", {"checkpoint": str(checkpoint), "mode": "client", "socket_dir": str(socket_dir)})
    assert disk["source"] == "disk" and daemon["source"] == "cache" and client["source"] == "cache"
    assert disk["output"] == daemon["output"] == client["output"]
    assert client["warnings"] == []
    assert disk["digest"] == daemon["digest"] == client["digest"]


def test_memory_is_shared_not_copied(tmp_path: Path, socket_dir: Path) -> None:
    """Two clients touch every page of the weights; smaps shows the pages shared, none private or anonymous,
    and the host's shared-memory total grows by one copy, not three."""
    ckpt = make_checkpoint(tmp_path / "big", dim=512, vocab=4096)  # ~25 MB of weights
    spec = {"checkpoint": str(ckpt), "socket_dir": str(socket_dir), "touch": True}
    shmem_before = _meminfo_kb("Shmem")
    publisher = Holder({**spec, "mode": "daemon"})
    a = Holder({**spec, "mode": "client"})
    b = Holder({**spec, "mode": "client"})
    try:
        shmem_after = _meminfo_kb("Shmem")
        entry = wc.Cache(socket_dir).entries()[0]
        size_kb = entry.bytes // 1024
        for holder in (a, b):
            smaps = holder.info["smaps"]
            assert holder.info["source"] == "cache"
            assert smaps["Rss"] >= 0.9 * size_kb
            shared = smaps.get("Shared_Clean", 0) + smaps.get("Shared_Dirty", 0)
            assert shared >= 0.9 * size_kb, str({k: v for k, v in smaps.items() if v})
            assert smaps["Pss"] <= 0.55 * smaps["Rss"]  # proportional share: at least two processes map it
            assert smaps.get("Private_Dirty", 0) == 0 and smaps.get("Anonymous", 0) == 0, smaps
        # one copy in shared memory (plus noise), not one per process
        assert shmem_after - shmem_before < 1.5 * size_kb + 8192
    finally:
        for h in (a, b, publisher):
            h.close()


def test_a_client_writing_its_weights_cannot_corrupt_others(checkpoint: Path, socket_dir: Path) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    writer = run_worker("attach", {**spec, "mode": "client", "write": True})
    assert writer["output_after_write"] != writer["output"]  # its own copy changed...
    reader = run_worker("attach", {**spec, "mode": "client"})
    assert reader["output"] == first["output"]  # ...nobody else's


def test_keeper_sigkill_leaves_attached_clients_computing(checkpoint: Path, socket_dir: Path) -> None:
    proc = start_keeper(socket_dir)
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    publisher = run_worker("attach", {**spec, "mode": "daemon"})
    holder = Holder({**spec, "mode": "client"})
    try:
        assert holder.info["source"] == "cache"
        proc.send_signal(signal.SIGKILL)
        proc.wait(10)
        for _ in range(3):
            after = holder.compute()
            assert after["output"] == publisher["output"]
        assert holder.proc.poll() is None
    finally:
        holder.close()


def test_publisher_exit_keeps_entry_for_later_clients(checkpoint: Path, socket_dir: Path) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    first = run_worker("attach", {**spec, "mode": "daemon"})  # process exits: keeper keeps the fds
    again = run_worker("attach", {**spec, "mode": "client", "strict": True})
    assert again["source"] == "cache" and again["output"] == first["output"]


def test_client_without_keeper_falls_back_with_reason(checkpoint: Path, socket_dir: Path) -> None:
    model = meta_model()
    with pytest.warns(wc.FallbackWarning, match="no keeper"):
        handle = wc.attach(model, checkpoint, mode="client", socket_dir=socket_dir)
    assert handle.source == "disk" and "no keeper" in (handle.fallback_reason or "")
    assert output_digest(model) == digest(reference_output(checkpoint))
    with pytest.raises(wc.KeeperUnavailable):
        wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir, strict=True)


def test_client_without_entry_falls_back_or_raises(checkpoint: Path, socket_dir: Path, keeper: object) -> None:
    with pytest.warns(wc.FallbackWarning, match="holds no entry"):
        handle = wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir)
    assert handle.source == "disk"
    with pytest.raises(wc.EntryNotFound, match="holds no entry"):
        wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir, strict=True)


def test_dtype_mismatch_names_the_field(checkpoint: Path, socket_dir: Path) -> None:
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir):
        pass
    model = meta_model().to(torch.bfloat16)
    model.positions = torch.arange(16)
    with pytest.warns(wc.FallbackWarning, match=r"dtype: requested 'bfloat16', cached None"):
        handle = wc.attach(model, checkpoint, mode="client", dtype=torch.bfloat16, socket_dir=socket_dir)
    assert handle.source == "disk" and model.embed.weight.dtype == torch.bfloat16
    with pytest.raises(wc.FingerprintMismatch, match="dtype") as info:
        wc.attach(model, checkpoint, mode="client", dtype="bfloat16", socket_dir=socket_dir, strict=True)
    assert ("dtype", "bfloat16", None) in info.value.differences


def test_a_copied_checkpoint_misses_and_the_reason_names_the_copy(tmp_path: Path, socket_dir: Path) -> None:
    """A checkpoint copied elsewhere is another checkpoint (its path, inodes and times are in the fingerprint):
    the miss says where the cached one is and what differs, in one line."""
    original = make_checkpoint(tmp_path / "original", seed=0)
    with wc.attach(meta_model(), original, mode="daemon", socket_dir=socket_dir) as first:
        cached = first.fingerprint.digest
    copy = tmp_path / "copy"
    copy.mkdir()
    for file in original.iterdir():
        (copy / file.name).write_bytes(file.read_bytes())
    with pytest.warns(wc.FallbackWarning) as caught:
        handle = wc.attach(meta_model(), copy, mode="client", socket_dir=socket_dir)
    reason = handle.fallback_reason or ""
    assert handle.source == "disk" and reason in str(caught[0].message)
    assert f"holds no entry for {copy}" in reason and f"its entry {cached[:12]} holds" in reason
    assert f"same headers at {original}" in reason and "(differences: model_path, checkpoint[" in reason
    assert ".inode" in reason and "\n" not in reason and len(reason) <= MAX_REASON
    with pytest.raises(wc.FingerprintMismatch, match="path, inodes and file times") as info:
        wc.attach(meta_model(), copy, mode="client", socket_dir=socket_dir, strict=True)
    assert ("model_path", str(copy), str(original)) in info.value.differences


def test_relative_weightcache_dir_is_refused_with_the_absolute_one(tmp_path: Path, checkpoint: Path) -> None:
    """Each process would resolve a relative $WEIGHTCACHE_DIR against its own working directory (and find another
    keeper): it is refused, naming the absolute path to export instead, by the library and the command alike."""
    env = {**os.environ, "WEIGHTCACHE_DIR": "cache-dir", "PYTHONPATH": str(Path(__file__).parents[1])}
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "ls"], cwd=tmp_path, env=env, capture_output=True, text=True
    )
    assert out.returncode == 1 and out.stdout == ""
    assert "relative path" in out.stderr and f"export WEIGHTCACHE_DIR={tmp_path / 'cache-dir'}" in out.stderr
    code = "import weightcache as wc; wc.Cache(spawn=True)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    assert out.returncode == 1 and "SocketDirError" in out.stderr and "is a relative path" in out.stderr
    assert not (tmp_path / "cache-dir").exists()


def test_rewritten_checkpoint_is_never_served(tmp_path: Path, socket_dir: Path) -> None:
    """Same shapes, other values, mtime put back: the fingerprint still changes (ctime, inode)."""
    ckpt = make_checkpoint(tmp_path / "ckpt", seed=0)
    file = ckpt / "model.safetensors"
    with wc.attach(meta_model(), ckpt, mode="daemon", socket_dir=socket_dir) as first:
        old_digest = first.fingerprint.digest
    st = os.stat(file)
    size = st.st_size
    make_checkpoint(tmp_path / "ckpt", seed=1)  # rewrite in place
    os.utime(file, ns=(st.st_atime_ns, st.st_mtime_ns))
    assert os.stat(file).st_size == size
    model = meta_model()
    with pytest.warns(wc.FallbackWarning, match="does not match"):
        handle = wc.attach(model, ckpt, mode="client", socket_dir=socket_dir)
    assert handle.source == "disk" and handle.fingerprint.digest != old_digest
    assert output_digest(model) == digest(reference_output(ckpt))
    with pytest.raises(wc.FingerprintMismatch, match="checkpoint"):
        wc.attach(meta_model(), ckpt, mode="client", socket_dir=socket_dir, strict=True)


@pytest.mark.parametrize("method", ["fp8_per_tensor", "marlin", "awq", "gptq"])
@pytest.mark.parametrize("mode", ["daemon", "client"])
def test_refused_quant_methods_raise_before_loading(checkpoint: Path, socket_dir: Path, method: str, mode: str) -> None:
    model = meta_model()
    with pytest.raises(wc.UnsupportedQuantError, match=method) as info:
        wc.attach(model, checkpoint, mode=mode, quant=method, socket_dir=socket_dir)  # type: ignore[arg-type]
    assert wc.quant.get(method).reason in str(info.value)
    assert model.embed.weight.is_meta, "nothing may be loaded for a refused method"
    assert not socket_dir.exists(), "no keeper may be started for a refused method"


def test_fp8_block_is_accepted(checkpoint: Path, socket_dir: Path) -> None:
    cfg = {"weight_block_size": [128, 128]}
    with wc.attach(
        meta_model(), checkpoint, mode="daemon", quant="fp8_block", quant_config=cfg, socket_dir=socket_dir
    ) as h:
        assert h.source == "cache" and h.fingerprint.quant == "fp8_block"
    with pytest.raises(wc.UnsupportedQuantError, match="weight_block_size"):
        wc.attach(meta_model(), checkpoint, mode="daemon", quant="fp8_block", quant_config={}, socket_dir=socket_dir)


def test_concurrent_clients(checkpoint: Path, socket_dir: Path) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir)}
    first = run_worker("attach", {**spec, "mode": "daemon"})
    with ThreadPoolExecutor(8) as pool:
        results = list(pool.map(lambda _: run_worker("attach", {**spec, "mode": "client", "strict": True}), range(8)))
    assert {r["source"] for r in results} == {"cache"}
    assert {r["output"] for r in results} == {first["output"]}
    assert len({r["pid"] for r in results}) == 8


def test_racing_daemons_publish_once(checkpoint: Path, socket_dir: Path, tmp_path: Path) -> None:
    """Six engines miss at the same instant in mode daemon, with no keeper running: one keeper, one entry,
    identical outputs, and one read of the checkpoint (the others wait for that load and attach its copy)."""
    barrier = tmp_path / "barrier"
    barrier.mkdir()
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "mode": "daemon"}
    spec |= {"barrier": str(barrier), "barrier_count": 6}  # all six attach at once, whenever their imports end
    with ThreadPoolExecutor(6) as pool:
        results = list(pool.map(lambda _: run_worker("attach", spec), range(6)))
    assert {r["source"] for r in results} == {"cache"}
    assert len({r["output"] for r in results}) == 1
    assert len(wc.Cache(socket_dir).entries()) == 1
    assert sorted(r["read_disk"] for r in results) == [False] * 5 + [True], results
    assert not list(socket_dir.glob("load-*.lock"))  # the lock files go with their loads
    # an entry that appeared while an engine waited for that load was not resident before its start (an engine
    # sizing its KV cache from memory sampled before loading must not count it as preloaded:
    # Loaded.preloaded_bytes); only one that found it at its first look (a plain "hit") had it resident before
    waited = [r for r in results if "hit, after another engine's load" in (r["start_line"] or "")]
    assert waited and not any(r["resident_before"] for r in waited), results
    for r in results:
        plain_hit = (r["start_line"] or "").startswith("weightcache: hit (mode")
        assert r["resident_before"] == plain_hit, (r["start_line"], r["resident_before"], r["read_disk"])
    later = run_worker("attach", {**spec, "barrier": None})
    assert (later["source"], later["read_disk"], later["resident_before"]) == ("cache", False, True), later


def test_leases_follow_handles(checkpoint: Path, socket_dir: Path) -> None:
    handle = wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir)
    cache = wc.Cache(socket_dir)
    assert cache.entries()[0].leases == 1
    assert cache.entries()[0].holders[0][0] == os.getpid()
    with wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir):
        assert cache.entries()[0].leases == 2
    handle.close()
    assert wait_until(lambda: cache.entries()[0].leases == 0)  # the keeper notices closed connections async


def test_sharded_checkpoint_with_index(tmp_path: Path, socket_dir: Path) -> None:
    ckpt = make_checkpoint(tmp_path / "sharded", shards=3)
    assert len(list(ckpt.glob("*.safetensors"))) == 3
    model = meta_model()
    with wc.attach(model, ckpt, mode="daemon", socket_dir=socket_dir) as h:
        assert len(h.fingerprint.checkpoint) == 3
        assert output_digest(model) == digest(reference_output(ckpt))


def test_dtype_conversion_and_transform(checkpoint: Path, socket_dir: Path) -> None:
    def double_scale(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        state["scale"] = state["scale"] * 2
        return state

    model = meta_model().to(torch.bfloat16)
    model.positions = torch.arange(16)
    with wc.attach(
        model, checkpoint, mode="daemon", dtype=torch.bfloat16, transform=double_scale, socket_dir=socket_dir
    ) as h:
        assert ".double_scale#" in h.fingerprint.transform
        assert model.embed.weight.dtype == torch.bfloat16
        assert model.positions.dtype == torch.int64
    again = meta_model().to(torch.bfloat16)
    again.positions = torch.arange(16)
    with wc.attach(
        again,
        checkpoint,
        mode="client",
        dtype=torch.bfloat16,
        transform=double_scale,
        socket_dir=socket_dir,
        strict=True,
    ) as h2:
        assert h2.source == "cache"
        assert torch.equal(again.scale, model.scale)
    ref = wc.attach(meta_model(), checkpoint, mode="off")
    assert torch.equal(model.scale, (ref.tensors["scale"] * 2).to(torch.bfloat16))


def test_bad_mode_and_bad_model(checkpoint: Path, socket_dir: Path) -> None:
    with pytest.raises(wc.InvalidArgument, match="mode must be one of"):
        wc.attach(meta_model(), checkpoint, mode="sometimes")  # type: ignore[arg-type]
    # found before anything is read: a checkpoint that is not there is not the first problem
    with pytest.raises(wc.InvalidArgument, match="did you mean 'daemon'"):
        wc.attach(meta_model(), checkpoint.parent / "not-there", mode="deamon")  # type: ignore[arg-type]
    with pytest.raises(wc.BindError, match="shape"):
        wc.attach(meta_model(dim=32), checkpoint, mode="off")


def test_a_device_this_process_lacks_is_one_clear_error_in_every_mode(checkpoint: Path, socket_dir: Path) -> None:
    """A CUDA device that torch cannot give (a CPU build: any; else one index past the last GPU) and a device that
    is no device at all are a WeightCacheError naming the device and what to do, in every mode and before anything
    else happens: no keeper spawned, nothing read. (Falling back to disk would not help: the disk load needs the
    device too.)"""
    missing = f"cuda:{torch.cuda.device_count()}"
    for mode in ("off", "daemon", "client"):
        with pytest.raises(wc.InvalidArgument, match=rf"device '{missing}'.*device 'cpu'") as info:
            wc.attach(meta_model(), checkpoint, mode=mode, device=missing, socket_dir=socket_dir)
        assert isinstance(info.value, ValueError)
        with pytest.raises(wc.InvalidArgument, match=r"device 'gpu' .*expected 'cpu' or 'cuda:N'"):
            wc.attach(meta_model(), checkpoint, mode=mode, device="gpu", socket_dir=socket_dir)
    with pytest.raises(wc.InvalidArgument, match=rf"device '{missing}'"):
        wc.preload(checkpoint, device=missing, socket_dir=socket_dir)
    with pytest.raises(wc.InvalidArgument, match=rf"device '{missing}'"):
        wc.Fingerprint.create(checkpoint, device=missing)
    assert not socket_dir.exists()  # no keeper was started for it


def keep_all(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A transform: the fit of its output is known only once the checkpoint is loaded."""
    return state


def test_daemon_refuses_a_model_that_does_not_fit_before_it_publishes(checkpoint: Path, socket_dir: Path) -> None:
    """Mode daemon checks the model against the checkpoint's layout first: a model that cannot take these weights
    is a BindError with no keeper started and nothing published (not a wrong-fit entry left behind)."""
    with pytest.raises(wc.BindError, match="shape"):
        wc.attach(meta_model(dim=32), checkpoint, mode="daemon", socket_dir=socket_dir)
    assert keeper_pid(socket_dir) is None and not (socket_dir / "keeper.sock").exists()
    keeper = start_keeper(socket_dir)
    try:
        for transform in (None, keep_all):  # known from the headers; known only after the load
            with pytest.raises(wc.BindError, match="shape"):
                wc.attach(meta_model(dim=32), checkpoint, mode="daemon", socket_dir=socket_dir, transform=transform)
            assert wc.Cache(socket_dir).entries() == []
        with pytest.raises(wc.BindError, match=r"dtype torch.bfloat16 vs model torch.float32"):  # converted dtype
            wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir, dtype="bfloat16")
        assert wc.Cache(socket_dir).entries() == []
        with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir) as handle:  # one that fits
            assert handle.source == "cache" and len(wc.Cache(socket_dir).entries()) == 1
    finally:
        terminate_keeper(keeper)


def test_keeper_pid_is_recorded(checkpoint: Path, socket_dir: Path) -> None:
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir):
        pass
    pid = keeper_pid(socket_dir)
    assert pid and wc.Cache(socket_dir).keeper_info()["pid"] == pid
    # the spawned keeper is detached: not our child, its own session
    assert os.getsid(pid) == pid
    out = subprocess.run(["ps", "-o", "ppid=", "-p", str(pid)], capture_output=True, text=True)
    assert out.stdout.strip() != str(os.getpid())


def _meminfo_kb(key: str) -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1])
    raise KeyError(key)


def test_after_keeper_sigkill_daemon_mode_starts_a_fresh_keeper(checkpoint: Path, socket_dir: Path) -> None:
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir):
        pass
    old = keeper_pid(socket_dir)
    assert old
    os.kill(old, signal.SIGKILL)
    assert wait_until(lambda: process_gone(old))
    assert (socket_dir / "keeper.sock").exists()  # left behind: stale
    with pytest.warns(wc.FallbackWarning, match="stale socket"):
        wc.attach(meta_model(), checkpoint, mode="client", socket_dir=socket_dir)
    model = meta_model()
    with wc.attach(model, checkpoint, mode="daemon", socket_dir=socket_dir) as handle:
        assert handle.source == "cache"
        assert output_digest(model) == digest(reference_output(checkpoint))
    new = keeper_pid(socket_dir)
    assert new and new != old


def test_client_falls_back_from_a_broken_entry(checkpoint: Path, socket_dir: Path, keeper: object) -> None:
    """A same-user peer publishes an entry under the right fingerprint whose manifest does not fit its
    segment: client mode must load from disk with a warning, not crash."""
    from weightcache.client import KeeperConnection

    fp = wc.Fingerprint.create(checkpoint)
    fd = sealed_memfd(1024)
    manifest = one_tensor_manifest(fp.to_json(), size=1024, name="embed.weight", kind="parameter", requires_grad=True)
    with KeeperConnection.connect(socket_dir) as conn:
        conn.request({"op": "publish", "manifest": manifest}, [fd])
    os.close(fd)
    model = meta_model()
    with pytest.raises(wc.BindError):  # binding a wrong entry is a hard error, never silent
        wc.attach(model, checkpoint, mode="client", socket_dir=socket_dir)
    assert model.embed.weight.is_meta


def test_daemon_over_budget_runs_from_disk_or_raises(checkpoint: Path, socket_dir: Path) -> None:
    """A keeper whose memory budget cannot hold the weights: mode daemon warns and runs on its own copy (the
    same output), publishes nothing, and the keeper keeps serving; with strict=True it raises."""
    proc = start_keeper(socket_dir, "--max-bytes", "4K")
    try:
        model = meta_model()
        with pytest.warns(wc.FallbackWarning, match=r"publishing the loaded weights failed \(BudgetExceeded.*budget"):
            handle = wc.attach(model, checkpoint, mode="daemon", socket_dir=socket_dir)
        assert handle.source == "disk" and "--max-bytes" in (handle.fallback_reason or "")
        assert output_digest(model) == digest(reference_output(checkpoint))
        assert wc.Cache(socket_dir).entries() == []
        with pytest.raises(wc.BudgetExceeded, match="budget"):
            wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir, strict=True)
        assert proc.poll() is None and wc.Cache(socket_dir).entries() == []
    finally:
        proc.terminate()
        proc.wait(10)


#: A restarted engine's first attach, in a fresh process: what it imported, and whether the collector ran.
FIRST_ATTACH = r"""
import gc, json, sys
import torch
from models import meta_model
model = meta_model()
before = set(sys.modules)
import weightcache as wc
attach = wc.attach
collections = []
if len(sys.argv) > 3:  # a collection at (nearly) every allocation: any made with the collector running shows
    gc.set_threshold(1, 1, 1)
gc.callbacks.append(lambda phase, info: phase == "start" and collections.append(info["generation"]))
handle = attach(model, sys.argv[1], mode="client", socket_dir=sys.argv[2], strict=True)
gc.callbacks.clear()
gc.set_threshold(700, 10, 10)
assert handle.source == "cache"
heavy = ("filelock", "cuda.bindings", "safetensors", "weightcache.loader", "weightcache.publish",
         "weightcache.digests", "weightcache.standby")
new = set(sys.modules) - before
# a heavy module or one of its submodules (weightcache.loaders, the light registry of framework loaders, is not
# weightcache.loader)
print(json.dumps({"imported": sorted(m for m in new if m in heavy or m.startswith(tuple(h + "." for h in heavy))),
                  "collections": collections,
                  "gc_enabled": gc.isenabled()}))
"""


def test_a_restarted_engine_attaches_without_importing_what_only_loading_needs(
    checkpoint: Path, socket_dir: Path
) -> None:
    """The restart path imports neither filelock (spawning a keeper), the CUDA bindings (CPU), safetensors nor
    the loading, packing and hashing modules, and no full garbage collection (the one a fresh interpreter owes
    for torch's import, tens of ms) runs inside the attach; the collector is enabled again afterwards."""
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir):
        pass
    here = Path(__file__).parent
    out = subprocess.run(
        [sys.executable, "-c", FIRST_ATTACH, str(checkpoint), str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])},
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["imported"] == [] and report["gc_enabled"] is True
    assert 2 not in report["collections"], report["collections"]


@pytest.mark.parametrize("bytecode", ["cached", "not written"])
def test_an_attach_from_the_cache_allocates_nothing_with_the_collector_running(
    checkpoint: Path, socket_dir: Path, bytecode: str
) -> None:
    """A fresh process owes the collector a full pass over torch's import-time objects; whichever allocation
    comes next while the collector runs pays it. An attach from the cache makes none such, from its first line
    to its return, with or without cached bytecode (without, the modules the first attach imports are compiled
    inside it): with the thresholds at 1, any allocation made with the collector running would collect."""
    with wc.attach(meta_model(), checkpoint, mode="daemon", socket_dir=socket_dir):
        pass
    here = Path(__file__).parent
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(here), os.environ.get("PYTHONPATH", "")])}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    if bytecode == "not written":
        env["PYTHONDONTWRITEBYTECODE"] = "1"
    out = subprocess.run(
        [sys.executable, "-c", FIRST_ATTACH, str(checkpoint), str(socket_dir), "collect-at-every-allocation"],
        capture_output=True,
        text=True,
        timeout=120,
        env=env,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report["collections"] == [] and report["gc_enabled"] is True

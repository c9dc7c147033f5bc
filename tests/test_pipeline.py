"""The one mode engine (weightcache.pipeline) as every entry point meets it: attach, `weightcache load`
(weightcache.preload), the backend template (the torch adapter and the custom-adapter example).

The engine adapters' own runs of the same cases are in tests/backends/ (make test-engines).
"""

from __future__ import annotations

import ast
import json
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from conftest import run_worker, start_keeper, stop_keeper, terminate_keeper
from models import INPUT_IDS, TinyLM, meta_model, model_kwargs, reference_output

import weightcache as wc
from weightcache import backends
from weightcache.backends import LoaderOptions
from weightcache.backends.torch import ModuleLoad
from weightcache.pipeline import MODES, check_mode
from weightcache.publish import pack_state

ROOT = Path(__file__).resolve().parents[1]


def test_attach_daemon_serves_the_loaded_weights_when_the_budget_refuses_them(
    checkpoint: Path, socket_dir: Path
) -> None:
    keeper = start_keeper(socket_dir, "--max-bytes", "4K")
    try:
        model = meta_model(**model_kwargs(checkpoint))
        with pytest.warns(wc.FallbackWarning, match=r"publishing the loaded weights failed \(BudgetExceeded"):
            handle = wc.attach(model, checkpoint, mode="daemon", socket_dir=socket_dir)
        assert handle.source == "disk" and handle.read_disk and "BudgetExceeded" in (handle.fallback_reason or "")
        assert not handle.leased and handle.manifest is None
        with torch.no_grad():
            assert torch.equal(model(INPUT_IDS), reference_output(checkpoint))
        assert wc.Cache(socket_dir).entries() == []
        with pytest.raises(wc.BudgetExceeded):
            wc.attach(
                meta_model(**model_kwargs(checkpoint)), checkpoint, mode="daemon", socket_dir=socket_dir, strict=True
            )
    finally:
        terminate_keeper(keeper)


def test_attach_daemon_serves_the_loaded_weights_when_segments_cannot_be_allocated(
    checkpoint: Path, socket_dir: Path
) -> None:
    spec = {"checkpoint": str(checkpoint), "socket_dir": str(socket_dir), "mode": "daemon", "fsize_limit": 4096}
    result = run_worker("attach", spec)
    assert result["source"] == "disk" and result["read_disk"]
    assert len(result["warnings"]) == 1 and "SegmentError" in result["warnings"][0], result
    assert result["output"] == run_worker("attach", {**spec, "mode": "off", "fsize_limit": 0})["output"]
    assert wc.Cache(socket_dir).entries() == []  # the keeper was started (spawned while loading), holds nothing
    strict = run_worker("attach", {**spec, "strict": True})
    assert strict["error"] == "SegmentError"


PARTIAL_PACK = """
import resource, sys, torch
from weightcache.fingerprint import Fingerprint
from weightcache.pipeline import MODES, check_mode
from weightcache.publish import pack_state
torch.manual_seed(0)
state = {f"t{i}": torch.randn(n) for i, n in enumerate([1024, 1024, 1 << 16, 1024])}
originals = {k: v.clone() for k, v in state.items()}
fp = Fingerprint.create(sys.argv[1], device="cpu")
# one tensor per segment; the third segment (256 KiB) cannot grow past RLIMIT_FSIZE, the first two can
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 16, resource.RLIM_INFINITY))
try:
    pack_state(fp, state, consume=True, max_segment_bytes=4096)
except Exception as exc:
    print(type(exc).__name__)
print(sorted(state) == sorted(originals), all(torch.equal(state[k], originals[k]) for k in originals))
"""


def test_a_pack_that_fails_part_way_puts_the_moved_tensors_back(checkpoint: Path) -> None:
    out = subprocess.run([sys.executable, "-c", PARTIAL_PACK, str(checkpoint)], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["SegmentError", "True", "True"]


def test_consume_releases_each_tensor_once_packed(checkpoint: Path) -> None:
    state = {f"t{i}": torch.randn(256) for i in range(4)}
    packed = pack_state(wc.Fingerprint.create(checkpoint, device="cpu"), state, consume=True, max_segment_bytes=1024)
    try:
        assert state == {} and len(packed.segments) == 4
        assert all(d is not None for d in packed.manifest.digest)
    finally:
        packed.close()


@pytest.mark.parametrize("after_sealing", [False, True])
def test_digests_are_the_tensors_digests_as_copied_or_from_the_sealed_segments(
    checkpoint: Path, after_sealing: bool
) -> None:
    """Digests taken as each tensor is copied (host memory) or from the sealed segments once all are filled,
    largest first (GPU segments; run here on memfds) are each tensor's own (content_digest of the original, in
    its memory order), whatever its segment, shape, strides or dtype, with consume taking the originals away
    segment by segment, in the state dict's order."""
    from weightcache.digests import content_digest
    from weightcache.publish import _digest_sealed

    torch.manual_seed(1)
    base = torch.randn(64, 48)
    state = {
        "small": torch.arange(7, dtype=torch.int16),
        "empty": torch.empty(0, 3),
        "big": torch.randn(3000),
        "transposed": base.t(),  # dense in another order: stored as is, hashed in memory order
        "strided": base[:, ::2],  # not dense: stored contiguous
        "half": torch.randn(33, 5).to(torch.bfloat16),
        "scalar": torch.tensor(2.5),
    }
    expected = {name: content_digest(t) for name, t in state.items()}
    fp = wc.Fingerprint.create(checkpoint, device="cpu")
    packed = pack_state(fp, state, digests=not after_sealing, consume=True, max_segment_bytes=4096)
    try:
        if after_sealing:
            assert set(packed.manifest.digest) == {None}
            bytes_hashed: list[int] = []
            _digest_sealed(packed, bytes_hashed.append)
            assert sum(bytes_hashed) == sum(t.numel() * t.element_size() for t in packed.local_tensors().values())
        assert state == {} and len(packed.segments) >= 4
        manifest = packed.manifest
        assert dict(zip(manifest.names, manifest.digest)) == expected
        views = packed.local_tensors()
        assert torch.equal(views["transposed"], base.t()) and torch.equal(views["strided"], base[:, ::2])
    finally:
        packed.close()


def test_the_custom_adapter_serves_the_loaded_weights_when_the_budget_refuses_them(
    tmp_path: Path, socket_dir: Path
) -> None:
    # The example runs in processes of its own: importing it here would register its adapter in this one.
    example = ROOT / "examples" / "custom_adapter.py"
    checkpoint = tmp_path / "toy"
    code = (
        f"import sys; sys.path.insert(0, {str(example.parent)!r}); import custom_adapter as c; "
        "c.make_checkpoint(c.Path(sys.argv[1]))"
    )
    subprocess.run([sys.executable, "-c", code, str(checkpoint)], check=True, timeout=120)
    serve = [sys.executable, str(example), "--serve", str(checkpoint)]
    disk = subprocess.run([*serve, "client", str(tmp_path / "no-keeper")], capture_output=True, text=True, timeout=300)
    reference = json.loads(disk.stdout)  # no keeper: the engine's own disk load
    keeper = start_keeper(socket_dir, "--max-bytes", "4K")
    try:
        out = subprocess.run(
            [sys.executable, str(example), "--serve", str(checkpoint), "daemon", str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert out.returncode == 0, out.stderr
        result = json.loads(out.stdout)
        assert result["source"] == "disk" and result["output"] == reference["output"]
        assert "FallbackWarning" in out.stderr and "BudgetExceeded" in out.stderr
        assert wc.Cache(socket_dir).entries() == []
    finally:
        terminate_keeper(keeper)


def entry_digests(handle: wc.Handle) -> list[tuple[str, str | None]]:
    assert handle.manifest is not None
    return list(zip(handle.manifest.names, handle.manifest.digest))


def test_attach_load_and_an_adapter_publish_the_same_entry(checkpoint: Path, tmp_path: Path) -> None:
    """The same weights published three ways: same entry digest, same per-tensor digests, same verify()."""
    dirs = {name: tmp_path / name for name in ("attach", "load", "adapter")}
    handles: dict[str, wc.Handle] = {}
    try:
        handles["attach"] = wc.attach(
            meta_model(**model_kwargs(checkpoint)), checkpoint, mode="daemon", socket_dir=dirs["attach"]
        )
        out = subprocess.run(
            [sys.executable, "-m", "weightcache", "load", str(checkpoint), "--socket-dir", str(dirs["load"])],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert out.returncode == 0 and out.stdout.startswith("published "), out.stdout + out.stderr
        handles["load"] = wc.Cache(dirs["load"]).get(handles["attach"].fingerprint)  # type: ignore[assignment]
        kw = model_kwargs(checkpoint)
        loaded = backends.get("torch").load_model(
            ModuleLoad(lambda: TinyLM(**kw), checkpoint),
            fingerprint=wc.Fingerprint.create(checkpoint, device="cpu"),
            device="cpu",
            options=LoaderOptions(mode="daemon", socket_dir=str(dirs["adapter"])),
        )
        assert loaded.handle is not None
        handles["adapter"] = loaded.handle
        digests = {name: h.digest for name, h in handles.items()}
        assert len(set(digests.values())) == 1, digests
        # The adapter publishes every tensor of the model it loaded, computed buffers included; attach and load
        # publish the checkpoint's. Every tensor they share has the same digest, and every digest is recorded.
        by_name = {name: dict(entry_digests(h)) for name, h in handles.items()}
        assert by_name["attach"] == by_name["load"]
        assert all(d is not None for names in by_name.values() for d in names.values())
        shared = set(by_name["attach"]) & set(by_name["adapter"])
        assert len(shared) >= len(by_name["attach"]) - 1  # the tied head is published under one of its names
        assert all(by_name["attach"][n] == by_name["adapter"][n] for n in shared)
        for handle in handles.values():
            handle.verify()
            name = handle.manifest.names[0]  # type: ignore[union-attr]
            with torch.no_grad():
                handle.tensors[name].view(-1)[0] += 1  # this process's private page of the shared mapping
            with pytest.raises(wc.WeightCacheError, match=f"1 tensors differ from what was published: {name}"):
                handle.verify()
    finally:
        for handle in handles.values():
            handle.close()
        for directory in dirs.values():
            stop_keeper(directory)


def test_preload_is_mode_daemon_without_a_model(checkpoint: Path, socket_dir: Path) -> None:
    first = wc.preload(checkpoint, socket_dir=socket_dir)
    assert first.source == "cache" and first.read_disk
    first.close()
    again = wc.preload(checkpoint, socket_dir=socket_dir)  # already cached: nothing read
    assert again.source == "cache" and not again.read_disk and again.digest == first.digest
    again.close()
    model = meta_model(**model_kwargs(checkpoint))
    with wc.attach(model, checkpoint, mode="client", socket_dir=socket_dir, strict=True) as handle:
        assert handle.digest == first.digest and not handle.read_disk
        with torch.no_grad():
            assert torch.equal(model(INPUT_IDS), reference_output(checkpoint))


def test_each_start_logs_one_line(checkpoint: Path, socket_dir: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level("INFO", logger="weightcache")
    wc.attach(meta_model(**model_kwargs(checkpoint)), checkpoint, mode="daemon", socket_dir=socket_dir).close()
    wc.attach(meta_model(**model_kwargs(checkpoint)), checkpoint, mode="client", socket_dir=socket_dir).close()
    lines = [r.getMessage() for r in caplog.records if r.name == "weightcache"]
    assert len(lines) == 2, lines
    assert lines[0].startswith("weightcache: miss, published (mode daemon)") and " MiB in " in lines[0]
    # where the miss's time went: the disk load, the copies into segments with their digests, the publish
    assert re.search(r" ms \(load \d+ ms, pack and digests \d+ ms, publish \d+ ms\)$", lines[0]), lines[0]
    assert lines[1].startswith("weightcache: hit (mode client)")


def test_a_bad_mode_names_the_modes(checkpoint: Path) -> None:
    """A misspelled mode is a WeightCacheError (a ValueError too) that names the modes and the likely one."""
    expected = "mode must be one of off, daemon, client; found 'deamon' (did you mean 'daemon'?)"
    with pytest.raises(wc.InvalidArgument, match=re.escape(expected)) as info:
        wc.attach(meta_model(**model_kwargs(checkpoint)), checkpoint, mode="deamon")  # type: ignore[arg-type]
    assert isinstance(info.value, ValueError)
    with pytest.raises(wc.InvalidArgument, match=r"found 'sometimes'$"):  # nothing close: no guess
        check_mode("sometimes")


def test_no_module_but_the_pipeline_decides_modes_or_warns_of_fallbacks() -> None:
    """Deciding a mode (comparing a mode with "off", "daemon" or "client") and warning of a fallback (a warning of
    category FallbackWarning) happen in weightcache/pipeline.py alone; no example warns of a fallback either."""
    offenders = []
    for path in [*(ROOT / "weightcache").rglob("*.py"), *(ROOT / "examples").glob("*.py")]:
        if path.name == "pipeline.py" and path.parent.name == "weightcache":
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", "")) == "warn":
                arguments = [*node.args, *(k.value for k in node.keywords)]
                if any(getattr(a, "id", getattr(a, "attr", None)) == "FallbackWarning" for a in arguments):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} warns of a fallback")
            if isinstance(node, ast.Compare):
                values = [node.left, *node.comparators]
                names_a_mode = any("mode" in ast.unparse(v) for v in values if not isinstance(v, ast.Constant))
                in_library = path.is_relative_to(ROOT / "weightcache")  # examples may pick a mode's options
                if (
                    in_library
                    and names_a_mode
                    and any(isinstance(v, ast.Constant) and v.value in MODES for v in values)
                ):
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} decides a mode")
    assert offenders == []


def test_gpu_segments_are_large_when_the_weights_come_from_host_memory() -> None:
    """Migrating weights that sit on the GPU keeps segments at 1 GiB (the spare memory it needs); weights from
    host memory need none, so they get 16 GiB segments: fewer imports and mappings per attach."""
    from weightcache.publish import STREAM_SEGMENT_BYTES, default_segment_bytes

    sizes = [1 << 28] * 256  # 64 GiB
    assert default_segment_bytes("GPU-x", sizes) == 1 << 30
    assert default_segment_bytes("GPU-x", sizes, from_host=True) == STREAM_SEGMENT_BYTES == 16 << 30
    assert default_segment_bytes("cpu", sizes, from_host=True) == 8 << 30


def test_the_kill_switch_is_read_alike_everywhere_in_any_case_and_an_unknown_value_is_said(
    checkpoint: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """``WEIGHTCACHE_MODE`` is read one way by every entry point: surrounding spaces and case do not matter (`` OFF ``
    switches ``attach`` off as it does the engine adapters; ``attach`` used to take only the exact ``off``, the
    adapters ``OFF`` not at all), and a value that is none of off, daemon, client switches nothing off, which the
    library entry points log once as a warning and the engine adapters refuse."""
    from weightcache.errors import BackendConfigError
    from weightcache.pipeline import switched_off

    backend = backends.get("torch")
    for value in (" OFF ", "Off", "off"):
        monkeypatch.setenv("WEIGHTCACHE_MODE", value)
        assert switched_off() and backend.effective_options(LoaderOptions(mode="client")) is None
        with warnings.catch_warnings():
            warnings.simplefilter("error")  # no FallbackWarning: switched off, not falling back
            model = meta_model(**model_kwargs(checkpoint))
            handle = wc.attach(model, checkpoint, mode="client", socket_dir=socket_dir, strict=True)  # no keeper
        assert handle.source == "disk" and torch.equal(model(INPUT_IDS), reference_output(checkpoint))
    monkeypatch.setenv("WEIGHTCACHE_MODE", " Client ")
    assert not switched_off() and backend.effective_options(LoaderOptions(mode="daemon")).mode == "client"  # type: ignore[union-attr]
    monkeypatch.setenv("WEIGHTCACHE_MODE", "of")
    with caplog.at_level("WARNING", logger="weightcache"):
        assert not switched_off() and not switched_off()
    said = [r.getMessage() for r in caplog.records if "WEIGHTCACHE_MODE" in r.getMessage()]
    assert said == ["weightcache: WEIGHTCACHE_MODE='of' is none of off, daemon, client: weightcache is not switched "
                    "off (set it to off to switch it off, or unset it)"]  # fmt: skip
    with pytest.raises(BackendConfigError, match="must be one of off, daemon, client; found 'of'"):
        backend.effective_options(LoaderOptions(mode="client"))


def test_the_kill_switch_turns_off_every_entry_point(
    checkpoint: Path, socket_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``WEIGHTCACHE_MODE=off`` is one switch for everything, as it is for the engines: ``attach`` in any mode
    loads from disk without asking the keeper (no warning, ``strict`` does not apply), ``compile_cache`` neither
    loads nor publishes (its miss reason says why), and ``weightcache load`` says it is off and publishes nothing."""
    keeper = start_keeper(socket_dir)
    try:
        published = wc.attach(meta_model(**model_kwargs(checkpoint)), checkpoint, mode="daemon", socket_dir=socket_dir)
        published.close()
        monkeypatch.setenv("WEIGHTCACHE_MODE", "off")
        for mode in ("daemon", "client"):
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # no FallbackWarning
                model = meta_model(**model_kwargs(checkpoint))
                handle = wc.attach(model, checkpoint, mode=mode, socket_dir=socket_dir, strict=True)
            assert handle.source == "disk" and torch.equal(model(INPUT_IDS), reference_output(checkpoint))
        [entry] = wc.Cache(socket_dir).entries()
        assert entry.leases == 0  # nobody attached it while switched off
        with wc.compile_cache(handle.fingerprint, socket_dir=socket_dir) as compiled:
            pass
        assert compiled.stats.miss_reason == "WEIGHTCACHE_MODE=off" and compiled.stats.published_bytes == 0
        assert wc.Cache(socket_dir).artifacts() == []
        wc.Cache(socket_dir).evict(entry.digest)
        load = subprocess.run(
            [sys.executable, "-m", "weightcache", "load", str(checkpoint), "--socket-dir", str(socket_dir)],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert load.returncode == 1 and "WEIGHTCACHE_MODE=off" in load.stderr, load.stderr
        assert wc.Cache(socket_dir).entries() == []
    finally:
        stop_keeper(socket_dir)
        keeper.wait(30)

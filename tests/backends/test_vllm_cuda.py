"""The vLLM adapter on an NVIDIA GPU, with vLLM's defaults (torch.compile and CUDA graphs on), on any supported
release (the H200 runs vLLM 0.26.0, which lacks ``weights_already_processed`` and ``get_external_weight_memory``).

Each engine is a fresh process (tests/backends/vllm_gpu_worker.py) with vLLM's engine in-process. For a dense
Llama and an MoE Mixtral, in bf16: greedy tokens are identical from load format auto, weightcache daemon (a miss:
it loads, publishes and runs on the published copy) and weightcache client (a second engine, started while the
first still runs); the client's loader takes < 1 % of the weights' bytes of device memory (its weights are the
keeper's); and vLLM's KV cache in every engine is auto's within 1 % (its memory budget counts the weights it maps
once: before vLLM 0.32 through ``count_external_weights``). Then a keeper SIGKILL leaves the running engines
generating, and after a keeper restart the engines re-publish, and a new engine attaches. With
``WEIGHTCACHE_VLLM_GRAPHS=1``, a second engine restores the FULL CUDA graphs the first recorded.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import EngineProcess, republished, require_engine, within

require_engine("vllm")

import weightcache as wc  # noqa: E402
from weightcache.backends.vllm import LOAD_FORMAT  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from conftest import keeper_pid, wait_until  # noqa: E402
from engine_models import GPU_SHAPES, make_random_model  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

#: Models whose weights are several percent of the KV cache at the utilization used here (engine_models).
SHAPES = GPU_SHAPES


def make_model(directory: Path, architecture: str) -> Path:
    config_name, model_name, shape = SHAPES[architecture]
    return make_random_model(directory, config_name, model_name, {"vocab_size": 32000, **shape})


class Engine(EngineProcess):
    """One vLLM engine in its own process (vLLM's engine in-process there), kept running until closed."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **(env or {})}
        super().__init__("vLLM", HERE / "vllm_gpu_worker.py", spec, env, quit_s=60)


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def start(engines: list[Engine], spec: dict[str, Any], env: dict[str, str] | None = None) -> dict[str, Any]:
    engine = Engine(spec, env)
    engines.append(engine)
    return engine.result


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_auto_daemon_and_client_on_the_gpu(
    architecture: str, engines: list[Engine], socket_dir: Path, tmp_path: Path
) -> None:
    model = str(make_model(tmp_path / architecture, architecture))
    options = {"socket_dir": str(socket_dir)}
    auto = start(engines, {"model": model, "load_format": "auto"})
    engines.pop().close()  # auto's memory is given back before the cached engines start
    daemon = start(engines, {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}})
    [entry] = wc.Cache(socket_dir).entries()
    assert entry.device.startswith("cuda") and entry.fingerprint.dtype == "bfloat16"
    client = start(
        engines,
        {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}},
    )
    print(
        json.dumps(
            {"architecture": architecture, "bytes": entry.bytes, "auto": auto, "daemon": daemon, "client": client}
        )
    )

    assert len(auto["tokens"]) == 12 and auto["tokens"] == daemon["tokens"] == client["tokens"]
    assert (auto["source"], daemon["source"], client["source"]) == ("disk", "cache", "cache")
    assert daemon["warnings"] == client["warnings"] == []
    # The second engine maps the keeper's weights: its loader takes next to no device memory.
    assert client["load_delta"] < 0.01 * entry.bytes, (client["load_delta"], entry.bytes)
    assert auto["load_delta"] > 0.9 * entry.bytes
    # vLLM's memory budget counts the weights once, whoever allocated them: the KV caches agree.
    assert within(client["kv_blocks"], auto["kv_blocks"], 0.01), (auto["kv_blocks"], client["kv_blocks"])
    assert within(daemon["kv_blocks"], auto["kv_blocks"], 0.01), (auto["kv_blocks"], daemon["kv_blocks"])

    if architecture != "llama":
        return
    # A keeper SIGKILL: the running engines keep generating from the memory they map.
    pid = keeper_pid(socket_dir)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert [e.generate() for e in engines] == [auto["tokens"]] * 2
    # The engine in mode daemon starts a new keeper (it keeps one running); the engines re-publish what they
    # hold, and a new engine attaches it without reading the disk.

    assert wait_until(republished(socket_dir, pid, entry.digest), 60)
    third = start(
        engines,
        {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}},
    )
    assert third["tokens"] == auto["tokens"] and third["source"] == "cache"
    assert third["load_delta"] < 0.01 * entry.bytes


def test_full_graphs_of_a_second_engine_are_restored_and_give_the_same_tokens(
    engines: list[Engine], socket_dir: Path, tmp_path: Path
) -> None:
    """``WEIGHTCACHE_VLLM_GRAPHS=1`` (experimental, weightcache/backends/vllm_graphs.py): with the weights published
    by an engine in mode daemon (without the kind: its allocations before the KV cache differ from a client's), a
    first client captures vLLM's FULL graphs through a GraphCache, records and publishes them; a second client (the
    same KV cache size) restores every one of them instead of capturing it; both give load format auto's greedy
    tokens, for one prompt and for five at once (decode steps of five sequences: a FULL graph of eight, padded).
    A client whose recording is refused for an address outside the reproduced ranges publishes nothing, and the
    next one records (documented); the test then starts one more.
    First run on an H100 (2026-12-05): the first client hung (the CUPTI callback's deadlock, fixed since); with
    vLLM's thread pools made serial by hand, recording failed here (0 of 51: the rotary table outside the arena,
    adopted since). Run again the same day: recording failed for FlashAttention 3's kernels, local ELF symbols
    the image reader skipped (read since); then all 51 were recorded, and the second client restored none, torch
    having placed 23 runner tensors elsewhere (relocated since). With relocation (77f2827, 17:36 UTC): the first
    client's recording was refused, FlashAttention 3's combine kernel holding 0x7fb000000001 at argument byte 32
    of 16 nodes, an odd value inside a 512 MiB allocation no declared tensor holds (padding or a packed scalar,
    by every sign, but a byte pointer cannot be told apart); the next client recorded and published all 51."""
    from weightcache.backends import vllm_graphs

    model = str(make_model(tmp_path / "llama", "llama"))
    options = {"socket_dir": str(socket_dir)}
    sized = {"model": model, "kv_cache_memory_bytes": 1 << 30, "batch": 5}  # the key holds the KV cache's size
    auto = start(engines, {**sized, "load_format": "auto"})
    engines.pop().close()
    start(engines, {**sized, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}})
    env = {vllm_graphs.SWITCH_ENV: "1"}
    client = {**sized, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}}
    first = start(engines, client, env)
    [recording] = first["graphs"]
    assert recording["captured"] > 0 and recording["restored"] == 0, recording
    if not recording["published"]:  # refused: the next client records
        assert "outside the reproduced ranges" in (recording["record_problem"] or ""), recording
        print(json.dumps({"refused": recording}))
        first = start(engines, client, env)
        [recording] = first["graphs"]
    second = start(engines, client, env)
    print(json.dumps({"auto": auto, "first": first, "second": second}))
    [restoring] = second["graphs"]
    assert recording["recorded"] == recording["captured"] and recording["published"], recording
    assert restoring["restored"] == recording["captured"] and restoring["captured"] == 0, restoring
    assert restoring["relocated"] > 0, restoring  # torch's allocator put the runner's tensors elsewhere
    assert len(auto["batch_tokens"]) == 5 and auto["batch_tokens"] == first["batch_tokens"] == second["batch_tokens"]
    assert [e.generate() for e in engines] == [auto["tokens"]] * len(engines)

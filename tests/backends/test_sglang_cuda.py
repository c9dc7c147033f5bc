"""The SGLang adapter in a whole SGLang engine on an NVIDIA GPU, with SGLang's defaults (CUDA graphs on, its
default attention backend), at SGLang 0.5.17 on the H200 (the release that pins that machine's PyTorch 2.11.0).

Each engine is a fresh process (tests/backends/sglang_gpu_worker.py: ``sglang.Engine``, whose scheduler runs in
its own child process, where the adapter loads). For a dense Llama and an MoE Mixtral, in bf16: greedy tokens are
identical from load format auto, weightcache daemon (a miss: it loads, publishes and runs on the published copy)
and weightcache client; the client's load takes < 1 % of the weights' bytes of device memory (SGLang's own measure:
free memory before and after its load); SGLang's KV cache in every engine is auto's within 1 %. Then two engines
serve from one copy, a keeper SIGKILL leaves both generating, the engines re-publish to a new keeper and a third
engine attaches. Last, ``python -m sglang.launch_server --load-format weightcache`` answers HTTP completions.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engines import EngineProcess, republished, require_engine, within

require_engine("sglang")

import weightcache as wc  # noqa: E402
from weightcache.backends.sglang import LOAD_FORMAT  # noqa: E402

HERE = Path(__file__).parent
sys.path.insert(0, str(HERE.parent))

from conftest import keeper_pid, wait_until  # noqa: E402
from engine_models import GPU_SHAPES, PROMPT, make_random_model  # noqa: E402

pytestmark = [pytest.mark.cuda, pytest.mark.slow]

SHAPES = GPU_SHAPES
VOCAB = 32000


def make_tokenizer(directory: Path) -> None:
    """A word-level tokenizer over the model's whole vocabulary (``t0`` .. ``t31999``), made here: the HTTP
    completions API needs one, and nothing can be downloaded."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocab, unk_token="t0"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token="t0", bos_token="t1", eos_token="t2")
    fast.save_pretrained(directory)


def make_model(directory: Path, architecture: str) -> Path:
    config_name, model_name, shape = SHAPES[architecture]
    make_random_model(directory, config_name, model_name, {"vocab_size": VOCAB, **shape})
    make_tokenizer(directory)
    return directory


class Engine(EngineProcess):
    """One SGLang engine in its own process, kept running until closed; ``result["warnings"]`` holds the log lines
    of warnings that name weightcache (SGLang's scheduler process prints them)."""

    def __init__(self, spec: dict[str, Any]) -> None:
        super().__init__("SGLang", HERE / "sglang_gpu_worker.py", spec, {}, quit_s=90)
        self.result["warnings"] = [line.strip() for line in self.log if "weightcache" in line and "Warning" in line]


@pytest.fixture
def engines() -> Iterator[list[Engine]]:
    started: list[Engine] = []
    yield started
    for engine in started:
        engine.close()


def start(engines: list[Engine], spec: dict[str, Any]) -> dict[str, Any]:
    engine = Engine(spec)
    engines.append(engine)
    print(json.dumps({"spec": spec, "result": engine.result}))
    return engine.result


def fallbacks(result: dict[str, Any]) -> list[str]:
    return [w for w in result["warnings"] if "FallbackWarning" in w]


@pytest.mark.parametrize("architecture", ["llama", "mixtral"])
def test_auto_daemon_and_client_in_sglang_on_the_gpu(
    architecture: str, engines: list[Engine], socket_dir: Path, tmp_path: Path
) -> None:
    model = str(make_model(tmp_path / architecture, architecture))
    options = {"socket_dir": str(socket_dir)}
    auto = start(engines, {"model": model})
    engines.pop().close()  # each engine alone on the GPU, as SGLang's defaults size its KV cache from free memory
    daemon = start(engines, {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}})
    engines.pop().close()
    [entry] = wc.Cache(socket_dir).entries()
    assert entry.device.startswith("cuda") and entry.fingerprint.dtype == "bfloat16"
    weights_gb = entry.bytes / (1 << 30)
    client = start(
        engines,
        {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}},
    )
    engines.pop().close()

    assert len(auto["tokens"]) == 12 and auto["tokens"] == daemon["tokens"] == client["tokens"]
    assert fallbacks(daemon) == fallbacks(client) == []
    # SGLang's own measure of its load: auto's and the daemon's load allocate the weights, the client maps them.
    assert auto["weight_gb"] > 0.9 * weights_gb and daemon["weight_gb"] > 0.9 * weights_gb
    assert client["weight_gb"] < 0.01 * weights_gb, (client["weight_gb"], weights_gb)
    # KV cache: SGLang sizes it from the memory free after the load less a share of the memory free before it
    # (its pre-load baseline); the client's weights were resident before that baseline, and SGLang 0.5.17 does not
    # count preloaded_weights_bytes, so the adapter adds them to the baseline of the ModelRunner that called it.
    # Without that the client's cache was larger by weights x (1 - mem_fraction_static): +0.2 % for these ~2 GB
    # models (2026-12-03, on 76d0c81), +1.28 % for a 16 GB one (docs/benchmarks.md); with it, as auto's.
    assert within(daemon["kv_tokens"], auto["kv_tokens"], 0.01), (auto["kv_tokens"], daemon["kv_tokens"])
    assert within(client["kv_tokens"], auto["kv_tokens"], 0.001), (auto["kv_tokens"], client["kv_tokens"])
    assert client["warnings"] == [], client["warnings"]  # neither a fallback nor "its KV cache keeps ... less"


def test_two_engines_share_one_copy_and_outlive_a_keeper_sigkill(
    engines: list[Engine], socket_dir: Path, tmp_path: Path
) -> None:
    model = str(make_model(tmp_path / "llama", "llama"))
    options = {"socket_dir": str(socket_dir)}
    share = {"options": {"mem_fraction_static": 0.3}}  # two engines on one GPU: each takes a part of it
    first = start(
        engines, {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "daemon"}, **share}
    )
    [entry] = wc.Cache(socket_dir).entries()
    weights_gb = entry.bytes / (1 << 30)
    second = start(
        engines,
        {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}, **share},
    )
    assert first["tokens"] == second["tokens"] and len(first["tokens"]) == 12
    assert first["weight_gb"] > 0.9 * weights_gb
    assert second["weight_gb"] < 0.01 * weights_gb, (second["weight_gb"], weights_gb)  # no weight bytes added

    pid = keeper_pid(socket_dir)
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    assert [e.generate() for e in engines] == [first["tokens"]] * 2

    # The engine in mode daemon starts a new keeper; the engines re-publish what they hold.
    assert wait_until(republished(socket_dir, pid, entry.digest), 90)
    third = start(
        engines,
        {"model": model, "load_format": LOAD_FORMAT, "extra": {**options, "mode": "client", "strict": True}, **share},
    )
    assert third["tokens"] == first["tokens"]
    assert third["weight_gb"] < 0.01 * weights_gb
    assert [e.generate() for e in engines] == [first["tokens"]] * 3


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def post(url: str, body: dict[str, Any]) -> dict[str, Any]:
    request = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=120) as response:
        return dict(json.loads(response.read()))


def test_launch_server_with_load_format_weightcache_answers_http_completions(
    engines: list[Engine], socket_dir: Path, tmp_path: Path
) -> None:
    model = str(make_model(tmp_path / "llama", "llama"))
    options = {"socket_dir": str(socket_dir)}
    auto = start(engines, {"model": model})
    engines.pop().close()
    port = free_port()
    extra = json.dumps({**options, "mode": "daemon"})
    command = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--port", str(port),
               "--load-format", "weightcache", "--model-loader-extra-config", extra, "--random-seed", "0"]  # fmt: skip
    log_path = tmp_path / "server.log"
    with open(log_path, "w") as log:
        server = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
    try:

        def ready() -> bool:
            if server.poll() is not None:
                raise AssertionError(f"launch_server exited ({server.returncode}):\n{log_path.read_text()[-6000:]}")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2) as response:
                    return bool(response.status == 200)
            except OSError:
                time.sleep(1)
                return False

        assert wait_until(ready, 600), log_path.read_text()[-6000:]
        completion = post(
            f"http://127.0.0.1:{port}/v1/completions",
            {"model": model, "prompt": " ".join(f"t{i}" for i in PROMPT), "max_tokens": 12, "temperature": 0},
        )
        print(json.dumps(completion))
        assert completion["usage"]["completion_tokens"] >= 1 and completion["choices"][0]["text"].strip()
        generated = post(
            f"http://127.0.0.1:{port}/generate",
            {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 12, "temperature": 0}},
        )
        assert generated["output_ids"] == auto["tokens"], (generated, auto["tokens"])
        [entry] = wc.Cache(socket_dir).entries()  # the server published its weights
        assert entry.fingerprint.dtype == "bfloat16"
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(60)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()

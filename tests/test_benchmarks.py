"""The parts of the benchmark scripts that run without an engine or a GPU: what they read off an engine's log.

``benchmarks/restart_vllm.py`` reports a vLLM start phase by phase from vLLM's own log lines; its first parser
counted every line twice (the one-line ``MARKS`` record repeats what the main process logged) and let a greedy
pattern run on into another phase's number on that record, so its phase columns on the H200 were wrong."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from conftest import benchmark, serve_detached

restart_vllm = benchmark("restart_vllm")


def test_phases_are_read_line_by_line_and_never_from_the_marks_record() -> None:
    logged = [
        "INFO [backends.py:1150] Dynamo bytecode transform time: 3.22 s",
        "INFO [backends.py:250] Directly load the compiled graph(s) for compile range (1, 16384) from the cache, "
        "took 1.146 s",
        "INFO [monitor.py:53] torch.compile took 4.70 s in total",
        "INFO [gpu_model_runner.py:4100] Graph capturing finished in 6 secs, took 0.53 GiB",
        "INFO [core.py:250] init engine (profile, create kv cache, warmup model) took 19.79 s",
        "INFO [vllm.py:1] weightcache: attached 291 tensors (15.0 GiB) from the keeper in 219.0 ms",
    ]
    marks = "MARKS " + json.dumps({"marks": {}, "lines": [[0.0, "vllm", line] for line in logged]})
    phases = restart_vllm.phases_of("\n".join([*logged, marks]))
    assert phases == {
        "dynamo": 3.22,
        "inductor: cache load": 1.146,
        "torch.compile total": 4.7,
        "graph capture": 6.0,
        "init engine (profile, KV cache, warm-up)": 19.79,
        "weightcache": 0.219,
    }


def test_sglang_phases_come_from_its_log_lines_and_add_every_capture() -> None:
    side_by_side = benchmark("sglang_side_by_side")
    import datetime as dt

    start = dt.datetime(2026, 12, 3, 22, 0, 0).timestamp()
    logged = [
        "[2026-12-03 22:00:10.000] Launching the scheduler",  # no phase of its own
        "[2026-12-03 22:00:20.500 TP0] Init torch distributed begin.",
        "[2026-12-03 22:00:21.700 TP0] Init torch distributed ends. elapsed=1.20 s, mem usage=0.10 GB",
        "[2026-12-03 22:00:22.000 TP0] Load weight begin. avail mem=139.00 GB",
        "[2026-12-03 22:00:22.070 TP0] Load weight end. elapsed=0.07 s, type=LlamaForCausalLM, mem usage=0.02 GB.",
        "[2026-12-03 22:00:22.300 TP0] Capture target prefill CUDA graph begin. backend=x, avail mem=20.00 GB",
        "[2026-12-03 22:00:24.300 TP0] Capture target prefill CUDA graph end. elapsed=2.00 s, mem usage=0.1 GB.",
        "[2026-12-03 22:00:24.400 TP0] Capture cuda graph begin. This can take up to several minutes.",
        "[2026-12-03 22:00:36.400 TP0] Capture target decode CUDA graph end. elapsed=12.00 s, mem usage=1.5 GB.",
        "RESULT is not a log line: elapsed=99.0 s CUDA graph end",
    ]
    result = {"import_s": 8.0, "engine_s": 37.0, "first_token_s": 37.25}
    assert side_by_side.sglang_phases(logged, start, result) == {
        "imports": 8.0,
        "to_scheduler": 12.5,
        "distributed_and_setup": 1.5,
        "weights": 0.07,
        "kv_cache_and_backend": 0.23,
        "graph_capture": 14.0,
        "to_engine_ready": 0.6,
        "first_generation": 0.25,
        "total": 37.25,
    }


def test_side_by_side_resets_the_keeper_so_the_next_scenarios_mode_daemon_starts_one(socket_dir: Path) -> None:
    """Each scenario of the SGLang side-by-side benchmark starts from no keeper, and its first engine (mode daemon)
    spawns one. A keeper stopped with SIGTERM leaves its stop marker, which makes mode daemon refuse to start
    another (a deliberate stop stays a stop): on the H200 the memory scenario's first engine loaded from disk with
    "the keeper was stopped on purpose" after the start scenario had stopped its keeper."""
    import weightcache as wc
    from weightcache.client.lifecycle import ensure_keeper

    side_by_side = benchmark("sglang_side_by_side")
    serve_detached(socket_dir)
    systems = side_by_side.Systems(socket_dir.parent, socket_dir.parent / "model")
    systems.socket_dir = socket_dir
    pid = systems.keeper_pid()
    assert pid is not None
    systems.stop_keeper()
    assert not Path(f"/proc/{pid}").exists()
    ensure_keeper(socket_dir)  # what mode daemon does: spawns a keeper, never KeeperUnavailable
    assert systems.keeper_pid() not in (None, pid)
    wc.Cache(socket_dir).stop()


def test_the_awq_checkpoint_names_its_architecture_and_holds_every_linear_in_awq_layout(tmp_path: Path) -> None:
    """SGLang reads a checkpoint's architecture from config.json before anything else: the benchmark's first AWQ
    checkpoint had none, and every engine of the H200's AWQ row failed on it ('NoneType' object is not
    subscriptable, in SGLang's ModelConfig)."""
    import transformers
    from safetensors import safe_open

    side_by_side = benchmark("sglang_side_by_side")
    tiny = {"vocab_size": 256, "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
            "num_attention_heads": 4, "num_key_value_heads": 2}  # fmt: skip
    side_by_side.SHAPES["llama-tiny"] = ("LlamaConfig", "LlamaForCausalLM", tiny)
    try:
        path = side_by_side.make_awq_model(tmp_path / "awq", "llama-tiny")
    finally:
        del side_by_side.SHAPES["llama-tiny"]
    config = transformers.AutoConfig.from_pretrained(path)
    assert config.architectures == ["LlamaForCausalLM"]
    assert config.quantization_config["quant_method"] == "awq" and config.quantization_config["bits"] == 4
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        names = set(f.keys())
        qweight = f.get_tensor("model.layers.0.mlp.down_proj.qweight")
        scales = f.get_tensor("model.layers.0.mlp.down_proj.scales")
    linears = {n.rsplit(".", 1)[0] for n in names if n.endswith(".qweight")}
    assert len(linears) == 2 * len(side_by_side.AWQ_LINEARS)
    assert all(f"{base}.{part}" in names for base in linears for part in ("qzeros", "scales"))
    assert not any(n.endswith("_proj.weight") for n in names)
    assert tuple(qweight.shape) == (512, 256 // 8) and tuple(scales.shape) == (512 // 128, 256)


def test_gpu_plan_poll_stops_at_once_on_a_machine_where_no_plan_ran(tmp_path: Path) -> None:
    """`gpu_sglang.sh poll` on a machine with no plan log (a fresh one: the machine that ran `detach` was given back)
    exits at once with 3 and says so, instead of copying nothing for as long as it was asked (on 2026-12-04 that
    spent a session's last 464 s of device time)."""
    import subprocess
    import time

    script = Path(__file__).parent.parent / "benchmarks" / "gpu_sglang.sh"
    env = {"PATH": "/usr/bin:/bin", "OUT": str(tmp_path / "out"), "PERSIST": str(tmp_path / "persist")}
    start = time.monotonic()
    done = subprocess.run(["bash", str(script), "poll", "60"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 3, done.stdout + done.stderr
    assert "no plan has run on this machine" in done.stderr
    assert time.monotonic() - start < 20
    (tmp_path / "persist").mkdir()
    (tmp_path / "persist" / "plan.log").write_text("== 2026-12-04T11:24:45Z step\n== 2026-12-04T11:25:39Z exit 0\n")
    (tmp_path / "persist.done").touch()  # a plan that ran and ended: poll copies its logs and returns
    done = subprocess.run(["bash", str(script), "poll", "60"], env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr
    assert (tmp_path / "out" / "plan.log").exists() and "exit 0" in done.stdout


def test_a_vllm_start_that_hangs_is_stopped_with_its_stacks(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Found on the H100 (2026-12-05): a hung start would have held the benchmark for its 20 minutes' timeout, then
    died with nothing to say where. A start past START_TIMEOUT_S is sent SIGABRT (its whole process group) and
    the error ends with where each thread was."""
    hanging = "import time\n\ndef stuck_in_capture_model():\n    time.sleep(3600)\n\nstuck_in_capture_model()\n"
    monkeypatch.setattr(restart_vllm, "ENGINE", hanging)
    monkeypatch.setattr(restart_vllm, "START_TIMEOUT_S", 2.0)
    with pytest.raises(SystemExit) as stopped:
        restart_vllm.run_engine("auto", tmp_path, tmp_path / "s", dict(os.environ))
    text = str(stopped.value)
    assert "no result in 2 s (stopped with SIGABRT)" in text and "stuck_in_capture_model" in text, text


def test_the_cpu_restore_benchmark_restores_every_graph_relocated_on_this_tree(tmp_path: Path) -> None:
    """``benchmarks/graph_restore_cpu.py`` makes a GraphCache without its constructor (no GPU) and restores an
    artifact's graphs over moved tensors: run small on this tree, so that the harness keeps up with the
    GraphCache's state (every graph restored, its pointers relocated, the restore's steps reported), with its
    driver answering at once and with the H100's driver modelled (``--driver-latency``)."""
    import subprocess
    import sys

    root = Path(__file__).resolve().parent.parent
    out = tmp_path / "restore.json"
    subprocess.run(
        [sys.executable, "benchmarks/graph_restore_cpu.py", "--tree", str(root), "--processes", "1",
         "--graphs", "3", "--nodes", "20", "--externals", "5", "--json", str(out)],
        cwd=root, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    [tree] = json.loads(out.read_text())["trees"].values()
    assert tree["pointers_relocated"] > 0 and tree["seconds_median"] > 0
    assert {"map", "checks", "relocate", "extents"} <= set(tree["steps_median"])
    subprocess.run(
        [sys.executable, "benchmarks/graph_restore_cpu.py", "--tree", str(root), "--processes", "1",
         "--graphs", "3", "--nodes", "20", "--externals", "5", "--driver-latency", "--engine-ms", "2",
         "--engine-first-ms", "5", "--json", str(out)],
        cwd=root, check=True, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    report = json.loads(out.read_text())
    [modelled] = report["trees"].values()
    assert report["driver_latency"] is True and report["engine_ms"] == 2.0 and report["engine_first_ms"] == 5.0
    # at least the caller's own: three engine spins of 2 ms and one of 5 ms (the builds may all lie under them)
    assert modelled["seconds_median"] > 0.011 and modelled["pointers_relocated"] == tree["pointers_relocated"]


def test_the_node_cost_benchmark_hands_the_driver_each_nodes_own_bytes_both_ways() -> None:
    """``benchmarks/graph_node_costs.py`` runs on a GPU only (it has not run yet): what it hands the driver is
    checked here, on the parameters it builds for a node, as the driver would read them: the arguments as one
    buffer (``extra``: buffer pointer, a pointer to its size, end), or one pointer to each parameter (by the
    function's layout, ``kernelParams``), each pointing at that parameter's bytes."""
    import ctypes
    import struct

    from weightcache.graphs.description import KernelNode

    costs = benchmark("graph_node_costs")
    args = struct.pack("<QIIQ", 0x7F00_0000_1000, 7, 9, 0x7F00_0000_2000)
    node = KernelNode("k", (4, 2, 1), (128, 1, 1), 1024, args, ((0, 8), (8, 4), (12, 4), (16, 8)))
    keep: list[object] = []
    buffer = costs.kernel_params(0xF00, node, None, keep)
    assert (buffer.func, buffer.gridDimX, buffer.gridDimY, buffer.blockDimX, buffer.sharedMemBytes) == (
        0xF00, 4, 2, 128, 1024
    )  # fmt: skip
    assert not buffer.kernelParams
    extra = [buffer.extra[i] for i in range(5)]
    assert extra[0] == costs.PARAM_BUFFER and extra[2] == costs.PARAM_SIZE and extra[4] is None  # (END is 0)
    assert ctypes.c_size_t.from_address(extra[3]).value == len(args)
    assert ctypes.string_at(extra[1], len(args)) == args
    laid = costs.kernel_params(0xF00, node, list(node.layout), keep)
    assert not laid.extra
    assert [ctypes.string_at(laid.kernelParams[i], size) for i, (_, size) in enumerate(node.layout)] == [
        args[offset : offset + size] for offset, size in node.layout
    ]

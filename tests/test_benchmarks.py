"""The parts of the benchmark scripts that run without an engine or a GPU: what they read off an engine's log.

``benchmarks/restart_vllm.py`` reports a vLLM start phase by phase from vLLM's own log lines; its first parser
counted every line twice (the one-line ``MARKS`` record repeats what the main process logged) and let a greedy
pattern run on into another phase's number on that record, so its phase columns on the H200 were wrong."""

from __future__ import annotations

import json

from conftest import benchmark

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

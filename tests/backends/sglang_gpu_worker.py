"""Run one SGLang engine (``sglang.Engine``: its scheduler in a child process, as SGLang runs it) on a GPU with
SGLang's defaults (CUDA graphs on), and keep it: print a JSON line after the first greedy generation, then answer
commands on stdin.

Usage: python sglang_gpu_worker.py '<json spec>'; spec keys: model, load_format (``auto`` or ``weightcache``),
extra (model_loader_extra_config, a dict), weight_cache_mode (SGLang's own weight cache: ``off``, ``daemon`` or
``client``), weight_cache_socket, options (more ServerArgs, e.g. mem_fraction_static), max_new_tokens (default 12),
evict (drop the checkpoint from the page cache first).
Commands (one per line): ``generate`` (greedy again, a RESULT line), ``quit``.

Each RESULT line holds: tokens; weight_gb (SGLang's own measure of the device memory its load took: free memory
before and after), kv_tokens (its KV cache in tokens) and kv_gb; graph_gb; import_s (to sglang imported),
engine_s (to the engine ready), first_token_s (to the first generation's end), each from this process's start.
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time

START = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_models import PROMPT, evict_from_page_cache  # noqa: E402


def main() -> None:
    with contextlib.suppress(Exception):  # killed with the test process (it leads a process group of its own)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    spec = json.loads(sys.argv[1])
    if spec.get("evict"):
        evict_from_page_cache(spec["model"])
    import sglang

    import_s = time.time() - START
    kwargs = {
        "model_path": spec["model"],
        "load_format": spec.get("load_format", "auto"),
        "model_loader_extra_config": json.dumps(spec.get("extra") or {}),
        "skip_tokenizer_init": spec.get("skip_tokenizer_init", True),
        "random_seed": 0,
        "log_level": spec.get("log_level", "info"),
        **spec.get("options", {}),
    }
    if spec.get("weight_cache_mode", "off") != "off":
        kwargs["weight_cache_mode"] = spec["weight_cache_mode"]
        if spec.get("weight_cache_socket"):
            kwargs["weight_cache_socket"] = spec["weight_cache_socket"]
    engine = sglang.Engine(**kwargs)
    engine_s = time.time() - START
    params = {"max_new_tokens": spec.get("max_new_tokens", 12), "temperature": 0.0}

    def generate() -> list[int]:
        out = engine.generate(input_ids=PROMPT, sampling_params=params)
        return [int(t) for t in out["output_ids"]]

    tokens = generate()
    first_token_s = time.time() - START
    info = engine.get_server_info()
    usage = info["internal_states"][0].get("memory_usage", {})
    result = {
        "tokens": tokens,
        "weight_gb": usage.get("weight"),
        "kv_gb": usage.get("kvcache"),
        "kv_tokens": usage.get("token_capacity", info.get("max_total_num_tokens")),
        "graph_gb": sum((usage.get("graph") or {}).values()),
        "import_s": import_s,
        "engine_s": engine_s,
        "first_token_s": first_token_s,
    }
    print("RESULT " + json.dumps(result), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "generate":
            print("RESULT " + json.dumps({"tokens": generate()}), flush=True)
        elif command == "quit":
            break
    engine.shutdown()


if __name__ == "__main__":
    main()

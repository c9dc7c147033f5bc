"""Run one vLLM engine on a GPU, with vLLM's defaults (torch.compile and CUDA graphs on), in this process, and
keep it: print a JSON line after the first greedy generation, then answer commands on stdin.

Usage: python vllm_gpu_worker.py '<json spec>'; spec keys: model, load_format, extra (model_loader_extra_config),
gpu_memory_utilization (default 0.25), kv_cache_memory_bytes (vLLM's, where given), max_tokens (default 12), batch
(prompts generated at once, default 1: the first is engine_models.PROMPT, each other one its tokens shifted), evict
(drop the checkpoint from the page cache).
Commands (one per line): ``generate`` (greedy again, a RESULT line), ``quit``.

Each RESULT line holds: tokens (the first prompt's); batch_tokens (every prompt's); source (``cache`` or ``disk``,
from the model's Handle); load_delta (device memory the engine's loader took, from the driver's free memory before
and after it); kv_blocks (vLLM's KV cache size in blocks); warnings that mention weightcache; seconds from the start
of this process to the first token; graphs (what weightcache's vLLM graph kind did,
weightcache.backends.vllm_graphs.reports()).
"""

from __future__ import annotations

import contextlib
import ctypes
import json
import os
import signal
import sys
import time
import warnings

START = time.time()
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_models import PROMPT, evict_from_page_cache  # noqa: E402


def main() -> None:
    with contextlib.suppress(Exception):  # killed with the test process (it leads a process group of its own)
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    spec = json.loads(sys.argv[1])
    if spec.get("evict"):
        evict_from_page_cache(spec["model"])
    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt
    from vllm.model_executor import model_loader as loaders
    from vllm.plugins import load_general_plugins

    load_general_plugins()  # registers --load-format weightcache in this process, as LLM() would
    load_format = spec.get("load_format", "auto")
    loader_cls = loaders._LOAD_FORMAT_TO_MODEL_LOADER[load_format]
    measured: dict[str, int] = {}
    original = loader_cls.load_model

    def load_model(self, *args, **kwargs):  # the loader's own device memory, as the driver sees it
        torch.cuda.synchronize()
        free_before = torch.cuda.mem_get_info()[0]
        model = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        measured["load_delta"] = free_before - torch.cuda.mem_get_info()[0]
        return model

    loader_cls.load_model = load_model
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            load_format=load_format,
            model_loader_extra_config=spec.get("extra") or {},
            gpu_memory_utilization=spec.get("gpu_memory_utilization", 0.25),
            max_model_len=spec.get("max_model_len", 512),
            seed=0,
            **({"kv_cache_memory_bytes": spec["kv_cache_memory_bytes"]} if "kv_cache_memory_bytes" in spec else {}),
        )
    params = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0.0, detokenize=False)
    batch = int(spec.get("batch", 1))

    prompts = [TokensPrompt(prompt_token_ids=[(t + 101 * i) % 30000 + 1 for t in PROMPT]) for i in range(1, batch)]

    def generate() -> list[list[int]]:
        out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT), *prompts], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in out]

    def source(model: torch.nn.Module) -> str:
        handle = model.__dict__.get("weightcache_handle")
        return "disk" if handle is None else str(handle.source)

    batch_tokens = generate()
    first_token_s = time.time() - START
    result = {
        "tokens": batch_tokens[0],
        "batch_tokens": batch_tokens,
        "source": llm.apply_model(source)[0],
        "load_delta": measured.get("load_delta"),
        "kv_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
        "torch_allocated": torch.cuda.memory_allocated(),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "weightcache" in str(w.message)],
        "first_token_s": first_token_s,
        "graphs": graph_reports(),
    }
    print("RESULT " + json.dumps(result), flush=True)
    for line in sys.stdin:
        command = line.strip()
        if command == "generate":
            again = generate()
            print("RESULT " + json.dumps({"tokens": again[0], "batch_tokens": again}), flush=True)
        elif command == "quit":
            break


def graph_reports() -> list[dict[str, object]]:
    """What weightcache's vLLM graph kind did in this process (WEIGHTCACHE_VLLM_GRAPHS=1), if anything."""
    from weightcache.backends import vllm_graphs

    return vllm_graphs.reports()


if __name__ == "__main__":
    main()

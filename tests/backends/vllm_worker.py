"""Run one vLLM engine in this process and print a JSON line: greedy token ids and how the weights came.

Usage: python vllm_worker.py '<json spec>'; spec keys: model, load_format, extra (model_loader_extra_config),
evict (drop the checkpoint from the page cache first), fsize_limit (RLIMIT_FSIZE in bytes: memfd segments
fail), max_tokens, table (write the model's parity table there), model_impl (vLLM's: "auto", "vllm" or
"transformers"), compile (torch.compile on; vLLM's compile cache reported under "compile"), max_model_len,
pretend_version (vLLM reports this version: a release outside the adapter's range), remove_api ([module, name]:
that name is deleted from the module once vLLM has imported it, as if a release had moved it), dtype (vLLM's
dtype, default "float32"), children (report the command line of each process the worker started, after the engine
is up), linger (seconds the engine stays up after generating, before it reports). The result also says whether
vLLM was imported before the worker started (``preimported``: a warm process's child).
"""

from __future__ import annotations

import sys

PREIMPORTED = "vllm" in sys.modules  # started by a warm process (weightcache run) that imported vLLM already

import json  # noqa: E402
import os  # noqa: E402
import warnings  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from engine_models import PROMPT, evict_from_page_cache, resident_fraction  # noqa: E402


def children() -> list[str]:
    """The command line of each process this one started (vLLM's engine core, the resource tracker)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                parent = int(f.read().rsplit(")", 1)[1].split()[1])
            if parent == os.getpid():
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    found.append(f.read().replace(b"\0", b" ").decode(errors="replace"))
        except (OSError, ValueError, IndexError):
            continue
    return found


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if spec.get("evict"):
        evict_from_page_cache(spec["model"])
    before = resident_fraction(spec["model"])
    import vllm
    import vllm.model_executor.model_loader  # every loader of vLLM's own, with the names it imports
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    if spec.get("pretend_version"):
        vllm.__version__ = spec["pretend_version"]
    if spec.get("remove_api"):
        import importlib

        module_name, name = spec["remove_api"]
        delattr(importlib.import_module(module_name), name)

    if spec.get("fsize_limit"):
        # A real allocation failure for shared memory: a memfd cannot grow past RLIMIT_FSIZE (EFBIG; Python
        # ignores SIGXFSZ), so every segment this process creates fails, while reading the checkpoint works.
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], resource.RLIM_INFINITY))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        llm = LLM(
            model=spec["model"],
            skip_tokenizer_init=True,
            enforce_eager=not spec.get("compile"),
            dtype=spec.get("dtype", "float32"),
            max_model_len=spec.get("max_model_len", 128),
            load_format=spec.get("load_format", "auto"),
            model_loader_extra_config=spec.get("extra") or {},
            model_impl=spec.get("model_impl", "auto"),
            seed=0,
        )
    after_load = resident_fraction(spec["model"])
    params = SamplingParams(max_tokens=spec.get("max_tokens", 12), temperature=0.0, detokenize=False)
    out = llm.generate([TokensPrompt(prompt_token_ids=PROMPT)], params, use_tqdm=False)
    result = {
        "tokens": list(out[0].outputs[0].token_ids),
        "resident_before": before,
        "resident_after_load": after_load,
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "weightcache" in str(w.message)],
    }
    if spec.get("linger"):  # the engine stays up, holding what it holds, before it reports
        import time

        time.sleep(spec["linger"])
    result["preimported"] = PREIMPORTED
    if spec.get("children"):
        result["children"] = children()
    if spec.get("compile"):
        from weightcache.backends import vllm_compile

        result["compile"] = [
            {
                "restored_files": len(c.restored),
                "loaded_bytes": c.loaded_bytes,
                "published_bytes": c.published_bytes,
                "written": c.written,
                "counts": c.counts,
            }
            for c in vllm_compile.engine_caches()
        ]
        result["vllm_counters"] = vllm_compile.vllm_counters()
        from weightcache.torch_compile import torch_cache_counters

        result["torch_counters"] = torch_cache_counters()
    if spec.get("table"):
        from functools import partial

        from weightcache import parity

        # In the worker that holds the model (this process, or vLLM's engine process with multiprocessing on).
        llm.apply_model(partial(parity.write_table, path=spec["table"], load_format=spec.get("load_format")))
    if os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING") == "0":
        # The engine runs in this process: ask its loader what vLLM's memory accounting would be told.
        from vllm.model_executor.model_loader import get_model_loader

        config = llm.llm_engine.vllm_config
        result["config_hash"] = config.compute_hash()  # what vLLM keys its compile cache by
        loader = get_model_loader(config.load_config)
        result["loader"] = type(loader).__name__
        if hasattr(loader, "options"):
            result["external_weight_memory"] = loader.get_external_weight_memory(config)
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

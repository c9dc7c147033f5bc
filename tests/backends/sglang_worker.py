"""Load a model through SGLang's loader layer in this process and write its tensor table (weightcache.parity).

SGLang cannot run an engine on this CPU, but its loader layer runs in-process: a gloo process group of one,
model-parallel initialisation, then get_model_loader(LoadConfig(...)).load_model(model_config=...,
device_config=DeviceConfig("cpu")), as SGLang's own weight-cache daemon does it.

Usage: python sglang_worker.py '<json spec>'; spec keys: model, table (output path), loader ("default" or
"weightcache", or "launch_server": the plugin's --load-format weightcache, parsed as SGLang's CLI does), options
(weightcache loader options), other_layout (the weightcache loader's adapter builds the model in bfloat16: an
engine setting that changes the layout and that the identity does not record), evict, fsize_limit (RLIMIT_FSIZE
in bytes: memfd segments fail), runner (a number: the load runs inside ``load_model`` of SGLang's own
``ModelRunner`` class, as in an engine, with that ``pre_model_load_memory`` in GB; the RESULT line then has the
runner's ``pre_model_load_memory`` after the load), runner_loads (how many times that runner loads: a reload).
Prints one RESULT line.
"""

from __future__ import annotations

import inspect
import json
import os
import socket
import sys
import warnings

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)
sys.path.insert(0, os.path.join(HERE, "sglang_shims"))

from engine_models import evict_from_page_cache, resident_fraction  # noqa: E402


def init_sglang(model: str) -> object:
    from sglang.srt import runtime_context
    from sglang.srt.configs.model_config import ModelConfig
    from sglang.srt.distributed.parallel_state import init_distributed_environment, initialize_model_parallel
    from sglang.srt.layers import dp_attention
    from sglang.srt.layers.moe import initialize_moe_config
    from sglang.srt.server_args import ServerArgs

    server_args = ServerArgs(model_path=model, device="cpu", dtype="float32", skip_tokenizer_init=True)
    if hasattr(runtime_context, "SpawnRanks"):  # 0.5.20 on: rank reads need the launcher's placement
        ranks = runtime_context.SpawnRanks(world_rank=0, gpu_id=0)
        runtime_context.publish(server_args, role="weight_cache_daemon", ranks=ranks)
    elif hasattr(runtime_context, "publish"):  # 0.5.17: publish takes no ranks
        runtime_context.publish(server_args, role="weight_cache_daemon")
    else:  # 0.5.16: no publish yet
        runtime_context.get_context().set_server_args(server_args)
    if inspect.signature(initialize_moe_config).parameters:  # 0.5.17 takes the server args
        initialize_moe_config(server_args)
    else:  # 0.5.20 on read them from the runtime context
        initialize_moe_config()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    initialize_model_parallel()
    model_config = ModelConfig(model_path=model, dtype="float32")
    if hasattr(dp_attention, "init_dp_gathered_buffer"):  # 0.5.20 on: the buffer is sized separately
        dp_attention.initialize_dp_attention(server_args)
        dp_attention.init_dp_gathered_buffer(model_config)
    else:  # 0.5.17, as its own weight-cache daemon does
        dp_attention.initialize_dp_attention(server_args, model_config)
    return model_config


def other_layout_loader() -> type:
    """WeightCacheLoader whose adapter builds SGLang's model, then casts it to bfloat16: what a setting that
    changes the model as built (and that the adapter's identity misses) does. Its disk load is SGLang's own."""
    import torch

    from weightcache.backends.sglang import SglangBackend, WeightCacheLoader

    class OtherLayoutBackend(SglangBackend):
        def build_model(self, context: object) -> torch.nn.Module:
            return super().build_model(context).to(torch.bfloat16)

    class OtherLayoutLoader(WeightCacheLoader):
        def __init__(self, load_config: object) -> None:
            super().__init__(load_config)
            self.backend = OtherLayoutBackend()

    return OtherLayoutLoader


def load_in_model_runner(
    loader: object, model_config: object, device_config: object, baseline: float, loads: int
) -> tuple:
    """The load called from ``load_model`` of a ModelRunner, as SGLang 0.5.16 to 0.5.23 call it (through
    ``load_model_with_memory_saver``): SGLang's own class, whose ``__init__`` (a whole engine: CUDA, a scheduler)
    does not run on this CPU, with the one attribute its ``init_torch_distributed`` sets before the load and its
    KV cache reads after it; ``loads`` times (a reload). Returns the model and the runner's
    ``pre_model_load_memory`` after the last load."""
    from sglang.srt.model_executor.model_runner import ModelRunner

    def through_memory_saver() -> object:
        return loader.load_model(model_config=model_config, device_config=device_config)  # type: ignore[attr-defined]

    class CpuModelRunner(ModelRunner):  # type: ignore[misc]
        def load_model(self) -> None:
            self.model = through_memory_saver()

    runner = CpuModelRunner.__new__(CpuModelRunner)
    runner.pre_model_load_memory = baseline
    for _ in range(loads):
        runner.load_model()
    return runner.model, runner.pre_model_load_memory


def main() -> None:
    spec = json.loads(sys.argv[1])
    if spec.get("evict"):
        evict_from_page_cache(spec["model"])
    model_config = init_sglang(spec["model"])
    from sglang.srt.configs.device_config import DeviceConfig
    from sglang.srt.configs.load_config import LoadConfig
    from sglang.srt.model_loader.loader import get_model_loader

    from weightcache import parity
    from weightcache.backends.sglang import WeightCacheLoader

    if spec["loader"] == "weightcache":
        loader_class = other_layout_loader() if spec.get("other_layout") else WeightCacheLoader
        load_config = LoadConfig(load_format=loader_class, model_loader_extra_config=spec.get("options", {}))
    elif spec["loader"] == "launch_server":  # as `python -m sglang.launch_server --load-format weightcache` does
        from sglang.srt.plugins import load_plugins
        from sglang.srt.server_args import prepare_server_args

        load_plugins()
        argv = ["--model-path", spec["model"], "--device", "cpu", "--load-format", "weightcache"]
        server_args = prepare_server_args([*argv, "--model-loader-extra-config", json.dumps(spec.get("options", {}))])
        load_config = LoadConfig(
            load_format=server_args.load_format, model_loader_extra_config=server_args.model_loader_extra_config
        )
    else:
        load_config = LoadConfig(load_format="auto")
    loader = get_model_loader(load_config, model_config)
    if spec.get("fsize_limit"):
        # A real allocation failure for shared memory: a memfd cannot grow past RLIMIT_FSIZE (EFBIG; Python
        # ignores SIGXFSZ), so every segment this process creates fails, while reading the checkpoint works.
        import resource

        resource.setrlimit(resource.RLIMIT_FSIZE, (spec["fsize_limit"], resource.RLIM_INFINITY))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if spec.get("runner") is not None:
            model, after = load_in_model_runner(
                loader, model_config, DeviceConfig("cpu"), spec["runner"], spec.get("runner_loads", 1)
            )
        else:
            model = loader.load_model(model_config=model_config, device_config=DeviceConfig("cpu"))
    parity.write_table(model, spec["table"], loader=type(loader).__name__)
    result = {
        "loader": type(loader).__name__,
        "source": getattr(loader, "source", "disk"),
        "preloaded_weights_bytes": getattr(loader, "preloaded_weights_bytes", 0),  # SGLang 0.5.19 on declares it
        "resident_after_load": resident_fraction(spec["model"]),
        "warnings": [f"{w.category.__name__}: {w.message}" for w in caught if "weightcache" in str(w.message)],
    }
    if spec.get("runner") is not None:
        result["pre_model_load_memory"] = after
    print("RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main()

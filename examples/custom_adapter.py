"""Registering a weightcache adapter for a new engine.

``ToyEngine`` below stands for any inference engine with a loader of its own: it reads separate q/k/v
projections from the checkpoint and fuses them into one qkv matrix, and after loading it post-processes every
linear layer (``process_weights_after_loading``: the weight is replaced by its transpose, stored contiguous,
under another name), as real engines repack weights for their kernels. Its ``load_format`` lets a loader in.

``ToyEngineBackend`` is the adapter: a :class:`weightcache.backends.Backend` subclass, registered with
``weightcache.backends.register``, whose loader does what the vLLM and SGLang adapters do: compute the
fingerprint, ``fetch`` the entry, on a miss in mode daemon run the engine's own loader and ``publish`` its
post-processed weights, then build the model on meta, ``adopt_published_layout`` and ``bind``.

Two engine processes run: the first in mode daemon (loads, fuses, post-processes, publishes), the second in
mode client (attaches the post-processed weights: its loader and post-processing never run). Their outputs are
identical. The keeper lives in a temporary socket directory, removed at the end.

    python examples/custom_adapter.py [--json]
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any, ClassVar

import torch
from safetensors.torch import load_file, save_file
from torch import nn

import weightcache as wc
from weightcache import backends
from weightcache.backends.base import (
    Backend,
    LoaderOptions,
    QuantSpec,
    adopt_published_layout,
    fetch,
    publish,
    quant_spec_from_config,
)

# --- the engine (not weightcache's code: it knows nothing about caching) -------------------------------------


class Linear(nn.Module):
    def __init__(self, n_in: int, n_out: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x @ self.weight_t  # the kernel wants the post-processed layout

    def process_weights_after_loading(self) -> None:
        w = self._parameters.pop("weight")
        self.weight_t = nn.Parameter(w.t().contiguous(), requires_grad=False)


class ToyModel(nn.Module):
    def __init__(self, dim: int, layers: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.ModuleDict({"qkv": Linear(dim, 3 * dim), "o": Linear(dim, dim)}) for _ in range(layers)
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            q, k, v = layer["qkv"](x).chunk(3, dim=-1)
            x = x + layer["o"](torch.softmax(q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5, dim=-1) @ v)
        return x


class ToyEngine:
    """An engine: ``load_format="default"`` uses its own loader; otherwise a loader object builds the model."""

    __version__ = "0.1.0"

    def __init__(self, checkpoint: str, load_format: Any = "default") -> None:
        self.checkpoint = checkpoint
        self.config = json.loads((Path(checkpoint) / "config.json").read_text())
        self.post_processed = 0  # how many layers this process post-processed
        loader = DefaultLoader() if load_format == "default" else load_format
        self.model = loader.load_model(self)

    def build(self) -> ToyModel:
        with torch.device("meta"):
            return ToyModel(self.config["dim"], self.config["layers"])


class DefaultLoader:
    def load_model(self, engine: ToyEngine) -> ToyModel:
        raw = load_file(str(Path(engine.checkpoint) / "model.safetensors"))
        state = {}
        for i in range(engine.config["layers"]):  # fuse q, k, v into one matrix
            p = f"layers.{i}"
            state[f"{p}.qkv.weight"] = torch.cat([raw[f"{p}.{n}_proj.weight"] for n in "qkv"])
            state[f"{p}.o.weight"] = raw[f"{p}.o_proj.weight"]
        model = engine.build()
        model.load_state_dict(state, assign=True)
        for module in model.modules():
            if isinstance(module, Linear):
                module.process_weights_after_loading()
                engine.post_processed += 1
        return model


# --- the adapter ------------------------------------------------------------------------------------------------


@backends.register
class ToyEngineBackend(Backend):
    name: ClassVar[str] = "toyengine"  # also the fingerprint's engine field
    module: ClassVar[str] = __name__  # the engine's module (imported lazily by require()/version())
    install_hint: ClassVar[str] = "ToyEngine lives in examples/custom_adapter.py"

    def version(self) -> str:
        return ToyEngine.__version__  # the engine is this file, so there is no package to ask

    def quant(self, engine_quant: object) -> QuantSpec:
        return quant_spec_from_config("ToyEngine", engine_quant)  # None: unquantized


class WeightCacheLoader:
    """What the engine gets as its load_format: the cache half of modes daemon and client."""

    def __init__(self, options: LoaderOptions) -> None:
        self.options = options
        self.backend = backends.get("toyengine")
        self.source = "disk"
        self.handle: wc.Handle | None = None

    def load_model(self, engine: ToyEngine) -> ToyModel:
        fingerprint = self.backend.make_fingerprint(
            engine.checkpoint,
            dtype=torch.float32,
            engine_quant=None,  # the engine's quantization config: checked before anything loads
            parallel=lambda: {"tp": (0, 1)},
            device="cpu",
            identity=engine.config,  # the engine's model config joins the fingerprint
        )
        handle = fetch(fingerprint, self.options)
        if handle is None and self.options.mode == "client":  # a miss: fetch warned why; the engine loads alone
            return DefaultLoader().load_model(engine)
        if handle is None:  # mode daemon, a miss: the engine loads and post-processes, then we publish
            handle = publish(fingerprint, DefaultLoader().load_model(engine).state_dict(), self.options)
        model = engine.build()
        adopt_published_layout(model, handle)  # the meta model takes the post-processed layout (weight_t)
        wc.bind(model, handle.tensors, device="cpu")
        model.__dict__["weightcache_handle"] = self.handle = handle  # the lease lives as long as the model
        self.source = handle.source
        return model


# --- running it: two engine processes ----------------------------------------------------------------------------


def make_checkpoint(path: Path, dim: int = 256, layers: int = 4) -> None:
    torch.manual_seed(0)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    state = {f"layers.{i}.{n}.weight": torch.randn(dim, dim) / dim**0.5 for i in range(layers) for n in names}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "dim": dim, "layers": layers}))


def serve(checkpoint: str, mode: str, socket_dir: str) -> dict[str, Any]:
    """One engine start with the adapter as its loader, and one request."""
    loader = WeightCacheLoader(LoaderOptions.parse({"mode": mode, "socket_dir": socket_dir}, where="serve"))
    engine = ToyEngine(checkpoint, load_format=loader)
    x = torch.randn(2, 8, engine.config["dim"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out = engine.model(x)
    return {
        "mode": mode,
        "source": loader.source,
        "layers_post_processed_here": engine.post_processed,
        "registered": backends.names(),
        "engine": loader.handle.fingerprint.engine if loader.handle else None,
        "tensors": sorted(loader.handle.tensors)[:2] if loader.handle else [],
        "output": hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16],
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", action="store_true", help="print one JSON object of results")
    parser.add_argument("--serve", nargs=3, metavar=("CKPT", "MODE", "SOCKET_DIR"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(*args.serve)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="wc-adapter-"))
    checkpoint, socket_dir = work / "checkpoint", work / "sock"
    make_checkpoint(checkpoint)
    runs = []
    try:
        for mode in ("daemon", "client"):  # each a fresh engine process
            cmd = [sys.executable, __file__, "--serve", str(checkpoint), mode, str(socket_dir)]
            out = subprocess.run(cmd, check=True, stdout=subprocess.PIPE, text=True, timeout=300)
            runs.append(json.loads(out.stdout))
    finally:
        # wait: the keeper writes into socket_dir until it exits, so remove the directory only then
        with contextlib.suppress(wc.WeightCacheError):  # no keeper (any more): nothing to stop
            wc.Cache(socket_dir).stop(wait=30)
        shutil.rmtree(work, ignore_errors=True)
    result = {"runs": runs, "outputs_identical": runs[0]["output"] == runs[1]["output"]}
    if args.json:
        print(json.dumps(result))
    else:
        for r in runs:
            print(
                f"mode {r['mode']:<7} weights from {r['source']:<5} layers post-processed here: "
                f"{r['layers_post_processed_here']}  output {r['output'][:16]}"
            )
        print(f"registered adapters: {runs[1]['registered']}; outputs identical: {result['outputs_identical']}")
    return 0 if result["outputs_identical"] and runs[1]["source"] == "cache" else 1


if __name__ == "__main__":
    raise SystemExit(main())

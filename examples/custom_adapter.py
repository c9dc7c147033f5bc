"""Registering a weightcache adapter for a new engine.

``ToyEngine`` below stands for any inference engine with a loader of its own: it reads separate q/k/v
projections from the checkpoint and fuses them into one qkv matrix, and after loading it post-processes every
linear layer (``process_weights_after_loading``: the weight is replaced by its transpose, stored contiguous,
under another name), as real engines repack weights for their kernels. Its ``load_format`` lets a loader in.

``ToyEngineBackend`` is the adapter: a :class:`weightcache.backends.Backend` subclass, registered with
``weightcache.backends.register``. Like the vLLM and SGLang adapters it implements only the hooks: how the
engine builds its model (``build_model``, on the meta device) and how it loads and post-processes it from disk
(``load_from_disk``). ``Backend.load_model`` owns the rest: modes, fallbacks, publishing with bounded memory,
binding the published layout into the meta model.

Two engine processes run: the first in mode daemon (loads, fuses, post-processes, publishes), the second in
mode client (attaches the post-processed weights: its loader and post-processing never run). Their outputs are
identical. The keeper lives in a temporary socket directory, removed at the end.

    python examples/custom_adapter.py [--json] [--device cuda:0]
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
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

import weightcache as wc
from weightcache import backends
from weightcache.backends import Backend, LoaderOptions, QuantSpec
from weightcache.backends.base import quant_spec_from_config

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

    def __init__(self, checkpoint: str, load_format: Any = "default", device: str = "cpu") -> None:
        self.checkpoint = checkpoint
        self.device = torch.device(device)
        self.config = json.loads((Path(checkpoint) / "config.json").read_text())
        self.post_processed = 0  # how many layers this process post-processed
        loader = DefaultLoader() if load_format == "default" else load_format
        self.model = loader.load_model(self)

    def build(self) -> ToyModel:
        with torch.device("meta"):
            return ToyModel(self.config["dim"], self.config["layers"])


class DefaultLoader:
    def load_model(self, engine: ToyEngine) -> ToyModel:
        state = {}
        with safe_open(str(Path(engine.checkpoint) / "model.safetensors"), framework="pt") as f:
            for i in range(engine.config["layers"]):  # fuse q, k, v into one matrix, on the host, layer by layer
                p = f"layers.{i}"
                qkv = torch.cat([f.get_tensor(f"{p}.{n}_proj.weight") for n in "qkv"])
                state[f"{p}.qkv.weight"] = qkv.to(engine.device)
                state[f"{p}.o.weight"] = f.get_tensor(f"{p}.o_proj.weight").to(engine.device)
        model = engine.build()
        model.load_state_dict(state, assign=True)
        state.clear()  # the model holds the weights now: post-processing replaces them layer by layer
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

    # The two hooks every adapter implements; the context is whatever the engine hands its loader.
    def build_model(self, engine: ToyEngine) -> nn.Module:
        return engine.build()  # called on the meta device

    def load_from_disk(self, engine: ToyEngine) -> nn.Module:
        return DefaultLoader().load_model(engine)  # the engine's own load and post-processing


class WeightCacheLoader:
    """What the engine gets as its load_format: the engine's side of the adapter."""

    def __init__(self, options: LoaderOptions) -> None:
        self.options = options
        self.backend = backends.get("toyengine")
        self.source = "disk"
        self.handle: wc.Handle | None = None

    def load_model(self, engine: ToyEngine) -> nn.Module:
        def describe() -> wc.Fingerprint:  # asked only when the cache can be used with this engine
            return self.backend.make_fingerprint(
                engine.checkpoint,
                dtype=torch.float32,
                engine_quant=None,  # the engine's quantization config: checked before anything loads
                parallel=lambda: {"tp": (0, 1)},
                device=engine.device,
                identity=engine.config,  # the engine's model config joins the fingerprint
            )

        # serve_engine: the kill switch (WEIGHTCACHE_MODE), the engine's release, then load_model's sequence
        loaded = self.backend.serve_engine(engine, describe=describe, device=engine.device, options=self.options)
        self.handle, self.source = loaded.handle, loaded.source
        return loaded.model


# --- running it: two engine processes ----------------------------------------------------------------------------


def make_checkpoint(path: Path, dim: int = 256, layers: int = 4) -> None:
    torch.manual_seed(0)
    names = ("q_proj", "k_proj", "v_proj", "o_proj")
    state = {f"layers.{i}.{n}.weight": torch.randn(dim, dim) / dim**0.5 for i in range(layers) for n in names}
    path.mkdir(parents=True)
    save_file(state, str(path / "model.safetensors"))
    (path / "config.json").write_text(json.dumps({"architectures": ["ToyModel"], "dim": dim, "layers": layers}))


def serve(checkpoint: str, mode: str, socket_dir: str, device: str = "cpu") -> dict[str, Any]:
    """One engine start with the adapter as its loader, and one request."""
    loader = WeightCacheLoader(LoaderOptions.parse({"mode": mode, "socket_dir": socket_dir}, where="serve"))
    engine = ToyEngine(checkpoint, load_format=loader, device=device)
    x = torch.randn(2, 8, engine.config["dim"], generator=torch.Generator().manual_seed(1)).to(device)
    with torch.no_grad():
        out = engine.model(x).cpu()
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
    parser.add_argument("--device", default="cpu", help="where the engine runs (cpu, cuda:0, ...); default cpu")
    args = parser.parse_args()
    if args.serve:
        print(json.dumps(serve(*args.serve, device=args.device)))
        return 0
    work = Path(tempfile.mkdtemp(prefix="wc-adapter-"))
    checkpoint, socket_dir = work / "checkpoint", work / "sock"
    make_checkpoint(checkpoint)
    runs = []
    try:
        for mode in ("daemon", "client"):  # each a fresh engine process
            cmd = [sys.executable, __file__, "--serve", str(checkpoint), mode, str(socket_dir), "--device", args.device]
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

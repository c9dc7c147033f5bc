"""The small model the multi-process examples share: residual MLP blocks, saved as a bf16 safetensors checkpoint.

Not an example itself: demo.py, two_engines.py and hot_standby.py import it (each engine process builds it on meta).
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import nn


class MLPModel(nn.Module):
    """A stack of residual MLP blocks and an output projection."""

    def __init__(self, layers: int, hidden: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(hidden), nn.Linear(hidden, 4 * hidden), nn.GELU(), nn.Linear(4 * hidden, hidden))
            for _ in range(layers)
        )
        self.out = nn.Linear(hidden, 16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = x + layer(x)
        return self.out(x)


def make_checkpoint(path: Path, size_mib: int, hidden: int = 1024) -> int:
    """Write a bf16 checkpoint of about ``size_mib`` MiB (random weights, fixed seed) to ``path``; return its
    number of layers. The layer count and width go to config.json, where engines read them."""
    from safetensors.torch import save_file

    per_layer = (2 * 4 * hidden * hidden + 7 * hidden) * 2
    layers = max(1, round(size_mib * 2**20 / per_layer))
    torch.manual_seed(0)
    model = MLPModel(layers, hidden).to(torch.bfloat16)
    path.mkdir(parents=True, exist_ok=True)
    save_file(model.state_dict(), str(path / "model.safetensors"))
    config = {"architectures": ["MLPModel"], "layers": layers, "hidden": hidden}
    (path / "config.json").write_text(json.dumps(config))
    return layers


def meta_model(checkpoint: str | Path) -> MLPModel:
    """The model for ``checkpoint``, built on the meta device (no memory): weights come from attach."""
    config = json.loads((Path(checkpoint) / "config.json").read_text())
    with torch.device("meta"):
        return MLPModel(config["layers"], config["hidden"]).to(torch.bfloat16)


def request(checkpoint: str | Path, device: torch.device | str) -> torch.Tensor:
    """The same input every time: a batch of 4 rows."""
    hidden = json.loads((Path(checkpoint) / "config.json").read_text())["hidden"]
    g = torch.Generator().manual_seed(1)
    return torch.randn(4, hidden, generator=g, dtype=torch.float32).to(torch.bfloat16).to(device)


def run(model: nn.Module, x: torch.Tensor) -> str:
    """One forward pass, finished (copied to the host), as a short digest of the output's bytes."""
    with torch.no_grad():
        out = model(x).float().cpu()  # .cpu() waits for the GPU: the result exists when this returns
    return hashlib.sha256(out.numpy().tobytes()).hexdigest()[:16]


def weight_bytes(model: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in model.state_dict().values())

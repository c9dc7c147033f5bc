"""Small real models and checkpoints for the tests (importable by worker processes)."""

from __future__ import annotations

import os
from pathlib import Path

import torch
from safetensors.torch import save_file
from torch import nn


class Block(nn.Module):
    def __init__(self, dim: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.up = nn.Linear(dim, 4 * dim)
        self.down = nn.Linear(4 * dim, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.down(torch.nn.functional.gelu(self.up(self.norm(x))))


class TinyLM(nn.Module):
    """Embedding, blocks, tied output head, a persistent buffer and a non-persistent one."""

    def __init__(self, vocab: int = 256, dim: int = 64, layers: int = 2) -> None:
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(Block(dim) for _ in range(layers))
        self.head = nn.Linear(dim, vocab, bias=False)
        self.head.weight = self.embed.weight  # tied
        self.register_buffer("scale", torch.ones(dim))
        self.register_buffer("positions", torch.arange(16), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        x = self.embed(ids) * self.scale
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def make_checkpoint(directory: str | os.PathLike[str], *, seed: int = 0, shards: int = 1, **kw: int) -> Path:
    """Save a randomly initialised TinyLM as safetensors (the tied head only under its embedding name)."""
    torch.manual_seed(seed)
    model = TinyLM(**kw)
    with torch.no_grad():
        model.scale.uniform_(0.5, 1.5)
    state = {k: v.contiguous() for k, v in model.state_dict().items() if k != "head.weight"}
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    names = sorted(state)
    if shards == 1:
        save_file(state, str(path / "model.safetensors"))
    else:
        import json

        weight_map = {}
        for i in range(shards):
            part = {n: state[n] for n in names[i::shards]}
            fname = f"model-{i + 1:05d}-of-{shards:05d}.safetensors"
            save_file(part, str(path / fname))
            weight_map.update(dict.fromkeys(part, fname))
        (path / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    config = {"architectures": ["TinyLM"], "model_type": "tiny", "tiny": kw}
    (path / "config.json").write_text(__import__("json").dumps(config))
    return path


def model_kwargs(checkpoint: str | os.PathLike[str]) -> dict[str, int]:
    import json

    return dict(json.loads((Path(checkpoint) / "config.json").read_text()).get("tiny", {}))


def meta_model(**kw: int) -> TinyLM:
    """A TinyLM built on the meta device, its non-persistent buffer materialised as engines do."""
    with torch.device("meta"):
        model = TinyLM(**kw)
    model.positions = torch.arange(16)
    return model


def reference_output(checkpoint: str | os.PathLike[str], dtype: torch.dtype | None = None) -> torch.Tensor:
    """Forward pass of a model loaded the plain PyTorch way (load_state_dict), for comparisons."""
    from safetensors.torch import load_file

    model = TinyLM(**model_kwargs(checkpoint))
    state = {}
    for f in sorted(Path(checkpoint).glob("*.safetensors")):
        state.update(load_file(str(f)))
    model.load_state_dict(state, strict=False)
    if dtype is not None:
        model = model.to(dtype)
    with torch.no_grad():
        return model(INPUT_IDS)


INPUT_IDS = torch.tensor([[1, 5, 9, 42, 7, 200, 3, 3]])

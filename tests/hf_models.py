"""Tiny random transformers models for the tests: one configuration per architecture, saved with
``save_pretrained`` (safetensors). Built locally; nothing is downloaded.

Each architecture is here for what it exercises in loading (see docs/guides/transformers.md for the table).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

COMMON: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 64,
}


def _configs() -> dict[str, Callable[[], Any]]:
    import transformers as tf

    c = COMMON
    return {
        # dense, RoPE llama3 scaling, tied embeddings
        "llama": lambda: tf.LlamaConfig(
            **c,
            tie_word_embeddings=True,
            rope_parameters={
                "rope_type": "llama3",
                "rope_theta": 10000.0,
                "factor": 8.0,
                "low_freq_factor": 1.0,
                "high_freq_factor": 4.0,
                "original_max_position_embeddings": 32,
            },
        ),
        # sliding-window attention, untied
        "mistral": lambda: tf.MistralConfig(**c, sliding_window=8, tie_word_embeddings=False),
        # attention biases, dynamic NTK RoPE, untied
        "qwen2": lambda: tf.Qwen2Config(
            **c,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
        ),
        # q/k norms, tied
        "qwen3": lambda: tf.Qwen3Config(**c, head_dim=16, tie_word_embeddings=True),
        # computed embed_scale, local and global rotary tables, alternating sliding window, tied
        "gemma3": lambda: tf.Gemma3TextConfig(**c, head_dim=16, sliding_window=8, tie_word_embeddings=True),
        # fused qkv and gate_up projections, LongRoPE (short and long factors)
        "phi3": lambda: tf.Phi3Config(
            **c,
            pad_token_id=0,
            tie_word_embeddings=False,
            rope_parameters={
                "rope_type": "longrope",
                "rope_theta": 10000.0,
                "short_factor": [1.0] * 8,
                "long_factor": [2.0] * 8,
                "original_max_position_embeddings": 32,
            },
        ),
        # MoE: experts fused at load (experts.gate_up_proj, experts.down_proj)
        "mixtral": lambda: tf.MixtralConfig(**c, num_local_experts=4, num_experts_per_tok=2),
        # MoE with q/k norms
        "qwen3_moe": lambda: tf.Qwen3MoeConfig(
            **c, head_dim=16, moe_intermediate_size=32, num_experts=4, num_experts_per_tok=2, decoder_sparse_step=1
        ),
        # MLA (low-rank q/kv, decoupled rope), MoE with a shared expert, YaRN RoPE
        "deepseek_v3": lambda: tf.DeepseekV3Config(
            **{**c, "num_key_value_heads": 4},
            moe_intermediate_size=32,
            n_routed_experts=4,
            n_shared_experts=1,
            num_experts_per_tok=2,
            n_group=1,
            topk_group=1,
            first_k_dense_replace=1,
            q_lora_rank=32,
            kv_lora_rank=16,
            qk_rope_head_dim=8,
            qk_nope_head_dim=8,
            v_head_dim=16,
            rope_parameters={
                "rope_type": "yarn",
                "rope_theta": 10000.0,
                "factor": 2.0,
                "original_max_position_embeddings": 32,
                "beta_fast": 32.0,
                "beta_slow": 1.0,
                "mscale": 1.0,
                "mscale_all_dim": 1.0,
            },
        ),
        # no RoPE: learned absolute positions, Conv1D layers, tied
        "gpt2": lambda: tf.GPT2Config(vocab_size=128, n_embd=64, n_layer=2, n_head=4, n_positions=64),
        # partial rotary (a quarter of each head), parallel residual, untied
        "gpt_neox": lambda: tf.GPTNeoXConfig(**{**c, "num_key_value_heads": None}, rotary_pct=0.25),
    }


def names() -> list[str]:
    return list(_configs())


def config(name: str) -> Any:
    return _configs()[name]()


def save(name: str, directory: Path, dtype: torch.dtype = torch.bfloat16) -> Path:
    """A random model of architecture ``name`` saved under ``directory / name``; returns that path.

    Weights are drawn wider than the architectures' own initialisation, so that greedy generation varies."""
    import transformers

    cfg = config(name)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0.0, 0.5 if p.dim() > 1 else 0.1).add_(1.0 if p.dim() == 1 else 0.0)
    path = directory / name
    model.to(dtype).save_pretrained(path)
    return path


#: Projections that block FP8 checkpoints (DeepSeek-V3, Qwen3-FP8) store in float8_e4m3fn with block scales.
FP8_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def save_fp8(name: str, directory: Path, block: int = 32) -> Path:
    """A random model saved as block FP8 checkpoints ship: each projection's weight in ``float8_e4m3fn`` with a
    float32 ``weight_scale_inv`` per ``block x block`` tile, and ``quantization_config`` ``{"quant_method":
    "fp8", "weight_block_size": [block, block]}`` in config.json. Returns the checkpoint's path."""
    import json

    from safetensors.torch import load_file, save_file

    path = save(name, directory / "fp8-source")
    out = directory / f"{name}-fp8"
    out.mkdir(parents=True)
    state = load_file(str(path / "model.safetensors"))
    quantized: dict[str, torch.Tensor] = {}
    fp8_max = torch.finfo(torch.float8_e4m3fn).max
    for key, tensor in state.items():
        module = key.rsplit(".", 2)[-2] if key.endswith(".weight") else ""
        if module not in FP8_PROJECTIONS:
            quantized[key] = tensor
            continue
        rows, cols = tensor.shape
        tiles = tensor.float().reshape(rows // block, block, cols // block, block)
        scale = tiles.abs().amax(dim=(1, 3)).clamp(min=1e-12) / fp8_max
        q = (tiles / scale[:, None, :, None]).to(torch.float8_e4m3fn).reshape(rows, cols)
        quantized[key] = q
        quantized[key.removesuffix(".weight") + ".weight_scale_inv"] = scale.contiguous()
    save_file(quantized, str(out / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    config["quantization_config"] = {
        "quant_method": "fp8",
        "weight_block_size": [block, block],
        "activation_scheme": "dynamic",
        "fmt": "e4m3",
    }
    (out / "config.json").write_text(json.dumps(config, indent=2))
    for extra in ("generation_config.json",):
        if (path / extra).exists():
            (out / extra).write_text((path / extra).read_text())
    return out

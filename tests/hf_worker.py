"""One engine start per architecture, in one new process: ``python hf_worker.py MODE SOCKET_DIR DEVICE NAME=CKPT ...``.

Each model is built on meta exactly as the README shows (``AutoModelForCausalLM.from_config`` under
``torch.device("meta")``), attached in MODE, and generates greedily. Mode ``off`` also generates with the model
transformers' own ``from_pretrained`` loads, without weightcache: the reference. Prints one JSON line.

Block-FP8 models run transformers' FP8 modules (``FP8Linear``, loaded by its quantizer); their matmul is a Triton
kernel that the ``kernels`` package fetches from the Hugging Face Hub. Where it cannot be loaded (no network, as
on the test machines), ``fp8_linear`` is replaced by a dequantizing matmul, the same in every mode, and the
results say so (``fp8_matmul``).
"""

from __future__ import annotations

import json
import sys

import torch
import transformers

import weightcache as wc

PROMPT = [[1, 17, 42, 99, 7]]
NEW_TOKENS = 12


def generate(model: torch.nn.Module, device: str) -> list[int]:
    ids = torch.tensor(PROMPT, device=device)
    out = model.generate(ids, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0)  # type: ignore[operator]
    return [int(t) for t in out[0]]


def dequantized_fp8_linear(
    input: torch.Tensor,
    weight: torch.Tensor,
    weight_scale_inv: torch.Tensor,
    block_size: list[int] | None = None,
    bias: torch.Tensor | None = None,
    activation_scale: torch.Tensor | None = None,
    allow_deepgemm: bool = True,
) -> torch.Tensor:
    """transformers' ``fp8_linear`` (block-wise, dynamic activations) as a dequantize and a plain matmul."""
    rows, cols = weight.shape
    block_rows, block_cols = block_size if block_size is not None else (rows, cols)
    scale = weight_scale_inv.float().repeat_interleave(block_rows, 0)[:rows].repeat_interleave(block_cols, 1)
    full = (weight.float() * scale[:, :cols]).to(input.dtype)
    return torch.nn.functional.linear(input, full, bias)


def fp8_matmul() -> str:
    """Which FP8 matmul transformers' FP8Linear runs here: its kernel, or the dequantizing stand-in."""
    from transformers.integrations import finegrained_fp8

    try:
        finegrained_fp8.load_finegrained_fp8_kernel()
        return "transformers kernel"
    except Exception as exc:  # ImportError (no `kernels`), or the Hub is unreachable
        finegrained_fp8.fp8_linear = dequantized_fp8_linear
        return f"dequantized ({type(exc).__name__})"


def main() -> None:
    mode, socket_dir, device = sys.argv[1:4]
    results: dict[str, dict[str, object]] = {}
    matmul = fp8_matmul() if device != "cpu" else "none"
    for spec in sys.argv[4:]:
        name, _, ckpt = spec.partition("=")
        config = transformers.AutoConfig.from_pretrained(ckpt)
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config)
        handle = wc.attach(model, ckpt, mode=mode, device=device, socket_dir=socket_dir, strict=mode == "client")
        model.eval()
        on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
        result = {
            "source": handle.source,
            "read_disk": handle.read_disk,
            "tokens": generate(model, device),
            "on_meta": on_meta,
            "engine": handle.fingerprint.engine,
            "quant": handle.fingerprint.quant,
            "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
            "fp8_matmul": matmul,
        }
        if mode == "off":
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, device_map=None if device == "cpu" else device
            )
            result["reference"] = generate(reference.eval(), device)
        results[name] = result
        del model
        handle.close()
    print(json.dumps(results))


if __name__ == "__main__":
    main()

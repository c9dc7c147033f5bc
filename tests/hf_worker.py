"""Engine starts, one per architecture and way of building it, in one new process:
``python hf_worker.py MODE SOCKET_DIR DEVICE BUILDS NAME=CKPT ...``.

Each model is built on meta (``AutoModelForCausalLM.from_config`` under ``torch.device("meta")``) in each of the
comma-separated BUILDS, attached in MODE, and generates greedily:

- ``config``: ``from_config(config, dtype=torch.bfloat16)``, as the README shows;
- ``to``: ``from_config(config)``, then ``model.to(torch.bfloat16)``, as PyTorch's guide to the meta device shows;
  this converts the buffers that transformers computes in float32 (rotary ``inv_freq``) too.

Mode ``off`` also generates with the model transformers' own ``from_pretrained`` loads, without weightcache (and
then ``.to(torch.bfloat16)``, for the build ``to``): the reference. Prints one JSON line, keyed ``NAME/BUILD``.

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
DTYPE = torch.bfloat16


def build(config: object, how: str) -> torch.nn.Module:
    with torch.device("meta"):
        if how == "config":
            return transformers.AutoModelForCausalLM.from_config(config, dtype=DTYPE)
        if how == "to":
            return transformers.AutoModelForCausalLM.from_config(config).to(DTYPE)
    raise ValueError(f"unknown build {how!r}")


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
    mode, socket_dir, device, builds = sys.argv[1:5]
    results: dict[str, dict[str, object]] = {}
    matmul = fp8_matmul() if device != "cpu" else "none"
    for spec in sys.argv[5:]:
        name, _, ckpt = spec.partition("=")
        config = transformers.AutoConfig.from_pretrained(ckpt)
        for how in builds.split(","):
            model = build(config, how)
            handle = wc.attach(model, ckpt, mode=mode, device=device, socket_dir=socket_dir, strict=mode == "client")
            assert not model.training, "attach leaves a transformers model in evaluation mode"
            stored = set(model.state_dict())  # the rest are buffers the model computes (rotary inv_freq)
            on_meta = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
            results[f"{name}/{how}"] = {
                "source": handle.source,
                "read_disk": handle.read_disk,
                "tokens": generate(model, device),
                "on_meta": on_meta,
                "digest": handle.fingerprint.digest,
                "engine": handle.fingerprint.engine,
                "quant": handle.fingerprint.quant,
                "dtypes": sorted({str(p.dtype) for p in model.parameters()}),
                "computed": sorted(
                    {str(b.dtype) for n, b in model.named_buffers() if n not in stored and b.is_floating_point()}
                ),
                "fp8_matmul": matmul,
            }
            del model
            handle.close()
        if mode == "off":
            reference = transformers.AutoModelForCausalLM.from_pretrained(
                ckpt, device_map=None if device == "cpu" else device
            ).eval()
            if "config" in builds.split(","):
                results[f"{name}/config"]["reference"] = generate(reference, device)
            if "to" in builds.split(","):  # what the build's .to() makes of the computed buffers
                results[f"{name}/to"]["reference"] = generate(reference.to(DTYPE), device)
    print(json.dumps(results))


if __name__ == "__main__":
    main()

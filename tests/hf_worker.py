"""One engine start per architecture, in one new process: ``python hf_worker.py MODE SOCKET_DIR DEVICE NAME=CKPT ...``.

Each model is built on meta exactly as the README shows (``AutoModelForCausalLM.from_config`` under
``torch.device("meta")``), attached in MODE, and generates greedily. Mode ``off`` also generates with the model
transformers' own ``from_pretrained`` loads, without weightcache: the reference. Prints one JSON line.
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


def main() -> None:
    mode, socket_dir, device = sys.argv[1:4]
    results = {}
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

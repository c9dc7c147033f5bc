"""The CLI's ``load``: a checkpoint read from disk and published into the keeper (starting one if needed), as a
plain module's weights or, with ``--engine transformers``, a transformers model's.

Layer L5 (tools), on the library's public API (``wc.preload``, :func:`weightcache.backends.transformers.preload`).
Imports torch only when the command runs, never with the module.
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Callable

import weightcache as wc
from weightcache.units import format_bytes

from .cli_common import printable


def cmd_load(args: argparse.Namespace) -> int:
    try:
        quant_config = json.loads(args.quant_config) if args.quant_config else None
    except ValueError as exc:
        raise wc.WeightCacheError(f"bad argument: --quant-config is not JSON: {exc}") from exc
    t0 = time.perf_counter()
    if args.engine == "transformers":
        handle = _load_transformers(args, quant_config)
    else:
        handle = wc.preload(  # imports torch
            args.checkpoint,
            device=args.device,
            dtype=args.dtype,
            quant=args.quant,
            quant_config=quant_config,
            socket_dir=args.socket_dir,
            progress=None,
            digests=not args.no_digests,
            max_segment_bytes=args.max_segment_bytes,
        )
    seconds = time.perf_counter() - t0
    fp = handle.fingerprint
    size, count = handle.nbytes, len(handle.tensors)
    handle.close()
    if not handle.read_disk:
        print(printable(f"already cached: {fp.digest[:12]}  {fp.describe()}"))
        return 0
    print(printable(f"published {fp.digest[:12]}  {fp.describe()}"))
    print(f"  {count} tensors, {format_bytes(size)} in {seconds:.2f} s")
    for key in handle.evicted:  # the keeper's budget made room: say so here, not only in its log
        print(printable(f"  evicted {key} (unleased, least recently used) to make room under the keeper's budget"))
    return 0


def _load_transformers(args: argparse.Namespace, quant_config: object) -> wc.Handle:
    """``load --engine transformers``: the entry of a transformers model built from the checkpoint's config.json
    (:func:`weightcache.backends.transformers.preload`)."""
    if args.quant != "none" or quant_config is not None:
        raise wc.WeightCacheError(
            "--engine transformers takes the quantization from the checkpoint's config.json (quantization_config); "
            "leave out --quant and --quant-config"
        )
    try:
        import transformers  # noqa: F401 (only whether it is there)
    except ImportError as exc:
        raise wc.EngineNotInstalled(
            f"--engine transformers needs the transformers package ({exc}); install it with "
            "`pip install '.[transformers]'` in a clone of the weightcache repository (weightcache is not on PyPI), "
            "or load without --engine for a plain module"
        ) from None
    from weightcache.backends.transformers import preload

    return preload(
        args.checkpoint,
        device=args.device,
        dtype=args.dtype,
        socket_dir=args.socket_dir,
        progress=None,
        digests=not args.no_digests,
        max_segment_bytes=args.max_segment_bytes,
    )


def add_commands(add: Callable[[str, str], argparse.ArgumentParser]) -> None:
    """Add ``load`` to the CLI, through its ``add`` (which gives it ``--socket-dir``)."""
    p = add(
        "load",
        "load a checkpoint from disk and publish it into the keeper (starting one if needed): as a plain module's "
        "weights (the checkpoint's tensors, what weightcache.attach of a plain nn.Module attaches), or with "
        "--engine transformers as a Hugging Face transformers model's. vLLM and SGLang entries hold their own "
        "post-processed weights: the engine's first start in mode daemon publishes them, not this command",
    )
    p.add_argument("checkpoint", help="directory of .safetensors files (or one file)")
    p.add_argument(
        "--engine",
        choices=["torch", "transformers"],
        default="torch",
        help="whose entry to make: torch (default: a plain nn.Module's) or transformers (the model "
        "AutoModelForCausalLM.from_config builds from the checkpoint's config.json on meta, in --dtype or the "
        "config's dtype, loaded by transformers' from_pretrained)",
    )
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda:N")
    p.add_argument(
        "--dtype", default=None, help="convert floating point weights, e.g. bfloat16 or bf16 (default: as stored)"
    )
    p.add_argument("--quant", default="none", help="quantization method of the weights (default none)")
    p.add_argument("--quant-config", default=None, help="the method's config as JSON")
    p.add_argument("--no-digests", action="store_true", help="skip per-tensor content digests")
    p.add_argument("--max-segment-bytes", type=int, default=None, help=argparse.SUPPRESS)
    p.set_defaults(func=cmd_load)

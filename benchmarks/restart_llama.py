"""A whole engine restart, process start to first greedy token: a Llama-3-8B-shaped model, mode off vs client.

The model is built from a transformers ``LlamaConfig`` with Llama-3-8B's shapes (32 layers, hidden 4096, MLP
14336, 32 heads of which 8 KV heads, vocabulary 128,256: 8.0 B parameters, 16 GB in bf16) and random weights,
on the device, and saved once as a safetensors checkpoint in ``--workdir``; nothing is downloaded. Then each
engine is a fresh process that goes, with a timestamp after each step:

    start Python -> import torch -> create the CUDA context -> import transformers and build the model on the
    meta device (the engine's own start) -> import weightcache -> attach (mode off: read the checkpoint, page
    cache dropped; mode client: attach from the keeper) -> first forward pass of a 16-token prompt and its
    greedy next token on the host

Each step also reports the time CPython spent in garbage collections inside it: a fresh interpreter owes one full
collection of its import-time objects, and which step pays it shows. Mode daemon's first start runs once between
them (it loads, publishes and attaches). Every engine's logits of
the first forward pass are hashed: off, daemon and client must be bitwise identical. Needs transformers.

    PYTHONPATH=$PWD python benchmarks/restart_llama.py --device cuda:0 --workdir /tmp/llama8b --json out.json

``--layers``/``--hidden``/... shrink the model (the test suite runs a tiny one on the CPU). ``--warm`` adds the
mode ``client (warm)``: the same client engine started by ``weightcache run`` from a warm process that preloaded
torch, transformers' Llama classes and weightcache's ``attach`` (:data:`WARM_PRELOADS`), started and waited for
before the first engine; its rounds alternate with the plain client's. Its "python start" includes the launcher.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

#: Llama-3-8B (meta-llama/Meta-Llama-3-8B config.json), but random weights.
LLAMA3_8B = {
    "vocab_size": 128256,
    "hidden_size": 4096,
    "intermediate_size": 14336,
    "num_hidden_layers": 32,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "max_position_embeddings": 8192,
    "rope_theta": 500000.0,
    "rms_norm_eps": 1e-5,
    "tie_word_embeddings": False,
    "bos_token_id": 128000,
    "eos_token_id": 128001,
}

ENGINE = r"""
import sys, time
t = {"start": time.time()}
import gc
gc_ms = {}  # milliseconds of garbage collection per step (the step that ends at the next milestone)
def on_gc(phase, info, _t=[0.0]):
    if phase == "start":
        _t[0] = time.perf_counter()
    else:
        step = ("torch", "cuda", "model", "weightcache", "attach", "forward")[len(t) - 1] if len(t) < 7 else "after"
        gc_ms[step] = gc_ms.get(step, 0.0) + (time.perf_counter() - _t[0]) * 1e3
gc.callbacks.append(on_gc)
import hashlib, json
import torch
t["torch"] = time.time()
mode, ckpt, device, sock = sys.argv[1:5]
if device.startswith("cuda"):
    torch.zeros(1, device=device)
    torch.cuda.synchronize(device)
t["cuda"] = time.time()
import transformers
config = transformers.AutoConfig.from_pretrained(ckpt)
torch.set_default_dtype(torch.bfloat16)  # as engines build their models: in the checkpoint's dtype
with torch.device("meta"):
    model = transformers.LlamaForCausalLM(config)
torch.set_default_dtype(torch.float32)
# non-persistent buffers are computed, not stored: the rotary embedding is built on the real device
with torch.device(device):
    model.model.rotary_emb = type(model.model.rotary_emb)(config=config)
model.eval()
t["model"] = time.time()
import weightcache as wc
attach = wc.attach
t["weightcache"] = time.time()
handle = attach(model, ckpt, mode=mode, device=device, socket_dir=sock, strict=mode == "client")
if device.startswith("cuda"):
    torch.cuda.synchronize(device)
t["attach"] = time.time()
ids = torch.arange(1, 17, device=device).unsqueeze(0) * 101 % config.vocab_size
with torch.no_grad():
    logits = model(ids).logits[0, -1]
token = int(logits.argmax())
t["forward"] = time.time()
digest = hashlib.sha256(logits.float().cpu().numpy().tobytes()).hexdigest()
print(json.dumps({"mode": mode, "source": handle.source, "token": token, "logits": digest, "t": t, "gc_ms": gc_ms}),
      flush=True)
"""

#: What the warm process of ``--warm`` imports: everything the engine imports before its model exists.
WARM_PRELOADS = "torch,transformers:AutoConfig,transformers:LlamaForCausalLM,weightcache:attach"

#: (column, from milestone, to milestone); "launch" is the parent's clock just before it starts the process.
STEPS = (
    ("python start", "launch", "start"),
    ("torch import", "start", "torch"),
    ("CUDA init", "torch", "cuda"),
    ("transformers + meta model", "cuda", "model"),
    ("weightcache import", "model", "weightcache"),
    ("attach / load", "weightcache", "attach"),
    ("first forward + token", "attach", "forward"),
    ("total to first token", "launch", "forward"),
)


def build_checkpoint(path: Path, device: str, overrides: dict[str, Any]) -> None:
    """Random bf16 weights of the configured shapes, made on ``device``, saved as safetensors shards."""
    import torch
    import transformers

    settings = {**LLAMA3_8B, **overrides}
    if settings["vocab_size"] <= settings["eos_token_id"]:  # a shrunk vocabulary: no special tokens
        settings.update(bos_token_id=None, eos_token_id=None)
    config = transformers.LlamaConfig(**settings)
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path, safe_serialization=True, max_shard_size="5GB")
    del model
    if device.startswith("cuda"):
        torch.cuda.empty_cache()


def engine(mode: str, ckpt: Path, device: str, socket_dir: Path, *, warm: bool = False) -> dict[str, Any]:
    """One fresh engine; ``warm``: started by ``weightcache run`` from the warm process of :data:`WARM_PRELOADS`."""
    launcher = [sys.executable, "-m", "weightcache", "run", "--socket-dir", str(socket_dir)]
    launcher += ["--preload", WARM_PRELOADS, "--"]
    launch = time.time()
    out = subprocess.run(
        [*(launcher if warm else []), sys.executable, "-c", ENGINE, mode, str(ckpt), device, str(socket_dir)],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    if out.returncode != 0:
        raise SystemExit(f"engine in mode {mode} failed:\n{out.stderr[-4000:]}")
    if warm and "weightcache run:" in out.stderr:  # it started directly: not what this row measures
        raise SystemExit(f"the warm process did not start the engine:\n{out.stderr[-4000:]}")
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    result["t"]["launch"] = launch
    result["ms"] = {name: (result["t"][b] - result["t"][a]) * 1e3 for name, a, b in STEPS}
    return result


def summary(runs: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Median, min and max of every step, and the median of the garbage collection time inside it."""
    return {
        name: {
            "median": round(statistics.median(r["ms"][name] for r in runs), 1),
            "min": round(min(r["ms"][name] for r in runs), 1),
            "max": round(max(r["ms"][name] for r in runs), 1),
            "gc_median": round(statistics.median(_gc_in(r, a, b) for r in runs), 1),
        }
        for name, a, b in STEPS
    }


def _gc_in(run: dict[str, Any], start: str, end: str) -> float:
    """Collection time inside the steps from milestone ``start`` to ``end``."""
    order = ("launch", "start", "torch", "cuda", "model", "weightcache", "attach", "forward")
    steps = order[order.index(start) + 1 : order.index(end) + 1]
    return float(sum(run["gc_ms"].get(step, 0.0) for step in steps))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--device", default="cuda:0")
    parser.add_argument("--workdir", default=None, help="where the checkpoint is written (kept; reused if there)")
    parser.add_argument("--repeat", type=int, default=5, help="fresh engines per mode (default 5)")
    parser.add_argument("--json", dest="json_out", default=None)
    parser.add_argument("--no-drop", action="store_true", help="do not drop the page cache before mode off")
    parser.add_argument("--warm", action="store_true", help="also clients started from a warm process")
    for key in ("num_hidden_layers", "hidden_size", "intermediate_size", "vocab_size"):
        parser.add_argument("--" + key.replace("_", "-"), type=int, default=None, help=f"override {key}")
    parser.add_argument("--num-attention-heads", type=int, default=None)
    parser.add_argument("--num-key-value-heads", type=int, default=None)
    args = parser.parse_args()
    keys = (
        "num_hidden_layers",
        "hidden_size",
        "intermediate_size",
        "vocab_size",
        "num_attention_heads",
        "num_key_value_heads",
    )
    overrides = {k: getattr(args, k) for k in keys if getattr(args, k) is not None}

    import torch

    import weightcache as wc
    from weightcache.checkpoint import drop_page_cache

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-llama-"))
    ckpt = work / "llama3-8b-random"
    if not (ckpt / "config.json").exists():
        t0 = time.perf_counter()
        build_checkpoint(ckpt, args.device, overrides)
        print(f"checkpoint written to {ckpt} in {time.perf_counter() - t0:.1f} s", flush=True)
    nbytes = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-")) / "s"
    cache = wc.Cache(socket_dir, spawn=True)  # a private keeper, started before any engine
    runs: dict[str, list[dict[str, Any]]] = {"off": [], "daemon": [], "client": []}
    if args.warm:
        runs["client (warm)"] = []
        warm_start = [sys.executable, "-m", "weightcache", "warm", "start", "--socket-dir", str(socket_dir)]
        subprocess.run([*warm_start, "--preload", WARM_PRELOADS], check=True, timeout=300)
    try:
        for _ in range(args.repeat):
            if not args.no_drop:
                drop_page_cache(ckpt, system=True)
            runs["off"].append(engine("off", ckpt, args.device, socket_dir))
        if not args.no_drop:
            drop_page_cache(ckpt, system=True)
        runs["daemon"].append(engine("daemon", ckpt, args.device, socket_dir))
        for _ in range(args.repeat):
            runs["client"].append(engine("client", ckpt, args.device, socket_dir))
            if args.warm:
                runs["client (warm)"].append(engine("client", ckpt, args.device, socket_dir, warm=True))
    finally:
        if args.warm:
            warm_stop = [sys.executable, "-m", "weightcache", "warm", "stop", "--all", "--socket-dir", str(socket_dir)]
            subprocess.run(warm_stop, check=False, timeout=60)
        cache.stop(wait=30)
        shutil.rmtree(socket_dir.parent, ignore_errors=True)
    every = [r for mode_runs in runs.values() for r in mode_runs]
    identical = len({r["logits"] for r in every}) == 1 and len({r["token"] for r in every}) == 1
    sources = {mode: sorted({r["source"] for r in mode_runs}) for mode, mode_runs in runs.items()}
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "device": args.device,
        "device_name": torch.cuda.get_device_name(args.device) if args.device.startswith("cuda") else "cpu",
        "torch": torch.__version__,
        "command": " ".join([os.path.basename(sys.argv[0]), *sys.argv[1:]]),
        "checkpoint_bytes": nbytes,
        "page_cache_dropped_for_off": not args.no_drop,
        "sources": sources,
        "identical": identical,
        "summary": {mode: summary(mode_runs) for mode, mode_runs in runs.items()},
        "runs": runs,
    }
    print(
        f"{nbytes / 2**30:.2f} GiB checkpoint; medians in ms (min-max) over fresh processes [median of it in garbage "
        f"collection]; identical {identical}"
    )
    print(f"{'':28s}" + "".join(f"{m:>32s}" for m in runs))
    for name, _, _ in STEPS:
        cells = []
        for mode in runs:
            s = report["summary"][mode][name]
            cells.append(f"{s['median']:9.1f} ({s['min']:.0f}-{s['max']:.0f}) [{s['gc_median']:.0f}]")
        print(f"{name:28s}" + "".join(f"{c:>32s}" for c in cells))
    if args.json_out:
        Path(args.json_out).write_text(json.dumps(report, indent=2))
        print(f"wrote {args.json_out}")
    expected = {"off": ["disk"], "daemon": ["cache"], "client": ["cache"]}
    ok = identical and sources == {**expected, **({"client (warm)": ["cache"]} if args.warm else {})}
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())

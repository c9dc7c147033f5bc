"""Research on cached weights: open a keeper's already-quantized entry without a model or the checkpoint, and
look inside.

Step 1 (this process) makes sure a quantized entry exists: it writes a small bf16 checkpoint, quantizes it to
block-wise FP8 (DeepSeek-V3 style: float8_e4m3fn weights plus one float32 scale per 128x128 block, stored as
``<name>_scale_inv``, the factor that dequantizes) and publishes the result with ``Cache.put`` under a
fingerprint whose quantization is ``fp8_block``.

Step 2 (a separate process that builds no model and reads no checkpoint to get the weights) lists what the
keeper holds (``Cache.entries()``), opens the FP8 entry by the fingerprint the keeper reports
(``Cache.get(entry.fingerprint)``: ``handle.source == "cache"``), and inspects it: the tensor table, the FP8
weights and their scales, and the error of dequantized blocks against the original bf16 weights (read from the
checkpoint the fingerprint names, for comparison only).

What "read-only" means here, exactly:
- CPU: each segment is a memfd sealed against write, shrink and grow, mapped MAP_PRIVATE. A store into an
  attached tensor succeeds but copies that one page into the writer's private memory; the shared bytes cannot
  change (a write through the fd itself fails with EPERM). The example writes into a weight, then attaches the
  entry again and shows the fresh mapping still holds the published bytes (and verifies every digest).
- GPU: segments are mapped with read-only access (CU_MEM_ACCESS_FLAGS_PROT_READ); a store faults in the writer
  alone. The example does not provoke that fault, which would end its CUDA context.

    python examples/inspect_cache.py [--device cpu|cuda:N] [--json]
    python examples/inspect_cache.py --socket-dir DIR   # inspect an FP8 entry an existing keeper holds
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import torch

import weightcache as wc

BLOCK = (128, 128)
FP8 = torch.float8_e4m3fn
MEMFD = "/memfd:weightcache"  # the name of the segments' memfds, as /proc shows it


def quantize_fp8_block(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Block-wise FP8: every 2-D weight becomes float8_e4m3fn plus float32 ``<name>_scale_inv`` per block."""
    out: dict[str, torch.Tensor] = {}
    for name, w in state.items():
        if w.dim() != 2 or w.shape[0] % BLOCK[0] or w.shape[1] % BLOCK[1]:
            out[name] = w  # norms and biases stay in bf16
            continue
        rows, cols = w.shape[0] // BLOCK[0], w.shape[1] // BLOCK[1]
        blocks = w.float().reshape(rows, BLOCK[0], cols, BLOCK[1])
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / torch.finfo(FP8).max
        out[name] = (blocks / scale[:, None, :, None]).reshape(w.shape).to(FP8)
        out[f"{name}_scale_inv"] = scale
    return out


def dequantize(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    rows, cols = q.shape[0] // scale.shape[0], q.shape[1] // scale.shape[1]
    return q.float() * scale.repeat_interleave(rows, 0).repeat_interleave(cols, 1)


def publish(checkpoint: Path, socket_dir: Path, device: str) -> str:
    """Write a bf16 checkpoint, quantize it and publish it; return the entry's digest. The entry stays in the
    keeper after this returns (no lease needed)."""
    from safetensors.torch import save_file

    from weightcache.loader import load_state_dict

    torch.manual_seed(0)
    state = {}
    for i in range(2):
        state[f"layers.{i}.norm.weight"] = torch.ones(512, dtype=torch.bfloat16)
        state[f"layers.{i}.up.weight"] = (torch.randn(1024, 512) * 0.02).to(torch.bfloat16)
        state[f"layers.{i}.down.weight"] = (torch.randn(512, 1024) * 0.02).to(torch.bfloat16)
    checkpoint.mkdir(parents=True)
    save_file(state, str(checkpoint / "model.safetensors"))
    (checkpoint / "config.json").write_text(json.dumps({"architectures": ["ToyFP8"]}))
    fingerprint = wc.Fingerprint.create(
        checkpoint,
        dtype=torch.bfloat16,
        quant="fp8_block",
        quant_config={"weight_block_size": list(BLOCK)},
        transform=quantize_fp8_block,
        device=device,
    )
    quantized = load_state_dict(checkpoint, dtype=torch.bfloat16, transform=quantize_fp8_block)
    with wc.Cache(socket_dir, spawn=True).put(fingerprint, quantized) as handle:
        return handle.digest


def memfd_seals() -> list[str]:
    """The seals of the memfds this process holds (the segments of its attached entries)."""
    names = {fcntl.F_SEAL_WRITE: "write", fcntl.F_SEAL_SHRINK: "shrink", fcntl.F_SEAL_GROW: "grow"}
    found: set[str] = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD):
                seals = fcntl.fcntl(int(fd), fcntl.F_GET_SEALS)
                found.update(n for bit, n in names.items() if seals & bit)
        except OSError:
            continue
    return sorted(found)


def segment_fd(tensor: torch.Tensor) -> tuple[int, int]:
    """The fd of the memfd segment this process maps ``tensor`` from, and the tensor's offset in it: the mapping
    that holds its first byte (/proc/self/maps) names the memfd's inode; the fd is the one open on that inode."""
    address = tensor.data_ptr()
    for line in Path("/proc/self/maps").read_text().splitlines():
        span, _, file_offset, _, inode, *path = line.split()
        start, end = (int(a, 16) for a in span.split("-"))
        if start <= address < end and path and path[0].startswith(MEMFD):
            break
    else:
        raise SystemExit(f"no {MEMFD} mapping holds address {address:#x}")
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/self/fd/{fd}").startswith(MEMFD) and os.fstat(int(fd)).st_ino == int(inode):
                return int(fd), address - start + int(file_offset, 16)
    raise SystemExit(f"this process holds no fd of the memfd (inode {inode}) that holds address {address:#x}")


def research(socket_dir: str | None) -> dict[str, Any]:
    """Step 2: what the keeper holds, and a look inside its FP8 entry. Builds no model."""
    from safetensors import safe_open

    cache = wc.Cache(socket_dir)
    entries = cache.entries()
    listing = [
        {"digest": e.digest[:12], "model": e.model, "placement": e.placement, "quant": e.fingerprint.quant,
         "bytes": e.bytes, "tensors": e.tensors, "leases": e.leases}
        for e in entries
    ]  # fmt: skip
    fp8 = [e for e in entries if e.fingerprint.quant == "fp8_block"]
    if not fp8:
        raise SystemExit(f"the keeper at {socket_dir} holds no fp8_block entry; entries: {listing}")
    entry = fp8[0]
    handle = cache.get(entry.fingerprint)  # by the keeper's own fingerprint: no checkpoint is read
    assert handle is not None
    tensors = handle.tensors
    table = [
        {"name": n, "dtype": str(t.dtype).removeprefix("torch."), "shape": list(t.shape), "bytes": t.nbytes}
        for n, t in tensors.items()
    ]
    # Quantization error, block by block, against the original bf16 weights (read for comparison only).
    errors = {}
    with safe_open(str(Path(entry.fingerprint.model_path) / "model.safetensors"), framework="pt") as original:
        for name, q in tensors.items():
            if q.dtype != FP8:
                continue
            scale = tensors[f"{name}_scale_inv"]
            w = original.get_tensor(name).float()
            deq = dequantize(q.cpu(), scale.cpu())
            errors[name] = {
                "block": [q.shape[0] // scale.shape[0], q.shape[1] // scale.shape[1]],
                "scale_min": scale.min().item(),
                "scale_max": scale.max().item(),
                "max_abs_error": (deq - w).abs().max().item(),
                "relative_error": ((deq - w).norm() / w.norm()).item(),
                "first_block_relative_error": ((deq[:128, :128] - w[:128, :128]).norm() / w[:128, :128].norm()).item(),
            }
    result: dict[str, Any] = {
        "entries": listing,
        "entry": entry.digest,
        "source": handle.source,
        "quant": handle.fingerprint.quant,
        "tensor_table": table,
        "quantization_error": errors,
        "max_relative_error": max(e["relative_error"] for e in errors.values()),
    }
    name = next(iter(errors))
    if entry.placement == "cpu":
        result["read_only"] = write_stays_private(cache, handle, name)
    else:
        from weightcache.segments.cuda_vmm import read_only_mappings

        result["read_only"] = {"mapping": "CUDA VMM, read-only access" if read_only_mappings() else "read-write"}
    handle.close()
    return result


def write_stays_private(cache: wc.Cache, handle: wc.Handle, name: str) -> dict[str, Any]:
    """Write into an attached weight; show that only this mapping changed and the shared bytes did not."""
    maps = [line.split() for line in Path("/proc/self/maps").read_text().splitlines() if MEMFD in line]
    raw = handle.tensors[name].view(torch.uint8)
    before = int(raw[0, 0])
    raw[0, 0] = before ^ 0x7F  # a store into a MAP_PRIVATE page: the kernel copies the page for us alone
    fd, offset = segment_fd(handle.tensors[name])  # the segment that holds this weight, and where in it
    try:
        os.pwrite(fd, bytes([before ^ 0x7F]), offset)  # the same store, through the fd
        fd_write = "succeeded"
    except OSError as exc:
        fd_write = errno.errorcode.get(exc.errno or 0, str(exc))
    fresh = cache.get(handle.fingerprint)  # a second attach: a new mapping of the same shared memory
    assert fresh is not None
    out = {
        "mapping_perms": sorted({m[1] for m in maps}),  # "rw-p": private (copy-on-write), never "rw-s"
        "seals": memfd_seals(),
        "written_byte": f"{before:#04x} -> {int(raw[0, 0]):#04x} in this mapping",
        "fresh_attach_sees_original": int(fresh.tensors[name].view(torch.uint8)[0, 0]) == before,
        # every tensor still matches the digest recorded at publish time, in the fresh mapping; not in ours
        "fresh_attach_verifies": verifies(fresh),
        "written_mapping_verifies": verifies(handle),
        "write_through_fd": fd_write,
    }
    fresh.close()
    return out


def verifies(handle: wc.Handle) -> bool:
    """Whether every tensor of ``handle`` matches the content digest recorded at publish time."""
    try:
        handle.verify()
    except wc.WeightCacheError:
        return False
    return True


def show(r: dict[str, Any]) -> None:
    print("what the keeper holds:")
    for e in r["entries"]:
        print(
            f"  {e['digest']}  {e['model']}  {e['placement']}  quant={e['quant']}  {e['bytes']} B  leases={e['leases']}"
        )
    print(f"\nentry {r['entry'][:12]} opened from the {r['source']} ({r['quant']}); its tensors:")
    for t in r["tensor_table"]:
        print(f"  {t['name']:<32}{t['dtype']:<16}{t['shape']!s:<14}{t['bytes']:>10} B")
    print("\nFP8 weights dequantized (weight * scale_inv per block) against the original bf16 weights:")
    for name, e in r["quantization_error"].items():
        print(
            f"  {name:<24} block {e['block']}, scales {e['scale_min']:.2e}..{e['scale_max']:.2e}: relative "
            f"error {e['relative_error']:.4f} (first block {e['first_block_relative_error']:.4f}), "
            f"max abs {e['max_abs_error']:.2e}"
        )
    print(f"\nread-only: {json.dumps(r['read_only'])}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--device", default="cpu", help="where the entry is published: cpu or cuda:N (default cpu)")
    parser.add_argument("--socket-dir", help="inspect this keeper's FP8 entry instead of publishing one")
    parser.add_argument("--json", action="store_true", help="print one JSON object of results")
    parser.add_argument("--research", metavar="SOCKET_DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.research:
        print(json.dumps(research(args.research)))
        return 0

    work = Path(tempfile.mkdtemp(prefix="wc-inspect-"))
    socket_dir = Path(args.socket_dir) if args.socket_dir else work / "sock"
    try:
        published = publish(work / "checkpoint", socket_dir, args.device) if not args.socket_dir else None
        out = subprocess.run(
            [sys.executable, __file__, "--research", str(socket_dir)], stdout=subprocess.PIPE, text=True, timeout=300
        )
        if out.returncode != 0:
            return out.returncode
        result = json.loads(out.stdout.strip().splitlines()[-1])
        result["published"] = published
    finally:
        if not args.socket_dir:
            # wait: the keeper writes into socket_dir until it exits, so remove the directory only then
            with contextlib.suppress(wc.WeightCacheError):  # no keeper (any more): nothing to stop
                wc.Cache(socket_dir).stop(wait=30)
        shutil.rmtree(work, ignore_errors=True)
    if args.json:
        print(json.dumps(result))
    else:
        show(result)
    return 0 if result["source"] == "cache" else 1


if __name__ == "__main__":
    raise SystemExit(main())

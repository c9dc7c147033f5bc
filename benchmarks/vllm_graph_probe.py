"""vLLM's CUDA graphs seen from inside, over fresh processes (issue 31, the vLLM artifact kind's first step:
research, not product code). Runs on a GPU with vLLM installed; nothing is downloaded.

Each run is a fresh process with vLLM in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) on a Llama-3-8B-shaped
config with dummy weights (``load_format="dummy"``), vLLM's defaults otherwise (torch.compile, CUDA graphs), the KV
cache pinned with ``kv_cache_memory_bytes`` (a profiled size would move every address after it) and one compile
cache for every run (the first fills it). ``torch.cuda.CUDAGraph`` is replaced, before vLLM is imported, by a
subclass that keeps each captured graph (``keep_graph=True``) and times its capture. After the engine started and
generated 8 greedy tokens, every kept graph is walked with weightcache's describer (``weightcache.graphs``): its
node kinds, whether a description can hold it, how many of its argument words point into which of PyTorch's
segments (``torch.cuda.memory_snapshot``: default pool or a private graph pool) and into device memory outside
them, and digests of its description and of its pointer set. With ``--sites`` (the default) the allocator records
where each allocation was made (``torch.cuda.memory._record_memory_history``, before vLLM is imported), and every
block of PyTorch's memory a graph points into is listed once: its address, size, pool, whether it is still
allocated, and the vLLM (or torch) lines that allocated it: the buffers a restore must have at the same addresses,
and which code makes them. Then each describable graph is rebuilt from its description and instantiated (what a
restore would do, without the address checks), timed. Last (``--no-replay`` leaves it out), each graph vLLM keeps
(its Model Runner V2's FULL graphs, whose output is the manager's ``hidden_states``, and the first 600 entries of
its ``CUDAGraphWrapper`` pieces, whose output is the entry's) is replayed twice (the same bytes, or it is not
compared), its output filled with NaN (-1), and the graph rebuilt from its description launched in its place: are
the bytes the same? (A line of its own after the result: a fault there loses only this part.)

With ``--arena``, vLLM's graph pool is a ``wc.GraphCache``'s (its arena, set as vLLM's global graph pool before the
engine starts), and after the engine served, the model's parameters and every CUDA tensor the model runner reaches
(by attribute path) are declared to it with ``GraphCache.external``: each graph's pointers are then counted by what
would hold them in a weightcache restore (the arena, the weights, a runner tensor by name) and what nothing holds
(with the block and the code that allocated it): how far the GraphCache route covers vLLM's graphs.

Across runs it answers: do two fresh warm starts place every segment at the same address (the caching allocator
fed the same sequence)? Are the graphs' descriptions byte-identical? What does a restore cost beside vLLM's
capture, and which nodes can a description not hold? Which buffers outside the graph pool do the graphs read
and write, who allocates them, and are they at the same address in every warm start?

    PYTHONPATH=$PWD python benchmarks/vllm_graph_probe.py --workdir /tmp/vgp --runs 3 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

CHILD = r"""
import hashlib, json, logging, os, re, sys, time
from collections import Counter
t0 = time.time()
import torch
if sys.argv[3] == "sites":  # where each block was allocated (python frames), before anything is allocated
    torch.cuda.memory._record_memory_history(max_entries=200000, context="alloc", stacks="python")

kept = []  # (graph, capture seconds)


class Kept(torch.cuda.CUDAGraph):
    def __new__(cls, keep_graph=False):
        return super().__new__(cls, True)

    def __init__(self, keep_graph=False):  # torch 2.11 takes keep_graph in __init__ (a call passes both the same)
        try:
            super().__init__(True)
        except TypeError:
            super().__init__()

    def capture_begin(self, *args, **kwargs):
        self._t = time.perf_counter()
        return super().capture_begin(*args, **kwargs)

    def capture_end(self):
        out = super().capture_end()
        captured = time.perf_counter()
        self.instantiate()  # what capture_end does without keep_graph; timed apart
        kept.append((self, captured - self._t, time.perf_counter() - captured))
        return out


torch.cuda.CUDAGraph = Kept
torch.cuda.graphs.CUDAGraph = Kept
try:  # every module the engine loads, kept, and which image each module came from (before the first kernel)
    from weightcache.graphs.cubins import keep_kernel_images

    recorder = keep_kernel_images()
except Exception as exc:
    print("no kernel images kept:", exc, file=sys.stderr)
    recorder = None
x = torch.zeros(4, device="cuda")
check = Kept()
with torch.cuda.graph(check):
    y = x + 1
check.raw_cuda_graph()  # fails here, not after the engine, if the graph was not kept
kept.clear()
lines = []


class Lines(logging.Handler):
    def emit(self, record):
        lines.append((round(time.time() - t0, 2), record.getMessage()))


from vllm import LLM, SamplingParams

logging.getLogger("vllm").addHandler(Lines())
t_import = time.time() - t0
arena = None
if sys.argv[4] == "arena":  # vLLM's graph pool served from a GraphCache's arena, before the engine exists
    from vllm.platforms import current_platform
    from weightcache.torch_graphs import GraphCache

    arena = GraphCache("0" * 64, {"probe": "vllm"}, device="cuda:0", socket_dir=os.environ["WC_PROBE_SOCKETS"],
                       verify=False)
    assert arena.pool is not None, arena.reason
    platform_cls = type(current_platform)
    platform_cls._global_graph_pool = arena.pool
kwargs = dict(model=sys.argv[1], load_format="dummy", skip_tokenizer_init=True, max_model_len=4096, seed=0,
              gpu_memory_utilization=0.85, kv_cache_memory_bytes=int(sys.argv[2]))
try:
    llm = LLM(**kwargs)
except TypeError as exc:  # a release without kv_cache_memory_bytes: profiled size
    print("no kv_cache_memory_bytes:", exc, file=sys.stderr)
    kwargs.pop("kv_cache_memory_bytes")
    llm = LLM(**kwargs)
t_ready = time.time() - t0
out = llm.generate([{"prompt_token_ids": list(range(100, 116))}], SamplingParams(temperature=0.0, max_tokens=8))
tokens = list(out[0].outputs[0].token_ids)
t_token = time.time() - t0
torch.cuda.synchronize()

runner = "unknown"
try:
    runner = type(llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker.model_runner).__module__
except Exception as exc:
    runner = f"unknown ({exc!r})"[:200]

snapshot = torch.cuda.memory_snapshot()
segments = [(s["address"], s["total_size"], str(s.get("segment_pool_id")), s.get("segment_type"))
            for s in snapshot]
segments.sort()
blocks = []
for s in snapshot:  # each block's address: its own, else its segment's plus the sizes before it
    at = s["address"]
    for b in s.get("blocks", []):
        at = b.get("address", at)
        blocks.append((at, b["size"], b["state"], str(s.get("segment_pool_id")), b.get("frames") or []))
        at += b["size"]
blocks.sort(key=lambda b: b[0])
block_starts = [b[0] for b in blocks]


import bisect


def block_of(address):  # the block of PyTorch's memory that holds `address`, or None
    j = bisect.bisect_right(block_starts, address) - 1
    return blocks[j] if j >= 0 and address < blocks[j][0] + blocks[j][1] else None


def site(frames):  # the first frames of vLLM's (else torch's) code on an allocation's stack, innermost first
    mine = [f for f in frames if "/vllm/" in f.get("filename", "")] or [
        f for f in frames if "/torch/" in f.get("filename", "")]
    return [f"{f['filename'].split('site-packages/')[-1]}:{f.get('line')} {f.get('name')}" for f in mine[:4]]


referenced = {}  # block address -> what it is and how many pointers of which graphs point into it
pools = {"(0, 0)": "default"}  # torch's own pool; each private pool (a graph pool) named in address order
for _, _, pool, _ in segments:
    pools.setdefault(pool, f"private{len(pools)}")

from weightcache.graphs import AddressRange, CudaGraphDriver, describe, pointers, rebuild

driver = CudaGraphDriver()


def image_of(name, function):  # two functions of one name in a graph: told apart by their modules' images
    if recorder is None:
        return None
    return recorder.image_for(name, driver.function_module(function), by_name=False)


# How GraphCache's recording would find each kernel's image (as weightcache/torch_graphs.py does when it records a
# graph): through its function's module where that load was seen, else by its name where one kept image defines it;
# the kernels it could not, by why (several kept images define the name and the module's load was not seen: a
# module the runtime loaded through its library API; no kept image defines it), with a sample of names.
def kernel_images(description, functions):
    from weightcache.graphs.description import kernel_image

    found = Counter()
    sample = {}
    for kernel in sorted(description.kernels()):
        if kernel_image(kernel):
            found["qualified"] += 1
            continue
        if recorder is None:
            found["no recorder"] += 1
            continue
        try:
            module = driver.function_module(functions[kernel])
        except Exception:
            module = None
        if recorder.image_for(kernel, module, by_name=False) is not None:
            found["module seen"] += 1
        elif recorder.image_for(kernel, module, by_name=True) is not None:
            found["by name"] += 1
        else:
            why = f"{recorder.images_defining(kernel)} images define it, module not seen"
            found[why] += 1
            sample.setdefault(why, kernel[:160])
    return {"found": dict(found), "sample": sample}


ranges = [AddressRange(f"{pools[pool]}/{i}", address, size) for i, (address, size, pool, _) in enumerate(segments)]
graphs = []
described = []
described_at = {}  # index in `kept` -> (description, functions)
t = time.perf_counter()
for i, (g, seconds, instantiate) in enumerate(kept):
    entry = {"i": i, "capture_s": round(seconds, 5), "instantiate_s": round(instantiate, 5)}
    try:
        raw = g.raw_cuda_graph()
        kinds = Counter(driver.node_kind(n) for n in driver.graph_nodes(raw))
        entry.update(nodes=sum(kinds.values()), kinds=dict(kinds))
        description, functions = describe(driver, raw, image_of)
        entry["qualified"] = sum(1 for k in description.kernels() if "@" in k)
        entry["images"] = kernel_images(description, functions)
    except Exception as exc:  # one graph the describer cannot walk must not lose the run
        entry["error"] = f"{type(exc).__name__}: {exc}"[:300]
        entry.setdefault("kinds", {})
        graphs.append(entry)
        continue
    try:
        found, problems = pointers(description, ranges, driver.pointer_range)
    except Exception as exc:
        entry["error"] = f"pointers: {type(exc).__name__}: {exc}"[:300]
        graphs.append(entry)
        continue
    by_pool = Counter(p.range.split("/")[0] for p in found)
    states = Counter()
    try:  # which block of PyTorch's each pointer lies in (a failure here must not lose the run)
        for p in found:
            block = block_of(p.value)
            if block is None:
                states["no block"] += 1
                continue
            address, size, state, pool, frames = block
            states[f"{pools.get(pool, pool)}:{state}"] += 1
            r = referenced.setdefault(address, {"address": address, "size": size, "state": state,
                                                "pool": pools.get(pool, pool), "site": site(frames), "graphs": []})
            if not r["graphs"] or r["graphs"][-1] != i:
                r["graphs"].append(i)
    except Exception as exc:
        entry["block_error"] = f"{type(exc).__name__}: {exc}"[:300]
    entry.update(
        kernels=len(description.kernels()),
        pointers=len(found),
        by_pool=dict(by_pool),
        by_block_state=dict(states),
        segments=len({p.range for p in found}),
        outside=len(problems),
        outside_sample=problems[:2],
        digest=hashlib.sha256(description.to_binary()).hexdigest()[:16],
        pointer_digest=hashlib.sha256(repr(sorted(p.value for p in found)).encode()).hexdigest()[:16],
    )
    graphs.append(entry)
    described.append((description, functions))
    described_at[i] = (description, functions)
t_describe = time.perf_counter() - t

coverage = None
if arena is not None:  # would weightcache's ranges hold every pointer: the arena, the weights, the runner's tensors?
    from torch import nn

    coverage = {"declared": Counter(), "declare_errors": [], "by_kind": Counter(), "outside": 0,
                "outside_sample": [], "uncovered_blocks": {}, "runner_used": Counter(), "runner_bases": {}}
    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    model_runner = worker.model_runner
    model = getattr(model_runner, "model", None)

    def declare(name, t):
        try:
            arena.external(name.replace("/", "|"), t)
            coverage["declared"][name[:2]] += 1
        except Exception as exc:
            coverage["declare_errors"].append(f"{name[:80]}: {exc}"[:200])

    if isinstance(model, nn.Module):  # the weights (weightcache maps its own at their homes; these are dummy)
        for n, t in [*model.named_parameters(), *model.named_buffers()]:
            if t.is_cuda and t.numel():
                declare(f"w.{n}", t)
    from weightcache.backends.vllm_graphs import runner_tensors

    for path, t in runner_tensors(model_runner, depth=6):  # every CUDA tensor the runner reaches, by its path
        declare(f"r.{path}", t)
    covered = arena.ranges() + ranges  # then torch's own segments: what the arena and the names do not cover
    arena_name = covered[0].name
    for description, _ in described:
        found, problems = pointers(description, covered, driver.pointer_range)
        coverage["outside"] += len(problems)
        coverage["outside_sample"] = (coverage["outside_sample"] + problems[:1])[:3]
        for p in found:
            if p.range == arena_name:
                kind = "arena"
            elif p.range.startswith("external/w."):
                kind = "weights"
            elif p.range.startswith("external/r."):
                kind = "runner"
                coverage["runner_used"][p.range[len("external/r."):][:100]] += 1
            else:
                kind = "uncovered:" + p.range.split("/")[0]
                b = block_of(p.value)
                if b is not None:
                    u = coverage["uncovered_blocks"].setdefault(
                        b[0], {"address": b[0], "size": b[1], "state": b[2], "site": site(b[4]), "pointers": 0})
                    u["pointers"] += 1
            coverage["by_kind"][kind] += 1
    for r in arena.ranges():
        if r.name.startswith("external/r."):
            coverage["runner_bases"][r.name[len("external/r."):][:100]] = [r.base, r.size]
    coverage["uncovered_blocks"] = sorted(coverage["uncovered_blocks"].values(), key=lambda u: -u["pointers"])[:40]
    coverage["runner_used"] = dict(coverage["runner_used"].most_common(60))

rebuilt = failed = 0
first_failure = None
t = time.perf_counter()
for description, functions in described:
    try:
        graph = rebuild(driver, description, functions)
        try:
            driver.destroy_executable(driver.instantiate(graph))
        finally:
            driver.destroy_graph(graph)
        rebuilt += 1
    except Exception as exc:
        failed += 1
        first_failure = first_failure or f"{type(exc).__name__}: {exc}"[:300]
t_rebuild = time.perf_counter() - t

capture_log = [m for _, m in lines if re.search(r"[Gg]raph captur", m)]
print("RESULT " + json.dumps({
    "runner": runner, "import_s": round(t_import, 2), "ready_s": round(t_ready, 2), "token_s": round(t_token, 2),
    "tokens": tokens, "capture_log": capture_log[-3:], "kept": len(kept),
    "capture_sum_s": round(sum(k[1] for k in kept), 3), "instantiate_sum_s": round(sum(k[2] for k in kept), 3),
    "describe_s": round(t_describe, 3),
    "rebuild_instantiate_s": round(t_rebuild, 3), "rebuilt": rebuilt, "rebuild_failed": failed,
    "rebuild_first_failure": first_failure,
    "segments": segments, "pools": {v: k for k, v in pools.items()}, "graphs": graphs,
    "blocks": sorted(referenced.values(), key=lambda r: r["address"]),
    "coverage": coverage,
    "kv_cache_memory_bytes": kwargs.get("kv_cache_memory_bytes"),
}), flush=True)
if sys.argv[5] == "replay":  # each graph vLLM keeps, replayed, then rebuilt from its description: the same bytes?
    # (after RESULT: a fault here, a bad rebuild, loses only this part)
    replay = {"FULL": Counter(), "PIECEWISE": Counter(), "first_difference": None, "seconds": 0.0}
    kept_at = {id(g): i for i, (g, _, _) in enumerate(kept)}
    started = time.perf_counter()

    def tensors(out):  # an output's tensors (a tensor, or nested lists and tuples of them)
        if isinstance(out, torch.Tensor):
            return [out]
        if isinstance(out, (list, tuple)):
            return [t for x in out for t in tensors(x)]
        return []

    def bytes_of(out):
        return [t.detach().clone().contiguous().view(-1).view(torch.uint8) for t in tensors(out)]

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))

    def check(kind, graph, output, name):
        counts = replay[kind]
        i = kept_at.get(id(graph))
        if i is None or i not in described_at:
            counts["not described" if i is not None else "not kept"] += 1
            return
        graph.replay()
        torch.cuda.synchronize()
        first = bytes_of(output())
        graph.replay()
        torch.cuda.synchronize()
        if not first or not same(first, bytes_of(output())):
            counts["no output" if not first else "two replays differ"] += 1
            return
        description, functions = described_at[i]
        built = rebuild(driver, description, functions)
        try:
            rebuilt = driver.instantiate(built)
        finally:
            driver.destroy_graph(built)
        try:
            with torch.inference_mode():  # vLLM's outputs are inference tensors: written to only in this mode
                for t in tensors(output()):  # what the rebuilt graph must write again
                    t.fill_(float("nan") if t.is_floating_point() else -1)
            driver.launch(rebuilt, torch.cuda.current_stream().cuda_stream)
            torch.cuda.synchronize()
            if same(first, bytes_of(output())):
                counts["bitwise equal"] += 1
            else:
                counts["differs"] += 1
                replay["first_difference"] = replay["first_difference"] or f"{kind} {name} (graph {i})"
        finally:
            driver.destroy_executable(rebuilt)

    worker = llm.llm_engine.engine_core.engine_core.model_executor.driver_worker.worker
    manager = getattr(worker.model_runner, "cudagraph_manager", None)
    full = dict(getattr(manager, "graphs", None) or {})
    for desc, graph in full.items():  # Model Runner V2: FULL graphs write into the manager's hidden_states
        n = desc.num_tokens
        try:
            check("FULL", graph, lambda n=n: manager.hidden_states[:n], repr(desc)[:120])
        except Exception as exc:
            replay["FULL"][f"error: {type(exc).__name__}: {exc}"[:160]] += 1
    from vllm.compilation.cuda_graph import CUDAGraphWrapper

    checked = 0
    for wrapper in list(CUDAGraphWrapper._all_instances):  # PIECEWISE pieces (and V1's FULL wrapper)
        kind = str(getattr(wrapper, "runtime_mode", "PIECEWISE")).split(".")[-1]
        replay.setdefault(kind, Counter())
        for bd, entry in list(wrapper.concrete_cudagraph_entries.items()):
            if entry.cudagraph is None or checked >= 600:
                continue
            checked += 1
            try:
                check(kind, entry.cudagraph, lambda e=entry: e.output, repr(bd)[:120])
            except Exception as exc:
                replay[kind][f"error: {type(exc).__name__}: {exc}"[:160]] += 1
    replay["seconds"] = round(time.perf_counter() - started, 2)
    replay = {k: (dict(v) if isinstance(v, Counter) else v) for k, v in replay.items()}
    print("REPLAY " + json.dumps(replay), flush=True)

os._exit(0)  # the engine's teardown is not measured
"""


def write_config(path: Path) -> None:
    """A Llama-3-8B-shaped ``config.json`` (no weights: the runs use vLLM's dummy loader)."""
    import transformers
    from restart_llama import LLAMA3_8B

    path.mkdir(parents=True, exist_ok=True)
    transformers.LlamaConfig(**LLAMA3_8B, torch_dtype="bfloat16").save_pretrained(path)


def run(
    model: Path, kv_bytes: int, env: dict[str, str], log: Path, sites: bool, arena: bool, replay: bool
) -> dict[str, Any]:
    started = time.time()
    try:
        proc = subprocess.run(
            [
                sys.executable,
                "-c",
                CHILD,
                str(model),
                str(kv_bytes),
                "sites" if sites else "-",
                "arena" if arena else "-",
                "replay" if replay else "-",
            ],
            capture_output=True,
            text=True,
            env=env,
            check=False,
            timeout=900,
        )
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else str(exc.stderr or "")
        with log.open("a") as f:
            f.write(
                f"== run at {time.strftime('%FT%TZ', time.gmtime(started))}, timed out after 900 s\n{tail[-20000:]}"
            )
        return {"error": "timed out after 900 s", "tail": tail[-3000:], "wall_s": time.time() - started}
    with log.open("a") as f:
        f.write(f"== run at {time.strftime('%FT%TZ', time.gmtime(started))}, rc {proc.returncode}\n")
        f.write(proc.stderr[-20000:])
    result = next((line[7:] for line in proc.stdout.splitlines() if line.startswith("RESULT ")), None)
    if result is None:
        return {"error": f"rc {proc.returncode}", "tail": proc.stderr[-3000:], "wall_s": time.time() - started}
    out: dict[str, Any] = json.loads(result)
    replayed = next((line[7:] for line in proc.stdout.splitlines() if line.startswith("REPLAY ")), None)
    if replay:  # the replay check ran after RESULT; no line: it failed the process (the log has why)
        out["replay"] = json.loads(replayed) if replayed else {"error": f"no REPLAY line, rc {proc.returncode}"}
    out["wall_s"] = round(time.time() - started, 2)
    return out


def compare(a: dict[str, Any], b: dict[str, Any]) -> dict[str, Any]:
    """What two runs share: segments at the same place, graphs with the same description / pointer set."""
    sa = {tuple(s[:2]) for s in a["segments"]}
    sb = {tuple(s[:2]) for s in b["segments"]}
    ga, gb = a["graphs"], b["graphs"]
    same_desc = sum(1 for x, y in zip(ga, gb, strict=False) if x.get("digest") and x.get("digest") == y.get("digest"))
    same_ptrs = sum(
        1
        for x, y in zip(ga, gb, strict=False)
        if x.get("pointer_digest") and x["pointer_digest"] == y.get("pointer_digest")
    )
    # the non-pool blocks the graphs point into: at the same address, of the same size, made by the same code?
    ba = {(x["address"], x["size"], tuple(x["site"])) for x in a.get("blocks", []) if x["pool"] == "default"}
    bb = {(x["address"], x["size"], tuple(x["site"])) for x in b.get("blocks", []) if x["pool"] == "default"}
    # with --arena: the runner's tensors the graphs use, at the same address in both runs?
    ra = (a.get("coverage") or {}).get("runner_bases", {})
    rb = (b.get("coverage") or {}).get("runner_bases", {})
    return {
        "runner_tensors_same_place": [sum(1 for k, v in ra.items() if rb.get(k) == v), len(ra), len(rb)],
        "default_blocks": [len(ba), len(bb)],
        "default_blocks_same": len(ba & bb),
        "segments": [len(sa), len(sb)],
        "segments_same_place": len(sa & sb),
        "graphs": [len(ga), len(gb)],
        "same_description": same_desc,
        "same_pointers": same_ptrs,
        "same_tokens": a["tokens"] == b["tokens"],
    }


SUMMARY_KEYS = (
    *("runner", "compile_cache", "import_s", "ready_s", "token_s", "kept", "capture_sum_s", "instantiate_sum_s"),
    "describe_s",
    *("rebuild_instantiate_s", "rebuilt", "rebuild_failed", "capture_log", "tokens", "wall_s"),
)


def summary(r: dict[str, Any]) -> dict[str, Any]:
    graphs = r["graphs"]
    kinds: Counter[str] = Counter()
    errors: Counter[str] = Counter()
    for g in graphs:
        kinds.update(g["kinds"])
        if "error" in g:
            errors[g["error"][:90]] += 1
    return {k: r[k] for k in SUMMARY_KEYS} | {
        "node_kinds": dict(kinds),
        "not_describable": dict(errors),
        # graphs that launch two functions of one name, told apart by their images (describe's image_of)
        "graphs_with_qualified_kernels": sum(1 for g in graphs if g.get("qualified")),
        # how a recording would find each described graph's kernel images (kernel_images), summed over the graphs;
        # "N images define it, module not seen": a kernel it could not, which leaves its graph unrecorded
        "kernel_images": dict(sum((Counter(g.get("images", {}).get("found", {})) for g in graphs), Counter())),
        "kernel_images_sample": next((g["images"]["sample"] for g in graphs if g.get("images", {}).get("sample")), {}),
        "pointers": sum(g.get("pointers", 0) for g in graphs),
        "outside": sum(g.get("outside", 0) for g in graphs),
        "outside_sample": next((g["outside_sample"] for g in graphs if g.get("outside")), []),
        "by_pool": dict(sum((Counter(g.get("by_pool", {})) for g in graphs), Counter())),
        "by_block_state": dict(sum((Counter(g.get("by_block_state", {})) for g in graphs), Counter())),
        "segments": len(r["segments"]),
        "pools": r["pools"],
        # the blocks outside a graph pool that graphs point into, with the code that allocated each
        "default_blocks": [
            {k: x[k] for k in ("address", "size", "state", "site")} | {"graphs": len(x["graphs"])}
            for x in r.get("blocks", [])
            if x["pool"] == "default"
        ][:60],
        "coverage": {k: v for k, v in (r.get("coverage") or {}).items() if k != "runner_bases"} or None,
        "replay": r.get("replay"),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/vllm-graph-probe"))
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--kv-gib", type=float, default=16.0, help="kv_cache_memory_bytes, in GiB")
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-sites", dest="sites", action="store_false", help="do not record where each block was allocated"
    )
    parser.add_argument("--arena", action="store_true", help="vLLM's graph pool from a GraphCache; pointer coverage")
    parser.add_argument(
        "--no-replay",
        dest="replay",
        action="store_false",
        help="do not replay each graph against its rebuild from the description (bitwise comparison)",
    )
    args = parser.parse_args()
    model = args.workdir / "model"
    if not (model / "config.json").exists():
        write_config(model)
    env = dict(os.environ)
    env.update(
        VLLM_ENABLE_V1_MULTIPROCESSING="0",
        VLLM_CACHE_ROOT=str(args.workdir / "vllm-cache"),
        VLLM_USE_FLASHINFER_SAMPLER="0",
        WC_PROBE_SOCKETS=str(args.workdir / "no-keeper"),  # the GraphCache of --arena finds no artifact there
    )
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    log = (args.json or args.workdir / "probe.json").with_suffix(".log")
    runs: list[dict[str, Any]] = []
    report: dict[str, Any] = {"date": time.strftime("%F"), "runs": runs}
    for i in range(args.runs):
        cache = args.workdir / "vllm-cache"
        cold = not cache.exists() or not any(cache.iterdir())  # compare warm runs (an earlier call may have filled it)
        r = run(model, int(args.kv_gib * 2**30), env, log, args.sites, args.arena, args.replay)
        r["compile_cache"] = "cold (this run fills it)" if cold else "warm"
        runs.append(r)
        print(f"run {i + 1}:", json.dumps(summary(r) if "graphs" in r else r, indent=1)[:12000], flush=True)
        if args.json:  # after every run: a run cut short leaves the ones before it
            args.json.write_text(json.dumps(report))
        if "graphs" not in r:
            break
    ok = [r for r in runs if "graphs" in r]
    report["compare"] = [
        {"runs": [i + 1, j + 1], **compare(ok[i], ok[j])} for i in range(len(ok)) for j in range(i + 1, len(ok))
    ]
    print("compare:", json.dumps(report["compare"], indent=1), flush=True)
    if args.json:
        args.json.write_text(json.dumps(report))
    return 0 if len(ok) == args.runs else 1


if __name__ == "__main__":
    raise SystemExit(main())

"""The Python cost of restoring an engine's CUDA graphs over moved tensors (issue 31), on a CPU, tree against tree.

On an H100 (2026-12-05, docs/benchmarks.md) the vLLM kind restored vLLM's 51 FULL graphs in 1.7-2.6 s, more than
vLLM takes to capture them, 2.1 s of it in the restore's checks, while the runner's tensors (a hundred and more,
declared with ``GraphCache.external``) lay elsewhere than when recorded and every graph was relocated. This runs a
``GraphCache``'s restore path as far as a CPU can: ``graph_artifact_cpu.synthetic_bundle``'s graphs (``--graphs``
graphs of ``--nodes`` kernel nodes, 10 % launched with a 1 KiB argument buffer of random bytes around three
pointers, as FlashAttention's structures are), their pointers into the weights' first GiB recorded instead as
``--externals`` declared tensors, each of which lies 2 MiB further on in the restoring process. The GraphCache is
made without its constructor (no GPU: no arena, no pool, no CUPTI), its artifact handed over as the keeper would
hand it (the constructor's last step, the benchmark's one private call), and its driver answers every call at once
(nodes are not added anywhere), so what is timed is weightcache's own work: the artifact's images checked and
"loaded" on worker threads, the tensors declared (``GraphCache.external``), each graph's checks, relocation and build
(ahead, on the build thread, as the default does), from the artifact's load to the last graph restored. Each tree
runs in ``--processes`` fresh processes, alternating.

    python benchmarks/graph_restore_cpu.py --tree /tmp/wt-before --tree . --processes 5

``--driver-latency`` models the driver instead of answering at once: each call lets go of Python's GIL, as the
real driver's calls through ``ctypes`` and cuda-bindings do, and takes the time the H100 gave it (2026-12-05, the
vLLM kind's FULL graphs: nodes added at ~17 us a node, ``cuGraphInstantiate`` ~3.3 ms a graph, kernel images
loaded and their functions looked up at ~12 ms a MiB, side by side on the loading threads; not measured there and
assumed: 0.3 ms for the arena's memory mapped for a graph, the range queries letting go of the GIL and returning),
and the graph calls and queries one at a time: graph calls on two threads waited on each other on the H100, and
that a query waits behind a graph call too is assumed (with it the model gives 09d99a4's restore the shape the H100
reported for it: most of the time in the checks, little waiting for builds). What the restore's threads then do to
each other (the caller waiting for the build thread or for the driver, a call's return waiting for the GIL the
other thread holds) shows, which a driver answering at once hides.
``--engine-ms`` spins Python for that long before each graph, as an engine does (vLLM prepares each graph's inputs
and declares its tensors: ~14 ms a graph on the H100 before af9538c); ``--engine-first-ms`` once, after the tensors
are declared and before the first graph (the vLLM kind adopts the model there: ~0.1 s on the H100). A tree with
``GraphCache.start_builds`` (5c58952) is told there that the tensors are declared, as the vLLM kind does; a tree
whose driver adds a graph's nodes with their launch attributes in one native call (``wc_add_kernel_nodes`` in
weightcache's native library since it sets attributes, ``wc_add_nodes`` since it adds memset nodes too) has its node
adds modelled as one call a graph; others as two calls a node (each kernel node has one launch attribute, as every
node described on the H200 and the H100 had). The synthetic graphs have no memset nodes.

A tree whose GraphCache keeps other state than this harness sets may fail here; ``tests/test_benchmarks.py`` runs
it on the current tree.
"""

from __future__ import annotations

import argparse
import statistics
from typing import Any

from tree_runs import alternate, graph_options, graph_report

CHILD = r"""
import contextlib, ctypes, json, sys, threading, time
sys.path.insert(0, sys.argv[1] + "/benchmarks")
import attrs, torch
from graph_artifact_cpu import ARENA, HOME, synthetic_bundle
import weightcache.torch_graphs as tg
from weightcache.graphs.bundle import GraphBundle
from weightcache.graphs.check import AddressRange, extents, pointers
from weightcache.graphs.cupti_shim import SOURCE
from weightcache.graphs.loading import KernelLoader

graphs, nodes, externals, latency = (int(a) for a in sys.argv[2:6])
engine_s, first_s = float(sys.argv[6]) / 1000, float(sys.argv[7]) / 1000
libc = ctypes.CDLL(None)
NODE_S, INSTANTIATE_S, IMAGE_S_A_MIB, MAP_S = 17e-6, 3.3e-3, 12.4e-3, 0.3e-3  # --driver-latency (module's text)


DRIVER = threading.Lock()  # one call in the driver at a time (the module's text)
NATIVE_LOOP = "wc_add_nodes" in SOURCE or "wc_add_kernel_nodes" in SOURCE  # (a run of nodes in one native call)
ATTRIBUTES_IN_LOOP = "wc_set_attribute" in SOURCE  # (and sets their launch attributes in that call)


def driver_call(seconds=0.0, serial=True):
    # with --driver-latency: the GIL let go (a call into libc through ctypes, as the real driver's are made), then
    # held off for as long as the H100 took, one (serial) call at a time; the timer slack of each thread is set to
    # 1 ns (prctl) so that short sleeps are near their length
    if latency:
        with DRIVER if serial else contextlib.nullcontext():
            libc.getpid()
            if seconds:
                time.sleep(seconds)


def precise_sleeps():
    libc.prctl(29, 1, 0, 0, 0)  # PR_SET_TIMERSLACK


precise_sleeps()
made = synthetic_bundle(graphs, nodes, 18, 4, 0.1, 1024)
size, moved = (1 << 30) // externals, 2 << 20
pieces = [AddressRange(f"external/r{i:04}", HOME.base + i * size, size, own_mapping=False) for i in range(externals)]
ranges = [ARENA, *pieces]
records, end = [], 0
for record in made.graphs:  # one after the other in the arena, each as far as its pointers reach into it
    found, _ = pointers(record.description, ranges, None)
    reach = extents(found, ranges)
    start, end = end, max(end + (64 << 20), reach.get(ARENA.name, 0))
    records.append(attrs.evolve(record, start=start, end=end, reach=reach, outputs=()))
blob = GraphBundle(tuple(ranges), tuple(records), made.images).to_bytes()
bundle = GraphBundle.from_bytes(blob, check_images=False)


class Driver:
    # every call answered at once: what is timed is weightcache's own work
    def __init__(self):
        self.lock, self.next = threading.Lock(), 0
    def _id(self):
        with self.lock:
            self.next += 1
            return self.next
    def current_context(self): return 1
    def make_current(self, context): precise_sleeps()  # (called on each worker thread first)
    def load_module(self, image):  # (its functions' lookups included)
        driver_call(len(image) / 2**20 * IMAGE_S_A_MIB, serial=False)
        return self._id()
    def module_function(self, module, name): return self._id()
    def unload_module(self, module): pass
    def set_function_attribute(self, function, attribute, value): pass
    def create_graph(self): return self._id()
    def add_description(self, graph, description, functions):
        # as the tree's driver makes its calls, ~17 us a node, each kernel node with one launch attribute (its
        # cluster scheduling policy, as every node described on the H200 and the H100 had): two calls a node, the
        # node's and its attribute's (the GIL let go and taken again each time; slept 50 nodes at a time, the rest
        # at the end: a sleep that short overshoots), or, where the tree adds a run of nodes with their attributes
        # in one native call (wc_add_kernel_nodes since it sets attributes, now wc_add_nodes), the GIL let go once
        # for all of them; still one driver call a node in there, so another thread's query waits for one node at
        # most (not modelled: the query goes in at once). (A tree whose loop takes only nodes without attributes
        # makes two calls a node here.)
        count = len(description.tables.table)
        if NATIVE_LOOP and ATTRIBUTES_IN_LOOP:
            driver_call(count * NODE_S, serial=False)
            return
        for i in range(count):
            driver_call(50 * NODE_S if i % 50 == 49 else 0.0)
            driver_call()
        driver_call(count % 50 * NODE_S)
    def instantiate(self, graph):
        driver_call(INSTANTIATE_S)
        return self._id()
    def destroy_graph(self, graph): pass
    def destroy_executable(self, executable): pass
    def pointer_range(self, address):
        driver_call()
        if ARENA.holds(address):
            return ARENA.base, ARENA.size
        return HOME.base + moved, HOME.size


class Arena:
    name, base, size, used, mapped = ARENA.name, ARENA.base, ARENA.size, 0, 0
    def range(self): return ARENA
    def map_ahead(self, ends):  # (older trees map graph by graph, through skip_to)
        for end in ends:
            self._map_to(end)
        return True
    def unmap_unused(self):
        return 0
    def _map_to(self, end):
        if end > self.mapped:
            driver_call(MAP_S)
            self.mapped = end
    def skip_to(self, used):
        self._map_to(used)
        self.used = used
    def rewind_to(self, used): self.used = used
    def close(self): pass


class Tensor:
    # what GraphCache.external reads of a tensor on cuda:0, which this machine need not have
    device = torch.device("cuda", 0)
    def __init__(self, address, nbytes): self.address, self.shape = address, (nbytes,)
    def stride(self): return (1,)
    def element_size(self): return 1
    def data_ptr(self): return self.address
    def detach(self): return self


torch.cuda.device = lambda index: contextlib.nullcontext()
torch.cuda.synchronize = lambda device=None: None
tg.fetch_bundle = lambda *_: tg.FetchedBundle(bundle, "0" * 64, len(blob), {})
driver = Driver()
cache = object.__new__(tg.GraphCache)
state = dict(
    weights="0" * 64, device=0, verify=False, build_ahead=True, key="key", reason=None, relocated=0, _cause=None,
    _unrecordable=None, _no_images=None, _cache=None, _arena=Arena(), _pool=None, _recorder=None, _bundle=None,
    _replace=None, _next=0, _diverged=False, _recordable=True, _record_problem=None, _records=[], _external={},
    _also_kept=[], _redeclared={}, _capturing=False, _foreign=False, _images={}, _kernels=KernelLoader(driver),
    _prebuilt=None, _prebuilt_from=0, _prebuilt_moves=[], _build_ahead_waits=False, _relocations={},
    _relocations_lock=threading.Lock(), _relocating=None, _extents_passed=set(), _shared={}, phases={}, _captured=0,
    graphs=[], _driver=driver, _stream=None,
)
for name, value in state.items():
    setattr(cache, name, value)
began = time.perf_counter()
cache._load()  # the constructor's last step: the artifact asked for, its images loading on worker threads
for piece in pieces:  # declared where they lie here, as an engine declares its tensors before the first graph
    cache.external(piece.name.removeprefix("external/"), Tensor(piece.base + moved, piece.size))
if hasattr(cache, "start_builds"):  # (trees before 5c58952 start building at the first restore)
    cache.start_builds()
spin = time.perf_counter() + first_s  # the engine's own Python before the first graph (--engine-first-ms)
while time.perf_counter() < spin:
    pass
for record in bundle.graphs:
    spin = time.perf_counter() + engine_s  # the engine's own Python before each graph (--engine-ms)
    while time.perf_counter() < spin:
        pass
    restored = cache.restore(record.name)
    assert restored is not None and restored.restored, cache.reason
seconds = time.perf_counter() - began
steps = {}
for g in cache.graphs:
    for step, spent in g.phases.items():
        steps[step] = steps.get(step, 0.0) + spent
start_steps = dict(cache.phases)  # what the artifact's load did before the first graph (the arena mapped ahead)
cache.close()
print(json.dumps({"seconds": seconds, "relocated": cache.relocated, "steps": steps, "start_steps": start_steps}))
"""


def main() -> int:
    def more(parser: argparse.ArgumentParser) -> None:
        parser.add_argument("--driver-latency", action="store_true", help="model the H100's driver (module's text)")
        parser.add_argument("--engine-ms", type=float, default=0.0, help="the engine's Python before each graph")
        parser.add_argument(
            "--engine-first-ms", type=float, default=0.0, help="the engine's Python once, after declaring its tensors"
        )

    args = graph_options(__doc__.split("\n\n")[0], 450, 150, "declared tensors the graphs' pointers lie in", more)
    runs = alternate(
        CHILD, args.tree, args.processes, str(args.graphs), str(args.nodes), str(args.externals),
        str(int(args.driver_latency)), str(args.engine_ms), str(args.engine_first_ms),
    )  # fmt: skip

    def each(results: list[dict[str, Any]]) -> dict[str, Any]:
        steps = {k: round(statistics.median(r["steps"].get(k, 0.0) for r in results), 4) for k in results[0]["steps"]}
        first = results[0].get("start_steps", {})
        start = {k: round(statistics.median(r.get("start_steps", {}).get(k, 0.0) for r in results), 4) for k in first}
        return {"pointers_relocated": results[0]["relocated"], "steps_median": steps, "start_steps_median": start}

    graph_report(
        args,
        runs,
        each,
        lambda tree, row: (
            f"{tree}: {row['seconds_median']:.3f} s to restore {args.graphs} graphs of {args.nodes} nodes over "
            f"{args.externals} moved tensors{' (driver modelled)' if args.driver_latency else ''}"
            f"{f', {args.engine_ms} ms of engine work a graph' if args.engine_ms else ''}"
            f"{f', {args.engine_first_ms} ms before the first' if args.engine_first_ms else ''} "
            f"({row['pointers_relocated']} pointers relocated; at load {row['start_steps_median']}; median of "
            f"{len(row['seconds'])} processes); steps summed over the graphs: {row['steps_median']}"
        ),
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A whole vLLM restart, process start to first greedy token, phase by phase from vLLM's own log: load format
auto (page cache dropped) vs weightcache daemon's first start (a miss: load, publish, run on the published copy)
vs weightcache client (attach), each a fresh process, with vLLM's defaults (torch.compile and CUDA graphs on).

The model is benchmarks/restart_llama.py's Llama-3-8B-shaped random bf16 checkpoint (16 GB), written once into
``--workdir``; nothing is downloaded. vLLM runs in-process (``VLLM_ENABLE_V1_MULTIPROCESSING=0``) with
``skip_tokenizer_init``. vLLM's compile cache is left as it is (the first auto start fills it, so later starts find
it warm on local disk); ``--cold-compile`` gives every start an empty one.

    PYTHONPATH=$PWD python benchmarks/restart_vllm.py --workdir /tmp/llama8b --json out.json --repeat 3
    PYTHONPATH=$PWD python benchmarks/restart_vllm.py --workdir /tmp/llama8b --scenario compile --repeat 2

``--scenario compile`` (issue 21) measures vLLM's compile cache from the keeper, one cache root for every start
(``<workdir>/vllm-cache``; its path is part of the artifact's key): auto with it wiped (cold), auto with it warm,
daemon (publishes the weights and, after warm-up, the compile cache), then client with it wiped before each start
(weights and compile cache from the keeper). Every log line of vLLM and weightcache is recorded with its time
since process start (``lines`` in the JSON), which is how the phases between them are found. ``--scenario
empty-disk`` (the issue's goal: from an empty disk, within 1.2x of the same restart with a warm local disk): auto
from an empty disk (vLLM's and Triton's (``~/.triton/cache``) cache directories wiped: a new container), daemon from
an empty disk (compiles; publishes weights, compile cache and model info), client 1 from an empty disk (the first
restart after the compiling one), then ``--repeat`` rounds of two clients side by side: one from an empty disk
(everything from the keeper), one from the warm local disk that start left (the keeper's compile cache switched off
with ``WEIGHTCACHE_VLLM_COMPILE_CACHE=0``), and last auto from that warm local disk. ``--deadline-s`` leaves out a
round that would end past it (judged by the last round, and the last start by the first). ``--json`` is written
after every start.

``--scenario graphs`` (issue 31) measures vLLM's graph phase with weightcache's vLLM graph kind
(``WEIGHTCACHE_VLLM_GRAPHS=1``, weightcache/backends/vllm_graphs.py): a daemon from an empty disk (kind off), a
first client with the kind on (captures, records and publishes the FULL graphs), then ``--repeat`` rounds of four
clients from an empty disk: kind on (the FULL graphs restored), kind off (vLLM captures every graph), and each of
those in a process forked by the warm process (the whole restart, and what the kind gives of it). Every start of
it times ``GPUModelRunner.capture_model`` to the millisecond (``graph phases`` in its marks; vLLM's own line rounds
to whole seconds; the timer imports the runner's module after the ``vllm imported`` mark), records the kind's report
(``graphs``: graphs restored and captured, where its time went) and generates 16 greedy tokens for each of 8
prompts at once after the first token (decode steps of 8 sequences: FULL graphs where vLLM has them), which must be
the same in every start.
``--cudagraph-mode`` sets vLLM's ``cudagraph_mode`` for every start (e.g. ``FULL_DECODE_ONLY``: no PIECEWISE
graphs, prefills eager).

Phases (seconds, from vLLM's log lines, absent where a release does not log them): weights (the loader's own
line, or weightcache's), dynamo, inductor (compiling or loading compiled graphs), torch.compile in total, memory
profile + KV cache + warm-up (vLLM's "init engine" line), CUDA graph capture; and wall-clock marks: vLLM
imported, engine ready (``LLM()`` returned), first token.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))

from restart_llama import build_checkpoint

#: How long one start may take to its result (``BENCH_START_TIMEOUT``, seconds); a start past it is sent SIGABRT,
#: and its processes' stacks (faulthandler) end the error: a hung start shows where it hung.
START_TIMEOUT_S = float(os.environ.get("BENCH_START_TIMEOUT", "600"))

ENGINE = r"""
import sys, time, json, logging, os
t0 = float(sys.argv[4])
marks = {"python": time.time() - t0}
lines = []


class Timed(logging.Handler):  # every log line of vLLM and weightcache, with its time since process start
    def emit(self, record):
        lines.append([round(record.created - t0, 3), record.name, record.getMessage()[:300]])


marks["preimported"] = "vllm" in sys.modules  # a warm process's child
import vllm
logging.getLogger("vllm").addHandler(Timed())  # weightcache's lines reach it (the plugin forwards them)
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
marks["vllm imported"] = time.time() - t0
if os.environ.get("BENCH_GRAPH_TIMER") == "1":  # --scenario graphs: vLLM's graph phase to the millisecond
    import importlib
    graph_phases = marks["graph phases"] = []

    def timed(capture_model):
        def capture(self, *args, **kwargs):
            began = time.perf_counter()
            try:
                return capture_model(self, *args, **kwargs)
            finally:
                graph_phases.append(round(time.perf_counter() - began, 4))
        return capture

    for runner in ("vllm.v1.worker.gpu.model_runner", "vllm.v1.worker.gpu_model_runner"):  # V2 and V1 runners
        try:
            cls = importlib.import_module(runner).GPUModelRunner
            cls.capture_model = timed(cls.capture_model)
        except Exception as exc:
            marks.setdefault("graph timer", []).append(f"{runner}: {exc!r}"[:200])
    marks["graph timer imported"] = time.time() - t0
options = {}
if os.environ.get("BENCH_CUDAGRAPH_MODE"):
    options["compilation_config"] = {"cudagraph_mode": os.environ["BENCH_CUDAGRAPH_MODE"]}
llm = LLM(model=sys.argv[1], skip_tokenizer_init=True, load_format=sys.argv[2],
          model_loader_extra_config=json.loads(sys.argv[3]), gpu_memory_utilization=0.85, max_model_len=4096, seed=0,
          **options)
marks["engine ready"] = time.time() - t0
out = llm.generate([TokensPrompt(prompt_token_ids=list(range(1, 17)))],
                   SamplingParams(max_tokens=1, temperature=0.0, detokenize=False), use_tqdm=False)
marks["first token"] = time.time() - t0
tokens = [list(out[0].outputs[0].token_ids)]
if os.environ.get("BENCH_PROMPTS"):  # then BENCH_PROMPTS prompts at once, BENCH_MAX_TOKENS greedy tokens each: decode
    # steps of that batch size (FULL graphs where vLLM has them), each prompt its own 16 tokens
    batch = [TokensPrompt(prompt_token_ids=list(range(1 + 16 * i, 17 + 16 * i)))
             for i in range(int(os.environ["BENCH_PROMPTS"]))]
    params = SamplingParams(max_tokens=int(os.environ.get("BENCH_MAX_TOKENS", "16")), temperature=0.0,
                            detokenize=False)
    tokens = [list(o.outputs[0].token_ids) for o in llm.generate(batch, params, use_tqdm=False)]
    marks["batch generated"] = time.time() - t0


# Triton kernels this start compiled although the restore wrote files: each written kernel's metadata beside that
# of a restored kernel of the same name, and the fields where they differ (why its key missed).
def triton_misses(c, limit=4):
    import pathlib

    def path_of(member):
        if member.startswith("@triton/"):
            return c.triton / member.removeprefix("@triton/")
        return c.root / member

    def kernel(member):
        name = pathlib.PurePosixPath(member).name
        return name if name.endswith(".json") and not name.startswith("__grp__") else None

    restored = {}
    for member in c.restored:
        if kernel(member):
            restored.setdefault(kernel(member), []).append(member)
    found = []
    for member in c.written:
        if not kernel(member):
            continue
        entry = {"written": member, "restored of that name": restored.get(kernel(member), [])[:3]}
        try:
            new = json.loads(path_of(member).read_text())
            if entry["restored of that name"]:
                old = json.loads(path_of(entry["restored of that name"][0]).read_text())
                entry["differs"] = {k: [str(old.get(k))[:160], str(new.get(k))[:160]]
                                    for k in sorted(set(old) | set(new)) if old.get(k) != new.get(k)}
            else:
                entry["metadata"] = {k: str(v)[:160] for k, v in new.items()}
        except Exception as exc:
            entry["error"] = repr(exc)
        found.append(entry)
        if len(found) >= limit:
            break
    return found


try:
    from weightcache.backends import vllm_compile
    artifacts = [{"restored_files": len(c.restored), "loaded_bytes": c.loaded_bytes,
                  "published_bytes": c.published_bytes, "written": len(c.written), "counts": c.counts,
                  "rewritten": c.rewritten()[:8], "triton_misses": triton_misses(c) if c.written else [],
                  "triton_dir": str(c.triton), "env": {k: v for k, v in os.environ.items() if "TRITON" in k
                                                      or "INDUCTOR" in k}}
                 for c in vllm_compile.engine_caches()]
except Exception as exc:
    artifacts = repr(exc)
try:
    from weightcache.backends import vllm_graphs
    graphs = vllm_graphs.reports()
except Exception as exc:
    graphs = repr(exc)
print("MARKS " + json.dumps({"marks": marks, "token": out[0].outputs[0].token_ids[0],
      "tokens": tokens, "graphs": graphs,
      "kv_blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks, "vllm": vllm.__version__,
      "artifacts": artifacts, "lines": lines}), flush=True)
"""

#: A vLLM general plugin (vLLM loads its plugins in every process of an engine, once vLLM is imported) that says in
#: each process how long after that process began it ran: the import phase of every process of a start, the engine
#: core's of a multiprocessing engine included (a process forked by the warm process begins at the fork). The
#: process's start is the kernel's (``/proc/self/stat`` field 22, in clock ticks since boot).
MARKS_PLUGIN = r"""
import json, os, sys, time


def mark(**extra):
    with open("/proc/self/stat") as stat:
        began = int(stat.read().rsplit(")", 1)[1].split()[19]) / os.sysconf("SC_CLK_TCK")
    with open("/proc/self/cmdline", "rb") as cmdline:
        argv = cmdline.read().split(b"\0")
    age = time.clock_gettime(time.CLOCK_BOOTTIME) - began
    print("IMPORTMARK " + json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "s since process start": round(age, 3),
          "argv": [a.decode(errors="replace")[:60] for a in argv[:3]], **extra}), file=sys.stderr, flush=True)


def register():
    mark()
    # a process vLLM forks from this one (its engine core) inherits its imports and does not load plugins again
    os.register_at_fork(after_in_child=lambda: mark(forked=True))
"""


def marks_plugin(directory: Path) -> Path:
    """``directory``, made a path entry holding :data:`MARKS_PLUGIN` as a distribution (vLLM finds its plugins by
    their entry points)."""
    (directory / "wc_bench_marks-0.dist-info").mkdir(parents=True, exist_ok=True)
    (directory / "wc_bench_marks.py").write_text(MARKS_PLUGIN)
    info = directory / "wc_bench_marks-0.dist-info"
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: wc-bench-marks\nVersion: 0\n")
    (info / "entry_points.txt").write_text("[vllm.general_plugins]\nwc_bench_marks = wc_bench_marks:register\n")
    return directory


def import_marks(text: str) -> list[dict[str, Any]]:
    """Every process's :data:`MARKS_PLUGIN` line in ``text``, in order."""
    marks = []
    for line in text.splitlines():
        if "IMPORTMARK " in line:
            try:
                marks.append(json.loads(line.split("IMPORTMARK ", 1)[1]))
            except ValueError:
                continue
    return marks


#: What the warm process of ``--scenario restart`` imports: vLLM's engine, its GPU worker and the Llama model.
PRELOADS = "torch,vllm:LLM,vllm.v1.engine.core,vllm.v1.worker.gpu_worker,vllm.model_executor.models.llama"

#: (phase, regular expression over vLLM's and weightcache's log lines, matched line by line; group 1 in seconds,
#: or ms where named). The MARKS line is never matched: it repeats every line the main process logged.
PHASES: tuple[tuple[str, str], ...] = (
    ("weights (vLLM's loader)", r"Loading weights took ([\d.]+) seconds"),
    ("model loading", r"Model loading took [\d.]+ GiB memory and ([\d.]+) seconds"),
    ("weightcache", r"weightcache: .* in ([\d.]+) ms"),
    ("dynamo", r"Dynamo bytecode transform time: ([\d.]+) s"),
    ("inductor: compile", r"Compiling a graph for .*? takes ([\d.]+) s"),
    ("inductor: cache load", r"Directly load the compiled graph.*? took ([\d.]+) s"),
    ("torch.compile total", r"torch\.compile (?:takes|took) ([\d.]+) s in total"),
    ("graph capture", r"Graph capturing finished in ([\d.]+) secs"),
    (
        "init engine (profile, KV cache, warm-up)",
        r"init engine \(profile, create kv cache, warmup model\) took ([\d.]+)",
    ),
)

#: vLLM's compile counters on a restart, in its own words (the mega AOT artifact rebuilds its subgraphs).
COMPILE_LINES = r"AOT compil|load failure|reconstructed serializable fn|collected artifacts|MEGA_AOT"


def phases_of(text: str) -> dict[str, float]:
    """Each phase's seconds summed over the log lines of ``text`` (every process of the start), MARKS excluded."""
    lines = [line for line in text.splitlines() if not line.startswith("MARKS ")]
    phases: dict[str, float] = {}
    for name, pattern in PHASES:
        values = [float(m.group(1)) for line in lines if (m := re.search(pattern, line))]
        if values:
            phases[name] = round(sum(values) / (1000 if name == "weightcache" else 1), 3)
    return phases


def run_engine(
    mode: str, ckpt: Path, socket_dir: Path, env: dict[str, str], launcher: list[str] | None = None
) -> dict[str, Any]:
    """One engine in a fresh process (started by ``launcher``, e.g. ``weightcache run --``, if given)."""
    load_format = "auto" if mode == "auto" else "weightcache"
    extra = {} if mode == "auto" else {"mode": mode, "socket_dir": str(socket_dir)}
    t0 = time.time()
    proc = subprocess.Popen(
        [*(launcher or []), sys.executable, "-c", ENGINE, str(ckpt), load_format, json.dumps(extra), repr(t0)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**env, "PYTHONFAULTHANDLER": "1"},
        start_new_session=True,  # its own process group: a hung start's SIGABRT reaches its engine core too
    )
    try:
        stdout, stderr = proc.communicate(timeout=START_TIMEOUT_S)
    except subprocess.TimeoutExpired:  # every Python process of the start prints its threads' stacks, and ends
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGABRT)
        try:
            stdout, stderr = proc.communicate(timeout=30)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            stdout, stderr = proc.communicate()
        at = stderr.find("most recent call first")
        stacks = stderr[max(0, at - 200) :] if at >= 0 else ""
        whose = (
            " (started through the warm process: these are the launcher's stacks, not the engine's)" if launcher else ""
        )
        raise SystemExit(
            f"{mode} engine gave no result in {START_TIMEOUT_S:.0f} s (stopped with SIGABRT){whose}:\n"
            f"{(stdout + stderr)[-3000:]}\n{stacks[:12000]}"
        ) from None
    except BaseException:  # (an interrupt): the start's processes do not outlive the benchmark
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        raise
    text = stdout + stderr
    found = [line for line in stdout.splitlines() if line.startswith("MARKS ")]
    if proc.returncode != 0 or not found:
        raise SystemExit(f"{mode} engine failed ({proc.returncode}):\n{text[-6000:]}")
    result: dict[str, Any] = json.loads(found[-1].removeprefix("MARKS "))
    result.update(
        mode=mode,
        phases=phases_of(text),
        imports=import_marks(text),
        log_tail=[line for line in text.splitlines() if "weightcache" in line][-6:],
    )
    # whether vLLM loaded its AOT-compiled function or compiled again, and why, in its own words
    result["aot"] = [
        line[-300:] for line in text.splitlines() if not line.startswith("MARKS ") and re.search(COMPILE_LINES, line)
    ][:6]
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workdir", default=None)
    parser.add_argument("--json", default=None, help="write every run here")
    parser.add_argument("--repeat", type=int, default=1, help="fresh processes per mode (auto and client)")
    parser.add_argument("--cold-compile", action="store_true", help="an empty vLLM cache directory for each start")
    parser.add_argument("--layers", type=int, default=None, help="fewer layers (a smaller model)")
    parser.add_argument(
        "--deadline-s",
        type=float,
        default=None,
        help="empty-disk: leave out a round of clients that would end past this many seconds from the first start",
    )
    parser.add_argument(
        "--multiprocessing",
        action="store_true",
        help="restart: each round also runs the plain and the warm client with vLLM's engine in its own process "
        "(VLLM_ENABLE_V1_MULTIPROCESSING=1); every start reports each process's import phase (IMPORTMARK)",
    )
    parser.add_argument(
        "--cudagraph-mode",
        default=None,
        help="vLLM's compilation_config cudagraph_mode for every start (e.g. FULL_DECODE_ONLY; default: vLLM's)",
    )
    parser.add_argument(
        "--scenario",
        choices=("weights", "compile", "empty-disk", "restart", "graphs"),
        default="weights",
        help="weights: auto, daemon, client (the compile cache as it is); compile: vLLM's compile cache from the "
        "keeper (auto cold, auto with a warm local cache, daemon (publishes weights and compile cache), then "
        "client with the cache directory wiped before each start); empty-disk: auto, daemon and a first client with "
        "vLLM's and Triton's cache directories wiped (a new container each time), then rounds of a client from an "
        "empty disk beside one from the warm local disk, then auto from the warm local disk; restart (issue 29): "
        "daemon and a first client from an empty disk, then rounds of three clients from an empty disk: plain, "
        "with another cache root, and forked by the warm process (weightcache run); graphs (issue 31): daemon and "
        "a first client with the vLLM graph kind on (records and publishes the FULL graphs), then rounds of three "
        "clients from an empty disk: kind on (FULL graphs from the keeper), kind off (vLLM captures them), kind on "
        "and forked by the warm process; every start times vLLM's graph phase and checks 8 prompts x 16 greedy "
        "tokens",
    )
    args = parser.parse_args()

    from weightcache.backends.vllm_compile import SWITCH_ENV as SWITCH
    from weightcache.checkpoint import drop_page_cache

    work = Path(args.workdir or tempfile.mkdtemp(prefix="wc-vllm-"))
    ckpt = work / "llama3-8b-random"
    if not (ckpt / "config.json").exists():
        t = time.perf_counter()
        build_checkpoint(ckpt, "cuda:0", {} if args.layers is None else {"num_hidden_layers": args.layers})
        print(f"checkpoint written in {time.perf_counter() - t:.1f} s", flush=True)
    socket_dir = Path(tempfile.mkdtemp(prefix="wc-")) / "s"
    env = dict(os.environ, VLLM_ENABLE_V1_MULTIPROCESSING="0")
    if args.cudagraph_mode:
        env["BENCH_CUDAGRAPH_MODE"] = args.cudagraph_mode
    marks = marks_plugin(Path(tempfile.mkdtemp(prefix="wc-marks-")))
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(marks), env.get("PYTHONPATH")]))
    runs: list[dict[str, Any]] = []

    began = time.perf_counter()
    round_s: list[float] = []

    def once(
        mode: str,
        drop: bool,
        way: str | None = None,
        wipe: tuple[Path, ...] = (),
        extra: dict[str, str] | None = None,
        launcher: list[str] | None = None,
    ) -> None:
        """One fresh engine in ``mode``; ``wipe``: directories deleted first; ``way``: the row's name; ``extra``:
        environment variables for this start. Every run is written to ``--json`` as soon as it ends."""
        for directory in wipe:
            shutil.rmtree(directory, ignore_errors=True)
        run_env = {**env, **(extra or {})}
        if args.cold_compile:
            run_env["VLLM_CACHE_ROOT"] = tempfile.mkdtemp(prefix="vllm-cache-")
        if drop:
            drop_page_cache(ckpt, system=True)
        result = run_engine(mode, ckpt, socket_dir, run_env, launcher)
        if way is not None:
            result["way"] = way
        runs.append(result)
        if args.json:
            Path(args.json).write_text(json.dumps({"complete": False, "runs": runs}, indent=1))
        print(
            json.dumps(
                {
                    k: result.get(k)
                    for k in ("mode", "marks", "phases", "imports", "token", "kv_blocks", "artifacts", "graphs")
                }
            ),
            flush=True,
        )

    def warm_launcher() -> list[str]:
        """Start the warm process (vLLM imported once) and wait for it; the launcher that forks a start from it."""
        command = ["warm", "start", "--socket-dir", str(socket_dir), "--preload", PRELOADS]
        t = time.perf_counter()
        started = subprocess.run(
            [sys.executable, "-m", "weightcache", *command, "--", sys.executable, "-c", "pass"],
            env=env,
            capture_output=True,
            text=True,
        )
        print(f"warm process ready in {time.perf_counter() - t:.1f} s: {started.stdout}{started.stderr}", flush=True)
        launcher = [sys.executable, "-m", "weightcache", "run", "--socket-dir", str(socket_dir)]
        return [*launcher, "--preload", PRELOADS, "--"]

    def in_rounds(rounds: list[tuple[str, tuple[Path, ...], dict[str, str], list[str] | None]]) -> None:
        """``--repeat`` rounds of one client start per ``(way, wipe, extra, launcher)``, leaving out a round that
        would end past ``--deadline-s`` (judged by the last round)."""
        for i in range(args.repeat):
            if args.deadline_s and i and time.perf_counter() - began + 1.2 * round_s[-1] > args.deadline_s:
                print(f"round {i + 1} left out: past --deadline-s", flush=True)
                break
            t = time.perf_counter()
            for way, wipe, extra, launcher in rounds:
                once("client", True, way, wipe, extra, launcher)
            round_s.append(time.perf_counter() - t)

    # one cache root for every start of the compile scenarios (its path is part of the artifact's key)
    root, triton = work / "vllm-cache", Path.home() / ".triton" / "cache"
    if args.scenario == "weights":
        for _ in range(args.repeat):
            once("auto", drop=True)
        once("daemon", drop=True)
        for _ in range(args.repeat):
            once("client", drop=True)
    elif args.scenario == "empty-disk":
        env["VLLM_CACHE_ROOT"] = str(root)
        env.pop("TRITON_CACHE_DIR", None)
        empty = (root, triton)
        once("auto", True, "auto, empty disk (cold)", empty)
        once("daemon", True, "daemon, empty disk (compiles; publishes weights, compile cache, model info)", empty)
        once("client", True, "client 1, empty disk (the first start after the compiling one)", empty)
        rounds = [
            ("client, empty disk (weights, compile cache, Triton kernels, model info from the keeper)", empty, {}),
            # what the restores above left on disk is what vLLM wrote (bit for bit): the warm local disk of a
            # machine that keeps it; the keeper's compile cache switched off, so that only the disk serves
            ("client, warm local disk (compile cache from the keeper off)", (), {SWITCH: "0"}),
        ]
        last_start_s = 0.7 * runs[0]["marks"]["first token"]  # auto from a warm disk, by auto from an empty one
        for i in range(args.repeat):
            ends_s = time.perf_counter() - began + 1.3 * round_s[-1] + last_start_s if i else 0.0
            if args.deadline_s and ends_s > args.deadline_s:
                print(f"round {i + 1} left out: past --deadline-s", flush=True)
                break
            t = time.perf_counter()
            for way, wipe, extra in rounds:
                once("client", True, way, wipe, extra)
            round_s.append(time.perf_counter() - t)
        once("auto", True, "auto, warm local disk (what vLLM and the restores above left)")
    elif args.scenario == "restart":
        env["VLLM_CACHE_ROOT"] = str(root)
        env.pop("TRITON_CACHE_DIR", None)
        empty = (root, triton)
        other = work / "another-cache-root" / "vllm"
        once("daemon", True, "daemon, empty disk (compiles; publishes weights, compile cache, model info)", empty)
        once("client", True, "client 1, empty disk (the first start after the compiling one)", empty)
        warm = warm_launcher()
        rounds = [
            ("client, empty disk (everything from the keeper)", empty, {}, None),
            ("client, empty disk, another cache root", (other, triton), {"VLLM_CACHE_ROOT": str(other)}, None),
            ("client, empty disk, forked by the warm process", empty, {}, warm),
        ]
        if args.multiprocessing:
            separate = {"VLLM_ENABLE_V1_MULTIPROCESSING": "1"}
            rounds += [
                ("client, empty disk, engine in its own process", empty, separate, None),
                ("client, empty disk, engine in its own process, forked by the warm process", empty, separate, warm),
            ]
        in_rounds(rounds)
    elif args.scenario == "graphs":
        from weightcache.backends.vllm_graphs import SWITCH_ENV as GRAPHS

        env.update(VLLM_CACHE_ROOT=str(root), BENCH_GRAPH_TIMER="1", BENCH_PROMPTS="8", BENCH_MAX_TOKENS="16")
        env.pop("TRITON_CACHE_DIR", None)
        env.pop(GRAPHS, None)
        empty, kind = (root, triton), {GRAPHS: "1"}
        once("daemon", True, "daemon, empty disk (kind off: publishes weights, compile cache, model info)", empty)
        once("client", True, "client 1, empty disk, graph kind on (records and publishes the FULL graphs)", empty, kind)
        warm = warm_launcher()
        in_rounds(
            [
                ("client, empty disk, graph kind on (FULL graphs from the keeper)", empty, kind, None),
                ("client, empty disk, graph kind off (vLLM captures every graph)", empty, {}, None),
                ("client, empty disk, graph kind on, forked by the warm process", empty, kind, warm),
                ("client, empty disk, graph kind off, forked by the warm process", empty, {}, warm),
            ]
        )
    else:
        env["VLLM_CACHE_ROOT"] = str(root)
        for _ in range(args.repeat):
            once("auto", True, "auto, cold (empty cache directory)", (root,))
        for _ in range(args.repeat):
            once("auto", True, "auto, warm local cache")
        once("daemon", True, "daemon, warm local cache (publishes weights and compile cache)")
        for _ in range(args.repeat):
            once("client", True, "client, wiped cache directory (weights and compile cache from the keeper)", (root,))
    keys = [r.get("way", r["mode"]) for r in runs]
    summary = {
        key: {
            "first token (median s)": statistics.median(
                r["marks"]["first token"] for r in runs if r.get("way", r["mode"]) == key
            ),
            "runs": keys.count(key),
        }
        for key in dict.fromkeys(keys)
    }
    for key, row in summary.items():
        mine = [r for r in runs if r.get("way", r["mode"]) == key]
        phases = [sum(r["marks"]["graph phases"]) for r in mine if r["marks"].get("graph phases")]
        if phases:
            row["graph phase (median s)"] = statistics.median(phases)
        kinds = [g for r in mine if isinstance(r.get("graphs"), list) for g in r["graphs"]]
        if kinds:
            row["FULL graphs restored, captured"] = sorted({(g["restored"], g["captured"]) for g in kinds})
            totals = [g.get("seconds", {}).get("total", 0.0) for g in kinds]
            row["kind's FULL graphs (median s)"] = statistics.median(totals)
    same_token = len({r["token"] for r in runs}) == 1 and len({json.dumps(r["tokens"]) for r in runs}) == 1
    print(json.dumps(summary, indent=1), "\nthe same greedy tokens in every run:", same_token, flush=True)
    if args.json:
        report = {"complete": True, "same_token": same_token, "summary": summary, "runs": runs}
        Path(args.json).write_text(json.dumps(report, indent=1))
    subprocess.run([sys.executable, "-m", "weightcache", "stop", "--socket-dir", str(socket_dir)], check=False)
    return 0 if same_token else 1


if __name__ == "__main__":
    raise SystemExit(main())

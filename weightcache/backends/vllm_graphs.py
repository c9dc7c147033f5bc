"""vLLM's FULL CUDA graphs restored from the keeper instead of captured: the ``cuda.graphs`` artifact kind for vLLM
(issue 31). **Opt-in and experimental**: ``WEIGHTCACHE_VLLM_GRAPHS=1``. On an H100 (2026-12-06, vLLM 0.26.0,
``FULL_DECODE_ONLY``) every restoring engine restored all 51 FULL graphs with the same greedy tokens, and vLLM's graph
phase took 0.70 s against 1.97 s with vLLM capturing them, in engines forked by the warm process (docs/benchmarks.md).

A vLLM start captures two kinds of graphs (docs/architecture.md, "Restoring captured CUDA graphs at recorded
addresses", the vLLM artifact kind; measured on an H100 with vLLM 0.26.0): FULL graphs, whole forward passes for the
decode sizes, and PIECEWISE graphs, the pieces between attention calls. The PIECEWISE graphs read attention's
output, which attention allocates eagerly from torch's default pool, so a fresh process cannot be shown to have it
at the captured address: they are captured by vLLM as always. The FULL graphs read the weights, their own graph
memory and the model runner's persistent buffers (inputs, block tables, attention metadata, the KV cache), so this
module gives them what a :class:`~weightcache.torch_graphs.GraphCache` restores:

- their graph memory comes from the GraphCache's arena (``GraphCache.pool``, instead of vLLM's shared pool: the
  FULL graphs no longer share memory with the PIECEWISE ones), and the manager's ``hidden_states``, which they
  write, is allocated in the arena too;
- the model's buffers and (up to :data:`ADOPT_PARAMETERS_MAX`) its parameters that are not the keeper's weights
  at their homes (a rotary embedding's cos/sin table, which the FULL graphs read: on the H100, 2026-12-05, every
  graph was refused recording for it, "48 address(es) outside the reproduced ranges") are copied into the arena
  (``GraphCache.adopt``, in the model's order, the memory they had kept for the PIECEWISE graphs vLLM captured
  before; not under ``VLLM_LOGGING_LEVEL=DEBUG``, where vLLM checks that PIECEWISE replays' inputs did not move:
  FULL graphs that read such a tensor are then captured and not recorded);
- every CUDA tensor the model runner reaches (its buffers, its KV caches, the attention metadata builders'
  buffers) is declared with ``GraphCache.external`` under ``runner.<its attribute path>`` (``runner.kv_caches.0``;
  a ``/`` in a key becomes ``|``), before each graph, so that a restore finds each where it was recorded or
  elsewhere (relocated), or captures the graph; after the first graph only the tensors the next one reads
  (``GraphCache.reads``) are looked up again, by the steps that found them, unless one is new or gone;
- each FULL graph is restored by its descriptor's name in vLLM's order (``GraphCache.restore``), or captured as
  vLLM does (its warm-up run, then the capture) through ``GraphCache.capturing``, which records it; the artifact
  is published after the last one. A restored graph skips vLLM's warm-up run and capture; its inputs are still
  prepared (``create_forward_fn``), as attention backends may set per-size state there.

The key holds what puts scalars into the graphs' kernel arguments, which no address check sees (:func:`graphs_key`):
vLLM's version, config hash and compile environment variables, ``max_num_seqs``, FlashInfer's version, the KV
cache's configuration, the descriptors, and the shape, stride and dtype of every tensor the runner reaches.

What it supports: vLLM's V2 GPU model runner (``vllm.v1.worker.gpu``: ``CudaGraphManager.capture(create_forward_fn,
...)``, ``GPUModelRunner.capture_model``) of the releases in :data:`RELEASES` (0.26.0), one rank (no tensor, data
or pipeline parallelism: ranks deciding apart whether to restore would wait on each other's collectives), no
LoRA, no auxiliary hidden states, weights from weightcache (``--load-format weightcache``). Anything else, and any
failure, leaves vLLM's own capture in place, with a log line that says why; the engine always starts. The FULL
graphs' memory in the arena is not in vLLM's memory budget (which counted it shared with the PIECEWISE pool):
leave room. Every tensor the runner reaches when a graph is declared stays alive as long as the engine
(``GraphCache.external`` keeps what it was given).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import importlib
import importlib.metadata
import logging
import os
import re
import time
import weakref
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch

from ..cache import Cache
from ..fingerprint import Fingerprint

log = logging.getLogger(__name__)

#: ``WEIGHTCACHE_VLLM_GRAPHS=1`` turns the kind on (off by default: experimental, one vLLM release, one rank).
SWITCH_ENV = "WEIGHTCACHE_VLLM_GRAPHS"
#: Where vLLM's V2 GPU runner keeps its graph managers and its model runner.
MANAGERS = "vllm.v1.worker.gpu.cudagraph_utils"
RUNNER = "vllm.v1.worker.gpu.model_runner"
#: How deep :func:`runner_tensors` looks into the model runner's attributes (FlashInfer's per-size decode
#: wrappers' workspaces lie 8 steps down: ``attn_groups.0.0.metadata_builders.0._decode_wrappers_cudagraph.<n>...``).
DEPTH = 10
#: The vLLM releases whose V2 runner this kind is written against (others: vLLM's own capture, with a log line).
RELEASES = ("0.26.0",)
#: Whose objects :func:`runner_tensors` looks into (by the first part of their class's module).
WALKED = ("vllm", "torch", "flashinfer")

#: The most bytes of model parameters outside the keeper's homes that the kind copies into the graphs' arena (see
#: ``_few_parameters_outside``); the model's buffers are copied whatever their size.
ADOPT_PARAMETERS_MAX = 64 << 20

#: The steps of a report's ``seconds``: ``warmup`` (one run of the largest size before the key is computed),
#: ``cache`` (the GraphCache made: its arena, the artifact asked for, mapped and parsed), ``adopt`` (the model's
#: tensors that are not the keeper's copied into the arena), ``inputs`` (vLLM's
#: ``create_forward_fn`` for each restored graph), ``declare`` (the runner's tensors walked and declared before each
#: graph), ``restore`` (the restored graphs' checks and builds), ``capture`` (the graphs captured here, their
#: warm-up runs and records included), ``publish``, and ``total`` (the FULL graphs from the warm-up on).
STEPS = ("warmup", "cache", "adopt", "inputs", "declare", "restore", "capture", "publish", "total")

_PENDING: dict[int, tuple[Fingerprint | str, Cache]] = {}  # id(vllm_config) -> the weights and the keeper
_REPORTS: list[dict[str, Any]] = []


def switched_on() -> bool:
    """Whether the operator turned the kind on (:data:`SWITCH_ENV`), and not weightcache off
    (``WEIGHTCACHE_MODE=off``, the kill switch for every entry point)."""
    from ..pipeline import switched_off

    return os.environ.get(SWITCH_ENV, "").strip().lower() in ("1", "on", "true", "yes") and not switched_off()


def reports() -> list[dict[str, Any]]:
    """What each capture of this process did: ``restored`` FULL graphs and ``captured`` ones (captured here,
    through :meth:`~weightcache.torch_graphs.GraphCache.capturing`; None where the kind stood aside before the graph
    phase, for another release, rank count or feature: vLLM captured every graph; the graphs the kind left to vLLM's
    own capture, all of them where no GraphCache could be had, the rest after an exception, are counted in
    neither), ``recorded``, ``published``, ``reason`` (why the first graph not restored was captured, ``graph
    '<name>' is captured: <why>``, or why the kind stood aside or left graphs to vLLM; an exception that stopped
    the kind replaces it, ``<type>: <message>``), ``record_problem`` (why the first graph captured here was not
    recorded, ``graph '<name>': <why>``; None where each was), ``seconds`` (where the kind's time went,
    :data:`STEPS`; absent where it stood aside before the graph phase), ``restore_steps`` (the ``restore``
    step by the restored graphs' own steps, summed over them: ``map``, ``checks``, ``relocate``, ``extents``,
    ``wait`` for a graph built ahead and that build's ``ahead_kernels``, ``ahead_rebuild``, ``ahead_instantiate``,
    or ``kernels``, ``rebuild``, ``instantiate`` where built on the caller's thread: each graph's
    :attr:`~weightcache.torch_graphs.CudaGraph.phases`),
    ``start_steps`` (the GraphCache's start-up, :attr:`~weightcache.torch_graphs.GraphCache.phases`, and its
    kernel images' loads, ``images_<step>`` of :attr:`~weightcache.torch_graphs.GraphCache.image_steps`),
    ``relocated`` (pointers the restored graphs moved with the runner's tensors,
    :attr:`~weightcache.torch_graphs.GraphCache.relocated`),
    ``graph_phase_s`` (vLLM's whole
    ``capture_model``: the PIECEWISE graphs, the FULL ones and vLLM's own steps around them) and ``images_freed``
    (the bytes of kernel images let go after that phase, :func:`~weightcache.graphs.cubins.stop_keeping_kernel_images`:
    nothing more is recorded in this engine)."""
    return list(_REPORTS)


def register() -> None:
    """From the vLLM plugin, in each vLLM process, when :func:`switched_on`: keep every kernel image from now on
    (before the model's first kernel: a graph's kernels must be found in a fresh process) and hook the V2
    runner's capture. Raises what the hook's imports raise (the plugin logs it and goes on)."""
    if not switched_on():
        return
    from ..graphs.cubins import keep_kernel_images

    try:
        keep_kernel_images()
    except Exception as exc:  # GraphRestoreError: no CUPTI; graphs are captured as usual, the hook says why
        log.info("weightcache: vLLM's graphs will be captured as usual: %s", exc)
    install_hook()


def begin(vllm_config: Any, weights: Fingerprint | str, cache: Cache) -> None:
    """At the load (the weights are the keeper's): remember them for this engine's capture."""
    if switched_on():
        _PENDING[id(vllm_config)] = (weights, cache)


_hooked: set[type] = set()


def install_hook() -> None:
    """Wrap ``GPUModelRunner.capture_model`` (to hand the runner to its manager) and ``CudaGraphManager.capture``
    of vLLM's V2 runner; idempotent."""
    managers = importlib.import_module(MANAGERS)
    runner_cls = importlib.import_module(RUNNER).GPUModelRunner
    manager_cls = managers.CudaGraphManager
    if runner_cls not in _hooked and "capture_model" in vars(runner_cls):
        runner_cls.capture_model = _with_runner(runner_cls.capture_model)
        _hooked.add(runner_cls)
    if manager_cls not in _hooked and "capture" in vars(manager_cls):
        manager_cls.capture = _capturing(manager_cls.capture)
        _hooked.add(manager_cls)


def _with_runner(original: Callable[..., Any]) -> Callable[..., Any]:
    def capture_model(self: Any, *args: Any, **kwargs: Any) -> Any:
        manager = getattr(self, "cudagraph_manager", None)
        if manager is not None:
            manager._weightcache_runner = self
        before, began = len(_REPORTS), time.perf_counter()
        try:
            return original(self, *args, **kwargs)
        finally:
            seconds = round(time.perf_counter() - began, 4)
            if manager is not None:
                manager._weightcache_runner = None
            for report in _REPORTS[before:]:
                report["graph_phase_s"] = seconds
            if len(_REPORTS) > before:
                log.info("weightcache: vLLM's graph phase took %.3f s", seconds)
                _stop_keeping(_REPORTS[before:])

    capture_model.__wrapped__ = original  # type: ignore[attr-defined]
    return capture_model


def _stop_keeping(reports: list[dict[str, Any]]) -> None:
    """After vLLM's graph phase nothing more is recorded in this engine: let go of the kernel images kept since
    :func:`register` (a process that restored every graph never reads them, and the callback's queue would grow
    with each module loaded while serving); how many bytes that freed goes into ``reports``."""
    from ..graphs.cubins import stop_keeping_kernel_images

    try:
        freed = stop_keeping_kernel_images()
    except Exception as exc:  # never the engine's problem
        log.warning("weightcache: the kept kernel images were not let go (%s: %s)", type(exc).__name__, exc)
        return
    for report in reports:
        report["images_freed"] = freed
    log.info("weightcache: %d bytes of kept kernel images let go after the graph phase", freed)


def _capturing(original: Callable[..., Any]) -> Callable[..., Any]:
    def capture(self: Any, create_forward_fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            managers = importlib.import_module(MANAGERS)
            full_mode = managers.CUDAGraphMode.FULL
            why = _unsupported(self)
        except Exception as exc:  # a release whose manager differs: vLLM's own capture
            why = f"this vLLM's graph manager is not the one this kind knows ({type(exc).__name__}: {exc})"
        if why is not None:
            if switched_on() and getattr(self, "_weightcache_runner", None) is not None:  # (not a speculator's)
                log.info("weightcache: vLLM's graphs are captured as usual: %s", why)
                _REPORTS.append({"restored": 0, "captured": None, "recorded": 0, "published": False, "reason": why})
            return original(self, create_forward_fn, *args, **kwargs)
        full = self._capture_descs.pop(full_mode)
        try:  # the PIECEWISE graphs, as vLLM captures them
            original(self, create_forward_fn, *args, **kwargs)
        finally:
            self._capture_descs[full_mode] = full
        left = _full_graphs(self, managers, full, create_forward_fn)
        if left:  # what this module could not do: vLLM's own capture of those graphs
            captures, self._capture_descs = self._capture_descs, {full_mode: left}
            try:
                original(self, create_forward_fn, *args, **kwargs)
            finally:
                self._capture_descs = captures
        self._graphs_captured = True
        return None

    capture.__wrapped__ = original  # type: ignore[attr-defined]
    return capture


def _unsupported(manager: Any) -> str | None:
    """Why this capture is left to vLLM, or None."""
    if not switched_on():
        return f"{SWITCH_ENV} is not set"
    import vllm

    if vllm.__version__ not in RELEASES:
        return f"vLLM {vllm.__version__} is not among the releases this kind supports ({', '.join(RELEASES)})"
    managers = importlib.import_module(MANAGERS)
    runner = getattr(manager, "_weightcache_runner", None)
    if runner is None or not hasattr(manager, "_capture_descs"):
        return "not vLLM's V2 GPU model runner, whose capture this kind knows"
    if managers.CUDAGraphMode.FULL not in manager._capture_descs:
        return "no FULL graphs to capture"
    if id(runner.vllm_config) not in _PENDING:
        return "the weights are not weightcache's (--load-format weightcache)"
    from vllm.distributed.parallel_state import get_world_group

    checks = {
        # ranks deciding apart whether to restore would wait on each other's collectives (and the custom
        # all-reduce registers buffers only for graphs it captured)
        "more than one rank": get_world_group().world_size != 1 or getattr(manager, "tp_size", 1) != 1,
        "pipeline parallelism": not (manager.is_first_pp_rank and manager.is_last_pp_rank),
        "data parallelism": getattr(manager, "dp_size", 1) != 1,
        "auxiliary hidden states": bool(getattr(manager, "use_aux_hidden_state_outputs", False)),
        "LoRA": any(d.num_active_loras for d in manager._capture_descs[managers.CUDAGraphMode.FULL]),
        "hidden states made before the capture": getattr(manager, "hidden_states", None) is not None,
    }
    found = [name for name, present in checks.items() if present]
    return f"not supported by this kind: {', '.join(found)}" if found else None


def graph_name(desc: Any) -> str:
    """The artifact's name of the graph of a ``BatchExecutionDescriptor``: its fields, in order."""
    if dataclasses.is_dataclass(desc) and not isinstance(desc, type):
        fields = [(f.name, getattr(desc, f.name)) for f in dataclasses.fields(desc)]
    else:
        fields = sorted(vars(desc).items())
    return "full:" + ",".join(f"{k}={getattr(v, 'name', v)}" for k, v in fields if k != "cg_mode")


def runner_tensors(
    runner: Any, depth: int = DEPTH, keep: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda
) -> Iterator[tuple[str, torch.Tensor]]:
    """Every tensor the model runner reaches through its attributes, dicts, lists and tuples that ``keep`` (CUDA
    tensors) and has elements: into the objects of :data:`WALKED` packages, not into ``nn.Module`` s (whose
    weights are the keeper's), at most ``depth`` steps down, each object once, named by its attribute path
    (``kv_caches.0``, ``input_buffers.positions``, ...)."""
    for path, _, tensor in _walk(runner, depth, keep):
        yield path, tensor


#: The kinds of step from an object to one it holds: a mapping's key, a list's or tuple's index, an attribute.
_KEY, _INDEX, _ATTRIBUTE = 0, 1, 2
_Steps = tuple[tuple[int, Any], ...]


def _walk(
    runner: Any, depth: int = DEPTH, keep: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda
) -> Iterator[tuple[str, _Steps, torch.Tensor]]:
    """:func:`runner_tensors` with the steps that lead from the runner to each tensor (:func:`_follow` takes them
    again)."""
    seen: set[int] = set()
    stack: list[tuple[Any, str, _Steps, int]] = [(runner, "", (), 0)]
    while stack:
        obj, path, steps, level = stack.pop()
        if id(obj) in seen or level > depth:
            continue
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            if obj.numel() and keep(obj):
                yield path, steps, obj
            continue
        if isinstance(obj, torch.nn.Module):
            continue
        items: list[tuple[Any, Any]]
        if isinstance(obj, Mapping):
            kind, items = _KEY, list(obj.items())
        elif isinstance(obj, (list, tuple)):
            kind, items = _INDEX, list(enumerate(obj))
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in WALKED:
            kind, items = _ATTRIBUTE, list(vars(obj).items())
        else:
            continue
        for key, value in reversed(items[:4096]):
            stack.append((value, f"{path}.{key}" if path else str(key), (*steps, (kind, key)), level + 1))


def _follow(runner: Any, steps: _Steps) -> torch.Tensor | None:
    """The tensor that ``steps`` (from :func:`_walk`) lead to from ``runner`` now; None where a step is gone or
    they lead to something else."""
    obj = runner
    try:
        for kind, key in steps:
            if kind == _KEY:
                obj = obj[key] if isinstance(obj, Mapping) else None
            elif kind == _INDEX:
                obj = obj[key] if isinstance(obj, (list, tuple)) and 0 <= key < len(obj) else None
            else:
                obj = vars(obj).get(key) if hasattr(obj, "__dict__") else None
            if obj is None:
                return None
    except (KeyError, TypeError):
        return None
    return obj if isinstance(obj, torch.Tensor) else None


#: An address a refusal names (``holds 0x...``, ``allocation ...: 0x..., 0x...``), not an allocation's base.
_ADDRESS = re.compile(r"(?<!allocation )\b(0x[0-9a-f]{6,})\b")


def owners(problem: str, runner: Any, keep: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda, most: int = 8) -> str:
    """For a graph refused recording: which tensors of the model (``model.<name>``, its parameters and buffers)
    and of the runner (``runner.<path>``, :func:`runner_tensors`) hold the addresses ``problem`` names (each
    tensor's whole storage), as text to append to it; empty where it names none, or where looking fails (never
    raises: it only adds words to a report)."""
    try:
        addresses = {int(a, 16) for a in _ADDRESS.findall(problem)}
        if not addresses:
            return ""
        model = getattr(runner, "model", None)
        tensors = [(f"runner.{path}", t) for path, t in runner_tensors(runner, keep=keep)]
        if isinstance(model, torch.nn.Module):
            tensors += [(f"model.{n}", t) for n, t in [*model.named_parameters(), *model.named_buffers()] if keep(t)]
        inside: set[str] = set()
        for name, tensor in tensors:
            storage = tensor.untyped_storage()
            first = storage.data_ptr()
            if any(first <= a < first + storage.nbytes() for a in addresses):
                inside.add(name)
    except Exception as exc:  # a tensor subclass without storage, an odd runner attribute
        log.debug("weightcache: the tensors behind a graph's addresses were not found: %s", exc)
        return ""
    if not inside:
        return "; no tensor of the model or the runner holds those addresses"
    named = sorted(inside)
    extra = f" and {len(named) - most} more" if len(named) > most else ""
    return f"; the tensors holding them: {', '.join(named[:most])}{extra}"


def graphs_key(runner: Any, manager: Any, descs: list[Any]) -> dict[str, Any]:
    """What decides the FULL graphs besides the weights (a graph holds sizes, strides and flags as scalar
    arguments, which no address check sees): vLLM's version, its config hash, the environment variables vLLM
    keys its compile cache with (``envs.compile_factors``: e.g. ``VLLM_KV_CACHE_LAYOUT``, which permutes the KV
    cache's strides), ``max_num_seqs`` (not in the config hash), FlashInfer's version, the KV cache's
    configuration, the descriptors, and the path, shape, stride and dtype of every tensor the runner reaches
    (GraphCache adds torch, CUDA, driver, GPU and arena)."""
    import vllm

    config = runner.vllm_config
    try:
        config_hash = str(config.compute_hash())
    except Exception:  # a release without it: its text (changes with any option)
        config_hash = str(config)
    try:
        import vllm.envs as envs

        factors: object = envs.compile_factors()
    except Exception:  # a release without it: every VLLM_ variable set
        factors = {k: v for k, v in os.environ.items() if k.startswith("VLLM_")}
    factors_text = repr(sorted(factors.items(), key=repr) if isinstance(factors, Mapping) else factors)
    try:
        flashinfer = importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        flashinfer = None
    layouts = sorted((path, list(t.shape), list(t.stride()), str(t.dtype)) for path, t in runner_tensors(runner))
    return {
        "engine": "vllm",
        "vllm": vllm.__version__,
        "config": config_hash,
        "env": hashlib.sha256(factors_text.encode()).hexdigest(),
        "max_num_seqs": getattr(getattr(config, "scheduler_config", None), "max_num_seqs", None),
        "flashinfer": flashinfer,
        "kv_cache": repr(getattr(runner, "kv_cache_config", None)),
        "graphs": [graph_name(d) for d in descs],
        "hidden": str(getattr(getattr(runner, "model_config", None), "dtype", "")),
        "tensors": hashlib.sha256(repr(layouts).encode()).hexdigest(),
    }


def _full_graphs(manager: Any, managers: Any, descs: list[Any], create_forward_fn: Any) -> list[Any]:
    """Restore or capture (and record) the FULL graphs of ``descs`` in order; the descriptors left for vLLM's own
    capture (all of them where the GraphCache cannot be made, the rest after a failure). Never raises for the
    cache's sake."""
    from ..torch_graphs import GraphCache

    runner = manager._weightcache_runner
    weights, keeper = _PENDING[id(runner.vllm_config)]
    seconds = dict.fromkeys(STEPS, 0.0)
    restore_steps: dict[str, float] = {}
    report: dict[str, Any] = {
        "restored": 0,
        "captured": 0,
        "recorded": 0,
        "published": False,
        "reason": None,
        "record_problem": None,
        "seconds": seconds,
        "restore_steps": restore_steps,
    }
    _REPORTS.append(report)
    graphs: GraphCache | None = None
    done = 0
    began = time.perf_counter()

    @contextlib.contextmanager
    def step(name: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            seconds[name] = round(seconds[name] + time.perf_counter() - started, 4)

    try:
        with managers.graph_capture(device=manager.device), torch.inference_mode():
            # one warm-up run of the largest size: what attention backends make lazily, the output's shape; the
            # key then sees every tensor the runner has
            with step("warmup"):
                create_forward_fn(descs[0], warmup=True)(managers.CUDAGraphMode.NONE)
            with step("cache"):
                key = graphs_key(runner, manager, descs)
                graphs = GraphCache(weights, key, device=manager.device, cache=keeper)
            manager._weightcache_graphs = graphs  # kept: restored graphs and the arena live as long as the engine
            if graphs.pool is None:
                report["reason"] = graphs.reason
                log.info("weightcache: vLLM's FULL graphs are captured as usual: %s", graphs.reason)
                return descs
            if graphs.reads(graph_name(descs[0])) is not None:  # an artifact to restore from: its graphs are built
                with step("declare"):  # from now on, while the model is adopted and the first inputs are made
                    output = id(manager.hidden_states)  # (not declared: replaced by the arena's below, and let go)
                    _declare(graphs, runner, keep=lambda t: t.is_cuda and id(t) != output)
                graphs.start_builds()
            model = getattr(runner, "model", None)
            if os.environ.get("VLLM_LOGGING_LEVEL", "").upper() == "DEBUG":
                # vLLM then checks that each PIECEWISE replay's inputs (the parameters and buffers among them)
                # are where they were at capture: a tensor moved into the arena would fail that check
                log.info("weightcache: VLLM_LOGGING_LEVEL=DEBUG: the model's tensors stay where they are")
            elif isinstance(model, torch.nn.Module):
                with step("adopt"):  # (the PIECEWISE graphs captured before read the memory they had: kept)
                    graphs.adopt(model, keep_previous=True, parameters=_few_parameters_outside(graphs, model))
            made = manager.hidden_states
            manager.hidden_states = graphs.empty(tuple(made.shape), made.dtype)  # the graphs' output, in the arena
            del made
            for desc in descs:
                with step("inputs"):
                    create_forward_fn(desc, warmup=False)  # inputs prepared as vLLM prepares them (per-size state)
                with step("declare"):
                    _declare(graphs, runner, graphs.reads(graph_name(desc)))
                with step("restore"):
                    restored = graphs.restore(graph_name(desc))
                if restored is not None:
                    manager.graphs[desc] = restored
                    report["restored"] += 1
                    for name, spent in restored.phases.items():
                        restore_steps[name] = round(restore_steps.get(name, 0.0) + spent, 4)
                else:
                    report["reason"] = report["reason"] or graphs.reason
                    with step("capture"):
                        problem = _capture(manager, managers, graphs, desc, create_forward_fn)
                    if problem is None:
                        report["recorded"] += 1
                    elif report["record_problem"] is None:
                        report["record_problem"] = f"graph {graph_name(desc)!r}: {problem}{owners(problem, runner)}"
                    report["captured"] += 1
                done += 1
        with step("publish"):
            report["published"] = graphs.publish()
    except Exception as exc:  # the graphs not made here are vLLM's to capture
        report["reason"] = f"{type(exc).__name__}: {exc}"
        log.warning("weightcache: vLLM's FULL graphs from graph %d on are captured as usual: %s", done + 1, exc)
        if graphs is not None:  # no worker thread of the GraphCache beside vLLM's captures (global capture mode)
            graphs.settle()
        return descs[done:]
    finally:
        seconds["total"] = round(time.perf_counter() - began, 4)
        if graphs is not None:
            images = {f"images_{name}": spent for name, spent in graphs.image_steps.items()}
            report["start_steps"] = {name: round(spent, 4) for name, spent in {**graphs.phases, **images}.items()}
            report["relocated"] = graphs.relocated
    log.info(
        "weightcache: vLLM's FULL graphs: %d restored, %d captured in %.3f s%s",
        report["restored"],
        report["captured"],
        seconds["total"],
        f" ({report['reason']})" if report["reason"] else "",
    )
    return []


def _few_parameters_outside(graphs: Any, model: torch.nn.Module) -> bool:
    """Whether the model's parameters that are not at the keeper's homes are few enough to copy into the arena
    (<= :data:`ADOPT_PARAMETERS_MAX` bytes: scales and the like). More means its weights are not the keeper's at
    their homes (a home that was taken): copying them would double their memory, and no graph could be restored
    anyway; then only the buffers are copied, and the log says so."""
    storages: dict[int, int] = {}
    for p in model.parameters():
        try:
            if p.is_cuda and not graphs.reproduced(p):
                storage = p.untyped_storage()
                storages[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):  # a tensor subclass without storage: adopt skips it too
            continue
    outside = sum(storages.values())
    if outside <= ADOPT_PARAMETERS_MAX:
        return True
    log.warning(
        "weightcache: %d parameter storage(s) of %d bytes are not at the keeper's homes: they are not copied into "
        "the graphs' arena, and graphs that read them are captured",
        len(storages),
        outside,
    )
    return False


@dataclasses.dataclass
class _Declared:
    """What :func:`_declare` declared to one GraphCache: each name's layout (address, shape, strides, dtype) and the
    steps from the runner to its tensor."""

    layouts: dict[str, tuple[Any, ...]] = dataclasses.field(default_factory=dict)
    steps: dict[str, _Steps] = dataclasses.field(default_factory=dict)


_DECLARED: weakref.WeakKeyDictionary[Any, _Declared] = weakref.WeakKeyDictionary()


def _declare(
    graphs: Any,
    runner: Any,
    needed: list[str] | None = None,
    keep: Callable[[torch.Tensor], bool] = lambda t: t.is_cuda,
) -> None:
    """Declare every CUDA tensor the runner reaches as an external range of ``graphs``, under its path; one
    declared before with the same address, shape, strides and dtype is not declared again (the kind declares
    before each of vLLM's 51 graphs: on the H100 the walk took 0.3-0.6 s of a start). ``needed`` (the names the
    next graph reads, ``GraphCache.reads``): where each was declared before, only those are looked up again, by
    the steps that led to them, instead of walking the runner; one not declared yet, or whose steps lead to no
    tensor now, makes it walk. A name found for another tensor than declared is not declared (the GraphCache
    raises, and then restores no graph that reads it: each is captured). ``keep``: which tensors the walk declares
    (CUDA tensors)."""
    declared = _DECLARED.setdefault(graphs, _Declared())
    if needed is not None and declared.steps and all(n in declared.steps for n in needed):
        found = [(n, _follow(runner, declared.steps[n])) for n in needed]
        if all(t is not None and t.numel() and t.is_cuda for _, t in found):
            for name, tensor in found:
                assert tensor is not None
                _declare_one(graphs, declared, name, declared.steps[name], tensor)
            return
    for path, steps, tensor in _walk(runner, keep=keep):
        _declare_one(graphs, declared, "runner." + path.replace("/", "|"), steps, tensor)


def _declare_one(graphs: Any, declared: _Declared, name: str, steps: _Steps, tensor: torch.Tensor) -> None:
    try:
        layout = (tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype)
        declared.steps.setdefault(name, steps)
        if declared.layouts.get(name) == layout:
            return
        graphs.external(name, tensor)
        declared.layouts[name] = layout
    except Exception as exc:  # e.g. a name now naming another tensor: a graph that reads it is captured
        log.debug("weightcache: runner tensor %s not declared: %s", name, exc)


def _capture(manager: Any, managers: Any, graphs: Any, desc: Any, create_forward_fn: Any) -> str | None:
    """One FULL graph captured as vLLM captures it (its warm-up run, fresh inputs, the capture), its memory from
    the arena, recorded by ``graphs``; None where it was recorded, else why not."""
    none = managers.CUDAGraphMode.NONE
    create_forward_fn(desc, warmup=True)(none)
    forward = create_forward_fn(desc, warmup=False)
    _declare(graphs, manager._weightcache_runner)
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    offloader = managers.get_offloader()
    offloader.sync_prev_onload()
    with graphs.capturing(graph_name(desc)) as capture:
        with torch.cuda.graph(graph, graphs.pool):
            forward(none)
            offloader.join_after_forward()
        capture.record(graph, (manager.hidden_states[: desc.num_tokens],))
    manager.graphs[desc] = graph
    counter = getattr(managers, "compilation_counter", None)
    if counter is not None and hasattr(counter, "num_cudagraph_captured"):
        counter.num_cudagraph_captured += 1  # as vLLM counts its captures
    problem: str | None = capture.problem
    return problem


__all__ = [
    "ADOPT_PARAMETERS_MAX",
    "DEPTH",
    "MANAGERS",
    "RELEASES",
    "RUNNER",
    "STEPS",
    "SWITCH_ENV",
    "WALKED",
    "begin",
    "graph_name",
    "graphs_key",
    "install_hook",
    "owners",
    "register",
    "reports",
    "runner_tensors",
    "switched_on",
]

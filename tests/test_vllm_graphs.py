"""The vLLM graph kind's parts that need no GPU and no vLLM (weightcache/backends/vllm_graphs.py): the switch, the
names of vLLM's graph descriptors, the walk that finds the model runner's tensors to declare, and the order of the
wrapped capture (fakes of vLLM's module, a stand-in for the GraphCache). Its GPU test is
tests/backends/test_vllm_cuda.py::test_full_graphs_of_a_second_engine_are_restored_and_give_the_same_tokens."""

from __future__ import annotations

import dataclasses
import enum
from typing import Any, ClassVar

import pytest
import torch

from weightcache.backends import vllm_graphs


@pytest.mark.parametrize(("value", "on"), [("1", True), ("on", True), ("yes", True), ("0", False), ("", False)])
def test_the_kind_is_on_only_when_the_operator_says_so(value: str, on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(vllm_graphs.SWITCH_ENV, value)
    monkeypatch.delenv("WEIGHTCACHE_MODE", raising=False)
    assert vllm_graphs.switched_on() is on
    monkeypatch.setenv("WEIGHTCACHE_MODE", "off")  # the kill switch turns every part of weightcache off
    assert vllm_graphs.switched_on() is False


def test_switched_off_register_and_begin_do_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """The plugin calls register() in every vLLM process: off, it imports nothing of vLLM's and keeps no images."""
    monkeypatch.delenv(vllm_graphs.SWITCH_ENV, raising=False)
    vllm_graphs.register()  # no vLLM in this environment: an import would raise
    vllm_graphs.begin(object(), "0" * 64, object())  # type: ignore[arg-type]
    assert vllm_graphs._PENDING == {}


class Mode(enum.Enum):
    FULL = 2


@dataclasses.dataclass(frozen=True)
class Desc:  # the fields of vLLM 0.26's BatchExecutionDescriptor
    cg_mode: Mode
    num_tokens: int
    num_reqs: int | None
    uniform_token_count: int | None = None
    num_active_loras: int = 0


def test_a_graph_is_named_by_its_descriptors_fields() -> None:
    names = {vllm_graphs.graph_name(Desc(Mode.FULL, n, r, u)) for n, r, u in [(8, 8, 1), (8, 4, 2), (16, 16, 1)]}
    assert len(names) == 3
    assert vllm_graphs.graph_name(Desc(Mode.FULL, 8, 8, 1)) == (
        "full:num_tokens=8,num_reqs=8,uniform_token_count=1,num_active_loras=0"
    )


def test_the_runner_walk_finds_each_tensor_once_by_its_path_and_stays_out_of_modules() -> None:
    """vLLM's runner keeps its buffers in its own objects, dicts and lists (``kv_caches``, ``input_buffers``,
    attention metadata builders); the walk names each tensor by its path, once however often it is reached, does
    not go into ``nn.Module`` s (the weights are the keeper's, at their homes) or other packages' objects, and stops
    at the depth it is given."""

    class Buffers:
        pass

    class Runner:
        pass

    class Foreign:
        pass

    for cls in (Buffers, Runner):
        cls.__module__ = "vllm.v1.worker.gpu.fake"
    buffers = Buffers()
    positions = torch.zeros(4)
    buffers.positions = positions  # type: ignore[attr-defined]
    buffers.empty = torch.zeros(0)  # type: ignore[attr-defined]
    runner = Runner()
    kv = [torch.zeros(2), torch.zeros(3)]
    runner.kv_caches = kv  # type: ignore[attr-defined]
    runner.input_buffers = buffers  # type: ignore[attr-defined]
    runner.again = {"positions": positions}  # type: ignore[attr-defined]
    runner.model = torch.nn.Linear(2, 2)  # type: ignore[attr-defined]
    foreign = Foreign()
    foreign.hidden = torch.zeros(5)  # type: ignore[attr-defined]
    runner.foreign = foreign  # type: ignore[attr-defined]
    deep: Any = {"d": torch.zeros(6)}
    for _ in range(vllm_graphs.DEPTH):
        deep = [deep]
    runner.deep = deep  # type: ignore[attr-defined]

    found = dict(vllm_graphs.runner_tensors(runner, keep=lambda t: True))
    assert set(found) == {"kv_caches.0", "kv_caches.1", "input_buffers.positions"}
    assert found["kv_caches.1"] is kv[1] and found["input_buffers.positions"] is positions
    assert dict(vllm_graphs.runner_tensors(runner)) == {}  # CUDA tensors only, by default
    one_deeper = dict(vllm_graphs.runner_tensors(runner, depth=vllm_graphs.DEPTH + 2, keep=lambda t: True))
    assert "deep" + ".0" * vllm_graphs.DEPTH + ".d" in one_deeper


def test_a_runner_tensor_is_declared_again_only_when_it_changed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The kind declares the runner's tensors before each FULL graph (a size's inputs may bring new ones); on the
    H100 (2026-12-05) that took 0.57 s of the 2.5 s the kind spent on 51 graphs. A tensor declared before with the
    same address, shape, strides and dtype is not declared again; one that changed, or is new, is."""
    positions, table = torch.zeros(4), torch.zeros(8)
    found = [("input_buffers.positions", (), positions), ("attn/0", (), table)]
    monkeypatch.setattr(vllm_graphs, "_walk", lambda runner, keep: iter(found))
    cache = StandInGraphCache("0" * 64, {}, device=None, cache=None)
    for _ in range(3):
        vllm_graphs._declare(cache, object())
    assert cache.declared == ["runner.input_buffers.positions", "runner.attn|0"]
    found[1] = ("attn/0", (), torch.zeros(8))  # a new tensor under that path
    found.append(("kv_caches.0", (), torch.zeros(2)))
    vllm_graphs._declare(cache, object())
    assert cache.declared[2:] == ["runner.attn|0", "runner.kv_caches.0"]
    other = StandInGraphCache("0" * 64, {}, device=None, cache=None)  # another GraphCache: declared afresh
    vllm_graphs._declare(other, object())
    assert len(other.declared) == 3


def test_the_tensors_a_graph_reads_are_looked_up_by_their_steps_and_the_runner_walked_only_for_a_new_one(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Walking the runner before each of vLLM's 51 graphs took 0.3-0.6 s of a start on an H100 (2026-12-05). Where
    the GraphCache says which tensors the next graph reads (``GraphCache.reads``) and each was declared before,
    those are looked up again by the steps that led to them (a tensor replaced under the same path is seen; a
    list's index, a dict's key and an attribute are each followed as the walk took them), and the runner is walked
    only for a name not declared yet or steps that lead nowhere now."""

    class Buffers:
        pass

    class Runner:
        pass

    for cls in (Buffers, Runner):
        cls.__module__ = "vllm.v1.worker.gpu.fake"
    runner, buffers = Runner(), Buffers()
    buffers.positions = torch.zeros(4)  # type: ignore[attr-defined]
    runner.input_buffers = buffers  # type: ignore[attr-defined]
    runner.kv_caches = [torch.zeros(2), torch.zeros(3)]  # type: ignore[attr-defined]
    runner.tables = {"block": torch.zeros(5)}  # type: ignore[attr-defined]
    walks: list[int] = []
    walk = vllm_graphs._walk

    def counted(root: Any, keep: Any) -> Any:
        walks.append(1)
        return walk(root, keep=lambda t: True)

    monkeypatch.setattr(vllm_graphs, "_walk", counted)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    cache = StandInGraphCache("0" * 64, {}, device=None, cache=None)
    names = ["runner.input_buffers.positions", "runner.kv_caches.1", "runner.tables.block"]
    vllm_graphs._declare(cache, runner, names)  # nothing declared yet: walked
    assert len(walks) == 1 and sorted(cache.declared) == sorted([*names, "runner.kv_caches.0"])
    for _ in range(3):
        vllm_graphs._declare(cache, runner, names)
    assert len(walks) == 1 and len(cache.declared) == 4  # looked up, unchanged: nothing declared again
    runner.kv_caches[1] = torch.zeros(3)  # replaced under the same path
    vllm_graphs._declare(cache, runner, names)
    assert len(walks) == 1 and cache.declared[4:] == ["runner.kv_caches.1"]
    vllm_graphs._declare(cache, runner, [*names, "runner.tables.new"])  # a name not declared yet: walked
    assert len(walks) == 2
    del runner.tables["block"]  # steps that lead nowhere now: walked
    vllm_graphs._declare(cache, runner, names)
    assert len(walks) == 3
    vllm_graphs._declare(cache, runner, None)  # no artifact to say what the graph reads: walked
    assert len(walks) == 4


def test_a_graph_refused_recording_names_the_tensors_that_hold_its_addresses() -> None:
    """Found on the H100 (2026-12-05): the refusal named an address and its allocation only, and which tensor it
    was had to be guessed (the rotary table). The report now names the model's and the runner's tensors whose
    memory holds an address the refusal names (not every tensor of the allocation: torch's segments hold many),
    and the naming never raises."""

    class Runner:
        pass

    Runner.__module__ = "vllm.v1.worker.gpu.fake"
    runner = Runner()
    runner.model = torch.nn.Linear(2, 2)  # type: ignore[attr-defined]
    runner.model.register_buffer("table", torch.zeros(4))
    runner.positions = torch.zeros(8)  # type: ignore[attr-defined]
    runner.other = torch.zeros(8)  # type: ignore[attr-defined]
    table, positions = runner.model.table, runner.positions  # type: ignore[attr-defined]
    problem = (
        "3 address(es) outside the reproduced ranges (2 address(es) in allocation 0x7f0000000000 (2097152 bytes): "
        f"{table.data_ptr() + 8:#x}, {positions.data_ptr():#x}), e.g. node 2 (triton_poi_0), argument byte 16 "
        f"holds {table.data_ptr() + 8:#x}, device memory outside every range the restore reproduces (allocation "
        f"0x7f0000000000, 2097152 bytes): ..."
    )
    named = vllm_graphs.owners(problem, runner, keep=lambda t: True)
    assert named == "; the tensors holding them: model.table, runner.positions"
    elsewhere = problem.replace(f"{table.data_ptr() + 8:#x}", "0x100000").replace(
        f"{positions.data_ptr():#x}", "0x200000"
    )
    assert vllm_graphs.owners(elsewhere, runner, keep=lambda t: True).startswith("; no tensor")
    assert vllm_graphs.owners("a kernel whose image was not kept", runner) == ""
    assert vllm_graphs.owners(problem, runner, keep=lambda t: 1 / 0 > 0) == ""  # never raises


class FakeManagers:
    """What the kind takes from vLLM 0.26's ``vllm.v1.worker.gpu.cudagraph_utils``, for a capture on a CPU."""

    class CUDAGraphMode(enum.Enum):
        NONE = 0
        PIECEWISE = 1
        FULL = 2

    def __init__(self) -> None:
        import contextlib

        self.graph_capture = lambda device: contextlib.nullcontext()
        self.get_offloader = lambda: None


def fake_vllm(monkeypatch: pytest.MonkeyPatch) -> FakeManagers:
    """vLLM 0.26.0 as the kind sees it, on one rank, with the kind switched on: the fake manager module."""
    import sys
    import types

    managers = FakeManagers()
    monkeypatch.setitem(sys.modules, vllm_graphs.MANAGERS, managers)
    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.26.0"))
    one_rank = types.SimpleNamespace(get_world_group=lambda: types.SimpleNamespace(world_size=1))
    monkeypatch.setitem(sys.modules, "vllm.distributed.parallel_state", one_rank)
    monkeypatch.setenv(vllm_graphs.SWITCH_ENV, "1")
    return managers


class Manager:
    """A graph manager as the kind sees it; ``capture`` is what vLLM's would do: capture every descriptor left in
    ``_capture_descs`` (recorded in ``calls``)."""

    def __init__(self, modes: Any, descs: dict[Any, list[Any]], runner: Any) -> None:
        self._capture_descs = descs
        self.graphs: dict[Any, str] = {}
        self.hidden_states = None
        self.is_first_pp_rank = self.is_last_pp_rank = True
        self.dp_size = 1
        self.device = torch.device("cpu")
        self._weightcache_runner = runner
        self.calls: list[dict[str, list[Any]]] = []
        self._graphs_captured = False

    def capture(self, create_forward_fn: Any, progress_bar_desc: str = "") -> None:
        self.calls.append({mode.name: list(descs) for mode, descs in self._capture_descs.items()})
        for descs in self._capture_descs.values():
            for desc in descs:
                self.graphs[desc] = "vllm's"
        self._graphs_captured = True


def test_a_capture_the_kind_cannot_do_is_vllms_own_and_the_engine_starts(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the wrapped capture with fakes of vLLM's module (a CPU: no GraphCache can be made): vLLM captures
    the PIECEWISE graphs first, then the FULL ones the kind could not restore or capture, and every graph exists
    after; where the kind does not apply (LoRA, another release, a manager it does not know), vLLM's capture runs
    once, as it would without weightcache (several ranks too: ranks deciding apart would wait on each other's
    collectives); a report says why each time."""
    import sys
    import types

    managers = fake_vllm(monkeypatch)
    mode = managers.CUDAGraphMode
    runner = types.SimpleNamespace(vllm_config=object())
    monkeypatch.setitem(vllm_graphs._PENDING, id(runner.vllm_config), ("0" * 64, None))
    monkeypatch.setattr(vllm_graphs, "_REPORTS", [])
    capture = vllm_graphs._capturing(Manager.capture)
    piecewise, full = [Desc(mode.PIECEWISE, 16, None)], [Desc(mode.FULL, n, n, 1) for n in (8, 4)]  # type: ignore[arg-type]

    manager = Manager(mode, {mode.PIECEWISE: piecewise, mode.FULL: full}, runner)
    capture(manager, lambda desc, warmup: lambda m: None)
    assert manager.calls == [{"PIECEWISE": piecewise}, {"FULL": full}]
    assert set(manager.graphs) == {*piecewise, *full} and manager._graphs_captured
    assert set(manager._capture_descs) == {mode.PIECEWISE, mode.FULL}  # vLLM's own lists, as they were
    [report] = vllm_graphs.reports()
    assert report["restored"] == 0 and report["reason"]

    lora = [Desc(mode.FULL, 8, 8, 1, num_active_loras=1)]  # type: ignore[arg-type]
    manager = Manager(mode, {mode.PIECEWISE: piecewise, mode.FULL: lora}, runner)
    capture(manager, lambda desc, warmup: lambda m: None)
    assert manager.calls == [{"PIECEWISE": piecewise, "FULL": lora}]
    assert "LoRA" in vllm_graphs.reports()[-1]["reason"]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.32.0"))
    manager = Manager(mode, {mode.FULL: full}, runner)
    capture(manager, lambda desc, warmup: lambda m: None)
    assert manager.calls == [{"FULL": full}] and "0.32.0" in vllm_graphs.reports()[-1]["reason"]

    monkeypatch.setitem(sys.modules, "vllm", types.SimpleNamespace(__version__="0.26.0"))
    manager = Manager(mode, {mode.PIECEWISE: piecewise, mode.FULL: full}, runner)
    manager.tp_size = 2  # type: ignore[attr-defined]
    capture(manager, lambda desc, warmup: lambda m: None)
    assert manager.calls == [{"PIECEWISE": piecewise, "FULL": full}]
    assert "more than one rank" in vllm_graphs.reports()[-1]["reason"]

    manager = Manager(mode, {mode.FULL: full}, runner)
    del manager.is_first_pp_rank  # a manager of another shape
    capture(manager, lambda desc, warmup: lambda m: None)
    assert manager.calls == [{"FULL": full}] and "AttributeError" in vllm_graphs.reports()[-1]["reason"]


class Restored(tuple):  # type: ignore[type-arg]
    """A graph the stand-in "restored": ``("restored", name)``, with the steps a restore reports."""

    phases: ClassVar[dict[str, float]] = {"checks": 0.25, "wait": 0.5}


class StandInGraphCache:
    """What the kind asks of :class:`~weightcache.torch_graphs.GraphCache` (which needs a GPU), answering
    ``restore`` from a set of graph names it "holds"; records what it was told."""

    made: ClassVar[list[StandInGraphCache]] = []
    holds: ClassVar[set[str]] = set()
    reading: ClassVar[list[str] | None] = None  # what reads() answers (None: no artifact to restore from)

    def __init__(self, weights: Any, key: dict[str, Any], *, device: Any, cache: Any) -> None:
        self.key, self.pool, self.reason = key, object(), None
        self.declared: list[str] = []
        self.asked: list[str] = []
        self.events: list[tuple[str, Any]] = []  # adopt and empty calls, in order (the arena's layout)
        self.published = self.stopped = False
        self.phases, self.image_steps = {"arena": 0.125, "artifact": 0.25}, {"load": 0.5}
        self.relocated = 7
        self.made.append(self)

    def empty(self, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
        self.events.append(("empty", tuple(shape)))
        return torch.empty(shape, dtype=dtype)

    def adopt(
        self, module: torch.nn.Module, *, keep_previous: bool = False, parameters: bool = True
    ) -> torch.nn.Module:
        self.events.append(("adopt", (type(module).__name__, keep_previous, parameters)))
        return module

    def reproduced(self, tensor: torch.Tensor) -> bool:
        return False

    def external(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        self.declared.append(name)
        return tensor

    def restore(self, name: str) -> object | None:
        self.asked.append(name)
        if name in self.holds:
            return Restored(("restored", name))
        self.reason = f"graph {name!r} is not in the artifact"
        return None

    def reads(self, name: str) -> list[str] | None:
        return self.reading

    def start_builds(self) -> bool:
        self.events.append(("start_builds", len(self.declared)))
        return True

    def publish(self) -> bool:
        self.published = True
        return True

    def settle(self) -> None:
        self.stopped = True


def kind_with_stand_in(monkeypatch: pytest.MonkeyPatch) -> tuple[Any, Any]:
    """The kind as a capture in a fake vLLM (:func:`fake_vllm`) meets it, with :class:`StandInGraphCache` for the
    GraphCache (none made yet) and no report yet: vLLM's ``CUDAGraphMode``, and a vLLM config whose engine's
    weights the kind has been told of (``begin``)."""
    import types

    import weightcache.torch_graphs as torch_graphs

    mode = fake_vllm(monkeypatch).CUDAGraphMode
    monkeypatch.setattr(torch_graphs, "GraphCache", StandInGraphCache)
    monkeypatch.setattr(StandInGraphCache, "made", [])
    monkeypatch.setattr(vllm_graphs, "_REPORTS", [])
    config = types.SimpleNamespace(compute_hash=lambda: "c0ffee")
    monkeypatch.setitem(vllm_graphs._PENDING, id(config), ("0" * 64, None))
    return mode, config


def test_full_graphs_the_artifact_holds_are_restored_in_order_and_a_failure_leaves_the_rest_to_vllm(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Through vLLM's ``capture_model`` and the manager's ``capture`` (both wrapped as in an engine) with fakes of
    vLLM's module and a stand-in GraphCache: vLLM captures the PIECEWISE graphs, then each FULL graph is asked
    for in vLLM's order (largest first) after its inputs are prepared and the runner's tensors declared, and a
    restored one is what vLLM replays; the graphs' output buffer is the cache's; the report counts them, says
    where the time went (every step of ``STEPS``) and how long vLLM's whole graph phase took. A failure halfway
    (vLLM's input preparation raising) leaves the graphs not yet made to vLLM's own capture, the worker threads
    stopped."""
    mode, config = kind_with_stand_in(monkeypatch)
    piecewise = [Desc(mode.PIECEWISE, 16, None)]  # type: ignore[arg-type]
    full = [Desc(mode.FULL, n, n, 1) for n in (8, 4, 2)]  # type: ignore[arg-type]
    names = [vllm_graphs.graph_name(d) for d in full]
    capture = vllm_graphs._capturing(Manager.capture)

    class Runner:
        def __init__(self) -> None:
            self.vllm_config = config
            self.model = torch.nn.Linear(2, 2)
            self.cudagraph_manager = Manager(mode, {mode.PIECEWISE: piecewise, mode.FULL: list(full)}, None)
            self.prepared: list[tuple[int, bool]] = []

        def capture_model(self, fail_at: int | None = None) -> None:
            manager = self.cudagraph_manager

            def create_forward_fn(desc: Any, warmup: bool) -> Any:
                self.prepared.append((desc.num_tokens, warmup))
                if desc.num_tokens == fail_at and not warmup:
                    raise RuntimeError("vLLM's inputs could not be prepared")

                def forward(cg_mode: Any) -> None:
                    if manager.hidden_states is None:
                        manager.hidden_states = torch.zeros(desc.num_tokens, 4)

                return forward

            capture(manager, create_forward_fn)

    capture_model = vllm_graphs._with_runner(Runner.capture_model)

    monkeypatch.setattr(StandInGraphCache, "holds", set(names))

    class Recorder:  # the process's recorder (keep_kernel_images), as far as letting go of it goes
        def stop(self) -> int:
            return 12345

    from weightcache.graphs import cubins

    monkeypatch.setattr(cubins, "_recorder", Recorder())
    monkeypatch.setattr(cubins, "_let_go", False)  # (set by the stop below: not left to the tests after this one)
    runner = Runner()
    manager = runner.cudagraph_manager
    capture_model(runner)
    assert cubins._recorder is None  # nothing more is recorded in this engine: its kernel images let go
    [cache] = StandInGraphCache.made
    assert manager.calls == [{"PIECEWISE": piecewise}]  # vLLM captured the pieces, no FULL graph
    assert [manager.graphs[d] for d in full] == [("restored", n) for n in names]
    assert cache.asked == names and cache.published and not cache.stopped
    assert runner.prepared == [(8, True), (8, False), (4, False), (2, False)]  # one warm-up, then each graph's inputs
    assert manager.hidden_states.shape == (8, 4) and manager._weightcache_graphs is cache
    # the model's own tensors (a rotary table) go into the arena first, the memory they had kept for the PIECEWISE
    # graphs; then the graphs' output buffer: the same arena layout in every process
    assert cache.events == [("adopt", ("Linear", True, True)), ("empty", (8, 4))]
    assert cache.key["graphs"] == names and cache.key["config"] == "c0ffee" and cache.key["vllm"] == "0.26.0"
    [report] = vllm_graphs.reports()
    assert (report["restored"], report["captured"], report["published"], report["reason"]) == (3, 0, True, None)
    assert report["record_problem"] is None
    assert set(report["seconds"]) == set(vllm_graphs.STEPS) and min(report["seconds"].values()) >= 0
    assert report["seconds"]["total"] >= report["seconds"]["restore"]
    assert report["graph_phase_s"] >= report["seconds"]["total"] and report["images_freed"] == 12345
    assert report["restore_steps"] == {"checks": 0.75, "wait": 1.5}  # each restored graph's steps, summed
    assert report["start_steps"] == {"arena": 0.125, "artifact": 0.25, "images_load": 0.5}
    assert report["relocated"] == 7

    runner = Runner()
    manager = runner.cudagraph_manager
    capture_model(runner, fail_at=4)
    cache = StandInGraphCache.made[-1]
    assert manager.calls == [{"PIECEWISE": piecewise}, {"FULL": full[1:]}]  # the rest: vLLM's own capture
    assert manager.graphs[full[0]] == ("restored", names[0]) and manager.graphs[full[1]] == "vllm's"
    assert cache.stopped and not cache.published
    report = vllm_graphs.reports()[-1]
    assert report["restored"] == 1 and "inputs could not be prepared" in report["reason"]

    # parameters outside the keeper's homes beyond ADOPT_PARAMETERS_MAX: weights that are not the keeper's (a home
    # taken); copying them would double their memory: only the buffers are copied
    monkeypatch.setattr(vllm_graphs, "ADOPT_PARAMETERS_MAX", -1)
    capture_model(Runner())
    assert StandInGraphCache.made[-1].events[0] == ("adopt", ("Linear", True, False))
    assert set(manager._capture_descs) == {mode.PIECEWISE, mode.FULL} and manager._graphs_captured


def test_with_an_artifact_the_runners_tensors_are_declared_and_the_builds_started_before_the_model_is_adopted(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Where the GraphCache holds an artifact (``reads`` answers for the first graph), the kind declares every
    tensor the runner reaches right after making it and calls ``start_builds``: the driver builds the graphs while
    the model is adopted and the first graph's inputs are made (on the H100, 2026-12-05: ~0.2 s before the first
    restore, when the builds started until then). Without an artifact, nothing is declared before the first
    graph's inputs."""
    mode, config = kind_with_stand_in(monkeypatch)
    full = [Desc(mode.FULL, n, n, 1) for n in (8, 4)]  # type: ignore[arg-type]
    monkeypatch.setattr(StandInGraphCache, "holds", {vllm_graphs.graph_name(d) for d in full})
    capture = vllm_graphs._capturing(Manager.capture)

    class Buffers:
        pass

    Buffers.__module__ = "vllm.v1.worker.gpu.fake"  # (walked: one of vLLM's objects)
    kv = torch.zeros(4)
    # "CUDA" tensors: kv, and vLLM's graph output buffer (the manager's hidden_states, made at the warm-up)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda t: t is kv or getattr(t, "made_by_vllm", False)))
    monkeypatch.setattr(Manager, "__module__", "vllm.v1.worker.gpu.fake")  # (walked: one of vLLM's objects)

    class Runner:
        def __init__(self) -> None:
            self.vllm_config = config
            self.model = torch.nn.Linear(2, 2)
            self.cudagraph_manager = Manager(mode, {mode.FULL: list(full)}, None)
            self.buffers = Buffers()
            self.buffers.kv = kv  # type: ignore[attr-defined]

        def capture_model(self) -> None:
            manager = self.cudagraph_manager

            def create_forward_fn(desc: Any, warmup: bool) -> Any:
                def forward(cg_mode: Any) -> None:
                    if manager.hidden_states is None:
                        manager.hidden_states = torch.zeros(desc.num_tokens, 4)
                        manager.hidden_states.made_by_vllm = True  # type: ignore[attr-defined]

                return forward

            capture(manager, create_forward_fn)

    Runner.__module__ = Buffers.__module__
    capture_model = vllm_graphs._with_runner(Runner.capture_model)
    for reading, events in [
        (["runner.buffers.kv"], [("start_builds", 1), ("adopt", ("Linear", True, True)), ("empty", (8, 4))]),
        (None, [("adopt", ("Linear", True, True)), ("empty", (8, 4))]),
    ]:
        monkeypatch.setattr(StandInGraphCache, "reading", reading)
        capture_model(Runner())
        cache = StandInGraphCache.made[-1]
        assert cache.events == events
        assert cache.declared[0] == "runner.buffers.kv"  # (declared before the first graph either way)
        # vLLM's own output buffer, which the arena's replaces, is never declared (it would be kept for good)
        assert not [n for n in cache.declared if "hidden_states" in n]
        assert vllm_graphs.reports()[-1]["restored"] == 2

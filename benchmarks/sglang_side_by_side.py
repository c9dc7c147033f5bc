"""weightcache beside SGLang's own weight cache daemon (SGLang 0.5.17, ``sglang.srt.weight_cache``), on one GPU,
in one run, with the same checkpoint: each engine a fresh process (tests/backends/sglang_gpu_worker.py,
``sglang.Engine`` with SGLang's defaults, CUDA graphs on).

Scenarios (``--scenarios``, default all), each measured for both systems:
  start     process start to the first token, and SGLang's phases (imports, engine set-up before the load, weights,
            KV cache, graph capture, the rest), for: SGLang alone (load format auto, warm page cache); the
            first start (weightcache: an engine in mode daemon, a miss that loads and publishes; SGLang: the
            standalone daemon's load to ready, then an engine in client mode); a restart of a client with the
            checkpoint dropped from the page cache (``--repeat`` times: medians).
  memory    device memory of the daemon or keeper alone, and of it with two engines serving from one copy.
  kill      the daemon or keeper SIGKILLed while an engine serves: does the engine keep serving, does a new one
            start, what comes back when the daemon or keeper is started again.
  mismatch  a client asking for another dtype (float16) than the copy held (bfloat16).
  race      two engines started at once with nothing cached (weightcache: mode daemon twice; SGLang: two engines
            in mode daemon, each with its own engine-spawned daemon).
  awq       an AWQ checkpoint (4-bit, group 128, random values; the Llama shape of ``--shape`` made with the
            llama1b shape when that is not a Llama): SGLang alone (not with ``--no-awq-reference``: on a fresh
            machine its first generation compiles AWQ kernels, 330 s on the H200), weightcache mode daemon then
            client, SGLang's daemon (its allow-list holds only unquantized and block-wise FP8).
Only ``start`` captures CUDA graphs (SGLang's default); the other scenarios' engines run with
``disable_cuda_graph`` (graph capture is the same per engine in both systems, ~14 s and ~1.7 GB for the Llama-3-8B
shape in ``start``, and none of those rows is about it).
Every figure is from this run; the JSON (``--json``) holds every engine's result and phases.

Usage: python benchmarks/sglang_side_by_side.py --workdir DIR [--shape llama8b|llama1b|mixtral]
       [--scenarios start,memory,kill,mismatch,race,awq] [--repeat 3] [--no-awq-reference] [--json FILE]
"""

from __future__ import annotations

import argparse
import contextlib
import datetime as dt
import glob
import json
import os
import re
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
WORKER = ROOT / "tests" / "backends" / "sglang_gpu_worker.py"
sys.path.insert(0, str(ROOT / "tests" / "backends"))

from engine_models import GPU_SHAPES, evict_from_page_cache, make_random_model, untied_config  # noqa: E402
from engines import EngineProcess  # noqa: E402

SHAPES: dict[str, tuple[str, str, dict[str, Any]]] = {
    "llama8b": (  # Llama-3-8B's shape (random weights): 16 GB in bf16
        "LlamaConfig",
        "LlamaForCausalLM",
        {
            "vocab_size": 128256,
            "hidden_size": 4096,
            "intermediate_size": 14336,
            "num_hidden_layers": 32,
            "num_attention_heads": 32,
            "num_key_value_heads": 8,
            "rope_theta": 500000.0,
        },
    ),
    # the engines' GPU test models (tests/backends/engine_models.py), with a 32,000-token vocabulary
    "llama1b": (*GPU_SHAPES["llama"][:2], {"vocab_size": 32000, **GPU_SHAPES["llama"][2]}),
    "mixtral": (*GPU_SHAPES["mixtral"][:2], {"vocab_size": 32000, **GPU_SHAPES["mixtral"][2]}),  # a small MoE
}
LOG_LINE = re.compile(r"^\[(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\.\d{3})[^\]]*\] (.*)$")
SGLANG_READY = "/tmp/sglang_weight_cache_rank0.ready"
SGLANG_SOCKET = "/tmp/sglang_weight_cache_rank0.sock"


#: Seconds an engine worker may take to its first token (or to answer a generation) before it is killed: the
#: Llama-3-8B shape's slowest start, from disk with graph capture, took 78 s on the H200.
ENGINE_TIMEOUT_S = 420
#: Engine options of every scenario but ``start``: no CUDA graph capture (see the module's docstring).
NO_GRAPHS = {"disable_cuda_graph": True}
#: Engine spec of the scenarios that run two engines on the GPU at once: each takes a part of it, without graphs.
SHARED_GPU: dict[str, Any] = {"options": {"mem_fraction_static": 0.3, **NO_GRAPHS}}


def make_model(directory: Path, shape: str) -> Path:
    if (directory / "config.json").exists():
        return directory
    config_name, model_name, kwargs = SHAPES[shape]
    return make_random_model(directory, config_name, model_name, kwargs, max_position_embeddings=4096)


#: The projections AWQ quantizes in a Llama (embeddings, norms and the LM head stay float16).
AWQ_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def make_awq_model(directory: Path, shape: str) -> Path:
    """An AWQ checkpoint in AutoAWQ's GEMM layout (``qweight`` int32 [in, out/8], ``qzeros`` int32
    [in/128, out/8], ``scales`` float16 [in/128, out]) with random 4-bit values, built from a Llama of ``shape``."""
    if (directory / "config.json").exists():
        return directory
    import torch
    import transformers
    from safetensors.torch import save_file

    config_name, model_name, kwargs = SHAPES[shape if shape.startswith("llama") else "llama1b"]
    config = untied_config(config_name, kwargs, max_position_embeddings=4096)
    with torch.device("meta"):
        shapes = {name: p.shape for name, p in getattr(transformers, model_name)(config).named_parameters()}
    generator = torch.Generator().manual_seed(0)
    tensors: dict[str, torch.Tensor] = {}
    group = 128
    for name, size in shapes.items():
        if name.endswith(".weight") and name.split(".")[-2] in AWQ_LINEARS:
            out_features, in_features = size
            base = name.removesuffix(".weight")
            words = (in_features, out_features // 8)
            tensors[base + ".qweight"] = torch.randint(
                -(2**31), 2**31 - 1, words, generator=generator, dtype=torch.int32
            )
            zeros = torch.full((in_features // group, out_features // 8), 0x88888888 - 2**32, dtype=torch.int32)
            tensors[base + ".qzeros"] = zeros  # every zero point 8, the middle of 0..15
            scales = torch.rand((in_features // group, out_features), generator=generator) * 0.004 + 0.001
            tensors[base + ".scales"] = scales.to(torch.float16)
        elif "norm" in name:
            tensors[name] = (torch.rand(size, generator=generator) + 0.5).to(torch.float16)
        else:
            tensors[name] = (torch.randn(size, generator=generator) * 0.02).to(torch.float16)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"), metadata={"format": "pt"})
    config.dtype = "float16"
    config.architectures = [model_name]  # what a model's save_pretrained writes; SGLang needs it to pick its model
    config.quantization_config = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True,
                                  "version": "gemm"}  # fmt: skip
    config.save_pretrained(directory)
    return directory


def device_free() -> int:
    """Free device memory as the driver reports it (nvidia-smi, so that this process holds no CUDA context)."""
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.free", "--format=csv,noheader,nounits", "-i", "0"],
        capture_output=True, text=True, check=True,
    ).stdout  # fmt: skip
    return int(out.split()[0]) << 20


def sglang_phases(log: list[str], start: float, result: dict[str, Any]) -> dict[str, float]:
    """An engine's start phase by phase, in seconds, from SGLang's own log lines (``SGLANG_LOG_MS=1``: times to
    the millisecond) and the worker's RESULT (``import_s``, ``engine_s``, ``first_token_s``, from ``start``, the
    worker process's start as epoch seconds). Weights and graph capture are SGLang's own ``elapsed=`` figures (every
    capture's, prefill and decode, added up); the other phases are the times between its lines."""
    marks: dict[str, float] = {}
    captures = 0.0
    for line in log:
        m = LOG_LINE.match(line.strip())
        if not m:
            continue
        t = dt.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S.%f").timestamp() - start
        text = m.group(2)
        for key, pattern in (
            ("scheduler_up", "Init torch distributed begin"),
            ("load_begin", "Load weight begin"),
            ("load_end", "Load weight end"),
            ("capture_begin", "CUDA graph begin"),
            ("capture_end", "CUDA graph end"),
        ):
            if pattern in text and (key not in marks or key.endswith("_end")):
                marks[key] = t
        elapsed = re.search(r"elapsed=([\d.]+) s", text)
        if elapsed and "CUDA graph end" in text:
            captures += float(elapsed.group(1))
        if elapsed and "Load weight end" in text:
            marks["weights"] = float(elapsed.group(1))
    phases = {"imports": float(result.get("import_s", 0.0))}
    if "scheduler_up" in marks:
        phases["to_scheduler"] = marks["scheduler_up"] - phases["imports"]
    if "load_begin" in marks and "scheduler_up" in marks:
        phases["distributed_and_setup"] = marks["load_begin"] - marks["scheduler_up"]
    if "weights" in marks:
        phases["weights"] = marks["weights"]
    if "load_end" in marks and "capture_begin" in marks:
        phases["kv_cache_and_backend"] = marks["capture_begin"] - marks["load_end"]
    phases["graph_capture"] = captures
    if "capture_end" in marks:
        phases["to_engine_ready"] = float(result.get("engine_s", 0.0)) - marks["capture_end"]
    phases["first_generation"] = float(result.get("first_token_s", 0.0)) - float(result.get("engine_s", 0.0))
    phases["total"] = float(result.get("first_token_s", 0.0))
    return {k: round(v, 3) for k, v in phases.items()}


class Engine(EngineProcess):
    """One engine process (the GPU test worker), kept until closed; an engine that exits before its first token
    is kept too, with ``error`` saying why (a scenario reports it rather than stopping)."""

    def __init__(self, spec: dict[str, Any], env: dict[str, str] | None = None) -> None:
        self.spec = spec
        self.start = time.time()
        self.result: dict[str, Any] = {}
        self.error: str | None = None
        try:
            super().__init__("SGLang", WORKER, spec, {"SGLANG_LOG_MS": "1", **(env or {})}, quit_s=90)
            self.result["phases"] = sglang_phases(self.log, self.start, self.result)
        except AssertionError as e:  # the worker exited: EngineProcess.read says with what
            self.error = str(e)

    def read(self) -> dict[str, Any]:
        """The worker's next result; a worker with none in :data:`ENGINE_TIMEOUT_S` is killed (a hung engine would
        otherwise hold the rest of the run), and the result is then the AssertionError of an exited worker."""

        def hung() -> None:
            self.log.append(f"benchmark: no result in {ENGINE_TIMEOUT_S} s, worker killed\n")
            self.proc.kill()

        timer = threading.Timer(ENGINE_TIMEOUT_S, hung)
        timer.start()
        try:
            return super().read()
        finally:
            timer.cancel()

    def generate(self) -> list[int] | str:  # type: ignore[override]
        """The tokens, or what went wrong instead: an engine whose keeper or daemon was killed may hang."""
        result: dict[str, Any] = {}

        def ask() -> None:
            try:
                result["tokens"] = super(Engine, self).generate()
            except (AssertionError, OSError) as e:
                result["error"] = str(e)

        thread = threading.Thread(target=ask, daemon=True)
        thread.start()
        thread.join(120)
        if thread.is_alive():
            return "no answer in 120 s"
        return list(result["tokens"]) if "tokens" in result else str(result.get("error"))

    def summary(self) -> dict[str, Any]:
        if self.error:
            return {"error": self.error[-2000:]}
        keep = ("tokens", "weight_gb", "kv_tokens", "kv_gb", "graph_gb", "first_token_s", "phases")
        out = {k: self.result.get(k) for k in keep}
        out["warnings"] = [ln.strip()[:400] for ln in self.log if "Warning" in ln and "weightcache" in ln]
        # weightcache's own lines: hit or miss, and where a miss's time went (load, pack and digests, publish)
        out["weightcache_log"] = [ln.strip()[:400] for ln in self.log if "weightcache: " in ln and "Warning" not in ln]
        return out


class Systems:
    """The two systems' processes: weightcache's keeper (started by an engine in mode daemon) and SGLang's
    standalone daemon (python -m sglang.srt.weight_cache.daemon)."""

    def __init__(self, workdir: Path, model: Path) -> None:
        self.model = model
        self.socket_dir = workdir / "wc-sockets"
        self.daemon: subprocess.Popen[str] | None = None
        self.daemon_log = workdir / "sglang-daemon.log"

    def wc_spec(self, mode: str, **more: Any) -> dict[str, Any]:
        extra = {"socket_dir": str(self.socket_dir), "mode": mode, **more.pop("extra", {})}
        return {"model": str(self.model), "load_format": "weightcache", "extra": extra, **more}

    def sg_spec(self, mode: str, **more: Any) -> dict[str, Any]:
        options = {"weight_cache_timeout": 120, **more.pop("options", {})}
        return {"model": str(self.model), "weight_cache_mode": mode, "options": options, **more}

    def keeper_pid(self) -> int | None:
        from weightcache.rundir import INSTANCE_LOCK_NAME

        with contextlib.suppress(OSError, ValueError):
            return int((self.socket_dir / INSTANCE_LOCK_NAME).read_text().strip())
        return None

    def stop_keeper(self) -> None:
        """No keeper afterwards, and none stopped on purpose: the next scenario's first engine (mode daemon) spawns
        a fresh one. SIGTERM leaves the keeper's stop marker, which makes mode daemon refuse to start another (an
        operator's deliberate stop stays a stop); between scenarios this is a reset, so the marker goes too."""
        from weightcache.rundir import STOPPED_NAME

        pid = self.keeper_pid()
        if pid:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGTERM)
            deadline = time.time() + 30
            while time.time() < deadline and os.path.exists(f"/proc/{pid}"):
                time.sleep(0.2)
            if os.path.exists(f"/proc/{pid}"):
                raise RuntimeError(f"the keeper (pid {pid}) did not exit within 30 s of SIGTERM")
        with contextlib.suppress(FileNotFoundError):
            (self.socket_dir / STOPPED_NAME).unlink()

    def start_daemon(self, dtype: str = "auto", timeout: float = 900) -> float:
        """SGLang's standalone daemon for rank 0; seconds until its ready file appears (RuntimeError if it exits
        first, or is not ready in ``timeout`` s: then it is killed)."""
        for path in (SGLANG_READY, SGLANG_SOCKET):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
        t0 = time.time()
        with open(self.daemon_log, "a") as log:  # the child keeps its own descriptor
            self.daemon = subprocess.Popen(
                [sys.executable, "-m", "sglang.srt.weight_cache.daemon", "--model-path", str(self.model),
                 "--gpu-id", "0", "--tp-size", "1", "--tp-rank", "0", "--dtype", dtype],
                stdout=log, stderr=subprocess.STDOUT, text=True,
            )  # fmt: skip
        while not os.path.exists(SGLANG_READY):
            if self.daemon.poll() is not None:
                raise RuntimeError(f"SGLang's daemon exited ({self.daemon.returncode}): {self.daemon_log}")
            if time.time() - t0 > timeout:
                self.stop_daemon(signal.SIGKILL)
                raise RuntimeError(f"SGLang's daemon not ready in {timeout:.0f} s: {self.daemon_log}")
            time.sleep(0.05)
        return time.time() - t0

    def stop_daemon(self, sig: int = signal.SIGTERM) -> None:
        if self.daemon is not None and self.daemon.poll() is None:
            self.daemon.send_signal(sig)
            try:
                self.daemon.wait(60)
            except subprocess.TimeoutExpired:
                self.daemon.kill()
                self.daemon.wait()
        self.daemon = None
        for path in (SGLANG_READY, SGLANG_SOCKET):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)


@contextlib.contextmanager
def running(spec: dict[str, Any], record: list[dict[str, Any]], label: str) -> Iterator[Engine]:
    engine = Engine(spec)
    try:
        yield engine
    finally:
        entry = {"label": label, **engine.summary()}
        record.append(entry)
        print(json.dumps(entry), flush=True)
        engine.close()


def evict(model: Path) -> None:
    evict_from_page_cache(model)


def describe(after: list[int] | str, before: Any) -> Any:
    """What an engine answered after the kill: an error text, "same tokens", or the other tokens."""
    return after if isinstance(after, str) else "same tokens" if after == before else after


def median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def scenario_start(s: Systems, repeat: int, record: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    with running({"model": str(s.model)}, record, "sglang auto (warm page cache)") as e:
        out["auto"] = e.summary()
    # weightcache first start: an engine in mode daemon (a miss: it loads from disk and publishes)
    s.stop_keeper()
    evict(s.model)
    with running(s.wc_spec("daemon"), record, "weightcache first start (mode daemon, miss, page cache dropped)") as e:
        out["wc_first"] = e.summary()
    clients = []
    for i in range(repeat):
        evict(s.model)
        with running(s.wc_spec("client", extra={"strict": True}), record, f"weightcache client restart {i}") as e:
            clients.append(e.summary())
    out["wc_client"] = clients
    s.stop_keeper()
    # SGLang's own: the standalone daemon's first start, then clients
    evict(s.model)
    out["sg_daemon_ready_s"] = round(s.start_daemon(), 3)
    clients = []
    for i in range(repeat):
        evict(s.model)
        with running(s.sg_spec("client"), record, f"sglang daemon client restart {i}") as e:
            clients.append(e.summary())
    out["sg_client"] = clients
    s.stop_daemon()

    def med(rows: list[dict[str, Any]], key: str) -> float | None:
        return median([r["phases"][key] for r in rows if "phases" in r and key in r["phases"]])

    out["medians"] = {
        system: {k: med(out[system], k) for k in ("total", "imports", "weights", "graph_capture")}
        for system in ("wc_client", "sg_client")
    }
    return out


def scenario_memory(s: Systems, record: list[dict[str, Any]]) -> dict[str, Any]:
    share = SHARED_GPU
    out: dict[str, Any] = {}
    s.stop_keeper()
    base = device_free()
    with running(s.wc_spec("daemon", **share), record, "weightcache publisher (memory)"):
        pass
    keeper_only = base - device_free()
    with (
        running(s.wc_spec("client", **share), record, "weightcache engine 1 of 2") as a,
        running(s.wc_spec("client", **share), record, "weightcache engine 2 of 2") as b,
    ):
        two = base - device_free()
        out["weightcache"] = {
            "keeper_alone_gb": round(keeper_only / 2**30, 3),
            "keeper_and_two_engines_gb": round(two / 2**30, 3),
            "engine_weight_gb": [a.result.get("weight_gb"), b.result.get("weight_gb")],
            "engine_kv_gb": [a.result.get("kv_gb"), b.result.get("kv_gb")],
        }
    s.stop_keeper()
    base = device_free()
    s.start_daemon()
    daemon_only = base - device_free()
    with (
        running(s.sg_spec("client", **share), record, "sglang daemon engine 1 of 2") as a,
        running(s.sg_spec("client", **share), record, "sglang daemon engine 2 of 2") as b,
    ):
        two = base - device_free()
        out["sglang"] = {
            "daemon_alone_gb": round(daemon_only / 2**30, 3),
            "daemon_and_two_engines_gb": round(two / 2**30, 3),
            "engine_weight_gb": [a.result.get("weight_gb"), b.result.get("weight_gb")],
            "engine_kv_gb": [a.result.get("kv_gb"), b.result.get("kv_gb")],
        }
    s.stop_daemon()
    return out


def scenario_kill(s: Systems, record: list[dict[str, Any]]) -> dict[str, Any]:
    share = SHARED_GPU
    out: dict[str, Any] = {}
    s.stop_keeper()
    with running(s.wc_spec("daemon", **share), record, "weightcache engine serving (kill)") as a:
        pid = s.keeper_pid()
        if pid is None:
            raise RuntimeError(f"no keeper serves {s.socket_dir}: the engine in mode daemon did not start one")
        os.kill(pid, signal.SIGKILL)
        after = a.generate()
        t0 = time.time()
        while (s.keeper_pid() in (None, pid)) and time.time() - t0 < 60:
            time.sleep(0.2)
        import weightcache as wc

        entries: list[Any] = []
        while time.time() - t0 < 60:
            with contextlib.suppress(wc.KeeperUnavailable):
                entries = wc.Cache(s.socket_dir).entries()
                if entries:
                    break
            time.sleep(0.2)
        back_s = time.time() - t0 if entries else None
        with running(s.wc_spec("client", **share), record, "weightcache new engine after kill") as b:
            out["weightcache"] = {
                "engine_keeps_serving": after == a.result.get("tokens"),
                "engine_after_kill": describe(after, a.result.get("tokens")),
                "republished_in_s": round(back_s, 3) if back_s is not None else None,
                "new_engine": "started" if b.result else b.error,
                "new_engine_weight_gb": b.result.get("weight_gb"),
                "new_engine_first_token_s": b.result.get("first_token_s"),
            }
    s.stop_keeper()
    s.start_daemon()
    with running(s.sg_spec("client", **share), record, "sglang engine serving (kill)") as a:
        assert s.daemon is not None
        s.daemon.send_signal(signal.SIGKILL)
        s.daemon.wait()
        after = a.generate()
        with running(s.sg_spec("client", **share), record, "sglang new engine after kill (no daemon)") as b:
            new = {"new_engine": "started" if b.result else b.error, "new_engine_weight_gb": b.result.get("weight_gb"),
                   "new_engine_first_token_s": b.result.get("first_token_s")}  # fmt: skip
        restart_s = s.start_daemon()
        out["sglang"] = {
            "engine_keeps_serving": after == a.result.get("tokens"),
            "engine_after_kill": describe(after, a.result.get("tokens")),
            **new,
            "daemon_restart_ready_s": round(restart_s, 3),
        }
    s.stop_daemon()
    return out


def scenario_mismatch(s: Systems, record: list[dict[str, Any]]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    s.stop_keeper()
    with running(s.wc_spec("daemon", options=NO_GRAPHS), record, "weightcache publisher (bf16)"):
        pass
    for strict in (False, True):
        spec = s.wc_spec("client", extra={"strict": strict}, options={"dtype": "float16", **NO_GRAPHS})
        with running(spec, record, f"weightcache client float16 strict={strict}") as e:
            out[f"weightcache_strict_{strict}"] = e.summary()
    s.stop_keeper()
    s.start_daemon()
    with running(s.sg_spec("client", options={"dtype": "float16", **NO_GRAPHS}), record, "sglang client float16") as e:
        out["sglang"] = e.summary()
    s.stop_daemon()
    return out


def scenario_race(s: Systems, record: list[dict[str, Any]]) -> dict[str, Any]:
    share = SHARED_GPU
    out: dict[str, Any] = {}
    for system, spec in (("weightcache", s.wc_spec("daemon", **share)), ("sglang", s.sg_spec("daemon", **share))):
        s.stop_keeper()
        s.stop_daemon()
        engines: list[Engine] = []

        def start_one(spec: dict[str, Any] = spec, engines: list[Engine] = engines) -> None:
            engines.append(Engine(spec))

        threads = [threading.Thread(target=start_one) for _ in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        rows = [e.summary() for e in engines]
        for i, row in enumerate(rows):
            record.append({"label": f"{system} racing engine {i}", **row})
        if system == "weightcache":
            import weightcache as wc

            with contextlib.suppress(wc.KeeperUnavailable):
                rows.append({"entries": len(wc.Cache(s.socket_dir).entries())})
        out[system] = rows
        for e in engines:
            e.close()
    s.stop_keeper()
    for stale in glob.glob("/tmp/sglang_weight_cache_rank*"):
        with contextlib.suppress(OSError):
            os.unlink(stale)
    return out


def scenario_awq(s: Systems, shape: str, record: list[dict[str, Any]], reference: bool = True) -> dict[str, Any]:
    awq = Systems(s.socket_dir.parent, make_awq_model(s.socket_dir.parent / f"{shape}-awq", shape))
    awq.socket_dir = s.socket_dir.parent / "wc-sockets-awq"
    out: dict[str, Any] = {}
    if reference:
        with running({"model": str(awq.model), "options": NO_GRAPHS}, record, "sglang auto (AWQ)") as e:
            out["auto"] = e.summary()
    with running(awq.wc_spec("daemon", options=NO_GRAPHS), record, "weightcache mode daemon (AWQ)") as e:
        out["weightcache_daemon"] = e.summary()
    with running(awq.wc_spec("client", options=NO_GRAPHS), record, "weightcache mode client (AWQ)") as e:
        out["weightcache_client"] = e.summary()
    import weightcache as wc

    with contextlib.suppress(wc.KeeperUnavailable):
        out["weightcache_entries"] = len(wc.Cache(awq.socket_dir).entries())
    awq.stop_keeper()
    try:
        out["sglang_daemon_ready_s"] = round(awq.start_daemon(timeout=300), 3)  # a 5 GB checkpoint: ~30 s
        with running(awq.sg_spec("client", options=NO_GRAPHS), record, "sglang daemon client (AWQ)") as e:
            out["sglang_client"] = e.summary()
    except RuntimeError as e:
        log = awq.daemon_log.read_text(errors="replace") if awq.daemon_log.exists() else ""
        out["sglang_daemon"] = {"error": str(e), "log_tail": log[-1500:]}
    finally:
        awq.stop_daemon()
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workdir", type=Path, required=True)
    parser.add_argument("--shape", choices=sorted(SHAPES), default="llama8b")
    parser.add_argument("--scenarios", default="start,memory,kill,mismatch,race,awq")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--json", type=Path)
    parser.add_argument(
        "--no-awq-reference",
        dest="awq_reference",
        action="store_false",
        help="in scenario awq, skip SGLang alone on the AWQ checkpoint (the refusals are measured either way)",
    )
    args = parser.parse_args(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.time()
    model = make_model(args.workdir / args.shape, args.shape)
    print(f"model {args.shape} ready in {time.time() - t0:.1f} s", flush=True)
    systems = Systems(args.workdir, model)
    record: list[dict[str, Any]] = []
    results: dict[str, Any] = {
        "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
        "shape": args.shape,
        "engines": record,
    }
    scenarios = {
        "start": lambda: scenario_start(systems, args.repeat, record),
        "memory": lambda: scenario_memory(systems, record),
        "kill": lambda: scenario_kill(systems, record),
        "mismatch": lambda: scenario_mismatch(systems, record),
        "race": lambda: scenario_race(systems, record),
        "awq": lambda: scenario_awq(systems, args.shape, record, args.awq_reference),
    }
    try:
        for name in args.scenarios.split(","):
            t1 = time.time()
            try:
                results[name] = scenarios[name]()
            except Exception as e:  # one scenario's failure is reported, the next still runs
                results[name] = {"error": f"{type(e).__name__}: {e}"}
            results[name + "_seconds"] = round(time.time() - t1, 1)
            print(json.dumps({name: results[name]}), flush=True)
            if args.json:
                args.json.write_text(json.dumps(results, indent=1))
    finally:
        systems.stop_daemon()
        systems.stop_keeper()
        if args.json:
            args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())

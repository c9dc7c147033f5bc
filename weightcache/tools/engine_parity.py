"""``weightcache parity --engine``: run an engine three times (its own disk load, weightcache mode daemon, mode
client in a new process) and compare their tensor tables and greedy tokens.

The tables themselves (:func:`weightcache.parity.write_table`, ``read_table``, ``compare``) stay in the library:
engine adapters record them inside the engine's processes. This module only drives the runs.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

import weightcache as wc
from weightcache.parity import compare, read_table

#: Token ids fed to the engine when none are given (any ids below the vocabulary size do).
DEFAULT_PROMPT = [1, 5, 9, 200, 31, 7]


@attrs.frozen
class EngineParity:
    """What :func:`engine_parity` found: per run (``disk``, ``daemon``, ``client``) its greedy tokens, and the
    differences of the daemon's and the client's tensor tables from the disk-loaded model's."""

    tokens: dict[str, list[int]]
    differences: dict[str, list[str]]
    tensors: int

    @property
    def identical(self) -> bool:
        same_tokens = len({tuple(t) for t in self.tokens.values()}) == 1
        return same_tokens and not any(self.differences.values())


def engine_parity(
    engine: str,
    model: str,
    workdir: str | os.PathLike[str],
    *,
    engine_args: Mapping[str, Any] | None = None,
    prompt: list[int] | None = None,
    max_tokens: int = 16,
    timeout: float = 1800,
) -> EngineParity:
    """Run ``engine`` three times on ``model``, each in a new process: its own disk load, weightcache mode
    daemon (publishing into a keeper of a private socket directory under ``workdir``), and mode client (strict,
    attaching what the daemon published). Compare their tensor tables and greedy tokens. The keeper is
    stopped at the end. Engines: ``vllm``.
    """
    if engine != "vllm":
        raise wc.WeightCacheError(
            f"weightcache parity --engine drives vllm; found {engine!r}. For another engine, record the tables "
            "with weightcache.parity.write_table() in its process and diff them with `weightcache parity A B`."
        )
    work = Path(workdir)
    work.mkdir(parents=True, exist_ok=True)
    socket_dir = work / "keeper"
    options = {"socket_dir": str(socket_dir)}
    runs = {
        "disk": ("auto", None),
        "daemon": ("weightcache", {**options, "mode": "daemon"}),
        "client": ("weightcache", {**options, "mode": "client", "strict": True}),
    }
    # apply_model hands a function to vLLM's workers, which vLLM only pickles when told it may.
    env = dict(os.environ, VLLM_ALLOW_INSECURE_SERIALIZATION="1")
    tokens: dict[str, list[int]] = {}
    try:
        for name, (load_format, extra) in runs.items():
            spec = {
                "model": model,
                "table": str(work / f"{name}.json"),
                "load_format": load_format,
                "extra": extra,
                "engine_args": dict(engine_args or {}),
                "prompt": prompt or DEFAULT_PROMPT,
                "max_tokens": max_tokens,
            }
            out = subprocess.run(
                [sys.executable, "-m", "weightcache.backends.vllm", json.dumps(spec)],
                capture_output=True,
                text=True,
                timeout=timeout,
                env=env,
            )
            lines = [line for line in out.stdout.splitlines() if line.startswith("WEIGHTCACHE-TOKENS ")]
            if out.returncode != 0 or not lines:
                raise wc.WeightCacheError(
                    f"the {name} run of {engine} failed (exit {out.returncode}); its last output:\n{out.stderr[-3000:]}"
                )
            tokens[name] = json.loads(lines[-1].removeprefix("WEIGHTCACHE-TOKENS "))
    finally:
        with contextlib.suppress(wc.KeeperUnavailable):  # the daemon run spawned it; nothing else uses it
            wc.Cache(socket_dir).stop()
    disk = read_table(work / "disk.json")
    return EngineParity(
        tokens=tokens,
        differences={name: compare(disk, read_table(work / f"{name}.json")) for name in ("daemon", "client")},
        tensors=len(disk),
    )


__all__ = ["DEFAULT_PROMPT", "EngineParity", "engine_parity"]

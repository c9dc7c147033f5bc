"""Where a transformers client restart spends its "transformers import + meta model" seconds, in fresh processes,
and what a pre-imported fork server (a zygote) would leave of them.

Each measurement is a fresh interpreter (``--repeat`` of them, medians reported). One engine-like process takes a
timestamp after each step:

    start -> import torch -> import transformers -> resolve ``transformers.AutoModelForCausalLM`` (transformers'
    lazy module) -> ``AutoConfig.from_pretrained`` of a local Llama-3-8B-shaped config -> the model built on the meta
    device from that config (bf16; the first build imports ``modeling_llama``) -> a second build (construction alone)

Then a zygote: a process that has imported torch and transformers and resolved ``LlamaForCausalLM`` (no CUDA, no
torch op run) forks a child per request; the child reads the config and builds the meta model. Reported: the
zygote's own preparation, and in the child the time from the fork request to the model (what a restart would pay
instead of the imports). Last, ``python -X importtime`` of the same imports, once per repeat: the self time of
every module summed by top-level package (medians), the slowest single modules, and what resolving
``AutoModelForCausalLM`` imports, by package.

    python benchmarks/import_split.py --repeat 5 --json out.json

The config is Llama-3-8B's shapes (benchmarks/restart_llama.py's ``LLAMA3_8B``), written once to a temporary
directory; nothing is downloaded and no weights are made. CPU only: nothing here initialises CUDA.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).parent))
from restart_llama import LLAMA3_8B as _SHAPES  # a sibling script, not a package

#: restart_llama.py's Llama-3-8B shapes as a config.json transformers reads on its own.
LLAMA3_8B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **_SHAPES, "torch_dtype": "bfloat16"}

STEPS_CODE = r"""
import time
t = {"start": time.perf_counter()}
import json, sys
import torch
t["torch"] = time.perf_counter()
import transformers
t["transformers"] = time.perf_counter()
auto = transformers.AutoModelForCausalLM
t["auto class"] = time.perf_counter()
config = transformers.AutoConfig.from_pretrained(sys.argv[1])
t["config"] = time.perf_counter()
with torch.device("meta"):
    model = auto.from_config(config, dtype=torch.bfloat16)
t["meta model"] = time.perf_counter()
with torch.device("meta"):
    again = auto.from_config(config, dtype=torch.bfloat16)
t["meta model again"] = time.perf_counter()
print(json.dumps({"t": t, "parameters": sum(p.numel() for p in model.parameters())}))
"""

ZYGOTE_CODE = r"""
import time
t0 = time.perf_counter()
import json, os, sys
import torch
import transformers
from transformers import AutoConfig, LlamaForCausalLM
from transformers.models.llama import modeling_llama  # what the first build would import
ready = time.perf_counter()
out = {"prepare": ready - t0, "children": []}
for _ in range(int(sys.argv[2])):
    r, w = os.pipe()
    asked = time.perf_counter()
    pid = os.fork()
    if pid == 0:  # the child: one engine start
        os.close(r)
        started = time.perf_counter()
        config = AutoConfig.from_pretrained(sys.argv[1])
        with torch.device("meta"):
            model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        x = torch.ones(64, 64) @ torch.ones(64, 64)  # torch's CPU ops work in the child
        done = time.perf_counter()
        os.write(w, json.dumps({"fork": started - asked, "model": done - started, "total": done - asked,
                                "ok": bool(x[0, 0] == 64)}).encode())
        os._exit(0)
    os.close(w)
    data = b""
    while chunk := os.read(r, 65536):
        data += chunk
    os.close(r)
    os.waitpid(pid, 0)
    out["children"].append(json.loads(data))
print(json.dumps(out))
"""

IMPORTS = (
    "import torch; import transformers; transformers.AutoModelForCausalLM; "
    "import transformers.models.llama.modeling_llama"
)


def run(code: str, *args: str) -> dict[str, Any]:
    out = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, check=True)
    result: dict[str, Any] = json.loads(out.stdout.strip().splitlines()[-1])
    return result


def importtime() -> tuple[dict[str, int], dict[str, int]]:
    """One ``-X importtime`` run: self microseconds summed per top-level package (``torch``, ``sympy``, ...), and
    self microseconds per module."""
    out = subprocess.run(
        [sys.executable, "-X", "importtime", "-c", IMPORTS], capture_output=True, text=True, check=True
    )
    packages: dict[str, int] = {}
    modules: dict[str, int] = {}
    for line in out.stderr.splitlines():
        if not line.startswith("import time:") or "cumulative" in line:
            continue
        self_us, _, name = line[len("import time:") :].split("|", 2)
        module = name.strip()
        modules[module] = int(self_us)
        top = module.split(".")[0]
        packages[top] = packages.get(top, 0) + int(self_us)
    return packages, modules


def auto_class_importtime() -> dict[str, int]:
    """One ``-X importtime`` run of ``import torch, transformers`` and then ``transformers.AutoModelForCausalLM``:
    self microseconds of the modules that resolving the auto class imported, summed per package (two name parts
    for torch and transformers, e.g. dynamo's package under torch; one for others: ``sympy``)."""
    code = "import torch, transformers; transformers.AutoModelForCausalLM"
    out = subprocess.run([sys.executable, "-X", "importtime", "-c", code], capture_output=True, text=True, check=True)
    rows = []
    for line in out.stderr.splitlines():
        if line.startswith("import time:") and "cumulative" not in line:
            self_us, _, name = line[len("import time:") :].split("|", 2)
            rows.append((int(self_us), name[1:]))  # one space after the bar; then two per level of nesting
    after = max(i for i, (_, name) in enumerate(rows) if name == "transformers")  # transformers' own import ends
    packages: dict[str, int] = {}
    for self_us, name in rows[after + 1 :]:
        parts = name.strip().split(".")
        key = ".".join(parts[:2]) if parts[0] in ("torch", "transformers") else parts[0]
        packages[key] = packages.get(key, 0) + self_us
    return packages


def median(values: list[float]) -> float:
    return round(statistics.median(values), 3)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="import-split-") as tmp:
        Path(tmp, "config.json").write_text(json.dumps(LLAMA3_8B))
        steps = [run(STEPS_CODE, tmp) for _ in range(args.repeat)]
        zygote = run(ZYGOTE_CODE, tmp, str(args.repeat))
        times = [importtime() for _ in range(args.repeat)]
        auto = [auto_class_importtime() for _ in range(args.repeat)]
    order = ["start", "torch", "transformers", "auto class", "config", "meta model", "meta model again"]
    split = {f"{a} -> {b}": median([(s["t"][b] - s["t"][a]) for s in steps]) for a, b in itertools.pairwise(order)}
    split["start -> meta model"] = median([s["t"]["meta model"] - s["t"]["start"] for s in steps])
    split["torch -> meta model"] = median([s["t"]["meta model"] - s["t"]["torch"] for s in steps])
    packages = sorted({p for pk, _ in times for p in pk})
    by_package = {p: median([pk.get(p, 0) / 1e6 for pk, _ in times]) for p in packages}
    slowest = sorted(
        {m for _, mods in times for m in mods}, key=lambda m: -statistics.median(t[1].get(m, 0) for t in times)
    )
    report = {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "python": sys.version.split()[0],
        "cpus": os.cpu_count(),
        "repeat": args.repeat,
        "parameters": steps[0]["parameters"],
        "median_s": split,
        "zygote": {
            "prepare_s": round(zygote["prepare"], 3),
            "child_fork_s": median([c["fork"] for c in zygote["children"]]),
            "child_model_s": median([c["model"] for c in zygote["children"]]),
            "child_total_s": median([c["total"] for c in zygote["children"]]),
            "children_ok": all(c["ok"] for c in zygote["children"]),
        },
        "importtime_self_by_package_s": dict(sorted(by_package.items(), key=lambda kv: -kv[1])[:20]),
        "importtime_slowest_self_s": {m: median([t[1].get(m, 0) / 1e6 for t in times]) for m in slowest[:15]},
        "auto_class_importtime_self_s": dict(
            sorted(
                ((k, median([a.get(k, 0) / 1e6 for a in auto])) for k in {k for a in auto for k in a}),
                key=lambda kv: -kv[1],
            )[:12]
        ),
        "runs": steps,
    }
    text = json.dumps({k: v for k, v in report.items() if k != "runs"}, indent=2)
    print(text)
    if args.json:
        args.json.write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())

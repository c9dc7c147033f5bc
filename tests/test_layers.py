"""The layers of DESIGN.md ("Layers"), held by this test rather than by comments.

Every module of weightcache/ has a layer (the table below; a module missing from it fails). Each import, at the
top of a module or inside a function, relative or absolute, must name a weightcache module of the importer's layer
or below, the standard library, or a third-party package that the importer's layer may use. The keeper and the
public namespace must then import without torch: a subprocess in which importing torch fails checks that.
"""

from __future__ import annotations

import ast
import fnmatch
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

import weightcache as wc

PACKAGE = Path(wc.__file__).parent

#: Module path (relative to weightcache/, a glob) -> layer. The first matching glob decides.
LAYERS: dict[str, int] = {
    # L0: the standard library only
    "_version.py": 0,
    "errors.py": 0,
    "units.py": 0,
    "dtypes.py": 0,
    "rundir.py": 0,
    "pidlock.py": 0,
    "standby.py": 0,
    # L1: values and wire formats (+ attrs)
    "fingerprint.py": 1,
    "manifest.py": 1,
    "budget.py": 1,
    "protocol.py": 1,
    "messages/*.py": 1,  # the package: base (ops, codes), session, weights, artifacts
    "quant/*.py": 1,
    "checkpoint.py": 1,
    "fdcheck.py": 1,
    "artifact_key.py": 1,
    # L2: the keeper and the client (+ filelock)
    "client/*.py": 2,  # the package: connection (one typed method per op), lifecycle (spawn, stop)
    "client.py": 2,  # the single module it was: test_the_check_catches still names it
    "lease.py": 2,
    "republish.py": 2,
    "artifacts.py": 2,
    "keeper/*.py": 2,
    "warm/*.py": 2,  # the warm process: imports what it is told by name, never torch by an import statement
    # L3: the torch side
    "segments/*.py": 3,
    "torch_dtypes.py": 3,
    "digests.py": 3,
    "views.py": 3,
    "publish.py": 3,
    "handle.py": 3,
    "cache.py": 3,
    "binding.py": 3,
    "loader.py": 3,
    "progress.py": 3,
    "parity.py": 3,
    "pipeline.py": 3,
    "structure.py": 3,
    "loaders.py": 3,
    "api.py": 3,
    "torch_compile.py": 3,
    "torch_compile_key.py": 3,
    "torch_compile_blob.py": 3,
    "torch_precompile.py": 3,
    "torch_graphs.py": 3,  # CUDA graphs restored from the keeper (issue 31): arena pool, kept kernel images
    "graphs/*.py": 3,  # CUDA graphs described, checked, rebuilt (issue 31): the driver through ctypes, no torch
    # L4: engine adapters
    "backends/*.py": 4,
    # L5: tools
    "tools/*": 5,
    "cli.py": 5,
    "doctor.py": 5,
    "bench.py": 5,
    "bench_restart.py": 5,
    "__main__.py": 5,
    # The public namespace: L1 at run time (L3 names load through PEP 562 __getattr__, never an import statement).
    "__init__.py": 1,
}

#: Third-party distributions (top-level import names) and the lowest layer that may import them.
THIRD_PARTY: dict[str, int] = {
    "attrs": 1,
    "attr": 1,
    "filelock": 2,
    "torch": 3,
    "safetensors": 3,
    "numpy": 3,
    "tqdm": 3,
    "cuda": 3,
    # version comparisons: the engine adapters' release ranges, and the doctor
    "packaging": 4,
}
#: Engines: from L4 up, and only inside functions (importing an adapter never imports its engine).
ENGINES = frozenset({"vllm", "sglang", "transformers"})
#: Imported by this module's own name under ``if TYPE_CHECKING:`` only: the namespace's lazy names, for mypy.
TYPE_ONLY = {"__init__.py": 3}


def layer_of(relative: str) -> int | None:
    for pattern, layer in LAYERS.items():
        if fnmatch.fnmatchcase(relative, pattern):
            return layer
    return None


def module_name(relative: str) -> str:
    parts = ["weightcache", *relative.removesuffix(".py").split("/")]
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def module_file(name: str) -> str | None:
    """weightcache/ relative path of module ``name`` (a package's __init__.py), or None if it is none of ours."""
    parts = name.split(".")[1:]
    path = PACKAGE.joinpath(*parts)
    if path.is_dir() and (path / "__init__.py").is_file():
        return "/".join([*parts, "__init__.py"])
    if path.with_suffix(".py").is_file():
        return "/".join(parts) + ".py"
    return None


class _Imports(ast.NodeVisitor):
    """Every import of a module: (line, imported module, inside a function, under ``if TYPE_CHECKING``)."""

    def __init__(self, package: str) -> None:
        self.package = package
        self.found: list[tuple[int, str, bool, bool]] = []
        self._function = 0
        self._type_only = 0

    def _add(self, line: int, name: str) -> None:
        self.found.append((line, name, self._function > 0, self._type_only > 0))

    def _function_body(self, node: ast.FunctionDef | ast.AsyncFunctionDef | ast.Lambda) -> None:
        self._function += 1
        self.generic_visit(node)
        self._function -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function_body

    def visit_If(self, node: ast.If) -> None:
        test = node.test
        type_only = (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
            isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
        )
        self._type_only += type_only
        for child in node.body:
            self.visit(child)
        self._type_only -= type_only
        for child in node.orelse:
            self.visit(child)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(node.lineno, alias.name)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        if node.level:
            base = self.package.split(".")
            base = base[: len(base) - (node.level - 1)]
            source = ".".join([*base, *([node.module] if node.module else [])])
        else:
            source = node.module or ""
        if source == "__future__":
            return
        for alias in node.names:  # ``from . import quant`` imports the module weightcache.quant
            submodule = f"{source}.{alias.name}"
            is_ours = submodule.startswith("weightcache.") and module_file(submodule) is not None
            self._add(node.lineno, submodule if is_ours else source)

    def visit_Call(self, node: ast.Call) -> None:  # importlib.import_module("literal") and __import__("literal")
        func = node.func
        name = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
        if name in ("import_module", "__import__") and node.args:
            first = node.args[0]
            if isinstance(first, ast.Constant) and isinstance(first.value, str) and not first.value.startswith("."):
                self._add(node.lineno, first.value)
        self.generic_visit(node)


def violations(relative: str, source: str) -> list[str]:
    """What is wrong with the imports of the module at ``relative`` (weightcache/-relative path)."""
    layer = layer_of(relative)
    if layer is None:
        return [f"{relative} has no layer: add it to LAYERS in tests/test_layers.py"]
    name = module_name(relative)
    visitor = _Imports(name if relative.endswith("__init__.py") else name.rpartition(".")[0])
    visitor.visit(ast.parse(source, relative))
    out = []
    for line, imported, in_function, type_only in visitor.found:
        where = f"{relative}:{line} (L{layer}) imports {imported}"
        top = imported.split(".")[0]
        allowed = TYPE_ONLY.get(relative, layer) if type_only else layer
        if top == "weightcache":
            target = module_file(imported)
            target_layer = None if target is None else layer_of(target)
            if target_layer is None:
                out.append(f"{where}, which is no module with a layer")
            elif target_layer > allowed:
                out.append(f"{where}, which is L{target_layer}: a layer may import only its own and those below")
        elif top in sys.stdlib_module_names:
            continue
        elif top in ENGINES:
            if layer < 4:
                out.append(f"{where}: engines are for the adapters (L4) and the tools (L5)")
            elif not in_function:
                out.append(f"{where} at module level: import an engine inside the function that needs it")
        elif top in THIRD_PARTY:
            if THIRD_PARTY[top] > allowed:
                out.append(f"{where}: {top} is for L{THIRD_PARTY[top]} and up")
        elif layer < 5:
            out.append(f"{where}: a third-party package no layer below the tools (L5) may use; see THIRD_PARTY")
    return out


def modules() -> list[str]:
    return sorted(p.relative_to(PACKAGE).as_posix() for p in PACKAGE.rglob("*.py"))


def test_every_module_has_a_layer_and_imports_only_below_it() -> None:
    found = [v for relative in modules() for v in violations(relative, (PACKAGE / relative).read_text())]
    assert not found, "\n".join(found)


def imports_of(relative: str, source: str) -> set[str]:
    """The modules of the package that the module at ``relative`` imports, in any way the check sees (at the top,
    inside a function, under ``if TYPE_CHECKING``)."""
    name = module_name(relative)
    visitor = _Imports(name if relative.endswith("__init__.py") else name.rpartition(".")[0])
    visitor.visit(ast.parse(source, relative))
    found = {module_file(imported) for _, imported, _, _ in visitor.found if imported.split(".")[0] == "weightcache"}
    return {target for target in found if target is not None and target != relative}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import circles of ``graph`` (module -> modules it imports): its strongly connected components of more
    than one module (Tarjan's algorithm, iteratively), each sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []
    for start in sorted(graph):
        if start in index:
            continue
        work = [(start, iter(sorted(graph.get(start, ()))))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph.get(child, ())))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_no_import_circle_inside_the_package() -> None:
    """Issue 34: ``backends/template.py`` imported ``engine_steps.py``, which imported ``Backend`` back (for
    types only). Every import counts, even one for types or inside a function: a circle means a name lives in the
    wrong room."""
    graph = {relative: imports_of(relative, (PACKAGE / relative).read_text()) for relative in modules()}
    assert not circles(graph), circles(graph)


def test_the_circle_check_catches() -> None:
    assert circles({"a.py": {"b.py"}, "b.py": {"c.py"}, "c.py": {"a.py"}, "d.py": {"a.py"}}) == [
        ["a.py", "b.py", "c.py"]
    ]
    assert circles({"a.py": {"b.py"}, "b.py": set()}) == []
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .template import Backend\n"
    assert imports_of("backends/engine_steps.py", typed) == {"backends/template.py"}


@pytest.mark.parametrize(
    ("relative", "source", "expected"),
    [
        ("fingerprint.py", "def f():\n    import torch\n", "torch is for L3"),
        ("manifest.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    import torch\n", "torch is for L3"),
        ("keeper/store.py", "from .. import segments\n", "which is L3"),
        ("keeper/store.py", "def f():\n    from ..segments import memfd\n", "which is L3"),
        ("checkpoint.py", "def f():\n    from safetensors import safe_open\n", "safetensors is for L3"),
        ("errors.py", "import attrs\n", "attrs is for L1"),
        ("client.py", "import weightcache.api\n", "which is L3"),
        ("protocol.py", "import importlib\nimportlib.import_module('torch')\n", "torch is for L3"),
        ("api.py", "def f():\n    import vllm\n", "engines are for the adapters"),
        ("backends/vllm.py", "import vllm\n", "at module level"),
        ("loader.py", "import requests\n", "no layer below the tools"),
        ("brand_new.py", "", "has no layer"),
    ],
)
def test_the_check_catches(relative: str, source: str, expected: str) -> None:
    """The check itself: each of these would slip a layer (or escape the table)."""
    found = violations(relative, source)
    assert any(expected in v for v in found), found


def test_the_check_allows() -> None:
    assert not violations("loader.py", "import torch\nfrom .checkpoint import read_header\n")
    assert not violations("backends/vllm.py", "def f():\n    import vllm\n")
    assert not violations("keeper/server.py", "from .store import Store\nfrom .. import fdcheck, messages\n")
    assert not violations("segments/memfd.py", "from ..fdcheck import REQUIRED_SEALS\nfrom .dense import dense_bytes\n")


_BLOCK_TORCH = """\
import sys
for name in ("torch", "safetensors", "numpy", "tqdm", "cuda"):
    sys.modules[name] = None  # importing any of them raises ImportError
"""

_TORCH_FREE = """\
import importlib, json, sys
for name in sys.argv[2:]:
    importlib.import_module(name)
import weightcache as wc
fingerprint = wc.Fingerprint.create(sys.argv[1])
try:
    wc.Fingerprint.create(sys.argv[1], device="cuda:0")
    cuda = ""
except ValueError as exc:
    cuda = str(exc)
lazy = {}
for name in ("attach", "preload", "bind", "Cache", "Handle"):
    assert name in wc.__all__ and name in dir(wc), name
    try:
        getattr(wc, name)
    except ImportError as exc:
        lazy[name] = str(exc)
loaded = sorted(m for m in sys.modules if m.startswith("weightcache"))
print(json.dumps({"digest": fingerprint.digest, "cuda": cuda, "lazy": lazy, "loaded": loaded}))
"""


def test_the_keeper_and_the_namespace_import_without_torch(tmp_path: Path, checkpoint: Path) -> None:
    """Every module of L0-L2 imports, and a CPU fingerprint is computed, where importing torch fails; the torch
    names stay in the namespace and fail only when used; a CUDA fingerprint asks for torch."""
    (tmp_path / "sitecustomize.py").write_text(_BLOCK_TORCH)
    below = [module_name(r) for r in modules() if (layer := layer_of(r)) is not None and layer <= 2]
    assert {"weightcache.keeper", "weightcache.client", "weightcache.fdcheck", "weightcache.checkpoint"} <= set(below)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(PACKAGE.parent)])}
    run = subprocess.run(
        [sys.executable, "-c", _TORCH_FREE, str(checkpoint), *below],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert run.returncode == 0, run.stderr
    result = json.loads(run.stdout.splitlines()[-1])
    assert result["digest"] == wc.Fingerprint.create(checkpoint).digest  # torch's version read without torch
    assert set(result["lazy"]) == {"attach", "preload", "bind", "Cache", "Handle"}, result["lazy"]
    assert all("torch" in message for message in result["lazy"].values()), result["lazy"]
    assert set(below) <= set(result["loaded"])
    assert "import torch before" in result["cuda"]


def test_a_function_local_torch_import_in_l1_fails_the_check(tmp_path: Path) -> None:
    """Planting ``import torch`` inside a function of a real L1 module makes the check fail."""
    source = (PACKAGE / "checkpoint.py").read_text()
    planted = source + textwrap.dedent(
        """

        def _sneaky() -> None:
            import torch  # noqa: F401
        """
    )
    assert not violations("checkpoint.py", source)
    assert any("torch is for L3" in v for v in violations("checkpoint.py", planted))

"""docs/ keeps up with the code: every error, warning, keeper error code and fallback reason is explained in
docs/troubleshooting.md, every CLI subcommand and option in docs/cli.md, every example in docs/examples.md.

The site itself is built with ``mkdocs build --strict`` by ``make docs`` (part of ``make test``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import attrs
import pytest

import weightcache.errors
import weightcache.messages
from weightcache.tools.cli import build_parser

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"
TROUBLESHOOTING = (DOCS / "troubleshooting.md").read_text()


def error_classes() -> list[type[BaseException]]:
    found = [
        obj
        for _, obj in inspect.getmembers(weightcache.errors, inspect.isclass)
        if obj.__module__ == weightcache.errors.__name__
        and issubclass(obj, (weightcache.errors.WeightCacheError, Warning))
    ]
    assert len(found) >= 20
    return found


@pytest.mark.parametrize("cls", error_classes(), ids=lambda c: c.__name__)
def test_every_error_and_warning_is_in_troubleshooting(cls: type[BaseException]) -> None:
    assert re.search(rf"^#+ `{cls.__name__}`$", TROUBLESHOOTING, re.MULTILINE), (
        f"docs/troubleshooting.md has no section '#### `{cls.__name__}`' saying what it means and what to do"
    )


def keeper_error_codes() -> set[str]:
    """Every code the keeper can put in a reply's "error" field: weightcache.messages names them all."""
    return set(weightcache.messages.ERROR_CODES)


def client_error_codes() -> set[str]:
    """The codes weightcache's client side gives the KeeperErrors it raises itself (no keeper reply carries them,
    e.g. ``timeout`` of ``stop --wait``): every literal code passed to KeeperError or a subclass in weightcache/,
    and ``"error"``, KeeperError's default, where one is raised without a code."""
    classes = {"KeeperError", "BudgetExceeded", "KeeperForbidden"}
    codes = set()
    for path in (ROOT / "weightcache").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not isinstance(node, ast.Call):
                continue
            name = node.func.id if isinstance(node.func, ast.Name) else getattr(node.func, "attr", None)
            if name not in classes:
                continue
            code = (
                node.args[1] if len(node.args) > 1 else next((k.value for k in node.keywords if k.arg == "code"), None)
            )
            if code is None:
                codes.add("error")
            elif isinstance(code, ast.Constant) and isinstance(code.value, str):
                codes.add(code.value)
    return codes


def test_every_keeper_error_code_is_in_troubleshooting() -> None:
    """`exc.code` of a KeeperError is one of the table's codes (docs/troubleshooting.md says so): those the keeper
    replies with and those the client gives errors of its own."""
    codes = keeper_error_codes()
    # sanity: the regexes find codes raised in every way the keeper raises them
    assert {"bad_request", "forbidden", "busy", "not_found", "leased", "ambiguous", "over_budget", "version"} <= codes
    assert "internal" in codes
    client = client_error_codes()
    assert {"timeout", "version"} <= client  # sanity: `stop --wait`'s, and a keeper too old for artifacts
    section = TROUBLESHOOTING.split("## Keeper error codes", 1)[1].split("\n## ", 1)[0]
    table = {m for m in re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)}
    codes |= client
    assert codes <= table, f"keeper error codes missing from docs/troubleshooting.md: {sorted(codes - table)}"


def fallback_reasons() -> list[str]:
    """The constant start of each reason a FallbackWarning can give: weightcache/pipeline.py decides them all."""
    reasons = []
    tree = ast.parse((ROOT / "weightcache" / "pipeline.py").read_text())
    for node in ast.walk(tree):
        texts: list[ast.expr] = []
        if isinstance(node, ast.Call) and getattr(node.func, "id", None) == "_fallback":
            texts = node.args
        elif isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "reason" for t in node.targets):
            texts = [node.value]
        elif isinstance(node, ast.FunctionDef) and node.name in ("why_missing", "_why_missing"):
            texts = [
                r.value.elts[0] for r in ast.walk(node) if isinstance(r, ast.Return) and isinstance(r.value, ast.Tuple)
            ]
        for text in texts:
            if isinstance(text, ast.JoinedStr) and isinstance(text.values[0], ast.Constant):
                reasons.append(str(text.values[0].value))
    return reasons


def test_every_fallback_reason_is_in_troubleshooting() -> None:
    reasons = fallback_reasons()
    assert len(reasons) >= 6, reasons
    for reason in reasons:
        assert f"`{reason}" in TROUBLESHOOTING, f"fallback reason {reason!r} is not in docs/troubleshooting.md"


def subcommands() -> dict[str, argparse.ArgumentParser]:
    [action] = [a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)]
    return dict(action.choices)


@pytest.mark.parametrize("name", sorted(subcommands()))
def test_every_cli_subcommand_and_option_is_documented(name: str) -> None:
    cli = (DOCS / "cli.md").read_text()
    sections = re.split(r"^## ", cli, flags=re.MULTILINE)
    [section] = [s for s in sections if s.startswith(f"weightcache {name}\n")] or [""]
    assert section, f"docs/cli.md has no section '## weightcache {name}'"
    for action in subcommands()[name]._actions:
        if action.help == argparse.SUPPRESS or "-h" in action.option_strings:
            continue
        if action.option_strings:
            assert any(f"`{opt}" in section for opt in action.option_strings), (
                f"docs/cli.md, weightcache {name}: option {action.option_strings[-1]} is not documented"
            )


def test_every_example_is_described() -> None:
    text = (DOCS / "examples.md").read_text()
    for path in sorted((ROOT / "examples").glob("*.py")):
        assert f"examples/{path.name}" in text, f"docs/examples.md does not describe examples/{path.name}"


# --- the snippets: every shell and Python block of these pages runs, on CPU, as a new user would run it --------

#: The pages whose snippets run, in a fresh working directory each, top to bottom (a page's blocks build on each
#: other, as a reader's commands do).
SNIPPET_PAGES = [
    "quickstart.md",
    "cli.md",
    "guides/pytorch.md",
    "guides/transformers.md",
    "guides/vllm.md",
    "guides/sglang.md",
]

#: What a page's Python snippets may take as given (the names its prose says stand for your own): the
#: quickstart's model and checkpoint, already written to ./ckpt.
PRELUDE = {
    "guides/pytorch.md": """
import torch, weightcache as wc
from safetensors.torch import load_file
from torch import nn

class MyModel(nn.Module):
    def __init__(self, cfg: object) -> None:
        super().__init__()
        self.a, self.b = nn.Linear(1024, 1024), nn.Linear(1024, 10)
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(torch.relu(self.a(x)))

cfg = None
x = torch.ones(1, 1024, dtype=torch.bfloat16)
state_dict = {k: v.to(torch.bfloat16) for k, v in load_file("ckpt/model.safetensors").items()}
rank, world = 0, 1
with torch.device("meta"):
    model = MyModel(cfg)
""",
}

FENCE = re.compile(r"^```(\w*)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
MARKER = re.compile(r"<!-- snippet: (skip|file|output illustrative)\b:? ?(.*?) -->\n$")


@attrs.frozen
class Snippet:
    page: str
    line: int
    lang: str
    code: str
    #: None (run it), "skip", "file" (write it to ``arg``), "output illustrative" (run, check the status only)
    marker: str | None
    arg: str


def snippets(page: str) -> list[Snippet]:
    text = (DOCS / page).read_text()
    out = []
    for m in FENCE.finditer(text):
        before = text[: m.start()]
        marker = MARKER.search(before[before.rfind("<!--", max(0, len(before) - 400)) :] if "<!--" in before else "")
        line = before.count("\n") + 1
        out.append(
            Snippet(
                page,
                line,
                m.group(1),
                m.group(2),
                marker.group(1) if marker else None,
                marker.group(2).strip() if marker else "",
            )
        )
    return out


#: The user name the docs' transcripts show; whoever runs them sees their own.
EXAMPLE_USER = "alice"


def loose(line: str) -> re.Pattern[str]:
    """A documented output line as a pattern: numbers, hex digests, paths and the docs' example user (``alice``,
    e.g. in `weightcache ls`'s PUBLISHER column) stand for any, spaces for any run."""
    pieces = []
    for token in line.split():
        if "/" in token or token == EXAMPLE_USER:
            pieces.append(r"\S+")
            continue
        piece = re.escape(re.sub(r"\b[0-9a-f]{8,}\b", "QHEXQ", token))
        pieces.append(re.sub(r"\d+", r"\\d+", piece).replace("QHEXQ", "[0-9a-f]+"))
    return re.compile(r"\s+".join(pieces))


def transcript(code: str) -> list[tuple[str, list[str]]]:
    """``$ command`` lines and the output documented under each."""
    steps: list[tuple[str, list[str]]] = []
    for line in code.splitlines():
        if line.startswith("$ "):
            steps.append((line[2:].split("  #")[0].strip(), []))
        elif steps and line.strip():
            steps[-1][1].append(line)
    return steps


class Reader:
    """A new user in a fresh directory: ``python`` and ``weightcache`` on the PATH, a private keeper directory."""

    def __init__(self, tmp: Path, socket_dir: Path) -> None:
        self.cwd = tmp / "work"
        self.cwd.mkdir()
        shims = tmp / "bin"
        shims.mkdir()
        for name, line in (("python", '"$@"'), ("weightcache", '-m weightcache "$@"')):
            (shims / name).write_text(f"#!/bin/sh\nexec {sys.executable} {line}\n")
            (shims / name).chmod(0o755)
        path = [str(ROOT), *filter(None, os.environ.get("PYTHONPATH", "").split(os.pathsep))]
        self.env = {
            **os.environ,
            "PATH": f"{shims}{os.pathsep}{os.environ['PATH']}",
            "PYTHONPATH": os.pathsep.join(path),
            "WEIGHTCACHE_DIR": str(socket_dir),
        }
        self.env.pop("XDG_RUNTIME_DIR", None)

    def run(self, command: str, where: str) -> subprocess.CompletedProcess[str]:
        out = subprocess.run(
            ["bash", "-c", command], cwd=self.cwd, env=self.env, capture_output=True, text=True, timeout=300
        )
        assert out.returncode == 0, f"{where}: `{command}` exited {out.returncode}:\n{out.stdout}\n{out.stderr}"
        return out

    def substitute(self, command: str) -> str:
        """A digest (prefix) the page shows names the keeper's one entry here."""
        words = command.split()
        if words[:2] not in (["weightcache", "inspect"], ["weightcache", "evict"]):
            return command
        entries = json.loads(self.run("weightcache ls --json", "substitute").stdout)["entries"]
        assert len(entries) == 1, f"`{command}`: the page's digest should name the one entry; found {entries}"
        return re.sub(r"(?<= )[0-9a-f]{4,64}(?=\s|$)", entries[0]["digest"][:12], command)

    def stop(self) -> None:
        subprocess.run(
            ["bash", "-c", "weightcache stop --wait"], cwd=self.cwd, env=self.env, capture_output=True, timeout=60
        )


def run_snippet(reader: Reader, s: Snippet) -> None:
    where = f"docs/{s.page}:{s.line}"
    if s.marker == "file":
        (reader.cwd / s.arg).write_text(s.code)
        return
    if s.lang == "python":
        script = reader.cwd / f"snippet_{s.line}.py"
        script.write_text(PRELUDE.get(s.page, "") + "\n" + s.code)
        reader.run(f"python {script.name}", where)
        return
    if s.lang in ("bash", "sh"):
        for line in s.code.splitlines():
            command = line.split("  #")[0].strip()
            if command and not command.startswith("#"):
                reader.run(command, where)
        return
    steps = transcript(s.code)
    assert steps, f"{where}: a block without a language must be a transcript (`$ command` lines) or be marked"
    for command, documented in steps:
        out = reader.run(reader.substitute(command), where)
        if s.marker == "output illustrative":
            continue
        got = (out.stdout + out.stderr).splitlines()
        for want in documented:
            pattern = loose(want)
            assert any(pattern.search(line) for line in got), (
                f"{where}: `{command}` printed no line like\n  {want}\nit printed:\n" + "\n".join(got)
            )


@pytest.mark.parametrize("page", SNIPPET_PAGES)
def test_the_snippets_of_a_page_run(page: str, tmp_path: Path, socket_dir: Path) -> None:
    """Each block runs (a Python block as a script, a shell block line by line, a transcript command by command
    with its documented output), or is marked with why not: ``<!-- snippet: skip: REASON -->`` (a GPU, an engine,
    minutes of work), ``<!-- snippet: file NAME -->`` (a file later blocks use), ``<!-- snippet: output
    illustrative: REASON -->`` (run; the output shown is another machine's)."""
    found = snippets(page)
    assert found, f"docs/{page} has no snippets"
    reader = Reader(tmp_path, socket_dir)  # a short socket path, its keeper stopped afterwards (conftest)
    if page != "quickstart.md":  # the other pages use the quickstart's checkpoint, ./ckpt
        [model] = [s for s in snippets("quickstart.md") if s.marker == "file"]
        (reader.cwd / model.arg).write_text(model.code)
        reader.run(f"python {model.arg} save", "the quickstart's checkpoint")
    try:
        for s in found:
            if s.marker == "skip":
                assert len(s.arg.split()) >= 3, f"docs/{page}:{s.line}: a skipped snippet says why"
                continue
            run_snippet(reader, s)
    finally:
        reader.stop()


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("g++") is None, reason="inductor on the CPU needs a C++ compiler")
def test_the_compile_cache_snippet_hits_fully_from_its_second_run(tmp_path: Path, socket_dir: Path) -> None:
    """docs/guides/pytorch.md's `compile_cache` block, exactly as written, run twice in fresh processes, each with
    an empty inductor cache directory: the first compiles and publishes; the second loads every graph from the
    keeper (torch's hits, no miss) and publishes nothing."""
    [block] = [s for s in snippets("guides/pytorch.md") if "wc.compile_cache(" in s.code]
    reader = Reader(tmp_path, socket_dir)
    [model] = [s for s in snippets("quickstart.md") if s.marker == "file"]
    (reader.cwd / model.arg).write_text(model.code)
    reader.run(f"python {model.arg} save", "the quickstart's checkpoint")
    script = reader.cwd / "compiled.py"
    script.write_text(PRELUDE["guides/pytorch.md"] + "\n" + block.code)
    try:
        runs = []
        for n in (1, 2):
            reader.env["TORCHINDUCTOR_CACHE_DIR"] = str(tmp_path / f"inductor-{n}")
            out = reader.run("python compiled.py", f"docs/guides/pytorch.md:{block.line}, run {n}")
            runs.append(out.stdout)
    finally:
        reader.stop()
    first, second = (re.search(r"CompileCacheStats\(.*\)", out) for out in runs)
    assert first is not None and second is not None, runs
    assert "source='none'" in first.group() and "published_bytes=0" not in first.group(), first.group()
    assert "source='keeper'" in second.group() and "misses=0" in second.group(), second.group()
    assert "hits=0" not in second.group() and "published_bytes=0" in second.group(), second.group()


def test_the_cli_reference_lists_the_keepers_limits_as_the_code_sets_them() -> None:
    """Issue 33: the keeper's limits that have no flag (send deadline, reply caps, page sizes) are listed in the
    CLI reference, with the values the code uses."""
    from weightcache import artifact_key, messages, protocol
    from weightcache.keeper import server

    text = (DOCS / "cli.md").read_text()
    section = text.split("The keeper's limits that have no flag", 1)[1].split("```", 1)[0]
    mib = 1 << 20
    expected = {
        "bytes of replies not read yet": f"{server.MAX_REPLY_BYTES // mib} MiB",
        "a reply not read within": f"{server.SEND_TIMEOUT_S:.0f} s",
        "a frame's remaining bytes after its first": f"{protocol.FRAME_TIMEOUT_S:.0f} s",
        "fds on one frame": f"{protocol.MAX_FDS}",
        "entries in one `list` page": f"{server.LIST_PAGE_ENTRIES:,}, and at most "
        f"{messages.LIST_PAGE_BYTES // mib} MiB",
        "artifacts in one `list_artifacts` page": f"{messages.MAX_LISTED_ARTIFACTS:,}",
        "an artifact key": f"{artifact_key.MAX_KEY_BYTES // 1024} KiB of JSON, nested at most "
        f"{artifact_key.MAX_KEY_DEPTH} levels",
        "payload bytes of large frames being received at once": f"{server.MAX_INFLIGHT_BYTES // mib} MiB",
    }
    rows = dict(re.findall(r"^\| (.+?) \| (.+?) \|$", section, re.MULTILINE))
    for name, value in expected.items():
        [row] = [cell for label, cell in rows.items() if label.startswith(name)]
        assert value in row, f"docs/cli.md's limit {name!r} says {row!r}; the code: {value}"

"""docs/ keeps up with the code: every error, warning, keeper error code and fallback reason is explained in
docs/troubleshooting.md, every CLI subcommand and option in docs/cli.md, every example in docs/examples.md.

The site itself is built with ``mkdocs build --strict`` by ``make docs`` (part of ``make test``).
"""

from __future__ import annotations

import argparse
import ast
import inspect
import re
from pathlib import Path

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


def test_every_keeper_error_code_is_in_troubleshooting() -> None:
    codes = keeper_error_codes()
    # sanity: the regexes find codes raised in every way the keeper raises them
    assert {"bad_request", "forbidden", "busy", "not_found", "leased", "ambiguous", "over_budget", "version"} <= codes
    assert "internal" in codes
    section = TROUBLESHOOTING.split("## Keeper error codes", 1)[1]
    table = {m for m in re.findall(r"^\| `(\w+)` \|", section, re.MULTILINE)}
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
        elif isinstance(node, ast.FunctionDef) and node.name == "why_missing":
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

"""What a command line asks Python to run, worked out without running it: whether the warm process can start it.

``weightcache run -- CMD ...`` hands the warm process a :class:`Target`, never a shell command. A command is one of:

- ``python [-u] SCRIPT ARGS``, ``python [-u] -m MODULE ARGS`` or ``python [-u] -c CODE ARGS``, where ``python`` is
  the interpreter the warm process runs (the same file in the same environment's ``bin``);
- a console script of that environment (``vllm serve ...``, ``sglang ...``): an executable whose ``#!`` line names
  that interpreter and whose name is one of the environment's ``console_scripts`` entry points. The child runs
  the script's file as that interpreter would (so ``__main__``, ``sys.argv[0]`` and multiprocessing's spawn
  see what they see in a direct start); the entry point only names the package to preload.

Anything else (another interpreter, interpreter options that only a new interpreter can honour, such as ``-X dev``
where the warm process runs without it, a shell script, a binary) is not a :class:`Target`: :func:`resolve` raises
:class:`NotWarmable` saying why, and the launcher starts the command directly.

This module also names what a warm process imports for a target by default (:func:`default_preloads`): the
engine's heavy modules, found by the top-level package of the command's module or entry point.

Layer L2 (the warm process's pure logic): never imports torch or an engine; :func:`importlib.util.find_spec`
locates modules without importing them.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
from collections.abc import Mapping, Sequence

import attrs

#: What each kind of target means: run a file (``script``: a script or a console script), ``python -m``
#: (``module``), ``python -c`` (``code``).
KINDS = ("script", "module", "code")

#: Modules a warm process imports for commands of an engine, by the top-level package of the command's module or
#: entry point, beside what the command itself names. ``module:attr`` resolves an attribute after the import, for
#: packages whose heavy imports are lazy (``from vllm import LLM`` imports the engine; ``import vllm`` does not).
ENGINE_PRELOADS: dict[str, tuple[str, ...]] = {
    "vllm": (
        "torch",
        "vllm:LLM",
        "vllm.entrypoints.openai.api_server",
        "vllm.v1.engine.core",
        "vllm.v1.worker.gpu_worker",
    ),
    "sglang": ("torch", "sglang.srt.entrypoints.engine", "sglang.srt.entrypoints.http_server"),
    "transformers": ("torch", "transformers:AutoModelForCausalLM"),
}
#: For a script or ``-c`` (which names no package): torch, and transformers' model classes where installed.
SCRIPT_PRELOADS = ("torch", "transformers:AutoModelForCausalLM")


class NotWarmable(Exception):
    """This command cannot be started by the warm process (the message says why); start it directly."""


@attrs.frozen
class Target:
    """One command, as the forked child will run it.

    ``kind`` is one of :data:`KINDS`; ``value`` the script path (as given, relative to the working directory),
    module name or code; ``argv`` what ``sys.argv`` becomes; ``path0`` what ``sys.path[0]`` becomes (as Python
    sets it: the script's directory, the working directory for ``-m``, ``""`` for ``-c``); ``unbuffered`` for
    ``python -u``; ``entry`` the ``module:attr`` of a console script (for the preloads only).
    """

    kind: str
    value: str
    argv: tuple[str, ...]
    path0: str
    unbuffered: bool = False
    entry: str = ""

    def to_wire(self) -> dict[str, object]:
        return {
            "kind": self.kind,
            "value": self.value,
            "argv": list(self.argv),
            "path0": self.path0,
            "unbuffered": self.unbuffered,
        }

    @classmethod
    def from_wire(cls, message: Mapping[str, object]) -> Target:
        kind, value, argv, path0, unbuffered = (
            message.get(k) for k in ("kind", "value", "argv", "path0", "unbuffered")
        )
        if kind not in KINDS:
            raise ValueError(f"target kind must be one of {', '.join(KINDS)}; found {kind!r}")
        if not isinstance(value, str) or not isinstance(path0, str) or not isinstance(unbuffered, bool):
            raise ValueError("target value and path0 must be strings, unbuffered a boolean")
        if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
            raise ValueError("target argv must be a non-empty list of strings")
        return cls(kind, value, tuple(argv), path0, unbuffered)


def same_interpreter(path: str, executable: str) -> bool:
    """Whether the program at ``path`` is the interpreter ``executable`` in the same environment: the same file
    in the same ``bin`` directory (``python``, ``python3`` and ``python3.11`` of one venv are; the base
    interpreter a venv links to is not, since it would run with other packages)."""
    try:
        return os.path.dirname(os.path.abspath(path)) == os.path.dirname(executable) and os.path.samefile(
            path, executable
        )
    except OSError:
        return False


def _which(program: str, env: Mapping[str, str], cwd: str) -> str | None:
    if os.sep in program:
        full = os.path.join(cwd, program)
        return full if os.path.isfile(full) and os.access(full, os.X_OK) else None
    return shutil.which(program, path=env.get("PATH", os.defpath))


def interpreter_flags() -> list[str]:
    """The options that give an interpreter this one's settings (``-B``, ``-O``, ``-X dev``, ``-W error``, ...), as
    multiprocessing passes them to what it spawns. A warm process's key holds them, so a warm process of the same
    key runs with the same: such an option on a command line changes nothing there."""
    return list(subprocess._args_from_interpreter_flags())  # type: ignore[attr-defined]


def _python_target(args: Sequence[str], cwd: str) -> Target:
    unbuffered = False
    rest = list(args)
    same = interpreter_flags()
    while rest and rest[0].startswith("-") and rest[0] not in ("-m", "-c", "-"):
        option = rest.pop(0)
        if option in ("-X", "-W") and rest:
            option += rest.pop(0)  # written apart: compare as written together
        if option == "-u":
            unbuffered = True
        elif option == "--":
            break
        elif option not in same and not (option[:2] in ("-X", "-W") and [option[:2], option[2:]] in _pairs(same)):
            raise NotWarmable(
                f"the interpreter option {option[:2]!r} takes effect only when an interpreter starts (the warm "
                "process honours -u, -m, -c, and options that give the settings it runs with)"
            )
    if not rest or rest[0] == "-":
        raise NotWarmable("a program read from standard input is not started by the warm process")
    if rest[0] == "-m":
        if len(rest) < 2:
            raise NotWarmable("python -m needs a module name")
        return Target("module", rest[1], (rest[1], *rest[2:]), cwd, unbuffered)
    if rest[0] == "-c":
        if len(rest) < 2:
            raise NotWarmable("python -c needs the code to run")
        return Target("code", rest[1], ("-c", *rest[2:]), "", unbuffered)
    script = os.path.join(cwd, rest[0])
    if not os.path.exists(script):
        raise NotWarmable(f"the script {rest[0]!r} does not exist (in {cwd})")
    # As given: runpy sets sys.argv[0] to it, and the child runs in cwd.
    return Target("script", rest[0], tuple(rest), os.path.dirname(os.path.realpath(script)), unbuffered)


def _pairs(flags: Sequence[str]) -> list[list[str]]:
    return [[flags[i], flags[i + 1]] for i in range(len(flags) - 1) if flags[i] in ("-X", "-W")]


def _shebang(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            first = f.readline(4096)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode(errors="replace").split()
    return words[0] if words else None


def resolve(argv: Sequence[str], *, env: Mapping[str, str], cwd: str, executable: str) -> Target:
    """The :class:`Target` for ``argv`` run with ``env`` in ``cwd``, for a warm process whose interpreter is
    ``executable``; :class:`NotWarmable` if it cannot start it."""
    if not argv:
        raise NotWarmable("no command given")
    program = _which(argv[0], env, cwd)
    if program is None:
        raise NotWarmable(f"{argv[0]!r} is not an executable on PATH")
    if same_interpreter(program, executable):
        return _python_target(argv[1:], cwd)
    interpreter = _shebang(program)
    if interpreter is None or not same_interpreter(interpreter, executable):
        raise NotWarmable(
            f"{program} is not run by this environment's interpreter ({executable}): the warm process starts "
            "that interpreter's scripts, modules and console scripts"
        )
    name = os.path.basename(program)
    found = importlib.metadata.entry_points(group="console_scripts", name=name)
    if not found:
        raise NotWarmable(f"{program} runs {executable} but is no console script of its environment")
    entry = next(iter(found))
    return Target("script", program, (program, *argv[1:]), os.path.dirname(program), entry=entry.value)


def top_package(target: Target) -> str:
    """The top-level package a target's code comes from (empty for a script or ``-c``)."""
    if target.kind == "module":
        return target.value.split(".")[0]
    return target.entry.split(":")[0].split(".")[0]


def installed(package: str) -> bool:
    """Whether the top-level ``package`` can be imported here, without importing it (a submodule could not be
    found without importing its parents, which is the warm process's work, not the launcher's)."""
    try:
        return importlib.util.find_spec(package) is not None
    except (ImportError, ValueError):
        return False


def default_preloads(target: Target) -> tuple[str, ...]:
    """What a warm process imports for ``target`` when the user names nothing: the engine's modules
    (:data:`ENGINE_PRELOADS`) and the entry point's module, or :data:`SCRIPT_PRELOADS` for a script, each only
    whose top-level package is installed (the warm process skips, with a log line, a submodule it cannot import).
    A ``-m`` module itself is never preloaded: ``runpy`` would then find it imported already."""
    package = top_package(target)
    wanted = list(ENGINE_PRELOADS.get(package, ("torch",) if package else SCRIPT_PRELOADS))
    if target.entry:
        wanted.append(target.entry.split(":")[0].split()[0])
    elif target.kind == "module" and "." in target.value:
        wanted.append(target.value.rpartition(".")[0])
    seen: list[str] = []
    for spec in wanted:
        if spec not in seen and installed(spec.split(":")[0].split(".")[0]):
            seen.append(spec)
    return tuple(seen)


__all__ = [
    "ENGINE_PRELOADS",
    "KINDS",
    "NotWarmable",
    "SCRIPT_PRELOADS",
    "Target",
    "default_preloads",
    "installed",
    "resolve",
    "same_interpreter",
    "top_package",
]

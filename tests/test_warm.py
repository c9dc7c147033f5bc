"""The warm process (weightcache.warm) with real processes: ``weightcache run`` forks a torch program from a
pre-imported process, and the program sees what a direct start gives it (arguments, environment, working
directory, streams, umask, limits), exits with the same status, and gets the launcher's signals; another uid is
refused; a warm process whose packages changed is replaced; a missing or dead one means a direct start with a
line that says why.
"""

from __future__ import annotations

import importlib.metadata
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from conftest import process_gone, wait_until

import weightcache as wc
from weightcache.warm import identity, target

pytestmark = pytest.mark.slow

#: The program both ways: what it was given, a torch result, whether torch was imported before it asked.
PROGRAM = textwrap.dedent(
    """
    import json, os, resource, sys
    preimported = "torch" in sys.modules
    import torch
    umask = os.umask(0); os.umask(umask)
    print(json.dumps({
        "argv": sys.argv, "cwd": os.getcwd(), "foo": os.environ.get("WC_TEST_FOO"), "path0": sys.path[0],
        "stdin": sys.stdin.read(), "umask": umask, "nofile": resource.getrlimit(resource.RLIMIT_NOFILE)[0],
        "sum": torch.arange(10, dtype=torch.float32).pow(2).sum().item(), "ppid": os.getppid(),
        "preimported": preimported, "main": __name__, "stdout_tty": sys.stdout.isatty(),
        "comm": open("/proc/self/comm").read().strip(),
    }))
    print("a line on stderr", file=sys.stderr)
    sys.exit(int(os.environ.get("WC_TEST_CODE", "0")))
    """
)


#: Prints its pid and its parent's, then sleeps.
SLEEPER = "import os, time; print(os.getpid(), os.getppid(), flush=True); time.sleep(60)"


def with_path(directory: Path) -> str:
    """PYTHONPATH with ``directory`` first (weightcache itself may come from PYTHONPATH, as on the GPU machine)."""
    return os.pathsep.join(filter(None, [str(directory), os.environ.get("PYTHONPATH")]))


def console_script() -> Path:
    """A console script of this environment: weightcache's own where it is installed, else pytest's."""
    for name in ("weightcache", "pytest"):
        path = Path(sys.executable).parent / name
        if path.exists():
            return path
    pytest.skip("no console script beside this interpreter")


def cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "weightcache", *args]


@pytest.fixture(scope="module")
def warm_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    directory = tmp_path_factory.mktemp("warm")
    os.chmod(directory, 0o700)
    yield directory
    subprocess.run(cli("warm", "stop", "--all"), env={**os.environ, "WEIGHTCACHE_DIR": str(directory)}, timeout=30)


@pytest.fixture(scope="module")
def env(warm_dir: Path) -> dict[str, str]:
    return {**os.environ, "WEIGHTCACHE_DIR": str(warm_dir), "WEIGHTCACHE_WARM": "1"}


@pytest.fixture(scope="module")
def warm_pid(env: dict[str, str]) -> int:
    """A warm process that preloads torch, started and waited for."""
    out = subprocess.run(
        cli("warm", "start", "--preload", "torch"), env=env, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return hello(env, ("torch",))["pid"]


def hello(env: dict[str, str], preloads: tuple[str, ...]) -> dict:
    out = subprocess.run(cli("warm", "ls", "--json"), env=env, capture_output=True, text=True, timeout=30)
    assert out.returncode == 0, out.stderr
    slot = identity.slot(sys.executable, preloads)
    [found] = [h for h in json.loads(out.stdout) if h["slot"] == slot]
    return found


@pytest.fixture
def program(tmp_path: Path) -> Path:
    (tmp_path / "prog.py").write_text(PROGRAM)
    return tmp_path / "prog.py"


def both(
    command: list[str], cwd: Path, env: dict[str, str], stdin: str = ""
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """``command`` started directly, then through ``weightcache run --preload torch``, in ``cwd``."""
    direct, warm = (
        subprocess.run(
            [*launcher, *command], cwd=cwd, env=env, input=stdin, capture_output=True, text=True, timeout=120
        )
        for launcher in ([], cli("run", "--preload", "torch", "--"))
    )
    return direct, warm


def run_both(
    program: Path, env: dict[str, str], *args: str, stdin: str = "", extra: dict[str, str] | None = None
) -> tuple[subprocess.CompletedProcess[str], subprocess.CompletedProcess[str]]:
    """The program started directly and through ``weightcache run``, from its directory, with ``args``."""
    return both([sys.executable, program.name, *args], program.parent, {**env, **(extra or {})}, stdin)


def test_a_forked_torch_program_sees_what_a_direct_start_gives_it(
    program: Path, env: dict[str, str], warm_pid: int
) -> None:
    """Same arguments, environment, working directory, sys.path[0], standard input, output and error, umask,
    limits and exit status; the torch result equal; but forked from the warm process (its parent), with torch
    already imported."""
    extra = {"WC_TEST_FOO": "bar baz", "WC_TEST_CODE": "3"}
    direct, warm = run_both(program, env, "x", "--flag", "ä", stdin="from stdin\n", extra=extra)
    assert direct.returncode == warm.returncode == 3, (direct.stderr, warm.stderr)
    assert direct.stderr == warm.stderr == "a line on stderr\n"
    d, w = json.loads(direct.stdout), json.loads(warm.stdout)
    assert w.pop("ppid") == warm_pid and d.pop("ppid") != warm_pid
    assert (d.pop("preimported"), w.pop("preimported")) == (False, True)
    assert d.pop("comm").startswith("python") and w.pop("comm") == "prog.py"  # named for ps and top
    assert d == w
    assert w["argv"] == ["prog.py", "x", "--flag", "ä"] and w["foo"] == "bar baz" and w["stdin"] == "from stdin\n"
    assert w["sum"] == 285.0 and w["main"] == "__main__"


def test_module_code_and_console_script_forms(tmp_path: Path, env: dict[str, str], warm_pid: int) -> None:
    """``python -m``, ``python -c`` and a console script of the environment (``weightcache`` itself) run from
    the warm process as they run directly."""
    (tmp_path / "wcmod_probe.py").write_text("import sys\nprint(__name__, sys.argv[1:], sys.path[0] == '')\n")
    probes = [
        [sys.executable, "-m", "wcmod_probe", "a"],
        [sys.executable, "-c", "import sys, os; print(sys.argv, os.getppid() == int(sys.argv[1]))", str(warm_pid)],
        [str(console_script()), "--version"],
    ]
    for command in probes:
        direct, warm = both(command, tmp_path, env)
        assert warm.returncode == direct.returncode == 0, (command, direct.stderr, warm.stderr)
        assert warm.stderr == "", warm.stderr  # no fallback line: the warm process ran it
        if command[1] == "-c":
            assert direct.stdout == f"['-c', '{warm_pid}'] False\n" and warm.stdout == f"['-c', '{warm_pid}'] True\n"
        else:
            assert warm.stdout == direct.stdout, command


#: Spawns a process (multiprocessing's spawn, as vLLM starts its engine core) and reports what it found.
SPAWNER = textwrap.dedent(
    """
    import multiprocessing as mp, os, sys

    def child(queue, code):
        queue.put(("torch" in sys.modules, os.getppid(), sys.argv[1:]))
        sys.exit(code)

    if __name__ == "__main__":
        ctx = mp.get_context("spawn")
        queue = ctx.Queue()
        process = ctx.Process(target=child, args=(queue, 5))
        process.start()
        preimported, parent, argv = queue.get(timeout=60)
        process.join(60)
        print(preimported, parent == os.getpid(), argv, process.exitcode)
    """
)


def test_what_the_command_spawns_comes_from_the_warm_process_too(
    tmp_path: Path, env: dict[str, str], warm_pid: int
) -> None:
    """A process the command starts with multiprocessing's spawn is forked from the warm process as well (torch
    already imported; its parent is the warm process), through multiprocessing's own pipes, and its parent sees it
    as a spawned process of its own: its result, its exit code."""
    (tmp_path / "spawner.py").write_text(SPAWNER)
    direct, warm = both([sys.executable, "spawner.py"], tmp_path, env)
    assert direct.returncode == warm.returncode == 0, (direct.stderr, warm.stderr)
    assert direct.stdout == "False True [] 5\n"
    assert warm.stdout == "True False [] 5\n" and warm.stderr == "", warm.stderr


def test_signals_reach_the_command_and_its_death_is_the_launchers(
    tmp_path: Path, env: dict[str, str], warm_pid: int
) -> None:
    """SIGTERM to the launcher reaches the command's handler (exit status 7 comes back); SIGINT becomes the
    command's KeyboardInterrupt and, uncaught, its death by SIGINT, which the launcher dies of too; a command
    killed by SIGKILL gives a launcher killed by SIGKILL."""
    script = tmp_path / "sig.py"
    script.write_text(
        textwrap.dedent(
            """
            import os, signal, sys, time
            mode = sys.argv[1]
            if mode == "term":
                signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
            print("ready", flush=True)
            if mode == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            time.sleep(60)
            """
        )
    )
    outcomes = {}
    for mode, signum in (("term", signal.SIGTERM), ("int", signal.SIGINT), ("kill", None)):
        proc = subprocess.Popen(
            [*cli("run", "--preload", "torch", "--"), sys.executable, str(script), mode],
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        try:
            assert proc.stdout is not None
            assert proc.stdout.readline() == "ready\n"
            if signum is not None:
                proc.send_signal(signum)
            out, err = proc.communicate(timeout=30)
        finally:
            proc.kill()  # a launcher that hung takes its command with it, not into the next test
        outcomes[mode] = (proc.returncode, out, err)
    assert outcomes["term"][:2] == (7, "got SIGTERM\n"), outcomes["term"]
    assert outcomes["int"][0] == -signal.SIGINT and "KeyboardInterrupt" in outcomes["int"][2], outcomes["int"]
    assert outcomes["kill"][0] == -signal.SIGKILL, outcomes["kill"]


#: A launcher with a second thread that takes the launcher's SIGTERM itself (pthread_kill), once the command it
#: waits for has written its ready file: the signal's C handler runs on that thread, not on the main thread blocked
#: in its wait, as when a signal arrives just before the main thread enters that wait.
THREADED_LAUNCHER = textwrap.dedent(
    """
    import os, signal, sys, threading, time
    from weightcache.warm import launcher
    script, ready = sys.argv[1:]

    def poke():
        while not os.path.exists(ready):
            time.sleep(0.01)
        time.sleep(0.3)  # the launcher is in its wait for the command's exit by now
        signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=poke, daemon=True).start()
    sys.exit(launcher.run([sys.executable, script, ready], preloads=["torch"]))
    """
)

#: Writes its ready file once its SIGTERM handler is in place, then sleeps 20 s unless a SIGTERM ends it first.
TERM_WAITER = textwrap.dedent(
    """
    import signal, sys, time
    signal.signal(signal.SIGTERM, lambda *a: (print("got SIGTERM", flush=True), sys.exit(7)))
    open(sys.argv[1], "w").close()
    time.sleep(20)
    print("slept", flush=True)
    """
)


def test_a_signal_taken_by_another_thread_of_the_launcher_still_reaches_the_command(
    tmp_path: Path, env: dict[str, str], warm_pid: int
) -> None:
    """A signal's C-level handler may run on any thread of the launcher, or just before its main thread blocks in
    its wait: the launcher still forwards it at once (it waits on its socket and a signal wakeup fd together), not
    when the command happens to exit. On CI the plain signal test hung this way (the launcher blocked in recvmsg, its
    SIGTERM handled only after the command's exit)."""
    (tmp_path / "launch.py").write_text(THREADED_LAUNCHER)
    (tmp_path / "waiter.py").write_text(TERM_WAITER)
    ready = tmp_path / "ready"
    start = time.monotonic()
    out = subprocess.run(
        [sys.executable, str(tmp_path / "launch.py"), str(tmp_path / "waiter.py"), str(ready)],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert (out.returncode, out.stdout) == (7, "got SIGTERM\n"), (out.returncode, out.stdout, out.stderr)
    assert time.monotonic() - start < 15, time.monotonic() - start


#: What a command inherited of its signal state: the dispositions of a few signals and the blocked mask.
SIGNAL_STATE = (
    "import json, signal; d = lambda s: {signal.SIG_IGN: 'ign', signal.SIG_DFL: 'dfl'}.get(signal.getsignal(s), 'py');"
    "print(json.dumps([d(s) for s in (signal.SIGHUP, signal.SIGINT, signal.SIGQUIT, signal.SIGTERM, signal.SIGPIPE)]"
    " + [sorted(signal.pthread_sigmask(signal.SIG_BLOCK, []))]))"
)


def test_the_command_inherits_the_launchers_ignored_and_blocked_signals_not_the_warm_processes(
    env: dict[str, str], warm_pid: int
) -> None:
    """``nohup`` (SIGHUP ignored), a shell's background job (SIGINT and SIGQUIT ignored) and a blocked signal reach
    the command as a direct start gives them; and a launcher that ignores nothing gets a command that ignores
    nothing, whatever the warm process itself inherited (here: started from a launcher that ignored SIGTERM)."""

    def ignoring(*signums: int) -> Callable[[], None]:
        def preexec() -> None:
            for signum in signums:
                signal.signal(signum, signal.SIG_IGN)
            signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])

        return preexec

    def state(launcher: list[str], preexec: Callable[[], None] | None, run_env: dict[str, str]) -> tuple[list, str]:
        out = subprocess.run(
            [*launcher, sys.executable, "-c", SIGNAL_STATE],
            env=run_env,
            preexec_fn=preexec,
            capture_output=True,
            text=True,
            timeout=60,
        )
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout), out.stderr

    warm = cli("run", "--preload", "torch", "--")
    nohup = ignoring(signal.SIGHUP, signal.SIGINT, signal.SIGQUIT)
    direct, _ = state([], nohup, env)
    forked, stderr = state(warm, nohup, env)
    assert direct == ["ign", "ign", "ign", "dfl", "ign", [signal.SIGUSR2]], direct
    assert forked == direct and stderr == "", stderr

    plain_direct, _ = state([], None, env)
    assert plain_direct == ["dfl", "py", "dfl", "dfl", "ign", []], plain_direct
    assert state(warm, None, env) == (plain_direct, "")

    # A warm process of its own, spawned by a launcher that ignored SIGTERM and blocked SIGUSR2: its children take
    # the launcher's state, not the one it inherited.
    with tempfile.TemporaryDirectory() as directory:
        os.chmod(directory, 0o700)
        own = {**env, "WEIGHTCACHE_DIR": directory}
        try:
            start = subprocess.run(
                cli("warm", "start", "--preload", "json"),
                env=own,
                preexec_fn=ignoring(signal.SIGTERM),
                capture_output=True,
                text=True,
                timeout=60,
            )
            assert start.returncode == 0, start.stderr
            assert state(cli("run", "--preload", "json", "--"), None, own) == (plain_direct, "")
        finally:
            subprocess.run(cli("warm", "stop", "--all"), env=own, capture_output=True, timeout=30)


def test_the_command_dies_with_its_launcher(env: dict[str, str], warm_pid: int) -> None:
    """A launcher killed outright (SIGKILL: it forwards nothing) takes its command with it, as a supervisor's kill
    of the whole unit would."""
    proc = subprocess.Popen(
        [*cli("run", "--preload", "torch", "--"), sys.executable, "-c", SLEEPER],
        env=env,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    child, parent = map(int, proc.stdout.readline().split())
    assert parent == warm_pid
    proc.kill()
    proc.wait(timeout=10)
    assert wait_until(lambda: process_gone(child), timeout=10)


def test_the_warm_process_outlives_a_burst_of_commands_and_killed_launchers(env: dict[str, str], warm_pid: int) -> None:
    """Twelve commands at once, every other launcher SIGKILLed as its command ends: the warm process keeps serving
    (its events for a connection dropped, or a child reaped, earlier in the same wake-up are stale, not fatal)."""
    launcher = [*cli("run", "--preload", "torch", "--"), sys.executable, "-c", "import time; time.sleep(0.3)"]
    procs = [subprocess.Popen(launcher, env=env, stderr=subprocess.PIPE, text=True) for _ in range(12)]
    time.sleep(0.3)
    for proc in procs[::2]:
        proc.kill()
    for proc in procs:
        proc.wait(60)
    assert all(p.returncode == 0 for p in procs[1::2]), [p.stderr.read() for p in procs[1::2] if p.stderr]
    assert hello(env, ("torch",))["pid"] == warm_pid and hello(env, ("torch",))["children"] == 0


@pytest.mark.skipif(os.getuid() != 0, reason="needs root to act as a second uid")
def test_another_uid_is_refused(env: dict[str, str]) -> None:
    """The socket sits 0600 in a 0700 directory; past both (opened up here on purpose, in a directory of its own
    under /tmp that another uid can reach), the warm process still checks the peer's uid and refuses to fork for
    anyone but its owner, and keeps serving its owner."""
    directory = Path(tempfile.mkdtemp(prefix="wc-warm-uid-", dir="/tmp"))
    own = {**env, "WEIGHTCACHE_DIR": str(directory)}
    try:
        start = subprocess.run(cli("warm", "start", "--preload", "json"), env=own, capture_output=True, timeout=60)
        assert start.returncode == 0, start.stderr
        pid = hello(own, ("json",))["pid"]
        socket = directory / "warm" / f"{identity.slot(sys.executable, ('json',))}.sock"
        for path, mode in ((directory, 0o711), (directory / "warm", 0o711), (socket, 0o666)):
            os.chmod(path, mode)
        probe = textwrap.dedent(
            f"""
            import os, socket
            from weightcache import protocol
            os.setgroups([]); os.setgid(65534); os.setuid(65534)
            conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            conn.connect({str(socket)!r})
            reply, _ = protocol.recv_frame(conn, idle_timeout=10)  # refused at once, before any request
            print(reply["op"], reply["message"])
            """
        )
        out = subprocess.run([sys.executable, "-c", probe], env=own, capture_output=True, text=True, timeout=60)
        for path, mode in ((socket, 0o600), (directory / "warm", 0o700), (directory, 0o700)):
            os.chmod(path, mode)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("error ") and "serves uid 0 only; the peer runs as uid 65534" in out.stdout
        assert hello(own, ("json",))["pid"] == pid  # and it keeps serving its owner
    finally:
        os.chmod(directory, 0o700)
        subprocess.run(cli("warm", "stop", "--all"), env=own, capture_output=True, timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def start_warm(preload: str, env: dict[str, str]) -> None:
    """``weightcache warm start --preload preload`` with ``env``, asserted to succeed."""
    start = subprocess.run(
        cli("warm", "start", "--preload", preload), env=env, capture_output=True, text=True, timeout=60
    )
    assert start.returncode == 0, start.stderr


def run_preloaded(preload: str, code: str, env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    """``python -c code`` through ``weightcache run --preload preload`` with ``env``."""
    return subprocess.run(
        [*cli("run", "--preload", preload, "--"), sys.executable, "-c", code],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_stale_warm_process_is_replaced(tmp_path: Path, env: dict[str, str]) -> None:
    """A warm process whose preloaded package changed on disk (an upgrade) is stopped by the next launcher, which
    starts that command directly with a line saying so; the next warm process imports the new code."""
    package = tmp_path / "wcstale_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("VERSION = 1\n")
    stale_env = {**env, "PYTHONPATH": with_path(tmp_path)}
    code = "import os, wcstale_pkg; print(wcstale_pkg.VERSION, os.getppid())"

    def run() -> subprocess.CompletedProcess[str]:
        return run_preloaded("wcstale_pkg", code, stale_env)

    start_warm("wcstale_pkg", stale_env)
    first = hello(stale_env, ("wcstale_pkg",))["pid"]
    assert run().stdout == f"1 {first}\n"
    (package / "__init__.py").write_text("VERSION = 2  # upgraded\n")
    replaced = run()
    assert replaced.returncode == 0 and replaced.stdout.startswith("2 ")
    assert (
        "imported other versions of its packages" in replaced.stderr
        and "starting the command directly" in replaced.stderr
    )
    assert wait_until(lambda: process_gone(first), timeout=10)
    assert wait_until(lambda: run().stderr == "", timeout=60)
    second = hello(stale_env, ("wcstale_pkg",))["pid"]
    assert second != first and run().stdout == f"2 {second}\n"


def test_a_variable_read_at_import_reaches_the_command_as_a_direct_start_gives_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """vLLM before 0.32 configures its logging from VLLM_LOGGING_LEVEL when it is imported: a command whose
    environment sets another value than the warm process was started with must not get a fork that kept the old
    one (seen failing: it printed the warm process's value). The launcher starts it directly, and a warm process
    of that value replaces the old one."""
    package = tmp_path / "wcimport_pkg"
    package.mkdir()
    (package / "__init__.py").write_text("import os\nLEVEL = os.environ.get('VLLM_LOGGING_LEVEL')\n")
    base = {k: v for k, v in env.items() if k != "VLLM_LOGGING_LEVEL"} | {"PYTHONPATH": with_path(tmp_path)}
    code = "import os, wcimport_pkg; print(wcimport_pkg.LEVEL, os.environ.get('VLLM_LOGGING_LEVEL'))"

    def run(level: str | None) -> subprocess.CompletedProcess[str]:
        return run_preloaded("wcimport_pkg", code, base if level is None else {**base, "VLLM_LOGGING_LEVEL": level})

    start_warm("wcimport_pkg", base)
    assert run(None).stdout == "None None\n"
    debug = run("DEBUG")
    assert debug.returncode == 0 and debug.stdout == "DEBUG DEBUG\n", debug.stdout + debug.stderr
    assert "read at import" in debug.stderr and "starting the command directly" in debug.stderr
    assert wait_until(lambda: run("DEBUG").stderr == "", timeout=60)  # forked again, from a DEBUG warm process
    assert run("DEBUG").stdout == "DEBUG DEBUG\n"


def warm_start_and_run(cwd: Path, env: dict[str, str], preload: str, code: str) -> subprocess.CompletedProcess[str]:
    """``weightcache warm start --preload preload`` in ``cwd`` (asserted to succeed), then ``python -c code`` through
    ``weightcache run`` there: what a launcher started from that directory gets."""
    start = subprocess.run(
        [*cli("warm", "start", "--preload", preload, "--timeout", "30"), "--", sys.executable, "-c", "pass"],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=90,
    )
    assert start.returncode == 0, start.stdout + start.stderr
    return subprocess.run(
        [*cli("run", "--preload", preload, "--"), sys.executable, "-c", code],
        cwd=cwd,
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_a_launcher_whose_weightcache_comes_from_its_working_directory_gets_its_warm_process(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """On the H200 the benchmark ran ``python -m weightcache`` from a checkout while the installed copy was on
    PYTHONPATH: the launcher imported the checkout's weightcache (``-m`` puts the working directory first), the
    warm process it spawned (from ``/``) the installed one, so their keys never matched and ``warm start`` waited
    300 s for nothing. The warm process runs the launcher's own weightcache."""
    checkout = tmp_path / "checkout"
    shutil.copytree(Path(wc.__file__).parent, checkout / "weightcache", ignore=shutil.ignore_patterns("__pycache__"))
    own = {**env, "WEIGHTCACHE_DIR": str(tmp_path / "s")}
    os.mkdir(tmp_path / "s", 0o700)
    try:
        ran = warm_start_and_run(checkout, own, "json", "import os, sys; print(os.getppid())")
        assert ran.returncode == 0 and ran.stderr == "", ran.stderr
        assert int(ran.stdout) == hello(own, ("json",))["pid"]  # forked by the warm process
    finally:
        subprocess.run(cli("warm", "stop", "--all"), cwd=checkout, env=own, timeout=30)


def test_a_relative_pythonpath_reaches_the_warm_process_as_the_launcher_reads_it(
    tmp_path: Path, env: dict[str, str]
) -> None:
    """On the H200, ``PYTHONPATH=. pytest`` from a checkout: the launcher read "." as its working directory, the
    warm process it spawned (from ``/``) as "/", so their sys.path (and keys) never matched: ``warm start`` waited
    300 s and every ``run`` started directly, saying the warm process was stale. A relative entry means what it
    means to the launcher, so the warm process gets it made absolute against the launcher's directory."""
    lib = tmp_path / "lib"
    lib.mkdir()
    (lib / "wc_relative_mod.py").write_text("VALUE = 42\n")
    own = {
        **env,
        "WEIGHTCACHE_DIR": str(tmp_path / "s"),
        "PYTHONPATH": os.pathsep.join(filter(None, ["lib", env.get("PYTHONPATH")])),
    }
    os.mkdir(tmp_path / "s", 0o700)
    try:
        code = "import os, sys, wc_relative_mod; print(os.getppid(), os.environ['PYTHONPATH'].split(os.pathsep)[0])"
        ran = warm_start_and_run(tmp_path, own, "wc_relative_mod", code)
        assert ran.returncode == 0 and ran.stderr == "", ran.stderr
        ppid, first = ran.stdout.split()
        assert int(ppid) == hello(own, ("wc_relative_mod",))["pid"]  # forked by the warm process
        assert first == "lib"  # the command's own environment is the launcher's, as given
    finally:
        subprocess.run(cli("warm", "stop", "--all"), cwd=tmp_path, env=own, timeout=30)


def test_missing_dead_or_switched_off_means_a_direct_start(tmp_path: Path, env: dict[str, str]) -> None:
    """No warm process yet: the command starts directly and one starts for the next time. Killed (its socket left
    behind): the same. WEIGHTCACHE_WARM=0: directly, without a word. A command it cannot start (an interpreter
    option): directly, saying why."""
    own = {**env, "WEIGHTCACHE_DIR": str(tmp_path)}
    os.chmod(tmp_path, 0o700)
    command = [*cli("run", "--preload", "json", "--"), sys.executable, "-c", "import os; print(os.getppid())"]
    inherited, writer = os.pipe()  # an fd the launcher inherits (as from a supervisor): the command gets it,
    try:  # the warm process it starts in the background must not keep it
        first = subprocess.run(command, env=own, capture_output=True, text=True, timeout=60, pass_fds=(inherited,))
    finally:
        os.close(writer)
    assert first.returncode == 0 and int(first.stdout) == os.getpid()  # exec'd in the launcher's place
    assert "no warm process for this command yet; one is starting" in first.stderr
    assert wait_until(
        lambda: subprocess.run(command, env=own, capture_output=True, text=True, timeout=60).stderr == "", timeout=60
    )
    pid = hello(own, ("json",))["pid"]
    pipe = os.readlink(f"/proc/self/fd/{inherited}")
    os.close(inherited)
    assert pipe not in [os.readlink(f"/proc/{pid}/fd/{fd}") for fd in os.listdir(f"/proc/{pid}/fd")]
    os.kill(pid, signal.SIGKILL)
    assert wait_until(lambda: process_gone(pid), timeout=10)
    after = subprocess.run(command, env=own, capture_output=True, text=True, timeout=60)
    assert after.returncode == 0 and int(after.stdout) == os.getpid()
    assert "no warm process for this command yet" in after.stderr
    off = subprocess.run(command, env={**own, "WEIGHTCACHE_WARM": "0"}, capture_output=True, text=True, timeout=60)
    assert off.returncode == 0 and int(off.stdout) == os.getpid() and off.stderr == ""
    option = subprocess.run(
        [*cli("run", "--"), sys.executable, "-X", "dev", "-c", "print('ran')"], env=own, capture_output=True, text=True
    )
    assert (
        option.stdout == "ran\n"
        and "the interpreter option '-X' takes effect only when an interpreter starts" in option.stderr
    )
    (tmp_path / "wc_exit_preload.py").write_text("import os\nos._exit(3)\n")  # a warm process that dies importing
    dying = subprocess.run(
        cli("warm", "start", "--preload", "wc_exit_preload"),
        env={**own, "PYTHONPATH": with_path(tmp_path)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert dying.returncode == 1 and "the warm process exited; the end of" in dying.stderr, dying.stderr
    subprocess.run(cli("warm", "stop", "--all"), env=own, timeout=30)


def test_targets_and_default_preloads(tmp_path: Path) -> None:
    """What a command line resolves to, without running it."""
    (tmp_path / "s.py").write_text("")
    resolve = lambda *argv: target.resolve(argv, env=os.environ, cwd=str(tmp_path), executable=sys.executable)  # noqa: E731
    script = resolve(sys.executable, "-u", "s.py", "a")
    assert (script.kind, script.value, script.argv, script.unbuffered) == ("script", "s.py", ("s.py", "a"), True)
    assert script.path0 == str(tmp_path.resolve())
    assert resolve(sys.executable, "-m", "json.tool", "x").argv == ("json.tool", "x")
    script = console_script()
    console = resolve(str(script), "ls")
    [entry] = importlib.metadata.entry_points(group="console_scripts", name=script.name)
    assert console.kind == "script" and console.entry == entry.value and console.argv == (str(script), "ls")
    assert target.default_preloads(console) == ("torch", entry.value.split(":")[0])
    assert target.default_preloads(resolve(sys.executable, "-m", "json.tool")) == ("torch", "json")
    for argv, why in (
        (["/bin/sh", "-c", "true"], "is not run by this environment's interpreter"),
        ([sys.executable, "-X", "importtime", "s.py"], "option '-X' takes effect only when an interpreter starts"),
        ([sys.executable, "missing.py"], "does not exist"),
        (["no-such-program-wc"], "is not an executable on PATH"),
    ):
        with pytest.raises(target.NotWarmable, match=why):
            resolve(*argv)


def test_the_warm_process_keeps_one_thread_and_frees_its_slot_on_stop(env: dict[str, str], warm_pid: int) -> None:
    found = hello(env, ("torch",))
    assert found["threads"] == 1 and found["imported"]["torch"] > 0
    start = time.monotonic()
    stop = subprocess.run(
        cli("warm", "stop", "--preload", "torch"), env=env, capture_output=True, text=True, timeout=30
    )
    assert stop.returncode == 0 and "stopped the warm process" in stop.stdout
    assert wait_until(lambda: process_gone(warm_pid), timeout=10), time.monotonic() - start


#: Run on a GPU through the warm process: CUDA must be usable in the child, and untouched before it.
CUDA_CHILD = textwrap.dedent(
    """
    import json, sys, torch
    before = torch.cuda.is_initialized()
    x = torch.arange(1024, dtype=torch.float32, device="cuda:0").reshape(32, 32)
    print(json.dumps({"before": before, "after": torch.cuda.is_initialized(), "sum": (x @ x).sum().item()}))
    """
)


@pytest.mark.cuda
def test_on_a_gpu_the_warm_process_has_no_cuda_context_and_its_child_uses_cuda(tmp_path: Path) -> None:
    """A warm process that imported torch and transformers' model classes has created no CUDA context (nor opened
    the driver); its forked child initialises CUDA itself and computes what a direct start computes. A preload that
    creates a context makes the warm process refuse to serve (its log says which), and the command starts
    directly."""
    own = {**os.environ, "WEIGHTCACHE_DIR": str(tmp_path)}
    os.chmod(tmp_path, 0o700)
    preloads = "torch,transformers:AutoModelForCausalLM"
    start = subprocess.run(cli("warm", "start", "--preload", preloads), env=own, capture_output=True, text=True)
    assert start.returncode == 0, start.stderr
    found = hello(own, ("torch", "transformers:AutoModelForCausalLM"))
    assert found["cuda_initialized"] is False and found["driver_files"] == [], found
    command = [sys.executable, "-c", CUDA_CHILD]
    direct = subprocess.run(command, env=own, capture_output=True, text=True, timeout=120)
    warm = subprocess.run(
        [*cli("run", "--preload", preloads, "--"), *command], env=own, capture_output=True, text=True, timeout=120
    )
    assert warm.returncode == direct.returncode == 0 and warm.stderr == "", (direct.stderr, warm.stderr)
    assert (
        json.loads(warm.stdout)
        == json.loads(direct.stdout)
        == {"before": False, "after": True, "sum": json.loads(direct.stdout)["sum"]}
    )
    (tmp_path / "wc_cuda_preload.py").write_text("import torch\ntorch.zeros(1, device='cuda:0')\n")
    bad = {**own, "PYTHONPATH": with_path(tmp_path)}
    refused = subprocess.run(
        cli("warm", "start", "--preload", "wc_cuda_preload", "--timeout", "60"), env=bad, capture_output=True, text=True
    )
    assert refused.returncode == 1 and "importing wc_cuda_preload created a CUDA context" in refused.stderr
    ran = subprocess.run(
        [*cli("run", "--preload", "wc_cuda_preload", "--"), sys.executable, "-c", "print('ran')"],
        env=bad,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ran.stdout == "ran\n" and "starting the command directly" in ran.stderr
    subprocess.run(cli("warm", "stop", "--all"), env=own, capture_output=True, timeout=30)


def test_python_and_python3_of_one_venv_are_one_slot_and_its_base_interpreter_another(tmp_path: Path) -> None:
    """The docs' promise for the slot: ``python``, ``python3`` and ``python3.11`` of one venv (links in one ``bin``
    to one file) name one warm process; the base interpreter they link to, in its own directory, another (it runs
    with other packages). The slot hashed the launcher's path as invoked, so each name had a warm process."""
    base = tmp_path / "base" / "bin"
    venv = tmp_path / "venv" / "bin"
    base.mkdir(parents=True)
    venv.mkdir(parents=True)
    real = base / "python3.11"
    real.write_text("")
    for name in ("python", "python3", "python3.11"):
        (venv / name).symlink_to(real)
    preloads = ["torch"]
    slots = {identity.slot(str(venv / name), preloads) for name in ("python", "python3", "python3.11")}
    assert len(slots) == 1
    assert identity.slot(str(real), preloads) not in slots
    assert identity.slot(str(venv / "python"), ["torch", "vllm"]) not in slots


def test_a_socket_directory_too_long_for_a_warm_socket_is_one_line_and_run_still_starts(tmp_path: Path) -> None:
    """A socket directory short enough for the keeper's socket but not for a warm process's (``warm/<slot>.sock``
    is 10 bytes longer): ``warm start`` says so in one line (it ended in a traceback), and ``run`` starts the
    command directly, saying why."""
    base = Path(tempfile.mkdtemp(prefix="wc-"))
    try:
        long_dir = base / ("d" * (88 - len(str(base)) - 1))
        assert len(str(long_dir)) == 88  # keeper.sock fits in 108 bytes, warm/<16 hex>.sock does not
        env = {**os.environ, "WEIGHTCACHE_DIR": str(long_dir), "WEIGHTCACHE_WARM": "1"}
        start = subprocess.run(cli("warm", "start", "--preload", "json"), env=env, capture_output=True, text=True)
        assert start.returncode == 1 and "Traceback" not in start.stderr, start.stderr
        assert start.stderr.startswith("weightcache warm") and "Unix sockets allow" in start.stderr
        run = subprocess.run(
            cli("run", "--", sys.executable, "-c", "print('ran')"), env=env, capture_output=True, text=True
        )
        assert run.returncode == 0 and run.stdout == "ran\n" and "starting the command directly" in run.stderr
    finally:
        shutil.rmtree(base, ignore_errors=True)


def test_warm_serve_of_a_directory_that_is_none_is_one_line(tmp_path: Path) -> None:
    """``warm serve --dir DIR`` where DIR does not exist or is a file: ``weightcache warm: ...`` in one line, exit 1,
    as for any weightcache error (it ended in a FileNotFoundError traceback), and nothing is created there."""
    a_file = tmp_path / "file"
    a_file.write_text("")
    for where, what in ((tmp_path / "missing", "does not exist"), (a_file, "is not a directory")):
        served = subprocess.run(
            cli("warm", "serve", "--dir", str(where), "--preload", "json"), capture_output=True, text=True, timeout=60
        )
        assert served.returncode == 1 and "Traceback" not in served.stderr, served.stderr
        assert served.stderr.startswith(f"weightcache warm: --dir {where} {what}"), served.stderr
        assert len(served.stderr.strip().splitlines()) == 1
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file"]


def test_the_warm_log_says_why_the_warm_process_stopped(tmp_path: Path) -> None:
    """The guide: its log says what it imported, in how long, and why it stopped: a stop request, an idle
    timeout, a SIGTERM (the log held only its import lines)."""
    directory = Path(tempfile.mkdtemp(prefix="wc-"))
    os.chmod(directory, 0o700)
    env = {**os.environ, "WEIGHTCACHE_DIR": str(directory), "WEIGHTCACHE_WARM": "1"}
    log = directory / "warm" / f"{identity.slot(sys.executable, ('json',))}.log"

    def last_line() -> str:
        lines = log.read_text().splitlines() if log.exists() else []
        return lines[-1] if lines else ""

    try:
        start_warm("json", env)
        pid = hello(env, ("json",))["pid"]
        subprocess.run(cli("warm", "stop", "--all"), env=env, capture_output=True, timeout=30)
        assert wait_until(lambda: "exited: a stop request" in last_line(), 15), log.read_text()
        assert wait_until(lambda: process_gone(pid), 15)

        start = subprocess.run(
            cli("warm", "start", "--preload", "json", "--idle-timeout", "1"), env=env, capture_output=True, timeout=60
        )
        assert start.returncode == 0, start.stderr
        assert wait_until(lambda: "exited: idle for 1 s" in last_line(), 20), log.read_text()

        start_warm("json", env)
        os.kill(hello(env, ("json",))["pid"], signal.SIGTERM)
        assert wait_until(lambda: last_line().endswith("exited: SIGTERM"), 15), log.read_text()
    finally:
        subprocess.run(cli("warm", "stop", "--all"), env=env, capture_output=True, timeout=30)
        shutil.rmtree(directory, ignore_errors=True)


def test_a_preload_that_created_a_cuda_context_and_failed_still_stops_the_warm_process(tmp_path: Path) -> None:
    """The check that no preload created a CUDA context (which no forked child could use) runs after a preload
    that failed too: such a warm process refuses to serve and exits, naming the preload (it served on, refusing
    every command). The context is a stand-in here (this machine has no GPU): a module that makes torch say it
    initialised CUDA, then raises."""
    (tmp_path / "ctx_then_fail.py").write_text(
        "import sys, types\n"
        "sys.modules['torch'] = types.SimpleNamespace(cuda=types.SimpleNamespace(is_initialized=lambda: True))\n"
        "raise RuntimeError('failed after creating a context')\n"
    )
    directory = Path(tempfile.mkdtemp(prefix="wc-"))
    os.chmod(directory, 0o700)
    env = {
        **os.environ,
        "WEIGHTCACHE_DIR": str(directory),
        "WEIGHTCACHE_WARM": "1",
        "PYTHONPATH": with_path(tmp_path),
    }
    try:
        start = subprocess.run(
            cli("warm", "start", "--preload", "ctx_then_fail", "--timeout", "30"),
            env=env,
            capture_output=True,
            text=True,
            timeout=90,
        )
        assert start.returncode == 1 and "created a CUDA context" in start.stderr, start
        assert "ctx_then_fail" in start.stderr
    finally:
        subprocess.run(cli("warm", "stop", "--all"), env=env, capture_output=True, timeout=30)
        shutil.rmtree(directory, ignore_errors=True)

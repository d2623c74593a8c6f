"""The tests' child processes, forked from a zygote that imported torch and hugeembed once.

multiprocessing's forkserver: its server process imports the modules below and never runs a torch op,
so a child forked from it starts in milliseconds instead of ~3 s of interpreter and torch start-up, and
is still a process of its own (its exit status, its signals, its file descriptors).  The CLI tests
(tests/unit/cli/clihelp.py) and the gloo ranks (tests/dist/_harness.py) share the one server; a forked
`train --nproc N` launcher has its N ranks forked from it too (`fork_launched_ranks`).
"""

from __future__ import annotations

import multiprocessing
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_CTX = None


def preload() -> list[str]:
    """What the zygote imports: torch, and the CLI with every command's module (the CLI imports them all to
    build its parser: once here, not once per forked command, ~1.3 s each)."""
    from hugeembed.cli import COMMANDS

    return ["torch", "torch.distributed", "hugeembed.cli", *(f"hugeembed.cli.{m}" for m in COMMANDS.values())]


def child_env(extra: dict[str, str] | None = None) -> dict[str, str]:
    """The caller's environment with this tree's package first on PYTHONPATH."""
    path = os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])
    return {**os.environ, "PYTHONPATH": path, **(extra or {})}


def context():
    global _CTX
    if _CTX is None:
        os.environ["PYTHONPATH"] = child_env()["PYTHONPATH"]  # the zygote imports this tree's package
        _CTX = multiprocessing.get_context("forkserver")
        _CTX.set_forkserver_preload(preload())
    return _CTX


def enter_child(env: dict[str, str], out: str | int, err: str | int | None = None) -> None:
    """In a forked child: the caller's environment now (a variable read when torch or hugeembed is imported
    keeps the zygote's), stdout and stderr into files (one file when `err` is None), or onto descriptors
    passed in (ints: a launcher's own stdout and stderr, as a process it starts inherits them)."""
    import sys

    os.environ.clear()
    os.environ.update(env)
    paths = {1: out, 2: err or out}
    fds = {}
    for path in set(paths.values()):
        fds[path] = path if isinstance(path, int) else os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, path in paths.items():
        if fds[path] != fd:
            os.dup2(fds[path], fd)
    for f in fds.values():
        if f not in (1, 2):
            os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)


def address() -> str:
    """The zygote's socket, for a forked child to ask it for processes of its own (`fork_launched_ranks`)."""
    from multiprocessing import forkserver

    context()
    forkserver._forkserver.ensure_running()
    return forkserver._forkserver._forkserver_address


def run_command(argv: list[str], cwd: str | None, out: str | int, err: str | int, env: dict[str, str],
                zygote: str | None = None) -> None:
    """In a forked child: ``python -m hugeembed ARGV`` with stdout / stderr into `out` / `err` (enter_child)
    and the exit status of the command; `zygote` (its address): ranks the command launches fork from it."""
    import sys
    import traceback

    enter_child(env, out, err)
    code = 1
    try:
        if env.get("OMP_NUM_THREADS"):  # what a fresh interpreter's torch reads at import
            import torch

            torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
        if zygote is not None:
            fork_launched_ranks(zygote)
        if cwd is not None:
            os.chdir(cwd)
        sys.argv = [os.path.join(str(ROOT), "hugeembed", "__main__.py"), *argv]
        from hugeembed.cli import main

        code = main()
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int) and e.code is not None:
            print(e.code, file=sys.stderr)
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        import atexit

        try:  # as an interpreter's exit: atexit handlers and weakref finalizers (tiers remove their files)
            atexit._run_exitfuncs()
        except BaseException:
            traceback.print_exc()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code or 0)


def fork_launched_ranks(zygote: str) -> None:
    """In a child forked from the zygote: hugeembed's local launcher (train --nproc) starts each
    ``python -m hugeembed ARGS`` rank as a sibling forked from the zygote (through `zygote`, its address),
    with the environment the launcher gives it and the launcher's stdout, stderr and working directory,
    as a fresh interpreter would inherit them.  Any other command runs as the launcher asked."""
    import sys
    import types
    from multiprocessing import forkserver

    from hugeembed.training import _launch

    server = forkserver._forkserver
    server._forkserver_address = zygote
    server.ensure_running = lambda: None  # it runs (it forked this process); a new one would cost seconds

    def popen(command, env=None, **kw):
        command = [str(c) for c in command]
        if kw or command[:3] != [sys.executable, "-m", "hugeembed"]:
            return subprocess.Popen(command, env=env, **kw)
        return LaunchedRank(command[3:], env)

    _launch.subprocess = types.SimpleNamespace(Popen=popen, TimeoutExpired=subprocess.TimeoutExpired)


class _Inherited:
    """A descriptor of this process that a forked child receives as the same open file (SCM_RIGHTS)."""

    def __init__(self, fd: int):
        self.fd = fd

    def __reduce__(self):
        from multiprocessing import reduction

        return _received, (reduction.DupFd(self.fd),)


def _received(dup) -> int:
    return dup.detach()


class Child:
    """A forked child with subprocess.Popen's wait / kill / returncode, for code written against Popen."""

    def __init__(self, target, args: tuple):
        self._p = context().Process(target=target, args=args)
        self._p.start()

    @property
    def pid(self) -> int:
        return self._p.pid

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def poll(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self._p.pid}", timeout)
        return self._p.exitcode

    def send_signal(self, signum: int) -> None:
        if self._p.exitcode is None:
            os.kill(self._p.pid, signum)

    def terminate(self) -> None:
        self._p.terminate()

    def kill(self) -> None:
        self._p.kill()


class LaunchedRank(Child):
    """subprocess.Popen([python, -m, hugeembed, *ARGV], env=ENV) as the launcher calls it, forked from the zygote."""

    def __init__(self, argv: list[str], env: dict[str, str] | None):
        super().__init__(run_command, (argv, os.getcwd(), _Inherited(1), _Inherited(2), dict(env or os.environ)))

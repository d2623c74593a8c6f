"""The tests' child processes, forked from a zygote that imported torch and hugeembed once.

multiprocessing's forkserver: its server process imports the modules below and never runs a torch op,
so a child forked from it starts in milliseconds instead of ~3 s of interpreter and torch start-up, and
is still a process of its own (its exit status, its signals, its file descriptors).  The CLI tests
(tests/unit/cli/clihelp.py) and the gloo ranks (tests/dist/_harness.py) share the one server.
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


def enter_child(env: dict[str, str], out: str, err: str | None = None) -> None:
    """In a forked child: the caller's environment now (a variable read when torch or hugeembed is imported
    keeps the zygote's), stdout and stderr into files (one file when `err` is None)."""
    import sys

    os.environ.clear()
    os.environ.update(env)
    paths = {1: out, 2: err or out}
    fds = {}
    for path in set(paths.values()):
        fds[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    for fd, path in paths.items():
        os.dup2(fds[path], fd)
    for f in fds.values():
        os.close(f)
    sys.stdout = open(1, "w", closefd=False)
    sys.stderr = open(2, "w", closefd=False)


class Child:
    """A forked child with subprocess.Popen's wait / kill / returncode, for code written against Popen."""

    def __init__(self, target, args: tuple):
        self._p = context().Process(target=target, args=args)
        self._p.start()

    @property
    def returncode(self) -> int | None:
        return self._p.exitcode

    def wait(self, timeout: float | None = None) -> int:
        self._p.join(timeout)
        if self._p.exitcode is None:
            raise subprocess.TimeoutExpired(f"child {self._p.pid}", timeout)
        return self._p.exitcode

    def kill(self) -> None:
        self._p.kill()

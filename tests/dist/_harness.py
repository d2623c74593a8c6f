"""Runs a function in N fresh processes joined by a gloo process group on localhost.

``run_ranks(2, "tests.dist.workers_parity:main", args)`` starts 2 Python processes, each
initialising torch.distributed (gloo, tcp://127.0.0.1:<free port>) and calling
``main(rank, world_size, **args)``; returns each rank's return value (via torch.save).
Processes of their own forked from the tests' zygote (tests/_zygote.py; ``HUGEEMBED_TEST_RANK_SUBPROCESS=1``:
fresh interpreters), not torch.multiprocessing.spawn: the failure test needs the other ranks to keep
running when one dies.
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from tests._zygote import Child, child_env, enter_child

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_ranks(world_size: int, target: str, args: dict[str, Any], workdir: Path,
                timeout_s: float = 60.0) -> list[Child | subprocess.Popen]:
    port = free_port()
    (workdir / "args.pkl").write_bytes(pickle.dumps(args))
    env = child_env({"OMP_NUM_THREADS": "1", "HUGEEMBED_NUM_THREADS": "1"})
    fresh = os.environ.get("HUGEEMBED_TEST_RANK_SUBPROCESS") == "1"
    procs = []
    for rank in range(world_size):
        argv = [target, str(rank), str(world_size), str(port), str(workdir), str(timeout_s)]
        log = workdir / f"log.{rank}.txt"
        if not fresh:
            procs.append(Child(_rank, (argv, env, str(log))))
            continue
        with open(log, "w") as out:  # the child keeps its own descriptor
            procs.append(subprocess.Popen([sys.executable, "-m", "tests.dist._worker", *argv], cwd=ROOT, env=env,
                                          stdout=out, stderr=subprocess.STDOUT))
    return procs


def _rank(argv: list[str], env: dict[str, str], log: str) -> None:
    """In a forked child: one rank, as ``python -m tests.dist._worker ARGV`` runs it."""
    import traceback

    enter_child(env, log)
    os.chdir(ROOT)
    code = 0
    try:
        from tests.dist._worker import main

        main(argv)
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else 1
    except BaseException:
        traceback.print_exc()
        code = 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def logs(workdir: Path, world_size: int) -> str:
    return "\n".join(f"--- rank {r} ---\n" + (workdir / f"log.{r}.txt").read_text()[-4000:]
                     for r in range(world_size) if (workdir / f"log.{r}.txt").exists())


def wait_all(procs: list[subprocess.Popen], deadline_s: float) -> list[int | None]:
    end = time.monotonic() + deadline_s
    codes: list[int | None] = []
    for p in procs:
        try:
            codes.append(p.wait(timeout=max(0.1, end - time.monotonic())))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            codes.append(None)
    return codes


def run_ranks(world_size: int, target: str, args: dict[str, Any] | None = None, *, deadline_s: float = 240.0,
              timeout_s: float = 60.0, expected_codes: dict[int, int | None] | None = None) -> list[Any]:
    """Runs `target` on `world_size` ranks; returns their results (None for a rank that saved none).

    Every rank must exit 0 unless `expected_codes` says otherwise: ``{1: 3}`` expects rank 1 to
    exit with 3 (it killed itself); ``{1: None}`` lets rank 1 hang: it is killed once the others end.
    """
    expected = {r: 0 for r in range(world_size)} | dict(expected_codes or {})
    with tempfile.TemporaryDirectory(prefix="he-dist-") as d:
        workdir = Path(d)
        procs = start_ranks(world_size, target, {"workdir": str(workdir), **(args or {})}, workdir, timeout_s)
        waited = [r for r in range(world_size) if expected[r] is not None]
        codes: list[int | None] = [None] * world_size
        for r, c in zip(waited, wait_all([procs[r] for r in waited], deadline_s)):
            codes[r] = c
        for r in range(world_size):
            if expected[r] is None:
                procs[r].kill()
                procs[r].wait()
        bad = [r for r in waited if codes[r] != expected[r]]
        if bad:
            raise AssertionError(f"ranks exited with {codes}, expected {expected}\n{logs(workdir, world_size)}")
        return [torch.load(workdir / f"result.{r}.pt", weights_only=False) if (workdir / f"result.{r}.pt").exists()
                else None for r in range(world_size)]

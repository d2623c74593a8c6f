"""run_cli: runs the real ``hugeembed`` command in a process of its own (this tree's package on PYTHONPATH).

A process is forked from the tests' zygote (tests/_zygote.py): the command runs as ``python -m hugeembed``
does (its own process, its exit status, its stdout and stderr) without ~3.5 s of start-up per call; so do
the ranks of a ``train --nproc N`` (the launcher's own code starts them, each forked from the zygote).
``HUGEEMBED_TEST_CLI_SUBPROCESS=1`` (or arguments beyond ``cwd``) runs a fresh interpreter instead.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from pathlib import Path

from tests._zygote import ROOT, Child, address, run_command
from tests._zygote import child_env as _env


def run_cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    argv = [str(a) for a in args]
    if os.environ.get("HUGEEMBED_TEST_CLI_SUBPROCESS") == "1" or set(kw) - {"cwd"}:
        return subprocess.run([sys.executable, "-m", "hugeembed", *argv], capture_output=True, text=True,
                              env=_env(), timeout=timeout, **kw)
    return _forked(argv, kw.get("cwd"), timeout)


def _forked(argv: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
    with tempfile.TemporaryDirectory(prefix="hugeembed-cli-") as d:
        out, err = os.path.join(d, "out"), os.path.join(d, "err")
        p = Child(run_command, (argv, None if cwd is None else str(cwd), out, err, _env(), address()))
        try:
            p.wait(timeout)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()
            raise subprocess.TimeoutExpired(["hugeembed", *argv], timeout) from None
        read = lambda path: Path(path).read_text(errors="replace") if os.path.exists(path) else ""  # noqa: E731
        return subprocess.CompletedProcess(["hugeembed", *argv], p.returncode, read(out), read(err))


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, exactly one line on stderr containing every fragment, no traceback."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hugeembed"), err
    for f in fragments:
        assert f in err, (f, err)
    return err

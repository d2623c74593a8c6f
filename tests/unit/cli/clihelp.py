"""run_cli: runs the real ``hugeembed`` command in a subprocess (this tree's package on PYTHONPATH)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[3]


def run_cli(*args, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    return subprocess.run([sys.executable, "-m", "hugeembed", *map(str, args)], capture_output=True, text=True,
                          env=env, timeout=timeout, **kw)


def assert_one_line_error(proc: subprocess.CompletedProcess, *fragments: str) -> str:
    """Exit status 2, exactly one line on stderr containing every fragment, no traceback."""
    err = proc.stderr
    assert proc.returncode == 2, (proc.returncode, err[-2000:])
    assert "Traceback" not in err and err.count("\n") == 1 and err.startswith("hugeembed"), err
    for f in fragments:
        assert f in err, (f, err)
    return err

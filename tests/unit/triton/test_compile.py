"""Every triton kernel compiles for sm_90 on a machine without a GPU (the interpreter accepts code the GPU
compiler rejects): ``python -m hugeembed._triton.compile_check``, as ``bash bench/gpu_check.sh compile`` runs it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from hugeembed import _triton

pytestmark = [pytest.mark.triton, pytest.mark.skipif(not _triton.available(), reason="triton does not import")]


@pytest.mark.slow  # ~10 s: two dozen cubins
def test_every_kernel_case_compiles_for_sm90_one_ok_line_each():
    cases = [c[0] for m in _triton.kernel_modules() for c in getattr(m, "COMPILE_CASES", [])]
    assert cases, "no kernel declares COMPILE_CASES"
    run = subprocess.run([sys.executable, "-m", "hugeembed._triton.compile_check", "90"],
                         env=dict(os.environ, TRITON_INTERPRET="0"), cwd=Path(__file__).resolve().parents[3],
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout + run.stderr
    lines = run.stdout.splitlines()
    assert len(lines) == len(cases), run.stdout
    # "ok    NAME  sm_90 cubin ...": names may hold spaces ("hash_index.probe (find)")
    names = [line[len("ok"):].rsplit(" sm_", 1)[0].strip() for line in lines if line.startswith("ok ")]
    assert sorted(names) == sorted(cases), run.stdout


def test_no_kernel_parameter_is_shadowed_by_the_launchers_binder():
    # init_rows_kernel's `params` launched under the interpreter and failed every launch on an H200
    from triton.runtime.interpreter import InterpretedFunction
    from triton.runtime.jit import JITFunction

    from hugeembed._triton.compile_check import launcher_clashes

    jitted = (JITFunction, InterpretedFunction)  # (TRITON_INTERPRET=1 gives the latter)
    kernels = [o for m in _triton.kernel_modules() for o in vars(m).values() if isinstance(o, jitted)]
    assert len(kernels) > 10
    assert {k.fn.__name__: launcher_clashes(k) for k in kernels if launcher_clashes(k)} == {}
    def probe(params, x):  # the check itself sees the clash
        pass
    assert launcher_clashes(probe) == ["params"]
    def probe_run(grid, y, warmup):  # run()'s keywords too
        pass
    assert launcher_clashes(probe_run) == ["grid", "warmup"]

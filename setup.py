"""Builds hugeembed's native CPU kernels.

The kernels are plain C++17 with no Python or torch headers: they take raw pointers
and are called through ctypes (which also releases the GIL while they run).  This
keeps the build free of torch, so ``pip install`` never pulls a torch wheel into an
isolated build environment.  Every source file under csrc/ goes into one library,
built twice on x86-64: portable (SSE2), and with AVX2 (``_kernels_avx2``), which
hugeembed/_native.py loads where the CPU has it.  Both compute the same floats:
no FMA contraction, no reassociation, so only the vector width differs.
"""

import platform

from glob import glob

from setuptools import Extension, setup

# No -ffast-math: results must match the reference implementations to the last float.
FLAGS = ["-std=c++20", "-O3", "-pthread", "-fvisibility=hidden", "-fno-math-errno", "-ffp-contract=off"]


def kernels(name: str, flags: list[str]) -> Extension:
    return Extension(name, sources=sorted(glob("csrc/*.cpp")), depends=sorted(glob("csrc/*.h")),
                     include_dirs=["csrc"], language="c++", extra_compile_args=FLAGS + flags,
                     extra_link_args=["-pthread"])


modules = [kernels("hugeembed._kernels", [])]
if platform.machine().lower() in ("x86_64", "amd64"):
    modules.append(kernels("hugeembed._kernels_avx2", ["-mavx2"]))

setup(ext_modules=modules)

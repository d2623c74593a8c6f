"""Builds hugeembed's native CPU kernels.

The kernels are plain C++17 with no Python or torch headers: they take raw pointers
and are called through ctypes (which also releases the GIL while they run).  This
keeps the build free of torch, so ``pip install`` never pulls a torch wheel into an
isolated build environment.  Every source file under csrc/ goes into one library.
"""

from glob import glob

from setuptools import Extension, setup

kernels = Extension(
    "hugeembed._kernels",
    sources=sorted(glob("csrc/*.cpp")),
    depends=sorted(glob("csrc/*.h")),
    include_dirs=["csrc"],
    language="c++",
    # No -ffast-math: results must match the reference implementations to the last float.
    extra_compile_args=["-std=c++20", "-O3", "-pthread", "-fvisibility=hidden", "-fno-math-errno"],
    extra_link_args=["-pthread"],
)

setup(ext_modules=[kernels])

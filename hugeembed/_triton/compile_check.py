"""Compile every kernel for a CUDA architecture without a GPU: ``python -m hugeembed._triton.compile_check [ARCH]``.

The interpreter accepts what the GPU compiler rejects (and runs programs one at a time), so CI
also compiles each kernel's cases to a cubin for sm_90 (default).  One line per kernel; exit 1 when
any fails.
"""

from __future__ import annotations

import inspect
import sys

# Names the launcher's generated binder (triton/runtime/jit.py, create_function_from_signature) uses for
# its own locals and globals, and JITFunction.run's keywords: a kernel parameter so
# named is shadowed, and the launch fails on a GPU only ("failed to specialize argument of type: dict" for
# `params`), never under the interpreter.
LAUNCHER_NAMES = frozenset({"params", "specialization", "options", "specialize_impl", "backend", "JITCallable",
                            "grid", "warmup"})


def launcher_clashes(fn) -> list[str]:
    """The parameters of the jitted `fn` that the launcher's binder would shadow."""
    return sorted(set(inspect.signature(getattr(fn, "fn", fn)).parameters) & LAUNCHER_NAMES)


def compile_all(arch: int = 90) -> int:
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from . import kernel_modules

    failed = 0
    cases = [c for m in kernel_modules() for c in getattr(m, "COMPILE_CASES", [])]
    if not cases:
        print("no kernels to compile")
        return 1
    for name, fn, signature, constexprs, *options in cases:  # (options: the launch's, e.g. num_warps)
        try:
            if clash := launcher_clashes(fn):
                raise ValueError(f"parameters {clash} clash with the launcher's own names: rename them")
            src = ASTSource(fn=fn, signature=signature, constexprs=constexprs)
            k = triton.compile(src, target=GPUTarget("cuda", arch, 32), options=options[0] if options else None)
            print(f"ok    {name:40s} sm_{arch} cubin {len(k.asm['cubin'])} B, {k.metadata.num_warps} warps, "
                  f"shared {k.metadata.shared} B")
        except Exception as e:  # report every kernel, then fail
            failed += 1
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            print(f"FAIL  {name:40s} sm_{arch}: {type(e).__name__}: {first}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(compile_all(int(sys.argv[1]) if len(sys.argv) > 1 else 90))

"""The serving key index probe on the native kernels (csrc/serve.cpp): ``_runtime._find``'s results.

Installed into the runtime as ``find_accelerator`` by ``hugeembed.serving`` (the runtime, copied
into every artifact, imports nothing from hugeembed and keeps its torch probe).
"""

from __future__ import annotations

import torch

from .. import _native

__all__ = ["native_find"]


def native_find(ids: torch.Tensor, table: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
                meta: torch.Tensor) -> torch.Tensor | None:
    """Position in `keys` of each (id, table), -1 where absent or the table is static; None when
    the kernels cannot run here (not CPU, not built, an index of another dtype)."""
    tensors = (ids, table, keys, index, meta)
    if not _native.available() or any(t.device.type != "cpu" for t in tensors) or \
            index.dtype not in (torch.int32, torch.int64) or meta.dim() != 2 or meta.shape[1] != 5 or \
            table.shape != ids.shape:
        return None
    ids, table, keys, meta = (t.to(torch.int64).contiguous() for t in (ids, table, keys, meta))
    index = index.contiguous()
    out = torch.empty_like(ids)
    P, I = _native.PTR, _native.I64
    try:
        fn = _native.fn("he_serve_find", P, P, I, P, I, P, I, I, P, I, P, I)
    except AttributeError:  # kernels built before csrc/serve.cpp
        return None
    rc = fn(_native.ptr(ids), _native.ptr(table), ids.numel(), _native.ptr(keys), keys.numel(), _native.ptr(index),
            index.element_size(), index.numel(), _native.ptr(meta), meta.shape[0], _native.ptr(out), _native.nthreads())
    return out if rc == 0 else None

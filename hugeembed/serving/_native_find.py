"""The serving lookup's id -> row pass on the native kernels (csrc/serve.cpp): the results of
``_runtime._find`` and of pooled_lookup's torch pass.

Installed into the runtime as ``find_accelerator`` / ``bags_accelerator`` / ``pool_accelerator`` by ``hugeembed.serving``
(the runtime, copied into every artifact, imports nothing from hugeembed and keeps its torch path).
"""

from __future__ import annotations

import functools

import torch

from .. import _native
from ._index import is_serving_index, serving_index

__all__ = ["native_find", "native_bags", "native_pool", "native_index"]


def native_index(keys: torch.Tensor, index: torch.Tensor, meta: torch.Tensor) -> torch.Tensor:
    """The lookup index of a dim group as loaded (``_runtime.Tables``): the private, salted index where
    the kernels run (``_index.py``), else the artifact's own."""
    if not _native.available() or any(t.device.type != "cpu" for t in (keys, index, meta)):
        return index
    return serving_index(keys, meta)


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
    try:
        _native.call("he_serve_find", [ids, table, keys, index, meta, out], [meta.shape[0]])
    except ImportError:  # kernels built before csrc/serve.cpp
        return None
    except _native.KernelError as e:  # an index the kernel refuses (BAD_VALUE): the torch rounds decide
        if e.status != _native.Status.BAD_VALUE:
            raise
        return None
    return out


def native_bags(values: torch.Tensor, offsets: torch.Tensor, keys: torch.Tensor, index: torch.Tensor,
                meta: torch.Tensor, feature_pos: list[int], feature_table: list[int], batch_size: int,
                n_rows: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None:
    """(row of each id in batch-major bag order, first id of each bag, kept ids per bag) of one dim
    group (see he_serve_bags; int32 when the rows and ids fit, else int64), or None when the kernels cannot
    run here or refuse the arguments."""
    private = is_serving_index(index)
    got = _bags_buffers(values, offsets, keys, index, meta, feature_pos, feature_table, batch_size, n_rows)
    if got is None:
        return None
    bufs, ints = got
    try:
        n = _native.call("he_serve_index_bags" if private else "he_serve_bags", bufs, ints)
    except ImportError:  # kernels built before he_serve_bags
        return None
    except _native.KernelError as e:  # inconsistent arguments (BAD_VALUE, nothing written): the torch pass decides
        if e.status != _native.Status.BAD_VALUE or private:  # (it cannot read the private index)
            raise
        return None
    starts, idx, kept = bufs[7:10]
    return idx[:n], starts, kept


def native_pool(values: torch.Tensor, offsets: torch.Tensor, rows: torch.Tensor, keys: torch.Tensor,
                index: torch.Tensor, meta: torch.Tensor, feature_pos: list[int], feature_table: list[int],
                batch_size: int, dim: int, dtype: str) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(pooled sums ``[B, F, D]`` float32, kept ids per bag ``[B, F]``) of one int8 / int4 dim group: native_bags
    and torch's quantized embedding_bag op over its rows in one kernel (he_serve_pool, the same floats), or None
    when the kernels cannot run here or refuse the arguments.

    Every int8 / int4 group, static tables too: at full size (bench/serve.py --two-pass, rows on 2 MiB pages) the
    one kernel took less CPU than the two passes for static ids as well, each row fetched as its id is read."""
    if dtype not in ("int8", "int4") or rows.dtype != torch.uint8 or rows.dim() != 2 or \
            rows.device.type != "cpu" or not rows.is_contiguous():
        return None
    private = is_serving_index(index)
    got = _bags_buffers(values, offsets, keys, index, meta, feature_pos, feature_table, batch_size, rows.shape[0])
    if got is None:
        return None
    bufs, ints = got
    B, F = batch_size, len(feature_pos)
    out = torch.empty(B, F, dim, dtype=torch.float32)
    try:
        _native.call("he_serve_pool", [*bufs, rows, out],
                     [*ints, rows.shape[1], dim, 8 if dtype == "int8" else 4, int(private)])
    except ImportError:  # kernels built before he_serve_pool
        return None
    except _native.KernelError as e:  # as native_bags
        if e.status != _native.Status.BAD_VALUE or private:
            raise
        return None
    return out, bufs[9].view(B, F)


def _bags_buffers(values, offsets, keys, index, meta, feature_pos, feature_table, batch_size, n_rows):
    """The buffers and ints of he_serve_bags (its outputs allocated), or None when the kernels cannot run here."""
    tensors = (values, offsets, keys, index, meta)
    if not _native.available() or any(t.device.type != "cpu" for t in tensors) or \
            index.dtype not in (torch.int32, torch.int64) or meta.dim() != 2 or meta.shape[1] != 5:
        return None
    values, offsets, keys, meta = (t if t.dtype == torch.int64 and t.is_contiguous() else t.to(torch.int64).contiguous()
                                   for t in (values, offsets, keys, meta))
    index = index.contiguous()
    B, F = batch_size, len(feature_pos)
    pos, table, distinct = _feature_tensors(tuple(feature_pos), tuple(feature_table))
    if distinct:  # each input bag read once: at most every id
        capacity = values.numel()
    else:
        first = pos * B
        if first.numel() and (int(first.max()) + B >= offsets.numel() or int(first.min()) < 0):
            return None
        capacity = int((offsets[first + B] - offsets[first]).clamp(min=0).sum())
    # int32 where rows and ids fit: half the bytes written here and read by the kernel after
    out_type = torch.int32 if max(capacity, n_rows) < (1 << 31) else torch.int64
    starts = torch.empty(B * F, dtype=out_type)
    kept = torch.empty(B * F, dtype=out_type)
    idx = torch.empty(capacity, dtype=out_type)
    return [values, offsets, pos, table, keys, index, meta, starts, idx, kept], [B, meta.shape[0], n_rows]


@functools.lru_cache(maxsize=256)
def _feature_tensors(feature_pos: tuple[int, ...], feature_table: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(feature_pos, feature_table as int64 tensors, whether no input feature repeats) of a group: the same lists at
    every call of a program's lookup node, made once (~13 us a call).  The kernels only read them."""
    return (torch.tensor(feature_pos, dtype=torch.int64), torch.tensor(feature_table, dtype=torch.int64),
            len(set(feature_pos)) == len(feature_pos))

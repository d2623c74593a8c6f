"""Text cells -> hashed ids in one native pass over an Arrow string array's own buffers (csrc/encode.cpp).

The ids are :func:`~hugeembed.data._hash.hash_text`'s (the tests hold both to it); an empty or null cell is
the given missing id.  No copy of the text: the kernels read each cell's bytes where they lie, and hash each
distinct value once per call (a small table of the values met, off for a column whose values rarely repeat).
A column may come in chunks (pyarrow's blocks): the kernels
take the chunks as they are.  Used by the Encoder where the native kernels are built; its
NumPy path (dictionary encoding + ``hash_utf8``) gives the same ids without them.
"""

from __future__ import annotations

import numpy as np

from .. import _native
from ._block import Bag

__all__ = ["native_cells", "hash_cells", "hash_columns", "split_hash", "string_buffers"]

_ALL_VALID = np.zeros(0, np.uint8)  # an empty valid buffer: no cell is null


def native_cells() -> bool:
    """True when the native kernels are built (and not disabled)."""
    return _native.available()


def string_buffers(arr) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """(offsets int32 / int64 [n + 1], data uint8, valid uint8 [n] or None) of a string / large_string
    array, the offsets and data viewing Arrow's memory (they index the data from its start)."""
    import pyarrow as pa

    n = len(arr)
    wide = pa.types.is_large_string(arr.type)
    width = 8 if wide else 4
    bufs = arr.buffers()
    offsets = np.frombuffer(bufs[1], np.int64 if wide else np.int32, n + 1, arr.offset * width) if n else \
        np.zeros(1, np.int32)
    data = np.frombuffer(bufs[2], np.uint8) if len(bufs) > 2 and bufs[2] is not None else np.zeros(0, np.uint8)
    valid = None
    if arr.null_count:
        valid = np.asarray(arr.is_valid().to_numpy(zero_copy_only=False), np.uint8)
    return offsets, data, valid


def _parts(arr) -> list:
    """The arrays of an Array or ChunkedArray (a column read in blocks comes in chunks: they are handed to
    the kernel as they are, not joined into a copy first)."""
    return list(arr.chunks) if hasattr(arr, "chunks") else [arr]


def _part_buffers(parts) -> tuple[list, list]:
    """(buffers, cell counts) of string arrays, three buffers each (offsets, data, valid) as the kernels take them."""
    bufs, counts = [], []
    for part in parts:
        offsets, data, valid = string_buffers(part)
        bufs += [offsets, data, _ALL_VALID if valid is None else valid]
        counts.append(len(part))
    return bufs, counts


def hash_columns(columns: list[tuple[object, int, int]], out: np.ndarray) -> None:
    """Hashes string columns into columns of `out` (a C-contiguous int64 [n, k] matrix), all in one pass over
    its rows: ``(arr, missing_id, j)`` puts each cell's hash of `arr` (an Array or ChunkedArray of n strings)
    into ``out[:, j]``, `missing_id` where the cell is empty or null."""
    n = out.shape[0] if out.ndim == 2 else -1
    if out.dtype != np.int64 or out.ndim != 2 or not out.flags.c_contiguous or \
            any(len(arr) != n or not 0 <= j < out.shape[1] for arr, _, j in columns):
        raise ValueError(f"hash_columns: out must be a C-contiguous int64 [n, k] matrix, each column n cells into a "
                         f"slot < k; got {out.dtype} {out.shape} and columns of {[len(a) for a, _, _ in columns]} "
                         f"cells into {[j for _, _, j in columns]}")
    bufs, heads, counts = [], [], []
    for arr, missing, j in columns:
        parts = _parts(arr)
        part_bufs, part_counts = _part_buffers(parts)
        bufs += part_bufs
        counts += part_counts
        heads += [int(j), int(missing), len(parts)]
    _native.call("he_hash_columns", [out] + bufs, [n, out.shape[1], len(columns)] + heads + counts)


def hash_cells(arr, missing_id: int, out: np.ndarray | None = None, column: int = 0) -> np.ndarray:
    """int64 [n]: each cell's hash, `missing_id` where the cell is empty or null (`arr`: a string Array or
    ChunkedArray).  With `out` (a C-contiguous int64 [n, k] matrix) the ids go into its column `column`, and
    that column is returned."""
    n = len(arr)
    if out is None:
        out = np.empty((n, 1), np.int64)
    if out.dtype != np.int64 or out.ndim != 2 or out.shape[0] != n or not out.flags.c_contiguous or \
            not 0 <= column < out.shape[1]:
        raise ValueError(f"hash_cells: out must be a C-contiguous int64 [{n}, k] matrix with column {column}, got "
                         f"{out.dtype} {out.shape}")
    hash_columns([(arr, missing_id, column)], out)
    return out[:, column]


def split_hash(arr, separator: str, max_length: int | None, missing_id: int) -> Bag:
    """Each cell (of a string Array or ChunkedArray) split at `separator` into the hashes of its non-empty
    pieces, the last `max_length` kept; an empty or null cell is one `missing_id`."""
    parts = _parts(arr)
    bufs, counts = _part_buffers(parts)
    n = sum(counts)
    span = sum(int(o[-1] - o[0]) for o in bufs[::3])
    ids = np.empty(span + n, np.int64)  # each id comes from a byte of its cell, or is a cell's one missing id
    bag_offsets = np.empty(n + 1, np.int64)
    sep = np.frombuffer(separator.encode("utf-8"), np.uint8)
    written = _native.call("he_split_hash", [sep, bag_offsets, ids] + bufs,
                           [int(max_length or 0), int(missing_id)] + counts)
    ids.resize(written, refcheck=False)  # shrunk in place (realloc): no view of it outlives the call above
    return Bag(ids, bag_offsets)

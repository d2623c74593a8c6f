"""Durable file primitives: checksummed array files, fsync, atomic renames."""

from __future__ import annotations

import hashlib
import io
import itertools
import math
import os
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._durable import atomic_write_text, fsync_dir, fsync_write, sha256_file
from ..errors import CheckpointError

__all__ = ["write_bytes", "write_tensor", "write_rows", "read_tensor", "sha256_file", "fsync_dir", "atomic_write_text"]

_CHUNK_BYTES = 32 << 20  # rows streamed to a snapshot file at a time

# numpy has no bfloat16: such tensors are stored as the bits of an int16 array.
_BITCAST = {torch.bfloat16: torch.int16}
_TORCH_DTYPES = {str(d).removeprefix("torch."): d for d in (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16, torch.int8,
    torch.uint8, torch.bool)}


def write_bytes(path: Path, data: bytes) -> dict[str, Any]:
    """Writes and fsyncs `data`; returns its file record (size, sha256)."""
    fsync_write(path, data)
    return {"file": path.name, "bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}


def write_tensor(path: Path, t: torch.Tensor) -> dict[str, Any]:
    """Writes `t` as .npy (memory-mappable), fsynced; returns its record."""
    return write_rows(path, t)


def write_rows(path: Path, source: torch.Tensor, index: torch.Tensor | None = None,
               chunk_bytes: int = _CHUNK_BYTES) -> dict[str, Any]:
    """Writes ``source`` (or ``source[index]`` when `index` is given) as .npy, streamed.

    Chunk by chunk: the header, then at most `chunk_bytes` of rows at a time, hashed as they
    go, so a table of any size is saved without a second copy of it in memory.  Fsynced;
    returns the file record (bytes, sha256, dtype, shape).
    """
    dtype = source.dtype
    if source.dim() == 0:
        n, shape = 1, ()
    else:
        n = source.shape[0] if index is None else index.numel()
        shape = (n, *source.shape[1:])
    # from the shape: `source` may be a row source that only selects rows (a tiered table's TierRows)
    row_bytes = max(1, math.prod(source.shape[1:]) * source.element_size() if source.dim() else 1)
    step = max(1, chunk_bytes // row_bytes)
    np_dtype = torch.empty(0, dtype=_BITCAST.get(dtype, dtype)).numpy().dtype
    h = hashlib.sha256()
    size = 0
    with open(path, "wb") as f:
        head = io.BytesIO()
        np.lib.format.write_array_header_1_0(
            head, {"descr": np.lib.format.dtype_to_descr(np_dtype), "fortran_order": False, "shape": shape})
        for b in itertools.chain((head.getvalue(),), _chunks(source, index, n, step)):  # lazily: one chunk held
            h.update(b)
            f.write(b)
            size += len(b)
        f.flush()
        os.fsync(f.fileno())
    return {"file": path.name, "bytes": size, "sha256": h.hexdigest(), "dtype": str(dtype).removeprefix("torch."),
            "shape": list(shape)}


def _chunks(source: torch.Tensor, index: torch.Tensor | None, n: int, step: int):
    """The bytes of the rows to write, `step` rows at a time (C order, on the CPU)."""
    if source.dim() == 0:
        yield _as_bytes(source)
        return
    for start in range(0, n, step):
        end = min(n, start + step)
        part = source[start:end] if index is None else source.index_select(0, index[start:end])
        yield _as_bytes(part)


def _as_bytes(t: torch.Tensor) -> memoryview:
    t = t.detach().to("cpu").contiguous()
    if t.dtype in _BITCAST:
        t = t.view(_BITCAST[t.dtype])
    return memoryview(t.numpy()).cast("B")


def verify(path: Path, rec: dict[str, Any]) -> None:
    """Raises CheckpointError if the file is missing, truncated or altered."""
    if not path.exists():
        raise CheckpointError(f"snapshot file {path} is missing")
    size = path.stat().st_size
    if size != rec["bytes"]:
        raise CheckpointError(f"snapshot file {path} has {size} bytes, the manifest says {rec['bytes']}: truncated?")
    if sha256_file(path) != rec["sha256"]:
        raise CheckpointError(f"snapshot file {path} is corrupted: its sha256 differs from the manifest")


def read_tensor(path: Path, rec: dict[str, Any], check: bool = True) -> torch.Tensor:
    """Reads a tensor written by write_tensor, verifying its checksum first.

    Non-empty arrays are memory-mapped copy-on-write: loading a table reads its pages as
    they are imported instead of holding a second copy of it in memory.
    """
    if check:
        verify(path, rec)
    shape = rec.get("shape", [])
    mappable = len(shape) > 0 and all(int(d) > 0 for d in shape)  # numpy maps neither scalars nor empties
    try:
        arr = np.load(path, allow_pickle=False, mmap_mode="c" if mappable else None)
    except (ValueError, OSError, EOFError) as e:  # EOFError: an empty file
        raise CheckpointError(f"snapshot file {path} is unreadable: {e}") from None
    t = torch.from_numpy(arr if arr.flags.c_contiguous else np.ascontiguousarray(arr))  # keeps 0-d as 0-d
    dtype = _TORCH_DTYPES.get(rec.get("dtype", ""))
    if dtype is None:
        raise CheckpointError(f"snapshot file {path}: unknown dtype {rec.get('dtype')!r} in the manifest")
    if dtype in _BITCAST:
        t = t.view(dtype)
    if list(t.shape) != list(rec["shape"]) or t.dtype != dtype:
        raise CheckpointError(f"snapshot file {path}: holds {t.dtype} {list(t.shape)}, manifest says "
                              f"{dtype} {rec['shape']}")
    return t


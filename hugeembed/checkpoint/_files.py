"""Durable file primitives: checksummed array files, fsync, atomic renames."""

from __future__ import annotations

import hashlib
import io
from pathlib import Path
from typing import Any

import numpy as np
import torch

from .._durable import atomic_write_text, fsync_dir, fsync_write, sha256_file
from ..errors import CheckpointError

__all__ = ["write_bytes", "write_tensor", "read_tensor", "sha256_file", "fsync_dir", "atomic_write_text"]

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
    """Writes a CPU copy of `t` as .npy (memory-mappable), fsynced; returns its record."""
    t = t.detach().to("cpu").contiguous()
    dtype = t.dtype
    if dtype in _BITCAST:
        t = t.view(_BITCAST[dtype])
    buf = io.BytesIO()
    np.save(buf, t.numpy(), allow_pickle=False)
    rec = write_bytes(path, buf.getvalue())
    rec.update(dtype=str(dtype).removeprefix("torch."), shape=list(t.shape))
    return rec


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
    """Reads a tensor written by write_tensor, verifying its checksum first."""
    if check:
        verify(path, rec)
    try:
        arr = np.load(path, allow_pickle=False)
    except (ValueError, OSError) as e:
        raise CheckpointError(f"snapshot file {path} is unreadable: {e}") from None
    t = torch.from_numpy(np.ascontiguousarray(arr))
    dtype = _TORCH_DTYPES.get(rec.get("dtype", ""))
    if dtype is None:
        raise CheckpointError(f"snapshot file {path}: unknown dtype {rec.get('dtype')!r} in the manifest")
    if dtype in _BITCAST:
        t = t.view(dtype)
    if list(t.shape) != list(rec["shape"]) or t.dtype != dtype:
        raise CheckpointError(f"snapshot file {path}: holds {t.dtype} {list(t.shape)}, manifest says "
                              f"{dtype} {rec['shape']}")
    return t


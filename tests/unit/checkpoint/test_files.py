"""Snapshot array files: streamed .npy writing against numpy's own writer, memory-mapped reads."""

from __future__ import annotations

import hashlib
import io

import numpy as np
import pytest
import torch
from hypothesis import given, strategies as st

from hugeembed.checkpoint._files import read_tensor, write_rows, write_tensor


def npy_bytes(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


@given(n=st.integers(0, 40), width=st.integers(1, 6), chunk=st.sampled_from([1, 7, 100, 1 << 20]),
       gather=st.booleans(), dtype=st.sampled_from([torch.float32, torch.float64, torch.int64, torch.float16]))
def test_streamed_file_is_byte_identical_to_numpy_save(tmp_path_factory, n, width, chunk, gather, dtype):
    g = torch.Generator().manual_seed(n * 7 + width)
    src = (torch.randn(max(n, 1) * 2, width, generator=g) * 100).to(dtype)
    index = torch.randperm(src.shape[0], generator=g)[:n] if gather else None
    want = (src[index] if gather else src).numpy()
    path = tmp_path_factory.mktemp("f") / "a.npy"
    rec = write_rows(path, src, index, chunk_bytes=chunk)
    data = path.read_bytes()
    assert data == npy_bytes(want)  # numpy's writer is the oracle: header, padding, C order
    assert rec["bytes"] == len(data) and rec["sha256"] == hashlib.sha256(data).hexdigest()
    assert rec["shape"] == list(want.shape)
    back = read_tensor(path, rec)
    assert back.dtype == dtype and torch.equal(back, torch.from_numpy(want))


@pytest.mark.parametrize("t", [torch.tensor(3.5), torch.zeros(0, 4), torch.arange(5, dtype=torch.int64),
                               torch.randn(6, 3).to(torch.bfloat16), torch.tensor([True, False])],
                         ids=["scalar", "empty", "int64", "bfloat16", "bool"])
def test_round_trip_of_every_shape_and_dtype(tmp_path, t):
    rec = write_tensor(tmp_path / "t.npy", t)
    back = read_tensor(tmp_path / "t.npy", rec)
    assert back.dtype == t.dtype and back.shape == t.shape and torch.equal(back, t)


def test_mapped_read_is_private_the_file_never_changes(tmp_path):
    path = tmp_path / "rows.npy"
    rec = write_tensor(path, torch.ones(1000, 8))
    t = read_tensor(path, rec)
    t.mul_(3.0)  # copy-on-write pages: the snapshot on disk stays as saved
    assert torch.equal(read_tensor(path, rec), torch.ones(1000, 8))

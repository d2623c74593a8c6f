"""bench/serve.py's TorchRec reference holds our rows (not timed): the quantized rows it copies into a
QuantEmbeddingBagCollection dequantize to ours, so the lookup comparison reads the same values."""

from __future__ import annotations

import pytest
import torch

from hugeembed.serving import pooled_lookup

from ._load import load_bench

pytest.importorskip("torchrec")


@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_the_qebc_rows_dequantize_to_ours(dtype):
    from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

    bench = load_bench("serve")
    rows, dim, B = [5, 9, 3], 8, 6
    T = len(rows)
    stored = bench._random_rows(sum(rows) + 1, dim, dtype)
    g = torch.Generator().manual_seed(1)
    ids = [torch.randint(0, n, (B,), generator=g) for n in rows]  # one id a bag
    offsets = torch.arange(T * B + 1)
    kjt = KeyedJaggedTensor.from_offsets_sync([f"f{t}" for t in range(T)], torch.cat(ids), offsets)
    got = bench.qebc_holding(rows, dim, stored, dtype)(kjt).values().view(B, T, dim)
    # the oracle: our rows dequantized by hand (FBGEMM holds a float16 scale and bias: int8's float32 ones
    # rounded to float16, int4's already are), read by hand (table t's rows after the tables before it)
    exact, rounded = _dequantized(stored, dtype, dim, False), _dequantized(stored, dtype, dim, True)
    first = [sum(rows[:t]) for t in range(T)]
    want = torch.stack([rounded[first[t] + ids[t]] for t in range(T)], 1)
    torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-6)
    # and the serving op on the same ids (static tables: the id is the row) reads our rows unrounded
    static = {"table_keys": [-1] * T, "table_rows": list(rows), "table_shared": [0] * T}
    from hugeembed.serving._index import group_tables

    _, _, index, meta = group_tables(static, rows, stored, torch.zeros(0, dtype=torch.int64))
    served = pooled_lookup(torch.cat(ids), offsets, stored, torch.zeros(0, dtype=torch.int64), index, meta,
                           list(range(T)), list(range(T)), [0] * T, B, dim, dtype)
    torch.testing.assert_close(served, torch.stack([exact[first[t] + ids[t]] for t in range(T)], 1), atol=1e-6,
                               rtol=1e-6)
    torch.testing.assert_close(served, got, atol=2e-4 if dtype == "int8" else 1e-6, rtol=0)  # float16 rounding


def _dequantized(stored: torch.Tensor, dtype: str, dim: int, half_scale: bool) -> torch.Tensor:
    """Rows from the stored bytes: int8 [D values, float32 scale, bias], int4 [D/2 bytes, two values each (the
    low nibble first), float16 scale, bias]; value * scale + bias."""
    if dtype == "int8":
        q = stored[:, :dim].to(torch.float32)
        sb = stored[:, dim:dim + 8].view(torch.float32)
    else:
        b = stored[:, :dim // 2].to(torch.int32)
        q = torch.stack([b & 15, b >> 4], -1).reshape(-1, dim).to(torch.float32)
        sb = stored[:, dim // 2:dim // 2 + 4].view(torch.float16).to(torch.float32)
    if half_scale:
        sb = sb.to(torch.float16).to(torch.float32)
    return q * sb[:, :1] + sb[:, 1:2]

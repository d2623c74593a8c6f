"""The int8 / int4 lookup in one kernel (he_serve_pool, csrc/serve_pool.h): the floats of the runtime's torch
path (torch's quantized embedding_bag ops) bit for bit, and of an exact fma oracle over the stored bytes."""

from __future__ import annotations

import os
import subprocess
import sys
from fractions import Fraction

import numpy as np
import pytest
import torch

from hugeembed.serving import _index, _lookup_ops, _runtime, pooled_lookup, quantize
from hugeembed.serving._native_find import native_pool

native = pytest.mark.skipif(not _lookup_ops.pool_accelerator, reason="native kernels not built")


def _case(dtype: str, D: int, B: int, seed: int):
    """A group of a dynamic table (with a shared row), a static table and a dynamic table; 3 features reading
    input features 2, 0, 1; bags of 0-5 ids: held keys, unknown ids, dropped (< 0) ids, static ids past the table."""
    g = torch.Generator().manual_seed(seed)
    k0 = [-1] + sorted(set((torch.randint(0, 1 << 40, (40,), generator=g)).tolist()))
    k1 = sorted(set(torch.randint(0, 60, (25,), generator=g).tolist()))
    sizes = [len(k0), 17, len(k1)]
    weights = torch.randn(sum(sizes), D, generator=g) * torch.rand(sum(sizes), 1, generator=g)
    rows = quantize(torch.cat([weights, torch.zeros(1, D)]), dtype)
    group = {"table_keys": [0, -1, 1], "table_rows": [0, 17, 0], "table_shared": [1, 0, 0]}
    args = _index.group_tables(group, sizes, rows, torch.tensor(k0 + k1, dtype=torch.int64))
    pool = [k0[1:], list(range(20)), k1]
    unknown = [5, 7, (1 << 41) + 3, -1, -9]
    lengths = torch.randint(0, 6, (3 * B,), generator=g)
    values = []
    for f, n in enumerate(lengths.tolist()):  # input feature f // B reads table (1, 2, 0)[f // B]
        table = (1, 2, 0)[f // B]
        for _ in range(n):
            src = pool[table] if torch.rand(1, generator=g) < 0.8 else unknown
            values.append(src[int(torch.randint(0, len(src), (1,), generator=g))])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    return torch.tensor(values, dtype=torch.int64), offsets, args


def _torch_path(monkeypatch, *args):
    with monkeypatch.context() as mp:
        for hook in ("bags_accelerator", "find_accelerator", "pool_accelerator"):
            mp.setattr(_lookup_ops, hook, None)
        return pooled_lookup(*args)


@native
@pytest.mark.parametrize("dtype,D", [("int8", 1), ("int8", 7), ("int8", 64), ("int8", 70), ("int4", 2),
                                     ("int4", 14), ("int4", 64), ("int4", 66)])
@pytest.mark.parametrize("index", ["private", "artifact"])
def test_the_pool_kernel_gives_the_torch_paths_floats(dtype, D, index, monkeypatch):
    B = 130  # three blocks of samples (64 each), the last one short
    values, offsets, (rows, keys, slots, meta) = _case(dtype, D, B, seed=D)
    lookup = _runtime.Tables([rows], [keys], [slots], [meta]).lookup_index[0] if index == "private" else slots
    assert _index.is_serving_index(lookup) == (index == "private")
    tail = ([2, 0, 1], [0, 1, 2], [0, 1, 2], B, D, dtype)
    got = pooled_lookup(values, offsets, rows, keys, lookup, meta, *tail)
    want = _torch_path(monkeypatch, values, offsets, rows, keys, slots, meta, *tail)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))  # bit for bit, signs of zeros too
    pooled, kept = native_pool(values, offsets, rows, keys, lookup, meta, [2, 0, 1], [0, 1, 2], B, D, dtype)
    per_bag = [[i for i in offsets_bag if i >= 0] for offsets_bag in
               (values[offsets[j]:offsets[j + 1]].tolist() for j in range(3 * B))]
    assert kept.tolist() == [[len(per_bag[p * B + b]) for p in (2, 0, 1)] for b in range(B)]
    assert torch.equal(pooled[:, 0].view(torch.int32), want[:, 0].view(torch.int32))  # feature 0 sums


def _fma32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """a * b + c rounded once to float32 (ties to even), exactly."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    near = np.float32(float(exact))  # within an ulp: its neighbours are the other candidates
    cands = [np.nextafter(near, np.float32(-np.inf)), near, np.nextafter(near, np.float32(np.inf))]
    return min(cands, key=lambda x: (abs(Fraction(float(x)) - exact), int(np.float32(x).view(np.uint32)) & 1))


@native
@pytest.mark.parametrize("dtype,D", [("int8", 5), ("int4", 6), ("int8", 16), ("int4", 18)])
def test_the_pool_kernel_sums_fma_of_the_stored_bytes(dtype, D):
    """An oracle that reads the bytes: value q, scale s, bias b per row; out = fma(s, q, out + b) per id."""
    g = torch.Generator().manual_seed(D)
    rows = quantize(torch.cat([torch.randn(9, D, generator=g), torch.zeros(1, D)]), dtype)
    meta = _runtime.table_meta([-1], [9], [0], [9], torch.zeros(0, dtype=torch.int64), [0])
    values = torch.tensor([3, 0, 8, 8, -1, 2, 4, 1, 5, 6, 7])
    offsets = torch.tensor([0, 3, 3, 5, 11])  # an empty bag, a dropped id
    slots = torch.full((2,), -1, dtype=torch.int32)
    pooled, _ = native_pool(values, offsets, rows, torch.zeros(0, dtype=torch.int64), slots, meta, [0], [0], 4, D,
                            dtype)
    # a group of static tables takes the one kernel too
    hooked, _ = _lookup_ops.pool_accelerator(values, offsets, rows, torch.zeros(0, dtype=torch.int64), slots, meta,
                                             [0], [0], 4, D, dtype)
    assert torch.equal(hooked.view(torch.int32), pooled.view(torch.int32))
    raw = rows.numpy()

    def row(r):
        if dtype == "int8":
            q, sb = raw[r, :D].astype(np.float32), raw[r, D:D + 8].view(np.float32)
        else:
            packed = raw[r, :D // 2]
            q = np.stack([packed & 15, packed >> 4], 1).reshape(-1).astype(np.float32)
            sb = raw[r, D // 2:D // 2 + 4].view(np.float16).astype(np.float32)
        return q, sb[0], sb[1]

    for j in range(4):
        acc = [np.float32(0)] * D
        for i in values[offsets[j]:offsets[j + 1]].tolist():
            q, s, b = row(i if i >= 0 else 9)  # a dropped id reads the zero row
            acc = [_fma32(s, q[k], np.float32(acc[k] + b)) for k in range(D)]
        assert np.array_equal(np.array(acc, dtype=np.float32).view(np.uint32), pooled[j, 0].numpy().view(np.uint32))


@native
@pytest.mark.parametrize("dtype,D", [("int8", 1), ("int8", 9), ("int8", 64), ("int8", 72), ("int4", 2),
                                     ("int4", 30), ("int4", 34), ("int4", 64), ("int4", 98)])
def test_a_group_of_static_tables_pools_the_torch_paths_floats(dtype, D, monkeypatch):
    """Static tables only (the id is the row; past the table: the zero row): the one kernel, bit for bit the
    torch path's floats, with empty bags, dropped ids and ids past a table, mean and sqrtn too; int4 widths
    that are not a multiple of 32 values, int8 dims not a multiple of 8."""
    g = torch.Generator().manual_seed(D + (1000 if dtype == "int4" else 0))
    sizes, B = [11, 5, 23], 70
    rows = quantize(torch.cat([torch.randn(sum(sizes), D, generator=g) * 3, torch.zeros(1, D)]), dtype)
    meta = _runtime.table_meta([-1] * 3, sizes, [0] * 3, sizes, torch.zeros(0, dtype=torch.int64), [0] * 3)
    lengths = torch.randint(0, 4, (3 * B,), generator=g)  # a quarter of the bags empty
    lengths[:5] = 0
    values = torch.randint(-3, 26, (int(lengths.sum()),), generator=g)  # dropped ids, ids past tables 0 and 1
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), lengths.cumsum(0)])
    slots = torch.full((2,), -1, dtype=torch.int32)
    nokeys = torch.zeros(0, dtype=torch.int64)
    args = (values, offsets, rows, nokeys, slots, meta, [1, 2, 0], [0, 2, 1], [0, 1, 2], B, D, dtype)
    got = pooled_lookup(*args)
    want = _torch_path(monkeypatch, *args)
    assert torch.equal(got.view(torch.int32), want.view(torch.int32))
    pooled, kept = native_pool(*args[:8], B, D, dtype)
    assert kept.tolist() == [[sum(1 for i in values[offsets[p * B + b]:offsets[p * B + b + 1]].tolist() if i >= 0)
                              for p in (1, 2, 0)] for b in range(B)]
    assert torch.equal(pooled[:, 0].view(torch.int32), want[:, 0].view(torch.int32))  # feature 0 sums


@native
@pytest.mark.parametrize("dtype", ["int8", "int4"])
def test_a_large_output_streamed_past_the_cache_holds_the_same_floats(dtype, monkeypatch):
    """d64 outputs from 4 MiB on are written with non-temporal stores (serve_pool.h kStreamBytes): 8200 x 2 bags
    (4.2 MB), static and dynamic tables, bit for bit the torch path's floats."""
    g = torch.Generator().manual_seed(7)
    B, D, sizes = 8200, 64, [300, 200]
    keys = torch.arange(200, dtype=torch.int64) * 5 + 1
    rows = quantize(torch.cat([torch.randn(sum(sizes), D, generator=g), torch.zeros(1, D)]), dtype)
    group = {"table_keys": [-1, 0], "table_rows": [300, 0], "table_shared": [0, 0]}
    rows, keys, slots, meta = _index.group_tables(group, sizes, rows, keys)
    lookup = _runtime.Tables([rows], [keys], [slots], [meta]).lookup_index[0]
    values = torch.cat([torch.randint(-1, 310, (B,), generator=g), torch.randint(0, 200, (B,), generator=g) * 5 + 1])
    offsets = torch.arange(2 * B + 1, dtype=torch.int64)
    tail = ([0, 1], [0, 1], [0, 0], B, D, dtype)
    got = pooled_lookup(values, offsets, rows, keys, lookup, meta, *tail)
    want = _torch_path(monkeypatch, values, offsets, rows, keys, slots, meta, *tail)
    assert got.numel() * 4 >= 4 << 20 and torch.equal(got.view(torch.int32), want.view(torch.int32))


@native
def test_the_pool_kernel_refuses_rows_that_cannot_hold_the_values(monkeypatch):
    """Rows not of torch's layout of D values (another width, an odd int4 D): BAD_VALUE (kServeBadRows), nothing
    written; native_pool gives None (the artifact's index) and pooled_lookup the torch path's floats."""
    from hugeembed import _native

    values, offsets, (rows, keys, slots, meta) = _case("int8", 8, 3, seed=1)
    bufs = [values, offsets, torch.tensor([0]), torch.tensor([0]), keys, slots, meta.contiguous(),
            *(torch.full((n,), -7, dtype=torch.int64) for n in (3, values.numel(), 3)), rows,
            torch.full((3 * 8,), -7.0)]
    for width, D, bits in ((rows.shape[1], 9, 8), (rows.shape[1], 7, 4), (rows.shape[1], 8, 5)):
        with pytest.raises(_native.KernelError) as e:
            _native.call("he_serve_pool", bufs, [3, 3, rows.shape[0], width, D, bits, 0])
        assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:4] == (2, width, D, bits)
        assert all(t.eq(-7).all() for t in bufs[7:10] + bufs[11:])
    for width in (12, 20):
        other = torch.cat([rows, rows], 1)[:, :width].contiguous()
        assert native_pool(values, offsets, other, keys, slots, meta, [0], [0], 3, 8, "int8") is None
    # 20 bytes: the torch op reads 12 values and a scale and bias, of which the lookup keeps 8 values
    args = (values, offsets, other, keys, slots, meta, [0, 1, 2], [0, 1, 2], [1, 0, 2], 3, 8, "int8")
    assert torch.equal(pooled_lookup(*args), _torch_path(monkeypatch, *args))


@native
@pytest.mark.slow
def test_the_portable_build_pools_the_same_floats():
    """The SSE2 build (scalar fma) and the AVX2 one (vector fma; d64: sums in registers, int4 32 values a load,
    and at 5500 x 3 bags the output streamed past the cache) give the same bits."""
    script = ("import sys, torch; sys.path.insert(0, %r); from test_lookup_pool import _case; "
              "from hugeembed.serving._native_find import native_pool\n"
              "for dtype, D, B in (('int8', 70, 70), ('int4', 66, 70), ('int8', 64, 5500), ('int4', 64, 5500)):\n"
              "    v, o, (r, k, s, m) = _case(dtype, D, B, seed=3)\n"
              "    out, _ = native_pool(v, o, r, k, s, m, [2, 0, 1], [0, 1, 2], B, D, dtype)\n"
              "    sys.stdout.buffer.write(out.numpy().tobytes())\n") % os.path.dirname(__file__)
    runs = [subprocess.run([sys.executable, "-c", script], capture_output=True, check=True,
                           env={**os.environ, "HUGEEMBED_KERNELS": build}).stdout for build in ("portable", "avx2")]
    assert len(runs[0]) == 4 * 3 * (70 * (70 + 66) + 5500 * 128) and runs[0] == runs[1]

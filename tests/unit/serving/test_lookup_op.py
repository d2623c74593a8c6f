"""The serving lookup op against a plain Python oracle, and row-wise quantization error bounds."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hugeembed.serving import _index, _lookup_ops, _runtime, dequantize, pooled_lookup, quantize
from hugeembed.serving._index import is_serving_index as serving_index_of


I64_MAX = (1 << 63) - 1
I64_MIN = -(1 << 63)


def colliding_keys(n: int, table: int = 0) -> list[int]:
    """`n` keys whose home slot (table `table`, the index of 2n keys) is one and the same."""
    cap = _index.index_capacity(2 * n)
    cand = torch.arange(1 << 16, dtype=torch.int64) * 1_000_003 + 17
    home = _lookup_ops.hash_slots(cand, torch.full_like(cand, table), cap)
    return cand[home == home[0]][:n].tolist()


key_values = st.one_of(st.integers(0, 1 << 40), st.integers(I64_MAX - 8, I64_MAX), st.sampled_from(colliding_keys(12)))


@st.composite
def cases(draw):
    """Group tables: 0 dynamic (maybe with a shared row), 1 static, 2 dynamic (maybe empty, maybe
    holding keys of table 0); 4 group features read tables 0, 1, 0, 2 from input features at
    `pos` (a permutation of 5 input features, so the group's features are not consecutive)."""
    D = 4
    keys = sorted(draw(st.sets(key_values, min_size=0, max_size=12)))
    shared = draw(st.booleans())  # unknown ids read the shared row, when the table holds one (key -1)
    if draw(st.booleans()):
        keys = [-1, *keys]
    keys2 = sorted(draw(st.sets(st.one_of(key_values, st.sampled_from(keys or [3])), max_size=6)))
    static_rows = draw(st.integers(1, 5))
    B = draw(st.integers(1, 4))
    combiners = draw(st.lists(st.sampled_from([0, 1, 2]), min_size=4, max_size=4))
    pos = draw(st.permutations(range(5)))[:4] if draw(st.booleans()) else [0, 1, 2, 3]
    pool = keys + keys2 + [static_rows + 3, (1 << 41) + 7, -1, 0, 1, I64_MAX, I64_MIN, I64_MIN + 1, -7]
    bags = [[draw(st.lists(st.sampled_from(pool), max_size=4)) for _ in range(B)] for _ in range(5)]
    rng = np.random.default_rng(draw(st.integers(0, 1 << 30)))
    dyn = torch.from_numpy(rng.normal(size=(len(keys), D)).astype(np.float32))
    stat = torch.from_numpy(rng.normal(size=(static_rows, D)).astype(np.float32))
    dyn2 = torch.from_numpy(rng.normal(size=(len(keys2), D)).astype(np.float32))
    return D, (keys, keys2), (dyn, stat, dyn2), B, combiners, bags, shared, pos


def oracle(D, keys, weights, B, combiners, bags, shared, pos, read):
    """Bags pooled one by one: group feature f reads input feature pos[f] and table (0, 1, 0, 2)[f];
    an unknown id of table 0 reads its shared row (key -1) when `shared` and it has one."""
    dyn, stat, dyn2 = (read(w) if w.shape[0] else w for w in weights)
    out = torch.zeros(B, 4, D)
    for f, table in enumerate((0, 1, 0, 2)):
        for b in range(B):
            kept = [i for i in bags[pos[f]][b] if i >= 0]
            acc = torch.zeros(D)
            for i in kept:
                if table == 1:
                    acc += stat[i] if i < stat.shape[0] else 0
                elif table == 2:
                    acc += dyn2[keys[1].index(i)] if i in keys[1] else 0
                elif i in keys[0]:
                    acc += dyn[keys[0].index(i)]
                elif shared and -1 in keys[0]:
                    acc += dyn[keys[0].index(-1)]
            n = max(len(kept), 1)
            out[b, f] = acc / {0: 1.0, 1: n, 2: n ** 0.5}[combiners[f]] if kept else acc
    return out


@pytest.fixture(params=["private index", "kernels", "torch"])
def id_pass(request, monkeypatch):
    """pooled_lookup over the private, salted index loaded tables read (serving/_index.py), with the
    kernels over the artifact's slot index (csrc/serve.cpp), and with the torch path an artifact's own
    runtime copy runs."""
    if request.param == "torch":
        monkeypatch.setattr(_lookup_ops, "bags_accelerator", None)
        monkeypatch.setattr(_lookup_ops, "find_accelerator", None)
        monkeypatch.setattr(_lookup_ops, "pool_accelerator", None)
    else:
        assert _lookup_ops.bags_accelerator is not None and _lookup_ops.find_accelerator is not None
        assert _lookup_ops.pool_accelerator is not None
    return request.param


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cases(), st.sampled_from(["fp32", "fp16", "int8", "int4"]))
@pytest.mark.slow
def test_pooled_lookup_matches_the_oracle(id_pass, case, dtype):
    D, keys, weights, B, combiners, bags, shared, pos = case
    values = torch.tensor([i for f in bags for bag in f for i in bag], dtype=torch.int64)
    lengths = torch.tensor([len(bag) for f in bags for bag in f])
    offsets = torch.cat([torch.zeros(1, dtype=torch.int64), torch.cumsum(lengths, 0)])
    # the group's matrix: dynamic table, static table, dynamic table, zero row; keys of tables 0 and 2
    rows = quantize(torch.cat([*weights, torch.zeros(1, D)]), dtype)
    group = {"table_keys": [0, -1, 1], "table_rows": [0, weights[1].shape[0], 0], "table_shared": [int(shared), 0, 0]}
    args = _index.group_tables(group, [w.shape[0] for w in weights], rows,
                                 torch.tensor(keys[0] + keys[1], dtype=torch.int64))
    if id_pass == "private index":
        args = [a[0] for a in _runtime.Tables(*([a] for a in args)).args()]
        assert serving_index_of(args[2])
    got = pooled_lookup(values, offsets, *args, pos, [0, 1, 0, 2], combiners, B, D, dtype)

    def read(w):  # what the stored rows hold, as float32
        return dequantize(quantize(w, dtype), dtype, D)

    tol = 1e-5 if dtype == "fp32" else 1e-2
    torch.testing.assert_close(got, oracle(D, keys, weights, B, combiners, bags, shared, pos, read), atol=tol, rtol=tol)


def splitmix64(key: int, table: int, cap: int) -> int:
    """The index's hash in plain Python integers (mod 2^64), as the format defines it."""
    m = (1 << 64) - 1
    z = (key + (table + 1) * 0x9E3779B97F4A7C15) & m
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & m
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & m
    return (z ^ (z >> 31)) & (cap - 1)


@given(st.lists(st.integers(I64_MIN, I64_MAX), min_size=1, max_size=20), st.integers(0, 30))
def test_the_hash_is_splitmix64_of_key_and_table(keys, table):
    cap = 1 << 20
    got = _lookup_ops.hash_slots(torch.tensor(keys, dtype=torch.int64), torch.full((len(keys),), table), cap).tolist()
    assert got == [splitmix64(k, table, cap) for k in keys]


def test_index_build_is_deterministic_and_finds_every_key_when_all_collide():
    keys = torch.tensor(sorted(colliding_keys(40)), dtype=torch.int64)
    table_of = torch.zeros(40, dtype=torch.int64)
    a, probes = _index.build_index(keys, table_of, 1)
    b, _ = _index.build_index(keys.clone(), table_of, 1)
    assert torch.equal(a, b) and a.dtype == torch.int32 and a.numel() == 128
    assert probes == [40]  # one home slot: the keys lie one after the other
    meta = _runtime.table_meta([0], [0], [0], [40], keys, probes)
    for find in FINDS:
        found = find(keys, table_of, keys, a, meta)
        assert torch.equal(found, torch.arange(40))
        absent = torch.tensor([I64_MAX, 5, 0], dtype=torch.int64)
        assert find(absent, torch.zeros(3, dtype=torch.int64), keys, a, meta).tolist() == [-1] * 3


def _torch_find(ids, table, keys, index, meta):
    return _lookup_ops._find_torch(ids, table, keys, index, meta.index_select(0, table))


FINDS = [_lookup_ops._find, _torch_find]  # the native probe (where built) and the torch rounds


@settings(max_examples=40)
@given(st.lists(st.lists(st.integers(-50, 50) | st.integers(I64_MIN, I64_MAX), max_size=30, unique=True),
                min_size=1, max_size=4), st.lists(st.integers(-60, 60) | st.integers(I64_MIN, I64_MAX), max_size=60),
       st.booleans(), st.data())
def test_the_native_probe_finds_what_the_torch_rounds_find(tables, queries, with_static, data):
    """Several dynamic tables (one key may be in several), a static one, ids present and absent,
    int32 slots: he_serve_find (csrc/serve.cpp) against _find_torch, position for position."""
    keys = torch.tensor([k for t in tables for k in sorted(t)], dtype=torch.int64)
    table_of = torch.tensor([i for i, t in enumerate(tables) for _ in t], dtype=torch.int64)
    index, probes = _index.build_index(keys, table_of, len(tables))
    sizes = [len(t) for t in tables]
    meta = _runtime.table_meta([0] * len(tables), [0] * len(tables), [0] * len(tables), sizes, keys, probes)
    if with_static:  # a static table's ids are rows, never probed
        meta = torch.cat([meta, torch.tensor([[sum(sizes), 10, -1, sum(sizes) + 10, 0]])])
    T = meta.shape[0]
    ids = torch.tensor(queries + keys.tolist(), dtype=torch.int64)
    table = torch.tensor(data.draw(st.lists(st.integers(0, T - 1), min_size=ids.numel(), max_size=ids.numel())),
                         dtype=torch.int64)
    want = _torch_find(ids, table, keys, index, meta)
    got = _lookup_ops._find(ids, table, keys, index, meta)
    dynamic = meta[table, _runtime.KEY_BASE] >= 0  # (the torch rounds' result for a static id is unused)
    assert torch.equal(got[dynamic], want[dynamic])
    assert bool((got[~dynamic] == -1).all())
    own = torch.arange(len(queries), ids.numel())  # every key found in its own table
    assert torch.equal(_lookup_ops._find(ids[own], table_of, keys, index, meta), torch.arange(keys.numel()))


@given(st.integers(1, 40), st.integers(1, 8).map(lambda h: 2 * h), st.integers(0, 1 << 30),
       st.floats(1e-3, 1e3))
@pytest.mark.slow
def test_row_wise_quantization_error_is_half_a_step(n, dim, seed, spread):
    """int8: |x - q(x)| <= (max - min) / 255 / 2 per row; int4: / 15 / 2 (+ float16 scale rounding)."""
    w = torch.from_numpy(np.random.default_rng(seed).normal(scale=spread, size=(n, dim)).astype(np.float32))
    span = (w.max(1).values - w.min(1).values)[:, None]
    err8 = (dequantize(quantize(w, "int8"), "int8", dim) - w).abs()
    assert bool((err8 <= span / 255 / 2 * 1.001 + 1e-6 * w.abs().max()).all())
    err4 = (dequantize(quantize(w, "int4"), "int4", dim) - w).abs()
    assert bool((err4 <= span / 15 / 2 * 1.01 + 2e-3 * (w.abs().max(1).values[:, None] + span)).all())
    assert quantize(w, "int8").shape == (n, dim + 8) and quantize(w, "int4").shape == (n, dim // 2 + 4)


def test_the_runtime_names_the_shared_row_key_as_the_tables_do():
    from hugeembed.nn._rare import SHARED_ROW_KEY
    from hugeembed.serving import _runtime
    assert _runtime.SHARED_ROW_KEY == SHARED_ROW_KEY


# -- the kernels' calling convention (csrc/call.h) -----------------------------------------------

native = pytest.mark.skipif(not _lookup_ops.bags_accelerator, reason="native kernels not built")


def _group():
    """One dynamic table of 3 keys (rows 0..2, the zero row 3): keys, index, meta."""
    keys = torch.tensor([10, 20, 30], dtype=torch.int64)
    index, probes = _index.build_index(keys, torch.zeros(3, dtype=torch.int64), 1)
    meta = _runtime.table_meta([0], [0], [0], [3], keys, probes)
    return keys, index, meta


@native
def test_the_serve_kernels_refuse_a_too_short_buffer_and_write_nothing():
    from hugeembed import _native

    keys, index, meta = _group()
    ids = torch.tensor([20, 5, 30])
    out = torch.full((2,), -7, dtype=torch.int64)
    with pytest.raises(_native.KernelError, match=r"\(out\) holds 2 elements, needs 3") as e:
        _native.call("he_serve_find", [ids, torch.zeros(3, dtype=torch.int64), keys, index, meta, out], [1])
    assert e.value.status == _native.Status.BAD_CALL and out.eq(-7).all()
    offsets = torch.tensor([0, 2, 3])
    starts, idx, kept = (torch.full((n,), -7, dtype=torch.int64) for n in (2, 3, 1))  # kept: 2 bags, room for 1
    one = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(_native.KernelError, match=r"\(kept\) holds 1 elements, needs 2") as e:
        _native.call("he_serve_bags", [ids, offsets, one, one, keys, index, meta, starts, idx, kept], [2, 1, 4])
    assert e.value.status == _native.Status.BAD_CALL
    assert all(t.eq(-7).all() for t in (starts, idx, kept))


@native
def test_the_bags_kernel_refuses_a_feature_position_whose_bags_wrap():
    """feature_pos * B wrapping to -1 read offsets[-1]: a position past offsets / B is BAD_VALUE
    (kServeBadFeature), nothing written, and native_bags leaves it to the torch pass."""
    from hugeembed import _native

    keys, index, meta = _group()
    B = 3
    fp = (2**64 - 1) // 3  # fp * 3 == -1 mod 2^64
    values, offsets = torch.tensor([20]), torch.tensor([0, 0, 1, 1])
    starts, idx, kept = (torch.full((n,), -7, dtype=torch.int64) for n in (B, 8, B))
    with pytest.raises(_native.KernelError) as e:
        _native.call("he_serve_bags", [values, offsets, torch.tensor([fp]), torch.zeros(1, dtype=torch.int64), keys,
                                       index, meta, starts, idx, kept], [B, 1, 4])
    assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:4] == (4, 0, 0, fp)
    assert all(t.eq(-7).all() for t in (starts, idx, kept))


@native
def test_arguments_the_bags_kernel_refuses_take_the_torch_path(monkeypatch):
    """BAD_VALUE (nothing written): native_bags / native_find give None and pooled_lookup the torch
    pass's result, as when the kernels returned their error code."""
    from hugeembed import _native
    from hugeembed.serving._native_find import native_bags, native_find

    keys, index, meta = _group()
    values, offsets = torch.tensor([20, 5, 30]), torch.tensor([0, 2, 3])
    assert native_bags(values, offsets, keys, index, meta, [0], [0], 2, 4) is not None
    bad_offsets = torch.tensor([0, 2, 9])  # past the values
    with pytest.raises(_native.KernelError) as e:
        _native.call("he_serve_bags", [values, bad_offsets, torch.zeros(1, dtype=torch.int64),
                                       torch.zeros(1, dtype=torch.int64), keys, index, meta,
                                       torch.empty(2, dtype=torch.int64), torch.empty(9, dtype=torch.int64),
                                       torch.empty(2, dtype=torch.int64)], [2, 1, 4])
    assert e.value.status == _native.Status.BAD_VALUE and e.value.detail[:5] == (5, 1, 1, 2, 9)
    assert native_bags(values, bad_offsets, keys, index, meta, [0], [0], 2, 4) is None
    assert native_bags(values, offsets, keys, index, meta, [0], [1], 2, 4) is None  # table 1 of 1
    bad_meta = meta.clone()
    bad_meta[0, 0] = 2  # rows 2..4 of 4
    assert native_bags(values, offsets, keys, index, bad_meta, [0], [0], 2, 4) is None
    odd = torch.cat([index, index[:1]])  # not a power of two
    assert native_bags(values, offsets, keys, odd, meta, [0], [0], 2, 4) is None
    assert native_find(values, torch.zeros(3, dtype=torch.int64), keys, odd, meta) is None
    rows = torch.arange(16, dtype=torch.float32).view(4, 4)
    args = (values, bad_offsets[:2].contiguous(), rows, keys, index, meta, [0], [0], [0], 1, 4, "fp32")
    assert native_bags(values, bad_offsets[:2].contiguous(), keys, index, meta, [0], [0], 1, 4) is not None
    got = pooled_lookup(*args)
    monkeypatch.setattr(_lookup_ops, "bags_accelerator", None)
    monkeypatch.setattr(_lookup_ops, "find_accelerator", None)
    assert torch.equal(got, pooled_lookup(*args))
    # an index of no power of two is refused by the torch pass too (it is no artifact index)
    with pytest.raises(_runtime.ArtifactError, match="power of two"):
        pooled_lookup(values, offsets, rows, keys, odd, meta, [0], [0], [0], 2, 4, "fp32")

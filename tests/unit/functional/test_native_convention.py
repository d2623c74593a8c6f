"""The lookup kernels (csrc/lookup_call.cpp) in the one calling convention (csrc/call.h): each
checks the buffers it is handed against the sizes it derives (B, F, T, D, the counts the
earlier stages produced) and refuses a short one with BAD_CALL before writing anything; a
bad id in the batch is BAD_VALUE, which the Python side turns into the same InputError."""

from __future__ import annotations

import pytest
import torch

from hugeembed import InputError, _native as nat
from hugeembed.functional import FeatureSpec, FusedEmbeddingLookup, TableSpec
from hugeembed.functional import _native_stages as ns

from .test_fused import make_batch

pytestmark = pytest.mark.skipif(not nat.available(), reason="native kernels not built")

B, D = 3, 4


def _setup(combiner="sum", max_norm=None):
    specs = [TableSpec("a", D, num_rows=6, max_norm=max_norm), TableSpec("b", D, num_rows=5)]
    feats = [FeatureSpec("f", "a", combiner=combiner), FeatureSpec("g", "b", combiner=combiner)]
    lookup = FusedEmbeddingLookup(specs, feats, backend="native")
    tables = [torch.randn(6, D), torch.randn(5, D)]
    sf = make_batch({"f": [[1, 2], [5], []], "g": [[0], [4, 4, 1], [2]]})
    prep = lookup.prepare(sf, tables)
    return lookup, tables, sf, prep


def _pool_args(lookup, tables, prep, out, slots):
    plan = lookup.plan
    pb, group = ns._buffers(plan), plan.groups[0]
    feats, cols, *_ = pb.groups[group]
    bufs = [pb.i64, pb.i8, pb.max_norm, feats, cols, prep.offsets, prep.inverse, prep.weights, slots, out,
            torch.arange(len(tables)), *tables]  # (each table its own storage)
    ints = (B, plan.num_features, plan.num_tables, D, prep.capacity, len(group.pooled) * D, len(tables),
            *[t.stride(0) for t in tables])
    return bufs, ints


def test_the_call_as_the_stages_make_it_pools_what_pool_native_does():
    lookup, tables, _, prep = _setup()
    slots = lookup.static_slots(prep)
    out = torch.full((B, 2, D), 7.0)
    assert nat.call("he_lookup_pool", *_pool_args(lookup, tables, prep, out, slots)) == 0
    assert torch.equal(out, ns.pool_native(lookup.plan, prep, tables, slots, lookup.plan.groups[0]))


@pytest.mark.parametrize("short, says", [
    ("out", "buffer 9 \\(out\\) holds 16 elements, needs 24"),
    ("slots", "buffer 8 \\(slots\\) holds"),
    ("inverse", "buffer 6 \\(inverse\\) holds"),
])
def test_pool_refuses_a_short_buffer_and_writes_nothing(short, says):
    lookup, tables, _, prep = _setup()
    slots = lookup.static_slots(prep)
    out = torch.full((B, 2, D), 7.0)
    if short == "out":  # one sample's row short
        out = out.view(-1)[: (B - 1) * 2 * D].clone()
    elif short == "slots":  # shorter than the capacity
        slots = slots[:-1].clone()
    else:
        prep.inverse = prep.inverse[:-1].clone()
    before = out.clone()
    with pytest.raises(nat.KernelError, match=says) as info:
        nat.call("he_lookup_pool", *_pool_args(lookup, tables, prep, out, slots))
    assert info.value.status == nat.Status.BAD_CALL and info.value.kernel == "he_lookup_pool"
    assert torch.equal(out, before)
    # through the stage function too: the kernel's refusal, never a read past the buffer
    if short == "slots":
        with pytest.raises(nat.KernelError, match=says):
            ns.pool_native(lookup.plan, prep, tables, slots, lookup.plan.groups[0])


def test_unpooled_refuses_slots_shorter_than_the_capacity():
    lookup, tables, _, prep = _setup(combiner="none")
    slots = lookup.static_slots(prep)
    with pytest.raises(nat.KernelError, match="slots") as info:
        ns.unpooled_native(lookup.plan, prep, tables, slots[:-1].clone(), lookup.plan.groups[0])
    assert info.value.status == nat.Status.BAD_CALL


def test_backward_refuses_a_gradient_one_row_short():
    lookup, tables, _, prep = _setup(max_norm=1.0)
    slots = lookup.static_slots(prep)
    grad = torch.randn(B, 2, D)
    blocks, row0 = ns.backward_native(lookup.plan, prep, tables, slots, [grad], [None])
    assert row0 == [0, prep.unique_count[0]]
    assert tuple(blocks[D].shape) == (prep.unique_count[0] + prep.unique_count[1], D)
    with pytest.raises(nat.KernelError, match="output gradient") as info:
        ns.backward_native(lookup.plan, prep, tables, slots, [grad[:-1]], [None])
    assert info.value.status == nat.Status.BAD_CALL


def test_count_refuses_short_outputs_and_one_pass_a_table_shorter_than_its_rows():
    lookup, tables, sf, _ = _setup()
    plan, pb = lookup.plan, ns._buffers(lookup.plan)
    values, offsets, weights = ns.batch_arrays(sf)
    src = plan.source_indices(sf.keys())
    out_offsets = torch.zeros(2 * B)  # needs F*B + 1 = 7 int64
    for wrong, says in ((out_offsets, "has element type 4, expected 3"),
                        (out_offsets.long(), "buffer 6 \\(out_offsets\\) holds 6 elements, needs 7")):
        with pytest.raises(nat.KernelError, match=says) as info:
            nat.call("he_lookup_count", [pb.i64, pb.i8, values, offsets, weights, src, wrong,
                                         torch.empty(2, dtype=torch.int64), torch.empty(2, dtype=torch.int64)],
                     (B, plan.num_features, plan.num_tables))
        assert info.value.status == nat.Status.BAD_CALL
    # the one-pass forward checks ids against num_rows, so each table must hold that many rows
    out = torch.zeros(B, 2, D)
    with pytest.raises(nat.KernelError, match="buffer 11 \\(table rows\\) holds 20 elements, needs 24"):
        nat.call("he_lookup_pool_direct",
                 [pb.i64, pb.i8, pb.max_norm, *pb.groups[plan.groups[0]][:2], values, offsets, weights, src, out,
                  torch.tensor([0, 1]), tables[0][:5], tables[1]], (B, 2, 2, D, 2 * D, 2, D, D))
    assert not out.any()


def test_a_bad_id_is_bad_value_with_its_detail_and_the_same_input_error():
    lookup, tables, _, _ = _setup()
    bad = make_batch({"f": [[1], [0, 7], []], "g": [[0], [1], [2]]})
    plan, pb = lookup.plan, ns._buffers(lookup.plan)
    values, offsets, weights = ns.batch_arrays(bad)
    with pytest.raises(nat.KernelError, match="plan feature 0: out-of-range value of id 7 at position 2") as info:
        nat.call("he_lookup_count", [pb.i64, pb.i8, values, offsets, weights, plan.source_indices(bad.keys()),
                                     torch.empty(2 * B + 1, dtype=torch.int64), torch.empty(2, dtype=torch.int64),
                                     torch.empty(2, dtype=torch.int64)], (B, 2, 2))
    assert info.value.status == nat.Status.BAD_VALUE
    assert info.value.detail[:4] == (1, 0, 2, 7)  # out of range, plan feature 0, position 2, id 7
    says = "feature 'f': id 7 at sample 1 is out of range for table 'a' of 6 rows"
    with pytest.raises(InputError, match=says) as caught:
        lookup.prepare(bad, tables)
    assert caught.value.__cause__ is None and caught.value.__context__ is None  # as before: no kernel error behind it
    with pytest.raises(InputError, match=says):
        lookup(tables, bad)  # the one-pass forward hands it to the two-stage path, which reports it
    assert ns.pool_direct(plan, bad, tables, plan.groups[0]) is None  # POOL_DIRECT_TWO_STAGE: a result, not an error


def test_the_lookup_context_is_an_integer_handle():
    scratch = ns.NativeScratch()
    assert isinstance(scratch.handle, int) and scratch.handle != 0
    scratch._finalizer()  # frees it (he_lookup_ctx_free), once
    assert not scratch._finalizer.alive


# ---- Crafted calls that would read or write past a buffer: refused (BAD_CALL), nothing written.
# A plan of one feature, as _plan_bufs packs it: i64 = table[F] default_id[F] table_feats[F]
# num_rows[T] dims[T] table_feat_ptr[T+1]; i8 = prune_neg[F] oor[F] has_default[F] combiner[F].

def _plan(num_rows=-1, default_id=0, has_default=0, table=(0,), table_feats=(0,), ptr=(0, 1), dims=(D,)):
    F, T = len(table), len(ptr) - 1
    i64 = torch.tensor([*table, *[default_id] * F, *table_feats, *[num_rows] * T, *dims, *ptr])
    i8 = torch.tensor([0] * F + [0] * F + [has_default] * F + [0] * F, dtype=torch.int8)
    return i64, i8


def _refused(match, name, bufs, ints):
    with pytest.raises(nat.KernelError, match=match) as info:
        nat.call(name, bufs, ints)
    assert info.value.status == nat.Status.BAD_CALL


def _count_bufs(i64, i8, values, offsets, F=1, T=1, Bn=1):
    guards = [torch.full((F * Bn + 1,), -7, dtype=torch.int64), torch.full((T,), -7, dtype=torch.int64),
              torch.full((2,), -7, dtype=torch.int64)]
    return [i64, i8, values, offsets, None, torch.zeros(F, dtype=torch.int64), *guards], guards


def test_a_num_rows_past_the_bound_is_refused_before_its_row_product_wraps():
    i64, i8 = _plan(num_rows=2**62)  # (n-1)*W + D wrapped to 0: a 1-row table passed for any id
    out = torch.full((1, 1, D), 7.0)
    _refused("table 0 has 4611686018427387904 rows", "he_lookup_pool_direct",
             [i64, i8, torch.zeros(1), torch.tensor([0]), torch.tensor([0]), torch.tensor([10]), torch.tensor([0, 1]),
              None, torch.tensor([0]), out, torch.tensor([0]), torch.zeros(1, D)], (1, 1, 1, D, D, 1, D))
    assert out.eq(7).all()


@pytest.mark.parametrize("default_id", [-1, 9, 2**40])
def test_a_default_id_outside_a_static_table_is_refused(default_id):
    i64, i8 = _plan(num_rows=9, default_id=default_id, has_default=1)  # the direct dedup indexes by it
    bufs, guards = _count_bufs(i64, i8, torch.empty(0, dtype=torch.int64), torch.tensor([0, 0]))
    _refused(f"default_id {default_id} outside the 9 rows", "he_lookup_count", bufs, (1, 1, 1))
    assert all(g.eq(-7).all() for g in guards)


def test_a_feature_listed_under_a_table_it_does_not_read_is_refused():
    # feature 0 reads table 1 (2^40 rows, hashed) but is listed under table 0 (2 rows, direct dedup)
    i64 = torch.tensor([1, 0, 0, 2, 2**40, D, D, 0, 1, 1])
    i8 = torch.zeros(4, dtype=torch.int8)
    bufs, guards = _count_bufs(i64, i8, torch.tensor([2**39]), torch.tensor([0, 1]), T=2)
    _refused("table_feats\\[0\\] = 0, not a feature of table 0", "he_lookup_count", bufs, (1, 1, 2))
    assert all(g.eq(-7).all() for g in guards)


def test_backward_refuses_unique_rows_whose_end_overflows():
    i64, i8 = _plan()
    gbuf = torch.full((16,), 7.0)
    _refused("unique rows", "he_lookup_backward",
             [i64, i8, torch.tensor([1.0]), torch.tensor([0, 0]), torch.empty(0, dtype=torch.int32), None,
              torch.full((1,), -1, dtype=torch.int64), gbuf, torch.tensor([2**62, 2**62 + 4]), torch.tensor([0]),
              torch.tensor([0, 0, 0]), torch.tensor([0]), torch.zeros(1, D), torch.ones(1, D)],
             (1, 1, 1, 1, 1, 1, D))  # base + count wraps below capacity 1
    assert gbuf.eq(7).all()


@pytest.mark.parametrize("kernel", ["he_lookup_pool", "he_lookup_pool_direct"])
def test_pool_refuses_an_output_span_that_overflows(kernel):
    Bn, ors = 1 << 24, 1 << 40  # (B-1) * ors + D wraps
    i64, i8 = _plan(num_rows=1 if kernel == "he_lookup_pool_direct" else -1)
    out = torch.full((D,), 7.0)
    head = [i64, i8, torch.zeros(1), torch.tensor([0]), torch.tensor([0])]
    if kernel == "he_lookup_pool":
        bufs = head + [torch.zeros(Bn + 1, dtype=torch.int64), torch.empty(0, dtype=torch.int32), None,
                       torch.empty(0, dtype=torch.int64), out, torch.tensor([0]), torch.zeros(1, D)]
        ints = (Bn, 1, 1, D, 0, ors, 1, D)
    else:
        bufs = head + [torch.empty(0, dtype=torch.int64), torch.zeros(Bn + 1, dtype=torch.int64), None,
                       torch.tensor([0]), out, torch.tensor([0]), torch.zeros(1, D)]
        ints = (Bn, 1, 1, D, ors, 1, D)
    _refused("out: 16777215 \\* 1099511627776 \\+ 0 \\+ 4 overflows", kernel, bufs, ints)
    assert out.eq(7).all()


@pytest.mark.parametrize("n_values, counted", [(6, [0, 1]), (1, [0, 3]), (6, [0, 2, 1])])
def test_dedup_refuses_a_batch_that_does_not_match_out_offsets(n_values, counted):
    """More ids than counted (past inverse / unique_keys), fewer (inverse left unwritten), or
    out_offsets decreasing: refused; the scratch outputs are written at most inside their bounds."""
    Bn = len(counted) - 1
    i64, i8 = _plan()
    values, offsets = torch.arange(n_values), torch.tensor([0] + [n_values] * Bn)
    n_kept = counted[-1]
    inv, keys, cnt = (torch.full((16,), -7, dtype=t) for t in (torch.int32, torch.int64, torch.int32))
    ctx = ns.NativeScratch()
    _refused("does not match out_offsets|out_offsets", "he_lookup_dedup",
             [i64, i8, values, offsets, None, torch.tensor([0]), torch.tensor(counted), torch.tensor([0]),
              inv[:n_kept], None, keys[:n_kept], cnt[:n_kept], torch.zeros(1, dtype=torch.int64)],
             (Bn, 1, 1, 1, ctx.handle))
    assert all(t[n_kept:].eq(-7).all() for t in (inv, keys, cnt))


def test_the_tables_rows_go_over_once_per_storage_with_the_table_to_storage_column():
    """Tables reading one storage (a group's) hand it over once, with of_table saying which each
    reads: the same pooled numbers as each table given its own tensor, and no int per table."""
    specs = [TableSpec(n, D, num_rows=4) for n in "abc"]
    feats = [FeatureSpec(n, n) for n in "abc"]
    lookup = FusedEmbeddingLookup(specs, feats, backend="native")
    rows = torch.randn(4, D)
    sf = make_batch({"a": [[1, 2], [3], []], "b": [[0], [3, 3, 1], [2]], "c": [[], [0], [1, 2, 3]]})
    prep = lookup.prepare(sf, [rows] * 3)
    slots, group = lookup.static_slots(prep), lookup.plan.groups[0]
    shared = ns.pool_native(lookup.plan, prep, [rows] * 3, slots, group)
    apart = ns.pool_native(lookup.plan, prep, [rows.clone(), rows.clone(), rows.clone()], slots, group)
    assert torch.equal(shared, apart)
    bufs, of_table, strides = ns._tables([rows] * 3)
    assert len(bufs) == 1 and bufs[0] is rows and of_table.tolist() == [0, 0, 0] and strides == [D]
    other = torch.randn(4, D)
    bufs, of_table, _ = ns._tables([rows, other, rows])  # another sharing: found afresh, not from the cache
    assert len(bufs) == 2 and bufs[1] is other and of_table.tolist() == [0, 1, 0]


@pytest.mark.parametrize("of_table", [[0, 1], [0, -1]])
def test_a_table_naming_a_storage_not_given_is_refused_and_nothing_written(of_table):
    lookup, tables, _, prep = _setup()
    slots = lookup.static_slots(prep)
    out = torch.full((B, 2, D), 7.0)
    bufs, ints = _pool_args(lookup, tables, prep, out, slots)
    bufs = bufs[:10] + [torch.tensor(of_table), tables[0]]  # one storage given
    ints = ints[:6] + (1, D)
    _refused("table 1 reads row storage", "he_lookup_pool", bufs, ints)
    assert out.eq(7).all()

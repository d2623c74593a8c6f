"""The static tables' fetch on the triton kernels (what a GPU runs: StaticGroup._rows_triton) against the torch
reference (_rows_torch): the same rows, hit counts and last steps, the same error naming the first bad pair with
nothing counted, programs in any order, and two kernels with one read of the device."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed._triton._grid import shuffled_programs
from hugeembed.errors import InputError, ShardingError
from hugeembed.store import RowLayout, StaticGroup, TableSettings

from tests.bench._load import load_bench

from ._batches import DEV

pytestmark = pytest.mark.triton

LAY = RowLayout(2, torch.float32)


def _group():
    return StaticGroup([TableSettings("a", LAY, num_rows=5, seed=1), TableSettings("b", LAY, num_rows=7, seed=2),
                        TableSettings("c", LAY, num_rows=9, shard=1, num_shards=2, seed=3)], device=DEV)


def _pairs(draw_t, draw_k):
    return torch.tensor(draw_t, dtype=torch.int64, device=DEV), torch.tensor(draw_k, dtype=torch.int64, device=DEV)


@settings(max_examples=25, deadline=None)
@given(st.lists(st.tuples(st.integers(-1, 2), st.integers(-1, 9), st.integers(0, 3)), max_size=40),
       st.booleans(), st.integers(1, 50))
def test_rows_counts_and_errors_equal_the_torch_reference(pairs, with_counts, step):
    tids, keys = _pairs([p[0] for p in pairs], [p[1] for p in pairs])
    counts = torch.tensor([p[2] for p in pairs], dtype=torch.int64, device=DEV) if with_counts else None
    want_g, got_g = _group(), _group()
    want_out, got_out = torch.empty_like(keys), torch.empty_like(keys)
    try:
        want_g._rows_torch(tids, keys, step, counts, want_out, True)
    except (InputError, ShardingError) as e:
        with pytest.raises(type(e)) as got:
            got_g._rows_triton(tids, keys, step, counts, got_out, True)
        assert str(got.value) == str(e)
        assert torch.equal(got_g.meta, want_g.meta) and not got_g.meta.any()  # nothing counted
        return
    with shuffled_programs(step):
        got_g._rows_triton(tids, keys, step, counts, got_out, True)
    assert torch.equal(got_out, want_out)
    n = want_g.meta.size(0) - 1  # (the torch path's sink row is its own)
    assert torch.equal(got_g.meta[:n], want_g.meta[:n])


def test_two_kernels_and_one_read():
    ops = load_bench("ops")
    g = _group()
    tids, keys = _pairs([0, 1, 2, 1], [4, 6, 3, 0])
    out = torch.empty_like(keys)
    with ops.CountLaunches() as c:
        g._rows_triton(tids, keys, 3, None, out, True)
    assert c.syncs() == 1 and sum(c.kernels.values()) == 2, (dict(c.ops), dict(c.kernels))
    assert out.tolist() == [4, 11, 12 + 1, 5]  # c's key 3 -> row 12 + 3 // 2
    assert g.meta[[4, 11, 13, 5]].tolist() == [[1, 3]] * 4


def test_keys_a_prepare_proved_in_range_are_not_checked_again(monkeypatch):
    """The fetch given the prepare's proof (Prepared.id_bounds) equal to its tables' own ranges: the same rows and
    counts as the checked fetch, in two kernels and no read.  A proof of other ranges, or a group with a row-wise
    shard, is not enough: the keys are checked (and a bad one raises, changing nothing)."""
    ops = load_bench("ops")
    monkeypatch.setattr(StaticGroup, "_on_triton", lambda self: True)  # (CPU tensors: the kernels, as on a GPU)
    plain = lambda: StaticGroup([TableSettings("a", LAY, num_rows=5, seed=1), TableSettings("b", LAY, num_rows=7, seed=2)],
                                device=DEV)
    tids, keys = _pairs([0, 1, 1, -1, 0], [4, 6, 0, 9, 0])
    counts = torch.tensor([1, 2, 1, 1, 3], dtype=torch.int64, device=DEV)
    want, got = plain(), plain()
    assert got.key_bounds == (5, 7)
    want_out = want.fetch(tids, keys, 3, counts)
    with ops.CountLaunches() as c:
        got_out = got.fetch(tids, keys, 3, counts, within=(5, 7))
    assert c.syncs() == 0 and sum(c.kernels.values()) == 2, (dict(c.ops), dict(c.kernels))
    assert torch.equal(got_out, want_out) and torch.equal(got.meta, want.meta)
    bad = _pairs([0, 1], [2, 7])
    for g, within in ((plain(), (5, 8)), (_group(), (5, 7, 9))):  # other ranges; a shard's group
        with pytest.raises(InputError, match="table 'b': key 7 is outside \\[0, 7\\)"):
            g.fetch(*bad, 1, within=within)
        assert not g.meta.any()

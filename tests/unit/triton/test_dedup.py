"""Dedup on the device (hugeembed._triton.dedup) against prepare_torch's dedup and a plain-Python oracle."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from hugeembed._triton._grid import shuffled_programs
from hugeembed._triton.dedup import dedup
from hugeembed.errors import InputError

from ._batches import DEV, batches, entries, group_base, prepared

pytestmark = pytest.mark.triton


def _oracle(ids, tables, base, rows, valid):
    """Plain Python: sorted unique (table, id) keys, each entry's unique index (-1: not valid)."""
    keys = []
    for j in range(len(ids)):
        ok = (valid is None or valid[j]) and tables[j] >= 0 and 0 <= ids[j] < rows[tables[j]]
        keys.append(base[tables[j]] + ids[j] if ok else None)
    uniq = sorted({k for k in keys if k is not None})
    where = {k: u for u, k in enumerate(uniq)}
    inverse = [where[k] if k is not None else -1 for k in keys]
    return uniq, inverse, keys


def _check(d, ids, tables, base, rows, valid):
    uniq, inverse, keys = _oracle(ids, tables, base, rows, valid)
    n_valid, n_unique = d.counts.tolist()
    assert n_unique == len(uniq) and n_valid == sum(k is not None for k in keys)
    assert d.rows[:n_unique].tolist() == uniq
    assert d.tables[:n_unique].tolist() == [tables[keys.index(k)] for k in uniq]
    assert d.inverse.tolist() == inverse
    seg = d.seg_start.tolist()
    assert seg[n_unique:] == [n_valid] * (len(ids) + 1 - n_unique)
    order = d.order.tolist()
    for u in range(n_unique):  # each run: that key's entries in batch order (a stable sort)
        assert order[seg[u] : seg[u + 1]] == [j for j in range(len(ids)) if keys[j] == uniq[u]]


@settings(max_examples=25)
@given(ids=st.lists(st.integers(-2, 9), max_size=40), data=st.data())
def test_dedup_matches_oracle(ids, data):
    n = len(ids)
    tables = data.draw(st.lists(st.integers(-1, 2), min_size=n, max_size=n))  # -1: an entry that does not count
    valid = data.draw(st.none() | st.lists(st.booleans(), min_size=n, max_size=n))
    base, rows = [0, 7, 7], [7, 0, 10]  # an empty table between two
    d = dedup(torch.tensor(ids, dtype=torch.int64, device=DEV), torch.tensor(tables, dtype=torch.int32, device=DEV),
              torch.tensor(base, device=DEV), torch.tensor(rows, device=DEV), 17,
              None if valid is None else torch.tensor(valid, device=DEV))
    _check(d, ids, tables, base, rows, valid)


@settings(max_examples=10)
@given(case=batches())
def test_dedup_equals_prepare_torch(case):
    """On a prepared batch: the same unique keys in the same order, the same inverse."""
    plan, sf = case
    prep = prepared(plan, sf)
    ids, table, _ = entries(plan, prep)
    base, rows, R = group_base(plan)
    d = dedup(ids, table, base, rows, R)
    n_unique = int(d.counts[1])
    assert n_unique == prep.unique_keys.numel()
    assert torch.equal((d.rows[:n_unique].long() - base[d.tables[:n_unique].long()]), prep.unique_keys)
    assert torch.equal(d.inverse.long(), prep.inverse.long())


def test_dedup_shuffled_program_order_is_identical():
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(0, 9, (700,), generator=g).to(DEV)  # several programs of 256
    tables = torch.randint(0, 2, (700,), generator=g, dtype=torch.int32).to(DEV)
    base, rows = torch.tensor([0, 9], device=DEV), torch.tensor([9, 9], device=DEV)
    want = dedup(ids, tables, base, rows, 18)
    with shuffled_programs(11):
        got = dedup(ids, tables, base, rows, 18)
    n_unique = int(want.counts[1])
    for a, b in ((want.order, got.order), (want.inverse, got.inverse), (want.counts, got.counts),
                 (want.seg_start, got.seg_start), (want.rows[:n_unique], got.rows[:n_unique])):
        assert torch.equal(a, b)


def test_dedup_empty_and_bad_shapes():
    d = dedup(torch.zeros(0, dtype=torch.int64, device=DEV), torch.zeros(0, dtype=torch.int32, device=DEV),
              torch.tensor([0], device=DEV), torch.tensor([4], device=DEV), 4)
    assert d.counts.tolist() == [0, 0] and d.seg_start.tolist() == [0]
    with pytest.raises(InputError, match="one entry each"):
        dedup(torch.zeros(3, dtype=torch.int64), torch.zeros(2, dtype=torch.int32), torch.tensor([0]),
              torch.tensor([4]), 4)

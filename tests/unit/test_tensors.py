"""hugeembed._tensors: joined_view is a view only when the parts lie end to end in one storage."""

import torch
from hypothesis import given, settings, strategies as st

from hugeembed._tensors import joined, joined_view


@settings(max_examples=60, deadline=None)
@given(sizes=st.lists(st.integers(0, 5), min_size=1, max_size=6), width=st.integers(1, 3),
       gap=st.integers(0, 2), at=st.integers(0, 5))
def test_joined_view_of_consecutive_parts_is_their_concatenation(sizes, width, gap, at):
    base = torch.arange(100 * width, dtype=torch.float32).reshape(100, width)
    parts, pos = [], 0
    for i, n in enumerate(sizes):
        parts.append(base[pos : pos + n])
        pos += n + (gap if i == at else 0)
    v = joined_view(parts)
    expect = torch.cat(parts)
    if gap and at < len(sizes) - 1 and any(sizes[at + 1 :]) and sizes[at + 1] > 0:
        assert v is None  # a gap between two parts: no view
    if v is not None:
        assert torch.equal(v, expect)
        assert v.untyped_storage().data_ptr() == base.untyped_storage().data_ptr()  # a view, no copy
    assert torch.equal(joined(parts), expect)


def test_joined_view_refuses_parts_of_other_storages_and_kinds():
    a = torch.zeros(4, 2)
    b = torch.ones(4, 2)
    assert joined_view([a, b]) is None  # separate allocations, even if they happened to be adjacent
    assert joined_view([a[:2], a[2:].to(torch.float64)]) is None  # dtype
    assert joined_view([a[:, :1], a[:, 1:]]) is None  # not contiguous
    assert joined_view([a.reshape(-1)[:4], a.reshape(-1)[4:]]) is not None
    assert joined_view([a[:2], None]) is None
    assert joined_view([]) is None
    # a storage just big enough: the joined extent must lie inside it
    big = torch.arange(12.0).reshape(6, 2)
    assert torch.equal(joined_view([big[1:3], big[3:6]]), big[1:6])

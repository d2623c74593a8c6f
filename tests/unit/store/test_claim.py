"""The torch reference's claim (store/_index_torch.py): crowds of keys wanting one bucket are
placed as linear probing places them, checked against a sequential insertion written here."""

import torch
from hypothesis import given, settings, strategies as st

from hugeembed.store._index_torch import claim

EMPTY = -1


def _sequential(occupied: list[bool], homes: list[int]) -> list[int]:
    """Each key in position order into the first empty bucket from its home (the oracle)."""
    occ, out, B = list(occupied), [], len(occupied)
    for h in homes:
        b = h
        while occ[b]:
            b = (b + 1) % B
        occ[b] = True
        out.append(b)
    return out


@settings(max_examples=80, deadline=None)
@given(B=st.integers(8, 300), fill=st.floats(0.0, 0.5), n_frac=st.floats(0.0, 0.45), crowd=st.integers(1, 12),
       seed=st.integers(0, 2**31))
def test_claim_places_crowds_as_linear_probing(B, fill, n_frac, crowd, seed):
    g = torch.Generator().manual_seed(seed)
    occupied = (torch.rand(B, generator=g) < fill).tolist()
    n = min(int(n_frac * B), B - sum(occupied))
    homes = torch.randint(0, max(1, B // crowd), (n,), generator=g) * crowd % B  # crowds on a few homes
    buckets = torch.zeros(B, 4, dtype=torch.int64)
    buckets[:, 1] = torch.tensor([0 if o else EMPTY for o in occupied])
    records = torch.zeros(n, 4, dtype=torch.int64)
    records[:, 0] = torch.arange(n) + 1000  # the key: its position + 1000
    claim(buckets, records, homes.clone())
    where = {int(k): b for b, k in enumerate(buckets[:, 0].tolist()) if k >= 1000}
    assert sorted(where) == list(range(1000, 1000 + n))  # every key placed, once
    occ_after = (buckets[:, 1] != EMPTY).tolist()
    expect = _sequential(occupied, homes.tolist())
    assert occ_after == [o or b in set(expect) for b, o in enumerate(occupied)]  # the same buckets taken
    for i, h in enumerate(homes.tolist()):  # no empty bucket between a key's home and its bucket
        b = h
        while b != where[1000 + i]:
            assert occ_after[b]
            b = (b + 1) % B

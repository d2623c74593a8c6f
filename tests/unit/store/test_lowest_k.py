"""lowest_k (the eviction choice of the stores and the tiered cache) against a sort: the k smallest
entries in lexicographic order of the columns, ties broken by the later columns."""

from __future__ import annotations

import numpy as np
import torch
from hypothesis import given
from hypothesis import strategies as st

from hugeembed.store._common import lowest_k


@given(st.integers(1, 300), st.data(), st.sampled_from([torch.int64, torch.int32, torch.float32]),
       st.integers(1, 4))
def test_lowest_k_is_the_first_k_of_a_lexicographic_sort(n, data, dtype, span):
    rng = np.random.default_rng(data.draw(st.integers(0, 2**31)))
    k = data.draw(st.integers(0, n))
    a = torch.from_numpy(rng.integers(0, span, n)).to(dtype)  # few values: many ties
    b = torch.from_numpy(rng.integers(0, span, n))
    key = torch.from_numpy(rng.permutation(n) * 3 - n)  # unique, negatives too
    got = lowest_k([a, b, key], k)
    order = np.lexsort((key.numpy(), b.numpy(), a.double().numpy()))  # last key is the primary one
    want = torch.zeros(n, dtype=torch.bool)
    want[torch.from_numpy(order[:k])] = True
    assert torch.equal(got, want)

"""Dense padded [B, slots, max_nnz] (HugeCTR) and torch.sparse_coo_tensor converters."""

from __future__ import annotations

import pytest
import torch

from features_oracle import build, lists_of, weight_lists_of
from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures

# the batch of seed doc 001 (HugeCTR embedding plugin): B=4, slots=3, max_nnz=2
HUGECTR = [[[0, -1], [1, -1], [2, 6]],
           [[0, -1], [1, -1], [-1, -1]],
           [[0, -1], [1, -1], [6, -1]],
           [[0, -1], [1, -1], [2, -1]]]


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_hugectr_seed_batch(device, dtype):
    sf = SparseFeatures.from_dense_padded(["s0", "s1", "s2"], torch.tensor(HUGECTR, dtype=dtype, device=device))
    assert lists_of(sf) == {"s0": [[0], [0], [0], [0]], "s1": [[1], [1], [1], [1]], "s2": [[2, 6], [], [6], [2]]}
    assert sf.values().dtype == torch.int64 and sf.offsets().dtype == torch.int64
    assert sf.device.type == device.type and sf.weights_or_none() is None
    sf.validate()
    assert sf.to_dense_padded().tolist() == HUGECTR


def test_padding_anywhere_in_the_bag_and_weights(device):
    dense = torch.tensor([[[-1, 4, -7, 9], [3, -1, -1, 8]],
                          [[-1, -1, -1, -1], [-1, 5, 6, -1]]], device=device)
    weights = torch.arange(16, dtype=torch.float32, device=device).view(2, 2, 4) / 4
    sf = SparseFeatures.from_dense_padded(["user", "item"], dense, weights=weights)
    # every negative entry is padding, also -7 between two ids; ids keep column order
    assert lists_of(sf) == {"user": [[4, 9], []], "item": [[3, 8], [5, 6]]}
    assert weight_lists_of(sf) == {"user": [[0.25, 0.75], []], "item": [[1.0, 1.75], [3.25, 3.5]]}
    ids, w = sf.to_dense_padded(with_weights=True)
    assert ids.tolist() == [[[4, 9], [3, 8]], [[-1, -1], [5, 6]]]
    assert w.tolist() == [[[0.25, 0.75], [1.0, 1.75]], [[0.0, 0.0], [3.25, 3.5]]]
    assert ids.device.type == device.type and w.dtype == torch.float32


def test_custom_padding_value():
    dense = torch.tensor([[[3, 0, 0]], [[0, 2, -5]]])
    sf = SparseFeatures.from_dense_padded("f", dense, padding=0)  # a single name is one slot
    assert lists_of(sf) == {"f": [[3], [2]]}
    assert sf.to_dense_padded(max_nnz=3, padding=0).tolist() == [[[3, 0, 0]], [[2, 0, 0]]]
    assert sf.to_dense_padded(max_nnz=2, padding=-9).tolist() == [[[3, -9]], [[2, -9]]]


def test_empty_shapes():
    for shape in [(0, 2, 3), (3, 2, 0), (2, 0, 3)]:
        keys = ["a", "b"][: shape[1]]
        sf = SparseFeatures.from_dense_padded(keys, torch.zeros(shape, dtype=torch.int64) - 1)
        assert sf.batch_size == shape[0] and sf.keys() == tuple(keys) and sf.values().numel() == 0
        assert sf.to_dense_padded().shape == (shape[0], shape[1], 0)
    all_pad = SparseFeatures.from_dense_padded(["a"], torch.full((2, 1, 3), -1))
    assert lists_of(all_pad) == {"a": [[], []]} and all_pad.to_dense_padded(max_nnz=1).tolist() == [[[-1]], [[-1]]]


def test_from_dense_padded_errors():
    dense = torch.tensor(HUGECTR)
    with pytest.raises(InputError, match="2 feature names for 3 slots"):
        SparseFeatures.from_dense_padded(["a", "b"], dense)
    with pytest.raises(InputError, match=r"must be \[B, slots, max_nnz\], got shape \(4, 6\); for a single slot use"):
        SparseFeatures.from_dense_padded(["a"], dense.view(4, 6))
    with pytest.raises(InputError, match="dense keys must be integers .* got torch.float32"):
        SparseFeatures.from_dense_padded(["a", "b", "c"], dense.float())
    with pytest.raises(InputError, match=r"weights have shape \(4, 3\) but ids have shape \(4, 3, 2\)"):
        SparseFeatures.from_dense_padded(["a", "b", "c"], dense, weights=torch.ones(4, 3))
    with pytest.raises(InputError, match="weights must be floating point, got torch.int64"):
        SparseFeatures.from_dense_padded(["a", "b", "c"], dense, weights=torch.ones(4, 3, 2, dtype=torch.int64))
    with pytest.raises(InputError, match="feature names must be strings, got 1"):
        SparseFeatures.from_dense_padded(["a", 1, "c"], dense)
    with pytest.raises(InputError, match=r"duplicate feature names \['a'\]"):
        SparseFeatures.from_dense_padded(["a", "b", "a"], dense)


def test_to_dense_padded_never_truncates():
    sf = build({"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]})
    with pytest.raises(InputError, match=r"feature 'item' sample 1 has 3 ids, more than max_nnz=2; .*never dropped"):
        sf.to_dense_padded(max_nnz=2)
    with pytest.raises(InputError, match="max_nnz must be >= 0, got -1"):
        sf.to_dense_padded(max_nnz=-1)
    with pytest.raises(InputError, match="no weights"):
        sf.to_dense_padded(with_weights=True)


def test_to_dense_padded_refuses_ids_that_read_as_padding():
    sf = build({"user": [[1], [0, -4]]})
    with pytest.raises(InputError, match=r"feature 'user' sample 1 has id -4, which would read back as padding"):
        sf.to_dense_padded()
    with pytest.raises(InputError, match=r"feature 'user' sample 1 has id 0, which would read back as padding \(negative or 0\)"):
        build({"user": [[1], [0]]}).to_dense_padded(padding=0)


# -- torch.sparse_coo_tensor ----------------------------------------------------------------


def sparse(indices, values, shape, **kw):
    idx = torch.tensor(indices, dtype=torch.int64).reshape(-1, 2).t()
    return torch.sparse_coo_tensor(idx, torch.tensor(values, **kw), shape, check_invariants=True)


def test_from_sparse_coo_tensors_uncoalesced_takes_column_order(device):
    # positions given out of order: (1, 2) (0, 0) (1, 0) (0, 3)
    ids = sparse([[1, 2], [0, 0], [1, 0], [0, 3]], [30, 10, 20, 11], (3, 4)).to(device)
    w = sparse([[1, 2], [0, 0], [1, 0], [0, 3]], [3.0, 1.0, 2.0, 1.5], (3, 4)).to(device)
    other = sparse([[2, 0]], [7], (3, 1), dtype=torch.int32).to(device)
    other_w = sparse([[2, 0]], [0.5], (3, 1)).to(device)
    sf = SparseFeatures.from_sparse_coo_tensors({"a": ids, "b": other}, weights={"a": w, "b": other_w})
    assert lists_of(sf) == {"a": [[10, 11], [20, 30], []], "b": [[], [], [7]]}
    assert weight_lists_of(sf) == {"a": [[1.0, 1.5], [2.0, 3.0], []], "b": [[], [], [0.5]]}
    assert sf.device.type == device.type


def test_to_sparse_coo_tensors(device):
    sf = build({"a": [[10, 11], [], [20]], "b": [[], [], []]}, {"a": [[1.0, 2.0], [], [3.0]], "b": [[], [], []]},
               device=device)
    ids, w = sf.to_sparse_coo_tensors(with_weights=True)
    assert ids["a"].is_coalesced() and ids["a"].shape == (3, 2) and ids["b"].shape == (3, 0)
    assert ids["a"].to_dense().tolist() == [[10, 11], [0, 0], [20, 0]]
    assert ids["a"].indices().tolist() == [[0, 0, 2], [0, 1, 0]]
    assert w["a"].to_dense().tolist() == [[1.0, 2.0], [0.0, 0.0], [3.0, 0.0]]
    assert ids["a"].device.type == device.type
    assert sf.to_sparse_coo_tensors(max_len=5)["a"].shape == (3, 5)
    back = SparseFeatures.from_sparse_coo_tensors(ids, weights=w)
    assert lists_of(back) == lists_of(sf) and weight_lists_of(back) == weight_lists_of(sf)
    with pytest.raises(InputError, match="feature 'a' sample 0 has 2 ids, more than max_len=1"):
        sf.to_sparse_coo_tensors(max_len=1)
    with pytest.raises(InputError, match="max_len must be >= 0, got -1"):
        sf.to_sparse_coo_tensors(max_len=-1)


def test_empty_batch_of_sparse_tensors():
    sf = SparseFeatures.from_sparse_coo_tensors({"a": sparse([], [], (0, 0), dtype=torch.int64).coalesce()})
    assert sf.batch_size == 0 and sf.keys() == ("a",)
    assert sf.to_sparse_coo_tensors()["a"].shape == (0, 0)


def test_from_sparse_coo_tensors_errors():
    good = sparse([[0, 0]], [1], (2, 2))
    with pytest.raises(InputError, match="feature 'a': expected a torch.sparse_coo_tensor, got torch.strided"):
        SparseFeatures.from_sparse_coo_tensors({"a": torch.zeros(2, 2)})
    with pytest.raises(InputError, match=r"feature 'a': expected a 2-D sparse tensor \[B, max_len\], got shape \(2, 2, 2\)"):
        SparseFeatures.from_sparse_coo_tensors({"a": torch.zeros(2, 2, 2).to_sparse()})
    with pytest.raises(InputError, match="feature 'a': ids must be integers .* got torch.float32"):
        SparseFeatures.from_sparse_coo_tensors({"a": sparse([[0, 0]], [1.0], (2, 2))})
    dup = sparse([[0, 1], [0, 1]], [1, 2], (2, 2))
    with pytest.raises(InputError, match=r"feature 'a': two ids at the same position \(sample 0, column 1\)"):
        SparseFeatures.from_sparse_coo_tensors({"a": dup})
    with pytest.raises(InputError, match="feature 'b' has batch size 3, but feature 'a' has 2"):
        SparseFeatures.from_sparse_coo_tensors({"a": good, "b": sparse([[0, 0]], [1], (3, 2))})
    with pytest.raises(InputError, match="weights for unknown feature 'z'"):
        SparseFeatures.from_sparse_coo_tensors({"a": good}, weights={"z": good.float()})
    with pytest.raises(InputError, match="feature 'b': has no weights, but other features do"):
        SparseFeatures.from_sparse_coo_tensors({"a": good, "b": good}, weights={"a": good.float()})
    with pytest.raises(InputError, match="feature 'a': weights must have the same indices as the ids"):
        SparseFeatures.from_sparse_coo_tensors({"a": good}, weights={"a": sparse([[1, 0]], [1.0], (2, 2))})
    with pytest.raises(InputError, match="feature 'a' weights: must be floating point, got torch.int64"):
        SparseFeatures.from_sparse_coo_tensors({"a": good}, weights={"a": good})

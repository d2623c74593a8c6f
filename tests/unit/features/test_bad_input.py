"""Bad input to the SparseFeatures constructors and converters: a clear InputError, never a torch error.

Issue 10: bools/floats/strings/None/nested lists among list ids, meta batches, non-contiguous
ids (valid input: accepted), non-integer lengths.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures


@pytest.mark.parametrize(
    "rows, shown",
    [
        ([[1, True]], r"sample 0 has True \(bool\)"),
        ([[1], [2, False]], r"sample 1 has False \(bool\)"),
        ([[1], [], [1.5]], r"sample 2 has 1.5 \(float\)"),
        ([[2.0]], r"sample 0 has 2.0 \(float\)"),  # integral floats too: the id list holds a float
        ([["7"]], r"sample 0 has '7' \(str\)"),
        ([[1, None]], r"sample 0 has None \(NoneType\)"),
        ([[[1, 2]], [3]], r"sample 0 has \[1, 2\] \(list\); samples are flat lists"),
        ([[1], [[3]]], r"sample 1 has \[3\] \(list\)"),
        ([[np.bool_(True)]], r"sample 0 has .*True"),
    ],
)
def test_from_lists_refuses_non_integer_ids(rows, shown):
    with pytest.raises(InputError, match=r"from_lists: feature 'tags': ids must be integers, but " + shown):
        SparseFeatures.from_lists({"ok": [[0]] * len(rows), "tags": rows})


def test_from_lists_refuses_bool_and_junk_weights():
    with pytest.raises(InputError, match=r"feature 'a' weights: weights must be numbers, but sample 1 has True"):
        SparseFeatures.from_lists({"a": [[1], [2]]}, {"a": [[0.5], [True]]})
    with pytest.raises(InputError, match=r"feature 'a' weights: .*sample 0 has 'x' \(str\)"):
        SparseFeatures.from_lists({"a": [[1]]}, {"a": [["x"]]})


def test_from_lists_still_takes_numpy_and_tensor_ints():
    sf = SparseFeatures.from_lists({"a": [[np.int64(3), 4], [torch.tensor(5)]]}, {"a": [[np.float32(0.5), 1], [2.0]]})
    assert sf.values().tolist() == [3, 4, 5] and sf.lengths().tolist() == [2, 1]
    assert sf.weights().tolist() == [0.5, 1.0, 2.0]


def test_non_contiguous_ids_are_accepted_everywhere():
    ids = torch.arange(12)[::2]  # [0, 2, 4, 6, 8, 10], stride 2
    offs = torch.tensor([0, 2, 6])
    w = torch.ones(12)[::2]
    sf = SparseFeatures(["a"], ids, offsets=offs, weights=w).validate()
    assert sf.values().is_contiguous() and sf.weights().is_contiguous()
    assert sf.to_lists() == {"a": [[0, 2], [4, 6, 8, 10]]}
    assert SparseFeatures.from_csr({"a": (offs, ids)}).to_lists() == sf.to_lists()
    assert SparseFeatures.from_dict({"a": (ids, offs, w)}).to_lists() == sf.to_lists()
    dense = torch.tensor([[[0, 2, -1, -1]], [[4, 6, 8, 10]]]).transpose(0, 2).contiguous().transpose(0, 2)
    assert not dense.is_contiguous()
    assert SparseFeatures.from_dense_padded(["a"], dense).to_lists() == sf.to_lists()
    rows = torch.tensor([[0, 0, 1, 1, 1, 1], [9, 9, 9, 9, 9, 9]])[0]
    assert SparseFeatures.from_coo("a", rows, ids, [2]).to_lists() == sf.to_lists()


def test_lengths_must_be_integers():
    with pytest.raises(InputError, match=r"SparseFeatures \['a'\]: lengths must be integers, got torch.bool"):
        SparseFeatures(["a"], torch.tensor([1]), lengths=torch.tensor([True]))
    with pytest.raises(InputError, match=r"SparseFeatures \['a'\]: lengths must be integers, got torch.float32"):
        SparseFeatures(["a"], torch.tensor([1]), lengths=torch.tensor([1.0]))


def test_constructor_errors_name_the_features():
    with pytest.raises(InputError, match=r"SparseFeatures \['u', 'v'\]: offsets must be a tensor, got list"):
        SparseFeatures(["u", "v"], torch.tensor([1]), offsets=[0, 1, 1])
    with pytest.raises(InputError, match=r"SparseFeatures \['u'\]: values must be a tensor, got list"):
        SparseFeatures(["u"], [1], offsets=torch.tensor([0, 1]))


def meta_batch() -> SparseFeatures:
    return SparseFeatures(["a", "b"], torch.zeros(3, dtype=torch.int64, device="meta"),
                          offsets=torch.zeros(5, dtype=torch.int64, device="meta"),
                          weights=torch.ones(3, device="meta"))


def test_validate_of_a_meta_batch_is_shape_only():
    sf = meta_batch()
    assert sf.validate() is sf  # no data to read: dtypes and devices only
    bad = SparseFeatures(["a"], torch.zeros(3, dtype=torch.int32, device="meta"),
                         offsets=torch.zeros(2, dtype=torch.int64, device="meta"))
    with pytest.raises(InputError, match=r"\['a'\]: ids must be int64, got torch.int32"):
        bad.validate()


@pytest.mark.parametrize("op", [
    lambda sf: sf.feature("b"),
    lambda sf: sf.to_lists(),
    lambda sf: sf.to_dense_padded(),
    lambda sf: sf.to_coo(),
    lambda sf: sf.to_sparse_coo_tensors(),
    lambda sf: sf.split(1),
    lambda sf: sf.select(["b"]),
    lambda sf: SparseFeatures.concat_batches([sf, sf]),
])
def test_reading_a_meta_batch_is_a_clear_error(op):
    with pytest.raises(InputError, match=r"meta device, which holds no values to read"):
        op(meta_batch())


@pytest.mark.parametrize("make", [
    lambda m: SparseFeatures.from_csr({"a": (torch.tensor([0, 1], device=m), torch.tensor([1], device=m))}),
    lambda m: SparseFeatures.from_dict({"a": (torch.tensor([1], device=m), torch.tensor([0, 1], device=m))}),
    lambda m: SparseFeatures.from_dense_padded(["a"], torch.zeros(2, 1, 3, dtype=torch.int64, device=m)),
    lambda m: SparseFeatures.from_coo("a", torch.tensor([0], device=m), torch.tensor([1], device=m), [1]),
    lambda m: SparseFeatures.from_coo(["a", "b"], torch.tensor([0], device=m), torch.tensor([1], device=m)),
])
def test_converting_meta_tensors_is_a_clear_error(make):
    with pytest.raises(InputError, match=r"feature 'a'|\['a'.*meta device|meta device"):
        make("meta")
    make("cpu")  # the same call on real tensors works


@pytest.mark.parametrize("op", [
    lambda sf: sf.to_lists(),
    lambda sf: sf.to_dense_padded(),
    lambda sf: sf.to_coo(),
    lambda sf: sf.to_csr(),
    lambda sf: sf.to_sparse_coo_tensors(),
    lambda sf: sf.feature("a"),
    lambda sf: sf.split(1),
    lambda sf: sf.select(["a"]),
    lambda sf: SparseFeatures.concat_batches([sf]),
])
def test_converting_out_of_a_batch_with_bad_offsets_raises_validates_error(op):
    # the constructor does not read offsets; a converter must, before trusting them
    sf = SparseFeatures(["a"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 1]))
    with pytest.raises(InputError, match=r"feature 'a': lengths sum to 1 \(the last offset\) but there are 3 ids"):
        op(sf)
    sf = SparseFeatures(["a"], torch.tensor([1, 2, 3]), offsets=torch.tensor([0, 3, 1, 3]))
    with pytest.raises(InputError, match=r"feature 'a': offsets decrease at sample 1 \(3 -> 1\)"):
        op(sf)


def test_coo_junk_shapes_and_absurd_rows():
    with pytest.raises(InputError, match=r"from_coo: feature 'a': dense_shape must be integers, got torch.float32"):
        SparseFeatures.from_coo("a", [0], [1], [1.5])
    with pytest.raises(InputError, match=r"feature 'a': expected a tensor, got str"):
        SparseFeatures.from_coo("a", [0], [1], "x")
    with pytest.raises(InputError, match=r"feature 'a': 1099511627777 bags .* do not fit in memory"):
        SparseFeatures.from_coo("a", [2**40], [1])

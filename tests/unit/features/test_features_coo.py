"""COO (HugeCTR fprop, TF SparseTensor) and CSR converters."""

from __future__ import annotations

import pytest
import torch

from features_oracle import build, lists_of, weight_lists_of
from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures

T = torch.tensor


def test_single_feature_unsorted_rows_keep_order_within_a_row(device):
    # rows 2, 0, 0: the two ids of row 0 stay in input order (5 before 1), not sorted by value
    sf = SparseFeatures.from_coo("user", T([2, 0, 0], device=device), T([7, 5, 1], dtype=torch.int32, device=device),
                                 dense_shape=[4], weights=T([0.5, 1.0, 2.0], device=device))
    assert lists_of(sf) == {"user": [[5, 1], [], [7], []]}  # dense_shape keeps the empty sample 3
    assert weight_lists_of(sf) == {"user": [[1.0, 2.0], [], [0.5], []]}
    assert sf.values().dtype == torch.int64 and sf.device.type == device.type


def test_batch_size_from_largest_row_or_keyword():
    assert lists_of(SparseFeatures.from_coo("u", T([1]), T([3]))) == {"u": [[], [3]]}
    assert SparseFeatures.from_coo("u", T([1]), T([3]), batch_size=4).batch_size == 4
    empty = SparseFeatures.from_coo("u", T([], dtype=torch.int64), T([], dtype=torch.int64))
    assert empty.batch_size == 0 and empty.keys() == ("u",)


def test_tf_indices_order_by_column():
    # TF SparseTensor indices [n, 2]: ids are placed by column, with gaps allowed
    idx = T([[1, 3], [0, 1], [1, 0], [0, 0]])
    sf = SparseFeatures.from_coo({"tags": (idx, T([13, 11, 10, 9]), [2, 4])})
    assert lists_of(sf) == {"tags": [[9, 11], [10, 13]]}


def test_per_feature_dict_with_weights_and_empty_features():
    sf = SparseFeatures.from_coo({
        "a": (T([1, 1, 0]), T([4, 5, 6]), None, T([1.0, 2.0, 3.0])),
        "b": (T([], dtype=torch.int64), T([], dtype=torch.int64), [3], T([])),
    })
    assert lists_of(sf) == {"a": [[6], [4, 5], []], "b": [[], [], []]}
    assert weight_lists_of(sf) == {"a": [[3.0], [1.0, 2.0], []], "b": [[], [], []]}
    coo = sf.to_coo()
    assert [t.tolist() for t in coo["a"]] == [[0, 1, 1], [6, 4, 5], [3.0, 1.0, 2.0]]
    assert [t.tolist() for t in coo["b"]] == [[], [], []]
    assert SparseFeatures.from_coo({}, batch_size=5).batch_size == 5


def test_hugectr_slot_rows_match_dense_padded():
    # seed 001: reshape keys to [B * slots, max_nnz], tf.where(keys != -1) gives the COO
    keys = T([[[0, -1], [1, -1], [2, 6]], [[0, -1], [1, -1], [-1, -1]],
              [[0, -1], [1, -1], [6, -1]], [[0, -1], [1, -1], [2, -1]]])
    flat = keys.reshape(-1, 2)
    indices = torch.nonzero(flat != -1)
    values = flat[flat != -1]
    want = {"s0": [[0]] * 4, "s1": [[1]] * 4, "s2": [[2, 6], [], [6], [2]]}
    names = ["s0", "s1", "s2"]
    assert lists_of(SparseFeatures.from_coo(names, indices, values, dense_shape=[12, 2])) == want
    assert lists_of(SparseFeatures.from_coo(names, indices[:, 0], values, dense_shape=[12])) == want
    perm = torch.randperm(values.numel())
    assert lists_of(SparseFeatures.from_coo(names, indices[perm], values[perm], dense_shape=[12, 2])) == want
    assert lists_of(SparseFeatures.from_coo(names, indices[:, 0], values)) == want  # B = 11 // 3 + 1


def test_to_coo_device_and_dtypes(device):
    sf = build({"a": [[3], [], [4, 5]]}, offsets_dtype=torch.int32, device=device)
    rows, values, weights = sf.to_coo()["a"]
    assert rows.tolist() == [0, 2, 2] and rows.dtype == torch.int64 and values.tolist() == [3, 4, 5]
    assert weights is None and rows.device.type == device.type


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: SparseFeatures.from_coo("user", T([0, 3]), T([1, 2]), [3]),
         r"from_coo: feature 'user': row index 3 \(id number 1\) is outside \[0, 3\)"),
        (lambda: SparseFeatures.from_coo("user", T([0, -1]), T([1, 2])),
         r"feature 'user': row index -1 \(id number 1\) is outside \[0, 1\)"),
        (lambda: SparseFeatures.from_coo("user", T([[0, 2]]), T([1]), [1, 2]),
         r"feature 'user': column index 2 \(id number 0\) is outside \[0, 2\)"),
        (lambda: SparseFeatures.from_coo("user", T([0, 0, 0]), T([1, 2, 3]), [1, 2]),
         r"feature 'user': sample 0 has 3 ids, more than dense_shape\[1\]=2"),
        (lambda: SparseFeatures.from_coo("user", T([[0, 1], [0, 1]]), T([1, 2])),
         r"feature 'user': two ids at the same position \(sample 0, column 1\)"),
        (lambda: SparseFeatures.from_coo("user", T([[0, 0, 1], [1, 0, 0]]), T([1, 2])),
         r"feature 'user': row indices must be \[n\] or TF-style \[n, 2\].*got shape \(2, 3\); transpose"),
        (lambda: SparseFeatures.from_coo("user", T([0, 1]), T([1])),
         "feature 'user': 2 row indices on cpu for 1 ids on cpu"),
        (lambda: SparseFeatures.from_coo("user", T([0.0]), T([1])), "feature 'user': row indices must be integers"),
        (lambda: SparseFeatures.from_coo("user", T([0]), T([1.5])),
         r"feature 'user': ids must be integers \(int32 or int64\), got torch.float32"),
        (lambda: SparseFeatures.from_coo("user", T([0]), T([1]), [1, 2, 3]),
         r"dense_shape must be \[B\] or \[B, max_nnz\]"),
        (lambda: SparseFeatures.from_coo("user", T([0]), T([1]), weights=T([1.0, 2.0])),
         r"feature 'user': weights have shape \(2,\) but ids have shape \(1,\)"),
        (lambda: SparseFeatures.from_coo({"a": (T([0]), T([1]), [2]), "b": (T([0]), T([1]), [3])}),
         "feature 'b' has batch size 3, but feature 'a' has 2"),
        (lambda: SparseFeatures.from_coo({"a": (T([0]), T([1]), [2])}, batch_size=4),
         "feature 'a' has batch size 2, but batch_size=4 has 4"),
        (lambda: SparseFeatures.from_coo({"a": (T([0]), T([5]), [1]), "b": (T([4]), T([1]))}),
         r"feature 'b': row index 4 \(id number 0\) is outside \[0, 1\)"),
        (lambda: SparseFeatures.from_coo({"a": (T([0]), T([1]), [1], T([1.0])), "b": (T([0]), T([1]))}),
         "feature 'a' has weights but feature 'b' has none"),
        (lambda: SparseFeatures.from_coo({"a": T([0])}), r"feature 'a': expected \(rows, values"),
        (lambda: SparseFeatures.from_coo({"a": (T([0]), T([1]))}, T([0])), "give rows and values inside the dict"),
        (lambda: SparseFeatures.from_coo(["a", "b"], T([0, 6]), T([1, 2]), [6]),
         r"from_coo \['a', 'b'\]: row index 6 \(id number 1\) is outside \[0, 6\)"),
        (lambda: SparseFeatures.from_coo(["a", "b"], T([0]), T([1]), [5, 2]),
         r"dense_shape\[0\]=5 rows do not split into 2 slots"),
        (lambda: SparseFeatures.from_coo(["a", "b"], T([3, 3, 3]), T([1, 2, 3]), [4, 2]),
         r"feature 'b' sample 1 has 3 ids, more than dense_shape\[1\]=2"),
        (lambda: SparseFeatures.from_coo(["a", "b"], T([[3, 0], [1, 0], [3, 0]]), T([1, 2, 3])),
         r"two ids at the same position \(feature 'b' sample 1, column 0\)"),
        (lambda: SparseFeatures.from_coo(["a", "b"], T([0]), T([1]), [4], batch_size=3),
         "batch_size=3 but dense_shape gives 2"),
        (lambda: SparseFeatures.from_coo(["a", "b"]), "give row_indices and values"),
        (lambda: SparseFeatures.from_coo("a", T([0]), T([1]), batch_size=-1), "batch_size must be >= 0, got -1"),
        (lambda: SparseFeatures.from_coo([], T([0]), T([1])), "give at least one feature name"),
    ],
)
def test_from_coo_errors(call, message):
    with pytest.raises(InputError, match=message):
        call()


# -- CSR ------------------------------------------------------------------------------------


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_csr_round_trip(device, offsets_dtype):
    sf = SparseFeatures.from_csr({
        "user": (T([0, 2, 2, 3], dtype=offsets_dtype, device=device), T([1, 5, 7], dtype=torch.int32, device=device),
                 T([0.5, 1.0, 2.0], device=device)),
        "item": (T([0, 0, 0, 0], dtype=offsets_dtype, device=device), T([], dtype=torch.int64, device=device),
                 T([], device=device)),
    })
    assert lists_of(sf) == {"user": [[1, 5], [], [7]], "item": [[], [], []]}
    assert weight_lists_of(sf) == {"user": [[0.5, 1.0], [], [2.0]], "item": [[], [], []]}
    assert sf.offsets().dtype == torch.int64 and sf.values().dtype == torch.int64 and sf.device.type == device.type
    csr = sf.to_csr()
    assert [t.tolist() for t in csr["user"]] == [[0, 2, 2, 3], [1, 5, 7], [0.5, 1.0, 2.0]]
    assert [t.tolist() for t in csr["item"]] == [[0, 0, 0, 0], [], []]
    assert csr["user"][0].device.type == device.type


def test_csr_of_an_empty_batch():
    sf = SparseFeatures.from_csr({"a": (T([0]), T([], dtype=torch.int64))})
    assert sf.batch_size == 0 and sf.to_csr()["a"][0].tolist() == [0]
    assert SparseFeatures.from_csr({}).batch_size == 0


@pytest.mark.parametrize(
    "features, message",
    [
        ({"a": (T([1, 2]), T([1]))}, "from_csr: feature 'a': offsets must start at 0, got 1"),
        ({"a": (T([0, 2, 1, 3]), T([1, 2, 3]))}, r"feature 'a': offsets decrease at sample 1 \(2 -> 1\)"),
        ({"a": (T([0, 1, 2]), T([1, 2, 3]))}, "feature 'a': offsets end at 2 but there are 3 ids"),
        ({"a": (T([[0, 1]]), T([1]))}, r"feature 'a': offsets must be 1-D \[B \+ 1\], got shape \(1, 2\)"),
        ({"a": (T([0.0, 1.0]), T([1]))}, "feature 'a': offsets must be integers, got torch.float32"),
        ({"a": (T([0, 1]), T([True]))}, "feature 'a': ids must be integers .* got torch.bool"),
        ({"a": (T([0, 1]), T([1]), T([1]))}, "feature 'a': weights must be floating point, got torch.int64"),
        ({"a": (T([0, 1]), T([1])), "b": (T([0, 1, 1]), T([2]))}, "feature 'b' has batch size 2, but feature 'a' has 1"),
        ({"a": (T([0, 1]),)}, r"feature 'a': expected \(row_offsets, values\[, weights\]\), got tuple"),
        ({"a": (T([0, 1]), T([1])), "b": (T([0, 1]), T([1], device="meta"))},
         "feature 'b': offsets are on cpu but ids are on meta"),
    ],
)
def test_from_csr_errors(features, message):
    with pytest.raises(InputError, match=message):
        SparseFeatures.from_csr(features)


def test_features_on_different_devices_are_refused():
    # the converters read offsets (no meta tensors there), so check the shared join directly
    from hugeembed.features._inputs import Part, assemble

    parts = [Part("a", T([1]), T([1]), None), Part("b", T([1], device="meta"), T([1], device="meta"), None)]
    with pytest.raises(InputError, match="from_x: feature 'b' is on meta, but feature 'a' is on cpu"):
        assemble(SparseFeatures, parts, "from_x")

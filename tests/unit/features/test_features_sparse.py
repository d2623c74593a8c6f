"""SparseFeatures core: accessors, select/permute, split/concat, device moves, constructor errors."""

from __future__ import annotations

import pytest
import torch

from features_oracle import build, lists_of, weight_lists_of
from hugeembed.errors import InputError
from hugeembed.features import JaggedFeature, SparseFeatures

DOC = {"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]}
DOC_W = {"user": [[0.5, 1.0], [], [2.0]], "item": [[1.5], [0.25, 3.0, 4.0], [-1.0]]}


def test_layout_of_the_docstring_example(device):
    sf = build(DOC, DOC_W, device=device)
    assert sf.keys() == ("user", "item")
    assert sf.batch_size == 3 and sf.num_features == 2 and len(sf) == 2
    assert sf.values().tolist() == [1, 5, 7, 2, 2, 3, 9, 4]
    assert sf.offsets().tolist() == [0, 2, 2, 3, 4, 7, 8]
    assert sf.lengths().tolist() == [2, 0, 1, 1, 3, 1]
    assert sf.lengths_per_feature().tolist() == [[2, 0, 1], [1, 3, 1]]
    assert "user" in sf and "geo" not in sf and list(sf) == ["user", "item"]
    item = sf.feature("item")
    assert item.name == "item" and item.batch_size == 3
    assert item.values.tolist() == [2, 2, 3, 9, 4] and item.offsets.tolist() == [0, 1, 4, 5]
    assert item.weights.tolist() == [1.5, 0.25, 3.0, 4.0, -1.0]
    assert sf["user"].lengths().tolist() == [2, 0, 1]
    assert sf.device.type == device.type


def test_lengths_constructor_matches_offsets_constructor():
    for dtype in (torch.int32, torch.int64):
        sf = SparseFeatures(["a", "b"], torch.arange(4), lengths=torch.tensor([1, 0, 2, 1], dtype=dtype))
        assert sf.offsets().tolist() == [0, 1, 1, 3, 4] and sf.offsets().dtype == dtype


def test_weights_contract():
    sf = build(DOC)
    assert sf.weights_or_none() is None
    with pytest.raises(InputError, match="no weights"):
        sf.weights()


def test_unknown_feature_lists_known_ones():
    with pytest.raises(KeyError, match=r"'geo'.*\['user', 'item'\]"):
        build(DOC).feature("geo")


def test_locations_of_bags_and_ids():
    sf = build(DOC)
    assert [sf.bag_location(i) for i in range(6)] == [("user", 0), ("user", 1), ("user", 2),
                                                       ("item", 0), ("item", 1), ("item", 2)]
    # id 2 is the first id after the empty bag of user sample 1
    assert [sf.id_location(p) for p in range(8)] == [("user", 0), ("user", 0), ("user", 2), ("item", 0),
                                                      ("item", 1), ("item", 1), ("item", 1), ("item", 2)]


@pytest.mark.parametrize("offsets_dtype", [torch.int32, torch.int64])
def test_select_and_permute_against_oracle(device, offsets_dtype):
    batch = {"a": [[1], [], [2, 3]], "b": [[], [], []], "c": [[4, 5, 6], [7], []]}
    weights = {k: [[float(v) / 2 for v in row] for row in rows] for k, rows in batch.items()}
    sf = build(batch, weights, offsets_dtype=offsets_dtype, device=device)
    got = sf.select(["c", "a"])
    assert got.keys() == ("c", "a") and got.batch_size == 3
    assert lists_of(got) == {"c": batch["c"], "a": batch["a"]}
    assert weight_lists_of(got) == {"c": weights["c"], "a": weights["a"]}
    assert got.offsets().dtype == offsets_dtype and got.device.type == device.type
    assert lists_of(sf.permute([1])) == {"b": batch["b"]}
    assert sf.permute([]).keys() == () and sf.permute([]).batch_size == 3


def test_permute_and_select_on_an_empty_batch():
    # regression: with B == 0 permute indexed the first offset of each feature in an empty
    # [F, 0] view and failed with "index out of range"
    sf = SparseFeatures(["a", "b"], torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int32))
    got = sf.permute([1, 0])
    assert got.keys() == ("b", "a") and got.batch_size == 0 and got.offsets().tolist() == [0]
    assert sf.select(["b"]).keys() == ("b",)


def test_permute_errors():
    sf = build(DOC)
    with pytest.raises(IndexError, match="position 2 out of range for 2 features"):
        sf.permute([0, 2])
    with pytest.raises(InputError, match=r"duplicate feature names \['user'\]"):
        sf.permute([0, 0])
    with pytest.raises(KeyError, match="'geo'"):
        sf.select(["geo"])


def test_split_and_concat_by_hand():
    sf = build(DOC, DOC_W)
    first, empty, rest = sf.split([1, 0, 2])
    assert lists_of(first) == {"user": [[1, 5]], "item": [[2]]}
    assert empty.batch_size == 0 and lists_of(empty) == {"user": [], "item": []}
    assert lists_of(rest) == {"user": [[], [7]], "item": [[2, 3, 9], [4]]}
    assert weight_lists_of(rest) == {"user": [[], [2.0]], "item": [[0.25, 3.0, 4.0], [-1.0]]}
    assert [p.batch_size for p in sf.split(2)] == [2, 1]
    joined = SparseFeatures.concat_batches([first, empty, rest])
    assert lists_of(joined) == DOC and weight_lists_of(joined) == DOC_W


def test_split_errors():
    sf = build(DOC)
    with pytest.raises(ValueError, match=r"split sizes \[1, 1\] must be >= 0 and sum to the batch size 3"):
        sf.split([1, 1])
    with pytest.raises(ValueError, match="split size must be > 0, got 0"):
        sf.split(0)


def test_concat_errors():
    sf = build(DOC)
    with pytest.raises(ValueError, match="at least one batch"):
        SparseFeatures.concat_batches([])
    with pytest.raises(InputError, match=r"batch 1 has features \('item',\)"):
        SparseFeatures.concat_batches([sf, sf.select(["item"])])
    with pytest.raises(InputError, match="every batch has weights or none"):
        SparseFeatures.concat_batches([sf, build(DOC, DOC_W)])


def test_no_features_keeps_its_batch_size():
    sf = SparseFeatures([], torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64), batch_size=4)
    assert sf.batch_size == 4 and [p.batch_size for p in sf.split([3, 1])] == [3, 1]
    assert SparseFeatures.concat_batches(sf.split(2)).batch_size == 4


def test_no_features_with_weights_keeps_them_through_split_and_concat():
    # regression: split and concat_batches dropped the (empty) weights of a batch without features
    sf = SparseFeatures([], torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64),
                        weights=torch.zeros(0), batch_size=3)
    parts = sf.split([1, 2])
    assert all(p.weights_or_none() is not None for p in parts)
    assert SparseFeatures.concat_batches(parts).weights().numel() == 0


def test_to_same_device_is_identity_and_meta_moves(device):
    sf = build(DOC, DOC_W, device=device)
    assert sf.to(device) is sf
    meta = sf.to("meta")
    assert meta.device.type == "meta" and meta.offsets().device.type == "meta"
    assert meta.weights().device.type == "meta" and meta.batch_size == 3


def test_to_moves_every_tensor_not_only_values():
    # regression: to() looked at the values' device only and kept offsets elsewhere
    sf = SparseFeatures(["a"], torch.zeros(2, dtype=torch.int64, device="meta"), offsets=torch.tensor([0, 2]),
                        weights=torch.ones(2))
    moved = sf.to("meta")
    assert moved is not sf
    assert {t.device.type for t in (moved.values(), moved.offsets(), moved.weights())} == {"meta"}


def test_jagged_feature_round_trip():
    jf = JaggedFeature(torch.tensor([1, 5, 7]), torch.tensor([0, 2, 2, 3]), name="user")
    assert jf.batch_size == 3 and jf.lengths().tolist() == [2, 0, 1]
    assert lists_of(jf.to_features()) == {"user": [[1, 5], [], [7]]}


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(keys=["a", "a"], offsets=torch.tensor([0, 0, 0])), r"duplicate feature names \['a'\]"),
        (dict(keys=["a"]), "exactly one of offsets= or lengths="),
        (dict(keys=["a"], offsets=torch.tensor([0]), lengths=torch.tensor([0])), "exactly one of"),
        (dict(keys=["a"], offsets=[0, 0]), "offsets must be a tensor, got list"),
        (dict(keys=["a", "b"], offsets=torch.tensor([0, 0, 0, 0])), "3 bags do not split evenly over 2 features"),
        (dict(keys=["a"], offsets=torch.tensor([0, 0, 0]), batch_size=3), "batch_size=3 but offsets describe 2"),
        (dict(keys=[], offsets=torch.tensor([0, 0, 0])), "no features, but offsets describe 2 bags"),
        (dict(keys=[], offsets=torch.tensor([0]), batch_size=-1), "batch_size must be >= 0, got -1"),
        (dict(keys=["a"], offsets=torch.tensor([0, 0]), weights=torch.ones(2)), r"one weight per id \(0\)"),
    ],
)
def test_constructor_errors(kwargs, message):
    keys = kwargs.pop("keys")
    with pytest.raises(InputError, match=message):
        SparseFeatures(keys, torch.zeros(0, dtype=torch.int64), **kwargs)


def test_constructor_rejects_non_1d_values():
    with pytest.raises(InputError, match="values must be a 1-D tensor"):
        SparseFeatures(["a"], torch.zeros(1, 1, dtype=torch.int64), offsets=torch.tensor([0, 1]))

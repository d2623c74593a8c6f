"""validate(): every bad input gives an InputError (a ValueError) naming the feature and the value."""

from __future__ import annotations

import pytest
import torch

from features_oracle import build
from hugeembed.errors import InputError
from hugeembed.features import SparseFeatures

DOC = {"user": [[1, 5], [], [7]], "item": [[2], [2, 3, 9], [4]]}


def make(values=None, offsets=None, weights=None, keys=("user", "item")):
    values = torch.tensor([1, 5, 7, 2, 2, 3, 9, 4]) if values is None else values
    offsets = torch.tensor([0, 2, 2, 3, 4, 7, 8]) if offsets is None else offsets
    return SparseFeatures(list(keys), values, offsets=offsets, weights=weights)


def test_valid_batches_pass_and_chain(device):
    sf = build(DOC, device=device)
    assert sf.validate() is sf
    build(DOC, {k: [[1.0] * len(r) for r in rows] for k, rows in DOC.items()}, offsets_dtype=torch.int32,
          device=device).validate()
    SparseFeatures([], torch.zeros(0, dtype=torch.int64), offsets=torch.zeros(1, dtype=torch.int64),
                   batch_size=3).validate()
    build({"a": [], "b": []}, b=0).validate()


def test_error_is_a_value_error():
    with pytest.raises(ValueError):
        make(values=torch.tensor([1, 5, 7, 2, 2, 3, 9, 4], dtype=torch.int32)).validate()


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(values=torch.tensor([1, 5, 7, 2, 2, 3, 9, 4], dtype=torch.int32)),
         r"\['user', 'item'\]: ids must be int64, got torch.int32"),
        (dict(values=torch.tensor([1.0, 5, 7, 2, 2, 3, 9, 4])), r"\['user', 'item'\]: ids must be int64, got torch.float32"),
        (dict(offsets=torch.tensor([0, 2, 2, 3, 4, 7, 8], dtype=torch.int16)),
         r"\['user', 'item'\]: offsets must be int32 or int64, got torch.int16"),
        (dict(offsets=torch.tensor([1, 2, 2, 3, 4, 7, 8])), "feature 'user' sample 0: offsets must start at 0, got 1"),
        # item sample 1 ends before it starts
        (dict(offsets=torch.tensor([0, 2, 2, 3, 4, 3, 8])),
         r"feature 'item': offsets decrease at sample 1 \(4 -> 3\)"),
        (dict(offsets=torch.tensor([0, 2, 1, 3, 4, 7, 8])),
         r"feature 'user': offsets decrease at sample 1 \(2 -> 1\)"),
        (dict(offsets=torch.tensor([0, 2, 2, 3, 4, 7, 7])),
         r"feature 'item': lengths sum to 7 \(the last offset\) but there are 8 ids"),
        (dict(weights=torch.ones(8, dtype=torch.int64)), "weights must be floating point, got torch.int64"),
        (dict(weights=torch.tensor([1.0, 1, 1, 1, 1, float("nan"), 1, 1])),
         "feature 'item': weight nan of id 3 at sample 1 is not finite"),
        (dict(weights=torch.tensor([1.0, 1, float("-inf"), 1, 1, 1, 1, 1])),
         "feature 'user': weight -inf of id 7 at sample 2 is not finite"),
    ],
)
def test_bad_inputs(kwargs, message):
    with pytest.raises(InputError, match=message):
        make(**kwargs).validate()


def test_tensors_on_different_devices():
    sf = make(weights=torch.ones(8, device="meta"))
    with pytest.raises(InputError, match=r"different devices \(values on cpu, offsets on cpu, weights on meta\)"):
        sf.validate()
    sf = make(offsets=torch.tensor([0, 2, 2, 3, 4, 7, 8], device="meta"))
    with pytest.raises(InputError, match="values on cpu, offsets on meta"):
        sf.validate()


def test_offsets_not_starting_at_zero_without_samples():
    sf = SparseFeatures([], torch.zeros(0, dtype=torch.int64), offsets=torch.tensor([2]), batch_size=0)
    with pytest.raises(InputError, match=r"SparseFeatures \[\]: offsets must start at 0, got 2"):
        sf.validate()

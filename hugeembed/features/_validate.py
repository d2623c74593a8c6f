"""Opt-in validation of SparseFeatures: one pass over the data, exact error messages."""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["validate_features"]

_OFFSET_DTYPES = (torch.int32, torch.int64)


def validate_features(sf) -> None:
    """Raises InputError (a ValueError) naming the feature, sample and value at fault."""
    values, offsets, weights = sf.values(), sf.offsets(), sf.weights_or_none()
    keys = sf.keys()
    if values.dtype != torch.int64:
        raise InputError(f"SparseFeatures {list(keys)}: ids must be int64, got {values.dtype}")
    if offsets.dtype not in _OFFSET_DTYPES:
        raise InputError(f"SparseFeatures {list(keys)}: offsets must be int32 or int64, got {offsets.dtype}")
    devices = {t.device for t in (values, offsets, weights) if t is not None}
    if len(devices) > 1:
        raise InputError(f"SparseFeatures {list(keys)}: values, offsets and weights are on different devices {devices}")
    first = int(offsets[0])
    if first != 0:
        raise InputError(f"SparseFeatures {list(keys)}: offsets must start at 0, got {first}")
    diffs = offsets[1:] - offsets[:-1]
    if diffs.numel() and bool((diffs < 0).any()):
        bag = int(torch.nonzero(diffs < 0)[0, 0])
        feature, sample = sf.bag_location(bag)
        raise InputError(
            f"feature {feature!r}: offsets decrease at sample {sample} "
            f"({int(offsets[bag])} -> {int(offsets[bag + 1])}); offsets must be non-decreasing"
        )
    last = int(offsets[-1])
    if last != values.numel():
        raise InputError(
            f"SparseFeatures {list(keys)}: lengths sum to {last} but there are {values.numel()} ids"
        )
    if weights is not None:
        if not weights.dtype.is_floating_point:
            raise InputError(f"SparseFeatures {list(keys)}: weights must be floating point, got {weights.dtype}")
        bad = ~torch.isfinite(weights)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0, 0])
            feature, sample = sf.id_location(pos)
            raise InputError(
                f"feature {feature!r}: weight {float(weights[pos])} of id {int(values[pos])} "
                f"at sample {sample} is not finite"
            )

"""Opt-in validation of SparseFeatures: one pass over the data, exact error messages."""

from __future__ import annotations

import torch

from ..errors import InputError

__all__ = ["validate_features", "check_layout"]

_OFFSET_DTYPES = (torch.int32, torch.int64)


def validate_features(sf) -> None:
    """Raises InputError (a ValueError) naming the feature, sample and value at fault.

    Checks, in order: id and offset dtypes, one device for values/offsets/weights, offsets
    starting at 0 and never decreasing, the last offset equal to the number of ids, and
    weights that are floating point and finite (a batch on the meta device, which has
    shapes but no data, gets the dtype and device checks only). Ids and offsets are shared by every
    feature, so a dtype or device error names them all.
    """
    values, weights = sf.values(), sf.weights_or_none()
    where = f"SparseFeatures {list(sf.keys())}"
    if values.dtype != torch.int64:
        raise InputError(f"{where}: ids must be int64, got {values.dtype} (convert with values.long())")
    if not check_layout(sf):
        return  # shape-only: a meta batch has no offsets or weights to read
    if weights is not None:
        if not weights.dtype.is_floating_point:
            raise InputError(f"{where}: weights must be floating point, got {weights.dtype}")
        bad = ~torch.isfinite(weights)
        if bool(bad.any()):
            pos = int(torch.nonzero(bad)[0, 0])
            feature, sample = sf.id_location(pos)
            raise InputError(
                f"feature {feature!r}: weight {float(weights[pos])} of id {int(values[pos])} "
                f"at sample {sample} is not finite"
            )


def check_layout(sf) -> bool:
    """The offsets part of validate(): dtype, one device, starting at 0, never decreasing,
    ending at len(values).  What every converter out of a batch needs before it reads the
    bags.  Returns False for a batch on the meta device (shapes only, nothing to read).
    """
    values, offsets, weights = sf.values(), sf.offsets(), sf.weights_or_none()
    keys = list(sf.keys())
    where = f"SparseFeatures {keys}"
    if offsets.dtype not in _OFFSET_DTYPES:
        raise InputError(f"{where}: offsets must be int32 or int64, got {offsets.dtype}")
    placed = {"values": values.device, "offsets": offsets.device}
    if weights is not None:
        placed["weights"] = weights.device
    if len(set(placed.values())) > 1:
        got = ", ".join(f"{name} on {dev}" for name, dev in placed.items())
        raise InputError(f"{where}: tensors are on different devices ({got}); move them to one device")
    if values.device.type == "meta":
        return False
    first = int(offsets[0])
    if first != 0:
        owner = f"feature {keys[0]!r} sample 0" if keys and sf.batch_size else where
        raise InputError(f"{owner}: offsets must start at 0, got {first}")
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
        owner = f"feature {keys[-1]!r}" if keys and sf.batch_size else where
        raise InputError(
            f"{owner}: lengths sum to {last} (the last offset) but there are {values.numel()} ids"
        )
    return True

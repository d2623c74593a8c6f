"""Checks shared by the converters: coerce ids and weights, agree on batch size and device.

Every function raises :class:`~hugeembed.errors.InputError` whose message starts with
``what`` (the converter and the feature), so the user sees which input is wrong.
"""

from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import torch

from ..errors import InputError

__all__ = [
    "Part",
    "as_tensor",
    "refuse_meta",
    "as_ids",
    "as_index",
    "as_weights",
    "names",
    "first_true",
    "bag_positions",
    "offsets_to_lengths",
    "assemble",
]

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


class Part(NamedTuple):
    """One feature ready to be joined: int64 ids, int64 lengths [B], optional weights."""

    name: str
    values: torch.Tensor
    lengths: torch.Tensor
    weights: torch.Tensor | None


def refuse_meta(t: torch.Tensor, what: str) -> None:
    """InputError for a meta tensor where its values must be read (it has shapes, no data)."""
    if t.device.type == "meta":
        raise InputError(f"{what}: the tensor is on the meta device, which holds no values to read; "
                         "build the batch on a real device (meta batches are for shapes only)")


def as_tensor(x: Any, what: str) -> torch.Tensor:
    """`x` as a tensor (tensors pass through; lists and NumPy arrays are converted)."""
    if isinstance(x, torch.Tensor):
        return x
    try:
        return torch.as_tensor(x)
    except (TypeError, ValueError, RuntimeError) as e:
        raise InputError(f"{what}: expected a tensor, got {type(x).__name__} ({e})") from None


def as_ids(x: Any, what: str, ndim: int = 1) -> torch.Tensor:
    """Integer ids as int64; floats and bools are refused (they would truncate silently)."""
    t = as_tensor(x, what)
    if t.dtype not in INT_DTYPES:
        raise InputError(f"{what}: ids must be integers (int32 or int64), got {t.dtype}")
    if t.dim() != ndim:
        raise InputError(f"{what}: ids must be a {ndim}-D tensor, got shape {tuple(t.shape)}")
    return t.to(torch.int64)


def as_index(x: Any, what: str, label: str) -> torch.Tensor:
    """An integer index tensor (row indices, offsets) as int64."""
    t = as_tensor(x, what)
    if t.dtype not in INT_DTYPES:
        raise InputError(f"{what}: {label} must be integers, got {t.dtype}")
    return t.to(torch.int64)


def as_weights(x: Any, ids: torch.Tensor, what: str) -> torch.Tensor:
    """Float weights with the shape and device of `ids` (one weight per id)."""
    t = as_tensor(x, what)
    if not t.dtype.is_floating_point:
        raise InputError(f"{what}: weights must be floating point, got {t.dtype}")
    if t.shape != ids.shape:
        raise InputError(
            f"{what}: weights have shape {tuple(t.shape)} but ids have shape {tuple(ids.shape)}; "
            "give one weight per id"
        )
    if t.device != ids.device:
        raise InputError(f"{what}: weights are on {t.device} but ids are on {ids.device}")
    return t


def names(keys: Any, what: str) -> list[str]:
    """Feature names as a list; a single string is one name (not its characters)."""
    if isinstance(keys, str):
        return [keys]
    try:
        out = list(keys)
    except TypeError:
        raise InputError(f"{what}: keys must be a feature name or a sequence of names, got {keys!r}") from None
    bad = [k for k in out if not isinstance(k, str)]
    if bad:
        raise InputError(f"{what}: feature names must be strings, got {bad[0]!r}")
    return out


def first_true(mask: torch.Tensor) -> int | None:
    """Flat position of the first True in `mask`, or None (one device sync)."""
    if mask.numel() == 0 or not bool(mask.any()):
        return None
    return int(torch.nonzero(mask.reshape(-1))[0, 0])


def bag_positions(offsets: torch.Tensor, num_ids: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each id: its bag number and its position inside the bag (both int64 ``[num_ids]``).

    ``offsets`` is ``[num_bags + 1]`` and starts at 0. Vectorised: no loop over bags.
    """
    offsets = offsets.to(torch.int64)
    lengths = offsets[1:] - offsets[:-1]
    bags = torch.arange(lengths.numel(), dtype=torch.int64, device=offsets.device)
    bag = torch.repeat_interleave(bags, lengths, output_size=num_ids)
    col = torch.arange(num_ids, dtype=torch.int64, device=offsets.device) - offsets[:-1][bag]
    return bag, col


def offsets_to_lengths(offsets: Any, num_ids: int, what: str) -> torch.Tensor:
    """Checks CSR row offsets ``[B + 1]`` against `num_ids` and returns int64 lengths ``[B]``."""
    offs = as_index(offsets, what, "offsets")
    if offs.dim() != 1 or offs.numel() < 1:
        raise InputError(f"{what}: offsets must be 1-D [B + 1], got shape {tuple(offs.shape)}")
    refuse_meta(offs, what)
    first, last = int(offs[0]), int(offs[-1])
    if first != 0:
        raise InputError(f"{what}: offsets must start at 0, got {first}")
    lengths = offs[1:] - offs[:-1]
    bad = first_true(lengths < 0)
    if bad is not None:
        raise InputError(
            f"{what}: offsets decrease at sample {bad} ({int(offs[bad])} -> {int(offs[bad + 1])}); "
            "offsets must be non-decreasing"
        )
    if last != num_ids:
        raise InputError(f"{what}: offsets end at {last} but there are {num_ids} ids")
    return lengths


def assemble(cls, parts: Sequence[Part], what: str, batch_size: int | None = None,
             device: torch.device | None = None):
    """Joins per-feature parts into one `cls` (SparseFeatures), feature-major, int64 offsets.

    Checks that every feature has the same batch size, device and weights-or-not, and
    names the first feature that disagrees.
    """
    if batch_size is not None and batch_size < 0:
        raise InputError(f"{what} {[p.name for p in parts]}: batch_size must be >= 0, got {batch_size}")
    ref = f"batch_size={batch_size}" if batch_size is not None else None
    for p in parts:
        b = p.lengths.numel()
        if batch_size is None:
            batch_size, ref = b, f"feature {p.name!r}"
        elif b != batch_size:
            raise InputError(f"{what}: feature {p.name!r} has batch size {b}, but {ref} has {batch_size}")
    if batch_size is None:
        batch_size = 0
    if parts:
        device = parts[0].values.device
        for p in parts:
            if p.values.device != device or p.lengths.device != device:
                raise InputError(
                    f"{what}: feature {p.name!r} is on {p.values.device}, but feature "
                    f"{parts[0].name!r} is on {device}; move every feature to one device"
                )
        with_w = [p for p in parts if p.weights is not None]
        if with_w and len(with_w) != len(parts):
            lacking = next(p.name for p in parts if p.weights is None)
            raise InputError(
                f"{what}: feature {with_w[0].name!r} has weights but feature {lacking!r} has none; "
                "give weights for every feature or for none"
            )
        values = torch.cat([p.values for p in parts])
        lengths = torch.cat([p.lengths.to(torch.int64) for p in parts])
        weights = torch.cat([p.weights for p in parts]) if with_w else None  # type: ignore[misc]
    else:
        device = torch.device("cpu") if device is None else torch.device(device)
        values = torch.zeros(0, dtype=torch.int64, device=device)
        lengths = torch.zeros(0, dtype=torch.int64, device=device)
        weights = None
    offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64, device=device)
    torch.cumsum(lengths, 0, out=offsets[1:])
    return cls([p.name for p in parts], values, offsets=offsets, weights=weights, batch_size=batch_size)

"""One name per device: the one that tensors created there report."""

from __future__ import annotations

import torch

__all__ = ["canonical_device"]


def canonical_device(device: torch.device | str) -> torch.device:
    """`device` as a tensor created there reports it: ``"cuda"`` -> ``cuda:<current>``, ``"cpu:0"`` -> ``cpu``.

    torch.device("cuda") != torch.device("cuda:0"), yet a tensor moved to "cuda" lands on
    cuda:0: modules that keep a device and compare batches with it keep this form.
    """
    d = torch.device(device)
    if d.type == "cpu":
        return torch.device("cpu")
    if d.type == "cuda" and d.index is None and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return d

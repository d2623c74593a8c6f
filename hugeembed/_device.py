"""One name per device: the one that tensors created there report."""

from __future__ import annotations

import torch

__all__ = ["canonical_device", "host_to_device"]


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


def host_to_device(values, dtype: torch.dtype, device: torch.device | str) -> torch.Tensor:
    """``torch.tensor(values, dtype=dtype)`` on `device` without the host waiting for it.

    `values`: a list (or a CPU tensor) made on the host.  A blocking copy from pageable host
    memory to a GPU synchronizes the stream: the host waits for all the work queued before it,
    a stall like a read of the device.  A step's small host-made index arrays (table ids,
    bases, sizes) would pay one each.  Here a CUDA copy goes from page-locked memory with
    ``non_blocking`` (the caching host allocator keeps the staging block until the copy ran);
    on the CPU the tensor is made in place.
    """
    t = torch.as_tensor(values, dtype=dtype)
    device = torch.device(device)
    if device.type == "cpu":
        return t
    if device.type == "cuda":
        return t.pin_memory().to(device, non_blocking=True)
    return t.to(device)

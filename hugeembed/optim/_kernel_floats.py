"""Float operations of the torch twins that give the native kernels' bits."""

from __future__ import annotations

import torch


def sqrt_rn(t: torch.Tensor) -> torch.Tensor:
    """Correctly rounded square root, as the kernels' ``std::sqrt``.

    torch's vectorised CPU sqrt (Sleef on AVX2/AVX512) is accurate to ~0.5 ulp but not
    correctly rounded: on an AVX512 machine about 17% of float32 results differ from
    IEEE sqrt by one ulp.  A float32 square root computed in float64 (error below 2^-52
    relative) and rounded once IS correctly rounded: sqrt of a float32 is never within
    2^-50 (relative) of a float32 rounding midpoint.
    """
    if t.dtype == torch.float32 and t.device.type == "cpu":
        return t.double().sqrt_().float()
    return t.sqrt()


def rdiv(x: float, t: torch.Tensor) -> torch.Tensor:
    """``x / t`` element-wise by true division (Python's ``x / t`` computes ``t.reciprocal() * x``)."""
    return torch.full_like(t, x).div_(t)

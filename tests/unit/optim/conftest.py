"""Fixtures of the optimizer tests."""

from __future__ import annotations

import pytest

from ._optim_oracles import PRECISIONS


@pytest.fixture(params=sorted(PRECISIONS))
def precision(request):
    """(dtype, rtol, atol): float64 storage (torch twin) and float32 (native kernel on CPU)."""
    return PRECISIONS[request.param]

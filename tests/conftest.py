"""Shared test fixtures: devices to run on, hypothesis profiles, seeding."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# CI and local runs share one profile: enough examples to find edge cases, no
# per-example deadline (the machine is noisy; speed is measured by bench/, not here).
settings.register_profile(
    "default",
    max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
settings.load_profile("default")

torch.set_num_threads(min(2, torch.get_num_threads()))

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every device test runs on CPU, and on CUDA when present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

"""Shared test fixtures: devices to run on, hypothesis profiles, seeding."""

from __future__ import annotations

import os

import pytest
import torch
from hypothesis import HealthCheck, settings

# "default" (CI and plain `pytest`): derandomized, so a run is reproducible and CI is
# never turned red by a new random draw; no per-example deadline (the machine is
# noisy; speed is measured by bench/, not here).  "explore" draws fresh random
# examples, more of them, for hunting bugs locally: HYPOTHESIS_PROFILE=explore pytest
_common = dict(deadline=None, suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
settings.register_profile("default", derandomize=True,
                          max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "60")), **_common)
settings.register_profile("explore", derandomize=False,
                          max_examples=int(os.environ.get("HYPOTHESIS_MAX_EXAMPLES", "300")), **_common)
settings.load_profile(os.environ.get("HYPOTHESIS_PROFILE", "default"))

torch.set_num_threads(min(2, torch.get_num_threads()))

# Without CUDA the triton kernels run in triton's CPU interpreter; it must be chosen before triton
# is imported (triton.jit reads it when a kernel is defined).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


@pytest.fixture(params=DEVICES)
def device(request) -> torch.device:
    """Every device test runs on CPU, and on CUDA when present."""
    return torch.device(request.param)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield

"""Model tests run tiny tensors: one intra-op thread is faster than handing them to a pool
(on a loaded 2-core machine the hand-offs cost 10-20x the work)."""

from __future__ import annotations

import pytest
import torch


@pytest.fixture(autouse=True)
def _one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

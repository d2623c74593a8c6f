"""The batcher runs small model calls on one torch thread and large ones on the threads it was given."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np
import torch

from hugeembed.serving._batcher import SMALL_CALL_ROWS, Batcher, Pending
from hugeembed.serving._requests import ParsedRequest


class _Model:
    """Records the torch threads of each call; logits: the first dense column."""

    features = ("a",)

    def __init__(self) -> None:
        self.served = SimpleNamespace(version="v1")
        self.threads: list[int] = []

    def logits_raw(self, dense, values, offsets, served):
        self.threads.append(torch.get_num_threads())
        return dense[:, 0].clone()


def _pending(rows: int) -> Pending:
    dense = np.arange(rows, dtype=np.float32)[:, None]
    parsed = ParsedRequest(dense, np.zeros(rows, np.int64), np.arange(rows + 1, dtype=np.int64))
    return Pending(parsed, future=None)


def test_small_calls_run_on_one_thread_and_large_ones_on_all():
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        model = _Model()
        b = Batcher(model, max_batch_rows=4096, max_queue_rows=8192, max_wait_ms=0, on_batch=lambda *a: None)
        for rows in (1, SMALL_CALL_ROWS, SMALL_CALL_ROWS + 1, 3):
            batch = [_pending(rows)]
            results, version, cpu_ms = b._compute(batch, rows)
            assert version == "v1" and len(results[0]) == rows and cpu_ms >= 0
            np.testing.assert_allclose(results[0], torch.sigmoid(torch.arange(rows, dtype=torch.float32)).tolist())
        assert model.threads == [1, 1, 2, 1]
    finally:
        torch.set_num_threads(before)

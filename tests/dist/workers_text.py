"""What each rank runs in tests/dist/test_text_ranks.py: a FileSource over a Criteo text file whose
first dense column is the row's number, so the test can tell which rows every rank trained."""

from __future__ import annotations

from hugeembed.training import TrainConfig
from hugeembed.training._sources import FileSource


def train_rows(rank: int, world: int, workdir: str, data: str, eval_data: str, batch: int) -> list[list[int]]:
    """Each training batch of epoch 0 as the row numbers it holds, as the trainer would take them."""
    cfg = TrainConfig(data=[data], eval_data=[eval_data], batch_size=batch, dist_timeout=30.0)
    src = FileSource(cfg, rank, world)
    # Criteo's dense columns are read as log(1 + x)
    return [b.dense[:, 0].double().expm1().round().long().tolist() for b in src.train_batches(0)]

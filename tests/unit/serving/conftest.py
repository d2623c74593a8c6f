"""One trained run shared by the serving tests (a session: training is the slow part), and its exports.

DLRM d8 on synthetic Criteo (20 k ids per feature at most), 160 steps of 256 rows, a snapshot
every 40 steps, 1 in 4 full: step 40 is full, 80 / 120 / 160 are snapshot deltas.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from hugeembed.serving import export
from hugeembed.training import TrainConfig, Trainer, load_snapshot_model, make_source


def snapshot(run: Path, step: int) -> Path:
    return run / f"step-{step:09d}"


@pytest.fixture(scope="session")
def run(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("serving") / "run"
    cfg = TrainConfig(steps=160, batch_size=256, embedding_dim=8, checkpoint_dir=str(root), checkpoint_every=40,
                      full_checkpoint_every=4, keep_checkpoints=None, eval_every=0, eval_rows=8192,
                      synthetic_max_cardinality=20000, threads=1)
    Trainer(cfg, progress=None).fit()
    return root


@pytest.fixture(scope="session")
def artifacts(run, tmp_path_factory):
    """dtype -> artifact of the newest snapshot (exported on first use)."""
    out = tmp_path_factory.mktemp("artifacts")
    made: dict[str, Path] = {}

    def get(dtype: str) -> Path:
        if dtype not in made:
            made[dtype] = export(run, out / dtype, dtype=dtype)
        return made[dtype]

    return get


@pytest.fixture(scope="session")
def heldout(run):
    """(the trained model in eval mode, the run's held-out batches)."""
    model, cfg, _ = load_snapshot_model(run, device="cpu")
    return model, list(make_source(cfg).eval_batches())


def reference_probs(model, batches) -> torch.Tensor:
    with torch.no_grad():
        return torch.cat([torch.sigmoid(model(b.dense, b.sparse)) for b in batches])

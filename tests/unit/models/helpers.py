"""Small batches and a training loop shared by the model tests."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hugeembed.features import SparseFeatures

FEATURES = ("a", "b", "c")
NUM_DENSE = 4


def make_batch(B: int = 16, features=FEATURES, num_dense: int = NUM_DENSE, seed: int = 0, rows: int = 20,
               device: torch.device | str = "cpu"):
    """(dense [B, num_dense], sparse, labels [B]): mostly one id per bag, some two, one empty bag."""
    g = torch.Generator().manual_seed(seed)
    ids = {}
    for f in features:
        lens = torch.randint(1, 3, (B,), generator=g).tolist()
        lens[0] = 0 if f == features[0] else lens[0]  # an empty bag pools to zeros
        ids[f] = [torch.randint(0, rows, (k,), generator=g).tolist() for k in lens]
    dense = torch.rand(B, num_dense, generator=g)
    labels = (torch.rand(B, generator=g) < 0.4).float()
    return dense.to(device), SparseFeatures.from_lists(ids, device=device), labels.to(device)


def train(model, dense_params, dense, sparse, labels, steps: int = 20, lr: float = 0.01) -> list[float]:
    """`steps` full steps on one batch: tables in backward, Adam on the dense parameters."""
    opt = torch.optim.Adam(dense_params, lr=lr)
    losses = []
    for _ in range(steps):
        loss = F.binary_cross_entropy_with_logits(model(dense, sparse), labels)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def table_rows(collection, table: str, ids) -> torch.Tensor:
    """Current rows (weights only) of `ids` in a table; zeros where absent."""
    store = collection.store(table)
    slots = store.find(torch.as_tensor(ids, dtype=torch.int64, device=collection.device))
    return store.gather(slots)[:, : store.dim].clone()

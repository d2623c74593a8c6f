"""Shared pieces of the optimizer tests: batches with duplicate ids, our runner, torch.optim oracles.

A test problem is a table ``w0 [R, D]`` (float64) and a list of steps.  Each step
draws a batch of ids WITH duplicates from about half the rows of one parity
(even rows on odd steps, odd rows on even steps: every row is touched on
alternate steps at most, some rows not at all) and one gradient per id.  Our
optimizers get the per-unique-row sum (what the dedup stage produces); the
oracles get the per-id gradients and sum them their own way (a sparse COO
tensor that torch coalesces, or index_put with accumulate).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from hugeembed.optim import SparseOptimizer


@dataclass
class Step:
    step: int  # 1-based
    ids: torch.Tensor  # int64 [n], with duplicates
    per_id: torch.Tensor  # float64 [n, D]
    lr: float

    def summed(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(unique slots, per-slot summed gradient)."""
        slots, inv = torch.unique(self.ids, return_inverse=True)
        grad = torch.zeros(slots.numel(), self.per_id.shape[1], dtype=torch.float64).index_add_(0, inv, self.per_id)
        return slots, grad

    def dense(self, rows: int) -> torch.Tensor:
        return torch.zeros(rows, self.per_id.shape[1], dtype=torch.float64).index_put_(
            (self.ids,), self.per_id, accumulate=True)

    def sparse(self, rows: int) -> torch.Tensor:
        return torch.sparse_coo_tensor(self.ids[None], self.per_id, (rows, self.per_id.shape[1]))


def make_problem(rows: int = 16, dim: int = 5, n_steps: int = 8, *, seed: int = 0, batch: int = 24,
                 lr: float = 0.1, scale: float = 1.0) -> tuple[torch.Tensor, list[Step]]:
    gen = torch.Generator().manual_seed(seed)
    w0 = torch.randn(rows, dim, generator=gen, dtype=torch.float64)
    steps = []
    for k in range(n_steps):
        group = torch.arange(k % 2, rows, 2)
        pool = group[torch.randperm(group.numel(), generator=gen)[: max(2, group.numel() // 2)]]
        ids = pool[torch.randint(pool.numel(), (batch,), generator=gen)]
        per_id = torch.randn(batch, dim, generator=gen, dtype=torch.float64) * scale
        # A schedule: the lr drops halfway, so a wrong runtime lr shows.
        steps.append(Step(k + 1, ids, per_id, lr if k < n_steps // 2 else lr * 0.3))
    return w0, steps


def run_ours(opt: SparseOptimizer, w0: torch.Tensor, steps: list[Step], *, dtype=torch.float64,
             device="cpu", state_init: Callable[[torch.Tensor], None] | None = None) -> torch.Tensor:
    """Our optimizer over the problem; returns the storage [R, D + S] as float64 on CPU."""
    rows, dim = w0.shape
    S = opt.state_width(dim)
    storage = torch.zeros(rows, dim + S, dtype=dtype, device=device)
    storage[:, :dim] = w0.to(dtype)
    opt.init_state(storage[:, dim:])
    if state_init is not None:
        state_init(storage)
    for st in steps:
        slots, grad = st.summed()
        opt.apply(storage, slots.to(device), grad.to(device=device, dtype=dtype), lr=st.lr, step=st.step)
    return storage.cpu().double() if dtype != torch.float64 else storage.cpu()


def per_row_oracle(w0: torch.Tensor, steps: list[Step],
                   make_opt: Callable[[list[torch.nn.Parameter]], torch.optim.Optimizer],
                   before_step: Callable[[torch.optim.Optimizer, list, Step], None] | None = None):
    """torch.optim with one Parameter per row, stepped with grad None for untouched rows.

    torch optimizers skip a parameter whose grad is None: its weight AND its state
    stay put -- the lazy semantics.  Returns (weights [R, D], optimizer).
    """
    params = [torch.nn.Parameter(w0[r].clone()) for r in range(w0.shape[0])]
    opt = make_opt(params)
    for st in steps:
        dense = st.dense(w0.shape[0])
        touched = set(st.ids.tolist())
        for r, p in enumerate(params):
            p.grad = dense[r].clone() if r in touched else None
        for group in opt.param_groups:
            group["lr"] = st.lr
        if before_step is not None:
            before_step(opt, params, st)
        opt.step()
    return torch.stack([p.detach() for p in params]), opt


def table_oracle(w0: torch.Tensor, steps: list[Step], make_opt, *, sparse: bool):
    """torch.optim on the whole table as one Parameter (sparse or dense gradient every step)."""
    p = torch.nn.Parameter(w0.clone())
    opt = make_opt([p])
    # Checked sparse tensors (torch warns when the checks are left implicit).
    with torch.sparse.check_sparse_tensor_invariants(enable=True):
        for st in steps:
            p.grad = st.sparse(w0.shape[0]) if sparse else st.dense(w0.shape[0])
            for group in opt.param_groups:
                group["lr"] = st.lr
            opt.step()
    return p.detach(), opt


# (dtype, rtol, atol) of a run against a float64 oracle: float64 runs through the
# torch twin, float32 on CPU through the native kernel.
PRECISIONS = {
    "float64": (torch.float64, 1e-10, 1e-12),
    "float32": (torch.float32, 2e-4, 2e-5),
}

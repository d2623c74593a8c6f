"""Tiny batches for the triton kernel tests: a plan of static tables, a prepared batch, the kernels'
inputs read off it (the entries' ids and tables), and one row group laid out like a store's.

DEV: where the kernels run: CUDA when there is one (compiled kernels), else the CPU under triton's
interpreter (tests/conftest.py sets TRITON_INTERPRET=1 there)."""

from __future__ import annotations

import torch
from hypothesis import strategies as st

from hugeembed.features import SparseFeatures
from hugeembed.functional import FeatureSpec, TableSpec
from hugeembed.functional._plan import LookupPlan
from hugeembed.functional._reference import prepare_torch

COMBINERS = ("sum", "mean", "sqrtn")
DEV = torch.device("cuda" if torch.cuda.is_available() else "cpu")


@st.composite
def batches(draw, max_tables: int = 3, max_batch: int = 4, max_len: int = 5, dims=(3, 4)):
    """(plan, SparseFeatures): 1-3 static tables of a few rows (ids repeat: duplicates and hot rows),
    one pooled feature each (some share a table), bags of 0-5 ids, weights or not."""
    T = draw(st.integers(1, max_tables))
    dim = draw(st.sampled_from(dims))
    rows = [draw(st.integers(1, 6)) for _ in range(T)]
    tables = [TableSpec(f"t{i}", dim, num_rows=r) for i, r in enumerate(rows)]
    F = draw(st.integers(1, 3))
    feats = [FeatureSpec(f"f{k}", f"t{draw(st.integers(0, T - 1))}", combiner=draw(st.sampled_from(COMBINERS)),
                         out_of_range="prune") for k in range(F)]
    plan = LookupPlan(tables, feats)
    B = draw(st.integers(0, max_batch))
    lengths = [draw(st.integers(0, max_len)) for _ in range(F * B)]
    values = [draw(st.integers(-1, 6)) for _ in range(sum(lengths))]
    weighted = draw(st.booleans())
    w = torch.tensor([draw(st.sampled_from([0.5, 1.0, 2.0, 0.25, -1.0])) for _ in values], dtype=torch.float32)
    sf = SparseFeatures([f.name for f in feats], torch.tensor(values, dtype=torch.int64),
                        lengths=torch.tensor(lengths, dtype=torch.int64), weights=w if weighted else None,
                        batch_size=B)
    return plan, sf.to(DEV)


def entries(plan: LookupPlan, prep):
    """(ids int64 [N], table int32 [N], bag int64 [N]) of a prepared batch's kept entries."""
    n = prep.inverse.numel()
    dev = prep.offsets.device
    ids = prep.unique_keys[prep.inverse.long()] if n else torch.zeros(0, dtype=torch.int64, device=dev)
    pos = torch.arange(n, device=dev)
    bag = torch.searchsorted(prep.offsets, pos, right=True) - 1
    feature = bag // max(prep.batch_size, 1)
    table = plan.arrays(dev)["table"][feature].to(torch.int32)
    return ids, table, bag


def prepared(plan, sf):
    return prepare_torch(plan, sf)


def group_base(plan: LookupPlan) -> tuple[torch.Tensor, torch.Tensor, int]:
    """(table_base, table_rows, R) of all the plan's tables as one row group, in table order."""
    rows = [t.num_rows for t in plan.tables]
    base = [sum(rows[:i]) for i in range(len(rows))]
    return (torch.tensor(base, dtype=torch.int64, device=DEV), torch.tensor(rows, dtype=torch.int64, device=DEV),
            sum(rows))

"""Applying a delta costs memory for the rows it changes, not for the tables (issue 31, finding 5: on 78baa67 a
delta copied every table into RAM, 3-4x a table at peak): measured by counting the bytes of every tensor torch
allocates during the apply, against an artifact whose tables are many times larger than the delta's rows.
A failure half-way changes nothing."""

from __future__ import annotations


import numpy as np
import pytest
import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hugeembed.errors import ArtifactError
from hugeembed.serving import ServingModel, export, export_delta
from hugeembed.serving import _model
from hugeembed.serving._index import group_tables

from .conftest import snapshot
from .crafting import record, rewrite

KEEP = 48  # upserted keys kept per table (and 4 removed keys)
DELTA = "step-000000160"


class AllocatedBytes(TorchDispatchMode):
    """Sums the storage bytes of every tensor an op creates (not views or in-place results of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.total, self._seen = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in self._seen:
                    self._seen.add(ptr)
                    self.total += t.untyped_storage().nbytes()
        return out


@pytest.fixture(scope="module")
def small_delta(run, tmp_path_factory):
    """An fp32 artifact of step 120 and a delta to 160 cut down to KEEP upserted and 4 removed keys per table."""
    art = export(snapshot(run, 120), tmp_path_factory.mktemp("memory") / "art", dtype="fp32")
    d = export_delta(run, art)

    def trim(m):
        for t in m["tables"]:
            for field, n in (("upsert_keys", KEEP), ("upsert_rows", KEEP), ("removed_keys", 4)):
                rel = m["files"][f"{field}.{t['name']}"]["file"]
                np.save(d / rel, np.load(d / rel)[:n])
                m["files"][f"{field}.{t['name']}"] = record(d, rel)

    rewrite(d, trim)
    return art


def _table_bytes(tables) -> int:
    return sum(t.numel() * t.element_size() for part in tables.args() for t in part)


@pytest.mark.slow
def test_applying_a_delta_allocates_for_its_rows_not_for_the_tables(small_delta):
    model = ServingModel.load(small_delta, apply_deltas=False)
    from hugeembed.serving._delta import read_delta, read_header

    delta = read_delta(read_header(small_delta / "deltas" / DELTA, None), model.manifest, model.dense_spec)
    dense = sum(t.numel() * t.element_size() for t in delta.dense.values())
    rows = delta.nbytes - dense  # the delta's table part: keys and rows
    tables = _table_bytes(model.served.tables)
    assert tables > 20 * rows, (tables, rows)  # the artifact is many times larger than the delta
    with AllocatedBytes() as counted:
        assert model.reload() == [DELTA]
    # the dense weights are read once (a copy); the rows: read, merged into the patch, its index, a few small
    # tensors per table.  78baa67 copied every table of the group, 3-4x at its peak
    beyond_dense = counted.total - dense
    assert beyond_dense <= 16 * rows + (256 << 10), (beyond_dense, rows, tables)
    assert beyond_dense < tables / 2, (beyond_dense, tables)
    patch = [p for p in model.served.patch if p is not None]
    assert sum(p.nbytes for p in patch) <= 4 * rows + (64 << 10)  # what stays: the changed rows, beside the base


def test_the_patch_of_a_huge_table_costs_what_the_delta_changes():
    """merge_patch alone, over a base group of 4 M static rows (64 MB) and a dynamic table: the allocation
    follows the 1000 rows a delta changes, whatever the size of the tables."""
    from hugeembed.serving._patch import merge_patch

    n_static, width = 4_000_000, 16  # int8 rows of dim 8: 8 bytes, then a float32 scale and bias
    group = {"tables": ["big", "users"], "table_keys": [-1, 0], "table_rows": [n_static, 0], "table_shared": [0, 1],
             "dim": 8}
    keys = torch.cat([torch.tensor([-1]), torch.arange(50_000) * 7])  # the shared row, then 50 k ids
    rows = torch.zeros(n_static + keys.numel() + 1, width, dtype=torch.uint8)
    _, _, _, meta = group_tables(group, [n_static, keys.numel()], rows, keys)
    g = torch.Generator().manual_seed(0)
    upserts = {"big": (torch.randperm(n_static, generator=g)[:500], torch.ones(500, width, dtype=torch.uint8)),
               "users": (torch.arange(500) * 7 + 1, torch.full((500, width), 2, dtype=torch.uint8))}
    removed = {"big": torch.zeros(0, dtype=torch.int64), "users": torch.arange(20) * 7}
    with AllocatedBytes() as counted:
        patch = merge_patch(group, rows, meta, None, upserts, removed)
    changed = 1020 * (width + 8)  # rows and keys
    assert counted.total <= 64 * changed, (counted.total, changed)
    assert counted.total < rows.numel() / 100
    assert patch.keys.numel() == 1020 and bool(patch.removed.sum() == 20)


@pytest.mark.parametrize("where", ["merge_patch", "version_program"])
def test_a_failure_half_way_changes_nothing(small_delta, monkeypatch, where):
    model = ServingModel.load(small_delta, apply_deltas=False)
    before = model.served

    def fails(*args, **kwargs):  # the rows read and checked; the patch being built, or built and the program next
        raise MemoryError("out of memory half-way")

    monkeypatch.setattr(_model, where, fails)
    with pytest.raises(ArtifactError, match="MemoryError: out of memory half-way"):
        model.reload()
    assert model.served is before and model.version == "step-000000120"  # the same object: nothing changed
    assert model.refused.delta == DELTA
    monkeypatch.undo()
    (small_delta / "deltas" / DELTA / "manifest.json").touch()
    assert model.reload() == [DELTA] and model.served is not before
    assert all(torch.equal(a, b) for a, b in zip(model.served.tables.rows, before.tables.rows))  # base untouched

"""bench/delta.py as a correctness check (not timed): its synthetic group and delta are what it claims, its
memory count sees a copy of the tables, and the patched lookup it times reads the patch's rows."""

from __future__ import annotations

import torch

from hugeembed.serving import _runtime
from hugeembed.serving._patch import effective_rows

from ._load import load_bench


def test_the_counted_apply_follows_the_delta_and_the_patch_holds_its_rows():
    bench = load_bench("delta")
    small, large = (bench.apply_memory(n, 200, 8, "int8") for n in (20_000, 80_000))
    assert large["table_mb"] > 3.5 * small["table_mb"]
    assert large["alloc_mb"] < 1.5 * small["alloc_mb"]  # the tables grew 4x, the apply did not
    group, rows, keys, index, meta, patch = large.pop("state")
    upserts, removed = bench.make_delta(group, rows, keys, 200)
    tables = _runtime.Tables([rows], [keys], [index], [meta])
    for t, name in enumerate(group["tables"]):  # the version reads the delta's rows and the miss row for removed
        got = effective_rows(tables, (patch,), 0, t, upserts[name][0])
        assert torch.equal(got, upserts[name][1])
    gone = effective_rows(tables, (patch,), 0, 1, removed["users"])
    assert torch.equal(gone, rows[int(meta[1, _runtime.MISS_ROW])].expand_as(gone))


def test_the_counter_sees_a_copy_of_the_tables():
    bench = load_bench("delta")
    rows = torch.zeros(1000, 40, dtype=torch.uint8)
    with bench.AllocatedBytes() as counted:
        rows.clone()
    assert counted.total == rows.numel()

"""Static tables sharing one RowBlock train exactly as tables with storage of their own.

The block is a layout: one gather, one count and one optimizer call for all of its tables
on the torch path (any device), the same arithmetic per row.  The oracle is the same
collection built with every table in tensors of its own (the path the rest of the suite
checks against torch.optim and EmbeddingBag).
"""

from __future__ import annotations

import pytest
import torch

from hugeembed import _native
from hugeembed.features import SparseFeatures
from hugeembed.functional import _reference
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import make_optimizer
from hugeembed.optim._registry import NAMES

from tests.conftest import DEVICES

MIXED = [("a", 8, 30), ("b", 8, 17), ("c", 4, 25), ("d", 8, 40), ("e", 8, None), ("f", 4, 12)]
UNIFORM = [("a", 8, 30), ("b", 8, 17), ("c", 8, 25), ("d", 8, 40)]  # one block: one gather for all


def build(device, backend, optimizer, blocks: bool, monkeypatch, tables=MIXED) -> EmbeddingCollection:
    monkeypatch.setattr(EmbeddingCollection, "_share_static_storage", blocks)
    cfgs = [TableConfig(n, d, num_rows=r, combiner="mean" if n == "b" else "sum") for n, d, r in tables]
    return EmbeddingCollection(cfgs, optimizer=make_optimizer(optimizer, lr=0.05), device=device, seed=4,
                               backend=backend)


def batches(device, n: int = 5, B: int = 6, tables=MIXED):
    g = torch.Generator().manual_seed(11)
    out = []
    for _ in range(n):
        ids = {}
        for name, _, rows in tables:
            lens = torch.randint(0, 4, (B,), generator=g).tolist()
            ids[name] = [torch.randint(0, rows or 1000, (k,), generator=g).tolist() for k in lens]
        out.append(SparseFeatures.from_lists(ids, device=device))
    return out


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kernels", [True, False])  # False: the torch path alone, as on a GPU
@pytest.mark.parametrize("tables", ["mixed", "uniform"])
@pytest.mark.parametrize("optimizer", sorted(NAMES))
def test_tables_in_a_block_train_as_tables_apart(device, kernels, tables, optimizer, monkeypatch):
    if not kernels:
        monkeypatch.setattr(_native, "available", lambda: False)
    spec = MIXED if tables == "mixed" else UNIFORM
    gathers = []
    block_rows = _reference._block_rows
    monkeypatch.setattr(_reference, "_block_rows", lambda *a: gathers.append(r := block_rows(*a)) or r)
    blocked = build(device, "auto", optimizer, True, monkeypatch, spec)
    apart = build(device, "auto", optimizer, False, monkeypatch, spec)
    in_block = [t.name for t, s in zip(blocked.tables, blocked._stores) if getattr(s, "block_rows", lambda: None)()]
    # the static tables: in MIXED a block of width 8 and one of width 4
    assert in_block == [n for n, _, r in spec if r is not None]
    assert apart._row_blocks() is None
    g = torch.Generator().manual_seed(5)
    names = [n for n, _, _ in spec]
    for sf in batches(device, tables=spec):
        ob, oa = blocked(sf), apart(sf)
        for k in names:
            assert torch.equal(ob[k], oa[k]), k
        y = torch.randn(ob.concat().shape, generator=g).to(device)
        for o in (ob, oa):
            ((o.concat() - y) ** 2).sum().backward()
    sb, sa = blocked.state_dict(), apart.state_dict()
    assert sb.keys() == sa.keys()
    for k in sb:
        assert torch.equal(sb[k], sa[k]), k
    # the one-gather path ran where it can: the torch path over one block of one dim
    torch_path = not kernels or torch.device(device).type != "cpu"
    assert any(r is not None for r in gathers) == (tables == "uniform" and torch_path)


def test_a_block_is_left_when_a_table_is_loaded_or_moved(monkeypatch):
    """A store whose rows were replaced (load_state_dict, .to()) no longer counts as the block's:
    the lookup takes its own rows, and training stays exact."""
    blocked = build("cpu", "torch", "adagrad", True, monkeypatch)
    apart = build("cpu", "torch", "adagrad", False, monkeypatch)
    blocked.load_state_dict(apart.state_dict())  # rows copied in place or replaced: either way exact
    for sf in batches("cpu", n=3):
        for c in (blocked, apart):
            c(sf).concat().pow(2).sum().backward()
    for k, v in blocked.state_dict().items():
        assert torch.equal(v, apart.state_dict()[k]), k

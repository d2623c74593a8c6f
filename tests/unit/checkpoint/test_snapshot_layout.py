"""Snapshots of tables with typed row layouts: raw packed rows round-trip bit for bit, a resume
continues exactly, and a snapshot whose layout differs from the model's is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from hugeembed.checkpoint import load, save
from hugeembed.errors import CheckpointError
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import Adagrad, Adam

from .helpers import tables_equal


def _build(half_state=None, sr=True):
    return EmbeddingCollection([
        TableConfig("user", 5, combiner="sum", dtype=torch.float16, optimizer=Adam(lr=0.01, mode="global")),
        TableConfig("item", 3, combiner="mean", dtype=torch.bfloat16, stochastic_rounding=sr),
        TableConfig("dense", 4, num_rows=9, combiner="sum", dtype=torch.float16, state_dtype=half_state,
                    stochastic_rounding=sr),
        TableConfig("plain", 4, combiner="sum"),  # the default float32 layout beside them
    ], optimizer=Adagrad(lr=0.05), seed=4)


def _train(ec, steps):
    for step in steps:
        g = torch.Generator().manual_seed(step)
        bags = lambda hi: [torch.randint(0, hi, (int(k),), generator=g).tolist()  # noqa: E731
                           for k in torch.randint(1, 3, (6,), generator=g)]
        out = ec(SparseFeatures.from_lists({"user": bags(40), "item": bags(40), "dense": bags(9), "plain": bags(40)}))
        sum((out[k].float() * (1 + i)).sum() for i, k in enumerate(("user", "item", "dense", "plain"))).backward()


def test_mixed_layout_tables_round_trip_bit_identically_and_resume_exactly(tmp_path):
    ec = _build()
    _train(ec, range(1, 5))
    assert ec.store("user").layout.packed and not ec.store("plain").layout.packed
    path = save(tmp_path, ec)
    manifest = json.loads((path / "manifest.json").read_text())
    saved = {t["name"]: (t["dtype"], t["state_dtype"], t["stochastic_rounding"]) for t in manifest["tables"]}
    assert saved == {"user": ("float16", "float32", False), "item": ("bfloat16", "float32", True),
                     "dense": ("float16", "float32", True), "plain": ("float32", "float32", False)}
    back = _build()
    load(tmp_path, back)
    assert back.step == ec.step and tables_equal(ec, back)
    for name in ("user", "item", "dense"):  # the typed weights too, bit for bit (raw rows hold them)
        a, b = ec.store(name), back.store(name)
        keys = a.export().keys
        assert torch.equal(a.weights()[a.find(keys)].view(torch.int16), b.weights()[b.find(keys)].view(torch.int16))
    _train(ec, range(5, 8))
    _train(back, range(5, 8))
    # Global Adam and stochastic rounding continue identically: rounding draws by (table, key), so a
    # dynamic table whose imported rows got other slots rounds as it would have (docs/optim.md).
    for name in ("user", "dense", "plain", "item"):
        ea, eb = ec.store(name).export(), back.store(name).export()
        assert torch.equal(ea.keys, eb.keys) and torch.equal(ea.counts, eb.counts)
        assert torch.equal(ea.rows, eb.rows), name


def test_snapshot_of_another_layout_is_refused_by_name(tmp_path):
    ec = _build()
    _train(ec, range(1, 3))
    save(tmp_path, ec)
    other = _build(half_state=torch.float16)  # same dims and rules, 16-bit optimizer state
    before = other.store("dense").export().rows.clone()
    with pytest.raises(CheckpointError, match=r"table 'dense': rows in .* are stored as float16 weights with "
                                              r"float32 optimizer state, the model's as float16 weights with "
                                              r"float16 state"):
        load(tmp_path, other)
    assert torch.equal(other.store("dense").export().rows, before)  # nothing loaded
    # stochastic rounding changes how updates round, not how rows are stored: it loads
    load(tmp_path, _build(sr=False))

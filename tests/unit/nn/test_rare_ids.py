"""Rare ids: the shared row of ids below the admission threshold (TableConfig.shared_row) and the per-row
learning rate by hit count (TableConfig.lr_count_scale), checked against hand computations."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hugeembed import SparseFeatures
from hugeembed.errors import ConfigError
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.nn._rare import SHARED_ROW_KEY
from hugeembed.optim import FTRL, SGD, Adagrad, Adam
from hugeembed.store import Uniform
from tests.conftest import DEVICES

INIT = Uniform(-0.1, 0.1)
SEED = 7


def _collection(rule, device="cpu", **table):
    cfg = TableConfig("u", 3, combiner="sum", initializer=INIT, seed=SEED, **table)
    return EmbeddingCollection([cfg], optimizer=rule, device=device)


def _init_row(key: int) -> torch.Tensor:
    """The oracle of a new row: the initializer's pure function of (seed, key)."""
    return INIT.generate(torch.tensor([key]), 3, SEED)[0]


def _find(ec, keys: list[int]) -> torch.Tensor:
    """Slots of `keys` in table u (on the CPU, -1: no row)."""
    return ec.store("u").find(torch.tensor(keys, device=ec.device)).cpu()


def _row(ec, key: int) -> torch.Tensor:
    """Row of `key` as it is stored, on the CPU (where the oracles are)."""
    store = ec.store("u")
    slot = int(_find(ec, [key])[0])
    assert slot >= 0, f"key {key} has no row"
    return store.weights()[slot].cpu().clone()


def _lookup(ec, ids: list[int]) -> torch.Tensor:
    """Forward of one id per sample, the output on the CPU."""
    return ec(SparseFeatures.from_lists({"u": [[i] for i in ids]}).to(ec.device))["u"].cpu()


def _step(ec, ids: list[int], coef: torch.Tensor) -> torch.Tensor:
    """One training step with loss sum_i <out_i, coef_i>: sample i's gradient is coef_i (given on the CPU)."""
    out = ec(SparseFeatures.from_lists({"u": [[i] for i in ids]}).to(ec.device))["u"]
    (out * coef.to(out.device)).sum().backward()
    return out.detach().cpu()


def test_ids_below_the_threshold_read_and_train_the_shared_row(device):
    ec = _collection(SGD(lr=0.5), device, admit_min_count=3, shared_row=True)
    c = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [0.25, 0.25, -2.0]])
    shared0 = _init_row(SHARED_ROW_KEY)
    out = _step(ec, [1, 2, 1], c)  # id 1: 2 hits, id 2: 1 hit -- no row of their own yet
    torch.testing.assert_close(out, shared0.expand(3, 3))
    assert _find(ec, [1, 2]).tolist() == [-1, -1]
    shared1 = shared0 - 0.5 * c.sum(0)  # the three uses' gradients summed into the one row
    torch.testing.assert_close(_row(ec, SHARED_ROW_KEY), shared1)

    out = _step(ec, [1, 3], c[:2])  # id 1's third hit: its own row, fresh from the initializer; id 3 shares
    torch.testing.assert_close(out, torch.stack([_init_row(1), shared1]))
    torch.testing.assert_close(_row(ec, 1), _init_row(1) - 0.5 * c[0])
    torch.testing.assert_close(_row(ec, SHARED_ROW_KEY), shared1 - 0.5 * c[1])
    assert ec.num_rows() == {"u": 2}  # id 1 and the shared row

    ec.eval()  # eval: an id with a row reads it; rare (2) and unseen (99) ids read the shared row
    with torch.no_grad():
        got = _lookup(ec, [1, 2, 99])
    torch.testing.assert_close(got, torch.stack([_row(ec, 1), _row(ec, SHARED_ROW_KEY), _row(ec, SHARED_ROW_KEY)]))


@pytest.mark.parametrize("device", DEVICES)  # (a function-scoped fixture would not reset per example)
@settings(max_examples=25, deadline=None)
@given(stream=st.lists(st.lists(st.integers(0, 12), min_size=1, max_size=10), min_size=1, max_size=6),
       k=st.integers(1, 4))
def test_admission_routes_exactly_the_ids_seen_fewer_than_k_times_to_the_shared_row(device, stream, k):
    ec = _collection(SGD(lr=0.1), device, admit_min_count=k, shared_row=True)
    hits: Counter[int] = Counter()
    for ids in stream:
        _step(ec, ids, torch.ones(len(ids), 3))
        hits.update(ids)
    own = _find(ec, list(range(14))) >= 0
    assert own.tolist() == [hits[i] >= k for i in range(14)]  # 13 was never seen
    ec.eval()
    with torch.no_grad():
        got = _lookup(ec, list(range(14)))
    shared = _row(ec, SHARED_ROW_KEY)
    for i in range(14):
        want = _row(ec, i) if hits[i] >= k else shared
        torch.testing.assert_close(got[i], want)


def test_lr_count_scale_scales_each_rows_step_by_min_1_hits_over_n(device):
    ec = _collection(SGD(lr=0.5), device, lr_count_scale=4)
    c = torch.tensor([[1.0, 2.0, 3.0], [-1.0, 0.5, 0.0], [0.25, 0.25, -2.0]])
    _step(ec, [5, 5, 6], c)  # hits: 5 -> 2, 6 -> 1
    torch.testing.assert_close(_row(ec, 5), _init_row(5) - 0.5 * (2 / 4) * (c[0] + c[1]))
    torch.testing.assert_close(_row(ec, 6), _init_row(6) - 0.5 * (1 / 4) * c[2])
    w5 = _row(ec, 5)
    _step(ec, [5, 5, 5], c)  # 5 hits: the full lr from now on
    torch.testing.assert_close(_row(ec, 5), w5 - 0.5 * 1.0 * c.sum(0))


def test_lr_count_scale_with_adagrad_scales_the_step_and_not_the_accumulator(device):
    ec = _collection(Adagrad(lr=0.1, eps=1e-10), device, lr_count_scale=3)
    g = torch.tensor([[0.5, -2.0, 1.0]])
    _step(ec, [8], g)  # 1 hit: a third of the lr; Adagrad's sum = g^2 whatever the scale
    acc = g[0] ** 2
    want = _init_row(8) - (0.1 * (1 / 3)) * g[0] / (acc.sqrt() + 1e-10)
    torch.testing.assert_close(_row(ec, 8), want)
    store = ec.store("u")
    slot = int(_find(ec, [8])[0])
    torch.testing.assert_close(store.state()[slot].cpu(), acc)
    w = _row(ec, 8)
    _step(ec, [8], g)  # 2 hits: two thirds
    acc2 = acc + g[0] ** 2
    torch.testing.assert_close(_row(ec, 8), w - (0.1 * (2 / 3)) * g[0] / (acc2.sqrt() + 1e-10))


def test_the_shared_row_takes_the_full_lr_under_lr_count_scale(device):
    ec = _collection(SGD(lr=1.0), device, admit_min_count=2, shared_row=True, lr_count_scale=10)
    c = torch.tensor([[1.0, 0.0, 0.0], [0.0, 1.0, 0.0]])
    _step(ec, [1, 2], c)
    torch.testing.assert_close(_row(ec, SHARED_ROW_KEY), _init_row(SHARED_ROW_KEY) - c.sum(0))


def test_eviction_spares_the_shared_row_and_a_snapshot_keeps_it(device):
    ec = _collection(SGD(lr=0.5), device, admit_min_count=2, shared_row=True)
    _step(ec, [1, 1, 2, 3], torch.ones(4, 3))
    assert ec.num_rows() == {"u": 2}
    fresh = _collection(SGD(lr=0.5), device, admit_min_count=2, shared_row=True)
    fresh.load_state_dict(ec.state_dict())
    torch.testing.assert_close(_row(fresh, SHARED_ROW_KEY), _row(ec, SHARED_ROW_KEY))
    assert ec.evict(max_rows=0) == {"u": 1}  # id 1 goes, the shared row stays
    assert ec.num_rows() == {"u": 1} and _find(ec, [SHARED_ROW_KEY]).item() >= 0


@pytest.mark.parametrize("table, match", [
    (dict(num_rows=10, shared_row=True), "dynamic tables"),
    (dict(shared_row=True, prune_negative=False), "prune_negative"),
    (dict(shared_row=True, admit_probability=0.5), "admit_probability"),
    (dict(lr_count_scale=0), "lr_count_scale must be a positive int"),
    (dict(lr_count_scale=2, optimizer=FTRL(lr=0.1)), "'ftrl' is not"),
    (dict(lr_count_scale=2, optimizer=Adam(lr=0.1, mode="global")), "global mode"),
    (dict(lr_count_scale=2, dtype=torch.float16), "float32 / float64"),
])
def test_bad_rare_id_options_name_the_table_and_the_value(table, match):
    with pytest.raises(ConfigError, match=match) as e:
        TableConfig("u", 3, **table)
    assert "'u'" in str(e.value) and "\n" not in str(e.value)


def test_the_collections_rule_is_checked_too():
    with pytest.raises(ConfigError, match=r"table 'u'.*'ftrl' is not"):
        EmbeddingCollection([TableConfig("u", 3, lr_count_scale=2)], optimizer=FTRL(lr=0.1))

"""replicated_staleness (distributed/_pipeline.py) on one in-process gloo rank: bad values, what it does not
combine with, and a training forward without a backward (its late replica read is handed over at the forward).
Its reads against a float64 oracle and the synchronous run: tests/dist/test_staleness.py (2 ranks)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan
from hugeembed.errors import ConfigError
from hugeembed.features import SparseFeatures
from hugeembed.nn import TableConfig
from hugeembed.optim import SGD


@pytest.fixture
def one_rank(tmp_path):
    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _build(plan=("data_parallel", "row_wise"), **kw) -> ShardedEmbeddingCollection:
    tables = [TableConfig(n, 4, num_rows=10, combiner="sum", optimizer=SGD(lr=0.5)) for n in ("a", "b")]
    return ShardedEmbeddingCollection(tables, plan=ShardingPlan(1, dict(zip("ab", plan))), timeout=10.0, **kw)


def _batch(step: int) -> SparseFeatures:
    return SparseFeatures.from_lists({"a": [[step % 10], [(step + 3) % 10]], "b": [[step % 10], []]})


def test_bad_values_are_refused_naming_the_range(one_rank):
    for bad in (-1, 3, True, 1.0):
        with pytest.raises(ConfigError, match=r"replicated_staleness must be an int in \[0, staleness=2\]"):
            _build(staleness=2, replicated_staleness=bad)
    with pytest.raises(ConfigError, match="replicated_staleness needs staleness=K"):
        _build(replicated_staleness=0)
    # with the delay compensation too (a replica's drift counts from its late read: test_staleness.py)
    _build(staleness=2, replicated_staleness=1, stale_compensation=1.0)
    _build(plan=("row_wise", "row_wise"), staleness=2, replicated_staleness=1, stale_compensation=1.0)  # no replica


def test_a_training_forward_without_backward_reads_the_replica_as_it_is(one_rank):
    ec, ref = _build(staleness=2, replicated_staleness=0), _build()
    batches = [_batch(s) for s in range(5)]
    for b in batches[:3]:
        ec.enqueue(b)
    for s in range(2):  # trained: the reads of batch 3 (R = 0) wait for grads(2), not handed over yet
        (ec(batches[s]).concat() * (s + 1)).sum().backward()
        (ref(batches[s]).concat() * (s + 1)).sum().backward()
    ec.enqueue(batches[3])
    got = ec(batches[2]).concat()  # a forward whose backward never runs (its step's grads never come)
    want = ref(batches[2]).concat()
    assert torch.equal(got[:, :4], want[:, :4])  # the replica read after every update handed over
    ec.enqueue(batches[4])
    assert torch.equal(ec(batches[3]).concat()[:, :4], ref(batches[3]).concat()[:, :4])
    ec.drain()


@pytest.mark.parametrize("k,d,lam,want", [(3, 1, 0.0, 1), (3, 1, 50.0, 1), (2, 4, 50.0, 2), (0, 1, 50.0, None)])
def test_the_trainer_reads_replicas_min_k_d_stale_with_the_delay_compensation_too(monkeypatch, k, d, lam, want):
    """--staleness K --dense-staleness D [--stale-compensation L]: the collection gets R = min(K, D) (None: K = 0)."""
    from hugeembed.training import TrainConfig
    from hugeembed.training import _distributed

    got = {}
    monkeypatch.setattr(_distributed, "ShardedEmbeddingCollection", lambda tables, **kw: got.update(kw))
    cfg = TrainConfig(staleness=k, dense_staleness=d, stale_compensation=lam, size_from_data=False)
    ts = [TableConfig(n, 4, num_rows=10, combiner="sum") for n in ("a", "b")]
    _distributed.sharded_factory(cfg, 2)(ts, optimizer=SGD(lr=0.1))
    assert got["replicated_staleness"] == want and got["stale_compensation"] == lam

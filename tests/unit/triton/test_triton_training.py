"""Training steps with backend='triton' (under the interpreter, on CPU tensors) against backend='torch':
the fused backward + optimizer (nn/_fused_updates.py) gives the same tables, and a step reads the host
at most once (static tables: prepare's one read)."""

from __future__ import annotations

import pytest
import torch

from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.nn import _updates
from hugeembed.optim import SGD, Adagrad, Adam, RowWiseAdagrad

from tests.bench._load import load_bench

from ._batches import DEV

pytestmark = pytest.mark.triton

RULES = {"sgd": SGD(lr=0.1), "adagrad": Adagrad(lr=0.1), "adam": Adam(lr=0.05),
         "adam_global": Adam(lr=0.05, mode="global"), "rowwise_adagrad": RowWiseAdagrad(lr=0.1)}


def _collection(backend: str, rule, dtype=torch.float32) -> EmbeddingCollection:
    return EmbeddingCollection([TableConfig("a", 4, num_rows=9, combiner="sum", dtype=dtype),
                                TableConfig("b", 4, num_rows=5, combiner="mean", dtype=dtype)],
                               optimizer=rule, backend=backend, seed=3, device=DEV)


def _batch(step: int) -> SparseFeatures:
    g = torch.Generator().manual_seed(step)
    lengths = torch.randint(0, 4, (2 * 3,), generator=g)  # 2 features x 3 samples, bags of 0-3 ids
    values = torch.randint(0, 5, (int(lengths.sum()),), generator=g)  # repeats: rows with several ids
    weights = torch.rand(values.numel(), generator=g) + 0.5
    return SparseFeatures(["a", "b"], values, lengths=lengths, weights=weights).to(DEV)


def _train(ec: EmbeddingCollection, steps) -> None:
    for s in steps:
        out = ec(_batch(s)).stacked()
        (out * torch.linspace(-1, 1, out.numel(), device=DEV).view_as(out)).sum().backward()


@pytest.fixture
def fused_calls(monkeypatch):
    """How many unit updates ran on the fused kernels."""
    calls = []
    real = _updates.fused_update

    def counting(*args, **kwargs):
        calls.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(_updates, "fused_update", counting)
    return calls


@pytest.mark.parametrize("name", list(RULES))
def test_training_steps_equal_torch_backend(name, fused_calls):
    tri, ref = _collection("triton", RULES[name]), _collection("torch", RULES[name])
    _train(tri, range(4))
    _train(ref, range(4))
    assert len(fused_calls) == 4  # every step took the fused path (one unit: one group, one rule)
    got, want = tri.state_dict(), ref.state_dict()
    assert got.keys() == want.keys()
    for k in want:
        if want[k].dtype.is_floating_point:
            torch.testing.assert_close(got[k], want[k], rtol=1e-5, atol=1e-6, msg=k)
        else:
            assert torch.equal(got[k], want[k]), k


def test_bf16_tables_equal_torch_backend(fused_calls):
    tri, ref = _collection("triton", RULES["adagrad"], torch.bfloat16), _collection("torch", RULES["adagrad"],
                                                                                     torch.bfloat16)
    _train(tri, range(3))
    _train(ref, range(3))
    assert len(fused_calls) == 3
    for k, v in ref.state_dict().items():
        if v.dtype.is_floating_point:  # bf16 weights: the same to one unit in the last place
            torch.testing.assert_close(tri.state_dict()[k].float(), v.float(), rtol=2**-7, atol=1e-6, msg=k)


@pytest.mark.parametrize("dynamic", [False, True], ids=["static", "dynamic"])
def test_a_step_reads_the_host_at_most_once_or_twice(fused_calls, dynamic):
    """Issue 32 item 5 on the triton path: prepare's one read (and the hash tables' find-or-insert
    outcome for dynamic tables), none in the fused backward (bench/ops.py's counter)."""
    ops = load_bench("ops")
    ec = EmbeddingCollection([TableConfig("a", 4, num_rows=None if dynamic else 9, combiner="sum"),
                              TableConfig("b", 4, num_rows=None if dynamic else 5, combiner="mean")],
                             optimizer=RULES["adam_global"], backend="triton", seed=3, device=DEV)
    _train(ec, range(3))  # warm: constants made, kernels compiled, every id of _batch seen
    sf = _batch(1)
    with ops.CountOps() as counter:
        out = ec(sf).stacked()
        out.sum().backward()
    assert len(fused_calls) == 4 and counter.syncs() <= (2 if dynamic else 1), dict(counter.ops)


def test_dynamic_tables_take_the_fused_path(fused_calls):
    """Hash tables whose every id gets a row: the entries' slots are their group's rows, as for static ones."""
    def make(backend):
        return EmbeddingCollection([TableConfig("a", 4, combiner="sum"), TableConfig("b", 4, combiner="mean")],
                                   optimizer=SGD(lr=0.1), backend=backend, seed=3, device=DEV)
    tri, ref = make("triton"), make("torch")
    _train(tri, range(3))
    _train(ref, range(3))
    assert len(fused_calls) == 3
    for k, v in ref.state_dict().items():
        got = tri.state_dict()[k]
        assert torch.equal(got, v) if not v.dtype.is_floating_point else torch.allclose(got, v, rtol=1e-5, atol=1e-6), k


def test_what_the_kernels_do_not_take_falls_back_to_torch(fused_calls):
    """lr_count_scale (a per-row lr) is not in the kernel: the step takes the torch path, same result."""
    def make(backend):
        return EmbeddingCollection([TableConfig("a", 4, num_rows=9, combiner="sum", lr_count_scale=3),
                                    TableConfig("b", 4, num_rows=5, combiner="mean")],
                                   optimizer=Adagrad(lr=0.1), backend=backend, seed=3, device=DEV)
    tri, ref = make("triton"), make("torch")
    _train(tri, range(2))
    _train(ref, range(2))
    assert fused_calls == []
    for k, v in ref.state_dict().items():
        got = tri.state_dict()[k]
        assert torch.equal(got, v) if not v.dtype.is_floating_point else torch.allclose(got, v, rtol=1e-5, atol=1e-6), k


def test_units_of_two_groups_share_the_prepared_runs(fused_calls):
    """Tables of two dims (two groups, two units): each unit's update reads the batch's runs and leaves the
    other unit's rows alone; the same tables as the torch backend."""
    def make(backend):
        return EmbeddingCollection([TableConfig("a", 4, num_rows=9, combiner="sum"),
                                    TableConfig("b", 3, num_rows=5, combiner="mean")],
                                   optimizer=Adagrad(lr=0.1), backend=backend, seed=3, device=DEV)
    tri, ref = make("triton"), make("torch")
    for ec in (tri, ref):
        for s in range(3):
            out = ec(_batch(s))
            sum((v * torch.linspace(-1, 1, v.numel(), device=DEV).view_as(v)).sum() for v in out.groups()).backward()
    assert len(fused_calls) == 6  # two units a step
    for k, v in ref.state_dict().items():
        got = tri.state_dict()[k]
        assert torch.equal(got, v) if not v.dtype.is_floating_point else torch.allclose(got, v, rtol=1e-5, atol=1e-6), k


def test_a_static_step_on_the_kernels_reads_once_and_a_bad_id_still_raises_changing_nothing(monkeypatch):
    """The static fetch on its kernels too (as on a GPU): a step reads the device once (the prepare's report:
    the fetch takes its proof and checks nothing again); an id out of range raises the prepare's error naming
    the feature, the table and the id, and leaves the rows, the counts and the step as they were."""
    from hugeembed.errors import InputError
    from hugeembed.store import StaticGroup

    monkeypatch.setattr(StaticGroup, "_on_triton", lambda self: True)
    ops = load_bench("ops")
    ec = _collection("triton", RULES["adagrad"])
    _train(ec, range(2))
    sf = _batch(5)
    with ops.CountLaunches() as counter:
        ec(sf).stacked().sum().backward()
    assert counter.syncs() == 1 and counter.kernels["_static_rows"] == 1, dict(counter.ops)
    before = {k: v.clone() for k, v in ec.state_dict().items() if isinstance(v, torch.Tensor)}
    metas = [g.meta.clone() for g in ec.groups]
    step = ec._step
    bad = SparseFeatures(["a", "b"], torch.tensor([1, 2, 5]), lengths=torch.tensor([1, 0, 0, 1, 1, 0])).to(DEV)
    with pytest.raises(InputError, match="'b'.*5"):  # b has 5 rows
        ec(bad)
    assert ec._step == step and all(torch.equal(m, g.meta) for m, g in zip(metas, ec.groups))
    after = ec.state_dict()
    assert all(torch.equal(v, after[k]) for k, v in before.items())

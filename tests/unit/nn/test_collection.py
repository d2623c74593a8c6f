"""EmbeddingCollection against plain PyTorch (nn.Embedding + torch.optim) and between its own table kinds."""

from __future__ import annotations

import pytest
import torch

from hugeembed import ConfigError, InputError
from hugeembed.features import SparseFeatures
from hugeembed.nn import EmbeddingCollection, TableConfig
from hugeembed.optim import SGD, Adagrad, MomentumSGD
from hugeembed.store import Uniform, Zeros


def tol(device: torch.device, cpu: float) -> float:
    """`cpu` on the CPU; at least 1e-5 on an accelerator (float32 sums in another order there)."""
    return cpu if device.type == "cpu" else max(cpu, 1e-5)


def batch(user, item, B=None):
    return SparseFeatures.from_lists({"user": user, "item": item})


def random_batches(n, B, rows, seed=0):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        lens_u = torch.randint(0, 3, (B,), generator=g).tolist()
        lens_i = torch.randint(1, 3, (B,), generator=g).tolist()
        u = [torch.randint(0, rows, (k,), generator=g).tolist() for k in lens_u]
        i = [torch.randint(0, rows, (k,), generator=g).tolist() for k in lens_i]
        out.append(batch(u, i))
    return out


def torch_reference(init_user, init_item, opt_factory, batches, targets):
    """The same model in plain PyTorch: EmbeddingBag(sparse) tables + a torch optimizer."""
    eu = torch.nn.EmbeddingBag.from_pretrained(init_user.clone().double(), freeze=False, mode="sum", sparse=True)
    ei = torch.nn.EmbeddingBag.from_pretrained(init_item.clone().double(), freeze=False, mode="mean", sparse=True)
    opt = opt_factory([eu.weight, ei.weight])
    for sf, y in zip(batches, targets):
        u, i = sf["user"], sf["item"]
        out = torch.stack([eu(u.values, u.offsets[:-1]), ei(i.values, i.offsets[:-1])], dim=1)
        opt.zero_grad()
        ((out - y.double()) ** 2).sum().backward()
        opt.step()
    return eu.weight.detach(), ei.weight.detach()


@pytest.mark.parametrize("dynamic", [False, True])
@pytest.mark.parametrize("rule,ref", [
    (SGD(lr=0.05), lambda p: torch.optim.SGD(p, lr=0.05)),
    (Adagrad(lr=0.1), lambda p: torch.optim.Adagrad(p, lr=0.1)),
])
def test_training_matches_embedding_bag_and_torch_optim(dynamic, rule, ref, device):
    rows, B = 12, 6
    num_rows = None if dynamic else rows
    ec = EmbeddingCollection([TableConfig("user", 4, num_rows=num_rows, combiner="sum"),
                              TableConfig("item", 4, num_rows=num_rows, combiner="mean")], optimizer=rule, seed=3,
                             device=device)
    # the tables' deterministic initial rows for ids 0..rows-1 seed the reference (which runs on the CPU)
    ids = torch.arange(rows)
    init = torch.stack([ec.store(n).initializer.generate(ids, 4, ec.store(n).seed) for n in ("user", "item")], 1)
    probe = SparseFeatures.from_lists({"user": [[i] for i in range(rows)], "item": [[i] for i in range(rows)]})
    batches = random_batches(5, B, rows)
    g = torch.Generator().manual_seed(9)
    targets = [torch.randn(B, 2, 4, generator=g) for _ in batches]
    for sf, y in zip(batches, targets):
        ((ec(sf.to(device)).stacked() - y.to(device)) ** 2).sum().backward()
    ru, ri = torch_reference(init[:, 0], init[:, 1], ref, batches, targets)
    ec.eval()
    got = ec(probe.to(device)).stacked().cpu()
    # rows never touched keep their initial value in both; dynamic tables read them as zeros
    touched_u = sorted({i for sf in batches for i in sf["user"].values.tolist()})
    touched_i = sorted({i for sf in batches for i in sf["item"].values.tolist()})
    torch.testing.assert_close(got[touched_u, 0].double(), ru[touched_u], rtol=1e-5, atol=tol(device, 1e-6))
    torch.testing.assert_close(got[touched_i, 1].double(), ri[touched_i], rtol=1e-5, atol=tol(device, 1e-6))
    assert ec.step == len(batches)


def test_dynamic_table_on_ids_below_n_equals_static_table(device):
    """Same initial rows for the same ids, so training gives identical tables (bit for bit on the
    CPU; on CUDA the gradient sums are atomic adds in no fixed order: to float32 rounding)."""
    rows = 20
    cfg = dict(dim=8, combiner="sum", initializer=Uniform(-0.1, 0.1))
    make = lambda n: EmbeddingCollection([TableConfig("user", num_rows=n, **cfg), TableConfig("item", num_rows=n, **cfg)],
                                         optimizer=MomentumSGD(lr=0.05, momentum=0.9), seed=7, device=device)
    static, dynamic = make(rows), make(None)
    for sf in random_batches(6, 5, rows, seed=1):
        for ec in (static, dynamic):
            (ec(sf.to(device)).stacked() ** 2).sum().backward()
    for name in ("user", "item"):
        d = dynamic.store(name)
        keys = d.export().keys
        torch.testing.assert_close(d.export().rows, static.store(name).storage()[keys], rtol=tol(device, 0),
                                   atol=tol(device, 0))


def test_eval_mode_reads_unknown_ids_as_zeros_and_inserts_nothing(device):
    ec = EmbeddingCollection([TableConfig("user", 4, combiner="sum"), TableConfig("item", 4, combiner="sum")],
                             optimizer=SGD(lr=0.1), device=device)
    ec(batch([[1]], [[2]]).to(device)).stacked().sum().backward()
    counts_before = ec.store("user").export().counts.clone()
    ec.eval()
    out = ec(batch([[1, 99]], [[2]]).to(device))
    assert ec.num_rows() == {"user": 1, "item": 1}
    assert torch.equal(ec.store("user").export().counts, counts_before)
    ec.train()
    with torch.no_grad():
        ec2 = ec(batch([[1]], [[2]]).to(device))
    torch.testing.assert_close(out["user"], ec2["user"])  # 99 contributed zeros
    assert not out.stacked().requires_grad


def test_admission_reads_zeros_until_admitted_and_gets_no_update(device):
    ec = EmbeddingCollection([TableConfig("user", 4, combiner="sum", admit_min_count=3),
                              TableConfig("item", 4, combiner="sum")], optimizer=SGD(lr=0.1), device=device)
    for k in range(2):
        out = ec(batch([[5]], [[1]]).to(device))
        assert torch.count_nonzero(out["user"]) == 0
        out.stacked().sum().backward()
    ex = ec.store("user").export()
    assert ex.keys.numel() == 0 and ex.pending_keys.tolist() == [5] and ex.pending_counts.tolist() == [2]
    out = ec(batch([[5]], [[1]]).to(device))  # third sighting: admitted, fresh initial row
    assert torch.count_nonzero(out["user"]) > 0


def test_feature_read_by_two_tables_and_sequence_features(device):
    ec = EmbeddingCollection([TableConfig("wide", 1, features=("user",), combiner="sum"),
                              TableConfig("deep", 4, features=("user", "item"), combiner="mean"),
                              TableConfig("hist", 3, features=("clicks",), combiner="none")], optimizer=SGD(lr=0.1),
                             device=device)
    sf = SparseFeatures.from_lists({"user": [[1], [2, 3]], "item": [[4], []], "clicks": [[7, 8, 9], [7]]}).to(device)
    out = ec(sf)
    assert out.keys() == ("user@wide", "user@deep", "item")
    assert out["user@wide"].shape == (2, 1) and out["item"].shape == (2, 4)
    seq = out.unpooled["clicks"]
    assert seq.values.shape == (4, 3) and seq.lengths().tolist() == [3, 1]
    torch.testing.assert_close(seq.values[0], seq.values[3])  # same id 7, same row
    loss = out.concat().sum() + seq.values.sum()
    loss.backward()
    assert ec.num_rows() == {"wide": 3, "deep": 4, "hist": 3}


def test_lr_scheduler_drives_the_backward_update(device):
    ec = EmbeddingCollection([TableConfig("user", 2, num_rows=4, combiner="sum", initializer=Zeros())],
                             optimizer=SGD(lr=1.0), device=device)
    sched = torch.optim.lr_scheduler.StepLR(ec.optimizer, step_size=1, gamma=0.5)
    sf = SparseFeatures.from_lists({"user": [[1]]}).to(device)
    for _ in range(3):
        ec(sf)["user"].sum().backward()
        ec.optimizer.step()  # a no-op (updates ran in backward); keeps the usual loop shape
        sched.step()
    # lr 1, 0.5, 0.25 applied to a gradient of ones
    torch.testing.assert_close(ec.store("user").storage()[1].cpu(), torch.tensor([-1.75, -1.75]))


def test_frozen_table_is_not_updated(device):
    ec = EmbeddingCollection([TableConfig("user", 2, num_rows=4, trainable=False),
                              TableConfig("item", 2, num_rows=4)], optimizer=SGD(lr=1.0), device=device)
    before = ec.store("user").storage().clone()
    sf = SparseFeatures.from_lists({"user": [[1]], "item": [[2]]}).to(device)
    ec(sf).stacked().sum().backward()
    assert torch.equal(ec.store("user").storage(), before)
    assert len(ec.optimizer.param_groups) == 1


def test_ttl_eviction_by_config(device):
    ec = EmbeddingCollection([TableConfig("user", 2, ttl=2, evict_interval=1)], optimizer=SGD(lr=0.1), device=device)
    for ids in ([1], [2], [3], [3], [3]):
        ec(SparseFeatures.from_lists({"user": [ids]}).to(device))["user"].sum().backward()
    assert ec.store("user").export().keys.tolist() == [3]


def test_state_dict_round_trip_and_mismatch_errors(device):
    make = lambda dim=4, rule=Adagrad(lr=0.1): EmbeddingCollection(
        [TableConfig("user", dim, combiner="sum"), TableConfig("item", dim, num_rows=10)], optimizer=rule,
        device=device)
    ec = make()
    for sf in random_batches(3, 4, 10):
        ec(sf.to(device)).stacked().sum().backward()
    other = make()
    assert other.load_state_dict(ec.state_dict()).missing_keys == []
    assert other.step == ec.step
    for name in ("user", "item"):
        a, b = ec.store(name).export(), other.store(name).export()
        assert torch.equal(a.keys, b.keys) and torch.equal(a.rows, b.rows) and torch.equal(a.counts, b.counts)
    with pytest.raises(RuntimeError, match=r"table 'user': saved rows have 8 columns, this table needs 4"):
        make(rule=SGD(lr=0.1)).load_state_dict(ec.state_dict())
    with pytest.raises(RuntimeError, match=r"Missing key\(s\).*tables.item.rows"):
        sd = ec.state_dict()
        del sd["tables.item.rows"]
        make().load_state_dict(sd)


def test_meta_device_gives_shapes():
    ec = EmbeddingCollection([TableConfig("user", 8), TableConfig("item", 8)], optimizer=SGD(lr=0.1), device="meta")
    out = ec(SparseFeatures.from_lists({"user": [[1], [2]], "item": [[3], [4]]}).to("meta"))
    assert out.stacked().shape == (2, 2, 8) and out.stacked().device.type == "meta"


def test_config_and_input_errors():
    with pytest.raises(ConfigError, match="table 'user' is trainable but has no optimizer"):
        EmbeddingCollection([TableConfig("user", 4)])
    with pytest.raises(ConfigError, match="table 'user': dim must be a positive int, got -1"):
        TableConfig("user", -1)
    with pytest.raises(ConfigError, match="capacity, admit_min_count apply to dynamic tables"):
        TableConfig("user", 4, num_rows=10, capacity=5, admit_min_count=2)
    with pytest.raises(ConfigError, match="duplicate table names"):
        EmbeddingCollection([TableConfig("a", 4), TableConfig("a", 4)], optimizer=SGD(lr=0.1))
    ec = EmbeddingCollection([TableConfig("user", 4, num_rows=5)], optimizer=SGD(lr=0.1))
    with pytest.raises(InputError, match=r"feature 'user': id 9 at sample 0 is out of range for table 'user' of 5"):
        ec(SparseFeatures.from_lists({"user": [[9]]}))
    with pytest.raises(InputError, match="takes a SparseFeatures batch"):
        ec(torch.tensor([1, 2]))

"""Shared pieces of the multi-rank tests: tables, global batches, one training loop for 1 or N ranks.

The same loop runs in the single-process reference (rank 0 of 1, the whole global batch)
and on every rank of a sharded run (its slice): a test compares what both leave behind.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from hugeembed.features import SparseFeatures
from hugeembed.optim import FTRL, SGD, Adagrad, Adam, RowWiseAdagrad
from hugeembed.store import EXPORT_FIELDS

FIELDS = EXPORT_FIELDS
GLOBAL_BATCH = 12

OPTIMIZERS = {
    "sgd": lambda: SGD(lr=0.1),
    "adagrad": lambda: Adagrad(lr=0.1),
    "adam_lazy": lambda: Adam(lr=0.01),
    "adam_global": lambda: Adam(lr=0.01, mode="global"),
    "rowwise_adagrad": lambda: RowWiseAdagrad(lr=0.1),
    "ftrl": lambda: FTRL(lr=0.1, l1=0.001, l2=0.01),
}


def tables(opt_name: str = "adagrad", dim: int = 4, dtype: str = "float32"):
    """Dynamic with admission + ttl eviction, dynamic mean, static with a default id, a clipped one,
    and a sequence feature (combiner "none": one vector per id, no pooling); weights of `dtype`
    (16-bit ones keep float32 optimizer state, packed beside them)."""
    from hugeembed.nn import TableConfig

    opt = OPTIMIZERS[opt_name]()
    dt = getattr(torch, dtype)
    return [
        TableConfig("user", dim, combiner="sum", admit_min_count=2, ttl=3, evict_interval=2, optimizer=opt, dtype=dt),
        TableConfig("item", dim, combiner="mean", optimizer=opt, dtype=dt),
        TableConfig("country", dim, num_rows=11, combiner="sum", default_id=3, optimizer=opt, dtype=dt),
        TableConfig("page", dim, combiner="sqrtn", max_norm=0.6, optimizer=opt, dtype=dt),
        TableConfig("hist", dim, combiner="none", optimizer=opt, dtype=dt),
    ]


# the CLI's default sparse optimizer besides (Adam with per-row bias correction, no first moment)
RARE_OPTIMIZERS = {**OPTIMIZERS, "adam_per_row": lambda: Adam(lr=0.05, betas=(0.0, 0.999), eps=1e-5,
                                                             bias_correction="per_row")}


def rare_tables(opt_name: str = "adagrad", dim: int = 4):
    """The tables of `tables` as the CLI trains them by default: ids seen fewer than k times read
    their table's shared row (admission k = 2 or 3), rows stepped at lr * min(1, hits / scale)."""
    from hugeembed.nn import TableConfig

    opt = RARE_OPTIMIZERS[opt_name]()
    rare = dict(shared_row=True, optimizer=opt)
    return [
        TableConfig("user", dim, combiner="sum", admit_min_count=3, ttl=3, evict_interval=2, lr_count_scale=4, **rare),
        TableConfig("item", dim, combiner="mean", admit_min_count=2, lr_count_scale=3, **rare),
        TableConfig("country", dim, num_rows=11, combiner="sum", default_id=3, lr_count_scale=2, optimizer=opt),
        TableConfig("page", dim, combiner="sqrtn", max_norm=0.6, admit_min_count=2, **rare),
        TableConfig("hist", dim, combiner="none", admit_min_count=2, lr_count_scale=2, **rare),
    ]


def typed_rows(exported: dict, layouts: dict) -> dict:
    """`exported` tables with each raw row record replaced by its weights then state as float64
    (read through the table's RowLayout): packed 16-bit rows compared value by value."""
    out = {}
    for name, t in exported.items():
        lay = layouts[name]
        rows = t["rows"]
        out[name] = {**t, "rows": torch.cat([lay.weights(rows).double(), lay.state(rows).double()], 1)}
    return out


def global_batch(step: int, n: int = GLOBAL_BATCH, wide: bool = False) -> SparseFeatures:
    """The global batch of `step`: multi-hot bags with repeats (squares mod n), weights on odd steps.
    `wide`: ids drawn uniformly from 300 per dynamic table instead (few repeats across steps: a
    small cache misses)."""
    g = torch.Generator().manual_seed(7000 + step)

    def bags(hi: int, maxlen: int = 3):
        lens = torch.randint(0, maxlen + 1, (n,), generator=g)
        if wide:
            return [torch.randint(0, hi, (int(k),), generator=g).tolist() for k in lens]
        return [(torch.randint(0, hi, (int(k),), generator=g) ** 2 % hi).tolist() for k in lens]

    hi = (lambda k: 300) if wide else (lambda k: k)
    feats = {"user": bags(hi(40)), "item": bags(hi(60)), "country": bags(11, 2), "page": bags(hi(30)),
             "hist": bags(hi(25), 4)}
    weights = None
    if step % 2:
        weights = {k: [(0.5 + torch.rand(len(b), generator=g)).tolist() for b in v] for k, v in feats.items()}
    return SparseFeatures.from_lists(feats, weights)


def local_batch(step: int, rank: int, world: int, wide: bool = False) -> SparseFeatures:
    sf = global_batch(step, wide=wide)
    return sf if world == 1 else sf.split(GLOBAL_BATCH // world)[rank]


def coef(step: int, width: int) -> torch.Tensor:
    return torch.randn(GLOBAL_BATCH, width, generator=torch.Generator().manual_seed(9000 + step))


def labels(step: int) -> torch.Tensor:
    return (torch.rand(GLOBAL_BATCH, generator=torch.Generator().manual_seed(500 + step)) > 0.6).float()


def dense_model(in_dim: int) -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(in_dim, 8), torch.nn.ReLU(), torch.nn.Linear(8, 1))


def train(ec, steps, rank: int = 0, world: int = 1, dense=None, dense_opt=None, record=None, wide: bool = False,
          ahead: int | None = None, outputs: list | None = None):
    """Trains `ec` (and a dense model) on the global batches of `steps`; returns the first forward's output.
    `ahead` K: a collection built with staleness K, each batch enqueued K steps before its forward
    (then drained); `outputs` collects every forward's pooled output.

    Without `dense` the loss is linear in the pooled vectors (its gradient is exact, so
    sharded and unsharded row gradients agree bit for bit where the summation order
    does); with `dense` (DDP-wrapped on N ranks) it is a BCE over an MLP.
    """
    B = GLOBAL_BATCH // world
    sl = slice(rank * B, (rank + 1) * B)
    first = None
    steps = list(steps)
    batches = [local_batch(step, rank, world, wide) for step in steps]
    nxt = 0
    for i, step in enumerate(steps):
        while ahead is not None and nxt < len(steps) and nxt <= i + ahead:
            ec.enqueue(batches[nxt])
            nxt += 1
        out = ec(batches[i])
        x = out.concat()
        seq = out.unpooled["hist"].values  # this rank's ids of the sequence feature, in global order
        at = int(global_batch(step, wide=wide).feature("hist").offsets[rank * B])
        seq_coef = torch.randn(1000, seq.shape[1], generator=torch.Generator().manual_seed(8000 + step))
        if first is None:
            first = torch.cat([x.detach().flatten(), seq.detach().flatten()])
        if outputs is not None:
            outputs.append(x.detach().clone())
        seq_loss = (seq * seq_coef[at : at + seq.shape[0]]).sum() / B
        if dense is None:
            loss = (x * coef(step, x.shape[1])[sl]).sum() / B + seq_loss
        else:
            loss = F.binary_cross_entropy_with_logits(dense(x).squeeze(1), labels(step)[sl]) + seq_loss
            dense_opt.zero_grad()
        loss.backward()
        if dense_opt is not None:
            dense_opt.step()
        if record is not None:
            record.append(dict(ec.comm.stats.step))
    if ahead is not None:
        ec.drain()
    return first


def export_all(ec) -> dict[str, dict[str, torch.Tensor]]:
    return {cfg.name: {f: getattr(s.export(), f).clone() for f in FIELDS} for cfg, s in ec.stores()}


def merge_shards(per_rank: list[dict], replicated: set[str] = frozenset()) -> dict[str, dict[str, torch.Tensor]]:
    """Every rank's shards -> one export per table, keys ascending; replicas must agree bit for bit."""
    out = {}
    for name in per_rank[0]:
        parts = [r[name] for r in per_rank]
        if name in replicated:
            for p in parts[1:]:
                for f in FIELDS:
                    assert torch.equal(p[f], parts[0][f]), f"replicas of {name!r} differ in {f}"
            parts = parts[:1]
        merged = {}
        for keyf, fields in (("keys", ("rows", "counts", "last_step")),
                             ("pending_keys", ("pending_counts", "pending_last_step"))):
            keys = torch.cat([p[keyf] for p in parts])
            order = keys.argsort()
            assert keys.unique().numel() == keys.numel(), f"table {name!r}: a key lives on two ranks"
            merged[keyf] = keys[order]
            for f in fields:
                merged[f] = torch.cat([p[f] for p in parts])[order]
        out[name] = merged
    return out


def assert_tables(got: dict, want: dict, exact: set[str] = frozenset(), what: str = "", rtol: float = 1e-5,
                  atol: float = 1e-6) -> None:
    """Keys, counts, steps and pending keys equal; rows allclose (bit-identical for tables in `exact`)."""
    assert set(got) == set(want), what
    for name in want:
        for f in FIELDS:
            a, b = got[name][f], want[name][f]
            assert a.shape == b.shape, f"{what}: {name}.{f} shape {tuple(a.shape)} vs {tuple(b.shape)}"
            if f == "rows" and name not in exact:
                torch.testing.assert_close(a, b, rtol=rtol, atol=atol, msg=lambda m: f"{what}: {name}.rows: {m}")
            else:
                assert torch.equal(a, b), f"{what}: {name}.{f} differs (max {(a - b).abs().max()})"


def metrics_model(collection_factory=None):
    """A small DLRM over the test tables (seeded: the same dense weights in every process)."""
    from hugeembed.models import make_model

    # the default admission: ids seen fewer than 3 times read a shared row, in one process and sharded alike
    model, _ = make_model("dlrm", embedding_dim=4, sparse_optimizer=OPTIMIZERS["adagrad"](), seed=1,
                          features=("user", "item", "country", "page"), num_dense=3, bottom_mlp=(8,), top_mlp=(8,),
                          collection_factory=collection_factory)
    return model


def metrics_batch(i: int):
    """Held-out batch i: one id per bag (DLRM's default tables are dynamic), labels, dense features."""
    from hugeembed.data import Batch

    g = torch.Generator().manual_seed(300 + i)
    n = 5 + i  # batches of different sizes
    ids = {k: [[int(v)] for v in torch.randint(0, 50, (n,), generator=g)] for k in ("user", "item", "country", "page")}
    return Batch(torch.randn(n, 3, generator=g), SparseFeatures.from_lists(ids),
                 (torch.rand(n, generator=g) < 0.4).float())


# -- gradient accumulation under eviction pressure (rows of in-flight batches pinned) -------------------------------

def accumulation_tables(capacity):
    from hugeembed.nn import TableConfig

    return [TableConfig("u", 4, combiner="sum", capacity=capacity, on_full="evict", optimizer=Adagrad(lr=0.3))]


def accumulation_windows():
    """Windows of 3 global batches over 6 fresh ids: ids 0-1, then 2-3, then all six (4-5 new).
    With a capacity of 6, the second batch of a window must evict, and LFU would pick the first
    batch's rows (fewer hits than the last window's 0-3) were they not pinned."""
    out = []
    for w in range(4):
        ids = [w * 100 + i for i in range(6)]
        sets = [ids[0:2], ids[2:4], ids]
        out.append([[[s[k % len(s)]] for k in range(GLOBAL_BATCH)] for s in sets])
    return out


def train_windows(ec, windows, rank: int = 0, world: int = 1) -> None:
    B = GLOBAL_BATCH // world
    for w, window in enumerate(windows):
        loss = 0
        for b, bags in enumerate(window):
            out = ec(SparseFeatures.from_lists({"u": bags[rank * B : (rank + 1) * B]}))
            # / B: the sharded collection averages gradients over ranks, as DDP does
            loss = loss + (out["u"] * coef(w * 10 + b, 4)[rank * B : (rank + 1) * B]).sum() / B
        loss.backward()

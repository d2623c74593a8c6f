"""What each rank runs in tests/dist/test_column_wise.py: column-wise tables trained on the slices of
the same global batches as one process; results compared in the test process."""

from __future__ import annotations

import dataclasses

import torch

from hugeembed import checkpoint as ckpt
from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, new_embedding_group
from hugeembed.features import SparseFeatures

from hugeembed.optim import MomentumSGD

from .common import GLOBAL_BATCH, RARE_OPTIMIZERS, coef

# the CLI's default rule (Adam, per-row bias correction: a per-row counter beside per-element state) besides
RULES = {**RARE_OPTIMIZERS, "momentum": lambda: MomentumSGD(lr=0.1, momentum=0.9, nesterov=True)}

EVAL_STEP = 100


def colwise_tables(opt_name: str, dim: int = 6):
    """Tables column-wise sharding supports: dynamic with admission (a bound on pending keys) + ttl
    eviction, a shared row of rare ids with lr_count_scale (mean), static with a default id, sqrtn with
    a capacity (LFU eviction) and probabilistic admission: every block must keep the same keys."""
    from hugeembed.nn import TableConfig

    opt = RULES[opt_name]()
    scale = 3 if opt_name in ("sgd", "adagrad", "adam_lazy", "momentum") else None  # steps linear in lr
    return [
        TableConfig("user", dim, combiner="sum", admit_min_count=2, max_pending=6, ttl=3, evict_interval=2,
                    optimizer=opt),
        TableConfig("item", dim, combiner="mean", shared_row=True, admit_min_count=2, lr_count_scale=scale,
                    optimizer=opt),
        TableConfig("country", dim, num_rows=11, combiner="sum", default_id=3, optimizer=opt),
        TableConfig("page", dim, combiner="sqrtn", capacity=12, admit_probability=0.7, optimizer=opt),
    ]


def batch(step: int, n: int = GLOBAL_BATCH) -> SparseFeatures:
    """The global batch of `step`: multi-hot bags with repeats, weights on odd steps."""
    g = torch.Generator().manual_seed(7100 + step)

    def bags(hi: int, maxlen: int = 3, spread: bool = False):
        lens = torch.randint(0, maxlen + 1, (n,), generator=g)
        if spread:  # ids uniform over many: most seen once, pending (not admitted) to the end
            return [torch.randint(0, hi, (int(k),), generator=g).tolist() for k in lens]
        return [(torch.randint(0, hi, (int(k),), generator=g) ** 2 % hi).tolist() for k in lens]

    feats = {"user": bags(40), "item": bags(200, spread=True), "country": bags(11, 2), "page": bags(30)}
    weights = None
    if step % 2:
        weights = {k: [(0.5 + torch.rand(len(b), generator=g)).tolist() for b in v] for k, v in feats.items()}
    return SparseFeatures.from_lists(feats, weights)


def local(step: int, rank: int, world: int) -> SparseFeatures:
    sf = batch(step)
    return sf if world == 1 else sf.split(GLOBAL_BATCH // world)[rank]


def train(ec, steps, rank: int = 0, world: int = 1, record: list | None = None,
          ahead: int | None = None) -> list[torch.Tensor]:
    """A loss linear in the pooled vectors (an exact gradient); returns every forward's output.
    `record`: gets each step's bytes sent per stage and destination (ExchangeStats.step); `ahead` K:
    a collection built with staleness K, each batch enqueued K steps before its forward."""
    B = GLOBAL_BATCH // world
    outs = []
    steps = list(steps)
    batches = [local(step, rank, world) for step in steps]  # the very batches enqueued are the forwards'
    nxt = 0
    for i, step in enumerate(steps):
        while ahead is not None and nxt < len(steps) and nxt <= i + ahead:
            ec.enqueue(batches[nxt])
            nxt += 1
        x = ec(batches[i]).concat()
        outs.append(x.detach().clone())
        (x * coef(step, x.shape[1])[rank * B : (rank + 1) * B]).sum().div(B).backward()
        if record is not None:
            record.append(dict(ec.comm.stats.step))
    if ahead is not None:
        ec.drain()
    return outs


def scored(ec, rank: int = 0, world: int = 1) -> torch.Tensor:
    ec.eval()
    with torch.no_grad():
        out = ec(local(EVAL_STEP, rank, world)).concat()
    ec.train()
    return out


def main(rank: int, world: int, workdir: str, cases=(), refusals=()) -> dict:
    group = new_embedding_group("cpu", 30.0)
    out: dict = {"cases": {}, "refusals": {}}
    for case in cases:
        ec = ShardedEmbeddingCollection(colwise_tables(case["opt"]), plan=ShardingPlan(world, case["plan"]),
                                        process_group=group, timeout=30.0, staleness=case.get("staleness"))
        got: dict = {}
        if case.get("load"):
            got["loaded"] = ckpt.load(case["load"], ec, restore_rng=False).step
        a, b = case["steps"]
        got["bytes"] = []
        got["outputs"] = train(ec, range(a, b), rank, world, got["bytes"], case.get("staleness"))
        got["eval"] = scored(ec, rank, world)
        got["block"] = {cfg.name: store.export().rows.clone() for cfg, store in ec.stores()}
        got["state"] = {k: v.clone() for k, v in ec.state_dict().items()}  # collective: column blocks gathered
        if case.get("save"):
            got["saved"] = str(ckpt.save(case["save"], ec))
        out["cases"][case["name"]] = got
    for name, (opt, plan, dim, tweak) in dict(refusals).items():  # `tweak`: fields of table "user" changed
        ts = [dataclasses.replace(t, **tweak) if t.name == "user" else t for t in colwise_tables(opt, dim)]
        try:
            ShardedEmbeddingCollection(ts, plan=ShardingPlan(world, plan), process_group=group)
            out["refusals"][name] = "no error"
        except Exception as e:  # the test checks the type and the line
            out["refusals"][name] = f"{type(e).__name__}: {e}"
    return out

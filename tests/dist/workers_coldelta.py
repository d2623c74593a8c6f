"""What each rank runs in tests/dist/test_column_wise_deltas.py: column-wise tables trained in legs, a
snapshot (full or delta) after each leg; results compared in the test process."""

from __future__ import annotations

from hugeembed import checkpoint as ckpt
from hugeembed.distributed import ShardedEmbeddingCollection, ShardingPlan, new_embedding_group

from .workers_colwise import colwise_tables, train


def main(rank: int, world: int, workdir: str, runs=()) -> dict:
    """Each run: build the collection under `plan`, load `load` (optional), then per leg (first, stop,
    delta): train steps [first, stop) and save under `root` (a delta when `delta`)."""
    group = new_embedding_group("cpu", 30.0)
    out: dict = {}
    for run in runs:
        ec = ShardedEmbeddingCollection(colwise_tables(run["opt"]), plan=ShardingPlan(world, run["plan"]),
                                        process_group=group, timeout=30.0)
        got: dict = {"saved": []}
        if run.get("load"):
            got["loaded"] = ckpt.load(run["load"], ec, restore_rng=False).step
        for first, stop, delta in run["legs"]:
            train(ec, range(first, stop), rank, world)
            try:
                got["saved"].append(str(ckpt.save(run["root"], ec, delta=delta)))
            except Exception as e:  # the test checks the line
                got["saved"].append(f"{type(e).__name__}: {e}")
        got["state"] = {k: v.clone() for k, v in ec.state_dict().items()}  # collective: column blocks gathered
        out[run["name"]] = got
    return out

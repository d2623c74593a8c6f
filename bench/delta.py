"""Artifact deltas on a server: the memory a delta's apply allocates, and what the patched lookup costs.

    python bench/delta.py [--rows 500000,2000000,8000000] [--changed 1000] [--dim 32] [--dtype int8]
    python bench/delta.py --quick        # a few seconds
    python bench/delta.py --artifact ART  # also: ART's predictions without and with its deltas

One dim group of two tables, as an artifact holds them: a static table of N rows and a dynamic
one of N/4 keys (with a shared row).  A delta upserts `--changed` rows of each and removes 2%
as many keys of the dynamic one.

* **Apply memory**: the bytes of every tensor torch creates while the delta's patch is merged
  (``_patch.merge_patch``, the part of an apply that could grow with the tables; the dense
  weights are a fixed cost, the program a module of the base's), counted by a dispatch mode that
  never subtracts a free: an upper bound on the apply's peak.  Reported against the tables'
  bytes (78baa67 copied every table of the group, 3-4x a table at its peak) and the delta's.
* **Patched lookup**: ``patched_lookup`` (base + patch) against ``pooled_lookup`` on the base
  alone, the same batches, timed interleaved in the same run (medians), with hugeembed's kernels
  and with the torch pass an artifact's ``runtime.py`` runs without them.  The patched output is
  checked against the base's on every id the patch does not hold.
* With ``--artifact``: ``ServingModel.predict`` of that artifact's base alone and of the base with
  its deltas applied (the patched program), on the same synthetic requests, interleaved.

Target (issue 31, finding 5): the allocation follows the delta's rows, not the tables.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import torch
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from hugeembed.serving import _lookup_ops, _runtime  # importing hugeembed.serving installs the kernels' accelerators
from hugeembed.serving._index import group_tables
from hugeembed.serving._patch import merge_patch, patched_lookup
from hugeembed.serving._quant import quantize, row_width, storage_dtype

MB = 1 << 20


class AllocatedBytes(TorchDispatchMode):
    """Sums the storage bytes of every tensor an op creates (not views or in-place results of its inputs)."""

    def __init__(self) -> None:
        super().__init__()
        self.total, self._seen = 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage().data_ptr() for t in pytree.tree_leaves((args, kwargs))
                  if isinstance(t, torch.Tensor)}
        for t in pytree.tree_leaves(out):
            if isinstance(t, torch.Tensor):
                ptr = t.untyped_storage().data_ptr()
                if ptr not in inputs and ptr not in self._seen:
                    self._seen.add(ptr)
                    self.total += t.untyped_storage().nbytes()
        return out


def make_group(n_static: int, dim: int, dtype: str, seed: int = 0):
    """(group record, rows, keys, index, meta) of a static table of n_static rows and a dynamic one of
    n_static // 4 keys (its shared row first), random stored rows."""
    n_keys = max(2, n_static // 4)
    group = {"tables": ["items", "users"], "table_keys": [-1, 0], "table_rows": [n_static, 0],
             "table_shared": [0, 1], "dim": dim}
    g = torch.Generator().manual_seed(seed)
    keys = torch.cat([torch.tensor([_runtime.SHARED_ROW_KEY]),
                      torch.randperm(n_keys * 8, generator=g)[: n_keys - 1].sort().values])
    rows = torch.empty(n_static + n_keys + 1, row_width(dtype, dim), dtype=storage_dtype(dtype))
    for lo in range(0, rows.shape[0] - 1, 1 << 20):  # quantized in slices: no float copy of the whole table
        hi = min(lo + (1 << 20), rows.shape[0] - 1)
        rows[lo:hi] = quantize(torch.randn(hi - lo, dim, generator=g), dtype)
    rows[-1] = 0
    rows, keys, index, meta = group_tables(group, [n_static, n_keys], rows, keys)
    return group, rows, keys, index, meta


def make_delta(group, rows, keys, changed: int, seed: int = 1):
    """upserts (table -> (keys, rows)) and removed (table -> keys), as a delta's arrays read."""
    g = torch.Generator().manual_seed(seed)
    n_static = int(group["table_rows"][0])
    dyn = keys[1:]
    up_static = torch.randperm(n_static, generator=g)[:changed]
    pick = torch.randperm(dyn.numel(), generator=g)
    n_up = min(changed, dyn.numel() // 2)
    up_dyn = torch.cat([dyn[pick[:n_up]], keys.max() + 1 + torch.arange(changed - n_up)])  # some new keys
    gone = dyn[pick[n_up: n_up + max(1, changed // 50)]]
    new_rows = lambda n: rows[:n].clone().flip(0)  # noqa: E731 -- rows of the right format, not the base's own
    upserts = {"items": (up_static, new_rows(changed)), "users": (up_dyn, new_rows(up_dyn.numel()))}
    return upserts, {"items": torch.zeros(0, dtype=torch.int64), "users": gone}


def batch(group, keys, batch_size: int, pooling: int, seed: int):
    """values, offsets of a 2-feature batch: ids drawn uniformly from each table's (a few unknown)."""
    g = torch.Generator().manual_seed(seed)
    n = batch_size * pooling
    items = torch.randint(0, int(group["table_rows"][0]) + 16, (n,), generator=g)
    users = keys[1:][torch.randint(0, keys.numel() - 1, (n,), generator=g)]
    values = torch.cat([items, users])
    offsets = torch.arange(0, 2 * n + 1, pooling)
    return values, offsets


def apply_memory(n_static: int, changed: int, dim: int, dtype: str) -> dict:
    group, rows, keys, index, meta = make_group(n_static, dim, dtype)
    upserts, removed = make_delta(group, rows, keys, changed)
    table_bytes = sum(t.numel() * t.element_size() for t in (rows, keys, index, meta))
    delta_bytes = sum(t.numel() * t.element_size() for kr in upserts.values() for t in kr) \
        + sum(t.numel() * t.element_size() for t in removed.values())
    with AllocatedBytes() as counted:
        patch = merge_patch(group, rows, meta, None, upserts, removed)
    return {"rows": n_static, "table_mb": table_bytes / MB, "delta_mb": delta_bytes / MB,
            "alloc_mb": counted.total / MB, "per_table": counted.total / table_bytes,
            "per_delta": counted.total / delta_bytes, "patch_mb": patch.nbytes / MB,
            "state": (group, rows, keys, index, meta, patch)}


def lookup_cost(state, dim: int, dtype: str, batch_size: int, pooling: int, repeats: int, kernels: bool) -> dict:
    group, rows, keys, index, meta, p = state
    saved = _lookup_ops.bags_accelerator, _lookup_ops.find_accelerator
    if not kernels:
        _lookup_ops.bags_accelerator = _lookup_ops.find_accelerator = None
    try:
        batches = [batch(group, keys, batch_size, pooling, seed) for seed in range(8)]
        args = dict(feature_pos=[0, 1], feature_table=[0, 1], combiners=[0, 0], batch_size=batch_size, dim=dim,
                    dtype=dtype)
        patch = dict(patch_rows=p.rows, patch_keys=p.keys, patch_index=p.index, patch_meta=p.meta,
                     patch_miss=p.miss)

        def base(v, o):
            return _runtime.pooled_lookup(v, o, rows, keys, index, meta, **args)

        def patched(v, o):
            return patched_lookup(v, o, rows, keys, index, meta, **args, **patch)

        for v, o in batches:  # bags without an id the patch holds (in either table) read what the base reads
            held = torch.isin(v, p.keys).view(2, batch_size, pooling).any(-1).t()
            same = (base(v, o) == patched(v, o)).all(-1)
            if not bool(same[~held].all()):
                raise SystemExit("patched_lookup differs from the base on ids the patch does not hold")
        fns = {"base": base, "patched": patched}
        per_call: dict[str, list[float]] = {k: [] for k in fns}
        calls = max(1, int(2000 / batch_size)) * 8
        for r in range(repeats):  # interleaved, the order reversed every other run
            for name in fns if r % 2 == 0 else list(fns)[::-1]:
                fn = fns[name]
                t0 = time.perf_counter()
                for i in range(calls):
                    fn(*batches[i % len(batches)])
                per_call[name].append((time.perf_counter() - t0) / calls)
        med = {k: statistics.median(v) for k, v in per_call.items()}
        return {"base_us": med["base"] * 1e6, "patched_us": med["patched"] * 1e6,
                "ratio": med["patched"] / med["base"]}
    finally:
        _lookup_ops.bags_accelerator, _lookup_ops.find_accelerator = saved


def predict_cost(artifact: str, batch_size: int, repeats: int) -> dict:
    """Medians of ServingModel.predict without and with the artifact's deltas, on the same requests."""
    from hugeembed.features import SparseFeatures
    from hugeembed.serving import ServingModel

    base, patched = ServingModel.load(artifact, apply_deltas=False), ServingModel.load(artifact)
    if not patched.served.deltas:
        raise SystemExit(f"{artifact} has no delta to apply (hugeembed export --delta)")
    g = torch.Generator().manual_seed(0)
    names = base.features
    changed = torch.cat([p.keys for p in patched.served.patch if p is not None])
    n = batch_size * len(names)

    def ids() -> torch.Tensor:  # half of them keys the deltas changed (in some table), half random ones
        pick = changed[torch.randint(0, changed.numel(), (n,), generator=g)]
        return torch.where(torch.rand(n, generator=g) < 0.5, pick, torch.randint(0, 1 << 20, (n,), generator=g))

    requests = [(torch.randn(batch_size, base.num_dense, generator=g),
                 SparseFeatures(names, ids(), offsets=torch.arange(n + 1), batch_size=batch_size)) for _ in range(8)]
    models = {"base": base, "patched": patched}
    per_call: dict[str, list[float]] = {k: [] for k in models}
    calls = max(4, int(4000 / batch_size))
    for m in models.values():
        for dense, sparse in requests:
            m.predict(dense, sparse)
    for r in range(repeats):
        for name in models if r % 2 == 0 else list(models)[::-1]:
            t0 = time.perf_counter()
            for i in range(calls):
                models[name].predict(*requests[i % len(requests)])
            per_call[name].append((time.perf_counter() - t0) / calls)
    med = {k: statistics.median(v) for k, v in per_call.items()}
    return {"base_ms": med["base"] * 1e3, "patched_ms": med["patched"] * 1e3, "ratio": med["patched"] / med["base"],
            "deltas": len(patched.served.deltas)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0], allow_abbrev=False)
    ap.add_argument("--rows", default="500000,2000000,8000000", help="static table sizes, comma-separated")
    ap.add_argument("--changed", type=int, default=1000, help="rows a delta upserts per table")
    ap.add_argument("--dim", type=int, default=32)
    ap.add_argument("--dtype", default="int8", choices=["fp32", "fp16", "int8", "int4"])
    ap.add_argument("--batches", default="64,1024", help="batch sizes of the lookup timing")
    ap.add_argument("--pooling", type=int, default=1, help="ids per bag")
    ap.add_argument("--repeats", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (a server's model call)")
    ap.add_argument("--quick", action="store_true", help="small tables, few repeats")
    ap.add_argument("--artifact", help="an artifact with deltas: also time its predictions without and with them")
    a = ap.parse_args(argv)
    if a.quick:
        a.rows, a.batches, a.repeats = "100000,400000", "64", 3
    torch.set_num_threads(a.threads)
    sizes = [int(x) for x in a.rows.split(",")]
    print(f"# apply memory: a delta of {a.changed} rows per table ({a.dtype}, dim {a.dim}); allocated = every "
          f"tensor created while the patch is merged, no free subtracted")
    print(f"{'rows':>10} {'tables MB':>10} {'delta MB':>9} {'alloc MB':>9} {'alloc/tables':>13} "
          f"{'alloc/delta':>12} {'patch MB':>9}")
    states = []
    for n in sizes:
        r = apply_memory(n, a.changed, a.dim, a.dtype)
        states.append(r.pop("state"))
        print(f"{r['rows']:>10} {r['table_mb']:>10.1f} {r['delta_mb']:>9.3f} {r['alloc_mb']:>9.3f} "
              f"{r['per_table']:>13.5f} {r['per_delta']:>12.2f} {r['patch_mb']:>9.3f}", flush=True)
    print(f"# patched lookup against the base lookup ({a.threads} thread(s), pooling {a.pooling}, medians of "
          f"{a.repeats} interleaved runs), on the largest tables")
    print(f"{'path':>8} {'batch':>6} {'base us':>9} {'patched us':>11} {'ratio':>6}")
    for kernels in (True, False):
        for b in (int(x) for x in a.batches.split(",")):
            r = lookup_cost(states[-1], a.dim, a.dtype, b, a.pooling, a.repeats, kernels)
            print(f"{'kernels' if kernels else 'torch':>8} {b:>6} {r['base_us']:>9.1f} {r['patched_us']:>11.1f} "
                  f"{r['ratio']:>6.2f}", flush=True)
    if a.artifact:
        print(f"# ServingModel.predict of {a.artifact}: its base alone and with its deltas (medians of {a.repeats})")
        print(f"{'batch':>6} {'deltas':>6} {'base ms':>8} {'patched ms':>11} {'ratio':>6}")
        for b in (int(x) for x in a.batches.split(",")):
            r = predict_cost(a.artifact, b, a.repeats)
            print(f"{b:>6} {r['deltas']:>6} {r['base_ms']:>8.2f} {r['patched_ms']:>11.2f} {r['ratio']:>6.2f}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

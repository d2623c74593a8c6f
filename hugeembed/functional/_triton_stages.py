"""The pool stage on the triton kernels (hugeembed/_triton/pooled.py): CUDA tables, or CPU tensors under
triton's interpreter (``TRITON_INTERPRET=1``, the tests).

What the kernels take: pooled features (sum / mean / sqrtn) of fp32, fp16 or bf16 rows with unit
column stride, with no weights or float32 ones.  Everything else stays on the torch reference
(_reference.py), which is also the oracle: the clean + dedup stage (``prepare_torch``), unpooled
(sequence) features, float64 rows or weights, and the whole backward.

A dim group's pooled features go in one launch per rows tensor: a table group's tables share one
(an EmbeddingCollection gives every table of a group its rows, and slots that index them), so a
collection pools each dim group of a table group in one launch; tables given as separate tensors
take one launch each.  The tables of one launch are told apart by their element base in it.
"""

from __future__ import annotations

from typing import Sequence

import torch

from .. import _triton
from ._plan import DimGroup, LookupPlan, Prepared

__all__ = ["triton_runs_on", "pool_triton", "forward_direct_triton"]

_ROW_DTYPES = (torch.float32, torch.float16, torch.bfloat16)


def triton_runs_on(device: torch.device) -> bool:
    """Whether the triton kernels can run on tensors of `device`: CUDA when triton imports, or the CPU
    under triton's interpreter (which copies CUDA tensors to the host and back: not used for them)."""
    if not _triton.available():
        return False
    if device.type == "cuda":
        return not _triton.interpreting()
    return device.type == "cpu" and _triton.interpreting()


def _takes_rows(s) -> bool:
    return (isinstance(s, torch.Tensor) and s.dim() == 2 and s.dtype in _ROW_DTYPES
            and (s.stride(1) == 1 or s.size(1) <= 1))


def _takes_weights(w: torch.Tensor | None) -> bool:
    return w is None or w.dtype == torch.float32


def _launches(plan: LookupPlan, group: DimGroup, storages: Sequence[torch.Tensor], device: torch.device):
    """Per rows tensor the group's pooled features read: (the tensor, the launch's feature table
    ``int64 [n, 4]`` on `device`, n), or None when a table's rows are not the kernel's.

    Rows of one dtype share a launch (_launch_plan).  Worked out once per layout of the rows (where each
    table's rows start, their strides and dtypes): a call with the same layout only looks it up (the walk
    over the features cost ~100 us a call at 26 tables)."""
    key = (id(group), device, tuple((s.data_ptr(), s.stride(), s.dtype) if isinstance(s, torch.Tensor) else None
                                    for s in storages))
    cache = plan.memo(("triton_launches",), dict)
    plan_of = cache.get(key)
    if plan_of is None:
        if len(cache) >= 64:  # (layouts that keep changing: rows regrown, other tensors each call)
            cache.clear()
        plan_of = cache[key] = _launch_plan(plan, group, storages, device)
    return None if plan_of is None else [(storages[t], table, n) for t, table, n in plan_of]


def _launch_plan(plan: LookupPlan, group: DimGroup, storages: Sequence[torch.Tensor], device: torch.device):
    """_launches' result with each rows tensor given by its table's index (the cache keeps no tensor).

    Rows of one dtype share a launch wherever they live: a feature's rows are addressed from the lowest
    tensor by their distance in elements (one address space: a GPU's, or the host's under the
    interpreter), so 26 tables given as 26 tensors are one launch, not 26 (each costs ~10-30 us of
    the host's time); a distance that is not a whole number of elements takes a launch of its own."""
    units: dict[torch.dtype, list[tuple[int, int, int]]] = {}
    for k, f in enumerate(group.pooled):
        t = plan.feature_table[f]
        s = storages[t]
        if not _takes_rows(s):
            return None
        units.setdefault(s.dtype, []).append((f, k, t))
    out = []
    for members in _whole_elements(units, storages):
        base = min((t for _, _, t in members), key=lambda t: storages[t].data_ptr())
        table = []
        for f, k, t in members:
            s = storages[t]
            table += [f, k, (s.data_ptr() - storages[base].data_ptr()) // s.element_size(), s.stride(0)]
        out.append((base, plan.on_device(tuple(table), device), len(members)))
    return out


def _whole_elements(units: dict, storages) -> list[list[tuple[int, int, int]]]:
    """`units`' members split where a table's distance from its unit's lowest rows is not a whole number of
    elements (never for torch's allocations, which are aligned; a view at an odd byte could be)."""
    out = []
    for members in units.values():
        low = min(storages[t].data_ptr() for _, _, t in members)
        by_rest: dict[int, list] = {}
        for m in members:
            s = storages[m[2]]
            by_rest.setdefault((s.data_ptr() - low) % s.element_size(), []).append(m)
        out += by_rest.values()
    return out


def _settings(plan: LookupPlan, group: DimGroup, device: torch.device) -> tuple[dict, bool]:
    """The plan's per-feature and per-table arrays as the kernel's arguments, and whether a table of
    the group clips its rows (max_norm)."""
    def make():
        a = plan.arrays(device)
        clip = any(plan.tables[plan.feature_table[f]].max_norm for f in group.pooled)
        return dict(feat_table_ptr=a["table"], combiner_ptr=a["combiner"], max_norm_ptr=a["max_norm"],
                    prune_neg_ptr=a["prune_neg"], oor_ptr=a["oor"], has_default_ptr=a["has_default"],
                    default_id_ptr=a["default_id"], num_rows_ptr=a["num_rows"]), clip

    got = plan.memo(("triton_settings", id(group), device), make)
    return dict(got[0]), got[1]


def pool_triton(plan: LookupPlan, prep: Prepared, storages, slots: torch.Tensor, group: DimGroup,
                shuffle: int | None = None) -> torch.Tensor | None:
    """Pooled output ``float32 [B, F_g, D]`` of the group's pooled features from a prepared batch (the
    same numbers as ``pool_torch``), or None when the kernel does not take these rows or weights.

    `shuffle`: for tests, each launch's programs one at a time in an order drawn from this seed."""
    from .._triton import pooled

    B, D, n = prep.batch_size, group.dim, len(group.pooled)
    dev = prep.offsets.device
    if not _takes_weights(prep.weights):
        return None
    launches = _launches(plan, group, storages, dev)
    if launches is None:
        return None
    out = torch.empty(B, n, D, dtype=torch.float32, device=dev)
    if n == 0 or B == 0:
        return out
    settings, clip = _settings(plan, group, dev)
    weights = None if prep.weights is None else prep.weights.detach().contiguous()
    block_b, block_d = pooled.block_bags(D)
    for rows, table, count in launches:
        args = dict(rows_ptr=rows, out_ptr=out, launch_ptr=table, offsets_ptr=prep.offsets,
                    ids_ptr=prep.inverse.contiguous(), weights_ptr=prep.offsets if weights is None else weights,
                    slots_ptr=slots.contiguous(), source_ptr=prep.offsets, status_ptr=prep.offsets,
                    B=B, D=D, out_stride=n * D, n_ids=prep.inverse.numel(), n_offsets=prep.offsets.numel(),
                    **settings)
        pooled.launch(B * count, args, dict(DIRECT=False, HAS_WEIGHTS=weights is not None, CLIP=clip,
                                            BLOCK_B=block_b, BLOCK_D=block_d), shuffle)
    return out


def forward_direct_triton(plan: LookupPlan, sf, storages, shuffle: int | None = None) -> tuple[list[torch.Tensor], bool] | None:
    """Every dim group's pooled output ``float32 [B, F_g, D]`` of static tables straight from the raw
    batch (TF's cleaning inline, each row read once), and whether some bag holds bad input (bad
    offsets, a weight not finite, an id out of range under "error": the caller then runs the path
    that raises the error with its details).  One read of the device, for that flag.

    None when the kernel does not take these tables or weights (the caller takes prepare + pool)."""
    from .._triton import pooled

    values, weights, dev = sf.values(), sf.weights_or_none(), sf.device
    if not _takes_weights(weights) or any(g.unpooled for g in plan.groups):
        return None
    groups = [_launches(plan, g, storages, dev) for g in plan.groups]
    if any(launches is None for launches in groups):
        return None
    B, N = sf.batch_size, values.numel()
    offsets = sf.offsets().to(torch.int64).contiguous()
    weights = None if weights is None else weights.detach().contiguous()
    source = plan.source_indices(sf.keys(), dev)
    status = torch.zeros(1, dtype=torch.int32, device=dev)  # the kernels' flag: some bag or the offsets bad
    outs, done = [], 0
    for group, launches in zip(plan.groups, groups):
        D, n = group.dim, len(group.pooled)
        out = torch.empty(B, n, D, dtype=torch.float32, device=dev)
        outs.append(out)
        if n == 0 or B == 0:
            continue
        settings, clip = _settings(plan, group, dev)
        block_b, block_d = pooled.block_bags(D)
        for rows, table, count in launches:
            args = dict(rows_ptr=rows, out_ptr=out, launch_ptr=table, offsets_ptr=offsets, ids_ptr=values,
                        weights_ptr=offsets if weights is None else weights, slots_ptr=offsets, source_ptr=source,
                        status_ptr=status, B=B, D=D, out_stride=n * D, n_ids=N, n_offsets=offsets.numel(),
                        **settings)
            pooled.launch(B * count, args, dict(DIRECT=True, HAS_WEIGHTS=weights is not None, CLIP=clip,
                                                BLOCK_B=block_b, BLOCK_D=block_d), shuffle)
            done += B * count
    # the one read: the kernels' flag, or (no kernel ran: no bags) whether offsets run from 0 to len(values)
    bad = bool(status.item()) if done else bool(torch.cat([offsets[:1], offsets[-1:] - N]).any())
    return outs, bad

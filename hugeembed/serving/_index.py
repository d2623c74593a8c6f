"""The key indexes of a dim group: the artifact's (built at export, index.npy) and the served tables' private
one (the artifact's layout with a random salt, built at load).

The artifact's own index (:func:`build_index`; ``_runtime`` reads it, see its "key index" notes) hashes ids with a fixed, public
function: anyone can compute ids that share one home slot, and 24 k such ids made a table 800x
slower (every probe walks the whole chain).  hugeembed builds its own index of every dim group when
tables are loaded (``_runtime.Tables``: a delta's new tables too), in the server's memory only, with
the kernels (csrc/serve_index.h):

* the home slot of (id, table t) is splitmix64 of ``(id + (t + 1) * GOLDEN) ^ salt``, the salt 64 bits
  from the OS's random source, drawn for each index: colliding ids cannot be chosen from outside;
* a build whose longest chain passes ``PROBE_CAP`` slots draws another salt, and after a few draws
  doubles the slots;
* slots of (key, position in the key array), at most half full, linear probing: a probe reads one
  slot, 16 bytes, where the artifact's index (slots of positions alone) reads a slot and then the key
  it names elsewhere: two dependent cache misses an id.  It costs 32 bytes a key (the artifact's: 8,
  and the 8 of the key array, which the lookups then no longer touch).

The index is one int64 tensor (a header of 8 words, then two words a slot) that the lookup op takes
in place of the artifact's; only the kernels read it (an artifact's own runtime copy keeps the
artifact's index, and refuses this one: its length is no power of two).
"""

from __future__ import annotations

import secrets

import torch

from .. import _native
from . import _lookup_ops, _runtime

__all__ = ["serving_index", "index_probes", "is_serving_index", "index_salt", "build_index", "index_capacity",
           "group_tables", "INDEX_MAGIC", "PROBE_CAP"]

INDEX_MAGIC = 0x31534548  # csrc/serve_index.h kIndexMagic ("HES1")
HEADER = 8  # words: magic, log2(slots), longest chain, the salt in four 16-bit parts, 0
PROBE_CAP = 256  # the longest chain (slots) a build with a drawn salt keeps; a drawn salt gives ~50 at 10 M keys
CHAIN_TOO_LONG = -1  # he_serve_index_build's result (kIndexChainTooLong)
_SALT_DRAWS = 3


def is_serving_index(index: torch.Tensor) -> bool:
    """True for an index built by :func:`serving_index` (its header's magic)."""
    n = index.numel()
    return (index.dtype == torch.int64 and index.dim() == 1 and n > HEADER and n & (n - 1) != 0
            and int(index[0]) == INDEX_MAGIC)


def index_salt(index: torch.Tensor) -> int:
    """The salt a private index hashes with (64 bits)."""
    parts = [int(x) & 0xFFFF for x in index[3:7].tolist()]
    return sum(p << (16 * q) for q, p in enumerate(parts))


def serving_index(keys: torch.Tensor, meta: torch.Tensor, *, salt: int | None = None,
                  probe_cap: int = PROBE_CAP) -> torch.Tensor:
    """The private index of one dim group (``keys`` and ``meta`` as the lookup op takes them).

    Args:
        keys: int64, the group's dynamic tables' keys, table after table.
        meta: int64 ``[T, 5]`` table records (``_runtime.table_meta``).
        salt: the hash salt, 64 bits.  None (serving): drawn at random, and drawn again (then the
            slots doubled) while a chain is longer than `probe_cap`.  Given: used as is, every chain
            kept (tests, benchmarks).
        probe_cap: the longest chain, in slots, a build with a drawn salt keeps.

    ArtifactError when a table holds a key twice.
    """
    keys = keys.to(torch.int64).contiguous()
    meta = meta.to(torch.int64).contiguous()
    n = int(keys.numel())
    # >= 16 slots: 8 + 2^(k+1) words (k >= 4) are never a power of two, which the runtime's torch path refuses
    log2cap = max(4, index_capacity(n).bit_length() - 1)
    for attempt in range(4 * _SALT_DRAWS):
        s = (secrets.randbits(64) if salt is None else salt) & ((1 << 64) - 1)
        index = torch.empty(HEADER + (2 << log2cap), dtype=torch.int64)
        cap = probe_cap if salt is None else 1 << log2cap
        try:
            got = _native.call("he_serve_index_build", [keys, meta, index],
                               [log2cap, s - (1 << 64) if s >> 63 else s, cap])
        except _native.KernelError as e:  # a key twice in a table, or records outside the keys
            if e.status != _native.Status.BAD_VALUE:
                raise
            raise _runtime.ArtifactError(f"the key index cannot be built: {e}") from None
        if got != CHAIN_TOO_LONG:
            return index
        if attempt % _SALT_DRAWS == _SALT_DRAWS - 1:  # a few salts gave long chains: more room
            log2cap += 1
    raise _runtime.ArtifactError(f"the key index of {n} keys keeps chains longer than {probe_cap} slots")


def index_probes(index: torch.Tensor, ids: torch.Tensor, table: torch.Tensor, keys: torch.Tensor,
                 meta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(position in `keys` of each (id, table) or -1, slots each probe read) through a private index."""
    ids, table = ids.to(torch.int64).contiguous(), table.to(torch.int64).contiguous()
    pos, probes = torch.empty_like(ids), torch.empty_like(ids)
    _native.call("he_serve_index_probes", [ids, table, keys.contiguous(), index, meta.to(torch.int64).contiguous(),
                                           pos, probes])
    return pos, probes


# -- the artifact's index (export, deltas' patches): only built here, read by _runtime ------------------------------


def index_capacity(num_keys: int) -> int:
    """The smallest power of two >= 2 * num_keys (and >= 2): load factor <= 0.5."""
    return 1 << max(1, (2 * num_keys - 1).bit_length())


def build_index(keys: torch.Tensor, table_of: torch.Tensor, num_tables: int) -> tuple[torch.Tensor, list[int]]:
    """(slots, max probes per table) of a group's keys; ``table_of[i]``: the table (index in the group)
    key i belongs to.  Vectorized and deterministic: round r places every unplaced key at its home + r
    if that slot is free, the lowest key position winning a slot several keys want (scatter amin);
    the others move on.  Slots are int32 when the positions fit (< 2^31), else int64."""
    n = int(keys.numel())
    cap = index_capacity(n)
    slots = torch.full((cap,), -1, dtype=torch.int64)
    probes = torch.zeros(num_tables, dtype=torch.int64)
    home = _lookup_ops.hash_slots(keys.to(torch.int64), table_of.to(torch.int64), cap)
    pending = torch.arange(n, dtype=torch.int64)
    r = 0
    while pending.numel():
        at = (home.index_select(0, pending) + r).bitwise_and_(cap - 1)
        free = slots.index_select(0, at) == -1
        want, where = pending[free], at[free]
        slots.index_fill_(0, where, n)  # above every position: amin leaves the lowest contender
        slots.scatter_reduce_(0, where, want, "amin")
        won = torch.zeros_like(free)
        won[free] = slots.index_select(0, where) == want
        done = pending[won]
        probes.scatter_reduce_(0, table_of.index_select(0, done).to(torch.int64),
                               torch.full_like(done, r + 1), "amax")
        pending = pending[~won]
        r += 1
    return (slots.to(torch.int32) if n < (1 << 31) else slots), probes.tolist()


def group_tables(group: dict, sizes: list[int], rows: torch.Tensor, keys: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``_runtime.group_tables`` of a group whose index is built here from its keys (export, a patch)."""
    dyn = [t for t, k in enumerate(group["table_keys"]) if k >= 0]
    table_of = torch.repeat_interleave(torch.tensor(dyn, dtype=torch.int64),
                                       torch.tensor([sizes[t] for t in dyn], dtype=torch.int64),
                                       output_size=int(keys.numel()))
    index, max_probe = build_index(keys, table_of, len(sizes))
    return _runtime.group_tables(group, sizes, rows, keys, index, max_probe)

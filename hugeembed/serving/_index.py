"""The served tables' private key index: the artifact's layout with a random salt, built at load.

The artifact's own index (``_runtime.build_index``, index.npy) hashes ids with a fixed, public
function: anyone can compute ids that share one home slot, and 24 k such ids made a table 800x
slower (every probe walks the whole chain).  hugeembed builds its own index of every dim group when
tables are loaded (``_runtime.Tables``: a delta's new tables too), in the server's memory only, with
the kernels (csrc/serve_index.h):

* the home slot of (id, table t) is splitmix64 of ``(id + (t + 1) * GOLDEN) ^ salt``, the salt 64 bits
  from the OS's random source, drawn for each index: colliding ids cannot be chosen from outside;
* a build whose longest chain passes ``PROBE_CAP`` slots draws another salt, and after a few draws
  doubles the slots;
* otherwise the artifact's layout (slots of positions into the key array, at most half full, linear
  probing): measured, a bucket of keys and rows read at once was no faster here (with the home slots
  prefetched ahead, the key a slot names is mostly in cache), and took twice the memory.

The index is one tensor (a header of 8 words, then the slots) that the lookup op takes in place of
the artifact's; only the kernels read it (an artifact's own runtime copy keeps the artifact's index,
and refuses this one: its length is no power of two).
"""

from __future__ import annotations

import secrets

import torch

from .. import _native
from . import _runtime

__all__ = ["serving_index", "index_probes", "is_serving_index", "index_salt", "INDEX_MAGIC", "PROBE_CAP"]

INDEX_MAGIC = 0x31534548  # csrc/serve_index.h kIndexMagic ("HES1")
HEADER = 8  # words: magic, log2(slots), longest chain, the salt in four 16-bit parts, 0
PROBE_CAP = 256  # the longest chain (slots) a build with a drawn salt keeps; a drawn salt gives ~50 at 10 M keys
CHAIN_TOO_LONG = -1  # he_serve_index_build's result (kIndexChainTooLong)
_SALT_DRAWS = 3


def is_serving_index(index: torch.Tensor) -> bool:
    """True for an index built by :func:`serving_index` (its header's magic)."""
    n = index.numel()
    return (index.dtype in (torch.int32, torch.int64) and index.dim() == 1 and n > HEADER and n & (n - 1) != 0
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
    # >= 16 slots: 8 + 2^k words (k >= 4) are never a power of two, which the runtime's torch path refuses
    log2cap = max(4, _runtime.index_capacity(n).bit_length() - 1)
    dtype = torch.int32 if n < (1 << 31) else torch.int64
    for attempt in range(4 * _SALT_DRAWS):
        s = (secrets.randbits(64) if salt is None else salt) & ((1 << 64) - 1)
        index = torch.empty(HEADER + (1 << log2cap), dtype=dtype)
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

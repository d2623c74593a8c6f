"""ArrayStore: a static table of `num_rows` rows where key k lives at slot k, on its own.

A group of one static table (store/_static.py) and its view (store/_views.py): the classic
``nn.Embedding`` layout with the RowStore interface of the dynamic tables.  Rows start as the
table's initializer makes them at key = row index, so a HashStore trained on ids in [0, n) holds
exactly the rows of an ArrayStore(n)::

    keys   [3, 0, 7]  ->  slots [3, 0, 7]       key 12 with num_rows=10 -> InputError
"""

from __future__ import annotations

import torch

from ._common import make_layout
from ._init import Initializer
from ._layout import RowLayout
from ._settings import TableSettings
from ._static import StaticGroup
from ._views import StaticTable

__all__ = ["ArrayStore"]


class ArrayStore(StaticTable):
    """Static key -> row store: keys must lie in [0, num_rows).

    Args:
        name: table name (in every error message).
        num_rows: rows of the table, all allocated and initialised now.
        dim, state_width, initializer, init_state, dtype, device, seed, layout: as for HashStore.
        rows: False makes this store the key index of a tiered table (store/_tiered.py): the
            range check and the per-row counts, no rows.

    Example::

        >>> store = ArrayStore("country", num_rows=250, dim=4)
        >>> store.gather(store.find_or_insert(torch.tensor([3, 7]), step=0)).shape
        torch.Size([2, 4])
    """

    def __init__(self, name: str, num_rows: int, dim: int, state_width: int = 0, *,
                 initializer: Initializer | None = None, init_state=None, dtype: torch.dtype = torch.float32,
                 device: torch.device | str = "cpu", seed: int = 0, layout: RowLayout | None = None,
                 rows: bool = True, shard: int = 0, num_shards: int = 1):
        settings = TableSettings(name, make_layout(name, dim, state_width, dtype, layout), initializer=initializer,
                                 init_state=init_state, seed=int(seed), num_rows=num_rows, shard=shard,
                                 num_shards=num_shards)
        super().__init__(StaticGroup([settings], device=device, rows=rows), 0)

    @classmethod
    def of_group(cls, group: StaticGroup) -> "ArrayStore":
        out = cls.__new__(cls)
        StaticTable.__init__(out, group, 0)
        return out

    def to(self, device: torch.device | str) -> "ArrayStore":
        """A copy on `device`."""
        return type(self).of_group(self.group.to(device))

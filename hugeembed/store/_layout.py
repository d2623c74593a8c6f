"""RowLayout: how one table row (weights + optimizer state) is stored, and typed views of it.

A store keeps every row as ONE record of a single storage tensor ``[R, W]``, so rows
move whole (growth, eviction, snapshots, sharding, import/export copy raw rows).  The
layout says how that record splits into the weights (D values of the weight dtype) and
the optimizer state (S values of the state dtype)::

    same dtype (the default: fp32/fp32, fp64/fp64)      storage dtype = weight dtype, W = D + S
      | w_0 ... w_{D-1} | s_0 ... s_{S-1} |              weights(storage) = storage[:, :D]

    16-bit weights, fp32 state (the default of fp16/bf16 tables)   storage dtype = float32
      | w0 w1 | w2 w3 | ... | s_0 ... s_{S-1} |          W = ceil(D / 2) + S
        packed: the first ceil(D/2) float32 columns hold the D 16-bit weights, read through
        storage[:, :ceil(D/2)].view(float16 or bfloat16)[:, :D]

Both views alias the storage (no copy): writing into them writes the row.  Optimizer
state is 16-bit only when asked for (it overflows: Adagrad's accumulator in fp16 is inf
after one gradient of ~256), hence the fp32 default for 16-bit tables.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import ConfigError

__all__ = ["RowLayout", "LayoutViews", "default_state_dtype", "check_import_rows"]

_LOW = (torch.float16, torch.bfloat16)
_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def default_state_dtype(dtype: torch.dtype) -> torch.dtype:
    """float32 for 16-bit weights (16-bit state overflows / loses updates), else the weight dtype."""
    return torch.float32 if dtype in _LOW else dtype


def _name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class RowLayout:
    """How a row of `dim` weights (`dtype`) and `state_width` state values (`state_dtype`) is stored.

    Supported: ``state_dtype == dtype``, or 16-bit weights with float32 state (packed).
    Anything else is a ConfigError naming `table`.

    Example::

        >>> lay = RowLayout(dim=3, dtype=torch.float16, state_width=3, state_dtype=torch.float32)
        >>> lay.width, lay.storage_dtype            # ceil(3/2) packed columns + 3 state columns
        (5, torch.float32)
        >>> s = lay.empty(4)
        >>> lay.weights(s).shape, lay.weights(s).dtype, lay.state(s).shape
        (torch.Size([4, 3]), torch.float16, torch.Size([4, 3]))
    """

    dim: int
    dtype: torch.dtype
    state_width: int = 0
    state_dtype: torch.dtype | None = None  # None: default_state_dtype(dtype)
    stochastic_rounding: bool = False  # how updated weights are written (see round_weights)
    table: str = field(default="?", compare=False)  # named in errors only

    def __post_init__(self) -> None:
        who = f"table {self.table!r}"
        if isinstance(self.dim, bool) or not isinstance(self.dim, int) or self.dim < 1:
            raise ConfigError(f"{who}: dim must be a positive int, got {self.dim!r}")
        if isinstance(self.state_width, bool) or not isinstance(self.state_width, int) or self.state_width < 0:
            raise ConfigError(f"{who}: state_width must be an int >= 0, got {self.state_width!r}")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"{who}: dtype must be one of {[_name(d) for d in _DTYPES]}, got {self.dtype}")
        if self.state_dtype is None:
            object.__setattr__(self, "state_dtype", default_state_dtype(self.dtype))
        sd = self.state_dtype
        if not isinstance(sd, torch.dtype) or not (sd == self.dtype or (self.dtype in _LOW and sd == torch.float32)):
            raise ConfigError(f"{who}: state_dtype {sd} is not supported with {_name(self.dtype)} weights; "
                              f"use {_name(self.dtype)} (the weight dtype)"
                              + (" or float32 (the default)" if self.dtype in _LOW else ""))
        if not isinstance(self.stochastic_rounding, bool):
            raise ConfigError(f"{who}: stochastic_rounding must be True or False, got {self.stochastic_rounding!r}")
        if self.stochastic_rounding and self.dtype not in _LOW:
            raise ConfigError(f"{who}: stochastic_rounding rounds updates to float16/bfloat16 weights; "
                              f"this table's weights are {_name(self.dtype)}")

    # ------------------------------------------------------------------ shape
    @property
    def packed(self) -> bool:
        """True when the weights are packed into columns of the (wider) state dtype."""
        return self.dtype != self.state_dtype

    @property
    def storage_dtype(self) -> torch.dtype:
        return self.state_dtype

    @property
    def weight_columns(self) -> int:
        """Storage columns the weights occupy: D, or ceil(D * 2 / 4) when packed."""
        if not self.packed:
            return self.dim
        ratio = _itemsize(self.state_dtype) // _itemsize(self.dtype)
        return -(-self.dim // ratio)

    @property
    def width(self) -> int:
        """W: storage columns of one row."""
        return self.weight_columns + self.state_width

    @property
    def row_bytes(self) -> int:
        return self.width * _itemsize(self.storage_dtype)

    @property
    def compute_dtype(self) -> torch.dtype:
        """What the torch optimizer twins compute in: float32 for 16-bit weights, else the weight dtype."""
        return torch.float32 if self.dtype in _LOW else self.dtype

    def describe(self) -> dict:
        """Plain data for manifests (what must match for raw rows to be read back)."""
        return {"dim": self.dim, "dtype": _name(self.dtype), "state_width": self.state_width,
                "state_dtype": _name(self.state_dtype), "width": self.width}

    # ------------------------------------------------------------------ views
    def empty(self, rows: int, device: torch.device | str = "cpu") -> torch.Tensor:
        return torch.empty(rows, self.width, dtype=self.storage_dtype, device=device)

    def weights(self, storage: torch.Tensor) -> torch.Tensor:
        """``[R, D]`` view of the weights, of the weight dtype (aliases `storage`)."""
        if not self.packed:
            return storage[:, : self.dim]
        return storage[:, : self.weight_columns].view(self.dtype)[:, : self.dim]

    def lookup_rows(self, storage: torch.Tensor) -> torch.Tensor:
        """What a lookup reads: rows whose first D columns are the weights, of the weight dtype.

        The storage itself when plain (the fused lookup reads the first D columns of any
        wider row, and a training step then builds no view per table: a view costs ~1-4 us,
        ~2% of a small 26-table step), else the typed ``[R, D]`` weights view."""
        return storage if not self.packed else self.weights(storage)

    def state(self, storage: torch.Tensor) -> torch.Tensor:
        """``[R, S]`` view of the optimizer state, of the state dtype (aliases `storage`)."""
        wc = self.weight_columns
        return storage[:, wc : wc + self.state_width]


def _itemsize(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


class LayoutViews:
    """Mixin of the stores: typed views of the live storage through ``self.layout``.

    Re-read them after every find_or_insert, as ``storage()``: a growing store moves its rows.
    """

    layout: RowLayout
    write_stamp: int = 0  # a write outside training (store/_common.direct_write) sets a newer one

    def weights(self) -> torch.Tensor:
        """``[R, D]`` weights of the weight dtype (aliases the storage)."""
        return self.layout.weights(self.storage())  # type: ignore[attr-defined]

    def state(self) -> torch.Tensor:
        """``[R, S]`` optimizer state of the state dtype (aliases the storage)."""
        return self.layout.state(self.storage())  # type: ignore[attr-defined]

    def lookup_rows(self) -> torch.Tensor:
        """``layout.lookup_rows(storage())``: the rows a fused lookup reads the weights from."""
        return self.layout.lookup_rows(self.storage())  # type: ignore[attr-defined]


def check_import_rows(name: str, layout: RowLayout, rows: torch.Tensor) -> None:
    """Imported rows are raw records of this layout: same width, and (packed) the storage dtype,
    since converting a packed record value by value would scramble its weights."""
    from ..errors import InputError

    if rows.shape[1] != layout.width:
        raise InputError(f"table '{name}': import has rows of width {rows.shape[1]}, the table has "
                         f"{layout.width} (layout {layout.describe()})")
    if layout.packed and rows.dtype != layout.storage_dtype:
        raise InputError(f"table '{name}': import has {rows.dtype} rows, this table's packed rows are "
                         f"{layout.storage_dtype} (layout {layout.describe()})")

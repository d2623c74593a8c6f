"""Sparse optimizers: rules applied in place to the touched rows of an embedding table.

Each rule is a frozen config (:class:`SparseOptimizer`) with ``state_width(D)``,
``init_state(state)``, ``apply(storage, slots, grad, lr=, step=)`` over a plain table
whose rows hold the weight and the optimizer state side by side, and
``update(store, slots, grad, lr=, step=)``, the path every caller holding a store takes
(it reads weights and state through the store's RowLayout, each in its own dtype).
See docs/optim.md for every update formula and the reference it matches.
"""

from ._adagrad import Adagrad, RowWiseAdagrad
from ._adam import Adam
from ._base import SparseOptimizer
from ._ftrl import FTRL
from ._registry import make_optimizer
from ._sgd import SGD, MomentumSGD

__all__ = [
    "SparseOptimizer",
    "SGD",
    "MomentumSGD",
    "Adagrad",
    "RowWiseAdagrad",
    "Adam",
    "FTRL",
    "make_optimizer",
]

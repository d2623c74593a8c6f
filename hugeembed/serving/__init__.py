"""Serving: a frozen export of a trained model (fp32/fp16/int8/int4 tables, the dense part as a
torch.export program), its Python inference API, an HTTP server and increments (deltas) applied
to a running model.  See docs/serving.md.
"""

from ._delta import export_delta
from ._export import export
from ._model import Refusal, Served, ServingModel
from ._quant import dequantize, quantize
from . import _lookup_ops, _runtime
from ._native_find import native_bags, native_find, native_index, native_pool
from ._runtime import DTYPES, pooled_lookup

# the installed runtime maps ids to rows with the kernels; artifacts' copies keep their torch path
_lookup_ops.find_accelerator, _lookup_ops.bags_accelerator = native_find, native_bags
_lookup_ops.pool_accelerator = native_pool
_runtime.index_builder = native_index  # loaded tables: the private, salted key index (_index.py)

__all__ = ["export", "export_delta", "ServingModel", "Served", "Refusal", "quantize", "dequantize", "pooled_lookup", "DTYPES"]

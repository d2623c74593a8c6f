"""Serving: a frozen export of a trained model (fp32/fp16/int8/int4 tables, the dense part as a
torch.export program), its Python inference API, an HTTP server and increments (deltas) applied
to a running model.  See docs/serving.md.
"""

from ._delta import export_delta
from ._export import export
from ._model import Served, ServingModel
from ._quant import dequantize, quantize
from . import _runtime
from ._native_find import native_find
from ._runtime import DTYPES, pooled_lookup

_runtime.find_accelerator = native_find  # the installed runtime probes with the kernels; artifacts' copies do not

__all__ = ["export", "export_delta", "ServingModel", "Served", "quantize", "dequantize", "pooled_lookup", "DTYPES"]

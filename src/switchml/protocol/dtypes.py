"""The element types the switch sums, as numpy names them and as the kernels take them.

bfloat16 is ``ml_dtypes``' type. Importing ``ml_dtypes`` costs about half a second (its
extension registers its types and their casts with numpy: 0.55-0.65 s here, more than
importing torch's core), and every worker, switch and benchmark process would pay it before
its first datagram. Nothing here imports it until a caller asks for bfloat16 by name
(``BFLOAT16``): an array can only be bfloat16 once ``ml_dtypes`` is
loaded, so the checks below look for it in ``sys.modules`` and never load it themselves.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

__all__ = ["BFLOAT16",  # noqa: F822 (``__getattr__``'s)
           "SUPPORTED_NAMES", "finfo", "is_bfloat16", "is_float", "is_supported", "kernel_view"]

_NUMPY_OWN = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
              np.dtype(np.int32))
SUPPORTED_NAMES = ("float16", "bfloat16", "float32", "float64", "int32")
"""The supported types' names, bfloat16 being ``ml_dtypes.bfloat16``."""

_bf16: np.dtype | None = None


def _loaded_bfloat16() -> np.dtype | None:
    """``ml_dtypes``' bfloat16 once something has imported ``ml_dtypes``, else None (no array
    can be of that type yet). A module another thread is still importing is in
    ``sys.modules`` before it has ``bfloat16``: that too is None, and is looked at again next
    time."""
    global _bf16
    if _bf16 is None:
        bf = getattr(sys.modules.get("ml_dtypes"), "bfloat16", None)
        if bf is not None:
            _bf16 = np.dtype(bf)
    return _bf16


def __getattr__(name: str) -> Any:
    """``BFLOAT16``, which imports ``ml_dtypes`` on first use."""
    if name == "BFLOAT16":
        import ml_dtypes
        return np.dtype(ml_dtypes.bfloat16)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def is_bfloat16(dtype: Any) -> bool:
    """``dtype`` (a numpy dtype) is ``ml_dtypes.bfloat16`` (without importing it). Only a
    2-byte dtype of numpy's kind V can be, so nothing else looks further."""
    if getattr(dtype, "kind", None) != "V" or dtype.itemsize != 2:
        return False
    bf = _loaded_bfloat16()
    return bf is not None and dtype == bf


def is_supported(dtype: Any) -> bool:
    """One of :data:`SUPPORTED_NAMES` (byte order aside)."""
    return dtype in _NUMPY_OWN or is_bfloat16(dtype)


def finfo(dtype: np.dtype) -> np.finfo:
    """The limits of a float type, bfloat16 included: ``ml_dtypes.finfo`` for bfloat16
    (``np.finfo(bfloat16)`` works only with some numpy and ml_dtypes pairs: it raised "data
    type dtype(bfloat16) not compatible with finfo" under numpy 2.5), numpy's for its own."""
    if is_bfloat16(dtype):
        import ml_dtypes
        return ml_dtypes.finfo(dtype)
    return np.finfo(dtype)


def is_float(dtype: np.dtype) -> bool:
    """A float type the switch sums in fixed point (bfloat16 included: numpy's kind is V)."""
    return dtype.kind == "f" or is_bfloat16(dtype)


def kernel_view(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels take it: bfloat16 as its bits (uint16), anything else as is."""
    return a.view(np.uint16) if is_bfloat16(a.dtype) else a

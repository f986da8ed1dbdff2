"""The element types the switch sums, as numpy names them and as the kernels take them."""

from __future__ import annotations

import ml_dtypes
import numpy as np

__all__ = ["BFLOAT16", "SUPPORTED_DTYPES", "finfo", "is_float", "kernel_view"]

BFLOAT16 = np.dtype(ml_dtypes.bfloat16)
"""bfloat16 as numpy knows it (ml_dtypes'); the kernels take its bits as uint16."""
SUPPORTED_DTYPES = (np.dtype(np.float16), BFLOAT16, np.dtype(np.float32), np.dtype(np.float64),
                    np.dtype(np.int32))


def finfo(dtype: np.dtype) -> np.finfo:
    """The limits of a float type, bfloat16 included: ``ml_dtypes.finfo``, which knows numpy's
    types and its own (``np.finfo(bfloat16)`` works only with some numpy and ml_dtypes pairs: it
    raised "data type dtype(bfloat16) not compatible with finfo" under numpy 2.5)."""
    return ml_dtypes.finfo(dtype)


def is_float(dtype: np.dtype) -> bool:
    """A float type the switch sums in fixed point (bfloat16 included: numpy's kind is V)."""
    return dtype.kind == "f" or dtype == BFLOAT16


def kernel_view(a: np.ndarray) -> np.ndarray:
    """``a`` as the kernels take it: bfloat16 as its bits (uint16), anything else as is."""
    return a.view(np.uint16) if a.dtype == BFLOAT16 else a

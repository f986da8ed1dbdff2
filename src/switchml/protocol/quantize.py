"""Fixed-point conversion with block exponents agreed through the switch (pure numpy).

Theory of operation. The switch adds int32. For each block (one packet's elements) every worker
computes ``e`` with ``max|x| < 2**e`` over its own finite elements (:func:`block_exponent`); the
switch returns ``emax``, the max over workers. Every worker then sends
``q = rint(x * 2**-emax * S)`` with ``S = floor((2**31 - 1) / n)``. Since ``|x| < 2**emax``,
``|q| <= S`` and the n-way sum satisfies ``|sum q| <= n * S <= 2**31 - 1``: no overflow for any n
and any magnitudes. The receiver computes ``sum q * 2**emax / S``.

Error bound (documented in ``docs/protocol.md``, checked by ``tests/protocol/test_quantize.py``):
each worker's rounding error is at most ``0.5 * 2**emax / S`` per element, so the sum is off by at
most ``n * 0.5 * 2**emax / S`` (about ``n**2 * 2**(emax - 32)``) before the final rounding of the
result to the output dtype. Elements far smaller than the block max lose relative precision.

Computation happens in float64, where ``x * 2**-emax`` is exact for every float16/32/64 input
(``ldexp`` is used where the combined factor would overflow float64). Non-finite elements are sent
as 0 with the NONFINITE flag; a flagged result block is written as NaN.
"""

from __future__ import annotations

import math

import numpy as np

from switchml.protocol.wire import EXP_ZERO

__all__ = ["block_exponent", "dequantize_into", "error_bound", "quantize", "scale_for"]

INT32_MAX = 2**31 - 1
_FAST_EXP_LIMIT = 900  # |emax| below this: 2**-emax * S fits float64 comfortably


def scale_for(num_workers: int) -> float:
    """Return ``S = floor((2**31 - 1) / n)``, the fixed-point scale of a full-range element."""
    return float(INT32_MAX // num_workers)


def block_exponent(x: np.ndarray) -> tuple[int, bool]:
    """Return ``(e, nonfinite)``: ``max|x| < 2**e`` over finite elements, and whether any is not.

    An all-zero (or empty, or all non-finite) block gives ``EXP_ZERO``.
    """
    if x.size == 0:
        return EXP_ZERO, False
    m = float(np.max(np.abs(x)))
    nonfinite = not math.isfinite(m)
    if nonfinite:
        finite = x[np.isfinite(x)]
        m = float(np.max(np.abs(finite))) if finite.size else 0.0
    if m == 0.0:
        return EXP_ZERO, nonfinite
    return math.frexp(m)[1], nonfinite


def quantize(x: np.ndarray, emax: int, num_workers: int, *, nonfinite: bool = False) -> np.ndarray:
    """Scale a float block to little-endian int32 with the agreed exponent ``emax``.

    Args:
        x: the block (any float dtype); not modified.
        emax: the max block exponent over all workers (``>= block_exponent(x)[0]``).
        num_workers: n, the number of workers whose values will be summed.
        nonfinite: the block holds NaN/Inf; those elements are sent as 0.
    """
    if emax == EXP_ZERO:
        return np.zeros(x.size, dtype="<i4")
    s = scale_for(num_workers)
    y = x.astype(np.float64)  # always a fresh array we can modify
    if -_FAST_EXP_LIMIT < emax < _FAST_EXP_LIMIT:
        y *= s * 2.0**-emax  # exact power-of-two factor times S: one rounding, as ldexp then *S
    else:
        y = np.ldexp(y, -emax) * s
    if nonfinite:
        y[~np.isfinite(y)] = 0.0
    np.rint(y, out=y)
    return y.astype("<i4")


def dequantize_into(out: np.ndarray, q: np.ndarray, emax: int, num_workers: int,
                    *, nonfinite: bool = False) -> None:
    """Write ``q * 2**emax / S`` into ``out`` (same length), or NaN if ``nonfinite``."""
    if nonfinite:
        out[...] = np.nan
        return
    if emax == EXP_ZERO:
        out[...] = 0
        return
    s = scale_for(num_workers)
    if -_FAST_EXP_LIMIT < emax < _FAST_EXP_LIMIT:
        out[...] = q * (2.0**emax / s)
    else:
        out[...] = np.ldexp(q / s, emax)


def error_bound(emax: int, num_workers: int) -> float:
    """Return the largest absolute error of a sum before the final cast to the output dtype."""
    if emax == EXP_ZERO:
        return 0.0
    return num_workers * 0.5 * math.ldexp(1.0, emax) / scale_for(num_workers)

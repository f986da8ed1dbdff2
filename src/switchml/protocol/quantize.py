"""Fixed-point conversion with block exponents agreed through the switch (pure numpy).

Theory of operation. The switch adds int32. For each block (one packet's elements) every worker
computes ``e`` with ``max|x| < 2**e`` over its own finite elements (:func:`block_exponent`); the
switch returns ``emax``, the max over workers. Every worker then sends
``q = rint(x * 2**(P - emax))`` with ``P = 31 - n.bit_length()`` (:func:`scale_bits`). Since
``|x| < 2**emax``, ``|q| <= 2**P`` and the n-way sum satisfies
``|sum q| <= n * 2**P < 2**31``: no overflow for any n and any magnitudes. The receiver computes
``sum q * 2**(emax - P)``.

A power-of-two scale (rather than the original's ``(2**31 - 1) / n``) costs at most one bit of
resolution and buys exactness: multiplying by ``2**k`` never rounds, so float32 blocks are scaled
in float32 (half the memory traffic of float64) and the result is the integer sum correctly
rounded once to the output dtype.

Error bound (``docs/protocol.md``; checked by the tests): each worker's rounding error is at most
``0.5 * 2**(emax - P)`` per element, so the sum is off by at most ``n * 0.5 * 2**(emax - P)``
(about ``n**2 * 2**(emax - 32)``) plus the final rounding to the output dtype. Elements far
smaller than the block max lose relative precision (as in SwitchML).

Non-finite elements are sent as 0 with the NONFINITE flag; a flagged result block is all NaN.
"""

from __future__ import annotations

import math

import numpy as np

from switchml.protocol.wire import EXP_ZERO

__all__ = ["block_exponent", "dequantize_into", "error_bound", "quantize", "residual_into",
           "scale_bits"]

_F32 = np.dtype(np.float32)
_F16 = np.dtype(np.float16)


def scale_bits(num_workers: int, bits: int = 32) -> int:
    """Return ``P``: a full-range element (``|x| < 2**emax``) becomes at most ``2**P``.

    ``bits`` is the integer width on the wire (32, or 16 for the bandwidth-halving mode).
    """
    return bits - 1 - num_workers.bit_length()


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


def quantize(x: np.ndarray, emax: int, num_workers: int, *, nonfinite: bool = False,
             bits: int = 32) -> np.ndarray:
    """Scale a float block to little-endian int32 (or int16) with the agreed exponent ``emax``.

    Args:
        x: the block (float16, float32 or float64); not modified.
        emax: the max block exponent over all workers (``>= block_exponent(x)[0]``).
        num_workers: n, the number of workers whose values will be summed.
        nonfinite: the block holds NaN/Inf; those elements are sent as 0.
        bits: 32 or 16, the integer width on the wire.
    """
    wire = "<i4" if bits == 32 else "<i2"
    if emax == EXP_ZERO:
        return np.zeros(x.size, dtype=wire)
    shift = scale_bits(num_workers, bits) - emax
    if x.dtype in (_F32, _F16) and -126 <= shift <= 127:
        # 2**shift is a normal float32 and the product is below 2**P: exact in float32.
        y = np.multiply(x, np.float32(2.0**shift), dtype=np.float32)
    elif -1000 < shift < 1000:
        y = x.astype(np.float64)
        y *= 2.0**shift
    else:
        y = np.ldexp(x.astype(np.float64), shift)
    if nonfinite:
        y[~np.isfinite(y)] = 0.0
    np.rint(y, out=y)
    return y.astype(wire)


def dequantize_into(out: np.ndarray, q: np.ndarray, emax: int, num_workers: int,
                    *, nonfinite: bool = False, bits: int = 32) -> None:
    """Write ``q * 2**(emax - P)`` into ``out`` (same length), or NaN if ``nonfinite``.

    The integer sum is rounded once, to ``out``'s dtype.
    """
    if nonfinite:
        out[...] = np.nan
        return
    if emax == EXP_ZERO:
        out[...] = 0
        return
    shift = emax - scale_bits(num_workers, bits)
    if emax + num_workers.bit_length() >= np.finfo(out.dtype).maxexp:
        # |sum| < n * 2**emax may reach past the dtype's largest finite value
        _dequantize_at_the_edge(out, q, emax, num_workers, bits)
    elif out.dtype == _F32 and -126 <= shift <= 127:
        np.multiply(q, np.float32(2.0**shift), out=out, dtype=np.float32, casting="unsafe")
    elif -1000 < shift < 1000:
        out[...] = q * 2.0**shift  # exact in float64 (|q| < 2**31), one rounding into out
    else:
        out[...] = np.ldexp(q.astype(np.float64), shift)


def _dequantize_at_the_edge(out: np.ndarray, q: np.ndarray, emax: int, num_workers: int,
                            bits: int) -> None:
    """Dequantize a block whose sum may exceed the output dtype's range.

    A sum within the quantization error of the dtype's largest finite value may come out past
    it (an element at ``finfo.max`` rounds up to ``2**P`` quanta = ``2**emax``). Such results are
    clamped to +-max; sums further out are genuine overflows and stay inf.
    """
    info = np.finfo(out.dtype)
    shift = emax - scale_bits(num_workers, bits)
    with np.errstate(over="ignore"):
        out[...] = np.ldexp(q.astype(np.float64), shift)
    max_in_quanta = math.ldexp(float(info.max), -shift)
    near = np.abs(q) <= max_in_quanta + 0.5 * num_workers
    np.clip(out, -info.max, info.max, out=out, where=near)


def error_bound(emax: int, num_workers: int, bits: int = 32) -> float:
    """Return the largest absolute error of a sum before the final rounding to the output dtype."""
    if emax == EXP_ZERO:
        return 0.0
    return num_workers * 0.5 * math.ldexp(1.0, emax - scale_bits(num_workers, bits))


def residual_into(out: np.ndarray, x: np.ndarray, q: np.ndarray, emax: int, num_workers: int,
                  *, bits: int = 32) -> None:
    """Write this worker's own quantization error ``x - q * 2**(emax - P)`` into ``out``.

    Error feedback adds it to the next step's input, so rounding errors are not lost but
    delayed (used by the 16-bit DDP hook). Non-finite inputs leave a residual of 0.
    """
    if emax == EXP_ZERO:  # nothing was sent; keep what is finite for the next step
        out[...] = np.where(np.isfinite(x), x, 0)
        return
    back = np.empty(x.size, dtype=np.float64)
    with np.errstate(over="ignore", invalid="ignore"):
        back[...] = np.ldexp(q.astype(np.float64), emax - scale_bits(num_workers, bits))
        r = x.astype(np.float64) - back
    r[~np.isfinite(r)] = 0.0
    out[...] = r

"""Fixed-point conversion with block exponents agreed through the switch.

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

from switchml.protocol import kernels
from switchml.protocol.dtypes import finfo, kernel_view
from switchml.protocol.wire import EXP_ZERO

__all__ = ["block_exponent", "dequantize_into", "error_bound", "quantize", "residual_into",
           "scale_bits"]


def scale_bits(num_workers: int, bits: int = 32) -> int:
    """Return ``P``: a full-range element (``|x| < 2**emax``) becomes at most ``2**P``.

    ``bits`` is the integer width on the wire (32, or 16 for the bandwidth-halving mode).
    """
    return bits - 1 - num_workers.bit_length()


def _kernel_input(x: np.ndarray) -> np.ndarray:
    """A flat contiguous view (or copy) the kernels take: bfloat16 as its bits."""
    return kernel_view(np.ascontiguousarray(x).reshape(-1))


def block_exponent(x: np.ndarray) -> tuple[int, bool]:
    """Return ``(e, nonfinite)``: ``max|x| < 2**e`` over finite elements, and whether any is not.

    An all-zero (or empty, or all non-finite) block gives ``EXP_ZERO``. (The worker computes
    every block's exponent of an operation in one pass with ``kernels.block_exponents``.)
    """
    if x.size == 0:
        return EXP_ZERO, False
    exps = np.empty(1, np.int64)
    nonfinite = np.empty(1, np.uint8)
    kernels.block_exponents(_kernel_input(x), x.size, exps, nonfinite)
    return int(exps[0]), bool(nonfinite[0])


def quantize(x: np.ndarray, emax: int, num_workers: int, *, nonfinite: bool = False,
             bits: int = 32) -> np.ndarray:
    """Scale a float block to little-endian int32 (or int16) with the agreed exponent ``emax``.

    Args:
        x: the block (float16, bfloat16, float32 or float64); not modified.
        emax: the max block exponent over all workers (``>= block_exponent(x)[0]``).
        num_workers: n, the number of workers whose values will be summed.
        nonfinite: the block holds NaN/Inf; those elements are sent as 0.
        bits: 32 or 16, the integer width on the wire.
    """
    out = np.empty(x.size, dtype="<i4" if bits == 32 else "<i2")
    kernels.quantize_block(_kernel_input(x), emax, scale_bits(num_workers, bits), nonfinite, out)
    return out


def dequantize_into(out: np.ndarray, q: np.ndarray, emax: int, num_workers: int,
                    *, nonfinite: bool = False, bits: int = 32) -> None:
    """Write ``q * 2**(emax - P)`` into ``out`` (same length), or NaN if ``nonfinite``.

    The integer sum is rounded once, to ``out``'s dtype (float16 and bfloat16 included). A
    sum within the quantization error of the dtype's largest finite value may come out past it
    (an element at ``finfo.max`` rounds up to ``2**P`` quanta = ``2**emax``): such results are
    clamped to +-max; sums further out are
    genuine overflows and stay inf.
    """
    info = finfo(out.dtype)
    edge = emax + num_workers.bit_length() >= info.maxexp
    flat = out.reshape(-1)
    direct = flat.flags.c_contiguous and np.shares_memory(flat, out)
    target = flat if direct else np.empty(out.size, out.dtype)
    kernels.dequantize_block(np.ascontiguousarray(q).reshape(-1), emax,
                             scale_bits(num_workers, bits), nonfinite, kernel_view(target),
                             num_workers, edge, float(info.max))
    if not direct:
        with np.errstate(over="ignore"):
            out[...] = target.reshape(out.shape)


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
    r = np.empty(x.size, np.float64)
    kernels.residual_block(_kernel_input(x), np.ascontiguousarray(q).reshape(-1), emax,
                           scale_bits(num_workers, bits), r)
    out[...] = r.reshape(out.shape)

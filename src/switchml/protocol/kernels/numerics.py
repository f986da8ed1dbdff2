"""The numerics, compiled: block exponents, quantization, dequantization, residuals
(``quantize.py`` explains them and is their public face)."""

from __future__ import annotations

import math

import numpy as np

from switchml.protocol.kernels.frames import EXP_ZERO, INLINE, KW, njit


@njit(**INLINE)
def _exponent(m):
    """e with m < 2**e (m > 0, finite): frexp's exponent."""
    return math.frexp(m)[1]


@njit(**KW)
def block_exponent(x, lo, hi, b, exps, nonfinite):
    """Block ``b`` = ``x[lo:hi]``: ``max|x| < 2**e`` over finite elements (EXP_ZERO for an
    all-zero block) into ``exps[b]``, and whether it holds a NaN or Inf into ``nonfinite[b]``."""
    m = 0.0
    bad = False
    for j in range(lo, hi):
        a = abs(np.float64(x[j]))
        if a > m:
            if a == np.inf:
                bad = True
            else:
                m = a
        elif a != a:  # NaN
            bad = True
    exps[b] = EXP_ZERO if m == 0.0 else _exponent(m)
    nonfinite[b] = bad


@njit(**KW)
def block_exponents(x, k, exps, nonfinite):
    """Every block's exponent and non-finite flag (blocks of ``k`` elements), one pass."""
    for b in range(exps.size):
        block_exponent(x, b * k, min(b * k + k, x.size), b, exps, nonfinite)


@njit(**KW)
def quantize_block(x, emax, n_bits, nonfinite, out):
    """``out[j] = rint(x[j] * 2**(P - emax))`` (P = ``n_bits``), non-finite elements as 0.

    Exact scaling (a power of two) in float64; ``out`` is int32 or int16."""
    if emax == EXP_ZERO:
        for j in range(x.size):
            out[j] = 0
        return
    shift = n_bits - emax
    if -1000 < shift < 1000:
        f = 2.0 ** shift
        for j in range(x.size):
            y = np.float64(x[j]) * f
            if nonfinite and not math.isfinite(y):
                y = 0.0
            out[j] = np.rint(y)
    else:
        for j in range(x.size):
            y = math.ldexp(np.float64(x[j]), shift)
            if nonfinite and not math.isfinite(y):
                y = 0.0
            out[j] = np.rint(y)


@njit(**KW)
def dequantize_block(q, emax, n_bits, nonfinite, out, num_workers, edge, fmax):
    """``out[j] = q[j] * 2**(emax - P)``, rounded once to ``out``'s dtype; NaN if ``nonfinite``.

    ``edge``: ``emax`` is so large that ``|sum| < n * 2**emax`` may pass the output dtype's
    largest finite value ``fmax``: a sum within the quantization error past it is clamped to
    it (an element at the maximum rounds up to ``2**emax``); further out it is a genuine
    overflow and becomes inf."""
    if nonfinite:
        for j in range(out.size):
            out[j] = np.nan
        return
    if emax == EXP_ZERO:
        for j in range(out.size):
            out[j] = 0
        return
    shift = emax - n_bits
    if edge:
        max_in_quanta = math.ldexp(fmax, -shift)
        for j in range(out.size):
            qj = np.float64(q[j])
            v = math.ldexp(qj, shift)
            if abs(qj) <= max_in_quanta + 0.5 * num_workers:
                if v > fmax:
                    v = fmax
                elif v < -fmax:
                    v = -fmax
            out[j] = v
    elif -1000 < shift < 1000:
        f = 2.0 ** shift
        for j in range(out.size):
            out[j] = np.float64(q[j]) * f
    else:
        for j in range(out.size):
            out[j] = math.ldexp(np.float64(q[j]), shift)


@njit(**KW)
def residual_block(x, q, emax, n_bits, r):
    """``r = x - q * 2**(emax - P)``: this rank's own rounding error (error feedback); 0 where
    it is not finite. An unsent block (EXP_ZERO) keeps what is finite of ``x``."""
    if emax == EXP_ZERO:
        for j in range(x.size):
            v = np.float64(x[j])
            r[j] = v if math.isfinite(v) else 0.0
        return
    shift = emax - n_bits
    for j in range(x.size):
        v = np.float64(x[j]) - math.ldexp(np.float64(q[j]), shift)
        r[j] = v if math.isfinite(v) else 0.0

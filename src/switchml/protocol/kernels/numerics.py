"""The numerics in plain Python (the reference of ``src/switchml/csrc/worker.c``'s, which
production runs: ``switchml._worker``): block exponents, quantization, dequantization, residuals
(``quantize.py`` explains them and is their public face).

Each rule is written once, as a helper over ``(array, offset, count)``: the worker's kernels
call them on a lane's transmit buffer and on a received batch with no array slice per
datagram (every slice or view numba makes takes and drops a reference with an atomic
instruction; measured, those were most of the worker's compiled time), and the ``*_block``
functions are the same helpers over whole arrays, for ``quantize.py``. Indexes are cast to
unsigned: numba then drops its negative-index wrap-around, and the loops vectorize with plain
loads (with signed indexes from an offset, LLVM emitted gathers: 2x slower).
"""

from __future__ import annotations

import math

import numpy as np

from switchml.protocol.kernels.frames import EXP_ZERO

# float16 and bfloat16 (ml_dtypes): (Inf's bits, mantissa bits, exponent bias - 1, smallest
# subnormal), the 16-bit widths of exponent_of_bits.
_HALF_FORMAT = {"float16": (0x7C00, 10, 14, 2.0 ** -24), "bfloat16": (0x7F80, 7, 126, 2.0 ** -133)}


def _stored(out, v):
    """``v`` as stored into ``out``, rounded once to its type. numpy rounds a float64 into
    float16 once; ml_dtypes' bfloat16 goes through float32 (twice), so bfloat16 takes the
    nearest of that value and its two neighbours (ties: the even one)."""
    if out.dtype.name != "bfloat16" or not math.isfinite(v):
        return v
    if abs(v) >= 2.0 ** 128 - 2.0 ** 119:  # half way from the largest to 2**128: inf
        return math.copysign(math.inf, v)
    b = np.asarray(np.float32(v)).astype(out.dtype)
    bits = int(b.view(np.uint16))
    best, best_d = b, math.inf
    for c in (bits - 1, bits, bits + 1):
        cand = np.asarray(np.uint16(c & 0xFFFF)).view(out.dtype)
        f = float(cand)
        if not math.isfinite(f):
            continue
        d = abs(f - v)
        if d < best_d or d == best_d and c % 2 == 0:
            best, best_d = cand, d
    return best


def _exponent(m):
    """e with m < 2**e (m > 0, finite): frexp's exponent."""
    return math.frexp(m)[1]


def _ix(j):
    """An index the compiler knows is not negative (no wrap-around: see the module doc)."""
    return np.uint64(j)


def _scan_exponent(x, lo, hi, b, exps, nonfinite):
    """:func:`exponent_of_bits` for a block with a NaN or Inf: an element at a time."""
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


def exponent_of_bits(xbits, x, lo, hi, b, exps, nonfinite):
    """Block ``b`` = ``x[lo:hi]``: ``max|x| < 2**e`` over finite elements (EXP_ZERO for an
    all-zero block) into ``exps[b]``, and whether it holds a NaN or Inf into ``nonfinite[b]``.
    ``xbits``: ``x`` viewed as unsigned integers of its width (uint16 for float16 and
    bfloat16, uint32 for float32, uint64 for float64).

    An IEEE float's magnitude orders as its bits with the sign cleared, and NaN and Inf have
    the largest bits of all: so one pass takes the integer max of those bits (a reduction the
    compiler vectorizes, where a float max with NaN rules is not), the exponent field of the
    max is the block's exponent, and a max at or above Inf's bits sends the (rare) block to
    the element-by-element scan that tells NaN and Inf apart from the finite max."""
    if xbits.itemsize == 4:  # float32 (both branches compile; the width picks one)
        m32 = np.uint32(0)
        for j in range(lo, hi):
            v32 = xbits[_ix(j)] & np.uint32(0x7FFFFFFF)
            m32 = v32 if v32 > m32 else m32
        mb = np.uint64(m32)
        top, mant_bits, bias, tiny = 0x7F800000, 23, 126, 2.0 ** -149
    elif xbits.itemsize == 2:  # float16, bfloat16
        m16 = 0
        for j in range(lo, hi):
            v16 = int(xbits[_ix(j)]) & 0x7FFF
            m16 = v16 if v16 > m16 else m16
        mb = np.uint64(m16)
        top, mant_bits, bias, tiny = _HALF_FORMAT[x.dtype.name]
    else:  # float64
        mb = np.uint64(0)
        for j in range(lo, hi):
            v64 = np.uint64(xbits[_ix(j)]) & np.uint64(0x7FFFFFFFFFFFFFFF)
            mb = v64 if v64 > mb else mb
        top, mant_bits, bias, tiny = 0x7FF0000000000000, 52, 1022, 2.0 ** -1074
    if mb >= np.uint64(top):
        _scan_exponent(x, lo, hi, b, exps, nonfinite)
        return
    nonfinite[b] = 0
    field = np.int64(mb >> np.uint64(mant_bits))
    if mb == 0:
        exps[b] = EXP_ZERO
    elif field > 0:  # normal: 1.f x 2**(field - bias - 1) < 2**(field - bias)
        exps[b] = field - bias
    else:  # subnormal: the bits are the value in units of the smallest subnormal
        exps[b] = _exponent(np.float64(mb) * tiny)


def block_exponents(x, k, exps, nonfinite):
    """Every block's exponent and non-finite flag (blocks of ``k`` elements), one pass."""
    xbits = x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])
    for b in range(exps.size):
        exponent_of_bits(xbits, x, b * k, min(b * k + k, x.size), b, exps, nonfinite)


def quantize_into(x, lo, count, emax, n_bits, nonfinite, q, qo):
    """``q[qo + j] = rint(x[lo + j] * 2**(P - emax))`` for ``j < count`` (P = ``n_bits``),
    non-finite elements as 0. Exact scaling (a power of two) in float64; ``q`` is int32 or
    int16."""
    if emax == EXP_ZERO:
        for j in range(count):
            q[_ix(qo + j)] = 0
        return
    shift = n_bits - emax
    if -1000 < shift < 1000:
        f = 2.0 ** shift
        if nonfinite:
            for j in range(count):
                y = np.float64(x[_ix(lo + j)]) * f
                q[_ix(qo + j)] = np.rint(y) if math.isfinite(y) else 0
        else:
            for j in range(count):
                q[_ix(qo + j)] = np.rint(np.float64(x[_ix(lo + j)]) * f)
    else:
        for j in range(count):
            y = math.ldexp(np.float64(x[_ix(lo + j)]), shift)
            if nonfinite and not math.isfinite(y):
                y = 0.0
            q[_ix(qo + j)] = np.rint(y)


def quantize_clamped(x, lo, count, emax, n_bits, q, qo):
    """:func:`quantize_into` for a block whose own exponent is above the agreed one ``emax``
    (a quorum round completed without this rank's look-ahead exponent): each element clamped
    to what the agreed scale holds, ``+-(2**P - 1)``, so that the switch's sum still cannot
    overflow; non-finite elements as 0; all 0 where the agreed block is all zeros."""
    lim = 2.0 ** n_bits - 1.0
    for j in range(count):
        y = 0.0
        if emax != EXP_ZERO:
            v = float(x[_ix(lo + j)])
            if math.isfinite(v):
                try:
                    s = math.ldexp(v, int(n_bits - emax))
                except OverflowError:
                    s = math.copysign(math.inf, v)
                y = np.rint(min(max(s, -lim), lim))
        q[_ix(qo + j)] = y


def quantize_block(x, emax, n_bits, nonfinite, out):
    """:func:`quantize_into` over whole arrays: ``out = rint(x * 2**(P - emax))``."""
    quantize_into(x, 0, x.size, emax, n_bits, nonfinite, out, 0)


def dequantize_into(q, qo, emax, n_bits, nonfinite, out, lo, count, num_workers, edge, fmax):
    """``out[lo + j] = q[qo + j] * 2**(emax - P)`` for ``j < count``, rounded once to
    ``out``'s dtype (:func:`_stored`); NaN if ``nonfinite``.

    ``edge``: ``emax`` is so large that ``|sum| < n * 2**emax`` may pass the output dtype's
    largest finite value ``fmax``: a sum within the quantization error past it is clamped to
    it (an element at the maximum rounds up to ``2**emax``); further out it is a genuine
    overflow and becomes inf."""
    if nonfinite:
        for j in range(count):
            out[_ix(lo + j)] = np.nan
        return
    if emax == EXP_ZERO:
        for j in range(count):
            out[_ix(lo + j)] = 0
        return
    shift = emax - n_bits
    if edge:
        max_in_quanta = math.ldexp(fmax, -shift)
        for j in range(count):
            qj = np.float64(q[_ix(qo + j)])
            v = math.ldexp(qj, shift)
            if abs(qj) <= max_in_quanta + 0.5 * num_workers:
                if v > fmax:
                    v = fmax
                elif v < -fmax:
                    v = -fmax
            out[_ix(lo + j)] = _stored(out, v)
    elif -1000 < shift < 1000:
        f = 2.0 ** shift
        for j in range(count):
            out[_ix(lo + j)] = _stored(out, np.float64(q[_ix(qo + j)]) * f)
    else:
        for j in range(count):
            out[_ix(lo + j)] = _stored(out, math.ldexp(np.float64(q[_ix(qo + j)]), shift))


def dequantize_block(q, emax, n_bits, nonfinite, out, num_workers, edge, fmax):
    """:func:`dequantize_into` over whole arrays: ``out = q * 2**(emax - P)``."""
    dequantize_into(q, 0, emax, n_bits, nonfinite, out, 0, out.size, num_workers, edge, fmax)


def residual_into(x, lo, count, q, qo, emax, n_bits, r):
    """``r[lo + j] = x[lo + j] - q[qo + j] * 2**(emax - P)``: this rank's own rounding error
    (error feedback); 0 where it is not finite. An unsent block (EXP_ZERO) keeps what is
    finite of ``x``."""
    if emax == EXP_ZERO:
        for j in range(count):
            v = np.float64(x[_ix(lo + j)])
            r[_ix(lo + j)] = v if math.isfinite(v) else 0.0
        return
    shift = emax - n_bits
    if -1000 < shift < 1000:
        # q * 2**shift is exact in float64 (an integer of at most 31 bits times a power of
        # two in range), as ldexp's is, and a multiply the loop vectorises: ldexp per element
        # cost the 16-bit DDP hook about 20 ns per element (measured when it was replaced).
        f = 2.0 ** shift
        for j in range(count):
            v = np.float64(x[_ix(lo + j)]) - np.float64(q[_ix(qo + j)]) * f
            r[_ix(lo + j)] = v if math.isfinite(v) else 0.0
        return
    for j in range(count):
        v = np.float64(x[_ix(lo + j)]) - math.ldexp(np.float64(q[_ix(qo + j)]), shift)
        r[_ix(lo + j)] = v if math.isfinite(v) else 0.0


def residual_block(x, q, emax, n_bits, r):
    """:func:`residual_into` over whole arrays: ``r = x - q * 2**(emax - P)``."""
    residual_into(x, 0, x.size, q, 0, emax, n_bits, r)

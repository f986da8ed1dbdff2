"""Compiled per-datagram kernels: the one implementation of every per-packet rule.

The switch and the worker cost too much per datagram as chains of Python statements and numpy
calls (tens of microseconds each: at a 1500-byte MTU a 1 Gbit/s link carries 83,000 datagrams
per second). The rules that run once per datagram live here, as numba functions that take a
whole batch of datagrams (a GRO buffer of one sender) and the endpoint's state as numpy arrays,
and work through the batch without returning to Python:

* :func:`switch_requests`: validate a REQUEST, check job, rank, epoch, slot and round, aggregate
  into the slot, max the exponent, complete the round and write the result header in place.
* :func:`block_exponents`, :func:`quantize_block`, :func:`dequantize_block`: the numerics
  (``quantize.py`` explains them).
* :func:`worker_results` / :func:`build_request`: the worker takes results (dequantize into the
  output), updates its lanes and round-trip estimate, and builds the requests they release
  straight into a preallocated transmit buffer.

A kernel stops (returns the index of the datagram) at anything rare that needs Python: control
messages, malformed datagrams, another job in the same buffer, retransmissions to answer,
disagreeing ranks. The Python side (``switch.py``, ``worker.py``) handles that one datagram and
calls the kernel again for the rest, so datagrams are always processed in order and each rule
exists once. With ``NUMBA_DISABLE_JIT=1`` the kernels run as plain Python (for debugging and
coverage; very slow); without numba installed they do too, with a warning.

Header offsets (``wire.HEADER``, little-endian): magic 0 (u16), version 2, type 3, flags 4,
set 5, rank 6 (u16), job 8 (u32), token 12 (u64), seq 20 (u32), chunk 24 (u32), slot 28 (u32),
count 32 (u16), elem 34, digest 35, exp_data 36 (i16), exp_next 38 (i16).
"""

from __future__ import annotations

import math
import warnings
from enum import IntEnum

import numpy as np

try:
    from numba import njit
except ImportError:  # pragma: no cover - numba is a dependency; this keeps the core importable
    warnings.warn("numba is not installed: switchml's per-packet kernels run as plain Python "
                  "(correct, but about 100x slower)", RuntimeWarning, stacklevel=2)

    def njit(*args, **kwargs):  # type: ignore[no-redef]
        if args and callable(args[0]):
            return args[0]
        return lambda f: f

__all__ = [
    "J", "J_FIELDS", "LF", "LN", "OP", "R", "S", "S_FIELDS", "SC", "SS", "WC", "WS",
    "block_exponents", "build_request", "dequantize_block", "quantize_block", "residual_block",
    "send_chunk", "send_first", "switch_requests", "worker_results",
]

_KW = {"cache": True, "nogil": True}

# -- wire constants (checked against wire.py by tests/protocol/test_kernels.py) ------------------
HDR = 40
MAGIC = 0x4D53
VERSION = 1
T_REQUEST = 1
T_RESULT = 2
KNOWN_FLAGS = 0x0F
F_NONFINITE = 0x01
F_HAS_DATA = 0x02
F_HAS_EXP = 0x04
F_RESENT = 0x08
SHAPE_FLAGS = F_HAS_DATA | F_HAS_EXP
E_INT32 = 1
E_INT16 = 2
EXP_ZERO = -32768
HALF = 1 << 31
EPOCH_TRAIL = 1 << 30
MASK32 = (1 << 32) - 1


class J(IntEnum):
    """Indexes of a switch job's scalar fields (``jobv``, int64)."""

    JOB = 0
    TOKEN = 1  # stored as the signed reinterpretation of the u64 token
    N = 2
    SLOT_BASE = 3
    WINDOW = 4
    MAX_BYTES = 5  # 4 x elements_per_packet: the payload a slot holds
    MIN_SEQ = 6  # -1: none (no epoch JOIN yet)
    AGGREGATED = 7  # elements aggregated
    NACK_GAP = 8  # chunks a rank may run ahead of a chunk it has not delivered; 0: no NACKs
    NACK_CHUNK = 9  # out: the chunk a NACK names (valid when the kernel stops with SS.NACK)
    NACK_SLOT = 10  # out: its slot, relative to SLOT_BASE
    COMPLETIONS = 11  # rounds completed (stamps S.DONE_AT)
    FLOAT_SEQ = 12  # the last operation seen to be float (its rounds carry exponents)
    NACK_USEFUL = 13  # re-sends answering a NACK that brought a missing chunk (count)
    SHARDS = 14  # switch shards the job's lanes are striped over (lane i on shard i mod S)


J_FIELDS = 15


class S(IntEnum):
    """Indexes of a slot set's fields (``st[field, set, slot]``, int64)."""

    SEQ = 0  # -1: never used
    CHUNK = 1
    COUNT = 2
    ELEM = 3
    FLAGS = 4
    EXP_DATA = 5
    EXP_NEXT = 6
    DIGEST = 7
    MISSING = 8
    DONE_AT = 9  # the job's completion counter when the round completed (NACK ordering)


S_FIELDS = 10


class SC(IntEnum):
    """Switch counters (``cnt``, int64)."""

    STALE = 0
    BAD_SLOT = 1
    BAD_PAYLOAD = 2
    LATE_DUPLICATE = 3
    MULTICAST = 4
    ABANDONED = 5
    N = 6


class SS(IntEnum):
    """Why :func:`switch_requests` stopped."""

    DONE = 0  # every datagram taken
    OTHER = 1  # not a request of this job and rank, or from before the epoch: Python's path
    RETRANSMISSION = 2  # the rank already contributed to the round: Python answers
    MISMATCH = 3  # the chunk disagrees with the round: Python refuses it
    CONFLICT_ADDED = 4  # added to a round that has refused ranks: Python tells this rank
    NACK = 5  # added, and this rank is behind on an earlier chunk: Python sends it a NACK


# -- little-endian field access ------------------------------------------------------------------

@njit(**_KW)
def _u16(d, o):
    return np.int64(d[o]) | (np.int64(d[o + 1]) << 8)


@njit(**_KW)
def _u32(d, o):
    return (np.int64(d[o]) | (np.int64(d[o + 1]) << 8) | (np.int64(d[o + 2]) << 16)
            | (np.int64(d[o + 3]) << 24))


@njit(**_KW)
def _i16(d, o):
    v = _u16(d, o)
    return v - 65536 if v >= 32768 else v


@njit(**_KW)
def _i64(d, o):
    """The u64 at ``o``, reinterpreted as int64 (tokens are compared bit for bit)."""
    lo = _u32(d, o)
    hi = _u32(d, o + 4)
    return np.int64(np.uint64(lo) | (np.uint64(hi) << np.uint64(32)))


@njit(**_KW)
def _put16(d, o, v):
    d[o] = v & 0xFF
    d[o + 1] = (v >> 8) & 0xFF


@njit(**_KW)
def _put32(d, o, v):
    d[o] = v & 0xFF
    d[o + 1] = (v >> 8) & 0xFF
    d[o + 2] = (v >> 16) & 0xFF
    d[o + 3] = (v >> 24) & 0xFF


@njit(**_KW)
def _put64(d, o, v):
    u = np.uint64(v)
    _put32(d, o, np.int64(u & np.uint64(MASK32)))
    _put32(d, o + 4, np.int64(u >> np.uint64(32)))


@njit(**_KW)
def write_header(d, o, mtype, flags, set_bit, rank, job, token, seq, chunk, slot, count, elem,
                 digest, exp_data, exp_next):
    """Write a 40-byte header at ``d[o:]`` (``token`` as int64 bits)."""
    _put16(d, o, MAGIC)
    d[o + 2] = VERSION
    d[o + 3] = mtype
    d[o + 4] = flags
    d[o + 5] = set_bit
    _put16(d, o + 6, rank)
    _put32(d, o + 8, job)
    _put64(d, o + 12, token)
    _put32(d, o + 20, seq)
    _put32(d, o + 24, chunk)
    _put32(d, o + 28, slot)
    _put16(d, o + 32, count)
    d[o + 34] = elem
    d[o + 35] = digest
    _put16(d, o + 36, exp_data & 0xFFFF)
    _put16(d, o + 38, exp_next & 0xFFFF)


@njit(**_KW)
def request_framing(d, o, n):
    """Whether ``d[o:o+n]`` is a well-formed REQUEST with an int32 or int16 payload."""
    if n < HDR or _u16(d, o) != MAGIC or d[o + 2] != VERSION or d[o + 3] != T_REQUEST:
        return False
    if d[o + 5] > 1 or (np.int64(d[o + 4]) & ~KNOWN_FLAGS) != 0:
        return False
    elem = d[o + 34]
    if elem == E_INT32:
        return n == HDR + 4 * _u16(d, o + 32)
    if elem == E_INT16:
        return n == HDR + 2 * _u16(d, o + 32)
    return False


# -- the switch ---------------------------------------------------------------------------------

@njit(**_KW)
def _clear_bit(bm, v, s, rank):
    w = rank >> 6
    bm[v, s, w] &= ~(np.uint64(1) << np.uint64(rank & 63))


@njit(**_KW)
def _has_bit(bm, v, s, rank):
    return (bm[v, s, rank >> 6] >> np.uint64(rank & 63)) & np.uint64(1) != 0


@njit(**_KW)
def _any_bit(bm, v, s):
    for w in range(bm.shape[2]):
        if bm[v, s, w] != 0:
            return True
    return False


@njit(**_KW)
def _find_round(st, sp, seq, chunk):
    """The set of relative slot ``sp`` that holds round ``(seq, chunk)``, or -1."""
    for u in range(2):
        if st[S.SEQ, u, sp] == seq and st[S.CHUNK, u, sp] == chunk:
            return u
    return -1


@njit(**_KW)
def _lacks(rank, seq, p, sp, st, seen):
    """Whether ``rank`` has not delivered chunk ``p`` of operation ``seq`` (relative slot
    ``sp``): the lane neither holds round ``p`` with the rank in it nor has moved past it."""
    for u in range(2):
        cur = st[S.SEQ, u, sp]
        if cur < 0:
            continue
        if cur == seq:
            c = st[S.CHUNK, u, sp]
            if c > p or (c == p and _has_bit(seen, u, sp, rank)):
                return False
        elif ((cur - seq) & MASK32) < HALF:
            return False  # a later operation already uses the slot
    return True


@njit(**_KW)
def _behind_on(rank, seq, chunk, s, jobv, st, seen, clog, cursor):
    """Switch-driven loss recovery: a chunk ``chunk`` of ``rank`` (on relative slot ``s``) was
    just added; find a chunk of the same operation the rank should have delivered before it
    and has not. Writes it to ``jobv[NACK_CHUNK]``/``[NACK_SLOT]`` and returns True, or False.

    A worker sends a chunk when the result of the chunk before it on the same lane (its
    *release*) arrives, in the order results arrive, and requests and results each travel
    one path in order. So every chunk released by a round that completed before this chunk's
    release should have arrived before this chunk. The switch stamps completions with a
    counter and logs them (``clog``, a ring: seq, chunk, slot, and whether the round releases
    a chunk: 1 yes, 0 no, 2 unknown); ``cursor[rank]`` is how far the rank has been
    checked, so each completion is looked at once per rank (O(1) per request). A chunk that
    should be here and is not: its request was lost, or the result releasing it was. Either
    way the rank is told at once (a NACK) and re-sends what it has outstanding on that lane;
    the switch answers a re-sent request from its round or the shadow copy, as any
    retransmission. ``NACK_GAP`` completions of slack tolerate reordering inside the network.
    The first window (chunks ``0 .. E-1``) goes out at once in chunk order, so there chunk
    ``chunk - NACK_GAP * SHARDS`` (a lane of this shard) should have arrived.

    Lanes: chunk ``c`` goes to slot ``c mod E`` (E <= window lanes), and ``chunk - s`` is a
    multiple of E, which gives E once the chunk is past the first window."""
    gap = jobv[J.NACK_GAP]
    if gap <= 0:
        return False
    window = jobv[J.WINDOW]
    d = chunk - s
    E = window if d >= window else d  # 0: this chunk is in the first window, E unknown
    stride = jobv[J.SHARDS]  # this shard has the lanes congruent to chunk mod stride
    if chunk >= gap * stride:
        p = chunk - gap * stride
        # Both in the first window (lane = chunk), p on another lane of this shard.
        if (E == 0 or p < E) and p != s and p % stride == s % stride:
            if _lacks(rank, seq, p, p, st, seen):
                jobv[J.NACK_CHUNK] = p
                jobv[J.NACK_SLOT] = p
                return True
    if E == 0:
        return False
    u = _find_round(st, s, seq, chunk - E)
    if u < 0 or st[S.MISSING, u, s] != 0:
        return False
    limit = st[S.DONE_AT, u, s] - gap  # completions before this chunk's release, less slack
    size = clog.shape[0]
    c = max(cursor[rank], jobv[J.COMPLETIONS] - size)
    found = False
    while c < limit:
        e = (c + 1) % size
        if clog[e, 0] == seq and clog[e, 3] != 0:
            r = clog[e, 1] + E  # the chunk that completion released
            if clog[e, 3] == 2 and r >= chunk:
                # Integers: r may be past the end. Judge it when a later chunk arrives.
                break
            if _lacks(rank, seq, r, clog[e, 2], st, seen):
                jobv[J.NACK_CHUNK] = r
                jobv[J.NACK_SLOT] = clog[e, 2]
                found = True
                c += 1
                break
        c += 1
    cursor[rank] = c
    return found


@njit(**_KW)
def switch_requests(d, starts, lens, srcs, nseg, start, rank, jobv, st, seen, conflict, bufs,
                    clog, cursor, cnt, done):
    """Aggregate the REQUESTs of a batch of datagrams, from datagram ``start`` on.

    ``d``: the received bytes (uint8); datagram ``i`` is ``d[starts[i] : starts[i] + lens[i]]``
    and came from the sender ``srcs[i]`` (a number per address). The caller has checked that
    datagram ``start`` is a REQUEST of this job from ``rank`` at the rank's joined address;
    every later one must be too (same sender, job, token and rank), else the kernel stops
    there. ``done`` receives ``(set, slot, length)`` of every round completed
    here: the result datagram is ``bufs[set, slot, :length]``.

    Returns ``(next, ndone, code)``: the segment to go on from, completions written, and why it
    stopped (``SS.DONE`` when ``next`` is past the end; else the Python side handles segment
    ``next`` (``SS.CONFLICT_ADDED``: segment ``next - 1``) and calls again).
    """
    src = srcs[start]
    job_id = jobv[J.JOB]
    token = jobv[J.TOKEN]
    n = jobv[J.N]
    base = jobv[J.SLOT_BASE]
    window = jobv[J.WINDOW]
    max_bytes = jobv[J.MAX_BYTES]
    ndone = 0
    i = start
    while i < nseg:
        o = starts[i]
        ln = lens[i]
        if srcs[i] != src or not request_framing(d, o, ln):
            return i, ndone, SS.OTHER.value
        if (_u32(d, o + 8) != job_id or _i64(d, o + 12) != token or _u16(d, o + 6) != rank):
            return i, ndone, SS.OTHER.value
        seq = _u32(d, o + 20)
        min_seq = jobv[J.MIN_SEQ]
        if min_seq >= 0:
            ahead = (seq - min_seq) & MASK32
            if ahead >= HALF:
                return i, ndone, SS.OTHER.value  # from before a restart: Python tells it
            if ahead > EPOCH_TRAIL:  # keep the bound within reach of wrapping seq numbers
                jobv[J.MIN_SEQ] = (seq - EPOCH_TRAIL) & MASK32
        flags = np.int64(d[o + 4])
        v = np.int64(d[o + 5])
        chunk = _u32(d, o + 24)
        s = _u32(d, o + 28) - base
        count = _u16(d, o + 32)
        elem = np.int64(d[o + 34])
        digest = np.int64(d[o + 35])
        exp_data = _i16(d, o + 36)
        exp_next = _i16(d, o + 38)
        itemsize = 4 if elem == E_INT32 else 2
        if s < 0 or s >= window:
            cnt[SC.BAD_SLOT] += 1
            i += 1
            continue
        if count * itemsize > max_bytes:
            cnt[SC.BAD_PAYLOAD] += 1
            i += 1
            continue
        # Order (seq, chunk) against the set's round (seq: serial-number arithmetic, RFC 1982).
        cur = st[S.SEQ, v, s]
        if cur < 0:
            order = 1
        elif seq != cur:
            order = 1 if ((seq - cur) & MASK32) < HALF else -1
        else:
            cc = st[S.CHUNK, v, s]
            order = 0 if chunk == cc else (1 if chunk > cc else -1)
        if order < 0:
            cnt[SC.STALE] += 1
            i += 1
            continue
        pay = d[o + HDR:o + HDR + count * itemsize]
        acc_b = bufs[v, s, HDR:HDR + count * itemsize]
        stopped_conflict = False
        if order > 0:
            # A new round: the first contributor overwrites (no explicit reset of a slot).
            if cur >= 0 and st[S.MISSING, v, s] != 0:
                cnt[SC.ABANDONED] += 1  # only after a failed operation
            acc_b[:] = pay
            st[S.SEQ, v, s] = seq
            st[S.CHUNK, v, s] = chunk
            st[S.COUNT, v, s] = count
            st[S.ELEM, v, s] = elem
            st[S.FLAGS, v, s] = flags & (F_NONFINITE | SHAPE_FLAGS)
            st[S.EXP_DATA, v, s] = exp_data
            st[S.EXP_NEXT, v, s] = exp_next
            st[S.DIGEST, v, s] = digest
            for w in range(seen.shape[2]):
                seen[v, s, w] = 0
                conflict[v, s, w] = 0
            seen[v, s, rank >> 6] = np.uint64(1) << np.uint64(rank & 63)
            st[S.MISSING, v, s] = n - 1
        else:
            if _has_bit(seen, v, s, rank):
                return i, ndone, SS.RETRANSMISSION.value
            if st[S.MISSING, v, s] == 0:
                cnt[SC.LATE_DUPLICATE] += 1  # a rank that has already moved on
                i += 1
                continue
            if (count != st[S.COUNT, v, s] or elem != st[S.ELEM, v, s]
                    or digest != st[S.DIGEST, v, s] or exp_data != st[S.EXP_DATA, v, s]
                    or ((flags ^ st[S.FLAGS, v, s]) & SHAPE_FLAGS) != 0):
                return i, ndone, SS.MISMATCH.value
            if count:  # integer adds wrap, as a switch's adders do
                if elem == E_INT32:
                    a32 = acc_b.view(np.int32)
                    x32 = pay.view(np.int32)
                    for j in range(count):
                        a32[j] += x32[j]
                else:
                    a16 = acc_b.view(np.int16)
                    x16 = pay.view(np.int16)
                    for j in range(count):
                        a16[j] += x16[j]
            seen[v, s, rank >> 6] |= np.uint64(1) << np.uint64(rank & 63)
            st[S.FLAGS, v, s] |= flags & F_NONFINITE
            if exp_next > st[S.EXP_NEXT, v, s]:
                st[S.EXP_NEXT, v, s] = exp_next
            st[S.MISSING, v, s] -= 1
            if _any_bit(conflict, v, s):  # this chunk agrees, but others did not
                _clear_bit(conflict, v, s, rank)
                stopped_conflict = _any_bit(conflict, v, s)
        _clear_bit(seen, 1 - v, s, rank)
        if flags & F_RESENT:
            jobv[J.NACK_USEFUL] += 1  # a NACK's re-send that was needed
        nack = _behind_on(rank, seq, chunk, s, jobv, st, seen, clog, cursor)
        if st[S.MISSING, v, s] == 0:
            b = bufs[v, s]
            write_header(b, 0, T_RESULT, st[S.FLAGS, v, s], v, rank, job_id, token, seq, chunk,
                         s + base, count, elem, st[S.DIGEST, v, s], st[S.EXP_DATA, v, s],
                         st[S.EXP_NEXT, v, s])
            stamp = jobv[J.COMPLETIONS] + 1
            jobv[J.COMPLETIONS] = stamp
            st[S.DONE_AT, v, s] = stamp
            e = stamp % clog.shape[0]
            clog[e, 0] = seq
            clog[e, 1] = chunk
            clog[e, 2] = s
            # Whether the round releases a chunk: float chunks carry the look-ahead exponent
            # exactly when a chunk follows on the lane (chunk < L, so chunk + E < T = L + E);
            # an operation is float once a round with an exponent completed; integer chunks
            # do not say.
            if st[S.FLAGS, v, s] & F_HAS_EXP:
                jobv[J.FLOAT_SEQ] = seq
                clog[e, 3] = 1
            else:
                clog[e, 3] = 0 if jobv[J.FLOAT_SEQ] == seq else 2
            done[ndone, 0] = v
            done[ndone, 1] = s
            done[ndone, 2] = HDR + itemsize * count
            ndone += 1
            cnt[SC.MULTICAST] += 1
            jobv[J.AGGREGATED] += count
        i += 1
        if stopped_conflict:
            return i, ndone, SS.CONFLICT_ADDED.value
        if nack:
            return i, ndone, SS.NACK.value
    return i, ndone, SS.DONE.value


# -- numerics (quantize.py documents them) ------------------------------------------------------

@njit(**_KW)
def _exponent(m):
    """e with m < 2**e (m > 0, finite): frexp's exponent."""
    return math.frexp(m)[1]


@njit(**_KW)
def _block_exponent(x, lo, hi, b, exps, nonfinite):
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


@njit(**_KW)
def block_exponents(x, k, exps, nonfinite):
    """Every block's exponent and non-finite flag (blocks of ``k`` elements), one pass."""
    for b in range(exps.size):
        _block_exponent(x, b * k, min(b * k + k, x.size), b, exps, nonfinite)


@njit(**_KW)
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


@njit(**_KW)
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


@njit(**_KW)
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


# -- the worker ---------------------------------------------------------------------------------

class OP(IntEnum):
    """Indexes of a worker operation's scalar fields (``opv``, int64)."""

    SEQ = 0
    L = 1  # blocks
    E = 2  # lanes
    T = 3  # packets
    K = 4  # elements per block
    DONE = 5
    JOB = 6
    TOKEN = 7
    RANK = 8
    SLOT_BASE = 9
    ELEM = 10
    ITEMSIZE = 11
    DIGEST = 12
    P = 13  # scale bits
    N = 14  # workers
    IS_FLOAT = 15
    EDGE_EXP = 16  # emax >= this: dequantize near the dtype's range edge


O_FIELDS = 17


class R(IntEnum):
    """Indexes of the round-trip estimator and times (``rtt``, float64)."""

    SRTT = 0  # < 0: no sample yet
    RTTVAR = 1
    RTO = 2
    MIN_RTT = 3  # < 0: no sample yet
    MIN_RTO = 4
    MAX_RTO = 5
    LAST_PROGRESS = 6
    LAST_HEARD = 7
    REO_SCALE = 8  # RACK's reorder window, in units of the base window
    DELIVERED_XMIT = 9  # (out) the transmission the last result answered (RACK)
    FMAX = 10  # largest finite value of the output dtype
    MAX_REO_SCALE = 11  # cap of REO_SCALE (WorkerConfig.max_reorder_scale)
    TAIL_PROBE_SRTTS = 12  # a lane's last chunk is probed after this many srtt


R_FIELDS = 13


class LN(IntEnum):
    """Lane fields (``lane[field, i]``, int64)."""

    CHUNK = 0  # -1: idle
    SET = 1
    XMITS = 2  # transmissions of the current chunk after the first
    TRIES = 3  # timeouts of the current chunk (backoff)
    EMAX = 4  # agreed exponent of the block this lane sends data of next
    FAST = 5  # the current chunk was re-sent by RACK
    SLOT = 6  # the lane's slot on its switch (shard): that shard's slot base + lane


class LF(IntEnum):
    """Lane time fields (``lanef[field, i]``, float64)."""

    SENT_AT = 0  # first transmission (RTT samples, Karn's rule)
    XMIT_AT = 1  # latest transmission
    DEADLINE = 2


LN_FIELDS = 7
LNF_FIELDS = 3


class WC(IntEnum):
    """Worker counters (``cnt``, int64)."""

    RESULTS = 0
    PACKETS_SENT = 1
    PAYLOAD_BYTES = 2  # of first transmissions: each chunk's payload once
    RETRANSMISSIONS = 3
    STALE_RESULT = 4
    DUPLICATE_RESULT = 5
    BAD_SLOT = 6
    BAD_COUNT = 7
    SPURIOUS = 8
    PAYLOAD_RESENT = 9  # payload bytes of re-sends (timeouts, probes, NACKs, RACK)
    N = 10


class WS(IntEnum):
    """Why :func:`worker_results` stopped."""

    DONE = 0  # every datagram taken
    OTHER = 1  # not a RESULT of this job: Python's path
    OP_COMPLETE = 2  # the operation's last result: Python completes it
    ONE = 3  # took one result (``limit`` reached): RACK runs, then call again


@njit(**_KW)
def build_request(p, i, set_bit, opv, lane, exps, nonf, x, res, txbuf, cnt, residual):
    """Write packet ``p`` (lane ``i``) into ``txbuf[i]`` from the input; return its length.

    Float: the exponent of block ``p`` (p < L) and the data of block ``p - E`` (p >= E), scaled
    with the lane's agreed exponent. Integers: block ``p``. A retransmission is rebuilt the same
    way, never replayed from stored bytes; ``residual``: record this rank's rounding error."""
    L = opv[OP.L]
    E = opv[OP.E]
    k = opv[OP.K]
    itemsize = opv[OP.ITEMSIZE]
    b = txbuf[i]
    flags = 0
    exp_data = EXP_ZERO
    exp_next = EXP_ZERO
    count = 0
    if opv[OP.IS_FLOAT]:
        if p < L:
            # The block's exponent is computed when its first packet is built (and again,
            # identically, for a retransmission), not for the whole tensor up front: a pass
            # over 64 MiB held every rank ~30 ms before its first packet, and ranks that
            # finished it at different times timed each other out.
            _block_exponent(x, p * k, min(p * k + k, x.size), p, exps, nonf)
            exp_next = exps[p]
            flags |= F_HAS_EXP
        if p >= E:
            blk = p - E
            lo = blk * k
            hi = min(lo + k, x.size)
            count = hi - lo
            exp_data = lane[LN.EMAX, i]
            bad = nonf[blk] != 0
            pay = b[HDR:HDR + count * itemsize]
            if itemsize == 4:
                q32 = pay.view(np.int32)
                quantize_block(x[lo:hi], exp_data, opv[OP.P], bad, q32)
                if residual:
                    residual_block(x[lo:hi], q32, exp_data, opv[OP.P], res[lo:hi])
            else:
                q16 = pay.view(np.int16)
                quantize_block(x[lo:hi], exp_data, opv[OP.P], bad, q16)
                if residual:
                    residual_block(x[lo:hi], q16, exp_data, opv[OP.P], res[lo:hi])
            flags |= F_HAS_DATA | (F_NONFINITE if bad else 0)
    else:
        lo = p * k
        hi = min(lo + k, x.size)
        count = hi - lo
        b[HDR:HDR + 4 * count] = x[lo:hi].view(np.uint8)
        flags |= F_HAS_DATA
    write_header(b, 0, T_REQUEST, flags, set_bit, opv[OP.RANK], opv[OP.JOB], opv[OP.TOKEN],
                 opv[OP.SEQ], p, lane[LN.SLOT, i], count, opv[OP.ELEM], opv[OP.DIGEST],
                 exp_data, exp_next)
    cnt[WC.PACKETS_SENT] += 1
    return HDR + count * itemsize


@njit(**_KW)
def send_chunk(p, retransmit, fast, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, res,
               txbuf, cnt):
    """Start (or re-send) packet ``p`` on its lane: lane bookkeeping, build, deadline.

    ``fast``: a RACK re-send: it does not back the lane's timeout off (TRIES counts timeouts
    only). Returns the datagram's length (it is ``txbuf[p mod E]``)."""
    i = p % opv[OP.E]
    if retransmit:
        set_bit = lane[LN.SET, i]
        if fast:
            lane[LN.FAST, i] = 1
        else:
            lane[LN.TRIES, i] += 1
        lane[LN.XMITS, i] += 1
        cnt[WC.RETRANSMISSIONS] += 1
    else:
        set_bit = next_set[i]
        next_set[i] = set_bit ^ 1
        lane[LN.SET, i] = set_bit
        lane[LN.CHUNK, i] = p
        lane[LN.TRIES, i] = 0
        lane[LN.XMITS, i] = 0
        lane[LN.FAST, i] = 0
        lanef[LF.SENT_AT, i] = now
    n = build_request(p, i, set_bit, opv, lane, exps, nonf, x, res, txbuf, cnt,
                      res.size > 0 and not retransmit)
    if retransmit:
        cnt[WC.PAYLOAD_RESENT] += n - HDR
    else:
        cnt[WC.PAYLOAD_BYTES] += n - HDR
    rto = min(rtt[R.RTO] * (2.0 ** lane[LN.TRIES, i]), rtt[R.MAX_RTO])
    if p + opv[OP.E] >= opv[OP.T] and lane[LN.TRIES, i] == 0 and rtt[R.SRTT] > 0:
        # The lane's last chunk: no later chunk of ours can show the switch that it is
        # missing (NACKs), so probe sooner than the timeout (a tail loss probe, RFC 8985 7).
        rto = min(rto, rtt[R.TAIL_PROBE_SRTTS] * rtt[R.SRTT])
    lanef[LF.DEADLINE, i] = now + rto
    lanef[LF.XMIT_AT, i] = now
    return n


@njit(**_KW)
def _update_rtt(rtt, sample):
    """RFC 6298: srtt/rttvar smoothing; rto = srtt + 4 rttvar, clamped."""
    if rtt[R.MIN_RTT] < 0 or sample < rtt[R.MIN_RTT]:
        rtt[R.MIN_RTT] = sample
    if rtt[R.SRTT] < 0:
        rtt[R.SRTT] = sample
        rtt[R.RTTVAR] = sample / 2
    else:
        rtt[R.RTTVAR] = 0.75 * rtt[R.RTTVAR] + 0.25 * abs(rtt[R.SRTT] - sample)
        rtt[R.SRTT] = 0.875 * rtt[R.SRTT] + 0.125 * sample
    rtt[R.RTO] = min(max(rtt[R.SRTT] + 4 * rtt[R.RTTVAR], rtt[R.MIN_RTO]), rtt[R.MAX_RTO])


@njit(**_KW)
def worker_results(d, starts, lens, nseg, start, limit, now, opv, lane, lanef, rtt, next_set,
                   exps, nonf, x, out, res, txbuf, cnt, sendq, sendlen):
    """Take the RESULTs of a batch (datagram ``i`` is ``d[starts[i] : starts[i] + lens[i]]``)
    from datagram ``start`` on: dequantize into ``out``, time the
    round trip, and build the packet each result releases on its lane.

    Returns ``(next, nsend, code)``: lanes whose packet is ready are ``sendq[:nsend]`` (lengths
    in ``sendlen``); ``code`` says why it stopped (``WC``). ``limit``: stop after this many
    results taken (RACK looks for losses after each)."""
    E = opv[OP.E]
    T = opv[OP.T]
    L = opv[OP.L]
    k = opv[OP.K]
    nsend = 0
    taken = 0
    i = start
    while i < nseg:
        o = starts[i]
        ln = lens[i]
        if ln < HDR or _u16(d, o) != MAGIC or d[o + 2] != VERSION or d[o + 3] != T_RESULT:
            return i, nsend, WS.OTHER.value
        if d[o + 5] > 1 or (np.int64(d[o + 4]) & ~KNOWN_FLAGS) != 0:
            return i, nsend, WS.OTHER.value
        elem = np.int64(d[o + 34])
        count = _u16(d, o + 32)
        if elem == E_INT32:
            isz = 4
        elif elem == E_INT16:
            isz = 2
        else:
            return i, nsend, WS.OTHER.value
        if ln != HDR + isz * count:
            return i, nsend, WS.OTHER.value
        if _u32(d, o + 8) != opv[OP.JOB] or _i64(d, o + 12) != opv[OP.TOKEN]:
            return i, nsend, WS.OTHER.value
        i += 1
        flags = np.int64(d[o + 4])
        set_bit = np.int64(d[o + 5])
        seq = _u32(d, o + 20)
        p = _u32(d, o + 24)
        slot = _u32(d, o + 28)
        exp_data = _i16(d, o + 36)
        exp_next = _i16(d, o + 38)
        if seq != opv[OP.SEQ]:
            cnt[WC.STALE_RESULT] += 1
            continue
        ln_i = p % E
        if p >= T or lane[LN.CHUNK, ln_i] != p:
            cnt[WC.DUPLICATE_RESULT] += 1
            continue
        if slot != lane[LN.SLOT, ln_i] or set_bit != lane[LN.SET, ln_i]:
            cnt[WC.BAD_SLOT] += 1
            continue
        if count and elem != opv[OP.ELEM]:
            cnt[WC.BAD_COUNT] += 1
            continue
        pay = d[o + HDR:o + HDR + count * isz]
        if opv[OP.IS_FLOAT]:
            if p >= E:
                blk = p - E
                lo = blk * k
                hi = min(lo + k, out.size)
                if count != hi - lo:
                    cnt[WC.BAD_COUNT] += 1
                    continue
                edge = exp_data >= opv[OP.EDGE_EXP]
                if isz == 4:
                    dequantize_block(pay.view(np.int32), exp_data, opv[OP.P],
                                     (flags & F_NONFINITE) != 0, out[lo:hi], opv[OP.N], edge,
                                     rtt[R.FMAX])
                else:
                    dequantize_block(pay.view(np.int16), exp_data, opv[OP.P],
                                     (flags & F_NONFINITE) != 0, out[lo:hi], opv[OP.N], edge,
                                     rtt[R.FMAX])
            elif count:
                cnt[WC.BAD_COUNT] += 1
                continue
            if p < L:
                lane[LN.EMAX, ln_i] = exp_next
        else:
            lo = p * k
            hi = min(lo + k, out.size)
            if count != hi - lo:
                cnt[WC.BAD_COUNT] += 1
                continue
            out[lo:hi].view(np.uint8)[:] = pay
        cnt[WC.RESULTS] += 1
        delivered = lanef[LF.XMIT_AT, ln_i]
        if lane[LN.XMITS, ln_i] == 0:
            _update_rtt(rtt, now - lanef[LF.SENT_AT, ln_i])
        elif rtt[R.MIN_RTT] >= 0 and now - delivered < rtt[R.MIN_RTT]:
            # Too soon to answer the re-send: it answers an earlier transmission (RFC 8985
            # 6.2 step 2), so only that one's time says which chunks were sent before it.
            delivered = lanef[LF.SENT_AT, ln_i]
            if lane[LN.FAST, ln_i]:
                # The chunk was not lost: the RACK re-send was early; widen the window.
                lane[LN.FAST, ln_i] = 0
                cnt[WC.SPURIOUS] += 1
                rtt[R.REO_SCALE] = min(rtt[R.REO_SCALE] * 2, rtt[R.MAX_REO_SCALE])
        rtt[R.DELIVERED_XMIT] = delivered
        opv[OP.DONE] += 1
        rtt[R.LAST_PROGRESS] = now
        rtt[R.LAST_HEARD] = now
        nxt = p + E
        if nxt < T:
            sendlen[nsend] = send_chunk(nxt, False, False, now, opv, lane, lanef, rtt, next_set,
                                        exps, nonf, x, res, txbuf, cnt)
            sendq[nsend] = ln_i
            nsend += 1
        else:
            lane[LN.CHUNK, ln_i] = -1
        if opv[OP.DONE] == T:
            return i, nsend, WS.OP_COMPLETE.value
        taken += 1
        if taken >= limit:
            return i, nsend, WS.ONE.value
    return i, nsend, WS.DONE.value


@njit(**_KW)
def send_first(count, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, res, txbuf, cnt,
               sendlen):
    """Start packets ``0 .. count-1`` (the first window); lengths into ``sendlen``."""
    for p in range(count):
        sendlen[p] = send_chunk(p, False, False, now, opv, lane, lanef, rtt, next_set, exps,
                                nonf, x, res, txbuf, cnt)


MAX_BATCH = 4096
"""Datagrams one batch call takes at most (the kernel's GRO merges at most 64; recvmmsg of 64
buffers of up to 64 each)."""


def counter_snapshot(counter, cnt, names):
    """A Counter of ``counter`` plus the kernel counters ``cnt[i]`` named in ``names``
    (``(name, index)`` pairs): what an endpoint's ``drops`` and ``counters`` report."""
    c = type(counter)(counter)
    for name, i in names:
        if cnt[i]:
            c[name] += int(cnt[i])
    return c


def as_buffer(data) -> np.ndarray:
    """A writable uint8 array over one datagram (a copy where it is read-only, e.g. bytes)."""
    buf = data if isinstance(data, np.ndarray) else np.frombuffer(data, np.uint8)
    return buf if buf.flags.writeable else buf.copy()


def split_gro(nbytes: int, seg: int, starts: np.ndarray, lens: np.ndarray) -> tuple[int, int]:
    """Cut a GRO buffer (datagrams of ``seg`` bytes, the last may be shorter) into
    ``starts``/``lens``; return ``(datagrams, excess)``: ``excess`` datagrams did not fit the
    arrays (a real GRO buffer holds at most 64; more is malformed input, to drop and count)."""
    count = int(gro_segments(nbytes, seg, starts, lens))
    return count, -(-nbytes // seg) - count


@njit(**_KW)
def gro_segments(nbytes, seg, starts, lens):
    """Fill ``starts``/``lens`` with the datagrams of a GRO buffer (all ``seg`` long but the
    last); return their number."""
    n = 0
    o = 0
    while o < nbytes and n < starts.size:
        starts[n] = o
        lens[n] = min(seg, nbytes - o)
        o += seg
        n += 1
    return n


@njit(**_KW)
def split_mmsg(msgs, msg_len_at, controllen_at, names, control, n, slot_bytes, gro, sol_udp,
               udp_gro, out_starts, out_lens, out_senders):
    """Cut what one ``recvmmsg`` returned into datagrams; return their number.

    ``msgs``: the ``struct mmsghdr`` array as rows of bytes (``msg_len`` at ``msg_len_at``,
    ``msg_controllen`` at ``controllen_at``); message ``i`` filled ``slot_bytes`` bytes of the
    buffer at ``i * slot_bytes``, came from the IPv4 ``sockaddr_in`` in ``names[i]`` (numbered
    as ``address << 16 | port``) and, with UDP GRO, may hold several datagrams of one size,
    which its control message (``SOL_UDP``, ``UDP_GRO``, an int) says. Resets every
    ``msg_controllen`` for the next call."""
    m = 0
    for i in range(n):
        row = msgs[i]
        length = (np.int64(row[msg_len_at]) | (np.int64(row[msg_len_at + 1]) << 8)
                  | (np.int64(row[msg_len_at + 2]) << 16) | (np.int64(row[msg_len_at + 3]) << 24))
        nm = names[i]
        sender = ((np.int64(nm[4]) << 40) | (np.int64(nm[5]) << 32) | (np.int64(nm[6]) << 24)
                  | (np.int64(nm[7]) << 16) | (np.int64(nm[2]) << 8) | np.int64(nm[3]))
        seg = length
        if gro:
            used = np.int64(row[controllen_at]) | (np.int64(row[controllen_at + 1]) << 8)
            c = control[i]
            if used >= 20 and _u32(c, 8) == sol_udp and _u32(c, 12) == udp_gro:
                g = _u32(c, 16)
                if 0 < g < length:
                    seg = g
        o = i * slot_bytes
        end = o + length
        while True:
            if m >= out_starts.size:
                return m
            out_starts[m] = o
            out_lens[m] = min(seg, end - o)
            out_senders[m] = sender
            m += 1
            o += seg
            if o >= end:
                break
    if gro:
        full = control.shape[1]
        for i in range(msgs.shape[0]):
            for b in range(8):
                msgs[i, controllen_at + b] = (full >> (8 * b)) & 0xFF
    return m


@njit(**_KW)
def next_deadline(lane, lanef):
    """The earliest retransmission deadline of a busy lane (inf when none is busy)."""
    best = np.inf
    for i in range(lane.shape[1]):
        if lane[LN.CHUNK, i] >= 0 and lanef[LF.DEADLINE, i] < best:
            best = lanef[LF.DEADLINE, i]
    return best

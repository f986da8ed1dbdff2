"""Datagram framing for the reference kernels (plain Python; ``src/switchml/csrc`` holds the
compiled ones, from the same tables): wire constants, little-endian field access,
header writing, the REQUEST framing rule, and cutting received buffers into datagrams.

The header's byte offsets (``H_SEQ`` ...) come from ``wire.HEADER_FIELDS``, the one table of
the layout; the other wire constants are
checked against ``wire.py`` by ``tests/protocol/test_batches.py``.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.wire import AT, HEADER_SIZE

HDR = HEADER_SIZE
H_MAGIC, H_VERSION, H_TYPE, H_FLAGS, H_SET = (AT["magic"], AT["version"], AT["type"],
                                              AT["flags"], AT["set"])
H_RANK, H_JOB, H_TOKEN, H_SEQ = AT["rank"], AT["job"], AT["token"], AT["seq"]
H_CHUNK, H_SLOT, H_COUNT, H_ELEM = AT["chunk"], AT["slot"], AT["count"], AT["elem"]
H_DIGEST, H_EXP_DATA, H_EXP_NEXT = AT["digest"], AT["exp_data"], AT["exp_next"]
MAGIC = 0x4D53
VERSION = 1
T_REQUEST = 1
T_RESULT = 2
T_WAITING = 3
T_NACK = 6
KNOWN_FLAGS = 0x0F
F_NONFINITE = 0x01
F_HAS_DATA = 0x02
F_HAS_EXP = 0x04
F_RESENT = 0x08
F_CONTRIBUTORS = 0x10
F_RETRY = 0x20
F_AUTH = 0x40
DATA_TAG = 16  # an authenticated job's MAC after the payload (csrc/common.h's seal_data)
RESULT_FLAGS = 0x1F
REQUEST_FLAGS = 0x2F
SHAPE_FLAGS = F_HAS_DATA | F_HAS_EXP
E_BYTES = 0
E_INT32 = 1
E_INT16 = 2
EXP_ZERO = -32768
HALF = 1 << 31
EPOCH_TRAIL = 1 << 30
MASK32 = (1 << 32) - 1



def copy_bytes(dst, do, src, so, n):
    """``dst[do:do+n] = src[so:so+n]`` for byte arrays that do not overlap, with no slice
    (a slice assignment allocates in numba, which an ``NO_RC`` kernel may not)."""
    for j in range(n):
        dst[np.uint64(do + j)] = src[np.uint64(so + j)]


def u16(d, o):
    return np.int64(d[o]) | (np.int64(d[o + 1]) << 8)


def u32(d, o):
    return (np.int64(d[o]) | (np.int64(d[o + 1]) << 8) | (np.int64(d[o + 2]) << 16)
            | (np.int64(d[o + 3]) << 24))


def i16(d, o):
    v = u16(d, o)
    return v - 65536 if v >= 32768 else v


def i64(d, o):
    """The u64 at ``o``, reinterpreted as int64 (tokens are compared bit for bit)."""
    lo = u32(d, o)
    hi = u32(d, o + 4)
    return np.int64(np.uint64(lo) | (np.uint64(hi) << np.uint64(32)))


def put16(d, o, v):
    d[o] = v & 0xFF
    d[o + 1] = (v >> 8) & 0xFF


def put32(d, o, v):
    d[o] = v & 0xFF
    d[o + 1] = (v >> 8) & 0xFF
    d[o + 2] = (v >> 16) & 0xFF
    d[o + 3] = (v >> 24) & 0xFF


def put64(d, o, v):
    u = np.uint64(v)
    put32(d, o, np.int64(u & np.uint64(MASK32)))
    put32(d, o + 4, np.int64(u >> np.uint64(32)))


def write_header(d, o, mtype, flags, set_bit, rank, job, token, seq, chunk, slot, count, elem,
                 digest, exp_data, exp_next):
    """Write a 40-byte header at ``d[o:]`` (``token`` as int64 bits)."""
    put16(d, o + H_MAGIC, MAGIC)
    d[o + H_VERSION] = VERSION
    d[o + H_TYPE] = mtype
    d[o + H_FLAGS] = flags
    d[o + H_SET] = set_bit
    put16(d, o + H_RANK, rank)
    put32(d, o + H_JOB, job)
    put64(d, o + H_TOKEN, token)
    put32(d, o + H_SEQ, seq)
    put32(d, o + H_CHUNK, chunk)
    put32(d, o + H_SLOT, slot)
    put16(d, o + H_COUNT, count)
    d[o + H_ELEM] = elem
    d[o + H_DIGEST] = digest
    put16(d, o + H_EXP_DATA, exp_data & 0xFFFF)
    put16(d, o + H_EXP_NEXT, exp_next & 0xFFFF)


def request_framing(d, o, n):
    """Whether ``d[o:o+n]`` is a well-formed REQUEST with an int32 or int16 payload."""
    if (n < HDR or u16(d, o + H_MAGIC) != MAGIC or d[o + H_VERSION] != VERSION
            or d[o + H_TYPE] != T_REQUEST):
        return False
    flags = np.int64(d[o + H_FLAGS])
    if d[o + H_SET] > 1 or (flags & ~(REQUEST_FLAGS | F_AUTH)) != 0:
        return False
    if flags & F_AUTH:  # an authenticated job's: the MAC follows the payload
        n -= DATA_TAG
    elem = d[o + H_ELEM]
    if elem == E_INT32:
        return n == HDR + 4 * u16(d, o + H_COUNT)
    if elem == E_INT16:
        return n == HDR + 2 * u16(d, o + H_COUNT)
    return False


from switchml.protocol.kernels.layout import MAX_BATCH  # noqa: E402,F401  (re-exported)


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
    stopped = False
    for i in range(n):
        if stopped:
            break
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
            if used >= 20 and u32(c, 8) == sol_udp and u32(c, 12) == udp_gro:
                g = u32(c, 16)
                if 0 < g < length:
                    seg = g
        o = i * slot_bytes
        end = o + length
        while True:
            if m >= out_starts.size:
                stopped = True  # (the rest is dropped; the control lengths still reset below)
                break
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


def first_foreign(senders, start, count, allowed, nallowed):
    """The first ``i`` in ``start .. count-1`` whose ``senders[i]`` is none of
    ``allowed[:nallowed]``, or ``count``: the datagrams of a batch up to there come from
    senders already checked (a worker takes datagrams from its switch's addresses only)."""
    for i in range(start, count):
        s = senders[i]
        ok = False
        for j in range(nallowed):
            if allowed[j] == s:
                ok = True
                break
        if not ok:
            return i
    return count

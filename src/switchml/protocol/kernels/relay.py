"""A rack switch's relay in plain Python (the reference of ``src/switchml/csrc/switch.c``'s, which
production runs: ``switchml._switch``): completed rounds up as requests, the parent's results
down.

``tree.py`` explains the tree. Per (set, lane) the rack keeps one upstream request (``up``, a
datagram buffer), its state (``ust``, fields U) and times (``utimes``, fields UT), and the
parent's result rewritten for the children (``down``). :func:`relay_up` turns rounds the inner
switch completed into requests; :func:`relay_down` takes a batch of the parent's datagrams and
rewrites every result it can match; both list what Python must send. Anything else from the
parent (JOINED, WAITING, NACK, errors) stops :func:`relay_down` for Python.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.kernels.frames import (
    E_INT16,
    E_INT32,
    F_RESENT,
    H_CHUNK,
    H_COUNT,
    H_ELEM,
    H_FLAGS,
    H_JOB,
    H_MAGIC,
    H_SEQ,
    H_SET,
    H_SLOT,
    H_TOKEN,
    H_TYPE,
    H_VERSION,
    HDR,
    KNOWN_FLAGS,
    MAGIC,
    T_REQUEST,
    T_RESULT,
    VERSION,
    copy_bytes,
    i64,
    put16,
    put32,
    put64,
    u16,
    u32,
)
from switchml.protocol.kernels.layout import (  # noqa: E402,F401  (re-exported)
    ANSWERED,
    IDLE,
    RC,
    RV,
    RV_FIELDS,
    SENT,
    U_FIELDS,
    UT,
    UT_FIELDS,
    U,
)


def _retag(b, mtype, rank, job, token, slot):
    """Rewrite a datagram's header for the other level: type, rank, job, token, slot; no
    ``RESENT`` flag (header offsets: ``frames.py``)."""
    b[3] = mtype
    b[4] = b[4] & (0xFF & ~F_RESENT)
    put16(b, 6, rank)
    put32(b, 8, job)
    put64(b, 12, token)
    put32(b, 28, slot)


def relay_up(done, ndone, bufs, rv, up, ust, utimes, now, rto, cnt, sendq):
    """Rounds the inner switch completed (``done[i] = (set, slot, length)`` of its result in
    ``bufs``) become this rack's requests to the parent (``up[set, lane]``). Returns how many;
    ``sendq[j] = (set, lane, length)``. Call only once the parent job is joined."""
    for j in range(ndone):
        v, s, ln = done[j, 0], done[j, 1], done[j, 2]
        b = up[v, s]
        copy_bytes(b, 0, bufs[v, s], 0, ln)
        _retag(b, T_REQUEST, rv[RV.RACK], rv[RV.PARENT_JOB], rv[RV.PARENT_TOKEN],
               rv[RV.PARENT_BASE] + s)
        ust[U.STATE, v, s] = SENT
        ust[U.SEQ, v, s] = u32(b, 20)
        ust[U.CHUNK, v, s] = u32(b, 24)
        ust[U.LEN, v, s] = ln
        ust[U.TRIES, v, s] = 0
        utimes[UT.FIRST_SENT, v, s] = now
        utimes[UT.DUE, v, s] = now + rto
        sendq[j, 0], sendq[j, 1], sendq[j, 2] = v, s, ln
        cnt[RC.UPSTREAM_SENT] += 1
    return ndone


def _parent_result(d, o, ln, rv):
    """Whether ``d[o:o+ln]`` is a well-formed RESULT of the parent job."""
    if (ln < HDR or u16(d, o + H_MAGIC) != MAGIC or d[o + H_VERSION] != VERSION
            or d[o + H_TYPE] != T_RESULT):
        return False
    if d[o + H_SET] > 1 or (np.int64(d[o + H_FLAGS]) & ~KNOWN_FLAGS) != 0:
        return False
    elem = np.int64(d[o + H_ELEM])
    isz = 4 if elem == E_INT32 else (2 if elem == E_INT16 else 0)
    return (isz != 0 and ln == HDR + isz * u16(d, o + H_COUNT)
            and u32(d, o + H_JOB) == rv[RV.PARENT_JOB]
            and i64(d, o + H_TOKEN) == rv[RV.PARENT_TOKEN])


def relay_down(d, starts, lens, nseg, start, rv, ust, down, cnt, sendq):
    """Take the parent's RESULTs of a batch from datagram ``start`` on: each that answers an
    outstanding request is rewritten for the child job into ``down[set, lane]``. Returns
    ``(next, nsend)``: ``sendq[:nsend] = (set, lane, length)`` to multicast to the children;
    ``next < nseg``: datagram ``next`` is something else, for Python."""
    nsend = 0
    i = start
    W = ust.shape[2]
    while i < nseg:
        o, ln = starts[i], lens[i]
        if not _parent_result(d, o, ln, rv):
            return i, nsend
        i += 1
        v = np.int64(d[o + H_SET])
        lane = u32(d, o + H_SLOT) - rv[RV.PARENT_BASE]
        if (lane < 0 or lane >= W or ust[U.STATE, v, lane] != SENT
                or ust[U.SEQ, v, lane] != u32(d, o + H_SEQ)
                or ust[U.CHUNK, v, lane] != u32(d, o + H_CHUNK)):
            cnt[RC.PARENT_DUPLICATES] += 1
            continue
        b = down[v, lane]
        copy_bytes(b, 0, d, o, ln)
        _retag(b, T_RESULT, 0, rv[RV.CHILD_JOB], rv[RV.CHILD_TOKEN], rv[RV.CHILD_BASE] + lane)
        ust[U.STATE, v, lane] = ANSWERED
        ust[U.RESULT_LEN, v, lane] = ln
        sendq[nsend, 0], sendq[nsend, 1], sendq[nsend, 2] = v, lane, ln
        nsend += 1
        cnt[RC.PARENT_RESULTS] += 1
    return i, nsend


def relay_next_due(ust, utimes):
    """The earliest retransmission deadline of an unanswered request (inf when none)."""
    best = np.inf
    for v in range(2):
        for s in range(ust.shape[2]):
            if ust[U.STATE, v, s] == SENT and utimes[UT.DUE, v, s] < best:
                best = utimes[UT.DUE, v, s]
    return best


def relay_due(ust, utimes, now, rto, max_rto, out):
    """Unanswered requests whose deadline passed: their (set, lane) into ``out``, deadlines
    backed off (``rto * 2^tries``, at most ``max_rto``); returns how many (the caller re-sends
    them and checks each one's first transmission against the parent timeout)."""
    n = 0
    for v in range(2):
        for s in range(ust.shape[2]):
            if ust[U.STATE, v, s] == SENT and utimes[UT.DUE, v, s] <= now:
                ust[U.TRIES, v, s] += 1
                utimes[UT.DUE, v, s] = now + min(rto * 2.0 ** ust[U.TRIES, v, s], max_rto)
                out[n, 0], out[n, 1] = v, s
                n += 1
    return n

"""The switch's per-request rules in plain Python: the reference the compiled data plane
(``src/switchml/csrc/switch.c``, the one production implementation, imported as
``switchml._switch``) is tested against (``tests/protocol/test_switch_kernels.py``): validate,
classify by the slot table, aggregate, complete, find chunks a rank should have delivered
(NACKs), and answer a re-sent request (the stored result again, or WAITING).

``switch.py`` explains the protocol and holds the state as arrays (``jobs.Job``: ``jobv``
fields J, ``st`` fields S, bitmaps ``seen``/``conflict``, result buffers ``bufs``, the
completion log ``clog`` and per-rank ``cursor``); ``slots.py`` holds the table
every request is classified by (passed in as ``rules``). The answers to one rank (NACKs, RESENT
results, WAITING) are written into a reply buffer that the caller sends. A kernel stops at
what needs Python (disagreeing ranks, a full reply buffer) and returns why.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np

from switchml.protocol.kernels.bitmaps import any_bit, clear_bit, has_bit
from switchml.protocol.kernels.frames import (
    E_BYTES,
    E_INT32,
    EPOCH_TRAIL,
    EXP_ZERO,
    F_CONTRIBUTORS,
    F_NONFINITE,
    F_RESENT,
    F_RETRY,
    H_CHUNK,
    H_COUNT,
    H_DIGEST,
    H_ELEM,
    H_EXP_DATA,
    H_EXP_NEXT,
    H_FLAGS,
    H_JOB,
    H_RANK,
    H_SEQ,
    H_SET,
    H_SLOT,
    H_TOKEN,
    H_TYPE,
    HALF,
    HDR,
    MASK32,
    SHAPE_FLAGS,
    T_RESULT,
    T_WAITING,
    copy_bytes,
    i16,
    i64,
    request_framing,
    u16,
    u32,
    write_header,
)
from switchml.protocol.kernels.nacks import (
    _behind_on,
    _log_release,
    _nack_was_needless,
    _write_nack,
)
from switchml.protocol.slots import SlotAction

# The slot actions (slots.SlotAction) as this module's own constants. Checked at import.
A_DROP_STALE = 0
A_START_ROUND = 1
A_ADD = 2
A_RESEND_RESULT = 3
A_ANSWER_WAITING = 4
A_DROP_LATE = 5
A_REFUSE_MISMATCH = 6
A_ANSWER_LATE = 7
A_ANSWER_OLD = 8
if {a.name: int(a) for a in SlotAction} != {n[2:]: v for n, v in globals().items()
                                             if n.startswith("A_")}:
    raise ImportError("kernels/aggregate.py's A_* constants differ from slots.SlotAction")


from switchml.protocol.kernels.layout import (  # noqa: E402,F401  (re-exported)
    J_FIELDS,
    REPLIES_PER_CALL,
    S_FIELDS,
    SC,
    SS,
    J,
    S,
)


def reply_row_bytes(num_workers: int, elements_per_packet: int) -> int:
    """The bytes a reply row needs for a job: a stored result (header and int32 payload; a
    quorum job's adds its contributor bitmap: ``J.TRAILER``), or a WAITING (header and two
    bitmaps of the ranks)."""
    return HDR + max(4 * elements_per_packet, 2 * ((num_workers + 7) // 8))


class Request(NamedTuple):
    """The fields of a REQUEST that the slot rule reads (``s``: its slot, job-relative).

    The job's arrays are passed to the helpers one by one, not as a named tuple: a tuple of
    arrays costs reference counting at every use, measured at 0.1 us per request (a third of
    the switch's budget); a tuple of integers costs nothing."""

    seq: int
    chunk: int
    s: int
    v: int
    flags: int
    count: int
    elem: int
    digest: int
    exp_data: int
    exp_next: int
    itemsize: int


# -- the slot rule ------------------------------------------------------------------------------

def _parse(d, o, base):
    """The REQUEST at ``d[o:]`` (framing already checked)."""
    elem = np.int64(d[o + H_ELEM])
    return Request(u32(d, o + H_SEQ), u32(d, o + H_CHUNK), u32(d, o + H_SLOT) - base,
                   np.int64(d[o + H_SET]), np.int64(d[o + H_FLAGS]), u16(d, o + H_COUNT), elem,
                   np.int64(d[o + H_DIGEST]),
                   i16(d, o + H_EXP_DATA), i16(d, o + H_EXP_NEXT), 4 if elem == E_INT32 else 2)


def _round_order(st, r):
    """``slots.Round`` of the request's ``(seq, chunk)`` against its set's round (seq in
    serial-number arithmetic, RFC 1982)."""
    cur = st[S.SEQ, r.v, r.s]
    if cur < 0:
        return 2
    if r.seq != cur:
        return 2 if ((r.seq - cur) & MASK32) < HALF else 0
    cc = st[S.CHUNK, r.v, r.s]
    return 1 if r.chunk == cc else (2 if r.chunk > cc else 0)


def _agrees(st, r):
    """Whether the chunk has its round's shape (size, type, exponent, flags, digest)."""
    v, s = r.v, r.s
    return (r.count == st[S.COUNT, v, s] and r.elem == st[S.ELEM, v, s]
            and r.digest == st[S.DIGEST, v, s] and r.exp_data == st[S.EXP_DATA, v, s]
            and ((r.flags ^ st[S.FLAGS, v, s]) & SHAPE_FLAGS) == 0)


def _action(jobv, st, seen, rules, r, rank):
    """Look the request up in the slot rules (``slots.SLOT_RULES``)."""
    order = _round_order(st, r)
    contributed = complete = 0
    agrees = 1
    if order == 1:
        contributed = 1 if has_bit(seen, r.v, r.s, rank) else 0
        complete = 1 if st[S.MISSING, r.v, r.s] == 0 else 0
        if not contributed and not complete:
            agrees = 1 if _agrees(st, r) else 0
    return rules[1 if jobv[J.QUORUM] > 0 else 0, order, contributed, complete, agrees]


def _microseconds(t):
    """The switch's clock ``t`` (seconds) in whole microseconds, to nearest: a deadline
    computed back in seconds (``get_timer``) compares equal, not a microsecond short."""
    return np.int64(math.floor(t * 1e6 + 0.5))


def _result_size(jobv, st, v, s):
    """The bytes of the result datagram of (slot ``s``, set ``v``)."""
    return (HDR + (4 if st[S.ELEM, v, s] == E_INT32 else 2) * st[S.COUNT, v, s]
            + jobv[J.TRAILER])


def _archive(jobv, st, bufs, v, s):
    """A quorum job's complete round about to be overwritten: its result into the slot's
    history (``bufs[2:]``, a ring of ``J.HISTORY`` rows per slot), for a rank the quorum left
    behind (``_find_old``)."""
    h = jobv[J.HISTORY]
    if h <= 0 or st[S.SEQ, v, s] < 0 or st[S.MISSING, v, s] != 0:
        return
    pos = st[S.HPOS, 0, s]
    copy_bytes(bufs[2 + pos, s], 0, bufs[v, s], 0, _result_size(jobv, st, v, s))
    st[S.HPOS, 0, s] = (pos + 1) % h


def _find_old(jobv, bufs, r):
    """The history row of slot ``r.s`` holding the result of round ``(r.seq, r.chunk)``, or
    -1."""
    for h in range(jobv[J.HISTORY]):
        b = bufs[2 + h, r.s]
        if b[H_TYPE] == T_RESULT and u32(b, H_SEQ) == r.seq and u32(b, H_CHUNK) == r.chunk:
            return 2 + h
    return -1


def _write_old(jobv, bufs, replies, reply_meta, k, rank, r, row):
    """Reply ``k``: the result of an earlier round from the slot's history, marked RESENT."""
    b = bufs[row, r.s]
    size = HDR + (4 if b[H_ELEM] == E_INT32 else 2) * u16(b, H_COUNT) + jobv[J.TRAILER]
    out = replies[k]
    copy_bytes(out, 0, b, 0, size)
    out[H_FLAGS] |= F_RESENT
    reply_meta[k, 0], reply_meta[k, 1] = rank, size


def _start_round(jobv, st, seen, conflict, bufs, n, r, rank, pay, now, cnt):
    """A new round: the first contributor overwrites (no explicit reset of a slot); ``n``:
    the contributions that complete it (the job's quorum, else every rank). A quorum job
    keeps the round it overwrites (``_archive``)."""
    v, s = r.v, r.s
    if st[S.SEQ, v, s] >= 0 and st[S.MISSING, v, s] != 0:
        cnt[SC.ABANDONED] += 1  # only after a failed operation
    _archive(jobv, st, bufs, v, s)
    st[S.OPENED_AT, v, s] = _microseconds(now)  # (a quorum job's deadline counts from here)
    copy_bytes(bufs[v, s], HDR, pay, 0, pay.size)
    st[S.SEQ, v, s], st[S.CHUNK, v, s], st[S.COUNT, v, s] = r.seq, r.chunk, r.count
    st[S.ELEM, v, s], st[S.FLAGS, v, s] = r.elem, r.flags & (F_NONFINITE | SHAPE_FLAGS)
    st[S.EXP_DATA, v, s], st[S.EXP_NEXT, v, s] = r.exp_data, r.exp_next
    st[S.DIGEST, v, s] = r.digest
    for w in range(seen.shape[2]):
        seen[v, s, w] = 0
        conflict[v, s, w] = 0
    seen[v, s, rank >> 6] = np.uint64(1) << np.uint64(rank & 63)
    st[S.MISSING, v, s] = n - 1


def _add(st, seen, conflict, bufs, r, rank, pay):
    """Add a contribution (integer adds wrap, as a switch's adders do); returns whether the
    round has refused ranks left after this one (Python tells this rank)."""
    v, s = r.v, r.s
    acc = bufs[v, s, HDR:HDR + pay.size]
    if r.elem == E_INT32:
        a32, x32 = acc.view(np.int32), pay.view(np.int32)
        for j in range(r.count):
            a32[j] += x32[j]
    else:
        a16, x16 = acc.view(np.int16), pay.view(np.int16)
        for j in range(r.count):
            a16[j] += x16[j]
    seen[v, s, rank >> 6] |= np.uint64(1) << np.uint64(rank & 63)
    st[S.FLAGS, v, s] |= r.flags & F_NONFINITE
    if r.exp_next > st[S.EXP_NEXT, v, s]:
        st[S.EXP_NEXT, v, s] = r.exp_next
    st[S.MISSING, v, s] -= 1
    if any_bit(conflict, v, s):  # this chunk agrees, but others did not
        clear_bit(conflict, v, s, rank)
        return any_bit(conflict, v, s)
    return False


def _complete(jobv, st, seen, bufs, clog, r, rank, done, ndone, cnt):
    """The round's last contribution: write the result header into the slot's buffer (and a
    quorum job's contributor bitmap after the payload), log the completion (NACKs), and list
    it in ``done``."""
    _complete_round(jobv, st, seen, bufs, clog, r.v, r.s, rank, done, ndone, cnt)


def _complete_round(jobv, st, seen, bufs, clog, v, s, rank, done, ndone, cnt):
    """Complete the round of (slot ``s``, set ``v``) (``_complete``; a quorum job's deadline
    too: ``expire_rounds``); ``rank``: who completed it (the header's rank field)."""
    seq, chunk, count = st[S.SEQ, v, s], st[S.CHUNK, v, s], st[S.COUNT, v, s]
    elem = st[S.ELEM, v, s]
    size = HDR + (4 if elem == E_INT32 else 2) * count
    flags = st[S.FLAGS, v, s]
    trailer = jobv[J.TRAILER]
    if trailer > 0:
        flags |= F_CONTRIBUTORS
        for b in range(trailer):
            bufs[v, s, size + b] = (seen[v, s, b >> 3] >> np.uint64(8 * (b & 7))) & np.uint64(255)
    write_header(bufs[v, s], 0, T_RESULT, flags, v, rank, jobv[J.JOB],
                 jobv[J.TOKEN], seq, chunk, s + jobv[J.SLOT_BASE], count, elem,
                 st[S.DIGEST, v, s], st[S.EXP_DATA, v, s], st[S.EXP_NEXT, v, s])
    if jobv[J.LOG_AT_RELEASE]:
        st[S.DONE_AT, v, s] = -1  # not released yet: no chunk can follow it
    else:
        _log_release(jobv, st, clog, v, s, seq, chunk)
    done[ndone, 0], done[ndone, 1], done[ndone, 2] = v, s, size + trailer
    cnt[SC.MULTICAST] += 1
    jobv[J.AGGREGATED] += count


def expire_rounds(jobv, st, seen, conflict, bufs, clog, cursor, mkeys, heard, now, cnt, done):
    """A quorum job's deadline: complete every open round that has at least ``QUORUM_MIN``
    contributions and opened ``DEADLINE_US`` or longer before ``now`` (the switch's timer
    calls it; ``SwitchDataplane.get_timer`` says when). Returns how many; ``done`` rows as
    ``switch_requests`` writes them. (The arguments after ``clog`` are unused: the job's
    arrays, as every job kernel takes them.)"""
    d = jobv[J.DEADLINE_US]
    if d <= 0 or jobv[J.QUORUM] <= 0:
        return 0
    k, m = jobv[J.QUORUM], jobv[J.QUORUM_MIN]
    now_us = _microseconds(now)
    nd = 0
    for v in range(2):
        for s in range(jobv[J.WINDOW]):
            missing = st[S.MISSING, v, s]
            if (st[S.SEQ, v, s] >= 0 and missing > 0 and k - missing >= m
                    and now_us - st[S.OPENED_AT, v, s] >= d):
                if nd == done.shape[0]:
                    return nd
                st[S.MISSING, v, s] = 0
                _complete_round(jobv, st, seen, bufs, clog, v, s, jobv[J.N], done, nd, cnt)
                cnt[SC.DEADLINE_COMPLETED] += 1
                nd += 1
    return nd


# -- the batch ----------------------------------------------------------------------------------

def _member_request(d, o, ln, sender, jobv, mkeys):
    """Whether the datagram at ``d[o:o+ln]`` is a well-formed REQUEST of this job (job and
    token) from a rank whose membership was checked for this sender (``mkeys``: per rank, the
    sender number its admitted requests came with; -1: none)."""
    if sender < 0 or not request_framing(d, o, ln):
        return False
    if u32(d, o + H_JOB) != jobv[J.JOB] or i64(d, o + H_TOKEN) != jobv[J.TOKEN]:
        return False
    rank = u16(d, o + H_RANK)
    return rank < jobv[J.N] and mkeys[rank] == sender


def _before_epoch(jobv, seq):
    """Whether ``seq`` predates the job's epoch (a restart); keeps the bound within reach of
    wrapping sequence numbers."""
    min_seq = jobv[J.MIN_SEQ]
    if min_seq < 0:
        return False
    ahead = (seq - min_seq) & MASK32
    if ahead >= HALF:
        return True
    if ahead > EPOCH_TRAIL:
        jobv[J.MIN_SEQ] = (seq - EPOCH_TRAIL) & MASK32
    return False


def _outside(jobv, r, cnt):
    """A request for a slot outside the job's range, or with more payload than a slot holds:
    dropped and counted."""
    if r.s < 0 or r.s >= jobv[J.WINDOW]:
        cnt[SC.BAD_SLOT] += 1
        return True
    if r.count * r.itemsize > jobv[J.MAX_BYTES]:
        cnt[SC.BAD_PAYLOAD] += 1
        return True
    return False


def _write_resent(jobv, st, bufs, replies, reply_meta, k, rank, r):
    """Reply ``k``: the stored result of the request's round again, marked RESENT (the result
    was lost on its way to this rank, or the rank is late for a quorum round)."""
    v, s = r.v, r.s
    size = _result_size(jobv, st, v, s)
    row = replies[k]
    copy_bytes(row, 0, bufs[v, s], 0, size)
    row[H_FLAGS] |= F_RESENT
    reply_meta[k, 0], reply_meta[k, 1] = rank, size


def gone_ranks(jobv, seen, heard, now, v, s):
    """The ranks the open round ``(v, s)`` misses that are gone, as a bitmap (bit ``q``: rank
    ``q``): silent for ``MEMBER_TIMEOUT_US`` (a rank that never joined counts from the job's
    creation). The rule (``csrc/switch.c``'s ``waits_for_gone``) for the kernel and for the
    sealed WAITING the switch's Python writes (``switch_replies.py``)."""
    quiet = now - jobv[J.MEMBER_TIMEOUT_US] * 1e-6
    gone = 0
    for q in range(jobv[J.N]):
        if not has_bit(seen, v, s, q) and heard[q] < quiet:
            gone |= 1 << q
    return gone


def _waits_for_gone(jobv, seen, heard, now, v, s):
    """Whether the open round ``(v, s)`` misses a rank that is gone (:func:`gone_ranks`)."""
    return gone_ranks(jobv, seen, heard, now, v, s) != 0


def _write_waiting(jobv, seen, replies, reply_meta, k, rank, r):
    """Reply ``k``: WAITING, to a re-send into an open round that has this rank's data and
    waits for no gone rank: the ranks still missing, then an empty bitmap (of the gone ones:
    the switch's Python side writes those WAITINGs, sealed), each a little-endian bitmap of
    ``ceil(N / 8)`` bytes."""
    v, s = r.v, r.s
    n = jobv[J.N]
    nb = (n + 7) // 8
    row = replies[k]
    write_header(row, 0, T_WAITING, 0, v, rank, jobv[J.JOB], jobv[J.TOKEN], r.seq, r.chunk,
                 s + jobv[J.SLOT_BASE], 2 * nb, E_BYTES, 0, EXP_ZERO, EXP_ZERO)
    for b in range(2 * nb):
        row[HDR + b] = 0
    for q in range(n):
        if not has_bit(seen, v, s, q):
            row[HDR + (q >> 3)] |= np.uint8(1 << (q & 7))
    reply_meta[k, 0], reply_meta[k, 1] = rank, HDR + 2 * nb


def _answer_resend(jobv, st, seen, conflict, bufs, heard, now, replies, reply_meta, k, rank, r,
                   action, cnt):
    """A re-sent request (a timeout, a probe or a NACK: its round has this rank's data, or is
    complete), or a late one into a quorum round complete without it: write the answer as
    reply ``k`` and return ``SS.DONE``; or return what Python answers instead: the round has
    refused ranks (``SS.WAITING_CONFLICT``: MISMATCH), or waits for a gone rank
    (``SS.WAITING_GONE``: a sealed WAITING)."""
    if r.flags & F_RESENT:
        _nack_was_needless(jobv, cnt)  # the chunk NACKed as lost was in (reordered)
    if action == A_ANSWER_WAITING and any_bit(conflict, r.v, r.s):
        return SS.WAITING_CONFLICT.value
    if action == A_ANSWER_WAITING and _waits_for_gone(jobv, seen, heard, now, r.v, r.s):
        return SS.WAITING_GONE.value
    if action == A_RESEND_RESULT or action == A_ANSWER_LATE:
        _write_resent(jobv, st, bufs, replies, reply_meta, k, rank, r)
        cnt[SC.RESULTS_RESENT if action == A_RESEND_RESULT else SC.LATE_ANSWERED] += 1
    else:
        _write_waiting(jobv, seen, replies, reply_meta, k, rank, r)
        cnt[SC.WAITING_SENT] += 1
        cnt[SC.DUPLICATE] += 1
    return SS.DONE.value


# Over 60 lines on purpose: the per-packet rule in one piece, read line by line against
# csrc/switch.c's switch_requests (the compiled copy it is the reference for); cut up,
# the two would no longer line up.
def switch_requests(d, starts, lens, srcs, nseg, start, now, jobv, st, seen, conflict, bufs,
                    clog, cursor, mkeys, heard, rules, cnt, done, replies, reply_meta):
    """Aggregate the REQUESTs of one job in a batch of datagrams, from datagram ``start`` on.

    ``d``: the received bytes (uint8); datagram ``i`` is ``d[starts[i] : starts[i] + lens[i]]``
    and came from the sender ``srcs[i]`` (a number per address). The kernel takes every
    datagram that is a REQUEST of this job from a member whose address Python checked for that
    sender number (``mkeys[rank] == srcs[i]``), whichever rank it is, and stops at the first
    other one. ``heard[rank] = now`` for each. ``rules``: ``slots.action_table()``. ``done``
    receives ``(set, slot, length)`` of every round completed here: the result datagram is
    ``bufs[set, slot, :length]``. The answers to one rank (NACKs, RESENT results, WAITING) go
    into ``replies``: reply ``k`` is ``replies[k, :reply_meta[k, 1]]``, for rank
    ``reply_meta[k, 0]``; a row holds ``reply_row_bytes`` of the job.

    Returns ``(next, ndone, nreply, code)``: the segment to go on from, completions and
    replies written, and why it stopped (``SS.DONE`` when ``next`` is past the end; else the
    Python side handles segment ``next`` (``SS.CONFLICT_ADDED``: segment ``next - 1``;
    ``SS.REPLIES_FULL``: nothing) and calls again)."""
    ndone = 0
    nnack = 0
    i = start
    while i < nseg:
        o, ln = starts[i], lens[i]
        if not _member_request(d, o, ln, srcs[i], jobv, mkeys):
            return i, ndone, nnack, SS.OTHER.value
        r = _parse(d, o, jobv[J.SLOT_BASE])
        if _before_epoch(jobv, r.seq):
            return i, ndone, nnack, SS.OTHER.value  # from before a restart: Python tells it
        rank = u16(d, o + H_RANK)
        heard[rank] = now
        if _outside(jobv, r, cnt):
            i += 1
            continue
        action = _action(jobv, st, seen, rules, r, rank)
        if (action == A_ANSWER_LATE or action == A_ANSWER_OLD) and not r.flags & F_RETRY:
            # A first transmission: the round's multicast reaches this rank anyway.
            action = A_DROP_LATE if action == A_ANSWER_LATE else A_DROP_STALE
        if action == A_ANSWER_OLD:
            row = _find_old(jobv, bufs, r)
            if row < 0:  # gone from the history too: Python answers GONE
                return i, ndone, nnack, SS.ROUND_GONE.value
            else:
                _write_old(jobv, bufs, replies, reply_meta, nnack, rank, r, row)
                cnt[SC.OLD_ANSWERED] += 1
                nnack += 1
                i += 1
                if nnack == reply_meta.shape[0]:
                    return i, ndone, nnack, SS.REPLIES_FULL.value
                continue
        if action == A_DROP_STALE or action == A_DROP_LATE:
            cnt[SC.STALE if action == A_DROP_STALE else SC.LATE_DUPLICATE] += 1
            i += 1
            continue
        if action == A_RESEND_RESULT or action == A_ANSWER_WAITING or action == A_ANSWER_LATE:
            stop = _answer_resend(jobv, st, seen, conflict, bufs, heard, now, replies,
                                  reply_meta, nnack, rank, r, action, cnt)
            if stop != SS.DONE.value:
                return i, ndone, nnack, stop
            nnack += 1
            i += 1
            if nnack == reply_meta.shape[0]:
                return i, ndone, nnack, SS.REPLIES_FULL.value
            continue
        if action == A_REFUSE_MISMATCH:
            return i, ndone, nnack, SS.MISMATCH.value
        pay = d[o + HDR:o + HDR + r.count * r.itemsize]
        conflicted = False
        if action == A_START_ROUND:
            _start_round(jobv, st, seen, conflict, bufs, jobv[J.QUORUM] if jobv[J.QUORUM] > 0
                         else jobv[J.N], r, rank, pay, now, cnt)
        else:
            conflicted = _add(st, seen, conflict, bufs, r, rank, pay)
        clear_bit(seen, 1 - r.v, r.s, rank)  # frees the rank from the slot's other set
        if _behind_on(jobv, st, seen, clog, cursor, rank, r):
            _write_nack(jobv, replies, reply_meta, nnack, rank, r.seq)
            cnt[SC.NACKS] += 1
            nnack += 1
        if st[S.MISSING, r.v, r.s] == 0:
            _complete(jobv, st, seen, bufs, clog, r, rank, done, ndone, cnt)
            ndone += 1
        i += 1
        if conflicted:
            return i, ndone, nnack, SS.CONFLICT_ADDED.value
        if nnack == reply_meta.shape[0]:
            return i, ndone, nnack, SS.REPLIES_FULL.value
    return i, ndone, nnack, SS.DONE.value


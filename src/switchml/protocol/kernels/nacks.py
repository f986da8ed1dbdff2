"""Switch-driven loss recovery, the reference rules (``csrc/switch.c`` is the production
implementation; ``tests/protocol/test_switch_kernels.py`` runs both): the completion log, in
the order results reach the ranks (``log_releases``), and the NACK a rank gets when a chunk of
its own that a completed round released has not arrived although later ones have
(``_behind_on``), with the gap that widens when NACKs turn out needless (reordering, not
loss) and halves back when they stop (docs/protocol.md section 3).
"""

from __future__ import annotations

from switchml.protocol.kernels.bitmaps import has_bit
from switchml.protocol.kernels.frames import (
    E_BYTES,
    EXP_ZERO,
    F_HAS_EXP,
    HALF,
    HDR,
    MASK32,
    T_NACK,
    write_header,
)
from switchml.protocol.kernels.layout import SC, J, S

__all__ = ["log_releases"]


def log_releases(jobv, st, clog, sendq, nsend):
    """A relay multicast the results of rounds ``sendq[:nsend]`` (rows ``(set, slot, ...)``)
    of a job with ``LOG_AT_RELEASE``: log them now, in the order the children get them.
    The NACK rule assumes the log's order is the order results reach the ranks, which for a
    rack switch is the parent's order, not the order its own rounds completed in."""
    for q in range(nsend):
        v, s = sendq[q, 0], sendq[q, 1]
        _log_release(jobv, st, clog, v, s, st[S.SEQ, v, s], st[S.CHUNK, v, s])


def _log_release(jobv, st, clog, v, s, seq, chunk):
    """Stamp a round's results going out (``S.DONE_AT``) and log it for NACKs."""
    stamp = jobv[J.COMPLETIONS] + 1
    jobv[J.COMPLETIONS] = stamp
    st[S.DONE_AT, v, s] = stamp
    if (jobv[J.NACK_GAP] > jobv[J.NACK_BASE_GAP]
            and stamp - jobv[J.NACK_CALM_FROM] >= jobv[J.NACK_CALM]):
        # No needless NACK for NACK_CALM completions: the network stopped reordering (or
        # never did: a widening can also come from a race), so the widened gap halves back.
        # Counted in completions, not in needed NACKs: a gap widened far enough sends none.
        jobv[J.NACK_GAP] = max(jobv[J.NACK_BASE_GAP], jobv[J.NACK_GAP] // 2)
        jobv[J.NACK_CALM_FROM] = stamp
    e = stamp % clog.shape[0]
    clog[e, 0], clog[e, 1], clog[e, 2] = seq, chunk, s
    # Whether the round releases a chunk: float chunks carry the look-ahead exponent exactly
    # when a chunk follows on the lane (chunk < L, so chunk + E < T = L + E); an operation is
    # float once a round with an exponent completed; integer chunks do not say.
    if st[S.FLAGS, v, s] & F_HAS_EXP:
        jobv[J.FLOAT_SEQ] = seq
        clog[e, 3] = 1
    else:
        clog[e, 3] = 0 if jobv[J.FLOAT_SEQ] == seq else 2


def _find_round(st, sp, seq, chunk):
    """The set of relative slot ``sp`` that holds round ``(seq, chunk)``, or -1."""
    for u in range(2):
        if st[S.SEQ, u, sp] == seq and st[S.CHUNK, u, sp] == chunk:
            return u
    return -1


def _lacks(jobv, st, seen, rank, seq, p, sp):
    """Whether ``rank`` has not delivered chunk ``p`` of operation ``seq`` (relative slot
    ``sp``): the lane neither holds round ``p`` with the rank in it (or, in a quorum job,
    complete without it: the rank was late and gets the result) nor has moved past it."""
    for u in range(2):
        cur = st[S.SEQ, u, sp]
        if cur < 0:
            continue
        if cur == seq:
            c = st[S.CHUNK, u, sp]
            if c > p or (c == p and (has_bit(seen, u, sp, rank)
                                     or (jobv[J.QUORUM] > 0 and st[S.MISSING, u, sp] == 0))):
                return False
        elif ((cur - seq) & MASK32) < HALF:
            return False  # a later operation already uses the slot
    return True


def _nack(jobv, chunk, slot):
    jobv[J.NACK_CHUNK] = chunk
    jobv[J.NACK_SLOT] = slot
    return True


def _behind_in_first_window(jobv, st, seen, rank, seq, chunk, s, E):
    """The first window (chunks ``0 .. E-1``) goes out at once in chunk order, so chunk
    ``chunk - NACK_GAP * SHARDS`` (a lane of this shard) should have arrived before it."""
    stride = jobv[J.SHARDS]  # this shard has the lanes congruent to chunk mod stride
    p = chunk - jobv[J.NACK_GAP] * stride
    if p >= 0 and (E == 0 or p < E) and p != s and p % stride == s % stride:
        if _lacks(jobv, st, seen, rank, seq, p, p):
            return _nack(jobv, p, p)
    return False


def _behind_on(jobv, st, seen, clog, cursor, rank, r):
    """Switch-driven loss recovery: chunk ``r.chunk`` of ``rank`` was just added; find a
    chunk of the same operation the rank should have delivered before it and has not.
    Writes it to ``jobv[NACK_CHUNK]``/``[NACK_SLOT]`` and returns True, or False.

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

    Lanes: chunk ``c`` goes to slot ``c mod E`` (E <= window lanes), and ``chunk - s`` is a
    multiple of E, which gives E once the chunk is past the first window."""
    gap = jobv[J.NACK_GAP]
    if gap <= 0:
        return False
    seq, chunk, s = r.seq, r.chunk, r.s
    window = jobv[J.WINDOW]
    d = chunk - s
    E = window if d >= window else d  # 0: this chunk is in the first window, E unknown
    if _behind_in_first_window(jobv, st, seen, rank, seq, chunk, s, E):
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
    while c < limit and not found:
        e = (c + 1) % size
        if clog[e, 0] == seq and clog[e, 3] != 0:
            released = clog[e, 1] + E  # the chunk that completion released
            if clog[e, 3] == 2 and released >= chunk:
                break  # integers: it may be past the end; judge it when a later chunk comes
            if _lacks(jobv, st, seen, rank, seq, released, clog[e, 2]):
                found = _nack(jobv, released, clog[e, 2])
        c += 1
    cursor[rank] = c
    return found


def _write_nack(jobv, replies, reply_meta, k, rank, seq):
    """Reply ``k``: a NACK, telling ``rank`` the chunk ``_behind_on`` found (header only)."""
    write_header(replies[k], 0, T_NACK, 0, 0, rank, jobv[J.JOB], jobv[J.TOKEN], seq,
                 jobv[J.NACK_CHUNK], jobv[J.SLOT_BASE] + jobv[J.NACK_SLOT], 0, E_BYTES, 0,
                 EXP_ZERO, EXP_ZERO)
    reply_meta[k, 0], reply_meta[k, 1] = rank, HDR


def _nack_was_needless(jobv, cnt):
    """A re-send answering a NACK found its chunk already in: the chunk had been reordered,
    not lost. Widen the job's gap (as RACK widens its reorder window), so a network that
    reorders costs a few needless re-sends, not one per datagram. At most once per window of
    completions: the NACKs of one reordering episode, sent before the gap widened, come back
    needless together and must count once. It halves back after ``NACK_CALM`` completions
    without one (``_log_release``)."""
    cnt[SC.NACKS_NEEDLESS] += 1
    now = jobv[J.COMPLETIONS]
    jobv[J.NACK_CALM_FROM] = now
    gap = jobv[J.NACK_GAP]
    if gap > 0 and now - jobv[J.NACK_WIDENED_AT] >= jobv[J.WINDOW]:
        jobv[J.NACK_GAP] = max(jobv[J.NACK_BASE_GAP], min(2 * gap, jobv[J.NACK_CAP]))
        jobv[J.NACK_WIDENED_AT] = now

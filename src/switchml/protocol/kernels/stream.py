"""The worker's per-datagram rules in plain Python: the reference the compiled data plane
(``src/switchml/csrc/worker.c``, the one production implementation, imported as
``switchml._worker``) is tested against, rule for rule, on crafted and random batches
(``tests/protocol/test_worker_kernels.py``). Build (and rebuild) requests into the lanes'
transmit buffers, take results (dequantize into the output, time the round trip, release the
lane's next chunk).

``worker.py`` explains the protocol; ``operation.py`` builds the arrays (``opv`` fields OP,
``lane``/``lanef`` fields LN/LF), ``recovery.py`` the round-trip state (``rtt``, fields R).
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.kernels.frames import (
    DATA_TAG,
    E_INT16,
    E_INT32,
    EXP_ZERO,
    F_AUTH,
    F_CONTRIBUTORS,
    F_HAS_DATA,
    F_HAS_EXP,
    F_NONFINITE,
    F_RESENT,
    F_RETRY,
    H_CHUNK,
    H_COUNT,
    H_ELEM,
    H_EXP_DATA,
    H_EXP_NEXT,
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
    RESULT_FLAGS,
    T_NACK,
    T_REQUEST,
    T_RESULT,
    VERSION,
    i16,
    i64,
    u16,
    u32,
    write_header,
)
from switchml.protocol.kernels.layout import (  # noqa: F401  (re-exported)
    LF,
    LN,
    LN_FIELDS,
    LNF_FIELDS,
    O_FIELDS,
    OP,
    QUORUM_AHEAD,
    R_FIELDS,
    WC,
    WS,
    R,
)
from switchml.protocol.kernels.numerics import (
    dequantize_into,
    exponent_of_bits,
    quantize_clamped,
    quantize_into,
    residual_into,
)


def lane_row(i, opv):
    """Where lane ``i``'s datagram starts in the transmit buffer: each lane has a row of one
    full datagram (header, ``K`` elements and, for an authenticated job, its MAC)."""
    return i * (HDR + opv[OP.K] * opv[OP.ITEMSIZE] + (DATA_TAG if opv[OP.AUTH] else 0))


def keep_block(x, lo, count, keep):
    """An in-place operation's input block ``x[lo:lo+count]`` into ``keep`` (None: not in
    place), as the block is sent: its result overwrites it in ``x``, and a restart after the
    switch lost the job needs the input (``Operation.restarted`` rebuilds it)."""
    if keep is not None:
        keep[lo:lo + count] = x[lo:lo + count]


def build_request(p, i, set_bit, opv, lane, exps, nonf, x, xbits, res, tx8, tx16, tx32, cnt,
                  residual, keep=None):
    """Write packet ``p`` (lane ``i``) into the lane's row of the transmit buffer (``tx8``,
    and the same memory as int16 and int32: ``tx16``, ``tx32``) from the input; return its
    length.

    Float: the exponent of block ``p`` (p < L) and the data of block ``p - E`` (p >= E), scaled
    with the lane's agreed exponent. Integers: block ``p``. A retransmission is rebuilt the same
    way, never replayed from stored bytes; ``residual``: record this rank's rounding error.
    No array is sliced (``numerics.py`` says why): offsets index the whole buffers."""
    L = opv[OP.L]
    E = opv[OP.E]
    k = opv[OP.K]
    itemsize = opv[OP.ITEMSIZE]
    base = lane_row(i, opv)
    flags = 0
    exp_data = EXP_ZERO
    exp_next = EXP_ZERO
    count = 0
    if opv[OP.IS_FLOAT]:
        if p < L:
            # The block's exponent, when its first packet is built (not for the whole tensor
            # up front: 64 MiB held a rank ~30 ms, and ranks timed each other out).
            exponent_of_bits(xbits, x, p * k, min(p * k + k, x.size), p, exps, nonf)
            exp_next = exps[p]
            flags |= F_HAS_EXP
        if p >= E:
            blk = p - E
            lo = blk * k
            count = min(lo + k, x.size) - lo
            exp_data = lane[LN.EMAX, i]
            bad = nonf[blk] != 0
            keep_block(x, lo, count, keep)
            # A quorum round that completed without this rank agreed an exponent without its
            # own: the block goes clamped to the agreed scale (never without a quorum).
            tx = tx32 if itemsize == 4 else tx16
            qo = (base + HDR) // itemsize
            if exps[blk] != EXP_ZERO and exps[blk] > exp_data:
                quantize_clamped(x, lo, count, exp_data, opv[OP.P], tx, qo)
                cnt[WC.CLAMPED] += 1
            else:
                quantize_into(x, lo, count, exp_data, opv[OP.P], bad, tx, qo)
            if residual:
                residual_into(x, lo, count, tx, qo, exp_data, opv[OP.P], res)
            flags |= F_HAS_DATA | (F_NONFINITE if bad else 0)
    else:
        lo = p * k
        count = min(lo + k, x.size) - lo
        qo = (base + HDR) // 4
        keep_block(x, lo, count, keep)
        for j in range(count):
            tx32[np.uint64(qo + j)] = np.int32(x[np.uint64(lo + j)])
        flags |= F_HAS_DATA
    write_header(tx8, base, T_REQUEST, flags, set_bit, opv[OP.RANK], opv[OP.JOB], opv[OP.TOKEN],
                 opv[OP.SEQ], p, lane[LN.SLOT, i], count, opv[OP.ELEM], opv[OP.DIGEST],
                 exp_data, exp_next)
    cnt[WC.PACKETS_SENT] += 1
    return HDR + count * itemsize


def send_chunk(p, retransmit, fast, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits,
               res, tx8, tx16, tx32, cnt, sendlen, keep=None):
    """Start (or re-send) packet ``p`` on its lane: lane bookkeeping, build, deadline.

    ``fast``: a RACK re-send: it does not back the lane's timeout off (TRIES counts timeouts
    only). The datagram is the first ``sendlen[i]`` bytes of lane ``i``'s row (``i = p mod
    E``); returns the lane. The caller queues it (:func:`queue_lane`)."""
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
        if p + opv[OP.E] >= opv[OP.T]:  # the lane's last chunk: a tail-loss probe candidate
            if opv[OP.TAIL_END] == 0:  # the operation's last window: idle probes from the
                rtt[R.PROBED_AT] = rtt[R.LAST_PROGRESS]  # next result on (probe_time)
            lane[LN.TAIL_ORDER, opv[OP.TAIL_END]] = i
            opv[OP.TAIL_END] += 1
    n = build_request(p, i, set_bit, opv, lane, exps, nonf, x, xbits, res, tx8, tx16, tx32, cnt,
                      res.size > 0 and not retransmit, keep)
    sendlen[i] = n
    if retransmit and opv[OP.TRAILER]:  # a quorum job's round may be complete: answer it
        tx8[lane_row(i, opv) + H_FLAGS] |= F_RETRY
    if retransmit:
        cnt[WC.PAYLOAD_RESENT] += n - HDR
    else:
        cnt[WC.PAYLOAD_BYTES] += n - HDR
    rto = min(rtt[R.RTO] * (2.0 ** lane[LN.TRIES, i]), rtt[R.MAX_RTO])
    lanef[LF.DEADLINE, i] = now + rto
    lanef[LF.XMIT_AT, i] = now
    return i


def resend_chunk(p, fast, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res, tx8,
                 tx16, tx32, cnt, sendlen, keep=None):
    """:func:`send_chunk` for a re-send (timeouts, probes, NACKs): rare, so compiled once and
    called, where the first transmission's path has it inlined (each inlined copy of the
    request builder costs seconds of compilation per element type)."""
    return send_chunk(p, True, fast, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits,
                      res, tx8, tx16, tx32, cnt, sendlen, keep)


def queue_lane(i, opv, sendq):
    """Queue lane ``i``'s datagram to send; False if the queue is full (nothing queued)."""
    q = opv[OP.NQ]
    if q >= sendq.size:
        return False
    sendq[q] = i
    opv[OP.NQ] = q + 1
    return True


def _update_rtt(rtt, sample):
    """RFC 6298: srtt/rttvar smoothing; rto = srtt + 4 rttvar, at least RTO_SRTTS x srtt,
    clamped."""
    if rtt[R.MIN_RTT] < 0 or sample < rtt[R.MIN_RTT]:
        rtt[R.MIN_RTT] = sample
    if rtt[R.SRTT] < 0:
        rtt[R.SRTT] = sample
        rtt[R.RTTVAR] = sample / 2
    else:
        rtt[R.RTTVAR] = 0.75 * rtt[R.RTTVAR] + 0.25 * abs(rtt[R.SRTT] - sample)
        rtt[R.SRTT] = 0.875 * rtt[R.SRTT] + 0.125 * sample
    rto = max(rtt[R.SRTT] + 4 * rtt[R.RTTVAR], rtt[R.RTO_SRTTS] * rtt[R.SRTT])
    rtt[R.RTO] = min(max(rto, rtt[R.MIN_RTO]), rtt[R.MAX_RTO])


def _result_length(d, o, ln, opv):
    """The item size of the RESULT of this job at ``d[o:o+ln]``, or 0 if it is not one. A
    quorum job's results (``OP.TRAILER`` > 0) end in their contributor bitmap; others never
    carry one."""
    if (ln < HDR or u16(d, o + H_MAGIC) != MAGIC or d[o + H_VERSION] != VERSION
            or d[o + H_TYPE] != T_RESULT):
        return 0
    trailer = opv[OP.TRAILER]
    flags = np.int64(d[o + H_FLAGS])
    auth = F_AUTH if opv[OP.AUTH] else 0  # an authenticated job's: always sealed
    if (d[o + H_SET] > 1 or (flags & ~((RESULT_FLAGS if trailer else KNOWN_FLAGS) | auth)) != 0
            or (trailer and not flags & F_CONTRIBUTORS) or (flags & F_AUTH) != auth):
        return 0
    elem = np.int64(d[o + H_ELEM])
    if elem == E_INT32:
        isz = 4
    elif elem == E_INT16:
        isz = 2
    else:
        return 0
    if ln != HDR + isz * u16(d, o + H_COUNT) + trailer + (DATA_TAG if auth else 0):
        return 0
    if u32(d, o + H_JOB) != opv[OP.JOB] or i64(d, o + H_TOKEN) != opv[OP.TOKEN]:
        return 0
    return isz


def _ahead(d, o, opv, lane):
    """Whether the RESULT at ``d[o:]`` is ahead of this quorum job's rank: of a later
    operation (up to ``QUORUM_AHEAD``), or of this one for a chunk its lane has not reached.
    A rank that fell behind gets the others' results before it needs them, and Python keeps
    them for then (``worker.py``)."""
    ahead = (u32(d, o + H_SEQ) - opv[OP.SEQ]) & 0xFFFFFFFF
    if ahead:
        return ahead <= QUORUM_AHEAD
    p = u32(d, o + H_CHUNK)
    c = lane[LN.CHUNK, p % opv[OP.E]]
    return p < opv[OP.T] and 0 <= c < p


def _note_contributors(d, o, ln, p, opv, cnt, contrib):
    """A quorum result's contributor bitmap (the last ``OP.TRAILER`` bytes of ``d[o:o+ln]``,
    for chunk ``p``): how many ranks the block's sum holds, into ``contrib``; whether this
    rank is one (else counted ``LEFT_OUT``)."""
    tb = opv[OP.TRAILER]
    rank = opv[OP.RANK]
    t = o + ln - tb
    n = 0
    for b in range(tb):
        n += int(d[t + b]).bit_count()
    if not (d[t + (rank >> 3)] >> (rank & 7)) & 1:
        cnt[WC.LEFT_OUT] += 1
    blk = p - opv[OP.E] if opv[OP.IS_FLOAT] else p
    if blk >= 0 and contrib is not None:
        contrib[blk] = n


def _is_nack(d, o, ln, opv):
    """Whether ``d[o:o+ln]`` is a NACK of the operation in flight, as the switch sends them
    (header only, no flags, this job's token and sequence number). Anything else that claims to
    be one goes to Python's full header check (``wire.unpack_header``)."""
    return (ln == HDR and u16(d, o + H_MAGIC) == MAGIC and d[o + H_VERSION] == VERSION
            and d[o + H_TYPE] == T_NACK and d[o + H_FLAGS] == 0 and d[o + H_SET] <= 1
            and u16(d, o + H_COUNT) == 0 and d[o + H_ELEM] <= E_INT16
            and u32(d, o + H_JOB) == opv[OP.JOB] and i64(d, o + H_TOKEN) == opv[OP.TOKEN]
            and u32(d, o + H_SEQ) == opv[OP.SEQ] and opv[OP.PY_NACKS] == 0)


def take_nack(chunk, slot, now, opv, lane, lanef, rtt, cnt):
    """The switch lacks ``chunk`` (on ``slot``) of this operation although later chunks of
    this rank arrived: the chunk to re-send now on its lane (the chunk itself, or the one
    before it, whose lost result releases it: the switch answers that from its round or
    shadow copy), or -1. -1 when the NACK names no lane of ours (counted ``BAD_SLOT``), when
    the lane moved past the chunk meanwhile, or re-sent its chunk less than the smallest
    round trip ago (its answer may be on the way; counted ``NACKS_IGNORED``). A first
    transmission, however recent, is re-sent: the switch NACKs a chunk only once a chunk sent
    after it arrived, so on a path that keeps order it was lost. The caller re-sends it as a
    fast re-send (no timeout backoff) and calls :func:`mark_nack_resend`."""
    rtt[R.LAST_HEARD] = now
    i = chunk % opv[OP.E]
    if chunk >= opv[OP.T] or slot != lane[LN.SLOT, i]:
        cnt[WC.BAD_SLOT] += 1
        return -1
    p = lane[LN.CHUNK, i]
    if p < 0 or p > chunk or (lane[LN.XMITS, i] > 0
                              and now - lanef[LF.XMIT_AT, i] < rtt[R.MIN_RTT]):
        cnt[WC.NACKS_IGNORED] += 1
        return -1
    cnt[WC.NACK_RESENDS] += 1
    return p


def mark_nack_resend(i, p, chunk, opv, lane, tx8):
    """Lane ``i`` re-sent ``p`` for a NACK of ``chunk``. The switch thinks that request was
    lost: the chunk's first re-send carries ``RESENT``, so that the switch can tell when it
    was only late (reordered) and widen its NACK gap. Only the first: after a timeout's or a
    probe's re-send, finding the chunk in shows that copy got there first, not that the
    network reorders (marking it would widen the gap whenever timeouts race NACKs, and turn
    NACKs off for good)."""
    if p == chunk and lane[LN.XMITS, i] == 1:
        tx8[lane_row(i, opv) + H_FLAGS] |= F_RESENT


def _lane_of(d, o, opv, lane, cnt):
    """The lane whose chunk this result answers, or -1 (a stale, repeated or foreign result,
    counted)."""
    p = u32(d, o + H_CHUNK)
    if u32(d, o + H_SEQ) != opv[OP.SEQ]:
        cnt[WC.STALE_RESULT] += 1
        return -1
    i = p % opv[OP.E]
    if p >= opv[OP.T] or lane[LN.CHUNK, i] != p:
        cnt[WC.DUPLICATE_RESULT] += 1
        return -1
    if u32(d, o + H_SLOT) != lane[LN.SLOT, i] or np.int64(d[o + H_SET]) != lane[LN.SET, i]:
        cnt[WC.BAD_SLOT] += 1
        return -1
    count = u16(d, o + H_COUNT)
    if count and np.int64(d[o + H_ELEM]) != opv[OP.ELEM]:
        cnt[WC.BAD_COUNT] += 1
        return -1
    return i


def _store_float(d, d16, d32, o, isz, p, i, opv, lane, rtt, out, scratch):
    """Dequantize a float result's data (of block ``p - E``) into ``out``; take its look-ahead
    exponent for the lane. False if its size is wrong. ``scratch``: an aligned buffer of a
    datagram's size, for a payload at an odd offset."""
    E, k = opv[OP.E], opv[OP.K]
    count = u16(d, o + H_COUNT)
    if p >= E:
        lo = (p - E) * k
        if count != min(lo + k, out.size) - lo:
            return False
        exp_data = i16(d, o + H_EXP_DATA)
        nonfinite = (np.int64(d[o + H_FLAGS]) & F_NONFINITE) != 0
        edge = exp_data >= opv[OP.EDGE_EXP]
        po = o + HDR
        if isz == 4 and po % 4 == 0:
            dequantize_into(d32, po // 4, exp_data, opv[OP.P], nonfinite, out, lo, count,
                            opv[OP.N], edge, rtt[R.FMAX])
        elif isz == 2 and po % 2 == 0:
            dequantize_into(d16, po // 2, exp_data, opv[OP.P], nonfinite, out, lo, count,
                            opv[OP.N], edge, rtt[R.FMAX])
        else:  # a payload at an odd offset (an in-memory batch of mixed sizes): aligned first
            _store_unaligned(d, po, isz, count, exp_data, nonfinite, edge, lo, opv, rtt, out,
                             scratch)
    elif count:
        return False
    if p < opv[OP.L]:
        lane[LN.EMAX, i] = i16(d, o + H_EXP_NEXT)
    return True


def _store_unaligned(d, po, isz, count, exp_data, nonfinite, edge, lo, opv, rtt, out, scratch):
    """:func:`_store_float` for a payload at an odd offset (rare: an in-memory batch of mixed
    sizes): copied into the aligned ``scratch`` first. Called, not inlined."""
    for j in range(count * isz):
        scratch[j] = d[po + j]
    if isz == 4:
        dequantize_into(scratch.view(np.int32), 0, exp_data, opv[OP.P], nonfinite, out, lo,
                        count, opv[OP.N], edge, rtt[R.FMAX])
    else:
        dequantize_into(scratch.view(np.int16), 0, exp_data, opv[OP.P], nonfinite, out, lo,
                        count, opv[OP.N], edge, rtt[R.FMAX])


def _store_int(d, d32, o, p, opv, out):
    """Copy an integer result (block ``p``) into ``out``. False if its size is wrong."""
    lo = p * opv[OP.K]
    count = u16(d, o + H_COUNT)
    if count != min(lo + opv[OP.K], out.size) - lo:
        return False
    po = o + HDR
    if po % 4 == 0:
        for j in range(count):
            out[np.uint64(lo + j)] = d32[np.uint64(po // 4 + j)]
    else:  # an odd offset (an in-memory batch of mixed sizes)
        ob = out.view(np.uint8)
        for j in range(4 * count):
            ob[np.uint64(4 * lo + j)] = d[po + j]
    return True


def _time_round_trip(i, now, lane, lanef, rtt, cnt):
    """Karn's rule: an RTT sample only from a chunk sent once. Records which transmission the
    result answers (RACK); a result too soon to answer a re-send answers the first one, and
    a RACK re-send it answers was needless: the reorder window widens."""
    delivered = lanef[LF.XMIT_AT, i]
    if lane[LN.XMITS, i] == 0:
        first = rtt[R.SRTT] < 0
        _update_rtt(rtt, now - lanef[LF.SENT_AT, i])
        if first:
            _rearm(lane, lanef, rtt)
    elif rtt[R.MIN_RTT] >= 0 and now - delivered < rtt[R.MIN_RTT]:
        # Too soon to answer the re-send: it answers an earlier transmission (RFC 8985 6.2
        # step 2), so only that one's time says which chunks were sent before it.
        delivered = lanef[LF.SENT_AT, i]
        if lane[LN.FAST, i]:
            lane[LN.FAST, i] = 0
            cnt[WC.SPURIOUS] += 1
            rtt[R.REO_SCALE] = min(rtt[R.REO_SCALE] * 2, rtt[R.MAX_REO_SCALE])
    rtt[R.DELIVERED_XMIT] = delivered
    rtt[R.LAST_PROGRESS] = now
    rtt[R.LAST_HEARD] = now


def _rearm(lane, lanef, rtt):
    """The first round trip measured: the deadlines of chunks sent under the initial timeout
    (``initial_rto_s``, 0.2 s, before anything was measured) come down to the measured one,
    as TCP re-arms its timer with each new estimate (RFC 6298 5.3). Otherwise a loss in the
    first window that no NACK reaches (the NACK lost too) waits 0.2 s at the end of a first
    operation that takes a tenth of that."""
    for j in range(lane.shape[1]):
        if lane[LN.CHUNK, j] >= 0:
            due = lanef[LF.XMIT_AT, j] + min(rtt[R.RTO] * (2.0 ** lane[LN.TRIES, j]),
                                             rtt[R.MAX_RTO])
            if due < lanef[LF.DEADLINE, j]:
                lanef[LF.DEADLINE, j] = due


def _probe_tail(opv, lane, lanef, rtt, now, cnt):
    """Tail-loss probe (RFC 8985 section 7): a lane's last chunk has no later chunk on its lane
    to show the switch it is missing (NACKs). Every rank releases chunks in the order the
    switch multicasts results, and datagrams travel one path in order; so when the result of a
    chunk sent *after* a last chunk arrives first, that last chunk (or its result) was lost:
    probe it after a reorder window (a quarter of the smallest round trip, at least
    ``min_reorder_window_s``: a network that reorders a little gets time to deliver it), if
    it is at least a round trip old. Ranks that merely run late do not trigger it (their
    chunk is missing from both rounds). Last chunks queue in sending order
    (``LN.TAIL_ORDER``), so each is looked at once."""
    h, e, t = opv[OP.TAIL_HEAD], opv[OP.TAIL_END], rtt[R.DELIVERED_XMIT]
    window = max(rtt[R.MIN_RTT] / 4, rtt[R.MIN_REO_WINDOW])
    while h < e:
        j = lane[LN.TAIL_ORDER, h]
        if lane[LN.CHUNK, j] >= 0:
            sent = lanef[LF.XMIT_AT, j]
            if sent >= t or now - sent < rtt[R.MIN_RTT]:
                break
            if now + window < lanef[LF.DEADLINE, j]:
                lanef[LF.DEADLINE, j] = now + window
                cnt[WC.TAIL_PROBES] += 1
        h += 1
    opv[OP.TAIL_HEAD] = h


# Over 60 lines on purpose: the per-packet rule in one piece, read line by line against
# csrc/worker.c's worker_results (the compiled copy it is the reference for); cut up,
# the two would no longer line up.
def worker_results(d, starts, lens, nseg, start, limit, now, opv, lane, lanef, rtt, next_set,
                   exps, nonf, x, xbits, out, res, tx8, tx16, tx32, cnt, sendq, sendlen,
                   scratch, keep=None, contrib=None):
    """Take the RESULTs of a batch (datagram ``i`` is ``d[starts[i] : starts[i] + lens[i]]``)
    from datagram ``start`` on: dequantize into ``out``, time the round trip, and build the
    packet each result releases on its lane, queued in ``sendq`` (:func:`queue_lane`).

    Returns ``(next, code)``: ``code`` says why it stopped (``WS``). ``limit``: stop after
    this many results taken (RACK looks for losses after each). Compiled without reference
    counting (``NO_RC``): it allocates nothing, and its views live within the call."""
    taken = 0
    i = start
    n4 = d.size // 4 * 4  # the batch as int16 and int32 (payloads are read in place)
    d16 = d[:n4].view(np.int16)
    d32 = d[:n4].view(np.int32)
    while i < nseg:
        if opv[OP.NQ] >= sendq.size:
            return i, WS.FULL.value
        o = starts[i]
        isz = _result_length(d, o, lens[i], opv)
        if isz == 0:
            if not _is_nack(d, o, lens[i], opv):
                return i, WS.OTHER.value
            i += 1  # a NACK of this operation: answered here, without leaving the loop
            chunk = u32(d, o + H_CHUNK)
            p = take_nack(chunk, u32(d, o + H_SLOT), now, opv, lane, lanef, rtt, cnt)
            if p >= 0:
                ln_i = resend_chunk(p, True, now, opv, lane, lanef, rtt, next_set, exps, nonf,
                                    x, xbits, res, tx8, tx16, tx32, cnt, sendlen, keep)
                mark_nack_resend(ln_i, p, chunk, opv, lane, tx8)
                queue_lane(ln_i, opv, sendq)
            continue
        if opv[OP.TRAILER] and _ahead(d, o, opv, lane):
            return i, WS.OTHER.value
        i += 1
        ln_i = _lane_of(d, o, opv, lane, cnt)
        if ln_i < 0:
            continue
        p = lane[LN.CHUNK, ln_i]
        stored = (_store_float(d, d16, d32, o, isz, p, ln_i, opv, lane, rtt, out, scratch)
                  if opv[OP.IS_FLOAT] else _store_int(d, d32, o, p, opv, out))
        if not stored:
            cnt[WC.BAD_COUNT] += 1
            continue
        if opv[OP.TRAILER]:
            _note_contributors(d, o, lens[i - 1], p, opv, cnt, contrib)
        cnt[WC.RESULTS] += 1
        _time_round_trip(ln_i, now, lane, lanef, rtt, cnt)
        if opv[OP.TAIL_END] > opv[OP.TAIL_HEAD]:
            _probe_tail(opv, lane, lanef, rtt, now, cnt)
        opv[OP.DONE] += 1
        nxt = p + opv[OP.E]
        if nxt < opv[OP.T]:
            send_chunk(nxt, False, False, now, opv, lane, lanef, rtt, next_set, exps, nonf, x,
                       xbits, res, tx8, tx16, tx32, cnt, sendlen, keep)
            queue_lane(ln_i, opv, sendq)
        else:
            lane[LN.CHUNK, ln_i] = -1
        if opv[OP.DONE] == opv[OP.T]:
            return i, WS.OP_COMPLETE.value
        taken += 1
        if taken >= limit:
            return i, WS.ONE.value
    return i, WS.DONE.value


def send_first(count, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res, tx8, tx16,
               tx32, cnt, sendq, sendlen, keep=None):
    """Start packets ``0 .. count-1`` (the first window) and queue them (the queue is empty
    at an operation's start and holds a window)."""
    for p in range(count):
        send_chunk(p, False, False, now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits,
                   res, tx8, tx16, tx32, cnt, sendlen, keep)
        queue_lane(p, opv, sendq)


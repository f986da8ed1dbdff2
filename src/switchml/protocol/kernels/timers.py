"""The worker's timers in plain Python (the reference of ``src/switchml/csrc/worker.c``'s,
which production runs: ``switchml._worker``): when the idle probe is due, the next deadline, and the
re-sends that the timers call for (timeouts and the idle probe).

``recovery.py`` explains the loss recovery these belong to; ``stream.py`` holds the lanes'
state and ``send_chunk``, which every (re-)send goes through. The Python path
(``WorkerEndpoint.fire_timers``) and the transports' compiled loop (``transport/fastpath.py``)
both call :func:`fire_timers`.
"""

from __future__ import annotations

import numpy as np

from switchml.protocol.kernels.stream import LF, LN, OP, WC, R, queue_lane, resend_chunk

__all__ = ["PROBE_LANES", "fire_timers", "next_deadline", "probe_time"]

from switchml.protocol.kernels.layout import PROBE_LANES


def probe_time(rtt):
    """When the operation's idle probe is due (inf before a round trip was measured).

    The probe timeout (RFC 8985 section 7's PTO) is two smoothed round trips, at least
    ``MIN_REO_WINDOW``: no result for that long while chunks are outstanding means the
    results stopped, not that they are late. Unlike the retransmission timeout it has no
    ``min_rto_s`` floor, which is what makes it worth having at the end of an operation: there
    no later chunk shows the switch a loss (NACKs) and no later result shows the worker one
    (tail probes), so a lost chunk or result would wait for a timeout, tens of round trips,
    while the whole operation waits for it. Each probe without a result since doubles it.
    Armed only in the operation's last window (from the first result after its first lane
    sent its last chunk; ``send_chunk`` sets ``PROBED_AT``): before that, NACKs and later
    results see losses, and a silence says only that a peer stalls or has not started (on a
    busy host, probing then re-sent hundreds of chunks per loss-free operation for nothing)."""
    srtt = rtt[R.SRTT]
    if srtt < 0:
        return np.inf
    pto = max(2.0 * srtt, rtt[R.MIN_REO_WINDOW])
    if rtt[R.LAST_PROGRESS] > rtt[R.PROBED_AT]:
        return rtt[R.LAST_PROGRESS] + pto
    return rtt[R.PROBED_AT] + pto * 2.0 ** rtt[R.PROBES]


def fire_timers(now, opv, lane, lanef, rtt, next_set, exps, nonf, x, xbits, res, tx8, tx16, tx32,
                cnt, sendq, sendlen, picked, keep=None):
    """Re-send what is due at ``now`` and queue it: every busy lane whose deadline passed (a
    timeout: the lane's timeout backs off), then, if the idle probe is due
    (:func:`probe_time`), the ``PROBE_LANES`` busy lanes transmitted longest ago (ties: the
    lower lane), each that went out at least a smoothed round trip ago (a probe: no backoff;
    each probe doubles the wait for the next until a result comes). ``picked``: scratch of
    ``PROBE_LANES`` int64. Returns False, having done nothing, when the send queue lacks room
    for every busy lane: send (or spill) it and call again. The operation's own timeout is the
    caller's."""
    busy = 0
    for i in range(lane.shape[1]):
        if lane[LN.CHUNK, i] >= 0:
            busy += 1
    if opv[OP.NQ] > 0 and opv[OP.NQ] + busy > sendq.size:
        return False
    for i in range(lane.shape[1]):
        if lane[LN.CHUNK, i] >= 0 and lanef[LF.DEADLINE, i] <= now:
            cnt[WC.TIMER_RESENDS] += 1
            resend_chunk(lane[LN.CHUNK, i], False, now, opv, lane, lanef, rtt, next_set,
                         exps, nonf, x, xbits, res, tx8, tx16, tx32, cnt, sendlen, keep)
            queue_lane(i, opv, sendq)
    if now < probe_time(rtt):
        return True
    if rtt[R.LAST_PROGRESS] > rtt[R.PROBED_AT]:
        rtt[R.PROBES] = 0
    rtt[R.PROBED_AT] = now
    rtt[R.PROBES] += 1
    n = 0
    for _ in range(PROBE_LANES):  # the busy lanes transmitted longest ago, oldest first
        best = -1
        for i in range(lane.shape[1]):
            if lane[LN.CHUNK, i] < 0:
                continue
            taken = False
            for m in range(n):
                taken = taken or picked[m] == i
            if not taken and (best < 0 or lanef[LF.XMIT_AT, i] < lanef[LF.XMIT_AT, best]):
                best = i
        if best < 0:
            break
        picked[n] = best
        n += 1
    for m in range(n):
        i = picked[m]
        if now - lanef[LF.XMIT_AT, i] >= rtt[R.SRTT]:
            cnt[WC.IDLE_PROBES] += 1
            resend_chunk(lane[LN.CHUNK, i], True, now, opv, lane, lanef, rtt, next_set,
                         exps, nonf, x, xbits, res, tx8, tx16, tx32, cnt, sendlen, keep)
            queue_lane(i, opv, sendq)
    return True


def next_deadline(lane, lanef, rtt):
    """The earliest retransmission deadline of a busy lane, or the idle probe's
    (:func:`probe_time`) if sooner; inf when no lane is busy."""
    best = np.inf
    for i in range(lane.shape[1]):
        if lane[LN.CHUNK, i] >= 0 and lanef[LF.DEADLINE, i] < best:
            best = lanef[LF.DEADLINE, i]
    if best < np.inf:
        best = min(best, probe_time(rtt))
    return best

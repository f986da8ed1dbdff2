"""Loss recovery of a worker: round-trip estimate, retransmission deadlines, RACK, NACK answers.

Theory of operation. The result of a chunk is its only acknowledgement. Every outstanding
chunk has a retransmission deadline from an RFC 6298 style estimate (``srtt + 4 rttvar``,
at least ``min_rto_srtts`` x srtt; Karn's rule: no sample from a re-sent chunk), doubled at
each expiry up to ``max_rto_s``; a lane's last chunk, which no later chunk can reveal as
missing, is probed a reorder window after a chunk sent after it has its result (a tail-loss
probe, RFC 8985 section 7; ``kernels.stream``); when no result at all has come for two
round trips while chunks are outstanding in the operation's last window (where neither a
later chunk nor a later result can show a loss), an idle probe re-sends the oldest few of them
(``kernels.fire_timers``, backing off). The first measured round trip brings the
first window's deadlines, set under ``initial_rto_s``, down to the measured timeout.
Faster than timeouts:

* **NACKs** (the default): the switch sees a rank's later chunks arrive while an earlier one
  is missing, and says so; the worker re-sends what it has outstanding on that lane at once,
  unless it re-sent it less than a round trip ago (``kernels.take_nack``).
* **RACK** (``WorkerConfig.fast_retransmit``): a result for a chunk sent at time *t* marks
  every chunk still outstanding that was sent more than the reorder window before *t* as lost
  (:meth:`LossRecovery.lost_chunks`); a re-send that proves needless (a WAITING answer, or a
  result sooner than the smallest round trip after it) widens the window.

The per-datagram rules (the RTT update, the deadline of a (re-)sent chunk, spurious re-sends
seen in results) and the timers' re-sends (``kernels.fire_timers``: timeouts and the idle
probe, which the worker's compiled loop also runs) are compiled, in ``kernels/stream.py``;
this module holds their state (``rtt``, the array the kernels share, fields ``kernels.R``) and
the decisions taken per event in Python.
An operation with no progress for ``op_timeout_s`` fails with :meth:`silence_reason`.
"""

from __future__ import annotations

from collections.abc import Iterator

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.config import WorkerConfig
from switchml.protocol.operation import Operation

__all__ = ["LossRecovery"]


class LossRecovery:
    """One worker's loss-recovery state, shared with the kernels as ``rtt``."""

    def __init__(self, config: WorkerConfig, counters: np.ndarray) -> None:
        self.config = config
        self._cnt = counters  # the worker's kernel counters (kernels.WC)
        rtt = np.zeros(K.R_FIELDS, np.float64)
        rtt[K.R.SRTT] = rtt[K.R.MIN_RTT] = -1.0
        rtt[K.R.RTO] = config.initial_rto_s
        rtt[K.R.MIN_RTO] = config.min_rto_s
        rtt[K.R.MAX_RTO] = config.max_rto_s
        rtt[K.R.REO_SCALE] = 1.0
        rtt[K.R.MAX_REO_SCALE] = config.max_reorder_scale
        rtt[K.R.MIN_REO_WINDOW] = config.min_reorder_window_s
        rtt[K.R.RTO_SRTTS] = config.min_rto_srtts
        self.rtt = rtt
        self.fast_retransmit = config.fast_retransmit

    # -- the operation's life --------------------------------------------------------------------

    def on_started(self, op: Operation, now: float) -> None:
        """An operation starts: its clock of progress too."""
        op.spurious = int(self._cnt[K.WC.SPURIOUS])
        self.rtt[K.R.FMAX] = op.fmax
        self.rtt[K.R.LAST_PROGRESS] = self.rtt[K.R.LAST_HEARD] = now
        # No idle probe before the operation's last window (``kernels.probe_time``).
        self.rtt[K.R.PROBED_AT] = self.rtt[K.R.PROBES] = np.inf

    def on_completed(self, op: Operation) -> None:
        """A clean operation (no needless RACK re-send) narrows the reorder window again."""
        if self._cnt[K.WC.SPURIOUS] == op.spurious and self.rtt[K.R.REO_SCALE] > 1:
            self.rtt[K.R.REO_SCALE] //= 2

    def on_sent(self, op: Operation, lane: int, now: float) -> None:
        """Lane ``lane`` (re-)sent its chunk: RACK keeps transmissions in time order."""
        if self.fast_retransmit:
            op.xmit_order.append((now, lane, int(op.lane[K.LN.CHUNK, lane]),
                                  int(op.lane[K.LN.XMITS, lane])))

    def heard(self, now: float) -> None:
        """The switch answered something of ours (not necessarily progress)."""
        self.rtt[K.R.LAST_HEARD] = now

    # -- fast recovery ---------------------------------------------------------------------------

    def reorder_window(self) -> float:
        """How much later a chunk must have been sent for its result to mark an earlier one
        lost: a quarter of the smallest round trip (at least ``min_reorder_window_s``), times
        the current scale, at most the retransmission timeout."""
        rtt = self.rtt
        return min(max(rtt[K.R.MIN_RTT] / 4, self.config.min_reorder_window_s)
                   * rtt[K.R.REO_SCALE], rtt[K.R.SRTT] + 4 * rtt[K.R.RTTVAR])

    def lost_chunks(self, op: Operation) -> Iterator[int]:
        """RACK (RFC 8985): the chunks still outstanding that were sent more than the reorder
        window before the transmission the last result answered. The caller re-sends each
        (which records it again through :meth:`on_sent`)."""
        rtt = self.rtt
        if rtt[K.R.MIN_RTT] < 0 or rtt[K.R.SRTT] < 0:
            return
        window, delivered = self.reorder_window(), float(rtt[K.R.DELIVERED_XMIT])
        order = op.xmit_order
        lane_chunk, lane_xmits = op.lane[K.LN.CHUNK], op.lane[K.LN.XMITS]
        while order:
            t, i, p, xmits = order[0]
            if lane_chunk[i] != p or lane_xmits[i] != xmits:
                order.popleft()  # that transmission is answered or superseded
            elif t + window < delivered:
                order.popleft()
                yield p
            else:
                return

    def on_waiting(self, op: Operation, chunk: int, missing: int, now: float) -> None:
        """The switch answered a re-send of ``chunk`` with WAITING (``missing``: the ranks it
        waits for): our chunk was in all along. A RACK re-send of it was needless."""
        self.heard(now)
        i = chunk % op.E
        if op.lane[K.LN.FAST, i] and op.lane[K.LN.CHUNK, i] == chunk:
            op.lane[K.LN.FAST, i] = 0
            self._cnt[K.WC.SPURIOUS] += 1
            self.rtt[K.R.REO_SCALE] = min(self.rtt[K.R.REO_SCALE] * 2,
                                          self.rtt[K.R.MAX_REO_SCALE])
        op.waiting_missing = missing
        op.waiting_chunk = chunk

    # -- timers ----------------------------------------------------------------------------------

    def fail_at(self) -> float:
        """When the operation fails without progress (``op_timeout_s`` after the last)."""
        return float(self.rtt[K.R.LAST_PROGRESS]) + self.config.op_timeout_s

    def deadline(self, op: Operation) -> float:
        """The earliest of the lanes' retransmission deadlines and the failure time."""
        return min(float(K.next_deadline(op.state)), self.fail_at())

    def timed_out(self, now: float) -> bool:
        # The same sum as ``deadline``: ``now - last >= timeout`` can be false by a rounding
        # error at that very deadline, and the timer would fire forever.
        return now >= self.fail_at()

    def silence_reason(self, op: Operation, *, where: str, switch: str,
                       num_workers: int, now: float) -> str:
        """Why the operation made no progress: the ranks the switch says it waits for, or
        the switch's silence (:meth:`switch_silent`)."""
        last_heard = float(self.rtt[K.R.LAST_HEARD])
        idle = now - float(self.rtt[K.R.LAST_PROGRESS])
        ranks = [r for r in range(num_workers) if op.waiting_missing >> r & 1]
        if not self.switch_silent(op, now):
            return (f"{where} made no progress for {idle:.1f} s: the switch at {switch} "
                    f"answers, but rank(s) {ranks} have not sent chunk {op.waiting_chunk}")
        said = f" (it last said it waited for rank(s) {ranks})" if ranks else ""
        return (f"{where} made no progress for {idle:.1f} s: no answer from the switch at "
                f"{switch} for {now - last_heard:.1f} s{said}")

    def switch_silent(self, op: Operation, now: float) -> bool:
        """Whether the switch has stopped answering: it said nothing since the operation's
        last progress, or nothing for ``min(op_timeout_s / 2, 3 max_rto_s)`` although this
        rank kept re-sending (a live switch answers each re-send, with WAITING at least), as
        opposed to naming ranks that have not contributed."""
        last_heard = float(self.rtt[K.R.LAST_HEARD])
        if not op.waiting_missing or last_heard <= float(self.rtt[K.R.LAST_PROGRESS]):
            return True
        return now - last_heard >= min(self.config.op_timeout_s / 2, 3 * self.config.max_rto_s)

    @property
    def rto_s(self) -> float:
        """The current retransmission timeout before backoff."""
        return float(self.rtt[K.R.RTO])

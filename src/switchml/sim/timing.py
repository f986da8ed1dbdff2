"""Timing mode: the protocol's per-slot rules as a vectorised discrete-event model, no payloads.

Theory of operation. The real endpoints cost about 1-10 us of CPU per datagram, so 1024
workers x 64 MiB (96 million datagrams) cannot go through them in minutes. This model keeps
what decides *when* things happen and drops the data:

* Every worker runs lanes ``0..E-1``; packet ``p`` travels on lane ``p mod E``; the first ``E``
  go at once and the result of ``p`` releases ``p + E`` (self-clocking), ``T = L + E`` packets
  of which the first ``E`` carry only exponents (the float protocol's look-ahead), as in
  ``protocol/worker.py``.
* A switch completes a round when it holds every child's packet; in a tree a rack switch then
  sends one request upstream and multicasts the spine's result to its workers
  (``protocol/tree.py``). A retransmission into a completed round is answered with a unicast
  copy (the shadow copy); a lost request is re-sent when the worker's timer expires: the
  deadline is ``send + rto * 2^tries`` (capped at ``max_rto_s``), ``rto = srtt + 4 rttvar``
  from first transmissions (RFC 6298, Karn), at least ``min_rto_srtts`` x srtt, clamped to
  ``[min_rto_s, max_rto_s]``.
* Links are FIFO queues drained at their rate, then a propagation delay; a frame that does
  not fit the queue is dropped, one that leaves is lost with the link's probability; a failed
  link drops everything.
* A host is one CPU that spends ``host_cost_s`` per datagram and ``host_element_cost_s`` per
  element received or sent, shared by its ``threads`` (docs/simulator.md); a released packet
  leaves after its result's and its own cost. A star's switch is a CPU that spends
  ``switch_request_cost_s`` per request and ``switch_element_cost_s`` per element of it,
  shared by its ``shards``, serving requests in the order the model handles them (0: line
  rate); a tree's switches forward at line rate. Every switch adds ``switch_delay_s``.

Every event carries the packet number and a *vector* of workers (or racks) with their own
times, so a round costs a handful of numpy calls however many workers take part; workers whose
times drift apart (a loss, a straggler) split off into events of their own, so each link still
serves its frames in time order (to within one frame time). Not modelled: spurious timeouts
(a timer only fires for a datagram that was really lost), reordering, duplication, WAITING
replies, and a tree's switches' CPU. ``tests/sim/test_sim.py`` checks this model against the real
endpoints on the same links (``sim.exact``).
"""

from __future__ import annotations

import heapq
import math
import time
from collections.abc import Callable

import numpy as np

from switchml.protocol.wire import HEADER_SIZE
from switchml.sim.config import IP_UDP_BYTES, SimConfig, SimLink
from switchml.sim.report import LinkStats, SimReport

__all__ = ["TimingModel", "run_timing"]

_W_SEND, _W_ARRIVE_RETX, _R_UP, _S_DOWN, _W_DOWN, _W_RETRY, _W_NACK = range(7)
_REORDER_WINDOW_S = 1e-3  # WorkerConfig.min_reorder_window_s's default (tail-loss probes)
_NACK_IP_BYTES = IP_UDP_BYTES + HEADER_SIZE  # a NACK is a bare header


class _Links:
    """A class of links (one per worker, or one per rack), one direction: FIFO + loss."""

    def __init__(self, name: str, spec: SimLink, count: int, rng: np.random.Generator,
                 fail_at: np.ndarray) -> None:
        self.spec = spec
        self.free = np.zeros(count)
        self.queue_s = spec.queue_bytes * 8 / spec.rate_bps
        self.rng = rng
        self.fail_at = fail_at
        self.stats = LinkStats(name, count, busy_s=np.zeros(count))

    def send(self, idx: np.ndarray, t: np.ndarray, ip_bytes: int
             ) -> tuple[np.ndarray, np.ndarray]:
        """Queue one frame per link ``idx[i]`` at ``t[i]``; return (arrival times, delivered).
        ``idx`` holds each link at most once."""
        spec = self.spec
        ftime = spec.frame_time_s(ip_bytes)
        start = np.maximum(t, self.free[idx])
        fits = start - t + ftime <= self.queue_s
        dep = start + ftime
        self.free[idx] = np.where(fits, dep, self.free[idx])
        st = self.stats
        sent = int(fits.sum())
        st.frames += sent
        st.bytes += sent * ip_bytes
        st.busy_s[idx[fits]] += ftime
        st.queue_drops += len(idx) - sent
        ok = fits.copy()
        alive = t < self.fail_at[idx]
        st.failed_drops += int((ok & ~alive).sum())
        ok &= alive
        if spec.loss_rate:
            lost = ok & (self.rng.random(len(idx)) < spec.loss_rate)
            st.losses += int(lost.sum())
            ok &= ~lost
        return dep + spec.delay_s, ok


class _Round:
    """Per-packet state of every worker and rack (freed when every worker has the result)."""

    __slots__ = ("sent0", "last_send", "tries", "due", "arrived", "got", "n_got", "rack_cnt",
                 "rack_tmax", "rack_res", "up_arrived", "up_last", "up_tries", "spine_cnt",
                 "spine_tmax", "spine_done")

    def __init__(self, n: int, racks: int) -> None:
        self.sent0 = np.full(n, np.nan)
        self.last_send = np.zeros(n)
        self.tries = np.zeros(n, np.int64)
        self.due = np.full(n, np.inf)  # the armed retransmission deadline (after a loss)
        self.arrived = np.zeros(n, bool)
        self.got = np.zeros(n, bool)
        self.n_got = 0
        self.rack_cnt = np.zeros(racks, np.int64)
        self.rack_tmax = np.zeros(racks)
        self.rack_res = np.full(racks, np.inf)  # when the rack had the (global) result
        self.up_arrived = np.zeros(racks, bool)
        self.up_last = np.zeros(racks)
        self.up_tries = np.zeros(racks, np.int64)
        self.spine_cnt = 0
        self.spine_tmax = 0.0
        self.spine_done = math.inf


class SimulationFailed(Exception):
    """The operation could not finish (a failed link): the model stops with this reason."""


class TimingModel:
    """One all-reduce of ``config`` in timing mode. ``run()`` returns a :class:`SimReport`.

    Example::

        report = TimingModel(SimConfig(workers=8, size_bytes=64 << 20)).run()
        report.ate_per_s, report.fraction_of_line_rate
    """

    def __init__(self, config: SimConfig, *,
                 progress: Callable[[float, float], None] | None = None) -> None:
        c = self.config = config
        n, racks = c.workers, c.racks
        self.n, self.racks, self.m = n, racks, c.workers_per_rack
        self.tree = racks > 1
        self.rack_of = np.arange(n) // self.m
        k = c.elements_per_packet
        self.k = k
        self.L = -(-c.elements // k)
        self.E = min(c.slots, self.L)
        self.T = self.L + self.E
        self.last_count = c.elements - (self.L - 1) * k
        seeds = np.random.SeedSequence(c.seed).spawn(4)
        wfail = np.full(n, np.inf)
        rfail = np.full(racks, np.inf)
        for f in c.failures:
            (wfail if f.kind == "worker" else rfail)[f.index] = min(
                f.at_s, (wfail if f.kind == "worker" else rfail)[f.index])
        self.wfail, self.rfail = wfail, rfail
        self.up = _Links("worker_up", c.access, n, np.random.default_rng(seeds[0]), wfail)
        self.down = _Links("worker_down", c.access, n, np.random.default_rng(seeds[1]), wfail)
        self.rup = _Links("rack_up", c.spine_link, racks, np.random.default_rng(seeds[2]), rfail)
        self.sdown = _Links("spine_down", c.spine_link, racks, np.random.default_rng(seeds[3]),
                            rfail)
        s = c.stragglers
        slow = np.zeros(n, bool)
        if s.count:
            slow[n - s.count:] = True
        self.cost = np.where(slow, s.slowdown, 1.0) / c.threads  # x the packet's cost
        self.switch_free = 0.0  # when the star's switch CPU is next free
        self.start = np.where(slow, s.delay_s, 0.0)
        self.cpu_free = self.start.copy()
        self.srtt = np.full(n, np.nan)
        self.rttvar = np.zeros(n)
        self.rto = np.full(n, c.initial_rto_s)
        self.rack_rto = c.min_rto_s
        self.last_progress = self.start.copy()
        self.results = np.zeros(n, np.int64)
        self.done_at = np.full(n, np.nan)
        self.retransmissions = 0
        self.rack_retransmissions = 0
        self.rounds: dict[int, _Round] = {}
        # Switch-driven loss recovery (NACKs, protocol/switch.py): the order in which each
        # rack switch completed its rounds, and per worker the chunks the switch will find
        # missing: (chunk the switch expects, completion that released it, chunk to re-send).
        self.gap = c.nack_gap
        self.completions = np.zeros(racks, np.int64)
        self.cidx = np.full((self.T, racks), -1, np.int64)
        self.has_missing = np.zeros(n, bool)
        self.missing: dict[int, list[tuple[int, int, int]]] = {}
        self.nacks = 0
        self.heap: list[tuple[float, int, int, int, np.ndarray, np.ndarray]] = []
        self.seq = 0
        self.events = 0
        self.now = 0.0
        self.eps = c.access.frame_time_s(IP_UDP_BYTES + HEADER_SIZE + 4 * k)
        self.progress = progress
        self.all_workers = np.arange(n)
        self.rack_workers = [np.arange(r * self.m, (r + 1) * self.m) for r in range(racks)]

    # -- helpers ------------------------------------------------------------------------------

    def count(self, p: int) -> int:
        """Elements packet ``p`` carries: none (an exponent, ``p < E``) or block ``p - E``'s."""
        if p < self.E:
            return 0
        return self.last_count if p - self.E == self.L - 1 else self.k

    def ip_bytes(self, p: int) -> int:
        """IP bytes of packet ``p``: exponent only (``p < E``) or block ``p - E``'s data."""
        return IP_UDP_BYTES + HEADER_SIZE + 4 * self.count(p)

    def _switch_cpu(self, arrive: np.ndarray, cost: float) -> np.ndarray:
        """When the switch's CPU is done with requests arriving at ``arrive``, ``cost`` each,
        served one after another in arrival order after those before them:
        ``f_i = max(f_(i-1), a_i) + cost``, in closed form."""
        order = np.argsort(arrive, kind="stable")
        a = arrive[order]
        i = np.arange(len(a))
        f = cost * (i + 1) + np.maximum(self.switch_free, np.maximum.accumulate(a - cost * i))
        self.switch_free = float(f[-1])
        out = np.empty_like(f)
        out[order] = f
        return out

    def result_bytes(self, p: int) -> int:
        return self.ip_bytes(p)

    def _push(self, kind: int, p: int, idx: np.ndarray, t: np.ndarray) -> None:
        if len(idx):
            self.seq += 1
            heapq.heappush(self.heap, (float(t.min()), self.seq, kind, p, idx, t))

    def _round(self, p: int) -> _Round:
        r = self.rounds.get(p)
        if r is None:
            r = self.rounds[p] = _Round(self.n, self.racks)
        return r

    def _timeout(self, tries: np.ndarray, rto: np.ndarray | float) -> np.ndarray:
        return np.minimum(rto * 2.0 ** tries, self.config.max_rto_s)

    def _check_stall(self, ws: np.ndarray, t: np.ndarray, what: str) -> None:
        late = t - self.last_progress[ws] >= self.config.op_timeout_s
        if late.any():
            i = int(np.flatnonzero(late)[0])
            w = int(ws[i])
            at = float(self.last_progress[w] + self.config.op_timeout_s)
            self.now = at
            raise SimulationFailed(
                f"rank {w} made no progress for {self.config.op_timeout_s:g} s and failed at "
                f"t={at:.6f} s ({what})")

    # -- events -------------------------------------------------------------------------------

    def _worker_send(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """Workers ``ws`` (re)send packet ``p``, released at ``t``."""
        rd = self._round(p)
        keep = ~rd.got[ws]
        ws, t = ws[keep], t[keep]
        if not len(ws):
            return
        first = np.isnan(rd.sent0[ws])
        # CPU: a released packet costs its result's receive and its own send.
        mult = np.where(first & (p >= self.E), 2.0, 1.0)
        c = self.config
        count = self.count(p)
        s = (np.maximum(t, self.cpu_free[ws])
             + self.cost[ws] * mult * (c.host_cost_s + count * c.host_element_cost_s))
        self.cpu_free[ws] = s
        rd.sent0[ws] = np.where(first, s, rd.sent0[ws])
        rd.last_send[ws] = s
        self.retransmissions += int((~first).sum())
        arr, ok = self.up.send(ws, s, self.ip_bytes(p))
        arr += c.switch_delay_s
        if not self.tree and (c.switch_request_cost_s or c.switch_element_cost_s) and ok.any():
            arr[ok] = self._switch_cpu(arr[ok], (c.switch_request_cost_s
                                                 + count * c.switch_element_cost_s) / c.shards)
        lost = ~ok
        if lost.any():
            lw = ws[lost]
            due = s[lost] + self._lane_timeout(p, lw, rd.tries[lw])
            self._check_stall(lw, due, "its requests are lost")
            rd.tries[lw] += 1
            rd.due[lw] = due
            self._push(_W_RETRY, p, lw, due)
            if self.gap:
                self._expect(lw, p, p)
        again = ok & rd.arrived[ws]  # a retransmission after its result was lost
        if again.any():
            self._push(_W_ARRIVE_RETX, p, ws[again], arr[again])
        new = ok & ~rd.arrived[ws]
        if not new.any():
            return
        nw, na = ws[new], arr[new]
        rd.arrived[nw] = True
        if self.gap and self.has_missing[nw].any():
            self._nack_check(p, nw[self.has_missing[nw]], na[self.has_missing[nw]])
        racks = self.rack_of[nw]
        np.add.at(rd.rack_cnt, racks, 1)
        np.maximum.at(rd.rack_tmax, racks, na)
        done = np.unique(racks[rd.rack_cnt[racks] == self.m])
        if not len(done):
            return
        self.completions[done] += 1
        self.cidx[p, done] = self.completions[done]
        tc = rd.rack_tmax[done]
        if self.tree:
            rd.up_last[done] = tc
            self._push(_R_UP, p, done, tc)
        else:
            rd.rack_res[done] = tc
            self._push(_W_DOWN, p, self.all_workers, np.full(self.n, tc[0]))

    def _worker_retx_arrives(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """A re-sent request reaches a rack switch whose round already has it: answered with the
        (global) result if the rack has it; otherwise the multicast will bring it."""
        rd = self._round(p)
        have = rd.rack_res[self.rack_of[ws]] <= t
        self._push(_W_DOWN, p, ws[have], t[have])

    def _rack_up(self, p: int, rs: np.ndarray, t: np.ndarray) -> None:
        """Rack switches ``rs`` send their partial sum of round ``p`` to the spine."""
        rd = self._round(p)
        keep = np.isinf(rd.rack_res[rs])
        rs, t = rs[keep], t[keep]
        if not len(rs):
            return
        self.rack_retransmissions += int((rd.up_tries[rs] > 0).sum())
        rd.up_last[rs] = t
        arr, ok = self.rup.send(rs, t, self.ip_bytes(p))
        arr += self.config.switch_delay_s
        lost = ~ok
        if lost.any():
            lr = rs[lost]
            due = t[lost] + self._timeout(rd.up_tries[lr], self.rack_rto)
            self._check_stall(self.rack_workers[int(lr[0])], np.full(self.m, due[0]),
                              f"rack {int(lr[0])} gets no answer from the spine")
            rd.up_tries[lr] += 1
            self._push(_R_UP, p, lr, due)
        again = ok & rd.up_arrived[rs]
        if again.any():  # the spine's round is complete: unicast copy
            self._push(_S_DOWN, p, rs[again], np.maximum(arr[again], rd.spine_done))
        new = ok & ~rd.up_arrived[rs]
        if not new.any():
            return
        rd.up_arrived[rs[new]] = True
        rd.spine_cnt += int(new.sum())
        rd.spine_tmax = max(rd.spine_tmax, float(arr[new].max()))
        if rd.spine_cnt == self.racks:
            rd.spine_done = rd.spine_tmax
            self._push(_S_DOWN, p, np.arange(self.racks), np.full(self.racks, rd.spine_done))

    def _spine_down(self, p: int, rs: np.ndarray, t: np.ndarray) -> None:
        """The spine's result of round ``p`` goes down to rack switches ``rs``."""
        rd = self._round(p)
        keep = np.isinf(rd.rack_res[rs])
        rs, t = rs[keep], t[keep]
        if not len(rs):
            return
        arr, ok = self.sdown.send(rs, t, self.result_bytes(p))
        arr += self.config.switch_delay_s
        lost = ~ok
        if lost.any():  # the rack's timer re-sends its request
            lr = rs[lost]
            due = np.maximum(t[lost], rd.up_last[lr] + self._timeout(rd.up_tries[lr],
                                                                       self.rack_rto))
            rd.up_tries[lr] += 1
            self._push(_R_UP, p, lr, due)
        if ok.any():
            orr, oa = rs[ok], arr[ok]
            rd.rack_res[orr] = oa
            ws = np.concatenate([self.rack_workers[r] for r in orr.tolist()])
            self._push(_W_DOWN, p, ws, np.repeat(oa, self.m))

    def _worker_down(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """The result of round ``p`` goes down to workers ``ws``."""
        rd = self._round(p)
        keep = ~rd.got[ws]
        ws, t = ws[keep], t[keep]
        if not len(ws):
            return
        arr, ok = self.down.send(ws, t, self.result_bytes(p))
        lost = ~ok
        if lost.any():  # the worker's timer re-sends its request
            lw = ws[lost]
            due = np.maximum(t[lost], rd.last_send[lw] + self._lane_timeout(p, lw,
                                                                             rd.tries[lw]))
            self._check_stall(lw, due, "its results are lost")
            rd.tries[lw] += 1
            rd.due[lw] = due
            self._push(_W_RETRY, p, lw, due)
            if self.gap and p + self.E < self.T:
                # The switch will miss chunk p + E, released by this round: the NACK makes
                # the worker re-send p, which the switch answers with the result.
                self._expect(lw, p + self.E, p)
        if not ok.any():
            return
        gw, ga = ws[ok], arr[ok]
        rd.got[gw] = True
        rd.n_got += len(gw)
        clean = rd.tries[gw] == 0  # Karn: RTT samples from first transmissions only
        if clean.any():
            self._rtt_sample(gw[clean], ga[clean] - rd.sent0[gw[clean]])
        self.last_progress[gw] = ga
        self.results[gw] += 1
        if p > self.T - self.E:
            self._tail_probe(p, gw, ga)
        if p + self.E < self.T:
            self._push(_W_SEND, p + self.E, gw, ga)
        fin = self.results[gw] == self.T
        if fin.any():
            self.done_at[gw[fin]] = ga[fin]
        if rd.n_got == self.n:
            del self.rounds[p]

    def _lane_timeout(self, p: int, ws: np.ndarray, tries: np.ndarray) -> np.ndarray:
        """The deadline offset a real worker arms for packet ``p``: ``rto * 2^tries``
        (capped); a lane's last packet may be probed sooner (``_tail_probe``)."""
        return self._timeout(tries, self.rto[ws])

    def _tail_probe(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """Workers ``ws`` got the result of packet ``p`` at ``t``: a lane's last packet ``q``
        sent before it (``T - E <= q < p``) whose own request or result was lost is re-sent a
        reorder window later (``kernels.stream._probe_tail``; the workers' default 1 ms, the
        simulator has no reordering), if that is sooner than its timer."""
        for q in range(max(self.T - self.E, 0), p):
            rq = self.rounds.get(q)
            if rq is None:
                continue
            due = rq.due[ws]
            at = t + _REORDER_WINDOW_S
            probe = ~rq.got[ws] & np.isfinite(due) & (due > at)
            if probe.any():
                pw, pt = ws[probe], at[probe]
                rq.due[pw] = pt
                self._push(_W_RETRY, q, pw, pt)

    def _worker_retry(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """A retransmission timer expires (only armed deadlines count: a NACK re-send
        re-arms)."""
        rd = self._round(p)
        live = rd.due[ws] == t
        ws, t = ws[live], t[live]
        if len(ws):
            rd.due[ws] = np.inf
            self._worker_send(p, ws, t)

    def _expect(self, ws: np.ndarray, q: int, resend: int) -> None:
        """The switch will find chunk ``q`` of workers ``ws`` missing when a chunk released
        ``gap`` completions after ``q``'s release arrives."""
        for w in ws.tolist():
            r = int(self.rack_of[w])
            c = int(self.cidx[q - self.E, r]) if q >= self.E else -1
            self.missing.setdefault(w, []).append((q, c, resend))
            self.has_missing[w] = True

    def _nack_check(self, p: int, ws: np.ndarray, arr: np.ndarray) -> None:
        """Chunk ``p`` of workers ``ws`` arrived at ``arr``: NACK what they lack (the rule of
        ``kernels.nacks._behind_on``: a chunk released at least ``gap`` completions before this
        chunk's release; in the first window, chunk ``p - gap``)."""
        for w, a in zip(ws.tolist(), arr.tolist()):
            r = int(self.rack_of[w])
            limit = int(self.cidx[p - self.E, r]) - self.gap if p >= self.E else -1
            keep = []
            for q, c, resend in self.missing[w]:
                if (c >= 0 and c <= limit) or (c < 0 and p < self.E and q <= p - self.gap) or \
                        (c < 0 and p >= self.E):
                    rq = self.rounds.get(resend)
                    if rq is not None and not rq.got[w] and (q != resend or not rq.arrived[w]):
                        self._send_nack(resend, w, a)
                else:
                    keep.append((q, c, resend))
            if keep:
                self.missing[w] = keep
            else:
                del self.missing[w]
                self.has_missing[w] = False

    def _send_nack(self, p: int, w: int, t: float) -> None:
        idx = np.array([w])
        arr, ok = self.down.send(idx, np.array([t]), _NACK_IP_BYTES)
        self.nacks += 1
        if ok[0]:
            self._push(_W_NACK, p, idx, arr)

    def _worker_nack(self, p: int, ws: np.ndarray, t: np.ndarray) -> None:
        """A NACK reaches workers ``ws``: they re-send chunk ``p`` of that lane now."""
        rd = self.rounds.get(p)
        if rd is None:
            return
        live = ~rd.got[ws] & np.isfinite(rd.due[ws])
        ws, t = ws[live], t[live]
        if len(ws):
            rd.due[ws] = np.inf
            self._worker_send(p, ws, t)

    def _rtt_sample(self, ws: np.ndarray, rtt: np.ndarray) -> None:
        """RFC 6298 per worker (vectorised), as ``kernels`` does it."""
        c = self.config
        srtt = self.srtt[ws]
        fresh = np.isnan(srtt)
        var = self.rttvar[ws]
        if fresh.any():
            old = np.where(fresh, rtt, srtt)
            var = np.where(fresh, rtt / 2, 0.75 * var + 0.25 * np.abs(old - rtt))
            srtt = np.where(fresh, rtt, 0.875 * old + 0.125 * rtt)
        else:
            var = 0.75 * var + 0.25 * np.abs(srtt - rtt)
            srtt = 0.875 * srtt + 0.125 * rtt
        self.srtt[ws], self.rttvar[ws] = srtt, var
        self.rto[ws] = np.clip(np.maximum(srtt + 4 * var, c.min_rto_srtts * srtt),
                               c.min_rto_s, c.max_rto_s)

    # -- loop ---------------------------------------------------------------------------------

    def run(self) -> SimReport:
        """Run the operation to the end (or to a failure); return the report."""
        t_wall = time.perf_counter()
        for p in range(self.E):
            self._push(_W_SEND, p, self.all_workers, self.start.copy())
        handlers = (self._worker_send, self._worker_retx_arrives, self._rack_up,
                    self._spine_down, self._worker_down, self._worker_retry, self._worker_nack)
        heap = self.heap
        eps = self.eps
        error = None
        next_report = time.perf_counter() + 2.0
        try:
            while heap:
                t0, _, kind, p, idx, t = heapq.heappop(heap)
                self.now = t0
                if len(idx) > 1:
                    now_mask = t <= t0 + eps
                    if not now_mask.all():
                        rest = ~now_mask
                        self._push(kind, p, idx[rest], t[rest])
                        idx, t = idx[now_mask], t[now_mask]
                self.events += 1
                handlers[kind](p, idx, t)
                if self.progress is not None and self.events % 512 == 0:
                    wall = time.perf_counter()
                    if wall >= next_report:
                        next_report = wall + 2.0
                        self.progress(float(self.results.sum()) / (self.n * self.T), t0)
        except SimulationFailed as exc:
            error = str(exc)
        ok = error is None and not np.isnan(self.done_at).any()
        if error is None and not ok:
            error = "the event queue ran dry before every worker had every result (a bug)"
        elapsed = float(np.nanmax(self.done_at)) if ok else self.now
        return SimReport(
            mode="timing", config=self.config, elapsed_s=elapsed,
            elements=self.config.elements, ok=ok, error=error,
            retransmissions=self.retransmissions,
            rack_retransmissions=self.rack_retransmissions,
            links=[self.up.stats, self.down.stats] + (
                [self.rup.stats, self.sdown.stats] if self.tree else []),
            events=self.events, wall_s=time.perf_counter() - t_wall,
            extra={"packets_per_worker": self.T, "nacks": self.nacks})


def run_timing(config: SimConfig, *,
               progress: Callable[[float, float], None] | None = None) -> SimReport:
    """Simulate one all-reduce of ``config`` in timing mode."""
    return TimingModel(config, progress=progress).run()

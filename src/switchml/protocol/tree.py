"""Hierarchical aggregation: a rack switch that is one worker of a parent switch (sans-I/O).

Theory of operation (SwitchML's multi-rack sketch, SHARP's trees). A
:class:`RackAggregator` wraps an ordinary :class:`~switchml.protocol.switch.SwitchDataplane`
(the *inner* switch) that serves the rack's workers, the *children*, in a job of their own.
Upstream it is rank ``rack`` of a *parent* job on a parent (spine) switch, whose ranks are the
racks. Both jobs have the same window ``W`` and chunk size ``k``: child slot ``base_c + i`` maps
to parent slot ``base_p + i``, with the same set, ``seq`` and ``chunk``.

1. A child's REQUEST goes to the inner switch unchanged (every per-slot rule of the flat
   protocol applies in the rack: sets, seen bitmaps, WAITING, MISMATCH, NACK, ...).
2. When the inner switch completes a round, its multicast is intercepted: the partial sum goes
   upstream as one REQUEST (same payload, flags, ``exp_data``, digest; ``exp_next`` = the
   rack's max) with the parent job's id, token, slot and this rack's rank. No
   re-quantisation: the children quantise for the whole tree (``JobSpec.scale_workers`` = all
   workers of the tree), so the racks' integer sums add exactly and cannot overflow.
3. The parent's RESULT (global sums, global max exponent, ORed flags) is rewritten for the
   child job and multicast to every child: that is the children's result.
4. Loss recovery, level 1: a child's retransmission into a round the inner switch completed
   makes it answer with its shadow copy, the *local* partial sum; that answer is replaced by
   the parent's result for that round if the rack has it, and dropped otherwise (the result
   will be multicast when it comes). Level 2: every upstream request not yet answered has a
   retransmission deadline (``rto_s * 2^tries``, capped at ``max_rto_s``); the parent switch
   answers a re-sent request with its stored result, exactly as for a worker; a NACK from
   the parent re-sends at once.

Steps 2 and 3 run once per round, so they are compiled (``kernels/relay.py``): the inner switch
hands its completed rounds to the rack (``SwitchDataplane.on_completed``) instead of
multicasting them, the kernel rewrites each into the rack's upstream buffer of that (set,
lane), and the parent's results of a batch are rewritten into the children's buffers in one
call. Python only queues views of those buffers, as the flat switch queues its results.
5. Failures become :class:`TreeFailed` events (and :attr:`error`): the parent refuses the JOIN
   or does not answer it, the parent lost the job (``UNKNOWN_JOB``), the racks disagree
   (``MISMATCH``), or an upstream round gets no answer for ``parent_timeout_s`` (the message
   names the racks the parent said it waits for, from its WAITING replies). The children,
   which then get no results, fail on their own operation timeout.

The invariant the flat protocol relies on (no rank more than one round ahead on a slot) holds
upstream too: a rack completes round (s, v) only after every child had the result of
(s, 1 - v), which needed the parent's result of (s, 1 - v).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address, format_address
from switchml.protocol.auth import join_datagram, key_for, reply_forged
from switchml.protocol.config import JobSpec, SwitchConfig
from switchml.protocol.endpoint import Batch, Transmit, flatten_runs
from switchml.protocol.errors import ConfigError, WireError
from switchml.protocol.events import Event, JobCreated
from switchml.protocol.jobs import Job
from switchml.protocol.kernels import layout as KR
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.wire import (
    AT,
    HEADER,
    NO_COOKIE,
    ControlInfo,
    Datagram,
    Field,
    Flags,
    Header,
    MessageType,
    unpack_challenge,
    unpack_header,
    unpack_joined,
    unpack_payload,
)

__all__ = ["RackAggregator", "TreeConfig", "TreeFailed", "UpstreamJoined"]

_REQUEST = int(MessageType.REQUEST)
_RESULT = int(MessageType.RESULT)
_RESENT = int(Flags.RESENT)
# Header tuple positions and byte offsets, from the one table of the layout (wire.py).
_TYPE, _FLAGS, _SET, _RANK, _JOB, _TOKEN, _SEQ, _CHUNK, _SLOT = (
    Field.TYPE, Field.FLAGS, Field.SET, Field.RANK, Field.JOB, Field.TOKEN, Field.SEQ,
    Field.CHUNK, Field.SLOT)
_TYPE_OFFSET, _FLAGS_OFFSET = AT["type"], AT["flags"]


@dataclass(frozen=True, slots=True)
class TreeConfig:
    """Upstream loss recovery and failure detection of a rack switch. Times in seconds."""

    rto_s: float = 0.01
    """Retransmission timeout of an upstream request before backoff. Default 10 ms (the
    workers' ``min_rto_s``)."""
    max_rto_s: float = 1.0
    """Cap of the exponential backoff. Default 1 s."""
    parent_timeout_s: float = 10.0
    """An upstream round without an answer for this long is reported as a failure
    (:class:`TreeFailed`). Keep it below the workers' ``op_timeout_s`` so that the rack's
    reason is known before the children fail. Default 10 s."""
    join_timeout_s: float = 10.0
    """JOIN to the parent fails if not answered within this time."""
    join_retry_s: float = 0.2
    """JOIN to the parent is re-sent after this long while unanswered. Default 0.2 s."""
    secret: bytes | None = None
    """The parent switch's secret: the rack proves its JOIN of the parent job with the job key
    derived from it (``auth.key_for``). None for an open parent switch."""

    def __post_init__(self) -> None:
        if not 0 < self.rto_s <= self.max_rto_s:
            raise ConfigError(f"expected 0 < rto_s <= max_rto_s, got {self.rto_s}, "
                              f"{self.max_rto_s}")
        if self.parent_timeout_s <= self.max_rto_s:
            raise ConfigError(f"parent_timeout_s ({self.parent_timeout_s}) must exceed "
                              f"max_rto_s ({self.max_rto_s})")
        if not 0 < self.join_retry_s <= self.join_timeout_s:
            raise ConfigError(f"expected 0 < join_retry_s <= join_timeout_s, got "
                              f"{self.join_retry_s}, {self.join_timeout_s}")
        if self.join_timeout_s <= 0:
            raise ConfigError(f"join_timeout_s must be > 0, got {self.join_timeout_s}")


def tree_specs(spec: JobSpec, racks: int) -> tuple[JobSpec, JobSpec]:
    """The parent (spine) and child (rack) jobs of a tree of ``racks`` equal racks for the job
    ``spec`` of all its workers: the parent's ranks are the racks, a rack's ranks are its
    ``spec.num_workers // racks`` workers (global rank g is local rank ``g % that`` of rack
    ``g // that``), both quantise for every worker of the tree."""
    if racks < 1 or spec.num_workers % racks:
        raise ConfigError(f"{spec.num_workers} workers do not split into {racks} equal racks")
    n = spec.num_workers
    common = {"job_id": spec.job_id, "token": spec.token, "window": spec.window,
              "elements_per_packet": spec.elements_per_packet, "scale_workers": n}
    return (JobSpec(num_workers=racks, **common),  # type: ignore[arg-type]
            JobSpec(num_workers=n // racks, **common))  # type: ignore[arg-type]


@dataclass(frozen=True, slots=True)
class UpstreamJoined:
    """Rack switch: the parent switch granted the parent job (its slot base)."""

    rack: int
    slot_base: int


@dataclass(frozen=True, slots=True)
class TreeFailed:
    """Rack switch: the tree cannot finish its rounds; ``reason`` says why."""

    rack: int
    reason: str


class RackAggregator:
    """A rack switch: a switch to its children, rank ``rack`` of ``parent_spec`` upstream.

    Drive it with the Endpoint contract (``receive_datagram``/``receive_many``,
    ``handle_timer``, then ``datagrams_to_send`` or ``poll_transmit``, ``next_event``,
    ``get_timer``). Datagrams from ``parent_address`` are the parent's; anything else goes to
    the inner switch.

    Example::

        rack = RackAggregator(parent_spec=JobSpec(job_id=9, token=t, num_workers=2, window=W,
                                                  elements_per_packet=k, scale_workers=8),
                              child_spec=JobSpec(job_id=9, token=t, num_workers=4, window=W,
                                                 elements_per_packet=k, scale_workers=8),
                              rack=0, parent_address=("spine", 48864))
        rack.join(now)   # JOIN upstream; children JOIN the rack as they would any switch

    Raises:
        ConfigError: the child and parent jobs differ in window or chunk size, the rack index
            is outside the parent job, or the scales differ (they must both allow for every
            worker of the tree).
    """

    def __init__(self, *, parent_spec: JobSpec, child_spec: JobSpec, rack: int,
                 parent_address: Address, config: TreeConfig | None = None,
                 switch_config: SwitchConfig | None = None) -> None:
        _check_specs(parent_spec, child_spec, rack)
        self.parent_spec = parent_spec
        self.child_spec = child_spec
        self.rack = rack
        self.parent_address = parent_address
        self.config = config or TreeConfig()
        self._key = key_for(self.config.secret, parent_spec.job_id, parent_spec.token)
        self.switch = SwitchDataplane(switch_config)
        self.switch.on_completed = self._relay_up
        self.switch.relayed_jobs.add(child_spec.job_id)
        self._child_job: Job | None = None
        self.error: str | None = None
        self.parent_slot_base: int | None = None
        self.child_slot_base: int | None = None
        self._members: list[Address] = []
        self._held: list[np.ndarray] = []  # rounds completed before the parent JOINED
        self._out: list[tuple[bytes | memoryview, Address]] = []
        self._runs: dict[Address, list[memoryview]] = {}
        self._events: deque[Event | UpstreamJoined | TreeFailed] = deque()
        self._join_at: float | None = None
        self._join_deadline = 0.0
        self._waiting_for: list[int] = []
        self._init_relay()
        self._counters = {"upstream_retransmissions": 0, "results_resent": 0,
                          "resends_dropped": 0, "parent_nacks": 0}
        self._handlers = {MessageType.RESULT: self._handle_stray_result,
                          MessageType.JOINED: self._handle_joined,
                          MessageType.CHALLENGE: self._handle_challenge,
                          MessageType.REFUSED: self._handle_refused,
                          MessageType.WAITING: self._handle_waiting,
                          MessageType.NACK: self._handle_nack,
                          MessageType.UNKNOWN_JOB: self._handle_unknown_job,
                          MessageType.MISMATCH: self._handle_mismatch}

    def _init_relay(self) -> None:
        """The relay's arrays (``kernels/relay.py``): per (set, lane) one upstream request and
        one result for the children."""
        w, size = self.child_spec.window, HEADER.size + 4 * self.child_spec.elements_per_packet
        self._up = np.zeros((2, w, size), np.uint8)
        self._down = np.zeros((2, w, size), np.uint8)
        self._up_views = [[memoryview(self._up[v, s]) for s in range(w)] for v in range(2)]
        self._down_views = [[memoryview(self._down[v, s]) for s in range(w)] for v in range(2)]
        self._ust = np.zeros((KR.U_FIELDS, 2, w), np.int64)
        self._utimes = np.zeros((KR.UT_FIELDS, 2, w), np.float64)
        rv = np.zeros(KR.RV_FIELDS, np.int64)
        p, c = self.parent_spec, self.child_spec
        rv[KR.RV.PARENT_JOB], rv[KR.RV.RACK], rv[KR.RV.CHILD_JOB] = p.job_id, self.rack, c.job_id
        rv[KR.RV.PARENT_TOKEN] = np.uint64(p.token).view(np.int64)
        rv[KR.RV.CHILD_TOKEN] = np.uint64(c.token).view(np.int64)
        rv[KR.RV.PARENT_BASE] = rv[KR.RV.CHILD_BASE] = -1
        self._rv = rv
        self._cnt = np.zeros(KR.RC.N, np.int64)
        self._sendq = np.zeros((max(K.MAX_BATCH, 2 * w), 3), np.int64)
        self._starts = np.empty(1, np.int64)  # receive_datagram's batch of one
        self._lens = np.empty(1, np.int64)

    @property
    def counters(self) -> dict[str, int]:
        """``upstream_sent``, ``upstream_retransmissions``, ``parent_results``,
        ``results_multicast``, ``results_resent``, ``resends_dropped``, ``parent_nacks``,
        ``parent_duplicates``."""
        results = int(self._cnt[KR.RC.PARENT_RESULTS])
        return {"upstream_sent": int(self._cnt[KR.RC.UPSTREAM_SENT]), "parent_results": results,
                "results_multicast": results,
                "parent_duplicates": int(self._cnt[KR.RC.PARENT_DUPLICATES]),
                **self._counters}

    # -- user commands ------------------------------------------------------------------------

    def join(self, now: float) -> None:
        """Join the parent job as rank ``rack`` (retried until JOINED or ``join_timeout_s``).
        Call ``datagrams_to_send`` afterwards."""
        self._join_deadline = now + self.config.join_timeout_s
        self._send_join(now)

    # -- Endpoint contract --------------------------------------------------------------------

    def receive_datagram(self, data: Datagram, addr: Address,
                         now: float) -> None:
        """Process one datagram (from the parent or a child). Call ``datagrams_to_send``."""
        if addr != self.parent_address:
            self.switch.receive_datagram(data, addr, now)
            self._collect(now)
            return
        buf = K.as_buffer(data)
        self._starts[0], self._lens[0] = 0, len(buf)
        self._from_parent(buf, self._starts, self._lens, 0, 1 if len(buf) else 0, now)

    def receive_many(self, batch: Batch, now: float) -> None:
        """Process a batch (as ``SwitchDataplane.receive_many``): runs of child datagrams go to
        the inner switch in one call each, runs of the parent's through the relay kernel."""
        count, address_of, senders = batch.count, batch.address_of, batch.senders
        i = 0
        while i < count:
            parent = address_of(int(senders[i])) == self.parent_address
            j = i + 1
            while j < count and (address_of(int(senders[j])) == self.parent_address) == parent:
                j += 1
            if parent:
                self._from_parent(batch.buf, batch.starts, batch.lens, i, j, now)
            else:
                self.switch.receive_many(batch.slice(i, j), now)
                self._collect(now)
            i = j

    def handle_timer(self, now: float) -> None:
        """Re-send upstream requests that are due, retry the JOIN, expire leases, and report a
        parent that stopped answering. Call ``datagrams_to_send`` afterwards."""
        if self._join_at is not None and now >= self._join_at:
            if now >= self._join_deadline:
                self._join_at = None
                self._fail(f"parent switch at {self._parent_text} did not answer JOIN for "
                           f"job {self.parent_spec.job_id} within "
                           f"{self.config.join_timeout_s:g} s")
            else:
                self._send_join(now)
        timer = self.switch.get_timer()
        if timer is not None and now >= timer:
            self.switch.handle_timer(now)
            self._collect(now)
        cfg = self.config
        n = int(K.relay_due(self._ust, self._utimes, now, cfg.rto_s, cfg.max_rto_s,
                             self._sendq))
        for v, s in self._sendq[:n, :2].tolist():
            first = float(self._utimes[KR.UT.FIRST_SENT, v, s])
            if now - first >= cfg.parent_timeout_s and self.error is None:
                racks = f"; it waits for rack(s) {self._waiting_for}" if self._waiting_for \
                    else ""
                self._fail(f"rack {self.rack}: no result from the parent switch at "
                           f"{self._parent_text} for chunk {int(self._ust[KR.U.CHUNK, v, s])} "
                           f"of operation {int(self._ust[KR.U.SEQ, v, s])} within "
                           f"{cfg.parent_timeout_s:g} s{racks}")
            self._resend(v, s)

    def get_timer(self) -> float | None:
        """The earliest of: the inner switch's lease timer, upstream retransmissions, the JOIN
        retry."""
        times = [t for t in (self.switch.get_timer(), self._join_at) if t is not None]
        due = float(K.relay_next_due(self._ust, self._utimes))
        if due != np.inf:
            times.append(due)
        return min(times) if times else None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes | memoryview, Address]]:
        """Return and forget the datagrams to send: replies in order, then the upstream
        requests and the children's results (in order per destination). Valid until the next
        receive."""
        out, runs = self._take_output()
        return flatten_runs(out, runs)

    def poll_transmit(self, now: float, *, gso: tuple[int, int] | None = None,
                      compiled: bool = False) -> Transmit:
        """What to send (``endpoint.Transmit``), so that a UDP switch server can host a rack:
        the replies in order, and per destination its datagrams (``groups``), whatever the
        transport offers (a rack plans no GSO runs and has no compiled sender)."""
        out, runs = self._take_output()
        return Transmit(out, runs, [])

    def _take_output(self) -> tuple[list[tuple[bytes | memoryview, Address]],
                                    dict[Address, list[memoryview]]]:
        out, runs = self._out, self._runs
        self._out, self._runs = [], {}
        return out, runs

    @property
    def allocator(self):  # noqa: ANN201 - the inner switch's SlotAllocator
        """The inner switch's slot pool (what a server reports)."""
        return self.switch.allocator

    def next_event(self) -> Event | UpstreamJoined | TreeFailed | None:
        """The inner switch's events (JobCreated, MemberJoined, ...) and the tree's."""
        self._pull_switch_events()
        return self._events.popleft() if self._events else None

    def _pull_switch_events(self) -> None:
        ev = self.switch.next_event()
        while ev is not None:
            if isinstance(ev, JobCreated) and ev.job_id == self.child_spec.job_id:
                self.child_slot_base = ev.slot_base
                self._rv[KR.RV.CHILD_BASE] = ev.slot_base
            self._events.append(ev)
            ev = self.switch.next_event()

    def stats(self) -> dict[str, object]:
        """The inner switch's counters plus the tree's."""
        return {**self.switch.stats(), "tree": self.counters}

    # -- children ------------------------------------------------------------------------------

    def _relay_up(self, job: Job, done: np.ndarray, ndone: int, now: float) -> bool:
        """The inner switch completed ``ndone`` rounds of ``job``: send them upstream instead
        of to the children (another job's go to its members as usual: False)."""
        if job.job_id != self.child_spec.job_id or job.token != self.child_spec.token:
            return False
        self._members = [m for m in job.members if m is not None]
        self._rv[KR.RV.CHILD_BASE] = job.slot_base
        self._child_job = job
        if self.parent_slot_base is None:
            self._held.append(done[:ndone].copy())
            return True
        self._send_up(done, ndone, job.bufs, now)
        return True

    def _send_up(self, done: np.ndarray, ndone: int, bufs: np.ndarray, now: float) -> None:
        n = int(K.relay_up(done, ndone, bufs, self._rv, self._up, self._ust, self._utimes, now,
                            self.config.rto_s, self._cnt, self._sendq))
        run = self._runs.setdefault(self.parent_address, [])
        views = self._up_views
        for v, s, ln in self._sendq[:n].tolist():
            run.append(views[v][s][:ln])

    def _collect(self, now: float) -> None:
        """Take the inner switch's output: shadow-copy answers are replaced by the parent's
        result; the rest passes."""
        self._pull_switch_events()  # learn the child job's slot base as soon as it exists
        tx = self.switch.poll_transmit(now)
        replies, runs = tx.datagrams, tx.groups
        c = self.child_spec
        for data, addr in replies:
            if len(data) >= HEADER.size and data[_TYPE_OFFSET] == _RESULT and (
                    HEADER.unpack_from(data)[_JOB:_TOKEN + 1] == (c.job_id, c.token)):
                self._answer_resend(data, addr)  # the tree's job: the parent's result
            else:
                self._out.append((data, addr))  # replies of any other job pass
        for addr, run in runs.items():  # another job's results (not the tree's)
            self._runs.setdefault(addr, []).extend(run)

    def _answer_resend(self, data: bytes | memoryview, addr: Address) -> None:
        """A child lost a result: the parent's, if the rack has it (else it is on its way)."""
        f = HEADER.unpack_from(data)
        v, lane = f[_SET], f[_SLOT] - (self.child_slot_base or 0)
        ust = self._ust
        if not (0 <= lane < ust.shape[2] and ust[KR.U.STATE, v, lane] == KR.ANSWERED
                and (ust[KR.U.SEQ, v, lane], ust[KR.U.CHUNK, v, lane]) == (f[_SEQ], f[_CHUNK])):
            self._counters["resends_dropped"] += 1
            return
        copy = bytearray(self._down_views[v][lane][:int(ust[KR.U.RESULT_LEN, v, lane])])
        copy[_FLAGS_OFFSET] |= _RESENT
        self._out.append((bytes(copy), addr))
        self._counters["results_resent"] += 1

    # -- upstream ------------------------------------------------------------------------------

    @property
    def _parent_text(self) -> str:
        return format_address(self.parent_address)

    def _resend(self, v: int, s: int) -> None:
        self._runs.setdefault(self.parent_address, []).append(
            self._up_views[v][s][:int(self._ust[KR.U.LEN, v, s])])
        self._counters["upstream_retransmissions"] += 1

    def _from_parent(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, i: int,
                     j: int, now: float) -> None:
        """Datagrams ``i .. j-1`` are the parent's: results through the relay kernel, the
        rest (control, errors) one by one."""
        view = None
        while i < j:
            nxt, nsend = K.relay_down(buf, starts, lens, j, i, self._rv, self._ust, self._down,
                                       self._cnt, self._sendq)
            if nsend:
                self._waiting_for = []  # the parent answers: whom it waited for is history
                self._multicast(int(nsend))
                job = self._child_job
                if job is not None:  # the NACK order is the order the children get results
                    K.log_releases(job.jobv, job.st, job.clog, self._sendq, nsend)
            if nxt < j:
                if view is None:
                    view = memoryview(buf)
                o = int(starts[nxt])
                self._from_parent_other(view[o:o + int(lens[nxt])], now)
                nxt += 1
            i = nxt

    def _multicast(self, nsend: int) -> None:
        """Queue the children's results the relay kernel wrote."""
        if not nsend:
            return
        runs = [self._runs.setdefault(m, []) for m in self._members]
        views = self._down_views
        for v, s, ln in self._sendq[:nsend].tolist():
            d = views[v][s][:ln]
            for run in runs:
                run.append(d)

    def _from_parent_other(self, data: Datagram, now: float) -> None:
        try:
            h = unpack_header(data)
        except WireError:
            return
        p = self.parent_spec
        if h.job != p.job_id or h.token != p.token:
            return
        if reply_forged(self._key, data, h):
            self._counters["unauthenticated_reply"] += 1  # not the parent's (auth.py)
            return
        handler = self._handlers.get(h.type)
        if handler is not None:
            handler(h, data, now)

    def _handle_stray_result(self, h: Header, data: Datagram,
                             now: float) -> None:
        """A RESULT the relay kernel did not take (malformed for it): counted."""
        self._cnt[KR.RC.PARENT_DUPLICATES] += 1

    def _handle_waiting(self, h: Header, data: Datagram,
                        now: float) -> None:
        bitmap = int.from_bytes(bytes(unpack_payload(data, h)), "little")
        self._waiting_for = [r for r in range(self.parent_spec.num_workers) if bitmap >> r & 1]

    def _handle_nack(self, h: Header, data: Datagram, now: float) -> None:
        """The parent lacks a chunk of ours on that lane: re-send what is outstanding there."""
        if self.parent_slot_base is None:
            return
        self._counters["parent_nacks"] += 1
        lane = h.slot - self.parent_slot_base
        if not 0 <= lane < self._ust.shape[2]:
            return
        for v in (0, 1):
            if self._ust[KR.U.STATE, v, lane] == KR.SENT:
                self._resend(v, lane)

    def _handle_challenge(self, h: Header, data: Datagram,
                          now: float) -> None:
        if self._join_at is None or h.rank != self.rack:
            return
        try:
            cookie = unpack_challenge(unpack_payload(data, h))
        except WireError:
            return
        self._send_join(now, cookie)

    def _handle_joined(self, h: Header, data: Datagram,
                       now: float) -> None:
        if self._join_at is None:
            return
        try:
            info, _cookie = unpack_joined(unpack_payload(data, h))
        except WireError:
            return
        self._join_at = None
        self.parent_slot_base = info.slot_base
        self._rv[KR.RV.PARENT_BASE] = info.slot_base
        self._events.append(UpstreamJoined(self.rack, info.slot_base))
        held, self._held = self._held, []
        job_bufs = self.switch.job_buffers(self.child_spec.job_id)
        for done in held:
            if job_bufs is not None:
                self._send_up(done, len(done), job_bufs, now)

    def _handle_refused(self, h: Header, data: Datagram,
                        now: float) -> None:
        reason = bytes(unpack_payload(data, h)).decode("utf-8", "replace")
        self._join_at = None
        self._fail(f"rack {self.rack}: parent switch at {self._parent_text} refused JOIN: "
                   f"{reason}")

    def _handle_unknown_job(self, h: Header, data: Datagram,
                            now: float) -> None:
        self._fail(f"rack {self.rack}: the parent switch at {self._parent_text} lost job "
                   f"{self.parent_spec.job_id} (restarted?); the tree cannot continue")

    def _handle_mismatch(self, h: Header, data: Datagram,
                         now: float) -> None:
        self._fail(f"rack {self.rack}: the parent switch at {self._parent_text} reports that "
                   f"the racks disagree about chunk {h.chunk} of operation {h.seq}")

    def _send_join(self, now: float, cookie: bytes = NO_COOKIE) -> None:
        """JOIN the parent (asking for a challenge), or answer its challenge with ``cookie``;
        either way retried after ``join_retry_s`` until JOINED."""
        p = self.parent_spec
        self._out.append((join_datagram(self._key, job=p.job_id, token=p.token, rank=self.rack,
                                        seq=0, cookie=cookie,
                                        info=ControlInfo(p.num_workers, p.window,
                                                         p.elements_per_packet)),
                          self.parent_address))
        self._join_at = now + self.config.join_retry_s

    def _fail(self, reason: str) -> None:
        if self.error is None:
            self.error = reason
            self._events.append(TreeFailed(self.rack, reason))


def _check_specs(parent_spec: JobSpec, child_spec: JobSpec, rack: int) -> None:
    """The child and parent jobs of a rack must line up lane for lane and quantise alike."""
    if (child_spec.window, child_spec.elements_per_packet) != (
            parent_spec.window, parent_spec.elements_per_packet):
        raise ConfigError(
            f"child and parent jobs must have the same window and elements_per_packet "
            f"(lane i of one is lane i of the other): got {child_spec.window}/"
            f"{child_spec.elements_per_packet} and {parent_spec.window}/"
            f"{parent_spec.elements_per_packet}")
    if not 0 <= rack < parent_spec.num_workers:
        raise ConfigError(f"rack must be in 0..{parent_spec.num_workers - 1} (the parent "
                          f"job's ranks), got {rack}")
    if child_spec.scale_count != parent_spec.scale_count:
        raise ConfigError(
            f"child and parent jobs must quantise for the same number of workers (the "
            f"whole tree's, JobSpec.scale_workers): got {child_spec.scale_count} and "
            f"{parent_spec.scale_count}")

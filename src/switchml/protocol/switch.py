"""The switch dataplane: a pool of integer aggregation slots shared by many jobs (sans-I/O).

Theory of operation (SwitchML, NSDI'21 section 4; docs/protocol.md section 3). Each slot
``s`` of a job has two sets ``v`` in {0, 1}. Per (s, v) the switch keeps ``seen`` (bitmap of
ranks that contributed), ``missing`` (contributions still expected; 0 = complete), the int32
accumulator with the block exponents and flags, and the round key ``(seq, chunk)`` of the
operation and chunk that currently own it.

What a REQUEST from rank w for (s, v) with round key K does is one table, ``slots.SLOT_RULES``
(docs/protocol.md prints it): it depends on K against the set's key (older: stale, dropped;
newer: a new round, whose first contributor *overwrites* the accumulator, no explicit reset;
the same round), whether w already contributed (a retransmission: a unicast copy of the result
if the set is complete, else a WAITING reply naming the ranks still missing), whether the set
is complete (a late duplicate from a worker that moved on: dropped) and whether the chunk
agrees with the round's shape (else MISMATCH). The compiled kernel looks every request up in
it and writes the answers to one rank (RESENT results, WAITING, NACKs) itself; disagreeing
ranks come back to Python (``_refuse_mismatch``, ``_waiting_conflict``, in
``switch_replies.py``, a base class of the switch).

Every accepted contribution also clears w in ``seen`` of the other set, as in the original. The
invariant that makes one bit of set enough: a worker reaches (s, v) again only after receiving the
result of (s, 1 - v), which needed every worker's packet; so no worker is ever more than one round
ahead of another on any slot, and a retransmission always finds its round or its shadow copy.

Jobs are isolated: a datagram naming an unknown job, a wrong token, a rank outside the job, an
address other than the one the rank joined from, or a slot outside the job's range is dropped and
counted before it touches any state (``_admit``). The control plane (JOIN, LEAVE, KEEPALIVE)
and those checks are ``switch_control.py``; the counters and job states, ``switch_stats.py``:
base classes of the switch.

Buffers: a result datagram is a memoryview of the slot's own buffer (header + accumulator), so
multicasting costs no copy. It stays valid until the next receive call (``receive_datagram``,
``receive_many``); drivers that keep datagrams longer (the in-memory fabric)
copy them. The per-request rules themselves are ``kernels.switch_requests`` (compiled); this
class holds the state as arrays for it (``jobs.Job``) and handles what is rare in Python
(control messages, disagreeing ranks).
"""

from __future__ import annotations

import functools
from collections import Counter, deque
from collections.abc import Callable, Iterable

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address
from switchml.protocol.auth import Challenges, key_for
from switchml.protocol.config import SwitchConfig
from switchml.protocol.endpoint import Batch, Transmit, flatten_runs
from switchml.protocol.errors import WireError
from switchml.protocol.events import Event, JobRemoved
from switchml.protocol.jobs import Job, SlotAllocator
from switchml.protocol.slots import action_table
from switchml.protocol.switch_control import SwitchControl
from switchml.protocol.switch_replies import SwitchReplies
from switchml.protocol.switch_stats import SwitchStats
from switchml.protocol.wire import (
    AT,
    HEADER,
    HEADER_SIZE,
    Datagram,
    Field,
    MessageType,
    unpack_header,
)

__all__ = ["SlotAllocator", "SwitchDataplane"]

_OTHER = object()  # _check_in_python: the datagram was not a request, and was handled

_JOB_AT = AT["job"]
HOT_JOBS = 4
"""Jobs a transport's compiled loop takes requests of at once (``fast_path_state``)."""

_HALF = 2**31
_MASK32 = 2**32 - 1


class SwitchDataplane(SwitchStats, SwitchReplies, SwitchControl):
    """Aggregate chunks for many jobs; the sans-I/O switch.

    Drive it with the Endpoint contract: after ``receive_datagram`` or ``handle_timer``, drain
    ``datagrams_to_send`` (send each, in order) and ``next_event``; re-arm the timer from
    ``get_timer``. ``receive_datagram`` never raises for peer input: bad datagrams are dropped and
    counted in ``drops`` by reason.

    Example::

        sw = SwitchDataplane(SwitchConfig())
        sw.receive_datagram(data, ("10.0.0.2", 4000), now=0.0)
        for datagram, address in sw.datagrams_to_send(now=0.0):
            sock.sendto(datagram, address)
    """

    def __init__(self, config: SwitchConfig | None = None) -> None:
        self.config = config or SwitchConfig()
        self.allocator = SlotAllocator(self.config.pool_slots)
        self._jobs: dict[int, Job] = {}
        self._out: list[tuple[bytes | memoryview, Address]] = []
        # Results per destination in order (a run to one member: one GSO send), queued per job
        # as rows (``Job.pend``), made into views only by ``_output_runs``.
        self._runs: dict[Address, list[memoryview]] = {}
        self._pending: list[Job] = []  # jobs with results queued
        self._events: deque[Event] = deque()
        self._drops: Counter[str] = Counter()
        self._membership: Counter[str] = Counter()  # members joined and left, jobs expired
        self._cnt = np.zeros(K.SC.N, np.int64)  # the kernel's counters (kernels.SC)
        self._done = np.empty((K.MAX_BATCH, 3), np.int64)  # rounds one call completes
        self._run_rows = np.empty((K.MAX_BATCH, 4), np.int64)  # _runs_to_send's plan
        self._starts = np.empty(1, np.int64)  # receive_datagram's batch of one
        self._lens = np.empty(1, np.int64)
        self._one_sender = np.zeros(1, np.int64)
        # The kernel's replies (NACK, RESENT, WAITING): rows of the largest job's reply_bytes.
        self._reply_rows = np.empty((K.REPLIES_PER_CALL, HEADER_SIZE), np.uint8)
        self._reply_meta = np.empty((K.REPLIES_PER_CALL, 2), np.int64)
        self._hot: Job | None = None  # the job of the last request admitted
        # The jobs whose requests were taken last, the hot one first (at most HOT_JOBS): a
        # transport's compiled loop takes all of theirs (jobs streaming at once, as HSDP's
        # shard groups do, interleave datagram by datagram).
        self._warm: list[Job] = []
        self._stable = False  # whether the last batch's sender numbers were stable
        self._learned: list[Job] = []  # jobs whose mkeys this call learned (unstable numbers)
        self.packets_in = 0
        self.packets_out = 0
        self.mismatch_sent = 0
        self.challenges_sent = 0
        self._strangers_key = functools.lru_cache(maxsize=256)(
            functools.partial(key_for, self.config.secret))
        self.challenges = Challenges(self.config.join_challenge_s)
        """JOIN cookies (``auth.Challenges``): random per switch."""
        self._challenge_tokens = (float(self.config.challenges_per_s or 0.0), 0.0)
        """The CHALLENGE budget's bucket: (tokens, when last filled)."""
        self._removed: dict[int, float] = {}  # job -> when it went, for a cookie's lifetime
        self._now = 0.0
        self._handlers = {
            MessageType.JOIN: self._handle_join,
            MessageType.LEAVE: self._handle_leave,
            MessageType.KEEPALIVE: self._handle_keepalive,
        }
        self.on_completed: Callable[[Job, np.ndarray, int, float], bool] | None = None
        """A relay's hook (a rack switch of a tree, ``tree.py``): called with the rounds a
        kernel call completed (``done[:ndone]`` rows ``(set, slot, length)``, results in the
        job's buffers) before they are multicast; returns True when it took them instead."""
        self.relayed_jobs: set[int] = set()
        """Jobs whose rounds a relay releases later than they complete (the rack's child job):
        their NACK order is logged when the relay sends the results (``kernels.log_releases``),
        not at completion."""
        self._rules = action_table()  # slots.SLOT_RULES, as the kernel looks them up
        # The slot rule's answers that the kernel leaves to Python (slots.SlotAction).
        self._answers = {
            K.SS.WAITING_CONFLICT: self._waiting_conflict,
            K.SS.WAITING_GONE: self._waiting_gone,
            K.SS.ROUND_GONE: self._round_gone,
            K.SS.MISMATCH: self._refuse_mismatch,
        }

    # -- Endpoint contract -------------------------------------------------------------------

    def receive_datagram(self, data: Datagram | np.ndarray, addr: Address,
                         now: float) -> None:
        """Process one datagram. Call ``datagrams_to_send`` afterwards: results are views of
        slot memory, valid until the next receive. Never raises for peer input: bad
        datagrams are dropped and counted."""
        self._now = now
        buf = K.as_buffer(data)
        self._starts[0], self._lens[0] = 0, len(buf)
        self._receive(buf, self._starts, self._lens, self._one_sender, 1, lambda _key: addr, now,
                      False)

    def receive_many(self, batch: Batch, now: float) -> None:
        """Process a batch of datagrams of one or several senders (``endpoint.Batch``), in
        order, as the same datagrams one by one. Call ``datagrams_to_send`` afterwards. More
        than ``kernels.MAX_BATCH`` datagrams is malformed input (a real GRO buffer or
        ``recvmmsg`` holds at most 64): the excess is dropped and counted."""
        buf, starts, lens, senders, count, address_of, stable, _ = batch
        self._now = now
        if count > K.MAX_BATCH:
            self.packets_in += count - K.MAX_BATCH
            self._drops["too_many_segments"] += count - K.MAX_BATCH
            count = K.MAX_BATCH
        self._receive(buf, starts, lens, senders, count, address_of, now, stable)

    def _receive(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                 senders: np.ndarray, count: int, address_of: Callable[[int], Address],
                 now: float, stable: bool, start: int = 0) -> None:
        """Requests go through the compiled kernel, all of one job's members' in one call;
        control messages and anything rare datagram by datagram.

        The kernel takes a rank's requests from the sender number Python admitted it from
        (``Job.mkeys``, learned here by ``_admit``): with ``stable`` sender numbers that holds
        across calls, so a busy switch enters Python once per receive call; otherwise only
        within this call."""
        if stable != self._stable:  # another numbering: what was learned means nothing now
            self._forget_senders(self._jobs.values())
            self._stable = stable
        self.packets_in += count - start
        view = memoryview(buf)
        # The job of the last request taken, most likely the next one's; with unstable
        # numbers the kernel knows no sender yet, so Python looks first.
        job = self._hot if stable else None
        admitted_at = -1  # the datagram Python admitted last (the kernel takes it)
        switched_at = -1  # the datagram the kernel was last tried on for another known job
        i = start
        while i < count:
            if job is not None:
                j, code = self._run_kernel(job, buf, starts, lens, senders, count, i, now)
                if code == K.SS.DONE:
                    break
                if code != K.SS.OTHER:
                    i = self._after_kernel(job, code, j, view, starts, senders, address_of)
                    continue
                if j == admitted_at:  # can't happen: _admit checked the same
                    self._drops["internal"] += 1
                    i = j + 1
                    continue
                i = j
                if stable and j != switched_at:
                    # A request of another job whose members the kernel knows (jobs that
                    # stream at once interleave): the kernel checks it itself.
                    other = self._known_job_at(buf, starts, lens, j)
                    if other is not None and other is not job:
                        job, switched_at = other, j
                        continue
            # Datagram i is not a request of a known member of ``job``: check it in Python.
            admitted = self._check_in_python(buf, view, starts, lens, senders, i, address_of,
                                             now, stable)
            if admitted is None:  # dropped
                i += 1
            elif admitted is _OTHER:  # not a request: handled
                job = self._hot  # (a LEAVE or a lease may have removed it)
                i += 1
            else:
                job = admitted
                admitted_at = i  # the kernel takes it from here
        if self._learned:
            self._forget_senders(self._learned)
            self._learned.clear()

    def _check_in_python(self, buf: np.ndarray, view: memoryview, starts: np.ndarray,
                         lens: np.ndarray, senders: np.ndarray, i: int,
                         address_of: Callable[[int], Address], now: float,
                         stable: bool) -> Job | object | None:
        """Datagram ``i``, which no kernel call took: anything but a request is handled here
        (``_OTHER``); a request of a member ``_admit`` admits teaches its job the member's
        sender number and becomes the hot job (returned: the kernel takes the datagram next);
        None: dropped."""
        o = int(starts[i])
        end = o + int(lens[i])
        addr = address_of(int(senders[i]))
        f = self._request_fields(buf, view, o, end)
        if f is None:
            self._receive_other(view[o:end], addr, now)
            return _OTHER
        admitted = self._admit(f, addr, now, view[o:end])
        if admitted is None:
            return None
        admitted.mkeys[f[Field.RANK]] = senders[i]
        if not stable:
            self._learned.append(admitted)
        self._hot = admitted
        self._warm_job(admitted)
        return admitted

    def _known_job_at(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                      i: int) -> Job | None:
        """The live job datagram ``i`` names, if it is long enough to be a request."""
        if int(lens[i]) < HEADER_SIZE:
            return None
        o = int(starts[i]) + _JOB_AT
        return self._jobs.get(int.from_bytes(buf[o:o + 4].tobytes(), "little"))

    def _warm_job(self, job: Job) -> None:
        """``job`` took requests last: first of the warm jobs."""
        warm = self._warm
        if warm and warm[0] is job:
            return
        if job in warm:
            warm.remove(job)
        warm.insert(0, job)
        del warm[HOT_JOBS:]

    def _run_kernel(self, job: Job, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                    senders: np.ndarray, count: int, i: int, now: float) -> tuple[int, int]:
        """One call of the kernel for ``job`` from datagram ``i``; queue its results and
        replies. Returns ``(next, code)``."""
        nxt, ndone, nreply, code = K.switch_requests(
            buf, starts, lens, senders, count, i, now, job.jobv, job.st, job.seen,
            job.conflict, job.bufs, job.clog, job.cursor, job.mkeys, job.heard, self._rules,
            self._cnt, self._done, self._replies_for(job), self._reply_meta)
        if nxt > i or code != K.SS.OTHER:
            job.renew(now)
            job.started = True
            self._warm_job(job)
        if nreply:
            self._queue_replies(job, nreply)
        if ndone and (self.on_completed is None
                      or not self.on_completed(job, self._done, ndone, now)):
            self._queue_results(job, ndone)
        return nxt, code

    def _replies_for(self, job: Job) -> np.ndarray:
        """The kernel's reply rows, grown to hold ``job``'s."""
        if self._reply_rows.shape[1] < job.reply_bytes:
            self._reply_rows = np.empty((K.REPLIES_PER_CALL, job.reply_bytes), np.uint8)
        return self._reply_rows

    def fast_path_state(self) -> tuple[list[Job], tuple] | None:
        """What a transport's compiled receive loop (``transport/switchpath.py``) needs to
        take the requests of the jobs that took the last ones (at most ``HOT_JOBS``, the last
        first), as ``receive_many`` would, and send their results and replies itself:
        ``(jobs, the kernel's arguments shared by all jobs: rules, counters, completions,
        reply rows and their ranks and lengths)``. None when only the Python path may run: no
        job took requests, sender numbers are not stable, something is queued to send, or a
        relay takes the completions (a rack switch). The loop returns to Python
        (``after_fast_path``, then ``resume``) for anything else."""
        jobs = self._warm
        if (not jobs or not self._stable or self._out or self._pending or self._runs
                or self.on_completed is not None):
            return None
        for job in jobs:
            replies = self._replies_for(job)
        return list(jobs), (self._rules, self._cnt, self._done, replies, self._reply_meta)

    def after_fast_path(self, jobs: list[Job], taken: list[int], *, results_out: int,
                        replies: int, now: float) -> None:
        """Count what the compiled loop did: ``taken[k]`` datagrams received and taken by the
        kernel for ``jobs[k]``, ``results_out`` result datagrams and ``replies`` replies
        (NACK, RESENT, WAITING) sent."""
        for job, n in zip(jobs, taken):
            if n:
                self.packets_in += n
                job.renew(now)
                job.started = True
        self.packets_out += results_out + replies

    def resume(self, batch: Batch, job: Job, code: int, at: int, now: float) -> None:
        """Go on with a batch where the compiled loop's kernel call for ``job`` stopped
        (``code`` at datagram ``at``; the datagrams before it are taken, their results and
        replies sent): answer the stop as ``receive_many`` would, then take the rest. Call
        ``poll_transmit`` afterwards."""
        self._now = now
        buf, starts, lens, senders, count, address_of, stable, _ = batch
        i = at
        if code not in (K.SS.DONE, K.SS.OTHER):
            self.packets_in += 1 if self._answers.get(code) is not None else 0
            i = self._after_kernel(job, code, at, memoryview(buf), starts, senders, address_of)
        if i < count:
            self._receive(buf, starts, lens, senders, count, address_of, now, stable, i)

    @staticmethod
    def _forget_senders(jobs: Iterable[Job]) -> None:
        for job in jobs:
            job.mkeys[:] = -1

    def _after_kernel(self, job: Job, code: int, nxt: int, view: memoryview,
                      starts: np.ndarray, senders: np.ndarray,
                      address_of: Callable[[int], Address]) -> int:
        """Answer what stopped the kernel (the slot rule's Python actions); return the
        datagram to go on from."""
        answer = self._answers.get(code)
        if answer is not None:  # about datagram nxt, which the kernel did not take
            answer(job, HEADER.unpack_from(view, int(starts[nxt])),
                  address_of(int(senders[nxt])))
            return nxt + 1
        if code == K.SS.CONFLICT_ADDED:  # about datagram nxt - 1, which it took
            self._mismatch(job, HEADER.unpack_from(view, int(starts[nxt - 1])),
                           address_of(int(senders[nxt - 1])), None)
        return nxt  # (REPLIES_FULL: queued already)

    def _queue_replies(self, job: Job, n: int) -> None:
        """Send the replies the kernel wrote (``_reply_rows``, each to one rank): NACKs (the
        switch lacks an earlier chunk of the rank's: ``kernels.nacks._behind_on`` found
        it), RESENT results and WAITING (answers to re-sent requests)."""
        rows, members = self._reply_rows, job.members
        for k, (rank, length) in enumerate(self._reply_meta[:n].tolist()):
            self._out.append((rows[k, :length].tobytes(), members[rank]))

    @staticmethod
    def _request_fields(buf: np.ndarray, view: memoryview, o: int, end: int) -> tuple | None:
        """The header tuple of a well-formed int32/int16 REQUEST at ``buf[o:end]``, or None
        (the kernel's own framing rule, ``kernels.request_framing``)."""
        if not K.request_framing(buf, o, end - o):
            return None
        return HEADER.unpack_from(view, o)

    def _receive_other(self, data: memoryview, addr: Address, now: float) -> None:
        """Control messages and malformed datagrams."""
        if self._stranger_join(data, addr, now):
            return
        try:
            h = unpack_header(data)
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        handler = self._handlers.get(h.type)
        if handler is None:
            # A REQUEST reaching here is well-formed but not int32/int16.
            reason = "bad_payload" if h.type is MessageType.REQUEST else "unexpected_type"
            self._drops[reason] += 1
            return
        handler(h, data, addr, now)

    def _queue_results(self, job: Job, ndone: int) -> None:
        """Queue the rounds the kernel completed (``_done[:ndone]``) to go to every member:
        one array copy per kernel call (``poll_transmit`` sends them)."""
        q = job.npend
        if q + ndone > len(job.pend):
            self._materialize(job)
            q = 0
        if q == 0:
            self._pending.append(job)
        job.pend[q:q + ndone] = self._done[:ndone]
        job.npend = q + ndone

    def _materialize(self, job: Job) -> None:
        """Turn a job's queued results into per-member lists of views (``_output_runs``)."""
        n, job.npend = job.npend, 0
        if not n:
            return
        runs = self._runs
        member_runs = []
        for m in job.members:
            if m is not None:
                run = runs.get(m)
                if run is None:
                    run = runs[m] = []
                member_runs.append(run)
        views = job.views
        full = len(views[0][0])
        for v, s, size in job.pend[:n].tolist():
            datagram = views[v][s] if size == full else views[v][s][:size]
            for run in member_runs:
                run.append(datagram)

    def handle_timer(self, now: float) -> None:
        """Complete the rounds of quorum jobs whose deadline passed (``kernels.expire_rounds``)
        and expire the leases of jobs that have been silent for ``lease_timeout_s``."""
        self._now = now
        for job in self._jobs.values():
            if job.jobv[K.J.DEADLINE_US] > 0 and job.next_expiry() <= now:
                ndone = K.expire_rounds(job.jobv, job.st, job.seen, job.conflict, job.bufs,
                                        job.clog, job.cursor, job.mkeys, job.heard, now,
                                        self._cnt, self._done)
                if ndone:
                    self._queue_results(job, ndone)
        lease = self.config.lease_timeout_s
        for job in [j for j in self._jobs.values() if j.last_seen + lease <= now]:
            self.remove_job(job.job_id, f"lease expired after {lease:g} s of silence")
            self._membership["jobs_expired"] += 1

    def timer_granularity(self) -> float:
        """How long a driver may go without reading ``get_timer`` again: a round that gains
        its quorum minimum opens a deadline the last reading did not know of. A quarter of the
        shortest quorum deadline of the live jobs (at least 1 ms); else 1 s."""
        deadlines = [int(j.jobv[K.J.DEADLINE_US]) for j in self._jobs.values()
                     if j.jobv[K.J.DEADLINE_US] > 0]
        return max(0.001, min(deadlines) * 0.25e-6) if deadlines else 1.0

    def get_timer(self) -> float | None:
        """When the next lease runs out, or a quorum job's deadline completes a round (None
        without jobs)."""
        if not self._jobs:
            return None
        return min(min(j.last_seen for j in self._jobs.values()) + self.config.lease_timeout_s,
                   min(j.next_expiry() for j in self._jobs.values()))

    def datagrams_to_send(self, now: float) -> list[tuple[bytes | memoryview, Address]]:
        """Return and forget the datagrams to send: replies in order, then results (in order
        per destination). Valid until the next receive."""
        return flatten_runs(*self._output_runs())

    def poll_transmit(self, now: float, *, gso: tuple[int, int] | None = None,
                      compiled: bool = False) -> Transmit:
        """What to send (``endpoint.Transmit``), the one verb of a UDP transport: the replies
        one by one, then the results. ``compiled``: the results stay in the jobs' own arrays
        for the transport's compiled sender (``Transmit.compiled``: ``(job, count)`` pairs,
        :meth:`_results_to_send`); else, with ``gso`` ``(max_segments, max_bytes)``, as GSO
        runs a kernel plans (:meth:`_runs_to_send`); else grouped per destination."""
        if compiled:
            out, jobs = self._results_to_send()
            return Transmit(out, {}, [], jobs)
        if gso is not None:
            out, runs = self._runs_to_send(max_segments=gso[0], max_bytes=gso[1])
            return Transmit(out, {}, runs)
        out, groups = self._output_runs()
        return Transmit(out, groups, [])

    def _output_runs(self) -> tuple[list[tuple[bytes | memoryview, Address]],
                                    dict[Address, list[memoryview]]]:
        """The replies, in order, and the results grouped per destination, in order (no
        tuple per datagram). Valid until the next receive."""
        for job in self._pending:
            self._materialize(job)
        self._pending = []
        out, runs = self._out, self._runs
        if out:
            self._out = []
            self.packets_out += len(out)
        else:
            out = []  # a fresh list: the caller may extend it
        if runs:
            self._runs = {}
            self.packets_out += sum(len(r) for r in runs.values())
        return out, runs

    def _results_to_send(self) -> tuple[list[tuple[bytes | memoryview, Address]],
                                        list[tuple[Job, int]]]:
        """For a transport that sends results from the jobs' own arrays
        (``transport/fastpath.ResultSender``): ``(datagrams, jobs)``, the replies (and
        anything already made into views) one by one, then each job with results queued and
        how many: ``job.pend[:n]`` rows ``(set, slot, length)``, the results in
        ``job.bufs[set, slot]``, to go to every joined member. Valid until the next receive."""
        out, pending = self._take_queued()
        jobs = []
        for job in pending:
            n, job.npend = job.npend, 0
            if n:
                jobs.append((job, n))
                self.packets_out += n * sum(m is not None for m in job.members)
        return out, jobs

    def _take_queued(self) -> tuple[list[tuple[bytes | memoryview, Address]], list[Job]]:
        """The replies (and results already made into views), and the jobs with results
        queued: both taken (the caller sends them)."""
        out, self._out = self._out, []
        self.packets_out += len(out)
        if self._runs:  # made into views already (a queue that overflowed)
            runs0, self._runs = self._runs, {}
            self.packets_out += sum(len(r) for r in runs0.values())
            out = flatten_runs(out, runs0)
        pending, self._pending = self._pending, []
        return out, pending

    def _runs_to_send(self, *, max_segments: int, max_bytes: int
                      ) -> tuple[list[tuple[bytes | memoryview, Address]],
                                 list[tuple[list[memoryview], int, Address]]]:
        """For a pump with UDP GSO: ``(datagrams, runs)``.

        ``datagrams`` (replies, and anything already made into views) go first, one by one;
        each run ``(buffers, size, address)`` is one GSO send of results: the buffers,
        gathered, are datagrams of ``size`` bytes (the last may be shorter), at most
        ``max_segments`` and ``max_bytes`` in all. A kernel plans them
        (``kernels.plan_result_runs``): consecutive slots' results are one slice of the set's
        buffers, and every member gets the same runs, so a batch costs Python a few objects
        per run and member, not one per result. Valid until the next receive."""
        out, pending = self._take_queued()
        runs: list[tuple[list[memoryview], int, Address]] = []
        for job in pending:
            n, job.npend = job.npend, 0
            if not n:
                continue
            members = [m for m in job.members if m is not None]
            pend, stride = job.pend, job.stride
            if len(self._run_rows) < n:
                self._run_rows = np.empty((n, 4), np.int64)
            nr = K.plan_result_runs(pend, n, stride, max_segments, max_bytes, self._run_rows)
            for first, count, size, contiguous in self._run_rows[:nr].tolist():
                if contiguous:
                    v, s = int(pend[first, 0]), int(pend[first, 1])
                    start = s * stride
                    end = start + (count - 1) * stride + int(pend[first + count - 1, 2])
                    bufs = [job.flat[v][start:end]]
                else:
                    views = job.views
                    bufs = [views[v][s][:ln]
                            for v, s, ln in pend[first:first + count].tolist()]
                for m in members:
                    runs.append((bufs, size, m))
            self.packets_out += n * len(members)
        return out, runs

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    def remove_job(self, job_id: int, reason: str) -> bool:
        """Forget a job and free its slots (operator action or last LEAVE)."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return False
        job.npend = 0  # results not yet sent go nowhere
        if self._hot is job:
            self._hot = None
        if job in self._warm:
            self._warm.remove(job)
        self.allocator.release(job.slot_base, job.window)
        # JOINs challenged before now must not bring the job back (a replay within a
        # cookie's lifetime); remembered for that lifetime only.
        horizon = self._now - self.challenges.lifetime_s
        self._removed = {j: t for j, t in self._removed.items() if t >= horizon}
        self._removed[job_id] = self._now
        self._events.append(JobRemoved(job_id, reason))
        return True

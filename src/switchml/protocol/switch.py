"""The switch dataplane: a pool of integer aggregation slots shared by many jobs (sans-I/O).

Theory of operation (SwitchML, NSDI'21 section 4; docs/protocol.md section 3). Each slot
``s`` of a job has two sets ``v`` in {0, 1}. Per (s, v) the switch keeps ``seen`` (bitmap of
ranks that contributed), ``missing`` (contributions still expected; 0 = complete), the int32
accumulator with the block exponents and flags, and the round key ``(seq, chunk)`` of the
operation and chunk that currently own it.

A REQUEST from rank w for (s, v) with key K:

1. K older than the set's key: a stale packet from an earlier round or operation: dropped
   (``stale``). The P4 original cannot tell rounds apart; a software switch can (docs/design.md).
2. K newer: a new round. The first contributor *overwrites* the accumulator (no explicit reset),
   ``seen = {w}``, ``missing = n - 1``; the other set keeps its last result (the shadow copy).
3. K equal and w already in ``seen``: a retransmission. If the set is complete, w lost the result:
   it gets a unicast copy (``RESENT`` flag). If the set is open, its data is already in: it gets a
   WAITING reply that names the ranks still missing (so a stuck worker can say who is silent).
4. K equal, w not in ``seen``: add. If the set is complete this is a late duplicate from a worker
   that has already moved on (its bit was cleared by its packet to the other set): dropped.
   Otherwise add, OR the flags, max the look-ahead exponent; when ``missing`` reaches 0 the result
   goes to every member of the job.

Every accepted contribution also clears w in ``seen`` of the other set, as in the original. The
invariant that makes one bit of set enough: a worker reaches (s, v) again only after receiving the
result of (s, 1 - v), which needed every worker's packet; so no worker is ever more than one round
ahead of another on any slot, and a retransmission always finds its round or its shadow copy.

Jobs are isolated: a datagram naming an unknown job, a wrong token, a rank outside the job, an
address other than the one the rank joined from, or a slot outside the job's range is dropped and
counted before it touches any state.

Buffers: a result datagram is a memoryview of the slot's own buffer (header + accumulator), so
multicasting costs no copy. It stays valid until the next ``receive_datagram`` call; drivers that
keep datagrams longer (the in-memory fabric) copy them.
"""

from __future__ import annotations

import hmac
from collections import Counter, deque
from dataclasses import dataclass, field

import numpy as np

from switchml.protocol.config import SwitchConfig
from switchml.protocol.errors import WireError
from switchml.protocol.events import Event, JobCreated, JobRefused, JobRemoved, MemberJoined
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    VERSION,
    ChunkShape,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    join_proof,
    pack_control_info,
    pack_header,
    pack_mismatch,
    unpack_header,
    unpack_join,
    unpack_payload,
)

__all__ = ["SlotAllocator", "SwitchDataplane"]

_REQUEST = int(MessageType.REQUEST)
_INT32 = int(ElementType.INT32)
_INT16 = int(ElementType.INT16)
_DATA_ITEMSIZE = {_INT32: 4, _INT16: 2}
_ACC_DTYPE = {_INT32: "<i4", _INT16: "<i2"}
_SHAPE_FLAGS = int(Flags.HAS_DATA | Flags.HAS_EXP)
_NONFINITE = int(Flags.NONFINITE)
_RESULT = int(MessageType.RESULT)
_UNKNOWN_JOB = int(MessageType.UNKNOWN_JOB)
_BYTES = int(ElementType.BYTES)

Address = tuple[str, int]
_HALF = 2**31
_EPOCH_TRAIL = 2**30
_MASK32 = 2**32 - 1


class SlotAllocator:
    """First-fit allocator of contiguous slot ranges out of ``[0, pool_slots)``."""

    def __init__(self, pool_slots: int) -> None:
        self.pool_slots = pool_slots
        self._free: list[tuple[int, int]] = [(0, pool_slots)]  # sorted (base, size)

    @property
    def free_slots(self) -> int:
        return sum(size for _, size in self._free)

    def largest_free(self) -> int:
        return max((size for _, size in self._free), default=0)

    def allocate(self, size: int) -> int | None:
        """Return the base of ``size`` contiguous slots, or None if no free range fits."""
        for i, (base, free) in enumerate(self._free):
            if free >= size:
                if free == size:
                    del self._free[i]
                else:
                    self._free[i] = (base + size, free - size)
                return base
        return None

    def release(self, base: int, size: int) -> None:
        """Give a range back, merging with its free neighbours."""
        self._free.append((base, size))
        self._free.sort()
        merged: list[tuple[int, int]] = []
        for b, s in self._free:
            if merged and merged[-1][0] + merged[-1][1] == b:
                merged[-1] = (merged[-1][0], merged[-1][1] + s)
            else:
                merged.append((b, s))
        self._free = merged


@dataclass(slots=True)
class _Job:
    """One job's membership and slot state. Lists are indexed ``[set][local slot]``."""

    job_id: int
    token: int
    num_workers: int
    slot_base: int
    window: int
    elements_per_packet: int
    members: list[Address | None]
    all_ranks: int = 0
    seen: list[list[int]] = field(default_factory=list)
    missing: list[list[int]] = field(default_factory=list)
    seq: list[list[int]] = field(default_factory=list)  # -1: never used
    chunk: list[list[int]] = field(default_factory=list)
    count: list[list[int]] = field(default_factory=list)
    elem: list[list[int]] = field(default_factory=list)  # INT32 or INT16 for the round
    flags: list[list[int]] = field(default_factory=list)
    exp_data: list[list[int]] = field(default_factory=list)
    exp_next: list[list[int]] = field(default_factory=list)
    digest: list[list[int]] = field(default_factory=list)  # operation digest of the round
    conflict: list[list[int]] = field(default_factory=list)  # ranks whose chunk disagreed
    conflict_shape: list[list[ChunkShape | None]] = field(default_factory=list)
    buf: list[list[bytearray]] = field(default_factory=list)
    acc: dict[int, list[list[np.ndarray]]] = field(default_factory=dict)
    elements_aggregated: int = 0
    last_seen: float = 0.0  # ``now`` of the last valid datagram: the lease
    min_seq: int | None = None  # set by an epoch JOIN: older requests predate a restart
    started: bool = False  # a request was accepted (membership is then fixed)

    def __post_init__(self) -> None:
        w = self.window
        self.all_ranks = (1 << self.num_workers) - 1
        self.seen = [[0] * w, [0] * w]
        self.missing = [[0] * w, [0] * w]
        self.seq = [[-1] * w, [-1] * w]
        self.chunk = [[0] * w, [0] * w]
        self.count = [[0] * w, [0] * w]
        self.elem = [[_INT32] * w, [_INT32] * w]
        self.flags = [[0] * w, [0] * w]
        self.exp_data = [[EXP_ZERO] * w, [EXP_ZERO] * w]
        self.exp_next = [[EXP_ZERO] * w, [EXP_ZERO] * w]
        self.digest = [[0] * w, [0] * w]
        self.conflict = [[0] * w, [0] * w]
        self.conflict_shape = [[None] * w, [None] * w]
        size = HEADER_SIZE + 4 * self.elements_per_packet
        self.buf = [[bytearray(size) for _ in range(w)] for _ in range(2)]
        # One accumulator view per wire width over the same bytes.
        self.acc = {
            elem: [[np.frombuffer(b, dtype=dt, offset=HEADER_SIZE) for b in bufs]
                   for bufs in self.buf]
            for elem, dt in _ACC_DTYPE.items()
        }

    @property
    def info(self) -> ControlInfo:
        return ControlInfo(self.num_workers, self.window, self.elements_per_packet, self.slot_base)

    def memory_bytes(self) -> int:
        return 2 * self.window * (HEADER_SIZE + 4 * self.elements_per_packet)


class SwitchDataplane:
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
        self._jobs: dict[int, _Job] = {}
        self._out: list[tuple[bytes | memoryview, Address]] = []
        self._events: deque[Event] = deque()
        self.drops: Counter[str] = Counter()
        """Dropped datagrams by reason (``bad_magic``, ``unknown_job``, ``bad_token``, ...)."""
        self.packets_in = 0
        self.packets_out = 0
        self.results_multicast = 0
        self.results_resent = 0
        self.waiting_sent = 0
        self.mismatch_sent = 0
        self.rounds_abandoned = 0
        self._now = 0.0
        self._handlers = {
            MessageType.JOIN: self._handle_join,
            MessageType.LEAVE: self._handle_leave,
            MessageType.KEEPALIVE: self._handle_keepalive,
        }

    # -- Endpoint contract -------------------------------------------------------------------

    def receive_datagram(self, data: bytes | bytearray | memoryview, addr: Address,
                         now: float) -> None:
        """Process one datagram. Call ``datagrams_to_send`` afterwards."""
        self.packets_in += 1
        self._now = now
        # NOTE: REQUEST fast path, inlined for speed: one struct unpack, no Header object.
        if len(data) >= HEADER_SIZE:
            f = HEADER.unpack_from(data)
            if (f[2] == _REQUEST and f[0] == MAGIC and f[1] == VERSION and f[4] <= 1
                    and not f[3] & ~KNOWN_FLAGS and f[12] in _DATA_ITEMSIZE
                    and len(data) == HEADER_SIZE + _DATA_ITEMSIZE[f[12]] * f[11]):
                self._handle_request(f, data, addr, now)
                return
        try:
            h = unpack_header(data)
        except WireError as exc:
            self.drops[exc.reason] += 1
            return
        handler = self._handlers.get(h.type)
        if handler is None:
            # A REQUEST reaching here is well-formed but not int32/int16 (the fast path takes
            # those).
            reason = "bad_payload" if h.type is MessageType.REQUEST else "unexpected_type"
            self.drops[reason] += 1
            return
        handler(h, data, addr, now)

    def handle_timer(self, now: float) -> None:
        """Expire the leases of jobs that have been silent for ``lease_timeout_s``."""
        lease = self.config.lease_timeout_s
        for job in [j for j in self._jobs.values() if j.last_seen + lease <= now]:
            self.remove_job(job.job_id, f"lease expired after {lease:g} s of silence")

    def get_timer(self) -> float | None:
        """When the next lease runs out (None without jobs)."""
        if not self._jobs:
            return None
        return min(j.last_seen for j in self._jobs.values()) + self.config.lease_timeout_s

    def datagrams_to_send(self, now: float) -> list[tuple[bytes | memoryview, Address]]:
        """Return and forget the datagrams to send, in order. Valid until the next receive."""
        out = self._out
        if out:
            self._out = []
            self.packets_out += len(out)
        return out

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    # -- Introspection -----------------------------------------------------------------------

    @property
    def jobs(self) -> dict[int, ControlInfo]:
        """Job id -> geometry of every live job."""
        return {j.job_id: j.info for j in self._jobs.values()}

    def stats(self) -> dict[str, object]:
        """A snapshot of the counters (for logs, ``switchml stats`` and tests)."""
        return {
            "packets_in": self.packets_in,
            "packets_out": self.packets_out,
            "results_multicast": self.results_multicast,
            "results_resent": self.results_resent,
            "waiting_sent": self.waiting_sent,
            "mismatch_sent": self.mismatch_sent,
            "rounds_abandoned": self.rounds_abandoned,
            "drops": dict(self.drops),
            "jobs": len(self._jobs),
            "slots_in_use": self.config.pool_slots - self.allocator.free_slots,
            "elements_aggregated": {j.job_id: j.elements_aggregated for j in self._jobs.values()},
            "memory_bytes": sum(j.memory_bytes() for j in self._jobs.values()),
        }

    # -- Control -----------------------------------------------------------------------------

    def _refuse(self, h: Header, addr: Address, reason: str) -> None:
        self.drops["refused"] += 1
        self._events.append(JobRefused(h.job, h.rank, addr, reason))
        payload = reason.encode()[:1024]
        reply = Header(MessageType.REFUSED, h.job, rank=h.rank, token=h.token,
                       count=len(payload), elem=ElementType.BYTES)
        self._out.append((pack_header(reply) + payload, addr))

    def _handle_join(self, h: Header, data: bytes | bytearray | memoryview, addr: Address,
                     now: float) -> None:
        """JOIN creates the job on first use (same token and geometry for every rank after),
        refreshes its lease (as KEEPALIVE does for idle workers), and carries in ``seq`` the
        first operation of the worker's epoch (raised after a switch restart)."""
        try:
            asked, proof = unpack_join(unpack_payload(data, h))
        except WireError as exc:
            self.drops[exc.reason] += 1
            return
        job = self._jobs.get(h.job)
        if job is None:
            if h.rank >= asked.num_workers:  # refuse before allocating anything
                self._refuse(h, addr, f"rank {h.rank} outside job {h.job} of "
                             f"{asked.num_workers}")
                return
            secret = self.config.secret
            if secret is not None and not hmac.compare_digest(
                    proof, join_proof(secret, h.job, h.token, asked)):
                self.drops["bad_secret"] += 1
                self._refuse(h, addr, "creating a job on this switch needs its secret "
                             "(SWITCHML_SECRET)")
                return
            job = self._create_job(h, asked, addr)
            if job is None:
                return
        elif h.token != job.token:
            self.drops["bad_token"] += 1
            return
        elif (asked.num_workers, asked.window, asked.elements_per_packet) != (
                job.num_workers, job.window, job.elements_per_packet):
            self._refuse(h, addr, f"job {h.job} exists with n={job.num_workers} "
                         f"window={job.window} elements_per_packet={job.elements_per_packet}; "
                         f"asked n={asked.num_workers} window={asked.window} "
                         f"elements_per_packet={asked.elements_per_packet}")
            return
        if h.rank >= job.num_workers:
            self._refuse(h, addr, f"rank {h.rank} outside job {h.job} of {job.num_workers}")
            return
        old = job.members[h.rank]
        if old != addr:
            if old is not None and job.started:
                self._refuse(h, addr, f"rank {h.rank} of job {h.job} is joined from "
                             f"{old[0]}:{old[1]} and the job is running; a restarted worker "
                             "cannot take over its state: start a new job")
                return
            job.members[h.rank] = addr
            self._events.append(MemberJoined(job.job_id, h.rank, addr))
        if h.seq and (job.min_seq is None or ((h.seq - job.min_seq) & _MASK32) < _HALF):
            job.min_seq = h.seq  # a new epoch: older requests are stale from now on
        job.last_seen = now
        reply = Header(MessageType.JOINED, h.job, rank=h.rank, token=h.token, count=16,
                       elem=ElementType.BYTES)
        self._out.append((pack_header(reply) + pack_control_info(job.info), addr))

    def _create_job(self, h: Header, asked: ControlInfo, addr: Address) -> _Job | None:
        cfg = self.config
        problem = None
        if not 1 <= asked.num_workers <= cfg.max_workers:
            problem = f"num_workers must be in 1..{cfg.max_workers}, got {asked.num_workers}"
        elif not 1 <= asked.elements_per_packet <= cfg.max_elements_per_packet:
            problem = (f"elements_per_packet must be in 1..{cfg.max_elements_per_packet}, got "
                       f"{asked.elements_per_packet}")
        elif not 1 <= asked.window <= cfg.max_window:
            problem = f"window must be in 1..{cfg.max_window}, got {asked.window}"
        if problem is not None:
            self._refuse(h, addr, problem)
            return None
        base = self.allocator.allocate(asked.window)
        if base is None:
            self._refuse(h, addr, f"no room for job {h.job}: asked {asked.window} slots, the "
                         f"largest free range is {self.allocator.largest_free()} of a pool of "
                         f"{cfg.pool_slots}")
            return None
        try:
            job = _Job(h.job, h.token, asked.num_workers, base, asked.window,
                       asked.elements_per_packet, [None] * asked.num_workers)
        except MemoryError:
            self.allocator.release(base, asked.window)
            self._refuse(h, addr, f"no memory for job {h.job}")
            return None
        job.last_seen = self._now
        self._jobs[h.job] = job
        self._events.append(JobCreated(h.job, job.num_workers, base, job.window,
                                       job.elements_per_packet))
        return job

    def _handle_leave(self, h: Header, data: bytes | bytearray | memoryview,
                      addr: Address, now: float) -> None:
        """A member leaves; the job and its slots go when the last joined member has left."""
        job = self._jobs.get(h.job)
        if job is not None:
            if h.token != job.token:
                self.drops["bad_token"] += 1
                return
            if h.rank < job.num_workers and job.members[h.rank] == addr:
                job.members[h.rank] = None
            if all(m is None for m in job.members):
                self.remove_job(h.job, "left")
        reply = Header(MessageType.LEFT, h.job, rank=h.rank, token=h.token)
        self._out.append((pack_header(reply), addr))

    def _handle_keepalive(self, h: Header, data: bytes | bytearray | memoryview,
                          addr: Address, now: float) -> None:
        """Renew the lease of a member's job; an unknown job is answered with UNKNOWN_JOB."""
        job = self._jobs.get(h.job)
        if job is None:
            self.drops["unknown_job"] += 1
            self._unknown_job(HEADER.unpack_from(data), addr)
            return
        if h.token != job.token or h.rank >= job.num_workers:
            self.drops["bad_keepalive"] += 1
            return
        member = job.members[h.rank]
        if member is None:  # a member of an earlier incarnation of the job: rejoin
            self.drops["not_joined"] += 1
            self._unknown_job(HEADER.unpack_from(data), addr)
            return
        if member != addr:
            self.drops["bad_keepalive"] += 1
            return
        job.last_seen = now

    def remove_job(self, job_id: int, reason: str) -> bool:
        """Forget a job and free its slots (operator action or last LEAVE)."""
        job = self._jobs.pop(job_id, None)
        if job is None:
            return False
        self.allocator.release(job.slot_base, job.window)
        self._events.append(JobRemoved(job_id, reason))
        return True

    # -- Data --------------------------------------------------------------------------------

    def _handle_request(self, f: tuple, data: bytes | bytearray | memoryview,
                        addr: Address, now: float) -> None:
        """Steps 1-4 of the module docstring, after the isolation checks.

        ``f`` is the raw header tuple (see ``wire.HEADER``), already checked for framing.
        """
        (_m, _v, _t, flags, v, rank, job_id, token, seq, chunk, slot, count, elem, digest, exp_data,
         exp_next) = f
        job = self._jobs.get(job_id)
        if job is None:
            self.drops["unknown_job"] += 1
            self._unknown_job(f, addr)
            return
        if token != job.token:
            self.drops["bad_token"] += 1
            return
        if rank >= job.num_workers:
            self.drops["bad_rank"] += 1
            return
        member = job.members[rank]
        if member != addr:
            if member is None:
                # Right token, but this rank has not joined this incarnation of the job (the
                # switch restarted, or its lease expired and another rank re-created it).
                self.drops["not_joined"] += 1
                self._unknown_job(f, addr)
            else:
                self.drops["wrong_source"] += 1
            return
        if job.min_seq is not None:
            ahead = (seq - job.min_seq) & _MASK32
            if ahead >= _HALF:
                self.drops["stale_epoch"] += 1  # from before a restart: tell it to catch up
                self._unknown_job(f, addr)
                return
            if ahead > _EPOCH_TRAIL:  # keep the bound within reach of wrapping seq numbers
                job.min_seq = (seq - _EPOCH_TRAIL) & _MASK32
        job.last_seen = now
        job.started = True
        s = slot - job.slot_base
        if not 0 <= s < job.window:
            self.drops["bad_slot"] += 1
            return
        if count * _DATA_ITEMSIZE[elem] > 4 * job.elements_per_packet:
            self.drops["bad_payload"] += 1
            return
        me = 1 << rank
        order = self._compare_round(job, v, s, seq, chunk)
        if order < 0:
            self.drops["stale"] += 1
            return
        if order > 0:
            self._start_round(job, data, v, s, me, seq, chunk, count, elem, flags, exp_data,
                              exp_next, digest)
        else:
            prior = job.seen[v][s]
            if prior & me:
                self._answer_retransmission(job, rank, seq, chunk, slot, v, s, addr)
                return
            if job.missing[v][s] == 0:
                self.drops["late_duplicate"] += 1
                return
            if (count != job.count[v][s] or elem != job.elem[v][s] or digest != job.digest[v][s]
                    or exp_data != job.exp_data[v][s] or (flags ^ job.flags[v][s]) & _SHAPE_FLAGS):
                self.drops["inconsistent_chunk"] += 1
                self._mismatch(job, rank, seq, chunk, slot, v, s, addr,
                               ChunkShape(count, elem, flags & _SHAPE_FLAGS, exp_data, digest))
                return
            if count:
                acc = job.acc[elem][v][s][:count]
                np.add(acc, np.frombuffer(data, dtype=acc.dtype, count=count, offset=HEADER_SIZE),
                       out=acc)
            job.seen[v][s] = prior | me
            job.flags[v][s] |= flags & _NONFINITE
            if exp_next > job.exp_next[v][s]:
                job.exp_next[v][s] = exp_next
            job.missing[v][s] -= 1
            if job.conflict[v][s]:  # this chunk agrees with the round, but others did not
                job.conflict[v][s] &= ~me
                if job.conflict[v][s]:
                    self._mismatch(job, rank, seq, chunk, slot, v, s, addr, None)
        job.seen[1 - v][s] &= ~me
        if job.missing[v][s] == 0:
            self._complete(job, rank, seq, chunk, slot, v, s)

    def _unknown_job(self, f: tuple, addr: Address) -> None:
        """Answer with UNKNOWN_JOB: a header-only echo, never larger than the request."""
        self._out.append((HEADER.pack(MAGIC, VERSION, _UNKNOWN_JOB, 0, f[4], f[5], f[6], f[7],
                                      f[8], f[9], f[10], 0, _BYTES, 0, EXP_ZERO, EXP_ZERO),
                          addr))

    @staticmethod
    def _compare_round(job: _Job, v: int, s: int, seq: int, chunk: int) -> int:
        """Order (seq, chunk) against the set's round: -1 older, 0 same, 1 newer.

        ``seq`` compares with serial-number arithmetic (RFC 1982), so it may wrap.
        """
        cur = job.seq[v][s]
        if cur < 0:
            return 1
        if seq != cur:
            return 1 if ((seq - cur) & _MASK32) < _HALF else -1
        cur_chunk = job.chunk[v][s]
        return 0 if chunk == cur_chunk else (1 if chunk > cur_chunk else -1)

    def _start_round(self, job: _Job, data: bytes | bytearray | memoryview, v: int, s: int,
                     me: int, seq: int, chunk: int, count: int, elem: int, flags: int,
                     exp_data: int, exp_next: int, digest: int) -> None:
        """First contributor overwrites: no explicit reset of a recycled set."""
        if job.seq[v][s] >= 0 and job.missing[v][s]:
            self.rounds_abandoned += 1  # only after a failed operation; counted for operators
        if count:
            acc = job.acc[elem][v][s]
            acc[:count] = np.frombuffer(data, dtype=acc.dtype, count=count, offset=HEADER_SIZE)
        job.seq[v][s] = seq
        job.chunk[v][s] = chunk
        job.count[v][s] = count
        job.elem[v][s] = elem
        job.flags[v][s] = flags & (_NONFINITE | _SHAPE_FLAGS)
        job.exp_data[v][s] = exp_data
        job.exp_next[v][s] = exp_next
        job.digest[v][s] = digest
        job.seen[v][s] = me
        job.missing[v][s] = job.num_workers - 1
        job.conflict[v][s] = 0

    def _complete(self, job: _Job, rank: int, seq: int, chunk: int, slot: int, v: int,
                  s: int) -> None:
        """Write the result header into the slot buffer and send it to every member."""
        count = job.count[v][s]
        elem = job.elem[v][s]
        buf = job.buf[v][s]
        HEADER.pack_into(buf, 0, MAGIC, VERSION, _RESULT, job.flags[v][s], v, rank,
                         job.job_id, job.token, seq, chunk, slot, count,
                         elem, job.digest[v][s], job.exp_data[v][s], job.exp_next[v][s])
        datagram = memoryview(buf)[: HEADER_SIZE + _DATA_ITEMSIZE[elem] * count]
        for member in job.members:
            if member is not None:
                self._out.append((datagram, member))
        self.results_multicast += 1
        job.elements_aggregated += count

    def _round_shape(self, job: _Job, v: int, s: int) -> ChunkShape:
        return ChunkShape(job.count[v][s], job.elem[v][s], job.flags[v][s] & _SHAPE_FLAGS,
                          job.exp_data[v][s], job.digest[v][s])

    def _mismatch(self, job: _Job, rank: int, seq: int, chunk: int, slot: int, v: int, s: int,
                  addr: Address, refused: ChunkShape | None) -> None:
        """Tell ``rank`` that the ranks disagree about this chunk (the round can't complete).

        ``refused``: the shape of ``rank``'s own chunk that was just refused (it is compared
        with the round's); the round's contributors are told at once too, the first time
        ``rank`` disagrees, so that nobody waits for a retransmission (a rank that fails and
        exits may take the only other witness with it). None: ``rank`` is a contributor of a
        round that already has a conflict, and is told about the refused chunks.
        """
        if refused is not None:
            first = not job.conflict[v][s] >> rank & 1
            job.conflict[v][s] |= 1 << rank
            job.conflict_shape[v][s] = refused
            mine = self._round_shape(job, v, s)
            self._send_mismatch(job, rank, seq, chunk, slot, v, mine, refused, job.seen[v][s],
                                addr)
            if first:
                seen = job.seen[v][s]
                for r, member in enumerate(job.members):
                    if seen >> r & 1 and member is not None:
                        self._send_mismatch(job, r, seq, chunk, slot, v, refused, mine, 1 << rank,
                                            member)
        else:
            theirs = job.conflict_shape[v][s]
            assert theirs is not None
            self._send_mismatch(job, rank, seq, chunk, slot, v, theirs,
                                self._round_shape(job, v, s), job.conflict[v][s], addr)

    def _send_mismatch(self, job: _Job, rank: int, seq: int, chunk: int, slot: int, v: int,
                       theirs: ChunkShape, mine: ChunkShape, ranks: int, addr: Address) -> None:
        payload = pack_mismatch(theirs, mine, ranks, job.num_workers)
        reply = Header(MessageType.MISMATCH, job.job_id, rank=rank, token=job.token, seq=seq,
                       chunk=chunk, slot=slot, set_bit=v, count=len(payload))
        self._out.append((pack_header(reply) + payload, addr))
        self.mismatch_sent += 1

    def _answer_retransmission(self, job: _Job, rank: int, seq: int, chunk: int, slot: int,
                               v: int, s: int, addr: Address) -> None:
        if job.missing[v][s] == 0:
            # The result was lost on its way to this worker: resend the stored copy.
            count = job.count[v][s]
            datagram = bytearray(job.buf[v][s][: HEADER_SIZE + _DATA_ITEMSIZE[job.elem[v][s]]
                                               * count])
            datagram[4] |= Flags.RESENT
            self._out.append((bytes(datagram), addr))
            self.results_resent += 1
            return
        if job.conflict[v][s]:
            # Still open, and some rank sent this chunk with another shape: it never completes.
            self._mismatch(job, rank, seq, chunk, slot, v, s, addr, None)
            return
        # Still open: this worker's data is in; tell it who is missing.
        missing = job.all_ranks & ~job.seen[v][s]
        payload = missing.to_bytes((job.num_workers + 7) // 8, "little")
        reply = Header(MessageType.WAITING, job.job_id, rank=rank, token=job.token, seq=seq,
                       chunk=chunk, slot=slot, set_bit=v, count=len(payload))
        self._out.append((pack_header(reply) + payload, addr))
        self.waiting_sent += 1
        self.drops["duplicate"] += 1


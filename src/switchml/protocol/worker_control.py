"""A worker's control plane: JOIN (challenge, proof, every shard), rejoining a switch that lost
the job, LEAVE and KEEPALIVE.

Part of :class:`~switchml.protocol.worker.WorkerEndpoint` (a base class of it, split off so that
the data path's module stays readable). Every state change goes through the table in
``lifecycle.py`` (``_move``). A JOIN is retried with backoff (:class:`ControlRetry`) until
every shard of the switch granted the job, or ``join_timeout_s``; a CHALLENGE is answered with
the proof under the job key (``protocol/auth.py``). When the switch lost the job
(UNKNOWN_JOB), the worker joins again on a new epoch (``EPOCH_SEQ_STRIDE``) and, if an
operation was in flight, runs it again from its input.
"""

from __future__ import annotations

from collections import Counter, deque

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address
from switchml.protocol.auth import data_key, join_datagram, leave_proof
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import LocalProtocolError, WireError
from switchml.protocol.events import Event, Joined, JoinFailed, Left, OperationRestarted
from switchml.protocol.lifecycle import WorkerInput, WorkerState, can
from switchml.protocol.operation import Operation
from switchml.protocol.wire import (
    AUTH_DATA,
    NO_COOKIE,
    ControlInfo,
    Datagram,
    Flags,
    Header,
    MessageType,
    joined_incarnation,
    pack_header,
    pack_leave,
    unpack_challenge,
    unpack_joined,
    unpack_payload,
)

__all__ = ["EPOCH_SEQ_STRIDE", "ControlRetry", "WorkerControl"]

EPOCH_SEQ_STRIDE = 2**16
"""After the switch lost the job, the operation restarts as ``seq + EPOCH_SEQ_STRIDE``: every rank
computes the same number, and the switch drops anything older (docs/protocol.md, epochs)."""


class ControlRetry:
    """A control request (JOIN, LEAVE) retried with exponential backoff until a deadline."""

    __slots__ = ("at", "backoff", "config", "deadline")

    def __init__(self, config: WorkerConfig) -> None:
        self.config = config
        self.at = self.deadline = 0.0
        self.backoff = config.control_retry_s

    def start(self, now: float, timeout_s: float) -> None:
        self.deadline = now + timeout_s
        self.backoff = self.config.control_retry_s

    def sent(self, now: float) -> None:
        self.at = now + self.backoff
        self.backoff = min(self.backoff * 2, self.config.control_retry_max_s)


class WorkerControl:
    """JOIN, CHALLENGE, JOINED, REFUSED, UNKNOWN_JOB and LEFT handlers, the control timer and
    the control datagrams of a worker (``WorkerEndpoint``'s base class).

    Uses the worker's state (declared below) and its methods ``_move``, ``_fail`` and
    ``_begin``.
    """

    spec: JobSpec
    rank: int
    config: WorkerConfig
    state: WorkerState
    error: str | None
    switch_addresses: tuple[Address, ...]
    _switch_text: str
    _shard_bases: list[int | None]
    _shards_left: set[int]
    _cookies: list[bytes | None]
    _data_keys: list[bytes | None]
    _key: bytes
    _unsealed_refusal: str | None
    _seq: int
    _epoch_seq: int
    _late: bool
    _keepalive_at: float
    _op: Operation | None
    _out: list[tuple[Datagram, Address]]
    _events: deque[Event]
    _control: ControlRetry
    _next_set: np.ndarray
    _drops: Counter[str]
    _counters: Counter[str]

    @property
    def slot_base(self) -> int:
        """The first slot the switch (shard 0 of a sharded switch) granted the job."""
        return self._shard_bases[0] or 0

    @property
    def slot_bases(self) -> list[int]:
        """The slot base each shard granted (one entry for an unsharded switch)."""
        return [b or 0 for b in self._shard_bases]

    def _move(self, what: WorkerInput, detail: str = "") -> None:
        raise NotImplementedError

    def _fail(self, reason: str, what: WorkerInput = WorkerInput.FAIL) -> None:
        raise NotImplementedError

    def _begin(self, op: Operation, now: float) -> None:
        raise NotImplementedError

    def join(self, now: float, *, late: bool = False) -> None:
        """Send JOIN (retried until answered or ``join_timeout_s``). Call ``datagrams_to_send``.

        ``late``: this rank joins a quorum job that is running (a replacement for a rank that
        died, or one that fell too far behind, from a new address): the switch takes it in
        place of the rank's old address, and it keeps every result it is sent until it
        ``resume``s from a live rank's ``position`` (docs/protocol.md section 7).

        Raises:
            LocalProtocolError: if already joined or closed, or ``late`` for a job without a
                quorum (its rounds wait for every rank: a rank cannot join one running).
        """
        if late and not self.spec.quorum:
            raise LocalProtocolError("only a quorum job can take a rank while it runs (its "
                                     "rounds go on without a rank that joins late); this job "
                                     "has no quorum")
        self._move(WorkerInput.JOIN)
        self._late = late
        self._control.start(now, self.config.join_timeout_s)
        self._send_join(now)

    def _handle_challenge(self, h: Header, data: Datagram, now: float) -> None:
        """The switch (shard) asks this JOIN to prove itself: answer with its cookie and the
        proof under the job key, to the shard that asked (not retried: the next retry of the
        JOIN draws a new challenge)."""
        if not can(self.state, WorkerInput.CHALLENGED):
            self._drops["unexpected_control"] += 1
            return
        try:
            cookie = unpack_challenge(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        shard = h.chunk if len(self._shard_bases) > 1 else 0
        if shard >= len(self._shard_bases) or h.rank != self.rank:
            self._drops["bad_shard" if h.rank == self.rank else "foreign"] += 1
            return
        if self._shard_bases[shard] is not None:
            self._drops["late_challenge"] += 1  # this shard granted the job already
            return
        self._counters["challenges_answered"] += 1
        self._out.append((self._join_datagram(cookie), self.switch_addresses[shard]))

    def _handle_joined(self, h: Header, data: Datagram, now: float) -> None:
        if not can(self.state, WorkerInput.JOINED):
            # a late answer to a retried JOIN, or a replay: changes nothing, counted
            self._drops["unexpected_control"] += 1
            return
        if h.seq != self._epoch_seq:
            self._drops["stale_joined"] += 1  # an answer to a JOIN of an earlier epoch
            return
        try:
            info, cookie = unpack_joined(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        spec = self.spec
        if (info.num_workers, info.window, info.elements_per_packet, info.options) != (
                spec.num_workers, spec.window, spec.elements_per_packet,
                AUTH_DATA if spec.auth_data else 0):
            self._join_failed(f"switch granted {info}, which does not match the job spec")
            return
        shard = h.chunk if len(self._shard_bases) > 1 else 0  # a shard says which it is
        if shard >= len(self._shard_bases):
            self._drops["bad_shard"] += 1
            return
        self._shard_bases[shard] = info.slot_base
        self._cookies[shard] = cookie
        self._data_keys[shard] = (data_key(self._key, joined_incarnation(unpack_payload(data, h)))
                                  if spec.auth_data else None)
        if any(b is None for b in self._shard_bases):
            return  # other shards still to answer
        if self.state is WorkerState.REJOINING:
            self._resume_after_rejoin(now)
            return
        self._move(WorkerInput.JOINED)
        self._keepalive_at = now + self.config.keepalive_s
        self._events.append(Joined(self.slot_base, info.window))

    def _handle_refused(self, h: Header, data: Datagram, now: float) -> None:
        if not can(self.state, WorkerInput.JOIN_FAILED):
            self._drops["unexpected_control"] += 1
            return
        if h.seq != self._epoch_seq:
            self._drops["stale_refused"] += 1  # an answer to a JOIN of an earlier epoch
            return
        reason = bytes(unpack_payload(data, h)).decode("utf-8", "replace")
        self._join_failed(f"switch at {self._switch_text} refused JOIN: {reason}")

    def _join_failed(self, reason: str) -> None:
        """JOINING: the job can't be joined (JoinFailed). REJOINING: the operation fails."""
        if self.state is WorkerState.REJOINING:
            self._fail(f"restart after the switch lost the job failed: {reason}",
                       WorkerInput.JOIN_FAILED)
            return
        self._move(WorkerInput.JOIN_FAILED)
        self.error = reason
        self._events.append(JoinFailed(reason))

    def _handle_unknown_job(self, h: Header, data: Datagram, now: float) -> None:
        """The switch has lost the job (restarted, lease expired) or we are behind its epoch."""
        st = self.state
        if st is WorkerState.BUSY and self._op is not None and h.seq == self._op.seq:
            self._restart(now)
        elif st is WorkerState.READY and h.seq == self._epoch_seq:
            # Idle, and the answer is to our current keep-alive (not a stray echo of an older
            # epoch): the next operation starts the new epoch; every rank computes the same seq,
            # and a fresh switch means every slot starts on set 0, as for the busy ranks.
            self._epoch_seq = self._seq = (self._seq + EPOCH_SEQ_STRIDE) & 0xFFFFFFFF
            self._rejoin(now)
        else:
            self._drops["stale_unknown_job"] += 1

    def _rejoin(self, now: float) -> None:
        """Join the switch again on the current epoch (it lost the job)."""
        self._move(WorkerInput.SWITCH_LOST_JOB)
        self._next_set[:] = 0  # a fresh switch: every rank starts on set 0
        self._shard_bases = [None] * len(self.switch_addresses)
        self._control.start(now, self.config.join_timeout_s)
        self._send_join(now)

    def _restart(self, now: float) -> None:
        """Join again on a new epoch, then run the operation from its input."""
        op = self._op
        assert op is not None
        if op.restarts >= self.config.max_restarts:
            self._fail(f"operation {op.seq} of job {self.spec.job_id}: the switch at "
                       f"{self._switch_text} lost the job {op.restarts + 1} times "
                       f"(restarts allowed: {self.config.max_restarts})")
            return
        new_seq = (op.seq + EPOCH_SEQ_STRIDE) & 0xFFFFFFFF
        self._events.append(OperationRestarted(op.seq, new_seq, "the switch lost the job"))
        self._counters["operations_restarted"] += 1
        # From here on the operation is ``new_seq``: a failure is reported under it, and late
        # results of the old epoch no longer match it.
        op.seq = new_seq
        self._epoch_seq = new_seq
        self._rejoin(now)

    def _resume_after_rejoin(self, now: float) -> None:
        """Every shard granted the job again: run the operation from its input (or fail it,
        if its arrays can't be allocated again: peer input never raises)."""
        old = self._op
        assert old is not None
        try:
            op = old.restarted(self._epoch_seq, self.spec, self.rank, self.slot_bases,
                               self._data_keys)
        except MemoryError:
            self._fail(f"operation {old.seq}: no memory to restart it after the switch lost "
                       "the job")
            return
        self._move(WorkerInput.JOINED)
        self._seq = (self._epoch_seq + 1) & 0xFFFFFFFF
        self._begin(op, now)

    def _handle_left(self, h: Header, data: Datagram, now: float) -> None:
        if not can(self.state, WorkerInput.LEFT):
            self._drops["unexpected_control"] += 1
            return
        self._shards_left.add(h.chunk if len(self.switch_addresses) > 1 else 0)
        if len(self._shards_left) < len(self.switch_addresses):
            return  # other shards still to answer
        self._move(WorkerInput.LEFT)
        self._events.append(Left())

    def _handle_control_timer(self, now: float) -> None:
        """JOIN or LEAVE: retry it, or give up at its deadline."""
        st = self.state
        if now < self._control.deadline:
            if now >= self._control.at:
                (self._send_leave if st is WorkerState.CLOSING else self._send_join)(now)
        elif st is WorkerState.CLOSING:
            self._move(WorkerInput.LEFT)  # no answer to LEAVE: closed anyway
            self._events.append(Left())
        else:
            said = ("" if self._unsealed_refusal is None else
                    f"; a REFUSED that does not verify under this worker's job key (another "
                    f"secret than the switch's, or forged) said: {self._unsealed_refusal}")
            self._join_failed(f"switch at {self._switch_text} did not answer JOIN for job "
                              f"{self.spec.job_id} within {self.config.join_timeout_s:g} s"
                              + said)

    def _join_datagram(self, cookie: bytes = NO_COOKIE) -> bytes:
        """JOIN of this rank on the current epoch: without a cookie, a request for a
        challenge; with one, proven with the job key."""
        spec = self.spec
        return join_datagram(self._key, job=spec.job_id, token=spec.token, rank=self.rank,
                             seq=self._epoch_seq, cookie=cookie,
                             info=ControlInfo(spec.num_workers, spec.window,
                                              spec.elements_per_packet,
                                              quorum=spec.quorum or 0,
                                              quorum_min=spec.quorum_min or 0,
                                              deadline_us=round(1e6 * (spec.quorum_deadline_s
                                                                       or 0)),
                                              options=AUTH_DATA if spec.auth_data else 0))

    def _send_join(self, now: float) -> None:
        datagram = self._join_datagram()
        for shard, base in enumerate(self._shard_bases):
            if base is None:  # not joined yet (on this epoch)
                self._out.append((datagram, self.switch_addresses[shard]))
        self._control.sent(now)

    def _send_keepalive(self, now: float) -> None:
        auth = int(Flags.AUTH) if self.spec.auth_data else 0
        datagram = pack_header(Header(MessageType.KEEPALIVE, self.spec.job_id, rank=self.rank,
                                      token=self.spec.token, seq=self._epoch_seq, flags=auth))
        for key, a in zip(self._data_keys, self.switch_addresses, strict=True):
            # An authenticated job's keep-alive renews liveness only with its MAC (each
            # shard's key: its incarnation's).
            self._out.append((datagram + K.data_mac(key, datagram) if key else datagram, a))
        self._keepalive_at = now + self.config.keepalive_s

    def _send_leave(self, now: float) -> None:
        """LEAVE every shard that granted the job, proven with the cookie it granted it with
        (a shard that never answered JOIN holds no membership to end)."""
        spec = self.spec
        for i, a in enumerate(self.switch_addresses):
            if i in self._shards_left:
                continue
            cookie = self._cookies[i]
            if cookie is None:
                self._shards_left.add(i)
                continue
            proof = leave_proof(self._key, job=spec.job_id, token=spec.token, rank=self.rank,
                                cookie=cookie)
            self._out.append((pack_leave(job=spec.job_id, token=spec.token, rank=self.rank,
                                         proof=proof), a))
        self._control.sent(now)

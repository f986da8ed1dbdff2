"""The worker stream: one rank's side of a job (sans-I/O).

Theory of operation. An operation of ``N`` elements is cut into ``L = ceil(N / k)`` blocks. It
uses ``E = min(W, L)`` lanes; lane ``i`` is local slot ``i`` of the job's window. Packet (chunk)
``p`` travels on lane ``p mod E``; the first ``E`` packets go out at once, and the result of packet
``p`` releases packet ``p + E`` on the same lane (self-clocking: the result is the only
acknowledgement, results may arrive in any order, and nothing ever waits for a global counter).

Sets: every lane keeps the set it will use next, flipping it at each new packet, across
operations. So every slot alternates sets forever, which is the invariant the switch relies on (no
worker more than one round ahead on any slot). This per-slot state replaces the original's
``shift`` carried across operations: it gives the same alternation and stays right when an
operation uses fewer lanes than the window (``L < W``).

Floats use look-ahead block exponents (SwitchML section 5.2): packet ``p`` carries the exponent of
block ``p`` (if ``p < L``) and the data of block ``p - E`` (if ``p >= E``), scaled with the max
exponent the switch returned in the result of packet ``p - E``. So a float operation has
``T = L + E`` packets; an int32 operation has ``T = L`` and is exact.

States: every change of :attr:`WorkerEndpoint.state` goes through the table in
``lifecycle.py``. Loss recovery (timeouts, NACKs, RACK) is ``recovery.py``; a retransmission is
rebuilt from the input it still holds, never replayed from stored bytes. Results of other
operations, repeated results and results for chunks not in flight are dropped. An operation
with no progress for ``op_timeout_s`` fails with a reason naming the switch (no answer at all)
or the silent ranks (the switch said, in WAITING replies, who has not contributed). After a
failed operation the endpoint is in ``ERROR``: the job's slot state can no longer be trusted,
so a new job must be joined. Joining, rejoining, keep-alives and leaving are
``worker_control.py``; the switch's other answers (WAITING, NACK, MISMATCH) and the sealed-reply
check, ``worker_replies.py``; a quorum job's results kept for a rank behind,
``worker_ahead.py``: base classes of the endpoint.
"""

from __future__ import annotations

import numbers
from collections import Counter, deque
from collections.abc import Sequence

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address, as_addresses, format_addresses
from switchml.protocol.auth import worker_key
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.endpoint import Batch, Transmit
from switchml.protocol.errors import ConfigError, LocalProtocolError
from switchml.protocol.events import (
    Event,
    Left,
    OperationAborted,
    OperationCompleted,
)
from switchml.protocol.lifecycle import WorkerInput, WorkerState, can, next_state
from switchml.protocol.operation import Operation, check_wire, validate_arrays
from switchml.protocol.recovery import LossRecovery
from switchml.protocol.wire import Datagram, MessageType
from switchml.protocol.worker_ahead import WorkerAhead
from switchml.protocol.worker_control import EPOCH_SEQ_STRIDE, ControlRetry, WorkerControl
from switchml.protocol.worker_replies import WorkerReplies

__all__ = ["EPOCH_SEQ_STRIDE", "RECOVERY_COUNTERS", "WorkerEndpoint", "WorkerState",
           "validate_arrays"]


# Kernel counters (kernels.WC) by the names ``counters`` and ``drops`` report.
_KERNEL_COUNTERS = (
    ("results_received", K.WC.RESULTS), ("packets_sent", K.WC.PACKETS_SENT),
    ("payload_bytes_sent", K.WC.PAYLOAD_BYTES), ("payload_bytes_resent", K.WC.PAYLOAD_RESENT),
    ("retransmissions", K.WC.RETRANSMISSIONS), ("spurious_fast_retransmissions", K.WC.SPURIOUS),
    ("tail_probes", K.WC.TAIL_PROBES), ("nack_retransmissions", K.WC.NACK_RESENDS),
    ("nacks_ignored", K.WC.NACKS_IGNORED), ("timer_retransmissions", K.WC.TIMER_RESENDS),
    ("idle_probes", K.WC.IDLE_PROBES), ("results_left_out", K.WC.LEFT_OUT),
    ("blocks_clamped", K.WC.CLAMPED))
_KERNEL_DROPS = (("stale_result", K.WC.STALE_RESULT), ("duplicate_result", K.WC.DUPLICATE_RESULT),
                 ("bad_slot", K.WC.BAD_SLOT), ("bad_count", K.WC.BAD_COUNT),
                 ("bad_mac", K.WC.BAD_MAC))
_Run = tuple[list[Datagram], int, Address]
"""A GSO run: buffers whose bytes are datagrams of ``size`` bytes, and their destination."""
RECOVERY_COUNTERS = ("nack_retransmissions", "timer_retransmissions", "tail_probes", "idle_probes",
                     "nacks_ignored", "waiting_received")
"""The ``counters`` that say how a worker recovered loss (benchmarks and the simulator report
them summed over the workers)."""


class WorkerEndpoint(WorkerReplies, WorkerAhead, WorkerControl):
    """One rank of a job: join, run all-reduce operations one at a time, leave.

    Endpoint contract (``protocol/endpoint.py``): after every call that takes ``now``, drain
    ``datagrams_to_send`` and ``next_event`` and re-arm the timer from ``get_timer``. Peer
    input never raises; local misuse raises :class:`LocalProtocolError` and leaves the state
    unchanged. To queue many operations and get a handle for each, drive it through a
    :class:`~switchml.protocol.session.WorkerSession`.

    Example::

        w = WorkerEndpoint(spec=spec, rank=0, switch_address=("127.0.0.1", 48864))
        w.join(now)                      # -> JOIN datagram; event Joined when answered
        seq = w.start_allreduce(x, out, now)   # -> first window of chunks
        # ... pump until next_event() returns OperationCompleted(seq)
    """

    def __init__(self, *, spec: JobSpec, rank: int, switch_address: Address | Sequence[Address],
                 config: WorkerConfig | None = None) -> None:
        if not isinstance(spec, JobSpec):
            raise LocalProtocolError(f"spec must be a JobSpec, got {type(spec).__name__}")
        if not (config is None or isinstance(config, WorkerConfig)):
            raise LocalProtocolError(f"config must be a WorkerConfig or None, got "
                                     f"{type(config).__name__}")
        if not isinstance(rank, numbers.Integral) or isinstance(rank, bool):
            raise LocalProtocolError(f"rank must be an integer, got {rank!r}")
        if not 0 <= rank < spec.num_workers:
            raise LocalProtocolError(f"rank must be in 0..{spec.num_workers - 1}, got {rank}")
        self.spec, self.rank = spec, rank
        # One switch, or the shards of a sharded switch (lane i goes to shard i mod S).
        try:
            shards = as_addresses(switch_address)
        except ConfigError as exc:
            raise LocalProtocolError(f"switch_address: {exc}") from None
        self.switch_addresses: tuple[Address, ...] = shards
        self.switch_address: Address = shards[0]
        self._switch_set = frozenset(shards)  # who may send this endpoint anything
        self._switch_text = format_addresses(shards)
        self._shard_bases: list[int | None] = [None] * len(shards)
        self._shards_left: set[int] = set()
        self._cookies: list[bytes | None] = [None] * len(shards)  # each shard's JOINED cookie
        self._data_keys: list[bytes | None] = [None] * len(shards)  # (auth_data: JOINED's)
        self.config = config or WorkerConfig()
        cfg = self.config  # the key this rank proves its JOIN and LEAVE with
        self._key = worker_key(spec.job_id, spec.token, secret=cfg.secret,
                               job_key_=cfg.job_key, tenant_key_=cfg.tenant_key)
        self.state = WorkerState.NEW
        self.error: str | None = None
        self._seq = 0
        self._epoch_seq = 0  # first operation of the current epoch; sent in JOIN/KEEPALIVE
        self._keepalive_at = 0.0
        self._op: Operation | None = None
        self._kept = np.empty(0, np.uint8)  # in-place operations' inputs (``_keep_buffer``)
        # A quorum job's results of operations this rank has not started, per operation: pieces
        # (bytes, starts, lengths, chunks) (``_keep_ahead``).
        self._ahead: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]] = {}
        self._ahead_bytes = 0
        self._feeding = False  # (``_feed_kept`` runs the receive path itself)
        self._muted = False  # (``_begin``: requests of an operation kept whole are not sent)
        self._out: list[tuple[Datagram, Address]] = []
        self._events: deque[Event] = deque()
        self._control = ControlRetry(self.config)
        self._unsealed_refusal: str | None = None  # what a REFUSED we could not verify said
        self._next_set = np.zeros(spec.window, np.int64)  # per lane, kept across operations
        self._cnt = np.zeros(K.WC.N, np.int64)
        self.recovery = LossRecovery(self.config, self._cnt)
        self._starts = np.empty(1, np.int64)  # receive_datagram's batch of one
        self._lens = np.empty(1, np.int64)
        self._drops: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._handlers = {
            MessageType.RESULT: self._handle_stray_result,
            MessageType.WAITING: self._handle_waiting,
            MessageType.MISMATCH: self._handle_mismatch,
            MessageType.NACK: self._handle_nack,
            MessageType.GONE: self._handle_gone,
            MessageType.JOINED: self._handle_joined,
            MessageType.CHALLENGE: self._handle_challenge,
            MessageType.REFUSED: self._handle_refused,
            MessageType.LEFT: self._handle_left,
            MessageType.UNKNOWN_JOB: self._handle_unknown_job,
        }

    def _move(self, what: WorkerInput, detail: str = "") -> None:
        """Change state through the table (raises, changing nothing, if it has no entry)."""
        self.state = next_state(self.state, what, detail)

    # -- User commands -----------------------------------------------------------------------

    def start_allreduce(self, data: np.ndarray, out: np.ndarray, now: float, *, bits: int = 32,
                        residual: np.ndarray | None = None) -> int:
        """Start summing ``data`` over all ranks into ``out`` (may be ``data`` itself).

        Every rank must start the same operations, with the same size, dtype and ``bits``, in
        the same order. Returns the operation's sequence number; ``OperationCompleted(seq)``
        follows. Call ``datagrams_to_send`` afterwards.

        Args:
            bits: 32, or 16 for floats: 16-bit fixed point on the wire, half the bytes, about
                ``15 - log2(n)`` bits of the block max (pair it with ``residual``).
            residual: float array of data's size, apart from ``data`` and ``out``; receives
                this rank's own quantization error (error feedback: add it to the next
                operation's input), written as chunks are sent (an operation that fails
                leaves it partly written).

        Raises:
            LocalProtocolError: not ready (joining, busy, failed, closed), unsupported dtype,
                size or dtype mismatch between ``data`` and ``out``, a non-contiguous or
                read-only output, ``bits=16`` on integers, or a bad ``residual``; a rank that
                joined a running job and has not resumed.
        """
        if not can(self.state, WorkerInput.START):
            next_state(self.state, WorkerInput.START, self.error or "")  # raises
        if self._late:
            raise LocalProtocolError("this rank joined a running job: resume(position) from a "
                                     "live rank before its first operation")
        x, o = validate_arrays(data, out)
        residual = check_wire(x, o, bits, residual)
        # In place, the kernels keep each input block as they send it (a restart needs the
        # input, and results overwrite it), in a buffer this endpoint keeps.
        keep = (self._keep_buffer(x) if self.config.max_restarts and np.may_share_memory(x, o)
                else None)
        seq = self._seq
        if x.size == 0:
            self._seq = (seq + 1) & 0xFFFFFFFF
            self._events.append(OperationCompleted(seq))
            self._counters["operations_completed"] += 1
            return seq
        # Built first: if allocating it fails (MemoryError), nothing has changed, the
        # sequence number included (the ranks must stay in step).
        op = Operation(seq=seq, x=x, out=o, spec=self.spec, rank=self.rank,
                       slot_bases=self.slot_bases, bits=bits, residual=residual, keep=keep,
                       data_keys=self._data_keys if self.spec.auth_data else None)
        op.opv[K.OP.PY_NACKS] = self.recovery.fast_retransmit  # RACK logs its re-sends
        self._seq = (seq + 1) & 0xFFFFFFFF
        self._move(WorkerInput.START)
        self._begin(op, now)
        return seq

    def _keep_buffer(self, x: np.ndarray) -> np.ndarray:
        """Where an in-place operation's input is kept (a restart after a switch failure runs
        it again; ``Operation``'s ``keep``): a buffer this endpoint keeps from one operation
        to the next and grows to the largest, since one operation runs at a time, and a fresh
        allocation of tens of megabytes costs more in page faults than the copy itself (64 MiB:
        about 28 against 3 ms here). The kernels fill it block by block as they send: a copy
        of the whole input before the first packet cost 8.7 ms per 64 MiB here."""
        if self._kept.nbytes < x.nbytes:
            self._kept = np.empty(x.nbytes, np.uint8)
        return self._kept[:x.nbytes].view(x.dtype)

    def _begin(self, op: Operation, now: float) -> None:
        """Make ``op`` the operation in flight and send its first window."""
        if self._op is not None:
            self._spill(self._op)  # a restarted operation's queue goes out as it was
        self._op = op
        self.recovery.on_started(op, now)
        op.bind(self.recovery.rtt, self._next_set, self._cnt)
        K.send_first(op.state, op.E, now)
        if self.recovery.fast_retransmit:
            for i in range(op.E):
                self.recovery.on_sent(op, i, now)
        if self._ahead:
            # Every result of ``op`` kept already (the others finished it: a rank behind, or
            # one skipping a step): it completes here from them, and its requests, which the
            # switch would drop as late, are not sent.
            self._muted = self._kept_all(op)
            try:
                self._take_ahead(op, now)
            finally:
                self._muted = False

    def close(self, now: float) -> None:
        """Leave the job (LEAVE, retried briefly). An operation in flight fails. Idempotent."""
        if self.state in (WorkerState.CLOSING, WorkerState.CLOSED):
            return  # the one exception to the table: close is idempotent
        if self._op is not None:
            self._abort(f"operation {self._op.seq} aborted: endpoint closed locally")
        self._kept = np.empty(0, np.uint8)  # the last in-place input's copy: no longer needed
        self._move(WorkerInput.CLOSE)
        if self.state is WorkerState.CLOSED:  # never joined: nothing to leave
            self._events.append(Left())
            return
        self._control.start(now, self.config.leave_timeout_s)
        self._send_leave(now)

    # -- Endpoint contract -------------------------------------------------------------------

    def receive_datagram(self, data: Datagram, addr: Address, now: float) -> None:
        """Process one datagram from the switch. Call ``datagrams_to_send`` afterwards.
        Anything from another address is dropped (counted ``foreign_sender``): a result that
        carries the job's token is still only the switch's to give."""
        if addr not in self._switch_set:
            self._drops["foreign_sender"] += 1
            return
        if self._op is None or not len(data):
            self._receive_other(data, now)
            return
        buf = K.as_buffer(data)
        self._starts[0], self._lens[0] = 0, len(buf)
        self._receive(buf, self._starts, self._lens, 1, now)

    def receive_many(self, batch: Batch, now: float) -> None:
        """Process a batch of datagrams (``endpoint.Batch``; ``recvmmsg``, a GRO buffer) from
        the switch (or its shards), in order. Datagrams from any other address are dropped
        (counted ``foreign_sender``): the job's token travels in every datagram, so it proves
        nothing about who sent one. Call ``datagrams_to_send`` afterwards."""
        count = batch.count
        if batch.sender is not None:  # one sender for the whole batch: checked once
            if batch.sender in self._switch_set:
                self._receive(batch.buf, batch.starts, batch.lens, count, now)
            else:
                self._drops["foreign_sender"] += count
            return
        senders = batch.senders
        allowed, nallowed = np.empty(len(self._switch_set), np.int64), 0  # numbers checked
        i = 0
        while i < count:
            j = int(K.first_foreign(senders, i, count, allowed, nallowed))
            if j > i:  # datagrams i .. j-1 come from the switch: in order, many per call
                if i == 0 and j == count:
                    self._receive(batch.buf, batch.starts, batch.lens, count, now)
                else:
                    self._receive(batch.buf, batch.starts[i:j], batch.lens[i:j], j - i, now)
            if j == count:
                break
            sender = int(senders[j])
            if batch.address_of(sender) not in self._switch_set:
                self._drops["foreign_sender"] += 1
                i = j + 1
            elif nallowed < allowed.size:  # one of the switch's addresses, seen first now
                allowed[nallowed] = sender
                nallowed += 1
                i = j
            else:  # (more numbers than addresses: one address, many numbers; one at a time)
                self._receive(batch.buf, batch.starts[j:j + 1], batch.lens[j:j + 1], 1, now)
                i = j + 1

    def handle_timer(self, now: float) -> None:
        """Fire due deadlines (retransmissions, control retries, failure). Drain afterwards."""
        st = self.state
        if st is WorkerState.BUSY:
            self._handle_op_timers(now)
        elif st is WorkerState.READY:
            if now >= self._keepalive_at:
                self._send_keepalive(now)
        elif st in (WorkerState.JOINING, WorkerState.REJOINING, WorkerState.CLOSING):
            self._handle_control_timer(now)

    def get_timer(self) -> float | None:
        """Absolute time of the next deadline, or None."""
        st = self.state
        if st is WorkerState.BUSY:
            assert self._op is not None
            return self.recovery.deadline(self._op)
        if st in (WorkerState.JOINING, WorkerState.REJOINING, WorkerState.CLOSING):
            return min(self._control.at, self._control.deadline)
        if st is WorkerState.READY:
            return self._keepalive_at
        return None

    def datagrams_to_send(self, now: float) -> list[tuple[Datagram, Address]]:
        """Return and forget the datagrams to send, in order. Requests are views of the lanes'
        transmit buffers, valid until the next receive call."""
        if self._op is not None and self._op.opv[K.OP.NQ]:
            self._spill(self._op)
        return self._control_to_send()

    def poll_transmit(self, now: float, *, gso: tuple[int, int] | None = None,
                      compiled: bool = False) -> Transmit:
        """What to send (``endpoint.Transmit``), the one verb of a UDP transport. ``gso``:
        ``(max_segments, max_bytes)``: the operation's queued requests as GSO runs planned by a
        kernel (:meth:`_runs_to_send`); None: every datagram on its own. ``compiled``: where
        the transport's compiled loop may run (:meth:`fast_path_state`), the operation's
        queued requests stay queued for its sender (``Transmit.compiled`` is the operation's
        ``OpState``), after the datagrams here."""
        op = self._op
        if compiled and op is not None and op.opv[K.OP.NQ] and self.fast_path_state():
            return Transmit(self._control_to_send(), {}, [], op.state)
        if gso is None:
            return Transmit(self.datagrams_to_send(now), {}, [])
        out, runs = self._runs_to_send(now, max_segments=gso[0], max_bytes=gso[1])
        return Transmit(out, {}, runs)

    def _control_to_send(self) -> list[tuple[Datagram, Address]]:
        """Return and forget the datagrams queued out of the way (control messages, lanes
        spilled from a full queue), but not the operation's queued requests: for a transport
        whose compiled loop sends those (``transport/fastpath.py``), after these."""
        out = self._out
        if out:
            self._out = []
        return out

    def _runs_to_send(self, now: float, *, max_segments: int, max_bytes: int
                      ) -> tuple[list[tuple[Datagram, Address]], list[_Run]]:
        """:meth:`datagrams_to_send` for a transport with UDP GSO: ``(datagrams, runs)``.

        ``datagrams`` (control messages, and anything queued out of the way) go first, one
        by one; each run ``(buffers, size, address)`` is one GSO send: the buffers, gathered,
        are datagrams of ``size`` bytes (the last may be shorter), at most ``max_segments``
        of them and ``max_bytes`` in all. The requests the compiled kernels queued are cut
        into runs by a kernel too (``kernels.plan_runs``): consecutive lanes are one slice of
        the transmit buffer, so a batch of results costs a few Python objects, not one per
        datagram. Views of the endpoint's buffers, valid until its next receive call."""
        op = self._op
        runs: list[_Run] = []
        out = self._control_to_send()
        if op is None:
            return out, runs
        nq = int(op.opv[K.OP.NQ])
        if not nq:
            return out, runs
        op.opv[K.OP.NQ] = 0
        shards = self.switch_addresses
        nr = K.plan_runs(op.sendq, nq, op.sendlen, op.stride, len(shards), max_segments,
                         max_bytes, op.run_order, op.runs)
        stride, order, sendq, sendlen = op.stride, op.run_order, op.sendq, op.sendlen
        for first, count, size, contiguous, shard in op.runs[:nr].tolist():
            if contiguous:
                start = int(sendq[order[first]]) * stride
                end = start + (count - 1) * stride + int(sendlen[sendq[order[first + count - 1]]])
                bufs: list[Datagram] = [op.txflat[start:end]]
            else:
                bufs = [op.datagram(i) for i in sendq[order[first:first + count]].tolist()]
            runs.append((bufs, size, shards[shard]))
        return out, runs

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    @property
    def rto_s(self) -> float:
        """The current retransmission timeout before backoff."""
        return self.recovery.rto_s

    @property
    def counters(self) -> Counter[str]:
        """A snapshot: ``packets_sent``, ``payload_bytes_sent`` (each chunk's payload once),
        ``payload_bytes_resent`` (re-sends), ``retransmissions``, ``results_received``,
        ``waiting_received``, ``mismatch_received``, ``fast_retransmissions``,
        ``spurious_fast_retransmissions``, ``nack_retransmissions``, ``nacks_ignored``,
        ``timer_retransmissions`` (deadlines that passed: timeouts and tail-loss probes),
        ``tail_probes`` (deadlines a probe brought forward), ``idle_probes`` (chunks
        re-sent because no result came for two round trips), ``operations_completed``,
        ``operations_restarted``, ``operations_failed``."""
        return K.counter_snapshot(self._counters, self._cnt, _KERNEL_COUNTERS)

    @property
    def drops(self) -> Counter[str]:
        """A snapshot of the datagrams dropped, by reason."""
        return K.counter_snapshot(self._drops, self._cnt, _KERNEL_DROPS)

    def progress(self, now: float) -> str | None:
        """What the operation in flight waits for (a diagnostic line), or None when idle:
        the ranks the switch says it waits for, or the switch's silence."""
        op = self._op
        if op is None or self.state is not WorkerState.BUSY:
            return None
        return self.recovery.silence_reason(
            op, where=f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank})",
            switch=self._switch_text, num_workers=self.spec.num_workers, now=now)

    def fast_path_state(self) -> tuple[Operation, float] | None:
        """What a transport's compiled loop (``transport/fastpath.py``) needs to take results
        and send requests as ``receive_many`` and ``poll_transmit`` would: ``(operation,
        op_timeout_s)``, the operation's kernels' hand-off being ``operation.state``
        (``kernels.OpState``); None when only the Python path may run (no operation in flight,
        or RACK on). The loop runs the same kernels and returns to Python for anything they
        leave to it (with a sharded switch, a datagram from none of its addresses too)."""
        op = self._op
        if (op is None or self.state is not WorkerState.BUSY or self.recovery.fast_retransmit
                or self._ahead.get(op.seq)):
            return None  # (kept results of it: a lane reaching one takes it here, in Python)
        return op, self.config.op_timeout_s

    # -- Receiving ---------------------------------------------------------------------------

    def _receive(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, count: int,
                 now: float) -> None:
        """Results of the operation in flight go through the compiled kernel, many per call;
        anything else datagram by datagram."""
        self._receive_batch(buf, starts, lens, count, now)
        op = self._op
        if op is not None and not self._feeding and self._ahead.get(op.seq):
            self._feed_kept(op, now)

    def _receive_batch(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                       count: int, now: float) -> None:
        """``_receive``'s loop."""
        view = None
        sifted = False
        i = 0
        while i < count:
            op = self._op
            if op is None or self.state is not WorkerState.BUSY:
                nxt, code = i, K.WS.OTHER
            else:
                nxt, code = self._take_results(op, buf, starts, lens, count, i, now)
            if code == K.WS.OTHER and nxt < count:
                if self.spec.quorum and not sifted:
                    sifted = True  # (once per batch: what is left holds none)
                    rest = self._keep_ahead(buf, starts, lens, nxt, count)
                    if rest is not None:
                        starts, lens = starts[nxt:count][rest], lens[nxt:count][rest]
                        i, count = 0, int(starts.size)
                        continue
                if view is None:
                    view = memoryview(buf)
                o = int(starts[nxt])
                self._receive_other(view[o:o + int(lens[nxt])], now)
                nxt += 1
            i = nxt

    def _take_results(self, op: Operation, buf: np.ndarray, starts: np.ndarray,
                      lens: np.ndarray, count: int, i: int, now: float) -> tuple[int, int]:
        """Run the results kernel from datagram ``i``; send what it released."""
        rec = self.recovery
        limit = 1 if rec.fast_retransmit else count
        queued = int(op.opv[K.OP.NQ])
        nxt, code = K.worker_results(op.state, buf, starts, lens, count, i, limit, now)
        if rec.fast_retransmit:
            for lane in op.sendq[queued:int(op.opv[K.OP.NQ])].tolist():
                rec.on_sent(op, lane, now)
        self.after_results_kernel(op, code, now)
        if code == K.WS.ONE and rec.fast_retransmit:
            for p in list(rec.lost_chunks(op)):
                self._counters["fast_retransmissions"] += 1
                self._send_chunk(op, p, now, retransmit=True, fast=True)
        return nxt, code

    def after_results_kernel(self, op: Operation, code: int, now: float) -> None:
        """What the results kernel's stop ``code`` (``kernels.WS``) asks of Python: spill a
        full send queue, or complete the operation it took the last result of. (The
        transports' compiled loop calls it too, then ``receive_many`` for the rest.)"""
        if code == K.WS.FULL:
            self._spill(op)
        elif code == K.WS.OP_COMPLETE:
            self._complete(op, now)

    def _complete(self, op: Operation, now: float) -> None:
        """The operation's last result arrived (the kernel took it)."""
        self._spill(op)
        op.finish()
        self.recovery.on_completed(op)
        self._op = None
        self._move(WorkerInput.COMPLETE)
        self._keepalive_at = now + self.config.keepalive_s
        self._counters["operations_completed"] += 1
        self._events.append(OperationCompleted(op.seq, op.contrib, op.k))

    # -- Timers and failure ------------------------------------------------------------------

    def _handle_op_timers(self, now: float) -> None:
        op = self._op
        assert op is not None
        if not self.recovery.timed_out(now):
            self.fire_timers(op, now)
        if self.recovery.timed_out(now):
            self._fail(self.recovery.silence_reason(
                op, where=f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank})",
                switch=self._switch_text, num_workers=self.spec.num_workers, now=now),
                switch_silent=self.recovery.switch_silent(op, now))

    def fire_timers(self, op: Operation, now: float) -> None:
        """Re-send what is due (``kernels.fire_timers``: timeouts, then the idle probe) and
        queue it; RACK logs the re-sends. (The transports' compiled loop calls the kernel
        itself.)"""
        nq = int(op.opv[K.OP.NQ])
        if not K.fire_timers(op.state, now):
            self._spill(op)  # (a queue without room for every busy lane)
            nq = 0
            K.fire_timers(op.state, now)
        if self.recovery.fast_retransmit:
            for i in op.sendq[nq:int(op.opv[K.OP.NQ])].tolist():
                self.recovery.on_sent(op, i, now)

    def _fail(self, reason: str, what: WorkerInput = WorkerInput.FAIL, *,
              switch_silent: bool = False, disagree: bool = False, gone: bool = False) -> None:
        """The operation in flight can't complete: ERROR, and OperationAborted."""
        self._move(what)
        self._abort(reason, switch_silent=switch_silent, disagree=disagree, gone=gone)

    def _abort(self, reason: str, *, switch_silent: bool = False,
               disagree: bool = False, gone: bool = False) -> None:
        op = self._op
        assert op is not None
        self._spill(op)
        op.restore_input()  # a failed in-place operation leaves its input as it was
        self._op = None
        self.error = reason
        self._counters["operations_failed"] += 1
        self._events.append(OperationAborted(op.seq, reason, switch_silent, disagree, gone))

    # -- Sending -----------------------------------------------------------------------------

    def _send_chunk(self, op: Operation, p: int, now: float, *, retransmit: bool,
                    fast: bool = False) -> int:
        """(Re-)send packet ``p``, rebuilt from the input (``kernels.send_chunk``).

        ``fast``: a NACK or RACK re-send: it does not back the lane's timeout off but, as any
        re-send, ends the lane's RTT samples (Karn)."""
        i = K.send_chunk(op.state, p, retransmit, fast, now)
        self._queue_lane(op, int(i), now)
        return int(i)

    def _queue_lane(self, op: Operation, i: int, now: float) -> None:
        """Queue lane ``i``'s datagram (``txbuf[i, :sendlen[i]]``, sent by the next drain) as
        the kernels do; a full queue is spilled first."""
        q = int(op.opv[K.OP.NQ])
        if q >= op.sendq.size:
            self._spill(op)
            q = 0
        op.sendq[q] = i
        op.opv[K.OP.NQ] = q + 1
        self.recovery.on_sent(op, i, now)

    def _spill(self, op: Operation) -> None:
        """Move the lanes queued in ``op`` to the plain datagram list (views of their rows):
        a full queue, or an operation that ends with datagrams still to send."""
        q = int(op.opv[K.OP.NQ])
        if not q:
            return
        op.opv[K.OP.NQ] = 0
        if self._muted:  # (``_begin``: an operation whose every result is here)
            self._counters["requests_not_sent"] += q
            return
        shards = self.switch_addresses
        for i in op.sendq[:q].tolist():
            self._out.append((op.datagram(i), shards[i % len(shards)]))


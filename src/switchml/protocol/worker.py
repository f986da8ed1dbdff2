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

Loss recovery: every outstanding packet has a retransmission deadline from an RFC 6298 style
estimate (srtt + 4 rttvar, Karn's rule), doubled at each expiry up to ``max_rto_s``. A
retransmission is rebuilt from the input it still holds, never replayed from stored bytes.
Results of other operations, repeated results and results for chunks not in flight are dropped.
An operation with no progress for ``op_timeout_s`` fails with a reason naming the switch (no
answer at all) or the silent ranks (the switch said, in WAITING replies, who has not contributed).
After a failed operation the endpoint is in ``ERROR``: the job's slot state can no longer be
trusted, so a new job must be joined.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Callable, Sequence
from enum import Enum

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address, format_addresses
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import LocalProtocolError, WireError
from switchml.protocol.events import (
    Event,
    Joined,
    JoinFailed,
    Left,
    OperationAborted,
    OperationCompleted,
    OperationRestarted,
)
from switchml.protocol.quantize import scale_bits
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER_SIZE,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    join_proof,
    operation_digest,
    pack_control_info,
    pack_header,
    unpack_control_info,
    unpack_header,
    unpack_mismatch,
    unpack_payload,
)

__all__ = ["SUPPORTED_DTYPES", "WorkerEndpoint", "WorkerState", "validate_arrays"]

SUPPORTED_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64),
                    np.dtype(np.int32))
_CONTROL_RETRY_S = 0.2
EPOCH_SEQ_STRIDE = 2**16
"""After the switch lost the job, the operation restarts as ``seq + EPOCH_SEQ_STRIDE``: every rank
computes the same number, and the switch drops anything older (docs/protocol.md, epochs)."""
# Plain ints on the hot path: IntFlag arithmetic costs about a microsecond per operation.
_NONFINITE = int(Flags.NONFINITE)
_HAS_DATA = int(Flags.HAS_DATA)
_HAS_EXP = int(Flags.HAS_EXP)
_REQUEST = int(MessageType.REQUEST)
_RESULT = int(MessageType.RESULT)
_INT32 = int(ElementType.INT32)
_INT16 = int(ElementType.INT16)
_WIRE = {32: (_INT32, 4, "<i4"), 16: (_INT16, 2, "<i2")}  # bits -> (elem, itemsize, dtype)
_LEAVE_TIMEOUT_S = 1.0
_F16 = np.dtype(np.float16)
_NO_RESIDUAL = np.empty(0, np.float64)
# Kernel counters (kernels.WC) by the names ``counters`` and ``drops`` report.
_KERNEL_COUNTERS = (("results_received", K.WC.RESULTS), ("packets_sent", K.WC.PACKETS_SENT),
                    ("payload_bytes_sent", K.WC.PAYLOAD_BYTES),
                    ("payload_bytes_resent", K.WC.PAYLOAD_RESENT),
                    ("retransmissions", K.WC.RETRANSMISSIONS),
                    ("spurious_fast_retransmissions", K.WC.SPURIOUS))
_KERNEL_DROPS = (("stale_result", K.WC.STALE_RESULT), ("duplicate_result", K.WC.DUPLICATE_RESULT),
                 ("bad_slot", K.WC.BAD_SLOT), ("bad_count", K.WC.BAD_COUNT))


class WorkerState(Enum):
    NEW = "new"
    JOINING = "joining"
    READY = "ready"
    BUSY = "busy"
    REJOINING = "rejoining"
    """Busy, but the switch lost the job: joining again before restarting the operation."""
    CLOSING = "closing"
    CLOSED = "closed"
    ERROR = "error"


class _Op:
    """State of the operation in flight, as arrays the kernels work on (``kernels.OP``, ``LN``,
    ``LF``).

    Float16 data is staged in float32 (exact both ways); the result is copied back on
    completion. Requests are built into ``txbuf`` (one preallocated datagram per lane) and sent
    from views of it, with no copy per datagram.
    """

    __slots__ = ("seq", "x", "out", "is_float", "bits", "elem", "itemsize", "wire_dtype",
                 "residual", "restarts", "digest", "k", "L", "E", "T", "opv", "lane", "lanef",
                 "exps", "nonf", "xk", "outk", "res", "txbuf", "views", "sendq", "sendlen",
                 "xmit_order", "spurious", "waiting_missing", "waiting_chunk", "stage_out",
                 "stage_res", "fmax")

    def __init__(self, seq: int, x: np.ndarray, out: np.ndarray, spec: JobSpec, rank: int,
                 slot_bases: Sequence[int], bits: int = 32,
                 residual: np.ndarray | None = None) -> None:
        self.seq = seq
        self.x = x
        self.out = out
        self.is_float = x.dtype.kind == "f"
        self.bits = bits
        self.elem, self.itemsize, self.wire_dtype = _WIRE[bits]
        self.residual = residual
        self.restarts = 0
        self.digest = operation_digest(x.size, self.is_float, bits)
        self.k = spec.elements_per_packet * 4 // self.itemsize  # 16 bits: 2k per slot
        self.L = -(-x.size // self.k)
        self.E = min(spec.window, self.L)
        self.T = self.L + self.E if self.is_float else self.L
        # Staging: the kernels take float32, float64 and int32.
        self.xk = x.astype(np.float32) if x.dtype == _F16 else x
        self.stage_out = out.dtype == _F16
        self.outk = np.empty(x.size, np.float64) if self.stage_out else out  # one rounding
        self.stage_res = residual is not None and residual.dtype != np.float64
        if residual is None:
            self.res = _NO_RESIDUAL
        else:
            self.res = np.empty(x.size, np.float64) if self.stage_res else residual
        info = np.finfo(out.dtype) if self.is_float else None
        self.fmax = float(info.max) if info is not None else 0.0
        opv = np.zeros(K.O_FIELDS, np.int64)
        opv[K.OP.SEQ] = seq
        opv[K.OP.L], opv[K.OP.E], opv[K.OP.T], opv[K.OP.K] = self.L, self.E, self.T, self.k
        opv[K.OP.JOB] = spec.job_id
        opv[K.OP.TOKEN] = np.uint64(spec.token).view(np.int64)
        opv[K.OP.RANK] = rank
        opv[K.OP.SLOT_BASE] = slot_bases[0]
        opv[K.OP.ELEM], opv[K.OP.ITEMSIZE], opv[K.OP.DIGEST] = self.elem, self.itemsize, self.digest
        scale = spec.scale_count
        opv[K.OP.P] = scale_bits(scale, bits)
        opv[K.OP.N] = scale  # the bound |sum| < scale * 2**emax
        opv[K.OP.IS_FLOAT] = self.is_float
        opv[K.OP.EDGE_EXP] = (info.maxexp - scale.bit_length()) if info is not None else 0
        self.opv = opv
        self.lane = np.zeros((K.LN_FIELDS, self.E), np.int64)
        self.lane[K.LN.CHUNK] = -1
        self.lane[K.LN.EMAX] = EXP_ZERO
        # Lane i goes to shard i mod S, on that shard's slot i (each shard grants a base).
        lanes = np.arange(self.E)
        self.lane[K.LN.SLOT] = np.asarray(slot_bases, np.int64)[lanes % len(slot_bases)] + lanes
        self.lanef = np.zeros((K.LNF_FIELDS, self.E), np.float64)
        self.exps = np.empty(self.L if self.is_float else 0, np.int64)
        self.nonf = np.zeros(self.L if self.is_float else 0, np.uint8)
        # Block exponents are computed as packets are built (kernels.build_request).
        self.txbuf = np.empty((self.E, HEADER_SIZE + self.k * self.itemsize), np.uint8)
        self.views = [memoryview(self.txbuf[i]) for i in range(self.E)]
        # A batch of results releases at most one packet per lane.
        self.sendq = np.empty(self.E, np.int64)
        self.sendlen = np.empty(self.E, np.int64)
        # Transmissions in time order, (time, lane, chunk, xmits), for RACK loss detection
        # (only kept with fast_retransmit on); entries whose lane has moved on are skipped.
        self.xmit_order: deque[tuple[float, int, int, int]] = deque()
        self.spurious = 0  # the spurious RACK re-send count when the operation started
        self.waiting_missing = 0
        self.waiting_chunk = -1

    def finish(self) -> None:
        """Copy staged results into the caller's arrays."""
        if self.stage_out:
            self.out[...] = self.outk
        if self.stage_res:
            self.residual[...] = self.res


class WorkerEndpoint:
    """One rank of a job: join, run all-reduce operations one at a time, leave.

    Endpoint contract: after every call that takes ``now`` (and after ``receive_datagram`` and
    ``handle_timer``), drain ``datagrams_to_send`` and ``next_event`` and re-arm the timer from
    ``get_timer``. Peer input never raises; local misuse raises :class:`LocalProtocolError` and
    leaves the state unchanged.

    Example::

        w = WorkerEndpoint(spec=spec, rank=0, switch_address=("127.0.0.1", 48864))
        w.join(now)                      # -> JOIN datagram; event Joined when answered
        seq = w.start_allreduce(x, out, now)   # -> first window of chunks
        # ... pump until next_event() returns OperationCompleted(seq)
    """

    def __init__(self, *, spec: JobSpec, rank: int, switch_address: Address | Sequence[Address],
                 config: WorkerConfig | None = None) -> None:
        if not 0 <= rank < spec.num_workers:
            raise LocalProtocolError(f"rank must be in 0..{spec.num_workers - 1}, got {rank}")
        self.spec = spec
        self.rank = rank
        # One switch, or the shards of a sharded switch (lane i goes to shard i mod S).
        shards = ((switch_address,) if isinstance(switch_address[0], str)
                  else tuple(switch_address))  # type: ignore[arg-type]
        if not shards:
            raise LocalProtocolError("switch_address: give a switch address or a list of shards")
        self.switch_addresses: tuple[Address, ...] = shards  # type: ignore[assignment]
        self.switch_address: Address = shards[0]  # type: ignore[assignment]
        self._switch_text = format_addresses(shards)  # type: ignore[arg-type]
        self._shard_bases: list[int | None] = [None] * len(shards)
        self._shards_left: set[int] = set()
        self.config = config or WorkerConfig()
        self.state = WorkerState.NEW
        self.error: str | None = None
        self._seq = 0
        self._epoch_seq = 0  # first operation of the current epoch; sent in JOIN/KEEPALIVE
        self._keepalive_at = 0.0
        self._op: _Op | None = None
        self._out: list[tuple[bytes, Address]] = []
        self._events: deque[Event] = deque()
        self._control_retry_at = 0.0
        self._control_deadline = 0.0
        self._control_backoff = _CONTROL_RETRY_S
        self._fast_retransmit = self.config.fast_retransmit
        # Round-trip estimate and operation times, shared with the kernels (kernels.R).
        self._rtt = np.zeros(K.R_FIELDS, np.float64)
        self._rtt[K.R.SRTT] = self._rtt[K.R.MIN_RTT] = -1.0
        self._rtt[K.R.RTO] = self.config.initial_rto_s
        self._rtt[K.R.MIN_RTO] = self.config.min_rto_s
        self._rtt[K.R.MAX_RTO] = self.config.max_rto_s
        self._rtt[K.R.REO_SCALE] = 1.0
        self._next_set_arr = np.zeros(spec.window, np.int64)
        self._cnt = np.zeros(K.WC.N, np.int64)
        self._starts = np.empty(K.MAX_BATCH, np.int64)
        self._lens = np.empty(K.MAX_BATCH, np.int64)
        self._drops: Counter[str] = Counter()
        self._counters: Counter[str] = Counter()
        self._handlers = {
            MessageType.RESULT: self._handle_stray_result,
            MessageType.WAITING: self._handle_waiting,
            MessageType.MISMATCH: self._handle_mismatch,
            MessageType.NACK: self._handle_nack,
            MessageType.JOINED: self._handle_joined,
            MessageType.REFUSED: self._handle_refused,
            MessageType.LEFT: self._handle_left,
            MessageType.UNKNOWN_JOB: self._handle_unknown_job,
        }

    # -- User commands -----------------------------------------------------------------------

    def join(self, now: float) -> None:
        """Send JOIN (retried until answered or ``join_timeout_s``). Call ``datagrams_to_send``.

        Raises:
            LocalProtocolError: if already joined or closed.
        """
        if self.state is not WorkerState.NEW:
            raise LocalProtocolError(f"can't join in state {self.state.value}")
        self.state = WorkerState.JOINING
        self._control_deadline = now + self.config.join_timeout_s
        self._send_join(now)

    def start_allreduce(self, data: np.ndarray, out: np.ndarray, now: float, *, bits: int = 32,
                        residual: np.ndarray | None = None) -> int:
        """Start summing ``data`` over all ranks into ``out`` (may be ``data`` itself).

        Every rank must start the same operations, with the same size, dtype and ``bits``, in
        the same order. Returns the operation's sequence number; ``OperationCompleted(seq)``
        follows. Call ``datagrams_to_send`` afterwards.

        Args:
            bits: 32, or 16 for floats: 16-bit fixed point on the wire, half the bytes, about
                ``15 - log2(n)`` bits of the block max (pair it with ``residual``).
            residual: float array of data's size; receives this rank's own quantization error
                (error feedback: add it to the next operation's input).

        Raises:
            LocalProtocolError: not ready (joining, busy, failed, closed), unsupported dtype,
                size or dtype mismatch between ``data`` and ``out``, a non-contiguous or
                read-only output, ``bits=16`` on integers, or a bad ``residual``.
        """
        if self.state is not WorkerState.READY:
            detail = f": {self.error}" if self.error else ""
            raise LocalProtocolError(
                f"can't start an operation in state {self.state.value}{detail}")
        x, o = validate_arrays(data, out)
        if bits not in _WIRE:
            raise LocalProtocolError(f"bits must be 32 or 16, got {bits}")
        if bits != 32 and x.dtype.kind != "f":
            raise LocalProtocolError(f"bits={bits} is for float data; {x.dtype} is summed exactly "
                                     "in 32 bits")
        if residual is not None:
            if (not isinstance(residual, np.ndarray) or residual.dtype.kind != "f"
                    or residual.size != x.size or not residual.flags.c_contiguous
                    or not residual.flags.writeable or x.dtype.kind != "f"):
                raise LocalProtocolError("residual must be a writeable C-contiguous float array "
                                         "of data's size, for float data")
            residual = residual.reshape(-1)
        if self.config.max_restarts and np.may_share_memory(x, o):
            x = x.copy()  # a restart after a switch failure needs the input, not partial sums
        seq = self._seq
        self._seq = (self._seq + 1) & 0xFFFFFFFF
        if x.size == 0:
            self._events.append(OperationCompleted(seq))
            self._counters["operations_completed"] += 1
            return seq
        self._begin(_Op(seq, x, o, self.spec, self.rank, self.slot_bases, bits, residual), now)
        return seq

    def _begin(self, op: _Op, now: float) -> None:
        """Make ``op`` the operation in flight and send its first window."""
        self._op = op
        op.spurious = int(self._cnt[K.WC.SPURIOUS])
        self._rtt[K.R.FMAX] = op.fmax
        self.state = WorkerState.BUSY
        self._rtt[K.R.LAST_PROGRESS] = self._rtt[K.R.LAST_HEARD] = now
        K.send_first(op.E, now, op.opv, op.lane, op.lanef, self._rtt, self._next_set_arr,
                     op.exps, op.nonf, op.xk, op.res, op.txbuf, self._cnt, op.sendlen)
        for i in range(op.E):
            self._queue_lane(op, i, int(op.sendlen[i]), now)

    def close(self, now: float) -> None:
        """Leave the job (LEAVE, retried briefly). An operation in flight fails. Idempotent."""
        if self.state in (WorkerState.CLOSING, WorkerState.CLOSED):
            return
        if self._op is not None:
            self._fail(f"operation {self._op.seq} aborted: endpoint closed locally")
        was_joined = self.state is not WorkerState.NEW
        self.state = WorkerState.CLOSING
        if not was_joined:
            self.state = WorkerState.CLOSED
            self._events.append(Left())
            return
        self._control_deadline = now + _LEAVE_TIMEOUT_S
        self._control_backoff = _CONTROL_RETRY_S
        self._send_leave(now)

    # -- Endpoint contract -------------------------------------------------------------------

    @property
    def slot_base(self) -> int:
        """The first slot the switch (shard 0 of a sharded switch) granted the job."""
        return self._shard_bases[0] or 0

    @property
    def slot_bases(self) -> list[int]:
        """The slot base each shard granted (one entry for an unsharded switch)."""
        return [b or 0 for b in self._shard_bases]

    def receive_datagram(self, data: bytes | bytearray | memoryview, addr: Address,
                         now: float) -> None:
        """Process one datagram from the switch. Call ``datagrams_to_send`` afterwards."""
        if self._op is None or not len(data):
            self._receive_other(data, now)
            return
        buf = K.as_buffer(data)
        self.receive_batch(buf, len(buf), len(buf), addr, now)

    def receive_batch(self, buf: np.ndarray, nbytes: int, seg: int, addr: Address,
                      now: float) -> None:
        """Process the datagrams ``buf[i*seg : min((i+1)*seg, nbytes)]`` (uint8; one GRO
        buffer from the switch, or one datagram with ``seg = nbytes``), in order."""
        if nbytes <= 0 or seg <= 0:
            self._receive_other(b"", now)
            return
        count, excess = K.split_gro(nbytes, seg, self._starts, self._lens)
        if excess:
            self._drops["too_many_segments"] += excess
        self._receive(buf, self._starts, self._lens, count, now)

    def receive_many(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                     senders: np.ndarray, count: int, address_of: Callable[[int], Address],
                     now: float) -> None:
        """Process ``count`` datagrams ``buf[starts[i] : starts[i] + lens[i]]`` (int64 arrays;
        ``recvmmsg``) from the switch (or its shards), in order. The senders do not matter: a
        result is checked against the job's token and the lane's slot and set."""
        self._receive(buf, starts, lens, count, now)

    def _receive(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, count: int,
                 now: float) -> None:
        """Results of the operation in flight go through the compiled kernel, many per call;
        anything else datagram by datagram."""
        view = None
        i = 0
        while i < count:
            op = self._op
            if op is None or self.state is not WorkerState.BUSY:
                nxt, code = i, K.WS.OTHER
            else:
                limit = 1 if self._fast_retransmit else count
                nxt, nsend, code = K.worker_results(
                    buf, starts, lens, count, i, limit, now, op.opv, op.lane, op.lanef,
                    self._rtt, self._next_set_arr, op.exps, op.nonf, op.xk, op.outk, op.res,
                    op.txbuf, self._cnt, op.sendq, op.sendlen)
                for j in range(nsend):
                    self._queue_lane(op, int(op.sendq[j]), int(op.sendlen[j]), now)
                if code == K.WS.OP_COMPLETE:
                    self._complete(op, now)
                elif code == K.WS.ONE and self._fast_retransmit:
                    self._detect_losses(op, float(self._rtt[K.R.DELIVERED_XMIT]), now)
            if code == K.WS.OTHER and nxt < count:
                if view is None:
                    view = memoryview(buf)
                o = int(starts[nxt])
                self._receive_other(view[o:o + int(lens[nxt])], now)
                nxt += 1
            i = nxt

    def _receive_other(self, data: bytes | bytearray | memoryview, now: float) -> None:
        """Any datagram but a result of the operation in flight (control, errors, strays)."""
        try:
            h = unpack_header(data)
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        if h.job != self.spec.job_id or h.token != self.spec.token:
            self._drops["foreign"] += 1
            return
        handler = self._handlers.get(h.type)
        if handler is None:
            self._drops["unexpected_type"] += 1
            return
        handler(h, data, now)

    def handle_timer(self, now: float) -> None:
        """Fire due deadlines (retransmissions, control retries, failure). Drain afterwards."""
        st = self.state
        if st is WorkerState.BUSY:
            self._handle_op_timers(now)
        elif st is WorkerState.READY:
            if now >= self._keepalive_at:
                self._send_keepalive(now)
        elif st in (WorkerState.JOINING, WorkerState.REJOINING, WorkerState.CLOSING):
            if now >= self._control_deadline:
                if st is WorkerState.CLOSING:
                    self.state = WorkerState.CLOSED
                    self._events.append(Left())
                    return
                reason = (f"switch at {self._switch_text} did not answer JOIN for job "
                          f"{self.spec.job_id} within {self.config.join_timeout_s:g} s")
                if st is WorkerState.JOINING:
                    self._join_failed(reason)
                else:
                    self._fail(f"restart after the switch lost the job failed: {reason}")
            elif now >= self._control_retry_at:
                if st is WorkerState.CLOSING:
                    self._send_leave(now)
                else:
                    self._send_join(now)

    def get_timer(self) -> float | None:
        """Absolute time of the next deadline, or None."""
        st = self.state
        if st is WorkerState.BUSY:
            op = self._op
            assert op is not None
            fail_at = float(self._rtt[K.R.LAST_PROGRESS]) + self.config.op_timeout_s
            return min(float(K.next_deadline(op.lane, op.lanef)), fail_at)
        if st in (WorkerState.JOINING, WorkerState.REJOINING, WorkerState.CLOSING):
            return min(self._control_retry_at, self._control_deadline)
        if st is WorkerState.READY:
            return self._keepalive_at
        return None

    def datagrams_to_send(self, now: float) -> list[tuple[bytes, Address]]:
        out = self._out
        if out:
            self._out = []
        return out

    def next_event(self) -> Event | None:
        return self._events.popleft() if self._events else None

    @property
    def rto_s(self) -> float:
        """The current retransmission timeout before backoff."""
        return float(self._rtt[K.R.RTO])

    @property
    def counters(self) -> Counter[str]:
        """A snapshot: ``packets_sent``, ``payload_bytes_sent`` (each chunk's payload once),
        ``payload_bytes_resent`` (re-sends), ``retransmissions``, ``results_received``,
        ``waiting_received``, ``mismatch_received``, ``fast_retransmissions``,
        ``spurious_fast_retransmissions``, ``nack_retransmissions``, ``nacks_ignored``,
        ``operations_completed``, ``operations_restarted``, ``operations_failed``."""
        return K.counter_snapshot(self._counters, self._cnt, _KERNEL_COUNTERS)

    @property
    def drops(self) -> Counter[str]:
        """A snapshot of the datagrams dropped, by reason."""
        return K.counter_snapshot(self._drops, self._cnt, _KERNEL_DROPS)

    # -- Sending -----------------------------------------------------------------------------

    def _control_header(self, mtype: MessageType, count: int = 0) -> Header:
        return Header(mtype, self.spec.job_id, rank=self.rank, token=self.spec.token,
                      count=count, elem=ElementType.BYTES)

    def _send_join(self, now: float) -> None:
        spec = self.spec
        info = ControlInfo(spec.num_workers, spec.window, spec.elements_per_packet)
        payload = pack_control_info(info)
        if self.config.secret is not None:
            payload += join_proof(self.config.secret, spec.job_id, spec.token, info)
        header = Header(MessageType.JOIN, spec.job_id, rank=self.rank, token=spec.token,
                        seq=self._epoch_seq, count=len(payload), elem=ElementType.BYTES)
        datagram = pack_header(header) + payload
        for shard, base in enumerate(self._shard_bases):
            if base is None:  # not joined yet (on this epoch)
                self._out.append((datagram, self.switch_addresses[shard]))
        self._arm_control_retry(now)

    def _send_keepalive(self, now: float) -> None:
        header = Header(MessageType.KEEPALIVE, self.spec.job_id, rank=self.rank,
                        token=self.spec.token, seq=self._epoch_seq)
        datagram = pack_header(header)
        self._out.extend((datagram, a) for a in self.switch_addresses)
        self._keepalive_at = now + self.config.keepalive_s

    def _send_leave(self, now: float) -> None:
        datagram = pack_header(self._control_header(MessageType.LEAVE))
        self._out.extend((datagram, a) for i, a in enumerate(self.switch_addresses)
                         if i not in self._shards_left)
        self._arm_control_retry(now)

    def _arm_control_retry(self, now: float) -> None:
        self._control_retry_at = now + self._control_backoff
        self._control_backoff = min(self._control_backoff * 2, 2.0)

    def _send_chunk(self, op: _Op, p: int, now: float, *, retransmit: bool,
                    fast: bool = False) -> None:
        """(Re-)send packet ``p``, rebuilt from the input (``kernels.send_chunk``).

        ``fast``: a RACK re-send: it does not back the lane's timeout off but, as any re-send,
        ends the lane's RTT samples (Karn)."""
        n = K.send_chunk(p, retransmit, fast, now, op.opv, op.lane, op.lanef, self._rtt,
                         self._next_set_arr, op.exps, op.nonf, op.xk, op.res, op.txbuf,
                         self._cnt)
        self._queue_lane(op, p % op.E, int(n), now)

    def _queue_lane(self, op: _Op, i: int, nbytes: int, now: float) -> None:
        """Queue lane ``i``'s datagram (a view of its transmit buffer, valid until the lane
        sends again)."""
        shards = self.switch_addresses
        self._out.append((op.views[i][:nbytes], shards[i % len(shards)]))
        if self._fast_retransmit:
            op.xmit_order.append((now, i, int(op.lane[K.LN.CHUNK, i]),
                                  int(op.lane[K.LN.XMITS, i])))

    # -- Receiving ---------------------------------------------------------------------------

    def _complete(self, op: _Op, now: float) -> None:
        """The operation's last result arrived (the kernel took it)."""
        op.finish()
        if self._cnt[K.WC.SPURIOUS] == op.spurious and self._rtt[K.R.REO_SCALE] > 1:
            self._rtt[K.R.REO_SCALE] //= 2  # a clean operation: narrow the window again
        self._op = None
        self.state = WorkerState.READY
        self._keepalive_at = now + self.config.keepalive_s
        self._counters["operations_completed"] += 1
        self._events.append(OperationCompleted(op.seq))

    def _detect_losses(self, op: _Op, delivered_xmit: float, now: float) -> None:
        """RACK (RFC 8985): a result for a chunk sent at ``delivered_xmit`` means every chunk
        still outstanding that was sent more than the reorder window before it was lost (or its
        result was): re-send those now rather than at their timeouts."""
        rtt = self._rtt
        if rtt[K.R.MIN_RTT] < 0 or rtt[K.R.SRTT] < 0:
            return
        window = min(max(rtt[K.R.MIN_RTT] / 4, self.config.min_reorder_window_s)
                     * rtt[K.R.REO_SCALE], rtt[K.R.SRTT] + 4 * rtt[K.R.RTTVAR])
        order = op.xmit_order
        lane_chunk, lane_xmits = op.lane[K.LN.CHUNK], op.lane[K.LN.XMITS]
        while order:
            t, i, p, xmits = order[0]
            if lane_chunk[i] != p or lane_xmits[i] != xmits:
                order.popleft()  # that transmission is answered or superseded
            elif t + window < delivered_xmit:
                order.popleft()
                self._counters["fast_retransmissions"] += 1
                self._send_chunk(op, p, now, retransmit=True, fast=True)
            else:
                break

    def _spurious(self, op: _Op, i: int) -> None:
        """A RACK re-send of lane ``i`` was not needed: results come back more out of order
        than the reorder window allows. Widen it (RFC 8985 6.2)."""
        op.lane[K.LN.FAST, i] = 0
        self._cnt[K.WC.SPURIOUS] += 1
        self._rtt[K.R.REO_SCALE] = min(self._rtt[K.R.REO_SCALE] * 2, 1024)

    def _handle_stray_result(self, h: Header, data: bytes | bytearray | memoryview,
                             now: float) -> None:
        """A result while no operation is in flight, or one the kernel did not take."""
        self._drops["stale_result"] += 1

    def _handle_waiting(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self._drops["stale_result"] += 1
            return
        self._counters["waiting_received"] += 1
        self._rtt[K.R.LAST_HEARD] = now
        i = h.chunk % op.E
        if op.lane[K.LN.FAST, i] and op.lane[K.LN.CHUNK, i] == h.chunk:
            self._spurious(op, i)  # our chunk was in the switch all along
        op.waiting_missing = int.from_bytes(bytes(unpack_payload(data, h)), "little")
        op.waiting_chunk = h.chunk

    def _handle_nack(self, h: Header, data: bytes | bytearray | memoryview,
                     now: float) -> None:
        """The switch lacks chunk ``h.chunk`` of ours although later ones arrived: re-send
        what is outstanding on its lane now (the chunk itself, or the chunk whose lost result
        releases it: the switch answers that from its round or shadow copy). Like a RACK
        re-send, it does not back the lane's timeout off."""
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self._drops["stale_nack"] += 1
            return
        i = h.chunk % op.E
        if h.chunk >= op.T or h.slot != op.lane[K.LN.SLOT, i]:
            self._drops["bad_slot"] += 1
            return
        self._rtt[K.R.LAST_HEARD] = now
        p = int(op.lane[K.LN.CHUNK, i])
        min_rtt = float(self._rtt[K.R.MIN_RTT])
        if p < 0 or p > h.chunk or now - float(op.lanef[K.LF.XMIT_AT, i]) < min_rtt:
            # Delivered meanwhile, or re-sent less than a round trip ago (its answer may be
            # on its way): nothing to do.
            self._counters["nacks_ignored"] += 1
            return
        self._counters["nack_retransmissions"] += 1
        self._send_chunk(op, p, now, retransmit=True, fast=True)
        if p == h.chunk:
            # The switch thinks this request was lost: mark the re-send, so that it can tell
            # when it was only late (reordered) and widen its NACK gap.
            op.txbuf[i, 4] |= Flags.RESENT

    def _handle_mismatch(self, h: Header, data: bytes | bytearray | memoryview,
                         now: float) -> None:
        """The ranks disagree about a chunk of this operation: it can never complete; fail now."""
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self._drops["stale_result"] += 1
            return
        try:
            m = unpack_mismatch(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        ranks = [r for r in range(self.spec.num_workers) if m.ranks >> r & 1]
        self._counters["mismatch_received"] += 1
        kind = "float" if op.is_float else "int32"
        mine = f"{op.x.size} {kind} elements in {op.bits} bits"
        if m.theirs.digest != m.mine.digest:
            what = (f"rank(s) {ranks} are in another operation (digest 0x{m.theirs.digest:02x}; "
                    f"this rank's, 0x{m.mine.digest:02x}, is {mine}): another size, float "
                    "against integer data, or other bits")
        else:
            what = (f"about chunk {h.chunk}, rank(s) {ranks} sent {m.theirs.describe()}; this "
                    f"rank sent {m.mine.describe()} ({mine})")
        self._fail(f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank}): the ranks "
                   f"disagree: {what}. Every rank must issue the same operations, with the "
                   "same size, dtype and bits, in the same order")

    def _handle_joined(self, h: Header, data: bytes | bytearray | memoryview, now: float) -> None:
        if self.state not in (WorkerState.JOINING, WorkerState.REJOINING):
            return  # a late answer to a retried or keep-alive JOIN
        try:
            info = unpack_control_info(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        spec = self.spec
        if (info.num_workers, info.window, info.elements_per_packet) != (
                spec.num_workers, spec.window, spec.elements_per_packet):
            reason = f"switch granted {info}, which does not match the job spec"
            if self.state is WorkerState.REJOINING:
                self._fail(f"restart after the switch lost the job failed: {reason}")
            else:
                self._join_failed(reason)
            return
        shard = h.chunk if len(self._shard_bases) > 1 else 0  # a shard says which it is
        if shard >= len(self._shard_bases):
            self._drops["bad_shard"] += 1
            return
        self._shard_bases[shard] = info.slot_base
        if any(b is None for b in self._shard_bases):
            return  # other shards still to answer
        if self.state is WorkerState.REJOINING:
            self._resume_after_rejoin(now)
            return
        self.state = WorkerState.READY
        self._keepalive_at = now + self.config.keepalive_s
        self._events.append(Joined(self.slot_base, info.window))

    def _handle_refused(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        if self.state not in (WorkerState.JOINING, WorkerState.REJOINING):
            self._drops["unexpected_control"] += 1
            return
        reason = bytes(unpack_payload(data, h)).decode("utf-8", "replace")
        reason = f"switch at {self._switch_text} refused JOIN: {reason}"
        if self.state is WorkerState.JOINING:
            self._join_failed(reason)
        else:
            self._fail(f"restart after the switch lost the job failed: {reason}")

    def _handle_unknown_job(self, h: Header, data: bytes | bytearray | memoryview,
                            now: float) -> None:
        """The switch has lost the job (restarted, lease expired) or we are behind its epoch."""
        st = self.state
        if st is WorkerState.BUSY and self._op is not None and h.seq == self._op.seq:
            self._restart(now)
        elif st is WorkerState.READY and h.seq == self._epoch_seq:
            # Idle, and the answer is to our current keep-alive (not a stray echo of an older
            # epoch): the next operation starts the new epoch; every rank computes the same seq,
            # and a fresh switch means every slot starts on set 0, as for the busy ranks.
            self._epoch_seq = self._seq = (self._seq + EPOCH_SEQ_STRIDE) & 0xFFFFFFFF
            self._next_set_arr[:] = 0
            self._shard_bases = [None] * len(self.switch_addresses)
            self.state = WorkerState.JOINING
            self._control_deadline = now + self.config.join_timeout_s
            self._control_backoff = _CONTROL_RETRY_S
            self._send_join(now)
        else:
            self._drops["stale_unknown_job"] += 1

    def _restart(self, now: float) -> None:
        """Join again on a new epoch, then run the operation from its input (issue 5)."""
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
        self._shard_bases = [None] * len(self.switch_addresses)
        self.state = WorkerState.REJOINING
        self._control_deadline = now + self.config.join_timeout_s
        self._control_backoff = _CONTROL_RETRY_S
        self._send_join(now)

    def _resume_after_rejoin(self, now: float) -> None:
        old = self._op
        assert old is not None
        op = _Op(self._epoch_seq, old.x, old.out, self.spec, self.rank, self.slot_bases,
                 old.bits, old.residual)
        op.restarts = old.restarts + 1
        self._seq = (self._epoch_seq + 1) & 0xFFFFFFFF
        self._next_set_arr[:] = 0  # a fresh switch: every rank starts on set 0
        self._begin(op, now)

    def _handle_left(self, h: Header, data: bytes | bytearray | memoryview, now: float) -> None:
        if self.state is not WorkerState.CLOSING:
            self._drops["unexpected_control"] += 1
            return
        self._shards_left.add(h.chunk if len(self.switch_addresses) > 1 else 0)
        if len(self._shards_left) < len(self.switch_addresses):
            return  # other shards still to answer
        self.state = WorkerState.CLOSED
        self._events.append(Left())

    # -- Timers and failure ------------------------------------------------------------------

    def _handle_op_timers(self, now: float) -> None:
        op = self._op
        assert op is not None
        chunk, deadline = op.lane[K.LN.CHUNK], op.lanef[K.LF.DEADLINE]
        for i in np.flatnonzero((chunk >= 0) & (deadline <= now)):
            self._send_chunk(op, int(chunk[i]), now, retransmit=True)
        last_progress = float(self._rtt[K.R.LAST_PROGRESS])
        idle = now - last_progress
        # The same sum as get_timer's deadline: ``now - last >= timeout`` can be false by a
        # rounding error at that very deadline, and the timer would fire forever.
        if now >= last_progress + self.config.op_timeout_s:
            self._fail(self._silence_reason(op, idle))

    def _silence_reason(self, op: _Op, idle: float) -> str:
        where = f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank})"
        last_heard, last_progress = float(self._rtt[K.R.LAST_HEARD]), float(
            self._rtt[K.R.LAST_PROGRESS])
        if op.waiting_missing and last_heard > last_progress:
            ranks = [r for r in range(self.spec.num_workers) if op.waiting_missing >> r & 1]
            return (f"{where} made no progress for {idle:.1f} s: the switch at "
                    f"{self._switch_text} answers, but rank(s) {ranks} have not sent "
                    f"chunk {op.waiting_chunk}")
        return (f"{where} made no progress for {idle:.1f} s: no answer from the switch at "
                f"{self._switch_text} for {last_progress - last_heard + idle:.1f} s")

    def _fail(self, reason: str) -> None:
        op = self._op
        assert op is not None
        self._op = None
        self.state = WorkerState.ERROR
        self.error = reason
        self._counters["operations_failed"] += 1
        self._events.append(OperationAborted(op.seq, reason))

    def _join_failed(self, reason: str) -> None:
        self.state = WorkerState.ERROR
        self.error = reason
        self._events.append(JoinFailed(reason))


def validate_arrays(data: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate the user's arrays and return flat views of both (no copies)."""
    for name, a in (("data", data), ("out", out)):
        if not isinstance(a, np.ndarray):
            raise LocalProtocolError(f"{name} must be a numpy array, got {type(a).__name__}")
        if not a.flags.c_contiguous:
            raise LocalProtocolError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if data.dtype not in SUPPORTED_DTYPES or not data.dtype.isnative:
        raise LocalProtocolError(
            f"unsupported dtype {data.dtype}; supported: "
            f"{', '.join(str(d) for d in SUPPORTED_DTYPES)}")
    if out.dtype != data.dtype or out.size != data.size:
        raise LocalProtocolError(
            f"out must match data: got {out.dtype}[{out.size}] for {data.dtype}[{data.size}]")
    if not out.flags.writeable:
        raise LocalProtocolError("out must be writeable")
    return data.reshape(-1), out.reshape(-1)

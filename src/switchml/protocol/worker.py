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

import heapq
from collections import Counter, deque
from enum import Enum

import numpy as np

from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import LocalProtocolError, WireError
from switchml.protocol.events import (
    Event,
    Joined,
    JoinFailed,
    Left,
    OperationCompleted,
    OperationFailed,
    OperationRestarted,
)
from switchml.protocol.quantize import block_exponent, dequantize_into, quantize, residual_into
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER,
    HEADER_SIZE,
    KNOWN_FLAGS,
    MAGIC,
    VERSION,
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

__all__ = ["SUPPORTED_DTYPES", "WorkerEndpoint", "WorkerState", "format_address",
           "validate_arrays"]

Address = tuple[str, int]
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
    """State of the operation in flight. Lane lists are indexed by lane ``i < E``."""

    __slots__ = ("seq", "x", "out", "is_float", "L", "E", "T", "k", "lane_chunk", "lane_set",
                 "lane_sent_at", "lane_tries", "lane_deadline", "lane_emax", "nonfinite",
                 "lane_xmit_at", "lane_xmits", "xmit_order", "lane_fast", "spurious",
                 "done", "last_progress", "last_heard", "waiting_missing", "waiting_chunk",
                 "bits", "elem", "itemsize", "wire_dtype", "residual", "restarts", "digest")

    def __init__(self, seq: int, x: np.ndarray, out: np.ndarray, k: int, window: int,
                 now: float, bits: int = 32, residual: np.ndarray | None = None) -> None:
        self.seq = seq
        self.x = x
        self.out = out
        self.is_float = x.dtype.kind == "f"
        self.bits = bits
        self.elem, self.itemsize, self.wire_dtype = _WIRE[bits]
        self.residual = residual
        self.restarts = 0
        self.digest = operation_digest(x.size, self.is_float, bits)
        self.k = k * 4 // self.itemsize  # a slot holds 4k bytes: 2k elements at 16 bits
        self.L = -(-x.size // self.k)
        self.E = min(window, self.L)
        self.T = self.L + self.E if self.is_float else self.L
        e = self.E
        self.lane_chunk = [-1] * e
        self.lane_set = [0] * e
        self.lane_sent_at = [0.0] * e  # first transmission (RTT samples, Karn's rule)
        self.lane_xmit_at = [0.0] * e  # latest transmission
        self.lane_xmits = [0] * e  # transmissions of the lane's current chunk
        # Transmissions in time order, (time, lane, chunk, xmits), for RACK loss detection
        # (only kept with fast_retransmit on); entries whose lane has moved on are skipped.
        self.xmit_order: deque[tuple[float, int, int, int]] = deque()
        self.lane_fast = [False] * e  # the lane's chunk was re-sent by RACK
        self.spurious = 0  # RACK re-sends the switch answered with WAITING (not lost after all)
        self.lane_tries = [0] * e
        self.lane_deadline = [0.0] * e
        self.lane_emax = [EXP_ZERO] * e
        self.nonfinite: set[int] = set()
        self.done = 0
        self.last_progress = now
        self.last_heard = now
        self.waiting_missing = 0
        self.waiting_chunk = -1


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

    def __init__(self, *, spec: JobSpec, rank: int, switch_address: Address,
                 config: WorkerConfig | None = None) -> None:
        if not 0 <= rank < spec.num_workers:
            raise LocalProtocolError(f"rank must be in 0..{spec.num_workers - 1}, got {rank}")
        self.spec = spec
        self.rank = rank
        self.switch_address = switch_address
        self._switch_text = format_address(switch_address)  # for error messages
        self.config = config or WorkerConfig()
        self.state = WorkerState.NEW
        self.error: str | None = None
        self.slot_base = 0
        self._next_set = [0] * spec.window
        self._seq = 0
        self._epoch_seq = 0  # first operation of the current epoch; sent in JOIN/KEEPALIVE
        self._keepalive_at = 0.0
        self._op: _Op | None = None
        self._heap: list[tuple[float, int, int]] = []
        self._out: list[tuple[bytes, Address]] = []
        self._events: deque[Event] = deque()
        self._control_retry_at = 0.0
        self._control_deadline = 0.0
        self._control_backoff = _CONTROL_RETRY_S
        self._srtt: float | None = None
        self._min_rtt: float | None = None
        self._fast_retransmit = self.config.fast_retransmit
        self._reo_scale = 1  # the reorder window, in units of the base window
        self._rttvar = 0.0
        self._rto = self.config.initial_rto_s
        self.drops: Counter[str] = Counter()
        """Dropped datagrams by reason."""
        self.counters: Counter[str] = Counter()
        """``packets_sent``, ``payload_bytes_sent``, ``retransmissions``, ``results_received``,
        ``waiting_received``, ``mismatch_received``, ``fast_retransmissions``,
        ``spurious_fast_retransmissions``,
        ``operations_completed``,
        ``operations_failed``."""
        self._handlers = {
            MessageType.WAITING: self._handle_waiting,
            MessageType.MISMATCH: self._handle_mismatch,
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
            self.counters["operations_completed"] += 1
            return seq
        op = _Op(seq, x, o, self.spec.elements_per_packet, self.spec.window, now, bits, residual)
        self._op = op
        self._heap = []
        self.state = WorkerState.BUSY
        for p in range(op.E):
            self._send_chunk(op, p, now, retransmit=False)
        return seq

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

    def receive_datagram(self, data: bytes | bytearray | memoryview, addr: Address,
                         now: float) -> None:
        """Process one datagram from the switch. Call ``datagrams_to_send`` afterwards."""
        # NOTE: RESULT fast path, inlined for speed: one struct unpack, no Header object.
        if len(data) >= HEADER_SIZE:
            f = HEADER.unpack_from(data)
            if (f[2] == _RESULT and f[0] == MAGIC and f[1] == VERSION and f[4] <= 1
                    and not f[3] & ~KNOWN_FLAGS and (f[12] == _INT32 or f[12] == _INT16)
                    and len(data) == HEADER_SIZE + (4 if f[12] == _INT32 else 2) * f[11]):
                if f[6] != self.spec.job_id or f[7] != self.spec.token:
                    self.drops["foreign"] += 1
                    return
                self._handle_result(f, data, now)
                return
        try:
            h = unpack_header(data)
        except WireError as exc:
            self.drops[exc.reason] += 1
            return
        if h.job != self.spec.job_id or h.token != self.spec.token:
            self.drops["foreign"] += 1
            return
        handler = self._handlers.get(h.type)
        if handler is None:
            self.drops["unexpected_type"] += 1
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
            heap = self._heap
            while heap:
                deadline, i, p = heap[0]
                if op.lane_chunk[i] == p and op.lane_deadline[i] == deadline:
                    break
                heapq.heappop(heap)
            fail_at = op.last_progress + self.config.op_timeout_s
            return min(heap[0][0], fail_at) if heap else fail_at
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
        return self._rto

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
        self._out.append((pack_header(header) + payload, self.switch_address))
        self._arm_control_retry(now)

    def _send_keepalive(self, now: float) -> None:
        header = Header(MessageType.KEEPALIVE, self.spec.job_id, rank=self.rank,
                        token=self.spec.token, seq=self._epoch_seq)
        self._out.append((pack_header(header), self.switch_address))
        self._keepalive_at = now + self.config.keepalive_s

    def _send_leave(self, now: float) -> None:
        self._out.append((pack_header(self._control_header(MessageType.LEAVE)),
                          self.switch_address))
        self._arm_control_retry(now)

    def _arm_control_retry(self, now: float) -> None:
        self._control_retry_at = now + self._control_backoff
        self._control_backoff = min(self._control_backoff * 2, 2.0)

    def _send_chunk(self, op: _Op, p: int, now: float, *, retransmit: bool,
                    fast: bool = False) -> None:
        """Build packet ``p`` from the input (also for a retransmission) and queue it.

        ``fast``: a RACK re-send: it does not back the lane's timeout off (``lane_tries``
        counts timeouts only) but, as any re-send, ends the lane's RTT samples (Karn).
        """
        i = p % op.E
        if retransmit:
            set_bit = op.lane_set[i]
            if fast:
                op.lane_fast[i] = True
            else:
                op.lane_tries[i] += 1
            op.lane_xmits[i] += 1
            self.counters["retransmissions"] += 1
        else:
            set_bit = self._next_set[i]
            self._next_set[i] = set_bit ^ 1
            op.lane_set[i] = set_bit
            op.lane_chunk[i] = p
            op.lane_tries[i] = 0
            op.lane_xmits[i] = 0
            op.lane_sent_at[i] = now
            op.lane_fast[i] = False
        k = op.k
        flags = 0
        exp_data = exp_next = EXP_ZERO
        payload: np.ndarray | bytes = b""
        if op.is_float:
            if p < op.L:
                exp_next, nonfinite = block_exponent(op.x[p * k:(p + 1) * k])
                if nonfinite:
                    op.nonfinite.add(p)
                flags |= _HAS_EXP
            if p >= op.E:
                b = p - op.E
                exp_data = op.lane_emax[i]
                nonfinite = b in op.nonfinite
                xb = op.x[b * k:(b + 1) * k]
                payload = quantize(xb, exp_data, self.spec.num_workers, nonfinite=nonfinite,
                                   bits=op.bits)
                if op.residual is not None and not retransmit:
                    residual_into(op.residual[b * k:(b + 1) * k], xb, payload, exp_data,
                                  self.spec.num_workers, bits=op.bits)
                flags |= _HAS_DATA | (_NONFINITE if nonfinite else 0)
        else:
            payload = op.x[p * k:(p + 1) * k]
            flags |= _HAS_DATA
        count = len(payload) // 4 if isinstance(payload, bytes) else payload.size
        hdr = HEADER.pack(MAGIC, VERSION, _REQUEST, flags, set_bit, self.rank,
                          self.spec.job_id, self.spec.token, op.seq, p, self.slot_base + i, count,
                          op.elem, op.digest, exp_data, exp_next)
        self._out.append((b"".join((hdr, payload)), self.switch_address))
        self.counters["packets_sent"] += 1
        self.counters["payload_bytes_sent"] += count * op.itemsize
        rto = min(self._rto * (2 ** op.lane_tries[i]), self.config.max_rto_s)
        deadline = now + rto
        op.lane_deadline[i] = deadline
        heapq.heappush(self._heap, (deadline, i, p))
        op.lane_xmit_at[i] = now
        if self._fast_retransmit:
            op.xmit_order.append((now, i, p, op.lane_xmits[i]))

    # -- Receiving ---------------------------------------------------------------------------

    def _handle_result(self, f: tuple, data: bytes | bytearray | memoryview, now: float) -> None:
        """Take a result (``f``: the raw header tuple, framing and job already checked)."""
        (_m, _v, _t, flags, set_bit, _rank, _job, _token, seq, p, slot, count, elem, _r, exp_data,
         exp_next) = f
        op = self._op
        if op is None or seq != op.seq or self.state is not WorkerState.BUSY:
            self.drops["stale_result"] += 1
            return
        i = p % op.E
        if p >= op.T or op.lane_chunk[i] != p:
            self.drops["duplicate_result"] += 1
            return
        if slot != self.slot_base + i or set_bit != op.lane_set[i]:
            self.drops["bad_slot"] += 1
            return
        if count and elem != op.elem:
            self.drops["bad_count"] += 1
            return
        k = op.k
        if op.is_float:
            if p >= op.E:
                b = p - op.E
                blk = op.out[b * k:(b + 1) * k]
                if count != blk.size:
                    self.drops["bad_count"] += 1
                    return
                q = np.frombuffer(data, dtype=op.wire_dtype, count=count, offset=HEADER_SIZE)
                dequantize_into(blk, q, exp_data, self.spec.num_workers,
                                nonfinite=bool(flags & _NONFINITE), bits=op.bits)
            elif count:
                self.drops["bad_count"] += 1
                return
            if p < op.L:
                op.lane_emax[i] = exp_next
        else:
            blk = op.out[p * k:(p + 1) * k]
            if count != blk.size:
                self.drops["bad_count"] += 1
                return
            blk[...] = np.frombuffer(data, dtype="<i4", count=count, offset=HEADER_SIZE)
        self.counters["results_received"] += 1
        delivered_xmit = op.lane_xmit_at[i]
        if op.lane_xmits[i] == 0:
            self._update_rtt(now - op.lane_sent_at[i])
        elif self._min_rtt is not None and now - delivered_xmit < self._min_rtt:
            # Too soon to answer the re-send: it answers an earlier transmission (RFC 8985
            # 6.2 step 2), so only that one's time says which chunks were sent before it.
            delivered_xmit = op.lane_sent_at[i]
            if op.lane_fast[i]:
                self._spurious(op, i)  # the chunk was not lost: the RACK re-send was early
        op.done += 1
        op.last_progress = op.last_heard = now
        nxt = p + op.E
        if nxt < op.T:
            self._send_chunk(op, nxt, now, retransmit=False)
        else:
            op.lane_chunk[i] = -1
        if self._fast_retransmit and op.done < op.T:
            self._detect_losses(op, delivered_xmit, now)
        if op.done == op.T:
            if not op.spurious and self._reo_scale > 1:
                self._reo_scale //= 2  # a clean operation: narrow the window again
            self._op = None
            self._heap = []
            self.state = WorkerState.READY
            self._keepalive_at = now + self.config.keepalive_s
            self.counters["operations_completed"] += 1
            self._events.append(OperationCompleted(op.seq))

    def _detect_losses(self, op: _Op, delivered_xmit: float, now: float) -> None:
        """RACK (RFC 8985): a result for a chunk sent at ``delivered_xmit`` means every chunk
        still outstanding that was sent more than the reorder window before it was lost (or its
        result was): re-send those now rather than at their timeouts."""
        if self._min_rtt is None or self._srtt is None:
            return
        window = min(max(self._min_rtt / 4, self.config.min_reorder_window_s) * self._reo_scale,
                     self._srtt + 4 * self._rttvar)
        order = op.xmit_order
        lane_chunk, lane_xmits = op.lane_chunk, op.lane_xmits
        while order:
            t, i, p, xmits = order[0]
            if lane_chunk[i] != p or lane_xmits[i] != xmits:
                order.popleft()  # that transmission is answered or superseded
            elif t + window < delivered_xmit:
                order.popleft()
                self.counters["fast_retransmissions"] += 1
                self._send_chunk(op, p, now, retransmit=True, fast=True)
            else:
                break

    def _spurious(self, op: _Op, i: int) -> None:
        """A RACK re-send of lane ``i`` was not needed: results come back more out of order
        than the reorder window allows. Widen it (RFC 8985 6.2)."""
        op.lane_fast[i] = False
        op.spurious += 1
        self.counters["spurious_fast_retransmissions"] += 1
        self._reo_scale = min(self._reo_scale * 2, 1024)

    def _handle_waiting(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self.drops["stale_result"] += 1
            return
        self.counters["waiting_received"] += 1
        op.last_heard = now
        i = h.chunk % op.E
        if op.lane_fast[i] and op.lane_chunk[i] == h.chunk:
            self._spurious(op, i)  # our chunk was in the switch all along
        op.waiting_missing = int.from_bytes(bytes(unpack_payload(data, h)), "little")
        op.waiting_chunk = h.chunk

    def _handle_mismatch(self, h: Header, data: bytes | bytearray | memoryview,
                         now: float) -> None:
        """The ranks disagree about a chunk of this operation: it can never complete; fail now."""
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self.drops["stale_result"] += 1
            return
        try:
            m = unpack_mismatch(unpack_payload(data, h))
        except WireError as exc:
            self.drops[exc.reason] += 1
            return
        ranks = [r for r in range(self.spec.num_workers) if m.ranks >> r & 1]
        self.counters["mismatch_received"] += 1
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
            self.drops[exc.reason] += 1
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
        self.slot_base = info.slot_base
        if self.state is WorkerState.REJOINING:
            self._resume_after_rejoin(now)
            return
        self.state = WorkerState.READY
        self._keepalive_at = now + self.config.keepalive_s
        self._events.append(Joined(info.slot_base, info.window))

    def _handle_refused(self, h: Header, data: bytes | bytearray | memoryview,
                        now: float) -> None:
        if self.state not in (WorkerState.JOINING, WorkerState.REJOINING):
            self.drops["unexpected_control"] += 1
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
            self._next_set = [0] * self.spec.window
            self.state = WorkerState.JOINING
            self._control_deadline = now + self.config.join_timeout_s
            self._control_backoff = _CONTROL_RETRY_S
            self._send_join(now)
        else:
            self.drops["stale_unknown_job"] += 1

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
        self.counters["operations_restarted"] += 1
        # From here on the operation is ``new_seq``: a failure is reported under it, and late
        # results of the old epoch no longer match it.
        op.seq = new_seq
        self._epoch_seq = new_seq
        self.state = WorkerState.REJOINING
        self._heap = []
        self._control_deadline = now + self.config.join_timeout_s
        self._control_backoff = _CONTROL_RETRY_S
        self._send_join(now)

    def _resume_after_rejoin(self, now: float) -> None:
        old = self._op
        assert old is not None
        op = _Op(self._epoch_seq, old.x, old.out, self.spec.elements_per_packet,
                 self.spec.window, now, old.bits, old.residual)
        op.restarts = old.restarts + 1
        self._op = op
        self._seq = (self._epoch_seq + 1) & 0xFFFFFFFF
        self._next_set = [0] * self.spec.window  # a fresh switch: every rank starts on set 0
        self.state = WorkerState.BUSY
        for p in range(op.E):
            self._send_chunk(op, p, now, retransmit=False)

    def _handle_left(self, h: Header, data: bytes | bytearray | memoryview, now: float) -> None:
        if self.state is not WorkerState.CLOSING:
            self.drops["unexpected_control"] += 1
            return
        self.state = WorkerState.CLOSED
        self._events.append(Left())

    # -- Timers and failure ------------------------------------------------------------------

    def _handle_op_timers(self, now: float) -> None:
        op = self._op
        assert op is not None
        heap = self._heap
        while heap and heap[0][0] <= now:
            deadline, i, p = heapq.heappop(heap)
            if op.lane_chunk[i] == p and op.lane_deadline[i] == deadline:
                self._send_chunk(op, p, now, retransmit=True)
        idle = now - op.last_progress
        if idle >= self.config.op_timeout_s:
            self._fail(self._silence_reason(op, idle))

    def _silence_reason(self, op: _Op, idle: float) -> str:
        where = f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank})"
        if op.waiting_missing and op.last_heard > op.last_progress:
            ranks = [r for r in range(self.spec.num_workers) if op.waiting_missing >> r & 1]
            return (f"{where} made no progress for {idle:.1f} s: the switch at "
                    f"{self._switch_text} answers, but rank(s) {ranks} have not sent "
                    f"chunk {op.waiting_chunk}")
        return (f"{where} made no progress for {idle:.1f} s: no answer from the switch at "
                f"{self._switch_text} for {op.last_progress - op.last_heard + idle:.1f} s")

    def _fail(self, reason: str) -> None:
        op = self._op
        assert op is not None
        self._op = None
        self._heap = []
        self.state = WorkerState.ERROR
        self.error = reason
        self.counters["operations_failed"] += 1
        self._events.append(OperationFailed(op.seq, reason))

    def _join_failed(self, reason: str) -> None:
        self.state = WorkerState.ERROR
        self.error = reason
        self._events.append(JoinFailed(reason))

    def _update_rtt(self, sample: float) -> None:
        """RFC 6298: srtt/rttvar smoothing; rto = srtt + 4 rttvar, clamped."""
        if self._min_rtt is None or sample < self._min_rtt:
            self._min_rtt = sample
        if self._srtt is None:
            self._srtt = sample
            self._rttvar = sample / 2
        else:
            self._rttvar = 0.75 * self._rttvar + 0.25 * abs(self._srtt - sample)
            self._srtt = 0.875 * self._srtt + 0.125 * sample
        cfg = self.config
        self._rto = min(max(self._srtt + 4 * self._rttvar, cfg.min_rto_s), cfg.max_rto_s)


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


def format_address(addr: Address) -> str:
    """``host:port``, as every error message and log line writes an address."""
    return f"{addr[0]}:{addr[1]}"

"""One all-reduce in flight on a worker, as the arrays the compiled kernels work on.

An operation of ``N`` elements is cut into ``L = ceil(N / k)`` blocks and uses
``E = min(W, L)`` lanes; a float operation has ``T = L + E`` packets (look-ahead exponents), an
integer one ``T = L`` (``worker.py`` explains the protocol). This module only builds the state:
``opv`` (scalars, ``kernels.OP``), ``lane``/``lanef`` (per lane, ``kernels.LN``/``LF``), the
exponents, the staged input and output, one preallocated transmit buffer per lane (rows of
one 2-D array, so that consecutive lanes' datagrams are one contiguous slice for UDP GSO), and
the queue of lanes to send.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.config import JobSpec
from switchml.protocol.dtypes import SUPPORTED_NAMES, finfo, is_float, is_supported, kernel_view
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.quantize import scale_bits
from switchml.protocol.wire import (
    AUTH_TAG_SIZE,
    EXP_ZERO,
    HEADER_SIZE,
    ElementType,
    operation_digest,
)

__all__ = ["WIRE_BITS", "Operation", "check_wire", "validate_arrays"]

WIRE_BITS = {32: (int(ElementType.INT32), 4), 16: (int(ElementType.INT16), 2)}
"""Wire width in bits -> (element type, bytes per element)."""
_NO_RESIDUAL = {np.dtype(np.float32): np.empty(0, np.float32),
                np.dtype(np.float64): np.empty(0, np.float64)}
"""The kernels' residual argument where there is none, of the input's residual type."""


def _checked_keys(spec: JobSpec, data_keys: Sequence[bytes | None] | None,
                  shards: int) -> list[bytes] | None:
    """An authenticated job's data keys, one of 16 bytes per shard (else LocalProtocolError);
    None for a job without a MAC."""
    if not spec.auth_data:
        return None
    if not data_keys or len(data_keys) != shards or any(k is None or len(k) != 16
                                                        for k in data_keys):
        raise LocalProtocolError("an authenticated job (auth_data) needs a 16-byte data key per "
                                 "shard")
    return [bytes(k) for k in data_keys if k is not None]


class Operation:
    """State of the operation in flight.

    The kernels read the input and write the results in the caller's own arrays, of any
    supported type (float16 and bfloat16 too: no staging copy). Requests are built into
    ``txbuf`` (one datagram per lane) and sent from views of it (``datagram``), with no copy
    per datagram. ``keep``: for an operation whose output is its input, a buffer of the
    input's type and size, apart from both, into which the kernels copy each input block as
    they send it (a restart needs the input, and results overwrite it); None otherwise.
    ``contrib``: in a quorum job, how many ranks each block's sum holds (written by the
    kernels as results land; 0 until then); None otherwise.
    """

    __slots__ = (
        "E", "L", "T", "bits", "contrib", "data_keys", "digest", "elem", "exps", "fmax", "in_place",
        "is_float", "itemsize", "k",
        "keep", "lane", "lanef", "nonf", "opv", "out", "outk", "picked", "res", "residual",
        "restarts", "run_order", "runs", "sendlen", "sendq", "seq", "spurious",
        "stage_res", "state", "stride", "tx16", "tx32", "tx8", "txbuf", "txflat",
        "waiting_chunk", "waiting_missing", "x", "xbits", "xk", "xmit_order")

    def __init__(self, *, seq: int, x: np.ndarray, out: np.ndarray, spec: JobSpec, rank: int,
                 slot_bases: Sequence[int], bits: int = 32,
                 residual: np.ndarray | None = None, keep: np.ndarray | None = None,
                 data_keys: Sequence[bytes | None] | None = None) -> None:
        self.seq, self.x, self.out, self.keep = seq, x, out, keep
        self.data_keys = _checked_keys(spec, data_keys, len(slot_bases))
        """``spec.auth_data``: its data key on each shard (lane i's: shard i mod S's)."""
        self.in_place = keep is not None
        """The caller's input is ``out`` (kept block by block in ``keep``, or, restarted,
        whole in ``x``): a failure puts it back (:meth:`restore_input`)."""
        self.is_float = is_float(x.dtype)
        self.bits = bits
        self.elem, self.itemsize = WIRE_BITS[bits]
        self.residual = residual
        self.restarts = 0
        self.digest = operation_digest(x.size, self.is_float, bits)
        self.k = spec.elements_per_packet * 4 // self.itemsize  # 16 bits: 2k per slot
        self.L = -(-x.size // self.k)
        self.E = min(spec.window, self.L)
        self.T = self.L + self.E if self.is_float else self.L
        tag = AUTH_TAG_SIZE if spec.auth_data else 0  # (an authenticated job's MAC)
        self.stride = HEADER_SIZE + self.k * self.itemsize + tag  # a lane's datagram, at most
        self._stage(x, out, residual)
        info = finfo(out.dtype) if self.is_float else None
        self.fmax = float(info.max) if info is not None else 0.0
        self.opv = self._scalars(spec, rank, slot_bases, info)
        self.lane = np.zeros((K.LN_FIELDS, self.E), np.int64)
        self.lane[K.LN.CHUNK] = -1
        self.lane[K.LN.EMAX] = EXP_ZERO
        # Lane i goes to shard i mod S, on that shard's slot i (each shard grants a base).
        lanes = np.arange(self.E)
        self.lane[K.LN.SLOT] = np.asarray(slot_bases, np.int64)[lanes % len(slot_bases)] + lanes
        if self.data_keys:  # and its requests and results that shard's MAC key
            keys = np.frombuffer(b"".join(self.data_keys), np.int64).reshape(-1, 2)
            self.lane[K.LN.MAC_K0] = keys[lanes % len(keys), 0]
            self.lane[K.LN.MAC_K1] = keys[lanes % len(keys), 1]
        self.lanef = np.zeros((K.LNF_FIELDS, self.E), np.float64)
        # Block exponents are computed as packets are built (kernels.build_request).
        self.exps = np.empty(self.L if self.is_float else 0, np.int64)
        self.contrib = np.zeros(self.L, np.int64) if spec.quorum else None
        self.nonf = np.zeros(self.L if self.is_float else 0, np.uint8)
        self.txbuf = np.zeros((self.E, self.stride), np.uint8)  # (never old heap bytes out)
        self.tx8 = self.txbuf.reshape(-1)  # the kernels' views: bytes, int16, int32
        self.tx16 = self.tx8.view(np.int16)
        self.tx32 = self.tx8.view(np.int32)
        self.txflat = memoryview(self.tx8)  # each lane's datagram is a slice of it (datagram)
        self.sendlen = np.zeros(self.E, np.int64)  # each lane's datagram: txbuf[i, :sendlen[i]]
        # Lanes queued to send (opv[NQ] of them), drained after every call. Between drains a
        # lane is released once (results) and may be re-sent (timers, NACKs, RACK): 4 per
        # lane is ample; a full queue is spilled into plain datagrams (worker.py).
        self.sendq = np.empty(4 * self.E + 64, np.int64)
        self.picked = np.empty(K.PROBE_LANES, np.int64)  # the idle probe's lanes (fire_timers)
        self.run_order = np.empty(self.sendq.size, np.int64)
        self.runs = np.empty((self.sendq.size, 5), np.int64)
        # Transmissions in time order, (time, lane, chunk, xmits): RACK's (recovery.py).
        self.xmit_order: deque[tuple[float, int, int, int]] = deque()
        self.spurious = 0  # the spurious RACK re-send count when the operation started
        self.waiting_missing = 0  # the ranks the switch last said it waits for (a bitmap)
        self.waiting_chunk = -1
        self.state = None  # the kernels' hand-off (kernels.OpState), from bind()

    def bind(self, rtt: np.ndarray, next_set: np.ndarray, cnt: np.ndarray) -> None:
        """Hand this operation's arrays, with the endpoint's round-trip state, lanes' next
        sets and counters, to the compiled kernels once (``kernels.OpState``: checked against
        each other and held while the operation lives); every kernel call then takes
        ``self.state``."""
        self.state = K.OpState(self.opv, self.lane, self.lanef, rtt, next_set, self.exps,
                               self.nonf, self.xk, self.xbits, self.outk, self.res, self.tx8,
                               self.tx16, self.tx32, cnt, self.sendq, self.sendlen, self.picked,
                               self.run_order, self.runs, self.stride,
                               None if self.keep is None else kernel_view(self.keep),
                               self.contrib)

    def _stage(self, x: np.ndarray, out: np.ndarray, residual: np.ndarray | None) -> None:
        """The arrays as the kernels take them (bfloat16 as its bits), and the residual's."""
        self.xk, self.outk = kernel_view(x), kernel_view(out)
        # The input's bits (block exponents are an integer max: kernels/numerics.py).
        self.xbits = x.view({2: np.uint16, 4: np.uint32, 8: np.uint64}[x.itemsize])
        # The residual in the input's float type, float32 for the half types, written by the
        # kernels in place: a float32 gradient's residual is float32 (staging it in float64
        # cost an allocation and a copy per element on every 16-bit DDP bucket).
        res_type = np.dtype(np.float64 if x.dtype in (np.float64, np.int32) else np.float32)
        self.stage_res = residual is not None and residual.dtype != res_type
        if residual is None:
            self.res = _NO_RESIDUAL[res_type]
        else:
            self.res = np.empty(x.size, res_type) if self.stage_res else residual

    def _scalars(self, spec: JobSpec, rank: int, slot_bases: Sequence[int],
                 info: np.finfo | None) -> np.ndarray:
        opv = np.zeros(K.O_FIELDS, np.int64)
        opv[K.OP.SEQ] = self.seq
        opv[K.OP.L], opv[K.OP.E], opv[K.OP.T], opv[K.OP.K] = self.L, self.E, self.T, self.k
        opv[K.OP.JOB] = spec.job_id
        opv[K.OP.TOKEN] = np.uint64(spec.token).view(np.int64)
        opv[K.OP.RANK] = rank
        opv[K.OP.SLOT_BASE] = slot_bases[0]
        opv[K.OP.ELEM], opv[K.OP.ITEMSIZE], opv[K.OP.DIGEST] = self.elem, self.itemsize, \
            self.digest
        scale = spec.scale_count
        opv[K.OP.P] = scale_bits(scale, self.bits)
        opv[K.OP.N] = scale  # the bound |sum| < scale * 2**emax
        opv[K.OP.IS_FLOAT] = self.is_float
        opv[K.OP.EDGE_EXP] = (info.maxexp - scale.bit_length()) if info is not None else 0
        opv[K.OP.TRAILER] = (spec.num_workers + 7) // 8 if spec.quorum else 0
        opv[K.OP.AUTH] = int(spec.auth_data)
        return opv

    def restarted(self, seq: int, spec: JobSpec, rank: int, slot_bases: Sequence[int],
                  data_keys: Sequence[bytes | None] | None = None) -> Operation:
        """The same operation from its input, as ``seq`` on a new epoch. In place (``keep``),
        the input is ``keep`` where a block's result has landed in ``x`` and ``x`` elsewhere;
        rebuilt into ``keep``, it is the restarted operation's input (apart from its output)."""
        x = self.x
        if self.keep is not None:
            landed = np.repeat(self.landed_blocks(), self.k)[:x.size]
            np.copyto(self.keep, x, where=~landed)
            x = self.keep
        op = Operation(seq=seq, x=x, out=self.out, spec=spec, rank=rank,
                       slot_bases=slot_bases, bits=self.bits, residual=self.residual,
                       data_keys=data_keys)
        op.restarts = self.restarts + 1
        op.in_place = self.in_place
        return op

    def restore_input(self) -> None:
        """After a failure: leave an in-place operation's array holding its input again. The
        blocks whose results landed come back from ``keep`` (the others were never
        overwritten); a restarted operation's whole input is in ``x`` (the first one's
        ``keep``, rebuilt). Nothing to do for one whose output is not its input."""
        if self.keep is not None:
            landed = np.repeat(self.landed_blocks(), self.k)[:self.x.size]
            np.copyto(self.x, self.keep, where=landed)
        elif self.in_place and self.out is not self.x:
            np.copyto(self.out, self.x)

    def awaits(self, chunk: int, slot: int) -> bool:
        """Whether packet ``chunk``, sent on switch slot ``slot``, is its lane's current one:
        sent, and its result not in yet."""
        if not 0 <= chunk < self.T:
            return False
        i = chunk % self.E
        return bool(self.lane[K.LN.SLOT, i] == slot and self.lane[K.LN.CHUNK, i] == chunk)

    def landed_blocks(self) -> np.ndarray:
        """Which blocks' results are in ``out`` (a bool per block). Lane ``i`` carries packets
        ``i, i + E, ...`` one after another (a float operation's packet ``p`` holds block
        ``p - E``); a lane's current packet (``LN.CHUNK``, -1 once it has carried its last)
        has not landed, those before it have."""
        blocks = np.arange(self.L)
        packet = blocks + self.E if self.is_float else blocks
        current = self.lane[K.LN.CHUNK][packet % self.E]
        return (current < 0) | (packet < current)

    def datagram(self, lane: int) -> memoryview:
        """Lane ``lane``'s datagram: a view of its row of ``txbuf`` (no copy). Made when
        asked, not one per lane per operation: a list of ``E`` views cost about 60 us per
        operation at E = 128, a quarter of starting one."""
        start = lane * self.stride
        return self.txflat[start:start + int(self.sendlen[lane])]

    def finish(self) -> None:
        """Copy a staged residual into the caller's array."""
        if self.stage_res:
            self.residual[...] = self.res  # type: ignore[index]

    def describe(self) -> str:
        """``N float elements in B bits``, for error messages."""
        kind = "float" if self.is_float else "int32"
        return f"{self.x.size} {kind} elements in {self.bits} bits"


def validate_arrays(data: np.ndarray, out: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Validate the user's arrays and return flat views of both (no copies).

    Raises:
        LocalProtocolError: not numpy arrays, not C-contiguous, an unsupported or non-native
            dtype, ``out`` of another dtype or size, or a read-only ``out``.
    """
    for name, a in (("data", data), ("out", out)):
        if not isinstance(a, np.ndarray):
            raise LocalProtocolError(f"{name} must be a numpy array, got {type(a).__name__}")
        if not a.flags.c_contiguous:
            raise LocalProtocolError(f"{name} must be C-contiguous (use np.ascontiguousarray)")
    if not is_supported(data.dtype) or not data.dtype.isnative:
        raise LocalProtocolError(
            f"unsupported dtype {data.dtype}; supported: {', '.join(SUPPORTED_NAMES)}")
    if out.dtype != data.dtype or out.size != data.size:
        raise LocalProtocolError(
            f"out must match data: got {out.dtype}[{out.size}] for {data.dtype}[{data.size}]")
    if not out.flags.writeable:
        raise LocalProtocolError("out must be writeable")
    return data.reshape(-1), out.reshape(-1)


def check_wire(x: np.ndarray, o: np.ndarray, bits: int, residual: np.ndarray | None
               ) -> np.ndarray | None:
    """Check ``bits`` and ``residual`` against the data; return the flat residual."""
    if bits not in WIRE_BITS:
        raise LocalProtocolError(f"bits must be 32 or 16, got {bits}")
    if bits != 32 and not is_float(x.dtype):
        raise LocalProtocolError(f"bits={bits} is for float data; {x.dtype} is summed exactly "
                                 "in 32 bits")
    if residual is None:
        return None
    if (not isinstance(residual, np.ndarray) or residual.dtype.kind != "f"
            or residual.size != x.size or not residual.flags.c_contiguous
            or not residual.flags.writeable or not is_float(x.dtype)):
        raise LocalProtocolError("residual must be a writeable C-contiguous float array "
                                 "of data's size, for float data")
    if np.may_share_memory(residual, x) or np.may_share_memory(residual, o):
        # the kernels write it as they send: a re-send re-quantizes data, and a result
        # lands in out
        raise LocalProtocolError("residual must not share memory with data or out")
    return residual.reshape(-1)

"""Switch capacity: how many REQUEST datagrams per second one software switch aggregates.

The switch runs in a process of its own (``bench.switchproc.SwitchProcess``: the real
``SwitchServer`` with its default settings), pinned to one core where there are two or more.
One generator process, pinned to another core, joins a job as N ranks (one UDP socket each: the
switch checks that a rank's data comes from the address it joined from) and replays prebuilt,
valid int32 REQUEST datagrams as fast as the switch answers: every rank keeps W slots in
flight, and a slot's next request leaves when its RESULT arrives (self-clocked, as real workers
do). Requests are built once in numpy buffers; per round only ``seq``, ``chunk`` and ``set`` are
patched. With batching (default) requests go out with UDP GSO and results come in with UDP GRO
(``transport/batching.py``), and a whole GRO batch is checked and answered with a few numpy
operations, so the generator's cost per datagram is far below the switch's.

Every result is checked (header against the outstanding request of its slot, payload against
the exact sum), and the switch's own counters are read before and after the measured interval.
The generator's CPU use is reported next to the switch's: a switch near 100% of its core is the
bottleneck; a generator near 100% means the figure is a lower bound of the switch's capacity.

Figures: datagrams/s into and out of the switch, payload GB/s (requests x K x 4 bytes), switch
CPU time per datagram received, drops by reason.

A sharded switch (``shards`` = S): S switch processes, shard i owning lanes i mod S of the job,
as ``switchml switch --shards S`` runs them. Shards share nothing, so G generator processes
(default one per shard) each feed a disjoint set of shards with all N ranks, one connected
socket per (rank, shard). The figures are given per shard and summed; the capacity figure
(datagrams/s at a whole core per shard) is the sum of the shards' own.
"""

from __future__ import annotations

import contextlib
import json
import multiprocessing as mp
import os
import select
import signal
import socket
import struct
import subprocess
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from switchml.bench.switchproc import SwitchProcess
from switchml.protocol.address import format_address
from switchml.protocol.auth import job_key, join_datagram, leave_proof
from switchml.protocol.wire import (
    AT,
    EXP_ZERO,
    HEADER,
    HEADER_DTYPE,
    HEADER_SIZE,
    MAX_ELEMENTS_PER_PACKET,
    NO_COOKIE,
    ControlInfo,
    ElementType,
    Flags,
    Header,
    MessageType,
    operation_digest,
    pack_header,
    pack_leave,
    unpack_header,
    unpack_joined,
)
from switchml.transport.batching import (
    MAX_GSO_BYTES,
    MAX_SEGMENTS,
    RECV_BUFFER_BYTES,
    SOL_UDP,
    UDP_SEGMENT,
    enable_gro,
    gso_supported,
    receive_segments,
    segments,
)
from switchml.transport.sockets import size_buffers

__all__ = ["SwitchCapConfig", "SwitchCapResult", "run_switchcap", "write_json"]

# The switch's default limits (the benchmark runs it with its default settings).
_MAX_WINDOW = 256
_MAX_WORKERS = 256  # one socket per rank in one process; far above what two cores can feed
_MAX_SECONDS = 3600.0
_MAX_SHARDS = 64
_CHUNKS_PER_OP_LANES = 1 << 16  # an operation is W x 65536 chunks; then seq moves on
_REQUEST = int(MessageType.REQUEST)
_RESULT = int(MessageType.RESULT)
_SEQ_CHUNK = struct.Struct("<II")
assert AT["chunk"] == AT["seq"] + 4  # _SEQ_CHUNK writes both at AT["seq"]
_SOCKET_BUFFER_BYTES = 8 * 2**20


@dataclass(frozen=True)
class SwitchCapConfig:
    workers: int = 4
    elements_per_packet: int = 256
    window: int = 64
    seconds: float = 5.0
    batching: bool = True
    """UDP GSO/GRO in the switch and in the generator."""
    warmup_s: float = 0.5
    """Traffic before the measured interval starts."""
    drain_s: float = 2.0
    """After the interval: how long to wait for the results of requests in flight."""
    rto_s: float = 1.0
    """A request without its result for this long is sent again (loss recovery only; on
    loopback it should never fire)."""
    first_result_timeout_s: float = 120.0
    """How long the first result may take (a switch may compile its data plane first)."""
    shards: int = 1
    """Switch processes (``switchml switch --shards``): lane i of the job on shard i mod S."""
    generators: int = 0
    """Generator processes, each serving a disjoint set of shards with all N ranks; 0: one
    per shard (a generator costs more CPU per datagram than a shard does)."""

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= _MAX_WORKERS:
            raise ValueError(f"--workers must be in 1..{_MAX_WORKERS}, got {self.workers}")
        if not 1 <= self.elements_per_packet <= MAX_ELEMENTS_PER_PACKET:
            raise ValueError(f"--elements-per-packet must be in 1..{MAX_ELEMENTS_PER_PACKET} "
                             f"(int32 elements in one UDP datagram), got "
                             f"{self.elements_per_packet}")
        if not 1 <= self.window <= _MAX_WINDOW:
            raise ValueError(f"--window must be in 1..{_MAX_WINDOW} (the switch's default "
                             f"max_window), got {self.window}")
        if not 1 <= self.shards <= _MAX_SHARDS:
            raise ValueError(f"--shards must be in 1..{_MAX_SHARDS}, got {self.shards}")
        if self.shards > self.window:
            raise ValueError(f"--shards ({self.shards}) must be at most --window "
                             f"({self.window}): every shard needs a lane")
        if not 0 <= self.generators <= self.shards:
            raise ValueError(f"--generators must be in 0..--shards ({self.shards}), got "
                             f"{self.generators}")
        if self.workers * -(-self.shards // (self.generators or self.shards)) > _MAX_WORKERS:
            raise ValueError(f"--workers x shards per generator must be at most "
                             f"{_MAX_WORKERS} sockets in one generator")
        if not 0 < self.seconds <= _MAX_SECONDS:
            raise ValueError(f"--seconds must be in (0, {_MAX_SECONDS:g}], got {self.seconds}")
        if (self.warmup_s < 0 or self.drain_s < 0 or self.rto_s <= 0
                or self.first_result_timeout_s <= 0):
            raise ValueError("warmup_s and drain_s must be >= 0, rto_s and "
                             "first_result_timeout_s > 0")

    @property
    def datagram_bytes(self) -> int:
        return HEADER_SIZE + 4 * self.elements_per_packet


@dataclass
class SwitchCapResult:
    config: dict[str, Any]
    interval_s: float
    """Measured interval, as the parent saw it between its two snapshots of the switch."""
    switch_datagrams_in: int
    switch_datagrams_out: int
    switch_in_per_s: float
    switch_out_per_s: float
    payload_gbytes_per_s: float
    """Requests into the switch x K x 4 bytes, per second (aggregated over the ranks)."""
    switch_cpu_percent: float
    """Summed over the shards, in % of one core (so up to S x 100)."""
    generator_cpu_percent: float
    """Summed over the generators, in % of one core."""
    other_cpu_percent: float
    """CPU the rest of the machine used meanwhile (this parent, other processes, interrupts),
    in % of one core: more than a few percent means the figures were taken under load."""
    switch_cpu_us_per_datagram: float
    """Switch CPU time over the interval / datagrams it received in the interval."""
    switch_capacity_per_s: float
    """Per shard, datagrams in / its CPU seconds, summed over the shards: datagrams in per
    second the switch would take with a whole core per shard (an extrapolation; equals the
    measured rate when every shard is the bottleneck, and is less disturbed by other load
    than the rate is)."""
    bottleneck: str
    generator: dict[str, Any]
    """Generator counters over the interval (requests, results, per second) and for the
    whole run (``*_total``)."""
    drops: dict[str, int]
    """Switch drop counters over the whole run (a fresh switch), by reason."""
    switch_errors: dict[str, int]
    switch_stats: dict[str, Any]
    pinned: dict[str, Any]
    shards: list[dict[str, Any]] = field(default_factory=list)
    """Per shard: datagrams in and out per second, CPU %, CPU time per datagram, capacity."""
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def wrong_results(self) -> int:
        return int(self.generator["wrong_results_total"])

    @property
    def consistent(self) -> bool:
        """Every request sent was answered by exactly one result, except those in flight."""
        g = self.generator
        return bool(g["results_total"] == g["requests_total"] - g["in_flight_at_end"])


# -- helpers -----------------------------------------------------------------------------------

def _proc_cpu_s(pid: int) -> float:
    """utime + stime of a process (all its threads), from /proc/<pid>/stat."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _machine_busy_s() -> float:
    """CPU seconds spent busy by the whole machine so far (all cores), from /proc/stat."""
    with open("/proc/stat") as f:
        fields = f.readline().split()[1:]
    ticks = [int(x) for x in fields]
    idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)  # idle + iowait
    busy = sum(ticks[:8]) - idle  # user nice system idle iowait irq softirq steal
    return busy / os.sysconf("SC_CLK_TCK")


def _pin_process(pid: int, cpu: int) -> None:
    """Pin every thread of ``pid`` (affinity is per thread on Linux) to ``cpu``."""
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        tids = [pid]
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
        except OSError:  # a thread that just ended
            pass


def _record_dtype(k: int) -> np.dtype:
    """One datagram as a numpy record: the 40-byte header (``wire.HEADER``), then k int32."""
    dt = np.dtype([*((name, HEADER_DTYPE[name]) for name in HEADER_DTYPE.names),
                   ("payload", "<i4", (k,))])
    assert dt.itemsize == HEADER_SIZE + 4 * k and HEADER.size == HEADER_SIZE
    return dt


def _rank_values(rank: int, k: int) -> np.ndarray:
    """What rank ``rank`` sends in every request (distinct per rank and element)."""
    return (np.arange(k, dtype=np.int64) * 7 + 1000 * (rank + 1) - 3 * rank).astype(np.int32)


def _send_rows(sock: socket.socket, rows: np.ndarray, gso: bool, per_call: int) -> int:
    """Send the datagrams in ``rows`` (uint8, one per row); GSO runs of up to ``per_call``.
    Returns how many the kernel refused for lack of buffer (lost: recovered by ``rto_s``)."""
    m, size = rows.shape
    blocked = 0
    if gso and m > 1:
        anc = [(SOL_UDP, UDP_SEGMENT, struct.pack("=H", size))]
        for i in range(0, m, per_call):
            chunk = rows[i:i + per_call]
            try:
                if len(chunk) == 1:
                    sock.send(chunk[0])
                else:
                    sock.sendmsg([chunk], anc)
            except BlockingIOError:
                blocked += len(chunk)
        return blocked
    for i in range(m):
        try:
            sock.send(rows[i])
        except BlockingIOError:
            blocked += 1
    return blocked


# -- the generator process -----------------------------------------------------------------------

_INF = float("inf")


@dataclass
class _Clock:
    """The generator's phases: the instants they end at (set when the parent gives the start
    of the interval, after every generator's first result) and the counters taken at the
    start (``mark``) and at the end of the interval."""

    t0: float
    parent: int
    """The parent's pid at the start: a different one means the parent died."""
    t_first: float = _INF
    t_mark: float = _INF
    t_end: float = _INF
    t_drain: float = _INF
    marked: bool = False
    ended: bool = False
    mark: dict[str, Any] = field(default_factory=dict)
    end: dict[str, Any] = field(default_factory=dict)


class _Generator:
    """N ranks of one job in one process, on some of the switch's shards; see the module
    docstring.

    One connected socket per (rank, shard): socket ``j`` is rank ``j // m`` on the ``j % m``-th
    of this generator's m shards, and carries the lanes of that shard (lane i on shard
    i mod S). An unsharded switch is one shard. Shards share nothing, so generators that
    serve disjoint sets of shards run independently."""

    def __init__(self, shards: list[tuple[int, tuple[str, int]]], cfg: SwitchCapConfig,
                 job_id: int, token: int) -> None:
        self.cfg = cfg
        self.shards = shards
        self.job_id = job_id
        self.token = token
        n, w, k, s = cfg.workers, cfg.window, cfg.elements_per_packet, cfg.shards
        self.n, self.w, self.k, self.s = n, w, k, s
        self.size = cfg.datagram_bytes
        self.chunks_per_op = w * _CHUNKS_PER_OP_LANES
        self.digest = operation_digest(self.chunks_per_op * k, False, 32)
        self.rec = _record_dtype(k)
        m = len(shards)
        self.rank_of = [j // m for j in range(n * m)]
        self.shard_of = [shards[j % m][0] for j in range(n * m)]
        self.lanes = [np.arange(self.shard_of[j], w, s) for j in range(n * m)]
        """Per socket: the job's lanes it carries (those of its shard)."""
        self.socks: list[socket.socket] = []
        for j in range(n * m):
            sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
            self.socks.append(sock)
            sock.bind(("127.0.0.1", 0))
            sock.connect(shards[j % m][1])  # only that shard's datagrams reach this socket
            size_buffers(sock, _SOCKET_BUFFER_BYTES)
        self.gro = cfg.batching and all(enable_gro(x) for x in self.socks)
        self.gso = cfg.batching and all(gso_supported(x) for x in self.socks)
        self.per_call = max(1, min(MAX_SEGMENTS, MAX_GSO_BYTES // self.size))
        total = sum(_rank_values(r, k).astype(np.int64) for r in range(n))
        self.expected = total.astype(np.int32)  # int32 sums wrap, like the switch's
        self.expected_bytes = self.expected.tobytes()
        self.slot_base = [0] * (n * m)
        """Per socket: the first slot its shard granted the job."""
        self.raw: list[np.ndarray] = []
        self.req: list[np.ndarray] = []
        self.outstanding = [np.zeros(len(ln), dtype=bool) for ln in self.lanes]
        self.sent_at = [np.zeros(len(ln)) for ln in self.lanes]
        self.rounds = [np.zeros(len(ln), dtype=np.int64) for ln in self.lanes]
        self.target: list[np.ndarray] | None = None
        """Set when the interval ends: per socket and lane, the most requests any rank has
        sent on that lane. Ranks stop a lane there, so that no rank waits for a request
        another rank won't send (every lane ends complete, with nothing in flight)."""
        # Counters (per run).
        self.requests = 0  # first transmissions
        self.retransmissions = 0
        self.results = 0
        self.wrong = 0
        self.unexpected: dict[str, int] = {}
        self.send_blocked = 0
        self.recv_calls = 0
        self.joins_sent = 0
        self.cookies = [NO_COOKIE] * len(self.socks)  # each socket's JOINED cookie (LEAVE)
        self.control_replies: dict[str, int] = {}
        """Late answers to JOIN retries (CHALLENGE, JOINED) and to LEAVE: not anomalies."""
        self.send_calls = 0

    # -- control ---------------------------------------------------------------------------

    def join(self, timeout_s: float = 15.0) -> None:
        """JOIN every rank on every shard (rank 0 first: it creates the job), answering the
        switch's challenge as a worker does (open switch: no secret); raise on REFUSED or
        silence, naming the shard."""
        cfg = self.cfg
        info = ControlInfo(cfg.workers, cfg.window, cfg.elements_per_packet)
        key = job_key(None, self.job_id, self.token)
        deadline = time.monotonic() + timeout_s
        buf = bytearray(RECV_BUFFER_BYTES)
        view = memoryview(buf)
        for j, sock in enumerate(self.socks):
            rank, where = self.rank_of[j], self._where(j)
            fields = dict(job=self.job_id, token=self.token, rank=rank, seq=0, info=info)
            join = join_datagram(key, **fields)
            granted = None
            wait = 0.25
            while granted is None:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{where} did not answer JOIN of rank {rank} within "
                                       f"{timeout_s:g} s")
                sock.send(join)
                self.joins_sent += 1
                sock.settimeout(wait)
                wait = min(2 * wait, 2.0)  # the switch may be busy compiling
                try:
                    nbytes, _seg, _addr, _trunc = receive_segments(sock, buf, view)
                except TimeoutError:
                    continue
                try:
                    h = unpack_header(view[:nbytes])
                except Exception:  # noqa: BLE001 - not ours; ask again
                    continue
                body = bytes(view[HEADER_SIZE:nbytes])
                if h.type is MessageType.REFUSED:
                    raise RuntimeError(f"{where} refused rank {rank}: "
                                       f"{body.decode(errors='replace')}")
                if h.job != self.job_id:
                    continue
                if h.type is MessageType.CHALLENGE and len(body) == len(NO_COOKIE):
                    sock.send(join_datagram(key, cookie=body, **fields))
                    self.joins_sent += 1
                    try:
                        nbytes, _seg, _addr, _trunc = receive_segments(sock, buf, view)
                        h = unpack_header(view[:nbytes])
                    except Exception:  # noqa: BLE001 - lost or not ours; JOIN again
                        continue
                    body = bytes(view[HEADER_SIZE:nbytes])
                if h.type is MessageType.JOINED and h.job == self.job_id:
                    granted, self.cookies[j] = unpack_joined(body)
            self.slot_base[j] = granted.slot_base
            sock.setblocking(False)
        self._build()

    def _where(self, j: int) -> str:
        """Socket j's switch, for messages: ``the switch at A`` or ``shard i/S at A``."""
        shard, addr = self.shards[j % len(self.shards)]
        name = f"shard {shard}/{self.s}" if self.s > 1 else "the switch"
        return f"{name} at {format_address(addr)}"

    def leave(self) -> None:
        for j, sock in enumerate(self.socks):
            try:
                proof = leave_proof(job_key(None, self.job_id, self.token), job=self.job_id,
                                    token=self.token, rank=self.rank_of[j],
                                    cookie=self.cookies[j])
                sock.send(pack_leave(job=self.job_id, token=self.token, rank=self.rank_of[j],
                                     proof=proof))
            except OSError:
                pass

    def close(self) -> None:
        for s in self.socks:
            s.close()

    # -- requests --------------------------------------------------------------------------

    def _build(self) -> None:
        """Prebuild each socket's requests (its lanes' first chunks, set 0) from
        ``wire.pack_header``."""
        k = self.k
        for j, lanes in enumerate(self.lanes):
            rank, wl = self.rank_of[j], len(lanes)
            raw = np.zeros((wl, self.size), dtype=np.uint8)
            req = raw.view(self.rec).reshape(wl)
            hdr = pack_header(Header(MessageType.REQUEST, self.job_id, rank=rank,
                                     token=self.token, seq=1, chunk=0, slot=self.slot_base[j],
                                     set_bit=0, count=k, elem=ElementType.INT32,
                                     flags=int(Flags.HAS_DATA), exp_data=EXP_ZERO,
                                     exp_next=EXP_ZERO, digest=self.digest))
            raw[:, :HEADER_SIZE] = np.frombuffer(hdr, dtype=np.uint8)
            req["chunk"] = lanes
            req["slot"] = self.slot_base[j] + lanes
            req["payload"] = _rank_values(rank, k)
            # The record layout must be the wire's: decode a built request with wire.py.
            h = unpack_header(raw[wl - 1].tobytes())
            assert (h.type, h.rank, h.job, h.token, h.seq, h.chunk, h.slot, h.count, h.digest) \
                == (MessageType.REQUEST, rank, self.job_id, self.token, 1, lanes[-1],
                    self.slot_base[j] + lanes[-1], k, self.digest)
            self.raw.append(raw)
            self.req.append(req)

    def start(self) -> None:
        """Fill every rank's window."""
        now = time.monotonic()
        for j, sock in enumerate(self.socks):
            self._send(sock, self.raw[j])
            self.requests += len(self.lanes[j])
            self.outstanding[j][:] = True
            self.sent_at[j][:] = now
            self.rounds[j][:] = 1

    def stop(self) -> None:
        """Stop sending: each lane ends at the round the furthest rank has reached."""
        m = len(self.shards)
        furthest = [np.max(np.stack(self.rounds[t::m]), axis=0) for t in range(m)]
        self.target = [furthest[j % m] for j in range(len(self.socks))]

    def _send(self, sock: socket.socket, rows: np.ndarray) -> None:
        m = len(rows)
        self.send_calls += -(-m // self.per_call) if self.gso and m > 1 else m
        self.send_blocked += _send_rows(sock, rows, self.gso, self.per_call)

    def _advance(self, j: int, idx: np.ndarray) -> None:
        """Move socket j's lanes ``idx`` (indices into its lanes) to their next chunk
        (chunk + W, other set)."""
        req = self.req[j]
        ch = req["chunk"][idx] + self.w
        wrap = ch >= self.chunks_per_op
        if wrap.any():  # the next operation: seq + 1, chunks from 0 again
            ch[wrap] -= self.chunks_per_op
            req["seq"][idx[wrap]] += 1
        req["chunk"][idx] = ch
        req["set"][idx] ^= 1

    def _index(self, j: int, slot: Any) -> Any:
        """Socket j's index of the lane in ``slot`` (scalar or array), and whether the slot is
        one of that socket's lanes at all."""
        off = slot - self.slot_base[j] - self.shard_of[j]
        idx = off // self.s
        return idx, (off >= 0) & (off % self.s == 0) & (idx < len(self.lanes[j]))

    # -- results ---------------------------------------------------------------------------

    def on_batch(self, j: int, data: np.ndarray, now: float) -> None:
        """Take m equal-sized datagrams (uint8, shape (m, size)) from socket j."""
        arr = data.view(self.rec).reshape(len(data))
        req = self.req[j]
        lanes, inside = self._index(j, arr["slot"].astype(np.int64))
        lanes_c = np.where(inside, lanes, 0)
        match = (inside & (arr["type"] == _RESULT) & (arr["job"] == self.job_id)
                 & (arr["seq"] == req["seq"][lanes_c]) & (arr["chunk"] == req["chunk"][lanes_c])
                 & (arr["set"] == req["set"][lanes_c]) & self.outstanding[j][lanes_c])
        if not match.all():
            self.unexpected["unmatched_result"] = (self.unexpected.get("unmatched_result", 0)
                                                   + int(len(match) - match.sum()))
            arr = arr[match]
            lanes = lanes[match]
        if self.retransmissions:  # only a re-send can bring two results for one lane
            lanes, first = np.unique(lanes, return_index=True)
            dup = len(arr) - len(lanes)
            if dup:
                self.unexpected["duplicate_result"] = (
                    self.unexpected.get("duplicate_result", 0) + dup)
            arr = arr[first]
        if not len(lanes):
            return
        bad = (arr["payload"] != self.expected).any(axis=1) | (arr["count"] != self.k)
        self.wrong += int(bad.sum())
        self.results += len(lanes)
        if self.target is not None:  # draining: a lane goes on only up to its target round
            go = self.rounds[j][lanes] < self.target[j][lanes]
            self.outstanding[j][lanes[~go]] = False
            lanes = lanes[go]
            if not len(lanes):
                return
        self._advance(j, lanes)
        self.rounds[j][lanes] += 1
        self._send(self.socks[j], self.raw[j][lanes])
        self.requests += len(lanes)
        self.sent_at[j][lanes] = now

    def on_one(self, j: int, view: memoryview, now: float) -> None:
        """One datagram, without numpy (the --no-batching path)."""
        if len(view) != self.size:
            self._other(view)
            return
        f = HEADER.unpack_from(view)
        i, inside = self._index(j, f[10])
        req = self.req[j]
        if not (f[2] == _RESULT and inside and f[6] == self.job_id
                and self.outstanding[j][i]):
            self.unexpected["unmatched_result"] = self.unexpected.get("unmatched_result", 0) + 1
            return
        rec = req[i]
        if f[8] != rec["seq"] or f[9] != rec["chunk"] or f[4] != rec["set"]:
            self.unexpected["unmatched_result"] = self.unexpected.get("unmatched_result", 0) + 1
            return
        if f[11] != self.k or bytes(view[HEADER_SIZE:]) != self.expected_bytes:
            self.wrong += 1
        self.results += 1
        if self.target is not None and self.rounds[j][i] >= self.target[j][i]:
            self.outstanding[j][i] = False
            return
        self.rounds[j][i] += 1
        chunk = int(rec["chunk"]) + self.w
        seq = int(rec["seq"])
        if chunk >= self.chunks_per_op:
            chunk -= self.chunks_per_op
            seq += 1
        row = self.raw[j][i]
        _SEQ_CHUNK.pack_into(row, AT["seq"], seq, chunk)  # chunk follows seq
        row[AT["set"]] ^= 1
        self.send_calls += 1
        try:
            self.socks[j].send(row)
        except BlockingIOError:
            self.send_blocked += 1
        self.requests += 1
        self.sent_at[j][i] = now

    def _other(self, view: memoryview) -> None:
        """Anything but a full-size result: WAITING, UNKNOWN_JOB, MISMATCH, LEFT, ..."""
        try:
            name = unpack_header(view).type.name.lower()
        except Exception:  # noqa: BLE001
            name = "malformed"
        if name in ("joined", "left", "challenge"):
            self.control_replies[name] = self.control_replies.get(name, 0) + 1
        else:
            self.unexpected[name] = self.unexpected.get(name, 0) + 1

    def retransmit_stuck(self, now: float) -> None:
        for j, sock in enumerate(self.socks):
            stuck = np.flatnonzero(self.outstanding[j] & (now - self.sent_at[j] > self.cfg.rto_s))
            if len(stuck):
                self._send(sock, self.raw[j][stuck])
                self.retransmissions += len(stuck)
                self.sent_at[j][stuck] = now

    def in_flight(self) -> int:
        return int(sum(int(o.sum()) for o in self.outstanding))

    def counters(self) -> dict[str, Any]:
        return {"t": time.monotonic(), "cpu_s": time.process_time(),
                "requests": self.requests, "results": self.results,
                "retransmissions": self.retransmissions, "wrong_results": self.wrong,
                "send_calls": self.send_calls, "recv_calls": self.recv_calls}

    # -- the loop ----------------------------------------------------------------------------

    def run(self, conn: Any) -> dict[str, Any]:
        """Warm up, tell the parent (``mark``), run the interval, tell it (``end``), drain."""
        ep = select.epoll()
        socket_of = {}
        for j, sock in enumerate(self.socks):
            ep.register(sock.fileno(), select.EPOLLIN)
            socket_of[sock.fileno()] = j
        buf = bytearray(RECV_BUFFER_BYTES)
        rx = (buf, memoryview(buf), np.frombuffer(buf, dtype=np.uint8))
        clock = _Clock(t0=time.monotonic(), parent=os.getppid())
        next_check = clock.t0 + 0.05
        self.start()
        while True:
            now = time.monotonic()
            if now >= next_check:
                next_check = now + 0.05
                if self._check(now, clock, conn):
                    break
            for fd, _ev in ep.poll(0.05):
                self._read_socket(socket_of[fd], rx, now)
        ep.close()
        return self._report(clock)

    def _check(self, now: float, clock: _Clock, conn: Any) -> bool:
        """The periodic check: the parent, the first result, mark, end; True when drained."""
        cfg = self.cfg
        if os.getppid() != clock.parent:  # the parent died: stop at once
            raise SystemExit(1)
        if clock.t_first == _INF:
            # The warm-up counts from the first result: a switch that compiles its
            # data plane on first use (numba, cold cache) may take half a minute.
            if self.results:
                clock.t_first = now
                conn.send(("first", now - clock.t0))
            elif now - clock.t0 > cfg.first_result_timeout_s:
                raise TimeoutError(f"no result from the switch within "
                                   f"{cfg.first_result_timeout_s:g} s of the first "
                                   "requests")
        elif clock.t_mark == _INF and conn.poll():
            # The parent's start of the interval, the same instant for every generator (the
            # monotonic clock is the machine's), once every shard has answered.
            clock.t_mark = float(conn.recv())
            clock.t_end = clock.t_mark + cfg.seconds
            clock.t_drain = clock.t_end + cfg.drain_s
        if not clock.marked and now >= clock.t_mark:
            clock.marked = True
            clock.mark = self.counters()
            conn.send(("mark", clock.mark))
        if not clock.ended and now >= clock.t_end:
            clock.ended = True
            self.stop()
            clock.end = self.counters()
            conn.send(("end", clock.end))
        if clock.ended and (not self.in_flight() or now >= clock.t_drain):
            return True
        if clock.t_first != _INF:  # no re-sends while the switch has not answered at all
            self.retransmit_stuck(now)
        return False

    def _read_socket(self, j: int, rx: tuple[bytearray, memoryview, np.ndarray],
                     now: float) -> None:
        """Take what socket j holds: until it is empty, or 64 reads (let the others in)."""
        buf, view, npbuf = rx
        sock = self.socks[j]
        size = self.size
        gro = self.gro
        for _ in range(64):
            try:
                if gro:
                    nbytes, seg, _a, truncated = receive_segments(sock, buf, view)
                else:
                    nbytes = sock.recv_into(buf)
                    seg, truncated = nbytes, False
            except BlockingIOError:
                break
            self.recv_calls += 1
            if truncated:
                self.unexpected["truncated"] = self.unexpected.get("truncated", 0) + 1
                continue
            if seg == size and nbytes % size == 0:
                if nbytes == size and not gro:
                    self.on_one(j, view[:nbytes], now)
                else:
                    self.on_batch(j, npbuf[:nbytes].reshape(-1, size), now)
            else:  # other message types, or a short last datagram in the batch
                for a, b in segments(nbytes, seg):
                    if b - a == size:
                        self.on_batch(j, npbuf[a:b].reshape(1, size), now)
                    else:
                        self._other(view[a:b])

    def _report(self, clock: _Clock) -> dict[str, Any]:
        """What the run sends the parent at its end."""
        final = self.counters()
        return {
            "mark": clock.mark, "end": clock.end, "final": final,
            "in_flight_at_end": self.in_flight(),
            "first_result_after_s": clock.t_first - clock.t0,
            "unexpected": dict(self.unexpected),
            "send_blocked": self.send_blocked,
            "joins_sent": self.joins_sent,
            "control_replies": dict(self.control_replies),
            "gso": self.gso, "gro": self.gro,
        }


def _generator_main(conn: Any, shards: list[tuple[int, tuple[str, int]]],
                    cfg_dict: dict[str, Any], job_id: int, token: int, cpu: int | None) -> None:
    gen = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        cfg = SwitchCapConfig(**cfg_dict)
        gen = _Generator(shards, cfg, job_id, token)
        gen.join()
        conn.send(("joined", {"slot_base": gen.slot_base, "gso": gen.gso, "gro": gen.gro}))
        if conn.recv() != "go":
            return
        report = gen.run(conn)
        gen.leave()
        conn.send(("done", report))
    except KeyboardInterrupt:
        pass
    except BaseException as exc:  # noqa: BLE001 - reported to the parent
        try:
            conn.send(("error", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass
    finally:
        if gen is not None:
            gen.close()


# -- the parent ----------------------------------------------------------------------------------

@dataclass
class _Generators:
    """The generator processes and the parent's ends of their pipes."""

    procs: list[Any] = field(default_factory=list)
    conns: list[Any] = field(default_factory=list)

    def recv_all(self, timeout_s: float, what: str) -> list[Any]:
        """Every generator's next message body (all of the same kind)."""
        return [_recv(c, p, timeout_s, what)[1] for c, p in zip(self.conns, self.procs)]

    def send_all(self, msg: Any) -> None:
        for c in self.conns:
            c.send(msg)

    def cpu_s(self) -> list[float]:
        return [_proc_cpu_s(p.pid) for p in self.procs]


def _recv(conn: Any, proc: Any, timeout_s: float, what: str) -> tuple[str, Any]:
    """The generator's next message, or an error naming what did not happen in time."""
    deadline = time.monotonic() + timeout_s
    while not conn.poll(min(0.25, max(0.0, deadline - time.monotonic()))):
        if not proc.is_alive():
            raise RuntimeError(f"the generator process exited with {proc.exitcode} before "
                               f"{what}")
        if time.monotonic() >= deadline:
            raise TimeoutError(f"the generator did not report {what} within {timeout_s:g} s")
    kind, body = conn.recv()
    if kind == "error":
        raise RuntimeError(f"the generator failed: {body}")
    return kind, body


def _switch_snapshot(sws: list[SwitchProcess]) -> dict[str, Any]:
    """Every shard's counters and CPU at one instant (CPU first: the stats call costs the
    switch)."""
    cpu = [_proc_cpu_s(sw.proc.pid) for sw in sws]
    busy = _machine_busy_s()
    t = time.monotonic()
    stats = []
    for i, sw in enumerate(sws):
        if not sw.proc.is_alive():
            raise RuntimeError(f"switch shard {i}/{len(sws)} at {format_address(sw.address)} "
                               f"exited with {sw.proc.exitcode}")
        stats.append(sw.stats())
    return {"t": t, "cpu_s": cpu, "busy_s": busy, "stats": stats}


@contextlib.contextmanager
def _children_ignore_sigint() -> Iterator[None]:
    """Start processes with SIGINT ignored (the disposition survives exec, and Python keeps
    it): on Ctrl-C only this process gets KeyboardInterrupt, and its teardown stops them."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, old)


def _commit() -> str | None:
    try:
        here = os.path.dirname(os.path.abspath(__file__))
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=here,
                             capture_output=True, text=True, timeout=5)
        return out.stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        return None


def _placement(cfg: SwitchCapConfig, cores: list[int]
               ) -> tuple[int, list[int | None], list[int | None]]:
    """How many generators, and the core each shard and each generator is pinned to (None:
    not pinned). Every process gets a core of its own where there are enough; otherwise the
    shards get one each (round robin) and the generators float."""
    s = cfg.shards
    g = cfg.generators or s
    if len(cores) >= s + g:
        return g, list(cores[:s]), list(cores[s:s + g])
    if len(cores) >= 2:
        return g, [cores[i % len(cores)] for i in range(s)], [None] * g
    return g, [None] * s, [None] * g


def run_switchcap(cfg: SwitchCapConfig,
                  progress: Callable[[str, float], None] | None = None) -> SwitchCapResult:
    """Run the benchmark; everything it started is stopped when it returns or raises.

    ``progress(text, fraction)``: optional, called about four times a second.
    """
    from switchml.control import new_job_spec

    def tell(text: str, fraction: float) -> None:
        if progress is not None:
            progress(text, fraction)

    cores = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    n_gen, switch_cpus, gen_cpus = _placement(cfg, cores)
    ctx = mp.get_context("spawn")
    spec = new_job_spec(cfg.workers, window=cfg.window,
                        elements_per_packet=cfg.elements_per_packet)
    tell("starting the switch" if cfg.shards == 1 else f"starting {cfg.shards} shards", 0.0)
    sws: list[SwitchProcess] = []
    gens = _Generators()
    ok = False
    try:
        with _children_ignore_sigint():  # Ctrl-C reaches this process only; it stops the others
            for i in range(cfg.shards):
                sws.append(SwitchProcess(ctx, batching=cfg.batching, shard=(i, cfg.shards)))
        for g in range(n_gen):
            mine = [(i, sws[i].address) for i in range(cfg.shards) if i % n_gen == g]
            parent_conn, child_conn = ctx.Pipe()
            proc = ctx.Process(target=_generator_main, daemon=True,
                               args=(child_conn, mine, asdict(cfg), spec.job_id, spec.token,
                                     gen_cpus[g]))
            with _children_ignore_sigint():
                proc.start()
            child_conn.close()
            gens.procs.append(proc)
            gens.conns.append(parent_conn)
        samples = _measure(cfg, sws, gens, switch_cpus, tell)
        ok = True
    finally:
        for proc in gens.procs:
            _stop_generator(proc, ok)
        for conn in gens.conns:
            conn.close()
        for sw in sws:
            sw.stop()
    pinned = {"switch_cpu": switch_cpus[0], "generator_cpu": gen_cpus[0], "cores": len(cores),
              "switch_cpus": switch_cpus, "generator_cpus": gen_cpus}
    return _result(cfg, samples, pinned, load_before)


def _measure(cfg: SwitchCapConfig, sws: list[SwitchProcess], gens: _Generators,
             switch_cpus: list[int | None], tell: Callable[[str, float], None]
             ) -> dict[str, Any]:
    """Join, warm up, measure, drain: the generators' reports and the shards' snapshots.

    Every generator runs the same interval: it starts ``warmup_s`` after the last shard's
    first result (shards may compile their data plane first, each at its own pace)."""
    tell("joining", 0.0)
    gens.recv_all(60.0, "joining the job")
    for sw, cpu in zip(sws, switch_cpus):
        if cpu is not None:
            _pin_process(sw.proc.pid, cpu)  # all its threads exist by now
    first = _switch_snapshot(sws)
    gens.send_all("go")
    tell("waiting for the first result (the switch may be compiling)", 0.0)
    first_s = max(gens.recv_all(cfg.first_result_timeout_s + 30.0,
                                "the switch's first result"))
    gens.send_all(time.monotonic() + cfg.warmup_s)  # one interval for every generator
    tell("warming up", 0.0)
    g_mark = gens.recv_all(cfg.warmup_s + 30.0, "the start of the interval")
    s_mark = _switch_snapshot(sws)
    c_gen0 = gens.cpu_s()
    _wait_for_interval(cfg, gens, tell)
    s_end = _switch_snapshot(sws)
    c_gen1 = gens.cpu_s()
    g_end = gens.recv_all(5.0, "the end of the interval")
    tell("draining", 1.0)
    reports = gens.recv_all(cfg.drain_s + 30.0, "its final counters")
    final = _switch_snapshot(sws)
    return {"first": first, "first_s": first_s, "g_mark": g_mark, "s_mark": s_mark,
            "c_gen0": c_gen0, "s_end": s_end, "c_gen1": c_gen1, "g_end": g_end,
            "reports": reports, "final": final}


def _wait_for_interval(cfg: SwitchCapConfig, gens: _Generators,
                       tell: Callable[[str, float], None]) -> None:
    """Until every generator says the interval ended (their messages are left in the
    pipes)."""
    t_end = time.monotonic() + cfg.seconds
    pending = list(zip(gens.conns, gens.procs))
    while pending:
        pending = [(c, p) for c, p in pending if not c.poll(0.25 / len(pending))]
        left = t_end - time.monotonic()
        for _c, p in pending:
            if not p.is_alive():
                raise RuntimeError(f"the generator process exited with {p.exitcode}")
        if left < -30.0:
            raise TimeoutError("the generator did not end the interval in time")
        tell(f"measuring ({max(left, 0):.0f} s left)",
             min(1.0, 1.0 - max(left, 0.0) / cfg.seconds))


def _stop_generator(gen: Any, ok: bool) -> None:
    """Let the generator end (terminate it first after a failure); kill it if it lingers."""
    if not ok:
        gen.terminate()
    gen.join(timeout=5)
    if gen.is_alive():
        gen.terminate()
        gen.join(timeout=5)
    if gen.is_alive():
        gen.kill()
        gen.join()


def _bottleneck(sw_pct: float, gen_pct: float, other_pct: float,
                machine_pct: float = 0.0) -> str:
    """Which side limited the rate, from the CPU each used over the interval (the busiest
    shard, the busiest generator) and the whole machine's use in % of all its cores."""
    if sw_pct >= 90.0 and gen_pct >= 90.0:
        return "both near 100% (the rate is a lower bound of the switch's)"
    if sw_pct >= 90.0:
        return "switch"
    if gen_pct >= 90.0:
        return "generator"
    if other_pct >= 20.0:
        return f"undetermined: other processes used {other_pct:.0f}% of a core"
    if machine_pct >= 90.0:
        return "the machine: every core busy (the rate is a lower bound of the switch's)"
    return "neither at 90% CPU (latency-bound)"


def _generator_figures(g_mark: dict[str, Any], g_end: dict[str, Any], report: dict[str, Any],
                       first_s: float) -> dict[str, Any]:
    """The generator's counters over the interval and (``*_total``) over the whole run."""
    g_dt = g_end["t"] - g_mark["t"]
    gfin = report["final"]
    return {
        "interval_s": g_dt,
        "requests": g_end["requests"] - g_mark["requests"],
        "results": g_end["results"] - g_mark["results"],
        "requests_per_s": (g_end["requests"] - g_mark["requests"]) / g_dt,
        "results_per_s": (g_end["results"] - g_mark["results"]) / g_dt,
        "cpu_percent_own_clock": 100.0 * (g_end["cpu_s"] - g_mark["cpu_s"]) / g_dt,
        "send_calls": g_end["send_calls"] - g_mark["send_calls"],
        "recv_calls": g_end["recv_calls"] - g_mark["recv_calls"],
        "requests_total": gfin["requests"],
        "results_total": gfin["results"],
        "retransmissions_total": gfin["retransmissions"],
        "wrong_results_total": gfin["wrong_results"],
        "in_flight_at_end": report["in_flight_at_end"],
        "first_result_after_s": first_s,
        "unexpected_total": report["unexpected"],
        "send_blocked_total": report["send_blocked"],
        "joins_sent": report["joins_sent"],
        "control_replies_total": report["control_replies"],
        "gso": report["gso"], "gro": report["gro"],
    }


def _merge_generators(figs: list[dict[str, Any]]) -> dict[str, Any]:
    """The generators' figures as one: counters and rates summed, dicts merged, the interval
    and the first result the longest, GSO/GRO only if every generator had them."""
    if len(figs) == 1:
        return figs[0]
    out: dict[str, Any] = {}
    for key, v in figs[0].items():
        vals = [f[key] for f in figs]
        if isinstance(v, bool):
            out[key] = all(vals)
        elif key in ("interval_s", "first_result_after_s"):
            out[key] = max(vals)
        elif isinstance(v, dict):
            out[key] = _sum_dicts(vals)
        else:
            out[key] = sum(vals)
    out["per_generator"] = figs
    return out


def _sum_dicts(ds: list[dict[str, Any]]) -> dict[str, Any]:
    """Numbers summed key by key (booleans: all true); other values from the first."""
    out: dict[str, Any] = {}
    for d in ds:
        for key, v in d.items():
            if key not in out:
                out[key] = dict(v) if isinstance(v, dict) else v
            elif isinstance(v, bool):
                out[key] = out[key] and v
            elif isinstance(v, (int, float)):
                out[key] += v
            elif isinstance(v, dict):
                out[key] = _sum_dicts([out[key], v])
    return out


_SHARD_LEVELS = frozenset({"jobs", "slots_in_use", "memory_bytes", "nack_gaps",
                           "elements_aggregated"})
"""Switch stats that describe one shard's state, not traffic: not summed over shards."""


def _sum_counters(stats: list[dict[str, Any]]) -> dict[str, Any]:
    """The shards' stats as one switch's: counters summed, drops merged; state (jobs, slots,
    gaps, ...) as shard 0 has it (each shard's own is in ``shards``)."""
    out = dict(stats[0])
    for key, v in stats[0].items():
        if key in _SHARD_LEVELS or isinstance(v, bool):
            continue
        if isinstance(v, (int, float)):
            out[key] = sum(st.get(key, 0) for st in stats)
        elif key == "drops":
            out[key] = _sum_dicts([st.get(key, {}) for st in stats])
    return out


def _shard_figures(i: int, dt: float, s_mark: dict[str, Any], s_end: dict[str, Any],
                   cpu: int | None) -> dict[str, Any]:
    """One shard's rate and CPU over the interval."""
    st0, st1 = s_mark["stats"][i], s_end["stats"][i]
    d_in = int(st1.get("packets_in", 0)) - int(st0.get("packets_in", 0))
    d_out = int(st1.get("packets_out", 0)) - int(st0.get("packets_out", 0))
    sw_cpu = s_end["cpu_s"][i] - s_mark["cpu_s"][i]
    return {"shard": i, "pinned_cpu": cpu, "datagrams_in": d_in, "datagrams_out": d_out,
            "in_per_s": d_in / dt, "out_per_s": d_out / dt,
            "cpu_s": sw_cpu, "cpu_percent": 100.0 * sw_cpu / dt,
            "cpu_us_per_datagram": 1e6 * sw_cpu / d_in if d_in else float("nan"),
            "capacity_per_s": d_in / sw_cpu if sw_cpu > 0 else float("nan")}


def _result(cfg: SwitchCapConfig, m: dict[str, Any], pinned: dict[str, Any],
            load_before: float) -> SwitchCapResult:
    """The figures from ``_measure``'s samples ``m``."""
    s_mark, s_end = m["s_mark"], m["s_end"]
    dt = s_end["t"] - s_mark["t"]
    shards = [_shard_figures(i, dt, s_mark, s_end, cpu)
              for i, cpu in enumerate(pinned["switch_cpus"])]
    d_in = sum(f["datagrams_in"] for f in shards)
    d_out = sum(f["datagrams_out"] for f in shards)
    sw_cpu = sum(f["cpu_s"] for f in shards)
    gen_pcts = [100.0 * (b - a) / dt for a, b in zip(m["c_gen0"], m["c_gen1"])]
    sw_pct = 100.0 * sw_cpu / dt
    gen_pct = sum(gen_pcts)
    busy_pct = 100.0 * (s_end["busy_s"] - s_mark["busy_s"]) / dt
    other_pct = max(0.0, busy_pct - sw_pct - gen_pct)
    generator = _merge_generators([
        _generator_figures(gm, ge, rep, m["first_s"])
        for gm, ge, rep in zip(m["g_mark"], m["g_end"], m["reports"])])
    final, first = m["final"]["stats"], m["first"]["stats"]
    fs = final[0] if len(final) == 1 else _sum_counters(final)
    errors = {key: sum(int(f.get(key, 0)) - int(b.get(key, 0)) for f, b in zip(final, first))
              for key in ("internal_errors", "send_errors", "truncated")}
    capacity = sum(f["capacity_per_s"] for f in shards)
    return SwitchCapResult(
        config={**asdict(cfg), "datagram_bytes": cfg.datagram_bytes,
                "generators": len(gen_pcts)},
        interval_s=dt,
        switch_datagrams_in=d_in, switch_datagrams_out=d_out,
        switch_in_per_s=d_in / dt, switch_out_per_s=d_out / dt,
        payload_gbytes_per_s=d_in * cfg.elements_per_packet * 4 / dt / 1e9,
        switch_cpu_percent=sw_pct, generator_cpu_percent=gen_pct, other_cpu_percent=other_pct,
        switch_cpu_us_per_datagram=1e6 * sw_cpu / d_in if d_in else float("nan"),
        switch_capacity_per_s=capacity,
        bottleneck=_bottleneck(max(f["cpu_percent"] for f in shards), max(gen_pcts),
                               other_pct, busy_pct / pinned["cores"]),
        generator=generator,
        drops={str(k): int(v) for k, v in dict(fs.get("drops", {})).items()},
        switch_errors=errors,
        switch_stats={k: v for k, v in fs.items() if k != "elements_aggregated"},
        pinned=pinned,
        shards=shards,
        machine={"cpus": os.cpu_count(), "uname": " ".join(os.uname()), "commit": _commit(),
                 "date": time.strftime("%Y-%m-%d"), "loadavg_before": load_before},
    )


def write_json(path: str, result: SwitchCapResult) -> None:
    doc = {"benchmark": "switch-capacity", **asdict(result),
           "wrong_results": result.wrong_results, "consistent": result.consistent}
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

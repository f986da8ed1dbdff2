"""The generator process: N ranks of one job replaying valid REQUEST datagrams at the switch's
shards as fast as they answer, every result checked (see the package docstring)."""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from switchml.protocol.address import format_address
from switchml.protocol.auth import join_datagram, key_for, leave_proof
from switchml.protocol.wire import (
    AT,
    EXP_ZERO,
    HEADER,
    HEADER_DTYPE,
    HEADER_SIZE,
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
    unpack_payload,
)
from switchml.protocol.wire import Field as F
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

if TYPE_CHECKING:
    from switchml.bench.switchcap.config import SwitchCapConfig

__all__ = ["generator_main"]

_CHUNKS_PER_OP_LANES = 1 << 16  # an operation is W x 65536 chunks; then seq moves on
_REQUEST = int(MessageType.REQUEST)
_RESULT = int(MessageType.RESULT)
_SEQ_CHUNK = struct.Struct("<II")
assert AT["chunk"] == AT["seq"] + 4  # _SEQ_CHUNK writes both at AT["seq"]
_SOCKET_BUFFER_BYTES = 8 * 2**20


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
        key = key_for(None, self.job_id, self.token)
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
                body = bytes(unpack_payload(view[:nbytes], h))  # (not a sealed reply's tag)
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
                    body = bytes(unpack_payload(view[:nbytes], h))
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
                proof = leave_proof(key_for(None, self.job_id, self.token), job=self.job_id,
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
        i, inside = self._index(j, f[F.SLOT])
        req = self.req[j]
        if not (f[F.TYPE] == _RESULT and inside and f[F.JOB] == self.job_id
                and self.outstanding[j][i]):
            self.unexpected["unmatched_result"] = self.unexpected.get("unmatched_result", 0) + 1
            return
        rec = req[i]
        if f[F.SEQ] != rec["seq"] or f[F.CHUNK] != rec["chunk"] or f[F.SET] != rec["set"]:
            self.unexpected["unmatched_result"] = self.unexpected.get("unmatched_result", 0) + 1
            return
        if f[F.COUNT] != self.k or bytes(view[HEADER_SIZE:]) != self.expected_bytes:
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
            # The warm-up counts from the first result.
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


def generator_main(conn: Any, shards: list[tuple[int, tuple[str, int]]],
                    cfg_dict: dict[str, Any], job_id: int, token: int, cpu: int | None) -> None:
    gen = None
    try:
        if cpu is not None:
            os.sched_setaffinity(0, {cpu})
        from switchml.bench.switchcap.config import SwitchCapConfig
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

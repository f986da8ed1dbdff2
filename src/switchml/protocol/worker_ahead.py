"""A quorum job's rank that fell behind: the results the switch multicast before this rank needed
them are kept, checked all at once, and fed through the results kernel when the rank's
operation reaches them (docs/protocol.md section 7, "A rank behind"). A rank that joins a
running quorum job (a replacement for one that died) is such a rank until it takes a live
rank's :class:`Position` (``resume``; section 7, "Joining a running job").

Part of :class:`~switchml.protocol.worker.WorkerEndpoint` (a base class of it, as
``worker_control.py`` is), split off so that the data path's module stays readable.
"""

from __future__ import annotations

import struct
from collections import Counter
from dataclasses import dataclass

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.config import JobSpec, WorkerConfig
from switchml.protocol.errors import LocalProtocolError
from switchml.protocol.lifecycle import WorkerState
from switchml.protocol.operation import Operation
from switchml.protocol.wire import (
    AT,
    HEADER_SIZE,
    MAGIC,
    RESULT_FLAGS,
    VERSION,
    Datagram,
    Flags,
    Header,
    MessageType,
)

__all__ = ["Position", "WorkerAhead"]

_MASK32 = 0xFFFFFFFF
_HALF = 1 << 31
_HDR = HEADER_SIZE
_MAGIC, _VERSION, _RESULT_FLAGS = MAGIC, VERSION, RESULT_FLAGS


_POSITION_MAGIC = b"SMP1"
_PART = struct.Struct("<II")  # a part's next sequence number, its lanes


@dataclass(frozen=True)
class Position:
    """Where a rank stands in its job between operations: per part of the job (one, without
    I/O threads: ``protocol/parts.py``), the sequence number of its next operation and each
    lane's next set (0 or 1, one byte per lane). Ranks that completed the same operations
    stand at the same position, so a live rank's (``WorkerEndpoint.position``) is where a rank
    joining a running quorum job starts (``resume``). ``to_bytes`` and ``from_bytes`` carry it
    between processes."""

    seqs: tuple[int, ...]
    sets: tuple[bytes, ...]

    def __post_init__(self) -> None:
        if not self.seqs or len(self.seqs) != len(self.sets):
            raise ValueError(f"a position needs one sequence number and one set of lanes per "
                             f"part, at least one part; got {len(self.seqs)} and "
                             f"{len(self.sets)}")
        for seq, sets in zip(self.seqs, self.sets):
            if not 0 <= seq <= _MASK32:
                raise ValueError(f"a position's sequence number is a uint32, got {seq}")
            if not sets or set(sets) - {0, 1}:
                raise ValueError("a position's lanes each hold a set, 0 or 1")

    @classmethod
    def of_parts(cls, parts: list[Position]) -> Position:
        """The position of a rank whose parts stand at ``parts`` (one part each)."""
        return cls(tuple(s for p in parts for s in p.seqs),
                   tuple(b for p in parts for b in p.sets))

    def part(self, t: int) -> Position:
        """Part ``t``'s position alone."""
        return Position((self.seqs[t],), (self.sets[t],))

    def to_bytes(self) -> bytes:
        return _POSITION_MAGIC + b"".join(
            _PART.pack(seq, len(sets)) + sets for seq, sets in zip(self.seqs, self.sets))

    @classmethod
    def from_bytes(cls, data: bytes) -> Position:
        """The position ``to_bytes`` wrote. Raises ValueError, saying what is wrong, for
        anything else."""
        data = bytes(data)
        if data[:4] != _POSITION_MAGIC:
            raise ValueError("not a switchml position (it starts with another magic)")
        seqs, sets, at = [], [], 4
        while at < len(data):
            if len(data) - at < _PART.size:
                raise ValueError(f"a truncated position: {len(data) - at} bytes left of a part")
            seq, lanes = _PART.unpack_from(data, at)
            at += _PART.size
            if lanes > len(data) - at:
                raise ValueError(f"a truncated position: a part of {lanes} lanes has "
                                 f"{len(data) - at} bytes")
            seqs.append(seq)
            sets.append(data[at:at + lanes])
            at += lanes
        return cls(tuple(seqs), tuple(sets))


class WorkerAhead:
    """Results of later operations, kept for a rank behind (``WorkerEndpoint``'s base class),
    and a rank's :class:`Position`, taken from a live rank by one that joined late. Uses the
    worker's state (declared below) and its ``_receive``."""

    spec: JobSpec
    config: WorkerConfig
    state: WorkerState
    _op: Operation | None
    _seq: int
    _ahead: dict[int, list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]]
    _ahead_bytes: int
    _feeding: bool
    _cnt: np.ndarray
    _counters: Counter[str]
    _drops: Counter[str]
    _next_set: np.ndarray
    _late = False
    """Joined a running quorum job (``join(late=True)``) and not resumed yet: results of any
    operation are kept, since this rank does not know yet where the others stand."""
    _floor: int | None = None
    """A late rank's position to come (``pin``): kept operations from it on are never
    evicted."""

    def position(self) -> Position:
        """Where this rank stands: take it between operations (joined, none in flight), and
        hand it to a rank joining the running job, with the state the operations so far
        produced (a model's parameters), for its ``resume``.

        Raises:
            LocalProtocolError: an operation is in flight, the rank is not joined, or it
                joined late and has not resumed.
        """
        if self.state is not WorkerState.READY or self._op is not None:
            raise LocalProtocolError(f"a position is taken between operations, joined and "
                                     f"idle; this rank is {self.state.value}")
        if self._late:
            raise LocalProtocolError("this rank joined a running job and has not resumed: it "
                                     "has no position yet")
        return Position((self._seq,), (self._next_set.astype(np.uint8).tobytes(),))

    @property
    def ops_behind(self) -> int:
        """A quorum job's rank between operations: how many operations the others are ahead
        of it, as far as the results it kept show (0: none kept beyond its next)."""
        return max((((s - self._seq) & _MASK32) + 1 for s in list(self._ahead)
                    if ((s - self._seq) & _MASK32) < _HALF), default=0)

    def catch_up(self) -> None:
        """This rank of a quorum job fell behind and will ``resume`` from a live rank's
        ``position`` (the steps between are skipped: the live rank's state holds them). From
        now on it keeps every result it is sent, as a rank that joined late does.

        Raises:
            LocalProtocolError: a job without a quorum, or the rank is not joined and idle.
        """
        if not self.spec.quorum:
            raise LocalProtocolError("catch_up is for a quorum job's rank (a job without one "
                                     "waits for every rank: nobody is ahead)")
        if self.state is not WorkerState.READY or self._op is not None:
            raise LocalProtocolError(f"catch_up needs a joined, idle rank; this rank is "
                                     f"{self.state.value}")
        self._late = True
        self._floor = None
        # What it kept so far is of operations the live rank's position is past (it serves
        # only with none of a later one at hand), and would take the budget the results
        # from the position on need.
        self._ahead.clear()
        self._ahead_bytes = 0

    def pin(self, position: Position) -> None:
        """A rank that joined late (or is catching up) learns the position it will resume at
        before the state that goes with it has arrived: the results kept of earlier
        operations are dropped now, and those of operations from the position on are never
        evicted to make room (past the budget, new results are dropped instead), so that
        what ``resume`` will need stays while the state is on its way.

        Raises:
            LocalProtocolError: the rank is not waiting for a position, or ``position`` is
                not one part's.
        """
        if not self._late:
            raise LocalProtocolError("pin is for a rank that joined a running job (or is "
                                     "catching up) and has not resumed")
        if len(position.seqs) != 1:
            raise LocalProtocolError(f"a position of {len(position.seqs)} parts; this "
                                     "endpoint is one part of its job (give it .part(t))")
        self._floor = position.seqs[0]
        self._forget_before(self._floor)

    def resume(self, position: Position) -> None:
        """Start where a live rank stands (its ``position``): this rank joined a running
        quorum job (``join(now, late=True)``) and has run no operation. Its next operation
        is the live rank's next; results kept meanwhile of earlier operations are dropped
        (the live rank's state holds them), those of later ones are kept for it.

        Raises:
            LocalProtocolError: the rank did not join late, has resumed already, is not
                joined, or ``position`` is not of this job's geometry (one part, ``window``
                lanes).
        """
        if not self._late:
            raise LocalProtocolError("resume is for a rank that joined a running quorum job "
                                     "(join(now, late=True)) or is catching up (catch_up()), "
                                     "once, before its next operation")
        if self.state is not WorkerState.READY:
            raise LocalProtocolError(f"resume needs a joined, idle rank; this rank is "
                                     f"{self.state.value}")
        if len(position.seqs) != 1:
            raise LocalProtocolError(f"a position of {len(position.seqs)} parts; this "
                                     "endpoint is one part of its job (give it .part(t))")
        sets = np.frombuffer(position.sets[0], np.uint8)
        if sets.size != self._next_set.size:
            raise LocalProtocolError(f"a position of {sets.size} lanes; this job's window is "
                                     f"{self._next_set.size}")
        self._seq = position.seqs[0]
        self._next_set[:] = sets
        self._late = False
        self._floor = None
        self._forget_before(self._seq)
        self._counters["resumed"] += 1

    def _forget(self, seq: int) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Stop keeping operation ``seq``'s results; returns them (none: [])."""
        pieces = self._ahead.pop(seq, [])
        self._ahead_bytes -= sum(int(p[2].sum()) for p in pieces)
        return pieces

    def _forget_before(self, seq: int) -> None:
        """Stop keeping the results of operations before ``seq`` (by sequence number)."""
        for s in [s for s in self._ahead if 0 < ((seq - s) & _MASK32) < _HALF]:
            self._forget(s)

    def _receive(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, count: int,
                 now: float) -> None:
        raise NotImplementedError

    def _take_ahead(self, op: Operation, now: float, drop_older: bool = True) -> None:
        """A quorum job's rank that fell behind: the results of ``op`` the switch multicast
        before this rank needed them go through the results kernel now, in chunk order (each
        releases its lane's next chunk, whose result follows). Kept results of earlier
        operations are dropped (``drop_older``)."""
        mine = self._forget(op.seq)
        if drop_older:
            self._forget_before(op.seq)
        if not mine:
            return
        buf = np.concatenate([p[0] for p in mine])
        offsets = np.cumsum([0] + [p[0].size for p in mine[:-1]])
        starts = np.concatenate([p[1] + o for p, o in zip(mine, offsets)])
        lens = np.concatenate([p[2] for p in mine])
        order = np.argsort(np.concatenate([p[3] for p in mine]), kind="stable")
        self._counters["results_taken_ahead"] += int(order.size)
        self._receive(buf, starts[order], lens[order], int(order.size), now)

    def _kept_all(self, op: Operation) -> bool:
        """Whether a result of every chunk of ``op`` is kept (the others finished it)."""
        pieces = self._ahead.get(op.seq)
        if not pieces:
            return False
        chunks = np.unique(np.concatenate([p[3] for p in pieces]))
        return bool(chunks.size == op.T and chunks[0] == 0 and chunks[-1] == op.T - 1)

    def _feed_kept(self, op: Operation, now: float) -> None:
        """Kept results of the operation in flight whose lane has reached their chunk go
        through the results kernel, in chunk order (each releases its lane's next chunk,
        whose kept result may follow): a rank the quorum left behind catches up from what it
        was multicast. The kernel hands back those still ahead, kept again."""
        self._feeding = True
        try:
            while self._op is op and (pieces := self._ahead.get(op.seq)):
                chunks = np.concatenate([p[3] for p in pieces])
                if not (op.lane[K.LN.CHUNK][chunks % op.E] == chunks).any():
                    return
                before = int(self._cnt[K.WC.RESULTS])
                self._take_ahead(op, now, drop_older=False)
                if int(self._cnt[K.WC.RESULTS]) == before:
                    return
        finally:
            self._feeding = False

    def _handle_stray_result(self, h: Header, data: Datagram, now: float) -> None:
        """A result while no operation is in flight, or one the kernel did not take: in a
        quorum job, one of an operation this rank has not started yet is kept for it (the
        others went on without this rank: ``_take_ahead``); anything else is stale."""
        if (self.spec.quorum and h.flags & Flags.CONTRIBUTORS
                and (self._late or ((h.seq - self._seq) & _MASK32) < K.QUORUM_AHEAD)):
            raw = np.frombuffer(bytes(data), np.uint8)
            one = np.zeros(1, np.int64)
            self._store_ahead(raw, one, one + raw.size, one + h.seq, one + h.chunk)
            return
        self._drops["stale_result"] += 1

    def _keep_ahead(self, buf: np.ndarray, starts: np.ndarray, lens: np.ndarray, i: int,
                    count: int) -> np.ndarray | None:
        """The results of later operations among datagrams ``i`` .. ``count - 1`` of a batch
        (a quorum job's rank behind the others gets them by multicast): checked and kept all
        at once, with numpy, not one by one. Returns the mask of the other datagrams (what
        the caller goes on with), or None when there were none."""
        s, ln = starts[i:count], lens[i:count]
        trailer = (self.spec.num_workers + 7) // 8
        at = np.where(ln >= _HDR, s, 0)  # (a short datagram's fields are read from 0: masked)

        def u(off: int, width: int) -> np.ndarray:
            v = np.zeros(at.size, np.uint64)
            for b in range(width):
                v |= buf[at + off + b].astype(np.uint64) << np.uint64(8 * b)
            return v

        flags, elem = buf[at + AT["flags"]], buf[at + AT["elem"]]
        isz = np.where(elem == 1, 4, np.where(elem == 2, 2, 0))
        seq = u(AT["seq"], 4).astype(np.int64)
        chunk = u(AT["chunk"], 4).astype(np.int64)
        ahead = ((seq - self._seq) & _MASK32) < K.QUORUM_AHEAD  # a later operation
        if self._late:  # (where the others stand is not known yet: any operation's)
            ahead[:] = True
        op = self._op
        if op is not None and self.state is WorkerState.BUSY:  # this one, a lane's later chunk
            reached = op.lane[K.LN.CHUNK][chunk % op.E]
            ahead |= (seq == op.seq) & (chunk < op.T) & (reached >= 0) & (reached < chunk)
        ok = ((ln >= _HDR) & (u(AT["magic"], 2) == _MAGIC) & (buf[at + AT["version"]] == _VERSION)
              & (buf[at + AT["type"]] == int(MessageType.RESULT))
              & ((flags & (0xFF ^ _RESULT_FLAGS)) == 0) & ((flags & int(Flags.CONTRIBUTORS)) != 0)
              & (buf[at + AT["set"]] <= 1) & (isz > 0)
              & (u(AT["job"], 4) == self.spec.job_id) & (u(AT["token"], 8) == self.spec.token)
              & (ln == _HDR + isz * u(AT["count"], 2).astype(np.int64) + trailer) & ahead)
        if not ok.any():
            return None
        blob, packed = _pack(buf, s[ok], ln[ok])
        self._store_ahead(blob, packed, ln[ok], seq[ok], chunk[ok])
        return ~ok

    def _store_ahead(self, blob: np.ndarray, starts: np.ndarray, lens: np.ndarray,
                     seqs: np.ndarray, chunks: np.ndarray) -> None:
        """Keep results (``blob[starts[j]:][:lens[j]]``, of operation ``seqs[j]``, chunk
        ``chunks[j]``) for when this rank starts their operations, within
        ``quorum_keep_bytes``."""
        if self._floor is not None:  # (pinned: operations before the position are past)
            past = ((seqs - self._floor) & _MASK32) >= _HALF
            if past.any():
                self._drops["stale_result"] += int(past.sum())
                keep = ~past
                starts, lens, seqs, chunks = starts[keep], lens[keep], seqs[keep], chunks[keep]
                if not starts.size:
                    return
                blob, starts = _pack(blob, starts, lens)  # (the blob holds these alone)
        size = int(lens.sum())  # (what the blob holds: the results alone, end to end)
        budget = self.config.quorum_keep_bytes
        if self._late and size <= budget:
            # A rank that joined late (or is catching up) will resume at a live rank's
            # position, most often taken after now: the oldest operations kept (by sequence
            # number) are the ones it will skip, so they make room for these (a rank behind
            # keeps the oldest instead: it needs them first). While a position already taken
            # is on its way (``pin``), operations from it on are kept, and new results are
            # dropped instead.
            now = int(seqs[0])  # (the newest operation's, or about: those kept are older)
            floor = self._floor
            while self._ahead_bytes + size > budget and self._ahead:
                oldest = max(self._ahead, key=lambda s: (now - s) & _MASK32
                             if ((now - s) & _MASK32) < _HALF else -1)
                if floor is not None and not 0 < ((floor - oldest) & _MASK32) < _HALF:
                    break  # (from the pinned position on: kept; these are dropped below)
                self._drops["ahead_evicted"] += sum(int(p[1].size)
                                                    for p in self._forget(oldest))
        if self._ahead_bytes + size > budget:
            self._drops["ahead_dropped"] += int(starts.size)
            return
        self._ahead_bytes += size
        self._counters["results_kept_ahead"] += int(starts.size)
        for seq in np.unique(seqs).tolist():
            pick = seqs == seq
            self._ahead.setdefault(seq, []).append(
                (blob, starts[pick], lens[pick], chunks[pick]) if not pick.all()
                else (blob, starts, lens, chunks))


def _pack(buf: np.ndarray, starts: np.ndarray, lens: np.ndarray
          ) -> tuple[np.ndarray, np.ndarray]:
    """A copy of the datagrams ``buf[starts[j]:][:lens[j]]`` end to end, and their starts in
    it. Datagrams that lie end to end in ``buf`` (a GRO batch's) are copied as one run, one
    memcpy each, where gathering datagram by datagram cost more than a step's compute; and
    the copy holds them alone, not the buffer between them: a receive batch gives each
    datagram a slot of 64 KiB, and a copy of the span they lay in held 58 to 1,600 times
    the bytes that ``quorum_keep_bytes`` counted."""
    end = starts + lens
    cut = np.flatnonzero(starts[1:] != end[:-1]) + 1  # where a new run begins
    runs = zip(np.concatenate(([0], cut)).tolist(), np.concatenate((cut, [starts.size])).tolist())
    blob = np.concatenate([buf[int(starts[a]):int(end[b - 1])] for a, b in runs])
    return blob, np.cumsum(lens) - lens

"""The switch's jobs: a first-fit allocator of slot ranges, and one job's state as arrays.

A job holds ``window`` slots of the pool, each with two sets; the compiled kernel
(``kernels/aggregate.py``) works on the arrays of :class:`Job` directly.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from switchml.protocol import kernels as K
from switchml.protocol.address import Address
from switchml.protocol.auth import data_key
from switchml.protocol.wire import (
    AUTH_DATA,
    AUTH_TAG_SIZE,
    EXP_ZERO,
    HEADER_SIZE,
    ChunkShape,
    ControlInfo,
    Datagram,
    ElementType,
    Flags,
)

__all__ = ["Job", "SlotAllocator", "bitmap", "store_bitmap"]

_INT32 = int(ElementType.INT32)
_SHAPE_FLAGS = int(Flags.HAS_DATA | Flags.HAS_EXP)
_AUTH = int(Flags.AUTH)


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


def bitmap(words: np.ndarray) -> int:
    """A bitmap of uint64 words as a Python int (bit r = rank r)."""
    return int.from_bytes(words.tobytes(), "little")


def store_bitmap(words: np.ndarray, value: int) -> None:
    words[:] = np.frombuffer(value.to_bytes(8 * words.size, "little"), np.uint64)


@dataclass(slots=True)
class Job:
    """One job's membership and slot state, as arrays the kernel works on.

    ``st[field, set, slot]`` holds each (slot, set)'s round (``kernels.S``); ``seen`` and
    ``conflict`` are bitmaps of 64-bit words ``[set, slot, word]``; ``bufs[set, slot]`` is the
    result datagram of the (slot, set): header, then the accumulator.
    """

    job_id: int
    token: int
    num_workers: int
    slot_base: int
    window: int
    elements_per_packet: int
    members: list[Address | None]
    all_ranks: int = 0
    jobv: np.ndarray = field(default=None)  # type: ignore[assignment]
    st: np.ndarray = field(default=None)  # type: ignore[assignment]
    seen: np.ndarray = field(default=None)  # type: ignore[assignment]
    conflict: np.ndarray = field(default=None)  # type: ignore[assignment]
    conflict_shape: dict[tuple[int, int], ChunkShape] = field(default_factory=dict)
    bufs: np.ndarray = field(default=None)  # type: ignore[assignment]
    clog: np.ndarray = field(default=None)  # type: ignore[assignment]
    cursor: np.ndarray = field(default=None)  # type: ignore[assignment]
    views: list[list[memoryview]] = field(default_factory=list)
    flat: list[memoryview] = field(default_factory=list)  # each set's results, one buffer
    stride: int = 0  # bytes per slot in ``bufs`` (a full result datagram)
    pend: np.ndarray = field(default=None)  # type: ignore[assignment]
    npend: int = 0  # rounds completed and not yet sent: ``pend[:npend]``
    nack_log_windows: int = 8  # completions logged for NACKs, in windows (SwitchConfig)
    member_timeout_s: float = 20.0  # a member silent this long is gone (SwitchConfig)
    quorum: int = 0  # JobSpec.quorum: a round completes with this many ranks; 0: all of them
    history: int = 0  # quorum jobs: earlier rounds kept per slot (SwitchConfig.quorum_history)
    quorum_min: int = 0  # JobSpec.quorum_min: the ranks a round needs at the deadline
    deadline_us: int = 0  # JobSpec.quorum_deadline_s, in microseconds (0: none)
    auth: bool = False  # JobSpec.auth_data: requests and results carry a MAC (use_key's)
    incarnation: bytes = bytes(16)  # new at every creation (JOINED says it): the MAC's salt
    reply_bytes: int = 0  # a row of the kernel's replies for this job (kernels.reply_row_bytes)
    last_seen: float = 0.0  # ``now`` of the last valid datagram: the lease
    started: bool = False  # a request was accepted (membership is then fixed)
    key: bytes = b""  # the job key (auth.job_key): JOIN and LEAVE proofs verify under it
    cookies: list[bytes | None] = field(default_factory=list)  # each member's JOIN cookie
    left_at: list[float] = field(default_factory=list)  # when each rank last left (LEAVE)
    heard: np.ndarray = field(default=None)  # type: ignore[assignment]
    """When each member last sent anything (float64 per rank; the kernel writes it)."""
    mkeys: np.ndarray = field(default=None)  # type: ignore[assignment]
    """Per rank, the sender number (``endpoint.Batch.senders``) its admitted requests came
    with, or -1: the kernel takes a rank's requests only from that sender, so the address check
    is made once per member, not per batch (``set_member`` forgets it)."""

    def __post_init__(self) -> None:
        w = self.window
        self.cookies = [None] * self.num_workers
        self.left_at = [float("-inf")] * self.num_workers
        self.heard = np.full(self.num_workers, float("-inf"))
        self.mkeys = np.full(self.num_workers, -1, np.int64)
        self.all_ranks = (1 << self.num_workers) - 1
        nwords = (self.num_workers + 63) // 64
        jobv = np.zeros(K.J_FIELDS, np.int64)
        jobv[K.J.JOB] = self.job_id
        jobv[K.J.TOKEN] = np.uint64(self.token).view(np.int64)
        jobv[K.J.N] = self.num_workers
        jobv[K.J.SLOT_BASE] = self.slot_base
        jobv[K.J.WINDOW] = w
        jobv[K.J.MAX_BYTES] = 4 * self.elements_per_packet
        jobv[K.J.MIN_SEQ] = -1
        jobv[K.J.FLOAT_SEQ] = -1
        jobv[K.J.SHARDS] = 1
        # NACKs off until the switch configures them (``SwitchDataplane._create_job``); a gap
        # never halves below its base, and never at all without a calm count.
        jobv[K.J.NACK_GAP] = jobv[K.J.NACK_BASE_GAP] = 0
        jobv[K.J.NACK_CALM] = np.iinfo(np.int64).max // 2
        jobv[K.J.NACK_WIDENED_AT] = -(1 << 40)
        jobv[K.J.NACK_CAP] = self.nack_log_windows * w
        # (a timeout of inf, or past any job's life, as 10^9 s: int64 microseconds)
        jobv[K.J.MEMBER_TIMEOUT_US] = round(min(self.member_timeout_s, 1e9) * 1e6)
        # A quorum job's results carry the bitmap of the ranks they hold after the payload.
        trailer = (self.num_workers + 7) // 8 if self.quorum else 0
        history = self.history if self.quorum else 0
        jobv[K.J.QUORUM], jobv[K.J.TRAILER], jobv[K.J.HISTORY] = self.quorum, trailer, history
        jobv[K.J.QUORUM_MIN], jobv[K.J.DEADLINE_US] = self.quorum_min, self.deadline_us
        jobv[K.J.AUTH] = int(self.auth)
        tag = AUTH_TAG_SIZE if self.auth else 0  # after an authenticated job's results
        self.jobv = jobv
        self.reply_bytes = (K.reply_row_bytes(self.num_workers, self.elements_per_packet)
                            + trailer + tag)
        self.st = np.zeros((K.S_FIELDS, 2, w), np.int64)
        self.st[K.S.SEQ] = -1
        self.st[K.S.ELEM] = _INT32
        self.st[K.S.EXP_DATA] = EXP_ZERO
        self.st[K.S.EXP_NEXT] = EXP_ZERO
        self.seen = np.zeros((2, w, nwords), np.uint64)
        self.conflict = np.zeros((2, w, nwords), np.uint64)
        # The two sets' result datagrams, then a quorum job's history rows (kernels'
        # ``_archive``).
        self.bufs = np.zeros((2 + history, w,
                              HEADER_SIZE + 4 * self.elements_per_packet + trailer + tag),
                             np.uint8)
        # Loss recovery (kernels.nacks._behind_on): the last completions, and how far each rank
        # has been checked against them.
        self.clog = np.full((self.nack_log_windows * w, 4), -1, np.int64)
        self.cursor = np.zeros(self.num_workers, np.int64)
        self.views = [[memoryview(self.bufs[v, s]) for s in range(w)] for v in range(2)]
        # Each set's results as one buffer: consecutive slots' results are one slice of it
        # (a GSO run sent with no gathering: ``SwitchDataplane.poll_transmit``).
        self.flat = [memoryview(self.bufs[v].reshape(-1)) for v in range(2)]
        self.stride = self.bufs.shape[2]
        # Rounds completed and not yet sent (rows (set, slot, length), in completion order).
        self.pend = np.empty((2 * w + K.MAX_BATCH, 3), np.int64)
        self.npend = 0

    def set_member(self, rank: int, addr: Address | None) -> None:
        """Record (or, with None, forget) the address of ``rank``; its datagrams' sender
        number is checked again."""
        self.members[rank] = addr
        self.mkeys[rank] = -1

    @property
    def min_seq(self) -> int | None:
        """Set by an epoch JOIN: older requests predate a restart."""
        m = int(self.jobv[K.J.MIN_SEQ])
        return None if m < 0 else m

    @min_seq.setter
    def min_seq(self, value: int) -> None:
        self.jobv[K.J.MIN_SEQ] = value

    @property
    def elements_aggregated(self) -> int:
        return int(self.jobv[K.J.AGGREGATED])

    @property
    def info(self) -> ControlInfo:
        return ControlInfo(self.num_workers, self.window, self.elements_per_packet, self.slot_base,
                           self.quorum, self.quorum_min, self.deadline_us,
                           AUTH_DATA if self.auth else 0)

    def renew(self, now: float) -> None:
        """The kernel took requests of the job: its lease runs from ``now``; an authenticated
        job's from the last request whose MAC verified (``heard``: the kernel stamps a rank
        only then), so that forged requests it dropped renew nothing."""
        self.last_seen = max(self.last_seen, float(self.heard.max())) if self.auth else now

    def mac_ok(self, flags: int, data: Datagram | None) -> bool:
        """Whether a datagram of this job with header ``flags`` passes the data MAC rule: an
        authenticated job's carries ``AUTH`` and a MAC that verifies (``data``: the datagram,
        MAC included), any other job's carries no ``AUTH``."""
        if not self.auth:
            return not flags & _AUTH
        return bool(flags & _AUTH) and data is not None and K.data_sealed(self.jobv, data)

    def use_key(self, key: bytes) -> None:
        """The job key (JOIN and LEAVE proofs, sealed replies); an authenticated job's kernel
        gets its data key from it (``auth.data_key``)."""
        self.key = key
        if self.auth:
            k0, k1 = np.frombuffer(data_key(key, self.incarnation), np.int64)
            self.jobv[K.J.MAC_K0], self.jobv[K.J.MAC_K1] = k0, k1

    def next_expiry(self) -> float:
        """When a quorum job's deadline completes a round next (the switch's clock, seconds),
        or inf: the earliest-opened open round that already has ``QUORUM_MIN`` contributions
        (one with fewer waits for another, and the timer is read again after every batch)."""
        jobv, st = self.jobv, self.st
        d = int(jobv[K.J.DEADLINE_US])
        if d <= 0:
            return math.inf
        missing = st[K.S.MISSING]
        ready = ((st[K.S.SEQ] >= 0) & (missing > 0)
                 & (jobv[K.J.QUORUM] - missing >= jobv[K.J.QUORUM_MIN]))
        if not ready.any():
            return math.inf
        return (int(st[K.S.OPENED_AT][ready].min()) + d) * 1e-6

    def memory_bytes(self) -> int:
        return int(self.bufs.nbytes)

    def shape(self, v: int, s: int) -> ChunkShape:
        """What the round of (slot ``s``, set ``v``) says about its chunk."""
        st = self.st
        return ChunkShape(int(st[K.S.COUNT, v, s]), int(st[K.S.ELEM, v, s]),
                          int(st[K.S.FLAGS, v, s]) & _SHAPE_FLAGS, int(st[K.S.EXP_DATA, v, s]),
                          int(st[K.S.DIGEST, v, s]))

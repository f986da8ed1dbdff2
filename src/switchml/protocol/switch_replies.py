"""The switch's answers to what its kernel leaves to Python: a re-sent request into a complete
round (the stored result again, marked RESENT), into an open round (WAITING, naming the ranks
still missing), and chunks that disagree with their round (MISMATCH, to both sides).

Part of :class:`~switchml.protocol.switch.SwitchDataplane` (a base class of it, as
``switch_control.py`` is): rare events, handled in plain Python datagram by datagram
(docs/protocol.md, the slot table's Python actions).
"""

from __future__ import annotations

from collections import Counter

from switchml.protocol import kernels as K
from switchml.protocol.address import Address
from switchml.protocol.config import SwitchConfig
from switchml.protocol.jobs import Job, bitmap, store_bitmap
from switchml.protocol.wire import (
    HEADER_SIZE,
    ChunkShape,
    ElementType,
    Field,
    Flags,
    Header,
    MessageType,
    pack_header,
    pack_mismatch,
)

__all__ = ["SwitchReplies"]

_DATA_ITEMSIZE = {int(ElementType.INT32): 4, int(ElementType.INT16): 2}
_SHAPE_FLAGS = int(Flags.HAS_DATA | Flags.HAS_EXP)


class SwitchReplies:
    """RESENT results, WAITING and MISMATCH replies of the switch (``SwitchDataplane``'s base
    class). Uses the switch's configuration, output queue, drop counters, clock and reply
    counters."""

    config: SwitchConfig
    _out: list[tuple[bytes | memoryview, Address]]
    _drops: Counter[str]
    _now: float
    results_resent: int
    waiting_sent: int
    mismatch_sent: int
    nacks_needless: int

    def _mismatch(self, job: Job, f: tuple, addr: Address, refused: ChunkShape | None) -> None:
        """Tell the sender of ``f`` that the ranks disagree about this chunk (the round can't
        complete).

        ``refused``: the shape of the sender's own chunk that was just refused (it is compared
        with the round's); the round's contributors are told at once too, the first time
        this rank disagrees, so that nobody waits for a retransmission (a rank that fails and
        exits may take the only other witness with it). None: the sender is a contributor of a
        round that already has a conflict, and is told about the refused chunks.
        """
        rank, seq, chunk, slot, v = (f[Field.RANK], f[Field.SEQ], f[Field.CHUNK],
                                     f[Field.SLOT], f[Field.SET])
        s = slot - job.slot_base
        conflict = bitmap(job.conflict[v, s])
        if refused is not None:
            first = not conflict >> rank & 1
            store_bitmap(job.conflict[v, s], conflict | 1 << rank)
            job.conflict_shape[v, s] = refused
            mine = job.shape(v, s)
            seen = bitmap(job.seen[v, s])
            self._send_mismatch(job, rank, seq, chunk, slot, v, mine, refused, seen, addr)
            if first:
                for r, member in enumerate(job.members):
                    if seen >> r & 1 and member is not None:
                        self._send_mismatch(job, r, seq, chunk, slot, v, refused, mine, 1 << rank,
                                            member)
        else:
            theirs = job.conflict_shape.get((v, s))
            if theirs is None:  # no refused chunk recorded: nothing to tell
                return
            self._send_mismatch(job, rank, seq, chunk, slot, v, theirs, job.shape(v, s),
                                conflict, addr)

    def _send_mismatch(self, job: Job, rank: int, seq: int, chunk: int, slot: int, v: int,
                       theirs: ChunkShape, mine: ChunkShape, ranks: int, addr: Address) -> None:
        payload = pack_mismatch(theirs, mine, ranks, job.num_workers)
        reply = Header(MessageType.MISMATCH, job.job_id, rank=rank, token=job.token, seq=seq,
                       chunk=chunk, slot=slot, set_bit=v, count=len(payload))
        self._out.append((pack_header(reply) + payload, addr))
        self.mismatch_sent += 1

    def _nack_was_needless(self, job: Job) -> None:
        """A re-send answering a NACK found its chunk already in: the chunk had been
        reordered, not lost. Widen the job's gap (as RACK widens its reorder window), so a
        network that reorders costs a few needless re-sends, not one per datagram. At most
        once per window of completions: the NACKs of one reordering episode, sent before the
        gap widened, come back needless together and must count once. It halves back after
        ``nack_calm`` completions without one (the kernel's ``_complete``)."""
        jobv = job.jobv
        self.nacks_needless += 1
        now = int(jobv[K.J.COMPLETIONS])
        jobv[K.J.NACK_CALM_FROM] = now
        gap = int(jobv[K.J.NACK_GAP])
        if gap > 0 and now - int(jobv[K.J.NACK_WIDENED_AT]) >= job.window:
            cap = self.config.nack_log_windows * job.window
            jobv[K.J.NACK_GAP] = max(int(jobv[K.J.NACK_BASE_GAP]), min(2 * gap, cap))
            jobv[K.J.NACK_WIDENED_AT] = now

    def _resend_result(self, job: Job, f: tuple, addr: Address) -> None:
        """A retransmission into a complete round: the result was lost on its way to this
        worker: resend the stored copy (``RESENT``)."""
        if f[Field.FLAGS] & Flags.RESENT:
            self._nack_was_needless(job)  # the chunk NACKed as lost was in (reordered)
        v, s = f[Field.SET], f[Field.SLOT] - job.slot_base
        st = job.st
        size = HEADER_SIZE + _DATA_ITEMSIZE[int(st[K.S.ELEM, v, s])] * int(st[K.S.COUNT, v, s])
        datagram = bytearray(job.views[v][s][:size])
        datagram[4] |= Flags.RESENT
        self._out.append((bytes(datagram), addr))
        self.results_resent += 1

    def _answer_waiting(self, job: Job, f: tuple, addr: Address) -> None:
        """A retransmission into an open round: this worker's data is in; tell it who is
        missing (or, if some rank's chunk was refused, that the round never completes)."""
        if f[Field.FLAGS] & Flags.RESENT:
            self._nack_was_needless(job)
        rank, seq, chunk, slot, v = (f[Field.RANK], f[Field.SEQ], f[Field.CHUNK],
                                     f[Field.SLOT], f[Field.SET])
        s = slot - job.slot_base
        if job.conflict[v, s].any():
            self._mismatch(job, f, addr, None)
            return
        missing = job.all_ranks & ~bitmap(job.seen[v, s])
        # Of those, the ones gone: silent (no JOIN, request or keep-alive) for
        # member_timeout_s; a rank that never joined counts from the job's creation.
        gone, quiet = 0, self._now - self.config.member_timeout_s
        rest = missing
        while rest:  # over the missing ranks only
            r = (rest & -rest).bit_length() - 1
            rest &= rest - 1
            if job.heard[r] < quiet:
                gone |= 1 << r
        nb = (job.num_workers + 7) // 8
        payload = missing.to_bytes(nb, "little") + gone.to_bytes(nb, "little")
        reply = Header(MessageType.WAITING, job.job_id, rank=rank, token=job.token, seq=seq,
                       chunk=chunk, slot=slot, set_bit=v, count=len(payload))
        self._out.append((pack_header(reply) + payload, addr))
        self.waiting_sent += 1
        self._drops["duplicate"] += 1

    def _refuse_mismatch(self, job: Job, f: tuple, addr: Address) -> None:
        """The chunk disagrees with its round: refuse it."""
        self._drops["inconsistent_chunk"] += 1
        self._mismatch(job, f, addr, ChunkShape(f[Field.COUNT], f[Field.ELEM],
                                                f[Field.FLAGS] & _SHAPE_FLAGS,
                                                f[Field.EXP_DATA], f[Field.DIGEST]))

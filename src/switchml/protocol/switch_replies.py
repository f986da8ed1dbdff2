"""The switch's answers to what its kernel leaves to Python: chunks that disagree with their
round (MISMATCH, to both sides), a re-sent request into a round that has refused ranks, or
that waits for a gone rank (WAITING, sealed), and a request for a job it does not hold
(UNKNOWN_JOB, sealed: docs/protocol.md, "Sealed replies"). The kernel answers the other
re-sent requests itself (``kernels.aggregate._answer_resend``: the stored result again,
marked RESENT, or WAITING, naming the ranks still missing).

Part of :class:`~switchml.protocol.switch.SwitchDataplane` (a base class of it, as
``switch_control.py`` is): rare events, handled in plain Python datagram by datagram
(docs/protocol.md, the slot table).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.auth import seal_reply
from switchml.protocol.jobs import Job, bitmap, store_bitmap
from switchml.protocol.kernels.aggregate import gone_ranks
from switchml.protocol.kernels.layout import SC
from switchml.protocol.wire import (
    EXP_ZERO,
    HEADER,
    MAGIC,
    VERSION,
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

_SHAPE_FLAGS = int(Flags.HAS_DATA | Flags.HAS_EXP)
_UNKNOWN_JOB = int(MessageType.UNKNOWN_JOB)
_BYTES = int(ElementType.BYTES)


class SwitchReplies:
    """MISMATCH replies of the switch (``SwitchDataplane``'s base class). Uses the switch's
    output queue, drop counters and reply counter."""

    _out: list[tuple[bytes | memoryview, Address]]
    _drops: Counter[str]
    _cnt: np.ndarray
    _now: float
    _jobs: dict[int, Job]
    _strangers_key: Callable[[int, int], bytes]
    mismatch_sent: int

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
        self._out.append((seal_reply(job.key, pack_header(reply) + payload), addr))
        self.mismatch_sent += 1

    def _waiting_conflict(self, job: Job, f: tuple, addr: Address) -> None:
        """A retransmission into an open round that has refused ranks: it never completes;
        tell the sender which chunks were refused (the kernel answers WAITING otherwise)."""
        self._mismatch(job, f, addr, None)

    def _waiting_gone(self, job: Job, f: tuple, addr: Address) -> None:
        """A retransmission into an open round that waits for a rank the switch has not heard
        from for ``member_timeout_s`` (dead, or left): WAITING with the ranks missing and
        those of them gone, sealed (a worker fails an operation on it, so a stranger must not
        be able to send one; the kernel answers the other WAITINGs itself)."""
        rank, v, s = f[Field.RANK], f[Field.SET], f[Field.SLOT] - job.slot_base
        n = job.num_workers
        nb = (n + 7) // 8
        missing = job.all_ranks & ~bitmap(job.seen[v, s])
        gone = gone_ranks(job.jobv, job.seen, job.heard, self._now, v, s)
        payload = missing.to_bytes(nb, "little") + gone.to_bytes(nb, "little")
        reply = Header(MessageType.WAITING, job.job_id, rank=rank, token=job.token,
                       seq=f[Field.SEQ], chunk=f[Field.CHUNK], slot=f[Field.SLOT], set_bit=v,
                       count=len(payload))
        self._out.append((seal_reply(job.key, pack_header(reply) + payload), addr))
        self._cnt[SC.WAITING_SENT] += 1
        self._cnt[SC.DUPLICATE] += 1

    def _round_gone(self, job: Job, f: tuple, addr: Address) -> None:
        """A quorum job's re-sent request of a round that completed without the sender and
        is past its slot's history: GONE, echoing the request, sealed (a worker fails its
        operation on it: it is too far behind to have that result again)."""
        reply = Header(MessageType.GONE, job.job_id, rank=f[Field.RANK], token=job.token,
                       seq=f[Field.SEQ], chunk=f[Field.CHUNK], slot=f[Field.SLOT],
                       set_bit=f[Field.SET], count=0)
        self._out.append((seal_reply(job.key, pack_header(reply)), addr))
        self._cnt[SC.ROUNDS_GONE] += 1

    def _refuse_mismatch(self, job: Job, f: tuple, addr: Address) -> None:
        """The chunk disagrees with its round: refuse it."""
        self._drops["inconsistent_chunk"] += 1
        self._mismatch(job, f, addr, ChunkShape(f[Field.COUNT], f[Field.ELEM],
                                                f[Field.FLAGS] & _SHAPE_FLAGS,
                                                f[Field.EXP_DATA], f[Field.DIGEST]))

    def _unknown_job(self, f: tuple, addr: Address) -> None:
        """Answer with UNKNOWN_JOB: a header-only echo, sealed under the key of the job and
        token it names (its tag in the header: never larger than the request)."""
        self._out.append((seal_reply(self._reply_key(f[Field.JOB], f[Field.TOKEN]), HEADER.pack(
            MAGIC, VERSION, _UNKNOWN_JOB, 0, f[Field.SET], f[Field.RANK], f[Field.JOB],
            f[Field.TOKEN], f[Field.SEQ], 0, 0, 0, _BYTES, 0, EXP_ZERO, EXP_ZERO)), addr))

    def _reply_key(self, job_id: int, token: int) -> bytes:
        """The key a reply about (``job_id``, ``token``) is sealed under (``auth.seal_reply``):
        the live job's, or, for a job id this switch does not hold under that token, the
        key derived from them (remembered for the last 256 of them: a stranger's flood of
        one id costs one derivation)."""
        job = self._jobs.get(job_id)
        if job is not None and job.token == token:
            return job.key
        return self._strangers_key(job_id, token)

"""A worker's answers from the switch about the operation in flight, other than its results:
WAITING (the ranks a round still waits for), NACK (a chunk the switch lacks) and MISMATCH (the
ranks disagree), and the dispatch of every datagram that is not a result the kernel took,
after the sealed-reply check (``auth.reply_forged``: docs/protocol.md, "Sealed replies").

Part of :class:`~switchml.protocol.worker.WorkerEndpoint` (a base class of it, as
``worker_control.py`` is).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

from switchml.protocol import kernels as K
from switchml.protocol.auth import reply_forged
from switchml.protocol.config import JobSpec
from switchml.protocol.errors import WireError
from switchml.protocol.lifecycle import WorkerInput, WorkerState
from switchml.protocol.operation import Operation
from switchml.protocol.recovery import LossRecovery
from switchml.protocol.wire import (
    Datagram,
    Flags,
    Header,
    MessageType,
    unpack_header,
    unpack_mismatch,
    unpack_payload,
)

__all__ = ["WorkerReplies"]


class WorkerReplies:
    """WAITING, NACK and MISMATCH handlers and the dispatch of other datagrams
    (``WorkerEndpoint``'s base class). Uses the worker's state (declared below) and its
    methods ``_fail`` and ``_send_chunk``."""

    spec: JobSpec
    rank: int
    state: WorkerState
    recovery: LossRecovery
    _op: Operation | None
    _key: bytes
    _switch_text: str
    _unsealed_refusal: str | None
    _handlers: dict[MessageType, Callable[[Header, Datagram, float], None]]
    _counters: Counter[str]
    _drops: Counter[str]

    def _fail(self, reason: str, what: WorkerInput = WorkerInput.FAIL, *,
              switch_silent: bool = False, disagree: bool = False, gone: bool = False) -> None:
        raise NotImplementedError

    def _send_chunk(self, op: Operation, p: int, now: float, *, retransmit: bool,
                    fast: bool = False) -> int:
        raise NotImplementedError

    def _receive_other(self, data: Datagram, now: float) -> None:
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
        if reply_forged(self._key, data, h):
            # Not the switch's (a stranger who knows the token, even from the switch's own
            # address): it must not restart, fail or redirect anything. (A WAITING that
            # names no gone rank is a hint, and comes from the compiled loop unsealed.)
            self._drops["unauthenticated_reply"] += 1
            if h.type is MessageType.REFUSED:  # kept for the JOIN's timeout to quote: the
                # switch seals a refusal under the key of ITS secret, which a worker given
                # another secret cannot verify
                self._unsealed_refusal = bytes(unpack_payload(data, h))[:200].decode(
                    "utf-8", "replace")
            return
        handler(h, data, now)

    def _current_op(self, h: Header, stale: str) -> Operation | None:
        """The operation in flight if ``h`` is about it; else count ``stale`` and None."""
        op = self._op
        if op is None or h.seq != op.seq or self.state is not WorkerState.BUSY:
            self._drops[stale] += 1
            return None
        return op

    def _handle_waiting(self, h: Header, data: Datagram, now: float) -> None:
        op = self._current_op(h, "stale_result")
        if op is None:
            return
        self._counters["waiting_received"] += 1
        raw = bytes(unpack_payload(data, h))
        nb = (self.spec.num_workers + 7) // 8
        missing = int.from_bytes(raw[:nb], "little")
        self.recovery.on_waiting(op, h.chunk, missing, now)
        gone = int.from_bytes(raw[nb:2 * nb], "little") & missing
        if gone and not h.flags & Flags.AUTH:  # only a sealed WAITING names gone ranks
            self._drops["unauthenticated_gone"] += 1
            gone = 0
        n, quorum = self.spec.num_workers, self.spec.quorum
        if gone and quorum is not None and n - gone.bit_count() >= quorum:
            # A quorum job: the ranks still alive can complete the round without the gone
            # ones (the round has the others' chunks, or will).
            self._counters["waiting_for_gone_ranks"] += 1
        elif gone:
            ranks = [r for r in range(self.spec.num_workers) if gone >> r & 1]
            self._fail(f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank}): "
                       f"the switch at {self._switch_text} waits for rank(s) {ranks}, which "
                       "it has heard nothing from for longer than its member timeout (no "
                       "request, no keep-alive) or which are no longer members: gone (dead, "
                       "or left); the operation cannot complete")

    def _handle_gone(self, h: Header, data: Datagram, now: float) -> None:
        """A round this rank re-sent for completed without it and is past the switch's history
        (sealed: ``_receive_other`` dropped a forged one): if the operation in flight still
        waits for that chunk's result, it can never have it; fail now, not after
        ``op_timeout_s``."""
        op = self._current_op(h, "stale_gone")
        if op is None:
            return
        if not op.awaits(h.chunk, h.slot):  # (its result came meanwhile, by another path)
            self._drops["stale_gone"] += 1
            return
        self._counters["gone_received"] += 1
        self._fail(f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank}): the round "
                   f"of chunk {h.chunk} completed without this rank, and the switch at "
                   f"{self._switch_text} no longer holds its result (past its history of "
                   "earlier rounds): this rank is too far behind the quorum to go on in this "
                   "job; rejoin with a live rank's state (switchml.torch.live)", gone=True)

    def _handle_nack(self, h: Header, data: Datagram, now: float) -> None:
        """The switch lacks chunk ``h.chunk`` of ours although later ones arrived: re-send
        what is outstanding on its lane now, by the kernel's rule (``kernels.take_nack``; the
        results kernel answers the NACKs it finds itself, without RACK). Like a RACK re-send,
        it does not back the lane's timeout off."""
        op = self._current_op(h, "stale_nack")
        if op is None:
            return
        p = int(K.take_nack(op.state, h.chunk, h.slot, now))
        if p >= 0:
            i = self._send_chunk(op, p, now, retransmit=True, fast=True)
            K.mark_nack_resend(op.state, i, p, h.chunk)

    def _handle_mismatch(self, h: Header, data: Datagram, now: float) -> None:
        """The ranks disagree about a chunk of this operation: it can never complete; fail now."""
        op = self._current_op(h, "stale_result")
        if op is None:
            return
        try:
            m = unpack_mismatch(unpack_payload(data, h))
        except WireError as exc:
            self._drops[exc.reason] += 1
            return
        ranks = [r for r in range(self.spec.num_workers) if m.ranks >> r & 1]
        self._counters["mismatch_received"] += 1
        if m.theirs.digest != m.mine.digest:
            what = (f"rank(s) {ranks} are in another operation (digest 0x{m.theirs.digest:02x}; "
                    f"this rank's, 0x{m.mine.digest:02x}, is {op.describe()}): another size, "
                    "float against integer data, or other bits")
        else:
            what = (f"about chunk {h.chunk}, rank(s) {ranks} sent {m.theirs.describe()}; this "
                    f"rank sent {m.mine.describe()} ({op.describe()})")
        self._fail(f"operation {op.seq} of job {self.spec.job_id} (rank {self.rank}): the ranks "
                   f"disagree: {what}. Every rank must issue the same operations, with the "
                   "same size, dtype and bits, in the same order", disagree=True)

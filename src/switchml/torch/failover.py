"""Switch failover: a group whose switch stops answering goes on over gloo, every rank with the
same sums.

Turned on per group by rank 0's ``SWITCHML_FAILOVER=gloo``. Theory of operation:

* **Numbering.** Every switch all-reduce of the group gets a sequence number at issue; every
  rank issues the same collectives in the same order, so the numbers agree across ranks.
* **Inputs stay whole.** A switch operation works on a staging copy of the tensor, never the
  tensor itself, and writes the tensor only once every part of the operation has its result.
  So an operation that fails has its input, untouched.
* **Results are kept.** When the switch dies, a rank may hold the last multicast results of
  an operation another rank never got (the switch completes a round for all and multicasts
  it; a lost copy is recovered by a re-send only while the switch lives). That rank hands its
  copy on. Without the copy the others would have to sum again over gloo, a different
  rounding from the switch's fixed point: replicas would drift apart. So a rank keeps its
  latest completed results: without a quorum, the latest operation's is all a peer can lack
  (a rank starts an operation only once it completed the one before, and no operation
  completes anywhere before every rank sent all of it, so no rank is two operations ahead);
  a quorum group's stragglers may lag further, and it keeps 256 MiB of results
  (``SWITCHML_FAILOVER_KEEP_MB`` sets either).
* **Switching over.** The first operation that fails with
  :class:`~switchml.protocol.errors.SwitchUnreachable` (the switch said nothing for the
  operation timeout) starts it: the rank announces it in the group's store (a rank with no
  operation in flight learns of it there within ``_WATCH_S``), closes its switch client (its
  pending operations fail at once and come here), and, on a gloo group of its own (apart
  from the one other collectives use, whose order it must not disturb):

  1. the ranks exchange how far each got: ``m``, the first operation some rank lacks, and
     ``M``, one past the last any rank completed;
  2. for each operation in ``[m, M)`` they exchange who has it; a rank that kept it
     broadcasts its result to the others, which take it as their own (no rank without a
     copy: every rank raises, naming the operation, rather than sum it again);
  3. from ``M`` on every switch all-reduce runs over gloo, in order, exact sums of all ranks
     (a quorum group's too).

Counted in ``stats()["failover"]`` and logged at WARNING. Not done: going back to a switch
that returns (the group stays on gloo), and failover of the DDP comm hooks' own clients.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import ProcessGroupGloo

__all__ = ["Failover", "PendingOp", "transition"]

log = logging.getLogger(__name__)
_WATCH_S = 0.5  # how often a rank reads the store for another rank's switch-over
_SIZES_KEPT = 65536  # operations whose sizes a rank remembers (a few MB at most)
_HALF = {torch.float16, torch.bfloat16}

# A rank's state of one operation at the switch-over (``transition``).
LACKS, HAS, KEEPS = 0, 1, 2


@dataclasses.dataclass
class PendingOp:
    """A switch all-reduce the failover completes: its tensors, AVG or SUM, and how to
    complete the user's work (``done(error_or_None)``)."""

    seq: int
    tensors: list[torch.Tensor]
    average: bool
    done: Callable[[BaseException | None], None]


def transition(states: list[int]) -> int | None:
    """Who broadcasts an operation at the switch-over, from every rank's state of it
    (``LACKS``, ``HAS`` without a copy, ``KEEPS`` a copy): None when no rank lacks it (nothing
    to do); else the lowest rank that keeps it.

    Raises:
        RuntimeError: some rank lacks it and none keeps it.
    """
    if LACKS not in states:
        return None
    if KEEPS not in states:
        lacking = [r for r, s in enumerate(states) if s == LACKS]
        raise RuntimeError(
            f"rank(s) {lacking} lack this result and no rank kept it (raise "
            "SWITCHML_FAILOVER_KEEP_MB): the group cannot go on with the same sums everywhere")
    return states.index(KEEPS)


class Failover:
    """One rank's failover state for one switchml group (see the module's text).

    Args:
        store: the group's store (the switch-over is announced there).
        rank, size: this rank and the group's size.
        timeout: the group's timeout (its gloo group's).
        keep_bytes: the results kept for peers (at least the latest operation's).
        close_switch: closes the group's switch client (its pending operations fail).
        recycle: takes back a kept result's buffer once it is dropped.
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 *, keep_bytes: int, close_switch: Callable[[], None],
                 recycle: Callable[[torch.Tensor], None] = lambda t: None,
                 prefix: str = "switchml-failover") -> None:
        self.rank, self.size = rank, size
        self.gloo = ProcessGroupGloo(dist.PrefixStore(f"{prefix}/gloo", store), rank, size,
                                     timeout)
        self._store = store
        self._key = f"{prefix}/switched"
        self.keep_bytes = keep_bytes
        self._close_switch = close_switch
        self._recycle = recycle
        self._cv = threading.Condition()
        self.active = False
        """The group has switched over: its all-reduces go over gloo."""
        self.error: str | None = None
        self._closed = False
        self._next = 0  # the next operation's number
        self._unresolved = 0  # operations handed to the switch and not yet done or failed
        self._completed: set[int] = set()
        self._prefix = 0  # every operation below this has completed (through the switch)
        self._kept: collections.OrderedDict[int, list[torch.Tensor]] = collections.OrderedDict()
        self._kept_bytes = 0
        self._sizes: collections.OrderedDict[int, list[tuple[int, torch.dtype]]] = \
            collections.OrderedDict()
        self._ops: dict[int, PendingOp] = {}  # handed to the failover, by number
        self.counters: collections.Counter[str] = collections.Counter()
        self.reason = ""
        self._thread: threading.Thread | None = None
        self._watcher = threading.Thread(target=self._watch, name="switchml-failover-watch",
                                         daemon=True)
        self._watcher.start()

    # -- the switch path's side --------------------------------------------------------------

    def issue(self) -> tuple[int, bool]:
        """Number the next operation; returns (number, whether it goes to the switch). One
        that does not goes to :meth:`take` (the group has switched over)."""
        with self._cv:
            seq = self._next
            self._next += 1
            if self.active:
                return seq, False
            self._unresolved += 1
            return seq, True

    def completed(self, seq: int, results: list[torch.Tensor]) -> None:
        """Operation ``seq`` completed through the switch; ``results``: each tensor's final
        values, flat on the CPU, kept for peers that may lack them (the failover owns them)."""
        nbytes = sum(t.numel() * t.element_size() for t in results)
        with self._cv:
            self._completed.add(seq)
            while self._prefix in self._completed:
                self._completed.discard(self._prefix)
                self._prefix += 1
            self._sizes[seq] = [(t.numel(), t.dtype) for t in results]
            while len(self._sizes) > _SIZES_KEPT:
                self._sizes.popitem(last=False)
            self._kept[seq] = results
            self._kept_bytes += nbytes
            dropped: list[torch.Tensor] = []
            while len(self._kept) > 1 and self._kept_bytes > self.keep_bytes:
                _, old = self._kept.popitem(last=False)
                self._kept_bytes -= sum(t.numel() * t.element_size() for t in old)
                dropped += old
            self._unresolved -= 1
            self._cv.notify_all()
        for t in dropped:
            self._recycle(t)

    def failed(self, op: PendingOp, error: BaseException | None) -> bool:
        """A switch operation failed with ``error`` (None: it could not even be queued).
        Returns True when the failover takes it over (then it completes ``op``), False
        when the caller should fail it as usual."""
        from switchml.protocol.errors import SwitchUnreachable

        with self._cv:
            self._unresolved -= 1
            self._cv.notify_all()
            if self.error is not None:
                return False
            if not self.active and not isinstance(error, SwitchUnreachable) \
                    and error is not None:
                return False
            self._ops[op.seq] = op
            start = not self.active
            self.active = True
            if start:
                self.reason = str(error) if error is not None else "the switch client closed"
        if start:
            self._start(announce=True)
        return True

    def take(self, op: PendingOp) -> None:
        """An operation issued after the switch-over: the failover runs it, in order."""
        with self._cv:
            if self.error is not None:
                error = self.error
            else:
                self._ops[op.seq] = op
                self._cv.notify_all()
                return
        op.done(RuntimeError(error))

    def stats(self) -> dict[str, Any]:
        with self._cv:
            return {"active": self.active, "error": self.error, **self.counters}

    def close(self) -> None:
        """Stop the threads (the group is being destroyed)."""
        with self._cv:
            self._closed = True
            self._cv.notify_all()
        try:
            self.gloo.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

    # -- the switch-over ---------------------------------------------------------------------

    def _watch(self) -> None:
        while True:
            with self._cv:
                self._cv.wait(_WATCH_S)
                if self._closed or self.active:
                    return
            try:
                seen = self._store.check([self._key])
            except Exception:  # noqa: BLE001 - the store went away: the group is ending
                return
            if seen:
                with self._cv:
                    if self.active or self._closed:
                        return
                    self.active = True
                    self.reason = ("rank " + self._store.get(self._key).decode()
                                   + " found the switch unreachable")
                self._start(announce=False)
                return

    def _start(self, *, announce: bool) -> None:
        log.warning("switchml rank %d of %d: switching over to gloo: %s", self.rank, self.size,
                    self.reason)
        self.counters["switch_overs"] += 1
        if announce:
            try:
                self._store.set(self._key, str(self.rank))
            except Exception:  # noqa: BLE001 - the others find out through their own timeouts
                log.warning("switchml rank %d: could not announce the switch-over", self.rank)
        self._thread = threading.Thread(target=self._run, name="switchml-failover",
                                        daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            # Closing fails the client's pending operations at once, then says LEAVE to the
            # silent switch for up to ``leave_timeout_s``: not worth waiting for.
            threading.Thread(target=self._close_switch, name="switchml-failover-close",
                             daemon=True).start()
            self._switch_over()
        except BaseException as exc:  # noqa: BLE001 - every waiting operation hears of it
            with self._cv:
                self.error = self.error or f"switchml failover failed: {exc}"
                ops, self._ops = list(self._ops.values()), {}
            log.error("switchml rank %d: %s", self.rank, self.error)
            for op in ops:
                op.done(RuntimeError(self.error))

    def _op(self, seq: int) -> PendingOp | None:
        """Wait until this rank has issued operation ``seq`` (None: the group is closing)."""
        with self._cv:
            while seq not in self._ops:
                if self._closed:
                    return None
                self._cv.wait(1.0)
            return self._ops.pop(seq)

    def _allgather(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor(values, dtype=torch.int64)
        out = [torch.empty_like(mine) for _ in range(self.size)]
        self.gloo.allgather([out], [mine]).wait()
        return [o.tolist() for o in out]

    def _switch_over(self) -> None:
        with self._cv:
            while self._unresolved > 0 and not self._closed:
                self._cv.wait(1.0)
            prefix = self._prefix
            top = max(self._completed, default=prefix - 1) + 1
        ranks = self._allgather([prefix, top])
        first, end = min(r[0] for r in ranks), max(r[1] for r in ranks)
        log.warning("switchml rank %d: at the switch-over every rank had completed operations "
                    "below %d; some, up to %d", self.rank, first, end)
        for seq in range(first, end):
            if not self._share(seq):
                return
        seq = end
        while True:
            op = self._op(seq)
            if op is None:
                return
            error: BaseException | None = None
            try:
                self._allreduce(op)
                self.counters["ops_over_gloo"] += 1
            except Exception as exc:  # noqa: BLE001 - this operation fails, the user sees it
                error = exc
            op.done(error)
            if error is not None:
                raise error
            seq += 1

    def _share(self, seq: int) -> bool:
        """Operation ``seq`` at the switch-over: ranks that lack it take a keeper's copy."""
        with self._cv:
            kept = self._kept.get(seq)
            state = KEEPS if kept is not None else HAS if (
                seq < self._prefix or seq in self._completed) else LACKS
        states = [r[0] for r in self._allgather([state])]
        src = transition(states)
        if src is None:
            return True
        op = None
        if state == LACKS:
            op = self._op(seq)
            if op is None:
                return False
            bufs = [torch.empty(t.numel(), dtype=t.dtype) for t in op.tensors]
        elif kept is not None:
            bufs = kept
        else:
            if seq not in self._sizes:
                raise RuntimeError(f"operation {seq} is too far back to take part in its "
                                   "hand-over")
            bufs = [torch.empty(n, dtype=d) for n, d in self._sizes[seq]]
        for b in bufs:
            opts = _c10d.BroadcastOptions()
            opts.rootRank = src
            self.gloo.broadcast([b.view(torch.uint8)], opts).wait()
        if op is not None:
            for t, b in zip(op.tensors, bufs, strict=True):
                t.detach().copy_(b.view(t.shape))
            self.counters["results_taken_from_peers"] += 1
            op.done(None)
        elif self.rank == src:
            self.counters["results_given_to_peers"] += 1
        return True

    def _allreduce(self, op: PendingOp) -> None:
        """One all-reduce over gloo: exact sums of every rank (half types summed in float32),
        AVG divided by the group's size (integers: truncating, as the switch path)."""
        for t in op.tensors:
            src = t.detach()
            wide = src.dtype in _HALF
            buf = src.to(device="cpu", dtype=torch.float32 if wide else src.dtype)
            if buf.data_ptr() == src.data_ptr() and not buf.is_contiguous():
                buf = buf.contiguous()
            opts = _c10d.AllreduceOptions()
            opts.reduceOp = dist.ReduceOp.SUM
            self.gloo.allreduce([buf], opts).wait()
            if op.average:
                if buf.is_floating_point():
                    buf.div_(self.size)
                else:
                    buf = torch.div(buf, self.size, rounding_mode="trunc")
            if buf.data_ptr() != src.data_ptr():
                src.copy_(buf)

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
     (a quorum group's too). An operation no rank completed is summed over gloo from the
     inputs, which are whole (with several I/O threads a small operation can complete on
     the first part while a large one before it waits on the second).

* **Any failure of the switch path switches over**, but a script bug (``RanksDisagree``):
  ranks judge the switch's silence each by its own clock, and one rank's path can fail
  alone; what they must agree on is that they switch. A dead rank then makes the failover's
  first gloo collective fail on every rank after the group's timeout, naming why it began.
* **Going back.** While on gloo, rank 0 joins a fresh job at the switch every
  ``SWITCHML_FAILOVER_PROBE_S`` (10 s; 0: never). Before each all-reduce over gloo it tells
  the others (a one-byte broadcast, with the job's spec when the switch is back); they join
  too, and if every rank did, that all-reduce and all after it go through the switch again.

Counted in ``stats()["failover"]`` (``switch_overs``, ``switch_backs``, ``ops_over_gloo``,
``results_taken_from_peers``, ``results_given_to_peers``) and logged at WARNING. The
``quorum`` hook's buckets are the group's own all-reduces and fail over with it.
``switchml.torch.live``'s replicas fail over too (``LiveQuorum(failover="gloo")``): they share
no group, so the ranks that go on are agreed at the switch-over (``roster``) and the gloo
group is made of them then; a replacement numbers its operations from the live rank's
position (``number_from``: the count the live rank sends with its state), and the live layer
names a fresh job in the store. The ``switchml`` and ``switchml16`` hooks' buckets
on a switchml group that fails over are numbered with its all-reduces (``allreduce_bucket``):
over gloo a bucket is summed exactly in float32, and its error feedback cleared (nothing was
rounded); a bucket taken from a peer keeps the feedback the switch path wrote.
"""

from __future__ import annotations

import collections
import dataclasses
import datetime
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d
from torch._C._distributed_c10d import ProcessGroupGloo

__all__ = ["Failover", "PendingOp", "SwitchBack", "transition"]

log = logging.getLogger(__name__)
_WATCH_S = 0.5  # how often a rank reads the store for another rank's switch-over
_SIZES_KEPT = 65536  # operations whose sizes a rank remembers (a few MB at most)
_HALF = {torch.float16, torch.bfloat16}

_SPEC_BYTES = 256  # a fresh job's spec as rank 0 broadcasts it (encode_job_spec: ~60 bytes)


class SwitchBack:
    """How a failover goes back to the switch (the backend's side).

    ``probe()``: rank 0 joins a fresh job at the switch; returns (client, the job's spec as
    text), or raises while the switch is not back. ``join(spec)``: the other ranks join it;
    returns the client or raises. ``install(client)``: the group's all-reduces use it from
    now on. ``submit(op)``: send an operation through the switch path. ``close(client)``:
    leave a job that is not used after all.
    """

    def __init__(self, *, probe: Callable[[], tuple[Any, str]], join: Callable[[str], Any],
                 install: Callable[[Any], None], submit: Callable[[PendingOp], None],
                 close: Callable[[Any], None]) -> None:
        self.probe, self.join, self.install = probe, join, install
        self.submit, self.close = submit, close


# A rank's state of one operation at the switch-over (``transition``).
LACKS, HAS, KEEPS = 0, 1, 2


@dataclasses.dataclass
class PendingOp:
    """A switch all-reduce the failover completes: its tensors, AVG or SUM, and how to
    complete the user's work (``done(error_or_None)``). ``bits`` and ``residual``: a DDP
    hook's bucket (one float32 tensor) at the hook's wire width, with its error feedback
    (float32, as many elements; the kernels write it in place); None: the group's rules
    (``wire_bits``), no feedback."""

    seq: int
    tensors: list[torch.Tensor]
    average: bool
    done: Callable[[BaseException | None], None]
    bits: int | None = None
    residual: torch.Tensor | None = None


SUM_AGAIN = -1  # ``transition``: no rank has the result; every rank sums it over gloo


def transition(states: list[int]) -> int | None:
    """Who broadcasts an operation at the switch-over, from every rank's state of it
    (``LACKS``, ``HAS`` without a copy, ``KEEPS`` a copy): None when no rank lacks it (nothing
    to do); ``SUM_AGAIN`` when every rank lacks it (no rank wrote a switch sum: gloo sums the
    inputs, which are whole); else the lowest rank that keeps it.

    Raises:
        RuntimeError: some rank lacks it, another has it, and none keeps it.
    """
    if LACKS not in states:
        return None
    if all(s == LACKS for s in states):
        return SUM_AGAIN
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
        roster: a job whose ranks come and go (``switchml.torch.live``): the ranks that go on
            over gloo are agreed at each switch-over, not known before; called then (with the
            switch-over's number and the reason), it returns this rank's place among them and
            their number, and a gloo group is made of them. None: ``rank`` and ``size`` are
            the group's, for good.
        stays: errors of the switch path that do not switch over (the user gets them). Once
            one came, this rank's switch path is its own fault: no later error of it switches
            over, and the rank takes no part in the others' switch-over (it rejoins).
        epoch: switch-overs the job had before this rank came (a live job's replacement).
        armed: whether the rank takes part in switch-overs from now on; False: a live job's
            replacement, from :meth:`number_from` on (before, it holds no operation the
            others could need, and a roster must not wait for it).
    """

    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 *, keep_bytes: int, close_switch: Callable[[], None],
                 recycle: Callable[[torch.Tensor], None] = lambda t: None,
                 prefix: str = "switchml-failover", back: SwitchBack | None = None,
                 probe_s: float = 0.0,
                 roster: Callable[[int, str], tuple[int, int]] | None = None,
                 stays: tuple[type[BaseException], ...] = (), epoch: int = 0,
                 armed: bool = True) -> None:
        self.rank, self.size = rank, size
        self.gloo_timeout_s = timeout.total_seconds()
        self._timeout = timeout
        self._roster = roster
        self._stays = stays
        self.gloo: Any = None if roster is not None else ProcessGroupGloo(
            dist.PrefixStore(f"{prefix}/gloo", store), rank, size, timeout)
        self._store = store
        self._prefix_key = prefix
        self._epoch = epoch  # switch-overs so far: each has a key of its own
        self._key = f"{prefix}/switched/{epoch}"
        self.keep_bytes = keep_bytes
        self._close_switch = close_switch
        self._recycle = recycle
        self._back = back
        self.probe_s = probe_s
        self._ready: tuple[Any, str] | None = None  # rank 0: a client joined to a fresh job
        self._backoff = 1  # the probe's period, in ``probe_s``: doubles at a failed go-back
        # Reentrant: going back submits operations under it, and a submission that fails at
        # once comes back to ``failed``.
        self._cv = threading.Condition(threading.RLock())
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
        self._closing = threading.Event()  # the watcher's sleep (not ``_cv``: every
        # completion notifies that)
        self.reason = ""
        self._thread: threading.Thread | None = None
        self._stayed = False  # a ``stays`` error came: this rank's path failed by its own fault
        self._watcher = threading.Thread(target=self._watch, name="switchml-failover-watch",
                                         daemon=True)
        self._armed = armed
        if armed:
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
            self._advance(seq)
            self._sizes[seq] = [(t.numel(), t.dtype) for t in results]
            while len(self._sizes) > _SIZES_KEPT:
                self._sizes.popitem(last=False)
            self._kept[seq] = results
            self._kept_bytes += nbytes
            dropped: list[torch.Tensor] = []
            while len(self._kept) > 1 and self._kept_bytes > self.keep_bytes:
                old = self._kept.pop(min(self._kept))  # the oldest operation first
                self._kept_bytes -= sum(t.numel() * t.element_size() for t in old)
                dropped += old
            self._unresolved -= 1
            self._cv.notify_all()
        for t in dropped:
            self._recycle(t)

    def _advance(self, seq: int) -> None:
        """Operation ``seq`` is done on this rank (through the switch, a peer or gloo)."""
        self._completed.add(seq)
        while self._prefix in self._completed:
            self._completed.discard(self._prefix)
            self._prefix += 1

    def failed(self, op: PendingOp, error: BaseException) -> bool:
        """A switch operation failed with ``error``.
        Returns True when the failover takes it over (then it completes ``op``), False
        when the caller should fail it as usual."""
        from switchml.protocol.errors import RanksDisagree, SwitchMLError

        # Any failure of the switch path but a script bug switches over, a refusal by a
        # client that failed earlier included. The ranks need not agree on why an operation
        # failed (each judges the switch's silence by its own clock, one rank's path may fail
        # alone, and a client may refuse the next operation before the failed one's callback
        # ran); what they must agree on is that they switch. Where a rank is dead, the
        # failover's first gloo collective fails on every rank after the group's timeout,
        # naming this reason.
        with self._cv:
            if isinstance(error, self._stays):
                self._stayed = True  # (what follows on this path fails because of it)
            takeable = (isinstance(error, SwitchMLError)
                        and not isinstance(error, RanksDisagree) and not self._stayed)
            self._unresolved -= 1
            self._cv.notify_all()
            if self.error is not None or not takeable:
                # A bug, or a script's (every rank hears of it at once): the user gets the
                # error; for the failover it is done (no rank holds a result of it).
                self._advance(op.seq)
                return False
            self._ops[op.seq] = op
            start = not self.active
            self.active = True
            if start:
                self.reason = str(error)
        if start:
            self._start(announce=True)
        return True

    def take(self, op: PendingOp) -> None:
        """An operation issued after the switch-over: the failover runs it, in order (or, if
        the group went back to the switch since ``issue``, the switch does)."""
        with self._cv:
            if self.error is not None:
                error = self.error
            elif not self.active and self._back is not None:
                self._unresolved += 1  # (every earlier one was handed to the switch already)
                self._back.submit(op)
                return
            else:
                self._ops[op.seq] = op
                self._cv.notify_all()
                return
        op.done(RuntimeError(error))

    def number_from(self, seq: int) -> None:
        """Number the next operation ``seq``: a live job's rank that resumed at another
        rank's position (the operations before it are done, their effect in the state it
        took), as that rank numbers it. Call between operations, before the switch-over.
        Arms a rank made with ``armed=False``.

        Raises:
            RuntimeError: operations in flight, or switched over already.
        """
        with self._cv:
            if self.active or self._unresolved or self._ops:
                raise RuntimeError("number_from between operations, before a switch-over only")
            self._next = self._prefix = seq
            self._completed.clear()
            dropped = [t for ts in self._kept.values() for t in ts]
            self._kept.clear()
            self._kept_bytes = 0
            self._sizes.clear()
            arm, self._armed = not self._armed, True
        if arm:
            self._watcher.start()
        for t in dropped:
            self._recycle(t)

    @property
    def numbered(self) -> int:
        """The next operation's number (a live rank sends it with its position)."""
        with self._cv:
            return self._next

    @property
    def epoch(self) -> int:
        """Switch-overs so far (each announced under a key of its own)."""
        with self._cv:
            return self._epoch

    def stats(self) -> dict[str, Any]:
        """``active``, ``error``, the counters, and ``numbered``: the next operation's number
        (equal on every rank between the same operations, as the hand-over needs)."""
        with self._cv:
            return {"active": self.active, "error": self.error, "numbered": self._next,
                    **self.counters}

    def close(self) -> None:
        """Stop the threads (the group is being destroyed)."""
        with self._cv:
            self._closed = True
            self.error = self.error or "the process group was destroyed"
            ready, self._ready = self._ready, None
            ops, self._ops = list(self._ops.values()), {}
            self._cv.notify_all()
        self._closing.set()
        for op in ops:
            op.done(RuntimeError(f"switchml all_reduce: {self.error}"))
        if ready is not None and self._back is not None:
            self._back.close(ready[0])
        try:
            if self.gloo is not None:
                self.gloo.shutdown()
        except Exception:  # noqa: BLE001 - best effort at teardown
            pass

    # -- the switch-over ---------------------------------------------------------------------

    def _watch(self) -> None:
        with self._cv:
            key = self._key
        while True:
            if self._closing.wait(_WATCH_S):
                return
            with self._cv:
                if self._closed or self.active or key != self._key or self._stayed:
                    return
            try:
                seen = self._store.check([key])
            except Exception:  # noqa: BLE001 - the store went away: the group is ending
                return
            if seen:
                with self._cv:
                    if self.active or self._closed or key != self._key:
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
        if self._roster is None:  # (with a roster: once it says who is rank 0)
            self._start_probe()

    def _start_probe(self) -> None:
        """Rank 0 of the ranks on gloo probes for the switch's return."""
        if self.rank == 0 and self._back is not None and self.probe_s > 0:
            threading.Thread(target=self._probe, args=(self._epoch,),
                             name="switchml-failover-probe", daemon=True).start()

    def _run(self) -> None:
        try:
            # Closing fails the client's pending operations at once, then says LEAVE to the
            # silent switch for up to ``leave_timeout_s``: not worth waiting for.
            threading.Thread(target=self._close_switch, name="switchml-failover-close",
                             daemon=True).start()
            if self._roster is not None:  # who goes on, and a gloo group of them
                rank, size = self._roster(self._epoch, self.reason)
                if self._closed:
                    return
                gloo = ProcessGroupGloo(dist.PrefixStore(
                    f"{self._prefix_key}/gloo/{self._epoch}", self._store), rank, size,
                    self._timeout)
                with self._cv:
                    old, self.rank, self.size, self.gloo = self.gloo, rank, size, gloo
                if old is not None:
                    old.shutdown()
                log.warning("switchml: this rank goes on over gloo as rank %d of %d", rank,
                            size)
                self._start_probe()
            self._switch_over()
        except BaseException as exc:  # noqa: BLE001 - every waiting operation hears of it
            with self._cv:
                self.error = self.error or (f"switchml failover failed: {exc} (it began with: "
                                            f"{self.reason})")
                ops, self._ops = list(self._ops.values()), {}
            log.error("switchml rank %d: %s", self.rank, self.error)
            for op in ops:
                op.done(RuntimeError(self.error))

    def _op(self, seq: int, within_s: float | None = None) -> PendingOp | None:
        """Wait until this rank has issued operation ``seq`` (None: the group is closing).

        Raises:
            RuntimeError: not within ``within_s``.
        """
        end = None if within_s is None else time.monotonic() + within_s
        with self._cv:
            while seq not in self._ops:
                if self._closed:
                    return None
                if end is not None and time.monotonic() > end:
                    raise RuntimeError(f"operation {seq} was not handed to the failover within "
                                       f"{within_s:g} s (it failed to the user on this rank?)")
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
            try:
                if self._back is not None and self.probe_s > 0 and self._go_back(op):
                    return  # through the switch again, from this operation on
            except BaseException as exc:
                op.done(exc if isinstance(exc, Exception) else RuntimeError(str(exc)))
                raise
            self._over_gloo(op)
            seq += 1

    # -- going back to the switch ------------------------------------------------------------

    def _probe(self, epoch: int) -> None:
        """Rank 0, while failed over: every ``probe_s``, join a fresh job at the switch; once
        that works, keep the client for :meth:`_go_back` to offer."""
        assert self._back is not None
        while True:
            with self._cv:
                wake = time.monotonic() + self.probe_s * self._backoff
                while (left := wake - time.monotonic()) > 0 and not self._closed:
                    self._cv.wait(left)
                if self._closed or not self.active or self._epoch != epoch:
                    return
                if self._ready is not None:
                    continue
            try:
                ready = self._back.probe()
            except Exception as exc:  # noqa: BLE001 - not back yet
                log.info("switchml rank 0: the switch is not back: %s", exc)
                continue
            with self._cv:
                if self._closed or not self.active or self._epoch != epoch:
                    stale = True
                else:
                    self._ready, stale = ready, False
            if stale:
                self._back.close(ready[0])
                return

    def _go_back(self, op: PendingOp) -> bool:
        """Before ``op`` runs over gloo: rank 0 says whether the switch is back (and the fresh
        job's spec); if every rank joins that job, ``op`` and every operation after it go
        through the switch. Returns whether they do."""
        assert self._back is not None
        box = torch.zeros(_SPEC_BYTES, dtype=torch.uint8)
        with self._cv:
            ready = self._ready if self.rank == 0 else None
        if ready is not None:
            text = ready[1].encode()
            box[0] = 1
            box[1:1 + len(text)] = torch.tensor(list(text), dtype=torch.uint8)
        opts = _c10d.BroadcastOptions()
        opts.rootRank = 0
        self.gloo.broadcast([box], opts).wait()
        if int(box[0]) == 0:
            return False
        spec = bytes(box[1:].tolist()).rstrip(b"\0").decode()
        client = ready[0] if ready is not None else None
        if client is None:
            try:
                client = self._back.join(spec)
            except Exception as exc:  # noqa: BLE001 - everyone stays on gloo
                log.warning("switchml rank %d: could not join the switch again: %s",
                            self.rank, exc)
        joined = [r[0] for r in self._allgather([int(client is not None)])]
        if not all(joined):
            if client is not None:
                self._back.close(client)
            with self._cv:
                self._ready = None
                self._backoff = min(self._backoff * 2, 16)  # probe less often meanwhile
            self.counters["switch_backs_failed"] += 1
            return False
        with self._cv:
            self._ready = None
            if self._closed:  # (the group is being destroyed: nobody would close it)
                self._back.close(client)
                return False
            self._back.install(client)
            self.active = False
            self._backoff = 1
            self._epoch += 1
            self._key = f"{self._prefix_key}/switched/{self._epoch}"
            self.counters["switch_backs"] += 1
            ops = [op] + [self._ops.pop(s) for s in sorted(self._ops) if s > op.seq]
            # In order, before any operation a user issues from now on (``issue`` waits).
            for k, o in enumerate(ops):
                self._unresolved += 1
                try:
                    self._back.submit(o)
                except Exception as exc:  # noqa: BLE001 - this one and the rest fail
                    self._unresolved -= 1
                    for rest in ops[k:]:
                        self._advance(rest.seq)
                        rest.done(exc)
                    break
        log.warning("switchml rank %d: the switch is back: all-reduces from %d on go through "
                    "it again", self.rank, op.seq)
        self._watcher = threading.Thread(target=self._watch, name="switchml-failover-watch",
                                         daemon=True)
        self._watcher.start()
        return True

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
        if src == SUM_AGAIN:  # (it may not be issued here yet: wait as for any later one)
            op = self._op(seq)
            if op is None:
                return False
            self._over_gloo(op)
            return True
        if state == LACKS:  # (issued: the ranks that have it needed this rank's part)
            op = self._op(seq, within_s=self.gloo_timeout_s)
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
        try:
            for b in bufs:
                opts = _c10d.BroadcastOptions()
                opts.rootRank = src
                self.gloo.broadcast([b.view(torch.uint8)], opts).wait()
        except Exception as exc:
            if op is not None:
                op.done(exc)
            raise
        if op is not None:
            for t, b in zip(op.tensors, bufs, strict=True):
                t.detach().copy_(b.view(t.shape))
            self.counters["results_taken_from_peers"] += 1
            with self._cv:
                self._advance(seq)
            op.done(None)
        elif self.rank == src:
            self.counters["results_given_to_peers"] += 1
        return True

    def _over_gloo(self, op: PendingOp) -> None:
        """Run ``op`` over gloo and complete it; its failure fails it and is raised (the
        failover stops: the ranks are out of step)."""
        error: BaseException | None = None
        try:
            self._allreduce(op)
            self.counters["ops_over_gloo"] += 1
        except Exception as exc:  # noqa: BLE001 - this operation fails, the user sees it
            error = exc
        with self._cv:
            self._advance(op.seq)
        op.done(error)
        if error is not None:
            raise error

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
            if op.residual is not None:  # an exact sum: no rounding error to feed back
                op.residual.zero_()
            if op.average:
                if buf.is_floating_point():
                    buf.div_(self.size)
                else:
                    buf = torch.div(buf, self.size, rounding_mode="trunc")
            if buf.data_ptr() != src.data_ptr():
                src.copy_(buf)

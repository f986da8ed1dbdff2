"""The one driver between a worker endpoint and its user: queued operations and their handles.

Theory of operation. A :class:`~switchml.protocol.worker.WorkerEndpoint` runs one operation at
a time and reports what happened as events. Its user wants more: to issue many all-reduces,
each returning a handle at once; to have them run in the order issued; to have the right handle
complete even when the switch lost the job and an operation restarted under a new sequence
number; and, when the job fails, to have every pending and queued handle fail with the reason
instead of waiting forever. :class:`WorkerSession` does that, once, for every driver: the UDP
client pumps it from its socket thread, the in-memory fabric and the simulator from their event
loops. It is itself an Endpoint (``protocol/endpoint.py``): every call is passed to the worker,
then the worker's events are *settled*:

1. ``OperationCompleted(seq)``: the handle of ``seq`` completes.
2. ``OperationRestarted(seq, new_seq)``: the handle of ``seq`` is re-keyed as ``new_seq``.
3. ``OperationAborted(seq, reason)``, or the worker in ``ERROR``: the handle fails with
   :class:`~switchml.protocol.errors.OperationFailed`, and so does every queued one ("job failed
   earlier"); later submissions are refused with the reason.
4. ``Joined`` / ``JoinFailed`` / ``Left``: :attr:`joined`, :attr:`error`, :attr:`closed`.
5. While the worker is ``READY`` and operations are queued, the next one starts.

Every event is then passed on unchanged through :meth:`next_event` (for logs and tests).

Handles (:class:`OperationHandle`) hold no locks and never block: a threaded driver subclasses
them (``transport/handles.py``) and gives the session a factory.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import numpy as np

from switchml.protocol.dtypes import is_float
from switchml.protocol.endpoint import Batch, Transmit
from switchml.protocol.errors import (
    LocalProtocolError,
    OperationFailed,
    RanksDisagree,
    RoundGone,
    SwitchMLError,
    SwitchUnreachable,
)
from switchml.protocol.events import (
    Event,
    Joined,
    JoinFailed,
    Left,
    OperationAborted,
    OperationCompleted,
    OperationRestarted,
)
from switchml.protocol.lifecycle import WorkerState
from switchml.protocol.operation import validate_arrays
from switchml.protocol.worker import WorkerEndpoint

__all__ = ["OperationHandle", "Submission", "WorkerSession", "prepare_submission"]


class OperationHandle:
    """The pending result of one all-reduce: done, failed, or not yet.

    ``out`` is the array the result goes to; ``seq`` the operation's sequence number once it
    started (it changes if the operation restarts on a new epoch).
    """

    __slots__ = ("_callbacks", "_done", "_error", "_finish", "block", "contributors", "out",
                 "seq")

    def __init__(self, out: np.ndarray, finish: Callable[[], None] | None = None) -> None:
        self.out = out
        self.seq: int | None = None
        # In a quorum job, once done: how many ranks each block of ``block`` elements of the
        # result holds (``OperationCompleted``); None: every rank.
        self.contributors: np.ndarray | None = None
        self.block = 0
        self._finish = finish
        self._done = False
        self._error: BaseException | None = None
        self._callbacks: list[Callable[[Any], None]] = []

    def done(self) -> bool:
        """Whether the operation completed or failed."""
        return self._done

    def exception(self) -> BaseException | None:
        """The error it failed with, or None (also while not done)."""
        return self._error

    def result(self) -> np.ndarray:
        """The output array of a completed operation.

        Raises:
            OperationFailed: it failed (the message says why).
            LocalProtocolError: it is not done yet.
        """
        if not self._done:
            raise LocalProtocolError("the all-reduce is not done yet")
        if self._error is not None:
            raise self._error
        return self.out

    def contributor_counts(self) -> np.ndarray | None:
        """In a quorum job, how many ranks each element's sum holds (int64, one per element
        of the output), once done; None in a job without a quorum (every rank) or before."""
        if self.contributors is None:
            return None
        return np.repeat(self.contributors, self.block)[:self.out.size]

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` when done (at once if it is); runs where the driver runs."""
        if self._done:
            fn(self)
        else:
            self._callbacks.append(fn)

    def resolve(self, error: BaseException | None) -> None:
        """Complete the handle (the driver's call; once: later calls are ignored)."""
        if self._done:
            return
        if error is None and self._finish is not None:
            try:
                self._finish()
            except Exception as exc:  # copying the result back failed: report it
                error = exc
        callbacks = self._mark_done(error)
        for fn in callbacks:
            self._run_callback(fn)

    def _mark_done(self, error: BaseException | None) -> list[Callable[[Any], None]]:
        """Record the outcome; return the callbacks to run (a threaded subclass locks here)."""
        self._error = error
        self._done = True
        callbacks, self._callbacks = self._callbacks, []
        return callbacks

    def _run_callback(self, fn: Callable[[Any], None]) -> None:
        fn(self)


@dataclass(frozen=True, slots=True)
class Submission:
    """An all-reduce checked and ready to queue (:func:`prepare_submission`)."""

    data: np.ndarray
    out: np.ndarray
    handle: OperationHandle
    bits: int = 32
    residual: np.ndarray | None = None


def prepare_submission(data: np.ndarray, out: np.ndarray | None = None, *, bits: int = 32,
                       residual: np.ndarray | None = None,
                       handle_type: type[OperationHandle] = OperationHandle) -> Submission:
    """Check an all-reduce's arguments and make its handle, without touching any session (so
    that a threaded client can do it in the caller's thread and raise there).

    ``out`` may be None (a new array), ``data`` itself (in place), or any writeable array of
    data's shape and dtype; a non-contiguous ``out`` gets the result through a copy.

    Raises:
        LocalProtocolError: not a numpy array, unsupported dtype, shapes or dtypes that differ,
            a read-only ``out``, ``bits`` other than 32 (or 16 for floats).
    """
    if not isinstance(data, np.ndarray):
        raise LocalProtocolError(f"data must be a numpy array, got {type(data).__name__}")
    if out is None:
        out = np.empty_like(data)
    elif not isinstance(out, np.ndarray) or out.shape != data.shape or out.dtype != data.dtype:
        what = f"{out.dtype}{out.shape}" if isinstance(out, np.ndarray) else type(out).__name__
        raise LocalProtocolError(f"out must match data: {what} vs {data.dtype}{data.shape}")
    if not out.flags.writeable:
        raise LocalProtocolError("out is read-only: it cannot take the result (give a writeable "
                                 "array, or none for a new one)")
    src = np.ascontiguousarray(data)
    dst = out if out.flags.c_contiguous else np.empty_like(src)
    finish = None if dst is out else (lambda: np.copyto(out, dst))
    validate_arrays(src, dst)
    if bits not in (32, 16) or (bits == 16 and not is_float(src.dtype)):
        raise LocalProtocolError(f"bits must be 32, or 16 for float data; got {bits} for "
                                 f"{src.dtype}")
    return Submission(src, dst, handle_type(out, finish), bits, residual)


class WorkerSession:
    """One rank's operations, in the order issued, on a :class:`WorkerEndpoint` (sans-I/O).

    Example::

        s = WorkerSession(WorkerEndpoint(spec=spec, rank=0, switch_address=switch))
        s.join(now)
        h = s.submit(np.ones(1000, np.float32), now=now)   # a handle, at once
        # ... pump s like any endpoint; h.done() becomes True, h.result() is the sum

    ``explain``: called when a failure is reported, returns text to append to its reason
    (the UDP client adds the ICMP port-unreachable errors it saw); "" for nothing.
    """

    def __init__(self, endpoint: WorkerEndpoint, *,
                 handle_type: type[OperationHandle] = OperationHandle,
                 explain: Callable[[], str] | None = None) -> None:
        self.endpoint = endpoint
        self.handle_type = handle_type
        self._explain = explain
        self._queue: deque[Submission] = deque()
        self._pending: dict[int, OperationHandle] = {}
        self._events: deque[Event] = deque()
        self.joined = False
        self.error: str | None = None
        """Why the job failed (join refused, an operation failed); None while healthy."""
        self.closed = False
        self._closing = False

    # -- user commands -------------------------------------------------------------------------

    def join(self, now: float, *, late: bool = False) -> None:
        """Join the job (the worker's JOIN; ``late``: a running quorum job, see
        ``WorkerEndpoint.join``). Call ``datagrams_to_send`` afterwards."""
        self.endpoint.join(now, late=late)
        self._settle(now)

    def submit(self, data: np.ndarray, out: np.ndarray | None = None, *, now: float,
               bits: int = 32, residual: np.ndarray | None = None) -> OperationHandle:
        """Queue an all-reduce of ``data`` (into ``out``; see :func:`prepare_submission`) and
        return its handle; it starts as soon as the operations before it are done. Call
        ``datagrams_to_send`` afterwards.

        Raises:
            LocalProtocolError: bad arguments, or the session failed or is closed (the reason
                is in the message).
        """
        sub = prepare_submission(data, out, bits=bits, residual=residual,
                                 handle_type=self.handle_type)
        self.enqueue(sub, now)
        return sub.handle

    def enqueue(self, sub: Submission, now: float) -> None:
        """Queue a prepared all-reduce. Call ``datagrams_to_send`` afterwards.

        Raises:
            LocalProtocolError: the session failed or is closed.
        """
        if self.error is not None:
            raise LocalProtocolError(f"the job failed earlier: {self.error}")
        if self.closed or self.endpoint.state in (WorkerState.CLOSING, WorkerState.CLOSED):
            raise LocalProtocolError("the session is closed")
        self._queue.append(sub)
        self._settle(now)

    def close(self, now: float) -> None:
        """Leave the job; an operation in flight and every queued one fail. Idempotent. Call
        ``datagrams_to_send`` afterwards."""
        self._closing = True  # an operation aborted by this close is not a job failure
        self.endpoint.close(now)
        self._settle(now)
        self.fail_all("the session was closed")

    def fail_all(self, reason: str) -> None:
        """Fail every pending and queued handle with ``reason`` (the driver stops)."""
        for handle in self._pending.values():
            handle.resolve(OperationFailed(reason))
        self._pending.clear()
        while self._queue:
            self._queue.popleft().handle.resolve(OperationFailed(reason))

    @property
    def busy(self) -> bool:
        """Whether operations are in flight or queued."""
        return bool(self._pending or self._queue)

    # -- Endpoint contract ---------------------------------------------------------------------

    def receive_datagram(self, data: Any, addr: Any, now: float) -> None:
        self.endpoint.receive_datagram(data, addr, now)
        self._settle(now)

    def receive_many(self, batch: Batch, now: float) -> None:
        self.endpoint.receive_many(batch, now)
        self._settle(now)

    def handle_timer(self, now: float) -> None:
        self.endpoint.handle_timer(now)
        self._settle(now)

    def after_results_kernel(self, op: Any, code: int, now: float) -> None:
        """The worker's ``after_results_kernel`` (a transport's compiled loop stopped)."""
        self.endpoint.after_results_kernel(op, code, now)
        self._settle(now)

    def datagrams_to_send(self, now: float) -> list[Any]:
        return self.endpoint.datagrams_to_send(now)

    def poll_transmit(self, now: float, *, gso: tuple[int, int] | None = None,
                      compiled: bool = False) -> Transmit:
        """The worker's ``poll_transmit``."""
        return self.endpoint.poll_transmit(now, gso=gso, compiled=compiled)

    def get_timer(self) -> float | None:
        return self.endpoint.get_timer()

    def next_event(self) -> Event | None:
        """The worker's next event, after the session acted on it (the handles it completed
        are done). Also takes events of calls made on the worker directly."""
        self._take_events()
        return self._events.popleft() if self._events else None

    # -- settling --------------------------------------------------------------------------------

    def _settle(self, now: float) -> None:
        """Turn the worker's events into handle outcomes; start queued operations."""
        ep = self.endpoint
        while True:
            self._take_events()
            if ep.state is WorkerState.ERROR and not self._closing:
                self._on_error(ep.error or "the worker failed")
                return
            if not self._queue or ep.state is not WorkerState.READY:
                return
            self._start(self._queue.popleft(), now)

    def _take_events(self) -> None:
        while (ev := self.endpoint.next_event()) is not None:
            self._on_event(ev)
            self._events.append(ev)

    def _start(self, sub: Submission, now: float) -> None:
        try:
            seq = self.endpoint.start_allreduce(sub.data, sub.out, now, bits=sub.bits,
                                                residual=sub.residual)
        except SwitchMLError as exc:  # e.g. a bad residual: fail this one, go on
            sub.handle.resolve(exc)
            return
        except Exception as exc:  # e.g. MemoryError copying the input
            sub.handle.resolve(OperationFailed(f"could not start the all-reduce: {exc!r}"))
            return
        sub.handle.seq = seq
        self._pending[seq] = sub.handle

    def _on_event(self, ev: Event) -> None:
        if isinstance(ev, OperationCompleted):
            handle = self._pending.pop(ev.seq, None)
            if handle is not None:
                handle.contributors, handle.block = ev.contributors, ev.block
                handle.resolve(None)
        elif isinstance(ev, OperationRestarted):
            handle = self._pending.pop(ev.seq, None)
            if handle is not None:
                handle.seq = ev.new_seq
                self._pending[ev.new_seq] = handle
        elif isinstance(ev, OperationAborted):
            handle = self._pending.pop(ev.seq, None)
            reason = self._explained(ev.reason)
            if not self._closing:
                self.error = self.error or reason
            if handle is not None:
                kind = (SwitchUnreachable if ev.switch_silent else
                        RanksDisagree if ev.disagree else
                        RoundGone if ev.gone else OperationFailed)
                handle.resolve(kind(reason))
        elif isinstance(ev, Joined):
            self.joined = True
        elif isinstance(ev, JoinFailed):
            self.error = self.error or self._explained(ev.reason)
        elif isinstance(ev, Left):
            self.closed = True
            self.fail_all("the session was closed")

    def _on_error(self, reason: str) -> None:
        """The worker is in ERROR: nothing queued or pending can complete any more."""
        self.error = self.error or self._explained(reason)
        self.fail_all(f"the job failed earlier: {self.error}")

    def _explained(self, reason: str) -> str:
        extra = self._explain() if self._explain is not None else ""
        return reason + extra

"""torch.distributed plumbing for the "switchml" process group (``torch/backend.py``): the
``Work`` it returns, futures that fail the way C++ consumers (DDP's reducer) see, and the
options torch's coalesced collectives take."""

from __future__ import annotations

import datetime
import threading
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
from torch._C import _distributed_c10d as _c10d

__all__ = ["SwitchMLWork", "all_of", "bucket_done", "complete_elsewhere", "error_of",
           "failable_future", "gather_opts", "scatter_opts"]


class SwitchMLWork(dist.Work):
    """A pending collective: ``wait()`` raises if the operation failed (unlike a bare future)
    and honours its timeout. ``parts``: the works it stands for (``all_of``), each waited
    for too: a gloo work on CUDA tensors makes the caller's stream wait for its copy back
    to the device in its own ``wait()``, which its future alone does not."""

    def __init__(self, future: torch.futures.Future[Any],
                 parts: list[dist.Work] | None = None) -> None:
        super().__init__()
        self._future = future
        self._parts = parts or []
        self._event = threading.Event()
        future.add_done_callback(lambda _f: self._event.set())

    def wait(self, timeout: datetime.timedelta = datetime.timedelta(0)) -> bool:
        seconds = timeout.total_seconds() if isinstance(timeout, datetime.timedelta) else 0.0
        if seconds > 0 and not self._event.wait(seconds):
            raise RuntimeError(f"switchml collective not done after {seconds:g} s")
        self._future.wait()  # raises the operation's error
        for part in self._parts:
            part.wait()
        return True

    def get_future(self) -> torch.futures.Future[Any]:
        return self._future

    def is_completed(self) -> bool:
        return self._future.done()

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True


def error_of(f: torch.futures.Future[Any]) -> BaseException | None:
    try:
        f.value()
    except Exception as exc:  # noqa: BLE001 - recorded
        return exc
    return None


def all_of(works: list[dist.Work], value: Any) -> dist.Work:
    """One work for several: done when every one is, failing if any fails, its future's
    value ``value``."""
    def result(f: torch.futures.Future[Any]) -> Any:
        for w in f.value():
            w.value()  # raises the first failure
        return value

    return SwitchMLWork(torch.futures.collect_all([w.get_future() for w in works]).then(result),
                        parts=works)


def gather_opts(opts: Any) -> Any:
    """AllgatherOptions for one tensor of a coalesced call (the same timeout)."""
    one = _c10d.AllgatherOptions()
    if opts is not None:
        one.timeout = opts.timeout
    return one


def scatter_opts(opts: Any) -> Any:
    """ReduceScatterOptions for one tensor of a coalesced call (same op and timeout)."""
    one = _c10d.ReduceScatterOptions()
    if opts is not None:
        one.reduceOp = opts.reduceOp
        one.timeout = opts.timeout
    return one


def failable_future() -> tuple[torch.futures.Future[Any], torch.futures.Future[Any]]:
    """Return (completer, future). Complete ``completer`` with a value or an exception
    *object*; ``future`` then holds the value or raises. (``Future.set_exception`` is not seen
    as an error by C++ consumers such as DDP's reducer, which then crash reading the value; an
    exception raised in a ``then`` callback is.)"""
    completer: torch.futures.Future[Any] = torch.futures.Future()

    def unwrap(f: torch.futures.Future[Any]) -> Any:
        value = f.value()
        if isinstance(value, BaseException):
            raise value
        return value

    return completer, completer.then(unwrap)


def complete_elsewhere(completer: torch.futures.Future[Any], value: Any) -> None:
    """Complete ``completer`` on a short-lived thread of its own, not on the caller's.

    Completions come from a worker's single I/O thread, and torch runs every chained ``then``
    callback on the thread that completes the future. A callback that waits for another
    switchml collective (PowerSGD-style hooks do) would block the only thread that can finish
    it: a deadlock no timeout breaks. A thread per completed collective costs tens of
    microseconds.
    """
    threading.Thread(target=completer.set_result, args=(value,), name="switchml-complete",
                     daemon=True).start()


def bucket_done(completer: torch.futures.Future[Any], value: Any,
                finish: Callable[[Any], None], what: str) -> Callable[[Any], None]:
    """A DDP hook's done-callback for its all-reduce handle: ``finish(handle)`` (the write-back
    into the bucket), then ``completer`` completed (``complete_elsewhere``) with ``value``, or
    with the all-reduce's or the write-back's error as a RuntimeError naming ``what``. DDP is
    never left waiting on a future nobody completes."""
    def done(h: Any) -> None:
        error = h.exception()
        if error is None:
            try:
                finish(h)
            except Exception as exc:  # noqa: BLE001 - surfaced through the future
                error = exc
        complete_elsewhere(completer, value if error is None
                           else RuntimeError(f"{what} failed: {error}"))
    return done

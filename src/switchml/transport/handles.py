"""Handles that other threads can wait on: the sans-I/O handle plus a lock and an event.

The session (``protocol/session.py``) completes handles where the driver runs: on the UDP
client's I/O thread, or inside the in-memory fabric's loop. :class:`AllreduceHandle` lets
any thread wait for that (``wait``), and register callbacks safely while it happens. For a
driver that runs only when asked (the fabric), ``drive`` is called by ``wait`` to make
progress until the handle is done.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

import numpy as np

from switchml.protocol.session import OperationHandle

__all__ = ["AllreduceHandle", "OutOfPlace"]

log = logging.getLogger(__name__)


class AllreduceHandle(OperationHandle):
    """The pending result of an all-reduce (``WorkerClient.allreduce_async``,
    ``MemoryCluster.start``)."""

    __slots__ = ("_event", "_lock", "drive")

    def __init__(self, out: np.ndarray, finish: Callable[[], None] | None = None) -> None:
        super().__init__(out, finish)
        self._event = threading.Event()
        self._lock = threading.Lock()  # orders add_done_callback against completion
        self.drive: Callable[[AllreduceHandle], None] | None = None
        """Set by a driver that runs only when asked: called by ``wait`` until done."""

    def wait(self, timeout: float | None = None) -> np.ndarray:
        """Block until done; return the output array.

        Raises:
            OperationFailed: the operation failed (the message names who stopped answering).
            TimeoutError: ``timeout`` passed first (the operation goes on).
        """
        if self.drive is not None and not self._done:
            self.drive(self)
        if not self._event.wait(timeout):
            raise TimeoutError(f"all-reduce not done after {timeout} s")
        return self.result()

    def add_done_callback(self, fn: Callable[[Any], None]) -> None:
        """Call ``fn(handle)`` when done (at once if it is); runs on the driver's thread."""
        with self._lock:
            if not self._done:
                self._callbacks.append(fn)
                return
        fn(self)

    def _mark_done(self, error: BaseException | None) -> list[Callable[[Any], None]]:
        with self._lock:
            callbacks = super()._mark_done(error)
        self._event.set()
        return callbacks

    def _run_callback(self, fn: Callable[[Any], None]) -> None:
        try:
            fn(self)
        except Exception:  # a user's callback must not kill the I/O thread
            log.exception("all-reduce done callback failed")


class OutOfPlace:
    """``allreduce`` out of place, for an in-process cluster of ranks (the in-memory fabric's,
    the simulator's tree) that has ``start(arrays, outs)`` and ``wait(handles)``."""

    def start(self, arrays: Any, outs: Any = None) -> Any:
        raise NotImplementedError

    def wait(self, handles: Any) -> None:
        raise NotImplementedError

    def allreduce(self, arrays: Any) -> list[np.ndarray]:
        """Sum the arrays (one per rank) out of place; return each rank's result."""
        outs = [np.empty_like(a) for a in arrays]
        self.wait(self.start(arrays, outs))
        return outs

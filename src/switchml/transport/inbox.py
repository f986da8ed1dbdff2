"""A thread-safe inbox of commands for an I/O thread, with a file descriptor to wake it.

User threads ``put`` commands (an all-reduce to queue, a request to close); the I/O thread
waits in ``select`` on its socket and :attr:`Inbox.fileno`, then ``drain``s. Putting, closing
and the wake-up write happen under one lock, so a command is either seen by the I/O thread or
refused, and nobody writes to a closed pipe.
"""

from __future__ import annotations

import os
import queue
import threading
from typing import Any

__all__ = ["Inbox"]


class Inbox:
    """Commands for one I/O thread. ``put`` after ``close`` raises ``RuntimeError``."""

    CLOSE = object()
    """What :meth:`drain` yields for a :meth:`close` request."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._woken = False  # a wake-up byte is in the pipe (set and cleared under the lock)
        self.closed = threading.Event()
        self._wake_r, self._wake_w = os.pipe()
        for fd in (self._wake_r, self._wake_w):  # a full pipe means a wake-up is pending
            os.set_blocking(fd, False)

    def fileno(self) -> int:
        """Readable when commands wait (``select`` on it)."""
        return self._wake_r

    def put(self, item: Any, *, check: Any = None) -> None:
        """Queue ``item`` and wake the I/O thread. ``check()``, called under the lock, may
        raise to refuse it (e.g. the client failed).

        Raises:
            RuntimeError: the inbox is closed.
        """
        with self._lock:
            if check is not None:
                check()
            if self.closed.is_set():
                raise RuntimeError("closed")
            self._queue.put(item)
            self._wake()

    def close(self) -> bool:
        """Ask the I/O thread to stop (queues ``CLOSE``); False if it was closed already."""
        with self._lock:
            if self.closed.is_set():
                return False
            self.closed.set()
            self._queue.put(self.CLOSE)
            self._wake()
            return True

    def shut(self) -> None:
        """The I/O thread ends: refuse every later ``put`` (``close`` does nothing)."""
        with self._lock:
            self.closed.set()

    def drain(self) -> list[Any]:
        """Everything queued, in order (the I/O thread's call); clears the wake-up.

        Cheap when nothing was put (one attribute read: the I/O thread calls it on every turn
        of its loop); a ``put`` racing with that read is seen on the next turn, since its
        wake-up byte makes ``select`` return."""
        if not self._woken:
            return []
        with self._lock:
            self._woken = False
            try:
                os.read(self._wake_r, 1 << 16)  # a pipe holds 64 KiB: all of it
            except OSError:
                pass
            items = []
            while not self._queue.empty():
                items.append(self._queue.get_nowait())
            return items

    def release(self) -> None:
        """Close the pipe (the I/O thread's last call, after :meth:`shut`)."""
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass

    def _wake(self) -> None:
        self._woken = True
        try:
            os.write(self._wake_w, b"x")
        except BlockingIOError:
            pass  # the pipe is full: a wake-up is pending anyway

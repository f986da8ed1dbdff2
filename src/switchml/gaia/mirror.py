"""The links between data centres: each data centre's leader talks to every other leader.

Theory of operation. Each leader listens on one TCP port and connects out to every other
leader; it sends on its outgoing connections (through one sender thread each, so training never
waits for the WAN) and receives on the accepted ones (one receiver thread each). Per finished
clock ``c`` a leader sends, to every other data centre: ``CLOCK(c, announce)`` and
``SPARSE(c)`` when it has significant updates, then ``CLOCK(c)``. Receivers record the announce
in the :class:`SelectiveBarrier`, queue the sparse update, and move the :class:`MirrorClock`.
:meth:`Mirror.exchange` applies the queued updates and returns once the rules allow the next
clock, or raises :class:`GaiaError` naming the data centres it waited for after ``timeout_s``,
or at once when a data centre's connection dropped without a goodbye.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from switchml.gaia.rules import MirrorClock, SelectiveBarrier, decode_sparse, encode_sparse
from switchml.protocol.address import Address, format_address
from switchml.protocol.errors import SwitchMLError
from switchml.ps.wire import MessageType, recv_message, send_message

__all__ = ["GaiaError", "Mirror"]

log = logging.getLogger(__name__)
_DONE = 1 << 30  # a data centre that said goodbye holds nobody back


class GaiaError(SwitchMLError):
    """A data centre died, timed out or broke the protocol; the message names it."""


class Mirror:
    """Data centre ``dc``'s links to the leaders at ``leaders`` (one address per data centre,
    its own included: it listens there)."""

    def __init__(self, *, dc: int, leaders: Sequence[Address], staleness: int = 2,
                 timeout_s: float = 120.0, bind_host: str = "0.0.0.0") -> None:
        self.dc = dc
        self.leaders = [tuple(a) for a in leaders]
        self.timeout_s = timeout_s
        self.clock = MirrorClock(len(leaders), dc, staleness=staleness)
        self.barrier = SelectiveBarrier()
        self.bytes_sent = 0
        self.updates_received = 0
        self.entries_received = 0
        self.wait_s = 0.0
        self._cond = threading.Condition()
        self._inbox: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self._errors: dict[int, str] = {}
        self._out: dict[int, socket.socket] = {}
        self._queues: dict[int, queue.Queue[Any]] = {}
        self._senders: list[threading.Thread] = []
        self._lsock = socket.socket()
        self._lsock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._lsock.bind((bind_host, self.leaders[dc][1]))
        self._lsock.listen(16)

    def _name(self, j: int) -> str:
        return f"data centre {j} (leader {format_address(self.leaders[j])})"

    # -- set-up -----------------------------------------------------------------------------

    def start(self) -> Mirror:
        """Accept the others and connect to them; returns when every link is up.

        Raises:
            GaiaError: a leader unreachable within ``timeout_s`` (named).
        """
        self._spawn(self._accept_loop)
        for j, addr in enumerate(self.leaders):
            if j == self.dc:
                continue
            deadline = time.monotonic() + self.timeout_s
            while True:
                try:
                    sock = socket.create_connection(addr, timeout=5)
                    break
                except OSError as exc:
                    if time.monotonic() > deadline:
                        raise GaiaError(f"cannot reach {self._name(j)} within "
                                        f"{self.timeout_s:g} s: {exc}") from exc
                    time.sleep(0.2)
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sock.settimeout(self.timeout_s)
            send_message(sock, MessageType.HELLO, worker=self.dc)
            self._out[j] = sock
            self._queues[j] = queue.Queue()
            self._senders.append(self._spawn(self._sender, j))
        return self

    def _spawn(self, fn: Callable[..., None], *args: Any) -> threading.Thread:
        t = threading.Thread(target=fn, args=args, daemon=True)
        t.start()
        return t

    def _accept_loop(self) -> None:
        while True:
            try:
                conn, _ = self._lsock.accept()
            except OSError:
                return
            self._spawn(self._receiver, conn)

    # -- sending ----------------------------------------------------------------------------

    def _sender(self, j: int) -> None:
        sock, q = self._out[j], self._queues[j]
        try:
            while True:
                item = q.get()
                if item is None:
                    send_message(sock, MessageType.BYE, worker=self.dc)
                    return
                for mtype, flags, clock, payload in item:
                    self.bytes_sent += send_message(sock, mtype, worker=self.dc, step=clock,
                                                    flags=flags, payload=payload)
        except OSError as exc:
            with self._cond:
                self._errors[j] = f"sending to {self._name(j)} failed: {exc}"
                self._cond.notify_all()

    def publish(self, clock: int, idx: np.ndarray, vals: np.ndarray) -> None:
        """Send this data centre's significant updates of ``clock`` and the clock itself to
        every other data centre (in the background)."""
        msgs: list[tuple[MessageType, int, int, bytes]] = []
        if idx.size:
            msgs.append((MessageType.CLOCK, 1, clock, b""))  # the selective barrier
            msgs.append((MessageType.SPARSE, 0, clock, encode_sparse(idx, vals)))
        msgs.append((MessageType.CLOCK, 0, clock, b""))
        for q in self._queues.values():
            q.put(msgs)

    # -- receiving --------------------------------------------------------------------------

    def _receiver(self, conn: socket.socket) -> None:
        j = -1
        try:
            h, _ = recv_message(conn)
            if h.type != MessageType.HELLO or not 0 <= h.worker < len(self.leaders):
                raise GaiaError(f"unexpected {h.type.name} from a peer")
            j = h.worker
            while True:
                h, payload = recv_message(conn)
                with self._cond:
                    if h.type == MessageType.CLOCK and h.flags:
                        self.barrier.announce(j, h.step)
                    elif h.type == MessageType.CLOCK:
                        self.clock.observe(j, h.step)
                    elif h.type == MessageType.SPARSE:
                        idx, vals = decode_sparse(payload)
                        self._inbox.append((j, h.step, idx, vals))
                    elif h.type == MessageType.BYE:
                        self.clock.observe(j, _DONE)
                        self._cond.notify_all()
                        return
                    else:
                        raise GaiaError(f"unexpected {h.type.name} from {self._name(j)}")
                    self._cond.notify_all()
        except (OSError, ConnectionError, GaiaError, ValueError) as exc:
            with self._cond:
                self._errors[j] = f"{self._name(j) if j >= 0 else 'a peer'}: {exc}"
                self._cond.notify_all()
        finally:
            conn.close()

    def exchange(self, apply: Callable[[np.ndarray, np.ndarray], None], *,
                 everyone: bool = False) -> None:
        """Apply every received update (``apply(idx, vals)``, in arrival order) and return
        once the selective barrier and the mirror clock allow the next clock (``everyone``:
        once every data centre reached this one's clock, as at the end of training).

        Raises:
            GaiaError: a data centre's link failed, or the wait passed ``timeout_s`` (names
                the data centres waited for).
        """
        t0 = time.monotonic()
        deadline = t0 + self.timeout_s
        with self._cond:
            while True:
                while self._inbox:
                    j, clock, idx, vals = self._inbox.pop(0)
                    apply(idx, vals)
                    self.barrier.applied(j, clock)
                    self.updates_received += 1
                    self.entries_received += idx.size
                caught_up = (min(self.clock.clocks) >= self.clock.clocks[self.dc]
                             if everyone else self.clock.may_start())
                if self.barrier.may_proceed() and caught_up:
                    break
                bad = [j for j in self._errors if self.clock.clocks[j] < _DONE]
                if bad:
                    raise GaiaError(self._errors[bad[0]])
                left = deadline - time.monotonic()
                if left <= 0:
                    mine = self.clock.clocks[self.dc]
                    behind = ([j for j, c in enumerate(self.clock.clocks) if c < mine]
                              if everyone else self.clock.waiting_for())
                    who = sorted({j for j, _ in self.barrier.pending} | set(behind))
                    raise GaiaError(f"data centre {self.dc} waited {self.timeout_s:g} s for "
                                    + ", ".join(self._name(j) for j in who))
                self._cond.wait(min(left, 0.5))
        self.wait_s += time.monotonic() - t0

    def close(self) -> None:
        """Say goodbye to every data centre (after the queued updates are sent) and stop."""
        for q in self._queues.values():
            q.put(None)
        for t in self._senders:
            t.join(self.timeout_s)
        for sock in self._out.values():
            sock.close()
        try:
            self._lsock.close()
        except OSError:
            pass

    def stats(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "updates_received": self.updates_received,
                "entries_received": self.entries_received, "wait_s": self.wait_s,
                "clocks": list(self.clock.clocks)}

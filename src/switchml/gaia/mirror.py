"""The links between data centres: each data centre's leader talks to every other leader.

Theory of operation. Each leader listens on one TCP port and connects out to every other
leader; it sends on its outgoing connections (through one sender thread each, so training never
waits for the WAN) and receives on the accepted ones (one receiver thread each). Per finished
clock ``c`` a leader sends, to every other data centre: ``CLOCK(c, announce)`` and
``SPARSE(c)`` when it has significant updates, then ``CLOCK(c)``. Receivers record the announce
in the :class:`SelectiveBarrier`, queue the sparse update, and move the :class:`MirrorClock`.
:meth:`Mirror.exchange` applies the queued updates of clocks up to its own (a faster data
centre's later ones wait) and returns once the rules allow the next clock, or raises
:class:`GaiaError` naming the data centres it waited for after ``timeout_s``, or at once when a
data centre's connection dropped without a goodbye.

Security. With ``security`` (``links.py``) every link is mutual TLS: a stranger cannot connect,
read or alter anything. Beyond loopback a mirror refuses to listen without it. Every message is
checked before it touches any state: a HELLO names another data centre that is not connected
yet; clocks come one at a time in order; an announce is for the next clock; a SPARSE update
follows its announce, holds at most the model's entries (``expect_entries``) and indexes
inside it. A link that breaks a rule is closed, logged and counted (``stats()``), and fails the
exchange naming its data centre; a connection that never said a valid HELLO changes nothing.
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
from switchml.links import LinkSecurity, WarningBudget, check_exposure
from switchml.protocol.address import Address, format_address
from switchml.protocol.errors import SwitchMLError
from switchml.ps.wire import (
    CONTROL_PAYLOAD_BYTES,
    MessageType,
    PSError,
    recv_header,
    recv_payload,
    send_message,
)

__all__ = ["GaiaError", "Mirror"]

log = logging.getLogger(__name__)
_DONE = 1 << 30  # a data centre that said goodbye holds nobody back


class GaiaError(SwitchMLError):
    """A data centre died, timed out or broke the protocol; the message names it."""


class Mirror:
    """Data centre ``dc``'s links to the leaders at ``leaders`` (one address per data centre,
    its own included: it listens there)."""

    def __init__(self, *, dc: int, leaders: Sequence[Address], staleness: int = 2,
                 timeout_s: float = 120.0, bind_host: str = "127.0.0.1",
                 security: LinkSecurity | None = None, insecure: bool = False) -> None:
        """``security``: mutual TLS on every link, needed to listen beyond loopback (that is,
        for data centres on other hosts) unless ``insecure``.

        Raises:
            ConfigError: a non-loopback ``bind_host`` without ``security`` or ``insecure``.
        """
        check_exposure(bind_host, security, insecure=insecure, what=f"Gaia leader {dc}")
        self.dc = dc
        self.security = security
        self._server_tls = security.server_context() if security is not None else None
        self._client_tls = security.client_context() if security is not None else None
        self.max_entries = 1 << 28
        """The most entries a SPARSE update may hold (the model's size: ``expect_entries``)."""
        self.refused_links = 0
        self.protocol_errors = 0
        self._linked: set[int] = set()  # data centres whose incoming link said HELLO
        self._listening = False
        self._warn = WarningBudget(log)
        self._receivers: list[threading.Thread] = []
        self._max_links = 2 * len(leaders) + 4  # links served at once
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
        self._lsock.listen(128)

    def _name(self, j: int) -> str:
        return f"data centre {j} (leader {format_address(self.leaders[j])})"

    # -- set-up -----------------------------------------------------------------------------

    def start(self) -> Mirror:
        """Accept the others and connect to them; returns when every link is up.

        Raises:
            GaiaError: a leader unreachable within ``timeout_s`` (named).
        """
        self.listen()
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
            if self.security is not None and self._client_tls is not None:
                try:
                    sock = self.security.connect(sock, self._client_tls)
                except (OSError, ValueError) as exc:
                    sock.close()
                    raise GaiaError(f"TLS with {self._name(j)} failed (credentials from the "
                                    f"same CA?): {exc}") from exc
            send_message(sock, MessageType.HELLO, worker=self.dc)
            self._out[j] = sock
            self._queues[j] = queue.Queue()
            self._senders.append(self._spawn(self._sender, j))
        return self

    def listen(self) -> Mirror:
        """Accept the other data centres' links (``start`` does this first, then connects
        out); on its own, for a leader that only receives (tests, the fuzzer)."""
        if not self._listening:
            self._listening = True
            self._spawn(self._accept_loop)
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
            self._receivers = [t for t in self._receivers if t.is_alive()]
            if len(self._receivers) >= self._max_links:
                with self._cond:
                    self.refused_links += 1
                self._warn.warn("Gaia leader %d refused a connection: %d links open",
                                self.dc, self._max_links)
                conn.close()
                continue
            self._receivers.append(self._spawn(self._receiver, conn))

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

    def expect_entries(self, size: int) -> None:
        """The model has ``size`` parameters: a SPARSE update indexes inside it."""
        self.max_entries = size

    def _receiver(self, conn: socket.socket) -> None:
        j = -1
        try:
            if self.security is not None and self._server_tls is not None:
                try:
                    conn = self.security.accept(conn, self._server_tls)
                except (OSError, ValueError) as exc:
                    with self._cond:
                        self.refused_links += 1
                    self._warn.warn("Gaia leader %d refused a connection: TLS handshake "
                                    "failed: %s", self.dc, exc)
                    return
            conn.settimeout(None)
            h = recv_header(conn)
            recv_payload(conn, h, limit=CONTROL_PAYLOAD_BYTES)
            if h.type != MessageType.HELLO or not 0 <= h.worker < len(self.leaders):
                raise GaiaError(f"{h.type.name} (worker field {h.worker}) instead of a HELLO")
            with self._cond:
                if h.worker == self.dc or h.worker in self._linked:
                    raise GaiaError(f"a HELLO as data centre {h.worker}, which "
                                    + ("is this one" if h.worker == self.dc
                                       else "is connected already"))
                self._linked.add(h.worker)
            j = h.worker
            self._receive_from(conn, j)
        except (OSError, ConnectionError, GaiaError, PSError, ValueError) as exc:
            with self._cond:
                self.protocol_errors += isinstance(exc, GaiaError | PSError | ValueError)
                if j >= 0:
                    self._errors[j] = f"{self._name(j)}: {exc}"
                    self._cond.notify_all()
            self._warn.warn("Gaia leader %d: link from %s: %s", self.dc,
                            self._name(j) if j >= 0 else "an unidentified peer", exc)
        finally:
            conn.close()

    def _receive_from(self, conn: socket.socket, j: int) -> None:
        """Data centre ``j``'s messages, each checked before it changes anything."""
        announced = 0  # the clock whose SPARSE update was announced and not yet received
        last = 0  # the last clock j finished
        while True:
            h = recv_header(conn)
            limit = 8 * self.max_entries if h.type == MessageType.SPARSE else (
                CONTROL_PAYLOAD_BYTES)
            payload = recv_payload(conn, h, limit=limit)
            if h.type == MessageType.CLOCK and h.flags:
                if h.step != last + 1 or announced:
                    raise GaiaError(f"announce of clock {h.step} after clock {last}"
                                    + (f" with clock {announced}'s update outstanding"
                                       if announced else ""))
                announced = h.step
                with self._cond:
                    self.barrier.announce(j, h.step)
                    self._cond.notify_all()
            elif h.type == MessageType.CLOCK:
                if h.step != last + 1 or announced:
                    raise GaiaError(f"clock {h.step} after clock {last}"
                                    + (f" before clock {announced}'s announced update"
                                       if announced else ""))
                last = h.step
                with self._cond:
                    self.clock.observe(j, h.step)
                    self._cond.notify_all()
            elif h.type == MessageType.SPARSE:
                if h.step != announced or not announced:
                    raise GaiaError(f"an update for clock {h.step}, which was not announced")
                idx, vals = decode_sparse(payload)
                if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.max_entries):
                    raise GaiaError(f"an update indexing outside the model's "
                                    f"{self.max_entries} parameters")
                announced = 0
                with self._cond:
                    self._inbox.append((j, h.step, idx, vals))
                    self._cond.notify_all()
            elif h.type == MessageType.BYE:
                with self._cond:
                    self.clock.observe(j, _DONE)
                    self._cond.notify_all()
                return
            else:
                raise GaiaError(f"unexpected {h.type.name}")

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
                mine = self.clock.clocks[self.dc]
                # Updates up to this data centre's own clock, in arrival order; a faster one's
                # later clocks wait for ours (never an update from this one's future: with
                # staleness 0 that is exactly synchronous training).
                later = []
                for item in self._inbox:
                    j, clock, idx, vals = item
                    if clock > mine:
                        later.append(item)
                        continue
                    apply(idx, vals)
                    self.barrier.applied(j, clock)
                    self.updates_received += 1
                    self.entries_received += idx.size
                self._inbox = later
                caught_up = (min(self.clock.clocks) >= mine
                             if everyone else self.clock.may_start())
                if self.barrier.may_proceed(up_to=mine) and caught_up:
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
                "clocks": list(self.clock.clocks), "refused_links": self.refused_links,
                "protocol_errors": self.protocol_errors}

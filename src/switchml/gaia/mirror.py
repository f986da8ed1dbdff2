"""The links between data centres: each data centre's leader talks to every other leader.

Theory of operation. Each leader listens on one TCP port and connects out to every other
leader; it sends on its outgoing connections (through one sender thread each, so training never
waits for the WAN) and receives on the accepted ones (one receiver thread each). Per finished
clock ``c`` a leader sends, to every other data centre: when it has significant updates, the
selective barrier ``CLOCK(c, announce)`` (how many entries, and a bitmap of the tensors they
touch); then ``CLOCK(c)``; then the entries, as ``SPARSE(c)`` pieces of at most
``piece_entries``. Control messages go before the next piece of any update, so a barrier and
a clock never wait behind bulky data (on a 50 Mbit/s WAN a piece of 32k entries is 42 ms).
Receivers record the announce in the :class:`SelectiveBarrier`, move the :class:`MirrorClock`,
and queue the pieces. :meth:`Mirror.exchange` applies the queued pieces of clocks up to its
own (a faster data centre's later ones wait) and returns once the mirror clock allows the next
clock; :meth:`Mirror.wait_tensors` is the barrier's reader side: it waits, with a bound, until
no announced update will still change the given tensors. Either raises :class:`GaiaError`
naming the data centres it waited for after ``timeout_s``, or at once when a data centre's
connection dropped without a goodbye.

Security. With ``security`` (``links.py``) every link is mutual TLS: a stranger cannot connect,
read or alter anything. Beyond loopback a mirror refuses to listen without it. Every message is
checked before it touches any state: a HELLO names another data centre that is not connected
yet; clocks come one at a time in order; an announce is for the next clock, names tensors of the
model and at most its entries; a SPARSE piece belongs to the oldest announced update with
entries to come, holds at most those, and indexes inside the tensors announced; a goodbye
leaves nothing announced outstanding. A link that breaks a rule is closed, logged and counted
(``stats()``), and fails the exchange naming its data centre; a connection that never said a
valid HELLO changes nothing.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from typing import Any

import numpy as np

from switchml.gaia.rules import (
    MirrorClock,
    SelectiveBarrier,
    decode_announce,
    decode_sparse,
    encode_announce,
    encode_sparse,
    layout_offsets,
    tensor_of,
)
from switchml.links import (
    LinkSecurity,
    WarningBudget,
    check_exposure,
    dial,
    identity_conflict,
    shutdown_descriptor,
)
from switchml.protocol.address import Address, format_address
from switchml.protocol.errors import SwitchMLError
from switchml.ps.wire import (
    CONTROL_PAYLOAD_BYTES,
    Deadline,
    MessageType,
    PSError,
    recv_header,
    recv_payload,
    send_message,
)

__all__ = ["GaiaError", "Mirror"]

log = logging.getLogger(__name__)
_DONE = 1 << 30  # a data centre that said goodbye holds nobody back


HELLO_TIMEOUT_S = 5.0
"""How long a link may take to finish its TLS handshake and say HELLO."""

class GaiaError(SwitchMLError):
    """A data centre died, timed out or broke the protocol; the message names it."""


class Mirror:
    """Data centre ``dc``'s links to the leaders at ``leaders`` (one address per data centre,
    its own included: it listens there)."""

    def __init__(self, *, dc: int, leaders: Sequence[Address], staleness: int = 2,
                 timeout_s: float = 120.0, bind_host: str = "127.0.0.1",
                 security: LinkSecurity | None = None, insecure: bool = False,
                 piece_entries: int = 1 << 15) -> None:
        """``security``: mutual TLS on every link, needed to listen beyond loopback (that is,
        for data centres on other hosts) unless ``insecure``. ``piece_entries``: the most
        entries an update's piece holds (control messages overtake an update between pieces).

        Raises:
            ConfigError: a non-loopback ``bind_host`` without ``security`` or ``insecure``.
        """
        check_exposure(bind_host, security, insecure=insecure, what=f"Gaia leader {dc}")
        self.dc = dc
        self.security = security
        self._server_tls = security.server_context() if security is not None else None
        self._client_tls = security.client_context() if security is not None else None
        if piece_entries < 1:
            raise ValueError(f"piece_entries must be >= 1, got {piece_entries}")
        self.piece_entries = piece_entries
        self._offsets = np.array([0, 1 << 28], np.int64)
        """Where each tensor of the model starts in the flat vector, and its end
        (``expect_layout``)."""
        self._layout = threading.Event()
        self.counters: dict[str, float] = {
            "bytes_sent": 0, "updates_received": 0, "entries_received": 0, "wait_s": 0.0,
            "barrier_waits": 0,  # readers that waited for an announced update (wait_tensors)
            "barrier_timeouts": 0,  # readers that went on without it after the bound
            "refused_connections": 0, "protocol_errors": 0,
            "pending_evicted": 0,  # links closed before their HELLO to make room
            "hello_timeouts": 0,  # links closed with no whole HELLO in HELLO_TIMEOUT_S
        }
        """What this leader counted, named as the parameter server's ``counters`` are
        (:meth:`stats` returns them)."""
        self._linked: set[int] = set()  # data centres whose incoming link said HELLO
        self._listening = False
        self._warn = WarningBudget(log)
        self._receivers: list[threading.Thread] = []
        self._max_links = 2 * len(leaders) + 4  # links served at once, from their HELLO
        # Links before their HELLO (or in their TLS handshake), oldest first: their threads
        # and descriptors, limited apart (when all are taken, a new one closes the oldest),
        # each with HELLO_TIMEOUT_S to say HELLO: strangers delay a leader, never keep it out.
        self._pending: dict[threading.Thread, int] = {}
        self.leaders = [tuple(a) for a in leaders]
        self.timeout_s = timeout_s
        self.clock = MirrorClock(len(leaders), dc, staleness=staleness)
        self.barrier = SelectiveBarrier()
        self._cond = threading.Condition()
        self._inbox: list[tuple[int, int, np.ndarray, np.ndarray]] = []
        self._errors: dict[int, str] = {}
        self._out: dict[int, socket.socket] = {}
        self._queues: dict[int, _Outbox] = {}
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
            sock = dial(addr, what=self._name(j), connect_timeout_s=self.timeout_s,
                        io_timeout_s=self.timeout_s, retry_s=0.2, security=self.security,
                        ctx=self._client_tls, role="dc", index=j, claims=f"data centre {j}",
                        error=GaiaError)
            send_message(sock, MessageType.HELLO, worker=self.dc)
            self._out[j] = sock
            self._queues[j] = _Outbox()
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
            t = threading.Thread(target=self._receiver, args=(conn,), daemon=True)
            with self._cond:
                self._receivers = [r for r in self._receivers if r.is_alive()]
                full = len(self._receivers) - len(self._pending) >= self._max_links
                if full:
                    self.counters["refused_connections"] += 1
                else:
                    if len(self._pending) >= self._max_links:  # strangers: the oldest goes
                        shutdown_descriptor(self._pending.pop(next(iter(self._pending))))
                        self.counters["pending_evicted"] += 1
                    self._pending[t] = conn.fileno()
                    self._receivers.append(t)
                    t.start()
            if full:
                self._warn.warn("Gaia leader %d refused a connection: %d links open",
                                self.dc, self._max_links)
                conn.close()

    # -- sending ----------------------------------------------------------------------------

    def _sender(self, j: int) -> None:
        sock, box = self._out[j], self._queues[j]
        try:
            while True:
                item = box.take()
                if item is None:
                    send_message(sock, MessageType.BYE, worker=self.dc)
                    return
                mtype, flags, clock, payload = item
                self.counters["bytes_sent"] += send_message(sock, mtype, worker=self.dc, step=clock,
                                                flags=flags, payload=payload)
        except OSError as exc:
            with self._cond:
                self._errors[j] = f"sending to {self._name(j)} failed: {exc}"
                self._cond.notify_all()

    def publish(self, clock: int, idx: np.ndarray, vals: np.ndarray) -> None:
        """Send this data centre's significant updates of ``clock`` and the clock itself to
        every other data centre (in the background): the selective barrier and the clock
        at once, ahead of any update still being sent; the entries in pieces."""
        control: list[tuple[MessageType, int, int, bytes]] = []
        data: list[tuple[MessageType, int, int, bytes]] = []
        if idx.size:
            tensors = np.unique(tensor_of(self._offsets, idx))
            control.append((MessageType.CLOCK, 1, clock,
                            encode_announce(idx.size, tensors, self.tensors)))
            step = self.piece_entries
            data += [(MessageType.SPARSE, 0, clock,
                      encode_sparse(idx[i:i + step], vals[i:i + step]))
                     for i in range(0, idx.size, step)]
        control.append((MessageType.CLOCK, 0, clock, b""))
        for box in self._queues.values():
            box.put(control, data)

    # -- receiving --------------------------------------------------------------------------

    def expect_layout(self, sizes: Sequence[int]) -> None:
        """The model's tensors have ``sizes`` elements (in parameter order): updates index the
        flat vector of all of them, and announces name tensors by their place here."""
        if not sizes or min(sizes) < 1:
            raise ValueError(f"a model of one or more non-empty tensors, got sizes {sizes}")
        self._offsets = layout_offsets(sizes)
        self._layout.set()

    def expect_entries(self, size: int) -> None:
        """The model has ``size`` parameters, as one tensor (:meth:`expect_layout`)."""
        self.expect_layout([size])

    @property
    def max_entries(self) -> int:
        """The model's parameters: the most entries an update may hold."""
        return int(self._offsets[-1])

    @property
    def tensors(self) -> int:
        return len(self._offsets) - 1

    def _receiver(self, conn: socket.socket) -> None:
        j = -1
        try:
            conn.settimeout(HELLO_TIMEOUT_S)
            if self.security is not None and self._server_tls is not None:
                try:
                    conn = self.security.accept(conn, self._server_tls, HELLO_TIMEOUT_S)
                except (OSError, ValueError) as exc:
                    with self._cond:
                        self.counters["refused_connections"] += 1
                    self._warn.warn("Gaia leader %d refused a connection: TLS handshake "
                                    "failed: %s", self.dc, exc)
                    return
            # the whole HELLO within HELLO_TIMEOUT_S: dribbled bytes do not stretch it
            hello = Deadline(conn, time.monotonic() + HELLO_TIMEOUT_S)
            h = recv_header(hello)
            recv_payload(hello, h, limit=CONTROL_PAYLOAD_BYTES)
            conn.settimeout(None)
            with self._cond:
                self._pending.pop(threading.current_thread(), None)
            if h.type != MessageType.HELLO or not 0 <= h.worker < len(self.leaders):
                raise GaiaError(f"{h.type.name} (worker field {h.worker}) instead of a HELLO")
            wrong = identity_conflict(conn, "dc", h.worker)
            if wrong is not None:
                raise GaiaError(f"a HELLO as data centre {h.worker}, but {wrong}")
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
                self.counters["protocol_errors"] += isinstance(exc, GaiaError | PSError
                                                               | ValueError)
                self.counters["hello_timeouts"] += j < 0 and isinstance(exc, TimeoutError)
                if j >= 0:
                    self._errors[j] = f"{self._name(j)}: {exc}"
                    self._cond.notify_all()
            self._warn.warn("Gaia leader %d: link from %s: %s", self.dc,
                            self._name(j) if j >= 0 else "an unidentified peer", exc)
        finally:
            with self._cond:
                self._pending.pop(threading.current_thread(), None)
            conn.close()

    def _receive_from(self, conn: socket.socket, j: int) -> None:
        """Data centre ``j``'s messages, each checked before it changes anything."""
        link = _Link()
        while True:
            h = recv_header(conn)
            if h.type in (MessageType.SPARSE, MessageType.CLOCK) and not self._layout.wait(
                    self.timeout_s):  # a peer may be a step ahead of this leader's set-up
                raise GaiaError("an update came, but this leader was never told the model's "
                                "layout (expect_layout)")
            if h.type == MessageType.SPARSE:
                if not link.due:
                    raise GaiaError(f"an update for clock {h.step}, which was not announced")
                limit = 8 * link.due[0][1]
            elif h.type == MessageType.CLOCK and h.flags:
                limit = 8 + (self.tensors + 7) // 8
            else:
                limit = CONTROL_PAYLOAD_BYTES
            payload = recv_payload(conn, h, limit=limit)
            if h.type == MessageType.CLOCK and h.flags:
                self._on_announce(j, link, h.step, payload)
            elif h.type == MessageType.CLOCK:
                if h.step != link.last + 1:
                    raise GaiaError(f"clock {h.step} after clock {link.last}")
                link.last = h.step
                with self._cond:
                    self.clock.observe(j, h.step)
                    self._cond.notify_all()
            elif h.type == MessageType.SPARSE:
                self._on_sparse(j, link, h.step, payload)
            elif h.type == MessageType.BYE:
                if link.due:
                    raise GaiaError(f"a goodbye with {link.due[0][1]} entries of clock "
                                    f"{link.due[0][0]}'s announced update outstanding")
                with self._cond:
                    self.clock.observe(j, _DONE)
                    self._cond.notify_all()
                return
            else:
                raise GaiaError(f"unexpected {h.type.name}")

    def _on_announce(self, j: int, link: _Link, clock: int, payload: memoryview) -> None:
        """A selective barrier: for the next clock, once, naming tensors of the model and at
        most its entries."""
        again = bool(link.due) and link.due[-1][0] == clock
        if clock != link.last + 1 or again:
            raise GaiaError(f"announce of clock {clock} after clock {link.last}"
                            + (" announced already" if again else ""))
        entries, tensors = decode_announce(payload, self.tensors)
        if entries > self.max_entries:
            raise GaiaError(f"an announce of {entries} entries for a model of "
                            f"{self.max_entries}")
        link.due.append([clock, entries])
        link.touched[clock] = tensors
        with self._cond:
            self.barrier.announce(j, clock, tensors.tolist(), entries)
            self._cond.notify_all()

    def _on_sparse(self, j: int, link: _Link, clock: int, payload: memoryview) -> None:
        """A piece of the oldest announced update with entries to come, inside the model and
        the tensors its announce named."""
        due, left = link.due[0]
        if clock != due:
            raise GaiaError(f"an update for clock {clock} while clock {due}'s announced "
                            "update is outstanding")
        idx, vals = decode_sparse(payload)
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= self.max_entries):
            raise GaiaError(f"an update indexing outside the model's {self.max_entries} "
                            "parameters")
        if not np.isin(tensor_of(self._offsets, idx), link.touched[due]).all():
            raise GaiaError(f"an update of clock {due} touching a tensor its announce did "
                            "not name")
        link.due[0][1] = left - idx.size
        if link.due[0][1] == 0:
            link.due.popleft()
            del link.touched[due]
        with self._cond:
            self._inbox.append((j, clock, idx, vals))
            self._cond.notify_all()

    def _apply_due(self, apply: Callable[[np.ndarray, np.ndarray], None]) -> None:
        """Apply the queued pieces of clocks up to this data centre's own, in arrival order;
        a faster one's later clocks wait for ours (never an update from this one's future:
        with staleness 0 that is exactly synchronous training). Under ``_cond``."""
        mine = self.clock.clocks[self.dc]
        later = []
        for item in self._inbox:
            j, clock, idx, vals = item
            if clock > mine:
                later.append(item)
                continue
            apply(idx, vals)
            self.barrier.applied(j, clock, idx.size)
            self.counters["entries_received"] += idx.size
            self.counters["updates_received"] += (j, clock) not in self.barrier.pending
        self._inbox = later

    def _wait(self, done: Callable[[], bool], apply: Callable[[np.ndarray, np.ndarray], None],
              deadline: float) -> bool:
        """Apply what comes until ``done()``; False at ``deadline``. Raises GaiaError at once
        when a data centre's link failed. Under ``_cond``."""
        while True:
            self._apply_due(apply)
            if done():
                return True
            bad = [j for j in self._errors if self.clock.clocks[j] < _DONE]
            if bad:
                raise GaiaError(self._errors[bad[0]])
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            self._cond.wait(min(left, 0.5))

    def exchange(self, apply: Callable[[np.ndarray, np.ndarray], None], *,
                 everyone: bool = False) -> None:
        """Apply every received piece of an update (``apply(idx, vals)``, in arrival order)
        and return once the mirror clock allows the next clock (``everyone``: once every data
        centre reached this one's clock and every update announced up to it is applied, as at
        the end of training). Updates still on their way are the selective barrier's: their
        tensors' readers wait in :meth:`wait_tensors`.

        Raises:
            GaiaError: a data centre's link failed, or the wait passed ``timeout_s`` (names
                the data centres waited for).
        """
        t0 = time.monotonic()
        mine = self.clock.clocks[self.dc]

        def done() -> bool:
            if everyone:
                return (min(self.clock.clocks) >= mine
                        and self.barrier.may_proceed(up_to=mine))
            return self.clock.may_start()

        with self._cond:
            if not self._wait(done, apply, t0 + self.timeout_s):
                behind = ([j for j, c in enumerate(self.clock.clocks) if c < mine]
                          if everyone else self.clock.waiting_for())
                who = sorted({j for j, _ in self.barrier.pending} | set(behind))
                raise GaiaError(f"data centre {self.dc} waited {self.timeout_s:g} s for "
                                + ", ".join(self._name(j) for j in who))
        self.counters["wait_s"] += time.monotonic() - t0

    def wait_tensors(self, tensors: Iterable[int], apply: Callable[[np.ndarray, np.ndarray],
                     None], *, timeout_s: float) -> set[int]:
        """The selective barrier's reader: apply what comes (as :meth:`exchange`) until no
        update announced for a clock up to this data centre's own will still change one of
        ``tensors``, or ``timeout_s`` passed; returns the tensors still waited for (read
        stale: their update is applied when it comes, at a later call).

        Raises:
            GaiaError: a data centre's link failed.
        """
        want = set(tensors)
        t0 = time.monotonic()
        with self._cond:
            mine = self.clock.clocks[self.dc]
            if not self.barrier.blocked(want, up_to=mine) and not self._inbox:
                return set()
            self.counters["barrier_waits"] += 1
            self._wait(lambda: not self.barrier.blocked(want, up_to=mine), apply,
                       t0 + timeout_s)
            still = self.barrier.blocked(want, up_to=mine)
            self.counters["barrier_timeouts"] += bool(still)
        self.counters["wait_s"] += time.monotonic() - t0
        return still

    def close(self) -> None:
        """Say goodbye to every data centre (after the queued updates are sent) and stop."""
        for box in self._queues.values():
            box.put([], [None])
        for t in self._senders:
            t.join(self.timeout_s)
        for sock in self._out.values():
            sock.close()
        try:
            self._lsock.close()
        except OSError:
            pass

    def stats(self) -> dict[str, Any]:
        return {**self.counters, "clocks": list(self.clock.clocks)}


class _Link:
    """What a receiver knows of one data centre's stream: the last clock it finished, its
    announced updates with entries still to come (``[clock, entries]``, oldest first), and the
    tensors each announced."""

    def __init__(self) -> None:
        self.last = 0
        self.due: deque[list[int]] = deque()
        self.touched: dict[int, np.ndarray] = {}


class _Outbox:
    """One link's messages to send: control messages (barriers, clocks) go before the next
    piece of data, whatever was queued first."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._control: deque[Any] = deque()
        self._data: deque[Any] = deque()

    def put(self, control: list[Any], data: list[Any]) -> None:
        with self._cond:
            self._control.extend(control)
            self._data.extend(data)
            self._cond.notify()

    def take(self) -> Any:
        """The next message (None: say goodbye), waiting for one."""
        with self._cond:
            while not self._control and not self._data:
                self._cond.wait()
            return self._control.popleft() if self._control else self._data.popleft()

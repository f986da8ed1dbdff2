"""The one discrete-event engine under the in-memory fabric and the simulator's exact mode.

:class:`EventEngine` drives sans-I/O endpoints attached at addresses on a virtual clock. It
owns everything the two drivers have in common: ``attach``/``detach``, ``flush`` (drain what
an endpoint sends and the events it reports, re-arm its timer), ``step`` (the next delivery,
callback or timer), ``run`` and ``call_at``. What differs between them is only what a datagram
meets on its way, the **link model**: a subclass overrides :meth:`EventEngine._transmit`,
which takes one datagram as it leaves its sender and returns when it arrives, or None if it is
lost (a link model that duplicates schedules the extra copy with
:meth:`EventEngine._deliver_at`).

* :class:`~switchml.transport.memory.MemoryFabric`: seeded faults (loss, duplication,
  latency, jitter, reordering) from one ``random.Random``.
* :class:`~switchml.sim.exact.ExactNetwork`: a FIFO link per direction and pair (rate,
  propagation delay, tail drop, loss, failure time).

The pattern is SimPy's: one engine, variants override one hook, as its
``RealtimeEnvironment`` overrides only ``step()``. A base class rather than an engine object
that each driver holds: callers use the driver as the engine (``fabric.run``, ``net.step``,
``net.endpoints``, ``net.now``), and a link model reads the engine's clock, seeds and
``stats``; a subclass keeps that one object and the one hook.

One heap holds every scheduled entry as ``(time, sequence, src, dst, payload)``, always in
that order (sender before receiver); the sequence number keeps entries of equal time in the
order they were scheduled. Three kinds:

* a datagram: ``src`` and ``dst`` addresses, ``payload`` bytes;
* a wake-up: ``src`` None, ``dst`` a host whose CPU is free again; ``payload`` None;
* a callback (``call_at``): ``src`` and ``dst`` None, ``payload`` the callable.

Hosts: each endpoint may cost ``cost_s`` of CPU per datagram received or sent (``attach``;
default 0, a free host). What it sends leaves after that work; what reaches it while its CPU
is busy waits in its inbox (a socket buffer) and is taken in one batch when the CPU is free.
Datagrams that reach one idle endpoint at the same instant are handed over in one batch call
(``receive_many``, as ``recvmmsg`` would) unless ``batch`` is False.

Timers: :class:`EndpointTimers`, a second heap with lazy invalidation; each endpoint's
``get_timer()`` is re-read after it handled something. Cost per event: O(log events),
independent of the number of endpoints. The engine itself never reads a clock or draws a
random number: the protocol core it drives stays sans-I/O, and a run is replayable.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable, Iterable
from typing import Any

from switchml.protocol.address import Address
from switchml.protocol.endpoint import Endpoint, deliver_datagrams
from switchml.protocol.errors import SwitchMLError
from switchml.protocol.events import Event

__all__ = ["MAX_BATCH", "EndpointTimers", "EventEngine"]

MAX_BATCH = 64
"""Datagrams one batch delivery takes at most (a ``recvmmsg`` of 64)."""


class EndpointTimers:
    """The endpoints' deadlines for a discrete-event driver: a heap of (deadline, counter,
    addr) with lazy invalidation. ``armed`` holds each endpoint's deadline as last read from
    ``get_timer()``; a heap entry whose time differs from it is stale and skipped when popped.
    The driver re-reads an endpoint's deadline after everything it handles (``rearm``), so
    finding the next timer costs O(log n) instead of a scan of every endpoint per event
    (456 s for n = 256 with a scan)."""

    def __init__(self) -> None:
        self._heap: list[tuple[float, int, Address]] = []
        self._counter = 0
        self.armed: dict[Address, float | None] = {}

    def forget(self, addr: Address) -> None:
        """An endpoint attached anew or detached: its old deadline no longer counts."""
        self.armed.pop(addr, None)

    def rearm(self, addr: Address, ep: Endpoint) -> None:
        """Re-read ``ep``'s deadline; push a heap entry if it changed."""
        t = ep.get_timer()
        if self.armed.get(addr, -1.0) != t:
            self.armed[addr] = t
            if t is not None:
                self._counter += 1
                heapq.heappush(self._heap, (t, self._counter, addr))

    def consume(self, addr: Address) -> None:
        """The endpoint's timer fired: the next ``rearm`` reads its new deadline."""
        self.armed[addr] = None

    def next(self, endpoints: dict[Address, Any]) -> tuple[float, Address] | None:
        """The earliest live timer of an endpoint in ``endpoints`` (stale entries dropped)."""
        heap = self._heap
        while heap:
            t, _, addr = heap[0]
            if addr in endpoints and self.armed.get(addr) == t:
                return t, addr
            heapq.heappop(heap)
        return None


class EventEngine:
    """Endpoints at addresses on a virtual clock (see the module docstring); a subclass
    supplies the link model by overriding :meth:`_transmit`.

    ``stats`` counts ``sent`` (datagrams endpoints sent) and ``delivered`` (datagrams handed
    to a live endpoint), plus the subclass's own ``counters``. ``events[addr]`` collects what
    the endpoint at ``addr`` reported; ``event_count`` counts them all (a cheap "anything
    new?" test)."""

    batch = True
    """Hand datagrams that reach one endpoint at the same instant, or wait for its CPU, to it
    in one call; False: one call each."""

    _kind = "engine"
    """What the errors of ``run`` call it ("fabric", "network")."""
    _counts_batches = False
    """Also count receive calls in ``stats["batches"]`` (a subclass that sets this names
    ``batches`` in its counters)."""

    def __init__(self, counters: Iterable[str] = ()) -> None:
        self.now = 0.0
        self.endpoints: dict[Address, Endpoint] = {}
        self.events: dict[Address, list[Event]] = {}
        self.event_count = 0
        self.stats = dict.fromkeys(("sent", "delivered", *counters), 0)
        self.cost: dict[Address, float] = {}
        self.cpu_free: dict[Address, float] = {}
        """When each host's CPU is free (its last datagram sent)."""
        self._heap: list[tuple[float, int, Any, Any, Any]] = []
        self._seq = 0
        self._timers = EndpointTimers()  # re-read after everything an endpoint handles
        self._inbox: dict[Address, list[tuple[Address, bytes]]] = {}
        """Datagrams waiting for a busy host's CPU; only non-empty lists."""
        self._any_cost = False  # some host has a CPU cost: check for busy hosts

    # -- building -----------------------------------------------------------------------------

    def attach(self, addr: Address, endpoint: Endpoint, *, cost_s: float = 0.0) -> None:
        """Put ``endpoint`` at ``addr``; its CPU spends ``cost_s`` per datagram in or out."""
        self.endpoints[addr] = endpoint
        self.events.setdefault(addr, [])
        self.cost[addr] = cost_s
        self._any_cost = self._any_cost or cost_s > 0
        self.cpu_free.setdefault(addr, 0.0)
        self._timers.forget(addr)
        self._timers.rearm(addr, endpoint)

    def detach(self, addr: Address) -> None:
        """Remove an endpoint (a crash): datagrams to it, and those waiting for its CPU,
        vanish from now on."""
        self.endpoints.pop(addr, None)
        self._inbox.pop(addr, None)
        self._timers.forget(addr)

    def call_at(self, t: float, fn: Callable[[], None]) -> None:
        """Run ``fn()`` at virtual time ``t`` (e.g. a straggler starting late)."""
        self._seq += 1
        heapq.heappush(self._heap, (t, self._seq, None, None, fn))

    # -- the link model -----------------------------------------------------------------------

    def _transmit(self, src: Address, dst: Address, payload: bytes, t: float) -> float | None:
        """The link model: ``payload`` leaves ``src`` for ``dst`` at ``t``; return when it
        reaches ``dst``, or None if it is lost. Further copies (duplicates) are scheduled with
        :meth:`_deliver_at`."""
        raise NotImplementedError

    def _deliver_at(self, at: float, src: Address, dst: Address, payload: bytes) -> None:
        """``payload`` from ``src`` reaches ``dst`` at ``at``."""
        self._seq += 1
        heapq.heappush(self._heap, (at, self._seq, src, dst, payload))

    # -- driving ------------------------------------------------------------------------------

    def flush(self, addr: Address, received: int = 0) -> None:
        """Send what ``addr`` has to send (after its CPU took ``received`` datagrams), collect
        its events and re-read its timer. Call it after a user command (join, start ...)."""
        ep = self.endpoints.get(addr)
        if ep is None:
            return
        out = ep.datagrams_to_send(self.now)
        cost = self.cost[addr]
        depart = self.now
        if cost:
            # The CPU takes the received datagrams, then builds and sends one datagram after
            # the other: the j-th output leaves after (received + j + 1) x cost.
            depart = max(self.now, self.cpu_free[addr]) + cost * received
            self.cpu_free[addr] = depart + cost * len(out)
        last: object = None
        payload = b""
        stats = self.stats
        transmit = self._transmit
        heap = self._heap
        for data, dst in out:
            if data is not last:  # a multicast repeats one buffer: copy it once
                # the switch's buffers are only valid until its next receive
                payload = bytes(data)
                last = data
            stats["sent"] += 1
            depart += cost
            at = transmit(addr, dst, payload, depart)
            if at is not None:  # _deliver_at, inlined: this loop runs per datagram
                self._seq += 1
                heapq.heappush(heap, (at, self._seq, addr, dst, payload))
        events = self.events[addr]
        while (ev := ep.next_event()) is not None:
            events.append(ev)
            self.event_count += 1
        self._timers.rearm(addr, ep)

    def step(self) -> bool:
        """Process the next delivery (batch), callback or timer. False when nothing is left."""
        timer = self._timers.next(self.endpoints)
        heap = self._heap
        if timer is None and not heap:
            # Idle: re-read every endpoint once, in case one was driven directly without a
            # ``flush`` afterwards (its deadline would otherwise be missed).
            for addr, ep in self.endpoints.items():
                self._timers.rearm(addr, ep)
            timer = self._timers.next(self.endpoints)
        if heap and (timer is None or heap[0][0] <= timer[0]):
            self._pop(heap)
            return True
        if timer is not None:
            t, addr = timer
            self.now = max(self.now, t, self.cpu_free[addr])
            self._timers.consume(addr)  # flush re-reads the next deadline
            self.endpoints[addr].handle_timer(self.now)
            self.flush(addr)
            return True
        return False

    def _pop(self, heap: list[tuple[float, int, Any, Any, Any]]) -> None:
        """Take the earliest entry of ``heap`` (the engine's) and act on it."""
        at, _, src, dst, payload = heapq.heappop(heap)
        if at > self.now:
            self.now = at
        if dst is None:  # a callback
            payload()
            return
        ep = self.endpoints.get(dst)
        if ep is None:
            return
        limit = MAX_BATCH if self.batch else 1
        woken = src is None
        if woken:  # a wake-up: the host's CPU is free, it takes what queued meanwhile
            inbox = self._inbox.pop(dst, None)
            if not inbox:
                return
            batch = inbox[:limit]
            if len(inbox) > limit:
                self._inbox[dst] = inbox[limit:]
        elif self._any_cost and (self.cpu_free[dst] > at or dst in self._inbox):
            # The host is still working: the datagram waits in its socket buffer and the
            # host takes everything waiting in one batch when it is done.
            inbox = self._inbox.setdefault(dst, [])
            if not inbox:
                self._wake(dst)
            inbox.append((src, payload))
            return
        elif limit == 1 or not heap or heap[0][0] != at or heap[0][3] != dst:
            batch = None  # the common case: one datagram
        else:
            # Datagrams due at the same instant for the same endpoint, next in the heap: one
            # batch call, as a host's recvmmsg would take them (same order).
            batch = [(src, payload)]
            while (heap and heap[0][0] == at and heap[0][3] == dst
                   and heap[0][2] is not None and len(batch) < limit):
                _, _, src, _, payload = heapq.heappop(heap)
                batch.append((src, payload))
        n = 1 if batch is None else len(batch)
        stats = self.stats
        stats["delivered"] += n
        if self._counts_batches:
            stats["batches"] += 1
        if batch is None:
            ep.receive_datagram(payload, src, self.now)
        else:
            deliver_datagrams(ep, batch, self.now)
        self.flush(dst, n)
        if woken and dst in self._inbox:
            self._wake(dst)

    def _wake(self, dst: Address) -> None:
        """Schedule ``dst`` to take its waiting datagrams when its CPU is free."""
        self._seq += 1
        heapq.heappush(self._heap, (self.cpu_free[dst], self._seq, None, dst, None))

    def run(self, until: Callable[[], bool], *, max_time_s: float = 3600.0,
            max_steps: int = 10**8) -> None:
        """Step until ``until()`` is true. Raises SwitchMLError if nothing is left to do first
        or the virtual clock passes ``max_time_s`` (a hang in virtual time is a bug)."""
        steps = 0
        while not until():
            if not self.step():
                raise SwitchMLError(f"{self._kind} idle at t={self.now:.6f} s before the "
                                    "condition held")
            steps += 1
            if self.now > max_time_s or steps > max_steps:
                raise SwitchMLError(f"condition not reached by t={self.now:.3f} s, {steps} "
                                    "steps")

"""In-memory fabric: drives switch and worker endpoints on a virtual clock, with seeded faults.

The fabric is a tiny discrete-event loop: datagrams become deliveries at ``now + latency`` (plus
jitter), each one may be lost, duplicated or held back (reordered) with the given probabilities,
drawn from one ``random.Random(seed)``; endpoint timers fire when the clock reaches them. The
same seed gives the same run, so a failure found with loss can be replayed exactly.

``MemoryCluster`` wires one switch and n workers of one job on a fabric: the tests' and the
docs' way to run the real protocol code with no sockets.
"""

from __future__ import annotations

import heapq
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.endpoint import Endpoint, deliver_datagrams
from switchml.protocol.errors import SwitchMLError
from switchml.protocol.events import Event
from switchml.protocol.session import WorkerSession
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.handles import AllreduceHandle

__all__ = ["EndpointTimers", "FaultModel", "MemoryCluster", "MemoryFabric"]



@dataclass(frozen=True, slots=True)
class FaultModel:
    """Per-datagram fault probabilities (0..1) and delays (seconds)."""

    loss_rate: float = 0.0
    duplicate_rate: float = 0.0
    reorder_rate: float = 0.0
    """Probability that a datagram is held back by up to ``reorder_delay_s`` extra."""
    latency_s: float = 50e-6
    jitter_s: float = 0.0
    reorder_delay_s: float = 2e-3

    def __post_init__(self) -> None:
        for name in ("loss_rate", "duplicate_rate", "reorder_rate"):
            value = getattr(self, name)
            if not 0.0 <= value <= 1.0:
                raise ValueError(f"{name} must be in 0..1, got {value}")
        if self.latency_s < 0 or self.jitter_s < 0 or self.reorder_delay_s < 0:
            raise ValueError("latency_s, jitter_s and reorder_delay_s must be >= 0")


class EndpointTimers:
    """The endpoints' deadlines for a discrete-event driver: a heap of (deadline, counter,
    addr) with lazy invalidation. ``armed`` holds each endpoint's deadline as last read from
    ``get_timer()``; a heap entry whose time differs from it is stale and skipped when popped.
    The driver re-reads an endpoint's deadline after everything it handles (``rearm``), so
    finding the next timer costs O(log n) instead of a scan of every endpoint per event
    (456 s for n = 256 with a scan). The memory fabric and the simulator share it."""

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


@dataclass
class MemoryFabric:
    """Moves datagrams between endpoints attached at addresses; a seeded virtual network."""

    faults: FaultModel = field(default_factory=FaultModel)
    seed: int = 0
    drop_filter: Callable[[bytes, Address, Address], bool] | None = None
    """Scripted drops for tests: return True to drop the datagram (src, dst given)."""
    batch: bool = True
    """Hand datagrams that reach one endpoint at the same instant to it in one batch call
    (``receive_many``, as ``recvmmsg`` would), in their order; False: one call each. Same
    rules either way; the batch calls cost about a tenth per datagram."""

    def __post_init__(self) -> None:
        self.rng = random.Random(self.seed)
        self.now = 0.0
        self.endpoints: dict[Address, Endpoint] = {}
        self.events: dict[Address, list[Event]] = {}
        self.stats = {"sent": 0, "lost": 0, "duplicated": 0, "reordered": 0, "delivered": 0}
        self._heap: list[tuple[float, int, Address, Address, bytes]] = []
        self._counter = 0
        self._timers = EndpointTimers()  # re-read after everything an endpoint handles
        self.event_count = 0
        """Events collected so far, all endpoints together (a cheap "anything new?" test)."""

    def attach(self, addr: Address, endpoint: Endpoint) -> None:
        self.endpoints[addr] = endpoint
        self.events.setdefault(addr, [])
        self._timers.forget(addr)
        self._timers.rearm(addr, endpoint)

    def detach(self, addr: Address) -> None:
        """Remove an endpoint (a crash): datagrams to it vanish from now on."""
        self.endpoints.pop(addr, None)
        self._timers.forget(addr)

    def flush(self, addr: Address) -> None:
        """Collect an endpoint's outputs and events after a user command (join, start ...)."""
        ep = self.endpoints.get(addr)
        if ep is None:
            return
        f = self.faults
        last_data: object = None
        payload = b""
        for data, dst in ep.datagrams_to_send(self.now):
            if data is not last_data:  # a multicast repeats one buffer: copy it once
                # the switch's buffers are only valid until its next receive
                payload = bytes(data)
                last_data = data
            self.stats["sent"] += 1
            if self.drop_filter is not None and self.drop_filter(payload, addr, dst):
                self.stats["lost"] += 1
                continue
            if f.loss_rate and self.rng.random() < f.loss_rate:
                self.stats["lost"] += 1
                continue
            copies = 1
            if f.duplicate_rate and self.rng.random() < f.duplicate_rate:
                copies = 2
                self.stats["duplicated"] += 1
            for _ in range(copies):
                delay = f.latency_s
                if f.jitter_s:
                    delay += self.rng.random() * f.jitter_s
                if f.reorder_rate and self.rng.random() < f.reorder_rate:
                    delay += self.rng.random() * f.reorder_delay_s
                    self.stats["reordered"] += 1
                self._counter += 1
                heapq.heappush(self._heap, (self.now + delay, self._counter, addr, dst, payload))
        while (ev := ep.next_event()) is not None:
            self.events[addr].append(ev)
            self.event_count += 1
        self._timers.rearm(addr, ep)

    def step(self) -> bool:
        """Advance to the next delivery or timer and process it. False when nothing is left."""
        next_timer = self._timers.next(self.endpoints)
        if next_timer is None and not self._heap:
            # Idle: re-read every endpoint once, in case one was driven directly without a
            # ``flush`` afterwards (its deadline would otherwise be missed).
            for addr, ep in self.endpoints.items():
                self._timers.rearm(addr, ep)
            next_timer = self._timers.next(self.endpoints)
        heap = self._heap
        if heap and (next_timer is None or heap[0][0] <= next_timer[0]):
            at, _, src, dst, payload = heapq.heappop(heap)
            self.now = max(self.now, at)
            ep = self.endpoints.get(dst)
            if ep is None:
                return True
            if not self.batch or not heap or heap[0][0] != at or heap[0][3] != dst:
                self.stats["delivered"] += 1
                ep.receive_datagram(payload, src, self.now)
            else:
                # Datagrams due at the same instant for the same endpoint, next in the heap:
                # one batch call, as a host's recvmmsg would take them (same order).
                batch = [(src, payload)]
                while (heap and heap[0][0] == at and heap[0][3] == dst
                       and len(batch) < _MAX_BATCH):
                    _, _, src, _, payload = heapq.heappop(heap)
                    batch.append((src, payload))
                self.stats["delivered"] += len(batch)
                deliver_datagrams(ep, batch, self.now)
            self.flush(dst)
            return True
        if next_timer is not None:
            self.now = max(self.now, next_timer[0])
            self._timers.consume(next_timer[1])  # flush re-reads the next deadline
            self.endpoints[next_timer[1]].handle_timer(self.now)
            self.flush(next_timer[1])
            return True
        return False

    def run(self, until: Callable[[], bool], *, max_time_s: float = 3600.0,
            max_steps: int = 10**8) -> None:
        """Step until ``until()`` is true. Raises SwitchMLError if the network goes idle first
        or the virtual clock passes ``max_time_s`` (a hang in virtual time is a bug)."""
        steps = 0
        while not until():
            if not self.step():
                raise SwitchMLError(f"fabric idle at t={self.now:.6f} s before the condition held")
            steps += 1
            if self.now > max_time_s or steps > max_steps:
                raise SwitchMLError(f"condition not reached by t={self.now:.3f} s, {steps} steps")


_MAX_BATCH = 64
"""Datagrams one batch delivery takes at most (a ``recvmmsg`` of 64)."""


class MemoryCluster:
    """One switch and the n workers of one job on a :class:`MemoryFabric`; each worker is
    driven through a :class:`~switchml.protocol.session.WorkerSession`, so operations queue
    and hand out the same handles as over UDP (``AllreduceHandle``; ``wait`` runs the
    fabric until done).

    Example::

        c = MemoryCluster(num_workers=4, seed=1, faults=FaultModel(loss_rate=0.01))
        outs = c.allreduce([np.ones(1000, np.float32)] * 4)   # four arrays of 4.0
        hs = c.start([np.ones(10, np.float32)] * 4)             # in place, one handle per rank
        c.wait(hs)
    """

    SWITCH = ("switch", 48864)

    def __init__(self, *, num_workers: int, window: int = 8, elements_per_packet: int = 256,
                 faults: FaultModel | None = None, seed: int = 0, job_id: int = 7,
                 token: int = 0x5EC12E7,
                 worker_config: WorkerConfig | Sequence[WorkerConfig | None] | None = None,
                 switch: SwitchDataplane | None = None, fabric: MemoryFabric | None = None,
                 shards: int = 1) -> None:
        """``worker_config``: one for every rank, or a list of one per rank. ``shards``: a
        sharded switch of that many shard endpoints at ports 48864 + i (``shard_switches``,
        ``shard_addresses``; ``switch`` is shard 0)."""
        self.spec = JobSpec(job_id=job_id, token=token, num_workers=num_workers, window=window,
                            elements_per_packet=elements_per_packet)
        self.fabric = fabric or MemoryFabric(faults or FaultModel(), seed)
        if switch is None and self.SWITCH in self.fabric.endpoints:
            switch = self.fabric.endpoints[self.SWITCH]  # type: ignore[assignment]
        if shards > 1 and switch is not None:
            raise ValueError("give either a switch or a shard count")
        self.shard_addresses = [(self.SWITCH[0], self.SWITCH[1] + i) for i in range(shards)]
        self.shard_switches = [switch or SwitchDataplane(SwitchConfig())] if shards == 1 else [
            SwitchDataplane(SwitchConfig(shard_index=i, shard_count=shards))
            for i in range(shards)]
        self.switch = self.shard_switches[0]
        for a, sw in zip(self.shard_addresses, self.shard_switches):
            self.fabric.attach(a, sw)
        switch_address = self.SWITCH if shards == 1 else self.shard_addresses
        self.addresses = [(f"worker{job_id}.{r}", 4000 + r) for r in range(num_workers)]
        configs = (list(worker_config) if isinstance(worker_config, Sequence)
                   else [worker_config] * num_workers)
        if len(configs) != num_workers:
            raise ValueError(f"worker_config: expected one config or {num_workers}, got "
                             f"{len(configs)}")
        self.workers = [
            WorkerEndpoint(spec=self.spec, rank=r, switch_address=switch_address,
                           config=configs[r])
            for r in range(num_workers)
        ]
        self.sessions = [WorkerSession(w, handle_type=AllreduceHandle) for w in self.workers]
        for addr, s in zip(self.addresses, self.sessions):
            self.fabric.attach(addr, s)
        self._joined = False

    def join(self) -> None:
        """Join every worker; raises SwitchMLError if any join fails."""
        for addr, s in zip(self.addresses, self.sessions):
            s.join(self.fabric.now)
            self.fabric.flush(addr)
        self.fabric.run(self._all(lambda s: s.joined or s.error is not None, self.sessions))
        for s in self.sessions:
            if s.error is not None:
                raise SwitchMLError(s.error)
        self._joined = True

    def restart_worker(self, rank: int, address: Address) -> WorkerEndpoint:
        """Rank ``rank`` restarts as a new process at ``address`` (the old one is detached):
        a new worker with the same spec joins. Returns its endpoint."""
        self.fabric.detach(self.addresses[rank])
        old = self.workers[rank]
        w = WorkerEndpoint(spec=self.spec, rank=rank, switch_address=old.switch_addresses
                           if len(old.switch_addresses) > 1 else old.switch_address,
                           config=old.config)
        self.addresses[rank], self.workers[rank] = address, w
        self.sessions[rank] = WorkerSession(w, handle_type=AllreduceHandle)
        self.fabric.attach(address, self.sessions[rank])
        self.sessions[rank].join(self.fabric.now)
        self.fabric.flush(address)
        return w

    def _all(self, test: Callable[[Any], bool], items: Sequence[Any]) -> Callable[[], bool]:
        """A condition for ``fabric.run``: ``test`` holds for every item. It looks again only
        when the fabric collected new events, so a step costs O(1) however many workers."""
        fabric = self.fabric
        seen = -1
        pending = list(items)

        def until() -> bool:
            nonlocal seen, pending
            if fabric.event_count == seen:
                return False
            seen = fabric.event_count
            pending = [x for x in pending if not test(x)]
            return not pending

        return until

    def start(self, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray] | None = None,
              ranks: Sequence[int] | None = None, *, bits: int = 32,
              residuals: Sequence[np.ndarray] | None = None) -> list[AllreduceHandle]:
        """Queue one all-reduce on the given ranks (default all; ``outs`` default: in
        place; ``bits`` and ``residuals`` as ``WorkerEndpoint.start_allreduce`` takes them);
        returns their handles (``wait`` on one runs the fabric until it is done)."""
        if not self._joined:
            self.join()
        ranks = list(range(len(self.workers))) if ranks is None else list(ranks)
        outs = arrays if outs is None else outs
        res = [None] * len(ranks) if residuals is None else list(residuals)
        handles = []
        for r, x, o, e in zip(ranks, arrays, outs, res):
            h = self.sessions[r].submit(x, o, now=self.fabric.now, bits=bits, residual=e)
            h.drive = self._drive
            handles.append(h)
            self.fabric.flush(self.addresses[r])
        return handles  # type: ignore[return-value]

    def _drive(self, handle: AllreduceHandle) -> None:
        self.fabric.run(handle.done)

    def wait(self, handles: Sequence[AllreduceHandle]) -> None:
        """Run until every handle is done; raise OperationFailed for the first that failed."""
        self.fabric.run(self._all(lambda h: h.done(), handles))
        for h in handles:
            h.result()

    def allreduce(self, arrays: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Sum the arrays (one per rank) out of place; return each rank's result."""
        outs = [np.empty_like(a) for a in arrays]
        self.wait(self.start(arrays, outs))
        return outs

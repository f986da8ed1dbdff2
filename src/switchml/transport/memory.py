"""In-memory fabric: drives switch and worker endpoints on a virtual clock, with seeded faults.

``MemoryFabric`` is the shared discrete-event engine (:mod:`switchml.transport.engine`, which
the simulator's ``ExactNetwork`` also runs on) with a fault model for its links: datagrams
become deliveries at ``now + latency`` (plus jitter), each one may be lost, duplicated or held
back (reordered) with the given probabilities, drawn from one ``random.Random(seed)``; endpoint
timers fire when the clock reaches them. The same seed gives the same run, so a failure found
with loss can be replayed exactly.

``MemoryCluster`` wires one switch and n workers of one job on a fabric: the tests' and the
docs' way to run the real protocol code with no sockets.
"""

from __future__ import annotations

import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.errors import SwitchMLError
from switchml.protocol.session import WorkerSession
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.engine import EndpointTimers, EventEngine
from switchml.transport.handles import AllreduceHandle, OutOfPlace

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


@dataclass
class MemoryFabric(EventEngine):
    """Moves datagrams between endpoints attached at addresses; a seeded virtual network.

    An :class:`~switchml.transport.engine.EventEngine` whose link model is ``faults``: each
    datagram may be dropped (``drop_filter``, then ``loss_rate``), duplicated, and arrives
    after ``latency_s`` plus jitter, plus a reordering delay when held back."""

    faults: FaultModel = field(default_factory=FaultModel)
    seed: int = 0
    drop_filter: Callable[[bytes, Address, Address], bool] | None = None
    """Scripted drops for tests: return True to drop the datagram (src, dst given)."""
    batch: bool = True
    """Hand datagrams that reach one endpoint at the same instant to it in one batch call
    (``receive_many``, as ``recvmmsg`` would), in their order; False: one call each. Same
    rules either way; the batch calls cost about a tenth per datagram."""

    _kind = "fabric"

    def __post_init__(self) -> None:
        EventEngine.__init__(self, ("lost", "duplicated", "reordered"))
        self.rng = random.Random(self.seed)

    def _transmit(self, src: Address, dst: Address, payload: bytes, t: float) -> float | None:
        """The fault model: drop, duplicate, delay and reorder ``payload``."""
        f = self.faults
        stats = self.stats
        if self.drop_filter is not None and self.drop_filter(payload, src, dst):
            stats["lost"] += 1
            return None
        rng = self.rng
        if f.loss_rate and rng.random() < f.loss_rate:
            stats["lost"] += 1
            return None
        duplicate = bool(f.duplicate_rate) and rng.random() < f.duplicate_rate
        if not (duplicate or f.jitter_s or f.reorder_rate):
            return t + f.latency_s  # the common case, without a call per datagram
        at = t + self._delay()
        if duplicate:
            stats["duplicated"] += 1
            self._deliver_at(t + self._delay(), src, dst, payload)
        return at

    def _delay(self) -> float:
        """One copy's time on the wire: latency, jitter and, if held back, a reordering
        delay."""
        f = self.faults
        delay = f.latency_s
        if f.jitter_s:
            delay += self.rng.random() * f.jitter_s
        if f.reorder_rate and self.rng.random() < f.reorder_rate:
            delay += self.rng.random() * f.reorder_delay_s
            self.stats["reordered"] += 1
        return delay


class MemoryCluster(OutOfPlace):
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
                 shards: int = 1, quorum: int | None = None,
                 quorum_min: int | None = None, quorum_deadline_s: float | None = None,
                 auth_data: bool = False) -> None:
        """``worker_config``: one for every rank, or a list of one per rank. ``shards``: a
        sharded switch of that many shard endpoints at ports 48864 + i (``shard_switches``,
        ``shard_addresses``; ``switch`` is shard 0). ``quorum``, ``quorum_min``,
        ``quorum_deadline_s`` and ``auth_data``: ``JobSpec``'s (``auth_data`` needs a
        ``switch`` and ``worker_config`` with a secret)."""
        self.spec = JobSpec(job_id=job_id, token=token, num_workers=num_workers, window=window,
                            elements_per_packet=elements_per_packet, quorum=quorum,
                            quorum_min=quorum_min, quorum_deadline_s=quorum_deadline_s,
                            auth_data=auth_data)
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

    def restart_worker(self, rank: int, address: Address, *, late: bool = False
                       ) -> WorkerEndpoint:
        """Rank ``rank`` restarts as a new process at ``address`` (the old one is detached):
        a new worker with the same spec joins (``late``: the running quorum job, see
        ``WorkerEndpoint.join``). Returns its endpoint."""
        self.fabric.detach(self.addresses[rank])
        old = self.workers[rank]
        w = WorkerEndpoint(spec=self.spec, rank=rank, switch_address=old.switch_addresses,
                           config=old.config)
        self.addresses[rank], self.workers[rank] = address, w
        self.sessions[rank] = WorkerSession(w, handle_type=AllreduceHandle)
        self.fabric.attach(address, self.sessions[rank])
        self.sessions[rank].join(self.fabric.now, late=late)
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

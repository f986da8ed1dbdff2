"""A two-level tree of real endpoints (spine switch, rack switches, workers) on any network
that offers the fabric interface (``attach``, ``flush``, ``run``, ``events``, ``now``): the
in-memory fabric (``transport.memory.MemoryFabric``) or the simulator's exact engine
(``sim.exact.ExactNetwork``).

Example::

    tree = TreeCluster(MemoryFabric(), racks=2, workers_per_rack=4, window=8,
                       elements_per_packet=64)
    outs = tree.allreduce([np.ones(1000, np.float32)] * 8)   # eight arrays of 8.0
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.errors import SwitchMLError
from switchml.protocol.events import Joined, JoinFailed
from switchml.protocol.session import WorkerSession
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.tree import RackAggregator, TreeConfig, TreeFailed, UpstreamJoined
from switchml.protocol.worker import WorkerEndpoint
from switchml.transport.handles import AllreduceHandle, OutOfPlace

__all__ = ["SPINE", "TreeCluster", "rack_address", "worker_address"]

SPINE: Address = ("spine", 48864)


def rack_address(r: int) -> Address:
    return (f"rack{r}", 48864)


def worker_address(rank: int) -> Address:
    return (f"worker{rank}", 4000 + rank)


class TreeCluster(OutOfPlace):
    """``racks`` rack switches of ``workers_per_rack`` workers each under one spine switch;
    global rank ``g`` is worker ``g % workers_per_rack`` of rack ``g // workers_per_rack``.
    Every worker quantises for all ``racks * workers_per_rack`` workers."""

    def __init__(self, net: Any, *, racks: int, workers_per_rack: int, window: int = 8,
                 elements_per_packet: int = 256, job_id: int = 7, token: int = 0x5EC12E7,
                 worker_config: WorkerConfig | None = None,
                 tree_config: TreeConfig | None = None,
                 switch_config: SwitchConfig | None = None) -> None:
        if racks < 1 or workers_per_rack < 1:
            raise ValueError(f"racks and workers_per_rack must be >= 1, got {racks}, "
                             f"{workers_per_rack}")
        self.net = net
        n = racks * workers_per_rack
        self.num_workers = n
        self.workers_per_rack = workers_per_rack
        self.parent_spec = JobSpec(job_id=job_id, token=token, num_workers=racks,
                                   window=window, elements_per_packet=elements_per_packet,
                                   scale_workers=n)
        self.child_spec = JobSpec(job_id=job_id, token=token, num_workers=workers_per_rack,
                                  window=window, elements_per_packet=elements_per_packet,
                                  scale_workers=n)
        self.spine = SwitchDataplane(switch_config)
        net.attach(SPINE, self.spine)
        self.rack_addresses = [rack_address(r) for r in range(racks)]
        self.racks = [RackAggregator(parent_spec=self.parent_spec, child_spec=self.child_spec,
                                     rack=r, parent_address=SPINE, config=tree_config,
                                     switch_config=switch_config)
                      for r in range(racks)]
        for a, rack in zip(self.rack_addresses, self.racks):
            net.attach(a, rack)
        self.addresses = [worker_address(g) for g in range(n)]
        self.workers = [WorkerEndpoint(spec=self.child_spec, rank=g % workers_per_rack,
                                       switch_address=self.rack_addresses[g // workers_per_rack],
                                       config=worker_config)
                        for g in range(n)]
        self.sessions = [WorkerSession(w, handle_type=AllreduceHandle) for w in self.workers]
        for a, session in zip(self.addresses, self.sessions):
            net.attach(a, session)
        self._joined = False

    def _all_have(self, addrs: Sequence[Address], kinds: tuple[type, ...],
                  seqs: Sequence[int | None]) -> Callable[[], bool]:
        net = self.net
        seen = -1
        pending = list(zip(addrs, seqs))

        def has(addr: Address, seq: int | None) -> bool:
            return any(isinstance(ev, kinds) and (seq is None or getattr(ev, "seq", None) == seq)
                       for ev in net.events[addr])

        def until() -> bool:
            nonlocal seen, pending
            if net.event_count == seen:
                return False
            seen = net.event_count
            self._raise_tree_failure()
            pending = [(a, s) for a, s in pending if not has(a, s)]
            return not pending

        return until

    def _raise_tree_failure(self) -> None:
        for a in self.rack_addresses:
            for ev in self.net.events[a]:
                if isinstance(ev, TreeFailed):
                    raise SwitchMLError(ev.reason)

    def join(self) -> None:
        """Join the racks upstream and the workers to their racks; raise on failure."""
        now = self.net.now
        for a, rack in zip(self.rack_addresses, self.racks):
            rack.join(now)
            self.net.flush(a)
        for a, w in zip(self.addresses, self.workers):
            w.join(now)
            self.net.flush(a)
        self.net.run(self._all_have(self.rack_addresses, (UpstreamJoined, TreeFailed),
                                    [None] * len(self.racks)))
        self.net.run(self._all_have(self.addresses, (Joined, JoinFailed),
                                    [None] * len(self.addresses)))
        for a in self.addresses:
            for ev in self.net.events[a]:
                if isinstance(ev, JoinFailed):
                    raise SwitchMLError(ev.reason)
        self._joined = True

    def start(self, arrays: Sequence[np.ndarray], outs: Sequence[np.ndarray] | None = None
              ) -> list[AllreduceHandle]:
        """Queue one all-reduce on every worker (``outs`` default: in place); returns the
        handles."""
        if not self._joined:
            self.join()
        outs = arrays if outs is None else outs
        handles = []
        for a, session, x, o in zip(self.addresses, self.sessions, arrays, outs):
            handles.append(session.submit(x, o, now=self.net.now))
            self.net.flush(a)
        return handles  # type: ignore[return-value]

    def wait(self, handles: Sequence[AllreduceHandle]) -> None:
        """Run until every handle is done; raise OperationFailed (or the tree's error)."""
        seen = -1
        pending = list(handles)

        def until() -> bool:
            nonlocal seen, pending
            if self.net.event_count == seen:
                return False
            seen = self.net.event_count
            self._raise_tree_failure()
            pending = [h for h in pending if not h.done()]
            return not pending

        self.net.run(until)
        for h in handles:
            h.result()

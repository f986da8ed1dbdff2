"""Exact mode: the real switch, rack-switch and worker objects on simulated links, real data.

``ExactNetwork`` is the discrete-event engine the in-memory fabric runs on
(:class:`~switchml.transport.engine.EventEngine`: ``attach``, ``flush``, ``step``, ``run``,
``call_at``, ``events``, ``now``, the per-host CPU cost and batch deliveries), so
``MemoryCluster``-style drivers and :class:`~switchml.sim.cluster.TreeCluster` run on it
unchanged. Only its link model differs from the fabric's: every pair of endpoints is joined by
a link per direction (:class:`~switchml.sim.config.SimLink`: FIFO serialisation at its rate,
propagation delay, tail drop at the queue limit, random loss, a failure time). Each endpoint
attached with ``cost_s`` has a CPU that spends that per datagram received or sent (what it
sends leaves after that work); datagrams that reach one endpoint at the same instant, or while
its CPU is busy, are handed over in one batch call (``receive_many``), as ``recvmmsg`` would.
Cost per event: O(log events), independent of the number of endpoints.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from switchml.protocol.address import Address
from switchml.protocol.config import JobSpec, SwitchConfig, WorkerConfig
from switchml.protocol.session import OperationHandle, WorkerSession
from switchml.protocol.switch import SwitchDataplane
from switchml.protocol.tree import RackAggregator, TreeConfig, TreeFailed
from switchml.protocol.worker import RECOVERY_COUNTERS, WorkerEndpoint
from switchml.sim.cluster import SPINE, TreeCluster, rack_address, worker_address
from switchml.sim.config import IP_UDP_BYTES, SimConfig, SimLink
from switchml.sim.report import LinkStats, SimReport
from switchml.transport.engine import EventEngine

__all__ = ["ExactNetwork", "run_exact"]


class _Link:
    """One direction of a link: FIFO at ``rate_bps``, ``delay_s``, tail drop, loss, failure."""

    __slots__ = ("spec", "free", "queue_s", "rng", "fail_at", "stats", "index")

    def __init__(self, spec: SimLink, rng: np.random.Generator, fail_at: float,
                 stats: LinkStats, index: int) -> None:
        self.spec = spec
        self.free = 0.0
        self.queue_s = spec.queue_bytes * 8 / spec.rate_bps
        self.rng = rng
        self.fail_at = fail_at
        self.stats = stats
        self.index = index

    def send(self, t: float, udp_bytes: int) -> float | None:
        """Queue a datagram of ``udp_bytes`` at ``t``; its arrival time, or None if lost."""
        spec = self.spec
        ip_bytes = udp_bytes + IP_UDP_BYTES
        ftime = spec.frame_time_s(ip_bytes)
        start = t if t > self.free else self.free
        st = self.stats
        if start - t + ftime > self.queue_s:
            st.queue_drops += 1
            return None
        self.free = start + ftime
        st.frames += 1
        st.bytes += ip_bytes
        st.busy_s[self.index] += ftime
        if t >= self.fail_at:
            st.failed_drops += 1
            return None
        if spec.loss_rate and self.rng.random() < spec.loss_rate:
            st.losses += 1
            return None
        return self.free + spec.delay_s


class ExactNetwork(EventEngine):
    """Endpoints joined by simulated links, on a virtual clock (see the module docstring).

    Example::

        net = ExactNetwork(seed=1)
        net.attach(("switch", 1), SwitchDataplane())
        net.attach(("w0", 1), worker, cost_s=6.6e-6)
        net.connect(("w0", 1), ("switch", 1), SimLink(rate_bps=1e9))
    """

    _kind = "network"
    _counts_batches = True  # receive calls: the report's events

    def __init__(self, *, seed: int = 0) -> None:
        super().__init__(("unroutable", "batches"))
        self.seed = seed
        self._seeds = np.random.SeedSequence(seed)
        self.links: dict[tuple[Address, Address], _Link] = {}

    def connect(self, a: Address, b: Address, spec: SimLink, *, up: LinkStats | None = None,
                down: LinkStats | None = None, index: int = 0,
                fail_at: float = float("inf")) -> None:
        """Join ``a`` and ``b`` by a link of ``spec`` each way (a -> b counted in ``up``)."""
        rng = np.random.default_rng(self._seeds.spawn(1)[0])
        up = up or LinkStats("link", 1, busy_s=np.zeros(1))
        down = down or LinkStats("link", 1, busy_s=np.zeros(1))
        self.links[a, b] = _Link(spec, rng, fail_at, up, index)
        self.links[b, a] = _Link(spec, np.random.default_rng(self._seeds.spawn(1)[0]),
                                 fail_at, down, index)

    def _transmit(self, src: Address, dst: Address, payload: bytes, t: float) -> float | None:
        """The link model: the ``src`` -> ``dst`` link queues, serialises, delays or drops."""
        link = self.links.get((src, dst))
        if link is None:
            self.stats["unroutable"] += 1
            return None
        return link.send(t, len(payload))


def _link_stats(config: SimConfig) -> list[LinkStats]:
    n, racks = config.workers, config.racks
    stats = [LinkStats("worker_up", n, busy_s=np.zeros(n)),
             LinkStats("worker_down", n, busy_s=np.zeros(n))]
    if racks > 1:
        stats += [LinkStats("rack_up", racks, busy_s=np.zeros(racks)),
                  LinkStats("spine_down", racks, busy_s=np.zeros(racks))]
    return stats


def _inputs(config: SimConfig, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(config.elements).astype(np.float32)
            for _ in range(config.workers)]


def _endpoint_configs(c: SimConfig) -> tuple[WorkerConfig, SwitchConfig]:
    """The workers' and switches' settings for ``c``."""
    wcfg = WorkerConfig(min_rto_s=c.min_rto_s, min_rto_srtts=c.min_rto_srtts,
                        initial_rto_s=c.initial_rto_s,
                        max_rto_s=c.max_rto_s, op_timeout_s=c.op_timeout_s)
    scfg = SwitchConfig(max_window=max(256, c.slots), max_workers=max(4096, c.workers),
                        pool_slots=max(1024, c.slots), nack_gap=c.nack_gap)
    return wcfg, scfg


def _build(c: SimConfig, net: ExactNetwork, stats: list[LinkStats]
           ) -> tuple[list[Address], list[WorkerSession], set[int]]:
    """Attach the switch(es) and workers and connect them; the workers' addresses, their
    sessions, and the stragglers' ranks."""
    wcfg, scfg = _endpoint_configs(c)
    k, window = c.elements_per_packet, c.slots
    wfail = {f.index: f.at_s for f in c.failures if f.kind == "worker"}
    rfail = {f.index: f.at_s for f in c.failures if f.kind == "rack"}
    if c.racks == 1:
        switch_addr = ("switch", 48864)
        net.attach(switch_addr, SwitchDataplane(scfg))
        spec = JobSpec(job_id=7, token=0x5EC12E7, num_workers=c.workers, window=window,
                       elements_per_packet=k)
        addrs = [worker_address(g) for g in range(c.workers)]
        workers = [WorkerSession(WorkerEndpoint(spec=spec, rank=g, switch_address=switch_addr,
                                                config=wcfg)) for g in range(c.workers)]
        uplinks = [switch_addr] * c.workers
    else:
        tree = TreeCluster(net, racks=c.racks, workers_per_rack=c.workers_per_rack,
                           window=window, elements_per_packet=k, worker_config=wcfg,
                           tree_config=TreeConfig(rto_s=c.min_rto_s, max_rto_s=c.max_rto_s,
                                                  parent_timeout_s=c.op_timeout_s * 0.8),
                           switch_config=scfg)
        addrs, workers = tree.addresses, tree.sessions
        uplinks = [rack_address(g // c.workers_per_rack) for g in range(c.workers)]
        for r in range(c.racks):
            net.connect(rack_address(r), SPINE, c.spine_link, up=stats[2], down=stats[3],
                        index=r, fail_at=rfail.get(r, float("inf")))
    s = c.stragglers
    slow = set(range(c.workers - s.count, c.workers))
    for g, (a, w) in enumerate(zip(addrs, workers)):
        net.attach(a, w, cost_s=c.host_cost_s * (s.slowdown if g in slow else 1.0))
        net.connect(a, uplinks[g], c.access, up=stats[0], down=stats[1], index=g,
                    fail_at=wfail.get(g, float("inf")))
    return addrs, workers, slow


def _join(net: ExactNetwork, sessions: list[WorkerSession], stats: list[LinkStats]) -> None:
    """Join every endpoint (not timed), then zero the link counters: they count the
    operation only."""
    for a, ep in net.endpoints.items():
        if hasattr(ep, "join") and not isinstance(ep, SwitchDataplane):
            ep.join(net.now)
            net.flush(a)
    net.run(lambda: all(s.joined or s.error for s in sessions), max_time_s=60.0)
    for st in stats:
        st.frames = st.bytes = st.queue_drops = st.losses = st.failed_drops = 0
        st.busy_s[:] = 0


class _Outcome:
    """When each rank's operation completed, and the first error."""

    def __init__(self, net: ExactNetwork, t0: float) -> None:
        self.net, self.t0 = net, t0
        self.done_at: dict[int, float] = {}
        self.error: str | None = None

    def watch(self, g: int, handle: OperationHandle) -> None:
        def done(h: OperationHandle) -> None:
            exc = h.exception()
            if exc is None:
                self.done_at[g] = self.net.now
            elif self.error is None:
                self.error = f"rank {g} failed at t={self.net.now - self.t0:.6f} s: {exc}"
        handle.add_done_callback(done)


def _schedule_starts(c: SimConfig, net: ExactNetwork, addrs: list[Address],
                     sessions: list[WorkerSession], slow: set[int], xs: list[np.ndarray],
                     outs: list[np.ndarray]) -> _Outcome:
    """Start every worker's all-reduce at the current time (stragglers later); returns what
    records their outcomes."""
    outcome = _Outcome(net, net.now)

    def starter(g: int) -> Callable[[], None]:
        def start() -> None:
            outcome.watch(g, sessions[g].submit(xs[g], outs[g], now=net.now))
            net.flush(addrs[g])
        return start

    for g in range(c.workers):
        delay = c.stragglers.delay_s if g in slow else 0.0
        net.call_at(outcome.t0 + delay, starter(g))
    return outcome


def _tree_failure(c: SimConfig, net: ExactNetwork, t0: float) -> str | None:
    """A rack switch's failure, if one reported any."""
    for a in ([] if c.racks == 1 else [rack_address(r) for r in range(c.racks)]):
        for ev in net.events[a]:
            if isinstance(ev, TreeFailed):
                return f"at t={net.now - t0:.6f} s: {ev.reason}"
    return None


def _run_operation(c: SimConfig, net: ExactNetwork, sessions: list[WorkerSession],
                   outcome: _Outcome, progress: Callable[[float, float], None] | None
                   ) -> tuple[dict[int, float], str | None]:
    """Step until every rank completed or one failed: when each completed, and the error."""
    next_report = time.perf_counter() + 2.0
    seen = -1
    chunks = c.workers * (-(-c.elements // c.elements_per_packet) + c.slots)
    while len(outcome.done_at) < c.workers and outcome.error is None:
        if not net.step():
            outcome.error = "the network went idle before every worker finished (a bug)"
            break
        if net.event_count != seen:
            seen = net.event_count
            outcome.error = outcome.error or _tree_failure(c, net, outcome.t0)
        if progress is not None and net.stats["delivered"] % 4096 == 0:
            wall = time.perf_counter()
            if wall >= next_report:
                next_report = wall + 2.0
                got = sum(s.endpoint.counters["results_received"] for s in sessions)
                progress(min(1.0, got / chunks), net.now - outcome.t0)
    return outcome.done_at, outcome.error


def _check_results(xs: list[np.ndarray], outs: list[np.ndarray]
                   ) -> tuple[str | None, float, int]:
    """Compare every rank's result with the float64 sum: the error (None if every rank holds
    the same bits), the max abs error, and how many results were checked."""
    error = None
    max_err = 0.0
    checked = 0
    ref = np.sum(np.stack(xs).astype(np.float64), axis=0)
    first = outs[0]
    for o in outs:
        if not np.array_equal(o, first):
            error = "the ranks hold different results"
        max_err = max(max_err, float(np.max(np.abs(o - ref))))
        checked += 1
    return error, max_err, checked


def _nack_totals(net: ExactNetwork) -> dict[str, int]:
    """NACKs the switches (rack switches included) sent, and how many were needless, summed;
    ``nacks`` as timing mode reports it."""
    stats = [ep.stats() for ep in net.endpoints.values()
             if isinstance(ep, SwitchDataplane | RackAggregator)]
    return {"nacks": sum(int(st["nacks_sent"]) for st in stats),
            "nacks_needless": sum(int(st["nacks_needless"]) for st in stats)}


def run_exact(config: SimConfig, *, check: bool = True,
              progress: Callable[[float, float], None] | None = None) -> SimReport:
    """Simulate one float32 all-reduce of ``config`` with the real endpoints and real data;
    with ``check``, compare every rank's result with the float64 sum (max abs error, and that
    every rank holds the same bits)."""
    c = config
    t_wall = time.perf_counter()
    net = ExactNetwork(seed=c.seed)
    stats = _link_stats(c)
    addrs, workers, slow = _build(c, net, stats)
    _join(net, workers, stats)
    xs = _inputs(c, c.seed)
    outs = [np.empty_like(x) for x in xs]
    t0 = net.now
    outcome = _schedule_starts(c, net, addrs, workers, slow, xs, outs)
    done_at, error = _run_operation(c, net, workers, outcome, progress)
    ok = error is None
    elapsed = (max(done_at.values()) - t0) if ok else net.now - t0
    max_err = 0.0
    checked = 0
    if ok and check:
        error, max_err, checked = _check_results(xs, outs)
        ok = error is None
    retx = sum(s.endpoint.counters["retransmissions"] for s in workers)
    rack_retx = 0
    if c.racks > 1:
        rack_retx = sum(net.endpoints[rack_address(r)].counters["upstream_retransmissions"]
                        for r in range(c.racks))
    return SimReport(mode="exact", config=c, elapsed_s=elapsed, elements=c.elements, ok=ok,
                     error=error, retransmissions=retx, rack_retransmissions=rack_retx,
                     links=stats, events=net.stats["batches"],
                     wall_s=time.perf_counter() - t_wall, results_checked=checked,
                     max_abs_error=max_err,
                     extra={"datagrams_delivered": net.stats["delivered"],
                            "recovery": {k: sum(s.endpoint.counters[k] for s in workers)
                                         for k in RECOVERY_COUNTERS},
                            **_nack_totals(net)})

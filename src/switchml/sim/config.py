"""What the simulator runs: links, topology, hosts and the operation, as plain validated data.

Units are SI (bits/s, seconds, bytes); probabilities are 0..1. A :class:`SimConfig` is built
from the command line (``switchml sim``), from a testbed :class:`~switchml.testbed.topology.
Topology` (:meth:`SimConfig.from_topology`), or directly in tests.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from switchml.protocol.config import default_window
from switchml.protocol.errors import ConfigError
from switchml.protocol.wire import HEADER_SIZE, elements_for_mtu
from switchml.testbed.topology import LinkSpec, Topology

__all__ = ["ETHERNET_OVERHEAD_BYTES", "HOST_COST_S", "IP_UDP_BYTES", "LinkFailure", "SimConfig",
           "SimLink", "Stragglers"]

IP_UDP_BYTES = 28
"""IPv4 (20) + UDP (8) header bytes per datagram."""
ETHERNET_OVERHEAD_BYTES = 14
"""Bytes a shaped veth link counts per frame beyond the IP packet (the Ethernet header; tbf
shapes ``skb->len``, so preamble, FCS and gap are not counted, as on the testbed)."""
HOST_COST_S = 6.6e-6
"""Calibrated CPU time a worker host spends per datagram received or sent (docs/simulator.md):
with it the model gives the testbed's 87% of B/32 at n = 4, 1 Gbit/s, MTU 1500, 64 MiB."""


def _check(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


@dataclass(frozen=True, slots=True)
class SimLink:
    """One direction of a link: a FIFO queue drained at ``rate_bps``, then ``delay_s`` of
    propagation. A frame that would make the queue exceed ``queue_bytes`` is dropped (tail
    drop); a frame that leaves is lost with probability ``loss_rate``."""

    rate_bps: float = 1e9
    """Line rate in bits/s."""
    delay_s: float = 0.0
    """Propagation delay, seconds (a veth pair: 0)."""
    queue_bytes: int = 2_500_000
    """Queue limit in bytes (tbf's ``latency`` of 20 ms at 1 Gbit/s: 2.5 MB)."""
    loss_rate: float = 0.0
    """Probability that a frame is lost on this link."""

    def __post_init__(self) -> None:
        _check(1e3 <= self.rate_bps <= 1e13, f"rate_bps must be in 1e3..1e13, got {self.rate_bps}")
        _check(self.delay_s >= 0, f"delay_s must be >= 0, got {self.delay_s}")
        _check(self.queue_bytes >= 1, f"queue_bytes must be >= 1, got {self.queue_bytes}")
        _check(0 <= self.loss_rate < 1, f"loss_rate must be in [0, 1), got {self.loss_rate}")

    @classmethod
    def from_linkspec(cls, spec: LinkSpec, *, delay_s: float = 0.0) -> SimLink:
        """The testbed's link (tbf rate, its queue time as bytes, nft loss)."""
        rate = spec.bandwidth_bps if spec.bandwidth_bps is not None else 1e11
        return cls(rate_bps=rate, delay_s=delay_s, loss_rate=spec.loss_rate,
                   queue_bytes=max(1, int(rate * spec.queue_s / 8)))

    def frame_time_s(self, ip_bytes: int) -> float:
        """Seconds to serialise one IP packet of ``ip_bytes`` on this link."""
        return (ip_bytes + ETHERNET_OVERHEAD_BYTES) * 8 / self.rate_bps


@dataclass(frozen=True, slots=True)
class Stragglers:
    """The last ``count`` ranks are slow: their host cost is multiplied by ``slowdown`` and
    they start the operation ``delay_s`` late."""

    count: int = 0
    slowdown: float = 1.0
    delay_s: float = 0.0

    def __post_init__(self) -> None:
        _check(self.count >= 0, f"straggler count must be >= 0, got {self.count}")
        _check(self.slowdown >= 1, f"straggler slowdown must be >= 1, got {self.slowdown}")
        _check(self.delay_s >= 0, f"straggler delay_s must be >= 0, got {self.delay_s}")


@dataclass(frozen=True, slots=True)
class LinkFailure:
    """The link of ``kind`` (``"worker"``: worker ``index``'s access link, ``"rack"``: rack
    ``index``'s link to the spine) drops everything, both ways, from ``at_s`` on."""

    kind: str
    index: int
    at_s: float

    def __post_init__(self) -> None:
        _check(self.kind in ("worker", "rack"), f"link kind must be 'worker' or 'rack', got "
               f"{self.kind!r}")
        _check(self.index >= 0, f"link index must be >= 0, got {self.index}")
        _check(self.at_s >= 0, f"failure time must be >= 0, got {self.at_s}")


@dataclass(frozen=True, slots=True)
class SimConfig:
    """One simulated all-reduce: ``workers`` ranks, star (``racks = 1``: every worker on a
    link to one switch) or a two-level tree (``racks = R``: ``workers / R`` workers per rack
    switch, each rack switch on a link to a spine switch)."""

    workers: int
    size_bytes: int = 64 << 20
    """Tensor size in bytes (float32: size / 4 elements)."""
    access: SimLink = SimLink()
    """Every worker <-> switch link (each direction alike)."""
    spine: SimLink | None = None
    """Every rack switch <-> spine link (default: the same as ``access``)."""
    racks: int = 1
    mtu: int = 1500
    """Path MTU: chunks hold ``elements_for_mtu(mtu)`` int32 (358 at 1500)."""
    window: int | None = None
    """Slots per job (W); default ``default_window`` for the chunk size (128 at MTU 1500)."""
    host_cost_s: float = HOST_COST_S
    """CPU seconds per datagram received or sent at a worker (see ``HOST_COST_S``)."""
    host_element_cost_s: float = 0.0
    """CPU seconds per element a worker sends or receives, on top of ``host_cost_s`` per
    datagram (``costs.Costs.worker_element_s``, from ``switchml calibrate``)."""
    threads: int = 1
    """I/O threads per worker (``transport/parallel.py``): its CPU costs are shared by them."""
    switch_request_cost_s: float = 0.0
    """CPU seconds a switch core spends per request (its results included); 0: a switch at
    line rate. Only for a star (``racks = 1``)."""
    switch_element_cost_s: float = 0.0
    """CPU seconds a switch core spends per element of a request."""
    shards: int = 1
    """Switch shards, each on a core of its own, sharing the requests."""
    switch_delay_s: float = 0.0
    """Fixed processing delay at each switch, besides its CPU (above)."""
    nack_gap: int = 4
    """Switch-driven loss recovery (``SwitchConfig.nack_gap``): the switch NACKs a rank whose
    chunk released ``nack_gap`` completions before the arriving one is missing. 0: off (loss
    costs a retransmission timeout). Default 4, the switch's default."""
    stragglers: Stragglers = Stragglers()
    failures: tuple[LinkFailure, ...] = ()
    seed: int = 0
    min_rto_s: float = 0.01
    min_rto_srtts: float = 3.0
    """``WorkerConfig.min_rto_srtts``: the timeout is at least this many srtt."""
    initial_rto_s: float = 0.2
    max_rto_s: float = 1.0
    op_timeout_s: float = 15.0
    extra: dict = field(default_factory=dict)
    """Free-form labels copied into reports."""

    def __post_init__(self) -> None:
        _check(1 <= self.workers <= 65535, f"workers must be in 1..65535, got {self.workers}")
        _check(self.size_bytes >= 4 and self.size_bytes % 4 == 0,
               f"size_bytes must be a positive multiple of 4 (float32), got {self.size_bytes}")
        _check(1 <= self.racks <= self.workers, f"racks must be in 1..workers, got {self.racks}")
        _check(self.workers % self.racks == 0, f"workers ({self.workers}) must be a multiple of "
               f"racks ({self.racks}): every rack has the same number of workers")
        _check(IP_UDP_BYTES + HEADER_SIZE + 4 <= self.mtu <= 65535,
               f"mtu must be in {IP_UDP_BYTES + HEADER_SIZE + 4}..65535 (room for the headers "
               f"and one element), got {self.mtu}")
        _check(self.window is None or 1 <= self.window <= 65536,
               f"window must be in 1..65536, got {self.window}")
        _check(self.host_cost_s >= 0, f"host_cost_s must be >= 0, got {self.host_cost_s}")
        for name in ("host_element_cost_s", "switch_request_cost_s", "switch_element_cost_s"):
            _check(getattr(self, name) >= 0, f"{name} must be >= 0, got {getattr(self, name)}")
        _check(1 <= self.threads <= 64, f"threads must be in 1..64, got {self.threads}")
        _check(self.shards >= 1, f"shards must be >= 1, got {self.shards}")
        _check(self.nack_gap >= 0, f"nack_gap must be >= 0, got {self.nack_gap}")
        _check(self.min_rto_srtts >= 1.0,
               f"min_rto_srtts must be >= 1 (round trips), got {self.min_rto_srtts}")
        _check(self.stragglers.count <= self.workers,
               f"stragglers ({self.stragglers.count}) exceed workers ({self.workers})")
        _check(0 < self.min_rto_s <= self.initial_rto_s <= self.max_rto_s < self.op_timeout_s,
               "expected 0 < min_rto_s <= initial_rto_s <= max_rto_s < op_timeout_s")
        for f in self.failures:
            limit = self.workers if f.kind == "worker" else self.racks
            _check(f.index < limit, f"{f.kind} link {f.index} does not exist (0..{limit - 1})")
            _check(f.kind == "worker" or self.racks > 1, "rack links exist only with racks > 1")

    @classmethod
    def from_topology(cls, topology: Topology, **kwargs: object) -> SimConfig:
        """The testbed's star (its link for every worker) as a simulation."""
        link = SimLink.from_linkspec(topology.link)
        return cls(workers=topology.workers, access=link, mtu=topology.link.mtu,
                   **kwargs)  # type: ignore[arg-type]

    @property
    def spine_link(self) -> SimLink:
        return self.spine if self.spine is not None else self.access

    @property
    def elements(self) -> int:
        return self.size_bytes // 4

    @property
    def elements_per_packet(self) -> int:
        return elements_for_mtu(self.mtu)

    @property
    def slots(self) -> int:
        return self.window if self.window is not None else default_window(
            self.elements_per_packet)

    @property
    def workers_per_rack(self) -> int:
        return self.workers // self.racks

    @property
    def line_bound_ate(self) -> float:
        """In-network bound per worker: B/32 elements/s."""
        return self.access.rate_bps / 32

    @property
    def ring_bound_ate(self) -> float:
        """Ring all-reduce bound per worker: B/32 / (2(n-1)/n) (B/32 for n = 1)."""
        n = self.workers
        return self.line_bound_ate if n == 1 else self.line_bound_ate / (2 * (n - 1) / n)

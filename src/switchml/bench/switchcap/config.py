"""The switch capacity benchmark's configuration (validated on creation) and its result."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from switchml.protocol.wire import HEADER_SIZE, MAX_ELEMENTS_PER_PACKET

__all__ = ["SwitchCapConfig", "SwitchCapResult"]

# The switch's default limits (the benchmark runs it with its default settings).
_MAX_WINDOW = 256
_MAX_WORKERS = 256  # one socket per rank in one process; far above what two cores can feed
_MAX_SECONDS = 3600.0
_MAX_SHARDS = 64


@dataclass(frozen=True)
class SwitchCapConfig:
    workers: int = 4
    elements_per_packet: int = 256
    window: int = 64
    seconds: float = 5.0
    batching: bool = True
    """UDP GSO/GRO in the switch and in the generator."""
    warmup_s: float = 0.5
    """Traffic before the measured interval starts."""
    drain_s: float = 2.0
    """After the interval: how long to wait for the results of requests in flight."""
    rto_s: float = 1.0
    """A request without its result for this long is sent again (loss recovery only; on
    loopback it should never fire)."""
    first_result_timeout_s: float = 120.0
    """How long the first result may take (a switch may compile its data plane first)."""
    shards: int = 1
    """Switch processes (``switchml switch --shards``): lane i of the job on shard i mod S."""
    generators: int = 0
    """Generator processes, each serving a disjoint set of shards with all N ranks; 0: one
    per shard (a generator costs more CPU per datagram than a shard does)."""

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= _MAX_WORKERS:
            raise ValueError(f"SwitchCapConfig.workers must be in 1..{_MAX_WORKERS}, got "
                             f"{self.workers}")
        if not 1 <= self.elements_per_packet <= MAX_ELEMENTS_PER_PACKET:
            raise ValueError("SwitchCapConfig.elements_per_packet must be in "
                             f"1..{MAX_ELEMENTS_PER_PACKET} "
                             f"(int32 elements in one UDP datagram), got "
                             f"{self.elements_per_packet}")
        if not 1 <= self.window <= _MAX_WINDOW:
            raise ValueError(f"SwitchCapConfig.window must be in 1..{_MAX_WINDOW} (the switch's "
                             f"default max_window), got {self.window}")
        if not 1 <= self.shards <= _MAX_SHARDS:
            raise ValueError(f"SwitchCapConfig.shards must be in 1..{_MAX_SHARDS}, got "
                             f"{self.shards}")
        if self.shards > self.window:
            raise ValueError(f"SwitchCapConfig.shards ({self.shards}) must be at most "
                             f"SwitchCapConfig.window ({self.window}): every shard needs a lane")
        if not 0 <= self.generators <= self.shards:
            raise ValueError(f"SwitchCapConfig.generators must be in 0..SwitchCapConfig.shards "
                             f"({self.shards}), got {self.generators}")
        if self.workers * -(-self.shards // (self.generators or self.shards)) > _MAX_WORKERS:
            raise ValueError(f"SwitchCapConfig.workers x shards per generator must be at most "
                             f"{_MAX_WORKERS} sockets in one generator")
        if not 0 < self.seconds <= _MAX_SECONDS:
            raise ValueError(f"SwitchCapConfig.seconds must be in (0, {_MAX_SECONDS:g}], got "
                             f"{self.seconds}")
        if (self.warmup_s < 0 or self.drain_s < 0 or self.rto_s <= 0
                or self.first_result_timeout_s <= 0):
            raise ValueError("SwitchCapConfig.warmup_s and SwitchCapConfig.drain_s must be >= 0, "
                             "SwitchCapConfig.rto_s and SwitchCapConfig.first_result_timeout_s > 0")

    @property
    def datagram_bytes(self) -> int:
        return HEADER_SIZE + 4 * self.elements_per_packet


@dataclass
class SwitchCapResult:
    config: dict[str, Any]
    interval_s: float
    """Measured interval, as the parent saw it between its two snapshots of the switch."""
    switch_datagrams_in: int
    switch_datagrams_out: int
    switch_in_per_s: float
    switch_out_per_s: float
    payload_gbytes_per_s: float
    """Requests into the switch x K x 4 bytes, per second (aggregated over the ranks)."""
    switch_cpu_percent: float
    """Summed over the shards, in % of one core (so up to S x 100)."""
    generator_cpu_percent: float
    """Summed over the generators, in % of one core."""
    other_cpu_percent: float
    """CPU the rest of the machine used meanwhile (this parent, other processes, interrupts),
    in % of one core: more than a few percent means the figures were taken under load."""
    switch_cpu_us_per_datagram: float
    """Switch CPU time over the interval / datagrams it received in the interval."""
    switch_capacity_per_s: float
    """Per shard, datagrams in / its CPU seconds, summed over the shards: datagrams in per
    second the switch would take with a whole core per shard (an extrapolation; equals the
    measured rate when every shard is the bottleneck, and is less disturbed by other load
    than the rate is)."""
    bottleneck: str
    generator: dict[str, Any]
    """Generator counters over the interval (requests, results, per second) and for the
    whole run (``*_total``)."""
    drops: dict[str, int]
    """Switch drop counters over the whole run (a fresh switch), by reason."""
    switch_errors: dict[str, int]
    switch_stats: dict[str, Any]
    pinned: dict[str, Any]
    shards: list[dict[str, Any]] = field(default_factory=list)
    """Per shard: datagrams in and out per second, CPU %, CPU time per datagram, capacity."""
    machine: dict[str, Any] = field(default_factory=dict)

    @property
    def wrong_results(self) -> int:
        return int(self.generator["wrong_results_total"])

    @property
    def consistent(self) -> bool:
        """Every request sent was answered by exactly one result, except those in flight."""
        g = self.generator
        return bool(g["results_total"] == g["requests_total"] - g["in_flight_at_end"])

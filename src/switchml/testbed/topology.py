"""A star topology as plain data, and its translation into tc, nft and ethtool arguments (no
root)."""

from __future__ import annotations

from dataclasses import dataclass

from switchml.protocol.errors import ConfigError

__all__ = ["GeoTopology", "LinkSpec", "Topology", "ethtool_args", "nft_host_loss_ruleset",
           "nft_loss_ruleset", "tbf_args"]


GSO_RUN_BYTES = 72 * 1024
"""The largest GSO run as tbf counts it: 64 KiB of payload plus 64 segments' headers."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One full-duplex link; both directions get the same shaping and loss."""

    bandwidth_bps: float | None = 1e9
    """Line rate in bits/s (tc tbf on both ends); None for unshaped."""
    loss_rate: float = 0.0
    """Probability (0..1) that a wire packet (one datagram, one TCP segment) is dropped on each
    link it crosses (nftables numgen: uplink in the router, downlink at the receiving host)."""
    mtu: int = 1500
    """Link MTU in bytes: 1500 (Ethernet) by default, 9000 for jumbo frames. veth takes up to
    65535, but no real network does: larger values are for experiments only."""
    queue_s: float = 0.02
    """How long tbf may queue a packet before dropping it (its ``latency``), seconds."""

    def __post_init__(self) -> None:
        if self.bandwidth_bps is not None and not 1e5 <= self.bandwidth_bps <= 1e11:
            raise ConfigError(f"bandwidth_bps must be in 1e5..1e11, got {self.bandwidth_bps}")
        if not 0.0 <= self.loss_rate < 1.0:
            raise ConfigError(f"loss_rate must be in [0, 1), got {self.loss_rate}")
        if not 68 <= self.mtu <= 65535:
            raise ConfigError(f"mtu must be in 68..65535, got {self.mtu}")
        if not 0.0 < self.queue_s <= 1.0:
            raise ConfigError(f"queue_s must be in (0, 1], got {self.queue_s}")

    @property
    def burst_bytes(self) -> int:
        """tbf bucket: at least two frames, about 1 ms of line rate, and one whole GSO run.

        A GSO run (UDP_SEGMENT, or a TCP super-packet: up to 64 KiB plus the headers of up to
        64 segments) larger than the bucket is cut by tbf and its datagrams leave one by one
        as tokens come, so the receiving host's GRO never sees two together; a run that fits
        leaves at once (the kernel cuts it after the qdisc) and reaches the receiver as one
        GRO batch.
        """
        rate = self.bandwidth_bps or 0.0
        return max(2 * (self.mtu + 14), int(rate / 8 / 1000), GSO_RUN_BYTES)


@dataclass(frozen=True, slots=True)
class Topology:
    """A star: worker i <-> router <-> ..., plus a parameter-server host on a link of its own.
    The router namespace stands for the rack switch: it forwards worker-to-worker traffic and
    the software switch (``switchml switch``, bound to 0.0.0.0) runs in it, so switchml traffic
    crosses one link each way, as in a real rack. Worker i talks to the switch at its own
    gateway address (:meth:`switch_ip`); the switch's replies leave with that source address.

    Loss is dropped once per link crossed, per wire datagram (see :func:`nft_loss_ruleset`):
    uplink loss in the router (input and forward), downlink loss at the receiving host's input
    (worker and parameter-server namespaces), never on output. See docs/testbed.md.
    """

    workers: int
    link: LinkSpec = LinkSpec()
    subnet: str = "10.201"
    """First two octets of the per-link /24s (inside the testbed's own namespaces only)."""

    def __post_init__(self) -> None:
        if not 1 <= self.workers <= 200:
            raise ConfigError(f"workers must be in 1..200, got {self.workers}")
        parts = self.subnet.split(".")
        if len(parts) != 2 or not all(p.isdigit() and 0 <= int(p) <= 255 for p in parts):
            raise ConfigError(f"subnet must look like '10.201', got {self.subnet!r}")

    def worker_ip(self, i: int) -> str:
        return f"{self.subnet}.{i}.2"

    def gateway_ip(self, i: int) -> str:
        """The router's address on link i (worker i's default route)."""
        return f"{self.subnet}.{i}.1"

    def switch_ip(self, i: int = 0) -> str:
        """The switch's address for worker i: the router's address on link i (the switch runs
        in the router namespace, bound to 0.0.0.0, so its replies to worker i leave with this
        source address, which the worker's connected UDP socket requires)."""
        return self.gateway_ip(i)

    @property
    def ps_ip(self) -> str:
        return f"{self.subnet}.{self.ps_link}.2"

    @property
    def ps_link(self) -> int:
        return 250


@dataclass(frozen=True, slots=True)
class GeoTopology:
    """Data centres joined by a WAN: each data centre a star of workers around its own router
    (LAN links), every data-centre router joined to a WAN core router by a WAN link.

    Worker ``i`` (numbered across data centres, in order) sits on link ``i`` as in
    :class:`Topology` (``subnet.i.2``, its router ``subnet.i.1``); data centre ``j``'s WAN link
    is ``subnet.(200 + j).0/24`` (core ``.1``, data-centre router ``.2``). Traffic between two
    data centres crosses two WAN links (up to the core, down to the other side), both shaped at
    ``wan``'s rate, so the path runs at that rate. With one data centre nothing crosses the
    WAN (the "all workers in one data centre" baseline). A round trip between data centres
    takes ``wan_rtt_s`` more than the links alone: a user-space delay line in the WAN core
    (:mod:`switchml.testbed.delayline`; this kernel has no netem). No loss.
    """

    dcs: tuple[int, ...] = (2, 2)
    """Workers per data centre."""
    lan: LinkSpec = LinkSpec(bandwidth_bps=1e9)
    wan: LinkSpec = LinkSpec(bandwidth_bps=50e6)
    subnet: str = "10.202"
    wan_rtt_s: float = 0.0
    """Propagation delay added to every round trip between two data centres (each packet is
    held ``wan_rtt_s / 2`` in the WAN core)."""

    def __post_init__(self) -> None:
        if not 1 <= len(self.dcs) <= 8 or any(n < 1 for n in self.dcs):
            raise ConfigError(f"dcs must list 1..8 data centres of >= 1 worker, got {self.dcs}")
        if sum(self.dcs) > 199:
            raise ConfigError(f"at most 199 workers in all, got {sum(self.dcs)}")
        if not 0.0 <= self.wan_rtt_s <= 10.0:
            raise ConfigError(f"wan_rtt_s must be in [0, 10] seconds, got {self.wan_rtt_s}")
        if self.lan.loss_rate or self.wan.loss_rate:
            raise ConfigError("the geo testbed has no loss emulation: loss_rate must be 0")
        Topology(workers=1, subnet=self.subnet)  # validates the subnet

    @property
    def workers(self) -> int:
        return sum(self.dcs)

    def dc_of(self, i: int) -> int:
        """The data centre of worker ``i``."""
        if not 0 <= i < self.workers:
            raise ConfigError(f"worker {i} out of range 0..{self.workers - 1}")
        for j, first in enumerate(self.first_workers):
            if i < first + self.dcs[j]:
                return j
        raise AssertionError("unreachable")

    @property
    def first_workers(self) -> list[int]:
        return [sum(self.dcs[:j]) for j in range(len(self.dcs))]

    def workers_of(self, j: int) -> list[int]:
        first = self.first_workers[j]
        return list(range(first, first + self.dcs[j]))

    def worker_ip(self, i: int) -> str:
        return f"{self.subnet}.{i}.2"

    def gateway_ip(self, i: int) -> str:
        """Worker i's data-centre router address on its LAN link."""
        return f"{self.subnet}.{i}.1"

    def wan_core_ip(self, j: int) -> str:
        return f"{self.subnet}.{200 + j}.1"

    def wan_router_ip(self, j: int) -> str:
        """Data centre ``j``'s router on its WAN link."""
        return f"{self.subnet}.{200 + j}.2"


def tbf_args(link: LinkSpec) -> list[str]:
    """``tc qdisc add ... root`` arguments for one direction of ``link``; [] if unshaped."""
    if link.bandwidth_bps is None:
        return []
    return ["tbf", "rate", f"{int(link.bandwidth_bps)}bit", "burst", str(link.burst_bytes),
            "latency", f"{int(link.queue_s * 1000)}ms"]


def _loss_rule(loss_rate: float) -> str:
    return f"numgen random mod 1000000 < {round(loss_rate * 1_000_000)} counter drop"


def nft_loss_ruleset(table: str, loss_rate: float) -> str:
    """The router's nft script: uplink loss, once for the link a packet arrives on.

    ``input`` (packets to the router itself, i.e. to the switch, which runs there; not from
    ``lo``) and ``forward`` (forwarded packets, worker to worker or to the parameter server)
    each drop a packet with probability ``loss_rate``. The router's veth ends have GRO off, so
    these rules see single wire datagrams. Nothing is dropped on output: there a GSO run the
    switch sends is still one super-packet (it is cut after the qdisc), and a drop would give
    the sender EPERM. Downlink loss is :func:`nft_host_loss_ruleset`'s, at the receiver."""
    rule = _loss_rule(loss_rate)
    return "\n".join([
        f"table inet {table} {{",
        "  chain forward {",
        "    type filter hook forward priority 0; policy accept;",
        f"    {rule}",
        "  }",
        "  chain input {",
        "    type filter hook input priority 0; policy accept;",
        f'    iifname != "lo" {rule}',
        "  }",
        "}"]) + "\n"


def nft_host_loss_ruleset(table: str, loss_rate: float) -> str:
    """A receiving host's nft script (each worker and the parameter server): downlink loss,
    once for the link a packet leaves the router on, at the host's ``input`` hook (not from
    ``lo``). Each packet is dropped with probability ``loss_rate``. GRO merges before
    netfilter, so the host's veth end has GRO off whenever there is loss
    (:func:`ethtool_args`): each wire datagram is dropped on its own."""
    return "\n".join([
        f"table inet {table} {{",
        "  chain input {",
        "    type filter hook input priority 0; policy accept;",
        f'    iifname != "lo" {_loss_rule(loss_rate)}',
        "  }",
        "}"]) + "\n"


def ethtool_args(dev: str, host_end: bool, loss_rate: float = 0.0) -> list[str]:
    """``ethtool -K`` arguments for one veth end.

    Every end sends wire packets (``tso off``, ``tx-udp-segmentation off``: the kernel cuts
    GSO runs and TCP super-packets in software after the qdisc, so tbf shapes the run and the
    link carries single datagrams). GRO is on at every end when ``loss_rate`` is 0 (there are
    no loss rules; UDP_GRO sockets, the switch's among them, get batches: measured, the
    switch at MTU 1500 went from 35% to 52% of the line rate with it) and off at every end
    when it is above 0 (the loss rules, in the router's input and forward chains and in each
    host's input chain, run after GRO and would drop a merged batch whole)."""
    del host_end  # both ends alike: kept for the call sites' clarity
    gro = "on" if loss_rate == 0 else "off"
    return [dev, "tso", "off", "tx-udp-segmentation", "off", "gro", gro]

"""A star topology as plain data, and its translation into tc, nft and ethtool arguments (no
root)."""

from __future__ import annotations

from dataclasses import dataclass

from switchml.protocol.errors import ConfigError

__all__ = ["LinkSpec", "Topology", "ethtool_args", "nft_loss_ruleset", "tbf_args"]


GSO_RUN_BYTES = 72 * 1024
"""The largest GSO run as tbf counts it: 64 KiB of payload plus 64 segments' headers."""


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One full-duplex link; both directions get the same shaping and loss."""

    bandwidth_bps: float | None = 1e9
    """Line rate in bits/s (tc tbf on both ends); None for unshaped."""
    loss_rate: float = 0.0
    """Probability (0..1) that a wire packet (one datagram, one TCP segment) is dropped on each
    link it crosses (nftables numgen in the router namespace)."""
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
    """A star: worker i <-> router <-> ..., plus a parameter-server host on the router, and the
    switch host (where ``switchml switch`` runs) on an internal, unshaped, lossless link of the
    router: the router and the switch host together stand for the rack switch.

    The switch runs apart from the router so that the loss rules (in the router, on every
    forwarded packet) see each datagram alone while receivers still get GRO batches: the
    kernel cuts a GSO run into datagrams on the sender's link, the router drops datagrams, and
    the receiving host's link merges what is left (see docs/testbed.md).
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
        """The switch host's address: what every worker (``i`` is ignored) talks to."""
        return f"{self.subnet}.{self.switch_link}.2"

    @property
    def ps_ip(self) -> str:
        return f"{self.subnet}.{self.ps_link}.2"

    @property
    def ps_link(self) -> int:
        return 250

    @property
    def switch_link(self) -> int:
        """Number of the internal link router <-> switch host (unshaped, lossless)."""
        return 251


def tbf_args(link: LinkSpec) -> list[str]:
    """``tc qdisc add ... root`` arguments for one direction of ``link``; [] if unshaped."""
    if link.bandwidth_bps is None:
        return []
    return ["tbf", "rate", f"{int(link.bandwidth_bps)}bit", "burst", str(link.burst_bytes),
            "latency", f"{int(link.queue_s * 1000)}ms"]


def nft_loss_ruleset(table: str, loss_rate: float, internal_dev: str) -> str:
    """The router's nft script: each packet is dropped with probability ``loss_rate`` once for
    the link it came in on and once for the link it goes out on (forward; input for packets
    addressed to the router itself), except the internal link ``internal_dev`` to the switch
    host. Dropping in the router, not on output, means senders never see EPERM; dropping
    before the receiving host's GRO means each wire datagram is dropped on its own."""
    ppm = round(loss_rate * 1_000_000)
    rule = f"numgen random mod 1000000 < {ppm} counter drop"
    return "\n".join([
        f"table inet {table} {{",
        "  chain forward {",
        "    type filter hook forward priority 0; policy accept;",
        f'    iifname != "{internal_dev}" {rule}',
        f'    oifname != "{internal_dev}" {rule}',
        "  }",
        "  chain input {",
        "    type filter hook input priority 0; policy accept;",
        f'    iifname != "{internal_dev}" iifname != "lo" {rule}',
        "  }",
        "}"]) + "\n"


def ethtool_args(dev: str, host_end: bool) -> list[str]:
    """``ethtool -K`` arguments for one veth end: every end sends wire packets (no TSO, no UDP
    segmentation offload: the kernel cuts GSO runs and TCP super-packets in software after the
    qdisc, so tbf shapes the run and the link carries single datagrams); host ends merge what
    arrives with GRO (so a UDP_GRO socket gets batches), router ends do not (so the loss rules
    see single datagrams)."""
    return [dev, "tso", "off", "tx-udp-segmentation", "off", "gro", "on" if host_end else "off"]

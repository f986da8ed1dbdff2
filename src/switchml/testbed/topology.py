"""A star topology as plain data, and its translation into tc and nft arguments (no root)."""

from __future__ import annotations

from dataclasses import dataclass

from switchml.protocol.errors import ConfigError

__all__ = ["LinkSpec", "Topology", "nft_loss_ruleset", "tbf_args"]


@dataclass(frozen=True, slots=True)
class LinkSpec:
    """One full-duplex link; both directions get the same shaping and loss."""

    bandwidth_bps: float | None = 1e9
    """Line rate in bits/s (tc tbf on both ends); None for unshaped."""
    loss_rate: float = 0.0
    """Probability (0..1) that a packet is dropped where it arrives (nftables numgen)."""
    mtu: int = 9000
    """Link MTU in bytes (68..65535; veth takes jumbo frames up to 65535)."""
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
        """tbf bucket: at least two MTUs, and about 1 ms of line rate."""
        rate = self.bandwidth_bps or 0.0
        return max(2 * (self.mtu + 14), int(rate / 8 / 1000))


@dataclass(frozen=True, slots=True)
class Topology:
    """A star: worker i <-> switch <-> ..., plus a parameter-server host on the switch."""

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

    def switch_ip(self, i: int) -> str:
        """The switch's address on worker i's link (what worker i talks to)."""
        return f"{self.subnet}.{i}.1"

    @property
    def ps_ip(self) -> str:
        return f"{self.subnet}.250.2"

    @property
    def ps_link(self) -> int:
        return 250


def tbf_args(link: LinkSpec) -> list[str]:
    """``tc qdisc add ... root`` arguments for one direction of ``link``; [] if unshaped."""
    if link.bandwidth_bps is None:
        return []
    return ["tbf", "rate", f"{int(link.bandwidth_bps)}bit", "burst", str(link.burst_bytes),
            "latency", f"{int(link.queue_s * 1000)}ms"]


def nft_loss_ruleset(table: str, loss_rate: float, hooks: tuple[str, ...]) -> str:
    """An nft script dropping ``loss_rate`` of the packets at each of ``hooks`` (input,
    forward): where packets arrive, so senders never see EPERM."""
    ppm = round(loss_rate * 1_000_000)
    lines = [f"table inet {table} {{"]
    for hook in hooks:
        lines += [f"  chain {hook} {{",
                  f"    type filter hook {hook} priority 0; policy accept;",
                  f"    numgen random mod 1000000 < {ppm} counter drop",
                  "  }"]
    lines.append("}")
    return "\n".join(lines) + "\n"

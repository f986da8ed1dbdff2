"""What a simulated all-reduce reports, in either mode (``timing.py``, ``exact.py``): per class
of links, the frames, bytes, drops and utilisation (``LinkStats``); per run, the time, the rate
against the line and ring bounds, the retransmissions and the checked results (``SimReport``,
as ``switchml sim --json`` writes it)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from switchml.sim.config import SimConfig

__all__ = ["LinkStats", "SimReport"]


@dataclass
class LinkStats:
    """Frames and bytes a class of links carried, and what it dropped."""

    name: str
    count: int
    frames: int = 0
    bytes: int = 0
    queue_drops: int = 0
    losses: int = 0
    failed_drops: int = 0
    busy_s: np.ndarray = field(default=None)  # type: ignore[assignment]

    def utilisation(self, elapsed_s: float) -> dict[str, float]:
        """Mean and max fraction of ``elapsed_s`` the links of this class were sending."""
        if elapsed_s <= 0 or self.busy_s is None or not len(self.busy_s):
            return {"mean": 0.0, "max": 0.0}
        u = self.busy_s / elapsed_s
        return {"mean": float(u.mean()), "max": float(u.max())}

    def as_dict(self, elapsed_s: float) -> dict[str, object]:
        return {"links": self.count, "frames": self.frames, "bytes": self.bytes,
                "queue_drops": self.queue_drops, "losses": self.losses,
                "failed_drops": self.failed_drops, "utilisation": self.utilisation(elapsed_s)}


@dataclass
class SimReport:
    """What one simulated all-reduce did. ``ate_per_s`` = elements / elapsed (slowest worker,
    from time 0)."""

    mode: str
    config: SimConfig
    elapsed_s: float
    elements: int
    ok: bool
    error: str | None
    retransmissions: int
    rack_retransmissions: int
    links: list[LinkStats]
    events: int
    wall_s: float
    results_checked: int = 0
    max_abs_error: float = 0.0
    extra: dict[str, object] = field(default_factory=dict)

    @property
    def ate_per_s(self) -> float:
        return self.elements / self.elapsed_s if self.ok and self.elapsed_s > 0 else 0.0

    @property
    def fraction_of_line_rate(self) -> float:
        return self.ate_per_s / self.config.line_bound_ate

    def as_dict(self) -> dict[str, object]:
        c = self.config
        return {
            "mode": self.mode, "workers": c.workers, "racks": c.racks,
            "size_bytes": c.size_bytes, "numel": self.elements, "rate_bps": c.access.rate_bps,
            "spine_rate_bps": c.spine_link.rate_bps, "mtu": c.mtu,
            "elements_per_packet": c.elements_per_packet, "window": c.slots,
            "loss_rate": c.access.loss_rate, "delay_s": c.access.delay_s,
            "host_cost_s": c.host_cost_s, "host_element_cost_s": c.host_element_cost_s,
            "threads": c.threads, "switch_request_cost_s": c.switch_request_cost_s,
            "switch_element_cost_s": c.switch_element_cost_s, "shards": c.shards,
            "stragglers": {
                "count": c.stragglers.count, "slowdown": c.stragglers.slowdown,
                "delay_s": c.stragglers.delay_s},
            "failures": [{"kind": f.kind, "index": f.index, "at_s": f.at_s}
                         for f in c.failures],
            "seed": c.seed, "ok": self.ok, "error": self.error,
            "elapsed_s": self.elapsed_s, "ate_per_s": self.ate_per_s,
            "bound_line_ate": c.line_bound_ate, "bound_ring_ate": c.ring_bound_ate,
            "fraction_of_line_rate": self.fraction_of_line_rate,
            "retransmissions": self.retransmissions,
            "rack_retransmissions": self.rack_retransmissions,
            "links": {s.name: s.as_dict(self.elapsed_s) for s in self.links},
            "events": self.events, "wall_s": self.wall_s,
            "results_checked": self.results_checked, "max_abs_error": self.max_abs_error,
            **self.extra,
        }

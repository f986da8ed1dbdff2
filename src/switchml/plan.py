"""``switchml plan``: the worker threads and switch shards a job needs at a given line rate.

The same calibrated model as ``switchml predict`` (``costs.py``, ``sim.timing``):

1. **Size** from the costs alone: an all-reduce of ``size`` bytes takes the wire ``t_w`` (a
   worker's link, one way, frames included); a worker's CPU ``t_c`` for one thread and the
   switch's ``t_s`` for one core. Reaching ``share`` of line rate needs
   ``T = ceil(share * t_c / t_w)`` threads and ``S = ceil(share * t_s / t_w)`` shards.
2. **Check** with the timing simulator (the protocol's window, the links, each worker's and
   the switch's CPU queue): while the simulated share falls short, add a thread or a shard,
   to whichever of the two is busier, and simulate again.
3. **Compare** with gloo's ring on the same links, charged its CPU per element, and the ring's
   ceiling (switchml moves ``1 / (2 (n - 1) / n)`` of its bytes).

Shards go to hosts of ``cores_per_host`` cores each (a shard per core).
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any

from switchml.costs import Costs
from switchml.costs import load as load_costs
from switchml.protocol.config import MAX_THREADS
from switchml.protocol.errors import ConfigError

__all__ = ["Plan", "plan"]

_MAX_STEPS = 12


@dataclass
class Plan:
    workers: int
    rate_bps: float
    mtu: int
    size_bytes: int
    threads: int
    shards: int
    switch_hosts: int
    share: float
    """The simulated all-reduce rate over B/32 (the in-network bound)."""
    switchml_s: float
    gloo_s: float
    ring_ceiling: float
    """gloo's time / switchml's where both run at their wire's bound: 2 (n - 1) / n."""
    bound_by: str
    """What binds the planned all-reduce: wire, worker CPU or switch CPU."""
    costs_source: str

    @property
    def speedup(self) -> float:
        return self.gloo_s / self.switchml_s if self.switchml_s else 0.0

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "speedup": self.speedup}


def plan(*, workers: int, rate_bps: float, mtu: int = 1500, share: float = 0.9,
         size_bytes: int = 64 << 20, costs: Costs | None = None, cores_per_host: int = 16
         ) -> Plan:
    """The threads and shards that reach ``share`` of line rate (see the module's docstring).

    Raises:
        ConfigError: an argument out of range.
    """
    from switchml.predict import (
        Resources,
        gloo_allreduce_s,
        switchml_allreduce_s,
        switchml_resources_s,
    )
    if workers < 1 or rate_bps <= 0 or not 0 < share <= 1 or cores_per_host < 1:
        raise ConfigError(f"need workers >= 1, a rate > 0, 0 < share <= 1 and cores per host "
                          f">= 1; got {workers}, {rate_bps}, {share}, {cores_per_host}")
    if size_bytes < 4 or size_bytes % 4:
        raise ConfigError(f"size must be a positive multiple of 4 bytes, got {size_bytes}")
    costs = costs or load_costs()
    numel = size_bytes // 4
    link = dict(workers=workers, rate_bps=rate_bps, mtu=mtu)
    alone = switchml_resources_s(numel, res=Resources(costs), **link)
    threads = max(1, math.ceil(share * alone["worker CPU"] / alone["wire"]))
    shards = max(1, math.ceil(share * alone["switch CPU"] / alone["wire"]))
    threads = min(threads, MAX_THREADS)
    for _ in range(_MAX_STEPS):
        res = Resources(costs, threads, shards)
        took = switchml_allreduce_s(numel, res=res, **link)
        reached = numel * 32 / rate_bps / took
        if reached >= share:
            break
        busy = switchml_resources_s(numel, res=res, **link)
        if busy["worker CPU"] >= busy["switch CPU"] and threads < MAX_THREADS:
            threads += 1
        else:
            shards += 1
    busy = switchml_resources_s(numel, res=Resources(costs, threads, shards), **link)
    return Plan(workers=workers, rate_bps=rate_bps, mtu=mtu, size_bytes=size_bytes,
                threads=threads, shards=shards, switch_hosts=-(-shards // cores_per_host),
                share=reached, switchml_s=took,
                gloo_s=gloo_allreduce_s(numel, costs=costs, **link),
                ring_ceiling=2 * (workers - 1) / workers if workers > 1 else 1.0,
                bound_by=max(busy, key=busy.__getitem__), costs_source=costs.source)

"""Hierarchical aggregation on the testbed (``switchml bench allreduce --testbed --racks R``):
racks of workers, each around its router with its rack switch, under a spine switch; beside it
one rack alone on a plain switch, the baseline."""

from __future__ import annotations

import json
from typing import Any

from switchml.bench.testbed import (
    SWITCH_PORT,
    TestbedBenchConfig,
    _ate_row,
    _cpu_percent,
    _nsproc,
    _start_server,
    _start_workers,
    _stop_servers,
    _wait_all,
)
from switchml.testbed import LinkSpec

__all__ = ["run_testbed_tree"]


def _tree_row(cfg: TestbedBenchConfig, system: str, n: int, size: int,
              rows: list[dict[str, Any]], **extra: Any) -> dict[str, Any]:
    return {**_ate_row(cfg, system, n, size, rows, 0.0),
            "max_abs_error": max(r["max_abs_error"] for r in rows),
            "retransmissions": sum(r["retransmissions"] for r in rows),
            "cpu_percent": _cpu_percent(rows), **extra}


_RACK_PORT = SWITCH_PORT + 1
"""Where the switch in a rack's router listens (the spine's is ``SWITCH_PORT``)."""


def _run_tree(tb: Any, cfg: TestbedBenchConfig, racks: int, size: int) -> dict[str, Any]:
    """The tree: one rack switch per rack (a fresh one per job) under the spine, every
    worker of every rack; its row, with the rack switches' reports."""
    from switchml.control import encode_job_spec, new_job_spec
    from switchml.protocol.tree import tree_specs
    geo, per = tb.geo, cfg.workers
    common = {"numel": size // 4, "warmup": cfg.warmup, "iters": cfg.iters}
    spec = new_job_spec(per * racks, window=cfg.window,
                        elements_per_packet=cfg.elements_per_packet)
    child = encode_job_spec(tree_specs(spec, racks)[1])
    rack_procs = [_start_server(tb, tb.dc_ns(j), "rack", {
        "port": _RACK_PORT, "upstream": geo.wan_core_ip(j), "upstream_port": SWITCH_PORT,
        "rack": j, "racks": racks, "spec": encode_job_spec(spec)},
        f"rack switch {j} did not start") for j in range(racks)]
    expect = racks * per * (per + 1) / 2
    procs = _start_workers(tb, range(geo.workers), lambda i: _nsproc("switchml", {
        **common, "spec": child, "rank": i - geo.first_workers[geo.dc_of(i)],
        "switch": geo.gateway_ip(i), "port": _RACK_PORT, "expect": expect}))
    rows = _wait_all(procs, cfg.timeout_s)
    trees = [json.loads(line or "{}") for line in _stop_servers(rack_procs)]
    return _tree_row(cfg, "switchml-tree", geo.workers, size, rows, racks=racks,
                     rack_switches=trees)


def _run_one_rack(tb: Any, cfg: TestbedBenchConfig, size: int) -> dict[str, Any]:
    """The baseline: rack 0's workers alone, on a plain switch in their rack's router."""
    from switchml.control import encode_job_spec, new_job_spec
    geo, per = tb.geo, cfg.workers
    common = {"numel": size // 4, "warmup": cfg.warmup, "iters": cfg.iters}
    flat = _start_server(tb, tb.dc_ns(0), "switch", {"port": _RACK_PORT},
                         "the rack's switch did not start")
    spec1 = encode_job_spec(new_job_spec(per, window=cfg.window,
                                         elements_per_packet=cfg.elements_per_packet))
    procs = _start_workers(tb, range(per), lambda i: _nsproc("switchml", {
        **common, "spec": spec1, "rank": i, "switch": geo.gateway_ip(i),
        "port": _RACK_PORT}))
    rows = _wait_all(procs, cfg.timeout_s)
    _stop_servers([flat])
    return _tree_row(cfg, "switchml-rack", per, size, rows, racks=1)


def run_testbed_tree(cfg: TestbedBenchConfig, racks: int, progress: Any = None
                     ) -> list[dict[str, Any]]:
    """Hierarchical aggregation on the testbed: ``racks`` racks of ``cfg.workers`` workers, each
    rack a star around its router (in which its rack switch runs), the racks' routers joined
    to a spine router (in which the spine switch runs) by links of the same rate. Per size: the
    tree (``switchml-tree``: every worker of every rack) and, as the baseline, rack 0's workers
    alone on a plain switch in their rack's router (``switchml-rack``: one rack's line rate)."""
    from switchml.testbed import GeoTestbed, GeoTopology
    if cfg.loss_rate > 0:
        raise ValueError("TestbedBenchConfig.loss_rate with racks: the tree testbed applies no "
                         "loss yet; simulate a lossy tree instead: switchml sim --racks R --loss "
                         "L --mode exact")
    if cfg.auth_data:
        raise ValueError("TestbedBenchConfig.auth_data with racks: a job under a parent switch "
                         "has no authenticated data plane yet")
    per = cfg.workers
    link = LinkSpec(bandwidth_bps=cfg.rate_bps, mtu=cfg.mtu)
    geo = GeoTopology(dcs=(per,) * racks, lan=link, wan=link)
    out: list[dict[str, Any]] = []
    with GeoTestbed(geo) as tb:
        spine = _start_server(tb, tb.router_ns, "switch", {"port": SWITCH_PORT},
                              "the spine switch did not start")
        for size in cfg.sizes_bytes:
            if progress is not None:
                progress(f"tree of {racks} racks x {per}, {size} B")
            out.append(_run_tree(tb, cfg, racks, size))
            if progress is not None:
                progress(f"one rack of {per}, {size} B")
            out.append(_run_one_rack(tb, cfg, size))
        _stop_servers([spine])
    return out

"""``switchml testbed``: an emulated star network (or, with ``--dcs``, the geo one), held until
Ctrl-C.
"""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_link_options,
    add_workers_option,
    stop_on_signals,
    wait_for,
)

if TYPE_CHECKING:
    from switchml.testbed import GeoTopology, Topology

__all__ = ["add_parser", "config_from_args", "geo_config_from_args", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml testbed``: an emulated star network (or, with ``--dcs``, the geo one)."""
    tb = sub.add_parser(
        "testbed", help="build an emulated star network and hold it until Ctrl-C (root)",
        description="Build the emulated network (one namespace per worker, a router in which "
                    "the switch runs, a parameter server; veth links shaped with tc tbf "
                    "both ways, nftables loss per datagram once per link, UDP GSO/GRO on), "
                    "print how to run things in it, and "
                    "tear it down on Ctrl-C or SIGTERM, removing exactly what it created.")
    add_workers_option(tb, "worker hosts")
    add_link_options(tb)
    tb.add_argument("--cleanup", action="store_true",
                    help="only remove what testbed runs killed before their teardown (kill "
                         "-9) left behind: their namespaces and the processes in them; every "
                         "new testbed also does this first")
    tb.add_argument("--dcs", default=None,
                    help="build the geo testbed instead: data centres x workers, e.g. 2x2 or "
                         "2,3 (workers on --rate-mbit LAN links, data centres joined by "
                         "--wan-mbit WAN links)")
    tb.add_argument("--wan-mbit", type=float, default=50.0,
                    help="with --dcs: WAN link rate in Mbit/s (default 50)")
    tb.add_argument("--wan-rtt-ms", type=float, default=0.0,
                    help="with --dcs: round-trip time added between data centres, ms "
                         "(default 0; a user-space delay line in the WAN core, as this "
                         "kernel may lack netem)")
    tb.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> Topology:
    """The star network ``args`` describe (``--rate-mbit 0``: unshaped links)."""
    from switchml.testbed import LinkSpec, Topology
    link = LinkSpec(bandwidth_bps=args.rate_mbit * 1e6 if args.rate_mbit else None,
                    loss_rate=args.loss, mtu=args.mtu)
    return Topology(workers=args.workers, link=link)


def geo_config_from_args(args: argparse.Namespace) -> GeoTopology:
    """The geo network of ``--dcs`` (LAN links at ``--rate-mbit``, WAN at ``--wan-mbit``)."""
    from switchml.gaia.rules import parse_dc_layout
    from switchml.testbed import GeoTopology, LinkSpec
    sizes = tuple(len(dc) for dc in parse_dc_layout(args.dcs))
    return GeoTopology(dcs=sizes, lan=LinkSpec(bandwidth_bps=args.rate_mbit * 1e6 or None,
                                               mtu=args.mtu),
                       wan=LinkSpec(bandwidth_bps=args.wan_mbit * 1e6, mtu=args.mtu),
                       wan_rtt_s=args.wan_rtt_ms / 1000)


def run(args: argparse.Namespace) -> int:
    """``switchml testbed``: build the star network (or the geo one) and hold it."""
    from switchml.testbed import Testbed, check_environment, cleanup_stale

    if args.cleanup:
        check_environment()
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)"
              + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if getattr(args, "dcs", None):
        return _run_geo_testbed(args)
    topology = config_from_args(args)
    link = topology.link
    stop = stop_on_signals("stopping")
    with Testbed(topology) as bed:
        topo = bed.topology
        print(f"testbed {bed.prefix} is up: {args.workers} workers, {link}")
        print(f"  switch (in the router):  ip netns exec {bed.switch_ns} switchml switch "
              "--host 0.0.0.0 --insecure")
        for i in range(args.workers):
            print(f"  worker {i}: ip netns exec {bed.worker_ns(i)} ...   (address "
                  f"{topo.worker_ip(i)}, switch at {topo.switch_ip(i)}, its gateway)")
        print(f"  parameter server host: ip netns exec {bed.ps_ns} ...   ({topo.ps_ip})")
        print("  router (uplink loss rules: nft list ruleset; downlink loss rules are in "
              f"each host): ip netns exec {bed.router_ns} ...")
        print("  UDP GSO/GRO batching: " + ("on, loss per datagram" if bed.batching else
                                            "off (no ethtool): SWITCHML_GSO=0 in there"))
        print("Ctrl-C tears it down.", flush=True)
        wait_for(stop)
    print("testbed removed")
    return 0


def _run_geo_testbed(args: argparse.Namespace) -> int:
    """``switchml testbed --dcs``: build the geo testbed and hold it."""
    from switchml.testbed import GeoTestbed
    topo = geo_config_from_args(args)
    sizes = topo.dcs
    stop = stop_on_signals("stopping")
    with GeoTestbed(topo) as bed:
        print(f"geo testbed {bed.prefix} is up: data centres {sizes}, LAN {topo.lan}, "
              f"WAN {topo.wan}, round trip between data centres +{topo.wan_rtt_s * 1000:g} ms"
              + (f" (delay line: TUN device {bed.delay_device} in the WAN core)"
                 if topo.wan_rtt_s else ""))
        for j in range(len(sizes)):
            print(f"  data centre {j}: router ip netns exec {bed.dc_ns(j)} ...  (WAN device "
                  f"{bed.wan_device(j)})")
            for i in topo.workers_of(j):
                print(f"    worker {i}: ip netns exec {bed.worker_ns(i)} ...  "
                      f"({topo.worker_ip(i)}; SWITCHML_DC={j})")
        print(f"  WAN core: ip netns exec {bed.router_ns} ...")
        print("Ctrl-C tears it down.", flush=True)
        wait_for(stop)
    print("testbed removed")
    return 0

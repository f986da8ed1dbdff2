"""``switchml plan``: worker threads and switch shards for a line rate, from the calibrated
model."""

from __future__ import annotations

import argparse

from switchml.cli.common import (
    Subparsers,
    add_calibration_option,
    add_json_option,
    add_mtu_option,
    add_workers_option,
    size,
)

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml plan``: size a deployment for N workers at B Gbit/s."""
    pl = sub.add_parser(
        "plan", help="the worker threads and switch shards a job needs at a line rate",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Size switchml for N workers on links of B Gbit/s: the I/O threads per\n"
                    "worker and the switch shards (a core each, on hosts of --cores-per-host)\n"
                    "that reach --share of line rate, found from this machine's calibrated\n"
                    "CPU costs (`switchml calibrate`; the reference machine's where it never\n"
                    "ran) and checked with the timing simulator; with the predicted all-reduce\n"
                    "time against gloo's ring on the same links (charged its CPU too).",
        epilog="Example: switchml plan --workers 8 --rate-gbit 10 --rate-gbit 100")
    add_workers_option(pl, default=8)
    pl.add_argument("--rate-gbit", type=float, action="append", dest="rates",
                    help="link rate in Gbit/s; repeatable (default 10, 25 and 100)")
    add_mtu_option(pl, help="path MTU (default 1500)")
    pl.add_argument("--share", type=float, default=0.9,
                    help="the share of line rate (B/32 elements/s) to reach (default 0.9)")
    pl.add_argument("--size", type=size, default=64 << 20,
                    help="the all-reduce to plan for (default 64MiB)")
    pl.add_argument("--cores-per-host", type=int, default=16,
                    help="cores per switch host, one shard each (default 16)")
    add_calibration_option(pl, help="a calibration file (default: the one "
                                    "`switchml calibrate` wrote)")
    add_json_option(pl, "the plans")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``switchml plan``: one row per rate."""
    from rich.console import Console
    from rich.table import Table

    from switchml.cli.common import stdout_console, write_json
    from switchml.costs import load
    from switchml.plan import plan

    costs = load(args.calibration)
    plans = []
    with Console(stderr=True).status("planning") as status:
        for gbit in args.rates or [10.0, 25.0, 100.0]:
            status.update(f"simulating {args.workers} workers at {gbit:g} Gbit/s")
            plans.append(plan(workers=args.workers, rate_bps=gbit * 1e9, mtu=args.mtu,
                              share=args.share, size_bytes=args.size, costs=costs,
                              cores_per_host=args.cores_per_host))
    table = Table(title=f"{args.workers} workers, MTU {args.mtu}, {args.size / 2**20:g} MiB "
                        f"all-reduce, aiming at {args.share:.0%} of line rate; CPU costs: "
                        f"{costs.source}")
    for col in ("Gbit/s", "threads per worker", "switch shards", "switch hosts",
                "of line rate", "bound by", "switchml (ms)", "gloo (ms)", "vs gloo",
                "ring's ceiling"):
        table.add_column(col, justify="right")
    for p in plans:
        table.add_row(f"{p.rate_bps / 1e9:g}", str(p.threads), str(p.shards),
                      str(p.switch_hosts), f"{p.share:.1%}", p.bound_by,
                      f"{p.switchml_s * 1e3:.1f}", f"{p.gloo_s * 1e3:.1f}",
                      f"{p.speedup:.2f}x", f"{p.ring_ceiling:.2f}x")
    stdout_console().print(table)
    if args.json:
        write_json(args.json, {"command": "switchml plan", "plans": [p.to_dict() for p in plans]})
    return 0

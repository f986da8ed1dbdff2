"""``switchml bench fuzz``: hostile datagrams at a switch while a job runs."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_json_option,
    figure_table,
    stdout_console,
    write_json,
)

if TYPE_CHECKING:
    from switchml.bench.soak import FuzzConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench fuzz``: hostile datagrams at a switch."""
    fz = bsub.add_parser(
        "fuzz", help="hostile datagrams at a switch while a job runs",
        description="Send hostile datagrams (random bytes, truncated and oversized ones, valid "
                    "headers with wrong fields, forged requests, JOIN floods) at a fresh switch "
                    "while a 2-rank job runs; report drops, the job's results and the switch's "
                    "memory.")
    fz.add_argument("--datagrams", type=int, default=1_000_000,
                    help="hostile datagrams in all (default 1000000)")
    fz.add_argument("--senders", type=int, default=2, help="sender processes (default 2)")
    fz.add_argument("--rate", type=float, default=20_000.0,
                    help="datagrams per second per sender (default 20000; 0: unpaced)")
    fz.add_argument("--no-secret", action="store_true",
                    help="run the switch without a job-creation secret (JOIN floods then fill "
                         "the pool, which bounds the memory)")
    fz.add_argument("--joins", action="store_true",
                    help="send only well-formed JOINs of new jobs, half asking for a "
                         "challenge and half with a forged cookie (a flood meant to cost the "
                         "switch CPU), and report the job's rate alone and during the flood")
    add_json_option(fz, "the report")
    fz.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> FuzzConfig:
    """The fuzzing run ``args`` describe."""
    from switchml.bench.soak import FuzzConfig
    return FuzzConfig(datagrams=args.datagrams, senders=args.senders,
                      rate_per_sender=args.rate, secret=not args.no_secret,
                      joins=args.joins)


def run(args: argparse.Namespace) -> int:
    """``switchml bench fuzz``: status 1 on a wrong or failed legitimate result or an internal
    error of the switch."""
    from rich.console import Console

    from switchml.bench.soak import run_fuzz

    cfg = config_from_args(args)
    console = Console(stderr=True)
    with console.status("fuzzing") as status:
        rep = run_fuzz(cfg, lambda st: status.update(
            f"fuzzing: switch received {st['packets_in']:,} datagrams, dropped "
            f"{sum(st['drops'].values()):,}"))
    rss = [m[1] for m in rep["memory"]]
    alone, during = rep["legit_elements_per_s_alone"], rep["legit_elements_per_s_during"]
    t = figure_table(
        f"fuzz: {rep['datagrams_sent']:,} hostile datagrams in {rep['seconds']} s", (
            ("switch datagrams received", f"{rep['switch_packets_in']:,}"),
            ("switch internal errors", rep["internal_errors"]),
            ("legit operations / wrong / errors",
             f"{rep['legit_operations']} / {rep['legit_wrong_results']} / "
             f"{len(rep['legit_errors'])}"),
            ("switch RSS before / max / after (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("jobs at end", rep["jobs_at_end"]),
            ("flood: hostile datagrams/s", f"{rep['flood_datagrams_per_s']:,.0f}"),
            ("job: elements/s alone / during the flood",
             f"{alone:,.0f} / {during:,.0f} ({during / max(alone, 1):.2f}x)")))
    for reason, n in sorted(rep["drops"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"drops: {reason}", f"{n:,}")
    stdout_console().print(t)
    if args.json:
        write_json(args.json, rep)
    bad = rep["legit_wrong_results"] or rep["legit_errors"] or rep["internal_errors"]
    return 1 if bad else 0

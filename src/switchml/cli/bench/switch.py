"""``switchml bench switch``: one software switch"s capacity (or a sharded switch"s)."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_json_option,
    add_shards_option,
    add_workers_option,
    figure_table,
    sigterm_interrupts,
    stdout_console,
)

if TYPE_CHECKING:
    from rich.table import Table

    from switchml.bench.switchcap import SwitchCapConfig, SwitchCapResult

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench switch``: one software switch's capacity."""
    sc = bsub.add_parser(
        "switch", help="switch capacity: aggregated datagrams/s of a software switch",
        description="Run the software switch in a process pinned to one core and a traffic "
                    "generator pinned to another, which joins a job as N ranks and replays "
                    "valid int32 requests as fast as the switch answers (W slots in flight per "
                    "rank, self-clocked). Report datagrams/s in and out of the switch, payload "
                    "GB/s, switch and generator CPU (which one was the bottleneck), switch CPU "
                    "time per datagram, drops and wrong results (must be 0). With --shards S, "
                    "S switch processes (as `switchml switch --shards S`) each own lanes i mod "
                    "S of the job, one generator per shard feeds them, and the figures are "
                    "given per shard and summed; compare S = 1, 2, ... on a machine with 2S "
                    "cores to see how capacity grows with shards.")
    add_workers_option(sc, "ranks in the job")
    sc.add_argument("--elements-per-packet", "-k", type=int, default=256,
                    help="int32 elements per request, K (default 256 = 1 KiB payload; 358 fits "
                         "a 1500-byte MTU, 2200 a 9000-byte one)")
    sc.add_argument("--window", "-w", type=int, default=64,
                    help="slots in flight per rank, W (default 64)")
    sc.add_argument("--seconds", type=float, default=5.0,
                    help="measured interval in seconds, after 0.5 s of warm-up (default 5)")
    sc.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True,
                    help="UDP GSO/GRO in the switch and the generator (default on)")
    add_shards_option(sc, metavar="S",
                      help="switch processes the job's lanes are striped over (default 1; W must "
                           "be at least S)")
    sc.add_argument("--generators", type=int, default=0, metavar="G",
                    help="generator processes, each feeding S/G of the shards (default 0: "
                         "one per shard)")
    add_json_option(sc, "the figures")
    sc.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SwitchCapConfig:
    """The capacity measurement ``args`` describe."""
    from switchml.bench.switchcap import SwitchCapConfig
    return SwitchCapConfig(workers=args.workers, elements_per_packet=args.elements_per_packet,
                           window=args.window, seconds=args.seconds, batching=args.batching,
                           shards=args.shards, generators=args.generators)


def run(args: argparse.Namespace) -> int:
    """``switchml bench switch``: status 1 on wrong results, drops or switch errors."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from switchml.bench.switchcap import run_switchcap, write_json

    cfg = config_from_args(args)
    sigterm_interrupts()  # SIGTERM runs the benchmark's teardown
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("starting", total=1.0)
            r = run_switchcap(cfg, progress=lambda text, frac: bar.update(
                task, description=text, completed=frac))
    except KeyboardInterrupt:
        console.print("interrupted; the switch and the generator were stopped"
                      if cfg.shards == 1 else
                      "interrupted; the shards and the generators were stopped")
        return 130
    stdout_console().print(_switchcap_table(cfg, r))
    if args.json:
        write_json(args.json, r)
        console.print(f"wrote {args.json}")
    bad = (r.wrong_results or not r.consistent or r.drops
           or any(r.switch_errors.values()))
    return 1 if bad else 0


def _switchcap_table(cfg: SwitchCapConfig, r: SwitchCapResult) -> Table:
    """The switch capacity figures."""
    g = r.generator
    sharded = cfg.shards > 1
    where = (f", {cfg.shards} shards, {r.config['generators']} generators" if sharded else "")
    per_shard = [(f"shard {f['shard']}: datagrams/s in; CPU %; us per datagram",
                  f"{f['in_per_s']:,.0f}; {f['cpu_percent']:.0f}; "
                  f"{f['cpu_us_per_datagram']:.2f}") for f in r.shards] if sharded else []
    return figure_table(
        f"switch capacity: {cfg.workers} ranks x {cfg.window} slots, K = "
        f"{cfg.elements_per_packet} int32 ({cfg.datagram_bytes} B datagrams), "
        f"{r.interval_s:.1f} s, batching {'on' if cfg.batching else 'off'}{where}", (
            ("datagrams/s into the switch", f"{r.switch_in_per_s:,.0f}"),
            ("datagrams/s out of the switch", f"{r.switch_out_per_s:,.0f}"),
            ("payload GB/s (requests x K x 4 B)", f"{r.payload_gbytes_per_s:.3f}"),
            ("switch CPU time per datagram in (us)", f"{r.switch_cpu_us_per_datagram:.2f}"),
            ("datagrams/s in at 100% of a core per shard (sum of 1e6 / us per datagram)"
             if sharded else "datagrams/s in at 100% of a core (1e6 / us per datagram)",
             f"{r.switch_capacity_per_s:,.0f}"),
            *per_shard,
            ("switch CPU %" + (" (shards summed)" if sharded else ""),
             f"{r.switch_cpu_percent:.0f}"),
            ("generator CPU %" + (" (summed)" if sharded else ""),
             f"{r.generator_cpu_percent:.0f}"),
            ("other CPU % (rest of the machine)", f"{r.other_cpu_percent:.0f}"),
            ("bottleneck", r.bottleneck),
            ("results received (whole run)", f"{g['results_total']:,}"),
            ("requests sent - in flight at end",
             f"{g['requests_total']:,} - {g['in_flight_at_end']}"),
            ("wrong results", r.wrong_results),
            ("retransmissions", g["retransmissions_total"]),
            ("unexpected replies", g["unexpected_total"] or 0),
            ("switch drops", r.drops or 0),
            ("switch errors", {k: v for k, v in r.switch_errors.items() if v} or 0),
            ("GSO / GRO (switch; generator)",
             f"{r.switch_stats.get('gso')} / {r.switch_stats.get('gro')}; "
             f"{g['gso']} / {g['gro']}")))

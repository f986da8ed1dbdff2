"""``switchml bench soak``: jobs with loss and churn against one switch, every result checked."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_json_option,
    add_seed_option,
    figure_table,
    stdout_console,
    write_json,
)

if TYPE_CHECKING:
    from switchml.bench.soak import SoakConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench soak``: long runs with loss and churn, every result checked."""
    so = bsub.add_parser(
        "soak", help="jobs with loss and churn against one switch: exact or error, never wrong",
        description="Run several jobs of worker processes (int32 all-reduces, every result "
                    "checked exactly) with seeded loss in every worker, while jobs stop and "
                    "start and workers are killed; report operations, errors, wrong results "
                    "(must be 0) and the switch's memory over time.")
    so.add_argument("--duration-s", type=float, default=60.0, help="run time (default 60)")
    so.add_argument("--jobs", type=int, default=3, help="concurrent jobs (default 3)")
    so.add_argument("--workers", type=int, default=2, help="workers per job (default 2)")
    so.add_argument("--loss", type=float, default=0.01,
                    help="datagram loss rate in each direction, 0..1 (default 0.01)")
    so.add_argument("--churn-interval-s", type=float, default=5.0,
                    help="stop or kill one job this often (default 5)")
    add_seed_option(so, help="random seed (default 0)")
    add_json_option(so, "the report")
    so.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> SoakConfig:
    """The soak run ``args`` describe.

    Raises:
        ValueError: ``--loss`` is outside [0, 1).
    """
    from switchml.bench.soak import SoakConfig

    if not 0.0 <= args.loss < 1.0:
        raise ValueError(f"--loss must be in [0, 1), got {args.loss}")
    return SoakConfig(duration_s=args.duration_s, jobs=args.jobs, workers=args.workers,
                      loss_rate=args.loss, churn_interval_s=args.churn_interval_s,
                      seed=args.seed)


def run(args: argparse.Namespace) -> int:
    """``switchml bench soak``: status 1 if any result was wrong."""
    import dataclasses

    from rich.console import Console

    from switchml.bench.soak import run_soak

    cfg = config_from_args(args)
    console = Console(stderr=True)
    with console.status("soaking") as status:
        report = run_soak(cfg, lambda r: status.update(
            f"soaking: {r.memory[-1][0]:.0f}/{cfg.duration_s:.0f} s, {r.operations} operations, "
            f"{r.errors} errors, {r.wrong_results} wrong, switch RSS "
            f"{r.memory[-1][1] / 2**20:.1f} MiB"))
    rss = [m[1] for m in report.memory]
    stdout_console().print(figure_table(
        f"soak: {cfg.jobs} jobs x {cfg.workers} workers, loss {cfg.loss_rate:g}, "
        f"{cfg.duration_s:g} s", (
            ("operations completed", report.operations),
            ("wrong results", report.wrong_results),
            ("errors raised (expected after kills)", report.errors),
            ("jobs started / stopped", f"{report.jobs_started} / {report.jobs_stopped}"),
            ("workers killed", report.workers_killed),
            ("switch RSS first / max / last (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("switch jobs / slots in use after the leases ran out",
             f"{report.switch_stats.get('jobs')} / {report.switch_stats.get('slots_in_use')}"),
            ("switch drops", report.switch_stats.get("drops")))))
    for e in report.error_samples:
        console.print(f"error sample: {e}")
    if args.json:
        write_json(args.json, dataclasses.asdict(report))
    return 1 if report.wrong_results else 0

"""``switchml stats``: a running switch"s counters, from its Prometheus endpoint."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING

from switchml.cli.common import Subparsers, add_metrics_options

if TYPE_CHECKING:
    from rich.table import Table

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml stats``: a running switch's counters."""
    stats = sub.add_parser(
        "stats", help="live counters of a running switch",
        description="Show a running switch's counters (like a hardware switch's port counters) "
                    "from its Prometheus endpoint, refreshed every --interval-s.")
    add_metrics_options(stats)
    stats.add_argument("--once", action="store_true", help="print one table and exit")
    stats.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``switchml stats``: one table (``--once``) or a live one until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    current = _read_counters(args.url)
    if args.once:
        Console().print(_stats_table(args.url, current, None, 0.0))
        return 0
    with Live(_stats_table(args.url, current, None, 0.0), refresh_per_second=4) as live:
        try:
            while True:
                t0 = time.monotonic()
                time.sleep(args.interval_s)
                nxt = _read_counters(args.url)
                live.update(_stats_table(args.url, nxt, current, time.monotonic() - t0))
                current = nxt
        except KeyboardInterrupt:
            pass
    return 0


def _read_counters(urls: str) -> dict:
    """One switch's counters, or the sum over a sharded switch's shards (comma list)."""
    from switchml.control.metrics import read_metrics

    total: dict = {}
    for url in urls.split(","):
        try:
            one = read_metrics(url)
        except OSError as exc:
            raise ValueError(f"can't read {url}: {exc} (is a switch running (every shard) with "
                             "--metrics-port?)") from exc
        for k, v in one.items():
            if isinstance(v, dict):
                d = total.setdefault(k, {})
                for label, x in v.items():
                    d[label] = d.get(label, 0) + x
            else:
                total[k] = total.get(k, 0) + v
    return total


def _counter_rate(now: dict, before: dict | None, dt: float, key: str,
                  label: str | None = None) -> str:
    """Counter ``key`` (its ``label`` series, if given) per second between two readings."""
    if before is None or dt <= 0:
        return ""
    a = now.get(key, {}) if label is not None else now.get(key, 0)
    b = before.get(key, {}) if label is not None else before.get(key, 0)
    if label is not None:
        a, b = a.get(label, 0), b.get(label, 0)
    return f"{(a - b) / dt:,.0f}"


def _stats_table(url: str, now: dict, before: dict | None, dt: float) -> Table:
    """The counters table: values and, given an earlier reading, rates."""
    from rich.table import Table

    t = Table(title=f"switchml switch {url}")
    t.add_column("counter")
    t.add_column("value", justify="right")
    t.add_column("per second", justify="right")
    for key, name in (("switchml_packets_in_total", "packets in"),
                      ("switchml_packets_out_total", "packets out"),
                      ("switchml_results_multicast_total", "results multicast"),
                      ("switchml_results_resent_total", "results resent (shadow copy)"),
                      ("switchml_late_contributions_total", "late contributions (quorum)"),
                      ("switchml_old_results_answered_total",
                       "old results answered (quorum history)"),
                      ("switchml_rounds_gone_answered_total",
                       "rounds gone (past the history)"),
                      ("switchml_waiting_sent_total", "WAITING answers"),
                      ("switchml_mismatch_sent_total", "MISMATCH answers")):
        t.add_row(name, f"{now.get(key, 0):,.0f}", _counter_rate(now, before, dt, key))
    t.add_row("jobs", f"{now.get('switchml_jobs', 0):.0f}", "")
    t.add_row("slots in use", f"{now.get('switchml_slots_in_use', 0):.0f} / "
              f"{now.get('switchml_pool_slots', 0):.0f}", "")
    t.add_row("slot memory", f"{now.get('switchml_memory_bytes', 0) / 2**20:.1f} MiB", "")
    for job, n in sorted(now.get("switchml_elements_aggregated_total", {}).items()):
        t.add_row(f"job {job} elements", f"{n:,.0f}",
                  _counter_rate(now, before, dt, "switchml_elements_aggregated_total", job))
    for reason, n in sorted(now.get("switchml_drops_total", {}).items()):
        t.add_row(f"drops: {reason}", f"{n:,.0f}",
                  _counter_rate(now, before, dt, "switchml_drops_total", reason))
    return t

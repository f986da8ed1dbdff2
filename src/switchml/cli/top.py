"""``switchml top``: a live view of a running switch, refreshed in place."""

from __future__ import annotations

import argparse
import time
from typing import TYPE_CHECKING, Any

from switchml.cli.common import Subparsers, add_metrics_options

if TYPE_CHECKING:
    from rich.console import Group

__all__ = ["add_parser", "frame", "run"]

_RATES = (("switchml_packets_in_total", "in"), ("switchml_packets_out_total", "out"),
          ("switchml_results_multicast_total", "results"),
          ("switchml_results_resent_total", "resent"), ("switchml_nacks_sent_total", "NACKs"),
          ("switchml_waiting_sent_total", "WAITING"))


def add_parser(sub: Subparsers) -> None:
    """``switchml top``: jobs, members, rates, loss and who each job waits for, live."""
    top = sub.add_parser(
        "top", help="a live view of a running switch: jobs, rates, loss, who each job waits for",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Show a running switch live, from its Prometheus endpoint (as `top` shows\n"
                    "processes): datagrams per second in and out, loss recovery (results\n"
                    "re-sent from shadow copies, NACKs, WAITING answers), drops by reason and\n"
                    "slots in use; then one row per job: members joined of its ranks, elements\n"
                    "aggregated per second, its open rounds, and the ranks those rounds wait\n"
                    "for, with how long each has been silent. Ctrl-C quits.",
        epilog="Example: switchml top --url http://127.0.0.1:9109/metrics")
    add_metrics_options(top)
    top.add_argument("--once", action="store_true",
                     help="print one frame (two readings, --interval-s apart) and exit")
    top.set_defaults(func=run)


def _rate(now: dict, before: dict | None, dt: float, key: str, label: str | None = None
          ) -> float | None:
    if before is None or dt <= 0:
        return None
    a, b = now.get(key, 0), before.get(key, 0)
    if label is not None:
        a = a.get(label, 0) if isinstance(a, dict) else 0
        b = b.get(label, 0) if isinstance(b, dict) else 0
    return max(0.0, (a - b) / dt)


def _per_s(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}/s"


def _waits(now: dict, job: str) -> str:
    """``rank 2 (12 rounds, silent 3.1 s)``, for every rank job ``job`` waits for."""
    missing = now.get("switchml_job_rank_missing_rounds", {})
    silent = now.get("switchml_job_rank_silent_seconds", {})
    said = []
    for key, rounds in sorted(missing.items(), key=lambda kv: -kv[1]):
        j, _, rank = key.partition(",")
        if j != job:
            continue
        quiet = silent.get(key, -1)
        heard = "never heard" if quiet < 0 else f"silent {quiet:.1f} s"
        said.append(f"rank {rank} ({rounds:.0f} rounds, {heard})")
    return "; ".join(said) or "-"


def frame(url: str, now: dict, before: dict | None, dt: float,
          error: str | None = None) -> Group:
    """One screen: the switch's rates and counters, then its jobs."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    head = Text(f"switchml top  {url}  {time.strftime('%H:%M:%S')}  (Ctrl-C quits)",
                style="bold")
    if error is not None:
        return Group(head, Text(f"can't read the switch: {error}", style="red"))
    rates = "  ".join(f"{name} {_per_s(_rate(now, before, dt, key))}" for key, name in _RATES)
    drops = now.get("switchml_drops_total", {})
    drop_text = ", ".join(
        f"{reason} {_per_s(_rate(now, before, dt, 'switchml_drops_total', reason))} ({n:,.0f})"
        for reason, n in sorted(drops.items()) if n) or "none"
    summary = Text.assemble(
        ("datagrams ", "bold"), rates, "\n", ("drops ", "bold"), drop_text, "\n",
        ("jobs ", "bold"), f"{now.get('switchml_jobs', 0):.0f}   ", ("slots ", "bold"),
        f"{now.get('switchml_slots_in_use', 0):.0f} / {now.get('switchml_pool_slots', 0):.0f}   ",
        ("slot memory ", "bold"), f"{now.get('switchml_memory_bytes', 0) / 2**20:.1f} MiB")
    jobs = Table(title="jobs", expand=False)
    for col, justify in (("job", "right"), ("members", "right"), ("elements/s", "right"),
                         ("open rounds", "right"), ("waits for", "left")):
        jobs.add_column(col, justify=justify)  # type: ignore[arg-type]
    ranks = now.get("switchml_job_ranks", {})
    for job in sorted(ranks, key=lambda j: int(j)):
        members = now.get("switchml_job_members", {}).get(job, 0)
        rate = _rate(now, before, dt, "switchml_elements_aggregated_total", job)
        jobs.add_row(job, f"{members:.0f} / {ranks[job]:.0f}",
                     "-" if rate is None else f"{rate:,.0f}",
                     f"{now.get('switchml_job_open_rounds', {}).get(job, 0):.0f}",
                     _waits(now, job))
    return Group(head, summary, jobs)


def _read(url: str) -> tuple[dict[str, Any], str | None]:
    from switchml.cli.stats import _read_counters
    try:
        return _read_counters(url), None
    except ValueError as exc:
        return {}, str(exc)


def run(args: argparse.Namespace) -> int:
    """``switchml top``: refresh until Ctrl-C (``--once``: one frame)."""
    from rich.console import Console
    from rich.live import Live

    if args.interval_s <= 0:
        raise ValueError(f"--interval-s must be > 0, got {args.interval_s}")
    before, error = _read(args.url)
    if args.once:
        if error is not None:
            raise ValueError(error)
        t0 = time.monotonic()
        time.sleep(args.interval_s)
        now, error = _read(args.url)
        Console().print(frame(args.url, now, before, time.monotonic() - t0, error))
        return 0 if error is None else 2
    t0 = time.monotonic()
    with Live(frame(args.url, before, None, 0.0, error), refresh_per_second=4,
              screen=False) as live:
        try:
            while True:
                time.sleep(args.interval_s)
                now, error = _read(args.url)
                t1 = time.monotonic()
                live.update(frame(args.url, now, before if before else None, t1 - t0, error))
                if error is None:
                    before, t0 = now, t1
        except KeyboardInterrupt:
            pass
    return 0

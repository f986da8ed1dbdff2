"""What the commands share: argument types, environment defaults, signals, tables, JSON.

Kept light on purpose: ``switchml --help`` imports this module, so rich, numpy and the
benchmarks are imported inside the functions that need them.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from switchml import env
from switchml.protocol.address import parse_address, parse_addresses
from switchml.protocol.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["SIGNAL_POLL_S", "ParserOrGroup", "Subparsers", "add_calibration_option",
           "add_host_option", "add_insecure_option", "add_json_option", "add_link_options",
           "add_metrics_options", "add_mtu_option", "add_nack_gap_option", "add_rate_option",
           "add_seed_option", "add_shards_option", "add_threads_option", "add_workers_option",
           "address", "addresses", "env_default", "figure_table", "human", "shard",
           "sigterm_interrupts", "size", "stdout_console", "stop_on_signals", "wait_for",
           "write_json"]

log = logging.getLogger("switchml")

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"
ParserOrGroup: TypeAlias = "argparse.ArgumentParser | argparse._ArgumentGroup"
"""Where a command's options go: its parser, or one of its argument groups."""

SIGNAL_POLL_S = 0.5

_T = TypeVar("_T")


def env_default(dest: str, default: _T) -> str | _T:
    """``SWITCHML_<DEST>`` from the environment, else ``default``."""
    return env.flag_default(dest, default)  # type: ignore[return-value]


_LINK_RATE_HELP = "link rate in Mbit/s, each way; 0 for unshaped (default 1000)"
_LINK_MTU_HELP = ("link MTU in bytes; switchml's chunks are sized to fit it (default 1500, "
                  "Ethernet; 9000 for jumbo frames; veth takes up to 65535 but that is not a "
                  "real network)")


def add_link_options(parser: ParserOrGroup, *, mtu: bool = True) -> None:
    """The emulated links' options, for every command that builds the testbed: ``--rate-mbit``,
    ``--loss`` and (``mtu``) ``--mtu``, written once."""
    add_rate_option(parser)
    parser.add_argument("--loss", type=float, default=0.0,
                        help="loss rate per datagram on every link, 0..1 (default 0)")
    if mtu:
        add_mtu_option(parser)


def add_rate_option(parser: ParserOrGroup, *, help: str = _LINK_RATE_HELP) -> None:
    """``--rate-mbit``: a link's rate in Mbit/s (default 1000). ``help`` defaults to the
    emulated links' wording (:func:`add_link_options`); a model of links says its own."""
    parser.add_argument("--rate-mbit", type=float, default=1000.0, help=help)


def add_mtu_option(parser: ParserOrGroup, *, help: str = _LINK_MTU_HELP) -> None:
    """``--mtu``: the path MTU in bytes that switchml's chunks fit (default 1500); ``help``
    defaults to the emulated links' wording."""
    parser.add_argument("--mtu", type=int, default=1500, help=help)


def add_workers_option(parser: ParserOrGroup, what: str = "workers", *,
                       default: int = 4) -> None:
    """``--workers``/``-n``: how many workers (ranks) take part; the help reads
    ``"<what> (default <default>)"``."""
    parser.add_argument("--workers", "-n", type=int, default=default,
                        help=f"{what} (default {default})")


def add_threads_option(parser: ParserOrGroup, *, help: str) -> None:
    """``--threads``: I/O threads per switchml worker, each with its own socket (default 1)."""
    parser.add_argument("--threads", type=int, default=1, help=help)


def add_shards_option(parser: ParserOrGroup, *, help: str, metavar: str | None = None) -> None:
    """``--shards``: switch processes (shards) that a job's lanes are striped over, a core
    each (default 1)."""
    parser.add_argument("--shards", type=int, default=1, metavar=metavar, help=help)


def add_nack_gap_option(parser: ParserOrGroup, *, help: str, default: int = 4) -> None:
    """``--nack-gap``: the switch's loss recovery, how many completions a missing chunk may
    lag before the switch NACKs its worker (0: off; default 4, the switch's)."""
    parser.add_argument("--nack-gap", type=int, default=default, help=help)


def add_calibration_option(parser: ParserOrGroup, *, help: str) -> None:
    """``--calibration JSON``: a file of CPU costs from ``switchml calibrate`` (default: the
    one it wrote, where there is one)."""
    parser.add_argument("--calibration", type=Path, default=None, metavar="JSON", help=help)


def add_seed_option(parser: ParserOrGroup, *, help: str) -> None:
    """``--seed``: the seed of the command's random draws (default 0)."""
    parser.add_argument("--seed", type=int, default=0, help=help)


def add_host_option(parser: ParserOrGroup, *, help: str, default: str = "127.0.0.1") -> None:
    """``--host``: the address a server listens on; loopback unless told otherwise (beyond
    loopback it needs its protection, or :func:`add_insecure_option`'s ``--insecure``)."""
    parser.add_argument("--host", default=default, help=help)


def add_insecure_option(parser: ParserOrGroup, *, help: str) -> None:
    """``--insecure``: let a server listen beyond loopback without its protection (a secret,
    TLS)."""
    parser.add_argument("--insecure", action="store_true", help=help)


def add_metrics_options(parser: ParserOrGroup) -> None:
    """``--url`` (a running switch's Prometheus endpoint, or a sharded switch's, summed; also
    ``SWITCHML_STATS_URL``) and ``--interval-s``, for the commands that watch a switch."""
    parser.add_argument("--url", default=env_default("stats_url", "http://127.0.0.1:9109/metrics"),
                        help="the switch's metrics URL (default http://127.0.0.1:9109/metrics); "
                             "a sharded switch: every shard's URL, comma-separated (summed)")
    parser.add_argument("--interval-s", type=float, default=1.0,
                        help="refresh period in seconds (default 1)")


def add_json_option(parser: ParserOrGroup, what: str) -> None:
    """``--json PATH``: write the command's results as JSON; the help reads
    ``"write <what> as JSON"`` (e.g. ``what="the figures"``)."""
    parser.add_argument("--json", metavar="PATH", type=output_path,
                        help=f"write {what} as JSON")


def output_path(text: str) -> str:
    """A file the command will write at its end: its directory must exist and be writable
    now, so that a long run does not end in an error about where to put its results."""
    import os
    folder = os.path.dirname(os.path.abspath(text))
    if not os.path.isdir(folder):
        raise argparse.ArgumentTypeError(f"{text}: no directory {folder} to write it in")
    if not os.access(folder, os.W_OK):
        raise argparse.ArgumentTypeError(f"{text}: the directory {folder} is not writable")
    return text


def bounded_int(what: str, low: int, high: int) -> Callable[[str], int]:
    """An argparse type: an integer in ``low``..``high``; its errors name ``what`` it is."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected {what}, got {text!r}") from None
        if not low <= value <= high:
            raise argparse.ArgumentTypeError(f"{what} is {low}..{high}, got {value}")
        return value
    parse.__name__ = what  # (argparse names the type in some errors)
    return parse


port = bounded_int("a port", 0, 65535)
"""A TCP or UDP port, 0 (pick a free one, or off, as the option says) to 65535."""


def address(text: str) -> tuple[str, int]:
    """``HOST:PORT``."""
    try:
        return parse_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def addresses(text: str) -> list[tuple[str, int]]:
    """``HOST:PORT[,HOST:PORT...]``: a switch, or a sharded switch's shards."""
    try:
        return parse_addresses(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def shard(text: str) -> tuple[int, int]:
    """``I/S``: shard I of S."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/S (shard I of S), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < S, got {text!r}")
    return i, n


def size(text: str) -> int:
    """A byte count with unit, e.g. ``64MiB``."""
    from switchml.bench.allreduce import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def human(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that divides it exactly."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def stop_on_signals(what: str) -> threading.Event:
    """An event that SIGINT and SIGTERM set (logging ``what``). Foreground commands wait on it
    in short slices (:func:`wait_for`): a signal delivered to another thread only runs its
    Python handler when the main thread executes bytecode."""
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("%s received, %s", signal.Signals(signum).name, what)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    return stop


def wait_for(stop: threading.Event) -> None:
    """Wait until ``stop`` is set, waking twice a second so that signal handlers run."""
    while not stop.wait(SIGNAL_POLL_S):
        pass


def sigterm_interrupts() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so that a benchmark's teardown runs."""
    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)


def stdout_console(width: int = 160) -> Console:
    """A console on standard output: the terminal's width, or ``width`` when redirected."""
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else width)


def figure_table(title: str, rows: Sequence[tuple[str, object]]) -> Table:
    """A two-column table (figure, value) of ``rows``."""
    from rich.table import Table
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name, value in rows:
        t.add_row(name, str(value))
    return t


def write_json(path: str, doc: object) -> None:
    """Write ``doc`` to ``path`` as indented JSON."""
    import json
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

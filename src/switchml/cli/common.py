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
from collections.abc import Sequence
from typing import TYPE_CHECKING, TypeAlias, TypeVar

from switchml import env
from switchml.protocol.address import parse_address, parse_addresses
from switchml.protocol.errors import ConfigError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

__all__ = ["SIGNAL_POLL_S", "Subparsers", "address", "addresses", "env_default", "figure_table",
           "human", "shard", "sigterm_interrupts", "size", "stdout_console", "stop_on_signals",
           "wait_for", "write_json"]

log = logging.getLogger("switchml")

Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

SIGNAL_POLL_S = 0.5

_T = TypeVar("_T")


def env_default(dest: str, default: _T) -> str | _T:
    """``SWITCHML_<DEST>`` from the environment, else ``default``."""
    return env.flag_default(dest, default)  # type: ignore[return-value]


def add_link_options(parser: argparse.ArgumentParser | argparse._ArgumentGroup, *,
                     mtu: bool = True) -> None:
    """The emulated links' options, for every command that builds the testbed: ``--rate-mbit``,
    ``--loss`` and (``mtu``) ``--mtu``, written once."""
    parser.add_argument("--rate-mbit", type=float, default=1000.0,
                        help="link rate in Mbit/s, each way; 0 for unshaped (default 1000)")
    parser.add_argument("--loss", type=float, default=0.0,
                        help="loss rate per datagram on every link, 0..1 (default 0)")
    if mtu:
        parser.add_argument("--mtu", type=int, default=1500,
                            help="link MTU in bytes; switchml's chunks are sized to fit it "
                                 "(default 1500, Ethernet; 9000 for jumbo frames; veth takes "
                                 "up to 65535 but that is not a real network)")


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

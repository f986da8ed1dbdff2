"""``switchml bench``: the benchmarks, one subcommand each (one module each, beside this one)."""

from __future__ import annotations

from switchml.cli.common import Subparsers
from switchml.cli.registry import BENCH_COMMANDS, add_commands

__all__ = ["add_parser"]


def add_parser(sub: Subparsers) -> None:
    """``switchml bench``: the benchmarks of :data:`switchml.cli.registry.BENCH_COMMANDS`."""
    bench = sub.add_parser("bench", help="benchmarks")
    add_commands(bench.add_subparsers(dest="bench", required=True, metavar="BENCH"),
                 BENCH_COMMANDS)

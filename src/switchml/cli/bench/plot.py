"""``switchml bench plot``: PNG plots of testbed benchmark results."""

from __future__ import annotations

import argparse

from switchml.cli.common import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench plot``: PNG plots of testbed benchmark results."""
    pl = bsub.add_parser("plot", help="PNG plots from testbed benchmark JSON files",
                         description="Draw ATE/s against size (with the line-rate and ring "
                                     "bounds), speedup over gloo against n, and slowdown "
                                     "against loss, from 'bench allreduce --testbed --json' "
                                     "files.")
    pl.add_argument("files", nargs="+", help="JSON files")
    pl.add_argument("--out", default="plots", help="output folder (default ./plots)")
    pl.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``switchml bench plot``: print the path of every PNG written."""
    from switchml.bench.plots import plot_results
    for path in plot_results(args.files, args.out):
        print(path)
    return 0

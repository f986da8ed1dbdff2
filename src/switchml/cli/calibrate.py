"""``switchml calibrate``: measure this machine's CPU costs for predict, sim and plan."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

from switchml.cli.common import Subparsers

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml calibrate``: CPU per datagram and per element, switchml and gloo."""
    cal = sub.add_parser(
        "calibrate", help="measure this machine's CPU costs (for predict, sim and plan)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Measure, on loopback, what a unit of work costs this machine's CPU: a\n"
                    "switchml worker and the switch per datagram and per element (one worker\n"
                    "through a switch process at MTU 1500 and 9000), and a gloo rank per\n"
                    "element it moves (two ranks). Takes about 10 s; run it on an idle\n"
                    "machine. `switchml predict`, `plan` and `sim --calibrated` read the file.")
    cal.add_argument("--out", type=Path, default=None,
                     help="where to write the calibration (default: ~/.cache/switchml/"
                          "calibration.json, where the other commands look)")
    cal.add_argument("--no-gloo", action="store_true", help="skip gloo (no torch needed)")
    cal.add_argument("--links", action="store_true",
                     help="also measure the testbed's emulated links (root: four workers over "
                          "1 Gbit/s veth pairs and shapers, a 2 and a 32 MiB all-reduce, about "
                          "40 s): the machine's CPU per byte and per all-reduce beyond "
                          "loopback's, which `predict --against` charges testbed runs (a real "
                          "network's NICs do that work)")
    cal.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``switchml calibrate``: measure, print, save."""
    from rich.console import Console

    from switchml.calibrate import calibrate
    from switchml.cli.common import figure_table, stdout_console
    from switchml.costs import default_path, load

    console = Console(stderr=True)
    with console.status("calibrating") as status:
        costs = calibrate(gloo=not args.no_gloo, links=args.links,
                          progress=lambda what: status.update(f"measuring {what}"))
    out = args.out or default_path()
    kept = ""
    if not args.links and out.exists():  # (the links' figure stays until measured again)
        try:
            old = load(out)
        except ValueError:
            old = None
        if old is not None and (old.link_byte_s or old.link_op_s):
            costs = dataclasses.replace(costs, link_byte_s=old.link_byte_s,
                                        link_op_s=old.link_op_s)
            kept = " (kept from the earlier calibration)"
    costs.save(out)
    stdout_console().print(figure_table(f"CPU costs ({costs.source})", [
        ("switchml worker, per datagram each way", f"{costs.worker_datagram_s * 1e9:.1f} ns"),
        ("switchml worker, per element each way", f"{costs.worker_element_s * 1e9:.2f} ns"),
        ("switch, per request", f"{costs.switch_request_s * 1e9:.0f} ns"),
        ("switch, per element of a request", f"{costs.switch_element_s * 1e9:.2f} ns"),
        ("gloo rank, per element moved", f"{costs.gloo_element_s * 1e9:.2f} ns"
         + ("" if not args.no_gloo else " (the reference machine's)")),
        ("emulated link (testbed), per byte beyond loopback",
         f"{costs.link_byte_s * 1e9:.3f} ns{kept}" if args.links or kept
         else "not measured (--links)"),
        ("emulated links (testbed), per all-reduce and worker beyond loopback",
         f"{costs.link_op_s * 1e3:.2f} ms{kept}" if args.links or kept
         else "not measured (--links)"),
    ]))
    print(f"written to {out}")
    return 0

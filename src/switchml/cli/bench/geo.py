"""``switchml bench geo``: Gaia and DiLoCo against synchronous training across data centres."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING

from switchml.bench.geo import MODEL_DEFAULTS, gaia_label
from switchml.cli.common import Subparsers, sigterm_interrupts

if TYPE_CHECKING:
    from switchml.bench.geo import GeoBenchConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench geo``: Gaia and DiLoCo against synchronous training across data
    centres."""
    geo = bsub.add_parser(
        "geo", help="Gaia and DiLoCo against synchronous training across data centres (root)",
        description="Train the same model "
                    "(by default matrix factorisation, the kind of model Gaia's paper trained; "
                    "or a CNN or an MLP on scikit-learn's digits) "
                    "four ways on the geo testbed: all workers in one data centre (LAN), "
                    "synchronous DDP spanning the WAN, Gaia (synchronous inside each data "
                    "centre, significant updates across) and DiLoCo (synchronous inside, an "
                    "outer step every --inner-steps steps, its all-reduce through a "
                    "switch across). Reports time to target accuracy, "
                    "final accuracy and WAN bytes (WAN interface counters); writes geo.json, "
                    "geo.csv and geo.png (accuracy against time), and with --thresholds "
                    "tradeoff.png (accuracy and time against WAN bytes). Gaia runs at the "
                    "library's defaults (S = 1% decaying, staleness 2). About 2 minutes at "
                    "the defaults (one seed). Needs root.")
    _network_options(geo.add_argument_group("the geo testbed"))
    _training_options(geo.add_argument_group("training (every mode)"))
    _gaia_options(geo.add_argument_group("Gaia (mode gaia)"))
    _diloco_options(geo.add_argument_group("DiLoCo (modes diloco and torchft)"))
    geo.add_argument("--seeds", type=int, default=1,
                     help="runs per mode (seeds 0 .. N-1); a mode's row is their mean "
                          "(default 1)")
    geo.add_argument("--out", default="switchml-geo", help="output folder (default "
                                                           "switchml-geo)")
    geo.set_defaults(func=run)


def _network_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--dcs", default="2x2", help="data centres x workers (default 2x2)")
    g.add_argument("--wan-mbit", type=float, default=50.0, help="WAN Mbit/s (default 50)")
    g.add_argument("--wan-rtt-ms", type=float, default=0.0,
                     help="round trip added between data centres, ms (default 0: the links' "
                          "own; a user-space delay line in the WAN core: docs/geo.md)")
    g.add_argument("--lan-mbit", type=float, default=1000.0, help="LAN Mbit/s (default 1000)")


def _training_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--modes", default="lan,wan,gaia,diloco",
                     help="comma list of lan, wan, gaia, diloco, torchft (default the first "
                          "four; torchft: torchft's DiLoCo across, with its Manager over gloo "
                          "and torchft_lighthouse, the same outer step as diloco, 32-bit; "
                          "needs pip install torchft==0.2.0)")
    g.add_argument("--model", choices=tuple(MODEL_DEFAULTS), default="mf",
                     help="mf: matrix factorisation of implicit feedback, 68k parameters, "
                          "plain SGD (Gaia's kind of workload); cnn: a CNN on digits, 560k "
                          "parameters; mlp: an MLP on digits (default mf)")
    g.add_argument("--steps", type=int, help="steps per run (default: the model's, "
                                               "mf 800, cnn 150)")
    g.add_argument("--batch", type=int, help="samples per worker (mf 64, cnn 32)")
    g.add_argument("--lr", type=float, help="learning rate of synchronous training "
                                              "(mf 50, cnn 0.05)")
    g.add_argument("--momentum", type=float, help="SGD momentum (mf 0, cnn 0.9)")
    g.add_argument("--target", type=float,
                     help="target held-out accuracy (mf 0.88, cnn 0.95)")
    g.add_argument("--eval-every", type=int, help="steps (mf 20, cnn 5)")


def _gaia_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--threshold", type=float, default=0.01,
                     help="Gaia's significance threshold S (default 0.01, the library's; on "
                          "the cnn, a run this short sends about half the entries at it, "
                          "and 0.1 without decay saves more: docs/geo.md)")
    g.add_argument("--thresholds", type=_fractions, default=(),
                     help="run Gaia once at each of these thresholds (comma list, e.g. "
                          "0,0.01,0.1,0.3) instead of --threshold, and plot final accuracy "
                          "against WAN bytes (tradeoff.png)")
    g.add_argument("--decay", action=argparse.BooleanOptionalAction, default=True,
                     help="decay the threshold as S/sqrt(t) (default on, the library's)")
    g.add_argument("--staleness", type=int, default=2,
                     help="mirror clock: clocks a data centre may run ahead (default 2)")
    g.add_argument("--gaia-lr-scale", type=float, default=None,
                     help="Gaia's learning rate factor (default 1/data centres)")
    g.add_argument("--dc-backend", choices=("gloo", "switchml"), default="gloo",
                     help="Gaia's synchronous training inside a data centre: DDP over gloo, "
                          "or over switchml with a switch in each data centre's router "
                          "(default gloo, as the other two modes)")


def _diloco_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--inner-steps", type=int, default=50,
                     help="DiLoCo: local steps between outer steps (default 50)")
    g.add_argument("--outer-lr", type=float, default=1.0,
                     help="DiLoCo: the outer step's learning rate (default 1: with no "
                          "momentum, the mean of the models; the paper's is 0.7)")
    g.add_argument("--outer-momentum", type=float, default=0.0,
                     help="DiLoCo: the outer step's Nesterov momentum (default 0; the "
                          "paper's is 0.9, which diverged on mf: docs/geo.md, section 3)")
    g.add_argument("--outer-bits", type=int, choices=(16, 32), default=16,
                     help="DiLoCo: bits per element of the outer all-reduce (default 16)")
    g.add_argument("--embedding-rows", action="store_true",
                     help="DiLoCo: average an embedding row over the data centres that moved "
                          "it (default: over all of them, the paper's and torchft's rule; "
                          "docs/geo.md, section 3)")


def config_from_args(args: argparse.Namespace) -> GeoBenchConfig:
    """The trainings ``args`` describe (``--dcs`` as data centre sizes)."""
    from switchml.bench.geo import GeoBenchConfig
    from switchml.gaia.rules import parse_dc_layout

    return GeoBenchConfig(dcs=tuple(len(d) for d in parse_dc_layout(args.dcs)),
                          wan_bps=args.wan_mbit * 1e6, lan_bps=args.lan_mbit * 1e6,
                          wan_rtt_s=args.wan_rtt_ms / 1000,
                          modes=tuple(m for m in args.modes.split(",") if m), steps=args.steps,
                          batch=args.batch, lr=args.lr, momentum=args.momentum,
                          model=args.model, eval_every=args.eval_every,
                          target_accuracy=args.target,
                          threshold=args.threshold, thresholds=args.thresholds,
                          decay=args.decay, staleness=args.staleness,
                          gaia_lr_scale=args.gaia_lr_scale, dc_backend=args.dc_backend,
                          inner_steps=args.inner_steps, outer_lr=args.outer_lr,
                          outer_momentum=args.outer_momentum, outer_bits=args.outer_bits,
                          embedding_rows=args.embedding_rows, seeds=args.seeds)


def _fractions(text: str) -> tuple[float, ...]:
    """``0,0.01,0.1`` as floats."""
    try:
        return tuple(float(x) for x in text.split(",") if x.strip())
    except ValueError:
        raise argparse.ArgumentTypeError("expected a comma list of numbers such as "
                                         f"0,0.01,0.1, got {text!r}") from None


def run(args: argparse.Namespace) -> int:
    """``switchml bench geo``: LAN, WAN-synchronous, Gaia and DiLoCo training, compared."""
    from switchml.bench.geo import run_geo_bench
    from switchml.bench.geo_report import write_outputs

    sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = config_from_args(args)
    rows = run_geo_bench(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    _print_geo_rows(rows)
    for path in write_outputs(rows, cfg, args.out):
        print(path)
    return 0


def _geo_cell(v: float | None, spec: str, suffix: str = "") -> str:
    """``v`` formatted with ``spec`` and ``suffix``, or ``-`` for none."""
    return "-" if v is None else format(v, spec) + suffix


def _print_geo_rows(rows: Sequence[dict]) -> None:
    """The geo benchmark's table, one line per mode."""
    print(f"{'mode':<20} {'time to target (s)':>18} {'final accuracy':>14} {'final loss':>10} "
          f"{'WAN MB':>9} {'vs LAN':>7} {'vs WAN sync':>11} {'WAN bytes vs sync':>17}")
    for r in rows:
        c = r["comparison"]
        mode = r["mode"] if "threshold" not in r else \
            f"gaia {gaia_label(r['threshold'], r.get('decay', False))}"
        print(f"{mode:<20} {_geo_cell(r['time_to_target_s'], '.2f'):>18} "
              f"{r['final_accuracy']:>14.4f} {_geo_cell(r.get('final_loss'), '.4f'):>10} "
              f"{r['wan_bytes'] / 1e6:>9.2f} "
              f"{_geo_cell(c.get('time_to_target_vs_lan'), '.2f', 'x'):>7} "
              f"{_geo_cell(c.get('speedup_vs_wan'), '.2f', 'x'):>11} "
              f"{_geo_cell(c.get('wan_bytes_vs_wan'), '.4f'):>17}")

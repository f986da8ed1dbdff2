"""``switchml demo``: train a small model on gloo and on switchml, side by side."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from switchml.cli.common import Subparsers, add_workers_option, stdout_console

if TYPE_CHECKING:
    from rich.table import Table

    from switchml.demo import DemoConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml demo``: gloo against switchml on a small model."""
    demo = sub.add_parser(
        "demo", help="train a model with gloo and with switchml, side by side",
        description="Train a small CNN on scikit-learn's digits with DistributedDataParallel in "
                    "N worker processes, once on gloo and once on switchml (embedded switch, no "
                    "set-up); print a table and save loss curves (PNG) and figures (JSON).")
    add_workers_option(demo, "worker processes")
    demo.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    demo.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    demo.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    demo.add_argument("--out", default="switchml-demo",
                      help="folder for loss.png and demo.json (default ./switchml-demo)")
    demo.add_argument("--backend", action="append", choices=["gloo", "switchml"],
                      help="run only this backend (repeatable; default both)")
    demo.set_defaults(func=run)


def config_from_args(args: argparse.Namespace) -> DemoConfig:
    """The demo ``args`` describe (both backends unless ``--backend`` names some)."""
    from switchml.demo import DemoConfig
    return DemoConfig(workers=args.workers, epochs=args.epochs, batch_size=args.batch_size,
                      lr=args.lr, out_dir=args.out,
                      backends=tuple(args.backend or ("gloo", "switchml")))


def run(args: argparse.Namespace) -> int:
    """``switchml demo``: train on gloo and on switchml, then compare."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from switchml.demo import run_demo

    if "switchml" in (args.backend or ("switchml",)):
        print("compiling switchml's kernels (loaded from the cache after the first run)",
              file=sys.stderr, flush=True)
    cfg = config_from_args(args)
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console) as progress:
        tasks: dict[str, TaskID] = {}

        def on_progress(backend: str, step: int, total: int, loss: float) -> None:
            if backend not in tasks:
                tasks[backend] = progress.add_task(f"training on {backend}", total=total,
                                                   info="")
            progress.update(tasks[backend], completed=step, info=f"loss {loss:.3f}")

        results = run_demo(cfg, on_progress)
    stdout_console().print(_demo_table(cfg, results))
    console.print(f"loss curves: {cfg.out_dir}/loss.png, figures: {cfg.out_dir}/demo.json")
    console.print("Same script, same loss: only the backend string differs. On one machine "
                  "there is no network bandwidth to save: the step times compare software "
                  "paths sharing this machine's cores (gloo's C++ ring; switchml's compiled "
                  "workers and an embedded software switch, which also needs CPU here). The "
                  "speedup in-network aggregation exists for appears on bandwidth-bound links: "
                  "see 'switchml predict' for your model, 'switchml bench train' and "
                  "'switchml bench allreduce --testbed' (root), and docs/benchmarks.md.")
    return 0


def _demo_table(cfg: DemoConfig, results: Sequence[Any]) -> Table:
    """One row per backend of the demo's training runs."""
    from rich.table import Table

    from switchml.demo import WARMUP_STEPS

    table = Table(title=f"DDP training on digits, {cfg.workers} workers, {cfg.epochs} epochs "
                        f"(step time: mean after the first {WARMUP_STEPS} steps)")
    for col in ("backend", "steps", "step time (ms)", "samples/s", "final loss", "test accuracy",
                "through the switch"):
        table.add_column(col, justify="right")
    for r in results:
        via = "-"
        if r.backend_stats:
            via = (f"{r.backend_stats['switch_ops'].get('allreduce', 0)} all-reduces; delegated "
                   f"{sum(r.backend_stats['delegated'].values())}")
        table.add_row(r.backend, str(r.steps), f"{1e3 * r.mean_step_s:.1f}",
                      f"{r.samples_per_s:.0f}", f"{r.final_loss:.4f}",
                      f"{100 * r.test_accuracy:.1f}%", via)
    return table

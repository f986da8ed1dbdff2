"""``switchml predict``: profile a model, predict its step time on each system."""

from __future__ import annotations

import argparse
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_calibration_option,
    add_json_option,
    add_mtu_option,
    add_rate_option,
    add_shards_option,
    add_threads_option,
    add_workers_option,
    stdout_console,
    write_json,
)

if TYPE_CHECKING:
    from rich.console import Console

__all__ = ["add_parser", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml predict``: profile a model, predict its step on each system."""
    from switchml import workloads
    pr = sub.add_parser(
        "predict", help="will switchml speed up my training job? (profile, then predict)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Profile a few local DDP steps of a model (compute, and each gradient\n"
                    "bucket's size and when backward makes it ready), then predict its step\n"
                    "time with N workers on links of the given rate and MTU: on gloo (ring\n"
                    "all-reduce), on switchml (the simulator's timing mode), with the 16-bit\n"
                    "hook, and with HybridDataParallel (per layer, aggregation or sufficient\n"
                    "factors), composed as each overlaps communication with backward. With\n"
                    "--colocated, the profiling processes also run in lockstep, and the\n"
                    "slowest one's pace stretches the compute. Prints the predicted speedup\n"
                    "and the share of the step spent communicating.\n\n"
                    "With --against, predict every row of a 'switchml bench train --json' run\n"
                    "instead and print predicted against measured step times.",
        epilog="Workloads: " + ", ".join(workloads.NAMES) + "; or module:factory, where "
               "factory(batch) returns a switchml.workloads.Task or (model, loss_fn, "
               "batch_of).")
    pr.add_argument("--model", default="ncf",
                    help="a workload or module:factory (default ncf)")
    pr.add_argument("--batch", type=int, default=None, help="per-worker batch (default: the "
                    "workload's own)")
    add_workers_option(pr)
    add_rate_option(pr, help="link rate in Mbit/s (default 1000)")
    add_mtu_option(pr, help="path MTU (default 1500)")
    add_threads_option(pr, help="switchml I/O threads per worker (default 1; `switchml plan` says "
                                "how many a rate needs)")
    add_shards_option(pr, help="switch shards, a core each (default 1)")
    add_calibration_option(pr, help="CPU costs (default: the file `switchml calibrate` wrote, "
                                    "else the reference machine's)")
    pr.add_argument("--colocated", type=int, default=1, metavar="K",
                    help="profile K processes at once: the workers share this machine's cores "
                         "(as on the testbed), default 1 (each worker has a host of its own)")
    pr.add_argument("--steps", type=int, default=8, help="profiled steps (default 8)")
    pr.add_argument("--against", metavar="JSON",
                    help="a 'switchml bench train --json' file: predict each of its rows "
                         "(profiling as many processes at once as the run had workers)")
    add_json_option(pr, "the profile and predictions")
    pr.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    """``switchml predict``: one table of predictions (or of predictions against a run)."""
    from rich.console import Console
    from rich.table import Table

    from switchml import predict as P
    console = Console(stderr=True)
    if args.against:
        return _run_against(args, console)
    with console.status(f"profiling {args.model} ({args.colocated} at once)"):
        prof = P.profile(args.model, args.batch, steps=args.steps, colocated=args.colocated)
    from switchml.costs import load
    res = P.Resources(load(args.calibration), args.threads, args.shards)
    with console.status("simulating the all-reduces"):
        preds = P.predict(prof, workers=args.workers, rate_bps=args.rate_mbit * 1e6,
                          mtu=args.mtu, res=res)
    table = Table(title=f"{args.model}: {prof.params:,} parameters, batch {prof.batch}, "
                        f"{args.workers} workers, {args.rate_mbit:g} Mbit/s, MTU {args.mtu}; "
                        f"compute {1e3 * prof.compute_s:.0f} ms per step "
                        f"(the slowest of {prof.colocated}: x{prof.slowdown:.2f}; "
                        f"{len(prof.buckets)} buckets); switchml on {args.threads} "
                        f"thread(s) per worker and {args.shards} switch shard(s)",
                  caption=f"CPU costs: {res.costs.source}")
    for col in ("system", "step (ms)", "communication (ms)", "exposed (ms)",
                "share of step", "speedup vs gloo", "bound by"):
        table.add_column(col, justify="right")
    for p in preds:
        table.add_row(p.system, f"{1e3 * p.step_s:.0f}", f"{1e3 * p.comm_s:.0f}",
                      f"{1e3 * p.exposed_s:.0f}", f"{p.comm_share:.0%}", f"{p.speedup:.2f}x",
                      p.bound_by or "-")
    stdout_console().print(table)
    best = max(preds, key=lambda p: p.speedup or 0)
    gloo = next(p for p in preds if p.system == "gloo")
    verdict = (f"switchml helps: {best.system} {best.speedup:.2f}x gloo's step, because "
               f"communication is {gloo.comm_share:.0%} of gloo's step and switchml moves "
               "fewer bytes" if (best.speedup or 0) > 1.05 else
               f"little to gain: communication is only {gloo.comm_share:.0%} of gloo's step")
    print(verdict)
    if args.json:
        write_json(args.json, {"profile": P.profile_dict(prof),
                                "resources": {"threads": args.threads, "shards": args.shards,
                                              "costs": res.costs.to_dict()},
                                "predictions": [dict(vars(p), comm_share=p.comm_share,
                                                     bound_by=p.bound_by) for p in preds]})
    return 0


def _run_against(args: argparse.Namespace, console: Console) -> int:
    """``switchml predict --against RUN.json``: each row of a ``bench train`` run, predicted
    and measured."""
    import json

    from rich.table import Table

    from switchml import predict as P
    with open(args.against) as f:
        rows = json.load(f)["results"]
    with console.status("profiling") as status:
        checked = P.validate(rows, progress=status.update)
    table = Table(title=f"predicted against measured step times ({args.against})")
    for col in ("model", "system", "workers", "Mbit/s", "measured (ms)", "predicted (ms)",
                "error"):
        table.add_column(col, justify="right")
    for c in checked:
        table.add_row(c["model"], c["system"], str(c["workers"]),
                      f"{c['rate_bps'] / 1e6:g}", f"{1e3 * c['measured_step_s']:.0f}",
                      f"{1e3 * c['predicted_step_s']:.0f}", f"{c['error']:+.0%}")
    stdout_console().print(table)
    if checked and not (checked[0].get("link_byte_s") or checked[0].get("link_op_s")):
        console.print("the testbed's emulated links are not calibrated (their kernel CPU is "
                      "not charged): run `switchml calibrate --links` as root")
    if args.json:
        write_json(args.json, {"against": args.against, "rows": checked})
    return 0

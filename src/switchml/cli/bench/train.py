"""``switchml bench train``: DDP training of the workloads over the testbed, system against
system.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_json_option,
    add_link_options,
    add_workers_option,
    output_path,
    sigterm_interrupts,
    stdout_console,
    write_json,
)

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from switchml.bench.testbed_train import TrainBenchConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench train``: DDP training over the testbed."""
    from switchml import workloads
    tr = bsub.add_parser(
        "train", help="DDP training of the workloads over the testbed, gloo against switchml "
                      "(root)",
        description="Train workloads (switchml.workloads: the paper's network-bound kinds, an "
                    "NCF-style click model, an LSTM and a BERT-style language model, and a CNN "
                    "and a wide MLP) with DistributedDataParallel over the same emulated "
                    "links, on each system. Per row: step time, samples/s, time to the target "
                    "metric (the level every system reached) and loss, bytes per step "
                    "(measured on the links and predicted), the share of communication hidden "
                    "behind backward, how busy the whole machine's CPUs were over the steps "
                    "(near 100%, the step is as short as the machine's cores allow, whatever "
                    "the links do), the speedup against gloo, and the ideal step time: the "
                    "step with no communication (the noop system) plus the exposed part of the "
                    "row's wire time at the link rate; with the lockstep system, also the "
                    "lockstep ideal, the same from the step whose ranks wait for the slowest "
                    "one at every bucket, as a synchronous all-reduce makes them.",
        epilog="Workloads: " + "; ".join(f"{w}: {workloads.get(w).summary}"
                                          for w in workloads.NAMES))
    add_workers_option(tr)
    tr.add_argument("--model", action="append", choices=list(workloads.NAMES),
                    help="workload to train (repeatable; default ncf and cnn)")
    tr.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    tr.add_argument("--batch", type=int, default=None,
                    help="per-worker batch (default: each workload's own)")
    tr.add_argument("--eval-every", type=int, default=10,
                    help="evaluate the workload's metric every N steps, outside the timed "
                         "steps (default 10; 0: never)")
    tr.add_argument("--systems", default="noop,gloo,switchml",
                    help="comma list of noop (no communication: the compute, for the ideal), "
                         "lockstep (no gradient moves, but the ranks wait for each other at "
                         "every bucket: the slowest rank's compute, for the lockstep ideal), "
                         "gloo, switchml (DDP on that backend), switchml16 (DDP with the 16-bit "
                         "switchml hook), hybrid (HybridDataParallel on switchml: per layer, "
                         "aggregation or sufficient-factor broadcasting), hsdp and hsdp-gloo "
                         "(FSDP2 on a mesh of n/2 replicas x 2 shards; the replicas' all-reduce "
                         "goes through the switch on hsdp, timed per step), switchml-quorum "
                         "(DDP on a switchml group with a quorum, --quorum, and its quorum "
                         "hook: a straggler does not set the pace), switchml-failover "
                         "(DDP on switchml with SWITCHML_FAILOVER=gloo and a 10 s group "
                         "timeout: goes on over gloo when the switch dies), switchml-live "
                         "(each rank a replica of its own, DDP averaged through a quorum job "
                         "a replacement can join while it runs: switchml.torch.live; with "
                         "--kill-worker-at) (default noop,gloo,switchml)")
    tr.add_argument("--trace", metavar="PATH",
                    help="write a Chrome trace (JSON, open in ui.perfetto.dev) of every rank's "
                         "forward, backward, optimizer and communication spans, and report the "
                         "fraction of communication hidden behind backward compute")
    add_link_options(tr)
    _fault_options(tr.add_argument_group("faults (stragglers, a killed switch)"))
    add_json_option(tr, "the rows")
    tr.add_argument("--csv", metavar="PATH", type=output_path, help="write the rows as CSV")
    tr.add_argument("--plot", metavar="PNG", help="save training loss against time (and "
                    "bytes per step and step time per system to PNG's name + '-bytes'; with "
                    "--trace, rank 0's last two steps to + '-timeline'; with faults, each "
                    "step's time with the faults marked to + '-steps')")
    tr.set_defaults(func=run)


def _fault_options(g: argparse._ArgumentGroup) -> None:
    g.add_argument("--straggle-s", type=float, default=0.0, metavar="SECONDS",
                    help="a straggler: this many seconds of extra compute before a step's "
                         "forward on the straggling rank (default 0: none)")
    g.add_argument("--straggle-every", type=int, default=0, metavar="N",
                    help="0: the last rank straggles at every step (persistent, the default); "
                         "N: at one step in N on average a rank drawn at random does "
                         "(transient)")
    g.add_argument("--quorum", type=int, default=None, metavar="K",
                    help="the switchml-quorum system's quorum: each round completes with K "
                         "ranks (default: workers - 1)")
    g.add_argument("--kill-worker-at", type=int, default=0, metavar="STEP",
                    help="switchml-live: the last rank exits abruptly as this step begins; "
                         "a replacement starts --replace-after seconds later, joins the "
                         "running job with a live rank's state; the rows give the live ranks' "
                         "worst step after the death, when the replacement's first step ended "
                         "and its share of the sums (default 0: never)")
    g.add_argument("--replace-after", type=float, default=3.0, metavar="SECONDS",
                    help="with --kill-worker-at: seconds from the death to the replacement's "
                         "start (default 3)")
    g.add_argument("--no-skip-behind", dest="skip_behind", action="store_false",
                    help="switchml-live: every rank computes every step (by default a rank "
                         "whose peers are past its next step takes that step's sums without "
                         "computing it: LiveQuorum.skip_step, how a straggler or a replacement "
                         "gets back in step, sending nothing for the steps it skips)")
    g.add_argument("--catch-up-after", type=int, default=0, metavar="STEPS",
                    help="switchml-live: a rank whose peers are more than STEPS steps ahead "
                         "takes a live rank's state and skips the steps between (a "
                         "straggler's remedy; the rows count the catch-ups and the steps "
                         "skipped) (default 0: never)")
    g.add_argument("--kill-switch-at", type=int, default=0, metavar="STEP",
                    help="kill the switch (SIGKILL) as rank 0 starts this step of each "
                         "switchml-failover and switchml-live run (both go on over gloo: "
                         "the live replicas with LiveQuorum(failover='gloo')); the rows give "
                         "the step times around it and the final metric (default 0: never)")
    g.add_argument("--switch-back-after", type=float, default=0.0, metavar="SECONDS",
                    help="with --kill-switch-at: start a new switch at the same address this "
                         "long after the kill (the group probes every 2 s and goes back to "
                         "it; the rows give the steps on gloo and the step time after) "
                         "(default 0: not)")


def config_from_args(args: argparse.Namespace) -> TrainBenchConfig:
    """The training runs ``args`` describe (ncf and cnn unless ``--model`` names some)."""
    from switchml.bench.testbed_train import TrainBenchConfig
    return TrainBenchConfig(workers=args.workers, models=tuple(args.model or ("ncf", "cnn")),
                            steps=args.steps, batch=args.batch, eval_every=args.eval_every,
                            rate_bps=args.rate_mbit * 1e6,
                            loss_rate=args.loss, mtu=args.mtu,
                            systems=tuple(s for s in args.systems.split(",") if s),
                            trace=bool(args.trace), straggle_s=args.straggle_s,
                            straggle_every=args.straggle_every, quorum=args.quorum,
                            kill_switch_at=args.kill_switch_at,
                            kill_worker_at=args.kill_worker_at,
                            catch_up_steps=args.catch_up_after,
                            skip_behind=args.skip_behind,
                            replace_after_s=args.replace_after,
                            switch_back_after_s=args.switch_back_after)


def run(args: argparse.Namespace) -> int:
    """``switchml bench train``: DDP training over the testbed, one row per model and system."""
    from rich.console import Console

    from switchml.bench.testbed_train import run_testbed_train

    sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = config_from_args(args)
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        rows = run_testbed_train(cfg, progress=lambda what: status.update(what))
    stdout_console(200).print(_train_table(cfg, args.rate_mbit, rows))
    for r in rows:
        for d in r.get("decisions", []):
            console.print(f"{r['model']} {r['system']}: {d}")
        if r.get("caught_up") or r.get("steps_not_computed"):
            console.print(f"{r['model']} {r['system']}: {r['steps_not_computed']} step(s) "
                          f"taken from the others' sums without computing; "
                          f"{r['caught_up']} catch-up(s) from a live rank's state, "
                          f"{r['skipped_steps']} step(s) skipped")
        if r.get("kill_worker_at"):
            console.print(
                f"{r['model']} {r['system']}: rank {r['workers'] - 1} died at step "
                f"{r['kill_worker_at']}; the others' steps took {_ms(r['before_kill_step_s'])} "
                f"before, the longest {_ms(r['kill_stall_s'])} after; its replacement started "
                f"{r['replace_after_s']:g} s later, "
                + (f"had the state after {r['replacement_state_s']:.2f} s and "
                   if r.get("replacement_state_s") is not None else "")
                + f"ended its first step (of "
                f"{r['replacement_start_step']}) {r['replacement_first_step_s'] or 0:.1f} s "
                f"after its start, its first with its data in the sums "
                + (f"{r['replacement_contributes_s']:.1f} s after"
                   if r.get("replacement_contributes_s") is not None else "never")
                + f"; its data is in "
                f"{r['replacement_contributed']:.0%} of the sums it took; replicas "
                f"identical: {r['replicas_identical']}")
        if r.get("kill_switch_at"):
            fo = r.get("failover") or {}
            after, before = r.get("after_kill_step_s"), r.get("before_kill_step_s")
            console.print(
                f"{r['model']} {r['system']}: the switch was killed at step "
                f"{r['kill_switch_at']}; steps took {_ms(before)} before, the longest "
                f"{r['kill_stall_s']:.1f} s, then {_ms(after)} (switch-overs to gloo: "
                f"{fo.get('switch_overs', 0)}; results taken from peers: "
                f"{fo.get('results_taken_from_peers', 0)})"
                + (f"; replicas identical: {r['replicas_identical']}"
                   if "replicas_identical" in r else ""))
            if r.get("back_at_step") is not None:
                console.print(f"{r['model']} {r['system']}: {r['steps_on_gloo']} steps on gloo; "
                              f"back on the switch at step {r['back_at_step']}, then "
                              f"{_ms(r.get('back_step_s'))} a step")
        if "replica_allreduce_s" in r:
            console.print(f"{r['model']} {r['system']}: the replicas' all-reduce took "
                          f"{1e3 * r['replica_allreduce_s']:.0f} ms per step")
    _write_outputs(args, cfg, rows, console)
    return 0


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{1e3 * seconds:.0f} ms"


def _train_table(cfg: TrainBenchConfig, rate_mbit: float, rows: Sequence[dict]) -> Table:
    """One row per model and system of the training benchmark."""
    from rich.table import Table

    table = Table(title=f"DDP training over the testbed: {cfg.workers} workers, "
                        f"{rate_mbit:g} Mbit/s links, loss {cfg.loss_rate:g}, "
                        f"MTU {cfg.mtu}")
    lockstep = any("achieved_over_lockstep_ideal" in r for r in rows)
    for col in ("model", "parameters", "system", "step (ms)", "samples/s", "final loss",
                "metric", "to target (s)", "speedup", "MB/step", "MB/step predicted",
                "hidden", "CPU busy", "ideal (ms)", "of ideal") + (
                    ("of lockstep ideal",) if lockstep else ()):
        table.add_column(col, justify="right")

    def fmt(v: float | None, spec: str, scale: float = 1.0) -> str:
        return "-" if v is None else format(v * scale, spec)

    for r in rows:
        metric = "-" if r.get("final_metric") is None else \
            f"{r['metric']} {r['final_metric']:.3g}"
        table.add_row(r["model"], f"{r['params']:,}", r["system"],
                      f"{1e3 * r['step_s']:.0f}", f"{r['samples_per_s']:.0f}",
                      f"{r['final_loss']:.4f}", metric, fmt(r.get("time_to_metric_s"), ".1f"),
                      fmt(r["speedup_step"], ".2f"),
                      fmt(r.get("bytes_per_step_measured"), ".2f", 1e-6),
                      fmt(r.get("bytes_per_step_predicted"), ".2f", 1e-6),
                      fmt(r.get("hidden_fraction"), ".0%"),
                      fmt(r.get("machine_busy"), ".0%"),
                      fmt(r.get("ideal_step_s"), ".0f", 1e3),
                      fmt(r.get("achieved_over_ideal"), ".2f"),
                      *([fmt(r.get("achieved_over_lockstep_ideal"), ".2f")] if lockstep
                        else []))
    return table


_TRAIN_CSV_KEYS = ["model", "backend", "system", "hook", "workers", "params", "rate_bps",
                   "loss_rate", "mtu", "batch", "step_s", "samples_per_s", "final_loss",
                   "target_loss", "time_to_target_s", "metric", "final_metric",
                   "target_metric", "time_to_metric_s", "speedup_step", "speedup_vs_switchml",
                   "bytes_per_step_measured", "bytes_per_step_predicted", "hidden_fraction",
                   "machine_cpu_s_per_step", "machine_busy",
                   "compute_step_s", "wire_s", "ideal_step_s", "achieved_over_ideal",
                   "lockstep_step_s", "ideal_lockstep_step_s", "achieved_over_lockstep_ideal",
                   "replica_allreduce_s"]


def _write_outputs(args: argparse.Namespace, cfg: TrainBenchConfig, rows: list[dict],
                         console: Console) -> None:
    """The training benchmark's trace, JSON, CSV and plots, as the options ask."""
    import csv

    from switchml.bench.testbed_train import (
        plot_bytes,
        plot_timeline,
        plot_training,
        write_trace,
    )

    base = args.plot[:-4] if args.plot and args.plot.endswith(".png") else args.plot
    if args.trace:
        events = write_trace(rows, args.trace)
        console.print(f"wrote {events} trace events to {args.trace}")
    if args.plot and args.trace:
        plot_timeline(rows, f"{base}-timeline.png")
    for r in rows:
        r.pop("trace_events", None)
    if args.json:
        write_json(args.json, {"benchmark": "train-testbed", "config": cfg.__dict__,
                                "results": rows})
    if args.csv:
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=_TRAIN_CSV_KEYS, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        plot_training(rows, args.plot)
        if any("bytes_per_step_measured" in r for r in rows):
            plot_bytes(rows, f"{base}-bytes.png")
        if any(r.get(k) for r in rows for k in ("kill_worker_at", "kill_switch_at",
                                                  "straggle_s")):
            from switchml.bench.testbed_live import plot_steps
            plot_steps(rows, f"{base}-steps.png")

"""``switchml sim``: all-reduce at scale on a discrete-event clock."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from switchml.cli.common import (
    Subparsers,
    add_calibration_option,
    add_json_option,
    add_mtu_option,
    add_nack_gap_option,
    add_rate_option,
    add_seed_option,
    add_shards_option,
    add_threads_option,
    size,
)
from switchml.protocol.errors import ConfigError

if TYPE_CHECKING:
    from switchml.sim.config import SimConfig

__all__ = ["add_parser", "config_from_args", "run"]


def add_parser(sub: Subparsers) -> None:
    """``switchml sim``: all-reduce at scale on a discrete-event clock."""
    sim = sub.add_parser(
        "sim", help="simulate all-reduce at scale on a discrete-event clock",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Simulate one all-reduce per combination of --workers and --loss over a "
                    "star (one switch) or a two-level tree (--racks: rack switches under a "
                    "spine). Links: FIFO queues at --rate-mbit with a propagation delay, tail "
                    "drop and random loss; hosts spend --host-cost-us of CPU per datagram. "
                    "Timing mode models the protocol's per-slot rules without payloads (1024 "
                    "workers x 64 MiB in minutes); exact mode runs the real switch, rack-switch "
                    "and worker objects with real data and checks every sum. Reports ATE/s "
                    "(elements / elapsed, slowest worker), link utilisation, retransmissions "
                    "and queue drops. See docs/simulator.md.",
        epilog="examples:\n"
               "  switchml sim -n 8 --size 64MiB --rate-mbit 400              # one run\n"
               "  switchml sim -n 2 -n 16 -n 128 -n 1024 --rack-size 32 --plot ate.png\n"
               "  switchml sim -n 4 --loss 0 --loss 0.001 --loss 0.01 --size 16MiB\n"
               "  switchml sim -n 256 --size 4MiB --mode exact                 # real objects\n"
               "  switchml sim --compare docs/results/testbed-n*-400mbit-mtu1500.json\n"
               "exit status: 0 when every run finished, 1 when one failed (a failed link), "
               "2 on bad arguments.")
    _add_network_args(sim)
    _add_scenario_args(sim)
    sim.set_defaults(func=run)


def _add_network_args(sim: argparse.ArgumentParser) -> None:
    """``sim``'s sweep, links and topology options."""
    sim.add_argument("--workers", "-n", type=int, action="append", dest="workers",
                     help="workers; repeat for a sweep (default 4)")
    sim.add_argument("--size", type=size, default=64 << 20,
                     help="tensor size (float32) with unit, e.g. 64MiB (default 64MiB)")
    sim.add_argument("--mode", choices=("timing", "exact"), default="timing",
                     help="timing: modelled protocol, no payloads; exact: the real endpoints "
                          "and data, every sum checked (default timing)")
    add_rate_option(sim, help="worker link rate in Mbit/s, each direction (default 1000)")
    sim.add_argument("--spine-rate-mbit", type=float, default=None,
                     help="rack-to-spine link rate in Mbit/s (default: --rate-mbit)")
    sim.add_argument("--delay-us", type=float, default=0.0,
                     help="propagation delay per link in microseconds (default 0, as veth)")
    sim.add_argument("--queue-ms", type=float, default=20.0,
                     help="queue limit per link as milliseconds of its rate (default 20, the "
                          "testbed's tbf latency)")
    add_mtu_option(sim, help="path MTU in bytes; chunks fit it (358 int32 at 1500) (default 1500)")
    sim.add_argument("--window", type=int, default=None,
                     help="slots per job W (default: about 256 KiB in flight, 128 at MTU 1500)")
    sim.add_argument("--loss", type=float, action="append", dest="losses",
                     help="loss rate per link crossed, 0..1; repeat for a sweep (default 0)")
    topo = sim.add_mutually_exclusive_group()
    topo.add_argument("--racks", type=int, default=None,
                      help="rack switches under a spine (must divide every n; default 1: a "
                           "star)")
    topo.add_argument("--rack-size", type=int, default=None,
                      help="workers per rack: n / rack-size racks (a star while n <= it)")


def _add_scenario_args(sim: argparse.ArgumentParser) -> None:
    """``sim``'s host, switch, straggler and failure options, and its outputs."""
    sim.add_argument("--host-cost-us", type=float, default=None,
                     help="worker CPU per datagram received or sent, in microseconds (default "
                          "6.6, calibrated on the testbed; 0: hosts are never the bottleneck)")
    sim.add_argument("--calibrated", action="store_true",
                     help="charge each worker and the switch the CPU costs `switchml "
                          "calibrate` measured (per datagram and per element; the reference "
                          "machine's where it never ran) instead of --host-cost-us")
    add_calibration_option(sim, help="with --calibrated: this calibration file (default: the one "
                                     "`switchml calibrate` wrote)")
    add_threads_option(sim, help="with --calibrated: I/O threads per worker (default 1)")
    add_shards_option(sim, help="with --calibrated: switch shards, a core each (default 1)")
    add_nack_gap_option(sim, help="switch-driven loss recovery: NACK a rank whose chunk released "
                                  "this many completions earlier is missing (0: off, loss waits "
                                  "for a timeout) (default 4, the switch's default)")
    sim.add_argument("--switch-delay-us", type=float, default=0.0,
                     help="fixed processing delay per switch in microseconds (default 0)")
    sim.add_argument("--stragglers", type=int, default=0,
                     help="the last N ranks are stragglers (default 0)")
    sim.add_argument("--straggler-slowdown", type=float, default=1.0,
                     help="stragglers' host cost multiplier (default 1)")
    sim.add_argument("--straggler-delay-ms", type=float, default=0.0,
                     help="stragglers start the operation this much later (default 0)")
    sim.add_argument("--fail-link", action="append", default=[], metavar="KIND:I@SECONDS",
                     help="a link fails, both ways, at a virtual time: worker:3@0.05 or "
                          "rack:1@0.1; repeatable")
    add_seed_option(sim, help="seed of every random draw (default 0)")
    sim.add_argument("--compare", nargs="+", metavar="TESTBED_JSON",
                     help="instead: predict every loss-free row of these `bench allreduce "
                          "--testbed` JSON files (same n, rate, MTU, size; switchml's "
                          "simulated, gloo's by predict's ring model with this machine's "
                          "calibration) and print predicted / testbed; a loopback run is "
                          "refused: its processes share this machine's cores, which the "
                          "model does not see")
    add_json_option(sim, "every run")
    sim.add_argument("--plot", metavar="PNG",
                     help="plot ATE/s against n (with the bounds) and/or against loss")
    sim.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


def run(args: argparse.Namespace) -> int:
    """``switchml sim``: a sweep over --workers x --loss, or ``--compare`` with the testbed."""
    command = "switchml " + " ".join(sys.argv[1:])
    config = config_from_args(args)
    if args.compare:
        return _run_compare(args, config, command)
    return _run_sweep(args, config, command)


def config_from_args(args: argparse.Namespace) -> Callable[[int, float], SimConfig]:
    """Check the simulator's options; the :class:`SimConfig` of n workers and a loss rate."""
    from switchml.costs import load as load_costs
    from switchml.sim.config import HOST_COST_S, SimConfig, Stragglers
    from switchml.sim.run import access_link, parse_failure

    host_cost = HOST_COST_S if args.host_cost_us is None else args.host_cost_us * 1e-6
    if host_cost < 0 or args.queue_ms <= 0 or args.delay_us < 0:
        raise ConfigError("--host-cost-us and --delay-us must be >= 0, --queue-ms > 0")
    cpu: dict[str, float | int] = {}
    if args.calibrated:
        if args.host_cost_us is not None:
            raise ConfigError("--calibrated charges the calibrated costs: drop --host-cost-us")
        costs = load_costs(args.calibration)
        cpu = dict(host_cost_s=costs.worker_datagram_s,
                   host_element_cost_s=costs.worker_element_s,
                   switch_request_cost_s=costs.switch_request_s,
                   switch_element_cost_s=costs.switch_element_s,
                   threads=args.threads, shards=args.shards)
    elif args.threads != 1 or args.shards != 1 or args.calibration is not None:
        raise ConfigError("--threads, --shards and --calibration need --calibrated")
    failures = tuple(parse_failure(t) for t in args.fail_link)

    def config(n: int, loss: float) -> SimConfig:
        racks = args.racks or 1
        if args.rack_size:
            racks = n // args.rack_size if n > args.rack_size else 1
            if n > args.rack_size and n % args.rack_size:
                raise ConfigError(f"--rack-size {args.rack_size} does not divide n = {n}")
        access = access_link(args.rate_mbit, delay_us=args.delay_us, queue_ms=args.queue_ms,
                             loss=loss)
        spine = None
        if args.spine_rate_mbit is not None:
            spine = access_link(args.spine_rate_mbit, delay_us=args.delay_us,
                                queue_ms=args.queue_ms, loss=loss)
        return SimConfig(workers=n, size_bytes=args.size, access=access, spine=spine,
                         racks=racks, mtu=args.mtu, window=args.window,
                         **({"host_cost_s": host_cost} | cpu),  # type: ignore[arg-type]
                         switch_delay_s=args.switch_delay_us * 1e-6,
                         stragglers=Stragglers(args.stragglers, args.straggler_slowdown,
                                               args.straggler_delay_ms * 1e-3),
                         failures=failures, seed=args.seed, nack_gap=args.nack_gap)

    return config


def _run_compare(args: argparse.Namespace, config: Callable[[int, float], SimConfig],
                     command: str) -> int:
    """``sim --compare``: predicted against measured ATE/s, one line per testbed row."""
    import json
    import os

    from switchml.costs import load as load_costs
    from switchml.sim.run import compare_with_testbed

    # gloo's rows by predict's ring model, with this machine's calibration (the reference
    # machine's without one), its processes sharing this machine's cores as on the testbed
    cores = len(os.sched_getaffinity(0))
    rows = compare_with_testbed(args.compare, config(4, 0.0), args.mode,
                                gloo_costs=load_costs(args.calibration), cores=cores)
    done = {r["file"] for r in rows}
    for path in args.compare:
        if path not in done:
            print(f"{path}: no row to compare in it (only loss-free rows at 32 bits, and "
                  "gloo's)", file=sys.stderr)
    print(f"{'system':>8} {'n':>3} {'Mbit/s':>7} {'MTU':>5} {'size':>10} "
          f"{'testbed ATE/s':>13} {'predicted':>10} {'predicted/testbed':>17} {'cores':>6}")
    for r in rows:
        print(f"{r['system']:>8} {r['workers']:3d} {r['rate_bps'] / 1e6:7.0f} {r['mtu']:5d} "
              f"{r['size_bytes']:10d} {r['testbed_ate_per_s']:13.3e} "
              f"{r['predicted_ate_per_s']:10.3e} {r['ratio']:17.3f} "
              f"{r['cores_needed']:5.1f}{'*' if r['cpu_shared'] else ' '}")
    if any(r["cpu_shared"] for r in rows):
        print(f"*: at the predicted rate the model's processes need more than this machine's "
              f"{cores} cores; on the testbed they shared them, which the model does not "
              "see: the prediction is optimistic there")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "sim-compare", "command": command, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


def _run_sweep(args: argparse.Namespace, config: Callable[[int, float], SimConfig],
                   command: str) -> int:
    """One simulated all-reduce per n and loss rate; status 1 if any failed."""
    from switchml.sim.run import format_table, plot_reports, run_config, write_json

    reports = []
    for n in args.workers or [4]:
        for loss in args.losses or [0.0]:
            reports.append(run_config(config(n, loss), args.mode, verbose=not args.quiet))
            print(format_table(reports[-1:]).splitlines()[-1] if len(reports) > 1 else
                  format_table(reports[-1:]), flush=True)
    if len(reports) > 1:
        print()
        print(format_table(reports))
    if args.json:
        write_json(args.json, reports, command=command)
        print(f"wrote {args.json}")
    if args.plot:
        for path in plot_reports(args.plot, [r.as_dict() for r in reports]):
            print(f"wrote {path}")
    return 0 if all(r.ok for r in reports) else 1

"""The ``switchml`` command.

Usage recipes::

    switchml switch                          # a software switch on 127.0.0.1:48864
    switchml stats                           # its live counters (metrics on 127.0.0.1:9109)
    switchml switch --host 0.0.0.0 --secret-file /etc/switchml.secret --pool-slots 8192
    switchml bench allreduce --workers 4 --size 64MiB --json results.json
    switchml bench allreduce --workers 2 --size 1MiB --size 16MiB --switch 127.0.0.1:48864
    switchml bench switch --workers 4 --elements-per-packet 256 --seconds 5   # switch capacity

Definitions: a *job* is one group of n workers (ranks 0..n-1) that all-reduce together; the
switch gives each job a *window* of W aggregation *slots* (each holding k int32 elements in two
*sets*) out of its *pool*. The switch's --host, --port, --pool-slots, --lease-timeout-s,
--secret-file, --metrics-port and --log-level may also come from the environment as
``SWITCHML_<FLAG>`` (e.g. ``SWITCHML_PORT=9000``), and stats' --url as ``SWITCHML_STATS_URL``.

Failure modes: a port in use makes ``switch`` exit with status 2 and the reason; a benchmark
worker that fails or hangs makes ``bench`` exit non-zero within its ``--timeout-s``.

Layout: every command (and every ``bench`` and ``ps`` subcommand) has an ``_add_*_parser``
function that builds its parser and binds its ``_run_*`` handler with ``set_defaults(func=...)``;
:func:`main` parses and calls ``args.func(args)``.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import os
import signal
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, TypeAlias, TypeVar

from switchml import __version__, env
from switchml.protocol.address import parse_address
from switchml.protocol.errors import ConfigError, SwitchMLError

if TYPE_CHECKING:
    from rich.console import Console
    from rich.table import Table

    from switchml.bench.switchcap import SwitchCapConfig, SwitchCapResult
    from switchml.bench.testbed import TrainBenchConfig
    from switchml.demo import DemoConfig
    from switchml.protocol.tree import RackAggregator
    from switchml.sim.config import SimConfig
    from switchml.transport.udp import SwitchServer

__all__ = ["build_parser", "main"]

log = logging.getLogger("switchml")

_Subparsers: TypeAlias = "argparse._SubParsersAction[argparse.ArgumentParser]"

_SIGNAL_POLL_S = 0.5

_T = TypeVar("_T")


# ---------------------------------------------------------------------------------------------
# Argument types and shared helpers


def _env(dest: str, default: _T) -> str | _T:
    """``SWITCHML_<DEST>`` from the environment, else ``default``."""
    return env.flag_default(dest, default)  # type: ignore[return-value]


def _address(text: str) -> tuple[str, int]:
    """``HOST:PORT``."""
    try:
        return parse_address(text)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _shard(text: str) -> tuple[int, int]:
    """``I/S``: shard I of S."""
    try:
        i, n = (int(v) for v in text.split("/"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected I/S (shard I of S), got {text!r}") from None
    if not 0 <= i < n:
        raise argparse.ArgumentTypeError(f"expected 0 <= I < S, got {text!r}")
    return i, n


def _size(text: str) -> int:
    """A byte count with unit, e.g. ``64MiB``."""
    from switchml.bench.allreduce import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def _human(nbytes: int) -> str:
    """``nbytes`` in the largest binary unit that divides it exactly."""
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def _is_loopback(host: str) -> bool:
    """Whether ``host`` resolves to a loopback address."""
    import ipaddress
    import socket
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _stop_on_signals(what: str) -> threading.Event:
    """An event that SIGINT and SIGTERM set (logging ``what``). Foreground commands wait on it
    in short slices: a signal delivered to another thread only runs its Python handler when the
    main thread executes bytecode."""
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("%s received, %s", signal.Signals(signum).name, what)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    return stop


def _sigterm_interrupts() -> None:
    """Make SIGTERM raise KeyboardInterrupt, so that a benchmark's teardown runs."""
    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, _term)


def _stdout_console(width: int = 160) -> Console:
    """A console on standard output: the terminal's width, or ``width`` when redirected."""
    from rich.console import Console
    return Console(width=None if sys.stdout.isatty() else width)


def _figure_table(title: str, rows: Sequence[tuple[str, object]]) -> Table:
    """A two-column table (figure, value) of ``rows``."""
    from rich.table import Table
    t = Table(title=title)
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name, value in rows:
        t.add_row(name, str(value))
    return t


def _write_json(path: str, doc: object) -> None:
    """Write ``doc`` to ``path`` as indented JSON."""
    import json
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)


# ---------------------------------------------------------------------------------------------
# The parser


def build_parser() -> argparse.ArgumentParser:
    """The ``switchml`` argument parser, every command's handler bound as ``func``."""
    parser = argparse.ArgumentParser(
        prog="switchml",
        description="In-network aggregation for distributed training: a software SwitchML "
                    "switch, worker library and benchmarks.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="Run 'switchml COMMAND --help' for a command's options.",
    )
    parser.add_argument("--version", action="version", version=f"switchml {__version__}")
    parser.add_argument("--log-level", default=_env("log_level", "info"),
                        choices=["debug", "info", "warning", "error"],
                        help="log verbosity (default: info)")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (_add_switch_parser, _add_demo_parser, _add_stats_parser, _add_testbed_parser,
                _add_bench_parser, _add_predict_parser, _add_ps_parser, _add_sim_parser,
                _add_tls_parser):
        add(sub)
    return parser


def _add_switch_parser(sub: _Subparsers) -> None:
    """``switchml switch``: a software switch in the foreground."""
    sw = sub.add_parser("switch", help="run a software switch in the foreground",
                        description="Run a software switch until SIGINT/SIGTERM. Jobs register "
                                    "themselves with their first JOIN; see docs/protocol.md.")
    sw.add_argument("--host", default=_env("host", "127.0.0.1"),
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    sw.add_argument("--port", type=int, default=int(_env("port", 48864)),
                    help="UDP port (default 48864; 0 picks a free one)")
    sw.add_argument("--pool-slots", type=int, default=int(_env("pool_slots", 1024)),
                    help="aggregation slots shared by all jobs; bounds the switch's slot "
                         "memory at 128 KiB per slot (default 1024 = 128 MiB)")
    sw.add_argument("--stats-interval-s", type=float, default=0.0,
                    help="log the counters every this many seconds (default 0: only at exit)")
    sw.add_argument("--lease-timeout-s", type=float,
                    default=float(_env("lease_timeout_s", 30.0)),
                    help="a job silent for this long loses its slots (default 30)")
    sw.add_argument("--member-timeout-s", type=float,
                    default=float(_env("member_timeout_s", 20.0)),
                    help="a member silent this long (no request, no keep-alive) is reported "
                         "gone to its peers, which then fail at once naming it (default 20)")
    sw.add_argument("--nack-gap", type=int, default=int(_env("nack_gap", 4)),
                    help="loss recovery: tell a worker at once that a chunk of its is missing "
                         "when its later chunks arrive, tolerating this much reordering "
                         "(completions); 0 leaves recovery to the workers' timeouts (default 4)")
    sw.add_argument("--secret-file", default=_env("secret_file", None),
                    help="file holding the secret needed to create jobs (workers pass it in "
                         "SWITCHML_SECRET); SWITCHML_SECRET also works here")
    sw.add_argument("--insecure", action="store_true",
                    help="allow listening beyond loopback without a secret (anyone who can "
                         "reach the port can then create jobs)")
    sw.add_argument("--metrics-port", type=int,
                    default=int(_env("metrics_port", 9109)),
                    help="Prometheus /metrics on 127.0.0.1:PORT (default 9109; 0: off); read "
                         "by 'switchml stats'")
    sw.add_argument("--mtu", type=int, default=None,
                    help="refuse jobs whose datagrams would not fit this MTU (e.g. 1500 or "
                         "9000), instead of letting IP fragment them; default: any size UDP "
                         "carries (workers size their chunks to their own path MTU)")
    sw.add_argument("--no-batching", action="store_true",
                    help="one system call per datagram: turn off UDP GSO/GRO batching (also: "
                         "SWITCHML_GSO=0)")
    sw.add_argument("--stop-on-stdin-eof", action="store_true",
                    help="also stop when standard input closes (used by the PyTorch backend's "
                         "embedded switch, so it dies with the process that started it)")
    _add_switch_topology_args(sw)
    sw.set_defaults(func=_run_switch)


def _add_switch_topology_args(sw: argparse.ArgumentParser) -> None:
    """The switch's sharding (``--shards``, ``--shard``) and rack (``--upstream``) options."""
    sw.add_argument("--shards", type=int, default=1, metavar="S",
                    help="run S switch processes (0: one per core) on ports PORT .. PORT+S-1 "
                         "(metrics on METRICS_PORT+i): workers stripe every job's lanes over "
                         "them (give them all: SWITCHML_SWITCH=h:p,h:p+1,...), so one job uses "
                         "every shard's core (default 1)")
    sw.add_argument("--upstream", type=_address, default=None, metavar="HOST:PORT",
                    help="run as the rack switch of a hierarchical job: aggregate this rack's "
                         "workers and send every partial sum to the parent (spine) switch at "
                         "HOST:PORT as one worker of its job; needs --rack and --job")
    sw.add_argument("--rack", type=_shard, default=None, metavar="I/R",
                    help="with --upstream: this is rack I of R equal racks")
    sw.add_argument("--job", default=None, metavar="SPEC",
                    help="with --upstream: the job of all the tree's workers "
                         "(switchml.control.encode_job_spec); the rack prints the spec its "
                         "own workers join with")
    sw.add_argument("--shard", type=_shard, default=None, metavar="I/S",
                    help="run shard I of a switch sharded over S processes or hosts (each "
                         "shard started by hand, e.g. one per host)")


def _add_demo_parser(sub: _Subparsers) -> None:
    """``switchml demo``: gloo against switchml on a small model."""
    demo = sub.add_parser(
        "demo", help="train a model with gloo and with switchml, side by side",
        description="Train a small CNN on scikit-learn's digits with DistributedDataParallel in "
                    "N worker processes, once on gloo and once on switchml (embedded switch, no "
                    "set-up); print a table and save loss curves (PNG) and figures (JSON).")
    demo.add_argument("--workers", "-n", type=int, default=4, help="worker processes (default 4)")
    demo.add_argument("--epochs", type=int, default=8, help="passes over the data (default 8)")
    demo.add_argument("--batch-size", type=int, default=32, help="per worker (default 32)")
    demo.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default 0.05)")
    demo.add_argument("--out", default="switchml-demo",
                      help="folder for loss.png and demo.json (default ./switchml-demo)")
    demo.add_argument("--backend", action="append", choices=["gloo", "switchml"],
                      help="run only this backend (repeatable; default both)")
    demo.set_defaults(func=_run_demo)


def _add_predict_parser(sub: _Subparsers) -> None:
    """``switchml predict``: profile a model, predict its step on each system."""
    from switchml import workloads
    pr = sub.add_parser(
        "predict", help="will switchml speed up my training job? (profile, then predict)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Profile a few local DDP steps of a model (compute, and each gradient\n"
                    "bucket's size and when backward makes it ready), then predict its step\n"
                    "time with N workers on links of the given rate and MTU: on gloo (ring\n"
                    "all-reduce), on switchml (the simulator's timing mode) and with the 16-bit\n"
                    "hook, composed as DDP overlaps communication with backward. Prints the\n"
                    "predicted speedup and the share of the step spent communicating.\n\n"
                    "With --against, predict every row of a 'switchml bench train --json' run\n"
                    "instead and print predicted against measured step times.",
        epilog="Workloads: " + ", ".join(workloads.NAMES) + "; or module:factory, where "
               "factory(batch) returns a switchml.workloads.Task or (model, loss_fn, "
               "batch_of).")
    pr.add_argument("--model", default="ncf",
                    help="a workload or module:factory (default ncf)")
    pr.add_argument("--batch", type=int, default=None, help="per-worker batch (default: the "
                    "workload's own)")
    pr.add_argument("--workers", "-n", type=int, default=4, help="workers (default 4)")
    pr.add_argument("--rate-mbit", type=float, default=1000.0,
                    help="link rate in Mbit/s (default 1000)")
    pr.add_argument("--mtu", type=int, default=1500, help="path MTU (default 1500)")
    pr.add_argument("--colocated", type=int, default=1, metavar="K",
                    help="profile K processes at once: the workers share this machine's cores "
                         "(as on the testbed), default 1 (each worker has a host of its own)")
    pr.add_argument("--steps", type=int, default=8, help="profiled steps (default 8)")
    pr.add_argument("--against", metavar="JSON",
                    help="a 'switchml bench train --json' file: predict each of its rows "
                         "(profiling as many processes at once as the run had workers)")
    pr.add_argument("--json", metavar="PATH", help="write the profile and predictions as JSON")
    pr.set_defaults(func=_run_predict)


def _run_predict(args: argparse.Namespace) -> int:
    """``switchml predict``: one table of predictions (or of predictions against a run)."""
    import json

    from rich.console import Console
    from rich.table import Table

    from switchml import predict as P
    console = Console(stderr=True)
    if args.against:
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
        _stdout_console().print(table)
        if args.json:
            _write_json(args.json, {"against": args.against, "rows": checked})
        return 0
    with console.status(f"profiling {args.model} ({args.colocated} at once)"):
        prof = P.profile(args.model, args.batch, steps=args.steps, colocated=args.colocated)
    with console.status("simulating the all-reduces"):
        preds = P.predict(prof, workers=args.workers, rate_bps=args.rate_mbit * 1e6,
                          mtu=args.mtu)
    table = Table(title=f"{args.model}: {prof.params:,} parameters, batch {prof.batch}, "
                        f"{args.workers} workers, {args.rate_mbit:g} Mbit/s, MTU {args.mtu}; "
                        f"compute {1e3 * prof.compute_s:.0f} ms per step "
                        f"({len(prof.buckets)} buckets)")
    for col in ("system", "step (ms)", "communication (ms)", "exposed (ms)",
                "share of step", "speedup vs gloo"):
        table.add_column(col, justify="right")
    for p in preds:
        table.add_row(p.system, f"{1e3 * p.step_s:.0f}", f"{1e3 * p.comm_s:.0f}",
                      f"{1e3 * p.exposed_s:.0f}", f"{p.comm_share:.0%}", f"{p.speedup:.2f}x")
    _stdout_console().print(table)
    best = max(preds, key=lambda p: p.speedup or 0)
    gloo = next(p for p in preds if p.system == "gloo")
    verdict = (f"switchml helps: {best.system} {best.speedup:.2f}x gloo's step, because "
               f"communication is {gloo.comm_share:.0%} of gloo's step and switchml moves "
               "fewer bytes" if (best.speedup or 0) > 1.05 else
               f"little to gain: communication is only {gloo.comm_share:.0%} of gloo's step")
    print(verdict)
    if args.json:
        _write_json(args.json, {"profile": P.profile_dict(prof),
                                "predictions": [dict(vars(p), comm_share=p.comm_share)
                                                for p in preds]})
    return 0


def _add_stats_parser(sub: _Subparsers) -> None:
    """``switchml stats``: a running switch's counters."""
    stats = sub.add_parser(
        "stats", help="live counters of a running switch",
        description="Show a running switch's counters (like a hardware switch's port counters) "
                    "from its Prometheus endpoint, refreshed every --interval-s.")
    stats.add_argument("--url", default=_env("stats_url", "http://127.0.0.1:9109/metrics"),
                       help="the switch's metrics URL (default http://127.0.0.1:9109/metrics); "
                            "a sharded switch: every shard's URL, comma-separated (summed)")
    stats.add_argument("--interval-s", type=float, default=1.0,
                       help="refresh period in seconds (default 1)")
    stats.add_argument("--once", action="store_true", help="print one table and exit")
    stats.set_defaults(func=_run_stats)


def _add_testbed_parser(sub: _Subparsers) -> None:
    """``switchml testbed``: an emulated star network (or, with ``--dcs``, the geo one)."""
    tb = sub.add_parser(
        "testbed", help="build an emulated star network and hold it until Ctrl-C (root)",
        description="Build the emulated network (one namespace per worker, a router in which "
                    "the switch runs, a parameter server; veth links shaped with tc tbf "
                    "both ways, nftables loss per datagram once per link, UDP GSO/GRO on), "
                    "print how to run things in it, and "
                    "tear it down on Ctrl-C or SIGTERM, removing exactly what it created.")
    tb.add_argument("--workers", "-n", type=int, default=4, help="worker hosts (default 4)")
    tb.add_argument("--rate-mbit", type=float, default=1000.0,
                    help="link rate in Mbit/s each way; 0 for unshaped (default 1000)")
    tb.add_argument("--loss", type=float, default=0.0, help="loss rate per link (default 0)")
    tb.add_argument("--cleanup", action="store_true",
                    help="only remove what testbed runs killed before their teardown (kill "
                         "-9) left behind: their namespaces and the processes in them; every "
                         "new testbed also does this first")
    tb.add_argument("--mtu", type=int, default=1500,
                    help="link MTU in bytes (default 1500, Ethernet; 9000 for jumbo frames; "
                         "veth takes up to 65535 but that is not a real network)")
    tb.add_argument("--dcs", default=None,
                    help="build the geo testbed instead: data centres x workers, e.g. 2x2 or "
                         "2,3 (workers on --rate-mbit LAN links, data centres joined by "
                         "--wan-mbit WAN links)")
    tb.add_argument("--wan-mbit", type=float, default=50.0,
                    help="with --dcs: WAN link rate in Mbit/s (default 50)")
    tb.set_defaults(func=_run_testbed)


def _add_bench_parser(sub: _Subparsers) -> None:
    """``switchml bench``: the benchmarks, one subcommand each."""
    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
    for add in (_add_bench_allreduce_parser, _add_bench_train_parser, _add_bench_plot_parser,
                _add_bench_soak_parser, _add_bench_fuzz_parser, _add_bench_switch_parser,
                _add_bench_geo_parser):
        add(bsub)


def _add_bench_allreduce_parser(bsub: _Subparsers) -> None:
    """``switchml bench allreduce``: all-reduce throughput, switchml against gloo."""
    ar = bsub.add_parser(
        "allreduce", help="all-reduce ATE/s of switchml against gloo",
        description="Run N worker processes on this machine and measure all-reduce throughput "
                    "in ATE/s (aggregated tensor elements per second, per worker) for switchml "
                    "and for torch.distributed gloo (ring all-reduce) in the same run.")
    ar.add_argument("--workers", "-n", type=int, default=4, help="worker processes (default 4)")
    ar.add_argument("--size", type=_size, action="append", dest="sizes",
                    help="tensor size in bytes of float32, with unit (e.g. 64MiB); repeat for "
                         "several (default 64MiB)")
    ar.add_argument("--iters", type=int, default=5, help="timed operations per size (default 5)")
    ar.add_argument("--warmup", type=int, default=2, help="untimed operations first (default 2)")
    ar.add_argument("--switch", type=_address, default=None,
                    help="HOST:PORT of a running switch (default: start one for the benchmark)")
    ar.add_argument("--window", type=int, default=None,
                    help="slots per job, W (default: about 256 KiB in flight per worker: 128 "
                         "at MTU 1500, 29 at 9000, 16 for 64 KB datagrams)")
    ar.add_argument("--elements-per-packet", type=int, default=None,
                    help="int32 elements per packet, k (default: the largest that fits the "
                         "MTU: 16366 (64 KB datagrams) on loopback, 358 at 1500, 2233 at 9000)")
    ar.add_argument("--bits", type=int, choices=(32, 16), default=32,
                    help="switchml's wire width for floats: 32, or 16 (fixed point in half the "
                         "bytes, the DDP hook's bandwidth-halving mode) (default 32)")
    ar.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline")
    ar.add_argument("--no-batching", action="store_true",
                    help="switch and workers make one system call per datagram (no UDP "
                         "GSO/GRO): the baseline for small packets")
    _add_bench_allreduce_testbed_args(ar)
    ar.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ar.add_argument("--timeout-s", type=float, default=600.0,
                    help="give up on a measurement after this long (default 600)")
    ar.set_defaults(func=_run_bench_allreduce)


def _add_bench_allreduce_testbed_args(ar: argparse.ArgumentParser) -> None:
    """``bench allreduce``'s emulated-network options (the "testbed" group) and ``--mtu``."""
    tbg = ar.add_argument_group(
        "testbed", "run over an emulated star network instead of loopback (needs root): one "
        "namespace per worker, a router in the middle with the switch behind it, links shaped "
        "with tc tbf both ways")
    tbg.add_argument("--testbed", action="store_true", help="use the emulated network")
    tbg.add_argument("--racks", type=int, default=1,
                     help="hierarchical aggregation: RACKS racks of -n workers each, every rack "
                          "switch under a spine switch, against one rack alone (switchml only; "
                          "default 1: a flat star)")
    tbg.add_argument("--nack-gap", type=int, default=4,
                     help="the switch's NACK gap (0: loss recovery by timeouts alone; compare "
                          "the two in one session) (default 4)")
    tbg.add_argument("--fast-retransmit", action="store_true",
                     help="switchml workers re-send a chunk as soon as a later chunk's result "
                          "arrives (RACK) instead of at its timeout (off by default: it did "
                          "not help on this testbed, see docs/benchmarks.md)")
    tbg.add_argument("--rate-mbit", type=float, default=1000.0,
                     help="link rate in Mbit/s, each direction (default 1000)")
    tbg.add_argument("--loss", type=float, default=0.0,
                     help="packet loss rate on every link, 0..1 (default 0)")
    ar.add_argument("--mtu", type=int, default=None,
                    help="MTU in bytes that chunks must fit (no IP fragmentation). Testbed: "
                         "the link MTU (default 1500, Ethernet; 9000 for jumbo frames; veth "
                         "takes up to 65535 but that is not a real network). Loopback: default "
                         "the route's MTU (65536)")
    tbg.add_argument("--systems", default="switchml,gloo,ps",
                     help="comma list of switchml, gloo, ps (parameter server) and floor (the "
                          "same bytes echoed through a hub in switchml's datagrams, with no "
                          "protocol: the CPU floor of the data path) (default switchml,gloo,ps)")
    tbg.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")


def _add_bench_train_parser(bsub: _Subparsers) -> None:
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
                    "behind backward, the speedup against gloo, and the ideal step time: the "
                    "step with no communication (the noop system) plus the exposed part of the "
                    "row's wire time at the link rate.",
        epilog="Workloads: " + "; ".join(f"{w}: {workloads.get(w).summary}"
                                          for w in workloads.NAMES))
    tr.add_argument("--workers", "-n", type=int, default=4, help="workers (default 4)")
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
                         "gloo, switchml (DDP on that backend), switchml16 (DDP with the 16-bit "
                         "switchml hook), hybrid (HybridDataParallel on switchml: per layer, "
                         "aggregation or sufficient-factor broadcasting), hsdp and hsdp-gloo "
                         "(FSDP2 on a mesh of n/2 replicas x 2 shards; the replicas' all-reduce "
                         "goes through the switch on hsdp, timed per step) (default "
                         "noop,gloo,switchml)")
    tr.add_argument("--trace", metavar="PATH",
                    help="write a Chrome trace (JSON, open in ui.perfetto.dev) of every rank's "
                         "forward, backward, optimizer and communication spans, and report the "
                         "fraction of communication hidden behind backward compute")
    tr.add_argument("--rate-mbit", type=float, default=1000.0,
                    help="link rate in Mbit/s (default 1000)")
    tr.add_argument("--loss", type=float, default=0.0, help="loss rate per link (default 0)")
    tr.add_argument("--mtu", type=int, default=1500,
                    help="link MTU in bytes; switchml's chunks are sized to fit it (default "
                         "1500, Ethernet; 9000 for jumbo frames; veth takes up to 65535 but "
                         "that is not a real network)")
    tr.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    tr.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    tr.add_argument("--plot", metavar="PNG", help="save training loss against time (and "
                    "bytes per step and step time per system to PNG's name + '-bytes'; with "
                    "--trace, rank 0's last two steps to + '-timeline')")
    tr.set_defaults(func=_run_bench_train)


def _add_bench_plot_parser(bsub: _Subparsers) -> None:
    """``switchml bench plot``: PNG plots of testbed benchmark results."""
    pl = bsub.add_parser("plot", help="PNG plots from testbed benchmark JSON files",
                         description="Draw ATE/s against size (with the line-rate and ring "
                                     "bounds), speedup over gloo against n, and slowdown "
                                     "against loss, from 'bench allreduce --testbed --json' "
                                     "files.")
    pl.add_argument("files", nargs="+", help="JSON files")
    pl.add_argument("--out", default="plots", help="output folder (default ./plots)")
    pl.set_defaults(func=_run_bench_plot)


def _add_bench_soak_parser(bsub: _Subparsers) -> None:
    """``switchml bench soak``: long runs with loss and churn, every result checked."""
    so = bsub.add_parser(
        "soak", help="jobs with loss and churn against one switch: exact or error, never wrong",
        description="Run several jobs of worker processes (int32 all-reduces, every result "
                    "checked exactly) with seeded loss in every worker, while jobs stop and "
                    "start and workers are killed; report operations, errors, wrong results "
                    "(must be 0) and the switch's memory over time.")
    so.add_argument("--duration-s", type=float, default=60.0, help="run time (default 60)")
    so.add_argument("--jobs", type=int, default=3, help="concurrent jobs (default 3)")
    so.add_argument("--workers", type=int, default=2, help="workers per job (default 2)")
    so.add_argument("--loss", type=float, default=0.01,
                    help="datagram loss rate in each direction, 0..1 (default 0.01)")
    so.add_argument("--churn-interval-s", type=float, default=5.0,
                    help="stop or kill one job this often (default 5)")
    so.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    so.add_argument("--json", metavar="PATH", help="write the report as JSON")
    so.set_defaults(func=_run_bench_soak)


def _add_bench_fuzz_parser(bsub: _Subparsers) -> None:
    """``switchml bench fuzz``: hostile datagrams at a switch."""
    fz = bsub.add_parser(
        "fuzz", help="hostile datagrams at a switch while a job runs",
        description="Send hostile datagrams (random bytes, truncated and oversized ones, valid "
                    "headers with wrong fields, forged requests, JOIN floods) at a fresh switch "
                    "while a 2-rank job runs; report drops, the job's results and the switch's "
                    "memory.")
    fz.add_argument("--datagrams", type=int, default=1_000_000,
                    help="hostile datagrams in all (default 1000000)")
    fz.add_argument("--senders", type=int, default=2, help="sender processes (default 2)")
    fz.add_argument("--rate", type=float, default=20_000.0,
                    help="datagrams per second per sender (default 20000; 0: unpaced)")
    fz.add_argument("--no-secret", action="store_true",
                    help="run the switch without a job-creation secret (JOIN floods then fill "
                         "the pool, which bounds the memory)")
    fz.add_argument("--json", metavar="PATH", help="write the report as JSON")
    fz.set_defaults(func=_run_bench_fuzz)


def _add_bench_switch_parser(bsub: _Subparsers) -> None:
    """``switchml bench switch``: one software switch's capacity."""
    sc = bsub.add_parser(
        "switch", help="switch capacity: aggregated datagrams/s of a software switch",
        description="Run the software switch in a process pinned to one core and a traffic "
                    "generator pinned to another, which joins a job as N ranks and replays "
                    "valid int32 requests as fast as the switch answers (W slots in flight per "
                    "rank, self-clocked). Report datagrams/s in and out of the switch, payload "
                    "GB/s, switch and generator CPU (which one was the bottleneck), switch CPU "
                    "time per datagram, drops and wrong results (must be 0). With --shards S, "
                    "S switch processes (as `switchml switch --shards S`) each own lanes i mod "
                    "S of the job, one generator per shard feeds them, and the figures are "
                    "given per shard and summed; compare S = 1, 2, ... on a machine with 2S "
                    "cores to see how capacity grows with shards.")
    sc.add_argument("--workers", "-n", type=int, default=4, help="ranks in the job (default 4)")
    sc.add_argument("--elements-per-packet", "-k", type=int, default=256,
                    help="int32 elements per request, K (default 256 = 1 KiB payload; 358 fits "
                         "a 1500-byte MTU, 2200 a 9000-byte one)")
    sc.add_argument("--window", "-w", type=int, default=64,
                    help="slots in flight per rank, W (default 64)")
    sc.add_argument("--seconds", type=float, default=5.0,
                    help="measured interval in seconds, after 0.5 s of warm-up (default 5)")
    sc.add_argument("--batching", action=argparse.BooleanOptionalAction, default=True,
                    help="UDP GSO/GRO in the switch and the generator (default on)")
    sc.add_argument("--shards", type=int, default=1, metavar="S",
                    help="switch processes the job's lanes are striped over (default 1; W "
                         "must be at least S)")
    sc.add_argument("--generators", type=int, default=0, metavar="G",
                    help="generator processes, each feeding S/G of the shards (default 0: "
                         "one per shard)")
    sc.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    sc.set_defaults(func=_run_bench_switch)


def _add_bench_geo_parser(bsub: _Subparsers) -> None:
    """``switchml bench geo``: Gaia against synchronous training across data centres."""
    geo = bsub.add_parser(
        "geo", help="Gaia against synchronous training across data centres (root)",
        description="Train the same model (switchml.workloads' CNN on scikit-learn's digits) "
                    "three ways on the geo testbed: all workers in one data centre (LAN), "
                    "synchronous DDP spanning the WAN, and Gaia (synchronous inside each data "
                    "centre, significant updates across). Reports time to target accuracy, "
                    "final accuracy and WAN bytes (WAN interface counters); writes geo.json, "
                    "geo.csv and geo.png (accuracy against time). Needs root.")
    geo.add_argument("--dcs", default="2x2", help="data centres x workers (default 2x2)")
    geo.add_argument("--wan-mbit", type=float, default=50.0, help="WAN Mbit/s (default 50)")
    geo.add_argument("--lan-mbit", type=float, default=1000.0, help="LAN Mbit/s (default 1000)")
    geo.add_argument("--modes", default="lan,wan,gaia", help="comma list (default all three)")
    geo.add_argument("--steps", type=int, default=150, help="steps per run (default 150)")
    geo.add_argument("--batch", type=int, default=32, help="samples per worker (default 32)")
    geo.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    geo.add_argument("--model", choices=("cnn", "mlp"), default="cnn", help="(default cnn)")
    geo.add_argument("--target", type=float, default=0.95,
                     help="target test accuracy (default 0.95)")
    geo.add_argument("--eval-every", type=int, default=5, help="steps (default 5)")
    geo.add_argument("--threshold", type=float, default=0.1,
                     help="Gaia's significance threshold S (default 0.1 here; the library's "
                          "default is 0.01 decaying, which sends about half the entries "
                          "every clock of a run this short: docs/geo.md)")
    geo.add_argument("--decay", action=argparse.BooleanOptionalAction, default=False,
                     help="decay the threshold as S/sqrt(t) (default off here)")
    geo.add_argument("--staleness", type=int, default=2,
                     help="mirror clock: clocks a data centre may run ahead (default 2)")
    geo.add_argument("--gaia-lr-scale", type=float, default=None,
                     help="Gaia's learning rate factor (default 1/data centres)")
    geo.add_argument("--dc-backend", choices=("gloo", "switchml"), default="gloo",
                     help="Gaia's synchronous training inside a data centre: DDP over gloo, "
                          "or over switchml with a switch in each data centre's router "
                          "(default gloo, as the other two modes)")
    geo.add_argument("--out", default="switchml-geo", help="output folder (default "
                                                           "switchml-geo)")
    geo.set_defaults(func=_run_bench_geo)


def _add_ps_parser(sub: _Subparsers) -> None:
    """``switchml ps``: parameter servers, one subcommand per role."""
    ps = sub.add_parser(
        "ps", help="TensorFlow-style parameter servers: run one, or train with them",
        description="Parameter servers: parameters placed round-robin by tensor on P servers "
                    "(large tensors split), workers push gradients and pull parameters over "
                    "TCP, the optimizer step runs on the servers. Synchronous with backup "
                    "workers (each step takes the first N-b gradients; late ones are dropped "
                    "and counted) or asynchronous. See docs/geo.md.")
    pss = ps.add_subparsers(dest="ps", required=True, metavar="ROLE")
    _add_ps_server_parser(pss)
    _add_ps_train_parser(pss)


def _add_ps_server_parser(pss: _Subparsers) -> None:
    """``switchml ps server``: one parameter server in the foreground."""
    srv = pss.add_parser("server", help="run one parameter server in the foreground",
                         description="Serve until SIGINT/SIGTERM (or, with --exit-when-done, "
                                     "until every worker said goodbye or died).")
    srv.add_argument("--index", type=int, default=0, help="this server's index (default 0)")
    srv.add_argument("--host", default="127.0.0.1",
                     help="listen address (default 127.0.0.1; beyond loopback it needs "
                          "--tls-dir or --insecure)")
    srv.add_argument("--port", type=int, default=40000, help="TCP port (default 40000)")
    srv.add_argument("--tls-dir", default=_env("tls_dir", None),
                     help="mutual-TLS credentials (ca.pem, peer.pem, peer.key; 'switchml tls "
                          "init DIR' makes them): only peers with a certificate of the same CA "
                          "connect, and all traffic is encrypted (env SWITCHML_TLS_DIR)")
    srv.add_argument("--insecure", action="store_true",
                     help="allow plain TCP beyond loopback (anyone who reaches the port can "
                          "set parameters and read them)")
    srv.add_argument("--exit-when-done", action="store_true",
                     help="exit when every worker said goodbye or died")
    _add_ps_training_args(srv)
    srv.set_defaults(func=_run_ps_server)


def _add_ps_train_parser(pss: _Subparsers) -> None:
    """``switchml ps train``: P servers and N workers on this machine."""
    tr = pss.add_parser("train", help="start P servers and N workers here; train on digits",
                        description="Start --servers server processes and --workers worker "
                                    "processes on this machine, train a model on "
                                    "scikit-learn's digits through the servers, print the "
                                    "placement, accuracy, dropped gradients and a digest of "
                                    "the final parameters (equal between runs with the same "
                                    "seed and no backup workers).")
    tr.add_argument("--servers", "-p", type=int, default=2, help="server processes (default 2)")
    tr.add_argument("--steps", type=int, default=200, help="steps (versions) (default 200)")
    tr.add_argument("--batch", type=int, default=32, help="samples per worker (default 32)")
    tr.add_argument("--model", choices=("mlp", "cnn"), default="mlp",
                    help="mlp (19k parameters) or cnn (560k) (default mlp)")
    tr.add_argument("--seed", type=int, default=0, help="seed of model and data (default 0)")
    tr.add_argument("--max-shard-elements", type=int, default=1 << 17,
                    help="split tensors above this many elements (default 131072)")
    tr.add_argument("--slow-worker", type=int, default=None,
                    help="make this worker a straggler (sleeps --slow-s per step)")
    tr.add_argument("--slow-s", type=float, default=0.05, help="straggler delay (default 0.05)")
    tr.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    tr.add_argument("--tls", action="store_true",
                    help="mutual TLS on every link, with credentials made for this run")
    _add_ps_training_args(tr)
    tr.set_defaults(func=_run_ps_train)


def _add_ps_training_args(p: argparse.ArgumentParser) -> None:
    """The options a parameter server and a training run share: workers, rule, optimizer."""
    p.add_argument("--workers", "-n", type=int, default=4, help="workers N (default 4)")
    p.add_argument("--backup", "-b", type=int, default=0,
                   help="backup workers b: each step uses the first N-b gradients "
                        "(default 0)")
    p.add_argument("--mode", choices=("sync", "async"), default="sync",
                   help="synchronous steps or asynchronous updates (default sync)")
    p.add_argument("--optimizer", choices=("sgd", "adam"), default="sgd",
                   help="optimizer run on the servers (default sgd)")
    p.add_argument("--lr", type=float, default=0.05, help="learning rate (default 0.05)")
    p.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default 0.9)")
    p.add_argument("--timeout-s", type=float, default=60.0,
                   help="a missing gradient or silent peer fails the run after this "
                        "long, naming it (default 60)")


def _add_tls_parser(sub: _Subparsers) -> None:
    """``switchml tls init DIR``: credentials for the parameter-server and Gaia links."""
    tls = sub.add_parser("tls", help="make TLS credentials for parameter servers and Gaia",
                         description="TLS credentials for the parameter-server and Gaia links "
                                     "(docs/operations.md).")
    tsub = tls.add_subparsers(dest="tls_command", required=True, metavar="SUBCOMMAND")
    init = tsub.add_parser("init", help="make a CA and a peer certificate in DIR",
                           description="Make a CA (ca.pem, ca.key) and one peer certificate "
                                       "signed by it (peer.pem, peer.key) in DIR. Give every "
                                       "server, worker and data-centre leader of the job DIR "
                                       "without ca.key (--tls-dir or SWITCHML_TLS_DIR).")
    init.add_argument("dir", help="directory to create (mode 0700)")
    init.add_argument("--days", type=int, default=365, help="validity (default 365 days)")
    init.set_defaults(func=_run_tls_init)


def _run_tls_init(args: argparse.Namespace) -> int:
    from switchml.links import make_credentials

    sec = make_credentials(args.dir, days=args.days)
    print(f"made {sec.ca}, {sec.cert} and {sec.key} (and ca.key: keep it off the peers)")
    return 0


def _add_sim_parser(sub: _Subparsers) -> None:
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
    _add_sim_network_args(sim)
    _add_sim_scenario_args(sim)
    sim.set_defaults(func=_run_sim)


def _add_sim_network_args(sim: argparse.ArgumentParser) -> None:
    """``sim``'s sweep, links and topology options."""
    sim.add_argument("--workers", "-n", type=int, action="append", dest="workers",
                     help="workers; repeat for a sweep (default 4)")
    sim.add_argument("--size", type=_size, default=64 << 20,
                     help="tensor size (float32) with unit, e.g. 64MiB (default 64MiB)")
    sim.add_argument("--mode", choices=("timing", "exact"), default="timing",
                     help="timing: modelled protocol, no payloads; exact: the real endpoints "
                          "and data, every sum checked (default timing)")
    sim.add_argument("--rate-mbit", type=float, default=1000.0,
                     help="worker link rate in Mbit/s, each direction (default 1000)")
    sim.add_argument("--spine-rate-mbit", type=float, default=None,
                     help="rack-to-spine link rate in Mbit/s (default: --rate-mbit)")
    sim.add_argument("--delay-us", type=float, default=0.0,
                     help="propagation delay per link in microseconds (default 0, as veth)")
    sim.add_argument("--queue-ms", type=float, default=20.0,
                     help="queue limit per link as milliseconds of its rate (default 20, the "
                          "testbed's tbf latency)")
    sim.add_argument("--mtu", type=int, default=1500,
                     help="path MTU in bytes; chunks fit it (358 int32 at 1500) (default 1500)")
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


def _add_sim_scenario_args(sim: argparse.ArgumentParser) -> None:
    """``sim``'s host, switch, straggler and failure options, and its outputs."""
    sim.add_argument("--host-cost-us", type=float, default=None,
                     help="worker CPU per datagram received or sent, in microseconds (default "
                          "6.6, calibrated on the testbed; 0: hosts are never the bottleneck)")
    sim.add_argument("--nack-gap", type=int, default=4,
                     help="switch-driven loss recovery: NACK a rank whose chunk released this "
                          "many completions earlier is missing (0: off, loss waits for a "
                          "timeout) (default 4, the switch's default)")
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
    sim.add_argument("--seed", type=int, default=0, help="seed of every random draw (default 0)")
    sim.add_argument("--compare", nargs="+", metavar="TESTBED_JSON",
                     help="instead: simulate every loss-free switchml row of these testbed "
                          "JSON files (same n, rate, MTU, size) and print sim / testbed")
    sim.add_argument("--json", metavar="PATH", help="write every run as JSON")
    sim.add_argument("--plot", metavar="PNG",
                     help="plot ATE/s against n (with the bounds) and/or against loss")
    sim.add_argument("--quiet", action="store_true", help="no progress lines on stderr")


# ---------------------------------------------------------------------------------------------
# switchml switch


def _run_switch(args: argparse.Namespace) -> int:
    """``switchml switch``: serve until SIGINT/SIGTERM (or standard input's end)."""
    secret = _switch_secret(args)
    shards = _switch_shard_count(args)
    if shards > 1:
        return _run_sharded_switch(args, shards)
    shard_index, shard_count = args.shard or (0, 1)
    rack = _rack_aggregator(args, secret) if args.upstream is not None else None
    server = _switch_server(args, secret, rack, shard_index, shard_count)
    if args.metrics_port:
        _start_metrics(server, args.pool_slots, args.metrics_port)
    stop = _stop_on_signals("stopping")
    server.start()
    if rack is not None:
        server.run_command(rack.join)  # join the parent job upstream
    from switchml.control.announce import announce
    announce(server.address, (shard_index, shard_count))  # the launchers' contract
    if args.stop_on_stdin_eof:
        _stop_on_stdin_eof(stop, server)
    _serve_until_stopped(server, stop, args.stats_interval_s)
    server.stop()
    return 0


def _switch_secret(args: argparse.Namespace) -> bytes | None:
    """The job-creation secret (``--secret-file`` or ``SWITCHML_SECRET``); refuses to listen
    beyond loopback without one unless ``--insecure``."""
    secret = None
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = f.read().strip()
    else:
        secret = env.secret()
    if secret is None and not _is_loopback(args.host) and not args.insecure:
        raise ValueError(f"listening on {args.host} exposes job creation to the network: give "
                         "--secret-file (or SWITCHML_SECRET), or --insecure to allow it anyway")
    return secret


def _switch_shard_count(args: argparse.Namespace) -> int:
    """How many switch processes ``--shards`` asks for here (0: one per core)."""
    shards = args.shards if args.shards > 0 else (os.cpu_count() or 1)
    if args.shards < 0:
        raise ValueError(f"--shards must be >= 0, got {args.shards}")
    if shards > 1 and args.shard is not None:
        raise ValueError("give --shards (run them all here) or --shard I/S (one), not both")
    return shards


def _rack_aggregator(args: argparse.Namespace, secret: bytes | None) -> RackAggregator:
    """The rack data plane of ``--upstream``; prints the job spec its own workers join with."""
    import socket

    from switchml.control import decode_job_spec, encode_job_spec
    from switchml.protocol.config import SwitchConfig
    from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
    if args.rack is None or args.job is None:
        raise ValueError("--upstream needs --rack I/R and --job SPEC")
    parent, child = tree_specs(decode_job_spec(args.job), args.rack[1])
    rack = RackAggregator(parent_spec=parent, child_spec=child, rack=args.rack[0],
                          parent_address=(socket.gethostbyname(args.upstream[0]),
                                          args.upstream[1]),
                          config=TreeConfig(secret=secret),
                          switch_config=SwitchConfig(
                              pool_slots=args.pool_slots,
                              lease_timeout_s=args.lease_timeout_s, secret=secret,
                              nack_gap=args.nack_gap, member_timeout_s=args.member_timeout_s))
    print(f"rack {args.rack[0]} of {args.rack[1]}: its workers join with "
          f"SWITCHML_JOB={encode_job_spec(child)} (rank = global rank mod "
          f"{child.num_workers})", flush=True)
    return rack


def _switch_server(args: argparse.Namespace, secret: bytes | None,
                   rack: RackAggregator | None, shard_index: int, shard_count: int
                   ) -> SwitchServer:
    """The (not yet started) UDP switch server the options describe."""
    from switchml.protocol.config import SwitchConfig
    from switchml.protocol.wire import elements_for_mtu
    from switchml.transport.udp import SwitchServer

    return SwitchServer(host=args.host, port=args.port, config=SwitchConfig(
        pool_slots=args.pool_slots, lease_timeout_s=args.lease_timeout_s, secret=secret,
        nack_gap=args.nack_gap, shard_index=shard_index, shard_count=shard_count,
        member_timeout_s=args.member_timeout_s,
        **({"max_elements_per_packet": elements_for_mtu(args.mtu)} if args.mtu else {})),
        batching=not args.no_batching and env.batching(), dataplane=rack)


def _start_metrics(server: SwitchServer, pool_slots: int, port: int) -> None:
    """Serve ``server``'s counters on http://127.0.0.1:PORT/metrics (a warning if it can't)."""
    from switchml.control.metrics import start_exporter
    try:
        start_exporter(server.stats, pool_slots, "127.0.0.1", port)
        log.info("metrics on http://127.0.0.1:%d/metrics", port)
    except OSError as exc:
        log.warning("metrics endpoint not started on port %d: %s", port, exc)


_OWNER_GONE_QUIET_S = 1.0
_OWNER_GONE_MAX_S = 5.0


def _stop_on_stdin_eof(stop: threading.Event, server: SwitchServer) -> None:
    """Set ``stop`` once standard input has closed (the owner is gone) and the switch has
    then been quiet for ``_OWNER_GONE_QUIET_S`` (at most ``_OWNER_GONE_MAX_S``).

    Not at once: the owner's process (rank 0 of an embedded switch) may end first in an
    operation whose outcome the other ranks have yet to hear, a MISMATCH, say. A switch
    that stopped with it left them waiting out their timeout; it answers them first."""
    def _watch_stdin() -> None:
        while sys.stdin.read(4096):
            pass
        log.info("standard input closed: stopping once quiet for %g s", _OWNER_GONE_QUIET_S)
        deadline = time.monotonic() + _OWNER_GONE_MAX_S
        seen = server.stats().get("packets_in")
        while not stop.wait(_OWNER_GONE_QUIET_S) and time.monotonic() < deadline:
            now = server.stats().get("packets_in")
            if now == seen:
                break
            seen = now
        stop.set()
    threading.Thread(target=_watch_stdin, daemon=True).start()


def _serve_until_stopped(server: SwitchServer, stop: threading.Event,
                         stats_interval_s: float) -> None:
    """Wait for ``stop``, logging the counters every ``stats_interval_s`` (if > 0)."""
    next_stats = time.monotonic() + stats_interval_s if stats_interval_s > 0 else None
    # Wake up at least twice a second: a signal delivered to another thread only runs its
    # Python handler when the main thread executes bytecode, which a bare wait() never does.
    while not stop.wait(_SIGNAL_POLL_S):
        if next_stats is not None and time.monotonic() >= next_stats:
            log.info("stats: %s", server.stats())
            next_stats += stats_interval_s


def _shard_argv(args: argparse.Namespace, i: int, shards: int) -> list[str]:
    """The command line of shard ``i`` of ``shards`` (``switchml switch --shards``)."""
    argv = [sys.executable, "-m", "switchml", "--log-level", args.log_level, "switch",
            "--host", args.host, "--port", str(args.port + i), "--shard", f"{i}/{shards}",
            "--pool-slots", str(args.pool_slots), "--lease-timeout-s", str(args.lease_timeout_s),
            "--nack-gap", str(args.nack_gap), "--stats-interval-s", str(args.stats_interval_s),
            "--member-timeout-s", str(args.member_timeout_s),
            "--metrics-port", str(args.metrics_port + i if args.metrics_port else 0),
            "--stop-on-stdin-eof"]
    if args.secret_file:
        argv += ["--secret-file", args.secret_file]
    if args.insecure:
        argv.append("--insecure")
    if args.mtu:
        argv += ["--mtu", str(args.mtu)]
    if args.no_batching:
        argv.append("--no-batching")
    return argv


def _run_sharded_switch(args: argparse.Namespace, shards: int) -> int:
    """Run ``shards`` switch processes and watch them: a shard that dies stops the others and
    the command fails naming it (its workers fail within their timeout, naming it too)."""
    import subprocess

    if args.port == 0:
        raise ValueError("--shards needs a fixed --port (shard i listens on PORT+i)")
    addrs = ",".join(f"{args.host}:{args.port + i}" for i in range(shards))
    # Said before the shards start, so that it is the first line (the shards print theirs).
    print(f"switchml switch: {shards} shards on udp {addrs} (workers: SWITCHML_SWITCH={addrs})",
          flush=True)
    procs = [subprocess.Popen(_shard_argv(args, i, shards), stdin=subprocess.PIPE)
             for i in range(shards)]
    stop = _stop_on_signals("stopping the shards")
    failed = None
    while not stop.wait(_SIGNAL_POLL_S):
        for i, p in enumerate(procs):
            if p.poll() is not None:
                failed = (i, p.returncode)
                stop.set()
                break
    for p in procs:
        if p.poll() is None:
            p.stdin.close()  # type: ignore[union-attr]  # --stop-on-stdin-eof
            p.terminate()
    for p in procs:
        try:
            p.wait(timeout=10)
        except subprocess.TimeoutExpired:
            p.kill()
    if failed is not None:
        i, rc = failed
        log.error("shard %d (udp %s:%d) exited with status %s; stopped the others", i,
                  args.host, args.port + i, rc)
        return 1
    return 0


# ---------------------------------------------------------------------------------------------
# switchml stats


def _run_stats(args: argparse.Namespace) -> int:
    """``switchml stats``: one table (``--once``) or a live one until Ctrl-C."""
    from rich.console import Console
    from rich.live import Live

    current = _read_counters(args.url)
    if args.once:
        Console().print(_stats_table(args.url, current, None, 0.0))
        return 0
    with Live(_stats_table(args.url, current, None, 0.0), refresh_per_second=4) as live:
        try:
            while True:
                t0 = time.monotonic()
                time.sleep(args.interval_s)
                nxt = _read_counters(args.url)
                live.update(_stats_table(args.url, nxt, current, time.monotonic() - t0))
                current = nxt
        except KeyboardInterrupt:
            pass
    return 0


def _read_counters(urls: str) -> dict:
    """One switch's counters, or the sum over a sharded switch's shards (comma list)."""
    from switchml.control.metrics import read_metrics

    total: dict = {}
    for url in urls.split(","):
        try:
            one = read_metrics(url)
        except OSError as exc:
            raise ValueError(f"can't read {url}: {exc} (is a switch running (every shard) with "
                             "--metrics-port?)") from exc
        for k, v in one.items():
            if isinstance(v, dict):
                d = total.setdefault(k, {})
                for label, x in v.items():
                    d[label] = d.get(label, 0) + x
            else:
                total[k] = total.get(k, 0) + v
    return total


def _counter_rate(now: dict, before: dict | None, dt: float, key: str,
                  label: str | None = None) -> str:
    """Counter ``key`` (its ``label`` series, if given) per second between two readings."""
    if before is None or dt <= 0:
        return ""
    a = now.get(key, {}) if label is not None else now.get(key, 0)
    b = before.get(key, {}) if label is not None else before.get(key, 0)
    if label is not None:
        a, b = a.get(label, 0), b.get(label, 0)
    return f"{(a - b) / dt:,.0f}"


def _stats_table(url: str, now: dict, before: dict | None, dt: float) -> Table:
    """The counters table: values and, given an earlier reading, rates."""
    from rich.table import Table

    t = Table(title=f"switchml switch {url}")
    t.add_column("counter")
    t.add_column("value", justify="right")
    t.add_column("per second", justify="right")
    for key, name in (("switchml_packets_in_total", "packets in"),
                      ("switchml_packets_out_total", "packets out"),
                      ("switchml_results_multicast_total", "results multicast"),
                      ("switchml_results_resent_total", "results resent (shadow copy)"),
                      ("switchml_waiting_sent_total", "WAITING answers"),
                      ("switchml_mismatch_sent_total", "MISMATCH answers")):
        t.add_row(name, f"{now.get(key, 0):,.0f}", _counter_rate(now, before, dt, key))
    t.add_row("jobs", f"{now.get('switchml_jobs', 0):.0f}", "")
    t.add_row("slots in use", f"{now.get('switchml_slots_in_use', 0):.0f} / "
              f"{now.get('switchml_pool_slots', 0):.0f}", "")
    t.add_row("slot memory", f"{now.get('switchml_memory_bytes', 0) / 2**20:.1f} MiB", "")
    for job, n in sorted(now.get("switchml_elements_aggregated_total", {}).items()):
        t.add_row(f"job {job} elements", f"{n:,.0f}",
                  _counter_rate(now, before, dt, "switchml_elements_aggregated_total", job))
    for reason, n in sorted(now.get("switchml_drops_total", {}).items()):
        t.add_row(f"drops: {reason}", f"{n:,.0f}",
                  _counter_rate(now, before, dt, "switchml_drops_total", reason))
    return t


# ---------------------------------------------------------------------------------------------
# switchml demo


def _run_demo(args: argparse.Namespace) -> int:
    """``switchml demo``: train on gloo and on switchml, then compare."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TaskID, TextColumn, TimeElapsedColumn

    from switchml.demo import DemoConfig, run_demo

    if "switchml" in (args.backend or ("switchml",)):
        print("compiling switchml's kernels (loaded from the cache after the first run)",
              file=sys.stderr, flush=True)
    cfg = DemoConfig(workers=args.workers, epochs=args.epochs, batch_size=args.batch_size,
                     lr=args.lr, out_dir=args.out,
                     backends=tuple(args.backend or ("gloo", "switchml")))
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
    _stdout_console().print(_demo_table(cfg, results))
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


# ---------------------------------------------------------------------------------------------
# switchml testbed


def _run_testbed(args: argparse.Namespace) -> int:
    """``switchml testbed``: build the star network (or the geo one) and hold it."""
    from switchml.testbed import LinkSpec, Testbed, Topology, check_environment, cleanup_stale

    if args.cleanup:
        check_environment()
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)"
              + (f": {', '.join(removed)}" if removed else ""))
        return 0
    if getattr(args, "dcs", None):
        return _run_geo_testbed(args)
    link = LinkSpec(bandwidth_bps=args.rate_mbit * 1e6 if args.rate_mbit else None,
                    loss_rate=args.loss, mtu=args.mtu)
    stop = _stop_on_signals("stopping")
    with Testbed(Topology(workers=args.workers, link=link)) as bed:
        topo = bed.topology
        print(f"testbed {bed.prefix} is up: {args.workers} workers, {link}")
        print(f"  switch (in the router):  ip netns exec {bed.switch_ns} switchml switch "
              "--host 0.0.0.0 --insecure")
        for i in range(args.workers):
            print(f"  worker {i}: ip netns exec {bed.worker_ns(i)} ...   (address "
                  f"{topo.worker_ip(i)}, switch at {topo.switch_ip(i)}, its gateway)")
        print(f"  parameter server host: ip netns exec {bed.ps_ns} ...   ({topo.ps_ip})")
        print("  router (uplink loss rules: nft list ruleset; downlink loss rules are in "
              f"each host): ip netns exec {bed.router_ns} ...")
        print("  UDP GSO/GRO batching: " + ("on, loss per datagram" if bed.batching else
                                            "off (no ethtool): SWITCHML_GSO=0 in there"))
        print("Ctrl-C tears it down.", flush=True)
        # short waits, as in _serve_until_stopped: signals need the main thread
        while not stop.wait(_SIGNAL_POLL_S):
            pass
    print("testbed removed")
    return 0


def _run_geo_testbed(args: argparse.Namespace) -> int:
    """``switchml testbed --dcs``: build the geo testbed and hold it."""
    from switchml.gaia.rules import parse_dc_layout
    from switchml.testbed import GeoTestbed, GeoTopology, LinkSpec
    sizes = tuple(len(dc) for dc in parse_dc_layout(args.dcs))
    topo = GeoTopology(dcs=sizes, lan=LinkSpec(bandwidth_bps=args.rate_mbit * 1e6 or None,
                                               mtu=args.mtu),
                       wan=LinkSpec(bandwidth_bps=args.wan_mbit * 1e6, mtu=args.mtu))
    stop = _stop_on_signals("stopping")
    with GeoTestbed(topo) as bed:
        print(f"geo testbed {bed.prefix} is up: data centres {sizes}, LAN {topo.lan}, "
              f"WAN {topo.wan} (no propagation delay: no netem)")
        for j in range(len(sizes)):
            print(f"  data centre {j}: router ip netns exec {bed.dc_ns(j)} ...  (WAN device "
                  f"{bed.wan_device(j)})")
            for i in topo.workers_of(j):
                print(f"    worker {i}: ip netns exec {bed.worker_ns(i)} ...  "
                      f"({topo.worker_ip(i)}; SWITCHML_DC={j})")
        print(f"  WAN core: ip netns exec {bed.router_ns} ...")
        print("Ctrl-C tears it down.", flush=True)
        while not stop.wait(_SIGNAL_POLL_S):
            pass
    print("testbed removed")
    return 0


# ---------------------------------------------------------------------------------------------
# switchml ps


def _run_ps_server(args: argparse.Namespace) -> int:
    """``switchml ps server``: serve until a signal (or, optionally, every worker's goodbye)."""
    import json

    from switchml.ps.server import ParameterServer, ServerConfig

    cfg = ServerConfig(args.workers, args.backup, args.mode, args.optimizer, args.lr,
                       args.momentum, args.timeout_s)
    from switchml.links import LinkSecurity

    security = LinkSecurity.from_dir(args.tls_dir) if args.tls_dir else None
    server = ParameterServer(args.index, cfg, host=args.host, port=args.port,
                             security=security, insecure=args.insecure).start()
    print(f"parameter server ps{args.index} listening on {server.address[0]}:"
          f"{server.address[1]}", flush=True)
    stop = _stop_on_signals("stopping")
    while not stop.wait(_SIGNAL_POLL_S):
        if args.exit_when_done and server.wait_finished(0.01):
            break
    print(json.dumps(server.stats()), flush=True)
    server.stop()  # joins its threads: see ParameterServer.stop for the abort this avoids
    return 0


def _run_ps_train(args: argparse.Namespace) -> int:
    """``switchml ps train``: train on digits through local parameter servers."""
    from switchml.ps.launch import PSRunConfig, run_ps_training

    cfg = PSRunConfig(servers=args.servers, workers=args.workers, backup=args.backup,
                      mode=args.mode, steps=args.steps, batch=args.batch, lr=args.lr,
                      momentum=args.momentum, optimizer=args.optimizer, seed=args.seed,
                      model=args.model, max_shard_elements=args.max_shard_elements,
                      slow_worker=args.slow_worker, slow_s=args.slow_s,
                      timeout_s=args.timeout_s)
    with tempfile.TemporaryDirectory(prefix="switchml-tls-") as tmp:
        if args.tls:
            from switchml.links import make_credentials
            make_credentials(f"{tmp}/tls")
            cfg = dataclasses.replace(cfg, tls_dir=f"{tmp}/tls")
        r = run_ps_training(cfg, progress=lambda m: print(m, file=sys.stderr, flush=True))
    print(r["placement"])
    print(f"test accuracy {r['test_accuracy']:.4f}  elapsed {r['elapsed_s']:.2f} s  "
          f"steps applied (all shards) {r['steps_applied']}  dropped late gradients "
          f"{r['dropped_late']}  iterations per worker {r['iterations']}")
    print(f"parameter digest {r['digest']}")
    if args.json:
        _write_json(args.json, r)
    return 0


# ---------------------------------------------------------------------------------------------
# switchml bench allreduce


def _run_bench_allreduce(args: argparse.Namespace) -> int:
    """``switchml bench allreduce`` on loopback (or, with ``--testbed``, the emulated network)."""
    if args.testbed:
        return _run_bench_testbed(args)
    from rich.console import Console

    from switchml.bench.allreduce import BenchConfig, run_benchmark, write_json
    from switchml.transport.udp import elements_per_packet_for

    cfg = BenchConfig(
        workers=args.workers, sizes_bytes=tuple(args.sizes or [64 * 2**20]), iters=args.iters,
        warmup=args.warmup, switch=args.switch, window=args.window,
        elements_per_packet=args.elements_per_packet or elements_per_packet_for(
            args.switch or ("127.0.0.1", 1), args.mtu), bits=args.bits,
        baselines=() if args.no_gloo else ("gloo",), timeout_s=args.timeout_s,
        batching=not args.no_batching)
    console = Console(stderr=True)
    with console.status("starting") as status:
        results, switch_stats = run_benchmark(
            cfg, progress=lambda what: status.update(f"measuring {what}"))
    _stdout_console().print(_allreduce_table(cfg, results))
    if args.json:
        write_json(args.json, cfg, results, switch_stats)
        console.print(f"wrote {args.json}")
    return 0


def _allreduce_table(cfg: Any, results: Sequence[Any]) -> Table:
    """One row per size: switchml against gloo on loopback."""
    from rich.table import Table

    table = Table(title=f"all-reduce, {cfg.workers} workers, float32, {cfg.iters} timed ops "
                        f"(ATE/s = elements/s per worker, slowest worker)")
    from switchml.bench.cpu import ratio_text
    table.caption = ("CPU-s/1e9: CPU-seconds per 10^9 elements aggregated per worker (worker "
                     "processes summed; whole machine from /proc/stat), and the ratio to gloo's")
    for col in ("size", "switchml ATE/s", "gloo ATE/s", "switchml/gloo", "switchml Gbit/s",
                "max rel err", "switchml CPU % (workers | switch)", "gloo CPU %",
                "switchml CPU-s/1e9 workers", "switchml CPU-s/1e9 machine"):
        table.add_column(col, justify="right")
    for size in cfg.sizes_bytes:
        sm = next(m for m in results if m.system == "switchml" and m.size_bytes == size)
        gl = next((m for m in results if m.system == "gloo" and m.size_bytes == size), None)
        table.add_row(
            _human(size), f"{sm.ate_per_s:.3g}", f"{gl.ate_per_s:.3g}" if gl else "-",
            f"{sm.ate_per_s / gl.ate_per_s:.2f}" if gl else "-", f"{sm.goodput_gbps:.2f}",
            f"{sm.max_rel_error:.1e}" if sm.max_rel_error is not None else "-",
            "/".join(f"{c:.0f}" for c in sm.cpu_percent) + (
                f" | {sm.extra['switch_cpu_percent']:.0f}" if "switch_cpu_percent" in sm.extra
                else ""),
            "/".join(f"{c:.0f}" for c in gl.cpu_percent) if gl else "-",
            *(ratio_text(sm.extra.get(k), gl.extra.get(k) if gl else None)
              for k in ("worker_cpu_s_per_gelem", "machine_cpu_s_per_gelem")))
    return table


def _run_bench_testbed(args: argparse.Namespace) -> int:
    """``switchml bench allreduce --testbed``: all-reduce over the emulated network."""
    from rich.console import Console

    from switchml.bench.testbed import (
        DEFAULT_MTU,
        TestbedBenchConfig,
        run_testbed_allreduce,
        write_outputs,
    )

    _sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = TestbedBenchConfig(
        workers=args.workers, sizes_bytes=tuple(args.sizes or [64 * 2**20]),
        rate_bps=args.rate_mbit * 1e6, loss_rate=args.loss, mtu=args.mtu or DEFAULT_MTU,
        iters=args.iters, warmup=args.warmup,
        systems=tuple(x.strip() for x in args.systems.split(",") if x),
        window=args.window, timeout_s=args.timeout_s,
        fast_retransmit=args.fast_retransmit, bits=args.bits, nack_gap=args.nack_gap)
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        if args.racks > 1:
            from switchml.bench.testbed import run_testbed_tree
            rows = run_testbed_tree(cfg, args.racks, progress=lambda what: status.update(
                f"measuring {what}"))
        else:
            rows = run_testbed_allreduce(cfg, progress=lambda what: status.update(
                f"measuring {what}"))
    _stdout_console().print(_testbed_table(cfg, args.rate_mbit, rows))
    write_outputs(rows, args.json, args.csv)
    bad = [r for r in rows if r["system"] == "switchml" and r.get("max_abs_error", 0) > 1e-3]
    return 1 if bad else 0


def _testbed_table(cfg: Any, rate_mbit: float, rows: Sequence[dict]) -> Table:
    """One row per size and system of the testbed all-reduce, with the CPU each spent per
    10^9 aggregated elements (worker processes, whole machine) and its ratio to gloo's."""
    from rich.table import Table

    from switchml.bench.cpu import ratio_text

    table = Table(title=f"all-reduce over the testbed: {cfg.workers} workers, {rate_mbit:g} "
                        f"Mbit/s links, loss {cfg.loss_rate:g}, MTU {cfg.mtu} (ATE/s per "
                        "worker)",
                  caption="CPU-s/1e9: CPU-seconds per 10^9 elements aggregated per worker "
                          "(the worker processes summed; the whole machine from /proc/stat, "
                          "switch and softirq included), and the ratio to gloo's")
    for col in ("size", "system", "ATE/s", "of line rate B/32", "ring bound", "vs gloo",
                "worker CPU %", "switch CPU %", "CPU-s/1e9 workers", "CPU-s/1e9 machine"):
        table.add_column(col, justify="right")
    for r in rows:
        gloo = next((g for g in rows if g["system"] == "gloo"
                     and g["size_bytes"] == r["size_bytes"]), None)
        table.add_row(_human(r["size_bytes"]),
                      r["system"] + (" [red](degraded)[/red]" if r.get("degraded") else ""),
                      f"{r['ate_per_s']:.3g}",
                      f"{100 * r['fraction_of_line_rate']:.0f}%",
                      f"{100 * r['bound_ring_ate'] / r['bound_line_ate']:.0f}%",
                      f"{r['ate_per_s'] / gloo['ate_per_s']:.2f}" if gloo else "-",
                      "/".join(f"{c:.0f}" for c in r["cpu_percent"]),
                      f"{r['switch_cpu_percent']:.0f}" if "switch_cpu_percent" in r else "-",
                      *(ratio_text(r.get(k), gloo.get(k) if gloo else None)
                        for k in ("worker_cpu_s_per_gelem", "machine_cpu_s_per_gelem")))
    degraded = {r["degraded"] for r in rows if r.get("degraded")}
    if degraded:
        table.caption = f"{table.caption}. [red]degraded: {'; '.join(sorted(degraded))}[/red]"
    return table


# ---------------------------------------------------------------------------------------------
# switchml bench train


def _run_bench_train(args: argparse.Namespace) -> int:
    """``switchml bench train``: DDP training over the testbed, one row per model and system."""
    from rich.console import Console

    from switchml.bench.testbed import TrainBenchConfig, run_testbed_train

    _sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = TrainBenchConfig(workers=args.workers, models=tuple(args.model or ("ncf", "cnn")),
                           steps=args.steps, batch=args.batch, eval_every=args.eval_every,
                           rate_bps=args.rate_mbit * 1e6,
                           loss_rate=args.loss, mtu=args.mtu,
                           systems=tuple(s for s in args.systems.split(",") if s),
                           trace=bool(args.trace))
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        rows = run_testbed_train(cfg, progress=lambda what: status.update(what))
    _stdout_console(200).print(_train_table(cfg, args.rate_mbit, rows))
    for r in rows:
        for d in r.get("decisions", []):
            console.print(f"{r['model']} {r['system']}: {d}")
        if "replica_allreduce_s" in r:
            console.print(f"{r['model']} {r['system']}: the replicas' all-reduce took "
                          f"{1e3 * r['replica_allreduce_s']:.0f} ms per step")
    _write_train_outputs(args, cfg, rows, console)
    return 0


def _train_table(cfg: TrainBenchConfig, rate_mbit: float, rows: Sequence[dict]) -> Table:
    """One row per model and system of the training benchmark."""
    from rich.table import Table

    table = Table(title=f"DDP training over the testbed: {cfg.workers} workers, "
                        f"{rate_mbit:g} Mbit/s links, loss {cfg.loss_rate:g}, "
                        f"MTU {cfg.mtu}")
    for col in ("model", "parameters", "system", "step (ms)", "samples/s", "final loss",
                "metric", "to target (s)", "speedup", "MB/step", "MB/step predicted",
                "hidden", "ideal (ms)", "of ideal"):
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
                      fmt(r.get("ideal_step_s"), ".0f", 1e3),
                      fmt(r.get("achieved_over_ideal"), ".2f"))
    return table


_TRAIN_CSV_KEYS = ["model", "backend", "system", "hook", "workers", "params", "rate_bps",
                   "loss_rate", "mtu", "batch", "step_s", "samples_per_s", "final_loss",
                   "target_loss", "time_to_target_s", "metric", "final_metric",
                   "target_metric", "time_to_metric_s", "speedup_step", "speedup_vs_switchml",
                   "bytes_per_step_measured", "bytes_per_step_predicted", "hidden_fraction",
                   "compute_step_s", "wire_s", "ideal_step_s", "achieved_over_ideal",
                   "replica_allreduce_s"]


def _write_train_outputs(args: argparse.Namespace, cfg: TrainBenchConfig, rows: list[dict],
                         console: Console) -> None:
    """The training benchmark's trace, JSON, CSV and plots, as the options ask."""
    import csv

    from switchml.bench.testbed import plot_bytes, plot_timeline, plot_training, write_trace

    base = args.plot[:-4] if args.plot and args.plot.endswith(".png") else args.plot
    if args.trace:
        events = write_trace(rows, args.trace)
        console.print(f"wrote {events} trace events to {args.trace}")
    if args.plot and args.trace:
        plot_timeline(rows, f"{base}-timeline.png")
    for r in rows:
        r.pop("trace_events", None)
    if args.json:
        _write_json(args.json, {"benchmark": "train-testbed", "config": cfg.__dict__,
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


# ---------------------------------------------------------------------------------------------
# switchml bench plot, soak, fuzz, switch and geo


def _run_bench_plot(args: argparse.Namespace) -> int:
    """``switchml bench plot``: print the path of every PNG written."""
    from switchml.bench.plots import plot_results
    for path in plot_results(args.files, args.out):
        print(path)
    return 0


def _run_bench_soak(args: argparse.Namespace) -> int:
    """``switchml bench soak``: status 1 if any result was wrong."""
    import dataclasses

    from rich.console import Console

    from switchml.bench.soak import SoakConfig, run_soak

    if not 0.0 <= args.loss < 1.0:
        raise ValueError(f"--loss must be in [0, 1), got {args.loss}")
    cfg = SoakConfig(duration_s=args.duration_s, jobs=args.jobs, workers=args.workers,
                     loss_rate=args.loss, churn_interval_s=args.churn_interval_s, seed=args.seed)
    console = Console(stderr=True)
    with console.status("soaking") as status:
        report = run_soak(cfg, lambda r: status.update(
            f"soaking: {r.memory[-1][0]:.0f}/{cfg.duration_s:.0f} s, {r.operations} operations, "
            f"{r.errors} errors, {r.wrong_results} wrong, switch RSS "
            f"{r.memory[-1][1] / 2**20:.1f} MiB"))
    rss = [m[1] for m in report.memory]
    _stdout_console().print(_figure_table(
        f"soak: {cfg.jobs} jobs x {cfg.workers} workers, loss {cfg.loss_rate:g}, "
        f"{cfg.duration_s:g} s", (
            ("operations completed", report.operations),
            ("wrong results", report.wrong_results),
            ("errors raised (expected after kills)", report.errors),
            ("jobs started / stopped", f"{report.jobs_started} / {report.jobs_stopped}"),
            ("workers killed", report.workers_killed),
            ("switch RSS first / max / last (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("switch jobs / slots in use after the leases ran out",
             f"{report.switch_stats.get('jobs')} / {report.switch_stats.get('slots_in_use')}"),
            ("switch drops", report.switch_stats.get("drops")))))
    for e in report.error_samples:
        console.print(f"error sample: {e}")
    if args.json:
        _write_json(args.json, dataclasses.asdict(report))
    return 1 if report.wrong_results else 0


def _run_bench_fuzz(args: argparse.Namespace) -> int:
    """``switchml bench fuzz``: status 1 on a wrong or failed legitimate result or an internal
    error of the switch."""
    from rich.console import Console

    from switchml.bench.soak import FuzzConfig, run_fuzz

    cfg = FuzzConfig(datagrams=args.datagrams, senders=args.senders,
                     rate_per_sender=args.rate, secret=not args.no_secret)
    console = Console(stderr=True)
    with console.status("fuzzing") as status:
        rep = run_fuzz(cfg, lambda st: status.update(
            f"fuzzing: switch received {st['packets_in']:,} datagrams, dropped "
            f"{sum(st['drops'].values()):,}"))
    rss = [m[1] for m in rep["memory"]]
    t = _figure_table(
        f"fuzz: {rep['datagrams_sent']:,} hostile datagrams in {rep['seconds']} s", (
            ("switch datagrams received", f"{rep['switch_packets_in']:,}"),
            ("switch internal errors", rep["internal_errors"]),
            ("legit operations / wrong / errors",
             f"{rep['legit_operations']} / {rep['legit_wrong_results']} / "
             f"{len(rep['legit_errors'])}"),
            ("switch RSS before / max / after (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("jobs at end", rep["jobs_at_end"])))
    for reason, n in sorted(rep["drops"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"drops: {reason}", f"{n:,}")
    _stdout_console().print(t)
    if args.json:
        _write_json(args.json, rep)
    bad = rep["legit_wrong_results"] or rep["legit_errors"] or rep["internal_errors"]
    return 1 if bad else 0


def _run_bench_switch(args: argparse.Namespace) -> int:
    """``switchml bench switch``: status 1 on wrong results, drops or switch errors."""
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    from switchml.bench.switchcap import SwitchCapConfig, run_switchcap, write_json

    cfg = SwitchCapConfig(workers=args.workers, elements_per_packet=args.elements_per_packet,
                          window=args.window, seconds=args.seconds, batching=args.batching,
                          shards=args.shards, generators=args.generators)
    _sigterm_interrupts()  # SIGTERM runs the benchmark's teardown
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("starting", total=1.0)
            r = run_switchcap(cfg, progress=lambda text, frac: bar.update(
                task, description=text, completed=frac))
    except KeyboardInterrupt:
        console.print("interrupted; the switch and the generator were stopped"
                      if cfg.shards == 1 else
                      "interrupted; the shards and the generators were stopped")
        return 130
    _stdout_console().print(_switchcap_table(cfg, r))
    if args.json:
        write_json(args.json, r)
        console.print(f"wrote {args.json}")
    bad = (r.wrong_results or not r.consistent or r.drops
           or any(r.switch_errors.values()))
    return 1 if bad else 0


def _switchcap_table(cfg: SwitchCapConfig, r: SwitchCapResult) -> Table:
    """The switch capacity figures."""
    g = r.generator
    sharded = cfg.shards > 1
    where = (f", {cfg.shards} shards, {r.config['generators']} generators" if sharded else "")
    per_shard = [(f"shard {f['shard']}: datagrams/s in; CPU %; us per datagram",
                  f"{f['in_per_s']:,.0f}; {f['cpu_percent']:.0f}; "
                  f"{f['cpu_us_per_datagram']:.2f}") for f in r.shards] if sharded else []
    return _figure_table(
        f"switch capacity: {cfg.workers} ranks x {cfg.window} slots, K = "
        f"{cfg.elements_per_packet} int32 ({cfg.datagram_bytes} B datagrams), "
        f"{r.interval_s:.1f} s, batching {'on' if cfg.batching else 'off'}{where}", (
            ("datagrams/s into the switch", f"{r.switch_in_per_s:,.0f}"),
            ("datagrams/s out of the switch", f"{r.switch_out_per_s:,.0f}"),
            ("payload GB/s (requests x K x 4 B)", f"{r.payload_gbytes_per_s:.3f}"),
            ("switch CPU time per datagram in (us)", f"{r.switch_cpu_us_per_datagram:.2f}"),
            ("datagrams/s in at 100% of a core per shard (sum of 1e6 / us per datagram)"
             if sharded else "datagrams/s in at 100% of a core (1e6 / us per datagram)",
             f"{r.switch_capacity_per_s:,.0f}"),
            *per_shard,
            ("switch CPU %" + (" (shards summed)" if sharded else ""),
             f"{r.switch_cpu_percent:.0f}"),
            ("generator CPU %" + (" (summed)" if sharded else ""),
             f"{r.generator_cpu_percent:.0f}"),
            ("other CPU % (rest of the machine)", f"{r.other_cpu_percent:.0f}"),
            ("bottleneck", r.bottleneck),
            ("results received (whole run)", f"{g['results_total']:,}"),
            ("requests sent - in flight at end",
             f"{g['requests_total']:,} - {g['in_flight_at_end']}"),
            ("wrong results", r.wrong_results),
            ("retransmissions", g["retransmissions_total"]),
            ("unexpected replies", g["unexpected_total"] or 0),
            ("switch drops", r.drops or 0),
            ("switch errors", {k: v for k, v in r.switch_errors.items() if v} or 0),
            ("GSO / GRO (switch; generator)",
             f"{r.switch_stats.get('gso')} / {r.switch_stats.get('gro')}; "
             f"{g['gso']} / {g['gro']}")))


def _run_bench_geo(args: argparse.Namespace) -> int:
    """``switchml bench geo``: LAN, WAN-synchronous and Gaia training, compared."""
    from switchml.bench.geo import GeoBenchConfig, run_geo_bench, write_outputs
    from switchml.gaia.rules import parse_dc_layout

    _sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = GeoBenchConfig(dcs=tuple(len(d) for d in parse_dc_layout(args.dcs)),
                         wan_bps=args.wan_mbit * 1e6, lan_bps=args.lan_mbit * 1e6,
                         modes=tuple(m for m in args.modes.split(",") if m), steps=args.steps,
                         batch=args.batch, lr=args.lr, model=args.model,
                         eval_every=args.eval_every, target_accuracy=args.target,
                         threshold=args.threshold, decay=args.decay, staleness=args.staleness,
                         gaia_lr_scale=args.gaia_lr_scale, dc_backend=args.dc_backend)
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
    print(f"{'mode':<6} {'time to target (s)':>18} {'final accuracy':>14} {'WAN MB':>9} "
          f"{'vs LAN':>7} {'vs WAN sync':>11} {'WAN bytes vs sync':>17}")
    for r in rows:
        c = r["comparison"]
        print(f"{r['mode']:<6} {_geo_cell(r['time_to_target_s'], '.2f'):>18} "
              f"{r['final_accuracy']:>14.4f} {r['wan_bytes'] / 1e6:>9.2f} "
              f"{_geo_cell(c.get('time_to_target_vs_lan'), '.2f', 'x'):>7} "
              f"{_geo_cell(c.get('speedup_vs_wan'), '.2f', 'x'):>11} "
              f"{_geo_cell(c.get('wan_bytes_vs_wan'), '.4f'):>17}")


# ---------------------------------------------------------------------------------------------
# switchml sim


def _run_sim(args: argparse.Namespace) -> int:
    """``switchml sim``: a sweep over --workers x --loss, or ``--compare`` with the testbed."""
    command = "switchml " + " ".join(sys.argv[1:])
    config = _sim_config_builder(args)
    if args.compare:
        return _run_sim_compare(args, config, command)
    return _run_sim_sweep(args, config, command)


def _sim_config_builder(args: argparse.Namespace) -> Callable[[int, float], SimConfig]:
    """Check the simulator's options; the :class:`SimConfig` of n workers and a loss rate."""
    from switchml.sim.config import HOST_COST_S, SimConfig, Stragglers
    from switchml.sim.run import access_link, parse_failure

    host_cost = HOST_COST_S if args.host_cost_us is None else args.host_cost_us * 1e-6
    if host_cost < 0 or args.queue_ms <= 0 or args.delay_us < 0:
        raise ConfigError("--host-cost-us and --delay-us must be >= 0, --queue-ms > 0")
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
                         racks=racks, mtu=args.mtu, window=args.window, host_cost_s=host_cost,
                         switch_delay_s=args.switch_delay_us * 1e-6,
                         stragglers=Stragglers(args.stragglers, args.straggler_slowdown,
                                               args.straggler_delay_ms * 1e-3),
                         failures=failures, seed=args.seed, nack_gap=args.nack_gap)

    return config


def _run_sim_compare(args: argparse.Namespace, config: Callable[[int, float], SimConfig],
                     command: str) -> int:
    """``sim --compare``: simulated against measured ATE/s, one line per testbed row."""
    import json

    from switchml.sim.run import compare_with_testbed

    rows = compare_with_testbed(args.compare, config(4, 0.0), args.mode)
    print(f"{'n':>3} {'Mbit/s':>7} {'MTU':>5} {'size':>10} {'testbed ATE/s':>13} "
          f"{'sim ATE/s':>10} {'sim/testbed':>11}")
    for r in rows:
        print(f"{r['workers']:3d} {r['rate_bps'] / 1e6:7.0f} {r['mtu']:5d} "
              f"{r['size_bytes']:10d} {r['testbed_ate_per_s']:13.3e} "
              f"{r['sim_ate_per_s']:10.3e} {r['ratio']:11.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "sim-compare", "command": command, "rows": rows}, f,
                      indent=1)
        print(f"wrote {args.json}")
    return 0


def _run_sim_sweep(args: argparse.Namespace, config: Callable[[int, float], SimConfig],
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


# ---------------------------------------------------------------------------------------------
# Entry point


def main(argv: Sequence[str] | None = None) -> int:
    """Run the ``switchml`` command line ``argv`` (default ``sys.argv[1:]``); its exit status:
    the command's, or 2 for bad arguments or an error the command reports."""
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        status: int = args.func(args)
    except (SwitchMLError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"switchml: error: {exc}", file=sys.stderr)
        return 2
    return status


if __name__ == "__main__":
    sys.exit(main())

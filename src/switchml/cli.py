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
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import sys
import time
from collections.abc import Sequence

from switchml import __version__
from switchml.protocol.errors import SwitchMLError

__all__ = ["build_parser", "main"]

log = logging.getLogger("switchml")


def _env(dest: str, default: object) -> object:
    return os.environ.get(f"SWITCHML_{dest.upper()}", default)


def _address(text: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise argparse.ArgumentTypeError(f"expected HOST:PORT, got {text!r}")
    return host, int(port)


def _size(text: str) -> int:
    from switchml.bench.allreduce import parse_size
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from exc


def build_parser() -> argparse.ArgumentParser:
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

    sw = sub.add_parser("switch", help="run a software switch in the foreground",
                        description="Run a software switch until SIGINT/SIGTERM. Jobs register "
                                    "themselves with their first JOIN; see docs/protocol.md.")
    sw.add_argument("--host", default=_env("host", "127.0.0.1"),
                    help="address to listen on (default 127.0.0.1; 0.0.0.0 for every interface)")
    sw.add_argument("--port", type=int, default=int(_env("port", 48864)),  # type: ignore[arg-type]
                    help="UDP port (default 48864; 0 picks a free one)")
    sw.add_argument("--pool-slots", type=int, default=int(_env("pool_slots", 1024)),  # type: ignore[arg-type]
                    help="aggregation slots shared by all jobs; bounds the switch's slot "
                         "memory at 128 KiB per slot (default 1024 = 128 MiB)")
    sw.add_argument("--stats-interval-s", type=float, default=0.0,
                    help="log the counters every this many seconds (default 0: only at exit)")
    sw.add_argument("--lease-timeout-s", type=float,
                    default=float(_env("lease_timeout_s", 30.0)),  # type: ignore[arg-type]
                    help="a job silent for this long loses its slots (default 30)")
    sw.add_argument("--secret-file", default=_env("secret_file", None),
                    help="file holding the secret needed to create jobs (workers pass it in "
                         "SWITCHML_SECRET); SWITCHML_SECRET also works here")
    sw.add_argument("--insecure", action="store_true",
                    help="allow listening beyond loopback without a secret (anyone who can "
                         "reach the port can then create jobs)")
    sw.add_argument("--metrics-port", type=int,
                    default=int(_env("metrics_port", 9109)),  # type: ignore[arg-type]
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

    stats = sub.add_parser(
        "stats", help="live counters of a running switch",
        description="Show a running switch's counters (like a hardware switch's port counters) "
                    "from its Prometheus endpoint, refreshed every --interval-s.")
    stats.add_argument("--url", default=_env("stats_url", "http://127.0.0.1:9109/metrics"),
                       help="the switch's metrics URL (default http://127.0.0.1:9109/metrics)")
    stats.add_argument("--interval-s", type=float, default=1.0,
                       help="refresh period in seconds (default 1)")
    stats.add_argument("--once", action="store_true", help="print one table and exit")

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

    bench = sub.add_parser("bench", help="benchmarks")
    bsub = bench.add_subparsers(dest="bench", required=True, metavar="BENCH")
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
    tbg = ar.add_argument_group(
        "testbed", "run over an emulated star network instead of loopback (needs root): one "
        "namespace per worker, a router in the middle with the switch behind it, links shaped "
        "with tc tbf both ways")
    tbg.add_argument("--testbed", action="store_true", help="use the emulated network")
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
                     help="comma list of switchml, gloo, ps (parameter server) (default all)")
    tbg.add_argument("--csv", metavar="PATH", help="also write the rows as CSV")
    ar.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    ar.add_argument("--timeout-s", type=float, default=600.0,
                    help="give up on a measurement after this long (default 600)")
    tr = bsub.add_parser(
        "train", help="DDP training over the testbed, gloo against switchml (root)",
        description="Train a convolutional model (CNN on digits) and a network-bound model "
                    "(a 6.4M-parameter embedding table, like NCF/DeepLight) with "
                    "DistributedDataParallel on gloo and on switchml over the same emulated "
                    "links; report step time, samples/s, time to a target loss and speedup.")
    tr.add_argument("--workers", "-n", type=int, default=4, help="workers (default 4)")
    tr.add_argument("--model", action="append", choices=["cnn", "embed"],
                    help="model to train (repeatable; default both)")
    tr.add_argument("--steps", type=int, default=60, help="training steps (default 60)")
    tr.add_argument("--batch", type=int, default=64, help="per-worker batch (default 64)")
    tr.add_argument("--rate-mbit", type=float, default=1000.0,
                    help="link rate in Mbit/s (default 1000)")
    tr.add_argument("--loss", type=float, default=0.0, help="loss rate per link (default 0)")
    tr.add_argument("--mtu", type=int, default=1500,
                    help="link MTU in bytes; switchml's chunks are sized to fit it (default "
                         "1500, Ethernet; 9000 for jumbo frames; veth takes up to 65535 but "
                         "that is not a real network)")
    tr.add_argument("--json", metavar="PATH", help="write the rows as JSON")
    tr.add_argument("--csv", metavar="PATH", help="write the rows as CSV")
    tr.add_argument("--plot", metavar="PNG", help="save training loss against time")
    pl = bsub.add_parser("plot", help="PNG plots from testbed benchmark JSON files",
                         description="Draw ATE/s against size (with the line-rate and ring "
                                     "bounds), speedup over gloo against n, and slowdown "
                                     "against loss, from 'bench allreduce --testbed --json' "
                                     "files.")
    pl.add_argument("files", nargs="+", help="JSON files")
    pl.add_argument("--out", default="plots", help="output folder (default ./plots)")
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
    sc = bsub.add_parser(
        "switch", help="switch capacity: aggregated datagrams/s of one software switch",
        description="Run the software switch in a process pinned to one core and a traffic "
                    "generator pinned to another, which joins a job as N ranks and replays "
                    "valid int32 requests as fast as the switch answers (W slots in flight per "
                    "rank, self-clocked). Report datagrams/s in and out of the switch, payload "
                    "GB/s, switch and generator CPU (which one was the bottleneck), switch CPU "
                    "time per datagram, drops and wrong results (must be 0).")
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
    sc.add_argument("--json", metavar="PATH", help="write the figures as JSON")
    return parser


_SIGNAL_POLL_S = 0.5


def _run_switch(args: argparse.Namespace) -> int:
    import threading

    from switchml.protocol.config import SwitchConfig
    from switchml.protocol.wire import elements_for_mtu
    from switchml.transport.udp import SwitchServer

    secret = None
    if args.secret_file:
        with open(args.secret_file, "rb") as f:
            secret = f.read().strip()
    elif os.environ.get("SWITCHML_SECRET"):
        secret = os.environ["SWITCHML_SECRET"].encode()
    if secret is None and not _is_loopback(args.host) and not args.insecure:
        raise ValueError(f"listening on {args.host} exposes job creation to the network: give "
                         "--secret-file (or SWITCHML_SECRET), or --insecure to allow it anyway")
    server = SwitchServer(host=args.host, port=args.port, config=SwitchConfig(
        pool_slots=args.pool_slots, lease_timeout_s=args.lease_timeout_s, secret=secret,
        **({"max_elements_per_packet": elements_for_mtu(args.mtu)} if args.mtu else {})),
        batching=not args.no_batching)
    if args.metrics_port:
        from switchml.control.metrics import start_exporter
        try:
            start_exporter(server.stats, args.pool_slots, "127.0.0.1", args.metrics_port)
            log.info("metrics on http://127.0.0.1:%d/metrics", args.metrics_port)
        except OSError as exc:
            log.warning("metrics endpoint not started on port %d: %s", args.metrics_port, exc)
    stop = threading.Event()

    def _on_signal(signum: int, _frame: object) -> None:
        log.info("%s received, stopping", signal.Signals(signum).name)
        stop.set()

    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)
    server.start()
    print(f"switchml switch listening on udp {server.address[0]}:{server.address[1]}",
          flush=True)
    if args.stop_on_stdin_eof:
        def _watch_stdin() -> None:
            while sys.stdin.read(4096):
                pass
            log.info("standard input closed, stopping")
            stop.set()
        threading.Thread(target=_watch_stdin, daemon=True).start()
    interval = args.stats_interval_s if args.stats_interval_s > 0 else None
    next_stats = time.monotonic() + interval if interval else None
    # Wake up at least twice a second: a signal delivered to another thread only runs its
    # Python handler when the main thread executes bytecode, which a bare wait() never does.
    while not stop.wait(_SIGNAL_POLL_S):
        if next_stats is not None and time.monotonic() >= next_stats:
            log.info("stats: %s", server.stats())
            next_stats += interval
    server.stop()
    return 0


def _run_testbed(args: argparse.Namespace) -> int:
    import threading

    from switchml.testbed import LinkSpec, Testbed, Topology, check_environment, cleanup_stale

    if args.cleanup:
        check_environment()
        removed = cleanup_stale()
        print(f"removed {len(removed)} stale namespace(s)"
              + (f": {', '.join(removed)}" if removed else ""))
        return 0
    link = LinkSpec(bandwidth_bps=args.rate_mbit * 1e6 if args.rate_mbit else None,
                    loss_rate=args.loss, mtu=args.mtu)
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
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
        while not stop.wait(_SIGNAL_POLL_S):  # see _run_switch: signals need the main thread
            pass
    print("testbed removed")
    return 0


def _is_loopback(host: str) -> bool:
    import ipaddress
    import socket
    try:
        return ipaddress.ip_address(socket.gethostbyname(host)).is_loopback
    except (OSError, ValueError):
        return False


def _run_stats(args: argparse.Namespace) -> int:
    import time

    from rich.console import Console
    from rich.live import Live
    from rich.table import Table

    from switchml.control.metrics import read_metrics

    def snapshot() -> dict:
        try:
            return read_metrics(args.url)
        except OSError as exc:
            raise ValueError(f"can't read {args.url}: {exc} (is a switch running with "
                             "--metrics-port?)") from exc

    def table(now: dict, before: dict | None, dt: float) -> Table:
        t = Table(title=f"switchml switch {args.url}")
        t.add_column("counter")
        t.add_column("value", justify="right")
        t.add_column("per second", justify="right")

        def rate(key: str, label: str | None = None) -> str:
            if before is None or dt <= 0:
                return ""
            a = now.get(key, {}) if label is not None else now.get(key, 0)
            b = before.get(key, {}) if label is not None else before.get(key, 0)
            if label is not None:
                a, b = a.get(label, 0), b.get(label, 0)
            return f"{(a - b) / dt:,.0f}"

        for key, name in (("switchml_packets_in_total", "packets in"),
                          ("switchml_packets_out_total", "packets out"),
                          ("switchml_results_multicast_total", "results multicast"),
                          ("switchml_results_resent_total", "results resent (shadow copy)"),
                          ("switchml_waiting_sent_total", "WAITING answers"),
                          ("switchml_mismatch_sent_total", "MISMATCH answers")):
            t.add_row(name, f"{now.get(key, 0):,.0f}", rate(key))
        t.add_row("jobs", f"{now.get('switchml_jobs', 0):.0f}", "")
        t.add_row("slots in use", f"{now.get('switchml_slots_in_use', 0):.0f} / "
                  f"{now.get('switchml_pool_slots', 0):.0f}", "")
        t.add_row("slot memory", f"{now.get('switchml_memory_bytes', 0) / 2**20:.1f} MiB", "")
        for job, n in sorted(now.get("switchml_elements_aggregated_total", {}).items()):
            t.add_row(f"job {job} elements", f"{n:,.0f}",
                      rate("switchml_elements_aggregated_total", job))
        for reason, n in sorted(now.get("switchml_drops_total", {}).items()):
            t.add_row(f"drops: {reason}", f"{n:,.0f}", rate("switchml_drops_total", reason))
        return t

    current = snapshot()
    if args.once:
        Console().print(table(current, None, 0.0))
        return 0
    with Live(table(current, None, 0.0), refresh_per_second=4) as live:
        try:
            while True:
                t0 = time.monotonic()
                time.sleep(args.interval_s)
                nxt = snapshot()
                live.update(table(nxt, current, time.monotonic() - t0))
                current = nxt
        except KeyboardInterrupt:
            pass
    return 0


def _run_demo(args: argparse.Namespace) -> int:
    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from switchml.demo import DemoConfig, run_demo

    cfg = DemoConfig(workers=args.workers, epochs=args.epochs, batch_size=args.batch_size,
                     lr=args.lr, out_dir=args.out,
                     backends=tuple(args.backend or ("gloo", "switchml")))
    console = Console(stderr=True)
    with Progress(TextColumn("{task.description}"), BarColumn(), TextColumn("{task.fields[info]}"),
                  TimeElapsedColumn(), console=console) as progress:
        tasks: dict[str, int] = {}

        def on_progress(backend: str, step: int, total: int, loss: float) -> None:
            if backend not in tasks:
                tasks[backend] = progress.add_task(f"training on {backend}", total=total,
                                                   info="")
            progress.update(tasks[backend], completed=step, info=f"loss {loss:.3f}")

        results = run_demo(cfg, on_progress)
    table = Table(title=f"DDP training on digits, {cfg.workers} workers, {cfg.epochs} epochs")
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
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    console.print(f"loss curves: {cfg.out_dir}/loss.png, figures: {cfg.out_dir}/demo.json")
    console.print("Same script, same loss: only the backend string differs. On one machine "
                  "there is no network bandwidth to save, so the step times compare software "
                  "paths (gloo's is C++, switchml's switch is Python). The speedup in-network "
                  "aggregation exists for appears on bandwidth-bound links: see 'switchml bench "
                  "allreduce --testbed' and 'switchml bench train' (root) and "
                  "docs/benchmarks.md.")
    return 0


def _run_bench_testbed(args: argparse.Namespace) -> int:
    import signal as _signal

    from rich.console import Console
    from rich.table import Table

    from switchml.bench.testbed import (
        DEFAULT_MTU,
        TestbedBenchConfig,
        run_testbed_allreduce,
        write_outputs,
    )

    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # run the testbed's teardown

    _signal.signal(_signal.SIGTERM, _term)
    cfg = TestbedBenchConfig(
        workers=args.workers, sizes_bytes=tuple(args.sizes or [64 * 2**20]),
        rate_bps=args.rate_mbit * 1e6, loss_rate=args.loss, mtu=args.mtu or DEFAULT_MTU,
        iters=args.iters, warmup=args.warmup,
        systems=tuple(x.strip() for x in args.systems.split(",") if x),
        window=args.window, timeout_s=args.timeout_s,
        fast_retransmit=args.fast_retransmit, bits=args.bits)
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        rows = run_testbed_allreduce(cfg, progress=lambda what: status.update(
            f"measuring {what}"))
    n = cfg.workers
    table = Table(title=f"all-reduce over the testbed: {n} workers, {args.rate_mbit:g} Mbit/s "
                        f"links, loss {cfg.loss_rate:g}, MTU {cfg.mtu} (ATE/s per worker)")
    for col in ("size", "system", "ATE/s", "of line rate B/32", "ring bound", "vs gloo",
                "worker CPU %", "switch CPU %"):
        table.add_column(col, justify="right")
    for r in rows:
        gloo = next((g for g in rows if g["system"] == "gloo"
                     and g["size_bytes"] == r["size_bytes"]), None)
        table.add_row(_human(r["size_bytes"]), r["system"], f"{r['ate_per_s']:.3g}",
                      f"{100 * r['fraction_of_line_rate']:.0f}%",
                      f"{100 * r['bound_ring_ate'] / r['bound_line_ate']:.0f}%",
                      f"{r['ate_per_s'] / gloo['ate_per_s']:.2f}" if gloo else "-",
                      "/".join(f"{c:.0f}" for c in r["cpu_percent"]),
                      f"{r['switch_cpu_percent']:.0f}" if "switch_cpu_percent" in r else "-")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    write_outputs(rows, args.json, args.csv)
    bad = [r for r in rows if r["system"] == "switchml" and r.get("max_abs_error", 0) > 1e-3]
    return 1 if bad else 0


def _run_bench_train(args: argparse.Namespace) -> int:
    import csv
    import json
    import signal as _signal

    from rich.console import Console
    from rich.table import Table

    from switchml.bench.testbed import TrainBenchConfig, plot_training, run_testbed_train

    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # run the testbed's teardown

    _signal.signal(_signal.SIGTERM, _term)
    cfg = TrainBenchConfig(workers=args.workers, models=tuple(args.model or ("cnn", "embed")),
                           steps=args.steps, batch=args.batch, rate_bps=args.rate_mbit * 1e6,
                           loss_rate=args.loss, mtu=args.mtu)
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        rows = run_testbed_train(cfg, progress=lambda what: status.update(what))
    table = Table(title=f"DDP training over the testbed: {cfg.workers} workers, "
                        f"{args.rate_mbit:g} Mbit/s links, loss {cfg.loss_rate:g}, "
                        f"MTU {cfg.mtu}")
    for col in ("model", "parameters", "backend", "step time (ms)", "samples/s", "final loss",
                "time to target (s)", "speedup"):
        table.add_column(col, justify="right")
    for r in rows:
        ttt = r["time_to_target_s"]
        table.add_row(r["model"], f"{r['params']:,}", r["backend"], f"{1e3 * r['step_s']:.0f}",
                      f"{r['samples_per_s']:.0f}", f"{r['final_loss']:.4f}",
                      f"{ttt:.1f}" if ttt is not None else "-", f"{r['speedup_step']:.2f}")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "train-testbed", "config": cfg.__dict__, "results": rows}, f,
                      indent=2)
    if args.csv:
        keys = ["model", "backend", "workers", "params", "rate_bps", "loss_rate", "step_s",
                "samples_per_s", "final_loss", "target_loss", "time_to_target_s", "speedup_step"]
        with open(args.csv, "w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=keys, extrasaction="ignore")
            w.writeheader()
            w.writerows(rows)
    if args.plot:
        plot_training(rows, args.plot)
    return 0


def _run_bench_allreduce(args: argparse.Namespace) -> int:
    if args.testbed:
        return _run_bench_testbed(args)
    from rich.console import Console
    from rich.table import Table

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
    table = Table(title=f"all-reduce, {cfg.workers} workers, float32, {cfg.iters} timed ops "
                        f"(ATE/s = elements/s per worker, slowest worker)")
    for col in ("size", "switchml ATE/s", "gloo ATE/s", "switchml/gloo", "switchml Gbit/s",
                "max rel err", "switchml CPU % (workers | switch)", "gloo CPU %"):
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
            "/".join(f"{c:.0f}" for c in gl.cpu_percent) if gl else "-")
    Console(width=None if sys.stdout.isatty() else 160).print(table)
    if args.json:
        write_json(args.json, cfg, results, switch_stats)
        console.print(f"wrote {args.json}")
    return 0


def _run_bench_soak(args: argparse.Namespace) -> int:
    import dataclasses
    import json

    from rich.console import Console
    from rich.table import Table

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
    t = Table(title=f"soak: {cfg.jobs} jobs x {cfg.workers} workers, loss {cfg.loss_rate:g}, "
                    f"{cfg.duration_s:g} s")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rss = [m[1] for m in report.memory]
    for name, value in (
            ("operations completed", report.operations),
            ("wrong results", report.wrong_results),
            ("errors raised (expected after kills)", report.errors),
            ("jobs started / stopped", f"{report.jobs_started} / {report.jobs_stopped}"),
            ("workers killed", report.workers_killed),
            ("switch RSS first / max / last (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("switch jobs / slots in use after the leases ran out",
             f"{report.switch_stats.get('jobs')} / {report.switch_stats.get('slots_in_use')}"),
            ("switch drops", report.switch_stats.get("drops"))):
        t.add_row(name, str(value))
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    for e in report.error_samples:
        console.print(f"error sample: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(dataclasses.asdict(report), f, indent=2)
    return 1 if report.wrong_results else 0


def _run_bench_fuzz(args: argparse.Namespace) -> int:
    import json

    from rich.console import Console
    from rich.table import Table

    from switchml.bench.soak import FuzzConfig, run_fuzz

    cfg = FuzzConfig(datagrams=args.datagrams, senders=args.senders,
                     rate_per_sender=args.rate, secret=not args.no_secret)
    console = Console(stderr=True)
    with console.status("fuzzing") as status:
        rep = run_fuzz(cfg, lambda st: status.update(
            f"fuzzing: switch received {st['packets_in']:,} datagrams, dropped "
            f"{sum(st['drops'].values()):,}"))
    t = Table(title=f"fuzz: {rep['datagrams_sent']:,} hostile datagrams in {rep['seconds']} s")
    t.add_column("figure")
    t.add_column("value", justify="right")
    rss = [m[1] for m in rep["memory"]]
    for name, value in (
            ("switch datagrams received", f"{rep['switch_packets_in']:,}"),
            ("switch internal errors", rep["internal_errors"]),
            ("legit operations / wrong / errors",
             f"{rep['legit_operations']} / {rep['legit_wrong_results']} / "
             f"{len(rep['legit_errors'])}"),
            ("switch RSS before / max / after (MiB)",
             f"{rss[0] / 2**20:.1f} / {max(rss) / 2**20:.1f} / {rss[-1] / 2**20:.1f}"),
            ("jobs at end", rep["jobs_at_end"])):
        t.add_row(name, str(value))
    for reason, n in sorted(rep["drops"].items(), key=lambda kv: -kv[1]):
        t.add_row(f"drops: {reason}", f"{n:,}")
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rep, f, indent=2)
    bad = rep["legit_wrong_results"] or rep["legit_errors"] or rep["internal_errors"]
    return 1 if bad else 0


def _run_bench_switch(args: argparse.Namespace) -> int:
    import signal as _signal

    from rich.console import Console
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn
    from rich.table import Table

    from switchml.bench.switchcap import SwitchCapConfig, run_switchcap, write_json

    def _term(signum: int, _frame: object) -> None:
        raise KeyboardInterrupt  # run the benchmark's teardown

    cfg = SwitchCapConfig(workers=args.workers, elements_per_packet=args.elements_per_packet,
                          window=args.window, seconds=args.seconds, batching=args.batching)
    _signal.signal(_signal.SIGTERM, _term)
    console = Console(stderr=True)
    try:
        with Progress(TextColumn("{task.description}"), BarColumn(), TimeElapsedColumn(),
                      console=console, transient=True) as bar:
            task = bar.add_task("starting", total=1.0)
            r = run_switchcap(cfg, progress=lambda text, frac: bar.update(
                task, description=text, completed=frac))
    except KeyboardInterrupt:
        console.print("interrupted; the switch and the generator were stopped")
        return 130
    g = r.generator
    t = Table(title=f"switch capacity: {cfg.workers} ranks x {cfg.window} slots, K = "
                    f"{cfg.elements_per_packet} int32 ({cfg.datagram_bytes} B datagrams), "
                    f"{r.interval_s:.1f} s, batching {'on' if cfg.batching else 'off'}")
    t.add_column("figure")
    t.add_column("value", justify="right")
    for name, value in (
            ("datagrams/s into the switch", f"{r.switch_in_per_s:,.0f}"),
            ("datagrams/s out of the switch", f"{r.switch_out_per_s:,.0f}"),
            ("payload GB/s (requests x K x 4 B)", f"{r.payload_gbytes_per_s:.3f}"),
            ("switch CPU time per datagram in (us)", f"{r.switch_cpu_us_per_datagram:.2f}"),
            ("datagrams/s in at 100% of a core (1e6 / us per datagram)",
             f"{r.switch_capacity_per_s:,.0f}"),
            ("switch CPU %", f"{r.switch_cpu_percent:.0f}"),
            ("generator CPU %", f"{r.generator_cpu_percent:.0f}"),
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
             f"{g['gso']} / {g['gro']}")):
        t.add_row(name, str(value))
    Console(width=None if sys.stdout.isatty() else 160).print(t)
    if args.json:
        write_json(args.json, r)
        console.print(f"wrote {args.json}")
    bad = (r.wrong_results or not r.consistent or r.drops
           or any(r.switch_errors.values()))
    return 1 if bad else 0


def _human(nbytes: int) -> str:
    for unit, div in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if nbytes >= div and nbytes % div == 0:
            return f"{nbytes // div} {unit}"
    return f"{nbytes} B"


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        if args.command == "switch":
            return _run_switch(args)
        if args.command == "demo":
            return _run_demo(args)
        if args.command == "stats":
            return _run_stats(args)
        if args.command == "testbed":
            return _run_testbed(args)
        if args.command == "bench" and args.bench == "allreduce":
            return _run_bench_allreduce(args)
        if args.command == "bench" and args.bench == "train":
            return _run_bench_train(args)
        if args.command == "bench" and args.bench == "plot":
            from switchml.bench.plots import plot_results
            for path in plot_results(args.files, args.out):
                print(path)
            return 0
        if args.command == "bench" and args.bench == "soak":
            return _run_bench_soak(args)
        if args.command == "bench" and args.bench == "fuzz":
            return _run_bench_fuzz(args)
        if args.command == "bench" and args.bench == "switch":
            return _run_bench_switch(args)
    except (SwitchMLError, ValueError, RuntimeError, TimeoutError) as exc:
        print(f"switchml: error: {exc}", file=sys.stderr)
        return 2
    parser.error("unknown command")
    return 2


if __name__ == "__main__":
    sys.exit(main())

"""``switchml bench allreduce``: all-reduce throughput of switchml against gloo, on loopback or
(``--testbed``) over the emulated network.
"""

from __future__ import annotations

import argparse
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

from switchml.cli.common import (
    Subparsers,
    add_json_option,
    add_link_options,
    add_nack_gap_option,
    add_shards_option,
    add_threads_option,
    add_workers_option,
    addresses,
    human,
    output_path,
    sigterm_interrupts,
    size,
    stdout_console,
)

if TYPE_CHECKING:
    from rich.table import Table

    from switchml.bench.allreduce import BenchConfig
    from switchml.bench.testbed import TestbedBenchConfig

__all__ = ["add_parser", "config_from_args", "run", "testbed_config_from_args"]


def add_parser(bsub: Subparsers) -> None:
    """``switchml bench allreduce``: all-reduce throughput, switchml against gloo."""
    ar = bsub.add_parser(
        "allreduce", help="all-reduce ATE/s of switchml against gloo",
        description="Run N worker processes on this machine and measure all-reduce throughput "
                    "in ATE/s (aggregated tensor elements per second, per worker) for switchml "
                    "and for torch.distributed gloo (ring all-reduce) in the same run.")
    add_workers_option(ar, "worker processes")
    ar.add_argument("--size", type=size, action="append", dest="sizes",
                    help="tensor size in bytes of float32, with unit (e.g. 64MiB); repeat for "
                         "several (default 64MiB)")
    ar.add_argument("--iters", type=int, default=5, help="timed operations per size (default 5)")
    ar.add_argument("--warmup", type=int, default=2, help="untimed operations first (default 2)")
    ar.add_argument("--switch", type=addresses, default=None,
                    help="HOST:PORT of a running switch, or its shards' HOST:PORT,HOST:PORT,... "
                         "(default: start one for the benchmark)")
    add_shards_option(ar, help="switch processes the benchmark starts, one shard each: a worker "
                               "stripes its lanes over them, so the switch uses that many cores "
                               "(loopback only; default 1)")
    ar.add_argument("--window", type=int, default=None,
                    help="slots per job, W (default: about 256 KiB in flight per worker: 128 "
                         "at MTU 1500, 29 at 9000, 16 for 64 KB datagrams)")
    ar.add_argument("--elements-per-packet", type=int, default=None,
                    help="int32 elements per packet, k (default: the largest that fits the "
                         "MTU: 16366 (64 KB datagrams) on loopback, 358 at 1500, 2233 at 9000)")
    ar.add_argument("--bits", type=int, choices=(32, 16), default=32,
                    help="switchml's wire width for floats: 32, or 16 (fixed point in half the "
                         "bytes, the DDP hook's bandwidth-halving mode) (default 32)")
    ar.add_argument("--residual", action="store_true",
                    help="with --testbed --bits 16: each worker keeps a float32 rounding "
                         "residual (error feedback), as the 16-bit DDP hook does")
    ar.add_argument("--auth-data", action="store_true",
                    help="switchml's job authenticates its data plane: a 16-byte MAC on every "
                         "request and result (the benchmark's switch gets a secret of the "
                         "run's own; chunks leave room for the MAC: 354 elements at MTU 1500)")
    add_threads_option(ar, help="I/O threads per switchml worker, each with its own socket and "
                                "share of the window (one core carries about 4 Gbit/s; results "
                                "are bit-identical for any count) (default 1)")
    ar.add_argument("--no-gloo", action="store_true", help="skip the gloo baseline")
    ar.add_argument("--no-batching", action="store_true",
                    help="switch and workers make one system call per datagram (no UDP "
                         "GSO/GRO): the baseline for small packets")
    _add_testbed_args(ar)
    add_json_option(ar, "the figures")
    ar.add_argument("--timeout-s", type=float, default=600.0,
                    help="give up on a measurement after this long (default 600)")
    ar.set_defaults(func=run)


def _add_testbed_args(ar: argparse.ArgumentParser) -> None:
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
    tbg.add_argument("--jobs", type=int, default=1,
                     help="split the -n workers into JOBS jobs that run at once (worker i in "
                          "job i mod JOBS), as HSDP's shard groups do: switchml's jobs share "
                          "the switch, gloo's are JOBS rings (default 1)")
    tbg.add_argument("--dtype", choices=("float32", "float16", "bfloat16"), default="float32",
                     help="the all-reduced tensors' type (default float32). float16, bfloat16: "
                          "switchml runs through its torch backend (dist.all_reduce on a "
                          "\"switchml\" group, which sets the wire width: 16 bits up to 4 "
                          "ranks for float16, 15 for bfloat16), gloo all-reduces the same type; "
                          "switchml and gloo only. Sizes stay float32's element counts")
    tbg.add_argument("--torch", action="store_true",
                     help="switchml through its torch backend for float32 too (dist.all_reduce "
                          "on a \"switchml\" group), beside the worker library's rows")
    add_nack_gap_option(tbg, help="the switch's NACK gap (0: loss recovery by timeouts alone; "
                                  "compare the two in one session) (default 4)")
    tbg.add_argument("--fast-retransmit", action="store_true",
                     help="switchml workers re-send a chunk as soon as a later chunk's result "
                          "arrives (RACK) instead of at its timeout (off by default: it did "
                          "not help on this testbed, see docs/benchmarks.md)")
    add_link_options(tbg, mtu=False)  # (--mtu is loopback's too: below)
    ar.add_argument("--mtu", type=int, default=None,
                    help="MTU in bytes that chunks must fit (no IP fragmentation). Testbed: "
                         "the link MTU (default 1500, Ethernet; 9000 for jumbo frames; veth "
                         "takes up to 65535 but that is not a real network). Loopback: default "
                         "the route's MTU (65536)")
    tbg.add_argument("--systems", default="switchml,gloo,ps",
                     help="comma list of switchml, gloo, ps (parameter server) and floor (the "
                          "same bytes echoed through a hub in switchml's datagrams, with no "
                          "protocol: the CPU floor of the data path) (default switchml,gloo,ps)")
    tbg.add_argument("--csv", metavar="PATH", type=output_path, help="also write the rows as CSV")
    # (what a loopback run refuses, by name, rather than ignore: the group's options)
    ar.set_defaults(testbed_only={a.dest: (a.option_strings[0], a.default)
                                  for a in tbg._group_actions if a.dest != "testbed"})


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    """The loopback benchmark ``args`` describe (chunks sized to the switch's route MTU)."""
    from switchml.bench.allreduce import BenchConfig
    from switchml.protocol.wire import AUTH_TAG_SIZE
    from switchml.transport.udp import elements_per_packet_for

    return BenchConfig(
        workers=args.workers, sizes_bytes=tuple(args.sizes or [64 * 2**20]), iters=args.iters,
        warmup=args.warmup, switch=tuple(args.switch) if args.switch else None,
        shards=args.shards, window=args.window,
        elements_per_packet=args.elements_per_packet or elements_per_packet_for(
            args.switch[0] if args.switch else ("127.0.0.1", 1), args.mtu,
            trailer=AUTH_TAG_SIZE if args.auth_data else 0), bits=args.bits,
        baselines=() if args.no_gloo else ("gloo",), timeout_s=args.timeout_s,
        batching=not args.no_batching, threads=args.threads, auth_data=args.auth_data)


def testbed_config_from_args(args: argparse.Namespace) -> TestbedBenchConfig:
    """The ``--testbed`` benchmark ``args`` describe."""
    from switchml.bench.testbed import DEFAULT_MTU, TestbedBenchConfig

    return TestbedBenchConfig(
        workers=args.workers, sizes_bytes=tuple(args.sizes or [64 * 2**20]),
        rate_bps=args.rate_mbit * 1e6, loss_rate=args.loss, mtu=args.mtu or DEFAULT_MTU,
        iters=args.iters, warmup=args.warmup,
        systems=tuple(x.strip() for x in args.systems.split(",") if x),
        window=args.window, timeout_s=args.timeout_s,
        fast_retransmit=args.fast_retransmit, bits=args.bits, nack_gap=args.nack_gap,
        jobs=args.jobs, residual=args.residual, dtype=args.dtype,
        torch=args.torch, threads=args.threads, auth_data=args.auth_data)


def run(args: argparse.Namespace) -> int:
    """``switchml bench allreduce`` on loopback (or, with ``--testbed``, the emulated network)."""
    if args.testbed:
        return _run_testbed(args)
    given = [flag for dest, (flag, default) in args.testbed_only.items()
             if getattr(args, dest) != default] + (["--residual"] if args.residual else [])
    if given:
        raise ValueError(f"{', '.join(given)}: only with --testbed (a loopback run all-reduces "
                         "float32 through the worker library, switchml against gloo)")
    from rich.console import Console

    from switchml.bench.allreduce import run_benchmark, write_json

    cfg = config_from_args(args)
    console = Console(stderr=True)
    with console.status("starting") as status:
        results, switch_stats = run_benchmark(
            cfg, progress=lambda what: status.update(f"measuring {what}"))
    stdout_console().print(_allreduce_table(cfg, results))
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
    for nbytes in cfg.sizes_bytes:
        sm = next(m for m in results if m.system == "switchml" and m.size_bytes == nbytes)
        gl = next((m for m in results if m.system == "gloo" and m.size_bytes == nbytes), None)
        table.add_row(
            human(nbytes), f"{sm.ate_per_s:.3g}", f"{gl.ate_per_s:.3g}" if gl else "-",
            f"{sm.ate_per_s / gl.ate_per_s:.2f}" if gl else "-", f"{sm.goodput_gbps:.2f}",
            f"{sm.max_rel_error:.1e}" if sm.max_rel_error is not None else "-",
            "/".join(f"{c:.0f}" for c in sm.cpu_percent) + (
                f" | {sm.extra['switch_cpu_percent']:.0f}" if "switch_cpu_percent" in sm.extra
                else ""),
            "/".join(f"{c:.0f}" for c in gl.cpu_percent) if gl else "-",
            *(ratio_text(sm.extra.get(k), gl.extra.get(k) if gl else None)
              for k in ("worker_cpu_s_per_gelem", "machine_cpu_s_per_gelem")))
    return table


def _run_testbed(args: argparse.Namespace) -> int:
    """``switchml bench allreduce --testbed``: all-reduce over the emulated network."""
    from rich.console import Console

    from switchml.bench.testbed import run_testbed_allreduce, write_outputs

    sigterm_interrupts()  # SIGTERM runs the testbed's teardown
    cfg = testbed_config_from_args(args)
    console = Console(stderr=True)
    with console.status("building the testbed") as status:
        if args.racks > 1:
            from switchml.bench.testbed_tree import run_testbed_tree
            rows = run_testbed_tree(cfg, args.racks, progress=lambda what: status.update(
                f"measuring {what}"))
        else:
            rows = run_testbed_allreduce(cfg, progress=lambda what: status.update(
                f"measuring {what}"))
    stdout_console().print(_testbed_table(cfg, args.rate_mbit, rows))
    write_outputs(rows, args.json, args.csv)
    bad = [r for r in rows if r["system"] == "switchml" and r.get("max_abs_error", 0) > 1e-3]
    return 1 if bad else 0


def _testbed_table(cfg: Any, rate_mbit: float, rows: Sequence[dict]) -> Table:
    """One row per size and system of the testbed all-reduce, with the CPU each spent per
    10^9 aggregated elements (worker processes, whole machine) and its ratio to gloo's."""
    from rich.table import Table

    from switchml.bench.cpu import ratio_text

    jobs = (f" in {cfg.jobs} jobs of {cfg.workers // cfg.jobs} at once"
            if getattr(cfg, "jobs", 1) > 1 else "")
    dtype = f", {cfg.dtype} tensors" if getattr(cfg, "dtype", "float32") != "float32" else ""
    table = Table(title=f"all-reduce over the testbed: {cfg.workers} workers{jobs}, {rate_mbit:g} "
                        f"Mbit/s links, loss {cfg.loss_rate:g}, MTU {cfg.mtu}{dtype} (ATE/s "
                        "per worker)",
                  caption="CPU-s/1e9: CPU-seconds per 10^9 elements aggregated per worker "
                          "(the worker processes summed; the whole machine from /proc/stat, "
                          "switch and softirq included), and the ratio to gloo's")
    for col in ("size", "system", "ATE/s", "of line rate B/32", "ring bound", "vs gloo",
                "worker CPU %", "switch CPU %", "CPU-s/1e9 workers", "CPU-s/1e9 machine"):
        table.add_column(col, justify="right")
    for r in rows:
        gloo = next((g for g in rows if g["system"] == "gloo"
                     and g["size_bytes"] == r["size_bytes"]), None)
        table.add_row(human(r["size_bytes"]),
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

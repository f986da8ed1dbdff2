"""All-reduce benchmark: switchml against torch.distributed gloo, same sizes, same run.

Every measurement runs N worker processes on this machine. switchml workers all-reduce through a
software switch (a process of its own unless ``--switch`` names a running one); gloo workers run
``torch.distributed.all_reduce`` (ring) over TCP on loopback. Both do ``warmup`` untimed and
``iters`` timed operations on a float32 tensor of the given size; each worker measures its own
wall time and CPU time over the timed loop.

Figure of merit (SwitchML's): ATE/s, aggregated tensor elements per second as one worker sees
it, ``numel * iters / elapsed``; we report the slowest worker. The switchml result is checked
against the exact expected sum every time (``max_rel_error``).
"""

from __future__ import annotations

import dataclasses
import json
import multiprocessing as mp
import os
import resource
import secrets
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from switchml.bench.cpu import cpu_per_gelem, machine_busy_s, sample_processes, span_cpu_percent
from switchml.bench.switchproc import SwitchProcess
from switchml.protocol.parts import check_threads

__all__ = ["BenchConfig", "Measurement", "parse_size", "run_benchmark"]

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1024, "m": 1000**2, "mb": 1000**2,
          "mib": 1024**2, "g": 1000**3, "gb": 1000**3, "gib": 1024**3}


def parse_size(text: str) -> int:
    """Parse ``64MiB``, ``1k``, ``4096`` into bytes; raises ValueError saying what is accepted."""
    t = text.strip().lower()
    num = t.rstrip("abcdefghijklmnopqrstuvwxyz")
    unit = t[len(num):]
    if not num or unit not in _UNITS:
        raise ValueError(f"bad size {text!r}: expected a number with an optional unit "
                         f"(B, KiB, MiB, GiB, KB, MB, GB), e.g. 64MiB")
    value = int(float(num) * _UNITS[unit])
    if value < 4:
        raise ValueError(f"size {text!r} is below one float32 element (4 bytes)")
    return value


@dataclass(frozen=True)
class BenchConfig:
    workers: int = 4
    sizes_bytes: tuple[int, ...] = (64 * 2**20,)
    iters: int = 5
    warmup: int = 2
    switch: tuple[tuple[str, int], ...] | None = None
    """A running switch's addresses (its shards' when sharded); None starts ``shards`` here."""
    shards: int = 1
    """Switch processes the benchmark starts (a sharded switch: workers stripe their lanes)."""
    window: int | None = None
    """Slots per job; default from the chunk size (``protocol.config.default_window``)."""
    elements_per_packet: int = 16366
    """int32 elements per chunk; the CLI derives it from the path MTU (loopback: 16366)."""
    bits: int = 32
    """Wire width of switchml's floats: 32, or 16 (half the bytes)."""
    baselines: tuple[str, ...] = ("gloo",)
    timeout_s: float = 600.0
    batching: bool = True  # UDP GSO/GRO in the switch and the workers
    secret: bytes | None = None
    """The secret of an external switch (``switch``) that has one: creating the job needs it."""
    threads: int = 1
    """I/O threads per switchml worker (``transport/parallel.py``)."""
    auth_data: bool = False
    """switchml's job authenticates its data plane (``JobSpec.auth_data``); the benchmark's
    own switch gets a secret of this run's (an outside one needs ``secret``), and
    ``elements_per_packet`` must leave room for the 16-byte MAC."""

    def __post_init__(self) -> None:
        if self.workers < 1:
            raise ValueError(f"BenchConfig.workers must be >= 1, got {self.workers}")
        if not self.timeout_s > 0:
            raise ValueError(f"BenchConfig.timeout_s must be > 0, got {self.timeout_s}")
        if self.auth_data and self.switch is not None and self.secret is None:
            raise ValueError("BenchConfig.auth_data through an outside switch needs its "
                             "BenchConfig.secret")
        if self.bits not in (32, 16):
            raise ValueError(f"BenchConfig.bits must be 32 or 16, got {self.bits}")
        check_threads(self.threads)
        if self.shards < 1:
            raise ValueError(f"BenchConfig.shards must be >= 1, got {self.shards}")
        if self.switch is not None and self.shards != 1:
            raise ValueError("BenchConfig.shards starts the benchmark's own switch; with "
                             "BenchConfig.switch, list the running switch's shards instead")
        if self.iters < 1 or self.warmup < 0:
            raise ValueError("BenchConfig.iters must be >= 1 and BenchConfig.warmup >= 0")
        unknown = set(self.baselines) - {"gloo"}
        if unknown:
            raise ValueError(f"unknown baseline(s) {sorted(unknown)}; known: gloo")


@dataclass
class Measurement:
    system: str
    workers: int
    size_bytes: int
    numel: int
    iters: int
    elapsed_s: float  # slowest worker
    ate_per_s: float
    goodput_gbps: float
    cpu_percent: list[float] = field(default_factory=list)  # per worker process
    max_rel_error: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


# -- processes ---------------------------------------------------------------------------------

def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _switchml_worker(rank: int, spec_text: str, switch: Sequence[tuple[str, int]], numel: int,
                     warmup: int, iters: int, barrier: Any, results: Any,
                     batching: bool = True, bits: int = 32, secret: bytes | None = None,
                     threads: int = 1, switch_pids: Sequence[int] = ()) -> None:
    from switchml.control import decode_job_spec
    from switchml.protocol.config import WorkerConfig
    from switchml.transport.parallel import open_worker
    try:
        spec = decode_job_spec(spec_text)
        n = spec.num_workers
        base = np.linspace(-1.0, 1.0, numel, dtype=np.float32)
        x = base * np.float32(rank + 1)
        expected = base.astype(np.float64) * (n * (n + 1) / 2)
        out = np.empty_like(x)
        with open_worker(switch, spec, rank, WorkerConfig(secret=secret), threads=threads,
                         batching=batching) as w:
            for _ in range(warmup):
                w.allreduce(x, out, bits=bits)
            barrier.wait()
            sw0 = sample_processes(switch_pids) if switch_pids else None
            b0, c0, t0 = machine_busy_s(), _cpu_s(), time.perf_counter()
            for _ in range(iters):
                w.allreduce(x, out, bits=bits)
            elapsed = time.perf_counter() - t0
            cpu, busy = _cpu_s() - c0, (b0, machine_busy_s())
            # the switch over this loop: [t0, cpu0, t1, cpu1] (its share of a core, with the
            # other workers' spans), not over the start-up and this check
            sw1 = sample_processes(switch_pids) if sw0 is not None else None
            span = sw0 + sw1 if sw0 is not None and sw1 is not None else None
            scale = np.max(np.abs(expected)) or 1.0
            err = float(np.max(np.abs(out - expected)) / scale)
            results.put((rank, elapsed, cpu, err, w.counters, None, busy, span))
    except BaseException as exc:  # report, don't hang the parent (nor the others at the barrier)
        barrier.abort()
        results.put((rank, 0.0, 0.0, None, {}, f"{type(exc).__name__}: {exc}", None, None))


def _gloo_worker(rank: int, n: int, port: int, numel: int, warmup: int, iters: int,
                 barrier: Any, results: Any) -> None:
    try:
        import torch
        import torch.distributed as dist
        torch.set_num_threads(1)
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=n)
        x = torch.full((numel,), float(rank + 1), dtype=torch.float32)
        for _ in range(warmup):
            dist.all_reduce(x)
        barrier.wait()
        b0, c0, t0 = machine_busy_s(), _cpu_s(), time.perf_counter()
        for _ in range(iters):
            dist.all_reduce(x)
        elapsed = time.perf_counter() - t0
        cpu, busy = _cpu_s() - c0, (b0, machine_busy_s())
        dist.destroy_process_group()
        results.put((rank, elapsed, cpu, None, {}, None, busy, None))
    except BaseException as exc:
        barrier.abort()
        results.put((rank, 0.0, 0.0, None, {}, f"{type(exc).__name__}: {exc}", None, None))


def _collect(procs: list[Any], results: Any, n: int, timeout_s: float) -> list[tuple]:
    rows = []
    deadline = time.monotonic() + timeout_s
    try:
        while len(rows) < n:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"benchmark workers did not finish within {timeout_s:g} s")
            try:
                rows.append(results.get(timeout=min(left, 1.0)))
            except Exception:
                dead = [p for p in procs if p.exitcode not in (None, 0)]
                if dead and len(rows) < n:
                    raise RuntimeError(f"worker process exited with {dead[0].exitcode}") from None
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
    errors = [r[5] for r in rows if r[5]]
    if errors:
        raise RuntimeError(f"worker failed: {errors[0]}")
    return sorted(rows, key=lambda r: r[0])


def _measure(system: str, cfg: BenchConfig, size: int,
             switch: Sequence[tuple[str, int]] | None,
             ctx: Any, switch_pids: Sequence[int] = ()) -> Measurement:
    n = cfg.workers
    numel = size // 4
    results = ctx.Queue()
    barrier = ctx.Barrier(n + 1)  # the workers and this process: marks the timed loop's start
    if system == "switchml":
        from switchml.control import encode_job_spec, new_job_spec
        spec = encode_job_spec(new_job_spec(n, window=cfg.window,
                                            elements_per_packet=cfg.elements_per_packet,
                                            auth_data=cfg.auth_data))
        procs = [ctx.Process(target=_switchml_worker, args=(r, spec, switch, numel, cfg.warmup,
                                                            cfg.iters, barrier, results,
                                                            cfg.batching, cfg.bits,
                                                            cfg.secret, cfg.threads,
                                                            tuple(switch_pids)))
                 for r in range(n)]
    else:
        port = _free_port()
        procs = [ctx.Process(target=_gloo_worker, args=(r, n, port, numel, cfg.warmup,
                                                        cfg.iters, barrier, results))
                 for r in range(n)]
    for p in procs:
        p.start()
    try:
        barrier.wait(timeout=cfg.timeout_s)
    except threading.BrokenBarrierError:
        pass  # a worker failed before the timed loop; _collect reports why
    rows = _collect(procs, results, n, cfg.timeout_s)
    busy = [r[6] for r in rows if r[6]]  # the machine over the workers' timed loops
    extra: dict[str, Any] = {}
    switch_percent = span_cpu_percent([r[7] for r in rows if r[7]])
    if switch_percent is not None:  # the switch (its shards summed) over the same loops
        extra["switch_cpu_percent"] = switch_percent
    elapsed = max(r[1] for r in rows)
    ate = numel * cfg.iters / elapsed
    errs = [r[3] for r in rows if r[3] is not None]
    counters: dict[str, int] = {}
    for r in rows:
        for k, v in r[4].items():
            counters[k] = counters.get(k, 0) + v
    return Measurement(
        system=system, workers=n, size_bytes=size, numel=numel, iters=cfg.iters,
        elapsed_s=elapsed, ate_per_s=ate, goodput_gbps=ate * 32 / 1e9,
        cpu_percent=[100.0 * r[2] / r[1] for r in rows],
        max_rel_error=max(errs) if errs else None,
        extra={**extra, **({"worker_counters": counters} if counters else {}),
               **cpu_per_gelem(worker_cpu_s=[r[2] for r in rows],
                               machine_busy=(min(b[0] for b in busy), max(b[1] for b in busy))
                               if busy else None,
                               elements=numel * cfg.iters)},
    )


def run_benchmark(cfg: BenchConfig, progress: Any = None
                  ) -> tuple[list[Measurement], dict[str, Any]]:
    """Run every (size, system) pair; return the measurements (switchml first per size) and
    the benchmark switch's final counters (empty when ``cfg.switch`` names an outside switch).

    ``progress``: optional callable(str) told what runs next.
    """
    ctx = mp.get_context("spawn")
    own: list[SwitchProcess] = []
    out: list[Measurement] = []
    switch_stats: dict[str, Any] = {}
    if cfg.auth_data and cfg.switch is None:  # the switch's secret: this run's own
        cfg = dataclasses.replace(cfg, secret=secrets.token_bytes(32))
    try:
        if cfg.switch is None:
            for i in range(cfg.shards):
                own.append(SwitchProcess(ctx, batching=cfg.batching, shard=(i, cfg.shards),
                                         secret=cfg.secret))
        switch = [p.address for p in own] if own else list(cfg.switch or ())

        for size in cfg.sizes_bytes:
            for system in ("switchml", *cfg.baselines):
                if progress is not None:
                    progress(f"{system} n={cfg.workers} size={size} B")
                out.append(_measure(system, cfg, size, switch, ctx,
                                    [p.proc.pid for p in own]))
        if len(own) == 1:
            switch_stats = own[0].stats()
        elif own:
            switch_stats = {"shards": [p.stats() for p in own]}
    finally:
        for p in own:
            p.stop()
    return out, switch_stats


def write_json(path: str, cfg: BenchConfig, results: list[Measurement],
               switch_stats: dict[str, Any]) -> None:
    doc = {
        "benchmark": "allreduce",
        "config": {**asdict(cfg), "secret": "(given)" if cfg.secret else None},  # not kept
        "switch_stats": switch_stats,
        "machine": {"cpus": os.cpu_count(), "uname": " ".join(os.uname())},
        "results": [asdict(m) for m in results],
    }
    with open(path, "w") as f:
        json.dump(doc, f, indent=2)

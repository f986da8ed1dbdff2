"""What one all-reduce costs a worker besides its datagrams: CPU and time per operation.

n worker processes and a switch (a thread of this process) on loopback run ``--iters``
all-reduces of ``--size`` back to back. Each worker reports its time and its process's CPU per
operation, and the CPU its I/O thread spent per operation in each step of the pump
(``time.thread_time`` around the ``WorkerClient`` methods named below; they nest: ``_read``
contains ``_read_fast``, which contains the compiled loop ``run`` and calls ``_transmit``,
so the columns do not add up). At a few kilobytes the
figures are the fixed cost of an operation; at a megabyte, the part of it that a DDP bucket
pays. Cited in docs/benchmarks.md ("Small operations").

    python experiments/per_operation_cost.py --size 16KiB --iters 2000
    python experiments/per_operation_cost.py --size 1MiB --iters 400
"""

from __future__ import annotations

import argparse
import collections
import multiprocessing as mp
import resource
import time
from typing import Any

import numpy as np

from switchml.bench.allreduce import parse_size
from switchml.control import decode_job_spec, encode_job_spec, new_job_spec
from switchml.transport.fastpath import FastPath
from switchml.transport.udp import SwitchServer, WorkerClient

STEPS = ((WorkerClient, "_run_commands"), (WorkerClient, "_transmit"), (WorkerClient, "_read"),
         (WorkerClient, "_read_fast"), (FastPath, "run"))


def _timed(acc: dict[str, float], cls: type, name: str) -> None:
    """Wrap ``cls.name`` to add the calling thread's CPU time to ``acc[name]``."""
    inner = getattr(cls, name)

    def timed(*args: Any, **kwargs: Any) -> Any:
        t0 = time.thread_time()
        try:
            return inner(*args, **kwargs)
        finally:
            acc[name] += time.thread_time() - t0
    setattr(cls, name, timed)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker(rank: int, spec_text: str, switch: tuple[str, int], numel: int, iters: int,
            barrier: Any, out: Any) -> None:
    acc: dict[str, float] = collections.defaultdict(float)
    for cls, name in STEPS:
        _timed(acc, cls, name)
    spec = decode_job_spec(spec_text)
    x = np.linspace(-1, 1, numel, dtype=np.float32) * (rank + 1)
    result = np.empty_like(x)
    with WorkerClient(switch, spec, rank) as w:
        for _ in range(5):  # (compiled code loaded, buffers touched)
            w.allreduce(x, result)
        barrier.wait()
        before = dict(acc)  # (a snapshot: the I/O thread may still be finishing a warm-up)
        c0, t0 = _cpu_s(), time.perf_counter()
        for _ in range(iters):
            w.allreduce(x, result)
        elapsed, cpu = time.perf_counter() - t0, _cpu_s() - c0
        steps = {k: (v - before.get(k, 0.0)) / iters for k, v in list(acc.items())}
    out.put((rank, elapsed / iters, cpu / iters, steps))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--workers", "-n", type=int, default=4)
    ap.add_argument("--size", type=parse_size, default=parse_size("1MiB"),
                    help="bytes of float32 per all-reduce (default 1MiB)")
    ap.add_argument("--iters", type=int, default=400)
    ap.add_argument("--elements-per-packet", type=int, default=358,
                    help="int32 elements per datagram (default 358: a 1500-byte MTU)")
    args = ap.parse_args()
    numel = args.size // 4
    with SwitchServer(port=0) as server:
        spec = new_job_spec(args.workers, elements_per_packet=args.elements_per_packet)
        ctx = mp.get_context("spawn")
        barrier, out = ctx.Barrier(args.workers), ctx.Queue()
        procs = [ctx.Process(target=_worker, args=(r, encode_job_spec(spec), server.address,
                                                   numel, args.iters, barrier, out))
                 for r in range(args.workers)]
        for p in procs:
            p.start()
        rows = sorted(out.get(timeout=600) for _ in procs)
        for p in procs:
            p.join()
    print(f"{args.workers} workers, {numel} float32 per all-reduce, {args.iters} all-reduces; "
          "ms per operation (the I/O thread's steps nest: _read > _read_fast > run, _transmit)")
    names = [name for _, name in STEPS]
    print(f"{'rank':>4} {'time':>7} {'CPU':>7} " + " ".join(f"{n:>13}" for n in names))
    for rank, wall, cpu, steps in rows:
        print(f"{rank:>4} {wall * 1e3:7.3f} {cpu * 1e3:7.3f} "
              + " ".join(f"{steps.get(n, 0.0) * 1e3:13.3f}" for n in names))


if __name__ == "__main__":
    main()

"""``switchml calibrate``: measure what a unit of work costs this machine's CPU (``costs.py``).

Three measurements on loopback, each a few seconds:

1. **A switchml worker.** One worker (a job of one rank, so the switch answers each request
   at once) all-reduces a float32 tensor through a switch in a process of its own, at two
   chunk sizes (an MTU of 1500 and of 9000: six times fewer datagrams for the same
   elements). The worker's process CPU over the timed operations, with the datagrams and
   elements each way, gives two equations; their solution is the cost per datagram and per
   element.
2. **The switch.** ``bench.switchcap`` (``switchml bench switch``): a generator replays valid
   requests of 4 ranks, each on a socket of its own, as fast as the switch answers, at the
   same two chunk sizes; the switch's CPU per request at each gives its cost per request and
   per element.
3. **gloo.** Two ranks all-reduce the same tensor with ``torch.distributed`` (gloo, TCP on
   loopback); a rank's CPU over the elements it moves is the cost per element.

On loopback a sender's system call also delivers the datagram to the receiving socket, so
each side's figure holds some of the other's kernel work, as on one machine it does.

4. **The testbed's emulated links** (``--links``; root): four workers all-reduce through the
   switch over the testbed's 1 Gbit/s links (veth pairs, tbf shapers, the switch's
   namespace), a small tensor (2 MiB) and a large one (32 MiB), and the whole machine's CPU
   per element (``/proc/stat``) is set against what steps 1 and 2 charge the same work on
   loopback. What is left is solved, over the two sizes, into a cost per byte the links
   carried (``Costs.link_byte_s``) and one per all-reduce and worker (``Costs.link_op_s``: a
   small all-reduce arrives at the link's pace in small batches). Only predictions of
   testbed runs charge them: a real network's NICs do that work.
"""

from __future__ import annotations

import dataclasses
import datetime
import multiprocessing as mp
import os
import resource
from collections.abc import Callable
from typing import Any

import numpy as np

from switchml.costs import REFERENCE, Costs
from switchml.protocol.wire import elements_for_mtu

__all__ = ["calibrate"]

_MTUS = (1500, 9000)


def _cpu_s() -> float:
    r = resource.getrusage(resource.RUSAGE_SELF)
    return r.ru_utime + r.ru_stime


def _worker_run(switch: Any, mtu: int, numel: int, ops: int) -> tuple[float, float]:
    """(worker CPU s, datagrams each way) over ``ops`` all-reduces."""
    from switchml.control import new_job_spec
    from switchml.protocol.config import default_window
    from switchml.protocol.wire import elements_for_mtu
    from switchml.transport.udp import WorkerClient

    k = elements_for_mtu(mtu)
    window = default_window(k)
    spec = new_job_spec(1, window=window, elements_per_packet=k)
    x = np.linspace(-1.0, 1.0, numel, dtype=np.float32)
    out = np.empty_like(x)
    with WorkerClient(switch.address, spec, 0) as w:
        w.allreduce(x, out)
        c0 = _cpu_s()
        for _ in range(ops):
            w.allreduce(x, out)
        cpu = _cpu_s() - c0
    if not np.allclose(out, x, rtol=0, atol=1e-6):
        raise RuntimeError("calibration: a one-rank all-reduce did not return its input")
    blocks = -(-numel // k)
    return cpu, ops * (blocks + min(window, blocks))  # look-ahead exponents included


def _switch_request_s(mtu: int, seconds: float) -> float:
    """The switch's CPU per request of ``elements_for_mtu(mtu)`` elements, 4 ranks."""
    from switchml.bench.switchcap import SwitchCapConfig, run_switchcap
    from switchml.protocol.wire import elements_for_mtu
    result = run_switchcap(SwitchCapConfig(workers=4, elements_per_packet=elements_for_mtu(mtu),
                                           window=64, seconds=seconds))
    if sum(result.drops.values()) or sum(result.switch_errors.values()):
        raise RuntimeError(f"calibration: the switch dropped requests ({result.drops}) or "
                           f"failed ({result.switch_errors})")
    return result.switch_cpu_us_per_datagram * 1e-6


def _gloo_rank(rank: int, port: int, numel: int, ops: int, q: Any) -> None:
    import torch
    import torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    x = torch.ones(numel)
    dist.all_reduce(x)
    dist.barrier()
    c0 = _cpu_s()
    for _ in range(ops):
        dist.all_reduce(x)
    q.put(_cpu_s() - c0)
    dist.destroy_process_group()


def _gloo_element_s(numel: int, ops: int) -> float:
    import socket
    ctx = mp.get_context("spawn")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    q = ctx.Queue()
    procs = [ctx.Process(target=_gloo_rank, args=(r, port, numel, ops, q)) for r in range(2)]
    for p in procs:
        p.start()
    try:
        cpus = [q.get(timeout=300) for _ in procs]
    finally:
        for p in procs:
            p.join(30)
            if p.is_alive():
                p.kill()
    return float(np.mean(cpus)) / (ops * numel)  # n = 2: a rank moves N elements each way


def _solve(d: list[float], e: list[float], cpu: list[float]) -> tuple[float, float]:
    """Per-datagram and per-element cost from ``cpu_i = d_i a + e_i b`` (least squares,
    clamped at 0)."""
    a, b = np.linalg.lstsq(np.array([d, e], float).T, np.array(cpu, float), rcond=None)[0]
    if a < 0:  # noise: all of it per element
        a, b = 0.0, float(np.dot(e, cpu) / np.dot(e, e))
    if b < 0:
        a, b = float(np.dot(d, cpu) / np.dot(d, d)), 0.0
    return float(a), float(b)


_LINK_SIZES = (2 << 20, 32 << 20)
"""The all-reduces ``--links`` times: a small bucket's (a CNN's) and a large one's."""


def link_costs(costs: Costs, *, workers: int = 4, mtu: int = 1500, rate_bps: float = 1e9,
               sizes_bytes: tuple[int, ...] = _LINK_SIZES, seconds: float = 1.5
               ) -> tuple[float, float, list[dict[str, Any]]]:
    """The testbed's emulated links' costs (step 4 of the module's text): the kernel's CPU
    per byte a link carries, and the machine's CPU per all-reduce and worker, beyond what the
    loopback calibration (``costs``) charges; and the figures they come from, per size.
    Needs root (the testbed). Each size runs for about ``seconds`` (``/proc/stat`` counts
    in 10 ms ticks: a few small all-reduces would measure nothing but them).

    Raises:
        RuntimeError: the run failed, or measured no machine CPU (no ``/proc/stat``).
    """
    from switchml.bench.testbed import TestbedBenchConfig, run_testbed_allreduce
    rows = [run_testbed_allreduce(TestbedBenchConfig(
        workers=workers, sizes_bytes=(size,), rate_bps=rate_bps, mtu=mtu,
        iters=max(3, round(seconds * rate_bps / (size * 8))), warmup=1,
        systems=("switchml",)))[0] for size in sizes_bytes]
    k = elements_for_mtu(mtu)
    # What steps 1 and 2 charge one element on loopback: each worker sends and receives it
    # (a k-th of a datagram each way), the switch takes it from every worker.
    model = workers * costs.worker_s(1 / k, 1) + costs.switch_s(workers / k, workers)
    link_bytes = workers * 2 * (mtu + 14) / k  # every worker's link, both ways
    excess, per_op, figures = [], [], []
    for row, size in zip(rows, sizes_bytes, strict=True):
        machine = row.get("machine_cpu_s_per_gelem")
        if not machine:
            raise RuntimeError(f"calibration: the testbed run measured no machine CPU: {row}")
        elements = size // 4
        excess.append(machine * 1e-9 - model)  # per element, beyond the loopback figures
        per_op.append(1.0 / elements)  # all-reduces per element
        figures.append({"size_bytes": size, "machine_cpu_ns_per_element": machine,
                        "model_cpu_ns_per_element": model * 1e9,
                        "link_bytes_per_element": link_bytes,
                        "fraction_of_line_rate": row.get("fraction_of_line_rate")})
    # excess = op / elements + bytes x byte: per all-reduce (all workers) and per byte
    op, byte = _solve(per_op, [link_bytes] * len(excess), excess) if len(excess) > 1 else (
        0.0, max(0.0, excess[0] / link_bytes))
    return byte, op / workers, figures


def calibrate(*, numel: int = 16 << 20, ops: int = 4, gloo: bool = True,
              switch_seconds: float = 2.0, links: bool = False,
              progress: Callable[[str], None] | None = None) -> Costs:
    """Measure this machine's :class:`~switchml.costs.Costs` (takes a few seconds per
    measurement; the machine should be idle). ``links``: also the testbed's emulated links
    (root; about 20 s more)."""
    from switchml.bench.switchproc import SwitchProcess

    say = progress or (lambda _msg: None)
    switch = SwitchProcess(mp.get_context("spawn"))
    d: list[float] = []
    e: list[float] = []
    wcpu: list[float] = []
    try:
        for mtu in _MTUS:
            say(f"a worker at MTU {mtu}")
            cpu, datagrams = _worker_run(switch, mtu, numel, ops)
            d.append(datagrams)
            e.append(float(ops * numel))
            wcpu.append(cpu / 2)  # each way: the model charges sending and receiving alike
    finally:
        switch.stop()
    wd, we = _solve(d, e, wcpu)
    per_request = []
    for mtu in _MTUS:
        say(f"the switch at MTU {mtu}")
        per_request.append(_switch_request_s(mtu, switch_seconds))
    ks = [float(elements_for_mtu(m)) for m in _MTUS]
    sd, se = _solve([1.0, 1.0], ks, per_request)
    stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    source = f"measured {stamp} on {os.uname().nodename}"
    if gloo:
        say("gloo, two ranks")
        ge = _gloo_element_s(numel, ops)
    else:
        ge, source = REFERENCE.gloo_element_s, f"{source} (gloo: the reference machine's)"
    costs = Costs(worker_datagram_s=wd, worker_element_s=we, switch_request_s=sd,
                  switch_element_s=se, gloo_element_s=ge, source=source)
    if links:
        say("the testbed's emulated links (four workers, 1 Gbit/s, two sizes)")
        per_byte, per_op, _figures = link_costs(costs)
        costs = dataclasses.replace(costs, link_byte_s=per_byte, link_op_s=per_op,
                                    source=f"{source}; emulated links measured on the testbed")
    return costs

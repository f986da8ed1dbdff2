"""``python -m switchml.warmup``: compile every per-packet kernel for this machine ahead, into
numba's cache, in parallel processes (one per core), then run every transport once.

Nothing needs it to be run: a switch and a worker compile what they need before they answer
or join (``transport/compiled.py``). It saves that wait later, and ``.ci/run`` and the test
suite run it first so that no test's time limit pays for the compiler.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time
from collections.abc import Callable, Sequence

import numpy as np

from switchml.protocol.warmup import KINDS, Kind
from switchml.transport.compiled import (
    clear_stale_caches,
    ensure_switch,
    ensure_tree,
    ensure_worker,
)

__all__ = ["main", "warm_up"]


# -- everything, ahead -------------------------------------------------------------------------

def _tasks(kinds: Sequence[Kind], switch: bool, tree: bool) -> list[str]:
    """The compile tasks, as ``--task`` arguments: ``tree`` (a rack's kernels and the
    switch's) or ``switch`` (the switch's alone). (A worker's kernels, one per kind of
    operation, are C built with the package: nothing to compile; ``kinds`` is what the
    transports' run takes.)"""
    del kinds
    return ["tree"] if tree else ["switch"] if switch else []


def _run_task(task: str) -> None:
    if task == "tree":
        ensure_tree()
        return
    if task == "switch":
        ensure_switch()
        return
    name, bits, residual = task.split("/")
    ensure_worker(np.dtype(name), int(bits), residual == "1")


def _warm_transports() -> None:
    """One single-rank job of every operation kind over loopback UDP: on the fast path, on
    the generic path with loss (retransmissions, fast retransmit), through a sharded switch and
    through a rack under a spine: the signatures only the transports reach."""
    from switchml.control import new_job_spec
    from switchml.protocol.config import SwitchConfig, WorkerConfig
    from switchml.protocol.tree import RackAggregator, TreeConfig, tree_specs
    from switchml.transport.faults import LossyEndpoint
    from switchml.transport.udp import SwitchServer, WorkerClient

    lossy = WorkerConfig(op_timeout_s=20.0, max_rto_s=0.05, initial_rto_s=0.02)

    def job(switch, spec, kinds, config=None, loss=0.0) -> None:
        wrap = (lambda s: LossyEndpoint(s, loss, seed=1)) if loss else None
        with WorkerClient(switch, spec, 0, config, wrap=wrap) as w:
            for dtype, bits, residual in kinds:
                x = np.arange(3000, dtype=dtype)
                w.allreduce(x, bits=bits, residual=np.zeros_like(x) if residual else None)

    def spec():
        return new_job_spec(1, window=4, elements_per_packet=64)

    servers = []
    try:
        spine = SwitchServer(host="127.0.0.1", port=0).start()
        servers.append(spine)
        job(spine.address, spec(), KINDS)
        job(spine.address, spec(), KINDS, lossy, loss=0.2)
        job(spine.address, spec(), KINDS, WorkerConfig(
            op_timeout_s=20.0, max_rto_s=0.05, initial_rto_s=0.02, fast_retransmit=True),
            loss=0.2)
        shards = [SwitchServer(host="127.0.0.1", port=0, config=SwitchConfig(
            shard_index=i, shard_count=2)).start() for i in range(2)]
        servers += shards
        job([s.address for s in shards], spec(), KINDS)
        parent, child = tree_specs(spec(), 1)
        rack = RackAggregator(parent_spec=parent, child_spec=child, rack=0,
                              parent_address=spine.address,
                              config=TreeConfig(parent_timeout_s=5.0))
        rack_server = SwitchServer(host="127.0.0.1", port=0, dataplane=rack).start()
        servers.append(rack_server)
        rack_server.run_command(rack.join)
        job(rack_server.address, child, KINDS, lossy, loss=0.2)
    finally:
        for server in servers:
            server.stop()


def warm_up(processes: int | None = None, progress: Callable[[str], None] | None = None, *,
            kinds: Sequence[Kind] = KINDS, switch: bool = True, tree: bool = True,
            transports: bool = True) -> float:
    """Compile (or load) the kernels of the switch (``switch``), of a rack switch (``tree``)
    and of a worker for each of ``kinds`` (default: every kind there is): ``processes``
    child processes (default: one per core, at most 4) each compile a share into the cache,
    then this process loads them all and, with ``transports``, runs every transport once
    (which compiles whatever the shares missed). Returns the seconds it took. ``progress``:
    called with a line as each share finishes."""
    say = progress or (lambda line: None)
    t0 = time.monotonic()
    tasks = _tasks(kinds, switch, tree)
    parts = max(1, min(processes or os.cpu_count() or 1, 4, len(tasks)))
    if parts > 1:
        clear_stale_caches()  # once, before the children look at the cache
        children = [subprocess.Popen([sys.executable, "-m", "switchml.warmup",
                                      *(f"--task={t}" for t in tasks[i::parts])])
                    for i in range(parts)]
        for i, child in enumerate(children):
            if child.wait() != 0:
                say(f"  share {i + 1}/{parts} failed (status {child.returncode}): compiling "
                    f"its kernels here instead")
            else:
                say(f"  share {i + 1}/{parts} compiled ({time.monotonic() - t0:.0f} s)")
    for task in tasks:
        _run_task(task)
    if transports:
        _warm_transports()
    return time.monotonic() - t0


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m switchml.warmup",
        description="Compile switchml's per-packet kernels for this machine into numba's cache "
                    "(next to the sources), so that no switch or worker waits for the compiler "
                    "later. Once per machine and after an edit to a kernel; a cached kernel "
                    "loads in well under a second.")
    ap.add_argument("--processes", "-j", type=int, default=None,
                    help="compile in this many processes at once (default: one per core, "
                         "at most 4)")
    ap.add_argument("--task", action="append", default=[],
                    help=argparse.SUPPRESS)  # a child's share: "tree", "float32/32/0", ...
    args = ap.parse_args(argv)
    if args.processes is not None and args.processes < 1:
        ap.error(f"--processes must be >= 1, got {args.processes}")
    if args.task:
        for task in args.task:
            _run_task(task)
        return 0
    print("switchml: compiling the per-packet kernels for this machine (cached after; "
          "about 2 min on 2 cores when nothing is cached)", flush=True)
    took = warm_up(args.processes, progress=lambda line: print(line, flush=True))
    print(f"switchml kernels compiled and cached ({took:.0f} s)", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Process bodies for the UDP tests (importable by spawned children through sys.path)."""

from __future__ import annotations

import os
import time

import numpy as np

from switchml.control import decode_job_spec
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import SwitchMLError
from switchml.transport.udp import WorkerClient


def rank_input(rank: int, numel: int, dtype: str, op: int = 0) -> np.ndarray:
    """Deterministic per-rank input, different per operation."""
    rng = np.random.default_rng(1000 * op + rank)
    if np.dtype(dtype).kind == "i":
        return rng.integers(-2**20, 2**20, numel).astype(dtype)
    return (rng.standard_normal(numel) * 10.0 ** rng.integers(-3, 4)).astype(dtype)


def allreduce_worker(switch, spec_text, rank, numel, dtype, ops, results) -> None:
    """Run ``ops`` all-reduces (async for every other one) and report the outputs."""
    try:
        spec = decode_job_spec(spec_text)
        with WorkerClient(tuple(switch), spec, rank) as w:
            outs = []
            for op in range(ops):
                x = rank_input(rank, numel, dtype, op)
                if op % 2:
                    outs.append(w.allreduce_async(x).wait(timeout=60))
                else:
                    outs.append(w.allreduce(x))
            results.put((rank, outs, w.counters, None))
    except BaseException as exc:  # noqa: BLE001 - reported to the test
        results.put((rank, None, None, f"{type(exc).__name__}: {exc}"))


def dying_worker(switch, spec_text, rank, die_rank, op_timeout_s, results) -> None:
    """One good operation; then ``die_rank`` exits abruptly in the middle of the second."""
    try:
        spec = decode_job_spec(spec_text)
        cfg = WorkerConfig(op_timeout_s=op_timeout_s, max_rto_s=0.5)
        w = WorkerClient(tuple(switch), spec, rank, cfg)
        w.allreduce(np.ones(200_000, np.float32))
        x = np.ones(10_000_000, np.float32)  # the same operation on every rank: rank 1 dies
        # well before it could finish
        if rank == die_rank:
            w.allreduce_async(x)
            time.sleep(0.02)
            os._exit(0)  # no LEAVE, no goodbye: a crash
        t0 = time.monotonic()
        try:
            w.allreduce(x)
            results.put((rank, "completed", time.monotonic() - t0))
        except SwitchMLError as exc:
            results.put((rank, f"{type(exc).__name__}: {exc}", time.monotonic() - t0))
        w.close()
    except BaseException as exc:  # noqa: BLE001
        results.put((rank, f"setup failed: {type(exc).__name__}: {exc}", 0.0))

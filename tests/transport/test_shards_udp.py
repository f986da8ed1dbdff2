"""``switchml switch --shards S`` over UDP: S processes, a job striped over them, counters
summed by ``switchml stats``, and a dead shard named by the command and by the workers."""

from __future__ import annotations

import os
import signal

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.control.metrics import read_metrics
from switchml.protocol.config import WorkerConfig
from switchml.protocol.errors import OperationFailed
from switchml.transport.udp import WorkerClient


def _run_ranks(run_threads, addrs, n: int, x_of, config=None) -> list:
    spec = new_job_spec(n, window=8, elements_per_packet=256)
    out: list = [None] * n

    def run(r: int) -> None:
        try:
            with WorkerClient(addrs, spec, r, config) as w:
                out[r] = w.allreduce(x_of(r))
        except Exception as exc:  # noqa: BLE001 - reported to the test
            out[r] = exc

    run_threads(run, n, 60)
    return out


def test_sharded_switch_sums_exactly_and_stats_sum_the_shards(
        free_port_range, start_switchml, run_switchml, run_threads):
    port = free_port_range(2)
    metrics = free_port_range(2)
    proc = start_switchml("switch", "--shards", "2", "--port", str(port),
                          "--metrics-port", str(metrics))
    line = proc.stdout.readline()
    assert f"SWITCHML_SWITCH=127.0.0.1:{port},127.0.0.1:{port + 1}" in line
    for _ in range(2):
        assert "listening on udp" in proc.stdout.readline()
    addrs = [("127.0.0.1", port), ("127.0.0.1", port + 1)]
    outs = _run_ranks(run_threads, addrs, 2,
                      lambda r: np.arange(20_000, dtype=np.int32) * (r + 1))
    for o in outs:
        assert isinstance(o, np.ndarray), o
        assert np.array_equal(o, np.arange(20_000, dtype=np.int32) * 3)
    per_shard = [read_metrics(f"http://127.0.0.1:{metrics + i}/metrics")
                 for i in range(2)]
    # 20,000 int32 in chunks of 256: 79 rounds, striped over the shards (8 lanes).
    rounds = [m["switchml_results_multicast_total"] for m in per_shard]
    assert all(r > 0 for r in rounds) and sum(rounds) == 79, rounds
    urls = ",".join(f"http://127.0.0.1:{metrics + i}/metrics" for i in range(2))
    res = run_switchml("stats", "--once", "--url", urls, timeout=30)
    assert res.returncode == 0, res.stderr
    assert " 79 " in res.stdout, res.stdout
    proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=20)
    assert proc.returncode == 0


@pytest.mark.slow
def test_a_dead_shard_is_named_by_the_command_and_by_the_workers(
        free_port_range, start_switchml, pids_with, run_threads):
    port = free_port_range(2)
    proc = start_switchml("switch", "--shards", "2", "--port", str(port), "--metrics-port", "0")
    for _ in range(3):
        proc.stdout.readline()
    pids = pids_with(["--port", str(port + 1), "--shard", "1/2"])
    assert pids, "shard 1 not found"
    addrs = [("127.0.0.1", port), ("127.0.0.1", port + 1)]
    cfg = WorkerConfig(op_timeout_s=3.0, max_rto_s=0.5, initial_rto_s=0.1)
    # Join first (both shards up), then kill shard 1 and start an operation.
    spec = new_job_spec(2, window=8, elements_per_packet=256)
    clients = [None, None]

    def join(r: int) -> None:
        clients[r] = WorkerClient(addrs, spec, r, cfg)

    run_threads(join, 2, 30)
    for p in pids:
        os.kill(p, signal.SIGKILL)
    handles = [c.allreduce_async(np.ones(10_000, np.float32)) for c in clients]
    for h in handles:
        with pytest.raises(OperationFailed, match=str(port + 1)):
            h.wait(timeout=30)
    for c in clients:
        c.close()
    _out, err = proc.communicate(timeout=30)
    assert proc.returncode == 1
    assert f"shard 1 (udp 127.0.0.1:{port + 1})" in err

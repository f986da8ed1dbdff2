"""The ``switchml ps`` launcher and server as processes."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest

from switchml.ps import PSClient, PSError, place
from switchml.ps.launch import PSRunConfig, run_ps_training


@pytest.mark.slow
@pytest.mark.parametrize("attempt", range(3))
def test_server_process_runs_the_optimizer_step_and_exits_when_done(start_switchml, attempt):
    """Also: it exits with status 0, by a normal interpreter exit. (A thread that outlived
    ``stop()`` used to free the shards' tensors during shutdown, and the process aborted in
    about 40% of runs; three attempts catch that four times in five.)"""
    proc = start_switchml("ps", "server", "--port", "0", "--host", "127.0.0.1", "--workers",
                          "2", "--lr", "0.5", "--momentum", "0", "--exit-when-done")
    line = proc.stdout.readline()
    assert "listening on" in line, proc.stderr.read()
    host, port = line.split()[-1].rsplit(":", 1)
    shards = place([("w", 3)], 1)
    a = PSClient([(host, int(port))], worker=0, workers=2)
    b = PSClient([(host, int(port))], worker=1, workers=2)
    a.init(shards, {0: np.array([1.0, 2.0, 3.0], np.float32)})
    a.push(shards, 0, {0: np.array([1.0, 0.0, 2.0], np.float32)})
    b.push(shards, 0, {0: np.array([3.0, 0.0, 0.0], np.float32)})
    out = {0: np.empty(3, np.float32)}
    assert a.pull(shards, 1, out) == 1
    # SGD on the mean gradient (2, 0, 1) with lr 0.5
    assert out[0].tolist() == [0.0, 2.0, 2.5]
    with pytest.raises(PSError, match="expects 3 workers, this server was started for 2"):
        PSClient([(host, int(port))], worker=0, workers=3)
    a.close()
    b.close()
    stdout, _ = proc.communicate(timeout=30)
    stats = json.loads(stdout.strip().splitlines()[-1])
    assert stats["pushes"] == 2 and stats["steps_applied"] == 1
    assert proc.returncode == 0


@pytest.mark.slow
def test_launcher_processes_match_the_threaded_run_bit_for_bit():
    cfg = dict(servers=1, workers=2, steps=8, max_shard_elements=8000)
    procs = run_ps_training(PSRunConfig(**cfg))
    threads = run_ps_training(PSRunConfig(in_process=True, **cfg))
    assert procs["digest"] == threads["digest"]
    assert "per server: ps0=" in procs["placement"]
    assert procs["dropped_late"] == 0 and procs["iterations"] == {0: 8, 1: 8}


@pytest.mark.slow
def test_torchrun_ranks_become_servers_and_workers_and_match_the_threaded_run(tmp_path):
    """examples/train_ps.py under torchrun: 2 workers and 1 server rank; same seed, same
    computation as the launcher's (MLP, digits, SGD lr 0.05 momentum 0.9): same parameters."""
    import os
    example = os.path.join(os.path.dirname(__file__), "..", "..", "examples", "train_ps.py")
    res = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone",
                          "--nproc-per-node", "3", example, "--servers", "1", "--steps", "10"],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "per server: ps0=19210" in res.stdout
    assert "server rank 2: 40 steps applied, 0 late gradients dropped" in res.stdout
    digest = res.stdout.split("parameter digest ")[1].split()[0]
    threads = run_ps_training(PSRunConfig(in_process=True, servers=1, workers=2, steps=10))
    assert digest == threads["digest"]

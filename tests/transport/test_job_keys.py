"""Job keys (``WorkerConfig.job_key``, ``switchml job-key``): a tenant's workers hold one
job's key, never the switch's secret; with it they create and join that job and no other."""

from __future__ import annotations

import dataclasses
import os
import threading

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.auth import job_key
from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.errors import ConfigError, OperationFailed
from switchml.transport.parallel import ParallelClient, choose_threads
from switchml.transport.udp import SwitchServer, WorkerClient

SECRET = b"the switch's secret, 32 bytes.."


def _allreduce_two(server, spec, keys):
    """Ranks 0 and 1 of ``spec``, each with its job key; their results."""
    out, errors = {}, []

    def rank(r):
        try:
            cfg = WorkerConfig(job_key=keys[r], join_timeout_s=3.0, op_timeout_s=5.0)
            with WorkerClient(server.address, spec, r, cfg) as w:
                out[r] = w.allreduce(np.arange(6, dtype=np.int32) * (r + 1))
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out, errors


def test_workers_with_the_job_key_create_and_join_their_job():
    spec = new_job_spec(2)
    key = job_key(SECRET, spec.job_id, spec.token)  # what `switchml job-key` prints
    with SwitchServer(port=0, config=SwitchConfig(secret=SECRET)) as server:
        out, errors = _allreduce_two(server, spec, [key, key])
        assert not errors, errors
        want = np.arange(6, dtype=np.int32) * 3  # 1x + 2x, by hand
        assert np.array_equal(out[0], want) and np.array_equal(out[1], want)


def test_a_job_key_opens_no_other_job():
    spec = new_job_spec(2)
    key = job_key(SECRET, spec.job_id, spec.token)
    with SwitchServer(port=0, config=SwitchConfig(secret=SECRET)) as server:
        for other in (dataclasses.replace(spec, job_id=(spec.job_id + 1) % 2**32),
                      dataclasses.replace(spec, token=spec.token ^ 1)):
            with pytest.raises(OperationFailed, match="proof does not verify"):
                WorkerClient(server.address, other, 0,
                             WorkerConfig(job_key=key, join_timeout_s=3.0))
        assert server.stats()["jobs"] == 0


def test_a_job_key_is_checked_and_means_one_thread():
    with pytest.raises(ConfigError, match="32 bytes"):
        WorkerConfig(job_key=b"short")
    with pytest.raises(ConfigError, match="not both"):
        WorkerConfig(job_key=bytes(32), secret=SECRET)
    cfg = WorkerConfig(job_key=bytes(32))
    assert choose_threads(("127.0.0.1", 1), cfg, rate_bps=100e9, cores=16) == 1
    with pytest.raises(ConfigError, match="a job key proves one job"):
        ParallelClient(("127.0.0.1", 1), new_job_spec(2), 0, cfg, threads=2)


def test_switchml_job_key_prints_the_key(run_switchml, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    res = run_switchml("job-key", "--job", "7", "--token", "0x10", "--secret-file", str(path))
    assert res.returncode == 0
    assert res.stdout.strip() == job_key(SECRET, 7, 16).hex()
    res = run_switchml("job-key", "--job", "7", "--token", "1",
                       env={**os.environ, "SWITCHML_SECRET": ""})
    assert res.returncode == 2 and "no secret" in res.stderr
    res = run_switchml("job-key", "--job", str(2**32), "--token", "1")
    assert res.returncode == 2 and "2^32-1" in res.stderr

"""Job keys (``WorkerConfig.job_key``, ``switchml job-key``): a tenant's workers hold one
job's key, never the switch's secret; with it they create and join that job and no other.
Tenant keys (``WorkerConfig.tenant_key``, ``switchml job-key --tenant``): the jobs of one range
of ids, and no other, within the tenant's quota of slots (``SwitchConfig.tenant_slots``)."""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import os
import struct
import threading

import numpy as np
import pytest

from switchml.control import new_job_spec
from switchml.protocol.auth import job_key, key_for, tenant_job_id, tenant_key, tenant_of
from switchml.protocol.config import SwitchConfig, WorkerConfig
from switchml.protocol.errors import ConfigError, OperationFailed
from switchml.transport.parallel import ParallelClient, choose_threads
from switchml.transport.udp import SwitchServer, WorkerClient

SECRET = b"the switch's secret, 32 bytes.."


def _allreduce_two(server, spec, keys, base=None):
    """Ranks 0 and 1 of ``spec``, each with its job key (or ``base``'s keys); their
    results."""
    out, errors = {}, []

    def rank(r):
        try:
            cfg = dataclasses.replace(base or WorkerConfig(), job_key=keys[r],
                                      join_timeout_s=3.0, op_timeout_s=5.0)
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
                WorkerClient(server.address, other, 0,  # (a refusal that does not
                             WorkerConfig(job_key=key, join_timeout_s=1.0))  # verify: waited)
        assert server.stats()["jobs"] == 0


def test_a_job_key_is_checked_and_means_one_thread():
    with pytest.raises(ConfigError, match="32 bytes"):
        WorkerConfig(job_key=b"short")
    with pytest.raises(ConfigError, match="not several"):
        WorkerConfig(job_key=bytes(32), secret=SECRET)
    cfg = WorkerConfig(job_key=bytes(32))
    assert choose_threads(("127.0.0.1", 1), cfg, rate_bps=100e9, cores=16) == 1
    with pytest.raises(ConfigError, match=r"a job \(or tenant\) key proves one job"):
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


# -- tenants: a key for a range of job ids, and a quota of slots -------------------------------

def _hmac(key: bytes, data: bytes) -> bytes:
    return hmac.new(key, data, hashlib.sha256).digest()


def test_a_tenants_keys_derive_as_documented():
    """docs/protocol.md: a tenant's key is HMAC-SHA256(secret, "switchml tenant key v1" |
    tenant u16); a job of its range (2^31 + tenant * 2^20 + n) has the job key of its id and
    token under the tenant's key; any other id's key is under the secret. Computed by hand."""
    tkey = _hmac(SECRET, b"switchml tenant key v1" + struct.pack("<H", 7))
    assert tenant_key(SECRET, 7) == tkey
    job = 2**31 + 7 * 2**20 + 12345
    assert tenant_job_id(7, 12345) == job and tenant_of(job) == 7 and tenant_of(12345) is None
    assert key_for(SECRET, job, 99) == _hmac(tkey, b"switchml job key v1"
                                             + struct.pack("<IQ", job, 99))
    assert key_for(SECRET, 12345, 99) == _hmac(SECRET, b"switchml job key v1"
                                               + struct.pack("<IQ", 12345, 99))
    assert {tenant_of(new_job_spec(2, tenant=7).job_id) for _ in range(20)} == {7}
    assert {tenant_of(new_job_spec(2).job_id) for _ in range(20)} == {None}
    with pytest.raises(ValueError, match="tenant must be in 0..2047"):
        tenant_key(SECRET, 2048)


def _one_rank(server, spec, cfg, join_timeout_s=3.0):
    """Rank 0 of a one-rank job, joined (the caller closes it)."""
    return WorkerClient(server.address, spec, 0, dataclasses.replace(
        cfg, join_timeout_s=join_timeout_s, op_timeout_s=5.0))


def test_a_tenant_key_opens_its_tenants_jobs_and_no_other():
    cfg = WorkerConfig(tenant_key=tenant_key(SECRET, 7))
    with SwitchServer(port=0, config=SwitchConfig(secret=SECRET)) as server:
        for _ in range(2):  # two jobs of its range, each summed right (1x + 2x, by hand)
            out, errors = _allreduce_two(server, new_job_spec(2, tenant=7), [None, None], cfg)
            assert not errors, errors
            assert [out[r].tolist() for r in (0, 1)] == [[0, 3, 6, 9, 12, 15]] * 2
        for other in (new_job_spec(1), new_job_spec(1, tenant=8)):  # no secret's, no other's
            with pytest.raises(OperationFailed, match="proof does not verify"):
                _one_rank(server, other, cfg, join_timeout_s=1.0)  # (waits it out)
        assert server.stats()["jobs"] == 0


def test_a_tenants_jobs_hold_at_most_its_quota_of_slots():
    cfg = WorkerConfig(tenant_key=tenant_key(SECRET, 3))
    quota = SwitchConfig(secret=SECRET, tenant_slots=16)
    with SwitchServer(port=0, config=quota) as server:
        a = _one_rank(server, new_job_spec(1, window=8, tenant=3), cfg)
        b = _one_rank(server, new_job_spec(1, window=8, tenant=3), cfg)
        c_spec = new_job_spec(1, window=8, tenant=3)
        with pytest.raises(OperationFailed, match="tenant 3 holds 16 slots in its other jobs; "
                                                  "8 more would pass its quota of 16"):
            _one_rank(server, c_spec, cfg)
        # another tenant, and a job outside every tenant's range, are not counted against it
        other = _one_rank(server, new_job_spec(1, window=8, tenant=4),
                          WorkerConfig(tenant_key=tenant_key(SECRET, 4)))
        plain = _one_rank(server, new_job_spec(1, window=8), WorkerConfig(secret=SECRET))
        a.close()  # its slots return: the third job fits now
        c = _one_rank(server, c_spec, cfg)
        assert c.allreduce(np.arange(3, dtype=np.int32)).tolist() == [0, 1, 2]
        for w in (b, c, other, plain):
            w.close()


def test_switchml_job_key_prints_a_tenants_key(run_switchml, tmp_path):
    path = tmp_path / "secret"
    path.write_bytes(SECRET + b"\n")
    res = run_switchml("job-key", "--tenant", "7", "--secret-file", str(path))
    assert res.returncode == 0
    assert res.stdout.strip() == _hmac(SECRET, b"switchml tenant key v1"
                                       + struct.pack("<H", 7)).hex()
    job = 2**31 + 7 * 2**20 + 5  # a job of that range: its key is the tenant's job key
    res = run_switchml("job-key", "--job", str(job), "--token", "9", "--secret-file", str(path))
    assert res.stdout.strip() == job_key(tenant_key(SECRET, 7), job, 9).hex()
    res = run_switchml("job-key", "--tenant", "7", "--job", "1", "--secret-file", str(path))
    assert res.returncode == 2 and "--tenant alone" in res.stderr
    res = run_switchml("job-key", "--tenant", "2048", "--secret-file", str(path))
    assert res.returncode == 2 and "0 .. 2047" in res.stderr


def test_a_tenant_key_in_the_environment_needs_its_tenant(monkeypatch):
    from switchml import env
    monkeypatch.setenv("SWITCHML_TENANT_KEY", "ab" * 32)
    with pytest.raises(ConfigError, match="needs SWITCHML_TENANT"):
        env.tenant_key()
    monkeypatch.setenv("SWITCHML_TENANT", "7")
    assert env.tenant_key() == bytes.fromhex("ab" * 32) and env.tenant() == 7
    monkeypatch.setenv("SWITCHML_TENANT", "4096")
    with pytest.raises(ConfigError, match="0..2047"):
        env.tenant()
